"""Incremental state per checkpoint directory: what was saved last, and the chain policy.

Change detection for row deltas is exact: each row-delta tensor ("row stream") owns one host buffer
that always holds the values of its last save, so the next capture compares the live tensor with
it bitwise (NaN-safe) and copies only the rows that differ. No fingerprint can miss a change, and
memory stays at one staging copy. Tensors whose rows all change (dense training) switch to plain
copies plus chunk-level content hashing and are re-probed every ``max_chain`` saves.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np
import torch

from ..codecs import Pipeline
from ..config import IncrementalConfig
from ..format.manifest import BlobRef, DeltaRef, TensorRecord

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: Rows compared per step of ``copy_changed_rows``: the block of both tensors stays in cache.
_COMPARE_BLOCK_BYTES = 1 << 20


def row_view(t: torch.Tensor) -> torch.Tensor:
    """A (rows, words) integer view of a contiguous tensor with ndim >= 2, for bitwise comparison,
    with the widest word (up to 8 bytes) that divides the row."""
    if t.is_complex():
        t = torch.view_as_real(t)
    rows = t.reshape(t.shape[0], -1)
    row_bytes = rows.shape[1] * t.element_size()
    width = next(w for w in (8, 4, 2, 1) if w >= t.element_size() and row_bytes % w == 0) if row_bytes else 1
    return rows.view(_INT_VIEW[t.element_size()]).view(_INT_VIEW[width]) if row_bytes else rows.view(
        _INT_VIEW[t.element_size()])


def copy_changed_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy the rows of ``src`` that differ bitwise from ``dst`` into ``dst``; return their indices.

    One pass over row blocks that fit in cache, in numpy (single-threaded, no temporaries of the
    tensor's size): compare the widest integer words, reduce per row, copy the changed rows.
    """
    a, b = row_view(src).numpy(), row_view(dst).numpy()
    rows, words = a.shape
    if rows == 0 or words == 0:
        return torch.empty(0, dtype=torch.int64)
    block = max(1, _COMPARE_BLOCK_BYTES // (words * a.itemsize))
    scratch = np.empty((min(block, rows), words), dtype=bool)
    found = []
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        ne = np.not_equal(a[start:stop], b[start:stop], out=scratch[:stop - start])
        # 8 bools per row in one uint64: the per-row reduction runs over an eighth of the elements
        changed = np.flatnonzero((ne.view(np.uint64) if words % 8 == 0 else ne).any(axis=1))
        if changed.size:
            b[start:stop][changed] = a[start:stop][changed]
            found.append(changed + start)
    return torch.from_numpy(np.concatenate(found)) if found else torch.empty(0, dtype=torch.int64)


@dataclass
class RowStream:
    """The last saved values and chain of one row-delta tensor in one directory."""

    buffer: torch.Tensor
    dtype: torch.dtype
    shape: tuple
    spec_id: str = ""
    valid: bool = False
    record: TensorRecord | None = None
    cum_mask: torch.Tensor | None = None
    saves_since_base: int = 0
    dense_countdown: int = 0
    tracker_since: int = 0

    @property
    def rows(self) -> int:
        return self.shape[0]

    def matches(self, t: torch.Tensor) -> bool:
        return self.valid and t.dtype == self.dtype and tuple(t.shape) == self.shape

    def capture(self, src: torch.Tensor, rows: torch.Tensor | None = None,
                cfg: IncrementalConfig | None = None, copy=None) -> torch.Tensor | None:
        """Update the buffer from ``src``; return changed row indices, or None after a full copy.

        ``rows``: the only rows that can have changed (from an EmbeddingTracker): copied without
        comparing. ``copy(src, flat_buffer)`` makes full copies (the engine's ``Copier.copy``,
        finished by its ``finish``); default: ``copy_`` here. Runs on the training thread (the
        blocking part of save)."""
        dst = self.buffer.view(self.shape)
        full = copy or (lambda s, flat: flat.view(s.shape).copy_(s))
        if not self.matches(src) or self.dense_countdown > 0:
            full(src, self.buffer)
            return None
        if rows is not None:
            if rows.numel():
                dst.index_copy_(0, rows, src.index_select(0, rows))
            return rows
        if cfg is not None and self._looks_dense(src, dst, cfg.rebase_ratio):
            # Dense training changes every row: skip the full comparison (it would only cost time)
            # and save this tensor whole for the next max_chain saves.
            full(src, self.buffer)
            self.dense_countdown = cfg.max_chain + 1
            return None
        return copy_changed_rows(src, dst)

    @staticmethod
    def _looks_dense(src: torch.Tensor, dst: torch.Tensor, ratio: float, samples: int = 64) -> bool:
        """Compare a few evenly spaced rows: a cheap, conservative guess that most rows changed."""
        n = src.shape[0]
        idx = torch.linspace(0, n - 1, min(samples, n)).long()
        changed = torch.ne(row_view(src.index_select(0, idx)), row_view(dst.index_select(0, idx))).any(dim=1)
        return changed.float().mean().item() > max(ratio, 0.5)

    def commit(self, plan: "RowPlan", record: TensorRecord, spec_id: str, detected: bool,
               max_chain: int) -> None:
        """Adopt a committed save's outcome (background thread, after the manifest is durable)."""
        self.valid, self.record, self.spec_id = True, record, spec_id
        self.cum_mask = plan.cum_mask
        self.saves_since_base = 0 if plan.full else self.saves_since_base + 1
        if plan.dense and detected:
            self.dense_countdown = max_chain
        elif self.dense_countdown > 0:
            self.dense_countdown -= 1


@dataclass(frozen=True)
class RowPlan:
    """What the background writes for one row stream: a full base, or a delta of ``rows``."""

    full: bool
    rows: torch.Tensor | None
    keep_deltas: tuple[DeltaRef, ...]
    cum_mask: torch.Tensor
    dense: bool


def plan_rows(stream: RowStream, changed: torch.Tensor | None, cfg: IncrementalConfig,
              spec_id: str, row_bytes: int) -> RowPlan:
    """Decide base vs delta for one row stream (Check-N-Run's one-shot/consecutive/intermittent)."""
    rows = stream.rows
    fresh = torch.zeros(rows, dtype=torch.bool)
    if changed is None or stream.record is None or spec_id != stream.spec_id:
        return RowPlan(True, None, (), fresh, dense=stream.dense_countdown > 0)
    dense = changed.numel() > cfg.rebase_ratio * rows
    cum = stream.cum_mask.clone() if stream.cum_mask is not None else fresh.clone()
    cum[changed] = True
    if cfg.policy == "consecutive":
        delta_rows, keep = changed, stream.record.deltas
        chain = len(keep) + (1 if changed.numel() else 0)
        predicted = sum(d.n for d in keep) + changed.numel()
    else:
        delta_rows, keep = cum.nonzero().squeeze(1), ()
        chain = 1 if delta_rows.numel() else 0
        predicted = delta_rows.numel()
    over_chain = stream.saves_since_base + 1 > cfg.max_chain or chain > cfg.max_chain
    too_big = cfg.policy != "one_shot" and predicted * (row_bytes + 8) > cfg.rebase_ratio * rows * row_bytes
    if over_chain or too_big or dense:
        return RowPlan(True, None, (), fresh, dense)
    return RowPlan(False, delta_rows, keep, cum, False)


@dataclass
class DirState:
    """Per-directory memory of the engine: blob index, row streams and the last records."""

    index: dict[str, BlobRef] = field(default_factory=dict)
    streams: dict[str, RowStream] = field(default_factory=dict)
    records: dict[str, TensorRecord] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    """Blob key -> ``EncodeStats`` of its lossy encoding (what the quantization error is built from)."""
    verified: dict[str, BlobRef] = field(default_factory=dict)
    """Blob key -> the reference its stored bytes were read and found to match, by a save's check
    or by a load. Only these are reused without reading them (see ``blobcheck``); a blob this
    engine wrote counts as unchecked until its first reuse reads it back."""
    row_norms: dict = field(default_factory=dict)
    """Lossy row stream key -> (the record it describes, float64 sum of squares of each row): the
    reference norm of the tensor as restored, updated row by row by delta saves."""
    last: object = None
    pending: dict = field(default_factory=dict)
    """Blob key -> size: candidates of the next collection here (blobs of checkpoints ``remove``
    deleted, or that a collection found protected by a lease)."""
    full_due: bool = False
    """The next collection here lists every blob (a removed checkpoint could not be read)."""
    leases_seen: bool = False
    """The last collection here saw live leases of other saves: look again at the next commit."""

    def adopt_verified(self, blobs: list[BlobRef]) -> None:
        """Blobs a load read and verified: reused by the next save without reading them again."""
        for b in blobs:
            self.index[b.key] = b
            self.verified[b.key] = b

    def forget(self, keys: list[str]) -> None:
        """Blobs that garbage collection deleted."""
        for key in keys:
            self.index.pop(key, None)
            self.verified.pop(key, None)

    def invalidate(self) -> None:
        """After a failed save the buffers no longer match what is committed: next save is full."""
        for s in self.streams.values():
            s.valid = False


def row_eligible(key: str, t: torch.Tensor, cfg: IncrementalConfig) -> bool:
    """Row deltas apply to CPU, contiguous tensors with ndim >= 2 and enough rows."""
    return (cfg.enabled and t.dim() >= 2 and t.shape[0] >= max(cfg.row_delta_min_rows, 1)
            and t.device.type == "cpu" and t.is_contiguous() and math.prod(t.shape[1:]) > 0
            and any(fnmatch.fnmatchcase(key, p) for p in cfg.row_delta_keys))


class Loaded(Protocol):
    """A tensor a load decoded (``loading.reader.LoadedTensor``), as seen by the save side."""

    record: TensorRecord
    delta_indices: list
    copy: torch.Tensor | None


def wants_stream(rec: TensorRecord, flat: torch.Tensor, cfg: IncrementalConfig,
                 lands_on_cpu: Callable[[], bool]) -> bool:
    """Whether a loaded tensor becomes a row stream (which needs its own host copy of the values).

    Only where row deltas will really apply: saved from the CPU and loaded onto the CPU
    (``lands_on_cpu``: where the load's ``map_location`` puts it; a GPU job resuming with
    ``map_location="cpu"`` saves from the GPU again, where row deltas never apply, so a host copy of
    model + optimizer state would only double its host memory)."""
    if rec.quant or rec.device != "cpu" or not row_eligible(rec.key, flat.view(rec.shape), cfg):
        return False
    return lands_on_cpu()


def adopt_loaded(state: DirState, blobs: Iterable[BlobRef], loaded: Iterable[Loaded],
                 host_copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Remember a loaded checkpoint in its directory's ``state`` so the next save there is incremental:
    its ``blobs`` count as verified (the load checked every one), its records as the last ones, and
    each tensor loaded with a copy (``wants_stream``) becomes a row stream whose buffer is
    ``host_copy(copy)`` (training thread, inside ``load``)."""
    state.adopt_verified(list(blobs))
    for lt in loaded:
        rec = lt.record
        state.records[rec.key] = rec
        if lt.copy is None:
            continue
        buffer = host_copy(lt.copy)
        stream = RowStream(buffer, buffer.dtype, tuple(rec.shape), valid=True, record=rec)
        mask = torch.zeros(rec.shape[0], dtype=torch.bool)
        for idx in lt.delta_indices:
            mask[idx] = True
        stream.cum_mask = mask
        stream.saves_since_base = len(rec.deltas)
        stream.spec_id = _spec_id(rec)
        state.streams[rec.key] = stream


def _spec_id(rec: TensorRecord) -> str:
    return Pipeline.from_list(list(rec.codecs)).spec_id
