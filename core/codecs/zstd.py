"""``zstd``: Zstandard compression of a chunk's bytes, one frame per chunk.

Frames carry the content size. They carry no content checksum: every blob is checked against
the xxh3-64 checksum of its stored bytes (in the manifest) before any codec sees it, and zstd's
own XXH64 over the decoded bytes cost ~20% of decoding (frames written with one by earlier
versions still have it verified). Decoding reads the declared content size from the
frame header first and refuses frames that declare no size or more than ``max_output`` bytes
before allocating anything (a hostile or corrupt blob cannot be a decompression bomb); trailing
bytes after the frame and every zstd error are reported as FormatError.

Levels <= 1 (the default is 1) compress with a 2^10-entry match-finder hash table instead of
zstd's 2^13-2^14: on byte-shuffled float chunks it fits in L1 and finds the same matches, so
encoding is 12-16% and decoding 17-20% faster at the same ratio (16 MiB chunks of a trained GPT
state, fp32 and bf16, medians of 9; ``python -m benchmarks.bench_stages`` gives the per-stage
costs). Exponent planes (``compress(..., planes=True)``, from the ``shuffle_zstd`` codec) use a
2^6-entry table and 7-byte minimum matches: on trained GPT weights + Adam moments, gaussian
weights and DLRM tables, encoding 28-48% and decoding 0-25% faster than 2^10, at ratios from 2.4%
worse (runs of identical values) to 1.6% better (gaussian-like values). Only the encoder changes:
the frames are ordinary zstd frames.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import zstandard

from ..errors import FormatError
from ._common import check_int
from .base import BytesCodec, Scratch, register

# zstandard's (de)compressor objects are not thread-safe but are costly to create (they own
# large contexts), so each worker thread keeps its own, keyed by the settings.
_local = threading.local()
# Levels <= 1: see the module docstring.
_FAST_TUNING = {False: {"hash_log": 10}, True: {"hash_log": 6, "min_match": 7}}


def _compressor(level: int, threads: int, planes: bool = False) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, threads, planes)
    if key not in cache:
        tuning = _FAST_TUNING[planes] if level <= 1 else {}
        params = zstandard.ZstdCompressionParameters.from_level(
            level, threads=threads, write_checksum=0, write_content_size=1, **tuning)
        cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


@register
@dataclass(frozen=True)
class ZstdCodec(BytesCodec):
    """zstd at ``level`` with ``threads`` worker threads per frame (0 = on the calling thread)."""

    level: int = 1
    threads: int = 0

    name = "zstd"
    version = 1

    def __post_init__(self) -> None:
        check_int(self.level, "level", -(1 << 17), 22)
        check_int(self.threads, "threads", 0, 256)

    @classmethod
    def from_params(cls, **params: Any) -> "ZstdCodec":
        return cls(**params)

    def encode(self, data: bytes | memoryview) -> bytes:
        return compress(data, self.level, self.threads)

    def decode(self, data: bytes | memoryview, max_output: int) -> bytes:
        size = _content_size(data, max_output)
        try:
            out = _decompressor().decompress(data, max_output_size=max_output, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd: corrupt data: {exc}") from None
        if len(out) != size:  # pragma: no cover - zstd itself checks this
            raise FormatError(f"zstd: frame declared {size} bytes but holds {len(out)}")
        return out

    def decode_into(self, data: bytes | memoryview, out: memoryview, scratch: Scratch | None = None) -> None:
        decompress_into(data, out)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "level": self.level, "threads": self.threads}


def compress(data: bytes | memoryview, level: int, threads: int = 0, planes: bool = False) -> bytes:
    """One zstd frame of ``data`` (content size recorded, no checksum); ``planes``: ``data`` is a
    byte plane of shuffled numbers (tunes the match finder, see the module docstring)."""
    return _compressor(level, threads, planes).compress(data)


def decompress_into(data: bytes | memoryview, out: memoryview) -> None:
    """Decode the single frame ``data`` into ``out``, which it must fill exactly (FormatError otherwise)."""
    size = _content_size(data, out.nbytes)
    if size != out.nbytes:
        raise FormatError(f"zstd: frame declares {size} bytes, expected {out.nbytes}")
    end = _frame_end(data)
    if end != memoryview(data).nbytes:
        raise FormatError(f"zstd: {memoryview(data).nbytes - end} bytes after the end of the frame")
    try:
        with _decompressor().stream_reader(data, read_across_frames=False) as reader:
            got = 0
            while got < size:
                n = reader.readinto(out[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)  # reaches the end of the frame (and checks a checksum it has)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd: corrupt data: {exc}") from None
    if got != size or extra:
        raise FormatError(f"zstd: frame declared {size} bytes but holds {got + len(extra)}+")


def _content_size(data: bytes | memoryview, max_output: int) -> int:
    """The frame's declared content size, refused if absent or over ``max_output`` (before any
    allocation: a hostile or corrupt blob cannot be a decompression bomb)."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd: invalid frame header: {exc}") from None
    if size < 0:
        raise FormatError("zstd: frame does not declare its content size")
    if size > max_output:
        raise FormatError(f"zstd: frame declares {size} bytes, more than the limit of {max_output} "
                          "(refusing a possible decompression bomb)")
    return size


def _frame_end(data: bytes | memoryview) -> int:
    """Offset just past the first frame, from its block headers (RFC 8878, section 3.1.1)."""
    view = memoryview(data).cast("B")
    try:
        pos = zstandard.frame_header_size(view)
        has_checksum = zstandard.get_frame_parameters(view).has_checksum
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd: invalid frame header: {exc}") from None
    while True:
        if pos + 3 > view.nbytes:
            raise FormatError("zstd: truncated frame")
        header = int.from_bytes(view[pos:pos + 3], "little")
        kind = (header >> 1) & 3
        if kind == 3:
            raise FormatError("zstd: corrupt data: reserved block type")
        pos += 3 + (1 if kind == 1 else header >> 3)  # RLE blocks hold one byte
        if header & 1:  # last block
            return pos + (4 if has_checksum else 0)
