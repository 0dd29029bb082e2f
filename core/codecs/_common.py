"""Helpers shared by the codecs: byte views of tensors, directed rounding, error statistics.

Everything here is pure and thread-safe; the heavy lifting is torch/numpy code that releases the GIL.
The ``*_np`` helpers serve the quantizing encoders, which run on the engine's worker threads in
numpy: numpy ufuncs never fan out to a thread pool, whereas every torch op over more than 32768
elements fans out to torch's OpenMP team (two workers x two OpenMP threads on two busy cores
thrash, 10-16x slower; docs/benchmarks.md P4). Avoid ``np.dot``/``matmul`` there (BLAS threads).
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import math
from typing import Any, Callable

import numpy as np
import torch
import xxhash

from ..errors import FormatError, LossyRefusedError
from .base import EncodeStats

log = logging.getLogger("ckpt_core.codecs")


#: ``checkrun_crows_abi()`` of the C kernel ``ckpt_core._crows`` this checkrun was written for
#: (its users: saving.streams, loading.decode, steplog.capture).
CROWS_ABI = 3


def load_native(module: str, abi_symbol: str, abi: int, fallback: str) -> ctypes.CDLL | None:
    """The optional C kernels ``ckpt_core.<module>`` (built by setup.py where a compiler exists),
    or None - then ``fallback`` (what runs instead, for the log line) is used. ``abi_symbol`` names
    the library's interface-version function; a library of another version is not used."""
    try:
        spec = importlib.util.find_spec(f"ckpt_core.{module}")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        log.debug("ckpt_core.%s was not built; %s", module, fallback)
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        found = getattr(lib, abi_symbol)()
    except (OSError, AttributeError) as exc:
        log.warning("cannot load %s (%s); %s", spec.origin, exc, fallback)
        return None
    if found != abi:
        log.warning("%s has interface %s, expected %s (rebuild with pip install); %s", spec.origin, found, abi,
                    fallback)
        return None
    return lib

#: The float dtypes the lossy codecs take (one definition; quantization rules select only these).
QUANTIZABLE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

#: Elements the lossy codecs process at once. Temporaries are a few times this many floats (a few
#: MB, the greedy search ~16 bytes per element); smaller blocks lose to the fixed cost of each
#: torch call (~5-10 us here), larger ones to cache misses.
BLOCK_ELEMS = 1 << 18

_SCALE_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
_NP_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
              torch.float64: np.dtype(np.float64)}


def scale_dtype(name: str) -> torch.dtype:
    """``"fp16"``/``"fp32"`` -> torch dtype; ValueError otherwise (becomes FormatError on decode)."""
    try:
        return _SCALE_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"scale_dtype must be 'fp16' or 'fp32', got {name!r}") from None


def check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    """Validate an integer codec parameter (bools are refused: they are ints to Python)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def check_shape(shape: object) -> tuple[int, int]:
    """A decode ``shape`` must be two non-negative ints (a manifest is untrusted input)."""
    if (not isinstance(shape, (tuple, list)) or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise FormatError(f"chunk shape must be two non-negative integers, got {shape!r}")
    return int(shape[0]), int(shape[1])


def tensor_bytes(array: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included).

    The view aliases the tensor's storage: it is valid only while the tensor is neither freed nor
    mutated (the engine encodes from staging buffers it does not reuse before the chunk is stored).
    """
    flat = array.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_digest(tensor: torch.Tensor) -> tuple:
    """A digest of a tensor's bytes: xxh3 on the CPU (any change, a permutation too); on a device,
    ``position_sums`` computed there (no copy to the host)."""
    t = tensor.detach().resolve_conj().resolve_neg().contiguous()  # byte views refuse those flags
    if t.device.type == "cpu":
        return ("xxh3", xxhash.xxh3_64_intdigest(tensor_bytes(t)) if t.numel() else 0)
    return ("psum", position_sums(t))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer of each (int64) value: pseudo-random, far from linear in its input."""
    x = (x * 0x9E3779B1) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def position_sums(t: torch.Tensor, step: int = 1 << 20) -> tuple[int, ...]:
    """Per ``step`` 32-bit words of contiguous ``t``: their sum and two sums weighted by pseudo-random
    per-position weights (int64, wrapping), in one transfer to the host. A permutation of the words, or
    changes whose sum is zero, change it but by chance (plain sums, the device digest before
    2026-12-07, missed every permutation; linear weights, rotations: found by independent checks)."""
    flat = t.reshape(-1).view(torch.uint8)
    aligned = flat.numel() % 4 == 0 and flat.storage_offset() % 4 == 0  # view(int32) needs both
    words = flat.view(torch.int32) if aligned else flat
    if not words.numel():
        return ()
    pos = torch.arange(min(step, words.numel()), dtype=torch.int64, device=t.device)
    weights = [_mix32(pos + seed) for seed in (0x2545F491, 0x6C8E9CF5)]
    sums = []
    for i in range(0, words.numel(), step):
        part = words[i:i + step].to(torch.int64)
        sums += [part.sum(), *((part * w[:part.numel()]).sum() for w in weights)]
    return tuple(torch.stack(sums).tolist())


def bytes_to_uint8(data: bytes | memoryview | bytearray) -> torch.Tensor:
    """A writable, 16-byte aligned uint8 tensor over ``data``; copies only when it has to.

    Read-only buffers (``bytes`` from zstd) are copied because torch tensors must be writable;
    misaligned buffers are copied so that wider dtype views never see unaligned elements.
    """
    if memoryview(data).nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    arr = np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.writeable or arr.ctypes.data % 16:
        arr = arr.copy()
    return torch.from_numpy(arr)


def require_quantizable(array: torch.Tensor, codec: str) -> None:
    """Lossy codecs take 2-D float16/bfloat16/float32/float64 CPU tensors only."""
    if array.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"{codec}: cannot encode dtype {array.dtype} (floating point only)")
    if array.dim() != 2:
        raise ValueError(f"{codec}: expected a 2-D tensor, got shape {tuple(array.shape)}")


def finite_encoding(stats: "EncodeStats", codec: str) -> "EncodeStats":
    """``stats`` of an encoding whose reconstruction and error statistics are finite; LossyRefusedError
    otherwise (a value at the dtype's limit whose step or scale carries it past, or values near
    float32's limit whose squares overflow the statistics the manifest records: stored lossless)."""
    if not math.isfinite(stats.max_abs_error):
        raise LossyRefusedError(f"{codec}: the quantized values would overflow their dtype")
    if not (math.isfinite(stats.sq_error_sum) and math.isfinite(stats.sq_ref_sum)):
        raise LossyRefusedError(f"{codec}: values too large for the error statistics (their squares overflow)")
    return stats


def finite_decoding(out: torch.Tensor, codec: str) -> torch.Tensor:
    """``out`` of a lossy decode, which must be finite: encoders refuse inf/nan inputs and
    reconstructions (``finite_encoding``), so inf or nan here comes from damaged or forged parameters
    that are finite themselves (a step of 3e38). min/max expose both and are cheaper than isfinite."""
    if out.numel() and not (math.isfinite(float(out.amin())) and math.isfinite(float(out.amax()))):
        raise FormatError(f"{codec}: decodes to inf or nan (damaged or forged quantization parameters)")
    return out


def require_finite(values: torch.Tensor, codec: str) -> None:
    """LossyRefusedError if ``values`` holds inf/nan: the writer then stores the tensor lossless.

    Quantizing inf/nan would turn them into finite garbage (or poison a whole row's scale).
    min/max propagate nan and expose infs, and are much faster than ``isfinite().all()``.
    """
    if values.numel() and not (math.isfinite(float(values.amin())) and math.isfinite(float(values.amax()))):
        raise LossyRefusedError(f"{codec}: input contains inf or nan; it cannot be quantized")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs are processed in float64, everything else in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_stats(ref: torch.Tensor, recon: torch.Tensor) -> EncodeStats:
    """Error statistics of one block: ``recon`` (as decode returns it) against ``ref``.

    Works in float64 for float64 inputs and float32 otherwise (the difference of nearby floats is
    exact; a block is small enough that float32 sums lose nothing that matters for a statistic);
    the caller sums blocks in Python floats (float64).
    """
    if ref.numel() == 0:
        return EncodeStats()
    cdt = compute_dtype(ref.dtype)
    r = ref.to(cdt).reshape(-1)
    err = recon.to(cdt).reshape(-1) - r
    max_abs = max(float(err.amax()), -float(err.amin()))  # faster than abs().max() or inf-norm
    return EncodeStats(max_abs, _sq_sum(err, max_abs, torch.dot), _sq_sum(r, max(float(r.amax()), -float(r.amin())),
                                                                           torch.dot))


#: Below this largest magnitude, squares are summed scaled up by a power of two (exact): squared in
#: float32 they fall under its range (~1e-38) and read 0, and an fp16 cast that zeroed a tensor of
#: ~1e-25 values (Adam's exp_avg_sq) recorded no error and was not refused (found by an independent check).
TINY = 2.0 ** -60


def _sq_sum(x: Any, largest: float, dot: Callable[[Any, Any], Any]) -> float:
    """Sum of squares of the flat ``x`` (``dot(x, x)``), exact in range for tiny values."""
    if 0 < largest < TINY:
        k = 1 - math.frexp(largest)[1]  # x * 2**k has its largest magnitude in [0.5, 1)
        y = x * (2.0 ** (k // 2)) * (2.0 ** (k - k // 2))  # two factors: 2**k may exceed float32's range
        return float(dot(y, y)) * 2.0 ** (-2 * k)
    return float(dot(x, x))


def format_guard(nbytes: int, expected: int, codec: str) -> None:
    """FormatError unless an encoded buffer has exactly the size its shape implies."""
    if nbytes != expected:
        raise FormatError(f"{codec}: encoded data has {nbytes} bytes, expected {expected}")


# ---------------------------------------------------------------- numpy helpers for the encoders

def np_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy dtype of float16/float32/float64 (scale dtypes, compute dtypes)."""
    return _NP_DTYPES[dtype]


def compute_array(x: torch.Tensor) -> np.ndarray:
    """The values of a float CPU tensor as a float32 numpy array (float64 for float64 tensors).

    float32/float64 tensors are returned as zero-copy (possibly strided) views: read only. The
    bfloat16 -> float32 widening is exact (the bf16 bits are the high half of the float32).
    """
    if x.dtype in (torch.float32, torch.float64):
        return x.numpy()
    if x.dtype == torch.float16:
        return x.numpy().astype(np.float32)
    bits = x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    return np.left_shift(bits, 16, out=bits).view(np.float32)


def as_stored(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Compute-dtype ``values`` rounded to ``dtype`` the way ``Tensor.to(dtype)`` rounds (to
    nearest, ties to even) and widened back: what decode returns, for exact error statistics."""
    if dtype in (torch.float32, torch.float64):
        return values
    if dtype == torch.float16:
        return values.astype(np.float16).astype(np.float32)
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits >> 16) & 1
    rounded += bits
    rounded += 0x7FFF  # finite values only (encode refuses inf/nan); ties go to the even bf16
    rounded &= 0xFFFF0000
    return rounded.view(np.float32)


def require_finite_np(values: np.ndarray, codec: str) -> None:
    """``require_finite`` for numpy arrays of per-row (or per-block) minima and maxima."""
    if values.size and not np.isfinite(values).all():
        raise LossyRefusedError(f"{codec}: input contains inf or nan; it cannot be quantized")


def round_directed_np(x64: np.ndarray, dtype: np.dtype, up: bool) -> np.ndarray:
    """Round float64 values to ``dtype`` towards +inf (``up``) or -inf, so stored parameters never
    shrink the range they must cover. LossyRefusedError if a value is not representable."""
    with np.errstate(over="ignore"):
        r = x64.astype(dtype)
    back = r.astype(np.float64)
    wrong = back < x64 if up else back > x64
    if wrong.any():
        r = np.where(wrong, np.nextafter(r, np.array(np.inf if up else -np.inf, dtype)), r)
    if not np.isfinite(r).all():
        raise LossyRefusedError(f"quantization parameters overflow {dtype}; use a wider scale dtype")
    return r


def array_stats(ref: np.ndarray, recon: np.ndarray) -> EncodeStats:
    """``block_stats`` for 2-D compute-dtype numpy arrays of the same shape (``recon`` as decode
    returns it). ``einsum`` (no BLAS) sums squares per row in one pass; rows add up in float64."""
    if ref.size == 0:
        return EncodeStats()
    err = np.subtract(recon, ref)
    max_abs = max(float(err.max()), -float(err.min()))

    def rows(x: np.ndarray, y: np.ndarray) -> float:
        return np.einsum("ij,ij->i", x, y).sum(dtype=np.float64)
    peak = max(float(ref.max()), -float(ref.min()))
    return EncodeStats(max_abs, _sq_sum(err, max_abs, rows), _sq_sum(ref, peak, rows))
