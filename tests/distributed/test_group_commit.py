"""Coordination between ranks with two real gloo processes: the Accelerate adapter's group commit
(core/saving/group.py) and the job-wide count of saves in flight (core/saving/inflight.py)."""
from __future__ import annotations

from tests.distributed import workers
from tests.distributed.harness import run_ranks


def test_a_rank_that_announced_its_part_is_waited_for() -> None:
    r0, r1 = run_ranks(workers.late_part_is_waited_for, 2)
    assert r0 == {"parts": [["part0", "part1"]], "errors": []} and r1 == {"parts": [], "errors": []}


def test_a_rank_whose_save_raised_after_announcing_fails_the_checkpoint() -> None:
    r0, r1 = run_ranks(workers.abandoned_part_fails_the_checkpoint, 2)
    assert r0 == {"errors": ["rank 1 did not save its part: OSError: disk full"]} and r1 == {"errors": []}


def test_a_save_in_flight_is_counted_in_the_process_group_it_began_in() -> None:
    r0, r1 = run_ranks(workers.inflight_count_follows_its_process_group, 2)
    assert r0 == r1 == {"during": [1, 1], "after": 0}


def test_a_store_lost_after_rank_0_committed_is_not_called_a_failed_commit() -> None:
    r0, r1 = run_ranks(workers.verdict_lost_after_rank0_committed, 2)
    assert r0 == {"errors": []}
    assert len(r1["errors"]) == 1 and r1["errors"][0].startswith("checkpoint commit unknown: commit group failed: ")
    assert "rank 0 may have committed it" in r1["errors"][0]


def test_a_rank_0_whose_process_ended_is_not_waited_for() -> None:
    r0, r1 = run_ranks(workers.rank0_gone_is_not_waited_for, 2)
    assert r0 == {"errors": []}
    assert r1 == {"errors": ["checkpoint memory://run/checkpoint_0/index not committed: no verdict from rank 0 "
                             "(it did not save this checkpoint, or ended)"]}
