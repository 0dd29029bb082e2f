"""``shuffle``: byte-shuffle (byte 0 of every element, then byte 1, ...), as in Blosc and ZipNN.

Grouping the exponent bytes of floats together makes them compress far better with zstd. A data
length that is not a multiple of ``itemsize`` leaves its last ``len % itemsize`` bytes unshuffled
at the end. numpy does the transposing copy (it releases the GIL for it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError
from ._common import check_int
from .base import BytesCodec, register

# Elements per piece. Each piece is `itemsize` numpy calls, and each call takes the GIL back: with
# small pieces a background shuffle keeps interrupting the training thread (measured: a Python +
# small-torch-ops loop ran 918-1277 iterations beside 16K-element pieces, 1556-1604 beside 256K,
# 1667-1828 alone), while larger pieces cost little cache locality.
_PIECE = 1 << 18


@register
@dataclass(frozen=True)
class ShuffleCodec(BytesCodec):
    """Byte-shuffle with element size ``itemsize`` (1 = identity)."""

    itemsize: int = 4

    name = "shuffle"
    version = 1

    def __post_init__(self) -> None:
        check_int(self.itemsize, "itemsize", 1, 64)

    @classmethod
    def from_params(cls, **params: Any) -> "ShuffleCodec":
        return cls(**params)

    def encode(self, data: bytes | memoryview) -> bytes | memoryview:
        return _transpose(data, self.itemsize, forward=True)

    def decode(self, data: bytes | memoryview, max_output: int) -> bytes | memoryview:
        if memoryview(data).nbytes > max_output:
            raise FormatError(f"shuffle: {memoryview(data).nbytes} bytes exceed the limit of {max_output}")
        return _transpose(data, self.itemsize, forward=False)

    def decode_into(self, data: bytes | memoryview, out: memoryview) -> None:
        if memoryview(data).nbytes != out.nbytes:
            raise FormatError(f"shuffle: {memoryview(data).nbytes} bytes do not fill {out.nbytes}")
        if out.nbytes:
            _transpose(data, self.itemsize, forward=False, out=np.frombuffer(out, dtype=np.uint8))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "itemsize": self.itemsize}


def _transpose(data: bytes | memoryview, itemsize: int, forward: bool,
               out: np.ndarray | None = None) -> bytes | memoryview:
    """Shuffle (``forward``) or unshuffle ``data`` into ``out`` (same size; a new buffer if None).

    With itemsize 1 and no ``out``, ``data`` itself is returned.
    """
    if itemsize == 1 and out is None:
        return data
    src = np.frombuffer(data, dtype=np.uint8) if memoryview(data).nbytes else np.empty(0, np.uint8)
    n = src.size // itemsize
    if out is None:
        out = np.empty_like(src)
    # Shuffled layout: plane b (byte b of every element) is [b*n, (b+1)*n). One byte column at a
    # time, in cache-sized pieces: numpy's strided 1-D copies beat its 2-D transposing copy ~4x
    # when unshuffling.
    planes = (out if forward else src)[:n * itemsize].reshape(itemsize, n)
    elems = (src if forward else out)[:n * itemsize].reshape(n, itemsize)
    for a in range(0, n, _PIECE):
        b = min(a + _PIECE, n)
        for k in range(itemsize):
            if forward:
                planes[k, a:b] = elems[a:b, k]
            else:
                elems[a:b, k] = planes[k, a:b]
    out[n * itemsize:] = src[n * itemsize:]
    return memoryview(out)
