"""torch.distributed.checkpoint through checkrun with real processes (gloo on CPU, 127.0.0.1).

2 ranks save DTensor shards; 2, 1 and 4 ranks load them (DCP's planner reshards); a second save writes
only changed chunks (also from fresh processes); a rank failing commits nothing; spreading replicated
tensors over ranks stores the same content as rank-0 writing; async_save snapshots before returning.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.dcp import CheckrunLoadPlanner, CheckrunStorageReader
from tests.distributed import workers
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _manifest(path: str) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read())


def test_two_ranks_save_sharded_then_load_on_two_one_and_four(tmp_path) -> None:
    path = str(tmp_path / "run" / "step=7.dcp")
    r0, r1 = run_ranks(workers.sharded_save_and_load, 2, path)
    # one checkpoint = one manifest file; every rank wrote its own shards into the shared blob store
    assert sorted(os.listdir(tmp_path / "run")) == [".checkrun", "step=7.dcp"]
    assert r0["written"] > 0 and r1["written"] > 0 and r1["info"] is None
    assert r0["info"]["ranks"] == [r0["written"], r1["written"]]
    body = _manifest(path)
    assert body["_checkrun"] == "manifest" and body["meta"]["format"] == cdcp.FORMAT
    assert {item[3] for item in body["meta"]["dcp"]["items"]} == {0, 1}
    # engine tooling recognises it
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(str(tmp_path / "run")) == path
        report = engine.verify(path)
        assert report.ok and report.blobs_checked > 0, report.problems
        flat = engine.load(path)
        assert torch.equal(flat["model.emb@32,0"], workers.full_tensors()["emb"][32:])
    # 1 process, no process group: DCP's planner reassembles the shards into plain tensors
    full = workers.full_tensors()
    whole = cdcp.load_state_dict(path)
    workers.check_state(whole, full)
    plain = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0,
             "extra": {"name": None, "lr": None}}
    dcp.load(plain, storage_reader=CheckrunStorageReader(path), planner=CheckrunLoadPlanner(), no_dist=True)
    workers.check_state(plain, full)
    # 4 processes: uneven shards (w has 6 columns: 2, 2, 2, 0)
    results = run_ranks(workers.load_resharded, 4, path)
    assert [r["local_w_cols"] for r in results] == [2, 2, 2, 0]
    # `checkrun export` writes the reassembled state (h130: it wrote the per-shard records, "model.emb@32,0")
    from ckpt_core.cli import main as cli

    assert cli(["export", path, str(tmp_path / "x.pt")]) == 0
    workers.check_state(torch.load(tmp_path / "x.pt", weights_only=True), full)


def test_second_save_writes_only_changed_chunks_also_after_restart(tmp_path) -> None:
    root = str(tmp_path / "inc")
    r0, r1 = run_ranks(workers.incremental_saves, 2, root, 1)
    (s1, _), (s2, s2_r0) = r0["s1"], r0["s2"]
    assert s1["written"] > 800_000  # 1 MiB of random float32 shards (compressed) + the replicated head
    assert s2_r0 == 0 and r1["s2"][1] == s2["written"]  # rank 0's shard did not change
    assert 0 < s2["written"] < 0.1 * s1["written"]  # one 64 KiB chunk of rank 1's shard
    # fresh processes: nothing changed since s2, nothing is written
    r0, r1 = run_ranks(workers.incremental_saves, 2, root, 2)
    assert r0["s3"][0]["written"] == 0 and r0["s3"][1] == r1["s3"][1] == 0
    full = cdcp.load_state_dict(os.path.join(root, "s3.dcp"))
    assert torch.equal(full["emb"], cdcp.load_state_dict(os.path.join(root, "s2.dcp"))["emb"])


def test_a_failing_rank_commits_nothing(tmp_path) -> None:
    root = str(tmp_path / "fail")
    results = run_ranks(workers.failing_rank, 2, root)
    assert all(r["raised"] for r in results), results
    assert "no space left" in results[0]["message"] + results[1]["message"]
    assert sorted(os.listdir(root)) == [".checkrun", "good.dcp"]  # bad.dcp never appeared
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(root) == os.path.join(root, "good.dcp")
        report = engine.gc(root, grace_seconds=0)  # rank 0's orphaned blobs go, the good ones stay
        assert report.deleted and not report.problems
        assert engine.verify(os.path.join(root, "good.dcp")).ok
    workers.check_state(cdcp.load_state_dict(os.path.join(root, "good.dcp")), workers.full_tensors())


def test_spreading_replicated_tensors_stores_what_rank0_writing_stores(tmp_path) -> None:
    root = str(tmp_path / "ddp")
    r0, _ = run_ranks(workers.replicated_saves, 2, root)
    spread, rank0 = r0["spread"]["ranks"], r0["rank0"]["ranks"]
    assert rank0[1] == 0 and rank0[0] > 0  # DCP's rank-0 dedup: rank 1 writes nothing
    assert min(spread) > 0 and max(spread) < 1.5 * min(spread)  # both ranks write, balanced
    a = cdcp.load_state_dict(os.path.join(root, "spread", "x.dcp"))
    b = cdcp.load_state_dict(os.path.join(root, "rank0", "x.dcp"))
    assert a.keys() == b.keys() and a["step"] == b["step"] == 3 and a["optim"]["lr"] == b["optim"]["lr"]
    for group in ("model", "optim"):
        for k, v in b[group].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(a[group][k], v), k
    items = _manifest(os.path.join(root, "spread", "x.dcp"))["meta"]["dcp"]["items"]
    emb_writers = {rank for fqn, _, _, rank in items if fqn == "model.emb"}
    assert emb_writers == {0, 1}  # the big table itself is written by both ranks


def test_async_save_snapshots_before_returning(tmp_path) -> None:
    assert run_ranks(workers.async_saves, 2, str(tmp_path / "async")) == [{"ok": True}, {"ok": True}]


def test_a_save_and_a_load_right_after_an_async_save_wait_for_it(tmp_path) -> None:
    assert run_ranks(workers.async_save_then_save_at_once, 2, str(tmp_path), timeout=90) == [{"ok": True}] * 2


@pytest.mark.s3
def test_two_ranks_on_s3(s3_root, s3_storage_options) -> None:
    path = f"{s3_root}/step=7.dcp"
    r0, _ = run_ranks(workers.s3_save, 2, path, s3_storage_options)
    assert r0["info"] > 0
    workers.check_state(cdcp.load_state_dict(path, storage_options=s3_storage_options), workers.full_tensors())


def test_every_rank_loads_what_rank_0_is_still_saving(tmp_path) -> None:
    """Plain DDP habit: rank 0 saves, dist.barrier(), every rank loads (Lightning's DDP does the same
    with save_checkpoint then validate(ckpt_path=...)): rank 1 waits for rank 0's commit."""
    assert run_ranks(workers.rank0_saves_every_rank_loads, 2, str(tmp_path)) == [{"same": True}, {"same": True}]


def test_per_rank_tensors_of_one_name_are_not_spread_and_process_async_save_works(tmp_path) -> None:
    assert run_ranks(workers.per_rank_buffers, 2, str(tmp_path / "ranks")) == [{"ok": True}, {"ok": True}]


def test_a_key_that_reads_like_a_chunk_name_saves_and_loads(tmp_path) -> None:
    assert run_ranks(workers.chunk_like_keys, 2, str(tmp_path)) == [{"ok": True}, {"ok": True}]


def test_a_zero_redundancy_optimizer_replays_its_step_log_on_every_rank(tmp_path):
    """ZeroRedundancyOptimizer on 2 gloo ranks: the replay applied the logged steps, then raised AttributeError
    ('NoneType' object has no attribute 'items') on both ranks (h162); it returns them, bit for bit."""
    results = run_ranks(workers.zero_step_log_replay, 2, str(tmp_path / "run"))
    assert results == [{"replayed": 3, "equal": True}] * 2, results
