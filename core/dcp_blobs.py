"""Per-rank chunk storage for DCP saves: content addressing before encoding, shared blob store.

Each rank runs one :class:`ItemWriter` per ``write_data`` call. A tensor item (DTensor shard, piece of
a replicated tensor, whole tensor) is cut into the engine's chunks (``chunk_spans``); each chunk's
content key is computed from its raw bytes (``blob_key``, the same address the engine uses), and only
chunks whose key is not already in ``DIR/.checkrun/blobs/`` are encoded and written. What this process
knows is in :data:`KNOWN` (per directory: blob refs of the last save or load, seeded from the newest
manifest of the directory on first use), and a known blob is still checked for existence (``has_blob``)
before it is reused, so garbage collection between two saves cannot leave a manifest dangling.
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

from .codecs import EncodeStats, Pipeline, lossless_pipeline, pipeline_for_rule
from .config import EngineConfig, QuantRule
from .dcp_format import ItemResult, record_key
from .errors import CheckrunError
from .manifest import MAGIC_PREFIX, BlobRef, ChunkRef, ObjectRecord, TensorRecord, dtype_name, parse_manifest
from .quant_rules import RuleMatcher
from .storage import Store
from .writer import blob_key, chunk_spans

log = logging.getLogger("ckpt_core")
_DEFAULT_WINDOW = 256 << 20


class BlobIndex:
    """Process-wide map directory URL -> {blob key: BlobRef} (plus encode stats of lossy chunks).

    Thread-safe. Holds the blobs of the latest save or load per directory, so memory stays
    proportional to one checkpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._refs: dict[str, dict[str, BlobRef]] = {}
        self._stats: dict[str, dict[str, EncodeStats]] = {}

    def view(self, store: Store, config: EngineConfig) -> tuple[dict[str, BlobRef], dict[str, EncodeStats]]:
        url = store.url("")
        with self._lock:
            refs, stats = self._refs.get(url), self._stats.get(url, {})
        if refs is None:
            refs = _seed(store, config)
            with self._lock:
                refs = self._refs.setdefault(url, refs)
        return dict(refs), dict(stats)

    def remember(self, store: Store, refs: Iterable[BlobRef], stats: dict[str, EncodeStats] | None = None,
                 replace: bool = True) -> None:
        url = store.url("")
        new = {r.key: r for r in refs}
        with self._lock:
            if replace or url not in self._refs:
                self._refs[url] = new
            else:
                self._refs[url].update(new)
            if stats:
                self._stats.setdefault(url, {}).update(stats)


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


def row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def _bytes_view(t2d: torch.Tensor) -> torch.Tensor:
    return t2d.view(torch.uint8).reshape(-1)


class ItemWriter:
    """Stores the items of one rank's plan. Created and used on the thread running ``write_data``;
    chunk work runs on ``workers``. ``known`` must not change while it runs."""

    def __init__(self, store: Store, config: EngineConfig, matcher: RuleMatcher, rank: int, workers: Executor,
                 known: dict[str, BlobRef], known_stats: dict[str, EncodeStats]) -> None:
        self.store, self.config, self.matcher, self.rank, self.workers = store, config, matcher, rank, workers
        self.known, self.known_stats = known, known_stats
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
        if self.store.has_blob(key):
            return ObjectRecord(record_key(item.index, True), "dcp.bytes", ref), 0
        self.store.put_blob(key, payload)
        return ObjectRecord(record_key(item.index, True), "dcp.bytes", ref), len(payload)

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
        known = self.known.get(key)
        if self.store.has_blob(key):
            if known is None:  # written by another process or rank: adopt it as stored
                data = self.store.get_blob(key, self.config.load.max_blob_bytes)
                known = BlobRef(key, len(data), xxhash.xxh3_64_hexdigest(data))
            return known, 0, self._stats_of(key)
        data, stats = pipeline.encode(array2d)
        ref = BlobRef(key, len(data), xxhash.xxh3_64_hexdigest(data))
        self.store.put_blob(key, data)
        return ref, len(data), stats


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()
