"""Quantization throughput (issue 24): MB/s per core and error of row-wise uniform quantization.

Encodes fp32 embedding-like tables of shape (N, 64) and (N, 128) (``--size`` MB each) with
``UniformCodec`` plain (4-bit) and greedy (2/3/4/8-bit), on one thread (``torch.set_num_threads(1)``;
the encoders are numpy and C and start no threads). Two distributions: ``normal`` (N(0, 0.02)) and
``trained`` (each row its own scale and offset, Student-t tails: what trained embedding rows look
like). MB/s are of fp32 input per second of this thread's CPU time (``time.thread_time``): a busy
machine stretches the wall clock much more than this figure (shared caches still slow it down a
little); min-median-max of ``--repeat`` runs.

Error per row, relative to the row's range (max - min): its largest absolute error and its RMS
error; the table shows the mean RMS and the largest max-abs over all rows. ``sq err`` is the total
squared error of the new encoding over the baseline's (1.000 = same; below 1 = better) and
``same bytes`` whether the two encodings are byte-identical.

``--baseline REV`` also runs the encoder of an older commit for comparison, interleaved with the
current one: rowwise.py, uniform.py and packing.py of REV are read with ``git show`` and loaded as
private modules (decode is shared: the format did not change). Without it only the current code
runs.

Run: ``python -m benchmarks.bench_quant_speed [--size 64] [--repeat 3] [--baseline c2e9296]
[--json PATH]``
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import MB, ROOT, machine_header, table, write_json

BASELINE_FILES = ("packing", "rowwise", "uniform")  # in dependency order


def tables(size_mb: int, cols: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The two test distributions as (N, cols) fp32 tables of ``size_mb`` MB."""
    rows = int(size_mb * MB) // (4 * cols)
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=g) * 0.02
    scale = torch.exp(torch.randn(rows, 1, generator=g)) * 0.01
    offset = torch.randn(rows, 1, generator=g) * 0.005
    chi2 = (torch.randn(3, rows, cols, generator=g) ** 2).mean(0)  # Student-t with 3 dof, seeded
    heavy = torch.randn(rows, cols, generator=g) / chi2.sqrt()
    return {"normal": normal, "trained": (heavy * scale + offset).contiguous()}


def load_baseline(rev: str) -> type:
    """The ``UniformCodec`` class of commit ``rev`` (encoder modules only; not registered)."""
    tmp = Path(tempfile.mkdtemp(prefix="checkrun-baseline-"))
    for name in BASELINE_FILES:
        text = subprocess.run(["git", "show", f"{rev}:core/codecs/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        for other in BASELINE_FILES:  # the old modules import each other, not the current ones
            text = text.replace(f"from .{other} import", f"from ._baseline_{other} import")
        text = text.replace("@register\n", "")  # keep the registry's current codec
        path = tmp / f"_baseline_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"ckpt_core.codecs._baseline_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["ckpt_core.codecs._baseline_uniform"].UniformCodec


def cpu_mb_per_s(codec, x: torch.Tensor) -> float:
    start = time.thread_time()
    codec.encode(x)
    return x.numel() * 4 / MB / (time.thread_time() - start)


def row_errors(codec, x: torch.Tensor) -> tuple[float, float, np.ndarray, bytes]:
    """(mean RMS / range, max of max-abs / range, squared error per row, bytes) of one encoding."""
    data = bytes(codec.encode(x)[0])
    y = codec.decode(data, tuple(x.shape), torch.float32)
    d = (y - x).double()
    rng = (x.amax(1) - x.amin(1)).double().clamp_min(1e-30)
    rms = (d.pow(2).mean(1).sqrt() / rng).mean()
    return float(rms), float((d.abs().amax(1) / rng).max()), d.pow(2).sum(1).numpy(), data


def configs() -> list[tuple[str, int, bool]]:
    return [("plain", 4, False)] + [("greedy", bits, True) for bits in (2, 3, 4, 8)]


def run(args) -> list[dict]:
    from ckpt_core.codecs.rowwise import native_available
    from ckpt_core.codecs.uniform import UniformCodec

    old_cls = load_baseline(args.baseline) if args.baseline else None
    print(f"C kernels (ckpt_core._cquant): {'yes' if native_available() else 'no (numpy)'}\n")
    results = []
    for cols in (64, 128):
        for dist, x in tables(args.size, cols).items():
            for label, bits, greedy in configs():
                row = {"shape": f"{x.shape[0]} x {cols}", "dist": dist, "codec": f"{label} {bits}-bit"}
                impls = {"new": UniformCodec(bits=bits, greedy=greedy)}
                if old_cls is not None:
                    impls["old"] = old_cls(bits=bits, greedy=greedy)
                speeds = {k: [] for k in impls}
                for _ in range(args.repeat):  # old and new alternate: both see the same noise
                    for k, codec in impls.items():
                        speeds[k].append(cpu_mb_per_s(codec, x))
                encoded = {}
                for k, codec in impls.items():
                    rms, worst, sq, encoded[k] = row_errors(codec, x)
                    row[k] = {"mb_s": speeds[k], "rms_rel": rms, "max_rel": worst, "sq_err": float(sq.sum())}
                if old_cls is not None:
                    row["sq_ratio"] = row["new"]["sq_err"] / max(row["old"]["sq_err"], 1e-300)
                    row["same_bytes"] = encoded["new"] == encoded["old"]
                results.append(row)
                print(_line(row), flush=True)
    return results


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.0f} / {statistics.median(xs):.0f} / {max(xs):.0f}"


def _line(row: dict) -> str:
    parts = [row["shape"], row["dist"], row["codec"]]
    for k in ("old", "new"):
        if k in row:
            r = row[k]
            parts.append(f"{k} {_spread(r['mb_s'])} MB/s rms {r['rms_rel']:.4g} max {r['max_rel']:.4g}")
    if "sq_ratio" in row:
        parts.append(f"sq err new/old {row['sq_ratio']:.6f} same bytes {row['same_bytes']}")
    return " | ".join(parts)


def report(results: list[dict]) -> str:
    has_old = "old" in results[0]
    headers = ["table", "dist", "codec"]
    if has_old:
        headers += ["old MB/s (min/med/max)", "old rms/range", "old max/range"]
    headers += ["new MB/s (min/med/max)", "new rms/range", "new max/range"]
    if has_old:
        headers += ["sq err new/old", "same bytes", "speed-up (medians)"]
    rows = []
    for r in results:
        cells = [r["shape"], r["dist"], r["codec"]]
        for k in (("old", "new") if has_old else ("new",)):
            cells += [_spread(r[k]["mb_s"]), f"{r[k]['rms_rel']:.4g}", f"{r[k]['max_rel']:.4g}"]
        if has_old:
            up = statistics.median(r["new"]["mb_s"]) / statistics.median(r["old"]["mb_s"])
            cells += [f"{r['sq_ratio']:.6f}", "yes" if r["same_bytes"] else "no", f"{up:.1f}x"]
        rows.append(cells)
    return table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=64, help="MB of fp32 per table (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="timed encodes per codec and table (default 3)")
    p.add_argument("--baseline", default=None, help="git revision whose encoder runs alongside")
    p.add_argument("--json", default=None, help="write the raw measurements here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_header("Quantization throughput (issue 24)"))
    results = run(args)
    print("\n" + report(results))
    write_json(args.json, "quant_speed", args, results)


if __name__ == "__main__":
    main()
