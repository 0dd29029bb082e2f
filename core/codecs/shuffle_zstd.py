"""``shuffle_zstd``: byte-shuffle, then zstd on each byte plane that compresses, the rest stored raw.

The default lossless stage for multi-byte dtypes. Byte-shuffling a float tensor gives one plane
per byte of the element; only the planes holding the exponent compress (to about a third on
trained weights and Adam moments) while the low mantissa planes are close to random. Compressing
the whole shuffled chunk as one frame spends most of zstd's time failing on the mantissa planes
(~0.9 ms CPU per MB each, to store them raw in the end) and decoding copies them once more. Here
each plane is its own segment: a plane whose evenly spread sample (8 x 8 KiB) does not compress
below 97% is stored raw without running zstd at all, the others are one zstd frame each (kept
only when smaller than the plane). Loading unshuffles raw planes straight from the blob.

Blob layout::

    itemsize + 1 segment headers: 2 * stored length + kind (0 raw, 1 zstd frame), each an
                                  unsigned LEB128 varint (1 byte below 64 bytes, 4 below 128 MiB)
    segment 0 .. itemsize-1       planes 0 .. itemsize-1 (byte k of every element)
    segment itemsize              the last len % itemsize bytes of the chunk, raw

A raw plane holds exactly ``len // itemsize`` bytes, a frame decodes to exactly that many; the
segment lengths add up to the blob's size. Anything else is a FormatError.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError
from ._common import check_int
from .base import BytesCodec, Scratch, register
from .shuffle import as_bytes, shuffle_into, unshuffle_into
from .zstd import _content_size, compress, decompress_into

_RAW, _ZSTD = 0, 1
_VARINT_MAX = 10  # bytes of a LEB128 varint of up to 64 bits
_PROBE_FROM = 256 << 10  # planes this large are probed before zstd runs on all of them
_PROBE_PIECES, _PROBE_BYTES = 8, 8 << 10
_RAW_ABOVE = 0.97  # a probe compressing to more than this fraction: the plane is stored raw


@register
@dataclass(frozen=True)
class ShuffleZstdCodec(BytesCodec):
    """Byte-shuffle with element size ``itemsize``, then zstd at ``level`` (``threads`` workers
    per frame) on each plane that compresses; see the module docstring for the layout."""

    itemsize: int = 4
    level: int = 1
    threads: int = 0

    name = "shuffle_zstd"
    version = 1

    def __post_init__(self) -> None:
        check_int(self.itemsize, "itemsize", 2, 64)
        check_int(self.level, "level", -(1 << 17), 22)
        check_int(self.threads, "threads", 0, 256)

    @classmethod
    def from_params(cls, **params: Any) -> "ShuffleZstdCodec":
        return cls(**params)

    def encode(self, data: bytes | memoryview) -> bytes | memoryview:
        src = as_bytes(data)
        k = self.itemsize
        head = _VARINT_MAX * (k + 1)  # room for the largest header; the real one ends at `head`
        n = src.size // k
        # Planes are shuffled straight into their place in the blob; a plane that compresses is
        # replaced by its (shorter) frame and later segments move down over the freed space.
        buf = np.empty(head + src.size, np.uint8)
        planes = [buf[head + i * n:head + (i + 1) * n] for i in range(k)]
        if n:
            shuffle_into(src, planes)
        out, pos, segments = memoryview(buf), head, []
        for i, plane in enumerate(planes):
            frame = self._compressed(plane)
            if frame is None:
                if pos != head + i * n:  # move down over a frame's spare room (memmove: overlap-safe)
                    out[pos:pos + n] = memoryview(plane)
                segments.append((_RAW, n))
                pos += n
            else:
                out[pos:pos + len(frame)] = frame
                segments.append((_ZSTD, len(frame)))
                pos += len(frame)
        tail = src[n * k:]
        out[pos:pos + tail.size] = memoryview(tail)
        segments.append((_RAW, tail.size))
        pos += tail.size
        header = b"".join(_varint(2 * length + kind) for kind, length in segments)
        start = head - len(header)
        out[start:head] = header
        # A well-compressed chunk is copied out rather than pinning the full-size buffer.
        return out[start:pos] if 2 * (pos - start) > buf.size else bytes(out[start:pos])

    def _compressed(self, plane: np.ndarray) -> bytes | None:
        """zstd frame of ``plane``, or None if it is not worth storing compressed."""
        if plane.size >= _PROBE_FROM:
            span = plane.size - _PROBE_BYTES
            probe = np.concatenate([plane[span * i // (_PROBE_PIECES - 1):][:_PROBE_BYTES]
                                    for i in range(_PROBE_PIECES)])
            if len(compress(probe, self.level, planes=True)) > _RAW_ABOVE * probe.size:
                return None
        frame = compress(plane, self.level, self.threads, planes=True)
        return frame if len(frame) < plane.size else None

    def _segments(self, data: bytes | memoryview) -> list[tuple[int, memoryview]]:
        """(kind, stored bytes) of each segment, with the lengths checked against the blob."""
        view = memoryview(data).cast("B")
        pos, fields = 0, []
        for i in range(self.itemsize + 1):
            value, pos = _read_varint(view, pos, i)
            fields.append(value)
        segments = []
        for i, value in enumerate(fields):
            kind, length = value & 1, value >> 1
            if kind == _ZSTD and i == self.itemsize:
                raise FormatError("shuffle_zstd: the tail segment is marked as a zstd frame")
            if length > view.nbytes - pos:
                raise FormatError(f"shuffle_zstd: segment {i} of {length} bytes runs past the end "
                                  f"of the {view.nbytes}-byte blob")
            segments.append((kind, view[pos:pos + length]))
            pos += length
        if pos != view.nbytes:
            raise FormatError(f"shuffle_zstd: {view.nbytes - pos} bytes after the last segment")
        return segments

    def decode(self, data: bytes | memoryview, max_output: int) -> bytes | memoryview:
        segments = self._segments(data)
        kind, seg = segments[0]
        n = seg.nbytes if kind == _RAW else _content_size(seg, max_output)
        size = n * self.itemsize + segments[-1][1].nbytes
        if size > max_output:
            raise FormatError(f"shuffle_zstd: {size} bytes exceed the limit of {max_output}")
        out = memoryview(bytearray(size))
        self._decode_segments(segments, out, None)
        return out

    def decode_into(self, data: bytes | memoryview, out: memoryview, scratch: Scratch | None = None) -> None:
        self._decode_segments(self._segments(data), out, scratch)

    def _decode_segments(self, segments: list[tuple[int, memoryview]], out: memoryview,
                         scratch: Scratch | None) -> None:
        k = self.itemsize
        n = out.nbytes // k
        tail = segments[-1][1]
        if tail.nbytes != out.nbytes - n * k:
            raise FormatError(f"shuffle_zstd: a {tail.nbytes}-byte tail does not fit {out.nbytes} bytes "
                              f"of {k}-byte elements")
        frames = sum(kind == _ZSTD for kind, _ in segments)
        spare = (scratch(frames * n) if scratch else memoryview(bytearray(frames * n))) if frames else None
        planes, used = [], 0
        for i, (kind, seg) in enumerate(segments[:k]):
            if kind == _RAW:
                if seg.nbytes != n:
                    raise FormatError(f"shuffle_zstd: raw plane {i} holds {seg.nbytes} bytes, expected {n}")
                planes.append(as_bytes(seg))
            else:
                target = spare[used:used + n]
                decompress_into(seg, target)
                planes.append(as_bytes(target))
                used += n
        dest = as_bytes(out)
        if n:
            unshuffle_into(planes, dest)
        dest[n * k:] = as_bytes(tail)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "itemsize": self.itemsize,
                "level": self.level, "threads": self.threads}


def _varint(value: int) -> bytes:
    """Unsigned LEB128: 7 bits per byte, low bits first, high bit set on all but the last."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, pos: int, segment: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; FormatError if truncated or too long."""
    value = 0
    for shift in range(0, 7 * _VARINT_MAX, 7):
        if pos >= view.nbytes:
            raise FormatError(f"shuffle_zstd: the header of segment {segment} is cut off "
                              f"(blob of {view.nbytes} bytes)")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise FormatError(f"shuffle_zstd: the header of segment {segment} is longer than {_VARINT_MAX} bytes")
