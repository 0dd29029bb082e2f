"""Fuzzing the hostile-input boundary with hypothesis: the manifest parser, the codec pipeline
decoders, and whole loads of forged checkpoints. Whatever the input, the outcome is a value or a
``CheckrunError`` subclass: never another exception, never output beyond the declared bound.

CI runs ``CHECKRUN_FUZZ_EXAMPLES`` (default 200) examples per test, derandomized (the same
examples every run). Setting the variable runs that many random examples instead, e.g.::

    CHECKRUN_FUZZ_EXAMPLES=20000 python -m pytest tests/reliability/test_fuzz.py -p no:cacheprovider
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.codecs import Pipeline
from ckpt_core.errors import CheckrunError, FormatError
from ckpt_core.format.manifest import DTYPES, MAGIC_PREFIX, Manifest, _body_checksum, parse_manifest

from .crash_child import Marker

EXAMPLES = int(os.environ.get("CHECKRUN_FUZZ_EXAMPLES", "200"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, derandomize="CHECKRUN_FUZZ_EXAMPLES" not in os.environ,
                database=None, suppress_health_check=list(HealthCheck))
LIMIT = 1 << 22


def config() -> EngineConfig:
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 4096},
        "load": {"allowed_globals": [f"{Marker.__module__}.Marker"], "max_blob_bytes": LIMIT},
        "saving": {"sigterm_grace_seconds": None},
        "storage": {"fsync": False},  # durability against power loss is not what is tested here
    })


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real directory with two checkpoints (the second a row delta of the first)."""
    root = tmp_path_factory.mktemp("fuzz") / "run"
    emb = torch.randn(1024, 8)
    with CheckpointEngine(config()) as engine:
        engine.save({"emb": emb, "w": torch.randn(16, 16), "obj": Marker(1), "n": (1, 2.5)},
                    root / "a.ckpt").result()
        emb[3] += 1
        engine.save({"emb": emb, "w": torch.randn(16, 16), "obj": Marker(2), "n": (1, 2.5)},
                    root / "b.ckpt").result()
    yield root
    if "engine" in _ENGINE:
        _ENGINE.pop("engine").close()


def forge(body: dict) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = _body_checksum(body)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse(data: bytes) -> Manifest | None:
    try:
        return parse_manifest(data, "fuzz.ckpt", max_blob_bytes=LIMIT)
    except CheckrunError as exc:
        assert "fuzz.ckpt" in str(exc)
        return None


# ------------------------------------------------------------------------------------ manifest
@fuzz
@given(st.binary(max_size=4096), st.booleans())
def test_parser_on_arbitrary_bytes(data, with_header):
    parse(MAGIC_PREFIX + data if with_header else data)


@fuzz
@given(st.data())
def test_any_byte_change_to_a_real_manifest_is_refused(real, data):
    original = (real / "b.ckpt").read_bytes()
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        kind = data.draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        i = data.draw(st.integers(0, len(buf) - 1))
        if kind == "set":
            buf[i] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del buf[i: i + data.draw(st.integers(1, 8))]
        else:
            del buf[i:]
        if not buf:
            break
    assume(bytes(buf) != original)
    assert parse(bytes(buf)) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40) | st.sampled_from(["", "0" * 32, "../x", "float32", "raw", "zstd", "$t", "$o"]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["key", "size", "csum", "rows", "cols", "off", "n", "idx", "chunks", "name", "version",
                         "dtype", "shape", "codecs", "base", "deltas", "$t", "$o", "$d", "$p", "$f", "x"]),
        inner, max_size=5),
    max_leaves=20)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def replace_fields(data, doc: dict, values, keep: tuple = ()) -> None:
    """Replace 1-3 fields of the JSON document ``doc`` (at any depth; not the top-level keys in
    ``keep``) by values drawn from ``values``, one after the other (a later one may be inside an
    earlier replacement)."""
    paths = [p for p in _paths(doc) if p and p[0] not in keep]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = data.draw(values, label=f"value at {path}")
        paths = [p for p in _paths(doc) if p and p[0] not in keep]


@fuzz
@given(st.data())
def test_forged_manifests_load_or_fail_with_checkrun_errors(real, data):
    """An attacker's manifest (valid checksum) with fields replaced by arbitrary JSON, loaded for
    real against the real blobs: a state or a CheckrunError."""
    body = json.loads((real / data.draw(st.sampled_from(["a.ckpt", "b.ckpt"]))).read_bytes())
    replace_fields(data, body, JSON, keep=("checksum", "_checkrun"))
    try:
        raw = forge(body)
    except (ValueError, RecursionError):
        return
    evil = real / "evil.ckpt"
    evil.write_bytes(raw)
    engine = _ENGINE.setdefault("engine", CheckpointEngine(config()))
    try:
        try:
            engine.load(evil)
        except CheckrunError:
            pass
        engine.verify(evil)
    finally:
        evil.unlink()


_ENGINE: dict = {}  # one engine for all examples (the module fixture closes it)


# ------------------------------------------------------------------------------------ decoders
CODEC = st.one_of(
    st.just({"name": "raw", "version": 1}),
    st.builds(lambda to: {"name": "cast", "version": 1, "to": to}, st.sampled_from(["bfloat16", "float16", "x"])),
    st.builds(lambda b, bs, sd, g: {"name": "uniform", "version": 1, "bits": b, "block_size": bs,
                                    "scale_dtype": sd, "greedy": g},
              st.sampled_from([2, 3, 4, 8, 5, 0]), st.one_of(st.none(), st.integers(-1, 2**41)),
              st.sampled_from(["fp16", "fp32", "fp8"]), st.booleans()),
    st.builds(lambda bs: {"name": "int8_block", "version": 1, "block_size": bs}, st.integers(-1, 2**41)),
)
BYTES_CODEC = st.one_of(
    st.builds(lambda n: {"name": "shuffle", "version": 1, "itemsize": n}, st.integers(0, 70)),
    st.builds(lambda lv: {"name": "zstd", "version": 1, "level": lv, "threads": 0}, st.integers(-5, 22)),
)


@fuzz
@given(st.lists(CODEC | BYTES_CODEC, min_size=0, max_size=4), st.binary(max_size=2048),
       st.integers(0, 40), st.integers(0, 40), st.sampled_from(sorted(DTYPES)), st.integers(0, 1 << 16))
def test_decoders_on_arbitrary_input(specs, blob, rows, cols, dtype, limit):
    try:
        pipe = Pipeline.from_list(specs)
    except FormatError:
        return
    try:
        out = pipe.decode(blob, (rows, cols), DTYPES[dtype], limit)
    except FormatError:
        return
    assert tuple(out.shape) == (rows, cols) and out.dtype == DTYPES[dtype]
    assert out.numel() * out.element_size() <= limit


def _pipelines():
    from ckpt_core.codecs import CastCodec, Int8BlockCodec, RawCodec, ShuffleCodec, UniformCodec, ZstdCodec

    return [Pipeline(RawCodec(), (ShuffleCodec(4), ZstdCodec(1, 0))), Pipeline(RawCodec()),
            Pipeline(CastCodec("bfloat16"), (ZstdCodec(3, 0),)), Pipeline(UniformCodec(4, None, "fp16", True)),
            Pipeline(UniformCodec(3, 16, "fp32", False), (ZstdCodec(1, 0),)), Pipeline(Int8BlockCodec(32))]


@fuzz
@given(st.sampled_from(range(6)), st.integers(1, 24), st.integers(1, 24), st.data())
def test_damaged_encodings_decode_or_fail_cleanly(which, rows, cols, data):
    pipe = _pipelines()[which]
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * 100 + cols))
    encoded = bytearray(bytes(pipe.encode(x)[0]))
    for _ in range(data.draw(st.integers(1, 3))):
        if not encoded:
            break
        i = data.draw(st.integers(0, len(encoded) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "grow"]))
        if op == "flip":
            encoded[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del encoded[i:]
        else:
            encoded[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    limit = 2 * rows * cols * 4 + 16 * rows + 4096  # what the reader allows for a chunk
    try:
        out = pipe.decode(bytes(encoded), (rows, cols), torch.float32, limit)
    except FormatError:
        return
    assert tuple(out.shape) == (rows, cols) and out.dtype == torch.float32


def test_real_manifest_round_trips(real):
    for name in ("a.ckpt", "b.ckpt"):
        data = (real / name).read_bytes()
        m = parse_manifest(data, name, max_blob_bytes=LIMIT)
        assert m.to_bytes() == data
        assert parse_manifest(copy.copy(m).to_bytes(), name, max_blob_bytes=LIMIT) == m
