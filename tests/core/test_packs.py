"""Small tensors stored together: packs (format 2, ``compression.pack_bytes``; docs/format.md#packs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt_core
from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import CorruptCheckpointError
from ckpt_core.format.manifest import DTYPES, parse_manifest
from ckpt_core.loading.reader import decode_chunk
from ckpt_core.storage.store import Store

LIMIT = 1 << 30


def small_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(256, 512, generator=g),                      # 512 KiB: a blob of its own
        "ln.w": torch.randn(64, generator=g), "ln.b": torch.randn(64, generator=g),
        "step": torch.tensor(7.0), "ids": torch.arange(5, dtype=torch.int32),  # 4-byte: same pack
        "h": torch.randn(3, 5, generator=g).to(torch.bfloat16), "h2": torch.randn(7, generator=g).half(),
        "mask": torch.tensor([True, False, True]), "u8": torch.arange(9, dtype=torch.uint8),
        "c": torch.randn(2, 2, dtype=torch.complex64, generator=g), "c2": torch.randn(3, dtype=torch.complex64, generator=g),
        "i64": torch.arange(3, dtype=torch.int64),                       # 8-byte, like complex64: same pack
        "lone": torch.randn(2, dtype=torch.complex128, generator=g),      # only 16-byte tensor: not packed
        "empty": torch.empty(0, 4),
        "view": torch.arange(40.0).view(5, 8)[:, ::2],                    # non-contiguous source
    }


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def manifest_of(path: Path):
    return parse_manifest(path.read_bytes(), str(path), max_blob_bytes=LIMIT)


def blob_files(root: Path) -> list[Path]:
    return [p for p in (root / ".checkrun" / "blobs").rglob("*") if p.is_file()]


def config(**dotted) -> EngineConfig:
    return EngineConfig().replace(**{"incremental.enabled": False, **dotted})


def test_small_tensors_share_blobs_and_round_trip_bit_exact(tmp_path):
    state = small_state()
    with CheckpointEngine(config()) as engine:
        engine.save(state, tmp_path / "a.ckpt").result()
        back = engine.load(tmp_path / "a.ckpt")
        assert engine.verify(tmp_path / "a.ckpt").ok
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(as_bytes(back[k]), as_bytes(v)), k
    m = manifest_of(tmp_path / "a.ckpt")
    assert m.format_version == 2
    parts = {r.key: r.base[0].part for r in m.tensors}
    assert parts["big"] is None and parts["lone"] is None and parts["empty"] is None
    packed = [k for k, p in parts.items() if p is not None]
    assert sorted(packed) == sorted(["ln.w", "ln.b", "step", "ids", "h", "h2", "mask", "u8", "c", "c2", "i64", "view"])
    # one pack per element size: 4-byte (5 tensors), 2-byte, 1-byte, 8-byte (complex64 and int64)
    packs = {r.base[0].blob.key for r in m.tensors if r.base[0].part is not None}
    assert len(packs) == 4
    assert len(blob_files(tmp_path)) == len(packs) + 3  # + big, lone, empty
    # the parts of a pack tile it and each tensor is charged its share of what was written
    by_pack: dict = {}
    for r in m.tensors:
        c = r.base[0]
        if c.part is not None:
            by_pack.setdefault(c.blob.key, []).append((c.part[0], c.part[0] + r.nbytes, c.part[1], r.written, c.blob.size))
    for members in by_pack.values():
        members.sort()
        assert members[0][0] == 0 and all(a[1] == b[0] for a, b in zip(members, members[1:]))
        assert members[-1][1] == members[0][2]
        assert sum(w for *_, w, _ in members) == members[0][4]
    assert sum(r.written for r in m.tensors) == m.stats["written_bytes"] > 0


def test_unchanged_pack_is_not_written_again_and_a_change_rewrites_it(tmp_path):
    state = small_state()
    with CheckpointEngine(config()) as engine:
        engine.save(state, tmp_path / "a.ckpt").result()
        engine.save(state, tmp_path / "b.ckpt").result()
        state["ln.b"][3] += 1
        engine.save(state, tmp_path / "c.ckpt").result()
        assert torch.equal(engine.load(tmp_path / "c.ckpt")["ln.b"], state["ln.b"])
        assert torch.equal(engine.load(tmp_path / "a.ckpt")["ln.b"][3], small_state()["ln.b"][3])
    assert manifest_of(tmp_path / "b.ckpt").stats["written_bytes"] == 0
    a, c = manifest_of(tmp_path / "a.ckpt"), manifest_of(tmp_path / "c.ckpt")
    keys = lambda m: {r.key: r.base[0].blob.key for r in m.tensors}  # noqa: E731
    moved = {k for k in keys(a) if keys(a)[k] != keys(c)[k]}
    assert moved == {"ln.w", "ln.b", "step", "ids", "view"}  # the 4-byte pack, and nothing else
    assert 0 < c.stats["written_bytes"] < 4096


def test_pack_bytes_zero_and_limits(tmp_path):
    state = small_state()
    with CheckpointEngine(config(**{"compression.pack_bytes": 0})) as engine:
        engine.save(state, tmp_path / "off.ckpt").result()
    assert all(r.base[0].part is None for r in manifest_of(tmp_path / "off.ckpt").tensors)
    # packs are cut at chunk_bytes; tensors above pack_bytes stay alone
    many = {f"t{i}": torch.full((100,), float(i)) for i in range(30)}  # 400 B each
    many["mid"] = torch.zeros(300)  # 1200 B > pack_bytes
    with CheckpointEngine(config(**{"compression.pack_bytes": 1024, "compression.chunk_bytes": 4096})) as engine:
        engine.save(many, tmp_path / "cut.ckpt").result()
        back = engine.load(tmp_path / "cut.ckpt")
    assert all(torch.equal(back[k], v) for k, v in many.items())
    m = manifest_of(tmp_path / "cut.ckpt")
    sizes = {r.base[0].part[1] for r in m.tensors if r.base[0].part is not None}
    assert max(sizes) <= 4096 and len({r.base[0].blob.key for r in m.tensors if r.key != "mid"}) == 3
    assert next(r for r in m.tensors if r.key == "mid").base[0].part is None


def test_quantized_and_row_incremental_tensors_are_not_packed(tmp_path):
    cfg = EngineConfig.from_dict({
        "incremental": {"enabled": True, "row_delta_min_rows": 4},
        "quantization": [{"pattern": "q.*", "method": "uniform", "bits": 8, "min_numel": 1}],
    })
    state = {"q.a": torch.randn(64), "q.b": torch.randn(64), "emb": torch.randn(16, 4), "x": torch.randn(8),
             "y": torch.randn(8)}
    with CheckpointEngine(cfg) as engine:
        engine.save(state, tmp_path / "a.ckpt").result()
        state["emb"][2] += 1
        engine.save(state, tmp_path / "b.ckpt").result()
        back = engine.load(tmp_path / "b.ckpt")
    assert torch.equal(back["emb"], state["emb"]) and torch.equal(back["x"], state["x"])
    m = manifest_of(tmp_path / "b.ckpt")
    packed = {r.key for r in m.tensors if any(c.part is not None for c in r.base)}
    assert packed == {"x", "y"}
    assert next(r for r in m.tensors if r.key == "emb").deltas  # the row stream still works


def test_a_missing_pack_blob_is_named_and_the_next_save_repairs_it(tmp_path):
    state = small_state()
    with CheckpointEngine(config()) as engine:
        engine.save(state, tmp_path / "a.ckpt").result()
        m = manifest_of(tmp_path / "a.ckpt")
        key = next(r.base[0].blob.key for r in m.tensors if r.key == "ln.w")
        (tmp_path / ".checkrun" / "blobs" / key[:2] / key[2:]).unlink()
        with pytest.raises(CorruptCheckpointError, match=key[2:]):
            engine.load(tmp_path / "a.ckpt")
        engine.save(state, tmp_path / "b.ckpt").result()  # the pack's blob is known gone: rewritten
        back = engine.load(tmp_path / "b.ckpt")
    assert torch.equal(back["ln.w"], state["ln.w"]) and torch.equal(back["ids"], state["ids"])


def test_decode_chunk_reads_one_part(tmp_path):
    state = small_state()
    ckpt_core.save(state, tmp_path / "a.ckpt", config=config())
    m = manifest_of(tmp_path / "a.ckpt")
    store = Store.for_directory(str(tmp_path), None, EngineConfig().storage)
    from ckpt_core.codecs import Pipeline

    for r in m.tensors:
        if r.base[0].part is not None:
            got = decode_chunk(store, Pipeline.from_list(list(r.codecs)), r.base[0], DTYPES[r.dtype])
            assert torch.equal(as_bytes(got), as_bytes(state[r.key])), r.key


def test_inspect_splits_a_pack_among_its_tensors(tmp_path, capsys):
    from ckpt_core.cli import main

    ckpt_core.save(small_state(), tmp_path / "a.ckpt", config=config())
    assert main(["inspect", "--json", str(tmp_path / "a.ckpt")]) == 0
    out = json.loads(capsys.readouterr().out)
    m = manifest_of(tmp_path / "a.ckpt")
    packs = {r.base[0].blob.key: r.base[0].blob.size for r in m.tensors if r.base[0].part is not None}
    shares = [t["stored_bytes"] for t in _tensors(out) if t["key"] in {r.key for r in m.tensors if r.base[0].part}]
    assert abs(sum(shares) - sum(packs.values())) <= len(shares)


def _tensors(node) -> list:
    if isinstance(node, dict):
        found = [node] if "stored_bytes" in node and "dtype" in node else []
        return found + [t for v in node.values() for t in _tensors(v)]
    if isinstance(node, list):
        return [t for v in node for t in _tensors(v)]
    return []


def test_diff_does_not_call_tensors_equal_for_sharing_a_pack_at_different_parts(tmp_path, capsys):
    from ckpt_core.cli import main

    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    ckpt_core.save({"a": a, "b": b}, tmp_path / "one.ckpt", config=config())
    ckpt_core.save({"b": a.clone(), "a": b.clone()}, tmp_path / "two.ckpt", config=config())  # same pack bytes
    one, two = manifest_of(tmp_path / "one.ckpt"), manifest_of(tmp_path / "two.ckpt")
    assert {r.base[0].blob.key for r in one.tensors} == {r.base[0].blob.key for r in two.tensors}
    assert main(["diff", "--json", str(tmp_path / "one.ckpt"), str(tmp_path / "two.ckpt")]) == 0
    status = {d["key"]: d["status"] for d in json.loads(capsys.readouterr().out)["tensors"]}
    assert status == {"a": "changed", "b": "changed"}
