"""Run every checkrun benchmark in turn: ``python -m benchmarks [--size MB] [--only NAME,...]``.

Each benchmark runs in its own process and prints its own markdown tables (with the machine, the
date and the load average); ``--size`` scales the states (default 1024 MB, about 25 minutes on
two cores in all; ``--size 128`` is a quick smoke run). States are cached under
``~/.cache/checkrun-bench`` (``CHECKRUN_BENCH_CACHE``).
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.common import run_module

BENCHES = ("format", "async", "incremental", "quant", "quant_accuracy")


def arguments(name: str, size: float, extra: bool) -> list[str]:
    if name == "format":
        return ["--size", str(size)] + (["--variants"] if extra else [])
    if name == "async":
        return ["--size", str(size), "--train-mb", str(max(16.0, size / 8))]
    if name in ("incremental", "quant"):
        return ["--size", str(size)]
    return ["--extra"] if extra else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="state size in MB (default 1024)")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated subset of {', '.join(BENCHES)}")
    ap.add_argument("--extra", action="store_true", help="format config variations; 2/3-bit and adaptive")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    failed = []
    for name in names:
        print(f"\n# bench_{name}\n", flush=True)
        if run_module(f"bench_{name}", arguments(name, args.size, args.extra)) != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
