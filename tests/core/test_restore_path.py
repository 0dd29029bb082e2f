"""The restore path (issue 24): loads into live tensors (``into=``), delta chains decoded in one pass
with their links applied in chain order, and errors in the middle of a load."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from torch import nn

import ckpt_core
from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.codecs.pipeline import Pipeline, index_pipeline
from ckpt_core.errors import CorruptCheckpointError
from ckpt_core.storage.store import Store

from ..reliability.test_hostile import forge


def _cfg(**over) -> EngineConfig:
    base = {"incremental": {"policy": "consecutive", "max_chain": 8, "row_delta_min_rows": 64},
            "compression": {"chunk_bytes": 16 * 1024}}  # several chunks per tensor: decoded in parallel
    for key, value in over.items():
        base.setdefault(key, {}).update(value)
    return EngineConfig.from_dict(base)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _leaves(x, path=""):
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}/{i}")


def _trained(seed: int) -> dict:
    """A model and Adam state after one real step (so the optimizer state holds tensors)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(300, 16), nn.Linear(16, 32), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randint(0, 300, (8,))).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": seed}


def _blob_file(root: Path, key: str) -> Path:
    return root / ".checkrun" / "blobs" / key[:2] / key[2:]


@pytest.mark.parametrize("via", ["engine", "function"])
def test_into_decodes_in_place_and_returns_the_live_tensors(tmp_path, via):
    saved = _trained(0)
    ckpt_core.save(saved, tmp_path / "a.ckpt", config=_cfg())
    live = _trained(1)  # same structure, other values
    ptrs = {p: t.data_ptr() for p, t in _leaves(live)}
    if via == "engine":
        with CheckpointEngine(_cfg()) as engine:
            out = engine.load(tmp_path / "a.ckpt", into=live)
    else:
        out = ckpt_core.load(tmp_path / "a.ckpt", config=_cfg(), into=live)
    got, want, mine = dict(_leaves(out)), dict(_leaves(saved)), dict(_leaves(live))
    assert got.keys() == want.keys() == ptrs.keys()
    for path, t in got.items():
        assert t is mine[path] and t.data_ptr() == ptrs[path], path  # the live tensor, not a new one
        assert _same(t, want[path]), path
    assert out["step"] == 0 and out["optim"]["param_groups"] == saved["optim"]["param_groups"]


def test_into_leaves_that_do_not_match_load_fresh_and_stay_untouched(tmp_path):
    saved = {"a": torch.randn(64, 8), "b": torch.randn(10), "c": torch.arange(6), "d": torch.randn(5, 5),
             "e": torch.randn(40, 3)}
    ckpt_core.save(saved, tmp_path / "x.ckpt", config=_cfg())
    other_shape, other_dtype = torch.zeros(11), torch.zeros(6, dtype=torch.int32)
    live_a = torch.zeros(64, 8)
    not_contiguous = torch.zeros(3, 40).t()  # same shape and dtype, another layout: filled by a copy
    into = {"a": live_a, "b": other_shape, "c": other_dtype, "e": not_contiguous, "zzz": torch.zeros(2)}
    out = ckpt_core.load(tmp_path / "x.ckpt", into=into)
    assert out["a"] is live_a and _same(live_a, saved["a"])
    assert out["e"] is not_contiguous and _same(not_contiguous, saved["e"])
    for key, untouched in (("b", other_shape), ("c", other_dtype)):
        assert out[key] is not untouched and _same(out[key], saved[key])
        assert not untouched.any()
    assert _same(out["d"], saved["d"]) and "zzz" not in out  # "d" not in into: loaded as usual


def test_into_fills_parameters_and_tied_leaves(tmp_path):
    w = torch.randn(128, 4)
    ckpt_core.save({"enc": w, "dec": w, "p": torch.randn(3)}, tmp_path / "t.ckpt", config=_cfg())
    param = nn.Parameter(torch.zeros(3))  # requires grad: written without autograd
    live_w = torch.zeros(128, 4)
    out = ckpt_core.load(tmp_path / "t.ckpt", into={"enc": live_w, "dec": live_w, "p": param})
    assert out["enc"] is live_w and out["dec"] is live_w and _same(live_w, w)
    assert out["p"] is param and param.requires_grad and param.grad is None


def _chain(root: Path, engine: CheckpointEngine, links: int, rows: int = 512) -> tuple[dict, list]:
    """A base and ``links`` consecutive deltas; row 7 changes in links 2 and 5 (different values)."""
    torch.manual_seed(0)
    state = {"emb": torch.randn(rows, 16), "mom": torch.rand(rows, 2)}
    infos = [engine.save(state, root / "0.ckpt").result()]
    for i in range(1, links + 1):
        for key in ("emb", "mom"):
            changed = torch.randperm(rows)[:20]
            state[key][changed] += i
        if i in (2, 5):
            state["emb"][7] = float(100 * i)
        infos.append(engine.save(state, root / f"{i}.ckpt").result())
    return state, infos


def test_chain_links_apply_in_order_and_equal_a_full_save_bit_for_bit(tmp_path):
    with CheckpointEngine(_cfg()) as engine:
        state, infos = _chain(tmp_path / "run", engine, links=6)
        assert infos[-1].chain_depth == 6
        rec = {r.key: r for r in engine.read_manifest(tmp_path / "run" / "6.ckpt").tensors}["emb"]
        assert len(rec.deltas) == 6  # the chain is real: 6 links on one base
    ckpt_core.save(state, tmp_path / "full" / "f.ckpt", config=_cfg())
    chain = ckpt_core.load(tmp_path / "run" / "6.ckpt")
    full = ckpt_core.load(tmp_path / "full" / "f.ckpt")
    assert torch.equal(chain["emb"][7], torch.full((16,), 500.0))  # link 5's value, not link 2's
    for key in state:
        assert _same(chain[key], state[key]) and _same(chain[key], full[key]), key
    live = {"emb": torch.zeros(512, 16), "mom": torch.zeros(512, 2)}
    with CheckpointEngine(_cfg()) as engine:
        out = engine.load(tmp_path / "run" / "5.ckpt", into=live)
    assert out["emb"] is live["emb"] and torch.equal(live["emb"][7], torch.full((16,), 500.0))


def test_the_c_row_scatter_and_numpy_apply_a_chain_alike(tmp_path, monkeypatch):
    """Links applied by ``checkrun_scatter_rows`` (the C kernel) or by numpy give the same bytes."""
    from ckpt_core.loading import decode

    assert decode._SCATTER is not None  # built by setup.py here (CI has a compiler)
    with CheckpointEngine(_cfg()) as engine:
        state, _ = _chain(tmp_path, engine, links=6)
    native = ckpt_core.load(tmp_path / "6.ckpt")
    monkeypatch.setattr(decode, "_SCATTER", None)
    fallback = ckpt_core.load(tmp_path / "6.ckpt")
    assert all(_same(native[k], fallback[k]) and _same(native[k], state[k]) for k in state)


def test_a_chain_is_read_in_one_pass(tmp_path, monkeypatch):
    with CheckpointEngine(_cfg()) as engine:
        _chain(tmp_path, engine, links=4)
    calls = []
    real = Store.map

    def counting(self, fn, items, cost=None):
        calls.append(len(list(items)) if not isinstance(items, list) else len(items))
        return real(self, fn, items, cost)

    monkeypatch.setattr(Store, "map", counting)
    ckpt_core.load(tmp_path / "4.ckpt")
    rec = {r.key: r for r in CheckpointEngine(_cfg()).read_manifest(tmp_path / "4.ckpt").tensors}["emb"]
    assert len(calls) == 1  # bases, indices and values of every link: one map, no round trip per link
    assert calls[0] >= len(rec.base) + sum(1 + len(d.chunks) for d in rec.deltas)


def _put_blob(root: Path, data) -> dict:
    data = bytes(data)
    key = xxhash.xxh3_128_hexdigest(data)
    path = _blob_file(root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"key": key, "size": len(data), "csum": xxhash.xxh3_64_hexdigest(data)}


@pytest.mark.parametrize("reference", ["inline", "background"])
@pytest.mark.parametrize("unsorted, split", [(True, False), (False, True), (True, True)])
def test_links_of_a_foreign_layout_are_applied_whole_in_chain_order(tmp_path, unsorted, split, reference):
    """checkrun writes each link's row indices ascending and cuts base chunks at row boundaries. A
    file that does neither (hand-made, another writer) loads the same: the links apply in order,
    within a link the last of a repeated row wins, a later link wins over it, and the copy the
    engine keeps for the next save equals the loaded state (that save finds no change). (A load
    that applied the links chunk by chunk as the base's chunks arrive, relying on that layout, was
    tried and measured no faster: docs/performance.md.)"""
    with CheckpointEngine(_cfg()) as engine:
        state, _ = _chain(tmp_path, engine, links=2)
    body = json.loads((tmp_path / "2.ckpt").read_bytes())
    rec = next(t for t in body["tensors"] if t["key"] == "emb")
    pipe = Pipeline.from_list(rec["codecs"])
    if split:  # base chunks of 1000 elements: rows of 16 cut across chunks
        base = ckpt_core.load(tmp_path / "0.ckpt")["emb"].view(-1)
        rec["base"] = [{"off": o, "rows": 1, "cols": len(piece),
                        "blob": _put_blob(tmp_path, pipe.encode(piece.view(1, -1))[0])}
                       for o, piece in zip(range(0, base.numel(), 1000), base.split(1000))]
    # rows 62, 312 and 437 are cut by the 1000-element chunks (elements 992-1007, 4992-5007, 6992-7007)
    for idx, fill in (([312, 62, 312, 0] if unsorted else [0, 62, 312], [1.0, 2.0, 3.0, 4.0]), ([0, 437], [5.0, 6.0])):
        rows = torch.tensor(fill[:len(idx)]).repeat_interleave(16).view(-1, 16)
        rec["deltas"].append({
            "n": len(idx), "idx": _put_blob(tmp_path, index_pipeline().encode(torch.tensor([idx]))[0]),
            "chunks": [{"off": 0, "rows": len(idx), "cols": 16, "blob": _put_blob(tmp_path, pipe.encode(rows)[0])}]})
        state["emb"][idx] = rows
    (tmp_path / "forged.ckpt").write_bytes(forge(body))
    assert [state["emb"][r][0].item() for r in (312, 62, 0)] == [3.0, 2.0, 5.0]
    with CheckpointEngine(_cfg(load={"reference": reference})) as engine:
        assert engine.verify(tmp_path / "forged.ckpt").ok
        live = {k: torch.zeros_like(v) for k, v in state.items()}
        engine.load(tmp_path / "forged.ckpt", into=live)
        assert all(_same(live[k], state[k]) for k in state)
        engine.save(live, tmp_path / "again.ckpt").result()
    again = {r.key: r for r in CheckpointEngine(_cfg()).read_manifest(tmp_path / "again.ckpt").tensors}["emb"]
    assert len(again.deltas) == len(rec["deltas"])  # no change found: no new link


@pytest.mark.parametrize("reference", ["inline", "background"])
@pytest.mark.parametrize("chunk_bytes", [16 * 1024, 1000, 64])  # several rows per chunk, or one
def test_links_applied_chunk_by_chunk_equal_the_state_and_its_kept_copy(tmp_path, chunk_bytes, reference):
    """With several base chunks per table (or one row each), the loaded state and the engine's kept
    copy (the reference of the next save, made during the load or after it) equal what was saved:
    the next save finds exactly the rows changed since."""
    cfg = _cfg(compression={"chunk_bytes": chunk_bytes}, load={"reference": reference})
    with CheckpointEngine(cfg) as engine:
        state, _ = _chain(tmp_path, engine, links=5)
    with CheckpointEngine(cfg) as engine:
        live = {k: torch.zeros_like(v) for k, v in state.items()}
        engine.load(tmp_path / "5.ckpt", into=live)
        assert all(_same(live[k], state[k]) for k in state)
        live["emb"][[3, 200, 511]] += 1.0
        info = engine.save(live, tmp_path / "6.ckpt").result()
    rec = {r.key: r for r in CheckpointEngine(cfg).read_manifest(tmp_path / "6.ckpt").tensors}
    assert [d.n for d in rec["emb"].deltas][-1] == 3 and info.chain_depth == 6
    assert _same(ckpt_core.load(tmp_path / "6.ckpt")["emb"], live["emb"])


def test_the_copy_kept_after_an_into_load_is_not_the_live_tensor(tmp_path):
    with CheckpointEngine(_cfg()) as engine:
        state, _ = _chain(tmp_path, engine, links=3)
        full = engine.save(state, tmp_path / "full.ckpt").result()  # same state: nothing changed
    live = {"emb": torch.zeros(512, 16), "mom": torch.zeros(512, 2)}
    with CheckpointEngine(_cfg()) as engine:
        engine.load(tmp_path / "3.ckpt", into=live)
        live["emb"][100:103] -= 1  # training goes on in the live tensors
        inc = engine.save(live, tmp_path / "4.ckpt").result()
        assert inc.chain_depth == 4 and inc.written_bytes < 0.2 * full.tensor_bytes
        back = engine.load(tmp_path / "4.ckpt")
    assert _same(back["emb"], live["emb"]) and _same(back["mom"], state["mom"])


def test_a_blob_corrupted_mid_chain_is_named_and_into_may_be_partly_written(tmp_path):
    with CheckpointEngine(_cfg()) as engine:
        _chain(tmp_path, engine, links=5)
        rec = {r.key: r for r in engine.read_manifest(tmp_path / "5.ckpt").tensors}["emb"]
    bad = _blob_file(tmp_path, rec.deltas[2].chunks[0].blob.key)  # link 3's values
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    live = {"emb": torch.zeros(512, 16), "mom": torch.zeros(512, 2)}
    with CheckpointEngine(_cfg()) as engine:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
            engine.load(tmp_path / "5.ckpt", into=live)
    assert str(bad) in str(info.value)
    assert ckpt_core.load(tmp_path / "2.ckpt")["emb"].shape == (512, 16)  # links before it still load


def test_a_blob_missing_in_the_middle_of_a_load_is_named(tmp_path):
    torch.manual_seed(0)
    state = {"a": torch.randn(2048, 16), "b": torch.randn(2048, 16)}
    with CheckpointEngine(_cfg()) as engine:
        engine.save(state, tmp_path / "m.ckpt").result()
        recs = engine.read_manifest(tmp_path / "m.ckpt").tensors
    chunks = [c for r in recs for c in r.base]
    assert len(chunks) >= 8
    gone = _blob_file(tmp_path, chunks[len(chunks) // 2].blob.key)
    gone.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing blob") as info:
        ckpt_core.load(tmp_path / "m.ckpt", into={"a": torch.zeros(2048, 16), "b": torch.zeros(2048, 16)})
    assert gone.name in str(info.value)


def test_a_tensor_saved_whole_because_every_row_changed_gets_no_reference_copy_at_load(tmp_path) -> None:
    """A dense tensor (every row changes between saves) is marked in the manifest; loading it keeps no
    second host copy (the next save copies it whole anyway), while a sparse table keeps its reference
    and its next save stays a row delta. Both save and load back bit for bit."""
    from ckpt_core.saving.streams import DENSE_META

    g = torch.Generator().manual_seed(0)
    state = {"dense": torch.randn(2048, 16, generator=g), "table": torch.randn(4096, 16, generator=g)}
    d = tmp_path / "run"
    with CheckpointEngine() as engine:
        engine.save(state, d / "0.ckpt").result()
        for i in (1, 2):
            state["dense"].add_(1.0)  # every row
            state["table"][i] += 1.0  # one row
            engine.save(state, d / f"{i}.ckpt").result()
        manifest = engine.read_manifest(d / "2.ckpt")
    assert manifest.meta[DENSE_META] == ["dense"]
    with CheckpointEngine() as engine:
        loaded = engine.load(d / "2.ckpt")
        assert _same(loaded["dense"], state["dense"]) and _same(loaded["table"], state["table"])
        dirstate = engine._dirstate(engine._dir_store(d, None))
        engine._adopt_rebuilds(dirstate)  # the references a load rebuilds in the background (load.reference)
        streams = dirstate.streams
        assert set(streams) == {"table"}  # no reference copy of the dense tensor
        loaded["dense"].add_(1.0)
        loaded["table"][7] += 1.0
        info = engine.save(loaded, d / "3.ckpt").result()
        assert info.chain_depth >= 1  # the table is still a row delta
    with CheckpointEngine() as engine:
        again = engine.load(d / "3.ckpt")
    assert _same(again["dense"], loaded["dense"]) and _same(again["table"], loaded["table"])


@pytest.mark.parametrize("damage", ["none", "one byte longer", "cut short"])
def test_a_blob_larger_than_one_read_piece_loads_exactly_or_fails_on_its_size(tmp_path, damage):
    """Local blobs are read in ``READ_PIECE`` pieces (issue 24: a cold read of 1 MiB pieces keeps the
    kernel's read-ahead ahead of the copy). A blob of several pieces, plus a partial one, loads bit
    for bit; one byte more, or a cut anywhere past the first piece, is still caught by its size."""
    from ckpt_core.storage.store import READ_PIECE

    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(3 * READ_PIECE // 4 + 1000, generator=g)}  # ~3 MiB of barely compressible floats
    cfg = {"compression": {"chunk_bytes": 64 << 20}}
    ckpt_core.save(state, tmp_path / "big.ckpt", config=cfg)
    with CheckpointEngine(cfg) as engine:
        blob = _blob_file(tmp_path, engine.read_manifest(tmp_path / "big.ckpt").tensors[0].base[0].blob.key)
    size = blob.stat().st_size
    assert size > 2 * READ_PIECE and size % READ_PIECE
    if damage == "one byte longer":
        blob.write_bytes(blob.read_bytes() + b"\0")
    elif damage == "cut short":
        blob.write_bytes(blob.read_bytes()[:READ_PIECE + 3])
    live = {"w": torch.zeros_like(state["w"])}
    if damage == "none":
        ckpt_core.load(tmp_path / "big.ckpt", into=live, config=cfg)
        assert _same(live["w"], state["w"])
        return
    with pytest.raises(CorruptCheckpointError) as info:
        ckpt_core.load(tmp_path / "big.ckpt", into=live, config=cfg)
    assert str(blob) in str(info.value)
    if damage == "cut short":
        assert f"size {READ_PIECE + 3} != {size} declared in the manifest (truncated or replaced blob)" in str(info.value)
    else:  # read one byte past its declared size: not reported as a size it does not have (h94)
        assert f"larger than the {size} bytes declared in the manifest" in str(info.value)
        assert f"size {size + 1}" not in str(info.value)
