"""``int8_block``: symmetric absmax 8-bit quantization per block, for optimizer moments.

Encoded layout for a chunk of ``n = rows * cols`` elements, flattened row-major and cut into
``nb = ceil(n / block_size)`` blocks (the last one may be shorter)::

    scales  nb x float32   absmax(block) / 127, rounded up to float32
    codes   n x int8       round(x / scale), in [-127, 127]

Decode is ``code * scale`` in float32 (float64 for float64 tensors), cast to the tensor's dtype.
Error: at most ``scale / 2`` per element (plus float rounding and the final cast). inf/nan input
raises ValueError in ``encode``; the engine then stores the tensor lossless.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import FormatError
from ._common import (BLOCK_ELEMS, QUANTIZABLE_DTYPES, block_stats, bytes_to_uint8, check_int,
                      check_shape, compute_dtype, format_guard, require_finite, require_quantizable,
                      round_directed, typed_view)
from .base import ArrayCodec, EncodeStats, register


@register
@dataclass(frozen=True)
class Int8BlockCodec(ArrayCodec):
    """Symmetric 8-bit codes with one float32 absmax scale per ``block_size`` elements."""

    block_size: int = 256

    name = "int8_block"
    version = 1
    lossy = True

    def __post_init__(self) -> None:
        check_int(self.block_size, "block_size", 1)

    @classmethod
    def from_params(cls, **params: Any) -> "Int8BlockCodec":
        return cls(**params)

    def _layout(self, n: int) -> tuple[int, int]:
        """(number of blocks, total encoded bytes)."""
        nb = -(-n // self.block_size)
        return nb, nb * 4 + n

    def _pieces(self, n: int):
        """Element ranges of whole blocks, about BLOCK_ELEMS long, covering 0..n."""
        span = max(1, BLOCK_ELEMS // self.block_size) * self.block_size
        return ((a, min(a + span, n)) for a in range(0, n, span))

    def encode(self, array: torch.Tensor) -> tuple[memoryview, EncodeStats]:
        require_quantizable(array, self.name)
        flat = array.detach().contiguous().reshape(-1)
        nb, total = self._layout(flat.numel())
        out = np.empty(total, dtype=np.uint8)
        scales = typed_view(out[:nb * 4], torch.float32)
        codes = out[nb * 4:].view(np.int8)
        stats = EncodeStats()
        for a, b in self._pieces(flat.numel()):
            x = flat[a:b]
            require_finite(x, self.name)
            c, s, recon = self._quantize(x)
            scales[a // self.block_size:a // self.block_size + s.numel()] = s
            codes[a:b] = c
            stats = stats.merge(block_stats(x, recon))
        return memoryview(out), stats

    def _quantize(self, x: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """One piece of whole blocks -> (int8 codes, float32 scales, values as decode returns them)."""
        cdt = compute_dtype(x.dtype)
        xc = x.to(cdt)
        absmax = _per_block(xc.abs(), self.block_size, torch.amax)
        # Rounding the scale up keeps |x| / scale <= 127, so no value needs clamping.
        scale = round_directed(absmax.to(torch.float64) / 127.0, torch.float32, up=True)
        sc = _expand(scale.to(cdt), self.block_size, xc.numel())
        inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
        codes = xc.mul(inv).round_().clamp_(-127, 127)
        recon = codes.mul(sc).to(x.dtype)
        return codes.numpy().astype(np.int8), scale, recon

    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = check_shape(shape)
        if dtype not in QUANTIZABLE_DTYPES:
            raise FormatError(f"int8_block: cannot decode to dtype {dtype}")
        n = rows * cols
        nb, total = self._layout(n)
        format_guard(memoryview(data).nbytes, total, self.name)
        buf = bytes_to_uint8(data)
        scales = buf[:nb * 4].view(torch.float32)
        if nb and not (math.isfinite(float(scales.amax())) and float(scales.amin()) >= 0):
            raise FormatError("int8_block: scales are not finite and non-negative")
        codes = buf[nb * 4:].view(torch.int8)
        cdt = compute_dtype(dtype)
        out = torch.empty(n, dtype=dtype)
        for a, b in self._pieces(n):
            s = scales[a // self.block_size:-(-b // self.block_size)]
            out[a:b] = codes[a:b].to(cdt).mul(_expand(s.to(cdt), self.block_size, b - a)).to(dtype)
        return out.view(rows, cols)

    def encoded_itemsize(self, dtype: torch.dtype) -> int:
        return 1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "block_size": self.block_size}


def _per_block(x: torch.Tensor, block: int, reduce) -> torch.Tensor:
    """``reduce`` over consecutive blocks of a 1-D tensor (the last block may be shorter)."""
    full = x.numel() // block * block
    parts = [reduce(x[:full].view(-1, block), dim=1)] if full else []
    if full < x.numel():
        parts.append(reduce(x[full:], dim=0, keepdim=True))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _expand(per_block: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Repeat each block's value over its elements: (nb,) -> (n,).

    ``min``: a block longer than ``n`` (a hostile manifest's block_size) must not size the output."""
    return per_block.repeat_interleave(min(block, max(n, 1)))[:n]
