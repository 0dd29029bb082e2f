"""``cast``: lossy down-cast of floating tensors to bfloat16 or float16."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FormatError, LossyRefusedError
from ._common import (BLOCK_ELEMS, QUANTIZABLE_DTYPES, block_stats, bytes_to_uint8, check_shape,
                      finite_encoding, format_guard, require_finite, require_quantizable, tensor_bytes)
from .base import ArrayCodec, EncodeStats, register

_TARGETS = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@register
@dataclass(frozen=True)
class CastCodec(ArrayCodec):
    """Stores ``to`` (``"bfloat16"`` or ``"float16"``) values; decode casts back to the original dtype.

    Error: round-to-nearest of the target dtype (relative at most 2^-8 for bfloat16, 2^-11 for float16).
    ``encode`` raises ValueError for inf/nan input and for values that overflow float16, so the
    engine stores such tensors lossless instead of silently producing inf.
    """

    to: str = "bfloat16"

    name = "cast"
    version = 1
    lossy = True

    def __post_init__(self) -> None:
        if self.to not in _TARGETS:
            raise ValueError(f"cast: 'to' must be one of {sorted(_TARGETS)}, got {self.to!r}")

    @classmethod
    def from_params(cls, **params: Any) -> "CastCodec":
        return cls(**params)

    @property
    def target(self) -> torch.dtype:
        return _TARGETS[self.to]

    def encode(self, array: torch.Tensor) -> tuple[memoryview, EncodeStats]:
        require_quantizable(array, self.name)
        flat = array.detach().contiguous().reshape(-1)
        out = torch.empty(flat.shape, dtype=self.target)
        stats = EncodeStats()
        wider = torch.finfo(self.target).max > torch.finfo(flat.dtype).max
        # Block-wise so that the finite checks and error statistics need only cache-sized temporaries.
        for start in range(0, flat.numel(), BLOCK_ELEMS):
            ref = flat[start:start + BLOCK_ELEMS]
            require_finite(ref, self.name)
            low = out[start:start + BLOCK_ELEMS]
            low.copy_(ref)
            require_finite(low, f"{self.name} to {self.to} (overflow)")
            if wider:  # bf16 rounds fp16's 65408..65504 up to 65536: finite in bf16, inf once decoded
                require_finite(low.to(flat.dtype), f"{self.name} to {self.to} and back to {flat.dtype} (overflow)")
            stats = stats.merge(block_stats(ref, low))
        # One rounding costs at most eps/2 of each value (relative L2 too); values below the target's
        # normal range lose more (fp16: |x| < 6.1e-5, flushed to 0 under 3e-8). A chunk they dominate
        # (e.g. Adam's exp_avg_sq in fp16) is refused: stored lossless, with a warning.
        # float64 values below ~1e-154 square to 0 even scaled back (``_sq_sum``): all below any normal range
        tiny = stats.sq_ref_sum == 0 and flat.numel() > 0 and bool(flat.abs().amax() > 0)
        if tiny or stats.sq_error_sum > (2 * torch.finfo(self.target).eps) ** 2 * stats.sq_ref_sum:
            rel = 1.0 if tiny else (stats.sq_error_sum / stats.sq_ref_sum) ** 0.5
            raise LossyRefusedError(f"{self.name} to {self.to}: values below its normal range "
                                    f"({torch.finfo(self.target).tiny:.3g}) would lose their precision "
                                    f"(relative error {rel:.3g}); "
                                    f"{'use bf16 or ' if self.to != 'bfloat16' else ''}keep the tensor lossless")
        return tensor_bytes(out), finite_encoding(stats, self.name)

    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        rows, cols = check_shape(shape)
        if dtype not in QUANTIZABLE_DTYPES:
            raise FormatError(f"cast: cannot decode to dtype {dtype}")
        format_guard(memoryview(data).nbytes, rows * cols * 2, self.name)
        if rows * cols == 0:
            return torch.empty((rows, cols), dtype=dtype)
        low = bytes_to_uint8(data).view(self.target).view(rows, cols)
        # No finite check here (uniform and int8_block have one): a cast stores values, not
        # parameters, and checkrun before 2026-12-05 wrote inf for fp16 values near 65504 cast to bf16;
        # those checkpoints load as they did.
        return low.to(dtype).contiguous()

    def encoded_itemsize(self, dtype: torch.dtype) -> int:
        return 2

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "to": self.to}
