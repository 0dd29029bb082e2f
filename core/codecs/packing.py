"""Dense bit-packing of small unsigned codes (2, 3, 4 or 8 bits) into bytes.

Layout: the codes' bits are concatenated least-significant bit first into one bit stream, which
is stored LSB-first in bytes (what ``numpy.packbits(..., bitorder="little")`` gives): every 8
consecutive codes form a group of ``bits`` bytes holding ``sum(code[k] << (bits * k))``. The stream
is zero-padded only at its end: ``n`` codes take exactly ``packed_nbytes(n, bits)`` =
ceil(n * bits / 8) bytes, however the codes are split into rows.

Implementation: 8 codes (one byte each) are read as one little-endian uint64 and squeezed
together with three shift-or-mask steps (the classic bit-compress ladder), so packing and
unpacking are a handful of vectorized numpy passes over n/8 words, not per-bit loops.
"""
from __future__ import annotations

import sys

import numpy as np

SUPPORTED_BITS = (2, 3, 4, 8)

if sys.byteorder != "little":  # pragma: no cover - the uint64 views below assume little-endian
    raise ImportError("checkrun's bit-packing requires a little-endian machine")


def _ladder(bits: int) -> list[tuple[int, int]]:
    """(shift, mask) per squeeze step: fields of ``bits`` at 8-bit spacing -> 2*bits at 16 -> ..."""
    steps = []
    for level in range(3):  # fields of width bits*2**level at spacing 8*2**level merge pairwise
        width, spacing = bits << (level + 1), 16 << level
        field = (1 << width) - 1
        mask = sum(field << (spacing * k) for k in range(64 // spacing))
        steps.append(((8 << level) - (bits << level), mask))
    return steps


_LADDERS = {b: [(np.uint64(s), np.uint64(m)) for s, m in _ladder(b)] for b in (2, 3, 4)}
_FIELD_MASK = {b: np.uint64(sum(((1 << b) - 1) << (8 * k) for k in range(8))) for b in (2, 3, 4)}


_WORD = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # a group of 8 codes of 2 or 4 bits


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


GROUP_CODES = 8
"""Codes per byte-aligned group (any width): a stream split at multiples of 8 packs piece by piece."""


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack a 1-D uint8 array of codes (each < 2**bits) into ``packed_nbytes(len, bits)`` bytes.

    Bits of a code above ``bits`` are masked off, so they cannot corrupt neighbouring codes.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}")
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    n = codes.size
    if bits == 8:
        return codes.copy()
    pad = (-n) % 8
    if pad:
        codes = np.concatenate([codes, np.zeros(pad, np.uint8)])
    v = codes.view("<u8") & _FIELD_MASK[bits]
    for shift, mask in _LADDERS[bits]:
        v = (v | (v >> shift)) & mask
    if bits == 3:  # no 24-bit integer type: take 3 of every 8 bytes
        out = v.view(np.uint8).reshape(-1, 8)[:, :3].reshape(-1)
    else:  # the low 2 or 4 bytes of each word, by a truncating integer cast (fast, contiguous)
        out = v.astype(_WORD[bits]).view(np.uint8)
    return out[:packed_nbytes(n, bits)]


def unpack(packed: np.ndarray, bits: int, n: int, start: int = 0) -> np.ndarray:
    """Codes ``start .. start+n-1`` of a packed stream as a 1-D uint8 array.

    ``packed`` holds the whole stream (only the bytes needed are read), so a stream can be decoded
    in pieces that do not start at a byte boundary. The caller checks the stream's length.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}")
    if n == 0:
        return np.empty(0, np.uint8)
    if bits == 8:
        return np.asarray(packed[start:start + n])
    g0, g1 = start // 8, (start + n + 7) // 8  # groups of 8 codes covering the request
    chunk = np.asarray(packed[g0 * bits:g1 * bits])
    if chunk.size < (g1 - g0) * bits:  # last group shortened by the end-of-stream padding
        chunk = np.concatenate([chunk, np.zeros((g1 - g0) * bits - chunk.size, np.uint8)])
    if bits == 3:
        raw = np.zeros((g1 - g0, 8), np.uint8)
        raw[:, :3] = chunk.reshape(-1, 3)
        v = raw.reshape(-1).view("<u8")
    else:
        v = chunk.view(_WORD[bits]).astype("<u8")
    # Inverse ladder: split each field in two, top half shifted back up; the mask is the one
    # of the level below (fields of half the width at half the spacing).
    masks = [_FIELD_MASK[bits]] + [m for _, m in _LADDERS[bits][:-1]]
    for (shift, _), mask in reversed(list(zip(_LADDERS[bits], masks))):
        v = (v | (v << shift)) & mask
    codes = v.view(np.uint8)
    off = start - g0 * 8
    return codes[off:off + n]
