"""SIGTERM while the training process's main thread is blocked in C code (a rendezvous or collective
waiting for a peer that never comes), after checkrun installed its SIGTERM grace and its saves committed.

Python runs a Python signal handler only when the main thread returns to the interpreter: before the
C hook (``ckpt_core._csig``) such a process did not end at SIGTERM at all, as it does with no handler,
but only when the blocked call gave up (an independent check: 39.9 s, stock 0.0 s). Here the call
would block for 10 minutes, past the test's wait for the process: only the hook ends it in time.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckpt_core

CHILD = """
    import datetime, sys, torch, ckpt_core
    import torch.distributed as dist
    root = sys.argv[1]
    if sys.argv[2] == "accelerate":  # its index is saved after the parts commit, by a group committer
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
        from accelerate_ckpt import AcceleratorCheckpointer
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(root, automatic_checkpoint_naming=True))
        model = acc.prepare(torch.nn.Linear(4, 4))
        ckpt = AcceleratorCheckpointer(acc, {"saving": {"sigterm_grace_seconds": 300}}).attach()
        acc.save_state()
        ckpt.wait()
    else:
        engine = ckpt_core.CheckpointEngine({"saving": {"sigterm_grace_seconds": 300}})
        for i in range(int(sys.argv[2])):  # the handler is installed; nothing is pending once they commit
            engine.save({"w": torch.full((10,), float(i))}, root + f"/{i}.ckpt").result()
    print("blocking", flush=True)
    # waits in C++ for a second rank that never comes (torch's rendezvous; no check for Python's signals)
    dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=600))
    print("not reached", flush=True)
"""


@pytest.fixture
def children():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # one that failed the test would block for 10 minutes
        p.kill()
        p.wait()


def _start(tmp_path, saves: int, children: list) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path), str(saves)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.append(p)
    assert p.stdout.readline().strip() == "blocking", p.stderr.read() if p.poll() is not None else ""
    # The signal must come once the main thread is inside the C++ wait (a sleep loop there), not while it
    # still runs Python (then Python's handler runs at once, hook or not): its kernel wait channel says so.
    wchan = Path(f"/proc/{p.pid}/task/{p.pid}/wchan")
    while wchan.exists() and wchan.read_text() != "hrtimer_nanosleep":
        with contextlib.suppress(subprocess.TimeoutExpired):
            assert p.wait(timeout=0.01) is None, p.stderr.read()
    return p


@pytest.mark.parametrize("saves", ["1", "3", "accelerate"])
def test_sigterm_ends_a_process_blocked_in_c_code_after_its_saves(tmp_path, children, saves):
    """``accelerate``: the hook stayed armed after ``save_state`` (the index's commit group ended after the
    last save had settled): such a process did not end at SIGTERM (found by an independent check)."""
    p = _start(tmp_path, saves, children)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err
    assert "not reached" not in out
    if saves == "accelerate":
        assert (tmp_path / "checkpoints" / "checkpoint_0" / "checkrun.ckpt").exists()
    else:
        last = int(saves) - 1
        assert torch.equal(ckpt_core.load(tmp_path / f"{last}.ckpt")["w"], torch.full((10,), float(last)))


def test_a_sigterm_handled_while_a_save_is_queued_gets_the_grace(tmp_path):
    """The Python handler can run inside ``save()`` on the main thread, right after the hook is armed: it
    ran before the save was queued, and it stopped the coordinator's settle behind a lock, so the grace
    waited for saves that could not run and the process ended without them (found by an independent
    check; the timing forced here by sending the signal from inside ``arm``)."""
    code = textwrap.dedent("""
        import os, signal, sys, torch, ckpt_core
        from ckpt_core.saving import lifecycle
        root = sys.argv[1]
        engine = ckpt_core.CheckpointEngine({"saving": {"sigterm_grace_seconds": 120, "max_pending": 4}})
        engine.save({"w": torch.zeros(4)}, f"{root}/warm.ckpt").result()  # the handler and the C hook
        lib = lifecycle._sigterm["hooked"]

        class Signalling:  # arm() of the second save below: the signal arrives inside save()
            fire = False
            def checkrun_sigterm_arm(self, on):
                if on and Signalling.fire:
                    Signalling.fire = False
                    os.kill(os.getpid(), signal.SIGTERM)
                lib.checkrun_sigterm_arm(on)

            def checkrun_sigterm_hook(self):
                return lib.checkrun_sigterm_hook()

        lifecycle._sigterm["hooked"] = lifecycle._sigterm["csig"] = Signalling()  # each save hooks again
        engine.save({"w": torch.randn(4_000_000)}, f"{root}/a.ckpt")  # still being written at the second
        Signalling.fire = True
        engine.save({"w": torch.ones(4)}, f"{root}/b.ckpt")
        print("not reached", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGTERM, p.stderr[-2000:]
    assert "ran out" not in p.stderr and "not reached" not in p.stdout
    assert torch.equal(ckpt_core.load(tmp_path / "b.ckpt")["w"], torch.ones(4))


FORKER = """
    import datetime, os, sys, torch, ckpt_core
    import torch.distributed as dist
    from ckpt_core.testing import FaultFS, Gate
    root = sys.argv[1]
    engine = ckpt_core.CheckpointEngine({"saving": {"sigterm_grace_seconds": 300}})
    engine.save({"w": torch.zeros(4)}, root + "/warm.ckpt").result()  # the handler and the C hook
    gate = FaultFS.policy = Gate("open", kind="blob")
    pending = engine.save({"w": torch.ones(4)}, "faultfile://" + root + "/held.ckpt")  # armed: a save pending
    assert gate.entered.wait(60)
    pid = os.fork()
    if pid == 0:  # the child has no save of its own; blocked in C++ as before
        dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=600))
        os._exit(3)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(status, flush=True)
    gate.release()
    pending.result()
"""


def test_a_child_forked_while_a_save_is_pending_ends_at_sigterm_while_blocked_in_c(tmp_path, children):
    """The child inherited the hook armed (it has no saves: the parent's are not its own), so a SIGTERM went to
    the Python handler, which runs only when the blocked call returns (found by an independent check)."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FORKER), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children.append(p)
    line = p.stdout.readline().strip()
    assert line.isdigit(), p.stderr.read() if p.poll() is not None else line
    child = int(line)
    try:
        wchan = Path(f"/proc/{child}/task/{child}/wchan")
        while wchan.exists() and wchan.read_text() != "hrtimer_nanosleep":
            with contextlib.suppress(subprocess.TimeoutExpired):
                assert p.wait(timeout=0.01) is None, p.stderr.read()
        os.kill(child, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert p.returncode == 0, err
    status = int(out.strip())
    assert status & 0x7F == signal.SIGTERM, status  # killed by the signal, at once
    assert torch.equal(ckpt_core.load(tmp_path / "held.ckpt")["w"], torch.ones(4))
