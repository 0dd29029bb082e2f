"""Codec interfaces: composable, self-describing stages of a chunk's encoding pipeline.

A pipeline is one ``ArrayCodec`` (tensor -> bytes: raw, cast, quantize) followed by any number of
``BytesCodec`` stages (bytes -> bytes: byte-shuffle, zstd). Each codec has a ``name`` and ``version``
and round-trips through ``to_dict``/``codec_from_dict``; unknown names or versions raise FormatError.
Codecs are pure and thread-safe; heavy work runs in numpy/torch/zstd code that releases the GIL.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ..errors import FormatError


@dataclass(frozen=True)
class EncodeStats:
    """Error of a lossy encoding of one chunk (all zero for lossless codecs)."""

    max_abs_error: float = 0.0
    sq_error_sum: float = 0.0
    sq_ref_sum: float = 0.0

    def merge(self, other: "EncodeStats") -> "EncodeStats":
        return EncodeStats(max(self.max_abs_error, other.max_abs_error),
                           self.sq_error_sum + other.sq_error_sum,
                           self.sq_ref_sum + other.sq_ref_sum)


class ArrayCodec(ABC):
    """tensor (CPU, contiguous, 2-D rows x cols) -> bytes, and back."""

    name: ClassVar[str]
    version: ClassVar[int]
    lossy: ClassVar[bool] = False

    @abstractmethod
    def encode(self, array: torch.Tensor) -> tuple[bytes | memoryview, EncodeStats]:
        """Encode a contiguous 2-D CPU tensor. Called on a background worker thread."""

    @abstractmethod
    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Return a contiguous 2-D tensor of ``shape`` and ``dtype``; FormatError if ``data`` does not fit."""

    @abstractmethod
    def encoded_itemsize(self, dtype: torch.dtype) -> int:
        """Element size of the encoded bytes (the byte-shuffle width); 1 if not element-structured."""

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        """``{"name": ..., "version": ..., **params}``."""


#: ``scratch(nbytes)``: a writable buffer of at least ``nbytes`` that a ``decode_into`` call may use
#: for its own intermediate data, reused across calls on the same thread (instead of allocating).
Scratch = Callable[[int], memoryview]


class BytesCodec(ABC):
    """bytes -> bytes, and back."""

    name: ClassVar[str]
    version: ClassVar[int]

    @abstractmethod
    def encode(self, data: bytes | memoryview) -> bytes | memoryview:
        ...

    @abstractmethod
    def decode(self, data: bytes | memoryview, max_output: int) -> bytes | memoryview:
        """Inverse of encode; never produces more than ``max_output`` bytes (FormatError instead)."""

    def decode_into(self, data: bytes | memoryview, out: memoryview, scratch: Scratch | None = None) -> None:
        """Decode into the writable byte buffer ``out``, which the output must fill exactly
        (FormatError otherwise). Codecs override this to skip the intermediate buffer; one that
        needs a buffer of its own takes it from ``scratch`` (allocates one if None)."""
        decoded = memoryview(self.decode(data, out.nbytes)).cast("B")
        if decoded.nbytes != out.nbytes:
            raise FormatError(f"{self.name}: decoded {decoded.nbytes} bytes, expected {out.nbytes}")
        out[:] = decoded

    @abstractmethod
    def to_dict(self) -> dict[str, Any]:
        ...


_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator adding a codec to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def codec_from_dict(spec: Any) -> ArrayCodec | BytesCodec:
    """Rebuild a codec from ``to_dict`` output; FormatError for unknown names, versions or params."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise FormatError(f"codec spec must be a mapping with a name, got {spec!r}")
    cls = _REGISTRY.get(spec["name"])
    if cls is None:
        raise FormatError(f"unknown codec {spec['name']!r} (known: {', '.join(sorted(_REGISTRY))})")
    if spec.get("version") != cls.version:
        raise FormatError(f"codec {cls.name!r} version {spec.get('version')!r} is not supported "
                          f"(this checkrun reads version {cls.version})")
    params = {k: v for k, v in spec.items() if k not in ("name", "version")}
    try:
        return cls.from_params(**params)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"codec {cls.name!r}: invalid parameters {params!r}: {exc}") from None
