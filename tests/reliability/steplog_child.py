"""Child process of test_steplog_kill: ``python -m tests.reliability.steplog_child MODE ...``.

    train DIR KIND        train with the step log on, a checkpoint every 7 steps, ``flush()`` every
                          5 steps; prints ``flushed N`` after each flush returned (N is committed)
                          and ``committed PATH`` after each checkpoint's commit; runs until killed
    resume DIR KIND OUT   load the newest checkpoint, replay the log; torch.save to OUT the state and
                          an uninterrupted run's (no logging) at the resumed step; print
                          ``resumed CKPT_STEP REPLAYED``
"""
from __future__ import annotations

import os
import re
import sys

import torch

from ckpt_core import CheckpointEngine
from tests.core.steplog_train import load_into, make, state, train_step

CKPT_EVERY, FLUSH_EVERY = 7, 5


def train(directory: str, kind: str) -> None:
    net, opt, sched = make(kind)
    engine = CheckpointEngine({"step_log": {"flush_every_steps": 3},
                               "saving": {"sigterm_grace_seconds": None}})
    slog = engine.step_log(directory, opt, sched)
    # one os.write per line: the save callback runs on the engine's background thread
    engine.add_callback(lambda info: os.write(1, f"committed {info.path}\n".encode()))
    for step in range(1, 1_000_000):
        train_step(net, opt, sched, step)
        if step % CKPT_EVERY == 0:
            engine.save(state(net, opt, sched), f"{directory}/step{step}.ckpt")
        if step % FLUSH_EVERY == 0:
            slog.flush()
            os.write(1, f"flushed {step}\n".encode())


def resume(directory: str, kind: str, out: str) -> None:
    net, opt, sched = make(kind)
    with CheckpointEngine() as engine:
        path = engine.latest(directory)
        load_into(engine.load(path), net, opt, sched)
        n = engine.replay(directory, opt, sched, after=path)
    ckpt_step = int(re.search(r"step(\d+)\.ckpt$", path).group(1))
    torch.save({"resumed": state(net, opt, sched), "reference": _reference(kind, ckpt_step + n)}, out)
    print(f"resumed {ckpt_step} {n}", flush=True)


def _reference(kind: str, steps: int) -> dict:
    """An uninterrupted run without logging, after ``steps`` steps."""
    net, opt, sched = make(kind)
    for step in range(1, steps + 1):
        train_step(net, opt, sched, step)
    return state(net, opt, sched)


if __name__ == "__main__":
    torch.set_num_threads(1)  # the same kernels in every process: bit-exact comparisons across them
    mode, *args = sys.argv[1:]
    if mode == "train":
        train(*args)
    else:
        resume(*args)
