"""``zstd``: Zstandard compression of a chunk's bytes, one frame per chunk.

Frames carry the content size and a checksum. Decoding reads the declared content size from the
frame header first and refuses frames that declare no size or more than ``max_output`` bytes
before allocating anything (a hostile or corrupt blob cannot be a decompression bomb); trailing
bytes after the frame and every zstd error are reported as FormatError.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import zstandard

from ..errors import FormatError
from ._common import check_int
from .base import BytesCodec, register

# zstandard's (de)compressor objects are not thread-safe but are costly to create (they own
# large contexts), so each worker thread keeps its own, keyed by the settings.
_local = threading.local()


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads,
                                              write_checksum=True, write_content_size=True)
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
        return _compressor(self.level, self.threads).compress(data)

    def decode(self, data: bytes | memoryview, max_output: int) -> bytes:
        try:
            size = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd: invalid frame header: {exc}") from None
        if size < 0:
            raise FormatError("zstd: frame does not declare its content size")
        if size > max_output:
            raise FormatError(f"zstd: frame declares {size} bytes, more than the limit of {max_output} "
                              "(refusing a possible decompression bomb)")
        try:
            out = _decompressor().decompress(data, max_output_size=max_output, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd: corrupt data: {exc}") from None
        if len(out) != size:  # pragma: no cover - zstd itself checks this
            raise FormatError(f"zstd: frame declared {size} bytes but holds {len(out)}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "level": self.level, "threads": self.threads}
