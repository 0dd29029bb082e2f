"""CheckpointEngine: the public entry point of checkrun.

Threads: ``save``, ``load``, ``remove``, ``latest``, ``verify``, ``gc``, ``wait`` and ``close`` are
called from the training thread (any one thread at a time). Each save's background part runs on one
coordinator thread in submission order (so saves to one path commit in order), fanning chunk work out
to a pool of ``saving.workers`` threads; with ``saving.background: process`` the coordinator hands each
save to a writer process instead (``writer_process``), which does the same there. An idle engine
holds no thread: the coordinator and its workers end once no save is queued (``wait`` returns after
they have), and the next save starts them again.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .saving import inflight, lifecycle
from .saving.capture import Snapshot, take_snapshot
from .config import EngineConfig, coerce_config
from .errors import BackgroundSaveError, CheckpointNotFoundError, CheckrunError
from .saving.handles import SaveHandle, SaveInfo
from .format.manifest import Manifest
from .saving.quant_rules import RuleMatcher
from .loading.reader import (
    VerifyReport, load_manifest_state, map_location_tensor, read_manifest, verify_manifest)
from .retain.retention import (
    CheckpointEntry, GCReport, apply_retention, blob_sizes, collect_garbage, list_checkpoints)
from .saving.staging import BufferPool, Copier, MemoryBudget
from .storage.store import Store
from .saving.streams import DirState, RowStream, row_eligible
from .saving.tracking import EmbeddingTracker
from .saving.commit import Committed, commit_streams, write_and_commit
from .saving.process import WriterProcess, check_store

import torch

log = logging.getLogger("ckpt_core")
PathLike = str | os.PathLike
IDLE_SECONDS = 30.0
"""An asynchronous engine's coordinator and workers end after this long without a save."""


class _Job:
    def __init__(self, snap: Snapshot, store: Store, name: str, handle: SaveHandle, dirstate: DirState,
                 started: float, blocking: float) -> None:
        self.snap, self.store, self.name, self.handle = snap, store, name, handle
        self.dir, self.started, self.blocking = dirstate, started, blocking


class CheckpointEngine:
    """Asynchronous, incremental, optionally quantized checkpoints on any fsspec storage.

    Use as a context manager or call ``close()``; a forgotten engine is flushed at interpreter exit.
    """

    def __init__(self, config: EngineConfig | dict | PathLike | None = None) -> None:
        self.config = coerce_config(config)
        sc = self.config.saving
        self._process = WriterProcess(self.config) if sc.background == "process" else None
        self._budget = MemoryBudget(sc.staging_budget_bytes)
        self._pool = BufferPool(pin_memory=sc.pin_memory, shared=self._process and self._process.shared,
                                budget=self._budget)  # the pool keeps within the staging budget too
        self._copier = Copier()
        self._slots = threading.BoundedSemaphore(sc.max_pending)
        self._matcher = RuleMatcher(self.config.quantization)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # the coordinator; None while the engine is idle
        self._retired: list[threading.Thread] = []  # coordinators that went idle, joined by wait/close
        self._dirs: dict[tuple, DirState] = {}
        self._stores: dict[tuple, Store] = {}
        self._inflight: list[SaveHandle] = []
        self._cond = threading.Condition()
        self._callbacks: list[Callable[[SaveInfo], None]] = []
        self._rules_checked = False
        self._failed: list[SaveHandle] = []
        self._trackers: list = []
        self._closed = False
        self._pid = os.getpid()
        lifecycle.register(self)

    # -- public API ---------------------------------------------------------------------------
    def save(self, state: Any, path: PathLike, storage_options: dict | None = None) -> SaveHandle:
        """Snapshot ``state`` and write it to ``path`` in the background; returns at once after the copy.

        Raises a pending background error from an earlier save first (once). With
        ``saving.asynchronous = False`` the save is committed before this returns."""
        self._check_open()
        self._raise_pending_error()
        started = time.perf_counter()
        store, name = self._store(path, storage_options)
        if self._process is not None:
            check_store(store)
        handle = SaveHandle(store.url(name))
        self._slots.acquire()
        try:
            dirstate = self._dirstate(store)
            self._wait_streams(dirstate)
            snap = take_snapshot(state, dirstate, self._pool, self._copier, self._budget, self.config,
                                 tuple(self._trackers))
        except BaseException:
            self._slots.release()
            raise
        job = _Job(snap, store, name, handle, dirstate, started, time.perf_counter() - started)
        dirstate.last = handle
        with self._cond:
            self._inflight.append(handle)
        inflight.begin(handle.path)
        if self.config.saving.asynchronous:
            lifecycle.install_sigterm(self.config.saving.sigterm_grace_seconds)
            with self._cond:  # atomic with the coordinator's check for an empty queue before it ends
                self._ensure_thread()
                self._queue.put(job)
        else:
            with self._new_workers() as workers:
                self._run(job, workers)
            self._release_if_idle()
            handle.result()
        return handle

    def load(self, path: PathLike, map_location: Any = None, weights_only: bool = True,
             storage_options: dict | None = None) -> Any:
        """Load the checkpoint at ``path`` (waits for a pending save to it). Tensors are verified.

        ``weights_only=True`` refuses values that need pickle unless their type is allow-listed.
        The next save to the same directory is incremental against what was loaded."""
        self._check_open()
        store, name = self._store(path, storage_options)
        self._wait_path(store.url(name))
        manifest = self._read_manifest(store, name)
        state, loaded = load_manifest_state(store, name, manifest, map_location=map_location,
                                            weights_only=weights_only, config=self.config,
                                            keep_copy=lambda rec, flat: self._wants_stream(rec, flat, map_location))
        self._adopt_loaded(store, manifest, loaded)
        self._release_if_idle()
        return state

    def remove(self, path: PathLike, storage_options: dict | None = None) -> None:
        """Delete the checkpoint's manifest (waits for a pending save to it). Its blobs that no other
        manifest references go in the background step of the next save committed in the directory
        (``retention.gc_after_save``), or at ``gc(directory, full=False)``."""
        self._check_open()
        store, name = self._store(path, storage_options)
        self._wait_path(store.url(name))
        state = self._dirstate(store)
        try:  # its blobs are the candidates of the next collection here
            state.pending.update((b.key, b.size) for b in read_manifest(store, name, self.config).blobs())
        except CheckpointNotFoundError:
            pass
        except CheckrunError:  # unreadable: its blobs are unknown, the next collection here lists them
            state.full_due = True
        store.delete_manifest(name)

    def latest(self, directory: PathLike, storage_options: dict | None = None, verify: bool = True) -> str | None:
        """Newest committed checkpoint in ``directory`` that verifies, or None.

        ``verify=True`` checks every blob's checksum (reads the checkpoint once); ``verify=False``
        only checks that every blob exists with its size. A bad candidate is skipped with a warning
        naming it, and the next older one is tried."""
        self._check_open()
        store = self._dir_store(directory, storage_options)
        self._wait_dir(store)
        sizes = None
        for entry in reversed(list_checkpoints(store, self.config)):
            if entry.manifest is None:
                log.warning("checkrun: skipping corrupt checkpoint %s: %s", entry.url, entry.error)
                continue
            if verify:
                report = verify_manifest(store, entry.name, self.config, decode=False)
                problems = report.problems
            else:
                sizes = sizes if sizes is not None else {b.key: b.size for b in store.list_blobs()}
                problems = [f"missing or truncated blob {store.blob_path(b.key)}"
                            for b in entry.manifest.blobs() if sizes.get(b.key) != b.size]
            if problems:
                log.warning("checkrun: skipping checkpoint %s: %s", entry.url, problems[0])
                continue
            return entry.url
        return None

    def verify(self, path: PathLike, storage_options: dict | None = None, decode: bool = True,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Check the manifest and every blob (size, checksum, and decoding unless ``decode=False``)."""
        self._check_open()
        store, name = self._store(path, storage_options)
        self._wait_path(store.url(name))
        return verify_manifest(store, name, self.config, decode=decode, progress=progress)

    def gc(self, directory: PathLike, grace_seconds: float | None = None, dry_run: bool = False,
           storage_options: dict | None = None, full: bool = True) -> GCReport:
        """Delete blobs in ``directory`` that no manifest references and no live lease protects.

        ``full=False``: only the blobs of checkpoints this engine removed there and of dead writers'
        leases (no listing of the blobs). ``grace_seconds``: also keep unreferenced blobs younger than
        this (default 0; ``retention.gc_grace_seconds`` where no lease-aware writer ever wrote)."""
        self._check_open()
        store = self._dir_store(directory, storage_options)
        if full:  # a full collection reports on settled saves; leases protect those in flight anyway
            self._wait_dir(store)
        state = self._dirstate(store)
        return self._collect(store, grace_seconds, dry_run, None if full else dict(state.pending))

    def list(self, directory: PathLike, storage_options: dict | None = None) -> list[CheckpointEntry]:
        """Every checkrun checkpoint in ``directory`` (oldest first), corrupt ones with their error."""
        self._check_open()
        return list_checkpoints(self._dir_store(directory, storage_options), self.config)

    def read_manifest(self, path: PathLike, storage_options: dict | None = None) -> Manifest:
        """The parsed, validated manifest of a checkpoint (no blob is read)."""
        store, name = self._store(path, storage_options)
        return read_manifest(store, name, self.config)

    def track(self, tracker: "EmbeddingTracker") -> "EmbeddingTracker":
        """Use an ``EmbeddingTracker`` so saves copy only looked-up rows of its tables."""
        self._trackers.append(tracker)
        return tracker

    def add_callback(self, fn: Callable[[SaveInfo], None]) -> None:
        """Call ``fn(info)`` on the background thread after each committed save (adapter metrics)."""
        self._callbacks.append(fn)

    def wait(self) -> None:
        """Block until every pending save is durable and the engine's threads have ended; raise a
        background error not yet surfaced."""
        if self._forked():
            return
        self._wait_idle()
        self._raise_pending_error()

    def close(self) -> None:
        """Wait for pending saves, then release threads and buffers. Idempotent.

        In a forked child (a DataLoader worker) the engine belongs to the parent: ``close`` only
        marks it closed, never waiting for the parent's saves nor touching shared resources."""
        if self._closed:
            return
        if self._forked():
            self._closed = True
            return
        try:
            self._wait_idle()
        finally:
            self._closed = True
            with self._cond:
                if self._thread is not None:  # interrupted while waiting: end after the queued saves
                    self._queue.put(None)
            self._wait_idle()
            self._copier.close()
            if self._process is not None:
                self._process.close()
            for store in self._stores.values():
                store.close()
            self._pool.clear()
            self._dirs.clear()
            lifecycle.unregister(self)
        self._raise_pending_error()

    @property
    def pending(self) -> int:
        """Number of saves not yet committed or failed (0 in a forked child: they are the parent's)."""
        if self._forked():
            return 0
        with self._cond:
            return len(self._inflight)

    @property
    def staging(self) -> BufferPool:
        """The staging buffer pool (its ``allocations`` counter shows buffer reuse)."""
        return self._pool

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckrunError as err:  # never mask the user's own exception
            log.error("checkrun: background save error while handling another exception: %s", err)

    def __getstate__(self):
        raise TypeError("CheckpointEngine holds threads and cannot be pickled; pickle its config instead")

    # -- internals ----------------------------------------------------------------------------
    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _check_open(self) -> None:
        if self._forked():
            raise CheckrunError(f"this CheckpointEngine belongs to process {self._pid}; a forked child "
                                f"(pid {os.getpid()}) cannot use it: create an engine in the child")
        if self._closed:
            raise CheckrunError("this CheckpointEngine is closed")

    def _read_manifest(self, store: Store, name: str) -> Manifest:
        try:
            return read_manifest(store, name, self.config)
        except CheckpointNotFoundError as exc:
            hint = self._directory_hint(store, name)
            if hint is None:
                raise
            raise CheckpointNotFoundError(f"{exc}: {hint}") from exc

    def _directory_hint(self, store: Store, name: str) -> str | None:
        """Why a load of a directory failed, in words: how many checkpoints it holds, the newest."""
        sub = store.subdirectory(name)
        try:
            if not sub.is_directory():
                return None
            entries = [e for e in list_checkpoints(sub, self.config) if e.manifest is not None]
        except CheckrunError:
            return None
        if not entries:
            return "it is a directory that holds no committed checkpoint"
        return (f"it is a directory of {len(entries)} checkpoint(s); the newest is {entries[-1].url} "
                "(load a file, e.g. engine.load(engine.latest(directory)))")

    def _store(self, path: PathLike | None, storage_options: dict | None) -> tuple[Store, str]:
        if path is None:
            raise CheckpointNotFoundError(
                "no checkpoint path given (None); latest(directory) returns None when the directory holds "
                "no committed checkpoint: start from scratch or check the directory")
        store, name = Store.for_path(path, storage_options, self.config.storage)
        return self._stores.setdefault((store.url(""), _opts_key(storage_options)), store), name

    def _dir_store(self, directory: PathLike, storage_options: dict | None) -> Store:
        store = Store.for_directory(directory, storage_options, self.config.storage)
        return self._stores.setdefault((store.url(""), _opts_key(storage_options)), store)

    def _dirstate(self, store: Store) -> DirState:
        return self._dirs.setdefault((store.url(""),), DirState())

    def _wait_streams(self, dirstate: DirState) -> None:
        """Row streams own one buffer each: the previous save to the directory must be done first."""
        if dirstate.streams and dirstate.last is not None:
            dirstate.last.wait()

    @staticmethod
    def _wait_path(url: str) -> None:
        """Wait for a save to ``url`` by any engine of this process (DESIGN: load/remove of a path
        wait for a save to it in flight anywhere in this process)."""
        inflight.wait(url)

    @staticmethod
    def _wait_dir(store: Store) -> None:
        prefix = store.url("")
        inflight.wait_under(prefix.rstrip("/") + "/")

    def _ensure_thread(self) -> None:
        """Start the coordinator (training thread, under ``_cond``) with its workers already running:
        no thread starts in the background while training goes on (see ``_loop``)."""
        if self._thread is None:
            workers = self._new_workers()
            for _ in range(self.config.saving.workers):
                workers.submit(int)  # each submit with no idle worker starts one, here
            self._thread = threading.Thread(target=self._loop, args=(workers,), name="checkrun-coordinator",
                                            daemon=True)
            self._thread.start()

    def _new_workers(self) -> ThreadPoolExecutor:
        sc = self.config.saving
        return ThreadPoolExecutor(sc.workers, thread_name_prefix="checkrun-worker",
                                  initializer=lifecycle.lower_thread_priority, initargs=(sc.thread_nice,))

    def _loop(self, workers: ThreadPoolExecutor) -> None:
        """Coordinator: runs the queued saves. It ends, with its workers, the snapshot's copy helper
        and the idle storage pools, when ``wait``/``close`` ask (a sentinel) or after
        ``IDLE_SECONDS`` without a save: an idle engine holds no thread, yet training that saves
        often does not start and end threads at every save (a fork racing a thread's start or end
        can deadlock the child in CPython 3.11, and DataLoader workers fork every epoch)."""
        lifecycle.lower_thread_priority(self.config.saving.thread_nice)
        with workers:
            while True:
                try:
                    job = self._queue.get(timeout=IDLE_SECONDS)
                except queue.Empty:
                    job = None
                if job is not None:
                    self._run(job, workers)
                    continue
                with self._cond:
                    if not self._queue.empty():  # a save came in meanwhile (queued under _cond)
                        continue
                    self._thread = None
                    self._retired = [t for t in self._retired if t.is_alive()]
                    self._retired.append(threading.current_thread())
                    lifecycle.retiring(threading.current_thread())  # a fork waits for our end
                    self._cond.notify_all()
                    break
        self._release_idle()

    def _wait_idle(self) -> None:
        """Wait until no save is pending, then end the coordinator and join it."""
        with self._cond:
            self._cond.wait_for(lambda: not self._inflight)
            if self._thread is not None:
                self._queue.put(None)
            self._cond.wait_for(lambda: self._thread is None)
            retired, self._retired = self._retired, []
        for thread in retired:
            if thread is not threading.current_thread():
                thread.join()

    def _release_if_idle(self) -> None:
        """Training thread, after a sync save or a load: stop the idle threads unless a coordinator
        runs (it stops them itself when it goes idle, off the training thread: a join there waits
        for the GIL behind the background threads, ~10 ms per save measured)."""
        with self._cond:
            busy = self._thread is not None
        if not busy:
            self._release_idle()

    def _release_idle(self) -> None:
        """Stop the snapshot's copy helper and the storage pools that no call is using."""
        self._copier.close()
        for store in list(self._stores.values()):
            store.release_idle()

    def _run(self, job: _Job, workers: ThreadPoolExecutor) -> None:
        """Background part of one save; never raises (errors go to the handle)."""
        info, error = None, None
        try:
            t0 = time.perf_counter()
            try:
                if self._process is not None:
                    done = self._process.commit(job.snap, job.store, job.name)
                else:
                    done = write_and_commit(job.snap, job.store, job.name, job.dir, self.config,
                                            self._matcher, workers)
            finally:
                self._release_staging(job.snap)
            commit_streams(job.snap, done, self.config.incremental.max_chain)
            info = self._info(job, done, time.perf_counter() - t0)
            self._after_commit(job, info, done.unmatched_rules)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the handle/next call
            job.dir.invalidate()
            error = exc
            log.error("checkrun: save to %s failed: %s", job.handle.path, exc)
        finally:
            job.handle._finish(info, error)
            with self._cond:
                if error is not None:
                    self._failed.append(job.handle)
                self._inflight.remove(job.handle)
                self._cond.notify_all()
            inflight.end(job.handle.path)
            self._slots.release()

    def _release_staging(self, snap: Snapshot) -> None:
        for st in snap.tensors:
            if st.stream is None:
                self._pool.give(st.data)
        self._budget.release(snap.charged)

    def _info(self, job: _Job, done: Committed, background: float) -> SaveInfo:
        stats = done.stats
        return SaveInfo(
            path=job.handle.path, tensor_bytes=stats["tensor_bytes"],
            written_bytes=stats["written_bytes"] + done.manifest_bytes, stored_bytes=stats["stored_bytes"],
            blocking_seconds=job.blocking, background_seconds=background,
            total_seconds=time.perf_counter() - job.started, new_blobs=done.new_blobs,
            reused_blobs=done.reused_blobs, chain_depth=stats["chain_depth"],
            quantized_tensors=done.quantized_tensors, quantization_saved_bytes=done.quantization_saved_bytes)

    def _after_commit(self, job: _Job, info: SaveInfo, unmatched_rules: tuple) -> None:
        log.info("checkrun: saved %s: %.1f MB of tensors, wrote %.1f MB (%.1f%%), ratio %.2fx, "
                 "blocked %.3f s, background %.2f s", info.path, info.tensor_bytes / 1e6,
                 info.written_bytes / 1e6, 100 * info.write_ratio, info.compression_ratio,
                 info.blocking_seconds, info.background_seconds)
        if not self._rules_checked:  # once, after the first committed save has seen every tensor
            self._rules_checked = True
            for rule in unmatched_rules:
                warnings.warn(f"checkrun: quantization rule {rule.pattern!r} ({rule.method}) matched no tensor "
                              f"of {info.path}; check its pattern, dtype and min_numel against the keys "
                              "`checkrun inspect` lists", UserWarning, stacklevel=2)
        for fn in self._callbacks:
            try:
                fn(info)
            except Exception:  # a metrics callback must not fail a committed save
                log.exception("checkrun: save callback failed")
        try:
            self._retain(job.store, job.name, job.dir)
        except CheckrunError as exc:
            log.warning("checkrun: retention/gc after saving %s failed: %s", info.path, exc)

    def _retain(self, store: Store, name: str, state: DirState) -> None:
        """Retention, then collection of what it (or ``remove``, or failed saves) made garbage: the
        candidates only, without listing the blobs (unless it finds that a writer died here: then
        everything, see ``collect_garbage``)."""
        removed = apply_retention(store, self.config, keep={name})
        if not self.config.retention.gc_after_save:
            return
        candidates = {**state.pending, **blob_sizes(removed)}
        if state.full_due:
            self._collect(store, None, False, None)
        elif candidates or state.leases_seen:
            self._collect(store, None, False, candidates)

    def _collect(self, store: Store, grace_seconds: float | None, dry_run: bool,
                 candidates: dict[str, int] | None) -> GCReport:
        state = self._dirstate(store)
        report = collect_garbage(store, self.config, grace_seconds=grace_seconds, dry_run=dry_run,
                                 candidates=candidates)
        if not dry_run and not report.problems:
            state.pending = dict(report.pending)
            state.full_due = state.full_due and candidates is not None
            state.leases_seen = report.leases > 0
        if not dry_run:
            state.forget(list(report.deleted))
        if self._process is not None and not dry_run:
            self._process.forget(store, list(report.deleted))
        return report

    def _raise_pending_error(self) -> None:
        with self._cond:
            failed, self._failed = self._failed, []
        for handle in failed:
            err = handle.take_error()
            if err is None:
                continue
            wrapped = BackgroundSaveError(f"checkpoint save to {handle.path} failed: {err}")
            wrapped.__cause__ = err
            if sys.exc_info()[1] is not None:  # never replace an exception being handled
                log.error("checkrun: %s", wrapped)
                continue
            raise wrapped

    def _wants_stream(self, rec, flat: torch.Tensor, map_location: Any = None) -> bool:
        """Whether a loaded tensor becomes a row stream (which needs its own host copy of the values).

        Only where row deltas will really apply: saved from the CPU and loaded onto the CPU (a GPU
        job resuming with ``map_location="cpu"`` saves from the GPU again, where row deltas never
        apply, so a host copy of model + optimizer state would only double its host memory)."""
        if rec.quant or rec.device != "cpu" or not row_eligible(rec.key, flat.view(rec.shape),
                                                                 self.config.incremental):
            return False
        if callable(map_location):  # never call the user's function more than the load does
            return False
        try:
            return map_location_tensor(flat[:0], rec.device, map_location).device.type == "cpu"
        except Exception:  # noqa: BLE001 - a map_location we cannot probe: no stream, no copy
            return False

    def _adopt_loaded(self, store: Store, manifest: Manifest, loaded) -> None:
        """Remember a loaded checkpoint so the next save to its directory is incremental."""
        state = self._dirstate(store)
        state.adopt_verified(manifest.blobs())  # the load checked every blob: no read to reuse them
        if self._process is not None:
            self._process.adopt(store, list(manifest.blobs()), [lt.record for lt in loaded])
        for lt in loaded:
            rec = lt.record
            state.records[rec.key] = rec
            if lt.copy is None:
                continue
            buffer = self._pool.host_copy(lt.copy)
            stream = RowStream(buffer, buffer.dtype, tuple(rec.shape), valid=True, record=rec)
            mask = torch.zeros(rec.shape[0], dtype=torch.bool)
            for idx in lt.delta_indices:
                mask[idx] = True
            stream.cum_mask = mask
            stream.saves_since_base = len(rec.deltas)
            stream.spec_id = _spec_id(rec)
            state.streams[rec.key] = stream


def _spec_id(rec) -> str:
    from .codecs import Pipeline

    return Pipeline.from_list(list(rec.codecs)).spec_id


def _opts_key(opts: dict | None) -> str:
    return repr(sorted((opts or {}).items()))


def save(state: Any, path: PathLike, *, config: EngineConfig | dict | PathLike | None = None,
         storage_options: dict | None = None) -> SaveInfo:
    """Save ``state`` to ``path`` and wait for the commit (a one-call convenience)."""
    with CheckpointEngine(config) as engine:
        return engine.save(state, path, storage_options=storage_options).result()


def load(path: PathLike, *, map_location: Any = None, weights_only: bool = True,
         config: EngineConfig | dict | PathLike | None = None, storage_options: dict | None = None) -> Any:
    """Load the checkpoint at ``path`` (a one-call convenience)."""
    with CheckpointEngine(config) as engine:
        return engine.load(path, map_location=map_location, weights_only=weights_only,
                           storage_options=storage_options)


__all__ = ["CheckpointEngine", "save", "load"]
