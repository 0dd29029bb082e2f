"""Real multi-process runs for the distributed tests: N processes, gloo on 127.0.0.1, a free port.

Processes come from a ``forkserver`` that imports torch, DCP and checkrun once, so a 2- or 4-process run
costs a fork, not N interpreter starts (on 2 cores importing torch takes seconds). ``run_ranks`` calls
``fn(rank, world_size, *args)`` in every process, after ``init_process_group("gloo")`` unless
``init=False`` (Lightning then initializes it from the environment), and returns the ranks' return
values (JSON data). A rank's exception fails the run with its traceback; a run that does not finish
within ``timeout`` is killed and fails (collectives also time out after 60 s), so nothing hangs CI.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as tmp

# Modules of optional extras (lightning, accelerate) are skipped by the forkserver if not installed.
_PRELOAD = ["torch", "torch.distributed.checkpoint", "ckpt_core.dcp", "tests.distributed.workers",
            "tests.distributed.lightning_workers", "tests.distributed.accelerate_workers"]
_preload_set = False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str, init: bool,
           env: dict) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by all ranks
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_ranks(fn: Callable, world_size: int, *args: Any, init: bool = True, timeout: float = 150,
              env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` real processes; return their results."""
    global _preload_set
    if not _preload_set:
        multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
        _preload_set = True
    with tempfile.TemporaryDirectory(prefix="dcp-ranks-") as out_dir:
        ctx = tmp.start_processes(_entry, args=(fn, world_size, free_port(), args, out_dir, init, env or {}),
                                  nprocs=world_size, join=False, start_method="forkserver")
        done, deadline = False, time.monotonic() + timeout
        try:
            # join returns False whenever some process ended cleanly and others still run
            while not (done := ctx.join(timeout=max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish within {timeout} s")
        finally:
            if not done:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results
