"""Run every checkrun benchmark and write the report: ``python -m benchmarks [--size MB] [--only NAME,...]``.

Each benchmark module runs in its own process with ``--json docs/benchmarks/data/NAME.json`` (its raw
per-run measurements); then ``benchmarks.report`` renders docs/benchmarks.md and the PNG plots under
docs/benchmarks/. A module that fails or exceeds ``--timeout`` is reported as failed (with the end of
its output) and the others still run and are reported. ``--size`` scales the states (default 256 MB,
chosen to finish in under 15 minutes on an idle 2-core, 24 GiB machine; the report records each
module's seconds; use more on larger machines); ``--quick`` is a smoke run at 64 MB. Modules left out with ``--only`` keep their previous results. ``quant_accuracy`` (trains a
model through 20 restores, long) runs only with ``--accuracy``; its JSON, when present, fills section 5.
States are cached under ``~/.cache/checkrun-bench`` (``CHECKRUN_BENCH_CACHE``).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import ROOT

BENCHES = ("format", "async", "incremental", "quant", "lightning", "accelerate", "dcp", "restore", "steplog", "quant_accuracy")
DEFAULT = BENCHES[:-1]
DEFAULT_SIZE = 256.0
DATA = ROOT / "docs" / "benchmarks" / "data"


def arguments(name: str, size: float, extra: bool) -> list[str]:
    """The module's command-line arguments for a report at state size ``size`` MB."""
    s = lambda x: f"{x:g}"  # noqa: E731
    if name == "format":
        return ["--size", s(size)] + (["--variants"] if extra else [])
    if name == "async":
        return ["--sizes", ",".join(s(size * f) for f in (0.25, 0.5, 1.0)), "--train-mb", s(max(16.0, size / 8))]
    if name == "incremental":
        return ["--size", s(size), "--ft-layers", str(max(2, round(24 * size / 1024)))]
    if name == "quant":
        return ["--size", s(size)]
    if name == "lightning":  # --extra adds checkrun with compression off
        return ["--state-mb", s(max(16.0, size / 8)), "--threads", "1", "--every", "10", "--saves", "100",
                "--configs", "noop,torch,async,checkrun,checkrun-process" + (",checkrun-raw" if extra else "")]
    if name == "accelerate":
        return ["--params-mb", str(max(8, round(size / 3))), "--saves", "3"]
    if name == "dcp":
        return ["--state-mb", str(max(16, round(size / 2))), "--repeats", "3"]
    if name == "restore":
        return ["--size", s(size), "--reps", "7"]
    if name == "steplog":  # DLRM tables of size/2 MB, a GPT-like state of size/5 MB
        return ["--steps", "24", "--rounds", "10", "--table-mb", s(max(16.0, size / 2)), "--gpt-mb", s(max(16.0, size / 5))]
    return ["--extra"] if extra else []


def supports_json(name: str) -> bool:
    return '"--json"' in (ROOT / "benchmarks" / f"bench_{name}.py").read_text()


def run_one(name: str, args: list[str], timeout: float) -> dict:
    """Run ``python -m benchmarks.bench_NAME args``, streaming its output; rc, seconds, output tail."""
    cmd = [sys.executable, "-u", "-m", f"benchmarks.bench_{name}", *args]
    t0 = time.perf_counter()
    tail: collections.deque = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own process group: a timeout kills its workers too
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    seconds = time.perf_counter() - t0
    if rc != 0 and seconds >= timeout:
        tail.append(f"(killed after the --timeout of {timeout:.0f} s)\n")
    return {"rc": rc, "seconds": seconds, "args": args, "tail": "".join(tail) if rc else "",
            "finished": datetime.datetime.now().isoformat(timespec="seconds")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=DEFAULT_SIZE, help=f"state size in MB (default {DEFAULT_SIZE:g})")
    ap.add_argument("--quick", action="store_true", help="smoke run: --size 64")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(BENCHES)}")
    ap.add_argument("--accuracy", action="store_true", help="also run quant_accuracy (long)")
    ap.add_argument("--extra", action="store_true", help="format config variations; 2/3-bit and adaptive accuracy")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one module may run (default 1800)")
    ap.add_argument("--data", default=str(DATA), help="where the JSON results go")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="the report")
    ap.add_argument("--report-only", action="store_true", help="render the report from the existing JSON")
    args = ap.parse_args(argv)
    size = 64.0 if args.quick else args.size
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(DEFAULT)
    if args.accuracy and "quant_accuracy" not in names:
        names.append("quant_accuracy")
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    try:
        runs = json.loads((data / "runs.json").read_text())
    except (OSError, ValueError):
        runs = {}
    failed, t0 = [], time.perf_counter()
    for name in [] if args.report_only else names:
        print(f"\n# bench_{name}\n", flush=True)
        out = data / f"{name}.json"
        out.unlink(missing_ok=True)  # a failed module must not leave an older result behind
        extra = ["--json", str(out)] if supports_json(name) else []
        runs.setdefault("modules", {})[name] = r = run_one(name, arguments(name, size, args.extra) + extra,
                                                            args.timeout)
        print(f"\n# bench_{name}: rc {r['rc']}, {r['seconds']:.0f} s", flush=True)
        if r["rc"] != 0:
            failed.append(name)
    if not args.report_only:
        shown = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        runs.update(command=f"python -m benchmarks {shown}".strip(), seconds=time.perf_counter() - t0, size=size,
                    smoke=size < DEFAULT_SIZE)
        (data / "runs.json").write_text(json.dumps(runs, indent=1))
    from benchmarks.report import render  # matplotlib only now: the runs above do not need it

    render(data, Path(args.out))
    print(f"\nwrote {args.out} and its plots under {Path(args.out).parent / 'benchmarks'}"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
