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

Encoding is numpy on the calling (worker) thread: ufuncs never fan out to a thread pool (see
``_common``). Decoding (``dequantize_rows``) is torch; both compute ``c * s + m`` with the same
float operations, so encode's error statistics describe exactly what decode returns.
"""
from __future__ import annotations

import numpy as np
import torch

from ._common import array_stats, as_stored, compute_dtype, require_finite_np, round_directed_np
from .base import EncodeStats

GREEDY_BINS = 200
"""The search step is ``(max - min) / GREEDY_BINS`` (FBGEMM's default)."""
GREEDY_STEPS = 32
"""Search steps: the range may shrink by up to 16% (FBGEMM's ``ratio=0.16`` of 200 bins)."""
SEARCH_ELEMS = 1 << 17
"""Elements per row block of the greedy search (its work arrays are 2 x this many floats).
Measured on 65536 x 64 fp32: 2**15 1.7 s, 2**16 1.4 s, 2**17 0.9-1.3 s, 2**18 1.4 s: smaller
blocks pay Python overhead per numpy call (~12 calls x 33 steps per block), larger ones cache misses."""


def stored_params(lo: np.ndarray, hi: np.ndarray, bits: int, sdt: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (min, step) in ``sdt``, rounded outwards so that ``[lo, hi]`` stays covered.

    ValueError when they are not representable (e.g. ``|min| > 65504`` with fp16): the engine then
    stores the tensor lossless.
    """
    q = (1 << bits) - 1
    m = round_directed_np(lo.astype(np.float64), sdt, up=False)
    s = round_directed_np((hi.astype(np.float64) - m.astype(np.float64)) / q, sdt, up=True)
    return m, s


def dequantize_rows(codes: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Decode: ``codes * s + m`` per row in the compute dtype of ``dtype``, returned as ``dtype``."""
    cdt = compute_dtype(dtype)
    out = codes.to(cdt).mul(s.to(cdt)[:, None]).add_(m.to(cdt)[:, None])
    return out.to(dtype)


def _float_codes(xc: np.ndarray, m: np.ndarray, s: np.ndarray, q: int) -> np.ndarray:
    """Nearest code on the stored grid, as floats (rows with step 0 are constant: code 0)."""
    sf = s.astype(xc.dtype)
    with np.errstate(divide="ignore"):
        inv = np.where(sf > 0, 1 / np.where(sf > 0, sf, 1), 0).astype(xc.dtype)
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
    per = max(1, SEARCH_ELEMS // max(cols, 1))
    for i in range(0, rows, per):
        j = min(i + per, rows)
        u = np.subtract(xc[i:j], lo[i:j, None])
        u *= inv[i:j, None]
        best_lo[i:j], best_k[i:j] = _search(u, q)
    best_hi = (best_k - best_lo).astype(xc.dtype)
    return lo + best_lo.astype(xc.dtype) * step, hi - best_hi * step


def quantize_rows(xc: np.ndarray, dtype: torch.dtype, bits: int, sdt: np.dtype,
                  greedy: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, EncodeStats]:
    """Quantize each row of a 2-D compute-dtype array holding values of a ``dtype`` tensor.

    Returns (codes as uint8 (R, C), min (R,), step (R,) in ``sdt``, stats). ValueError for
    inf/nan input or parameters not representable in ``sdt``.
    """
    q = (1 << bits) - 1
    lo, hi = xc.min(1), xc.max(1)  # min/max propagate nan; an inf shows up in one of them
    require_finite_np(lo, "uniform")
    require_finite_np(hi, "uniform")
    m, s = stored_params(lo, hi, bits, sdt)
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
