"""Row-wise asymmetric uniform quantization of a 2-D block, with optional greedy range search.

Each row ``x`` gets a stored minimum ``m`` and step ``s`` (fp16 or fp32) and codes
``c = clamp(round((x - m) / s), 0, 2**bits - 1)``; decode is ``c * s + m`` in float32 (float64 for
float64 tensors), cast to the tensor's dtype. The stored parameters are rounded *outwards*
(``m`` down, ``s`` up) so the stored grid still covers ``[min, max]``: for the plain range every
value's error is at most ``s / 2`` (plus float rounding and, for fp16/bf16 tensors, the final
cast to the tensor's dtype).

Greedy search (Guan et al. 2019; FBGEMM's ``param_search_greedy`` used by Check-N-Run): start
from ``[min, max]`` with step ``(max - min) / 200`` and 32 times move whichever end (min up or max
down) gives the lower L2 error, remembering the best range seen (the start included). It runs
vectorized over the rows; only the 32 steps are a Python loop. The search uses unrounded
parameters; the final choice per row between the greedy range and the full range is made on the
exact error with the *stored* parameters, so a row's greedy L2 error is never above its plain one.

Encoding runs on the calling (worker) thread, in numpy or in the C kernels of the optional
extension ``ckpt_core._cquant``; neither fans out to a thread pool (see ``_common``), and ctypes
releases the GIL for each kernel call. Decoding (``dequantize_rows``) is torch; all three compute
``c * s + m`` with the same float operations, so encode's error statistics describe exactly what
decode returns.

Native kernels (float32 tensors; float64/float16/bfloat16 ones use numpy): per-row min/max, codes
and errors with the stored parameters (byte-identical to numpy's, but for the sign of a zero
minimum when a row holds both +0 and -0), and the greedy search, about 5x faster than numpy's
(issue 24; benchmarks/bench_quant_speed.py). The search does numpy's float32 operations per
element and adds each row's squared errors in float32 in element order, as ``_direct_loss`` does on
many short rows (one row per vector lane, so the result is the same on every instruction set):
the same ranges there. Where numpy sums in another order (few rows, ``_sorted_loss`` on long rows)
the two can differ only where two candidates tie to float32 rounding; the stored-parameter check
below still guarantees never-worse-than-plain either way.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ._common import (TINY, array_stats, as_stored, compute_dtype, load_native, require_finite_np,
                      round_directed_np)
from .base import EncodeStats
from ..errors import LossyRefusedError

GREEDY_BINS = 200
"""The search step is ``(max - min) / GREEDY_BINS`` (FBGEMM's default)."""
GREEDY_STEPS = 32
"""Search steps: the range may shrink by up to 16% (FBGEMM's ``ratio=0.16`` of 200 bins)."""
SEARCH_ELEMS = 1 << 17
"""Elements per row block of the greedy search (its work arrays are 2 x this many floats).
Measured on 65536 x 64 fp32: 2**15 1.7 s, 2**16 1.4 s, 2**17 0.9-1.3 s, 2**18 1.4 s: smaller
blocks pay Python overhead per numpy call (~12 calls x 33 steps per block), larger ones cache misses."""
_ABI = 1  # checkrun_cquant_abi() of the C kernel this module was written for


def _load_native() -> ctypes.CDLL | None:
    """The C quantization kernels (``ckpt_core._cquant``), or None when they were not built."""
    lib = load_native("_cquant", "checkrun_cquant_abi", _ABI, "the greedy search runs in numpy")
    if lib is None:
        return None
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    lib.checkrun_greedy_search.argtypes = [ptr, size, size, size, ptr, ptr, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int, ptr, ptr]
    lib.checkrun_greedy_search.restype = ctypes.c_int
    lib.checkrun_quantize_rows.argtypes = [ptr, size, size, size, ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, ptr]
    lib.checkrun_quantize_rows.restype = ctypes.c_int
    lib.checkrun_row_minmax.argtypes = [ptr, size, size, size, ptr, ptr]
    lib.checkrun_row_minmax.restype = ctypes.c_int
    return lib


_NATIVE = _load_native()


def native_available() -> bool:
    """Whether float32 rows are quantized by the C kernels (greedy about 5x faster than numpy)."""
    return _NATIVE is not None


def stored_params(lo: np.ndarray, hi: np.ndarray, bits: int, sdt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (min, step) in ``sdt``, rounded outwards so that ``[lo, hi]`` stays covered.

    ValueError when they are not representable (e.g. ``|min| > 65504`` with fp16): the engine then
    stores the tensor lossless.
    """
    q = (1 << bits) - 1
    m = round_directed_np(lo.astype(np.float64), sdt, up=False)
    step = (hi.astype(np.float64) - m.astype(np.float64)) / q
    s = round_directed_np(step, sdt, up=True)
    # Rounding up moves a normal step by one ulp; a step below the dtype's normal range is rounded to
    # a multiple of its smallest subnormal (2**-24 for fp16), so a row of values ~1e-8 would decode
    # to its min. Refused where that makes the step (the error bound) 25% coarser *and* half a step
    # more than 1/64 of the row's largest value (a one-value row of 2e-5 needs a step of ~1e-9 only
    # to cover its min's rounding: 6e-8 is still 0.15% of it).
    # A step whose reciprocal overflows float32 (subnormal values, ~1e-40) made every code nan (found by
    # an independent check: refused as "values too large", with numpy's overflow warnings).
    s64 = s.astype(np.float64)
    coarse = s64 > 1.25 * step
    if (coarse.any() and (coarse & (s64 > 2.0 ** -5 * np.maximum(np.abs(lo), np.abs(hi)))).any()) or \
            ((s64 > 0) & (s64 < 1 / float(np.finfo(np.float32).max))).any():
        fix = "use scale_dtype fp32" if np.dtype(sdt) != np.float32 else "they cannot be quantized"
        raise LossyRefusedError(f"quantization steps underflow {np.dtype(sdt).name} (rows of values too small "
                                f"for it); {fix}")
    return m, s


def dequantize_rows(codes: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Decode: ``codes * s + m`` per row in the compute dtype of ``dtype``, returned as ``dtype``."""
    cdt = compute_dtype(dtype)
    out = codes.to(cdt).mul(s.to(cdt)[:, None]).add_(m.to(cdt)[:, None])
    return out.to(dtype)


def _float_codes(xc: np.ndarray, m: np.ndarray, s: np.ndarray, q: int) -> np.ndarray:
    """Nearest code on the stored grid, as floats (rows with step 0 are constant: code 0)."""
    inv = _inverse_steps(s, xc.dtype)
    t = np.subtract(xc, m.astype(xc.dtype)[:, None])
    t *= inv[:, None]
    np.rint(t, out=t)
    return np.clip(t, 0, q, out=t)


def _recon(codes: np.ndarray, m: np.ndarray, s: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """What decode returns for these float codes, in the compute dtype (same float ops as decode)."""
    out = np.multiply(codes, s.astype(codes.dtype)[:, None])
    out += m.astype(codes.dtype)[:, None]
    return as_stored(out, dtype)


def _row_sq_error(recon: np.ndarray, xc: np.ndarray) -> np.ndarray:
    d = np.subtract(recon, xc)
    return np.einsum("ij,ij->i", d, d)


# Greedy wins a row only if its error is smaller by this relative margin, far above float32
# rounding of the per-row sums: so it is smaller in exact arithmetic too, and a row's greedy
# L2 error is never above its plain one, however it is recomputed.
_GREEDY_MARGIN = 1e-4


def _direct_loss(u: np.ndarray, q: int):
    """Candidate loss by quantizing every element: cost O(C) per row and candidate.

    Returns the squared L2 error in step units; the search only compares losses of the same row.
    Short rows are processed transposed, (cols, rows): every ufunc then runs one long contiguous
    inner loop over rows with the per-row offsets as a contiguous operand (row-major, numpy would
    restart a short inner loop per row, ~3x slower), and the sum over columns adds whole rows.
    The work buffers are allocated once per search (fresh buffers on every step page-fault).
    """
    rows, cols = u.shape
    transposed = cols < 4 * rows
    v = np.ascontiguousarray(u.T) if transposed else u  # elements x rows, or rows x elements
    va = np.empty_like(v)
    t = np.empty((2,) + v.shape, dtype=u.dtype)
    r = np.empty_like(t)

    def loss(lows: np.ndarray, spacing: float) -> np.ndarray:
        a = u.dtype.type(1.0 / spacing)
        k = lows.shape[1]
        tk, rk = t[:k], r[:k]
        np.multiply(v, a, out=va)
        b = (lows * a).astype(u.dtype).T  # (k, rows)
        np.subtract(va, b[:, None, :] if transposed else b[:, :, None], out=tk)
        np.clip(tk, 0, q, out=rk)
        np.rint(rk, out=rk)
        tk -= rk  # error in grid units (of the unclipped value: clipping costs too)
        sq = np.einsum("kij,kij->kj" if transposed else "kij,kij->ki", tk, tk)
        return sq.T * (spacing * spacing)
    return loss


def _sorted_loss(u: np.ndarray, q: int):
    """Candidate loss from sorted rows and prefix sums: cost O(q log C) per row and candidate.

    With the row sorted, the values rounding to code ``m`` are a contiguous run found by binary
    search on the q thresholds, and summation by parts turns the per-cell sums
    ``sum((u - c_m)**2)`` into prefix sums at the thresholds. Returned is the squared error less
    the row constant ``sum(u**2)`` (only same-row comparisons matter); float64 keeps the
    cancellation harmless since u is within [0, 200]. numpy's searchsorted is 1-D: row ``i`` is
    shifted by ``256 * i`` (u and every threshold lie in [0, 256)), so all rows form one sorted array.
    """
    rows, cols = u.shape
    us = np.sort(u, axis=1).astype(np.float64)
    prefix = np.zeros((rows, cols + 1), dtype=np.float64)
    np.cumsum(us, axis=1, out=prefix[:, 1:])
    s1 = prefix[:, -1:]
    shift = 256.0 * np.arange(rows, dtype=np.float64)
    flat = (us + shift[:, None]).reshape(-1)
    base = (np.arange(rows) * cols)[:, None]
    half = np.arange(q, dtype=np.float64) + 0.5  # thresholds: (m - 0.5) spacings, m = 1..q

    def loss(lows: np.ndarray, spacing: float) -> np.ndarray:
        k = lows.shape[1]
        thr = lows.astype(np.float64)[:, :, None] + half * spacing  # (R, K, q)
        keys = (thr + shift[:, None, None]).reshape(rows, -1)
        idx = np.searchsorted(flat, keys.reshape(-1)).reshape(rows, -1) - base
        p1 = np.take_along_axis(prefix, idx, 1).reshape(rows, k, q).sum(-1)
        thr_idx = np.einsum("ijk,ijk->ij", thr, idx.reshape(rows, k, q).astype(np.float64))
        top = lows + q * spacing  # centre of the last cell
        return (top * cols - 2 * s1) * top + 2 * spacing * (p1 - thr_idx)
    return loss


_SORTED_FROM = {3: 512, 7: 1024, 15: 32768, 255: 32768}  # q (levels - 1) -> row length


def _search(u: np.ndarray, q: int) -> tuple[np.ndarray, np.ndarray]:
    """The greedy path over rows of ``u`` (step units): (steps at the min end, steps in all) of
    the best range seen per row, as floats."""
    # Long rows with few levels: O(q log C) per candidate beats O(C) from these row lengths on
    # (measured with numpy, whose 1-D searchsorted over all rows costs ~100 ns per query).
    loss = (_sorted_loss if u.shape[1] >= _SORTED_FROM[q] else _direct_loss)(u, q)
    rows = u.shape[0]
    moved_lo = np.zeros((rows, 1))  # steps taken at the min end
    offsets = np.array([[1.0, 0.0]])  # candidate 0 moves min, 1 moves max
    best = loss(moved_lo, GREEDY_BINS / q)[:, 0]
    best_lo, best_k = np.zeros(rows), np.zeros(rows)
    for k in range(1, GREEDY_STEPS + 1):
        err = loss(moved_lo + offsets, (GREEDY_BINS - k) / q)
        err0, err1 = err[:, 0], err[:, 1]
        moved_lo += (err0 < err1)[:, None]  # ties move the max end, as FBGEMM does
        cur = np.minimum(err0, err1)
        better = cur < best
        np.minimum(cur, best, out=best)
        best_lo[better] = moved_lo[better, 0]
        best_k[better] = k
    return best_lo, best_k


def greedy_range(xc: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy per-row range search; returns the best (lo, hi) seen, the start range included.

    Works in units of the search step, ``u = (x - lo) / step`` in [0, 200]: after ``k`` steps,
    ``i`` of them at the min end, a row's candidate range is ``[i, 200 - (k - i)]`` and its grid
    spacing ``(200 - k) / q`` is the same for every row. Rows are searched in blocks of about
    ``SEARCH_ELEMS`` elements (each row's result depends on that row only).
    """
    q = (1 << bits) - 1
    rows, cols = xc.shape
    step = (hi - lo) / xc.dtype.type(GREEDY_BINS)
    with np.errstate(divide="ignore"):
        inv = np.where(step > 0, 1 / np.where(step > 0, step, 1), 0).astype(xc.dtype)
    best_lo, best_k = np.empty(rows), np.empty(rows)
    if not _native_search(xc, lo, inv, q, best_lo, best_k):
        _numpy_search(xc, lo, inv, q, best_lo, best_k)
    best_hi = (best_k - best_lo).astype(xc.dtype)
    return lo + best_lo.astype(xc.dtype) * step, hi - best_hi * step


def _native_search(xc: np.ndarray, lo: np.ndarray, inv: np.ndarray, q: int, best_lo: np.ndarray,
                   best_k: np.ndarray) -> bool:
    """The search in the C kernel (float32 rows only); False when the caller must run it."""
    if _NATIVE is None or xc.dtype != np.float32:
        return False
    xc = _unit_stride(xc)
    lo, inv = np.ascontiguousarray(lo, np.float32), np.ascontiguousarray(inv, np.float32)
    return bool(_NATIVE.checkrun_greedy_search(xc.ctypes.data, xc.shape[0], xc.shape[1], xc.strides[0] // 4,
                                               lo.ctypes.data, inv.ctypes.data, q, GREEDY_BINS, GREEDY_STEPS,
                                               best_lo.ctypes.data, best_k.ctypes.data))


def _numpy_search(xc: np.ndarray, lo: np.ndarray, inv: np.ndarray, q: int, best_lo: np.ndarray,
                  best_k: np.ndarray) -> None:
    rows, cols = xc.shape
    per = max(1, SEARCH_ELEMS // max(cols, 1))
    for i in range(0, rows, per):
        j = min(i + per, rows)
        u = np.subtract(xc[i:j], lo[i:j, None])
        u *= inv[i:j, None]
        best_lo[i:j], best_k[i:j] = _search(u, q)


def quantize_rows(xc: np.ndarray, dtype: torch.dtype, bits: int, sdt: np.dtype,
                  greedy: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, EncodeStats]:
    """Quantize each row of a 2-D compute-dtype array holding values of a ``dtype`` tensor.

    Returns (codes as uint8 (R, C), min (R,), step (R,) in ``sdt``, stats). ValueError for
    inf/nan input or parameters not representable in ``sdt``.
    """
    q = (1 << bits) - 1
    native = _NATIVE is not None and xc.dtype == np.float32 and dtype == torch.float32 and xc.size > 0
    if native:
        xc = _unit_stride(xc)
        lo, hi = _native_minmax(xc)
    else:
        lo, hi = xc.min(1), xc.max(1)  # min/max propagate nan; an inf shows up in one of them
    require_finite_np(lo, "uniform")
    require_finite_np(hi, "uniform")
    m, s = stored_params(lo, hi, bits, sdt)
    if native:
        done = _quantize_native(xc, lo, hi, m, s, bits, sdt, greedy)
        if done is not None:
            return done
    codes = _float_codes(xc, m, s, q)
    recon = _recon(codes, m, s, dtype)
    if greedy and xc.shape[1] > 1:
        gm, gs = stored_params(*greedy_range(xc, lo, hi, bits), bits, sdt)
        gcodes = _float_codes(xc, gm, gs, q)
        grecon = _recon(gcodes, gm, gs, dtype)
        use = _row_sq_error(grecon, xc) < _row_sq_error(recon, xc) * (1 - _GREEDY_MARGIN)
        m, s = np.where(use, gm, m), np.where(use, gs, s)
        codes[use], recon[use] = gcodes[use], grecon[use]
    return codes.astype(np.uint8), m, s, array_stats(xc, recon)


def _unit_stride(xc: np.ndarray) -> np.ndarray:
    """``xc``, copied only if its rows are not runs of consecutive float32 (what the C kernels read)."""
    return xc if xc.strides[1] == 4 and xc.strides[0] >= 0 and xc.strides[0] % 4 == 0 else np.ascontiguousarray(xc)


def _native_minmax(xc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (min, max) of float32 rows from the C kernel (nan for rows with inf or nan)."""
    lo, hi = np.empty(xc.shape[0], np.float32), np.empty(xc.shape[0], np.float32)
    _NATIVE.checkrun_row_minmax(xc.ctypes.data, xc.shape[0], xc.shape[1], xc.strides[0] // 4, lo.ctypes.data,
                                hi.ctypes.data)
    return lo, hi


def _inverse_steps(s: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``1 / step`` per row as ``_float_codes`` computes it (0 for constant rows)."""
    sf = s.astype(dtype)
    with np.errstate(divide="ignore"):
        return np.where(sf > 0, 1 / np.where(sf > 0, sf, 1), 0).astype(dtype)


def _native_codes(xc: np.ndarray, m: np.ndarray, s: np.ndarray,
                  q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(uint8 codes, squared error per row, max abs error per row, sum of squares per row) of a
    float32 tensor's rows with stored parameters (m, s), from the C kernel: the codes of
    ``_float_codes`` and the errors of ``_recon``; None when the caller must use numpy."""
    inv = _inverse_steps(s, xc.dtype)
    if not np.isfinite(inv).all():  # a step below 1/FLT_MAX: keep numpy's inf/nan semantics
        return None
    rows, cols = xc.shape
    codes = np.empty((rows, cols), np.uint8)
    err, ref, top = np.empty(rows), np.empty(rows), np.empty(rows, np.float32)
    mf, sf = np.ascontiguousarray(m, np.float32), np.ascontiguousarray(s, np.float32)
    _NATIVE.checkrun_quantize_rows(xc.ctypes.data, rows, cols, xc.strides[0] // 4, mf.ctypes.data,
                                   sf.ctypes.data, inv.ctypes.data, q, codes.ctypes.data, err.ctypes.data,
                                   top.ctypes.data, ref.ctypes.data)
    return codes, err, top, ref


def _quantize_native(xc: np.ndarray, lo: np.ndarray, hi: np.ndarray, m: np.ndarray, s: np.ndarray, bits: int,
                     sdt: np.dtype, greedy: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, EncodeStats] | None:
    """``quantize_rows`` for float32 tensors in the C kernel (same codes and choices); None when
    the caller must use numpy (also for values so small that the kernel's float32 squares underflow:
    numpy's statistics scale them, ``_common.TINY``)."""
    if xc.size and 0 < max(-float(lo.min()), float(hi.max())) < TINY:
        return None
    plain = _native_codes(xc, m, s, (1 << bits) - 1)
    if plain is None:
        return None
    codes, err, top, ref = plain
    if greedy and xc.shape[1] > 1:
        gm, gs = stored_params(*greedy_range(xc, lo, hi, bits), bits, sdt)
        found = _native_codes(xc, gm, gs, (1 << bits) - 1)
        if found is None:
            return None
        gcodes, gerr, gtop, _ = found
        use = gerr < err * (1 - _GREEDY_MARGIN)
        m, s, err, top = np.where(use, gm, m), np.where(use, gs, s), np.where(use, gerr, err), np.where(use, gtop, top)
        codes[use] = gcodes[use]
    return codes, m, s, EncodeStats(float(top.max()), float(err.sum()), float(ref.sum()))

