"""Steps 2-6 of an asynchronous save, scheduled: the coordinator thread, its job queue and workers.

One ``Coordinator`` per engine. The training thread ``submit``s each snapshot (``save`` acquires a
slot first: at most ``saving.max_pending`` saves in flight, the backpressure); the coordinator thread
runs the jobs in submission order (so saves to one path commit in order), fanning chunk work out to
``saving.workers`` threads, or hands each to the writer process. After a commit it advances the row
streams, reports the save (log, callbacks) and runs retention and collection (``retain.after_commit``).

Thread lifecycle (a fork racing a thread's start or end can deadlock the child in CPython 3.11, and
DataLoader workers fork every epoch): the coordinator and its workers are started together on the
training thread (``submit``), and end together after ``IDLE_SECONDS`` without a save or when
``wait_idle`` asks; an idle engine holds no thread, and training that saves often starts and ends
none in the background.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .. import forksafe
from ..config import EngineConfig
from ..errors import CheckrunError
from ..format.limits import limits_for
from ..format.manifest import parse_manifest
from ..retain import after_commit, note_removed
from ..storage.store import Store
from . import inflight, lifecycle
from .capture import Snapshot
from .commit import Committed, commit_streams, write_and_commit
from .handles import SaveHandle, SaveInfo
from .process import WriterProcess
from .quant_rules import RuleMatcher
from .copier import Copier
from .staging import BufferPool, MemoryBudget
from .streams import DirState

log = logging.getLogger("ckpt_core")
SLOT_POLL_SECONDS = 0.1
"""How often a save waiting for a ``saving.max_pending`` slot looks again (``Coordinator.acquire_slot``)."""
IDLE_SECONDS = 30.0
"""An asynchronous engine's coordinator and workers end after this long without a save."""


@dataclass(frozen=True)
class Job:
    """One save between its snapshot (training thread) and its commit (coordinator)."""

    snap: Snapshot
    store: Store
    name: str
    handle: SaveHandle
    dir: DirState
    started: float
    """``time.perf_counter()`` at the call to ``save``."""
    blocking: float
    """Seconds the caller of ``save`` waited."""
    slot: bool = True
    """Whether it holds a ``max_pending`` slot (a repeat of the save in flight holds none)."""
    owner: object = None
    """The engine, kept alive while the job is queued or runs: an engine that only a returned function's
    local held was collected with its saves in flight, and the exit hook (``lifecycle``) flushed nothing."""
    leader: SaveHandle | None = None
    """The save this one repeats (``repeat``): if it failed, so does this one."""


class Coordinator:
    """The background side of one engine: backpressure, the job queue, the threads and their end.

    ``pool``/``budget``: where a job's staging buffers and memory go back after its write.
    ``copier``/``stores``: the snapshot's copy helper and the engine's stores, whose threads stop
    when nothing uses them. ``callbacks``: called with each committed save's ``SaveInfo``. The dict
    and the list are the engine's (it adds to them).
    """

    def __init__(self, config: EngineConfig, process: WriterProcess | None, matcher: RuleMatcher,
                 pool: BufferPool, budget: MemoryBudget, copier: Copier, stores: dict[tuple, Store],
                 callbacks: list[Callable[[SaveInfo], None]]) -> None:
        self.config, self.process, self.matcher = config, process, matcher
        self.pool, self.budget = pool, budget
        self._copier, self._stores, self._callbacks = copier, stores, callbacks
        self._slots = threading.BoundedSemaphore(config.saving.max_pending)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None  # None while the engine is idle
        self._retired: list[threading.Thread] = []  # coordinators that went idle, joined by wait_idle
        self._inflight: list[SaveHandle] = []
        self._failed: list[SaveHandle] = []
        self._cond = threading.Condition()
        self._rules_checked = False

    # -- training thread ------------------------------------------------------------------------
    def acquire_slot(self) -> None:
        """Backpressure: block while ``max_pending`` saves are in flight. Pair with ``release_slot``
        if the snapshot fails, else the job releases it.

        Waits in short rounds: a signal handler that saves (Lightning's SLURM requeue on SIGUSR1) runs on top
        of a wait here, and a release wakes the oldest waiter, the interrupted one, which cannot run until
        the handler returns: the handler's own wait was never woken (h126, a hang at 0 % CPU)."""
        while not self._slots.acquire(timeout=SLOT_POLL_SECONDS):
            pass

    def release_slot(self) -> None:
        """Give back a slot whose save never became a job (its snapshot raised)."""
        self._slots.release()

    def submit(self, job: Job, asynchronous: bool) -> None:
        """Run ``job`` on the coordinator (``asynchronous``), else here, with workers of its own."""
        with self._cond:
            self._inflight.append(job.handle)
        inflight.begin(job.handle.path)
        if asynchronous:
            try:
                with self._cond:  # atomic with the coordinator's check for an empty queue before it ends
                    self._ensure_thread()
                    self._queue.put(job)
            except BaseException as exc:
                self._abandon(job, exc)
                raise
            # queued (a SIGTERM handled in here waits for it: before the put, the save never ran): a SIGTERM
            # now gets the grace (lifecycle._watch); the coordinator settles after it
            lifecycle.arm()
            return
        try:
            workers = self._new_workers()  # any thread: the Accelerate index committer's is a background one
        except BaseException as exc:
            self._abandon(job, exc)
            raise
        try:
            self._run(job, workers)
        finally:
            forksafe.stop_executor(workers)
        self.release_if_idle()

    def wait_idle(self) -> None:
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

    def stop_after_queued(self) -> None:
        """``close`` interrupted while waiting: the coordinator ends after the queued saves."""
        with self._cond:
            if self._thread is not None:
                self._queue.put(None)

    def release_if_idle(self) -> None:
        """Training thread, after a sync save or a load: stop the idle threads unless a coordinator
        runs (it stops them itself when it goes idle, off the training thread: a join there waits
        for the GIL behind the background threads, ~10 ms per save measured)."""
        with self._cond:
            busy = self._thread is not None
        if not busy:
            self._release_idle()

    @property
    def pending(self) -> int:
        """Saves not yet committed or failed."""
        with self._cond:
            return len(self._inflight)

    def take_failed(self) -> list[SaveHandle]:
        """Handles of failed saves not handed out yet (their errors surface once)."""
        with self._cond:
            failed, self._failed = self._failed, []
        return failed

    def _abandon(self, job: Job, exc: BaseException) -> None:
        """A job that never ran (a thread could not start: a process limit): its staging, place in flight and
        slot go back and its handle fails (h146: the slot stayed taken, and the next save, close() and the
        interpreter's exit waited for ever, even once the limit was lifted). The caller raises ``exc``."""
        self.release_staging(job.snap)
        job.dir.invalidate()
        job.handle.finish(None, exc)
        with self._cond:
            self._inflight.remove(job.handle)
            self._cond.notify_all()
        inflight.end(job.handle.path)
        if job.slot:
            self._slots.release()

    def _release_idle(self) -> None:
        """Stop the snapshot's copy helper and the storage pools that no call is using."""
        self._copier.close()
        for store in list(self._stores.values()):
            store.release_idle()

    # -- threads --------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        """Start the coordinator (training thread, under ``_cond``) with its workers already running:
        no thread starts in the background while training goes on (see ``_loop``)."""
        if self._thread is None:
            workers = self._new_workers()
            self._thread = threading.Thread(target=self._loop, args=(workers,), name="checkrun-coordinator",
                                            daemon=True)
            # Tools that stop the daemon threads a test left (``thread.stop()``, as Lightning's test
            # suite does) get ``wait_idle``: the saves queued commit, then this thread and the
            # threads it owns (workers, copy helper, idle storage pools) end, joined.
            self._thread.stop = self.wait_idle  # type: ignore[attr-defined]
            try:
                self._thread.start()
            except BaseException:  # h146: its workers stayed, and a thread never started was taken for it
                self._thread = None
                forksafe.stop_executor(workers)
                raise

    def _new_workers(self) -> ThreadPoolExecutor:
        sc = self.config.saving
        return forksafe.started_executor(sc.workers, "checkrun-worker", lifecycle.lower_thread_priority,
                                         (sc.thread_nice,))

    def _loop(self, workers: ThreadPoolExecutor) -> None:
        """Coordinator: runs the queued saves. It ends, with its workers, the snapshot's copy helper
        and the idle storage pools, when ``wait_idle`` asks (a sentinel) or after ``IDLE_SECONDS``
        without a save: an idle engine holds no thread, yet training that saves often does not start
        and end threads at every save (a fork racing a thread's start or end can deadlock the child
        in CPython 3.11, and DataLoader workers fork every epoch)."""
        lifecycle.lower_thread_priority(self.config.saving.thread_nice)
        try:
            while True:
                try:
                    job = self._queue.get(timeout=IDLE_SECONDS)
                except queue.Empty:
                    job = None
                if job is not None:
                    self._run(job, workers)
                    job = None  # not held while idle: the job's handle reaches the caller's objects
                    lifecycle.settle()
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
        finally:
            forksafe.stop_executor(workers)
        self._release_idle()

    # -- one job ---------------------------------------------------------------------------------
    def _run(self, job: Job, workers: ThreadPoolExecutor) -> None:
        """Background part of one save; never raises (errors go to the handle)."""
        info, error = None, None
        try:
            t0 = time.perf_counter()
            try:
                if job.leader is not None and job.leader.failed():
                    raise CheckrunError(f"{job.handle.path}: not saved: it repeats the save to {job.leader.path}, "
                                        "which failed (as a failed torch.save stops what comes after it)")
                if self.process is not None:
                    done = self.process.commit(job.snap, job.store, job.name)
                else:
                    done = write_and_commit(job.snap, job.store, job.name, job.dir, self.config,
                                            self.matcher, workers)
            finally:
                self.release_staging(job.snap)
            commit_streams(job.snap, done, self.config.incremental.max_chain)
            info = _info(job, done, time.perf_counter() - t0)
            job.handle.settle(info, None)  # committed: its done-callbacks now, not after retention and gc
            self._after_commit(job, info, done.unmatched_rules)
            if done.replaced is not None:  # an overwrite (last.ckpt): the blobs only the old one used are garbage,
                # collected after the next commit here, not this one: a load that read the old manifest has a
                # checkpoint interval to finish (an independent check: "missing blob" under a concurrent reader)
                note_removed(job.dir, lambda: parse_manifest(done.replaced, job.handle.path,
                                                             limits=limits_for(self.config)).blobs())
        except BaseException as exc:  # noqa: BLE001 - surfaced through the handle/next call
            if info is not None:  # committed (settled): what failed came after, in retention or gc
                log.error("checkrun: after saving %s: %s", job.handle.path, exc)
                return
            job.dir.invalidate()
            error = exc
            # superseded by a later save of this process (another engine's, same name): its caller decides
            log.log(logging.INFO if getattr(exc, "same_process", False) else logging.ERROR,
                    "checkrun: save to %s failed: %s", job.handle.path, exc)
        finally:
            job.handle.finish(info, error)
            with self._cond:
                if error is not None:
                    self._failed.append(job.handle)
                self._inflight.remove(job.handle)
                self._cond.notify_all()
            inflight.end(job.handle.path)
            if job.slot:
                self._slots.release()

    def release_staging(self, snap: Snapshot) -> None:
        """Give ``snap``'s staging buffers and budget back, unless a save repeating it still uses them."""
        if not snap.hold.leave():
            return
        for st in snap.tensors:
            if st.stream is None:
                self.pool.give(st.data)
        self.budget.release(snap.charged)

    def _after_commit(self, job: Job, info: SaveInfo, unmatched_rules: tuple) -> None:
        """Report the committed save (log, the unmatched-rules warning once, callbacks), then retention
        and collection; a failure of those is logged: the save is committed."""
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
        after_commit(job.store, job.name, self.config, memory=job.dir, forget=self.forget_blobs(job.store))

    def forget_blobs(self, store: Store) -> Callable[[list[str]], None] | None:
        """What else must forget the blobs a collection in ``store`` deleted: the writer process."""
        if self.process is None:
            return None
        process = self.process
        return lambda keys: process.forget(store, keys)


def _info(job: Job, done: Committed, background: float) -> SaveInfo:
    stats = done.stats
    return SaveInfo(
        path=job.handle.path, tensor_bytes=stats.tensor_bytes,
        written_bytes=stats.written_bytes + done.manifest_bytes, stored_bytes=stats.stored_bytes,
        blocking_seconds=job.blocking, background_seconds=background,
        total_seconds=time.perf_counter() - job.started, new_blobs=done.new_blobs,
        reused_blobs=done.reused_blobs, chain_depth=stats.chain_depth,
        quantized_tensors=done.quantized_tensors, quantization_saved_bytes=done.quantization_saved_bytes)
