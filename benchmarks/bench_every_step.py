"""A small state saved at every step: the fixed cost of one save, against ``torch.save``.

A 0.8 MB state (an MLP 128-256-128 and its Adam moments, 14 tensors) is changed and saved ``--saves``
times into one directory with ``retention.keep_last: 3``, each save waited for (``result()``), as a
loop saving at every step meets it once the previous save has to be committed first
(``saving.max_pending: 1``). Per save, medians: the time ``save`` blocks, the time to commit, and the
process's CPU seconds from ``save`` to the commit (all threads); then the same state written with
``torch.save`` (no fsync, as Lightning's TorchCheckpointIO). Not part of ``python -m benchmarks``: a
standalone measure for docs/performance.md ("A small state saved very often").

Run: ``python -m benchmarks.bench_every_step [--saves 80] [--no-fsync]`` (a few seconds).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ckpt_core


def _state() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    net(torch.randn(2, 128)).sum().backward()
    opt.step()
    return net, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=80)
    parser.add_argument("--no-fsync", action="store_true", help="storage.fsync: false")
    args = parser.parse_args()
    net, opt = _state()
    root = Path(tempfile.mkdtemp(prefix="checkrun-every-step-"))
    blocked, committed, cpu = [], [], []
    try:
        config = {"storage": {"fsync": not args.no_fsync}, "retention": {"keep_last": 3}}
        with ckpt_core.CheckpointEngine(config) as engine:
            for step in range(args.saves):
                with torch.no_grad():
                    for p in net.parameters():
                        p.add_(1e-3)
                state = {"state_dict": net.state_dict(), "optimizer": opt.state_dict(), "step": step}
                t0, c0 = time.perf_counter(), time.process_time()
                handle = engine.save(state, root / f"step={step}.ckpt")
                t1 = time.perf_counter()
                handle.result()
                blocked.append(t1 - t0)
                committed.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        torch_s = []
        for step in range(args.saves):
            t0 = time.perf_counter()
            torch.save({"state_dict": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, root / "t.pt")
            torch_s.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = lambda xs: round(1e3 * statistics.median(xs), 2)  # noqa: E731
    print(json.dumps({"saves": args.saves, "fsync": not args.no_fsync, "checkrun_blocked_ms": ms(blocked),
                      "checkrun_commit_ms": ms(committed), "checkrun_cpu_ms": ms(cpu),
                      "torch_save_ms": ms(torch_s)}))


if __name__ == "__main__":
    main()
