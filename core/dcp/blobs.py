"""Per-rank chunk storage for DCP saves: content addressing before encoding, shared blob store.

Each rank runs one :class:`ItemWriter` per ``write_data`` call. A tensor item (DTensor shard, piece of
a replicated tensor, whole tensor) is cut into the engine's chunks (``chunk_spans``); each chunk's
content key is computed from its raw bytes (``blob_key``, the same address the engine uses), and only
chunks whose key is not already in ``DIR/.checkrun/blobs/`` are encoded and written. What this process
knows is in :data:`KNOWN` (per directory, a ``DirState``: blob refs of the last save or load, seeded
from the newest manifest of the directory on first use, and the blobs already checked). A stored blob
is reused only if it exists (``has_blob``: garbage collection between two saves cannot leave a manifest
dangling) and its stored bytes were checked against the reference about to be written (``blobcheck``:
once per process and blob; blobs a DCP load verified count as checked); a rotted one is written again.
Each rank's save holds a lease (``save_lease``): a key is named by it before the blob is looked at or
written, so no collection takes it until the coordinator's manifest references it.
"""
from __future__ import annotations

import io
import logging
import math
import threading
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import xxhash
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..saving.blobcheck import StoredBlob, adoptable, trusted
from ..codecs import EncodeStats, Pipeline, lossless_pipeline, pipeline_for_rule
from ..config import EngineConfig, QuantRule
from .format import ItemResult, record_key
from ..errors import CheckrunError
from ..format.dtypes import row_shape
from ..format.manifest import (
    MAGIC_PREFIX, BlobRef, ChunkRef, ObjectRecord, TensorRecord, dtype_name, parse_manifest)
from ..saving.quant_rules import RuleMatcher
from ..saving.lease import SaveLease
from ..storage.store import Store
from ..saving.streams import DirState
from ..saving.write import blob_key, chunk_spans

log = logging.getLogger("ckpt_core")
_DEFAULT_WINDOW = 256 << 20


class BlobIndex:
    """Process-wide map directory URL -> ``DirState``: the blob refs of the latest save or load
    (``index``), encode stats of lossy chunks (``stats``) and the blobs whose stored bytes this
    process checked (``verified``, see ``blobcheck``).

    Thread-safe. Holds the blobs of the latest save or load per directory, so memory stays
    proportional to one checkpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[str, DirState] = {}

    def view(self, store: Store, config: EngineConfig) -> tuple[dict[str, BlobRef], dict[str, EncodeStats], DirState]:
        """Copies of the directory's refs and stats (stable during a save), and its ``DirState``,
        whose ``verified`` a save updates in place as it checks blobs."""
        url = store.url("")
        with self._lock:
            state = self._dirs.get(url)
        if state is None:
            seeded = DirState(index=_seed(store, config))
            with self._lock:
                state = self._dirs.setdefault(url, seeded)
        with self._lock:
            return dict(state.index), dict(state.stats), state

    def remember(self, store: Store, refs: Iterable[BlobRef], stats: dict[str, EncodeStats] | None = None,
                 replace: bool = True) -> None:
        new = {r.key: r for r in refs}
        with self._lock:
            state = self._state(store)
            if replace:
                state.index = new
                for key in [k for k in list(state.verified) if k not in new]:
                    state.verified.pop(key, None)
            else:
                state.index.update(new)
            if stats:
                state.stats.update(stats)

    def adopt_verified(self, store: Store, refs: Iterable[BlobRef]) -> None:
        """Blobs a load read and verified: the next save reuses them without reading them again."""
        with self._lock:
            self._state(store).adopt_verified(list(refs))

    def _state(self, store: Store) -> DirState:
        return self._dirs.setdefault(store.url(""), DirState())


def _seed(store: Store, config: EngineConfig) -> dict[str, BlobRef]:
    """Blob refs of the newest readable manifest of the directory (an empty dict if there is none)."""
    try:
        files = sorted(store.list_files(), key=lambda f: f.mtime, reverse=True)
    except CheckrunError:
        return {}
    for info in files[:16]:
        try:
            if not store.read_head(info.name, len(MAGIC_PREFIX) + 8).lstrip().startswith(MAGIC_PREFIX):
                continue
            m = parse_manifest(store.read_manifest(info.name), store.url(info.name),
                               max_blob_bytes=config.load.max_blob_bytes)
        except (CheckrunError, OSError) as exc:
            log.debug("checkrun: not seeding the blob index from %s: %s", info.name, exc)
            continue
        return {b.key: b for b in m.blobs()}
    return {}


KNOWN = BlobIndex()


@dataclass(frozen=True)
class _Chunk:
    ref: ChunkRef
    written: int
    stats: EncodeStats | None


def _bytes_view(t2d: torch.Tensor) -> torch.Tensor:
    return t2d.view(torch.uint8).reshape(-1)


class ItemWriter:
    """Stores the items of one rank's plan. Created and used on the thread running ``write_data``;
    chunk work runs on ``workers``. ``known`` must not change while it runs; ``dirstate.verified``
    (the process's checked blobs of this directory) is updated as blobs are checked or written."""

    def __init__(self, store: Store, config: EngineConfig, matcher: RuleMatcher, rank: int, workers: Executor,
                 known: dict[str, BlobRef], known_stats: dict[str, EncodeStats], dirstate: DirState,
                 lease: SaveLease) -> None:
        self.store, self.config, self.matcher, self.rank, self.workers = store, config, matcher, rank, workers
        self.lease = lease
        self.known, self.known_stats, self.dir = known, known_stats, dirstate
        self.touched: dict[str, BlobRef] = {}
        self.new_stats: dict[str, EncodeStats] = {}
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.written = 0

    # -- items -----------------------------------------------------------------------------------
    def write(self, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Resolve each item lazily, keeping at most ``staging_budget_bytes`` (default 256 MiB) of
        resolved tensors in flight, and return one WriteResult per item, in plan order."""
        window = self.config.saving.staging_budget_bytes or _DEFAULT_WINDOW
        pending: deque = deque()
        inflight, results = 0, []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                pending.append((item, self.workers.submit(self._object, item, planner.resolve_data(item)), 0))
                continue
            tensor = _cpu(planner.resolve_data(item))
            job = self._tensor_job(item, tensor)
            pending.append((item, job, tensor.nbytes))
            inflight += tensor.nbytes
            while inflight > window and len(pending) > 1:
                inflight -= self._finish(pending.popleft(), results)
        while pending:
            self._finish(pending.popleft(), results)
        return results

    def _finish(self, entry: tuple, results: list[WriteResult]) -> int:
        item, job, nbytes = entry
        record, written = job.result() if isinstance(job, Future) else self._tensor_result(*job)
        self.written += written
        size = sum(b.size for b in record.blobs()) if isinstance(record, TensorRecord) else record.blob.size
        results.append(WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data=ItemResult(record, self.rank, written)))
        return nbytes

    def _object(self, item: WriteItem, data: Any) -> tuple[ObjectRecord, int]:
        payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        key = blob_key("object|", payload)
        ref = BlobRef(key, len(payload), xxhash.xxh3_64_hexdigest(payload))
        self.touched[key] = ref
        record = ObjectRecord(record_key(item.index, True), "dcp.bytes", ref)
        self.lease.cover([key])
        # The payload's own bytes are its only valid encoding: reuse the stored blob only if it is them.
        if self.store.has_blob(key) and trusted(self.dir, ref, self._stored(key)):
            return record, 0
        self._put(ref, payload)
        return record, len(payload)

    # -- tensors ---------------------------------------------------------------------------------
    def _pipeline(self, fqn: str, t: torch.Tensor) -> tuple[Pipeline, QuantRule | None]:
        rule = self.matcher.select(fqn, t) if self.matcher.rules else None
        if rule is None:
            return lossless_pipeline(t.dtype, self.config.compression), None
        return pipeline_for_rule(rule, t.dtype, t.dim(), self.config.compression), rule

    def _tensor_job(self, item: WriteItem, t: torch.Tensor, lossless: bool = False) -> tuple:
        td = item.tensor_data
        if td is None or tuple(t.shape) != tuple(td.chunk.sizes):
            raise CheckrunError(f"DCP item {item.index.fqn!r}: resolved tensor of shape {tuple(t.shape)} does "
                                f"not match its chunk {None if td is None else tuple(td.chunk.sizes)}")
        pipeline, rule = self._pipeline(item.index.fqn, t)
        if lossless:
            pipeline, rule = lossless_pipeline(t.dtype, self.config.compression), None
        rows, cols = row_shape(tuple(t.shape))
        flat = t.reshape(-1)
        prefix = f"{pipeline.spec_id}|{dtype_name(t.dtype)}"
        futures = []
        for off, r, c in chunk_spans(rows, cols, t.element_size(), self.config.compression.chunk_bytes):
            piece = flat[off:off + r * c].view(r, c)
            futures.append(self.workers.submit(self._chunk, piece, off, pipeline, prefix))
        whole = list(td.chunk.sizes) == list(td.size) and not any(td.chunk.offsets)
        return item, t, pipeline, rule, futures, record_key(item.index, whole)

    def _tensor_result(self, item, t, pipeline, rule, futures, key) -> tuple[TensorRecord, int]:
        try:
            chunks = [f.result() for f in futures]
        except ValueError as exc:  # a lossy codec refuses non-finite or out-of-range values
            if not pipeline.lossy:
                raise
            log.warning("checkrun: %s stored lossless: %s", key, exc)
            return self._tensor_result(*self._tensor_job(item, t, lossless=True))
        stats = EncodeStats()
        for c in chunks:
            if c.stats is not None:
                stats = stats.merge(c.stats)
        quant = None
        if rule is not None and pipeline.lossy:
            rel = math.sqrt(stats.sq_error_sum / stats.sq_ref_sum) if stats.sq_ref_sum > 0 else 0.0
            quant = {"method": rule.method, "bits": pipeline.array.to_dict().get("bits"),
                     "max_abs_error": stats.max_abs_error, "rel_l2_error": rel}
        written = sum(c.written for c in chunks)
        rec = TensorRecord(key, dtype_name(t.dtype), tuple(t.shape), tuple(pipeline.to_list()),
                           tuple(c.ref for c in chunks), (), written, quant, "cpu")
        return rec, written

    # -- chunks (worker threads) -----------------------------------------------------------------
    def _chunk(self, array2d: torch.Tensor, off: int, pipeline: Pipeline, prefix: str) -> _Chunk:
        self.lease.renew_if_due()  # the rank's threads renew its lease as they work
        rows, cols = array2d.shape
        key = blob_key(f"{prefix}|{rows}x{cols}|", _bytes_view(array2d))
        with self._lock:  # one writer per key in this save: identical chunks (zeros) are common
            owner = self._inflight.get(key)
            if owner is None:
                self._inflight[key] = mine = Future()
        if owner is not None:
            return _Chunk(ChunkRef(off, rows, cols, owner.result()), 0, self._stats_of(key))
        try:
            ref, written, stats = self._store_chunk(key, array2d, pipeline)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(ref)
        self.touched[key] = ref
        if stats is not None and pipeline.lossy:
            self.new_stats[key] = stats
        return _Chunk(ChunkRef(off, rows, cols, ref), written, stats if pipeline.lossy else None)

    def _stats_of(self, key: str) -> EncodeStats | None:
        return self.new_stats.get(key) or self.known_stats.get(key)

    def _store_chunk(self, key: str, array2d: torch.Tensor, pipeline: Pipeline):
        """Reuse the stored blob of a chunk once its bytes were checked (``blobcheck``), else write it.

        A known blob is reused without encoding once its stored bytes match the known reference
        and (lossy) its error is known; otherwise the chunk is encoded, and a stored blob (one this
        process does not know: another rank's or process's) adopted if it holds the same content,
        else (missing, rotted, truncated) written."""
        stored = self._stored(key)
        self.lease.cover([key])  # before looking: once named, a blob found stays
        exists = self.store.has_blob(key)
        known = self.known.get(key)
        if exists and known is not None and trusted(self.dir, known, stored):
            stats = self._stats_of(key)
            if stats is not None or not pipeline.lossy:
                return known, 0, stats
        data, stats = pipeline.encode(array2d)
        fresh = BlobRef(key, len(data), xxhash.xxh3_64_hexdigest(data))
        ref = adoptable(self.dir, fresh, data, array2d, pipeline, stored) if exists else None
        if ref is not None:
            return ref, 0, stats
        self._put(fresh, data)
        return fresh, len(data), stats

    def _stored(self, key: str) -> StoredBlob:
        return StoredBlob(self.store, key, self.config.load.max_blob_bytes)

    def _put(self, ref: BlobRef, data: bytes | memoryview) -> None:
        self.store.put_blob(ref.key, data)
        # Written, not read back: the first save that reuses it checks it.
        self.dir.verified.pop(ref.key, None)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()
