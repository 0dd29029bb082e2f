"""Small tensors: what each tensor costs a save and a load, with and without packs (issues 2 and 6).

Two states, each saved with checkrun's defaults (small tensors stored together in packs,
``compression.pack_bytes`` = 64 KiB) and with ``compression.pack_bytes: 0`` (one blob per tensor, as
before packs), and with ``torch.save`` for scale; ``incremental.enabled: false`` and every tensor
changed between saves, so every save writes everything:

* ``tiny``: ``--tiny`` tensors of 768 fp32 values (3 KB, a bias or a norm);
* ``lightning``: the 31 MB Lightning-like training state of ``bench_lightning`` (a GPT-like model's
  weights and Adam moments: 64 tensors, 46 of them below 8 KB, from ``gpt_state(32)``), also with
  ``saving.background: process`` (the writer process).

Per save: CPU seconds of the process (``time.process_time`` around ``save(...).result()``; for torch,
``torch.save`` into a file), and, for ``lightning``, what a Python training loop on the main thread
(64x64 matmuls, one torch thread) loses while the save runs in the background: wall time minus its
iterations divided by its rate measured just before ("lost"), the measure of how much a background
save slows training through the GIL and the shared cores. torch.save runs in a thread there (as
Lightning's ``AsyncCheckpointIO`` does); TorchCheckpointIO instead blocks for the whole save. Per
load: CPU seconds of ``ckpt_core.load`` / ``torch.load`` (page cache warm). The writers alternate
within each repetition; medians.

A third table asks why: the same loop beside 0.15 s of background work of one kind, in a thread
(zstd-compressing 4 MiB buffers, which releases the GIL while it runs; small file writes with
fsync; pure Python) or in a separate process (the same zstd work). What the loop loses beside a
thread that mostly runs without the GIL, against a process doing the same work, is the cost of
handing the GIL back and forth.

Run: ``python -m benchmarks.bench_small [--reps 8] [--tiny 1000] [--json PATH]`` (about a minute).
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import gpt_state, machine_header, machine_info, table, workdir, write_json  # noqa: E402

import ckpt_core  # noqa: E402
from ckpt_core import EngineConfig  # noqa: E402
from ckpt_core.format.tree import flatten  # noqa: E402

WRITERS = ("checkrun", "checkrun, no packs", "torch.save")
PROCESS = "checkrun, writer process"  # its save CPU is in another process: measured beside the probe only
_N = itertools.count()


def _bump(state: Any) -> None:
    """Change every floating-point tensor a little (so no blob can be reused)."""
    for t in flatten(state).tensors:
        if t.tensor.is_floating_point():
            t.tensor.add_(1e-3)


class Probe:
    """A Python + small-torch-ops loop standing in for the training thread."""

    def __init__(self) -> None:
        self.x = torch.randn(64, 64)

    def run(self, stop: Callable[[], bool]) -> int:
        n = 0
        while not stop():
            (self.x @ self.x).relu_()
            n += 1
        return n

    def rate(self, seconds: float = 0.2) -> float:
        t0 = time.perf_counter()
        return self.run(lambda: time.perf_counter() - t0 > seconds) / seconds


def save_once(name: str, engine: Any, state: Any, root: Path, probe: Probe | None) -> dict:
    path = root / f"{next(_N)}"
    base = probe.rate() if probe is not None else 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    if name == "torch.save":
        worker = threading.Thread(target=torch.save, args=(state, f"{path}.pt"))
        worker.start()
        done = lambda: not worker.is_alive()  # noqa: E731
    else:
        handle = engine.save(state, f"{path}.ckpt")
        done = handle.done
    blocked = time.perf_counter() - t0
    n = probe.run(done) if probe is not None else 0
    if name == "torch.save":
        worker.join()
        target = f"{path}.pt"
    else:
        handle.result()
        target = f"{path}.ckpt"
    wall = time.perf_counter() - t0
    out = {"cpu": time.process_time() - c0, "wall": wall, "blocked": blocked}
    if probe is not None:
        out["lost"] = wall - n / base
        out["cpu"] = float("nan")  # the probe's own CPU is in process_time
    c0 = time.process_time()
    if name == "torch.save":
        torch.load(target, weights_only=True)
    else:
        ckpt_core.load(target, config=engine.config)
    out["load_cpu"] = time.process_time() - c0
    return out


def bench(state: Any, n_tensors: int, reps: int, root: Path, probe: Probe | None,
          writers: tuple = WRITERS) -> dict:
    engines = {
        "checkrun": ckpt_core.CheckpointEngine(EngineConfig().replace(**{"incremental.enabled": False})),
        "checkrun, no packs": ckpt_core.CheckpointEngine(
            EngineConfig().replace(**{"incremental.enabled": False, "compression.pack_bytes": 0})),
        "torch.save": None,
    }
    if PROCESS in writers:
        engines[PROCESS] = ckpt_core.CheckpointEngine(
            EngineConfig().replace(**{"incremental.enabled": False, "saving.background": "process"}))
    runs: dict = {w: [] for w in writers}
    try:
        for rep in range(reps + 1):  # the first repetition warms up
            for w in writers[rep % len(writers):] + writers[:rep % len(writers)]:
                _bump(state)
                r = save_once(w, engines[w], state, root, probe)
                if rep:
                    runs[w].append(r)
    finally:
        for e in engines.values():
            if e is not None:
                e.close()
    return {"tensors": n_tensors, "runs": runs}


def _zstd_work(seconds: float) -> None:
    import zstandard

    data, c = bytes(range(256)) * (16 << 12), zstandard.ZstdCompressor(level=1)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        c.compress(data)


def _io_work(seconds: float, root: str) -> None:
    import os

    t0, i = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        with open(f"{root}/io{i % 50}", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        i += 1


def _python_work(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sum(range(1000))


def background_kinds(reps: int, root: Path, probe: Probe, seconds: float = 0.15) -> dict:
    """What the probe loop loses beside ``seconds`` of each kind of background work."""
    import multiprocessing as mp

    kinds: dict[str, Callable[[], Any]] = {
        "zstd in a thread": lambda: threading.Thread(target=_zstd_work, args=(seconds,)),
        "file writes + fsync in a thread": lambda: threading.Thread(target=_io_work, args=(seconds, str(root))),
        "pure Python in a thread": lambda: threading.Thread(target=_python_work, args=(seconds,)),
        "zstd in a process": lambda: mp.get_context("fork").Process(target=_zstd_work, args=(seconds,)),
    }
    out: dict = {k: [] for k in kinds}
    for rep in range(reps + 1):
        for name, make in kinds.items():
            base = probe.rate()
            t0 = time.perf_counter()
            worker = make()
            worker.start()
            n = probe.run(lambda: not worker.is_alive())
            worker.join()
            wall = time.perf_counter() - t0
            if rep:
                out[name].append({"wall": wall, "lost": wall - n / base})
    return out


def rows(name: str, res: dict) -> list[list]:
    out = []
    n = res["tensors"]
    for w, runs in res["runs"].items():
        med = lambda k: statistics.median(r[k] for r in runs) if runs and k in runs[0] else float("nan")  # noqa: E731
        out.append([name, n, w, med("cpu") * 1e3, med("cpu") * 1e3 / n, med("blocked") * 1e3,
                    med("lost") * 1e3, med("load_cpu") * 1e3, med("load_cpu") * 1e3 / n])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--tiny", type=int, default=1000, help="tensors in the 'tiny' state")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    started = machine_info()
    torch.set_num_threads(1)
    root = workdir(args.dir)
    try:
        tiny = {f"t{i}": torch.randn(768) for i in range(args.tiny)}
        results = {"tiny": bench(tiny, len(tiny), args.reps, root, None)}
        light = gpt_state(32)
        n = len(flatten(light).tensors)
        results["lightning"] = bench(light, n, args.reps, root, Probe(), WRITERS + (PROCESS,))
        results["background"] = background_kinds(args.reps, root, Probe())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, "small", args, results, started)
    head = ["state", "tensors", "writer", "save CPU ms", "per tensor", "blocked ms", "training lost ms",
            "load CPU ms", "per tensor"]
    print(f"{machine_header('Small tensors: cost per tensor, with and without packs')}\n"
          f"{args.reps} repetitions, medians; 'lightning' saves run beside a training-like loop on the "
          "main thread (save CPU then includes it: n/a)\n")
    print(table(head, rows("tiny", results["tiny"]) + rows("lightning", results["lightning"])))
    print("\nWhat the same loop loses beside 0.15 s of background work:\n")
    print(table(["background work", "wall ms", "training lost ms", "lost / wall"], [
        [k, statistics.median(r["wall"] for r in v) * 1e3, statistics.median(r["lost"] for r in v) * 1e3,
         statistics.median(r["lost"] / r["wall"] for r in v)] for k, v in results["background"].items()]))


if __name__ == "__main__":
    main()
