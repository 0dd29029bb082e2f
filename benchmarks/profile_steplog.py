"""Where the step log's cost on the DLRM-style loop of ``bench_steplog`` goes (a diagnostic, not a peer
comparison): the loop without checkpointing, and with the log cut short at each stage in turn.

* ``none``: no log;
* ``capture``: the step pre-hook copies the gradients into staging; the encoder thread takes each
  record and gives its staging back without encoding it;
* ``encode``: the encoder also encodes each step (shuffle + zstd); segments are not written;
* ``full``: the log as shipped (segments written to file://);
* ``bg-copy`` / ``bg-cpu``: no log, but after each step a background thread works for 2 ms: copying
  memory (4 MiB at a time through 64 MiB buffers), or compressing one cache-resident 64 KiB buffer
  over and over (zstd, GIL released): how much the "free" core's work slows the training step by
  itself, by kind of work.

Modes alternate in short rounds (same machine state for all); each prints the mean step time over
all its steps and its overhead against ``none``, then (Linux) the CPU time per step of each thread:
the training thread and the log's encoder (``checkrun-steplog``) and writer (``checkrun-steplog-writer``).

Run: ``python -m benchmarks.profile_steplog [--rounds 12] [--steps 24] [--table-mb 128] [--config JSON]``
(``--config``: the engine's config for the log, e.g. ``'{"compression": {"zstd_level": -3}}'``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from benchmarks.bench_steplog import dlrm_setup
from benchmarks.common import machine_header, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--table-mb", type=float, default=128.0)
    ap.add_argument("--config", default="{}", help="EngineConfig as JSON, for the engine of the log")
    ap.add_argument("--workdir", default="/tmp/checkrun-profile-steplog")
    args = ap.parse_args(argv)
    from ckpt_core import CheckpointEngine
    from ckpt_core.steplog import log as steplog

    torch.set_num_threads(1)
    model, opt, sched, step, _ = dlrm_setup(args.table_mb)
    for i in range(3):
        step(i)
    add, write = steplog._Batch.add, steplog.StepLog._write

    def give_back(self, kind, item, config, staging):  # capture only
        if kind == "step" and item.slot is not None:
            staging.give(item.slot)

    def drop(self, batch, seq):  # encode, do not write
        batch.payload.clear()

    modes = {"none": None, "capture": (give_back, write), "encode": (add, drop), "full": (add, write),
             "bg-copy": _copy_for(0.002), "bg-cpu": _compress_for(0.002)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, collections.Counter] = {m: collections.Counter() for m in modes}  # thread name -> seconds
    work = Path(args.workdir)
    i = 100
    try:
        for _ in range(args.rounds):
            for mode, patch in modes.items():
                if isinstance(patch, tuple):
                    steplog._Batch.add, steplog.StepLog._write = patch
                shutil.rmtree(work, ignore_errors=True)
                with CheckpointEngine(json.loads(args.config)) as engine, _Background(patch) as bg:
                    slog = engine.step_log(str(work), opt, sched) if isinstance(patch, tuple) else None
                    before, main0 = _thread_cpu(), time.thread_time()
                    for _ in range(args.steps):
                        i += 1
                        t0 = time.perf_counter()
                        step(i)
                        times[mode].append(time.perf_counter() - t0)
                        bg.kick()
                    if slog is not None:
                        slog.flush()  # the round's steps encoded and written before the threads' CPU is read
                    bg.settle()
                    cpu[mode]["training thread"] += time.thread_time() - main0
                    for name, seconds in _thread_cpu().items():
                        if name != threading.current_thread().name:
                            cpu[mode][name] += seconds - before.get(name, 0.0)
                    if slog is not None:
                        slog.close()
    finally:
        steplog._Batch.add, steplog.StepLog._write = add, write
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.mean(times["none"])
    print(machine_header("step log: where the DLRM step's overhead goes") + f"\nconfig: {args.config}\n")
    print(table(["mode", "mean step ms", "median step ms", "overhead (means)"],
                [[m, 1e3 * statistics.mean(t), 1e3 * statistics.median(t),
                  f"{100 * (statistics.mean(t) / base - 1):+.1f}%"] for m, t in times.items()]))
    names = sorted({n for c in cpu.values() for n in c if n != "training thread"})
    if names:  # Linux: /proc/self/task
        print("\nCPU ms per step, by thread (the training thread's includes the step itself):\n")
        print(table(["mode", "training thread", *names],
                    [[m, *(1e3 * c[n] / len(times[m]) for n in ["training thread", *names])] for m, c in cpu.items()]))
    return 0


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live Python thread of this process, by name (Linux: read
    from /proc/self/task; empty elsewhere)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class _Background:
    """A thread that runs ``work()`` once after each training step (``kick``), when ``work`` is a
    function (the ``bg-*`` modes); nothing otherwise."""

    def __init__(self, work) -> None:
        self.work = work if callable(work) else None
        self._go, self._stop, self._done = threading.Event(), threading.Event(), threading.Event()
        self._done.set()
        self._thread = threading.Thread(target=self._run, daemon=True, name="background work")

    def __enter__(self) -> "_Background":
        if self.work is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.work is not None:
            self._stop.set()
            self._go.set()
            self._thread.join()

    def kick(self) -> None:
        self._done.clear()
        self._go.set()

    def settle(self) -> None:
        """Wait until the work kicked last is done (so its CPU is counted)."""
        if self.work is not None:
            self._done.wait()

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop.is_set():
                return
            self.work()
            self._done.set()


def _copy_for(seconds: float):
    src, dst = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8)
    chunk = 4 << 20

    def work() -> None:
        t0, off = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            dst[off:off + chunk].copy_(src[off:off + chunk])
            off = (off + chunk) % (60 << 20)
    return work


def _compress_for(seconds: float):
    data = np.random.default_rng(0).integers(0, 4, 64 << 10, dtype=np.uint8).tobytes()
    cctx = zstandard.ZstdCompressor(level=1)

    def work() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            cctx.compress(data)
    return work


if __name__ == "__main__":
    raise SystemExit(main())
