"""Child side of the commit-fencing tests (``test_fencing.py``): a training process whose save is
left in flight in its writer process (``saving.background: process``) when it is killed.

Run in a process forked from the reliability suite's forkserver (``harness.context()``), so the
parent can SIGKILL it without touching the test process.
"""
from __future__ import annotations

import threading

import torch

from ckpt_core import CheckpointEngine, EngineConfig

from .crash_child import _redirect_stderr, versioned_state


def engine_config(background: str) -> EngineConfig:
    """What the fencing tests save with: no SIGTERM handler, no fsync (durability is not tested)."""
    return EngineConfig.from_dict({
        "saving": {"background": background, "sigterm_grace_seconds": None},
        "storage": {"fsync": False},
    })


def orphan_trainer(conn, root: str, log: str) -> None:
    """Commit version 1 of a state as ``root/last.ckpt``; report the writer process's pid and its
    staging directory; once the parent says go (it has SIGSTOPped the writer), save version 2 to
    ``last.ckpt`` and report when that save has been handed to the writer process; then wait for
    the parent's SIGKILL. The writer process inherits stderr, i.e. ``log``."""
    _redirect_stderr(log)
    torch.set_num_threads(1)
    engine = CheckpointEngine(engine_config("process"))
    engine.save(versioned_state(1), f"{root}/last.ckpt").result()
    writer = engine._process
    conn.send(("writer", writer._proc.pid, writer.shared.directory))
    conn.recv()
    send = writer._send

    def send_and_tell(message, start=True):
        out = send(message, start)
        if message[0] == "save":
            conn.send(("sent",))
        return out

    writer._send = send_and_tell
    engine.save(versioned_state(2), f"{root}/last.ckpt")
    threading.Event().wait()
