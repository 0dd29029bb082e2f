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
vectorized over the rows of the block; only the 32 steps are a Python loop. The search uses
unrounded parameters; the final choice per row between the greedy range and the full range is
made on the exact error with the *stored* parameters, so a row's greedy L2 error is never above
its plain one.
"""
from __future__ import annotations

import numpy as np
import torch

from ._common import block_stats, compute_dtype, require_finite, round_directed
from .base import EncodeStats

GREEDY_BINS = 200
"""The search step is ``(max - min) / GREEDY_BINS`` (FBGEMM's default)."""
GREEDY_STEPS = 32
"""Search steps: the range may shrink by up to 16% (FBGEMM's ``ratio=0.16`` of 200 bins)."""


def stored_params(lo: torch.Tensor, hi: torch.Tensor, bits: int,
                  sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (min, step) in ``sdt``, rounded outwards so that ``[lo, hi]`` stays covered.

    ValueError when they are not representable (e.g. ``|min| > 65504`` with fp16): the engine then
    stores the tensor lossless.
    """
    q = (1 << bits) - 1
    m = round_directed(lo.to(torch.float64), sdt, up=False)
    s = round_directed((hi.to(torch.float64) - m.to(torch.float64)) / q, sdt, up=True)
    return m, s


def dequantize_rows(codes: torch.Tensor, m: torch.Tensor, s: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``codes * s + m`` per row in the compute dtype of ``dtype``, returned as ``dtype``.

    ``codes`` may be uint8 or already in the compute dtype (encode's float codes); both give the
    same values, so encode's error statistics describe exactly what decode returns.
    """
    cdt = compute_dtype(dtype)
    out = codes.to(cdt).mul(s.to(cdt)[:, None]).add_(m.to(cdt)[:, None])
    return out.to(dtype)


def _float_codes(xc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, q: int) -> torch.Tensor:
    """Nearest code on the stored grid, as floats (rows with step 0 are constant: code 0)."""
    sf = s.to(xc.dtype)[:, None]
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
    return (xc - m.to(xc.dtype)[:, None]).mul_(inv).round_().clamp_(0, q)


def _row_sq_error(recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-row squared error in the compute dtype (float32 unless the input is float64)."""
    cdt = compute_dtype(x.dtype)
    d = recon.to(cdt) - x.to(cdt)
    return d.mul_(d).sum(1)


# Greedy wins a row only if its error is smaller by this relative margin, far above float32
# rounding of the per-row sums: so it is smaller in exact arithmetic too, and a row's greedy
# L2 error is never above its plain one, however it is recomputed.
_GREEDY_MARGIN = 1e-4


def _direct_loss(u: torch.Tensor, q: int):
    """Candidate loss by quantizing every element: cost O(C) per row and candidate.

    Returns the L2 error in step units; the search only compares losses of the same row. The
    work buffers are allocated once per search: fresh multi-MB tensors on every step would
    page-fault (glibc returns large freed blocks to the OS) and run several times slower.
    """
    rows, cols = u.shape
    pos = torch.empty((rows, 2, cols), dtype=u.dtype)
    err = torch.empty_like(pos)

    def loss(lows: torch.Tensor, spacing: float) -> torch.Tensor:
        a = 1.0 / spacing
        k = lows.shape[1]
        # t = u * a - lows * a in one pass: add() scales ``other`` by alpha.
        t = torch.add((lows * -a)[:, :, None], u[:, None, :], alpha=a, out=pos[:, :k])
        e = torch.clamp(t, 0, q, out=err[:, :k]).round_().sub_(t)  # error in grid units
        return torch.linalg.vector_norm(e, dim=-1).mul_(spacing)
    return loss, u.dtype


def _sorted_loss(u: torch.Tensor, q: int):
    """Candidate loss from sorted rows and prefix sums: cost O(q log C) per row and candidate.

    With the row sorted, the values rounding to code ``m`` are a contiguous run found by
    searchsorted on the q thresholds, and summation by parts turns the per-cell sums
    ``sum((u - c_m)**2)`` into prefix sums at the thresholds. Returned is the squared error less
    the row constant ``sum(u**2)`` (only same-row comparisons matter); float64 keeps the
    cancellation harmless since u is within [0, 200].
    """
    us = torch.from_numpy(np.sort(u.numpy(), axis=1).astype(np.float64))
    rows, cols = us.shape
    prefix = torch.zeros((rows, cols + 1), dtype=torch.float64)
    torch.cumsum(us, dim=1, out=prefix[:, 1:])
    s1 = prefix[:, -1:]
    half = torch.arange(q, dtype=torch.float64) + 0.5  # thresholds: (m - 0.5) spacings, m = 1..q

    def loss(lows: torch.Tensor, spacing: float) -> torch.Tensor:
        k = lows.shape[1]
        thr = torch.add(lows[:, :, None], half, alpha=spacing)  # (R, K, q)
        idx = torch.searchsorted(us, thr.view(rows, -1))
        p1 = torch.gather(prefix, 1, idx).view(rows, k, q).sum(-1)
        thr_idx = torch.linalg.vecdot(thr, idx.view(rows, k, q).to(torch.float64))
        top = lows + q * spacing  # centre of the last cell
        return torch.add(top * cols, s1, alpha=-2).mul_(top).add_(p1.sub_(thr_idx), alpha=2 * spacing)
    return loss, torch.float64


def greedy_range(xc: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy per-row range search; returns the best (lo, hi) seen, the start range included.

    Works in units of the search step, ``u = (x - lo) / step`` in [0, 200]: after ``k`` steps,
    ``i`` of them at the min end, a row's candidate range is ``[i, 200 - (k - i)]`` and its grid
    spacing ``(200 - k) / q`` is the same for every row.
    """
    q = (1 << bits) - 1
    step = (hi - lo) / GREEDY_BINS
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    u = (xc - lo[:, None]).mul_(inv[:, None])
    # Long rows with few levels: O(q log C) per candidate beats O(C); the measured crossover
    # is near C = 128 * 2**bits (searchsorted costs ~75 ns per query here).
    loss, dtype = (_sorted_loss if u.shape[1] >= 128 * (q + 1) else _direct_loss)(u, q)
    moved_lo = torch.zeros(lo.shape, dtype=dtype)  # steps taken at the min end
    offsets = torch.tensor([[1.0, 0.0]], dtype=dtype)  # candidate 0 moves min, 1 moves max
    best = loss(moved_lo[:, None], GREEDY_BINS / q)[:, 0]
    best_lo, best_k = torch.zeros_like(moved_lo), torch.zeros_like(moved_lo)
    for k in range(1, GREEDY_STEPS + 1):
        err0, err1 = loss(moved_lo[:, None] + offsets, (GREEDY_BINS - k) / q).unbind(1)
        moved_lo = moved_lo + (err0 < err1)  # ties move the max end, as FBGEMM does
        cur = torch.minimum(err0, err1)
        better = cur < best
        best = torch.minimum(cur, best)
        best_lo = torch.where(better, moved_lo, best_lo)
        best_k = torch.where(better, k, best_k)
    best_lo, best_hi = best_lo.to(lo.dtype), (best_k - best_lo).to(lo.dtype)
    return lo + best_lo * step, hi - best_hi * step


def quantize_rows(x: torch.Tensor, bits: int, sdt: torch.dtype,
                  greedy: bool) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, EncodeStats]:
    """Quantize each row of a 2-D float block.

    Returns (codes as a uint8 numpy array (R, C), min (R,), step (R,), stats). ValueError for
    inf/nan input or parameters not representable in ``sdt``.
    """
    q = (1 << bits) - 1
    xc = x.to(compute_dtype(x.dtype))
    lo, hi = xc.amin(1), xc.amax(1)  # amin/amax propagate nan; an inf shows up in one of them
    require_finite(lo, "uniform")
    require_finite(hi, "uniform")
    m, s = stored_params(lo, hi, bits, sdt)
    codes = _float_codes(xc, m, s, q)
    recon = dequantize_rows(codes, m, s, x.dtype)
    if greedy and x.shape[1] > 1:
        gm, gs = stored_params(*greedy_range(xc, lo, hi, bits), bits, sdt)
        gcodes = _float_codes(xc, gm, gs, q)
        grecon = dequantize_rows(gcodes, gm, gs, x.dtype)
        use = _row_sq_error(grecon, x) < _row_sq_error(recon, x) * (1 - _GREEDY_MARGIN)
        m, s = torch.where(use, gm, m), torch.where(use, gs, s)
        codes = torch.where(use[:, None], gcodes, codes)
        recon = torch.where(use[:, None], grecon, recon)
    # numpy's float->uint8 cast is several times faster than torch's on CPU.
    return codes.numpy().astype(np.uint8), m, s, block_stats(x, recon)
