"""``CheckrunStorageWriter``: a torch.distributed.checkpoint StorageWriter that stores in checkrun's format.

DCP's call order (``dcp.save`` / ``dcp.async_save``), and what each step does here:

0. (all ranks) ``reset(checkpoint_id)``: the checkpoint path, e.g. ``run/step=100.dcp`` (any fsspec URL).
1. (all ranks) ``set_up_storage_writer(is_coordinator, rank=...)``.
2. (all ranks) ``prepare_local_plan``: resolves the store (an unsafe path fails here, before any write).
3. (coordinator) ``prepare_global_plan``: tells every rank its rank and the world size.
4. (all ranks) ``write_data``: every rank stores its own items as content-addressed, checksummed,
   compressed blobs in the shared ``DIR/.checkrun/blobs/`` (a blob already there is not written again
   once its stored bytes were checked, once per process: ``blobcheck``; a rotted one is rewritten) and
   returns, with a completed future, one WriteResult per item carrying its manifest record.
5. (coordinator) ``finish(metadata, results)``: DCP calls it only after every rank's ``write_data``
   succeeded; it commits ONE manifest, atomically. A failure on any rank means DCP never calls
   ``finish``: no manifest, no checkpoint.

Every rank's ``write_data`` holds a lease (``save_lease``) on the blobs it writes or reuses, renewed
while it writes, then held for ``WAIT_HOLD`` times ``lease_seconds`` while the rank waits in DCP's
gather (no chunk left to renew on: ``SaveLease.hold``), and kept until the checkpoint is committed: the
coordinator releases its own in ``finish`` (after checking, for a save that took over half of
``lease_seconds``, that no blob of another rank was collected: ``_check_leases``); the other ranks
theirs when ``ckpt_core.dcp.save``/``async_save`` return (``release_lease``), else at the writer's next
save (``reset``), when their process ends, or when it expires. A lease left by a failed save is marked
expired at the next save: its orphan blobs go at the next collection.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import forksafe
from ..config import EngineConfig, coerce_config
from .blobs import KNOWN, ItemWriter
from .format import CheckpointIdMixin, ItemResult, build_manifest
from ..saving.commit import check_after, publish_manifest
from ..saving.fence import clock_ns, follow, new_stamp
from ..saving.lifecycle import lower_thread_priority
from ..errors import CheckrunError, CommitRefusedError, FormatError
from ..format.manifest import ObjectRecord, TensorRecord
from ..saving.quant_rules import RuleMatcher
from ..retain import after_commit
from ..saving.handles import ByteRatios
from ..saving.lease import SaveLease
from ..storage.paths import blob_url, refuse_directory
from ..storage.store import Store

log = logging.getLogger("ckpt_core")
WAIT_HOLD = 4
"""A rank that finished writing keeps its blobs leased this many ``retention.lease_seconds`` while it
waits for slower ranks and the commit (a rank slower than that: ``_check_leases`` before the commit)."""

__all__ = ["CheckrunStorageWriter", "DcpSaveInfo"]


@dataclass(frozen=True)
class _RankPlan:
    """``SavePlan.storage_data`` set by the coordinator: the rank's index and the world size."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class DcpSaveInfo(ByteRatios):
    """What the coordinator committed (``CheckrunStorageWriter.last_save``), in the words of ``SaveInfo``
    (``referenced_bytes`` = ``stored_bytes``, ``compression_ratio``, ``write_ratio``)."""

    path: str
    tensor_bytes: int
    written_bytes: int
    """Blob bytes written by all ranks together (the manifest not included)."""
    stored_bytes: int
    """Size of all blobs the checkpoint references (shared ones included)."""
    manifest_bytes: int
    items: int
    rank_written_bytes: list[int] = field(default_factory=list)


class CheckrunStorageWriter(CheckpointIdMixin, StorageWriter, BlockingAsyncStager):
    """Stores a DCP save as a checkrun checkpoint: ``dcp.save(sd, storage_writer=CheckrunStorageWriter(path))``.

    Args:
        path: the checkpoint, a manifest file such as ``run/step=100.dcp`` or ``s3://b/run/step=100.dcp``
            (``checkpoint_id`` given to ``dcp.save`` replaces it). All checkpoints of ``run/`` share
            ``run/.checkrun/blobs/``.
        config: ``EngineConfig``, dict, YAML path or None: compression, quantization rules (matched on
            the DCP key, e.g. ``model.emb.weight``), storage (threads, fsync, retries), retention.
        storage_options: fsspec options, merged over ``config.storage.storage_options``.
        cache_staged_state_dict: for ``dcp.async_save``: keep the CPU staging copy between saves and copy
            into it (needs the same writer for every save). Default False: a fresh copy each time.
        overwrite: as ``FileSystemWriter``'s: False refuses (before any write) a save to a path that
            already holds a checkpoint. Default True: the commit replaces it atomically.

    One instance per rank; reuse it across saves. ``last_save`` (coordinator) and ``last_written_bytes``
    (every rank) describe the latest save.
    """

    def __init__(self, path: str | os.PathLike | None = None, config: EngineConfig | dict | str | None = None,
                 storage_options: dict | None = None, *, cache_staged_state_dict: bool = False,
                 overwrite: bool = True) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = None if path is None else os.fspath(path)
        self.overwrite = overwrite
        self.config = coerce_config(config)
        self.storage_options = storage_options
        self.matcher = RuleMatcher(self.config.quantization)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.last_save: DcpSaveInfo | None = None
        self.last_written_bytes = 0
        self._store: Store | None = None
        self._name = ""
        self._lease: SaveLease | None = None
        _wait_at_exit()  # here, not in stage(): a stager of the user's own never calls that (h147)

    def __getstate__(self) -> dict:
        """Picklable: DCP's process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``) sends the
        writer to its saving process, which opens its own store and lease (pickling failed on a lock:
        found by an independent check)."""
        state = {**self.__dict__, "_store": None, "_lease": None, "_clock_ns": clock_ns()}  # h137: after a load
        self.__dict__.pop("_staged_stamp", None)  # the save it was staged for runs in the copy (DCP's process)
        return state

    # -- StorageWriter ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.release_lease(committed=False)  # a lease still held: of a save that failed, or raw dcp.save
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self._store = None
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise CheckrunError("CheckrunStorageWriter needs use_collectives=True: one manifest is committed "
                                "by the coordinator for all ranks")
        self.is_coordinator = is_coordinator
        follow(self.__dict__.pop("_clock_ns", 0))  # in DCP's saving process: the training process's stamp clock
        # async_save: when it was called; else now (the coordinator's dates the checkpoint: when the save began, h127)
        self._stamp = self.__dict__.pop("_staged_stamp", None) or new_stamp()
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        store, name = self._resolve()
        refuse_directory(store, name, dcp=True)  # every rank, before any write
        if not self.overwrite and store.manifest_exists(name):
            raise CommitRefusedError(f"{store.url(name)}: a file exists there (a checkpoint or another) and "
                                     "overwrite=False (CheckrunStorageWriter)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_RankPlan(i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(every rank, the thread running dcp.save) Store this rank's items; returns a completed future."""
        store, _ = self._resolve()
        rp = plan.storage_data
        rank = rp.rank if isinstance(rp, _RankPlan) else self.rank
        known, stats, dirstate = KNOWN.view(store, self.config)
        self.release_lease(committed=False)
        self._lease = lease = SaveLease(store, self.config)
        self._started = time.monotonic()
        try:
            pool = forksafe.started_executor(self.config.saving.workers, "checkrun-dcp", lower_thread_priority,
                                             (self.config.saving.thread_nice,))  # DCP's async thread: a fork races it
            try:
                writer = ItemWriter(store, self.config, self.matcher, rank, pool, known, stats, dirstate, lease)
                results = writer.write(plan.items, planner)
            finally:
                forksafe.stop_executor(pool)
            store.sync()  # this rank's blobs are durable before the coordinator commits the manifest
            lease.hold(WAIT_HOLD * lease.seconds)  # no chunk left to renew on while it waits for the commit
        except BaseException:
            self.release_lease(committed=False)
            raise
        KNOWN.remember(store, writer.touched.values(), writer.new_stats)
        self.last_written_bytes = writer.written
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator, after every rank's write_data succeeded) Commit the manifest atomically."""
        store, name = self._resolve()
        flat = [wr for rank_results in results for wr in rank_results]
        bad = [wr.index.fqn for wr in flat if not isinstance(wr.storage_data, ItemResult)]
        if bad:
            raise CheckrunError(f"write results for {bad[:3]} were not produced by CheckrunStorageWriter: "
                                "every rank must use it")
        _check_complete(metadata, [wr.storage_data for wr in flat])
        metadata.storage_meta = self.storage_meta()
        manifest = build_manifest(metadata, [wr.storage_data for wr in flat], len(results),
                                  [wr.index for wr in flat])
        stamp = getattr(self, "_stamp", None)  # a coordinator paused before its commit dated it then: newest
        if stamp is not None:
            manifest = dataclasses.replace(manifest, created=stamp.ns / 1e9, commit=stamp.to_json())
        data = manifest.to_bytes()
        self._check_leases(store, manifest)
        publish_manifest(store, name, stamp, data)  # the fence: never over a newer checkpoint of that name (h134)
        if self._lease is not None:  # paused past the lease between the check and the commit: blobs collected?
            check_after(store, name, self._lease, manifest, data)  # (h127: reported saved, did not load)
        self.release_lease()  # the coordinator's own; the manifest protects every rank's blobs now
        KNOWN.remember(store, manifest.blobs())
        st = manifest.stats
        self.last_save = DcpSaveInfo(store.url(name), st["tensor_bytes"], st["written_bytes"], st["stored_bytes"],
                                     len(data), len(flat), list(st["rank_written_bytes"]))
        log.info("checkrun: committed DCP checkpoint %s: %.1f MB of tensors, %d ranks wrote %.1f MB",
                 self.last_save.path, st["tensor_bytes"] / 1e6, len(results), st["written_bytes"] / 1e6)
        after_commit(store, name, self.config)  # retention, then collection of what it removed

    def _check_leases(self, store: Store, manifest) -> None:
        """(coordinator, before the commit) The other ranks renewed their leases until their last
        chunk, so every lease is valid for at least half of ``lease_seconds`` after this rank started
        writing. A save that took longer: name every blob in this rank's lease, wait for collections,
        and check that each still exists (else nothing is committed)."""
        lease = self._lease
        if lease is None or time.monotonic() - self._started < 0.5 * lease.seconds:
            return
        keys = sorted(manifest.blob_keys())
        lease.cover(keys)
        gone = [k for k, info in zip(keys, store.map(store.blob_info, keys)) if info is None]
        if gone:
            raise CheckrunError(f"{len(gone)} blob(s) of the DCP save to {store.url('')} were collected while "
                                f"the ranks waited for the commit (e.g. {blob_url(store, gone[0])}); not committed")

    def release_lease(self, committed: bool = True) -> None:
        """Release this rank's lease of the last save (call on every rank once the checkpoint is
        committed: ``ckpt_core.dcp.save`` does); ``committed=False`` marks it expired instead, so that
        the next collection deletes what no manifest references."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release() if committed else lease.abandon()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    # -- AsyncStager -----------------------------------------------------------------------------
    def stage(self, state_dict: dict) -> dict:
        """(dcp.async_save, training thread) Copy the state to CPU; with ``cache_staged_state_dict``
        into buffers kept from the previous save (pinned only when CUDA is available). The save is stamped
        here, when ``async_save`` is called (h138: stamped when DCP's thread or process began it, a save made
        right after it sorted older, and retention deleted that newer checkpoint)."""
        stamp = new_stamp()  # kept only if the staging succeeds (h139: a failed one's dated the next save)
        if not self.cache_staged_state_dict:
            staged = super().stage(state_dict)
        else:
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            staged = _copy_state_dict(state_dict, self.state_dict_cache)
        self._staged_stamp = stamp
        return staged

    # -- internals -------------------------------------------------------------------------------
    def _resolve(self) -> tuple[Store, str]:
        if self.path is None:
            raise CheckrunError("CheckrunStorageWriter has no path: pass one or a checkpoint_id to dcp.save")
        if self._store is None:
            self._store, self._name = Store.for_path(self.path, self.storage_options, self.config.storage)
        return self._store, self._name


def _check_complete(metadata: Metadata, results: list[ItemResult]) -> None:
    """Every chunk and value DCP's metadata lists must have a stored record (nothing silently lost)."""
    want_tensors = sum(len(md.chunks) for md in metadata.state_dict_metadata.values()
                       if isinstance(md, TensorStorageMetadata))
    want_objects = len(metadata.state_dict_metadata) - sum(
        1 for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))
    got_tensors = sum(1 for r in results if isinstance(r.record, TensorRecord))
    got_objects = sum(1 for r in results if isinstance(r.record, ObjectRecord))
    if (got_tensors, got_objects) != (want_tensors, want_objects):
        raise FormatError(f"DCP save incomplete: metadata lists {want_tensors} tensor chunks and {want_objects} "
                          f"values, the ranks stored {got_tensors} and {got_objects}; nothing committed")


_EXIT_HOOK: list[bool] = []


def _wait_at_exit() -> None:
    """Once per process, when the first checkrun writer is made: at interpreter exit, before
    ``concurrent.futures`` refuses new work, wait for DCP's async-save threads (h145: a script that ended right
    after ``async_save`` lost the checkpoint: the save's pools could not start, and its future's error went
    unseen; DCP's own FileSystemWriter wrote it). Threading's exit hooks run newest first."""
    if _EXIT_HOOK:
        return
    import concurrent.futures.thread  # noqa: F401 - registers its exit hook first, so it runs after this one

    def wait() -> None:
        for t in threading.enumerate():
            if t.name.startswith(_DCP_ASYNC_THREAD) and t is not threading.current_thread():
                t.join()

    try:
        getattr(threading, "_register_atexit", atexit.register)(wait)
    except RuntimeError:  # made while the interpreter shuts down: too late to wait for anything
        return
    _EXIT_HOOK.append(True)


_DCP_ASYNC_THREAD = "AsyncCheckpointExecutor"  # torch.distributed.checkpoint._async_thread_executor's thread names
