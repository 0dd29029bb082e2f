"""Hostile checkpoints: manifests and blobs crafted by an attacker who can write to the checkpoint
store (and so can recompute the manifest checksum, ``ckpt_core.format.manifest._body_checksum``).

Every one must be refused with a ``CheckrunError`` subclass, by ``load`` and by ``verify``, while:
no file outside the store is read or written (every storage call is audited through the
``faultfile://`` wrapper, every ``open()`` of the process through a Python audit hook), no
allocation is sized by an unvalidated number, and no code executes (pickle payloads that would
create a marker file).
"""
from __future__ import annotations

import copy
import io
import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import xxhash
import zstandard

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import (CheckrunError, CorruptCheckpointError, FormatError, NotACheckpointError,
                              UnsafeLoadError, UnsafePathError)
from ckpt_core.format.manifest import _body_checksum

from .crash_child import Marker
from ckpt_core.testing.faults import FaultFS, Policy

LIMIT = 1 << 24  # load.max_blob_bytes for these tests: 16 MiB


def config(max_blob_bytes: int = LIMIT) -> EngineConfig:
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 16384},
        "load": {"allowed_globals": [f"{Marker.__module__}.Marker"], "max_blob_bytes": max_blob_bytes},
        "saving": {"sigterm_grace_seconds": None},
        "storage": {"fsync": False},  # durability against power loss is not what is tested here
    })


# ------------------------------------------------------------------------------------ auditing
class Audit(Policy):
    """Records every storage operation's path."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def on(self, op: str, kind: str, path: str) -> None:
        self.paths.append(path)


_OPENED: list | None = None


def _audit_hook(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit_hook)  # process-wide and permanent; records only inside ``audited()``


@contextmanager
def audited():
    global _OPENED
    audit = Audit()
    FaultFS.policy = audit
    _OPENED = []
    try:
        yield audit, _OPENED
    finally:
        FaultFS.policy = None
        _OPENED = None


# ----------------------------------------------------------------------------------- fixtures
class Env:
    def __init__(self, tmp: Path, state: dict | None = None) -> None:
        self.tmp = tmp
        self.root = tmp / "run"
        self.url = f"faultfile://{self.root}"
        self.outside = tmp / "outside"
        self.outside.mkdir()
        (self.outside / "secret").write_bytes(b"do not read me")
        self.marker = tmp / "pwned"
        if state is None:
            state = {"emb": torch.randn(2048, 16), "w": torch.randn(64, 64), "obj": Marker(1), "step": 1}
        with CheckpointEngine(config()) as engine:
            engine.save(state, self.root / "good.ckpt").result()
        self.good = json.loads((self.root / "good.ckpt").read_bytes())

    def body(self) -> dict:
        b = copy.deepcopy(self.good)
        b["created"] = time.time() + 1000  # newer than good.ckpt: latest() considers it first
        return b

    def put_blob(self, data: bytes) -> dict:
        """Store ``data`` as a blob, as an attacker with write access can; returns its BlobRef."""
        key = xxhash.xxh3_128_hexdigest(data)
        path = self.root / ".checkrun" / "blobs" / key[:2] / key[2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return {"key": key, "size": len(data), "csum": xxhash.xxh3_64_hexdigest(data)}


@pytest.fixture
def env(tmp_path) -> Env:
    return Env(tmp_path)


def forge(body: dict) -> bytes:
    """Manifest bytes with a correct checksum (an attacker can compute it as well as we can)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = _body_checksum(body)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def refused(env: Env, data: bytes, expected: type = CheckrunError, match: str | None = None,
            max_blob_bytes: int = LIMIT, verify_detects: bool = True) -> BaseException:
    """Write ``evil.ckpt`` and check that load and verify refuse it safely; return load's error.

    ``latest()`` must skip it when its manifest or its blobs' checksums are bad; a manifest that
    is consistent with its blobs and fails only when decoded may be returned by ``latest()``
    (which checks checksums, not decoding): ``load`` is what refuses it then. ``verify`` checks
    everything; it unpickles values with torch's restricted unpickler, and one that unpickler
    refuses is not damage (``verify_detects=False`` for such pickle payloads)."""
    (env.root / "evil.ckpt").write_bytes(data)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with audited() as (audit, opened):
        with CheckpointEngine(config(max_blob_bytes)) as engine:
            with pytest.raises(CheckrunError) as info:
                engine.load(f"{env.url}/evil.ckpt")
            report = engine.verify(f"{env.url}/evil.ckpt")
            shallow = engine.verify(f"{env.url}/evil.ckpt", decode=False)
            latest = engine.latest(env.url)
    assert isinstance(info.value, expected), repr(info.value)
    if match is not None:
        assert match in str(info.value), str(info.value)
    assert "evil.ckpt" in str(info.value) or ".checkrun/blobs/" in str(info.value)
    assert report.ok is not verify_detects and bool(report.problems) is verify_detects
    if not shallow.ok:
        assert latest is not None and latest.endswith("good.ckpt")
    root = str(env.root)
    assert audit.paths and all(p == root or p.startswith(root + "/") for p in audit.paths), audit.paths
    inside_tmp = [p for p in opened if p.startswith(str(env.tmp))]
    assert all(p.startswith(root + "/") for p in inside_tmp), inside_tmp
    assert not env.marker.exists()
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grew_mb < 256, f"peak RSS grew by {grew_mb:.0f} MB"
    return info.value


def _set(path: str, value):
    """A body mutation: set ``path`` (dotted, ints index lists) to ``value``."""
    def mutate(body: dict, env: Env) -> bytes:
        node = body
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value(env) if callable(value) else value
        return forge(body)
    return mutate


# ---------------------------------------------------------------------------- escaping the store
ESCAPES = ["../../outside/secret", "../outside/secret", "/etc/passwd", "s3://other-bucket/run/blob",
           "file:///etc/passwd", "memory://x/y", "gs://b/k", "aa/../../../outside/secret",
           "0" * 31 + "/", "0" * 32 + "\x00", "A" * 32, "00/" + "0" * 30, ""]


@pytest.mark.parametrize("key", ESCAPES)
@pytest.mark.parametrize("where", ["tensor", "delta-index", "object"])
def test_blob_keys_that_escape_the_store(env, key, where):
    body = env.body()
    if where == "tensor":
        body["tensors"][1]["base"][0]["blob"]["key"] = key
    elif where == "object":
        body["objects"][0]["blob"]["key"] = key
    else:
        rec = body["tensors"][0]
        chunk = dict(rec["base"][0], off=0, rows=1)
        rec["deltas"] = [{"n": 1, "idx": dict(rec["base"][0]["blob"], key=key), "chunks": [chunk]}]
    refused(env, forge(body), UnsafePathError)


def test_manifest_name_cannot_escape(env):
    with CheckpointEngine(config()) as engine:
        for name in ("../outside/secret", "..", ".checkrun"):
            with pytest.raises(CheckrunError):
                engine.load(f"{env.root}/{name}")


# -------------------------------------------------------------------------- shapes and sizes
CASES = {
    "shape-larger-than-chunks": (_set("tensors.0.shape", [4096, 16]), FormatError),
    "shape-smaller-than-chunks": (_set("tensors.0.shape", [1024, 16]), FormatError),
    "negative-dim": (_set("tensors.0.shape", [-2048, -16]), FormatError),
    "too-many-dims": (_set("tensors.0.shape", [1] * 65), FormatError),
    "bool-dim": (_set("tensors.0.shape", [True, 16]), FormatError),
    "float-dim": (_set("tensors.0.shape", [2048.0, 16]), FormatError),
    "chunk-overlap": (_set("tensors.0.base.1.off", 0), FormatError),
    "chunk-rows-lie": (_set("tensors.1.base.0.rows", 32), FormatError),
    "blob-size-lie-small": (_set("tensors.1.base.0.blob.size", 100), CorruptCheckpointError),
    "blob-size-lie-large": (_set("tensors.1.base.0.blob.size", 10 ** 6), CorruptCheckpointError),
    "blob-size-over-limit": (_set("tensors.1.base.0.blob.size", 2 ** 62), FormatError),
    "chunk-over-limit": (_set("tensors.1.base.0.rows", 2 ** 40), FormatError),
    "csum-lie": (_set("tensors.1.base.0.blob.csum", "0" * 16), CorruptCheckpointError),
    "dtype-lie": (_set("tensors.1.dtype", "float64"), CorruptCheckpointError),
    "unknown-dtype": (_set("tensors.1.dtype", "float128"), FormatError),
    "unknown-codec": (_set("tensors.1.codecs.0", {"name": "evil", "version": 1}), FormatError),
    "codec-not-an-object": (_set("tensors.1.codecs.1", 0), FormatError),
    "codec-a-list": (_set("tensors.1.codecs.1", [["name", "zstd"]]), FormatError),
    "codec-nameless": (_set("tensors.1.codecs.1", {"level": 1}), FormatError),
    "codec-version": (_set("tensors.1.codecs.1.version", 99), FormatError),
    "codec-bad-param": (_set("tensors.1.codecs.1.itemsize", 10 ** 9), FormatError),
    "codec-extra-param": (_set("tensors.1.codecs.0.exec", "import os"), FormatError),
    "codecs-empty": (_set("tensors.1.codecs", []), FormatError),
    "codecs-bytes-first": (_set("tensors.1.codecs", [{"name": "zstd", "version": 1, "level": 1, "threads": 0}]),
                           FormatError),
    "format-version": (_set("format_version", 99), FormatError),
    "bad-device": (_set("tensors.1.device", "bogus:0"), FormatError),
    "leaf-table": (_set("meta.leaves", [0, 7]), FormatError),
    "skeleton-ref-out-of-range": (_set("skeleton", {"$d": ["w", {"$t": 9}]}), FormatError),
    "skeleton-object-out-of-range": (_set("skeleton", {"$d": ["w", {"$o": 5}]}), FormatError),
    "skeleton-unknown-tag": (_set("skeleton", {"$eval": "__import__('os')"}), FormatError),
    "created-huge-int": (_set("created", 10 ** 400), FormatError),
    "created-string": (_set("created", "yesterday"), FormatError),
    "delta-rows-lie": (_set("tensors.0.deltas", [{"n": 10 ** 6, "idx": None, "chunks": []}]), FormatError),
    # h128: no elements, but torch multiplies every dimension (a raw overflow error naming no file before)
    "zero-dim-overflow": (lambda b, env: _set("tensors.0.shape", [2 ** 40, 2 ** 40, 0])(
        {**b, "tensors": [{**b["tensors"][0], "base": []}, *b["tensors"][1:]]}, env), FormatError),
    "dim-over-int64": (lambda b, env: _set("tensors.0.shape", [0, 2 ** 63])(
        {**b, "tensors": [{**b["tensors"][0], "base": []}, *b["tensors"][1:]]}, env), FormatError),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fields_that_do_not_match_the_data(env, case):
    mutate, expected = CASES[case]
    refused(env, mutate(env.body(), env), expected)


@pytest.mark.parametrize("codec", [0, [["name", "zstd"]], "zstd", {"level": 1}])
def test_cli_names_a_codec_entry_that_is_not_an_object(env, capsys, codec):
    """``checkrun inspect`` built the pipeline's text from a forged entry: a bare TypeError or
    AttributeError, where load/verify said FormatError (found by an independent fuzzer)."""
    from ckpt_core.cli import main

    (env.root / "evil.ckpt").write_bytes(_set("tensors.1.codecs.1", codec)(env.body(), env))
    for argv in (["inspect", f"{env.root}/evil.ckpt"], ["ls", str(env.root)]):
        capsys.readouterr()
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 1 and "invalid codec pipeline" in out + err and "Error:" not in err, (argv, out, err)


# Small tensors stored together: each chunk is a byte range ("part") of one pack blob (format 2).
def _pack_env(tmp_path) -> Env:
    env = Env(tmp_path, {"a": torch.randn(8), "b": torch.randn(8), "c": torch.randn(4, 4), "obj": Marker(1)})
    assert [t["base"][0]["part"] for t in env.good["tensors"]] == [[0, 128], [32, 128], [64, 128]]
    return env


def _lossy(body: dict, env: Env) -> bytes:
    body["tensors"][1]["codecs"][0] = {"name": "cast", "version": 1, "to": "bfloat16"}
    return forge(body)


def _part_in_delta(body: dict, env: Env) -> bytes:
    rec = body["tensors"][2]
    rec["deltas"] = [{"n": 1, "idx": rec["base"][0]["blob"], "chunks": [dict(rec["base"][0], rows=1)]}]
    return forge(body)


PACK_CASES = {
    "part-outside-pack": _set("tensors.2.base.0.part", [96, 128]),
    "part-misaligned": _set("tensors.1.base.0.part", [34, 128]),
    "part-total-lie": _set("tensors.0.base.0.part", [0, 132]),
    "part-total-over-limit": _set("tensors.0.base.0.part", [0, 2 ** 62]),
    "part-not-a-pair": _set("tensors.0.base.0.part", [0, 128, 5]),
    "part-negative": _set("tensors.0.base.0.part", [-4, 128]),
    "part-bool": _set("tensors.0.base.0.part", [False, 128]),
    "part-in-format-1": _set("format_version", 1),
    "part-of-lossy-chunk": _lossy,
    "part-in-delta": _part_in_delta,
}


@pytest.mark.parametrize("case", sorted(PACK_CASES))
def test_pack_parts_that_do_not_match_the_data(tmp_path, case):
    env = _pack_env(tmp_path)
    refused(env, PACK_CASES[case](env.body(), env), FormatError)


def test_nan_and_infinity_literals(env):
    data = forge(env.body()).replace(b'"step":1}', b'"step":NaN}', 1)
    refused(env, data, FormatError)
    raw = forge(env.body()).decode()
    body = json.loads(raw)
    body["created"] = float("inf")  # with the checksum an attacker would compute over it
    text = json.dumps({k: v for k, v in body.items() if k != "checksum"}, sort_keys=True,
                      separators=(",", ":"))
    refused(env, text.encode(), FormatError)


def test_huge_declared_tensor_is_refused_without_allocating_it(env):
    """1 TiB tiled by 2**6 chunks of 16 GiB, each within the (default) per-blob limit."""
    body = env.body()
    rec = body["tensors"][1]
    rows = 2 ** 32  # 16 GiB of float32 per chunk
    rec["shape"] = [rows * 64, 1]
    rec["base"] = [{"off": i * rows, "rows": rows, "cols": 1, "blob": dict(rec["base"][0]["blob"])}
                   for i in range(64)]
    refused(env, forge(body), CheckrunError, max_blob_bytes=1 << 34)


@pytest.mark.parametrize("fields", [{"shape": [1] * 200_000}, {"key": "k" * 1_000_000, "dtype": "nope"},
                                    {"dtype": "d" * 1_000_000}])
def test_an_error_does_not_echo_a_huge_field(env, fields):
    """A shape of 200,000 dimensions came back as 600 KB of error text in load, verify and ls."""
    body = env.body()
    body["tensors"][1].update(fields)
    err = refused(env, forge(body), FormatError)
    assert len(str(err)) < 1000 and "characters)" in str(err), str(err)[:300]


@pytest.mark.parametrize("where", ["top", "tensor"])
def test_a_key_repeated_in_one_object_is_named(env, where):
    """JSON keeps the last of repeated keys, so such a manifest fails its checksum, which was all the
    error said ("checksum mismatch") though the file is not damaged but odd: the key is named."""
    text = forge(env.body()).decode()
    text = (text.replace('"created":', '"created":1,"created":', 1) if where == "top"
            else text.replace('"dtype":"float32"', '"dtype":"float32","dtype":"float32"', 1))
    err = refused(env, text.encode(), FormatError)
    assert "checksum mismatch" in str(err) and ("key 'created'" if where == "top" else "key 'dtype'") in str(err)


def test_an_unknown_format_version_is_not_echoed_whole(env):
    """Checked before the checksum, so no forging needed: 10 MB of version came back as 10 MB of error."""
    body = env.body()
    body["format_version"] = "9" * 1_000_000
    err = refused(env, json.dumps(body).encode(), FormatError)
    assert len(str(err)) < 1000 and "is not supported" in str(err), str(err)[:300]


def test_huge_files_are_not_read(env):
    big = env.root / "evil.ckpt"
    with open(big, "wb") as f:  # a sparse 65 MiB "manifest": refused by its size, unread
        f.write(b'{"_checkrun":"manifest"')
        f.truncate(65 << 20)
    with CheckpointEngine(config()) as engine, pytest.raises(CorruptCheckpointError, match="more than"):
        engine.load(big)
    other = env.root / "data.bin"
    with open(other, "wb") as f:  # a big file of another kind: said so, not "too large a manifest"
        f.write(b"PK\x03\x04")
        f.truncate(65 << 20)
    with CheckpointEngine(config()) as engine, pytest.raises(NotACheckpointError, match="not a checkrun checkpoint"):
        engine.load(other)
    body = env.body()
    ref = body["objects"][0]["blob"] = env.put_blob(b"x" * 100)
    blob = env.root / ".checkrun" / "blobs" / ref["key"][:2] / ref["key"][2:]
    with open(blob, "r+b") as f:  # the blob grew far beyond its declared size (sparse: no disk)
        f.truncate(1 << 30)
    refused(env, forge(body), CorruptCheckpointError, match="more than the allowed 100")


# ------------------------------------------------------------------------- decompression bombs
ZSTD_ONLY = [{"name": "raw", "version": 1}, {"name": "zstd", "version": 1, "level": 1, "threads": 0}]


def _bomb_chunk(env: Env, payload: bytes, rows: int = 64, cols: int = 64,
                codecs: list | None = None) -> bytes:
    body = env.body()
    rec = body["tensors"][1]
    rec["shape"] = [rows, cols]
    rec["codecs"] = codecs or ZSTD_ONLY
    rec["base"] = [{"off": 0, "rows": rows, "cols": cols, "blob": env.put_blob(payload)}]
    return forge(body)


def test_zstd_bomb_with_declared_size_is_refused_before_decompressing(env):
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(512 << 20))  # 512 MiB of zeros
    assert len(bomb) < 100_000
    err = refused(env, _bomb_chunk(env, bomb), FormatError)
    assert "decompression bomb" in str(err) and ".checkrun/blobs/" in str(err)
    small = _bomb_chunk(env, bomb, rows=4, cols=4)  # smaller chunk: refused even before zstd
    assert "exceeds the limit" in str(refused(env, small, FormatError))
    # The same frame as one byte plane of a shuffle_zstd blob (the default pipeline).
    plane = 64 * 64
    segments = [(1, bomb), (0, bytes(plane)), (0, bytes(plane)), (0, bytes(plane)), (0, b"")]
    header = b"".join(_varint(2 * len(p) + k) for k, p in segments)
    blob = header + b"".join(p for _, p in segments)
    shuffled = [{"name": "raw", "version": 1},
                {"name": "shuffle_zstd", "version": 1, "itemsize": 4, "level": 1, "threads": 0}]
    err = refused(env, _bomb_chunk(env, blob, codecs=shuffled), FormatError)
    assert "decompression bomb" in str(err) and ".checkrun/blobs/" in str(err)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def test_zstd_bomb_without_declared_size_is_refused(env):
    cctx = zstandard.ZstdCompressor(level=19, write_content_size=False)
    obj = cctx.compressobj()
    bomb = obj.compress(bytes(256 << 20)) + obj.flush()
    assert zstandard.frame_content_size(bomb) < 0
    refused(env, _bomb_chunk(env, bomb), FormatError)


def test_concatenated_frames_are_refused(env):
    frame = zstandard.ZstdCompressor().compress(bytes(16 * 16 * 4))
    refused(env, _bomb_chunk(env, frame * 1000), FormatError)


def test_int8_block_with_a_huge_block_size_stays_bounded(env):
    body = env.body()
    rec = body["tensors"][1]
    payload = bytes(4) + bytes(64 * 64)  # one float32 scale (0.0), then 4096 int8 codes
    rec["codecs"] = [{"name": "int8_block", "version": 1, "block_size": 2 ** 40}]
    rec["base"] = [{"off": 0, "rows": 64, "cols": 64, "blob": env.put_blob(payload)}]
    rec["quant"] = None
    (env.root / "evil.ckpt").write_bytes(forge(body))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with CheckpointEngine(config()) as engine:
        try:
            state = engine.load(env.root / "evil.ckpt")
            assert torch.equal(state["w"], torch.zeros(64, 64))  # a valid (if odd) encoding
        except CheckrunError:
            pass  # refusing it is fine too
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) < 256 * 1024


# ---------------------------------------------------------------------------------- nesting
def test_json_nested_100k_deep(env):
    deep = b"[" * 100_000 + b"]" * 100_000
    data = b'{"_checkrun":"manifest","format_version":1,"skeleton":' + deep + b"}"
    refused(env, data, FormatError)
    deep_dicts = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    refused(env, b'{"_checkrun":"manifest","format_version":1,"meta":' + deep_dicts + b"}", FormatError)


@pytest.mark.parametrize("depth", [600, 900])
def test_skeleton_nested_deeper_than_the_limit(env, depth):
    body = env.body()
    skeleton: object = {"$t": 0}
    for _ in range(depth):
        skeleton = [skeleton]
    body["skeleton"] = skeleton
    try:
        data = forge(body)
    except RecursionError:
        pytest.skip("json cannot even serialise this depth here")
    refused(env, data, FormatError)


# ----------------------------------------------------------------------------------- pickles
class _Payload:
    """Unpickling this calls ``open(marker, "w")``: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _torch_payload(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"x": _Payload(marker)}, buf)
    return buf.getvalue()


def _object_manifest(env: Env, payload: bytes, type_name: str = "builtins.dict") -> bytes:
    body = env.body()
    body["objects"][0] = {"key": "obj", "type": type_name, "blob": env.put_blob(payload)}
    return forge(body)


def test_the_pickle_payload_is_live(tmp_path):
    """Control: without the weights_only guard the payload really runs (so the tests below mean
    something)."""
    proof = tmp_path / "proof"
    torch.load(io.BytesIO(_torch_payload(proof)), weights_only=False)
    assert proof.exists()


def test_malicious_pickle_in_an_object_blob_does_not_execute(env):
    err = refused(env, _object_manifest(env, _torch_payload(env.marker)), UnsafeLoadError,
                  verify_detects=False)
    assert "weights_only" in str(err)


def test_raw_pickle_in_an_object_blob_does_not_execute(env):
    import pickle

    raw = pickle.dumps(_Payload(env.marker), protocol=2)
    refused(env, _object_manifest(env, raw), CorruptCheckpointError)
    legacy = io.BytesIO()
    torch.save(_Payload(env.marker), legacy, _use_new_zipfile_serialization=False)
    refused(env, _object_manifest(env, legacy.getvalue()), CorruptCheckpointError)


def _record_start(data: bytes, suffix: str) -> int:
    """Offset of the content of the zip record whose name ends with ``suffix``."""
    import zipfile

    info = next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(suffix))
    h = info.header_offset
    return h + 30 + int.from_bytes(data[h + 26:h + 28], "little") + int.from_bytes(data[h + 28:h + 30], "little")


@pytest.mark.parametrize("record", ["/.storage_alignment", "/byteorder"])
def test_a_well_formed_zip_with_a_damaged_record_is_corruption_and_verify_finds_it(env, record):
    """A value blob damaged before its checksum was computed (or forged): torch.load raised a bare
    ValueError/... through load and export, and verify, which did not unpickle values, said OK
    (found by an independent fuzzer)."""
    buf = io.BytesIO()
    torch.save({"x": torch.arange(4)}, buf)
    data = bytearray(buf.getvalue())
    data[_record_start(bytes(data), record)] = 0
    err = refused(env, _object_manifest(env, bytes(data)), CorruptCheckpointError, match="not a valid torch.save")
    assert ".checkrun/blobs/" in str(err)


def test_malicious_pickle_behind_an_allowed_type_name_does_not_execute(env):
    """The manifest's ``type`` is only a label: claiming an allow-listed type changes nothing."""
    data = _object_manifest(env, _torch_payload(env.marker), type_name=f"{Marker.__module__}.Marker")
    refused(env, data, UnsafeLoadError, verify_detects=False)


def test_not_a_checkpoint(env):
    refused(env, b"\x80\x04not json at all", NotACheckpointError)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    refused(env, buf.getvalue(), NotACheckpointError)
