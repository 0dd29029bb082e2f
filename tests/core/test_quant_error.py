"""The quantization error a manifest records bounds the error of the tensor as restored.

Row-delta checkpoints restore base chunks with delta rows on top: the recorded ``max_abs_error``
and ``rel_l2_error`` must cover every chunk the record references, not only the chunks one save
wrote (issue 20, point 4). Each checkpoint of a chain is loaded and its real error computed
against the exact state that was saved.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig

RULES = {
    "int8_block": {"pattern": "emb", "method": "int8_block", "block_size": 64, "min_numel": 1},
    "uniform4": {"pattern": "emb", "method": "uniform", "bits": 4, "greedy": False, "min_numel": 1},
}


def _config(rule: str, policy: str, background: str = "thread") -> EngineConfig:
    return EngineConfig.from_dict({
        "quantization": [RULES[rule]],
        "incremental": {"policy": policy, "row_delta_min_rows": 64, "max_chain": 8},
        "compression": {"chunk_bytes": 8192},
        "retention": {"gc_grace_seconds": 0},
        "saving": {"background": background, "sigterm_grace_seconds": None},
        "storage": {"fsync": False},
    })


def _real_error(saved: torch.Tensor, restored: torch.Tensor) -> tuple[float, float]:
    err = (restored.double() - saved.double())
    rel = float(err.norm() / saved.double().norm()) if saved.abs().sum() else 0.0
    return float(err.abs().max()), rel


def _assert_bounds(engine: CheckpointEngine, path, saved: torch.Tensor) -> dict:
    quant = next(r.quant for r in engine.read_manifest(path).tensors if r.key == "emb")
    max_abs, rel = _real_error(saved, engine.load(path)["emb"])
    eps = 1e-6
    assert quant["max_abs_error"] >= max_abs * (1 - eps), (path.name, quant, max_abs)
    assert quant["rel_l2_error"] >= rel * (1 - eps), (path.name, quant, rel)
    return quant


def _updates(rows: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step rewrites a few rows with values far smaller than the rest of the table, so a
    delta alone quantizes with a much smaller error than the base it sits on."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        idx = torch.randperm(rows, generator=g)[:6]
        out.append((idx, 1e-3 * torch.randn(6, 32, generator=g)))
    return out


@pytest.mark.parametrize("rule", ["int8_block", "uniform4"])
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_row_delta_chain_records_a_bound_of_the_restored_error(tmp_path, rule, policy):
    emb = torch.randn(512, 32, generator=torch.Generator().manual_seed(0)) * 10
    saved = []
    with CheckpointEngine(_config(rule, policy)) as engine:
        for i, (idx, rows) in enumerate([(None, None)] + _updates(512, 5)):
            if idx is not None:
                emb[idx] = rows
            info = engine.save({"emb": emb}, tmp_path / f"{i}.ckpt").result()
            saved.append(emb.clone())
        assert info.chain_depth >= 1  # the chain really is made of deltas
        for i, state in enumerate(saved):
            _assert_bounds(engine, tmp_path / f"{i}.ckpt", state)


def test_writer_process_records_a_bound(tmp_path):
    emb = torch.randn(512, 32, generator=torch.Generator().manual_seed(0)) * 10
    saved = []
    with CheckpointEngine(_config("int8_block", "consecutive", "process")) as engine:
        for i, (idx, rows) in enumerate([(None, None)] + _updates(512, 3)):
            if idx is not None:
                emb[idx] = rows
            engine.save({"emb": emb}, tmp_path / f"{i}.ckpt").result()
            saved.append(emb.clone())
        for i, state in enumerate(saved):
            _assert_bounds(engine, tmp_path / f"{i}.ckpt", state)


def test_save_after_load_covers_chunks_it_reused(tmp_path):
    """A new engine reuses the unchanged chunks of a loaded checkpoint, whose stats it never saw."""
    emb = torch.randn(512, 32, generator=torch.Generator().manual_seed(0)) * 10
    with CheckpointEngine(_config("int8_block", "intermittent")) as engine:
        engine.save({"emb": emb}, tmp_path / "0.ckpt").result()
    with CheckpointEngine(_config("int8_block", "intermittent")) as engine:
        engine.load(tmp_path / "0.ckpt")
        emb[:64] = 1e-3 * torch.randn(64, 32)  # the first chunk changes, the others are reused
        engine.save({"emb": emb}, tmp_path / "1.ckpt").result()
        _assert_bounds(engine, tmp_path / "1.ckpt", emb)
