"""accelerate's own ``save_state`` vs the same call through checkrun, in one process, one run.

A dense MLP (``--params-mb`` of fp32 weights; AdamW adds two more copies, so the saved state is ~3x
that) is trained one step between saves. For each side, ``--saves`` saves are timed:

* blocking: how long ``accelerator.save_state()`` kept the training thread (accelerate's own is
  synchronous: all of it; checkrun's returns after the in-memory snapshot);
* durable: until the checkpoint is complete on disk (accelerate: same call, page cache, no fsync;
  checkrun: committed, fsync'd, measured with ``wait()`` right after the save);
* written: bytes this save added to storage (accelerate: size of its folder; checkrun: SaveInfo).

Before each checkrun save the previous one is waited for, so blocking is the snapshot alone (saves
spaced further apart than their write time; with ``max_pending`` reached a save waits instead).
Run: ``python benchmarks/bench_accelerate.py [--params-mb 128] [--saves 3] [--dir DIR] [--json PATH]``
(``--json``: the medians and every save's raw measurements).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import sys

import torch
from accelerate import Accelerator
from torch import nn

if __package__ in (None, ""):  # `python benchmarks/bench_accelerate.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accelerate_ckpt import AcceleratorCheckpointer  # noqa: E402
from benchmarks.common import machine_info, write_json  # noqa: E402


def build(params_mb: int, width: int = 2048):
    layers = max(1, round(params_mb * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, width


def step(acc, model, opt, width: int) -> None:
    loss = model(torch.randn(8, width)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_accelerate(acc, model, opt, width, root: Path, saves: int) -> list[dict]:
    rows = []
    for i in range(saves):
        step(acc, model, opt, width)
        t0 = time.perf_counter()
        acc.save_state(str(root / f"ckpt_{i}"))
        dt = time.perf_counter() - t0
        rows.append({"blocking": dt, "durable": dt, "written": dir_bytes(root / f"ckpt_{i}")})
    return rows


def bench_checkrun(acc, model, opt, width, root: Path, saves: int, config: dict | None) -> list[dict]:
    rows = []
    with AcceleratorCheckpointer(acc, config, directory=str(root)) as ckpt:
        for _ in range(saves):
            step(acc, model, opt, width)
            t0 = time.perf_counter()
            acc.save_state()
            blocking = time.perf_counter() - t0
            ckpt.wait()
            durable = time.perf_counter() - t0
            rows.append({"blocking": blocking, "durable": durable})
        for row, m in zip(rows, ckpt.history):
            row["written"] = m["checkrun/written_bytes"]
            row["ratio"] = m["checkrun/compression_ratio"]
            row["tensor_bytes"] = m["checkrun/tensor_bytes"]
    return rows


def copy_floor(model, opt, saves: int) -> float:
    """Median time to copy the same tensors into buffers allocated once: the least any snapshot blocks."""
    tensors = list(model.state_dict().values()) + [v for st in opt.state_dict()["state"].values()
                                                   for v in st.values() if isinstance(v, torch.Tensor)]
    buffers = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(saves + 1):
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def summarize(name: str, rows: list[dict]) -> dict:
    return {"name": name, "blocking_s": statistics.median(r["blocking"] for r in rows),
            "durable_s": statistics.median(r["durable"] for r in rows),
            "first_written_mb": rows[0]["written"] / 1e6,
            "later_written_mb": statistics.median(r["written"] for r in rows[1:]) / 1e6 if len(rows) > 1
            else float("nan"),
            "ratio": statistics.median(r.get("ratio", 1.0) for r in rows),
            "blocking_each_s": [round(r["blocking"], 4) for r in rows], "raw": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params-mb", type=int, default=128)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    started = machine_info()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-accelerate-"))
    try:
        acc = Accelerator(cpu=True)
        model, opt, width = build(args.params_mb)
        model, opt = acc.prepare(model, opt)
        step(acc, model, opt, width)  # AdamW state exists before the first save
        state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
        results = [
            summarize("accelerate save_state", bench_accelerate(acc, model, opt, width, scratch / "accel",
                                                               args.saves)),
            summarize("checkrun save_state (lossless)", bench_checkrun(acc, model, opt, width, scratch / "ckr",
                                                                       args.saves, None)),
        ]
        floor = copy_floor(model, opt, args.saves)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    base = results[0]["blocking_s"]
    print(f"\nstate ~{state_mb:.0f} MB (weights + AdamW), {args.saves} saves, medians, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| save_state | blocking (s) | vs accelerate | durable (s) | 1st save written (MB) "
          "| later saves written (MB) | compression |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']} | {r['blocking_s']:.3f} | {r['blocking_s'] / base:.3f}x | {r['durable_s']:.2f} "
              f"| {r['first_written_mb']:.0f} | {r['later_written_mb']:.0f} | {r['ratio']:.2f}x |")
    for r in results:
        print(f"{r['name']}: blocking per save {r['blocking_each_s']}")
    print(f"\nreference: copying the same tensors into preallocated buffers takes {floor:.3f} s "
          f"({floor / base:.3f}x accelerate), the floor for any snapshot-based save on this machine now")
    write_json(args.json, "accelerate", args, {"state_mb": state_mb, "results": results, "copy_floor_s": floor},
               started)


if __name__ == "__main__":
    main()
