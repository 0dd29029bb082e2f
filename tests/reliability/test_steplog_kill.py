"""A plain PyTorch training process with the step log on is SIGKILLed at a random step; the resume
(newest checkpoint + replay) equals an uninterrupted run at the resumed step, bit for bit, and loses
no step whose ``flush()`` had returned (the crash bound). Synchronised through the child's stdout."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from tests.core.steplog_train import OPTIMIZERS, assert_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = [sys.executable, "-m", "tests.reliability.steplog_child"]


def _run(*args: str) -> str:
    done = subprocess.run([*CHILD, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_sigkill_at_random_step_then_resume_bit_exact(tmp_path, kind):
    seed = random.randrange(1 << 30)
    kill_after = random.Random(seed).randrange(8, 40)
    directory = str(tmp_path / "run")
    child = subprocess.Popen([*CHILD, "train", directory, kind], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    flushed, committed = 0, False
    try:
        for line in child.stdout:
            what, value = line.split()
            committed = committed or what == "committed"
            if what == "flushed":
                flushed = int(value)
                if flushed >= kill_after and committed:  # a checkpoint to resume from exists
                    break
        child.send_signal(signal.SIGKILL)  # it trains on meanwhile: the kill lands anywhere
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:]
    assert flushed >= kill_after, f"seed {seed}: the child ended before step {kill_after}"

    out = _run("resume", directory, kind, str(tmp_path / "resumed.pt")).split()
    ckpt_step, replayed = int(out[1]), int(out[2])
    resumed = ckpt_step + replayed
    assert resumed >= flushed, f"seed {seed}: resumed at {resumed}, but step {flushed} was flushed"
    both = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert_bit_equal(both["resumed"], both["reference"], f"seed {seed}, step {resumed}")
