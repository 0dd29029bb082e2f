"""Which Accelerate checkpoint is the newest, when clocks and commits do not run in order (h127).

``latest()``, ``load_state()`` and ``total_limit`` ordered checkpoint folders by the raw time in their
index, taken when the index was committed: a trainer paused before its commit while a restarted run
saved on, a clock stepped back in one process, or a trainer whose clock ran ahead made an older
checkpoint the newest, and retention deleted newer committed ones. Folders are now ordered as
checkpoint files are: one process's in the order it asked for them, a time far ahead replaced by the
index file's own, and an index dated when ``save_state`` was called.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from accelerate_ckpt import AcceleratorCheckpointer
from ckpt_core import CheckpointEngine
from ckpt_core.saving.fence import new_stamp

_TRAINER = textwrap.dedent('''
    import os, sys, time
    import torch
    if sys.argv[3] != "0":  # this trainer's clock runs ahead
        ahead = float(sys.argv[3]); t, tn = time.time, time.time_ns
        time.time = lambda: t() + ahead; time.time_ns = lambda: tn() + int(ahead * 1e9)
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from accelerate_ckpt import AcceleratorCheckpointer
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(sys.argv[1], automatic_checkpoint_naming=True,
                                                                    total_limit=2))
    model = acc.prepare(torch.nn.Linear(4, 4))
    ck = AcceleratorCheckpointer(acc).attach()
    if os.path.isdir(os.path.join(sys.argv[1], "checkpoints")):
        acc.load_state()
    for _ in range(int(sys.argv[2])):
        with torch.no_grad():
            model.weight.add_(1.0)
        acc.save_state()
    ck.close()
''')


def _accelerator(project: Path) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True,
                                                                     total_limit=2))


def _folders(project: Path) -> list[str]:
    return sorted(f for f in os.listdir(project / "checkpoints") if not f.startswith("."))


def test_a_clock_stepped_back_keeps_one_processs_checkpoints_in_order(tmp_path, monkeypatch) -> None:
    """One process, its clock set back an hour after checkpoint_1 (an NTP step, a restored VM): kept were
    checkpoint_0 and checkpoint_4, and ``latest()`` answered checkpoint_0."""
    acc = _accelerator(tmp_path)
    model = acc.prepare(torch.nn.Linear(4, 4))
    real, real_ns = time.time, time.time_ns
    with AcceleratorCheckpointer(acc).attach() as ck:
        for i in range(5):
            if i == 2:
                monkeypatch.setattr(time, "time", lambda: real() - 3600)
                monkeypatch.setattr(time, "time_ns", lambda: real_ns() - 3600 * 10**9)
            with torch.no_grad():
                model.weight.fill_(float(i))
            acc.save_state()
        ck.wait()
        assert _folders(tmp_path) == ["checkpoint_3", "checkpoint_4"]
        assert ck.latest().endswith("checkpoint_4")


def test_a_trainer_whose_clock_ran_ahead_does_not_stay_the_newest(tmp_path) -> None:
    """Trainer A's clock runs an hour ahead; trainer B (right clock) resumes from A's newest and saves three
    more with ``total_limit=2``: B's were deleted and ``latest()`` stayed A's."""
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    project = tmp_path / "project"
    for saves, ahead in ((2, 3600), (3, 0)):
        subprocess.run([sys.executable, str(script), str(project), str(saves), str(ahead)], check=True, timeout=300)
    # (checkpoint_1: the one B resumed from, which its retention never removes; before: 0, 1 and 4 were left)
    assert _folders(project) == ["checkpoint_1", "checkpoint_3", "checkpoint_4"]
    acc = _accelerator(project)
    model = acc.prepare(torch.nn.Linear(4, 4))
    with AcceleratorCheckpointer(acc).attach() as ck:
        assert ck.latest().endswith("checkpoint_4")
        acc.load_state()
    assert acc.project_configuration.iteration == 5
    assert torch.isfinite(model.weight).all()


def test_a_checkpoint_committed_late_is_dated_when_it_was_asked_for(tmp_path, monkeypatch) -> None:
    """A save whose commit comes long after it was asked for (a trainer paused, an Accelerate index written
    after its parts) carries the time of its stamp, not of its capture: a paused trainer's late commit
    became the newest checkpoint and its retention deleted the newer ones of the run that restarted."""
    asked = new_stamp()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)  # ten minutes later
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"w": torch.ones(4)}, tmp_path / "late.ckpt", stamp=asked)
        created = engine.read_manifest(tmp_path / "late.ckpt").created
    assert abs(created - asked.ns / 1e9) < 1.0
