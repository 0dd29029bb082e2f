"""A signal handler that saves while the training thread waits for a save slot (h126).

Lightning's SLURM auto-requeue runs ``trainer.save_checkpoint`` in its SIGUSR1 handler. When the signal
came while the training thread waited in ``Coordinator.acquire_slot`` for the save before it, the handler's
own save waited for a slot too, on top of that wait: the background save's release woke the oldest
waiter, the interrupted one, which could not run before the handler returned. The process hung at 0 % CPU
for good (SIGTERM swallowed as well). The child below reaches that state deterministically: the first
save is held by ``gatefile://`` until the handler's save waits, and the signal is sent once the training
thread is blocked in the slot's condition.
"""
from __future__ import annotations

import subprocess
import sys

_CHILD = r"""
import os, signal, sys, threading
import torch
from ckpt_core import CheckpointEngine
from ckpt_core.testing.faults import FaultFS

root = sys.argv[1]
FaultFS.reset()
FaultFS.gate = threading.Event()
engine = CheckpointEngine({"saving": {"max_pending": 1}})
slots = engine._coord._slots
handler_saves = []


def signal_when_blocked():
    while True:  # the training thread holds the condition's lock until it waits on it
        with slots._cond:
            if slots._cond._waiters:
                os.kill(os.getpid(), signal.SIGUSR1)
                return


class Spy:
    def __init__(self):
        self.outer = None

    def acquire(self, *args, **kwargs):
        if handler_saves:  # the handler's save waits for its slot: let the first save finish
            FaultFS.gate.set()
        elif self.outer is None and slots._value == 0:  # the second save waits: signal once it blocks
            self.outer = threading.Thread(target=signal_when_blocked)
            self.outer.start()
        return slots.acquire(*args, **kwargs)

    def release(self):
        slots.release()


def on_usr1(signum, frame):
    handler_saves.append(1)
    engine.save({"w": torch.full((8,), 2.0)}, f"gatefile://{root}/hpc.ckpt").result()


signal.signal(signal.SIGUSR1, on_usr1)
engine._coord._slots = Spy()
engine.save({"w": torch.full((8,), 1.0)}, f"gatefile://{root}/a.ckpt")  # held by the gate
engine.save({"w": torch.full((8,), 3.0)}, f"gatefile://{root}/b.ckpt")  # waits for a slot; the signal comes
engine.wait()
print("saved", sorted(n for n in os.listdir(root) if n.endswith(".ckpt")), engine.load(f"{root}/hpc.ckpt")["w"][0].item())
engine.close()
"""


def test_a_save_from_a_signal_handler_during_a_slot_wait_does_not_hang(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved ['a.ckpt', 'b.ckpt', 'hpc.ckpt'] 2.0" in done.stdout, done.stdout + done.stderr[-2000:]
