"""Codec pipelines: lossless round trips, composition, manifest form, and hostile input."""
from __future__ import annotations

import json
import platform
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_core.codecs import (CastCodec, Int8BlockCodec, Pipeline, RawCodec, ShuffleCodec, ShuffleZstdCodec,
                              UniformCodec, ZstdCodec, codec_from_dict, dtype_itemsize, lossless_pipeline)
from ckpt_core.saving.plan import pipeline_for_rule
from ckpt_core.codecs import shuffle as shuffle_module
from ckpt_core.config import CompressionConfig, QuantRule
from ckpt_core.errors import FormatError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
SHAPES = [(1, 0), (0, 3), (1, 1), (3, 7), (17, 33), (1, 1001)]
COMPRESSIONS = {
    "default": CompressionConfig(),
    "no-shuffle": CompressionConfig(shuffle=False),
    "no-compress": CompressionConfig(compress=False),
    "zstd3-threads2": CompressionConfig(zstd_level=3, zstd_threads=2),
}
LIMIT = 1 << 26


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Codec work is many small torch calls; on a busy 2-core runner torch's intra-op thread
    team (busy-waiting at each barrier) makes them 10x slower and the timings erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_tensor(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (nan/inf included for floats); bool only 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = shape[0] * shape[1] * dtype_itemsize(dtype)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


# ---------------------------------------------------------------- lossless round trips

@pytest.mark.parametrize("compression", COMPRESSIONS.values(), ids=COMPRESSIONS.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_round_trip_is_bit_exact(dtype, shape, compression):
    x = random_tensor(shape, dtype)
    pipe = lossless_pipeline(dtype, compression)
    data, stats = pipe.encode(x)
    y = pipe.decode(bytes(data), shape, dtype, LIMIT)
    assert same_bits(x, y) and y.is_contiguous()
    assert stats.max_abs_error == stats.sq_error_sum == 0.0
    assert not pipe.lossy


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.sampled_from([1, 2, 4, 8]), level=st.integers(1, 5))
def test_raw_shuffle_zstd_round_trip_property(data, itemsize, level):
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[itemsize]
    data = data[:len(data) // itemsize * itemsize]
    x = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(1, -1) if data else \
        torch.empty((1, 0), dtype=dtype)
    pipe = Pipeline(RawCodec(), (ShuffleCodec(itemsize), ZstdCodec(level)))
    enc, _ = pipe.encode(x)
    assert same_bits(pipe.decode(enc, tuple(x.shape), dtype, LIMIT), x)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=500), itemsize=st.integers(1, 16))
def test_shuffle_inverse_and_tail_property(data, itemsize):
    codec = ShuffleCodec(itemsize)
    enc = bytes(codec.encode(data))
    assert len(enc) == len(data)
    assert bytes(codec.decode(enc, len(data))) == data
    n = len(data) // itemsize
    body = np.frombuffer(data, np.uint8)[:n * itemsize].reshape(n, itemsize)
    assert enc[:n * itemsize] == body.T.tobytes()          # byte 0 of every element first
    assert enc[n * itemsize:] == data[n * itemsize:]      # tail left unshuffled at the end


@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.sampled_from([2, 3, 4, 8]), level=st.integers(-3, 5))
def test_shuffle_zstd_round_trip_property(data, itemsize, level):
    codec = ShuffleZstdCodec(itemsize, level)
    enc = bytes(codec.encode(data))
    assert bytes(codec.decode(enc, len(data))) == data
    out = memoryview(bytearray(len(data)))
    codec.decode_into(enc, out, lambda n: memoryview(bytearray(n)))
    assert bytes(out) == data


def shuffle_zstd_segments(blob: bytes, itemsize: int) -> tuple[list[tuple[int, int]], int]:
    """(kind, length) of each segment (kind 0 raw, 1 zstd) and the header's size in bytes."""
    segments, pos = [], 0
    for _ in range(itemsize + 1):
        value = shift = 0
        while True:
            byte = blob[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        segments.append((value & 1, value >> 1))
    return segments, pos


def shuffle_zstd_blob(segments: list[tuple[int, bytes]]) -> bytes:
    """A blob with these (kind, payload) segments (any header values, for hostile input)."""
    def varint(v):
        out = bytearray()
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        return bytes(out + bytes([v]))
    return b"".join(varint(2 * len(p) + k) for k, p in segments) + b"".join(p for _, p in segments)


@pytest.mark.parametrize("n", [2000, 300_000])  # below / above the size from which planes are probed
def test_shuffle_zstd_stores_incompressible_planes_raw(n):
    # Low byte random, high byte from a handful of values: plane 0 raw, plane 1 one zstd frame.
    rng = np.random.default_rng(n)
    words = rng.integers(0, 256, n, dtype=np.uint16) | (rng.integers(60, 64, n, dtype=np.uint16) << 8)
    data = words.tobytes() + b"\x07"  # and a 1-byte tail
    codec = ShuffleZstdCodec(2)
    enc = bytes(codec.encode(data))
    [(k0, l0), (k1, l1), (k2, l2)], head = shuffle_zstd_segments(enc, 2)
    assert (k0, l0) == (0, n) and k1 == 1 and l1 < n // 3 and (k2, l2) == (0, 1)
    assert len(enc) == head + l0 + l1 + l2 and head <= 3 * 3
    assert enc[head:head + n] == (words & 0xFF).astype(np.uint8).tobytes()  # the raw plane, as is
    assert bytes(codec.decode(enc, len(data))) == data
    # A compressible plane before a raw one: the raw plane moves down over the frame's spare room.
    swapped = ((words >> 8) | (words << 8)).astype(np.uint16).tobytes()
    enc = bytes(codec.encode(swapped))
    assert [k for k, _ in shuffle_zstd_segments(enc, 2)[0]] == [1, 0, 0]
    assert bytes(codec.decode(enc, len(swapped))) == swapped


def test_shuffle_zstd_compresses_zero_regions_of_random_planes():
    # Half the rows zero (untouched embedding rows): the probe must not call the planes random.
    x = torch.randn(600, 1024)
    x[::2] = 0
    data = x.numpy().tobytes()
    enc = bytes(ShuffleZstdCodec(4).encode(data))
    assert [k for k, _ in shuffle_zstd_segments(enc, 4)[0]][:4] == [1, 1, 1, 1]
    assert len(enc) < 0.6 * len(data)


def test_shuffle_zstd_small_chunks_have_a_small_header():
    codec = ShuffleZstdCodec(4)
    assert len(bytes(codec.encode(b"\x00\x00\x80\x3f"))) == 4 + 5  # a scalar: 1 byte per segment
    assert bytes(codec.decode(codec.encode(b""), 0)) == b""


def test_shuffle_zstd_refuses_malformed_segments():
    data = np.random.default_rng(3).integers(0, 8, 4001, dtype=np.uint8).tobytes()
    codec = ShuffleZstdCodec(4)
    enc = bytes(codec.encode(data))
    assert bytes(codec.decode(enc, len(data))) == data
    segs, head = shuffle_zstd_segments(enc, 4)
    payloads, pos = [], head
    for kind, length in segs:
        payloads.append((kind, enc[pos:pos + length]))
        pos += length
    assert shuffle_zstd_blob(payloads) == enc
    plane = np.frombuffer(data[:4000], np.uint8).reshape(1000, 4)[:, 0].tobytes()
    raw_plane = (0, plane)
    bad_blobs = {
        "cut off": enc[:2],
        "longer than": b"\xff" * 11,
        "tail segment is marked": shuffle_zstd_blob(payloads[:4] + [(1, payloads[4][1])]),
        "runs past the end": shuffle_zstd_blob(payloads)[:-1],
        "after the last segment": enc + b"\0",
        "raw plane 1 holds 999": shuffle_zstd_blob([raw_plane, (0, plane[:999])] + payloads[2:]),
        "raw plane 0 holds 1001": shuffle_zstd_blob([(0, plane + b"x")] + payloads[1:]),
        "zstd": shuffle_zstd_blob([(1, b"not a zstd frame")] + payloads[1:]),
    }
    out = memoryview(bytearray(len(data)))
    for match, bad in bad_blobs.items():
        with pytest.raises(FormatError):
            codec.decode(bad, 1 << 20)
        with pytest.raises(FormatError, match=match):
            codec.decode_into(bad, out)
    with pytest.raises(FormatError, match="tail"):  # 4001 bytes: the output must have a 1-byte tail
        codec.decode_into(enc, memoryview(bytearray(4000)))
    with pytest.raises(FormatError):
        codec.decode_into(enc, memoryview(bytearray(4005)))
    with pytest.raises(FormatError, match="limit"):
        codec.decode(enc, 4000)


@pytest.fixture(params=["native", "numpy"])
def shuffle_backend(request, monkeypatch):
    """Run a test with the C kernels of ckpt_core._cshuffle and again with the numpy code."""
    if request.param == "numpy":
        monkeypatch.setattr(shuffle_module, "_NATIVE", None)
    elif not shuffle_module.native_available():
        pytest.skip("ckpt_core._cshuffle was not built")
    return request.param


@pytest.mark.parametrize("itemsize", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 47, 1000, 300_001])
def test_shuffle_kernels_match_a_transpose(shuffle_backend, itemsize, n):
    rng = np.random.default_rng(n + itemsize)
    # One byte in: source and destination start at odd addresses, as views into blobs do.
    src = rng.integers(0, 256, n * itemsize + 1, dtype=np.uint8)[1:]
    planes = [np.full(n + 1, 7, np.uint8)[1:] for _ in range(itemsize)]
    shuffle_module.shuffle_into(src, planes)
    want = src.reshape(n, itemsize).T
    assert all(np.array_equal(planes[k], want[k]) for k in range(itemsize))
    out = np.zeros(n * itemsize + 3, np.uint8)
    shuffle_module.unshuffle_into(planes, out[1:])
    assert np.array_equal(out[1:n * itemsize + 1], src) and out[0] == 0 and not out[-2:].any()


@pytest.mark.parametrize("sizes", [(4, 8, 4), (2, 4, 8, 8, 2), (4, 3, 8)])
def test_shuffle_many_matches_one_by_one(shuffle_backend, sizes):
    """The step log's encoder shuffles a step's packs in one call (``shuffle_many``); a job the C kernels
    do not take (3-byte elements) sends the whole batch down the one-by-one path, same bytes."""
    rng = np.random.default_rng(len(sizes))
    jobs, want = [], []
    for j, k in enumerate(sizes):
        n = [17, 1000, 0, 4099, 33][j]
        src = rng.integers(0, 256, n * k + 1, dtype=np.uint8)[1:]
        jobs.append((src, [np.full(n + 1, 7, np.uint8)[1:] for _ in range(k)]))
        want.append(src.reshape(n, k).T)
    shuffle_module.shuffle_many(jobs)
    assert all(np.array_equal(planes[k], w[k]) for (_, planes), w in zip(jobs, want) for k in range(len(planes)))


def test_shuffle_kernels_never_write_into_read_only_buffers(shuffle_backend):
    planes = [np.frombuffer(bytes(range(k, k + 32)), np.uint8) for k in range(4)]
    with pytest.raises(ValueError):
        shuffle_module.unshuffle_into(planes, np.frombuffer(bytes(128), np.uint8))
    with pytest.raises(ValueError):
        shuffle_module.shuffle_into(np.zeros(128, np.uint8), planes)
    with pytest.raises(ValueError):
        shuffle_module.shuffle_many([(np.zeros(128, np.uint8), planes)])
    assert all(bytes(p) == bytes(range(k, k + 32)) for k, p in enumerate(planes))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None,
                    reason="the C kernels are built for x86-64 with a C compiler")
def test_c_shuffle_kernels_were_built():
    # pip install builds ckpt_core._cshuffle where a compiler exists; losing it silently would
    # triple the CPU of every shuffle and unshuffle.
    assert shuffle_module.native_available()


def test_shuffle_small_example_and_identity():
    assert bytes(ShuffleCodec(2).encode(b"\x01\x02\x03\x04\x05")) == b"\x01\x03\x02\x04\x05"
    assert bytes(ShuffleCodec(1).encode(b"abc")) == b"abc"


def test_raw_encode_is_zero_copy():
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    data, _ = RawCodec().encode(x)
    assert isinstance(data, memoryview)
    assert np.shares_memory(np.asarray(data), x.numpy())
    bf = torch.ones(2, 3, dtype=torch.bfloat16)  # no numpy dtype: goes through a uint8 view
    assert bytes(RawCodec().encode(bf)[0]) == bf.view(torch.uint8).numpy().tobytes()


def test_raw_decode_of_read_only_bytes_gives_a_writable_tensor():
    x = torch.randn(4, 5)
    y = RawCodec().decode(x.numpy().tobytes(), (4, 5), torch.float32)
    y += 1  # must not raise (bytes are immutable, so the codec copied)
    assert torch.equal(y, x + 1)


def test_zstd_frame_has_content_size_and_no_checksum():
    # The blob's own checksum (xxh3-64 in the manifest) is checked before any codec runs; zstd's
    # XXH64 of the content would only add ~20% to decoding.
    payload = bytes(range(256)) * 40
    for threads in (0, 2):
        frame = ZstdCodec(1, threads).encode(payload)
        params = zstandard.get_frame_parameters(frame)
        assert params.content_size == len(payload) and not params.has_checksum
        assert ZstdCodec().decode(frame, len(payload)) == payload


def test_zstd_frames_of_earlier_versions_have_their_checksum_verified():
    payload = np.random.default_rng(0).integers(0, 4, 20000, dtype=np.uint8).tobytes()
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(payload)
    out = memoryview(bytearray(len(payload)))
    ZstdCodec().decode_into(frame, out)
    assert bytes(out) == payload and ZstdCodec().decode(frame, 1 << 20) == payload
    bad = bytearray(frame)
    bad[-1] ^= 0xFF  # the checksum itself
    with pytest.raises(FormatError):
        ZstdCodec().decode(bytes(bad), 1 << 20)
    with pytest.raises(FormatError):
        ZstdCodec().decode_into(bytes(bad), out)


def test_codecs_are_thread_safe():
    pipe = lossless_pipeline(torch.float32, CompressionConfig())
    tensors = [torch.randn(64, 257, generator=torch.Generator().manual_seed(i)) for i in range(16)]
    expected = [bytes(pipe.encode(t)[0]) for t in tensors]
    barrier = threading.Barrier(4)

    def work(i):
        if i < 4:
            barrier.wait()
        data = bytes(pipe.encode(tensors[i])[0])
        return data, pipe.decode(data, (64, 257), torch.float32, LIMIT)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(16)))
    for (data, y), exp, t in zip(results, expected, tensors):
        assert data == exp and torch.equal(y, t)


# ---------------------------------------------------------------- composition and manifest form

def test_lossless_pipeline_composition():
    c = CompressionConfig(zstd_level=4, zstd_threads=1)
    assert lossless_pipeline(torch.float32, c) == Pipeline(RawCodec(), (ShuffleZstdCodec(4, 4, 1),))
    assert lossless_pipeline(torch.uint8, c) == Pipeline(RawCodec(), (ZstdCodec(4, 1),))
    assert lossless_pipeline(torch.bool, c).stages == (ZstdCodec(4, 1),)
    assert lossless_pipeline(torch.complex64, c).stages == (ShuffleZstdCodec(8, 4, 1),)
    assert lossless_pipeline(torch.bfloat16, CompressionConfig()).stages == (ShuffleZstdCodec(2, 1, 0),)
    assert lossless_pipeline(torch.float32, CompressionConfig(shuffle=False)).stages == (ZstdCodec(1, 0),)
    # Raw bytes means raw: shuffling without compressing would only cost time.
    assert lossless_pipeline(torch.float32, CompressionConfig(compress=False)) == Pipeline(RawCodec(), ())


@pytest.mark.parametrize("compress", [True, False])
def test_pipeline_for_rule(compress):
    comp = CompressionConfig(compress=compress)
    tail = (ZstdCodec(1, 0),) if compress else ()
    rule = QuantRule("*", method="uniform", bits=3, greedy=False, scale_dtype="fp32", block_size=64)
    assert pipeline_for_rule(rule, torch.float32, 2, comp) == Pipeline(
        UniformCodec(3, None, "fp32", False), tail)
    assert pipeline_for_rule(rule, torch.float32, 1, comp).array == UniformCodec(3, 64, "fp32", False)
    adaptive = QuantRule("*", method="adaptive", expected_restores=10)
    assert pipeline_for_rule(adaptive, torch.float16, 2, comp).array.bits == 4
    bf16 = pipeline_for_rule(QuantRule("*", method="bf16"), torch.float32, 2, comp)
    assert bf16 == Pipeline(CastCodec("bfloat16"), (ShuffleZstdCodec(2, 1, 0),) if compress else ())
    assert pipeline_for_rule(QuantRule("*", method="fp16"), torch.float64, 3, comp).array == CastCodec("float16")
    int8 = pipeline_for_rule(QuantRule("*", method="int8_block", block_size=128), torch.float32, 2, comp)
    assert int8 == Pipeline(Int8BlockCodec(128), tail) and int8.lossy
    with pytest.raises(ValueError):
        pipeline_for_rule(rule, torch.int64, 2, comp)


LEGACY_LOSSLESS = Pipeline(RawCodec(), (ShuffleCodec(4), ZstdCodec(1, 0)))  # the default until 2026-12
ALL_PIPELINES = [
    lossless_pipeline(torch.float32, CompressionConfig()),
    Pipeline(UniformCodec(4, None, "fp16", True), (ZstdCodec(3),)),
    Pipeline(UniformCodec(3, 256, "fp32", False), ()),
    Pipeline(CastCodec("float16"), (ShuffleCodec(2), ZstdCodec(1))),
    Pipeline(Int8BlockCodec(64), (ZstdCodec(1, 2),)),
    LEGACY_LOSSLESS,
]


@pytest.mark.parametrize("pipe", ALL_PIPELINES, ids=lambda p: p.array.name)
def test_manifest_form_round_trips(pipe):
    specs = pipe.to_list()
    assert json.loads(json.dumps(specs)) == specs
    again = Pipeline.from_list(json.loads(json.dumps(specs)))
    assert again == pipe and again.spec_id == pipe.spec_id
    assert len(pipe.spec_id) == 16


NEW_SPEC_ID = "72604e38ff637ff8"


def test_spec_id_is_stable_and_distinguishes_params():
    # Golden value: content addresses depend on it, so it must never change between releases.
    assert LEGACY_LOSSLESS.spec_id == "c7abb9816a06c457"
    # Delta row indices: a pipeline the manifest does not record, so it is fixed forever.
    from ckpt_core.codecs import index_pipeline
    assert index_pipeline() == Pipeline(RawCodec(), (ShuffleCodec(8), ZstdCodec(1, 0)))
    assert lossless_pipeline(torch.float32, CompressionConfig()).spec_id == NEW_SPEC_ID
    ids = {p.spec_id for p in ALL_PIPELINES}
    ids.add(Pipeline(UniformCodec(4, None, "fp16", False), (ZstdCodec(3),)).spec_id)
    assert len(ids) == len(ALL_PIPELINES) + 1


def test_encode_rejects_non_2d():
    with pytest.raises(ValueError):
        lossless_pipeline(torch.float32, CompressionConfig()).encode(torch.zeros(2, 2, 2))


# ---------------------------------------------------------------- hostile input

@pytest.mark.parametrize("pipe", ALL_PIPELINES, ids=lambda p: p.array.name)
def test_truncated_or_padded_data_is_refused(pipe):
    x = torch.randn(5, 301)
    data = bytes(pipe.encode(x)[0])
    for bad in (data[:-1], data[: len(data) // 2], data + b"\0", b""):
        with pytest.raises(FormatError):
            pipe.decode(bad, (5, 301), torch.float32, LIMIT)


@pytest.mark.parametrize("pipe", ALL_PIPELINES, ids=lambda p: p.array.name)
def test_wrong_shape_is_refused(pipe):
    data = bytes(pipe.encode(torch.randn(5, 301))[0])
    for shape in [(5, 300), (4, 301), (301, 6), (-1, 301), (5.0, 301), (5,), "5x301"]:
        with pytest.raises(FormatError):
            pipe.decode(data, shape, torch.float32, LIMIT)


def test_max_bytes_bounds_every_stage():
    pipe = lossless_pipeline(torch.float32, CompressionConfig())
    x = torch.zeros(256, 256)  # 256 KiB that compress to almost nothing
    data = bytes(pipe.encode(x)[0])
    assert torch.equal(pipe.decode(data, (256, 256), torch.float32, 256 * 1024), x)
    with pytest.raises(FormatError):
        pipe.decode(data, (256, 256), torch.float32, 256 * 1024 - 1)


def test_zstd_bomb_is_refused_before_decompressing():
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(64 << 20))
    assert len(bomb) < 10_000
    with pytest.raises(FormatError, match="bomb"):
        ZstdCodec().decode(bomb, 1 << 20)


def test_zstd_frame_without_content_size_is_refused():
    cobj = zstandard.ZstdCompressor().compressobj()
    frame = cobj.compress(b"abc" * 100) + cobj.flush()
    assert zstandard.frame_content_size(frame) == -1
    with pytest.raises(FormatError, match="content size"):
        ZstdCodec().decode(frame, 1 << 20)


def test_corrupt_zstd_is_refused():
    payload = np.random.default_rng(0).integers(0, 4, 20000, dtype=np.uint8).tobytes()
    frame = ZstdCodec().encode(payload)
    codec = ZstdCodec()
    for pos in (4, 5):  # frame header: descriptor, content size
        bad = bytearray(frame)
        bad[pos] ^= 0xFF
        with pytest.raises(FormatError):
            codec.decode(bytes(bad), 1 << 20)
    for bad in (b"", b"not a zstd frame at all", frame + frame, frame + b"x"):
        with pytest.raises(FormatError):
            codec.decode(bad, 1 << 20)


@pytest.mark.parametrize("spec", [
    [],
    "raw",
    [{"name": "nope", "version": 1}],
    [{"name": "raw", "version": 2}],
    [{"name": "raw"}],
    [{"version": 1}],
    ["raw"],
    [{"name": "raw", "version": 1, "extra": 1}],
    [{"name": "zstd", "version": 1, "level": 1, "threads": 0}],
    [{"name": "raw", "version": 1}, {"name": "raw", "version": 1}],
    [{"name": "raw", "version": 1}, {"name": "zstd", "version": 1, "level": "high", "threads": 0}],
    [{"name": "raw", "version": 1}, {"name": "zstd", "version": 1, "level": 1, "threads": -1}],
    [{"name": "raw", "version": 1}, {"name": "shuffle", "version": 1, "itemsize": 0}],
    [{"name": "raw", "version": 1}, {"name": "shuffle", "version": 1, "itemsize": True}],
    [{"name": "raw", "version": 1}, {"name": "shuffle_zstd", "version": 1, "itemsize": 1, "level": 1, "threads": 0}],
    [{"name": "raw", "version": 1}, {"name": "shuffle_zstd", "version": 1, "itemsize": 4, "level": "1", "threads": 0}],
    [{"name": "raw", "version": 1}, {"name": "shuffle_zstd", "version": 2, "itemsize": 4, "level": 1, "threads": 0}],
    [{"name": "uniform", "version": 1, "bits": 5, "block_size": None, "scale_dtype": "fp16", "greedy": False}],
    [{"name": "uniform", "version": 1, "bits": 4, "block_size": 0, "scale_dtype": "fp16", "greedy": False}],
    [{"name": "uniform", "version": 1, "bits": 4, "block_size": None, "scale_dtype": "bf16", "greedy": False}],
    [{"name": "uniform", "version": 1, "bits": 4, "block_size": None, "scale_dtype": "fp16", "greedy": 1}],
    [{"name": "cast", "version": 1, "to": "int8"}],
    [{"name": "cast", "version": 1, "to": ["bfloat16"]}],
    [{"name": "int8_block", "version": 1, "block_size": -3}],
], ids=repr)
def test_bad_specs_are_format_errors(spec):
    with pytest.raises(FormatError):
        Pipeline.from_list(spec)


def test_codec_from_dict_rebuilds_each_codec():
    for codec in (RawCodec(), CastCodec("float16"), UniformCodec(2, 32, "fp32", True), Int8BlockCodec(7),
                  ShuffleCodec(3), ZstdCodec(-5, 0), ShuffleZstdCodec(3, -5, 2)):
        assert codec_from_dict(codec.to_dict()) == codec


def test_hostile_quantization_parameters_are_refused():
    codec = UniformCodec(4, None, "fp16", False)
    data = bytearray(codec.encode(torch.randn(3, 10))[0])
    data[0:2] = np.array([np.nan], np.float16).tobytes()  # first row's min
    with pytest.raises(FormatError):
        codec.decode(bytes(data), (3, 10), torch.float32)
    int8 = Int8BlockCodec(4)
    data = bytearray(int8.encode(torch.randn(2, 8))[0])
    data[0:4] = np.array([-1.0], np.float32).tobytes()
    with pytest.raises(FormatError):
        int8.decode(bytes(data), (2, 8), torch.float32)


def test_lossy_decode_refuses_non_float_dtypes():
    for pipe in ALL_PIPELINES[1:-1]:  # the lossy ones
        data = bytes(pipe.encode(torch.randn(2, 8))[0])
        with pytest.raises(FormatError):
            pipe.decode(data, (2, 8), torch.int32, LIMIT)
