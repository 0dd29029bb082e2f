"""The quantization error a manifest records for a lossy tensor: a bound of its error as restored.

A full record's chunks cover the tensor exactly once, so the merged stats of its chunks are its
error. A row-delta record restores its base chunks, then the rows of each delta on top; every
element of the restored tensor comes from one of the blobs the record references, encoded from
the value it has in the state saved (rows are detected bitwise; a row changed later is in a later
delta). Hence:

- ``max_abs_error``: the largest over all referenced blobs bounds the restored tensor's;
- ``rel_l2_error``: the squared errors summed over all referenced blobs bound the restored
  tensor's (an element overwritten by a later delta is counted more than once, never missed),
  divided by the exact sum of squares of the tensor as saved (``row_sq_norms``, kept per row by
  the writer so that a delta save recomputes only its rows).
"""
from __future__ import annotations

import math

import torch

from ..codecs import EncodeStats, Pipeline
from ..config import QuantRule
from ..format.manifest import ChunkRef, DeltaRef, TensorRecord
from .streams import DirState

#: Rows per step of ``row_sq_norms``: the float64 copy of a block stays small.
_NORM_BLOCK_BYTES = 1 << 22


def row_sq_norms(t2d: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each row of a 2-D tensor, accumulated in float64, block by block."""
    rows, cols = t2d.shape
    out = torch.zeros(rows, dtype=torch.float64)
    if rows == 0 or cols == 0:
        return out
    step = max(1, _NORM_BLOCK_BYTES // (8 * cols))
    for start in range(0, rows, step):
        block = t2d[start:start + step].to(torch.float64)
        out[start:start + step] = (block * block).sum(dim=1)
    return out


def chain_stats(known: dict, base: tuple[ChunkRef, ...] | list[ChunkRef],
                deltas: tuple[DeltaRef, ...]) -> EncodeStats | None:
    """The stats of every chunk blob a row-delta record references, merged; None if the stats of
    one are unknown (``known``: blob key -> EncodeStats, ``DirState.stats``)."""
    total = EncodeStats()
    for chunk in [*base, *(c for d in deltas for c in d.chunks)]:
        stats = known.get(chunk.blob.key)
        if stats is None:
            return None
        total = total.merge(stats)
    return total


def quant_record(rule: QuantRule, pipeline: Pipeline, stats: EncodeStats, ref_sq_sum: float) -> dict:
    """The manifest's ``quant`` entry: ``stats`` bound the squared error, ``ref_sq_sum`` is the
    tensor's sum of squares (a tensor of zeros has no relative error)."""
    rel = math.sqrt(stats.sq_error_sum / ref_sq_sum) if ref_sq_sum > 0 else 0.0
    return {"method": rule.method, "bits": pipeline.array.to_dict().get("bits"),
            "max_abs_error": stats.max_abs_error, "rel_l2_error": rel}


def stream_row_norms(dirstate: DirState, key: str, t2d: torch.Tensor, idx: torch.Tensor | None,
                     base_record: TensorRecord | None) -> torch.Tensor:
    """``row_sq_norms`` of a lossy row stream's snapshot ``t2d``. A delta save (``idx``: its rows)
    recomputes only its rows of the norms kept for the record it builds on (``base_record``,
    ``DirState.row_norms``); anything else computes them all. The caller keeps the result with
    the new record."""
    kept = dirstate.row_norms.get(key) if idx is not None else None
    if kept is None or kept[0] != base_record:
        return row_sq_norms(t2d)
    norms = kept[1]  # updated in place: the entry is replaced with the new record's
    if idx.numel():
        norms[idx] = row_sq_norms(t2d.index_select(0, idx))
    return norms


def tensor_quant(rule: QuantRule, pipeline: Pipeline, known: dict, base: tuple | list, deltas: tuple,
                 new_stats: list[EncodeStats | None], norms: torch.Tensor | None) -> dict | None:
    """The ``quant`` entry of a lossy tensor's record, or None if its error cannot be bounded.

    ``new_stats``: of the chunks this save stored (a full record's cover the tensor once, so they
    are its error); a row-delta record combines the stats of every chunk it references (``known``:
    ``DirState.stats``) with the tensor's ``norms`` (``stream_row_norms``)."""
    if not deltas:
        if any(s is None for s in new_stats):
            return None
        stats = EncodeStats()
        for s in new_stats:
            stats = stats.merge(s)
        return quant_record(rule, pipeline, stats, stats.sq_ref_sum)
    stats = chain_stats(known, base, deltas)
    if stats is None or norms is None:
        return None
    return quant_record(rule, pipeline, stats, float(norms.sum()))
