"""Incremental state per checkpoint directory: what was saved last, and the chain policy.

Change detection for row deltas is exact: each row-delta tensor ("row stream") owns one host buffer
that always holds the values of its last save, so the next capture compares the live tensor with
it bitwise (NaN-safe) and copies only the rows that differ. No fingerprint can miss a change, and
memory stays at one staging copy. Tensors whose rows all change (dense training) switch to plain
copies plus chunk-level content hashing and are re-probed every ``max_chain`` saves.
"""
from __future__ import annotations

import ctypes
import fnmatch
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np
import torch

from ..codecs import Pipeline
from ..codecs._common import CROWS_ABI, load_native
from ..config import IncrementalConfig
from ..format.manifest import BlobRef, DeltaRef, TensorRecord
from .copier import SPLIT_COPY_BYTES

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


#: Rows compared per step of ``copy_changed_rows``: the block of both tensors stays in cache.
_COMPARE_BLOCK_BYTES = 1 << 20

#: Without the C kernel, tensors smaller than this are compared in full, never sampled by
#: ``RowStream._looks_dense``: sampling costs a dozen small torch calls (~0.1-0.2 ms).
_SAMPLE_MIN_BYTES = 1 << 20

#: ``Copier.share``: queues parts on the copier's helper thread; returns the join of their results.
Share = Callable[[list], Callable[[], list]]

#: Rows per part of a shared comparison: enough to make a ctypes call's cost negligible, small
#: enough that both threads finish close together.
_PART_BYTES = 4 << 20



def _load_native() -> ctypes.CDLL | None:
    """The C kernel (``ckpt_core._crows``), or None when it was not built."""
    lib = load_native("_crows", "checkrun_crows_abi", CROWS_ABI, "changed rows are found in numpy, on one thread")
    if lib is None:
        return None
    fn = lib.checkrun_copy_changed_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    return lib


_NATIVE = _load_native()


def native_available() -> bool:
    """Whether changed rows are found by the C kernel (see ``copy_changed_rows``)."""
    return _NATIVE is not None


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


def copy_changed_rows(src: torch.Tensor, dst: torch.Tensor, share: Share | None = None) -> torch.Tensor:
    """Copy the rows of ``src`` that differ bitwise from ``dst`` into ``dst``; return their indices
    (ascending, int64). Both contiguous, with the same shape and dtype.

    With the C kernel (``ckpt_core._crows``): one pass, a memcmp and, where it differs, a memcpy per
    row, without the GIL; a table of ``SPLIT_COPY_BYTES`` or more is cut in row ranges shared with
    the copier's helper thread (``share``: ``Copier.share``). Without it, numpy (the same indices):
    row blocks that fit in cache, one thread.
    """
    return start_changed_rows(src, dst, share)()


def start_changed_rows(src: torch.Tensor, dst: torch.Tensor, share: Share | None) -> Callable[[], torch.Tensor]:
    """``copy_changed_rows``, begun: the helper thread may still be comparing when this returns (with
    ``share``); the callable returned finishes the work and gives the indices. Until it is called,
    ``src`` and ``dst`` must stay as they are."""
    if _NATIVE is None or not (src.shape[0] and src.nbytes and src.is_contiguous() and dst.is_contiguous()):
        found = _numpy_changed_rows(src, dst)
        return lambda: found
    rows = src.shape[0]
    row_bytes = src.nbytes // rows
    out = torch.empty(rows, dtype=torch.int64)
    a, b, o = src.data_ptr(), dst.data_ptr(), out.data_ptr()

    def part(start: int, stop: int) -> int:
        return _NATIVE.checkrun_copy_changed_rows(a + start * row_bytes, b + start * row_bytes, stop - start,
                                                 row_bytes, start, o + start * 8)
    if share is None or rows < 2 or src.nbytes < SPLIT_COPY_BYTES:
        found = out[:part(0, rows)].clone()
        return lambda: found
    step = max(1, _PART_BYTES // row_bytes, -(-rows // 64))
    starts = range(0, rows, step)
    join = share([lambda s=s: part(s, min(s + step, rows)) for s in starts])

    def result() -> torch.Tensor:
        counts = join()
        return torch.cat([out[s:s + n] for s, n in zip(starts, counts)])
    return result


def _numpy_changed_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
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


def _sample_first(src: torch.Tensor) -> bool:
    """Whether to guess from a sample that most rows changed before comparing them all.

    Only for the numpy comparison of a large tensor: the C kernel stops comparing a row at its
    first difference and copies it, so on a tensor whose rows all changed it costs about a plain
    copy, and the sample (0.5-1.5 ms per 16 MB table measured, on the training thread) would only
    add to it. A dense tensor is then found by ``plan_rows`` and copied whole from the next save on."""
    return _NATIVE is None and src.nbytes >= _SAMPLE_MIN_BYTES


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
                cfg: IncrementalConfig | None = None, copy=None,
                share: Share | None = None) -> "torch.Tensor | Callable[[], torch.Tensor] | None":
        """Update the buffer from ``src``; return changed row indices, or None after a full copy.

        ``rows``: the only rows that can have changed (from an EmbeddingTracker): copied without
        comparing. ``copy(src, flat_buffer)`` makes full copies (the engine's ``Copier.copy``,
        finished by its ``finish``); default: ``copy_`` here. With ``share`` (``Copier.share``) a
        comparison may still run on the helper thread: then a callable is returned that waits for
        it and gives the indices (``start_changed_rows``). Runs on the training thread (the blocking
        part of save)."""
        full = copy or (lambda s, flat: flat.view(s.shape).copy_(s))
        if not self.matches(src) or self.dense_countdown > 0:
            full(src, self.buffer)
            return None
        dst = self.buffer.view_as(src)  # same shape (``matches``); view_as is cheaper than view(shape)
        if rows is not None:
            if rows.numel():
                dst.index_copy_(0, rows, src.index_select(0, rows))
            return rows
        if cfg is not None and _sample_first(src) and self._looks_dense(src, dst, cfg.rebase_ratio):
            # Dense training changes every row: skip the full comparison (it would only cost time)
            # and save this tensor whole for the next max_chain saves.
            full(src, self.buffer)
            self.dense_countdown = cfg.max_chain + 1
            return None
        if share is None:
            return copy_changed_rows(src, dst)
        return start_changed_rows(src, dst, share)

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
        self.saves_since_base = 0 if plan.full else self.saves_since_base + bool(plan.rows.numel())
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
    if changed is None or not stream.valid or stream.record is None or spec_id != stream.spec_id:
        return RowPlan(True, None, (), fresh, dense=stream.dense_countdown > 0)
    if not changed.numel() and stream.valid:  # nothing changed since the record: keep it as it is
        return RowPlan(False, changed, stream.record.deltas, stream.cum_mask if stream.cum_mask is not None
                       else fresh, False)
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
    seen: dict[str, tuple | float] = field(default_factory=dict)
    """Blob key -> ``BlobInfo.version`` of a verified blob's stored file when it was checked, or
    (checked by a load, which does not look at versions) the time the load started: a save that
    finds another version, or a file modified since, counts the blob as unchecked again
    (``blobcheck.notice``)."""
    row_norms: dict = field(default_factory=dict)
    """Lossy row stream key -> (the record it describes, float64 sum of squares of each row): the
    reference norm of the tensor as restored, updated row by row by delta saves."""
    last: object = None
    used: int = 0
    """When a save here last began (a counter): ``keep_recent_streams`` keeps the newest directories'."""
    leader: tuple | None = None
    """(handle, weak reference to the snapshot) of the last save here: a save of the same values
    repeats it while it is in flight (``repeat``); the reference dies with the save's job, so a
    directory keeps no staging buffer alive after its saves ended."""
    pending: dict = field(default_factory=dict)
    """Blob key -> size: candidates of the next collection here (blobs of checkpoints ``remove``
    deleted, or that a collection found protected by a lease)."""
    full_due: bool = False
    """The next collection here lists every blob (a removed checkpoint could not be read)."""
    leases_seen: bool = False
    """The last collection here saw live leases of other saves: look again at the next commit."""
    rebuilds: list = field(default_factory=list)
    """``loading.references.ReferenceBuild`` of loads here, oldest first: adopted by the next save."""

    def adopt_verified(self, blobs: list[BlobRef], since: float) -> None:
        """Blobs a load that started at ``since`` (epoch seconds) read and verified: reused by the
        next save without reading them again unless their stored file was modified since then."""
        for b in blobs:
            self.index[b.key] = b
            self.verified[b.key] = b
            self.seen[b.key] = since

    def distrust(self, key: str) -> None:
        """The blob's stored bytes must be read again before a save reuses it."""
        self.verified.pop(key, None)
        self.seen.pop(key, None)

    def forget(self, keys: list[str]) -> None:
        """Blobs that garbage collection deleted."""
        for key in keys:
            self.index.pop(key, None)
            self.distrust(key)

    def invalidate(self) -> None:
        """After a failed save the buffers no longer match what is committed: next save is full."""
        for s in self.streams.values():
            s.valid = False


def row_eligible(key: str, t: torch.Tensor, cfg: IncrementalConfig) -> bool:
    """Row deltas apply to CPU, contiguous tensors with ndim >= 2 and enough rows."""
    return (cfg.enabled and t.dim() >= 2 and t.shape[0] >= max(cfg.row_delta_min_rows, 1)
            and t.is_cpu and t.is_contiguous() and math.prod(t.shape[1:]) > 0
            and any(fnmatch.fnmatchcase(key, p) for p in cfg.row_delta_keys))


#: Manifest ``meta`` key: the row-stream tensors this save wrote whole because training changes
#: every row of them (``RowPlan.dense``). A load keeps no reference copy of those (``wants_stream``):
#: the next save copies them whole anyway, and the copy would double their host memory.
DENSE_META = "checkrun.dense_rows"


def dense_keys(meta: dict) -> frozenset[str]:
    """The tensor keys a manifest's ``meta`` marks dense (anything malformed marks none)."""
    keys = meta.get(DENSE_META)
    return frozenset(k for k in keys if isinstance(k, str)) if isinstance(keys, list) else frozenset()


class Loaded(Protocol):
    """A tensor a load decoded (``loading.reader.LoadedTensor``), as seen by the save side."""

    record: TensorRecord
    delta_indices: list
    copy: torch.Tensor | None


def wants_stream(rec: TensorRecord, flat: torch.Tensor, cfg: IncrementalConfig,
                 lands_on_cpu: Callable[[], bool], dense: frozenset[str] = frozenset()) -> bool:
    """Whether a loaded tensor becomes a row stream (which needs its own host copy of the values).

    Only where row deltas will really apply: saved from the CPU and loaded onto the CPU
    (``lands_on_cpu``: where the load's ``map_location`` puts it; a GPU job resuming with
    ``map_location="cpu"`` saves from the GPU again, where row deltas never apply, so a host copy of
    model + optimizer state would only double its host memory), and not for a tensor the checkpoint
    marks ``dense`` (``DENSE_META``: every row changes, the next save copies it whole)."""
    if (rec.quant or rec.device != "cpu" or rec.key in dense
            or not row_eligible(rec.key, flat.view(rec.shape), cfg)):
        return False
    return lands_on_cpu()


def adopt_loaded(state: DirState, blobs: Iterable[BlobRef], loaded: Iterable[Loaded],
                 host_copy: Callable[[torch.Tensor], torch.Tensor],
                 free: Callable[[torch.Tensor], None] | None = None, since: float = 0.0) -> None:
    """Remember a loaded checkpoint in its directory's ``state`` so the next save there is incremental:
    its ``blobs`` count as verified (the load, started at ``since``, checked every one), its records
    as the last ones, and
    each tensor loaded with a copy (``wants_stream``) becomes a row stream whose buffer is
    ``host_copy(copy)`` (training thread, inside ``load``). The buffer of a row stream this replaces
    goes to ``free`` (the pool's ``free_host``) once no save to the directory is in flight."""
    state.adopt_verified(list(blobs), since)
    # Saves to one directory finish in order: once the last is done, no save uses a stream's buffer.
    idle = state.last is None or state.last.done()
    for lt in loaded:
        rec = lt.record
        state.records[rec.key] = rec
        if lt.copy is None:
            continue
        buffer = host_copy(lt.copy)
        old = state.streams.get(rec.key)
        if free is not None and idle and old is not None and old.buffer is not buffer:
            free(old.buffer)  # in shared memory it would stay until the engine closes
        stream = RowStream(buffer, buffer.dtype, tuple(rec.shape), valid=True, record=rec)
        mask = torch.zeros(rec.shape[0], dtype=torch.bool)
        for idx in lt.delta_indices:
            mask[idx] = True
        stream.cum_mask = mask
        stream.saves_since_base = len(rec.deltas)
        stream.spec_id = _spec_id(rec)
        state.streams[rec.key] = stream


STREAM_DIRECTORIES = 2
"""Directories an engine keeps row streams for (the ones it saved to most recently): each holds a copy
of its row-delta tensors, so an engine saving to a new directory every time (``ckpts/epoch_N/``) grew
by a copy of the state per directory until ``close()``."""


def keep_recent_streams(states: Iterable[DirState], current: DirState,
                        free: Callable[[torch.Tensor], None] | None = None) -> None:
    """``current`` is being saved to: drop the row streams of the directories beyond the
    ``STREAM_DIRECTORIES`` saved to most recently (their next save copies those tensors whole)."""
    current.used = next(_USES)
    holding = sorted((s for s in states if s.streams and s is not current), key=lambda s: s.used, reverse=True)
    for state in holding[STREAM_DIRECTORIES - 1:]:
        if state.last is None or state.last.done():  # a save in flight still reads them
            drop_streams(state, list(state.streams), free)


_USES = itertools.count(1)


def drop_streams(state: DirState, keys: Iterable[str], free: Callable[[torch.Tensor], None] | None = None) -> None:
    """Forget the row streams of ``keys`` (their references no longer hold what was saved or loaded
    last): the next save copies those tensors whole. Buffers go to ``free`` as in ``adopt_loaded``."""
    idle = state.last is None or state.last.done()
    for key in keys:
        old = state.streams.pop(key, None)
        if old is not None and free is not None and idle:
            free(old.buffer)


def _spec_id(rec: TensorRecord) -> str:
    return Pipeline.from_list(list(rec.codecs)).spec_id
