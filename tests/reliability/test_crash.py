"""Crash consistency: a real training process is SIGKILLed at aimed points, many of them inside
saves; after every kill the directory holds only loadable checkpoints, ``latest()`` is at least
the newest committed one, and resuming reaches the uninterrupted run's state bit for bit.

A handful of trials for CI; ``benchmarks/soak_crash.py`` runs hundreds (docs/reliability.md).
"""
from __future__ import annotations

import random

import pytest

from ckpt_core import CheckpointEngine

from . import harness

TOTAL_STEPS, SAVE_EVERY = 12, 3


@pytest.fixture(scope="module")
def reference() -> harness.Reference:
    return harness.reference(TOTAL_STEPS, SAVE_EVERY)


def _assert_clean(report: harness.SequenceReport) -> None:
    assert report.failures == []
    assert report.completed and report.final_ok


# (phase, occurrence) twice in a row: the second kill hits a process that resumed from the first.
AIMED = [("capture", 2), ("lease-write", 2), ("blob-write", 5), ("blob-torn", 4), ("manifest-write", 2),
         ("manifest-rename", 2), ("committed", 2), ("retention", 1), ("gc", 2), ("step", 5)]


@pytest.mark.parametrize("phase,n", AIMED, ids=[p for p, _ in AIMED])
def test_kill_at_phase_then_resume(tmp_path, reference, phase, n):
    report = harness.crash_sequence(tmp_path, reference, [(phase, n), (phase, n)])
    assert [t.hit for t in report.trials] == [True, True], report.trials
    _assert_clean(report)
    if phase in ("blob-torn", "manifest-write", "manifest-rename"):
        assert report.trials[0].temp_files >= 1  # the torn temp file: ignored by every reader...
    if phase == "gc":  # killed between moving a blob aside and deleting it (storage/aside.py): the blob
        # stays under a temp name until the next full collection, which this sequence's last run (no
        # save, nothing removed) did not run: an explicit one puts it back and collects it
        assert report.trials[-1].temp_files >= 1
        with CheckpointEngine() as engine:
            engine.gc(tmp_path / "run")
        report.temp_files = harness.count_temp_files(tmp_path / "run")
    assert report.temp_files == 0  # ...and deleted by a later gc


def test_random_kills(tmp_path, reference):
    report = harness.soak(tmp_path, reference, random.Random(9), trials=6, max_kills=3)
    assert report.failures == []
    assert report.kills >= 3 and report.finals_ok == report.sequences


LIGHTNING_KILLS = [("blob-torn", 3), ("capture", 2), ("retention", 1), ("gc", 1)]


def test_lightning_plugin_killed_at_aimed_points(tmp_path):
    """The same harness around a Lightning Trainer with CheckrunCheckpointIO, resuming from
    ``ckpt_path="last"`` (compared at epoch boundaries, 4 epochs of 4 batches)."""
    pytest.importorskip("lightning")
    reference = harness.reference(4, 1, flavor="lightning")
    report = harness.crash_sequence(tmp_path, reference, LIGHTNING_KILLS)
    assert [t.hit for t in report.trials] == [True] * len(LIGHTNING_KILLS), report.trials
    _assert_clean(report)
