"""Loads with ``saving.background: process``: no writer process is started or waited for, the load's
own copies become the row streams' shared buffers (adoption copies nothing), and the next save is
a row delta, across engine restarts too. These are the copies made during the load
(``load.reference: inline``); those rebuilt after it are tests/core/test_load_reference.py's."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine, CheckrunError
from ckpt_core.saving.shm_staging import SharedBuffers
from ckpt_core.saving.staging import BufferPool

PROCESS = {"saving": {"background": "process"}, "incremental": {"row_delta_min_rows": 64},
           "retention": {"gc_grace_seconds": 0}, "load": {"reference": "inline"}}
TABLES, ROWS, DIM = 3, 2048, 32


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"emb.{i}": torch.randn(ROWS, DIM, generator=g) for i in range(TABLES)},
            "bias": torch.randn(DIM, generator=g), "step": 0}


def _change_rows(state: dict, frac: float, seed: int) -> None:
    """One interval of training: ``frac`` of each table's rows change."""
    g = torch.Generator().manual_seed(100 + seed)
    for t in state["model"].values():
        idx = torch.randperm(ROWS, generator=g)[: int(frac * ROWS)]
        t[idx] += 0.5
    state["bias"] += 1.0
    state["step"] += 1


def _equal(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and torch.equal(a["bias"], b["bias"]) and a["model"].keys() == b["model"].keys()
            and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]))


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _shared_files(engine: CheckpointEngine) -> list[str]:
    return [n for n in os.listdir(engine.staging.shared.directory) if n.endswith(".buf")]


def _streams(engine: CheckpointEngine) -> dict:
    (state,) = engine._dirs.values()
    return state.streams


TABLE_BYTES = TABLES * ROWS * DIM * 4


def test_process_load_starts_nothing_and_saves_deltas_across_a_restart(tmp_path) -> None:
    expected = _state()
    with CheckpointEngine(PROCESS) as engine:
        full = engine.save(expected, tmp_path / "0.ckpt").result()
    assert full.written_bytes > 0.8 * TABLE_BYTES

    with CheckpointEngine(PROCESS) as engine:
        state = engine.load(tmp_path / "0.ckpt")
        assert engine._process._proc is None  # the load neither started nor waited for the writer process
        streams = _streams(engine)
        assert sorted(streams) == [f"model.emb.{i}" for i in range(TABLES)]
        shared = engine.staging.shared
        assert all(shared.name_of(s.buffer) is not None for s in streams.values())
        assert len(_shared_files(engine)) == TABLES  # one shared copy per table, nothing else
        _change_rows(state, 0.05, seed=1)
        _change_rows(expected, 0.05, seed=1)
        before = _disk_bytes(tmp_path)
        first = engine.save(state, tmp_path / "1.ckpt").result()
        grown = _disk_bytes(tmp_path) - before
        assert engine._process._proc is not None
    assert first.chain_depth == 1  # a row delta against the loaded base
    assert grown == pytest.approx(first.written_bytes, rel=0.01)
    assert grown < 0.15 * TABLE_BYTES  # 5% of the rows, their indices and a manifest

    # a new engine (the trainer restarted) resumes from the delta and keeps saving deltas
    with CheckpointEngine(PROCESS) as engine:
        state = engine.load(tmp_path / "1.ckpt")
        assert _equal(state, expected)
        assert engine._process._proc is None
        _change_rows(state, 0.05, seed=2)
        _change_rows(expected, 0.05, seed=2)
        before = _disk_bytes(tmp_path)
        second = engine.save(state, tmp_path / "2.ckpt").result()
        grown = _disk_bytes(tmp_path) - before
    assert second.chain_depth == 1 and second.reused_blobs > 0
    assert grown < 0.3 * TABLE_BYTES  # intermittent policy: the rows changed since the base (~10%)
    with CheckpointEngine({"saving": {"background": "thread"}}) as engine:
        assert _equal(engine.load(tmp_path / "2.ckpt"), expected)


def test_repeated_loads_keep_one_shared_copy_per_table(tmp_path) -> None:
    expected = _state()
    with CheckpointEngine(PROCESS) as engine:
        engine.save(expected, tmp_path / "0.ckpt").result()
        counts = []
        for _ in range(3):
            assert _equal(engine.load(tmp_path / "0.ckpt"), expected)
            counts.append(len(_shared_files(engine)))
    # the streams a load replaced were released: one buffer per table, plus the staging buffer
    # of "bias" that the pool keeps for the next save
    assert counts == [TABLES + 1] * 3


def test_copies_of_a_failed_load_are_released_by_the_next(tmp_path) -> None:
    expected = _state()
    with CheckpointEngine(PROCESS) as engine:
        engine.save(expected, tmp_path / "0.ckpt").result()
        ref = next(iter(engine.read_manifest(tmp_path / "0.ckpt").tensors[0].base)).blob
    blob = tmp_path / ".checkrun" / "blobs" / ref.key[:2] / ref.key[2:]
    good = blob.read_bytes()
    blob.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
    with CheckpointEngine(PROCESS) as engine:
        with pytest.raises(CheckrunError, match="checksum mismatch"):
            engine.load(tmp_path / "0.ckpt")
        assert len(_shared_files(engine)) == TABLES  # the failed load's copies, held until the next load
        blob.write_bytes(good)
        assert _equal(engine.load(tmp_path / "0.ckpt"), expected)
        assert len(_shared_files(engine)) == TABLES


def test_host_copy_adopts_the_loads_own_copies_and_copies_anything_else() -> None:
    shared = SharedBuffers()
    try:
        pool = BufferPool(shared=shared)
        alloc = pool.copy_allocator()
        mine = alloc(1000, torch.float32)
        mine.copy_(torch.arange(1000.0))
        assert pool.host_copy(mine) is mine
        assert shared.name_of(mine) is not None
        other = torch.arange(1000.0)
        copy = pool.host_copy(other)
        assert copy is not other and shared.name_of(copy) is not None and torch.equal(copy, other)
        assert pool.host_copy(mine) is not mine  # adopted once; a second adoption gets its own buffer
    finally:
        shared.close()
    assert BufferPool().copy_allocator() is None  # threads mode: the reader allocates as before
