"""A chunk's full encoding: one ArrayCodec, then BytesCodec stages; described in the manifest.

``Pipeline.to_list()`` is what the manifest stores; ``Pipeline.from_list`` rebuilds it and refuses
anything it does not know. ``spec_id`` is a short stable hash of that description, which the
engine mixes into content addresses (the same tensor bytes encoded differently must not dedup).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from ..config import CompressionConfig
from ..errors import FormatError
from ._common import QUANTIZABLE_DTYPES, check_shape, format_guard, tensor_bytes
from .base import ArrayCodec, BytesCodec, EncodeStats, codec_from_dict
from .cast import CastCodec
from .int8_block import Int8BlockCodec
from .raw import RawCodec, dtype_itemsize
from .shuffle import ShuffleCodec
from .shuffle_zstd import ShuffleZstdCodec
from .uniform import UniformCodec
from .zstd import ZstdCodec


@dataclass(frozen=True)
class Pipeline:
    """``array`` (tensor -> bytes) followed by ``stages`` (bytes -> bytes), applied in order.

    Immutable and thread-safe: the engine shares one pipeline across its worker threads.
    """

    array: ArrayCodec
    stages: tuple[BytesCodec, ...] = ()

    @property
    def lossy(self) -> bool:
        """True if decoding does not give back the exact input (quantization, down-cast)."""
        return self.array.lossy

    def encode(self, tensor2d: torch.Tensor) -> tuple[bytes | memoryview, EncodeStats]:
        """Encode a contiguous 2-D CPU tensor (called on a background worker thread).

        A pipeline without byte stages may return a memoryview that aliases ``tensor2d`` (raw is
        zero-copy): it must be consumed before the tensor is modified or freed. ``LossyRefusedError``
        from a lossy codec (inf/nan, unrepresentable scale) means: store this tensor lossless
        instead; any other exception is a bug.
        """
        if tensor2d.dim() != 2:
            raise ValueError(f"pipeline input must be 2-D, got shape {tuple(tensor2d.shape)}")
        data, stats = self.array.encode(tensor2d)
        for stage in self.stages:
            data = stage.encode(data)
        return data, stats

    def decode(self, data: bytes | memoryview, shape: tuple[int, int], dtype: torch.dtype,
               max_bytes: int) -> torch.Tensor:
        """Decode to a contiguous tensor of ``shape`` and ``dtype``; FormatError if anything does
        not fit. No stage may produce more than ``max_bytes``, nor may the decoded tensor."""
        rows, cols = _check_limits(data, shape, dtype, max_bytes)
        for stage in reversed(self.stages):
            data = stage.decode(data, max_bytes)
        out = self.array.decode(data, (rows, cols), dtype)
        if tuple(out.shape) != (rows, cols) or out.dtype != dtype:  # pragma: no cover - codec bug
            raise FormatError(f"{self.array.name} decoded {tuple(out.shape)} {out.dtype}, "
                              f"expected {(rows, cols)} {dtype}")
        return out

    def decode_into(self, data: bytes | memoryview, out: torch.Tensor, max_bytes: int,
                    scratch: Callable[[Hashable, int], memoryview] | None = None) -> None:
        """Decode into ``out``, a contiguous 2-D CPU tensor of the chunk's shape and dtype.

        Same checks and errors as ``decode``. Lossless pipelines write each stage's output into
        the next buffer without allocating: ``scratch(slot, nbytes)`` lends the buffers between
        stages and those a stage needs itself (fresh ones if None), and the last stage writes into
        ``out`` itself; other array codecs decode and copy.
        """
        _check_limits(data, tuple(out.shape), out.dtype, max_bytes)
        if not isinstance(self.array, RawCodec) or out.numel() == 0 or not out.is_contiguous():
            out.copy_(self.decode(data, tuple(out.shape), out.dtype, max_bytes))
            return
        dest = tensor_bytes(out)
        stages = list(reversed(self.stages))
        for i, stage in enumerate(stages):
            last = i == len(stages) - 1
            target = dest if last else (scratch(i, dest.nbytes) if scratch else memoryview(bytearray(dest.nbytes)))
            stage.decode_into(data, target, (lambda n, i=i: scratch(("stage", i), n)) if scratch else None)
            data = target
        if not stages:
            format_guard(memoryview(data).nbytes, dest.nbytes, self.array.name)
            dest[:] = memoryview(data).cast("B")

    def to_list(self) -> list[dict[str, Any]]:
        """The manifest form: one ``to_dict`` per codec, array codec first."""
        return [self.array.to_dict()] + [stage.to_dict() for stage in self.stages]

    @classmethod
    def from_list(cls, specs: Any) -> "Pipeline":
        """Rebuild from ``to_list`` output; FormatError for anything malformed or unknown."""
        if not isinstance(specs, (list, tuple)) or not specs:
            raise FormatError(f"codec pipeline must be a non-empty list, got {specs!r}")
        codecs = [codec_from_dict(spec) for spec in specs]
        if not isinstance(codecs[0], ArrayCodec):
            raise FormatError(f"codec pipeline must start with an array codec, not {codecs[0].name!r}")
        for codec in codecs[1:]:
            if not isinstance(codec, BytesCodec):
                raise FormatError(f"array codec {codec.name!r} may only come first in a pipeline")
        return cls(codecs[0], tuple(codecs[1:]))

    @functools.cached_property
    def spec_id(self) -> str:
        """16 hex digits of SHA-256 over the canonical JSON of ``to_list()``; stable across runs
        (computed once per pipeline: a save asks for it several times per tensor)."""
        text = json.dumps(self.to_list(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_limits(data: bytes | memoryview, shape: Any, dtype: Any, max_bytes: int) -> tuple[int, int]:
    rows, cols = check_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"dtype must be a torch.dtype, got {dtype!r}")
    if rows * cols * dtype_itemsize(dtype) > max_bytes:
        raise FormatError(f"chunk of shape {shape} and dtype {dtype} exceeds the limit of {max_bytes} bytes")
    if memoryview(data).nbytes > max_bytes:
        raise FormatError(f"encoded chunk of {memoryview(data).nbytes} bytes exceeds the limit of {max_bytes}")
    return rows, cols


def _byte_stages(itemsize: int, compression: CompressionConfig) -> tuple[BytesCodec, ...]:
    """shuffle + zstd per byte plane (multi-byte elements), zstd alone, or nothing when
    compression is off.

    Shuffling only helps the compressor, so ``compress=False`` (store raw bytes) drops it too.
    (Checkpoints of earlier versions used a ``shuffle`` stage then one ``zstd`` frame per chunk;
    both codecs still decode.)
    """
    if not compression.compress:
        return ()
    if compression.shuffle and itemsize > 1:
        return (ShuffleZstdCodec(itemsize, compression.zstd_level, compression.zstd_threads),)
    return (ZstdCodec(compression.zstd_level, compression.zstd_threads),)


def lossless_pipeline(dtype: torch.dtype, compression: CompressionConfig) -> Pipeline:
    """raw -> shuffle_zstd(itemsize) (or zstd for 1-byte elements), as ``compression`` allows."""
    return Pipeline(RawCodec(), _byte_stages(dtype_itemsize(dtype), compression))


def index_pipeline() -> Pipeline:
    """Row indices of deltas always use one fixed lossless pipeline, whatever the config says.

    The manifest does not record it, so it must never change: byte-shuffle then one zstd frame
    (spelled out rather than taken from the defaults, which may move on)."""
    return Pipeline(RawCodec(), (ShuffleCodec(8), ZstdCodec(1, 0)))


def lossy_pipeline(method: str, dtype: torch.dtype, ndim: int, compression: CompressionConfig, *,
                   bits: int = 4, block_size: int = 256, scale_dtype: str = "fp16",
                   greedy: bool = True) -> Pipeline:
    """The pipeline of one lossy ``method`` with its codec parameters spelled out (which tensors
    are lossy, and with how many bits, is the planner's business: ``saving.plan``).

    ``ndim`` is the tensor's own rank: tensors of rank <= 1 reach the codec as one row (1, n),
    so uniform quantization switches to blocks of ``block_size``. ValueError for dtypes the
    lossy codecs do not take and for unknown methods.
    """
    if dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"cannot quantize dtype {dtype}")
    if method == "uniform":
        array: ArrayCodec = UniformCodec(bits=bits, block_size=block_size if ndim <= 1 else None,
                                         scale_dtype=scale_dtype, greedy=greedy)
        stages = _byte_stages(1, compression)
    elif method in ("bf16", "fp16"):
        array = CastCodec("bfloat16" if method == "bf16" else "float16")
        stages = _byte_stages(2, compression)
    elif method == "int8_block":
        array = Int8BlockCodec(block_size)
        stages = _byte_stages(1, compression)
    else:
        raise ValueError(f"unknown quantization method {method!r}")
    return Pipeline(array, stages)
