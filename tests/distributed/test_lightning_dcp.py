"""Lightning's sharded strategies through checkrun: a real 2-process Trainer saves a sharded checkpoint
(one manifest) and a new Trainer resumes from it with the same weights and optimizer moments."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning")

import ckpt_core  # noqa: E402
from ckpt_core import dcp as cdcp  # noqa: E402
from tests.distributed.harness import run_ranks  # noqa: E402


@pytest.mark.parametrize("kind", ["model_parallel", "fsdp"])
def test_sharded_strategy_saves_through_checkrun_and_resumes(tmp_path, kind) -> None:
    from tests.distributed import lightning_workers

    root = str(tmp_path / "ckpts")
    results = run_ranks(lightning_workers.fit_then_resume, 2, root, kind, init=False, timeout=240)
    path = os.path.join(root, "step=2.ckpt")
    assert sorted(os.listdir(root)) == [".checkrun", "step=2.ckpt"]  # step=1.ckpt removed (manifest only)
    assert cdcp.is_dcp_checkpoint(path)
    for r in results:
        assert r["step"] == 2 and r["final_step"] == 3
        assert r["params"] == r["saved"]["params"]  # a different init: only the checkpoint explains this
        assert r["moments"] == r["saved"]["moments"] and any(r["moments"])
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.verify(path).ok
    meta = cdcp.load_state_dict(path, keys={"lightning"})["lightning"][0]
    assert meta["global_step"] == 2 and "loops" in meta and "state_dict" not in meta
