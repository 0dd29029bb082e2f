"""Engine behaviour on every backend (memory://, local, S3 via moto): round trip, format, bad input."""
from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict

import pytest
import torch

import ckpt_core
from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import (CheckpointNotFoundError, CheckrunError, CorruptCheckpointError, FormatError,
                              NotACheckpointError, UnsafeLoadError)


def _state():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    shared = torch.randn(3, 3)
    return {
        "model": lin.state_dict(),
        "tensors": {
            "f16": torch.randn(5, 7).half(), "bf16": torch.randn(33).bfloat16(), "i64": torch.arange(10),
            "bool": torch.tensor([True, False, True]), "c64": torch.randn(4, dtype=torch.complex64),
            "zero_d": torch.tensor(3.5), "empty": torch.empty(0, 3), "view": torch.randn(6, 4).t(),
            "f64": torch.randn(2, 2, 2, dtype=torch.float64),
        },
        "tied_a": shared, "tied_b": shared,
        "plain": {1: "int key", (2, 3): [None, True, 1.5, float("inf"), float("nan")], "b": b"\x00\xff",
                  "dtype": torch.float16, "size": torch.Size([2, 3]), "dev": torch.device("cpu")},
        "tup": (1, [2, 3]),
        "od": OrderedDict(b=1, a=2),
        "step": 7,
    }


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() and a.dtype != torch.bool else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() and b.dtype != torch.bool else b)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_round_trip_every_backend(any_root):
    root, opts = any_root
    state = _state()
    with CheckpointEngine() as engine:
        info = engine.save(state, f"{root}/a.ckpt", storage_options=opts).result()
        assert info.tensor_bytes > 0 and info.written_bytes > 0 and info.blocking_seconds >= 0
        loaded = engine.load(f"{root}/a.ckpt", storage_options=opts)
        _assert_same(state, loaded)
        assert loaded["tied_a"] is loaded["tied_b"]
        assert engine.latest(root, storage_options=opts).endswith("a.ckpt")
        assert engine.verify(f"{root}/a.ckpt", storage_options=opts).ok


def test_one_call_conveniences(tmp_path):
    info = ckpt_core.save({"w": torch.ones(3)}, tmp_path / "x.ckpt")
    assert info.path.endswith("x.ckpt")
    assert torch.equal(ckpt_core.load(tmp_path / "x.ckpt")["w"], torch.ones(3))


def test_identical_blobs_not_written_twice(tmp_path):
    state = {"w": torch.randn(1000, 100)}
    with CheckpointEngine() as engine:
        first = engine.save(state, tmp_path / "a.ckpt").result()
        second = engine.save(state, tmp_path / "b.ckpt").result()
    assert second.written_bytes < first.written_bytes / 20
    with CheckpointEngine() as engine:  # a new process-like engine also finds them in the store
        third = engine.save(state, tmp_path / "c.ckpt").result()
    assert third.written_bytes < first.written_bytes / 20


def test_weights_only_refuses_pickled_objects(tmp_path):
    import pathlib

    with CheckpointEngine() as engine:
        engine.save({"cfg": {"path": pathlib.PurePosixPath("/x")}}, tmp_path / "o.ckpt").result()
        with pytest.raises(UnsafeLoadError, match=r"cfg\.path.*PurePosixPath"):
            engine.load(tmp_path / "o.ckpt")
        assert engine.load(tmp_path / "o.ckpt", weights_only=False)["cfg"]["path"] == pathlib.PurePosixPath("/x")


def test_keep_last_and_gc(tmp_path):
    cfg = EngineConfig.from_dict({"retention": {"keep_last": 2, "gc_grace_seconds": 0}})
    with CheckpointEngine(cfg) as engine:
        for i in range(4):
            engine.save({"w": torch.full((100, 100), float(i))}, tmp_path / f"s{i}.ckpt")
        engine.wait()
        names = [e.name for e in engine.list(tmp_path)]
        assert names == ["s2.ckpt", "s3.ckpt"]
        blobs = list((tmp_path / ".checkrun" / "blobs").rglob("*"))
        assert len([b for b in blobs if b.is_file()]) == 2
        for n in names:
            assert engine.verify(tmp_path / n).ok


def blob_files(root) -> set:
    return {b.name for b in (root / ".checkrun" / "blobs").rglob("*") if b.is_file()}


@pytest.mark.parametrize("background", ["thread", "process"])
def test_the_blobs_of_a_checkpoint_saved_over_are_collected(tmp_path, background):
    """Lightning saves last.ckpt again at every checkpoint: the blobs only the replaced manifest used were
    never collected (no removal notes them), so a run's directory grew by a state per save until a full gc
    (found by an independent check: 124 MiB of garbage after 60 steps of a 3 MB state)."""
    with CheckpointEngine({"saving": {"background": background}}) as engine:
        kept = []
        for i in range(5):
            engine.save({"w": torch.full((256, 64), float(i)), "step": i}, tmp_path / "last.ckpt").result()
            engine.wait()
            kept.append({k[2:] for k in engine.read_manifest(tmp_path / "last.ckpt").blob_keys()})
            # those of the checkpoint saved over go at the next commit (a load of it has that long)
            assert blob_files(tmp_path) == kept[-1] | (kept[-2] if i else set())
        engine.gc(tmp_path, full=False)  # or at a collection
        assert blob_files(tmp_path) == kept[-1] and engine.load(tmp_path / "last.ckpt")["step"] == 4


def test_a_load_of_a_checkpoint_saved_over_meanwhile_still_reads_it(tmp_path, monkeypatch):
    """A load that read last.ckpt's manifest while the trainer saved last.ckpt again failed with "missing
    blob" once the blobs of a checkpoint saved over were collected after that commit (found by an independent
    check; stock's reader gets the old file or the new one, never an error). They go a commit later."""
    import ckpt_core.loading.reader as reader

    read, entered, go, out = reader.load_tensors, threading.Event(), threading.Event(), {}

    def held(*args, **kwargs):  # the manifest is read, the blobs not yet
        entered.set()
        assert go.wait(120)  # watchdog only
        return read(*args, **kwargs)

    with CheckpointEngine() as engine:
        engine.save({"w": torch.full((256, 64), 1.0), "step": 1}, tmp_path / "last.ckpt").result()
        monkeypatch.setattr(reader, "load_tensors", held)
        loader = threading.Thread(target=lambda: out.update(state=ckpt_core.load(tmp_path / "last.ckpt")))
        loader.start()
        assert entered.wait(120)
        monkeypatch.setattr(reader, "load_tensors", read)
        engine.save({"w": torch.full((256, 64), 2.0), "step": 2}, tmp_path / "last.ckpt").result()
        engine.wait()
        go.set()
        loader.join(120)
    assert out["state"]["step"] == 1 and torch.equal(out["state"]["w"], torch.full((256, 64), 1.0))


def test_blobs_of_removed_checkpoints_are_collected_by_a_later_save(tmp_path):
    # Lightning's ModelCheckpoint removes old checkpoints with remove(): a long run must not keep
    # every blob it ever wrote until teardown.
    cfg = EngineConfig.from_dict({"retention": {"gc_grace_seconds": 0}, "incremental": {"enabled": False}})
    with CheckpointEngine(cfg) as engine:
        engine.save({"w": torch.full((100, 100), 1.0)}, tmp_path / "s1.ckpt").result()
        first = blob_files(tmp_path)
        engine.save({"w": torch.full((100, 100), 2.0)}, tmp_path / "s2.ckpt").result()
        engine.remove(tmp_path / "s1.ckpt")
        assert first <= blob_files(tmp_path)  # remove() itself deletes no blob
        engine.save({"w": torch.full((100, 100), 3.0)}, tmp_path / "s3.ckpt").result()
        assert not first & blob_files(tmp_path)
        assert engine.verify(tmp_path / "s2.ckpt").ok and engine.verify(tmp_path / "s3.ckpt").ok
    cfg = EngineConfig.from_dict({"retention": {"gc_after_save": False, "gc_grace_seconds": 0}})
    with CheckpointEngine(cfg) as engine:
        engine.save({"w": torch.full((100, 100), 4.0)}, tmp_path / "s4.ckpt").result()
        before = blob_files(tmp_path)
        engine.remove(tmp_path / "s2.ckpt")
        engine.save({"w": torch.full((100, 100), 5.0)}, tmp_path / "s5.ckpt").result()
        assert before <= blob_files(tmp_path)  # gc_after_save off: nothing collected


def test_a_removed_checkpoints_blobs_go_at_the_next_commit_without_listing_blobs(tmp_path, monkeypatch):
    from ckpt_core.storage.store import Store

    listings = []
    real = Store.list_blobs
    monkeypatch.setattr(Store, "list_blobs", lambda self: listings.append(1) or real(self))
    with CheckpointEngine() as engine:
        for i in range(3):
            engine.save({"w": torch.full((10,), float(i))}, tmp_path / f"s{i}.ckpt").result()
        assert listings == []  # nothing removed, no dead writer: no collection
        gone = {k[2:] for k in engine.read_manifest(tmp_path / "s0.ckpt").blob_keys()}  # file names
        engine.remove(tmp_path / "s0.ckpt")
        assert gone <= blob_files(tmp_path)  # the manifest only, until the next commit
        engine.save({"w": torch.full((10,), 3.0)}, tmp_path / "s3.ckpt").result()
        assert not gone & blob_files(tmp_path)  # collected in that save's background step
        assert listings == []  # from the removed manifest's references, not from a listing


def test_retention_protect_patterns_are_neither_counted_nor_removed(tmp_path):
    cfg = EngineConfig.from_dict({"retention": {"keep_last": 2, "protect": ["last*.ckpt"]}})
    with CheckpointEngine(cfg) as engine:
        engine.save({"w": torch.zeros(3)}, tmp_path / "last.ckpt").result()
        for i in range(4):
            engine.save({"w": torch.full((3,), float(i))}, tmp_path / f"s{i}.ckpt").result()
        assert [e.name for e in engine.list(tmp_path)] == ["last.ckpt", "s2.ckpt", "s3.ckpt"]


def test_bad_inputs_name_the_file(tmp_path):
    with CheckpointEngine() as engine:
        engine.save({"w": torch.randn(64, 64)}, tmp_path / "good.ckpt").result()
        torch.save({"w": 1}, tmp_path / "torch.pt")
        with pytest.raises(NotACheckpointError, match="torch.pt"):
            engine.load(tmp_path / "torch.pt")
        with pytest.raises(CheckpointNotFoundError, match="missing.ckpt"):
            engine.load(tmp_path / "missing.ckpt")
        raw = (tmp_path / "good.ckpt").read_bytes()
        (tmp_path / "trunc.ckpt").write_bytes(raw[: len(raw) // 2])
        with pytest.raises(FormatError, match="trunc.ckpt"):
            engine.load(tmp_path / "trunc.ckpt")
        (tmp_path / "tamper.ckpt").write_bytes(raw.replace(b'"float32"', b'"float64"'))
        with pytest.raises(FormatError, match="tamper.ckpt.*checksum"):
            engine.load(tmp_path / "tamper.ckpt")
        blob = next(p for p in (tmp_path / ".checkrun" / "blobs").rglob("*") if p.is_file())
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpointError, match=blob.name):
            engine.load(tmp_path / "good.ckpt")
        report = engine.verify(tmp_path / "good.ckpt")
        assert not report.ok and blob.name in report.problems[0]
        blob.unlink()
        with pytest.raises(CorruptCheckpointError, match=blob.name):
            engine.load(tmp_path / "good.ckpt")
        assert engine.latest(tmp_path) is None


def test_hostile_blob_key_rejected(tmp_path):
    import json

    from ckpt_core.format.manifest import _body_checksum

    with CheckpointEngine() as engine:
        engine.save({"w": torch.randn(4, 4)}, tmp_path / "good.ckpt").result()
        body = json.loads((tmp_path / "good.ckpt").read_bytes())
        for bad in ("../../etc/passwd", "/etc/passwd", "s3://other/bucket/key"):
            body["tensors"][0]["base"][0]["blob"]["key"] = bad
            body["checksum"] = _body_checksum(body)
            (tmp_path / "evil.ckpt").write_text(json.dumps(body))
            with pytest.raises(CorruptCheckpointError, match="evil.ckpt|" + bad[:5]):
                engine.load(tmp_path / "evil.ckpt")


def test_latest_skips_checkpoint_with_flipped_byte(tmp_path, caplog):
    with CheckpointEngine({"incremental": {"enabled": False}}) as engine:
        engine.save({"w": torch.zeros(100, 10)}, tmp_path / "old.ckpt").result()
        engine.save({"w": torch.ones(100, 10)}, tmp_path / "new.ckpt").result()
        new_keys = engine.read_manifest(tmp_path / "new.ckpt").blob_keys()
        old_keys = engine.read_manifest(tmp_path / "old.ckpt").blob_keys()
        key = sorted(new_keys - old_keys)[0]
        blob = tmp_path / ".checkrun" / "blobs" / key[:2] / key[2:]
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0x01
        blob.write_bytes(bytes(data))
        assert engine.latest(tmp_path).endswith("old.ckpt")
        assert "new.ckpt" in caplog.text
        assert engine.latest(tmp_path, verify=False).endswith("new.ckpt")  # quick check: sizes only


def _count_parses(monkeypatch, *modules) -> list[str]:
    """The names of the manifests ``parse_manifest`` parses from now on in ``modules``, in order."""
    from ckpt_core.format import manifest as fmt

    parsed: list[str] = []
    real = fmt.parse_manifest

    def counting(data, where, *a, **k):
        parsed.append(str(where).rsplit("/", 1)[-1])
        return real(data, where, *a, **k)

    for module in modules:
        monkeypatch.setattr(module, "parse_manifest", counting)
    return parsed


def test_retention_parses_only_the_manifests_that_count(tmp_path, monkeypatch):
    """Retention after each save parsed every manifest of the directory (2,000 checkpoints under a
    ``protect`` pattern or a large ``keep_last``: 12 s per save). It orders them by their heads and
    parses, newest first, the ``keep_last`` it keeps and the ones it removes; protected ones never.
    A manifest that does not parse is not counted, as before: the newest intact ones are kept."""
    from ckpt_core.retain import keycache, retention
    from ckpt_core.storage.store import Store

    cfg = {"incremental": {"enabled": False}, "retention": {"protect": ["p*.ckpt"]}}
    with CheckpointEngine(cfg) as engine:
        for step in range(10):
            engine.save({"w": torch.full((10,), float(step))}, tmp_path / f"p{step:02d}.ckpt").result()
        for step in range(10, 14):
            engine.save({"w": torch.full((10,), float(step))}, tmp_path / f"s{step:02d}.ckpt").result()
    (tmp_path / "s13.ckpt").write_bytes(b'{"_checkrun":"manifest",' + b"x" * 600)  # damaged: not counted
    keycache.clear()  # (what the saves' retention parsed is held by its bytes)
    parsed = _count_parses(monkeypatch, retention, keycache)
    config = EngineConfig.from_dict({**cfg, "retention": {"keep_last": 2, "protect": ["p*.ckpt"]}})
    store = Store.for_directory(str(tmp_path), None, config.storage)
    removed = retention.apply_retention(store, config, keep=set())
    assert [e.name for e in removed] == ["s10.ckpt"] and removed[0].manifest is not None
    assert sorted(parsed) == ["s10.ckpt", "s11.ckpt", "s12.ckpt", "s13.ckpt"]  # s13: fails, not counted
    assert sorted(p.name for p in tmp_path.glob("s*.ckpt")) == ["s11.ckpt", "s12.ckpt", "s13.ckpt"]
    parsed.clear()
    big = EngineConfig.from_dict({**cfg, "retention": {"keep_last": 20, "protect": ["p*.ckpt"]}})
    assert retention.apply_retention(store, big, keep=set()) == [] and parsed == ["s13.ckpt"]


def test_retention_after_each_save_parses_each_manifest_once(tmp_path, monkeypatch):
    """keep_last: 3 parsed the three kept manifests and the one removed after every save, the same bytes
    each time: most of the background CPU of a small state saved every step (h157). Held by their bytes
    now: one parse per new manifest (retention and the collection after it share it)."""
    from ckpt_core.retain import keycache, retention

    parsed = _count_parses(monkeypatch, retention, keycache)
    with CheckpointEngine({"retention": {"keep_last": 3}}) as engine:
        for step in range(8):
            engine.save({"w": torch.full((10,), float(step))}, tmp_path / f"s{step}.ckpt").result()
    assert sorted(parsed) == sorted(f"s{step}.ckpt" for step in range(8)), parsed
    assert sorted(p.name for p in tmp_path.glob("s*.ckpt")) == ["s5.ckpt", "s6.ckpt", "s7.ckpt"]


def test_listing_by_heads_orders_without_a_manifest_that_does_not_parse(tmp_path):
    """Ordered by heads, a manifest whose checksum matches but which does not parse (a future format, a
    forgery) claiming a later time lifted its writer's next checkpoint (a2) above another writer's newer
    one (b1): retention removed b1 and kept a2, latest() answered a2 (found by an independent old-vs-new
    check, h52). A head that lifts a later checkpoint of its writer is parsed first; one that does not
    parse is listed as corrupt, and the order is made without it, as when every manifest was parsed."""
    import subprocess
    import sys

    import xxhash

    with CheckpointEngine() as engine:  # writer A (this process): a1, a2
        for name in ("a1", "a2"):
            engine.save({"w": torch.randn(4)}, tmp_path / f"{name}.ckpt").result()
    subprocess.run([sys.executable, "-c", "import sys, torch; from ckpt_core import CheckpointEngine\n"
                    "with CheckpointEngine() as e: e.save({'w': torch.randn(4)}, sys.argv[1]).result()",
                    str(tmp_path / "b1.ckpt")], check=True)  # writer B, after A
    body = json.loads((tmp_path / "a1.ckpt").read_bytes())
    body.pop("checksum")
    body["format_version"], body["created"] = 999, json.loads((tmp_path / "b1.ckpt").read_bytes())["created"] + 60
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    head = b'{"_checkrun":"manifest",'
    (tmp_path / "a1.ckpt").write_bytes(head + b'"checksum":"' + xxhash.xxh3_128_hexdigest(text).encode() + b'",'
                                       + text[len(head):])
    with CheckpointEngine({"retention": {"keep_last": 2}}) as engine:
        assert engine.latest(tmp_path).endswith("b1.ckpt")  # not a2, lifted by a1's head
        engine.save({"w": torch.zeros(4)}, tmp_path / "c.ckpt").result()
        engine.wait()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["a1.ckpt", "b1.ckpt", "c.ckpt"]


def test_collections_of_one_process_parse_each_manifest_once(tmp_path, monkeypatch):
    """Every collection (after each save that retention or a removal made garbage) parsed every manifest
    of the directory again: thousands of protected checkpoints cost seconds of background CPU per save.
    What a parse gave is kept by the bytes' digest: a later collection parses only new or changed
    manifests, and finds the same referenced blobs; a changed manifest is parsed again."""
    from ckpt_core.retain import keycache, retention

    with CheckpointEngine() as engine:
        for step in range(6):
            engine.save({"w": torch.full((10,), float(step)), "b": torch.zeros(5)}, tmp_path / f"s{step}.ckpt").result()
    parsed = _count_parses(monkeypatch, retention, keycache)
    with CheckpointEngine() as engine:
        first = engine.gc(tmp_path, dry_run=True)
        assert sorted(parsed) == [f"s{i}.ckpt" for i in range(6)]
        parsed.clear()
        again = engine.gc(tmp_path, dry_run=True)
        assert parsed == [] and (again.referenced, again.deleted) == (first.referenced, first.deleted)
        parsed.clear()
        engine.save({"w": torch.full((10,), 9.0), "b": torch.ones(5)}, tmp_path / "s5.ckpt").result()
        engine.wait()  # its collection (the overwritten manifest's blobs) parses the new s5.ckpt only
        report = engine.gc(tmp_path, dry_run=True)
    assert parsed == ["s5.ckpt"], parsed
    assert report.referenced == first.referenced


def test_latest_parses_only_the_checkpoints_it_tries(tmp_path, monkeypatch):
    """``latest()`` parsed every manifest of the directory and held them all to find the newest (2,000
    manifests: 1 GB, 12.5 s at each resume). It orders them by the time and stamp in their first
    bytes and parses newest first: one manifest when the newest is intact, the next when it is not
    (a damaged body behind an intact head), and a manifest whose head does not read so is parsed
    where it is listed, as before."""
    from ckpt_core.loading import decode
    from ckpt_core.retain import retention

    with CheckpointEngine({"incremental": {"enabled": False}}) as engine:
        for step in range(12):
            engine.save({"w": torch.full((10,), float(step))}, tmp_path / f"s{step:02d}.ckpt").result()
    parsed = _count_parses(monkeypatch, decode, retention)
    with CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("s11.ckpt") and parsed == ["s11.ckpt"]
        newest = tmp_path / "s11.ckpt"
        newest.write_bytes(newest.read_bytes()[:-40] + b" " * 40)  # the body damaged, the head intact
        parsed.clear()
        assert engine.latest(tmp_path, verify=False).endswith("s10.ckpt") and parsed == ["s11.ckpt", "s10.ckpt"]
        (tmp_path / "s05.ckpt").write_bytes(b'{"_checkrun":"manifest",' + b"x" * 600)  # no head to read
        parsed.clear()
        assert engine.latest(tmp_path).endswith("s10.ckpt") and sorted(parsed) == ["s05.ckpt", "s10.ckpt",
                                                                                   "s11.ckpt"]


def test_latest_is_not_reordered_by_a_damaged_manifest(tmp_path):
    """Ordered by their first bytes alone, a damaged manifest's stamp counted in its writer's order:
    a1 damaged to claim a later time lifted a2 (same writer) above b1, committed after it by another
    writer, and ``latest()`` answered a2 (an independent check of the first version). Only intact
    manifests (checksum) are ordered by their heads."""
    from ckpt_core.format.manifest import _body_checksum

    t = time.time() - 600
    with CheckpointEngine({"incremental": {"enabled": False}}) as engine:
        for name in ("a1", "a2", "b1"):
            engine.save({"w": torch.zeros(4)}, tmp_path / f"{name}.ckpt").result()
    for name, created in (("a1", t), ("a2", t + 1), ("b1", t + 10)):
        body = json.loads((tmp_path / f"{name}.ckpt").read_bytes())
        body["created"] = created
        if name == "b1":
            body["commit"] = {"ns": int(created * 1e9), "seq": 1, "writer": "b" * 16}
        body["checksum"] = _body_checksum(body)
        (tmp_path / f"{name}.ckpt").write_text(json.dumps(body, sort_keys=True, separators=(",", ":")))
    a1 = tmp_path / "a1.ckpt"
    a1.write_bytes(a1.read_bytes().replace(f'"created":{t!r}'.encode(), f'"created":{t + 90!r}'.encode()))
    with CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("b1.ckpt")
        assert engine.latest(tmp_path, verify=False).endswith("b1.ckpt")


def test_a_symlink_to_a_checkpoint_elsewhere_reads_its_target(tmp_path):
    """``ln -s runs/exp1/epoch=3.ckpt models/best.ckpt``: torch.load follows the link, and so do checkrun's
    reads (load, verify, read_manifest, the CLI through them): the blobs are beside the target. Before,
    the link's own directory was searched and the load failed with "missing blob ... copy the whole
    directory". A save to the link replaces the link (it does not write through into the target
    checkpoint), and deleting it removes the link only."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "models").mkdir()
    target, link = tmp_path / "runs" / "epoch=3.ckpt", tmp_path / "models" / "best.ckpt"
    state = {"w": torch.arange(4.0)}
    with CheckpointEngine() as engine:
        engine.save(state, target).result()
        link.symlink_to(target)
        assert torch.equal(engine.load(link)["w"], state["w"])
        assert engine.verify(link).ok and engine.read_manifest(link).blobs()
        engine.save({"w": torch.zeros(4)}, link).result()
        assert not link.is_symlink() and torch.equal(engine.load(target)["w"], state["w"])
        link.unlink()
        link.symlink_to(target)
        engine.remove(link)
        assert not link.exists() and not link.is_symlink() and torch.equal(engine.load(target)["w"], state["w"])


@pytest.mark.parametrize("stem", ["\U0001F600" * 60, "\u68c0\u67e5\u70b9" * 26 + "\u68c0\u67e5", "a" * 250])
def test_a_long_file_name_in_any_script_saves_as_torch_save_does(tmp_path, stem):
    """245-255 byte names (the most a file name may have) of 4-byte, 3-byte and 1-byte characters. Before,
    the temp file's name kept the name's first 64 *characters*: 256 bytes of emoji, and the save failed
    with "File name too long" although torch.save writes the same name."""
    path = tmp_path / f"{stem}.ckpt"
    torch.save({"w": torch.ones(2)}, tmp_path / f"{stem}.pt")  # the name itself is legal here
    ckpt_core.save({"w": torch.arange(3.0)}, path)
    assert torch.equal(ckpt_core.load(path)["w"], torch.arange(3.0))


def test_a_local_folder_with_double_colons_in_its_name_holds_each_checkpoint(tmp_path):
    """A folder such as ``exp::lr=0.1`` (torch.save writes into it): fsspec reads ``::`` as a chain of URLs,
    and every checkpoint of the folder went silently into ONE file ``exp`` beside it, each save
    overwriting the last. A part before ``::`` that is a path, not a protocol or URL, means a local path."""
    folder = tmp_path / "exp::lr=0.1"
    folder.mkdir()
    for step in (1, 2):
        ckpt_core.save({"w": torch.full((4,), float(step))}, folder / f"step={step}.ckpt")
    assert not (tmp_path / "exp").exists()
    assert sorted(p.name for p in folder.iterdir()) == [".checkrun", "step=1.ckpt", "step=2.ckpt"]
    for step in (1, 2):
        assert torch.equal(ckpt_core.load(folder / f"step={step}.ckpt")["w"], torch.full((4,), float(step)))
    with CheckpointEngine() as engine:  # and a listing of the folder
        assert [e.name for e in engine.list(folder)] == ["step=1.ckpt", "step=2.ckpt"]


def test_ctrl_c_at_exit_names_what_it_interrupted(monkeypatch, caplog) -> None:
    """^C while the exit closes a step log (no save pending) says so, not "waiting for 0 pending save(s)"
    (h98: torch's parent-death SIGINT reached a spawned rank flushing its log at exit)."""
    import logging
    import weakref

    from ckpt_core.saving import lifecycle
    monkeypatch.setattr(lifecycle, "_owners", [])
    monkeypatch.setattr(lifecycle, "_engines", weakref.WeakSet())
    monkeypatch.setattr(lifecycle, "_busy", [])

    class Log:
        def close(self) -> None:
            raise KeyboardInterrupt

    closing = Log()
    lifecycle.register_owner(closing.close)
    with caplog.at_level(logging.ERROR, logger="ckpt_core"):
        lifecycle._flush_all()
    assert "interrupted at exit while closing (no save pending" in caplog.text
    assert "0 pending" not in caplog.text


@pytest.mark.parametrize("background", ["thread", "process"])
def test_threads_saving_through_one_engine_at_once_save_what_each_held(tmp_path, background) -> None:
    """Two threads, one engine (max_pending 4), each saving its own table under one key into one
    directory and changing it after save() returns: snapshots shared the copier and the directory's row
    streams, and 4-11 of 16 checkpoints loaded other values, verify saying OK (found by an independent
    check). Saves are serialised: each holds what its thread had."""
    saved, lock = {}, threading.Lock()

    def worker(engine: CheckpointEngine, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        emb = torch.randn(100_000, 16, generator=g)
        for i in range(6):
            emb[torch.randint(0, 100_000, (500,), generator=g)] += 1.0
            name = str(tmp_path / f"t{k}_{i}.ckpt")
            with lock:
                saved[name] = emb.clone()
            engine.save({"emb": emb}, name)

    with CheckpointEngine({"saving": {"max_pending": 4, "background": background}}) as engine:
        threads = [threading.Thread(target=worker, args=(engine, k)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        engine.wait()
        wrong = [n for n, v in saved.items() if not torch.equal(engine.load(n)["emb"], v)]
    assert len(saved) == 12 and wrong == []


def test_close_waits_while_a_commit_callback_saves_into_another_directory(tmp_path) -> None:
    """A done-callback saving a marker elsewhere (allowed: docs/ENGINE_API.md) while close() waited for
    the saves: close held the save lock the callback's save needed, a hang for good with max_pending 2
    (h159, a regression of the lock that h158's fix added)."""
    result: dict = {}

    def run() -> None:
        with CheckpointEngine({"saving": {"max_pending": 2}}) as engine:
            def mark(handle) -> None:
                engine.save({"done": torch.ones(1)}, tmp_path / "marks" / "a.done")

            engine.save({"w": torch.randn(1 << 20)}, tmp_path / "run" / "a.ckpt").add_done_callback(mark)
        result["closed"] = True

    closer = threading.Thread(target=run, daemon=True)
    closer.start()
    closer.join(300)  # a bound on a hang, not a timing assertion
    assert result.get("closed") and not closer.is_alive()
    assert torch.equal(ckpt_core.load(tmp_path / "marks" / "a.done")["done"], torch.ones(1))


def test_close_returns_while_another_thread_keeps_saving(tmp_path) -> None:
    """A thread saving in a loop until save() raises: close() let each of its saves in, waiting for the
    saves to end, which they never did (341 saves accepted in 20 s; a process with such a daemon thread
    never exited: h161, a regression of the lock). Once close() starts, other threads' saves are refused."""
    engine = CheckpointEngine({"saving": {"max_pending": 2}, "retention": {"keep_last": 2}})
    started, stopped = threading.Event(), []

    def loop() -> None:
        step, w = 0, torch.randn(1 << 23)
        try:
            while True:
                w.add_(1)
                engine.save({"w": w}, tmp_path / f"s{step}.ckpt")
                step += 1
                started.set()
        except CheckrunError as exc:
            stopped.append(str(exc))

    saver = threading.Thread(target=loop, daemon=True)
    saver.start()
    started.wait()
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(300)  # a bound on a hang, not a timing assertion
    saver.join(300)
    assert not closer.is_alive() and stopped == ["this CheckpointEngine is closed"]


def _save_in_child(engine: CheckpointEngine, path: str) -> None:
    import os

    try:
        engine.save({"w": torch.ones(2)}, path)
    except CheckrunError as exc:
        os._exit(0 if "forked child" in str(exc) else 2)
    os._exit(3)


def test_a_forked_childs_save_on_the_parents_engine_raises_while_a_parent_thread_saves(tmp_path) -> None:
    """The child inherits the save lock held by a parent thread that does not exist there: its save
    hung instead of raising the engine's "forked child" error (h159)."""
    import multiprocessing

    with CheckpointEngine() as engine:
        held, done = threading.Event(), threading.Event()

        def saving() -> None:  # as another parent thread inside save() at the fork
            with engine._saving:
                held.set()
                done.wait()

        holder = threading.Thread(target=saving)
        holder.start()
        held.wait()
        child = multiprocessing.get_context("fork").Process(target=_save_in_child, args=(engine, str(tmp_path / "c.ckpt")))
        child.start()
        done.set()
        holder.join()
        child.join(300)  # a bound on a hang, not a timing assertion
        if child.exitcode is None:
            child.kill()
        assert child.exitcode == 0


def test_a_first_ctrl_c_at_exit_that_still_finished_the_saves_says_so(monkeypatch, caplog) -> None:
    """The first ^C lands in engine.close(), which ends the queued saves before it lets go: the line said
    "no save pending" of a save that had been pending (h158)."""
    import logging
    import weakref

    from ckpt_core.saving import lifecycle
    monkeypatch.setattr(lifecycle, "_owners", [])
    monkeypatch.setattr(lifecycle, "_busy", [])

    class Engine:
        pending = 1

        def close(self) -> None:
            self.pending = 0  # the queued save was finished in close()'s finally
            raise KeyboardInterrupt

    engine = Engine()
    monkeypatch.setattr(lifecycle, "_engines", weakref.WeakSet([engine]))
    with caplog.at_level(logging.ERROR, logger="ckpt_core"):
        lifecycle._flush_all()
    assert "waiting for 1 pending save(s): they were finished before exiting" in caplog.text


def test_a_manifest_damaged_in_transit_once_is_read_again(tmp_path, monkeypatch, caplog) -> None:
    """As blobs are: one read with a flipped byte (a store without response checksums) does not fail the
    load of an intact checkpoint (h102); damaged at rest, it still fails."""
    import logging

    from ckpt_core.errors import CorruptCheckpointError
    from ckpt_core.storage.store import Store
    path = tmp_path / "a.ckpt"
    ckpt_core.save({"w": torch.arange(6.0)}, path)
    real, flips = Store.read_manifest, []

    def read(self, name, *args, **kwargs):
        data = real(self, name, *args, **kwargs)
        if flips and flips.pop():
            data = data[:40] + bytes([data[40] ^ 1]) + data[41:]
        return data
    monkeypatch.setattr(Store, "read_manifest", read)
    flips[:] = [True]
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        assert ckpt_core.load(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert "on the first read, the second matched" in caplog.text
    flips[:] = [True, True]
    with pytest.raises(CorruptCheckpointError, match="a.ckpt"):
        ckpt_core.load(path)


def test_latest_reads_a_manifest_damaged_in_transit_once_again(tmp_path, monkeypatch, caplog) -> None:
    """``latest()`` lists by manifest heads and checksums: one flipped byte in transit made it skip the intact
    newest checkpoint, and a resume go back to an older one (h104)."""
    import logging

    from ckpt_core.storage.store import Store
    for step in range(3):
        ckpt_core.save({"w": torch.full((4,), float(step))}, tmp_path / f"s{step}.ckpt")
    real, flips = Store.read_manifest, ["s2.ckpt"]

    def read(self, name, *args, **kwargs):
        data = real(self, name, *args, **kwargs)
        if name in flips:
            flips.remove(name)
            data = data[:-20] + bytes([data[-20] ^ 1]) + data[-19:]
        return data
    monkeypatch.setattr(Store, "read_manifest", read)
    with CheckpointEngine() as engine, caplog.at_level(logging.WARNING, logger="ckpt_core"):
        assert engine.latest(tmp_path).endswith("s2.ckpt")
        assert [e.name for e in engine.list(tmp_path) if e.manifest is not None] == ["s0.ckpt", "s1.ckpt", "s2.ckpt"]
    assert "the second matched" in caplog.text and "corrupt" not in caplog.text


def test_a_save_onto_a_symlink_to_a_directory_replaces_the_link(tmp_path) -> None:
    """Saves replace a link itself (``Store.for_path``), also one to a directory; a directory itself is
    refused before any write."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "x.ckpt").symlink_to(tmp_path / "folder")
    ckpt_core.save({"w": torch.ones(3)}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").is_symlink() and (tmp_path / "folder").is_dir()
    assert ckpt_core.load(tmp_path / "x.ckpt")["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_collection_skipped_for_an_unreadable_manifest_names_it(tmp_path, caplog):
    """h143: the warning of a save's collection said only "N manifest(s) cannot be read": the user had to run
    ``checkrun verify`` to learn which (and the directory grows with every save until it is fixed)."""
    import logging

    with CheckpointEngine() as engine:
        for step in range(2):
            engine.save({"w": torch.full((10,), float(step))}, tmp_path / f"s{step}.ckpt").result()
        (tmp_path / "s0.ckpt").write_bytes((tmp_path / "s0.ckpt").read_bytes()[:40])
        with caplog.at_level(logging.WARNING, logger="ckpt_core"):
            report = engine.gc(tmp_path)
    assert report.problems and report.deleted == []
    assert "1 manifest(s) cannot be read: s0.ckpt" in caplog.text
