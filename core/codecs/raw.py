"""``raw``: a tensor's bytes as they are in memory (any dtype), zero-copy where possible."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._common import bytes_to_uint8, check_shape, format_guard, tensor_bytes
from .base import ArrayCodec, EncodeStats, register


def dtype_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (bool and float8 included)."""
    return dtype.itemsize


@register
@dataclass(frozen=True)
class RawCodec(ArrayCodec):
    """Lossless: the little-endian bytes of the tensor, row-major.

    ``encode`` returns a memoryview aliasing the input tensor (no copy); ``decode`` returns a
    tensor aliasing ``data`` when it is a writable, aligned buffer and copies otherwise.
    """

    name = "raw"
    version = 1
    lossy = False

    @classmethod
    def from_params(cls, **params: Any) -> "RawCodec":
        if params:
            raise ValueError(f"raw takes no parameters, got {sorted(params)}")
        return cls()

    def encode(self, array: torch.Tensor) -> tuple[memoryview, EncodeStats]:
        return tensor_bytes(array), EncodeStats()

    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = check_shape(shape)
        format_guard(memoryview(data).nbytes, rows * cols * dtype_itemsize(dtype), self.name)
        if rows * cols == 0:
            return torch.empty(0, dtype=torch.uint8).view(dtype).view(rows, cols)  # no complex32 warning
        return bytes_to_uint8(data).view(dtype).view(rows, cols)

    def encoded_itemsize(self, dtype: torch.dtype) -> int:
        return dtype_itemsize(dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}
