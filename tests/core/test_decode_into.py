"""``Pipeline.decode_into``: the load path decodes straight into the destination tensor.

It must give exactly what ``decode`` gives and refuse exactly what ``decode`` refuses.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from ckpt_core.codecs import Pipeline, ShuffleCodec, ZstdCodec, lossless_pipeline
from ckpt_core.saving.plan import pipeline_for_rule
from ckpt_core.config import CompressionConfig, QuantRule
from ckpt_core.errors import FormatError

LIMIT = 1 << 26
PIPELINES = {
    "shuffle+zstd": lossless_pipeline(torch.float32, CompressionConfig()),
    "zstd": lossless_pipeline(torch.float32, CompressionConfig(shuffle=False)),
    "raw": lossless_pipeline(torch.float32, CompressionConfig(compress=False)),
    "zstd-threads": lossless_pipeline(torch.float32, CompressionConfig(zstd_level=3, zstd_threads=2)),
    "uint4": pipeline_for_rule(QuantRule("*", "uniform", bits=4), torch.float32, 2, CompressionConfig()),
    "bf16": pipeline_for_rule(QuantRule("*", "bf16"), torch.float32, 2, CompressionConfig()),
}


class Lender:
    """A ``scratch`` callable that records what it lent."""

    def __init__(self) -> None:
        self.lent: list[tuple[int, int]] = []

    def __call__(self, slot: int, nbytes: int) -> memoryview:
        self.lent.append((slot, nbytes))
        return memoryview(np.full(nbytes, 0xAB, dtype=np.uint8))


@pytest.mark.parametrize("name", PIPELINES)
@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (300, 1001), (0, 5)])
def test_decode_into_equals_decode(name, shape):
    pipe: Pipeline = PIPELINES[name]
    x = torch.randn(shape) * 0.02
    data = bytes(pipe.encode(x)[0])
    expected = pipe.decode(data, shape, torch.float32, LIMIT)
    big = torch.full((shape[0] * shape[1] + 10,), float("nan"))
    out = big[3:3 + shape[0] * shape[1]].view(shape)  # a slice of a larger tensor, as the reader uses
    lender = Lender()
    pipe.decode_into(data, out, LIMIT, lender)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert big[:3].isnan().all() and big[3 + out.numel():].isnan().all()  # nothing written outside
    if name == "shuffle+zstd" and out.numel() > 1000:
        # Only the exponent plane is compressed: decoded into one lent buffer, not allocated;
        # the raw planes are unshuffled straight from the blob.
        assert lender.lent == [(("stage", 0), out.numel())]
    if name == "zstd-threads" and out.numel() > 1000:
        assert lender.lent == [(("stage", 0), out.numel())]


@pytest.mark.parametrize("name", PIPELINES)
def test_decode_into_refuses_what_decode_refuses(name):
    pipe = PIPELINES[name]
    data = bytes(pipe.encode(torch.randn(5, 301))[0])
    out = torch.empty(5, 301)
    for bad in (data[:-1], data[: len(data) // 2], data + b"\0", b""):
        with pytest.raises(FormatError):
            pipe.decode(bad, (5, 301), torch.float32, LIMIT)
        with pytest.raises(FormatError):
            pipe.decode_into(bad, out, LIMIT, Lender())
    with pytest.raises(FormatError):
        pipe.decode_into(data, torch.empty(5, 300), LIMIT)
    with pytest.raises(FormatError, match="limit"):
        pipe.decode_into(data, out, 5 * 301 * 4 - 1)


def test_zstd_decode_into_checks_size_trailing_bytes_and_checksum():
    payload = np.random.default_rng(0).integers(0, 4, 300_000, dtype=np.uint8).tobytes()
    frame = ZstdCodec().encode(payload)
    out = memoryview(bytearray(len(payload)))
    ZstdCodec().decode_into(frame, out)
    assert bytes(out) == payload
    with pytest.raises(FormatError, match="expected"):
        ZstdCodec().decode_into(frame, memoryview(bytearray(len(payload) + 1)))
    with pytest.raises(FormatError, match="after the end"):
        ZstdCodec().decode_into(frame + b"\0\0\0", out)
    with pytest.raises(FormatError, match="after the end"):  # a second, valid frame
        ZstdCodec().decode_into(frame + ZstdCodec().encode(b""), out)
    legacy = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(payload)
    for pos in (len(legacy) // 2, len(legacy) - 1):  # payload, frame checksum (earlier versions)
        bad = bytearray(legacy)
        bad[pos] ^= 0xFF
        with pytest.raises(FormatError):
            ZstdCodec().decode_into(bytes(bad), out)
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(64 << 20))
    with pytest.raises(FormatError, match="bomb"):
        ZstdCodec().decode_into(bomb, memoryview(bytearray(1 << 20)))


def test_zstd_decode_into_handles_rle_and_raw_blocks():
    rng = np.random.default_rng(1)
    payload = bytes(200_000) + rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()  # RLE, raw
    frame = ZstdCodec(level=3).encode(payload)
    out = memoryview(bytearray(len(payload)))
    ZstdCodec().decode_into(frame, out)
    assert bytes(out) == payload


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_shuffle_decode_into(itemsize):
    data = np.random.default_rng(itemsize).integers(0, 256, 1000 * itemsize + 3, dtype=np.uint8).tobytes()
    codec = ShuffleCodec(itemsize)
    shuffled = bytes(codec.encode(data))
    out = memoryview(bytearray(len(data)))
    codec.decode_into(shuffled, out)
    assert bytes(out) == data
    with pytest.raises(FormatError):
        codec.decode_into(shuffled, memoryview(bytearray(len(data) - 1)))
