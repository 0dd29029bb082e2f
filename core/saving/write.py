"""Stage: write. Executes plans (``plan``): encode each chunk and put its blob, or reuse one stored.

The one writer of every save path: ordinary saves (``SnapshotWriter``, steps 3-4 of a save, on the
background thread; the commit is ``commit``) and DCP ranks (``dcp.blobs.ItemWriter``) run the same
``BlobWriter`` (chunks, packs, row indices, objects) and ``TensorWriter`` (a tensor's chunks, its
record and quantization entry, the lossless fallback). Nothing here decides what to write: when an
outcome needs another plan, the writer asks the ``Planner``.

Content addresses are computed from the raw staged bytes *before* encoding, so an unchanged chunk
costs one xxh3 pass (GB/s, GIL released) and no encoding or I/O at all, once its stored blob was
checked: every blob a save reuses is read back once per engine before it is trusted, and again
once its stored file changed (``blobcheck``; the cost is one read of each reused blob per engine,
and the look each save takes anyway), and a bad one is written again.

Every save holds a lease (``save_lease``) on the blobs it writes or reuses: a blob is written only
once the lease names it, and before the commit the lease names every blob of the manifest and the
reused ones are checked to exist (after that, no collection can take them). The lease goes after
the commit, or is marked expired after a failure.
"""
from __future__ import annotations

import dataclasses

import logging
import time
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import EngineConfig
from ..errors import LossyRefusedError
from ..format.dtypes import row_shape
from ..format.manifest import ChunkRef, DeltaRef, Manifest, ObjectRecord, TensorRecord, dtype_name
from ..storage.store import Store
from .blobcheck import check_reused, notice
from .blobwrite import BlobWriter, ChunkResult
from .capture import Snapshot, StagedTensor
from .lease import SaveLease
from .plan import PackPlan, Planner, TensorPlan, WritePlan
from .quant_error import stream_row_norms, tensor_quant
from .quant_rules import RuleMatcher
from .streams import DENSE_META, DirState

log = logging.getLogger("ckpt_core")


@dataclass(frozen=True)
class TensorDone:
    """A tensor whose chunks are stored: its record, the bytes written, the plan it was written
    by (after any fallback), and (lossy row stream) the row norms of its quantization entry."""

    record: TensorRecord
    written: int
    plan: TensorPlan
    norms: torch.Tensor | None = None


class _Part:
    """The result of one member of a pack, in the shape of a chunk future (``result()``): its chunk
    is bytes [start, start + nbytes) of the pack's ``size`` bytes, and it is charged its share of
    the bytes the pack wrote (the shares of a pack add up to exactly what it wrote)."""

    def __init__(self, pack: Future, plan: TensorPlan, nbytes: int, size: int) -> None:
        self.pack, self.start, self.size = pack, plan.pack.start, size
        self.end = self.start + nbytes
        self.rows, self.cols = plan.grid

    def result(self) -> ChunkResult:
        res: ChunkResult = self.pack.result()
        written = res.written * self.end // self.size - res.written * self.start // self.size
        return ChunkResult(ChunkRef(0, self.rows, self.cols, res.ref.blob, (self.start, self.size)), written, None)


@dataclass
class Pending:
    """A tensor whose chunk work is submitted: ``source`` is its (rows, cols) data."""

    plan: TensorPlan
    source: torch.Tensor
    chunks: list
    idx: torch.Tensor | None = None
    idx_future: Future | None = None


Replan = Callable[[bool, bool], TensorPlan]
"""(force, lossless) -> a new plan of the same tensor (``Planner.tensor``)."""


class TensorWriter:
    """Executes tensor plans on ``blobs``, chunk work through ``submit`` (a worker pool's).
    ``stats``: where the encode stats of lossy chunks are kept, and the chain of a delta looked up."""

    def __init__(self, blobs: BlobWriter, submit: Callable[..., Future], stats: dict) -> None:
        self.blobs, self.submit, self.stats = blobs, submit, stats

    def start(self, plan: TensorPlan, source: torch.Tensor) -> Pending:
        """Submit the chunk work of ``plan`` (not a pack member) over ``source``."""
        if plan.delta:
            idx = plan.rows.rows.to(torch.int64).contiguous()
            if not idx.numel():  # no row changed: the record is the last one, no link added
                return Pending(plan, source, [], idx)
            idx_future = self.submit(self.blobs.put_index, idx)
            rows = source.index_select(0, idx) if plan.spans else source[:0]
            return Pending(plan, source, self._chunks(plan, rows), idx, idx_future)
        return Pending(plan, source, self._chunks(plan, source))

    def _chunks(self, plan: TensorPlan, t2d: torch.Tensor) -> list[Future]:
        flat = t2d.reshape(-1)
        return [self.submit(self.blobs.put_chunk, flat[s.off:s.off + s.rows * s.cols].view(s.rows, s.cols),
                            s.off, plan.pipeline, plan.prefix, plan.force) for s in plan.spans]

    def start_pack(self, pack: PackPlan, plans: list[TensorPlan], sources: list[torch.Tensor]) -> list[Pending]:
        """Submit one pack; a pending tensor per member (``plans``/``sources`` in member order)."""
        future = self.submit(self.blobs.put_pack, sources, pack.pipeline)
        return [Pending(p, s, [_Part(future, p, s.nbytes, pack.size)]) for p, s in zip(plans, sources)]

    def finish(self, pending: Pending, device: str,
               norms_of: Callable[[torch.Tensor | None], torch.Tensor] | None = None) -> TensorDone | None:
        """The record of a tensor once its chunks are stored; None when it is lossy and its error
        cannot be bounded (stats of a blob it keeps are unknown): it must be written full.
        ``norms_of(idx)``: the row norms of a lossy row stream (``quant_error.stream_row_norms``)."""
        plan = pending.plan
        written = 0
        results = [f.result() for f in pending.chunks]
        if not plan.delta:
            base: tuple[ChunkRef, ...] = tuple(r.ref for r in results)
            deltas: tuple[DeltaRef, ...] = ()
        elif pending.idx_future is None:
            base, deltas = plan.base, tuple(plan.rows.keep_deltas)
        else:
            idx_ref, idx_written = pending.idx_future.result()
            new = DeltaRef(int(pending.idx.numel()), idx_ref, tuple(
                ChunkRef(r.ref.off, r.ref.rows, r.ref.cols, r.ref.blob) for r in results))
            written += idx_written
            base, deltas = plan.base, tuple(plan.rows.keep_deltas) + (new,)
        for r in results:
            written += r.written
            if r.stats is not None:
                self.stats[r.ref.blob.key] = r.stats
        quant, norms = None, None
        if plan.lossy:
            norms = norms_of(pending.idx) if norms_of is not None else None
            quant = tensor_quant(plan.rule, plan.pipeline, self.stats, base, deltas, [r.stats for r in results],
                                 norms)
            if quant is None:
                return None
        rec = TensorRecord(plan.key, dtype_name(plan.dtype), plan.shape, tuple(plan.pipeline.to_list()), base,
                           deltas, written, quant, device)
        return TensorDone(rec, written, plan, norms)

    def settle(self, pending: Pending, replan: Replan, device: str,
               norms_of: Callable[[torch.Tensor | None], torch.Tensor] | None = None) -> TensorDone:
        """``finish``, then follow the outcome: a refusal of the lossy codec (``LossyRefusedError``,
        and nothing else) writes the tensor lossless; an unknown error writes it full."""
        plan = pending.plan
        try:
            done = self.finish(pending, device, norms_of)
        except LossyRefusedError as exc:
            if not plan.pipeline.lossy:
                raise
            log.warning("checkrun: %s stored lossless: %s", plan.key, exc)
            return self.settle(self.start(replan(plan.force, True), pending.source), replan, device, norms_of)
        if done is None:  # its chunks encoded now give the error of a full record
            log.info("checkrun: quantization error of the chain of %s unknown; writing it full", plan.key)
            return self.settle(self.start(replan(True, False), pending.source), replan, device, norms_of)
        return done


def _submitter(workers: Executor, futures: list[Future]):
    """``submit(fn, *args)`` on ``workers``, each future also appended to ``futures``."""
    def submit(fn, *args) -> Future:
        future = workers.submit(fn, *args)
        futures.append(future)
        return future
    return submit


class SnapshotWriter:
    """Writes one snapshot to one store. Created and run on the background (coordinator) thread."""

    def __init__(self, snap: Snapshot, store: Store, dirstate: DirState, config: EngineConfig,
                 matcher: RuleMatcher, workers: Executor, lease: SaveLease) -> None:
        self.snap, self.store, self.dir, self.lease = snap, store, dirstate, lease
        self.planner = Planner(matcher, config.compression, config.incremental)
        self.blobs = BlobWriter(store, dirstate, lease, config.load.max_blob_bytes)
        self._futures: list[Future] = []
        # Not a bound method: a cycle through self would keep the snapshot (its staging buffers,
        # in a writer process mapped shared memory) alive until the cyclic GC runs.
        self._submit = _submitter(workers, self._futures)
        self.tensors = TensorWriter(self.blobs, self._submit, dirstate.stats)
        self.workers, self.max_blob_bytes = workers, config.load.max_blob_bytes
        self.stream_updates: dict[str, tuple] = {}
        self.written = self.blobs.written
        """Blobs this save wrote (key -> reference): trusted by this save only."""

    def _source(self, st: StagedTensor) -> torch.Tensor:
        return st.data.view(row_shape(tuple(st.shape)))

    def _start(self, plan: WritePlan, tensors: list[StagedTensor]) -> list[Pending]:
        """Submit the work of a whole plan of ``tensors``: packs first, then every other tensor, in order."""
        pending: dict[int, Pending] = {}
        for pack in plan.packs:
            members = [plan.tensors[i] for i in pack.members]
            done = self.tensors.start_pack(pack, members, [self._source(tensors[i]) for i in pack.members])
            pending.update(zip(pack.members, done))
        return [pending.get(i) or self.tensors.start(p, self._source(tensors[i]))
                for i, p in enumerate(plan.tensors)]

    def _tensor(self, st: StagedTensor, pending: Pending) -> tuple[TensorRecord, int]:
        def replan(force: bool, lossless: bool) -> TensorPlan:
            return self.planner.staged(st, force=force, lossless=lossless)

        def norms_of(idx: torch.Tensor | None) -> torch.Tensor:
            return stream_row_norms(self.dir, st.key, self._source(st), idx, st.stream.record)

        done = self.tensors.settle(pending, replan, st.device, norms_of if st.stream is not None else None)
        rec, plan = done.record, done.plan
        if done.norms is not None:
            self.dir.row_norms[st.key] = (rec, done.norms)
        if st.stream is not None:
            self.stream_updates[st.key] = (plan.rows, rec, plan.pipeline.spec_id, st.changed is not None)
        return rec, done.written

    def _repair_missing(self, records: list[TensorRecord], everything: bool = False) -> int:
        """Before the commit: make the lease name every blob of ``records``, then check that the
        reused ones (``everything``: all of them, after a lapse of the lease) exist, and rewrite,
        from the snapshot, every tensor that lost one: it may have been collected (another
        process's gc) before the lease named it. Once named and found, no collection can take it.
        So is every tensor holding a reference whose stored blob does not match it: the base and
        older deltas a row-delta save keeps never pass through ``put_chunk``, so they are checked
        here, before the manifest that references them commits (once per engine: ``blobcheck``)."""
        refs = list(dict.fromkeys(b for r in records for b in r.blobs()))
        self.lease.cover(b.key for b in refs)
        reused = [b for b in refs if everything or self.written.get(b.key) != b]
        keys = sorted({b.key for b in reused})
        infos = self.store.map(self.store.blob_info, keys)
        notice(self.dir, infos)  # a checked blob whose stored file changed is read again below
        missing = {k for k, info in zip(keys, infos) if info is None}
        present = [b for b in reused if b.key not in missing and self.written.get(b.key) != b]
        matches = check_reused(self.store, self.dir, present, self.max_blob_bytes,
                               {k: info for k, info in zip(keys, infos) if info is not None})
        missing.update(b.key for b, ok in zip(present, matches) if not ok)
        extra = 0
        for i, st in enumerate(self.snap.tensors):
            if missing.intersection(b.key for b in records[i].blobs()):
                log.warning("checkrun: blobs of %s are missing or damaged; writing it again", st.key)
                plan = self.planner.staged(st, force=True)
                records[i], w = self._tensor(st, self.tensors.start(plan, self._source(st)))
                extra += w
        return extra

    def _recheck_objects(self, objects: list[ObjectRecord]) -> int:
        """After a lapse of the lease: write again every object blob that is gone."""
        gone = [i for i, o in enumerate(objects) if self.store.blob_info(o.blob.key) is None]
        for i in gone:
            self.blobs.write_blob(objects[i].blob, self.snap.objects[i].data)
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
        # A save repeating a committed one (``repeat``: the same staging) takes its records as they are: its
        # row-stream tensors aside, they would encode to the very same blobs (Lightning's last.ckpt after the
        # top-k file went through the whole pipeline again, and committed seconds after it on a large state)
        reuse = self.snap.hold.records
        mine = [st.stream is not None or st.key not in reuse for st in self.snap.tensors]
        todo = [st for st, m in zip(self.snap.tensors, mine) if m]
        plan = self.planner.snapshot(todo)  # every decision before the first byte
        pending = iter(self._start(plan, todo))
        obj_futures = [self._submit(self.blobs.put_object, o.data) for o in self.snap.objects]
        records, written = [], 0
        for st, m in zip(self.snap.tensors, mine):
            rec, w = self._tensor(st, next(pending)) if m else (dataclasses.replace(reuse[st.key], written=0), 0)
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
        return self._manifest(records, objects, written, t0)

    def _manifest(self, records: list[TensorRecord], objects: list[ObjectRecord], written: int,
                  t0: float) -> tuple[Manifest, dict]:
        stats = {
            "tensor_bytes": sum(st.nbytes for st in self.snap.tensors),
            "written_bytes": written,
            "stored_bytes": 0,
            "chain_depth": max((len(r.deltas) for r in records), default=0),
            "quantized": any(r.quant for r in records),
            "encode_seconds": time.perf_counter() - t0,
        }
        meta = dict(self.snap.meta)
        dense = sorted(k for k, (rplan, *_) in self.stream_updates.items() if rplan is not None and rplan.full
                       and rplan.dense)
        if dense:
            meta[DENSE_META] = dense
        if list(self.snap.leaves) != list(range(len(self.snap.leaves))) or len(self.snap.leaves) != len(records):
            meta["leaves"] = list(self.snap.leaves)
        manifest = Manifest(self.snap.created, self.snap.skeleton, tuple(records), tuple(objects), stats, meta)
        stats["stored_bytes"] = sum(b.size for b in {b.key: b for b in manifest.blobs()}.values())
        return manifest, stats

    def adopt(self, manifest: Manifest) -> None:
        """After the commit: remember its blobs and records (the row streams: ``commit_streams``)."""
        for b in manifest.blobs():
            self.dir.index[b.key] = b
        for rec in manifest.tensors:
            self.dir.records[rec.key] = rec
