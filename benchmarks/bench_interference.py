"""How much background encoding slows a Python-heavy training loop on the other core (issue 6).

A small model (4 x Linear(64, 64), SGD, batch 8; one torch thread) trains for ``--seconds`` and
counts its steps, in three settings, rotated over ``--rounds`` rounds:

* alone: nothing else runs;
* thread: a thread of the same process encodes 16 MiB fp32 chunks with checkrun's lossless
  pipeline (byte-shuffle + zstd-1 + the xxh3 checksum) in a loop, at ``saving.thread_nice`` 10, as
  the engine's workers do;
* process: a separate process (nice 10) runs the same loop.

Both background settings use the second core; the difference between them is what sharing one
interpreter (GIL hand-offs, allocator, caches) costs the training thread on top of sharing the
machine. Reported: median steps per setting and the slowdown against "alone".

Run: ``python -m benchmarks.bench_interference [--seconds 2] [--rounds 6]``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import machine_header, table  # noqa: E402


def encode_loop(stop, nice: bool) -> None:
    """Encode one 16 MiB chunk after another until ``stop`` is set (the engine's worker path)."""
    import numpy as np
    import xxhash

    from ckpt_core import EngineConfig
    from ckpt_core.codecs import lossless_pipeline

    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
    torch.manual_seed(0)
    chunk = (torch.randn(1024, 4096) * 0.02).contiguous()
    pipe = lossless_pipeline(torch.float32, EngineConfig().compression)
    while not stop.is_set():
        data, _ = pipe.encode(chunk)
        xxhash.xxh3_64_hexdigest(np.frombuffer(data, np.uint8))


def train_steps(seconds: float) -> int:
    """Steps of a small SGD loop completed in ``seconds``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        steps += 1
    return steps


def run_with(setting: str, seconds: float) -> int:
    if setting == "alone":
        return train_steps(seconds)
    if setting == "thread":
        stop = threading.Event()
        worker = threading.Thread(target=encode_loop, args=(stop, True))
    else:
        stop = mp.get_context("spawn").Event()
        worker = mp.get_context("spawn").Process(target=encode_loop, args=(stop, True))
    worker.start()
    time.sleep(1.0 if setting == "process" else 0.1)  # let it import and reach its loop
    try:
        return train_steps(seconds)
    finally:
        stop.set()
        worker.join()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_header("Background encoding beside a training loop"))
    settings = ["alone", "thread", "process"]
    steps: dict[str, list[int]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for s in settings[r % 3:] + settings[:r % 3]:
            steps[s].append(run_with(s, args.seconds))
    alone = statistics.median(steps["alone"])
    rows = [[s, statistics.median(v), " ".join(map(str, v)), 1 - statistics.median(v) / alone]
            for s, v in steps.items()]
    print(table(["setting", "median steps", "steps per round", "slowdown vs alone"], rows))


if __name__ == "__main__":
    main()
