"""torchrun --max-restarts: the restarted workers reuse the agent's key-value store
(TORCHELASTIC_USE_AGENT_STORE), where a killed rank's count of its save in flight stayed: every rank's
load of that path after the restart, and every end of ``fit`` (``wait_job``), waited for ever (found by an
independent check: ``engine.load(engine.latest(dir))`` hung on both ranks of attempt 1). The counts are
kept per restart attempt (TORCHELASTIC_RESTART_COUNT). Checked here on a real TCPStore, as the agent hosts it."""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ckpt_core.saving import inflight
from tests.distributed.harness import free_port


def test_a_killed_ranks_save_in_flight_is_not_counted_after_a_restart(monkeypatch) -> None:
    agent = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30))
    url = "/run/step=3.ckpt"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert inflight._shared_add(agent, url, 1) == 1  # attempt 0's rank 0 began a save, then was SIGKILLed
    assert inflight._shared_add(agent, url, 0) == 1 and inflight._shared_add(agent, None, 0) == 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restarted workers, same store
    assert inflight._shared_add(agent, url, 0) == 0 and inflight._shared_add(agent, None, 0) == 0
    assert inflight._shared_add(agent, url, 1) == 1 and inflight._shared_add(agent, url, -1) == 0
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # not under torchelastic: the keys as before
    assert inflight._shared_add(agent, url, 0) == 0
