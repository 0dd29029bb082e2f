"""Incremental checkpoints: exact row deltas, frozen tensors, chain policies, removal in any order."""
from __future__ import annotations

import random

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig


def _cfg(policy="intermittent", **inc):
    return EngineConfig.from_dict({"incremental": {"policy": policy, "row_delta_min_rows": 64, **inc},
                                   "retention": {"gc_grace_seconds": 0}})


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_sparse_row_updates_write_only_changed_rows(tmp_path):
    emb = torch.randn(4096, 32)
    frozen = torch.randn(512, 512)
    with CheckpointEngine(_cfg()) as engine:
        full = engine.save({"emb": emb, "frozen": frozen}, tmp_path / "0.ckpt").result()
        emb[torch.randperm(4096)[:100]] += 1.0
        inc = engine.save({"emb": emb, "frozen": frozen}, tmp_path / "1.ckpt").result()
        loaded = engine.load(tmp_path / "1.ckpt")
    assert inc.written_bytes < 0.05 * full.written_bytes
    assert inc.chain_depth == 1
    assert _bits_equal(loaded["emb"], emb) and _bits_equal(loaded["frozen"], frozen)


def test_nan_and_negative_zero_changes_are_detected(tmp_path):
    t = torch.zeros(256, 4)
    with CheckpointEngine(_cfg()) as engine:
        engine.save({"t": t}, tmp_path / "0.ckpt").result()
        t[3, 1] = -0.0
        t[7, 2] = float("nan")
        engine.save({"t": t}, tmp_path / "1.ckpt").result()
        t[7, 2] = float("nan")  # nan -> same nan bits: unchanged
        t[9, 0] = 1e-45
        engine.save({"t": t}, tmp_path / "2.ckpt").result()
        for i, name in enumerate(["1.ckpt", "2.ckpt"]):
            assert _bits_equal(engine.load(tmp_path / name)["t"][:8], t[:8])
        assert _bits_equal(engine.load(tmp_path / "2.ckpt")["t"], t)


@pytest.mark.parametrize("policy", ["intermittent", "one_shot", "consecutive"])
def test_random_sequences_match_reference_at_every_save(tmp_path, policy):
    rng = random.Random(hash(policy) % 1000)
    torch.manual_seed(rng.randrange(1000))
    state = {"emb": torch.randn(512, 16), "emb16": torch.randn(300, 8).half(), "dense": torch.randn(70, 70),
             "frozen": torch.randn(128, 64), "step": 0}
    refs: dict[str, dict] = {}
    with CheckpointEngine(_cfg(policy, max_chain=4)) as engine:
        for i in range(14):
            kind = rng.choice(["sparse", "sparse", "dense", "none"])
            if kind == "sparse":
                for key in ("emb", "emb16"):
                    rows = torch.randint(0, state[key].shape[0], (rng.randrange(1, 40),))
                    state[key][rows] += torch.randn(len(rows), state[key].shape[1]).to(state[key].dtype)
            elif kind == "dense":
                state["dense"].mul_(0.9)
                state["emb"].add_(0.01)
            state["step"] = i
            name = f"{i}.ckpt"
            engine.save(state, tmp_path / name)
            refs[name] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
            if i % 3 == 2:  # remove random earlier checkpoints (like ModelCheckpoint's top-k)
                victim = rng.choice(sorted(refs))
                engine.remove(tmp_path / victim)
                refs.pop(victim)
                engine.gc(tmp_path, grace_seconds=0)
        engine.wait()
        for name, ref in refs.items():
            loaded = engine.load(tmp_path / name)
            for k, v in ref.items():
                assert _bits_equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v, (name, k)
            assert engine.verify(tmp_path / name).ok


def test_resume_then_save_stays_incremental(tmp_path):
    emb = torch.randn(2048, 64)
    with CheckpointEngine(_cfg()) as engine:
        full = engine.save({"emb": emb}, tmp_path / "0.ckpt").result()
    with CheckpointEngine(_cfg()) as engine:  # a new process: load, train a little, save
        emb2 = engine.load(tmp_path / "0.ckpt")["emb"]
        emb2[:10] += 1
        inc = engine.save({"emb": emb2}, tmp_path / "1.ckpt").result()
        assert inc.written_bytes < 0.05 * full.written_bytes
        assert _bits_equal(engine.load(tmp_path / "1.ckpt")["emb"], emb2)


def test_resume_from_a_delta_chain_compares_against_what_was_loaded(tmp_path):
    emb = torch.randn(4096, 64)
    cfg = _cfg().replace(**{"compression.chunk_bytes": 64 * 1024})  # many chunks, decoded in parallel
    with CheckpointEngine(cfg) as engine:
        full = engine.save({"emb": emb}, tmp_path / "0.ckpt").result()
        emb[100:110] += 1
        engine.save({"emb": emb}, tmp_path / "1.ckpt").result()  # base + one delta
    with CheckpointEngine(cfg) as engine:
        emb2 = engine.load(tmp_path / "1.ckpt")["emb"]
        assert _bits_equal(emb2, emb)
        emb2[4000:4005] -= 1  # the loaded tensor is the user's: the engine's reference must not follow it
        inc = engine.save({"emb": emb2}, tmp_path / "2.ckpt").result()
        assert inc.written_bytes < 0.05 * full.written_bytes
        assert _bits_equal(engine.load(tmp_path / "2.ckpt")["emb"], emb2)


def test_removing_base_keeps_dependents_loadable(tmp_path):
    emb = torch.randn(1024, 16)
    with CheckpointEngine(_cfg("consecutive")) as engine:
        engine.save({"emb": emb}, tmp_path / "0.ckpt")
        emb[5] = 0
        engine.save({"emb": emb}, tmp_path / "1.ckpt")
        emb[6] = 0
        engine.save({"emb": emb}, tmp_path / "2.ckpt")
        engine.wait()
        for name in ("0.ckpt", "1.ckpt"):
            engine.remove(tmp_path / name)
        report = engine.gc(tmp_path, grace_seconds=0)
        assert report.deleted == []  # everything still needed by 2.ckpt
        assert _bits_equal(engine.load(tmp_path / "2.ckpt")["emb"], emb)


@pytest.mark.parametrize("dtype,cols", [(torch.float32, 64), (torch.float32, 3), (torch.float16, 3),
                                        (torch.bfloat16, 8), (torch.float64, 1), (torch.int8, 5),
                                        (torch.bool, 9), (torch.complex64, 2)])
def test_copy_changed_rows_finds_exactly_the_changed_rows(dtype, cols):
    from ckpt_core.saving.streams import _COMPARE_BLOCK_BYTES, copy_changed_rows

    rng = random.Random(cols)
    rows = 3 * _COMPARE_BLOCK_BYTES // (cols * torch.empty((), dtype=dtype).element_size()) + 7  # > 3 blocks
    dst = torch.randn(rows, cols).to(dtype) if dtype != torch.bool else torch.rand(rows, cols) > 0.5
    src = dst.clone()
    changed = sorted(rng.sample(range(rows), 50) + [0, rows - 1])
    changed = sorted(set(changed))
    for r in changed:  # flip one bit of one element: the smallest possible change
        c = rng.randrange(cols)
        src[r].view(torch.uint8)[c * src.element_size()] ^= 1
    out = copy_changed_rows(src, dst)
    assert out.tolist() == changed
    assert torch.equal(src.view(torch.uint8) if dtype != torch.complex64 else torch.view_as_real(src),
                       dst.view(torch.uint8) if dtype != torch.complex64 else torch.view_as_real(dst))
