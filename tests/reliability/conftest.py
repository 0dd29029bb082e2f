"""Fixtures of the reliability suite: a clean fault policy per test, recorded retry backoffs."""
from __future__ import annotations

import pytest

from ckpt_core.storage import retry as retry_mod
from ckpt_core.testing.faults import FaultFS, Policy


@pytest.fixture(autouse=True)
def _no_faults_left():
    FaultFS.reset()
    yield
    policy = FaultFS.policy
    FaultFS.reset()
    for p in (policy, getattr(policy, "also", None)):
        if isinstance(p, Policy) and hasattr(p, "release"):
            p.release()  # never leave a background thread of a failed test held at a gate


@pytest.fixture
def sleeps(monkeypatch) -> list:
    """Every retry backoff of the test, recorded instead of slept (the delays stay checkable)."""
    recorded: list = []
    monkeypatch.setattr(retry_mod, "_sleep", recorded.append)
    return recorded
