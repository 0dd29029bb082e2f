"""CheckpointEngine: the public entry point of checkrun, a facade over the stage packages.

Threads: ``save`` may be called from several threads (a lock serialises saves and ``close``: snapshots share the
copier and the row streams; h158); the rest from one. ``save`` takes the snapshot here (``saving.capture``), hands the
rest to the engine's ``saving.coordinator.Coordinator``: one coordinator thread runs each save's background part
in submission order (saves to one path commit in order), fanning chunk work out to ``saving.workers`` threads, or
hands it to the writer process (``saving.background: process``); after each commit it runs ``retain.after_commit``.
An idle engine holds no thread (the coordinator and its workers end once no save is queued, ``wait`` after they
have). ``load`` leaves the directory's incremental state ready for the next save (``streams.adopt_loaded``)."""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

from .saving import inflight, lifecycle
from .saving.capture import take_snapshot
from .saving.fence import CommitStamp, new_stamp, observe
from .saving.repeat import repeat_snapshot
from .config import EngineConfig, coerce_config
from .errors import CheckpointNotFoundError, CheckrunError
from .saving.coordinator import Coordinator, Job
from .saving.handles import SaveHandle, SaveInfo, pending_error
from .format.manifest import Manifest
from .saving.quant_rules import RuleMatcher
from .loading.references import ReferenceBuild, supersede
from .loading.reader import (VerifyCache, VerifyReport, load_manifest_state, map_location_tensor, read_manifest,
                             require_readable, verify_manifest)
from .retain import collect, note_removed
from .retain.retention import CheckpointEntry as Entry, GCReport, list_checkpoints
from .saving.staging import BufferPool, Copier, MemoryBudget
from .storage.paths import blob_url, refuse_directory
from .storage.store import Store
from .saving.streams import DirState, adopt_loaded, dense_keys, drop_streams, keep_recent_streams, wants_stream
from .saving.tracking import EmbeddingTracker
from .saving.process import WriterProcess, check_store

import torch

log = logging.getLogger("ckpt_core")
PathLike = str | os.PathLike


class CheckpointEngine:
    """Asynchronous, incremental, optionally quantized checkpoints on any fsspec storage. Use as a
    context manager or call ``close()``; a forgotten engine is flushed at interpreter exit."""

    def __init__(self, config: EngineConfig | dict | PathLike | None = None) -> None:
        self.config = coerce_config(config)
        sc = self.config.saving
        self._process = WriterProcess(self.config) if sc.background == "process" else None
        budget = MemoryBudget(sc.staging_budget_bytes)  # the pool keeps within it too
        self._pool = BufferPool(pin_memory=sc.pin_memory, shared=self._process and self._process.shared, budget=budget)
        self._copier = Copier()
        self._dirs: dict[tuple, DirState] = {}
        self._stores: dict[tuple, Store] = {}
        self._callbacks: list[Callable[[SaveInfo], None]] = []
        self._coord = Coordinator(self.config, self._process, RuleMatcher(self.config.quantization), self._pool,
                                  budget, self._copier, self._stores, self._callbacks)
        self._trackers: list = []
        self._closed, self._closing, self._pid, self._saving = False, None, os.getpid(), threading.RLock()
        lifecycle.register(self)

    # -- public API ---------------------------------------------------------------------------
    def save(self, state: Any, path: PathLike, storage_options: dict | None = None, *,
             stamp: CommitStamp | None = None) -> SaveHandle:
        """Snapshot ``state`` and write it to ``path`` in the background; returns at once after the copy.
        Raises the error of an earlier failed save (once; also one that failed while this one waited for
        its slot). ``saving.asynchronous = False``: committed before this returns. ``stamp``: the commit stamp
        ordering saves of one name (``saving.fence``; default: now); an adapter passes ``new_stamp()`` of its ask."""
        self._check_open()  # before the lock: a forked child's copy of it may be held forever (h159)
        with self._saving:  # threads saving at once shared the copier and row streams: wrong values (h158)
            return self._save(state, path, storage_options, stamp)

    def _save(self, state: Any, path: PathLike, storage_options: dict | None, stamp: CommitStamp | None) -> SaveHandle:
        self._check_open()
        self._raise_pending_error()
        started, stamp = time.perf_counter(), stamp or new_stamp()  # stamped when asked for, not after waiting
        store, name = self._store(path, storage_options)
        refuse_directory(store, name)
        if self._process is not None:
            check_store(store)
        handle = SaveHandle(store.url(name))
        dirstate = self._dirstate(store)
        keep_recent_streams(self._dirs.values(), dirstate, self._pool.free_host)
        snap = repeat_snapshot(state, dirstate, self._coord, self._copier, stamp, self.config)
        slot = snap is None
        if slot:
            self._coord.acquire_slot()
            try:
                self._adopt_rebuilds(dirstate)
                if dirstate.streams and dirstate.last is not None:  # row streams own one buffer each:
                    dirstate.last.wait()  # the previous save to the directory must be done first
                self._raise_pending_error()  # a save it waited for (a slot, that one) failed: raised now, not later
                snap = take_snapshot(state, dirstate, self._pool, self._copier, self._budget, self.config,
                                     tuple(self._trackers), stamp)
            except BaseException:
                self._coord.release_slot()
                raise
        job = Job(snap, store, name, handle, dirstate, started, time.perf_counter() - started, slot, self,
                  None if slot else dirstate.leader[0])  # a repeat's leader (replaced below)
        dirstate.last, dirstate.leader = handle, (handle, weakref.ref(snap))  # the job owns the snapshot
        for steplog in getattr(self, "_steplogs", ()):  # engine.step_log: mark this save's position
            steplog.on_save(store, name, snap.stamp, handle)
        asynchronous = self.config.saving.asynchronous
        if asynchronous:
            lifecycle.install_sigterm(self.config.saving.sigterm_grace_seconds)
        self._coord.submit(job, asynchronous)
        if not asynchronous:
            handle.result()
        return handle

    def load(self, path: PathLike, map_location: Any = None, weights_only: bool | None = None,
             storage_options: dict | None = None, into: Any = None) -> Any:
        """Load the checkpoint at ``path`` (waits for a pending save to it). Tensors are verified.
        ``weights_only=True`` (or None, unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load's rule)
        refuses values that need pickle unless their type is allow-listed. The next save to the same
        directory is incremental against what was loaded. ``into``: a structure shaped like the checkpoint
        (``{"model": model.state_dict(), ...}``): each CPU tensor of it at the path of a stored tensor, with
        its shape and dtype, receives the values in place and is the leaf returned; any other leaf loads as
        without ``into``. A failed load may leave those partly overwritten: load again. See docs/ENGINE_API.md."""
        self._check_open()
        store, name = self._store(path, storage_options, follow_link=True)
        self._wait_path(store.url(name))
        since, manifest = time.time(), self._read_manifest(store, name)  # since: blobs read as of then
        observe(manifest.commit)  # this process's next checkpoints are newer than the one it loaded
        incremental, dense = self.config.incremental, dense_keys(manifest.meta)
        mode = self.config.load.reference
        later: list[int] | None = [] if mode == "background" or (mode == "auto" and store.is_local) else None

        def keep_copy(rec, flat, live) -> bool:  # ckpt_core.load's one-shot engine saves nothing after
            return getattr(self, "_keep_loaded", True) and wants_stream(
                rec, flat, incremental, lambda: live or _lands_on_cpu(flat, rec.device, map_location), dense)

        state, loaded = load_manifest_state(store, name, manifest, map_location=map_location,
                                            weights_only=weights_only, config=self.config, keep_copy=keep_copy,
                                            alloc_copy=self._pool.copy_allocator(), into=into, deferred=later)
        if self._process is not None:
            self._process.adopt(store, list(manifest.blobs()), [lt.record for lt in loaded], since)
        dirstate = self._dirstate(store)
        adopt_loaded(dirstate, manifest.blobs(), loaded, self._pool.host_copy, self._pool.free_host, since)
        if later:  # load.reference: the copies the next row-delta save compares against, made now in the background
            keys = [manifest.tensors[i].key for i in later]
            drop_streams(dirstate, keys, self._pool.free_host)
            dirstate.rebuilds = supersede(dirstate.rebuilds, keys, self._pool.free_host)
            dirstate.rebuilds.append(ReferenceBuild(store, manifest, store.url(name), later, self._pool.new_host,
                                                    self.config.load.max_total_bytes))
        self._coord.release_if_idle()
        return state

    def remove(self, path: PathLike, storage_options: dict | None = None, *, wait: bool = True) -> None:
        """Delete the checkpoint's manifest (waits for a pending save to it; ``wait=False``: not, e.g. from a
        ``SaveHandle`` done-callback on the engine's thread). Its blobs that no other manifest references go in
        the background step of the next save committed there (``retention.gc_after_save``), or at ``gc``."""
        self._check_open()
        store, name = self._store(path, storage_options)
        if wait:
            self._wait_path(store.url(name))
        note_removed(self._dirstate(store), lambda: read_manifest(store, name, self.config).blobs())
        store.delete_manifest(name)

    def latest(self, directory: PathLike, storage_options: dict | None = None, verify: bool = True) -> str | None:
        """Newest committed checkpoint in ``directory`` that verifies, or None. ``verify=True`` checks
        every blob's checksum (reads it once), ``False`` each blob's size. A corrupt candidate is skipped
        with a warning naming it; one the storage fails to return raises ``StorageError``."""
        self._check_open()
        self._wait_dir(store := self._dir_store(directory, storage_options))
        sizes, entries = None, list_checkpoints(store, self.config, heads=True)
        outages = [e for e in entries if e.error is not None and e.unreadable]
        for entry in reversed(entries):  # each parsed when tried
            if entry.error is not None:
                require_readable(entry.unreadable, entry.url, entry.error)
                log.warning("checkrun: skipping corrupt checkpoint %s: %s", entry.url, entry.error)
                continue
            report = verify_manifest(store, entry.name, self.config, decode=False, blobs=verify)
            problems = report.problems
            require_readable(report.unreadable, entry.url, problems[0] if problems else "")
            if not verify and not problems:
                sizes = sizes if sizes is not None else {b.key: b.size if b.sized else -1 for b in store.list_blobs()}
                problems = [f"missing or truncated blob {blob_url(store, b.key)}"  # -1: size unknown (http)
                            for b in report.manifest.blobs() if sizes.get(b.key) not in (b.size, -1)]
            if problems:
                log.warning("checkrun: skipping checkpoint %s: %s", entry.url, problems[0])
                continue
            for late in (u for u in outages if u.mtime >= entry.mtime):  # an unreadable one written after it (the
                require_readable(True, late.url, late.error)  # files' clock) may be newer than its commit time says
            return entry.url
        return None

    def verify(self, path: PathLike, storage_options: dict | None = None, decode: bool = True,
               progress: Callable[[int], None] | None = None, cache: VerifyCache | None = None) -> VerifyReport:
        """Check the manifest and every blob (size, checksum, decoding unless ``decode=False``), not ``cache``'s."""
        self._check_open()
        store, name = self._store(path, storage_options, follow_link=True)
        self._wait_path(store.url(name))
        return verify_manifest(store, name, self.config, decode=decode, progress=progress, cache=cache)

    def gc(self, directory: PathLike, grace_seconds: float | None = None, dry_run: bool = False,
           storage_options: dict | None = None, full: bool = True, removed: Iterable[str] = ()) -> GCReport:
        """Delete blobs in ``directory`` that no manifest references and no live lease protects. ``full=False``: only
        the blobs of checkpoints this engine removed there and of dead writers' leases (no listing of the blobs).
        ``grace_seconds``: also keep unreferenced blobs younger than this (default 0; ``retention.gc_grace_seconds``
        where no lease-aware writer ever wrote). ``removed``: manifest names a ``dry_run`` counts as deleted."""
        self._check_open()
        store = self._dir_store(directory, storage_options)
        if full:  # a full collection reports on settled saves; leases protect those in flight anyway
            self._wait_dir(store)
        state = self._dirstate(store)
        try:  # then the store's io threads go (Lightning removing a .temp.ckpt left 4: an independent check)
            return collect(store, self.config, memory=state, grace_seconds=grace_seconds, dry_run=dry_run,
                           candidates=None if full else dict(state.pending), forget=self._coord.forget_blobs(store),
                           removed=frozenset(removed) if dry_run else frozenset())
        finally:
            self._coord.release_if_idle()

    def list(self, directory: PathLike, storage_options: dict | None = None, heads: bool = False) -> list[Entry]:
        """Every checkrun checkpoint in ``directory`` (oldest first), corrupt ones with their error; ``heads``:
        intact ones unparsed (``manifest`` None, ``head`` set: ``read_manifest`` each)."""
        self._check_open()
        return list_checkpoints(self._dir_store(directory, storage_options), self.config, heads=heads)

    def read_manifest(self, path: PathLike, storage_options: dict | None = None) -> Manifest:
        """The parsed, validated manifest of a checkpoint (no blob is read)."""
        store, name = self._store(path, storage_options, follow_link=True)
        return read_manifest(store, name, self.config)

    def track(self, tracker: "EmbeddingTracker") -> "EmbeddingTracker":
        """Use an ``EmbeddingTracker`` so saves copy only looked-up rows of its tables."""
        self._trackers.append(tracker)
        return tracker

    def add_callback(self, fn: Callable[[SaveInfo], None]) -> None:
        """Call ``fn(info)`` on the background thread after each committed save (adapter metrics)."""
        self._callbacks.append(fn)

    def wait(self) -> None:
        """Block until every pending save is durable and the engine's threads have ended; raise a background error."""
        if self._forked():
            return
        for build in [b for dirstate in list(self._dirs.values()) for b in dirstate.rebuilds]:
            build.join()
        self._coord.wait_idle()
        self._raise_pending_error()

    def close(self) -> None:
        """Close the step logs (flushed), wait for pending saves, then release threads and buffers. Idempotent.

        In a forked child (a DataLoader worker) the engine belongs to the parent: ``close`` only
        marks it closed, never waiting for the parent's saves nor touching shared resources."""
        if self._closed or self._forked():
            self._closed = True
            return
        from .steplog.api import close_logs
        failed_logs: list[BaseException] = []
        try:
            with self._saving:  # a save of another thread (waiting for its slot) gets its snapshot first (h158);
                self._closing = threading.get_ident()  # then only this thread and commit callbacks save (h161)
            failed_logs = close_logs(self)  # every log flushed, its threads ended, even after one failed
            self._coord.wait_idle()  # (no lock held: a commit callback may save elsewhere meanwhile: h159)
        finally:
            with self._saving:  # no save starts after this one; a ^C above still ends the queued saves (h159)
                done, self._closed = self._closed, True
            if not done:  # (another thread's close did the rest)
                for dirstate in self._dirs.values():  # no thread reads a store after it is closed
                    self._adopt_rebuilds(dirstate, install=False)
                self._coord.stop_after_queued()  # interrupted while waiting: end after the queued saves
                self._coord.wait_idle()
                self._copier.close()
                if self._process is not None:
                    self._process.close()
                for store in self._stores.values():
                    store.close()
                self._pool.clear()
                self._dirs.clear()
                lifecycle.unregister(self)
        self._raise_pending_error(failed_logs)

    @property
    def pending(self) -> int:
        """Number of saves not yet committed or failed (0 in a forked child: they are the parent's)."""
        return 0 if self._forked() else self._coord.pending

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

    @property
    def _budget(self) -> MemoryBudget:
        """The staging memory budget (the coordinator refunds it after each write)."""
        return self._coord.budget

    @_budget.setter
    def _budget(self, budget: MemoryBudget) -> None:  # tests put a probing budget in its place
        self._coord.budget = budget

    def __getstate__(self):
        raise TypeError("CheckpointEngine holds threads and cannot be pickled; pickle its config instead")

    # -- internals ----------------------------------------------------------------------------
    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _check_open(self) -> None:
        if self._forked():
            raise CheckrunError(f"this CheckpointEngine belongs to process {self._pid}; a forked child "
                                f"(pid {os.getpid()}) cannot use it: create an engine in the child")
        me = threading.get_ident()  # closing: only the closer's thread and commit callbacks (coordinator) go on
        if self._closed or self._closing not in (None, me) and me != getattr(self._coord._thread, "ident", 0):
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

    def _store(self, path: PathLike | None, storage_options: dict | None, follow_link=False) -> tuple[Store, str]:
        if path is None:
            raise CheckpointNotFoundError(
                "no checkpoint path given (None); latest(directory) returns None when the directory holds "
                "no committed checkpoint: start from scratch or check the directory")
        store, name = Store.for_path(path, storage_options, self.config.storage, follow_link)
        return self._stores.setdefault(store.cache_key, store), name

    def _dir_store(self, directory: PathLike, storage_options: dict | None) -> Store:
        store = Store.for_directory(directory, storage_options, self.config.storage)
        return self._stores.setdefault(store.cache_key, store)

    def _dirstate(self, store: Store) -> DirState:
        # Keyed like the store: the same URL through other options (another endpoint) may be another
        # store, whose blobs this directory's index and row streams must not assume.
        return self._dirs.setdefault(store.cache_key, DirState())

    def _adopt_rebuilds(self, dirstate: DirState, install: bool = True) -> None:
        """Wait for the references loads rebuild (``load.reference``); make them the row streams (or drop them)."""
        builds, dirstate.rebuilds = dirstate.rebuilds, []
        for build in builds if not install else ():
            build.cancel()  # the engine closes: a script that exits after a load does not wait for it
        for build in builds:
            loaded = build.result(quiet=not install)
            if loaded is not None and install:
                adopt_loaded(dirstate, (), loaded, lambda t: t, self._pool.free_host)
                continue
            drop_streams(dirstate, build.keys, self._pool.free_host)
            if loaded is None:  # failed: release what it allocated; what it read is checked before reuse
                for buf in build.buffers:
                    self._pool.free_host(buf)
                for key in build.blob_keys:
                    dirstate.distrust(key)

    @staticmethod
    def _wait_path(url: str) -> None:
        """Wait for a save to ``url`` by any engine of this process (DESIGN: load/remove of a path wait for it)."""
        inflight.wait(url)

    @staticmethod
    def _wait_dir(store: Store) -> None:
        inflight.wait_under(store.url("").rstrip("/") + "/")

    def _raise_pending_error(self, also: list[BaseException] = ()) -> None:
        err = pending_error([(h.path, e) for h in self._coord.take_failed() if (e := h.take_error()) is not None], also)
        if err is not None:
            raise err  # also inside an except block (chained): logging it there lost it (retry code)

    def step_log(self, directory: PathLike, optimizer: Any, scheduler: Any = None,
                 storage_options: dict | None = None, *, scaler: Any = None, model: Any = None,
                 counters: Callable[[], dict[str, int]] | None = None) -> Any:
        """Log every ``optimizer.step()`` (and ``scheduler.step()``, ``scaler``'s state: a ``GradScaler``,
        and what ``counters()`` returns: the loop's own counters) into ``directory``'s step log; saves by
        this engine into ``directory`` mark their position in it. ``model``: its running statistics are
        logged with each step; it names the parameters. Returns the ``StepLog``. See docs/steplog.md."""
        from .steplog import open_log

        return open_log(self, directory, optimizer, scheduler, storage_options, scaler=scaler, model=model,
                        counters=counters)

    def replay(self, directory: PathLike, optimizer: Any, scheduler: Any = None, after: PathLike | None = None,
               storage_options: dict | None = None, *, scaler: Any = None, counters: dict | None = None,
               model: Any = None, rng: bool = True, max_steps: int | None = None,
               until: Callable[[dict], bool] | None = None) -> int:
        """After loading checkpoint ``after`` (default: the newest the log marks), apply the steps logged since
        (at most ``max_steps``; none from a step before which ``until(counters)`` holds); returns how many.
        ``counters``/``model``/``rng``: the logged counters, running statistics, RNG states (docs/steplog.md)."""
        from .steplog import replay

        return replay(self, directory, optimizer, scheduler, after, storage_options, scaler=scaler,
                      counters=counters, model=model, rng=rng, max_steps=max_steps, until=until)


def _lands_on_cpu(flat: torch.Tensor, device: str, map_location: Any) -> bool:
    """Whether the load's ``map_location`` puts a tensor saved on ``device`` onto the CPU."""
    if callable(map_location):  # never call the user's function more than the load does
        return False
    try:
        return map_location_tensor(flat[:0], device, map_location).device.type == "cpu"
    except Exception:  # noqa: BLE001 - a map_location we cannot probe: no stream, no copy
        return False


def save(state: Any, path: PathLike, *, config: EngineConfig | dict | PathLike | None = None,
         storage_options: dict | None = None) -> SaveInfo:
    """Save ``state`` to ``path`` and wait for the commit (a one-call convenience)."""
    with CheckpointEngine(config) as engine:
        return engine.save(state, path, storage_options=storage_options).result()


def load(path: PathLike, map_location: Any = None, *, weights_only: bool | None = None,
         config: EngineConfig | dict | PathLike | None = None, storage_options: dict | None = None,
         into: Any = None) -> Any:
    """Load the checkpoint at ``path`` (one call; ``into``: in place): see ``CheckpointEngine.load``."""
    with CheckpointEngine(config) as engine:
        engine._keep_loaded = False  # no save follows: no reference copy for the next row delta
        return engine.load(path, map_location=map_location, weights_only=weights_only,
                           storage_options=storage_options, into=into)


__all__ = ["CheckpointEngine", "save", "load"]
