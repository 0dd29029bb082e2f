"""A rotted blob is never silently reused (issue 20, point 1).

Content addressing skips writing a blob whose key exists. When the stored bytes of such a blob
rotted (a flipped byte, a truncation), a save that reuses it must check it first and write it
again: the new checkpoint verifies, loads the saved values and is what ``latest()`` returns.
Every reuse path is covered: chunks, packs, object blobs, delta row indices, and the base and
older deltas a row-delta save keeps. Blobs are damaged in place under ``.checkrun/blobs``.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import zstandard

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.format.manifest import Manifest
from ckpt_core.storage.store import Store

from .crash_child import Marker, digest


def config(background: str = "thread", policy: str = "consecutive") -> EngineConfig:
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 16384},
        "incremental": {"policy": policy, "row_delta_min_rows": 64},
        "load": {"allowed_globals": [f"{Marker.__module__}.Marker"]},
        "retention": {"gc_grace_seconds": 0},  # no refresh of old blobs: only the check rewrites
        "saving": {"background": background, "sigterm_grace_seconds": None},
        "storage": {"fsync": False},
    })


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(48, 256, generator=g),  # 48 KiB: three chunks, too few rows for deltas
            "bias": torch.randn(40, generator=g), "scale": torch.randn(24, generator=g),  # one pack
            "obj": Marker(7), "step": 3}


class Blobs:
    """The blob files of a checkpoint directory (local, memory:// or s3://), read and damaged in place."""

    def __init__(self, root: str, storage_options: dict | None = None) -> None:
        self.root, self.options = root, storage_options
        self.store = Store.for_directory(root, storage_options, EngineConfig().storage)

    def path(self, key: str) -> str:
        return self.store.blob_path(key)

    def read(self, key: str) -> bytes:
        return self.store.fs.cat_file(self.path(key))

    def damage(self, key: str, how: str) -> None:
        data = self.read(key)
        if how == "truncate":
            data = data[: len(data) // 2]
        else:  # flip one byte in the middle
            buf = bytearray(data)
            buf[len(buf) // 2] ^= 0x5A
            data = bytes(buf)
        self.store.fs.pipe_file(self.path(key), data)

    def of(self, engine: CheckpointEngine, name: str, tensor: str | None = None, kind: str = "base") -> list:
        """Blob keys of checkpoint ``name``: of one tensor's base chunks, delta chunks or delta
        indices, or (``tensor`` None) of its objects."""
        m = engine.read_manifest(f"{self.root}/{name}", storage_options=self.options)
        if tensor is None:
            return [o.blob.key for o in m.objects]
        rec = next(r for r in m.tensors if r.key == tensor)
        if kind == "base":
            return [c.blob.key for c in rec.base]
        if kind == "idx":
            return [d.idx.key for d in rec.deltas]
        return [c.blob.key for d in rec.deltas for c in d.chunks]


def assert_good(engine: CheckpointEngine, root: str, name: str, state: dict) -> None:
    """``name`` verifies, loads ``state`` bit for bit and is the newest valid checkpoint."""
    report = engine.verify(f"{root}/{name}")
    assert report.ok, report.problems
    assert digest(engine.load(f"{root}/{name}")) == digest(state)
    assert engine.latest(root).endswith(name)


def damage_every_kind(blobs: Blobs, engine: CheckpointEngine, name: str, how: str) -> None:
    """One chunk of ``w``, the pack of the small tensors and the object blob."""
    for key in {blobs.of(engine, name, "w")[1], blobs.of(engine, name, "bias")[0],
                blobs.of(engine, name)[0]}:
        blobs.damage(key, how)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://rot-{tmp_path.name}"


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_new_engine_rewrites_a_rotted_blob_it_would_reuse(root, how):
    state = make_state()
    blobs = Blobs(root)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
        damage_every_kind(blobs, engine, "c1.ckpt", how)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c2.ckpt").result()
        assert_good(engine, root, "c2.ckpt", state)
        # The encoding is deterministic: the rewrite also repaired the older checkpoint.
        assert engine.verify(f"{root}/c1.ckpt").ok


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_writing_engine_checks_a_blob_before_reusing_it(root, how):
    state = make_state()
    blobs = Blobs(root)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
        damage_every_kind(blobs, engine, "c1.ckpt", how)
        engine.save(state, f"{root}/c2.ckpt").result()
        assert_good(engine, root, "c2.ckpt", state)


@pytest.mark.parametrize("background", ["thread", "process"])
def test_writer_process_checks_reused_blobs(tmp_path, background):
    root, state = str(tmp_path / "run"), make_state()
    blobs = Blobs(root)
    with CheckpointEngine(config(background)) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
        damage_every_kind(blobs, engine, "c1.ckpt", "flip")
        engine.save(state, f"{root}/c2.ckpt").result()
        assert_good(engine, root, "c2.ckpt", state)


@pytest.mark.parametrize("kind", ["base", "delta", "idx"])
@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_row_delta_save_checks_the_blobs_it_keeps(root, kind, policy):
    """A delta save references the base and (consecutive) the older deltas without writing them;
    (intermittent) it writes the same rows, so the same index and delta blobs, again. Each blob
    is damaged after the save that wrote it, before any other save reused it."""
    blobs = Blobs(root)
    emb = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    with CheckpointEngine(config(policy=policy)) as engine:
        engine.save({"emb": emb}, f"{root}/c0.ckpt").result()
        last = "c0.ckpt"
        if kind != "base":
            emb[7:10] += 1.0
            engine.save({"emb": emb}, f"{root}/c1.ckpt").result()
            last = "c1.ckpt"
        for key in blobs.of(engine, last, "emb", kind)[:1]:
            blobs.damage(key, "flip")
        emb[20:22] -= 1.0 if kind == "base" else 0.0
        engine.save({"emb": emb}, f"{root}/c2.ckpt").result()
        assert_good(engine, root, "c2.ckpt", {"emb": emb})
        emb[500:502] -= 1.0
        engine.save({"emb": emb}, f"{root}/c3.ckpt").result()
        assert_good(engine, root, "c3.ckpt", {"emb": emb})


@pytest.mark.parametrize("background", ["thread", "process"])
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_blob_that_rots_after_the_engine_checked_it_is_not_reused(root, how, background):
    """A long-running trainer: the engine read every blob back at its first reuse (c2), then a
    blob rots. Later saves must see it (the stored file changed since the check) and write it
    again, not reference it from every further checkpoint until none of them loads."""
    if background == "process" and root.startswith("memory://"):
        pytest.skip("memory:// is in-process only")
    state, blobs = make_state(), Blobs(root)
    with CheckpointEngine(config(background)) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
        engine.save(state, f"{root}/c2.ckpt").result()  # reads back (checks) what c1 wrote
        engine.save(state, f"{root}/c3.ckpt").result()  # trusts the checks
        damage_every_kind(blobs, engine, "c3.ckpt", how)
        engine.save(state, f"{root}/c4.ckpt").result()
        assert_good(engine, root, "c4.ckpt", state)
        engine.save(state, f"{root}/c5.ckpt").result()
        assert_good(engine, root, "c5.ckpt", state)
        assert engine.verify(f"{root}/c1.ckpt").ok  # repaired: the encoding is deterministic


def test_a_blob_that_rots_on_s3_after_the_engine_checked_it_is_not_reused(s3_root, s3_storage_options):
    """The same on S3: the look each save takes (HEAD) shows another ETag and LastModified."""
    state, blobs = make_state(), Blobs(s3_root, s3_storage_options)
    with CheckpointEngine(config()) as engine:
        for name in ("c1", "c2", "c3"):
            engine.save(state, f"{s3_root}/{name}.ckpt", storage_options=s3_storage_options).result()
        damage_every_kind(blobs, engine, "c3.ckpt", "flip")
        engine.save(state, f"{s3_root}/c4.ckpt", storage_options=s3_storage_options).result()
        assert engine.verify(f"{s3_root}/c4.ckpt", storage_options=s3_storage_options).ok
        assert digest(engine.load(f"{s3_root}/c4.ckpt", storage_options=s3_storage_options)) == digest(state)


def test_a_blob_that_rots_after_a_load_checked_it_is_not_reused(root):
    """A resumed run: the load read and checked every blob, the first save took their versions,
    then a blob rots before a later save."""
    state, blobs = make_state(), Blobs(root)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
    with CheckpointEngine(config()) as engine:
        engine.load(f"{root}/c1.ckpt")
        engine.save(state, f"{root}/c2.ckpt").result()
        damage_every_kind(blobs, engine, "c2.ckpt", "flip")
        engine.save(state, f"{root}/c3.ckpt").result()
        assert_good(engine, root, "c3.ckpt", state)


def test_a_blob_that_a_load_checked_and_that_rots_with_its_mtime_put_back_is_not_reused(tmp_path):
    """A blob a load read and checked is rewritten in place before the first save, its mtime put back (as
    ``cp -p`` or ``rsync -a`` do): only the mtime was compared with the load's start, so the save built a
    row delta on the rotten base and its checkpoint failed to load (found by an independent check). The
    inode change time (ctime) counts too."""
    import time

    d = tmp_path / "run"
    torch.manual_seed(0)
    state = {"emb": torch.randn(4096, 64), "step": 1}
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{d}/step=1.ckpt").result()
    old = time.time() - 3600  # resumed an hour later
    for path in (d / ".checkrun" / "blobs").rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))
    with CheckpointEngine(config().replace(**{"load.reference": "inline"})) as engine:
        live = engine.load(f"{d}/step=1.ckpt")
        key = max(engine.read_manifest(f"{d}/step=1.ckpt").tensors, key=lambda t: t.nbytes).blobs()[0].key
        path = d / ".checkrun" / "blobs" / key[:2] / key[2:]
        before = os.stat(path)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        live["emb"][:5] += 1.0
        live["step"] = 2
        engine.save(live, f"{d}/step=2.ckpt").result()
        assert_good(engine, str(d), "step=2.ckpt", live)


def test_a_kept_delta_base_that_rots_after_its_check_is_written_again(root):
    """Row-delta saves keep the base without passing it through the encoder; one that rots after
    the save that checked it must not be kept by the next."""
    blobs = Blobs(root)
    emb = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    with CheckpointEngine(config()) as engine:
        for i in range(3):  # c1 checks the base c0 wrote, c2 trusts it
            emb[10 * i:10 * i + 3] += 1.0
            engine.save({"emb": emb}, f"{root}/c{i}.ckpt").result()
        blobs.damage(blobs.of(engine, "c2.ckpt", "emb", "base")[0], "flip")
        emb[600:603] -= 1.0
        engine.save({"emb": emb}, f"{root}/c3.ckpt").result()
        assert_good(engine, root, "c3.ckpt", {"emb": emb})


class _Reads:
    """Counts the blob reads of the save path that found a blob (``Store.get_blob``)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = Store.get_blob

        def counted(store, key, max_bytes):
            data = original(store, key, max_bytes)
            self.count += 1
            return data

        monkeypatch.setattr(Store, "get_blob", counted)

    def during(self, fn) -> int:
        before = self.count
        fn()
        return self.count - before


def test_each_reused_blob_is_read_once_per_engine(tmp_path, monkeypatch):
    root, state = str(tmp_path / "run"), make_state()
    reads = _Reads(monkeypatch)
    with CheckpointEngine(config()) as engine:
        assert reads.during(lambda: engine.save(state, f"{root}/c1.ckpt").result()) == 0
        unique = len({b.key for b in engine.read_manifest(f"{root}/c1.ckpt").blobs()})
        # Blobs it wrote itself count as unchecked until read back once, then never again.
        assert reads.during(lambda: engine.save(state, f"{root}/c2.ckpt").result()) == unique
        assert reads.during(lambda: engine.save(state, f"{root}/c3.ckpt").result()) == 0
    age_blobs(root)
    # utime moved the files' ctime to now, which counts as "changed since the load started" (a rewrite
    # that puts the mtime back); files written an hour before a resume have an hour-old ctime too
    from ckpt_core.saving import blobcheck

    monkeypatch.setattr(blobcheck, "CLOCK_MARGIN", -60.0)
    with CheckpointEngine(config()) as engine:
        engine.load(f"{root}/c3.ckpt")  # a load checks every blob: no second read by the save
        assert reads.during(lambda: engine.save(state, f"{root}/c4.ckpt").result()) == 0


def age_blobs(root: str, seconds: float = 3600.0) -> None:
    """Date the blob files of a local ``root`` back, as in a run resumed an hour after its save (a
    load trusts what it checked unless the file was modified less than ``CLOCK_MARGIN`` before it
    started)."""
    for path in (Path(root) / ".checkrun" / "blobs").rglob("*"):
        if path.is_file():
            past = path.stat().st_mtime - seconds
            os.utime(path, (past, past))


def test_a_valid_blob_of_another_encoding_is_adopted_not_overwritten(tmp_path):
    """A stored blob that differs from this engine's encoding but decodes to the same content
    (here a zstd frame with a content checksum, as earlier versions wrote) stays: older
    checkpoints reference its checksum."""
    root = str(tmp_path / "run")
    state = {"u": torch.arange(4096, dtype=torch.int32).to(torch.uint8)}
    blobs = Blobs(root)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c1.ckpt").result()
        key = blobs.of(engine, "c1.ckpt", "u")[0]
    raw = state["u"].numpy().tobytes()
    other = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(raw)
    assert other != blobs.read(key)
    blobs.store.fs.pipe_file(blobs.path(key), other)
    with CheckpointEngine(config()) as engine:
        engine.save(state, f"{root}/c2.ckpt").result()
        assert blobs.read(key) == other
        assert_good(engine, root, "c2.ckpt", state)


def test_references_to_one_blob_that_disagree_fail_verify_and_latest(tmp_path):
    root = str(tmp_path / "run")
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with CheckpointEngine(config()) as engine:
        engine.save({"a": a, "b": a.clone()}, f"{root}/c1.ckpt").result()
        m = engine.read_manifest(f"{root}/c1.ckpt")
        assert m.tensors[0].base[0].blob.key == m.tensors[1].base[0].blob.key
        first = m.tensors[0]
        bad = dataclasses.replace(first.base[0].blob, csum="0" * len(first.base[0].blob.csum))
        chunks = (dataclasses.replace(first.base[0], blob=bad),) + first.base[1:]
        forged = dataclasses.replace(m, created=m.created + 1,
                                     tensors=(dataclasses.replace(first, base=chunks),) + m.tensors[1:])
        Store.for_directory(root, None, EngineConfig().storage).write_manifest("c2.ckpt", Manifest.to_bytes(forged))
        assert not engine.verify(f"{root}/c2.ckpt", decode=False).ok
        assert engine.latest(root).endswith("c1.ckpt")
