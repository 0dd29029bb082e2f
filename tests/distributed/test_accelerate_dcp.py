"""accelerate_ckpt.dcp: a real 2-process Accelerator saves FSDP2-sharded model, optimizer, scheduler,
step and per-rank RNG state as one checkrun DCP checkpoint and restores them into fresh objects."""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from ckpt_core import dcp as cdcp  # noqa: E402
from tests.distributed.harness import run_ranks  # noqa: E402


def test_sharded_accelerate_state_round_trip(tmp_path) -> None:
    from tests.distributed import accelerate_workers

    path = str(tmp_path / "run" / "step=2.dcp")
    results = run_ranks(accelerate_workers.save_then_load, 2, path, init=False, timeout=240)
    for r in results:
        assert r["loaded"] == r["saved"]
    assert results[0]["saved"]["rand"] != results[1]["saved"]["rand"]  # each rank got its own RNG back
    whole = cdcp.load_state_dict(str(path))  # 1 process: the shards reassembled
    assert whole["model_0"]["0.weight"].shape == (32, 16) and whole["accelerator"][0] == {"step": 2}
    assert {"rng_0", "rng_1", "optimizer_0", "scheduler_0"} <= set(whole)
