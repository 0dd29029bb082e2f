"""Steps 2-4 of a save, on the background thread: plan, encode, store (the commit: ``commit``).

Content addresses are computed from the raw staged bytes *before* encoding, so an unchanged chunk
costs one xxh3 pass (GB/s, GIL released) and no encoding or I/O at all, once its stored blob was
checked: every blob a save reuses is read back once per engine before it is trusted (``blobcheck``;
the cost is one read of each reused blob per engine), and a bad one is written again.

Every save holds a lease (``save_lease``) on the blobs it writes or reuses: a blob is written only
once the lease names it, and before the commit the lease names every blob of the manifest and the
reused ones are checked to exist (after that, no collection can take them). The lease goes after
the commit, or is marked expired after a failure.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
import torch
import xxhash

from .capture import Snapshot, StagedTensor
from .blobcheck import StoredBlob, adoptable, check_reused, trusted
from ..codecs import EncodeStats, Pipeline, lossless_pipeline, pipeline_for_rule
from ..config import EngineConfig, QuantRule
from ..format.dtypes import row_shape
from ..format.manifest import BlobRef, ChunkRef, DeltaRef, Manifest, ObjectRecord, TensorRecord, dtype_name
from .quant_error import stream_row_norms, tensor_quant
from .quant_rules import RuleMatcher
from .lease import SaveLease
from ..storage.store import Store
from .streams import DirState, RowPlan, plan_rows

log = logging.getLogger("ckpt_core")

@dataclass(frozen=True)
class ChunkResult:
    ref: ChunkRef
    written: int
    stats: EncodeStats | None


def chunk_spans(rows: int, cols: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(element offset, rows, cols) pieces: whole rows when a row fits, else slices of one row."""
    if rows * cols == 0:
        return [(0, rows, cols)]
    row_bytes = cols * itemsize
    if row_bytes <= chunk_bytes:
        step = max(1, chunk_bytes // row_bytes)
        return [(r * cols, min(step, rows - r), cols) for r in range(0, rows, step)]
    step = max(1, chunk_bytes // itemsize)
    total = rows * cols
    return [(off, 1, min(step, total - off)) for off in range(0, total, step)]


def blob_key(prefix: str, data: torch.Tensor | bytes) -> str:
    h = xxhash.xxh3_128(prefix.encode())
    h.update(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)
    return h.hexdigest()


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t.view(torch.uint8)


class _Part:
    """The result of one member of a pack, in the shape of a chunk future (``result()``): its chunk
    is bytes [start, start + nbytes) of the pack's ``size`` bytes, and it is charged its share of
    the bytes the pack wrote (the shares of a pack add up to exactly what it wrote)."""

    def __init__(self, pack: Future, st: StagedTensor, start: int, size: int) -> None:
        self.pack, self.start, self.size = pack, start, size
        self.end = start + st.nbytes
        self.rows, self.cols = row_shape(tuple(st.shape))

    def result(self) -> ChunkResult:
        res: ChunkResult = self.pack.result()
        written = res.written * self.end // self.size - res.written * self.start // self.size
        return ChunkResult(ChunkRef(0, self.rows, self.cols, res.ref.blob, (self.start, self.size)), written, None)


class SnapshotWriter:
    """Writes one snapshot to one store. Created and run on the background (coordinator) thread."""

    def __init__(self, snap: Snapshot, store: Store, dirstate: DirState, config: EngineConfig,
                 matcher: RuleMatcher, workers: Executor, lease: SaveLease) -> None:
        self.snap, self.store, self.dir, self.config = snap, store, dirstate, config
        self.matcher, self.workers, self.lease = matcher, workers, lease
        self.stream_updates: dict[str, tuple] = {}
        self.written: dict[str, BlobRef] = {}
        """Blobs this save wrote (key -> reference): trusted by this save only."""
        self._futures: list[Future] = []

    def _submit(self, fn, *args) -> Future:
        future = self.workers.submit(fn, *args)
        self._futures.append(future)
        return future

    # -- chunks -------------------------------------------------------------------------------
    def _put_chunk(self, array2d: torch.Tensor, off: int, pipeline: Pipeline, prefix: str,
                   force: bool = False) -> ChunkResult:
        """Store one chunk, or reuse its stored blob once that was checked (``blobcheck``).

        A blob in the index is reused without encoding once its stored bytes match the indexed
        reference and (lossy) its error is known; otherwise the chunk is encoded, and the stored
        blob adopted if it holds the same content, else (missing, rotted, ``force``) written."""
        self.lease.renew_if_due()  # the save's threads renew its lease as they work
        rows, cols = array2d.shape
        key = blob_key(f"{prefix}|{rows}x{cols}|", _as_bytes_view(array2d).reshape(-1))
        known = None if force else self.dir.index.get(key)
        stored = StoredBlob(self.store, key, self.config.load.max_blob_bytes)
        if known is not None and trusted(self.dir, known, stored):
            stats = self.dir.stats.get(key)
            if stats is not None or not pipeline.lossy:
                return ChunkResult(ChunkRef(off, rows, cols, known), 0, stats)
        data, stats = pipeline.encode(array2d)
        stats = stats if pipeline.lossy else None
        fresh = BlobRef(key, len(data), xxhash.xxh3_64_hexdigest(data))
        ref = None if force else adoptable(self.dir, fresh, data, array2d, pipeline, stored)
        if ref is not None:
            return ChunkResult(ChunkRef(off, rows, cols, ref), 0, stats)
        self._write_blob(fresh, data)
        return ChunkResult(ChunkRef(off, rows, cols, fresh), len(data), stats)

    def _write_blob(self, ref: BlobRef, data: bytes | memoryview) -> None:
        self.lease.cover([ref.key])  # named by the lease before it exists: no collection takes it
        self.store.put_blob(ref.key, data)
        # Written, not read back: the first save that reuses it checks it.
        self.dir.verified.pop(ref.key, None)
        self.written[ref.key] = ref

    def _chunks(self, t2d: torch.Tensor, pipeline: Pipeline, prefix: str, force: bool = False):
        rows, cols = t2d.shape
        flat = t2d.reshape(-1)
        futures = []
        for off, r, c in chunk_spans(rows, cols, t2d.element_size(), self.config.compression.chunk_bytes):
            piece = flat[off:off + r * c].view(r, c)
            futures.append(self._submit(self._put_chunk, piece, off, pipeline, prefix, force))
        return futures

    # -- tensors ------------------------------------------------------------------------------
    def _pipeline(self, st: StagedTensor) -> tuple[Pipeline, QuantRule | None]:
        view = st.data.view(st.shape) if st.shape else st.data.view(())
        rule = self.matcher.select(st.key, view)
        if rule is None:
            return lossless_pipeline(st.dtype, self.config.compression), None
        return pipeline_for_rule(rule, st.dtype, len(st.shape), self.config.compression), rule

    def _tensor_jobs(self, st: StagedTensor, force: bool = False, lossless: bool = False):
        """Submit the chunk work of one tensor. ``force``: full base, every blob written again;
        ``lossless``: ignore quantization rules (a lossy codec refused this tensor's values)."""
        pipeline, rule = self._pipeline(st)
        if lossless:
            pipeline, rule = lossless_pipeline(st.dtype, self.config.compression), None
        rows, cols = row_shape(tuple(st.shape))
        t2d = st.data.view(rows, cols)
        prefix = f"{pipeline.spec_id}|{dtype_name(st.dtype)}"
        plan: RowPlan | None = None
        if st.stream is not None:
            row_bytes = cols * st.data.element_size()
            plan = plan_rows(st.stream, None if force else st.changed, self.config.incremental,
                             pipeline.spec_id, row_bytes)
        if plan is not None and not plan.full:
            base = list(st.stream.record.base)
            idx = plan.rows.to(torch.int64).contiguous()
            idx_future = self._submit(self._put_index, idx)
            delta_futures = self._chunks(t2d.index_select(0, idx), pipeline, prefix) if idx.numel() else []
            return st, pipeline, rule, plan, base, None, (idx, idx_future, delta_futures)
        return st, pipeline, rule, plan, None, self._chunks(t2d, pipeline, prefix, force), None

    def _packed_jobs(self) -> dict[int, tuple]:
        """Jobs of the small tensors stored together in packs, by index in the snapshot.

        Small lossless tensors without a row stream, grouped by pipeline and element size, are
        concatenated into packs of up to ``chunk_bytes``; each gets one chunk that is a part of
        its pack's blob (``ChunkRef.part``). A group of one stays a tensor of its own."""
        limit = min(self.config.compression.pack_bytes, self.config.compression.chunk_bytes)
        groups: dict[tuple[str, int], list] = {}
        for i, st in enumerate(self.snap.tensors):
            if st.stream is not None or not 0 < st.nbytes <= limit:
                continue
            pipeline, rule = self._pipeline(st)
            if rule is None:
                groups.setdefault((pipeline.spec_id, st.data.element_size()), []).append((i, st, pipeline))
        jobs: dict[int, tuple] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            packs, total = [[]], 0
            for m in members:
                if total + m[1].nbytes > self.config.compression.chunk_bytes and packs[-1]:
                    packs.append([])
                    total = 0
                packs[-1].append(m)
                total += m[1].nbytes
            for pack in packs:
                sts = [st for _, st, _ in pack]
                future = self._submit(self._put_pack, sts, pack[0][2])
                size, start = sum(st.nbytes for st in sts), 0
                for i, st, pipeline in pack:
                    part = _Part(future, st, start, size)
                    jobs[i] = (st, pipeline, None, None, None, [part], None)
                    start += st.nbytes
        return jobs

    def _put_pack(self, sts: list[StagedTensor], pipeline: Pipeline) -> ChunkResult:
        """Concatenate the staged bytes of ``sts`` (same element size) and store them as one blob."""
        buf = torch.empty(sum(st.nbytes for st in sts), dtype=torch.uint8)
        pos = 0
        for st in sts:
            buf[pos:pos + st.nbytes] = st.data.reshape(-1).view(torch.uint8)
            pos += st.nbytes
        data = buf.view(sts[0].dtype).view(1, -1)
        return self._put_chunk(data, 0, pipeline, f"{pipeline.spec_id}|pack")

    def _put_index(self, idx: torch.Tensor) -> tuple[BlobRef, int]:
        from ..loading.reader import index_pipeline

        pipeline = index_pipeline()
        res = self._put_chunk(idx.view(1, -1), 0, pipeline, f"{pipeline.spec_id}|index")
        return res.ref.blob, res.written

    def _finish_tensor(self, job) -> tuple[TensorRecord, int] | None:
        """The record of one tensor once its chunks are stored; None when it is a row delta whose
        error cannot be bounded (stats of a blob it keeps are unknown): write it full instead."""
        st, pipeline, rule, plan, base, base_futures, delta = job
        written, idx = 0, None
        if base_futures is not None:
            results = [f.result() for f in base_futures]
            base = [r.ref for r in results]
            deltas: tuple[DeltaRef, ...] = ()
        else:
            idx, idx_future, delta_futures = delta
            idx_ref, idx_written = idx_future.result()
            results = [f.result() for f in delta_futures]
            new = DeltaRef(int(idx.numel()), idx_ref, tuple(
                ChunkRef(r.ref.off, r.ref.rows, r.ref.cols, r.ref.blob) for r in results))
            written += idx_written
            deltas = tuple(plan.keep_deltas) + (new,)
        for r in results:
            written += r.written
            if r.stats is not None:
                self.dir.stats[r.ref.blob.key] = r.stats
        quant, norms = None, None
        if rule is not None and pipeline.lossy:
            if st.stream is not None:
                norms = stream_row_norms(self.dir, st.key, st.data.view(row_shape(tuple(st.shape))), idx, st.stream.record)
            quant = tensor_quant(rule, pipeline, self.dir.stats, base, deltas, [r.stats for r in results], norms)
            if quant is None:
                return None
        rec = TensorRecord(st.key, dtype_name(st.dtype), st.shape, tuple(pipeline.to_list()), tuple(base),
                           deltas, written, quant, st.device)
        if norms is not None:
            self.dir.row_norms[st.key] = (rec, norms)
        if st.stream is not None:
            self.stream_updates[st.key] = (plan, rec, pipeline.spec_id, st.changed is not None)
        return rec, written

    def _tensor(self, st: StagedTensor, job, force: bool = False) -> tuple[TensorRecord, int]:
        try:
            done = self._finish_tensor(job)
        except ValueError as exc:  # a lossy codec refuses non-finite or out-of-range values
            log.warning("checkrun: %s stored lossless: %s", st.key, exc)
            return self._finish_tensor(self._tensor_jobs(st, force=force, lossless=True))
        if done is None:  # its chunks encoded now give the error of a full record
            log.info("checkrun: quantization error of the chain of %s unknown; writing it full", st.key)
            return self._tensor(st, self._tensor_jobs(st, force=True), force=True)
        return done

    def _repair_missing(self, records: list[TensorRecord], everything: bool = False) -> int:
        """Before the commit: make the lease name every blob of ``records``, then check that the
        reused ones (``everything``: all of them, after a lapse of the lease) exist, and rewrite,
        from the snapshot, every tensor that lost one: it may have been collected (another
        process's gc) before the lease named it. Once named and found, no collection can take it.
        So is every tensor holding a reference whose stored blob does not match it: the base and
        older deltas a row-delta save keeps never pass through ``_put_chunk``, so they are checked
        here, before the manifest that references them commits (once per engine: ``blobcheck``)."""
        refs = list(dict.fromkeys(b for r in records for b in r.blobs()))
        self.lease.cover(b.key for b in refs)
        reused = [b for b in refs if everything or self.written.get(b.key) != b]
        keys = sorted({b.key for b in reused})
        infos = self.store.map(self.store.blob_info, keys)
        missing = {k for k, info in zip(keys, infos) if info is None}
        present = [b for b in reused if b.key not in missing and self.written.get(b.key) != b]
        matches = check_reused(self.store, self.dir, present, self.config.load.max_blob_bytes)
        missing.update(b.key for b, ok in zip(present, matches) if not ok)
        extra = 0
        for i, st in enumerate(self.snap.tensors):
            if missing.intersection(b.key for b in records[i].blobs()):
                log.warning("checkrun: blobs of %s are missing or damaged; writing it again", st.key)
                records[i], w = self._tensor(st, self._tensor_jobs(st, force=True), force=True)
                extra += w
        return extra

    def _recheck_objects(self, objects: list[ObjectRecord]) -> int:
        """After a lapse of the lease: write again every object blob that is gone."""
        gone = [i for i, o in enumerate(objects) if self.store.blob_info(o.blob.key) is None]
        for i in gone:
            self._write_blob(objects[i].blob, self.snap.objects[i].data)
        return sum(objects[i].blob.size for i in gone)

    # -- whole snapshot -----------------------------------------------------------------------
    def write(self) -> tuple[Manifest, dict]:
        """Encode and store every blob, then return the manifest (not yet committed) and stats.

        Returns or raises only once no worker uses the snapshot any more: the caller then hands
        its staging buffers to the next save (a worker still encoding from one would store the
        next save's bytes under this snapshot's content address). Work nobody waits for any more
        (after a failure, or a lossy attempt abandoned for a lossless one) is cancelled or awaited."""
        try:
            return self._write()
        finally:
            for future in self._futures:
                future.cancel()
            wait(self._futures)

    def _write(self) -> tuple[Manifest, dict]:
        t0 = time.perf_counter()
        if self.snap.event is not None:
            self.snap.event.synchronize()
        packed = self._packed_jobs()
        jobs = [packed.get(i) or self._tensor_jobs(st) for i, st in enumerate(self.snap.tensors)]
        obj_futures = [self._submit(self._put_object, o) for o in self.snap.objects]
        records, written = [], 0
        for st, job in zip(self.snap.tensors, jobs):
            rec, w = self._tensor(st, job)
            records.append(rec)
            written += w
        written += self._repair_missing(records)
        objects = []
        for fut, o in zip(obj_futures, self.snap.objects):
            ref, w = fut.result()
            objects.append(ObjectRecord(o.key, o.type_name, ref))
            written += w
        if not self.lease.intact():  # renewals failed for a while: a collection may have taken any
            log.warning("checkrun: the lease of the save to %s lapsed; checking its blobs again",
                        self.store.url(""))
            self.lease.refresh()
            written += self._repair_missing(records, everything=True) + self._recheck_objects(objects)
        tensor_bytes = sum(st.nbytes for st in self.snap.tensors)
        stats = {
            "tensor_bytes": tensor_bytes,
            "written_bytes": written,
            "stored_bytes": 0,
            "chain_depth": max((len(r.deltas) for r in records), default=0),
            "quantized": any(r.quant for r in records),
            "encode_seconds": time.perf_counter() - t0,
        }
        meta = dict(self.snap.meta)
        if list(self.snap.leaves) != list(range(len(self.snap.leaves))) or len(self.snap.leaves) != len(records):
            meta["leaves"] = list(self.snap.leaves)
        manifest = Manifest(self.snap.created, self.snap.skeleton, tuple(records), tuple(objects), stats, meta)
        stats["stored_bytes"] = sum(b.size for b in {b.key: b for b in manifest.blobs()}.values())
        return manifest, stats

    def _put_object(self, obj) -> tuple[BlobRef, int]:
        key = blob_key("object|", obj.data)
        ref = BlobRef(key, len(obj.data), xxhash.xxh3_64_hexdigest(obj.data))
        # Objects are few and small: always look at the stored blob, never trust the index, and
        # compare its bytes once per engine (the object's own bytes are its only valid encoding).
        stored = StoredBlob(self.store, key, self.config.load.max_blob_bytes)
        self.lease.cover([key])  # before looking: once named, a blob found stays
        if self.store.blob_info(key) is not None and trusted(self.dir, ref, stored):
            return ref, 0
        self._write_blob(ref, obj.data)
        return ref, len(obj.data)

    def adopt(self, manifest: Manifest) -> None:
        """After the commit: remember its blobs and records (the row streams: ``commit_streams``)."""
        for b in manifest.blobs():
            self.dir.index[b.key] = b
        for rec in manifest.tensors:
            self.dir.records[rec.key] = rec
