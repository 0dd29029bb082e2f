"""Corruption at rest: byte flips, truncation and deletion of every blob and every manifest of a
directory of incremental checkpoints (bases, row deltas, delta indices, object blobs).

For every damaged file: ``verify`` and ``load`` of every checkpoint that needs it fail with a
``CheckrunError`` naming that file, every other checkpoint still verifies and loads bit for bit,
and ``latest()`` falls back to the newest intact checkpoint.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import CheckrunError
from ckpt_core.format.manifest import parse_manifest
from ckpt_core.retain.retention import list_checkpoints
from ckpt_core.storage.store import Store

from ..core.test_cli import run
from .crash_child import Marker, digest

NAMES = ["c1.ckpt", "c2.ckpt", "c3.ckpt", "c4.ckpt"]


def config() -> EngineConfig:
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 16384},
        "load": {"allowed_globals": [f"{Marker.__module__}.Marker"]},
        "saving": {"sigterm_grace_seconds": None},
        "storage": {"fsync": False},  # durability against power loss is not what is tested here
    })


def make_states() -> list[dict]:
    emb = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0))
    states = []
    for i in range(1, 5):
        emb = emb.clone()
        emb[i * 10: i * 10 + 8] += i  # a few rows change: row deltas on a shared base
        states.append({"emb": emb, "w": torch.randn(48, 48, generator=torch.Generator().manual_seed(i)),
                       "obj": Marker(i), "step": i, "half": torch.arange(7, dtype=torch.float16) * i})
    return states


class Pristine:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.states = make_states()
        with CheckpointEngine(config()) as engine:
            for name, st in zip(NAMES, self.states):
                engine.save(st, path / name).result()
            self.needs = {name: {self.blob_file(b.key) for b in engine.read_manifest(path / name).blobs()}
                          | {path / name} for name in NAMES}
        self.digests = {name: digest(st) for name, st in zip(NAMES, self.states)}
        blobs = sorted(p for p in (path / ".checkrun" / "blobs").rglob("*") if p.is_file())
        self.files = [path / n for n in NAMES] + blobs
        assert any(len([n for n in NAMES if b in self.needs[n]]) > 1 for b in blobs)  # shared bases

    def blob_file(self, key: str) -> Path:
        return self.path / ".checkrun" / "blobs" / key[:2] / key[2:]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    return Pristine(tmp_path_factory.mktemp("pristine") / "run")


def damage(path: Path, how: str, rng: random.Random) -> None:
    data = path.read_bytes()
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
    else:  # flip: one random byte XOR a random non-zero mask
        buf = bytearray(data)
        i = rng.randrange(len(buf))
        buf[i] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(buf))


def label(pristine: Pristine, f: Path) -> str:
    """How errors name the file: the manifest's name, or the blob's shard/key path."""
    return f.name if f.parent == pristine.path else f"{f.parent.name}/{f.name}"


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_every_damaged_file_is_detected_and_named(pristine, tmp_path, how):
    rng = random.Random(f"corruption-{how}")
    work = tmp_path / "run"
    shutil.copytree(pristine.path, work)
    detections = 0
    with CheckpointEngine(config()) as engine:
        for f in pristine.files:
            damaged = work / f.relative_to(pristine.path)
            original = damaged.read_bytes()
            damage(damaged, how, rng)
            name = label(pristine, f)
            affected = [n for n in NAMES if f in pristine.needs[n]]
            assert affected
            for n in NAMES:
                report = engine.verify(work / n)
                if n in affected:
                    assert not report.ok and any(name in p for p in report.problems), (n, name, report)
                    with pytest.raises(CheckrunError) as info:
                        engine.load(work / n)
                    assert name in str(info.value), (n, name, str(info.value))
                    detections += 1
                else:
                    assert report.ok, (n, name, report.problems)
                    assert digest(engine.load(work / n)) == pristine.digests[n]
            intact = [n for n in NAMES if n not in affected]
            latest = engine.latest(work)
            assert (latest and Path(latest).name) == (intact[-1] if intact else None), (name, latest)
            damaged.write_bytes(original)  # undamaged again for the next file
    assert detections == sum(len([n for n in NAMES if f in pristine.needs[n]]) for f in pristine.files)


def test_every_single_bit_flip_of_a_manifest_is_detected(pristine):
    """Exhaustive: each byte of a manifest with one bit flipped (bit = offset % 8) must be refused.
    Includes the digits of floats and exponents, whose changes may parse to the same body."""
    data = (pristine.path / "c4.ckpt").read_bytes()
    accepted = []
    for i in range(len(data)):
        buf = bytearray(data)
        buf[i] ^= 1 << (i % 8)
        try:
            parse_manifest(bytes(buf), "c4.ckpt", max_blob_bytes=1 << 34)
            accepted.append(i)
        except CheckrunError:
            pass
    assert accepted == [], [data[max(0, i - 20): i + 20] for i in accepted[:5]]


def test_damage_to_a_manifests_first_bytes_is_a_broken_checkpoint_not_another_file(pristine, tmp_path):
    """A flipped bit in a manifest's header (``{"_checkrun":"manifest","checksum":"``), or a truncation
    inside it, must not make the file look like someone else's: listing then left it out, ``verify DIR``
    said intact and gc deleted the blobs only it referenced. Every bit of the first 40 bytes, and every
    truncation to 1-40 bytes, and its first 1-64 bytes (or all) zeroed as a crash zeroes a file (h106, h107:
    all of them, then its first 10-63 bytes, were taken for another file), is listed as a broken
    checkpoint; gc deletes nothing while it is there."""
    work = tmp_path / "run"
    shutil.copytree(pristine.path, work)
    target = work / "c4.ckpt"
    original = target.read_bytes()
    store = Store.for_directory(str(work), None, config().storage)
    variants = [original[:n] for n in range(1, 41)] + [b"\0" * n + original[n:] for n in (*range(1, 65), len(original))]
    for i in range(40):
        for bit in range(8):
            buf = bytearray(original)
            buf[i] ^= 1 << bit
            variants.append(bytes(buf))
    for data in variants:
        target.write_bytes(data)
        entries = {e.name: e for e in list_checkpoints(store, config())}
        assert "c4.ckpt" in entries and entries["c4.ckpt"].manifest is None, data[:40]
    blobs = sorted(p for p in (work / ".checkrun" / "blobs").rglob("*") if p.is_file())
    with CheckpointEngine(config()) as engine:
        gc = engine.gc(work, grace_seconds=0)
    assert not gc.deleted and gc.problems, gc
    assert sorted(p for p in (work / ".checkrun" / "blobs").rglob("*") if p.is_file()) == blobs
    target.write_bytes(b'{"step": 1, "note": "a JSON file of the user\'s"}')  # other files stay other files
    assert "c4.ckpt" not in {e.name for e in list_checkpoints(store, config())}


def test_a_zeroed_manifest_is_a_broken_checkpoint_that_latest_skips_with_a_warning(pristine, tmp_path, caplog,
                                                                                   capsys):
    """A crash (or the storage) can leave a committed file full of zero bytes, its size intact. It was
    taken for another file: ``latest()`` went back to the previous checkpoint without a word, ``verify
    DIR`` said everything was intact and gc deleted the blobs only it referenced (h106)."""
    work = tmp_path / "run"
    shutil.copytree(pristine.path, work)
    target = work / "c4.ckpt"
    target.write_bytes(b"\0" * target.stat().st_size)
    with CheckpointEngine(config()) as engine:
        with caplog.at_level("WARNING", logger="ckpt_core"):
            assert Path(engine.latest(work)).name == "c3.ckpt"
        assert f"{target}: it starts with zero bytes (zeroed by a crash)" in caplog.text
        code, out, _ = run(capsys, "verify", str(work))
        assert code == 1 and "c4.ckpt: it starts with zero bytes" in out and "3 intact, 1 corrupt" in out, out
        with pytest.raises(CheckrunError, match=r"c4\.ckpt: damaged checkpoint: it starts with zero bytes"):
            engine.load(target)
        blobs = sorted(p for p in (work / ".checkrun" / "blobs").rglob("*") if p.is_file())
        assert not engine.gc(work, grace_seconds=0).deleted
    assert sorted(p for p in (work / ".checkrun" / "blobs").rglob("*") if p.is_file()) == blobs


def test_flips_that_parse_to_the_same_body_are_detected(pristine):
    """The 17th significant digit of ``created`` and an exponent's case change no parsed value."""
    data = (pristine.path / "c4.ckpt").read_bytes()
    body = json.loads(data)
    created = json.dumps(body["created"]).encode()
    assert created in data
    for variant in (created + b"0", created + b"e0", created + b"E+00"):
        tampered = data.replace(b'"created":' + created, b'"created":' + variant, 1)
        assert json.loads(tampered)["created"] == body["created"]  # same body, other bytes
        with pytest.raises(CheckrunError, match="checksum"):
            parse_manifest(tampered, "c4.ckpt", max_blob_bytes=1 << 34)


def test_damage_is_detected_on_every_backend(any_root):
    url, opts = any_root
    states = [{**st, "emb": st["emb"][:512].clone()} for st in make_states()[:3]]  # S3 here is slow
    with CheckpointEngine(config().replace(**{"storage.storage_options": opts})) as engine:
        for name, st in zip(NAMES, states):
            engine.save(st, f"{url}/{name}").result()
        store = Store.for_directory(url, opts, engine.config.storage)
        fs = store.fs
        m3 = engine.read_manifest(f"{url}/c3.ckpt")
        m2 = engine.read_manifest(f"{url}/c2.ckpt")
        only3 = [b for b in m3.blobs() if b.key not in m2.blob_keys()]
        flipped = store.blob_path(only3[0].key)
        data = bytearray(fs.cat_file(flipped))
        data[len(data) // 2] ^= 0x10
        fs.pipe_file(flipped, bytes(data))
        fs.invalidate_cache()
        assert engine.latest(url).endswith("c2.ckpt")  # c3 has a flipped blob: skipped
        with pytest.raises(CheckrunError, match=only3[0].key[2:]):
            engine.load(f"{url}/c3.ckpt")
        fs.rm_file(store.blob_path(m2.blobs()[-1].key))  # c2 loses its object blob
        fs.invalidate_cache()
        assert engine.latest(url).endswith("c1.ckpt")
        manifest = f"{store.root}/c1.ckpt"
        fs.pipe_file(manifest, fs.cat_file(manifest)[:-7])  # and c1's manifest is truncated
        fs.invalidate_cache()
        assert engine.latest(url) is None
        for name in NAMES[:3]:
            assert not engine.verify(f"{url}/{name}").ok
            with pytest.raises(CheckrunError):
                engine.load(f"{url}/{name}")


def test_a_manifest_copied_without_its_folder_fails_saying_so(tmp_path):
    """``cp run/last.ckpt elsewhere/`` (or a download of the file alone): the load names the
    checkpoint, the missing blob, and that the data lives in the ``.checkrun`` folder."""
    import shutil

    from ckpt_core import CheckpointEngine, CorruptCheckpointError

    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    with CheckpointEngine() as engine:
        engine.save({"w": torch.ones(3)}, str(tmp_path / "run" / "last.ckpt")).result()
        shutil.copy(tmp_path / "run" / "last.ckpt", tmp_path / "elsewhere" / "last.ckpt")
        with pytest.raises(CorruptCheckpointError, match=r"elsewhere/last.ckpt: missing blob .*there is no "
                           r"\.checkrun/blobs folder beside the manifest.*checkrun export"):
            engine.load(str(tmp_path / "elsewhere" / "last.ckpt"))
        assert engine.load(str(tmp_path / "run" / "last.ckpt"))["w"].tolist() == [1.0, 1.0, 1.0]
