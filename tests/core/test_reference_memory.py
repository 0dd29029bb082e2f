"""Host memory an engine keeps between operations: the copies of row-delta tensors that the next save
compares against (row streams, and the background references loads rebuild). Found by a memory check
at 2 GiB: repeated loads into one engine held a copy of the state per load until the next save, and an
engine saving into a new directory each time held a copy per directory until ``close()``."""
from __future__ import annotations

import torch

from ckpt_core import CheckpointEngine


def _state(seed: int = 0) -> dict:
    return {"emb": torch.randn(4096, 64, generator=torch.Generator().manual_seed(seed))}


def _rows_held(engine: CheckpointEngine) -> int:
    """Bytes of row-stream references and reference builds the engine holds."""
    streams = sum(s.buffer.nbytes for d in engine._dirs.values() for s in d.streams.values())
    builds = sum(b.nbytes for d in engine._dirs.values() for r in d.rebuilds for b in r.buffers)
    return streams + builds


def test_repeated_loads_into_one_engine_keep_one_reference_copy(tmp_path):
    path = tmp_path / "a.ckpt"
    state = _state()
    with CheckpointEngine() as engine:
        engine.save(state, path).result()
    with CheckpointEngine({"load": {"reference": "background"}}) as engine:
        for _ in range(4):
            assert torch.equal(engine.load(path)["emb"], state["emb"])
        assert sum(len(d.rebuilds) for d in engine._dirs.values()) == 1
        engine.wait()
        assert _rows_held(engine) <= state["emb"].nbytes
        state["emb"][:5] += 1
        info = engine.save(state, tmp_path / "b.ckpt").result()  # still incremental against the load
        assert info.written_bytes < state["emb"].nbytes / 10
        assert torch.equal(engine.load(tmp_path / "b.ckpt")["emb"], state["emb"])


def test_an_engine_keeps_row_streams_of_its_two_latest_directories(tmp_path):
    state = _state()
    nbytes = state["emb"].nbytes
    with CheckpointEngine() as engine:
        for i in range(5):
            state["emb"][i] += 1
            engine.save(state, tmp_path / f"d{i}" / "a.ckpt").result()
        assert _rows_held(engine) <= 2 * nbytes
        state["emb"][9] += 1
        again = engine.save(state, tmp_path / "d4" / "b.ckpt").result()  # the latest directory: incremental
        assert again.written_bytes < nbytes / 10
        first = engine.save(state, tmp_path / "d0" / "b.ckpt").result()  # dropped: written whole, correct
        assert first.written_bytes > nbytes / 2
        for d in ("d0", "d4"):
            assert torch.equal(engine.load(tmp_path / d / "b.ckpt")["emb"], state["emb"])
        assert _rows_held(engine) <= 2 * nbytes
