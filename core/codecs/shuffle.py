"""``shuffle``: byte-shuffle (byte 0 of every element, then byte 1, ...), as in Blosc and ZipNN.

Grouping the exponent bytes of floats together makes them compress far better with zstd. A data
length that is not a multiple of ``itemsize`` leaves its last ``len % itemsize`` bytes unshuffled
at the end.

The transposing copies run in the C kernels of the optional extension ``ckpt_core._cshuffle``
(SSE2, element sizes 2 and 4, and 8 as a pass of each: 2.4-5x faster than numpy, and without the GIL) when it was built
at install time; otherwise, and for other element sizes, numpy does them (releasing the GIL for
each copy). Both give the same bytes (tests/core/test_codecs.py runs both), so there is no
setting for it: ``native_available()`` says which one runs.

``shuffle_into`` / ``unshuffle_into`` are the two directions on separate plane buffers; the
``shuffle_zstd`` codec uses them to compress each plane on its own.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import FormatError
from ._common import check_int, load_native
from .base import BytesCodec, Scratch, register

# Elements per piece. Each piece is a few numpy calls, and each call takes the GIL back: with
# small pieces a background shuffle keeps interrupting the training thread (measured: a Python +
# small-torch-ops loop ran 918-1277 iterations beside 16K-element pieces, 1556-1604 beside 256K,
# 1667-1828 alone), while larger pieces cost little cache locality.
_PIECE = 1 << 18
_LITTLE = sys.byteorder == "little"
_ABI = 1  # checkrun_cshuffle_abi() of the C kernels this module was written for


def _load_native() -> ctypes.CDLL | None:
    """The C kernels (``ckpt_core._cshuffle``), or None when they were not built."""
    lib = load_native("_cshuffle", "checkrun_cshuffle_abi", _ABI, "byte-shuffle runs in numpy")
    if lib is None:
        return None
    for fn in (lib.checkrun_shuffle, lib.checkrun_unshuffle):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    many = getattr(lib, "checkrun_shuffle_many", None)  # absent from a library built before 2026-12-06
    if many is not None:
        many.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        many.restype = ctypes.c_int
    return lib


_NATIVE = _load_native()


def native_available() -> bool:
    """Whether the C byte-shuffle kernels are in use (see the module docstring)."""
    return _NATIVE is not None


def _native(forward: bool, flat: np.ndarray, planes: Sequence[np.ndarray]) -> bool:
    """Run the C kernel when it applies (contiguous buffers, destination writable); False when
    the caller must do the work."""
    if _NATIVE is None or len(planes) not in (2, 4, 8) or not flat.flags.c_contiguous:
        return False
    if not all(p.flags.c_contiguous for p in planes):
        return False
    if not (all(p.flags.writeable for p in planes) if forward else flat.flags.writeable):
        return False
    pointers = (ctypes.c_void_p * len(planes))(*(p.ctypes.data for p in planes))
    if forward:
        return bool(_NATIVE.checkrun_shuffle(flat.ctypes.data, len(planes), planes[0].size, pointers))
    return bool(_NATIVE.checkrun_unshuffle(pointers, len(planes), planes[0].size, flat.ctypes.data))


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

    def decode_into(self, data: bytes | memoryview, out: memoryview, scratch: Scratch | None = None) -> None:
        if memoryview(data).nbytes != out.nbytes:
            raise FormatError(f"shuffle: {memoryview(data).nbytes} bytes do not fill {out.nbytes}")
        if out.nbytes:
            _transpose(data, self.itemsize, forward=False, out=np.frombuffer(out, dtype=np.uint8))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "itemsize": self.itemsize}


def as_bytes(data: bytes | memoryview) -> np.ndarray:
    """``data`` as a 1-D uint8 array (no copy)."""
    return np.frombuffer(data, dtype=np.uint8) if memoryview(data).nbytes else np.empty(0, np.uint8)


def shuffle_many(jobs: Sequence[tuple[np.ndarray, Sequence[np.ndarray]]]) -> None:
    """``shuffle_into`` of each ``(src, planes)``: in one call of the C kernels when they take every
    job (a background thread then takes the GIL back once, not once per buffer), else one by one."""
    many = getattr(_NATIVE, "checkrun_shuffle_many", None)
    ok = many is not None and all(
        len(planes) in (2, 4, 8) and src.flags.c_contiguous and src.size >= len(planes) * planes[0].size
        and all(p.flags.c_contiguous and p.flags.writeable and p.size == planes[0].size for p in planes)
        for src, planes in jobs)
    if ok and jobs:
        flat = [p for _, planes in jobs for p in planes]
        args = ((ctypes.c_void_p * len(jobs))(*(src.ctypes.data for src, _ in jobs)),
                (ctypes.c_size_t * len(jobs))(*(len(planes) for _, planes in jobs)),
                (ctypes.c_size_t * len(jobs))(*(planes[0].size for _, planes in jobs)),
                (ctypes.c_void_p * len(flat))(*(p.ctypes.data for p in flat)))
        if many(len(jobs), *args):
            return
    for src, planes in jobs:
        shuffle_into(src, planes)


def shuffle_into(src: np.ndarray, planes: Sequence[np.ndarray]) -> None:
    """Write byte ``k`` of every element of ``src`` (uint8, ``len(planes)``-byte elements) into
    ``planes[k]``; each plane holds ``len(src) // len(planes)`` bytes. A tail is not touched."""
    itemsize, n = len(planes), planes[0].size
    if _native(True, src[:n * itemsize], planes):
        return
    if itemsize == 2 and _swar_ok(src):
        words = src[:2 * n].view(np.uint16)
        for a in range(0, n, _PIECE):
            b = min(a + _PIECE, n)
            np.bitwise_and(words[a:b], 0xFF, out=planes[0][a:b], casting="unsafe")
            np.right_shift(words[a:b], 8, out=planes[1][a:b], casting="unsafe")
        return
    elems = src[:n * itemsize].reshape(n, itemsize)
    # One byte column at a time, in cache-sized pieces: numpy's strided 1-D copies beat its 2-D
    # transposing copy ~4x.
    for a in range(0, n, _PIECE):
        b = min(a + _PIECE, n)
        for k in range(itemsize):
            planes[k][a:b] = elems[a:b, k]


def unshuffle_into(planes: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Inverse of ``shuffle_into``: interleave the planes into the first ``n * len(planes)``
    bytes of ``out`` (uint8). Two-byte elements are put together with 16-bit shifts, which numpy
    vectorizes (~25% faster than the strided byte copies)."""
    itemsize, n = len(planes), planes[0].size
    if _native(False, out[:n * itemsize], planes):
        return
    if itemsize == 2 and _swar_ok(out):
        words = out[:2 * n].view(np.uint16)
        for a in range(0, n, _PIECE):
            b = min(a + _PIECE, n)
            np.left_shift(planes[1][a:b], 8, out=words[a:b], dtype=np.uint16)
            np.bitwise_or(words[a:b], planes[0][a:b], out=words[a:b], dtype=np.uint16)
        return
    elems = out[:n * itemsize].reshape(n, itemsize)
    for a in range(0, n, _PIECE):
        b = min(a + _PIECE, n)
        for k in range(itemsize):
            elems[a:b, k] = planes[k][a:b]


def _swar_ok(buf: np.ndarray) -> bool:
    """Whether 16-bit words of ``buf`` may stand for (low byte, high byte) pairs."""
    return _LITTLE and buf.ctypes.data % 2 == 0


def _transpose(data: bytes | memoryview, itemsize: int, forward: bool,
               out: np.ndarray | None = None) -> bytes | memoryview:
    """Shuffle (``forward``) or unshuffle ``data`` into ``out`` (same size; a new buffer if None).

    With itemsize 1 and no ``out``, ``data`` itself is returned.
    """
    if itemsize == 1 and out is None:
        return data
    src = as_bytes(data)
    n = src.size // itemsize
    if out is None:
        out = np.empty_like(src)
    # Shuffled layout: plane b (byte b of every element) is [b*n, (b+1)*n).
    if n:
        planes = list((out if forward else src)[:n * itemsize].reshape(itemsize, n))
        if forward:
            shuffle_into(src, planes)
        else:
            unshuffle_into(planes, out)
    out[n * itemsize:] = src[n * itemsize:]
    return memoryview(out)
