"""Where a cold load's io threads spend their time: waiting in reads vs decoding (issue 2).

Saves the GPT-like benchmark state (``--size`` MB fp32, cast to ``--dtype``) once, then loads it
``--loads`` times after dropping the page cache (root only; otherwise the loads are warm). Each
blob read (``Store.get_blob_into``) and each chunk decode (``Pipeline.decode_into``) is timed
(wall and thread CPU) by wrapping those two methods for the run; reported per load: wall
seconds, seconds spent in reads and in decodes summed over the threads, the mean number of
threads decoding, and the share of the load during which no thread was decoding.

Run: ``python -m benchmarks.bench_load_timeline [--size 1024] [--dtype bf16] [--loads 4]``.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (cached_state, cast_state, drop_caches, engine_config, gpt_state,  # noqa: E402
                               machine_header, table, workdir)


def instrument(events: list) -> None:
    """Time every blob read and chunk decode of this process into ``events``."""
    from ckpt_core.codecs.pipeline import Pipeline
    from ckpt_core.storage.store import Store

    lock = threading.Lock()
    for cls, name, label in ((Store, "get_blob_into", "read"), (Pipeline, "decode_into", "decode")):
        fn = getattr(cls, name)

        def wrapped(*a, _fn=fn, _label=label, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                with lock:
                    events.append((_label, t0, time.perf_counter(), time.thread_time() - c0))
        setattr(cls, name, wrapped)


def main(argv=None) -> None:
    import ckpt_core

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--loads", type=int, default=4)
    args = ap.parse_args(argv)
    state = cached_state(f"gpt_{int(args.size)}mb", lambda: gpt_state(args.size))
    if args.dtype == "bf16":
        state = cast_state(state, torch.bfloat16)
    cfg = engine_config(**{"incremental.enabled": False})
    root = workdir(None)
    events: list = []
    try:
        ckpt_core.save(state, root / "x.ckpt", config=cfg)
        del state
        instrument(events)
        print(machine_header(f"Load timeline ({args.dtype}, {args.size:g} MB fp32 state)"))
        cold = drop_caches()
        rows = []
        for _ in range(args.loads):
            events.clear()
            drop_caches()
            t0 = time.perf_counter()
            out = ckpt_core.load(root / "x.ckpt", config=cfg)
            wall = time.perf_counter() - t0
            del out
            decodes = [(a, b) for lab, a, b, _ in events if lab == "decode"]
            ticks = [t0 + i * 0.002 for i in range(int(wall / 0.002))]
            busy = [sum(1 for a, b in decodes if a <= x < b) for x in ticks]
            rows.append([wall, sum(b - a for lab, a, b, _ in events if lab == "read"),
                         sum(b - a for a, b in decodes), sum(c for lab, _, _, c in events if lab == "decode"),
                         statistics.mean(busy), sum(1 for n in busy if n == 0) / len(busy)])
        print(("cold loads (page cache dropped)" if cold else "warm loads (page cache could not be dropped)") + "\n")
        print(table(["wall s", "in reads s (all threads)", "in decodes s", "decode CPU s", "mean threads decoding",
                     "share of time no thread decodes"], rows))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
