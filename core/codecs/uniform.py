"""``uniform``: asymmetric uniform quantization per row, or per block of a row (Check-N-Run).

Encoded layout for a (rows, cols) chunk with ``nq`` quantization groups (``rows`` per row, or
``rows * ceil(cols / block_size)`` per block; the last block of each row may be shorter)::

    mins   nq x scale_dtype   group order: row 0 block 0, row 0 block 1, ..., row 1 block 0, ...
    steps  nq x scale_dtype
    codes  rows*cols codes of ``bits`` bits, row-major, packed as one stream (see packing.py):
           no padding between rows; zero bits pad the end of the stream to a whole byte.

Work proceeds in segments of about ``BLOCK_ELEMS`` elements (whole rows, or a range of whole
blocks within one long row), so temporaries stay cache-sized whatever the chunk size - except for
per-row quantization of a single row longer than that, whose temporaries scale with the row.

Edge values: a constant group stores step 0 and decodes exactly when its value is representable
in the scale dtype (otherwise min is rounded down and the step covers the gap, error <= step/2).
inf/nan input raises ValueError in ``encode`` (so does a min or step that fp16 cannot hold, e.g.
|values| > 65504): the engine then stores that tensor lossless rather than turning it into
finite garbage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import FormatError
from ._common import (BLOCK_ELEMS, QUANTIZABLE_DTYPES, bytes_to_uint8, check_int, check_shape,
                      compute_array, finite_decoding, finite_encoding, format_guard, np_dtype,
                      require_quantizable, scale_dtype)
from .base import ArrayCodec, EncodeStats, register
from .packing import GROUP_CODES, SUPPORTED_BITS, pack, packed_nbytes, unpack
from .rowwise import dequantize_rows, quantize_rows


@register
@dataclass(frozen=True)
class UniformCodec(ArrayCodec):
    """Asymmetric ``bits``-bit quantization per row, or per ``block_size`` elements of each row.

    ``greedy`` selects the greedy range search (encode only; kept in the spec because it changes
    the encoded bytes). Error: with ``greedy=False`` at most half the stored step per value.
    """

    bits: int = 4
    block_size: Optional[int] = None
    scale_dtype: str = "fp16"
    greedy: bool = False

    name = "uniform"
    version = 1
    lossy = True

    def __post_init__(self) -> None:
        if check_int(self.bits, "bits", 2, 8) not in SUPPORTED_BITS:
            raise ValueError(f"uniform: bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.block_size is not None:
            check_int(self.block_size, "block_size", 1)
        scale_dtype(self.scale_dtype)
        if not isinstance(self.greedy, bool):
            raise ValueError(f"uniform: greedy must be true or false, got {self.greedy!r}")

    @classmethod
    def from_params(cls, **params: Any) -> "UniformCodec":
        return cls(**params)

    @property
    def _sdt(self) -> torch.dtype:
        return scale_dtype(self.scale_dtype)

    def _block(self, cols: int) -> int:
        """Group length: ``block_size``, or the whole row."""
        return self.block_size if self.block_size is not None else max(cols, 1)

    def _layout(self, rows: int, cols: int) -> tuple[int, int, int]:
        """(groups per row, bytes of one parameter array, total encoded bytes)."""
        per_row = -(-cols // self._block(cols))
        param_bytes = rows * per_row * self._sdt.itemsize
        return per_row, param_bytes, 2 * param_bytes + packed_nbytes(rows * cols, self.bits)

    def encode(self, array: torch.Tensor) -> tuple[memoryview, EncodeStats]:
        """Runs numpy on the calling thread only (see ``rowwise``)."""
        require_quantizable(array, self.name)
        array = array.detach()
        rows, cols = array.shape
        per_row, param_bytes, total = self._layout(rows, cols)
        sdt = np_dtype(self._sdt)
        out = np.empty(total, dtype=np.uint8)
        mins = out[:param_bytes].view(sdt)
        steps = out[param_bytes:2 * param_bytes].view(sdt)
        packed = out[2 * param_bytes:]
        stats, pos = EncodeStats(), 0
        carry = np.empty(0, dtype=np.uint8)  # codes not yet filling a whole group of 8
        for i, j, a, b in _segments(rows, cols, self._block(cols), self.block_size is not None):
            codes, m, s, st = self._encode_segment(compute_array(array[i:j, a:b]), array.dtype)
            p0 = i * per_row + a // self._block(cols)
            mins[p0:p0 + m.size] = m
            steps[p0:p0 + s.size] = s
            stats = stats.merge(st)
            stream = np.concatenate([carry, codes.reshape(-1)]) if carry.size else codes.reshape(-1)
            whole = stream.size - stream.size % GROUP_CODES
            chunk = pack(stream[:whole], self.bits)
            packed[pos:pos + chunk.size] = chunk
            pos += chunk.size
            carry = stream[whole:]
        tail = pack(carry, self.bits)
        packed[pos:pos + tail.size] = tail
        return memoryview(out), finite_encoding(stats, self.name)

    def _encode_segment(self, x: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          EncodeStats]:
        """Quantize one segment (compute-dtype values of a ``dtype`` tensor); returns
        (codes (r, w), mins, steps in group order, stats)."""
        r, w = x.shape
        sdt = np_dtype(self._sdt)
        groups = _groups(w, self._block(w))
        if len(groups) == 1 and groups[0][2] == w:  # one group per row: no reassembly needed
            return quantize_rows(x, dtype, self.bits, sdt, self.greedy)
        codes = np.empty((r, w), dtype=np.uint8)
        m = np.empty((r, groups[-1][1][1]), dtype=sdt)
        s = np.empty_like(m)
        stats = EncodeStats()
        for (c0, c1), (p0, p1), length in groups:
            gc, gm, gs, st = quantize_rows(x[:, c0:c1].reshape(-1, length), dtype, self.bits, sdt, self.greedy)
            codes[:, c0:c1] = gc.reshape(r, c1 - c0)
            m[:, p0:p1] = gm.reshape(r, p1 - p0)
            s[:, p0:p1] = gs.reshape(r, p1 - p0)
            stats = stats.merge(st)
        return codes, m.reshape(-1), s.reshape(-1), stats

    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = check_shape(shape)
        if dtype not in QUANTIZABLE_DTYPES:
            raise FormatError(f"uniform: cannot decode to dtype {dtype}")
        per_row, param_bytes, total = self._layout(rows, cols)
        format_guard(memoryview(data).nbytes, total, self.name)
        buf = bytes_to_uint8(data)
        mins = buf[:param_bytes].view(self._sdt)
        steps = buf[param_bytes:2 * param_bytes].view(self._sdt)
        if param_bytes and not (math.isfinite(float(mins.amin())) and math.isfinite(float(mins.amax()))
                                and math.isfinite(float(steps.amax())) and float(steps.amin()) >= 0):
            raise FormatError("uniform: quantization parameters are not finite and non-negative")
        packed = buf[2 * param_bytes:].numpy()
        out = torch.empty((rows, cols), dtype=dtype)
        for i, j, a, b in _segments(rows, cols, self._block(cols), self.block_size is not None):
            codes = unpack(packed, self.bits, (j - i) * (b - a), start=i * cols + a)
            p0 = i * per_row + a // self._block(cols)
            self._decode_segment(torch.from_numpy(codes).view(j - i, b - a), mins, steps, p0, out[i:j, a:b])
        return finite_decoding(out, self.name)

    def _decode_segment(self, codes: torch.Tensor, mins: torch.Tensor, steps: torch.Tensor,
                        p0: int, out: torch.Tensor) -> None:
        r, w = codes.shape
        groups = _groups(w, self._block(w))
        n_params = groups[-1][1][1]
        m = mins[p0:p0 + r * n_params].view(r, n_params)
        s = steps[p0:p0 + r * n_params].view(r, n_params)
        for (c0, c1), (q0, q1), length in groups:
            block = codes[:, c0:c1].reshape(-1, length)
            values = dequantize_rows(block, m[:, q0:q1].reshape(-1), s[:, q0:q1].reshape(-1), out.dtype)
            out[:, c0:c1] = values.view(r, c1 - c0)

    def params(self, data: bytes | memoryview, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored per-group (mins, steps) of an encoding, in group order (for tests and tools)."""
        _, param_bytes, total = self._layout(*check_shape(shape))
        format_guard(memoryview(data).nbytes, total, self.name)
        buf = bytes_to_uint8(data)
        return buf[:param_bytes].view(self._sdt).clone(), buf[param_bytes:2 * param_bytes].view(self._sdt).clone()

    def encoded_itemsize(self, dtype: torch.dtype) -> int:
        return 1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "bits": self.bits,
                "block_size": self.block_size, "scale_dtype": self.scale_dtype, "greedy": self.greedy}


def _groups(width: int, block: int) -> list[tuple[tuple[int, int], tuple[int, int], int]]:
    """Split a segment of ``width`` columns into runs of equal-length groups.

    Returns ``((col0, col1), (param0, param1), group_length)`` per run: the full blocks, then the
    shorter last block if any. Parameters of one segment row are indexed 0..n_groups-1.
    """
    if width == 0:
        return []
    full, rest = divmod(width, block)
    runs = []
    if full:
        runs.append(((0, full * block), (0, full), block))
    if rest:
        runs.append(((full * block, width), (full, full + 1), rest))
    return runs


def _segments(rows: int, cols: int, block: int, blocked: bool) -> Iterator[tuple[int, int, int, int]]:
    """Row-major pieces ``(row0, row1, col0, col1)`` of about ``BLOCK_ELEMS`` elements.

    A piece is whole rows, or (per-block mode, long rows) whole blocks of one row, so every piece
    covers consecutive codes and consecutive parameter groups.
    """
    if rows == 0 or cols == 0:
        return
    if not blocked or cols <= BLOCK_ELEMS:
        step = max(1, BLOCK_ELEMS // cols)
        for i in range(0, rows, step):
            yield i, min(i + step, rows), 0, cols
        return
    width = max(block, BLOCK_ELEMS // block * block)
    for i in range(rows):
        for a in range(0, cols, width):
            yield i, i + 1, a, min(a + width, cols)
