"""``StepLog``: logs every ``step()`` of one optimizer into a checkpoint directory's step log.

Threads: the hooks run on the training thread (capture only); one encoder thread per log
(``checkrun-steplog``) encodes, batches events into segments and commits them in the order the
training thread issued them. The run object (at the start) and markers (in ``engine.save``) are
written by the training thread itself: each lands before anything that depends on it. Backpressure: at most
``step_log.queue_steps`` captured steps wait for the encoder (``Staging``). The LR scheduler is
not wrapped: its ``state_dict`` (plain data) and the groups' hyperparameters are logged as a
``state`` event whenever they changed, before each step and at each flush point. Errors of the encoder
surface once, at the next hook, ``flush`` or ``close``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any

import torch

from ..config import EngineConfig
from ..errors import FormatError
from .. import forksafe
from ..saving import inflight, lifecycle
from ..saving.lifecycle import lower_thread_priority
from ..storage.store import Store
from . import meta, rng
from .batch import _Batch, _Inbox
from .capture import Staging, capture_step, fingerprint, forward_buffers, group_scalars, sched_skeleton
from .encode import RAW_PIPELINE, StepEncoder
from .index import dir_key
from .registry import _ACTIVE, ENDED, _inner_call
from .registry import active_log, log_store  # noqa: F401 - log_store, active_log: importers'
from .format import (MAX_RUN_BYTES, Marker, RunInfo, StepLogError, marker_to_bytes, mark_name, segment_parts,
                     run_name, run_to_bytes, seg_name)

log = logging.getLogger("ckpt_core")


class StepLog:
    """The log of one optimizer (and its LR scheduler) into one directory. Build with
    ``engine.step_log(directory, optimizer, scheduler)``; ``flush()`` commits what is logged,
    ``close()`` flushes and stops logging."""

    def __init__(self, store: Store, optimizer: torch.optim.Optimizer, scheduler: Any,
                 config: EngineConfig, parent: tuple[str, int, int] | None = None, scaler: Any = None,
                 model: Any = None, counters: Any = None) -> None:
        if active_log(optimizer) is not None:
            raise StepLogError("this optimizer already has an open step log: close it first")
        self.store, self.optimizer, self.scheduler, self.config = store, optimizer, scheduler, config
        self.key = dir_key(store)  # the directory, however a save spells it
        self.scaler = scaler  # a GradScaler: its state goes with the scheduler's (meta.scaler_state)
        self.counters = counters  # the caller's counters (names to ints), logged with each state record
        self._buffers = forward_buffers(model)  # running statistics, logged with each step (model given)
        self._segs = log_store(store)
        self.run = uuid.uuid4().hex[:16]
        self.event = parent[1] if parent else 0  # events logged (all runs of the chain)
        self.step = parent[2] if parent else 0  # optimizer steps logged
        self._pid = os.getpid()
        self._paused = self._flushing = False
        self._lock = threading.RLock()  # held by a flush and by close (``commit_for`` from another thread)
        self._unflushed = self._mark_seq = 0
        self._error: BaseException | None = None
        self._queue = _Inbox()
        self._stop = threading.Event()
        self._staging = Staging(max(1, config.step_log.queue_steps))
        self.bytes_logged = self.segments = 0  # stored bytes and number of the segments committed so far
        info = RunInfo(self.run, time.time(), self.event, self.step,
                       None if parent is None else (parent[0], parent[1]), meta.class_name(optimizer),
                       meta.param_names(optimizer, model), meta.owner_record())
        self._info = self._write_run(info)  # before any segment (gc)
        self._first, self._first_step = self.event, self.step  # the encoder must not read self.event
        self._thread = threading.Thread(target=self._loop, name="checkrun-steplog", daemon=True)
        self._thread.stop = self.close  # type: ignore[attr-defined]  # a harness stopping leftover threads
        self._thread.start()
        self._last_state: dict | None = None
        self._window: "bool | dict | None" = None  # ``window_end``: armed by a step (True), then its state
        self._held: Any = None  # the record captured by the pre-hook of the step() in progress
        self._due: list[Marker] = []  # markers whose write failed at their save: written again (_write_due)
        self._void: set[str] = set()  # markers in ``_due`` whose save failed (added by its done-callback)
        self._hooks = [optimizer.register_step_pre_hook(self._pre_hook),
                       optimizer.register_step_post_hook(self._post_hook)]
        _ACTIVE[optimizer] = self
        lifecycle.register_owner(self._close_at_exit)

    # -- training thread ----------------------------------------------------------------------
    def flush(self) -> None:
        """Commit everything logged so far as a segment and wait for it (training thread). The RNG states
        now are logged as those after it (a flush between batches)."""
        self._flush(point=True)

    def commit_for(self, seconds: float) -> bool:
        """A replay of this directory by another log of the process: commit what is logged as ``close``
        does, waiting at most ``seconds`` (first for a flush or close under way on another thread: an
        Accelerator dropped closes its log on a thread of its own, and a replay that did not wait went
        without its steps, found by an independent check); False if it did not finish."""
        if os.getpid() != self._pid or not self._lock.acquire(timeout=seconds):  # a forked child's: not its own
            return False
        try:
            if self._stop.is_set():  # closed meanwhile: its close committed what it held
                return self._error is None
            return (not self._flushing and self._error is None
                    and self._flush(point=False, seconds=seconds, check=False) and self._error is None)
        finally:
            self._lock.release()

    def _flush(self, point: bool, seconds: float | None = None, check: bool = True) -> bool:
        """``flush``; ``close`` logs no RNG states (the process may have drawn or reseeded since its last step)."""
        if os.getpid() != self._pid:  # a forked child: the encoder is the parent's (and the lock maybe held)
            return False
        with self._lock:
            return self._flush_held(point, seconds, check)

    def _flush_held(self, point: bool, seconds: float | None, check: bool) -> bool:
        self._flushing, done, deadline = True, threading.Event(), time.monotonic() + (seconds or float("inf"))
        try:
            self._write_due()
            self._drop_held()
            self._state_event(window=True)  # before an error is raised: the encoder writes the held step at the stop,
            # and without the scheduler step after it a resume there was one scheduler step behind (h99)
            if check:  # commit_for (another log's replay) leaves errors to this log's owner
                self._check()
            if point:
                self._point()
            self._queue.put(("flush", done))
            self._unflushed = 0
            while not done.wait(0.5) and self._thread.is_alive() and time.monotonic() < deadline:
                pass
        finally:
            self._flushing = False
        if check:
            self._check()
        return done.is_set()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - at exit: report, never raise
            log.error("checkrun: closing the step log at exit: %s", exc)

    def close(self) -> None:
        """Flush, stop logging and end the encoder thread. Idempotent; raises a background error not
        raised yet (also one of a log that ``shutil.rmtree`` of its directory closed)."""
        self._close(check=True)

    def _close(self, check: bool) -> None:
        if os.getpid() != self._pid:  # a forked child: not its log (nor its lock's holder)
            return
        with self._lock:  # a replay's commit_for waits for it
            if self._stop.is_set():
                if check:
                    self._check()
                return
            try:
                if self._thread.is_alive():
                    self._flush(point=False, check=False)  # an error is raised below, once the run object is
            finally:
                self._stop.set()
                self._queue.put(("stop", None))
                self._thread.join()
                for h in self._hooks:
                    h.remove()
                if _ACTIVE.get(self.optimizer) is self:
                    del _ACTIVE[self.optimizer]
        # gc may drop a closed run's markers of checkpoints it does not list: only once no save (whose
        # marker this run wrote) can still commit. Where it ended goes in the same object, after an error
        # too (a resume then reports the lost tail), and is kept for the optimizer's next log here (h99:
        # both went missing after an error or a save slower than the lease: later resumes stopped early)
        if inflight.wait_under(self.store.url("").rstrip("/") + "/", self.config.retention.lease_seconds):
            try:
                self._write_run(dataclasses.replace(self._info, closed=True, end=(self.event, self.segments)))
            except Exception as exc:  # noqa: BLE001 - raised below unless an earlier error is
                self._error = self._error or exc
        ENDED.setdefault(self.optimizer, {})[self.key] = ((self.run, self.event, self.step),
                                                          fingerprint(self.optimizer))
        if check:
            self._check()

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (also at exit, or by ``shutil.rmtree`` of the log's directory)."""
        return self._stop.is_set()

    def _write_run(self, info: RunInfo) -> RunInfo:
        data = run_to_bytes(info)
        if len(data) > MAX_RUN_BYTES:  # parameter names past the format's limit: recorded without them
            info = dataclasses.replace(info, param_names=None)
            data = run_to_bytes(info)
        self._segs.write_manifest(run_name(self.run), data, what="step-log run record")
        return info

    def on_save(self, store: Store, name: str, stamp: Any, handle: Any = None) -> None:
        """Training thread, in ``engine.save`` after the snapshot, before the save is queued: write
        the marker of checkpoint ``name`` (one small object, so every checkpoint that commits has
        one) and close the open segment, if it is this log's directory. Never raises: an error
        surfaces at the log's next hook, ``flush`` or ``close``."""
        if ((dir_key(store) != self.key and store.url("") != self.store.url("")) or self._stop.is_set()
                or os.getpid() != self._pid):  # the same directory, however spelled (a symlink moved since: its URL)
            return
        marker = None
        try:  # the marker is written here, not by the encoder: it lands before the checkpoint commits
            self._drop_held()
            self._state_event()
            self._mark_seq += 1
            commit = stamp.to_json() if stamp is not None else None
            marker = Marker(mark_name(self.run, self.event, self._mark_seq), self.run, self.event, self.step,
                            name, commit)
            self._point()
            self._queue.put(("flush", None))  # the segment ends at the checkpoint (gc drops it whole)
            self._unflushed = 0
            self._segs.write_manifest(marker.name, marker_to_bytes(marker), what="step-log marker")
        except Exception as exc:  # noqa: BLE001 - the save goes on; the marker is tried again (_write_due)
            log.error("checkrun: step log of %s: marker of %s not written: %s", self.store.url(""), name, exc)
            self._error = self._error or exc
            if marker is not None:
                self._due.append(marker)
                if handle is not None:  # a save that fails marks nothing: its marker is not tried again at
                    handle.add_done_callback(lambda h, m=marker.name: h.failed() and self._void.add(m))  # each step

    def _write_due(self) -> None:
        """Training thread: write again the markers whose write failed at their save (the checkpoint may
        have committed without one: the steps logged after it are reachable once it lands)."""
        while self._due:
            marker = self._due[0]
            if marker.name in self._void:  # its save failed (h99: retried and raised at every later step)
                self._due.pop(0)
                continue
            try:
                self._segs.write_manifest(marker.name, marker_to_bytes(marker), what="step-log marker")
            except Exception as exc:  # noqa: BLE001 - tried again at the next step
                self._error = self._error or exc
                return
            log.warning("checkrun: step log of %s: marker of %s written on a later try", self.store.url(""),
                        marker.checkpoint)
            self._due.pop(0)

    def continue_chain(self, parent: tuple[str, int, int]) -> bool:
        """Training thread, after ``engine.replay`` into this log's optimizer: if nothing was logged
        yet, continue the chain the replay ended on (as a log opened after the replay would), so
        that a crash before the next checkpoint still resumes through this run. Returns whether it did."""
        if self.event != self._first or self.step != self._first_step or self._mark_seq or self._stop.is_set():
            return False
        # the run object first: if its write fails, this log goes on numbering from its own start, as its
        # encoder does (the counters moved first made the two disagree: a later resume replayed wrong
        # steps; found by an independent fault program)
        self._info = self._write_run(dataclasses.replace(self._info, created=time.time(), start=parent[1],
                                                         start_step=parent[2], parent=(parent[0], parent[1])))
        self.event, self.step = parent[1], parent[2]
        self._first, self._first_step = self.event, self.step
        self._queue.put(("rebase", self.event))
        return True

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._paused or self._stop.is_set() or os.getpid() != self._pid or _inner_call(optimizer):
            return
        # torch calls step pre-hooks with args = (optimizer, *step's args), before step() runs the
        # closure: the gradients here would be the previous step's. Refused, not logged wrong.
        if kwargs.get("closure") is not None or (len(args) > 1 and args[1] is not None):
            raise StepLogError(f"step log of {self.store.url('')}: optimizer.step(closure) is not supported: "
                               "torch runs the step pre-hook that captures the gradients before the closure "
                               "computes them. Call the closure yourself, then optimizer.step() without it")
        self._write_due()
        self._drop_held()
        if self._unflushed >= self.config.step_log.flush_every_steps:  # at the next step's start:
            self._state_event(window=True)  # the scheduler's step after the last logged step goes with it
            self._queue.put(("flush", None))
            self._unflushed = 0
        self._state_event()
        slot = self._staging.take(self._stop)
        try:
            rec = capture_step(optimizer, self.step + 1, self._staging, slot,
                               self.config.step_log.sparse_max_fraction, self._buffers)
            rec.rng = rng.capture() if self.config.step_log.rng else None
        except BaseException:
            self._staging.give(slot)
            raise
        self._held = rec

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """``step()`` returned: its record counts. A step that raised (an out-of-memory error the loop
        skips) consumed nothing and is not logged: its record is dropped at the next step or flush.
        An earlier failure of the log's background work is raised here, once this step is applied and
        logged: a loop that catches it and goes on loses no update (raised in the pre-hook, it stopped
        that step before it changed anything, and such a loop skipped the step; found by an independent
        check)."""
        if self._held is None or _inner_call(optimizer):
            return
        rec, self._held = self._held, None
        self.step += 1
        self.event += 1
        self._unflushed += 1
        self._window = True  # the state after this step: as ``window_end`` finds it, if called
        self._queue.put(("step", rec))
        self._check()

    def window_end(self) -> None:
        """The loop's work for the last logged step is done (an adapter calls it after the LR scheduler's
        step that follows the optimizer's): the state now is what a flush logs as the state after that step,
        not the state at the flush. A scheduler stepped per micro-batch (accelerate's
        ``step_scheduler_with_optimizer=False``) has stepped again by then, for batches a resume runs again
        (found by an independent check: the resumed scheduler was ahead by them)."""
        if self._window is True:
            self._window = self._state_now()

    def _drop_held(self) -> None:
        rec, self._held = self._held, None
        if rec is not None:
            self._staging.give(rec.slot)
            log.warning("checkrun: step log of %s: optimizer step %d raised; it is not logged",
                        self.store.url(""), rec.step)

    def _state_event(self, window: bool = False) -> None:
        """Log the groups' hyperparameters and the scheduler's state if they changed since logged:
        replay restores them before the next step, so the step and the resumed scheduler are exact.
        ``window``: at a flush, the state ``window_end`` found after the last step, if it did (kept for
        the flushes until the next step; any other event logs the state now and forgets it)."""
        if window and isinstance(self._window, dict):
            state = self._window
        else:
            state, self._window = self._state_now(), None
        if state != self._last_state:  # fresh plain data (no JSON round trip: this runs every step)
            self._last_state = state
            self.event += 1
            self._queue.put_quiet(("state", state))  # the step, a flush or a stop follows and wakes it

    def _state_now(self) -> dict:
        state = {"groups": group_scalars(self.optimizer),
                 "sched": None if self.scheduler is None else sched_skeleton(self.scheduler.state_dict())}
        if self.scaler is not None:  # its update() also runs after a skipped step, where no pre-hook does
            state["scaler"] = meta.scaler_state(self.scaler)
        if self.counters is not None:
            try:
                state["counters"] = meta.check_counters(self.counters())
            except FormatError as exc:
                raise StepLogError(f"step log of {self.store.url('')}: step_log(counters=): {exc}") from None
        return state

    def _point(self) -> None:
        """A flush point between batches (``flush``, a save): the RNG states as they are now hold after
        every event logged so far, as a checkpoint saved here holds them (a step's own are older when a
        batch whose step a GradScaler skipped followed it, or an evaluation before the save drew)."""
        if self.config.step_log.rng:
            self._queue.put(("rng", rng.capture()))

    def _check(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise StepLogError(f"step log of {self.store.url('')} failed: {err}") from err

    # -- encoder thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        """Encoder thread: events into batches; a full batch goes to the writer thread, so encoding
        goes on while a segment is written (one segment in flight: ``_writes`` holds one)."""
        lower_thread_priority(self.config.saving.thread_nice)  # as the saves' threads: training first
        writes: queue.Queue = queue.Queue(maxsize=1)
        writer = threading.Thread(target=self._write_loop, args=(writes,), name="checkrun-steplog-writer", daemon=True)
        writer.stop = self.close  # type: ignore[attr-defined]  # ends both threads, as the encoder's
        with forksafe.churn():  # a background thread starting one: a fork waits (core/forksafe.py)
            writer.start()
        pays = StepEncoder(self.config.compression)
        batch = _Batch(self.run, self._first, pays)
        issued = self._first  # events the training thread has queued so far, as it numbered them
        seq = 0
        while True:
            # only committed events age: a held step alone waits for the next event, not the clock
            timeout = (None if not batch.events
                       else max(0.0, batch.started + self.config.step_log.flush_seconds - time.monotonic()))
            try:
                kind, item = self._queue.get(timeout=timeout)
            except queue.Empty:
                kind, item = "timeout", None
            try:
                if kind == "rebase":  # nothing logged yet (continue_chain): the first segment starts there
                    batch, issued = _Batch(self.run, item, pays), item
                    continue
                if kind in ("step", "state"):
                    issued += 1
                    batch.add(kind, item, self.config, self._staging)
                    continue
                if kind == "rng":  # a flush follows: the states after every event so far
                    if not batch.empty:
                        batch.release()
                        batch.rng = (batch.hi, None, item)
                    continue
                if kind != "timeout":  # the training thread flushes: its last step is complete
                    batch.release()
                if batch.events:
                    seq += 1
                    writes.put((batch, seq))
                    batch = batch.rest()
                if item is not None:
                    writes.put((None, item))  # set once the segments before it are written
            except BaseException as exc:  # noqa: BLE001 - surfaced at the next hook/flush/close
                log.error("checkrun: step log of %s: %s", self.store.url(""), exc)
                self._error = exc
                # what failed is lost; the events before it (a step that failed to encode: its batch's) are
                # written. Later events keep the numbers the training thread gave them, so the next segment
                # starts after a gap that replay stops at (it started at the batch's end: a failed first
                # event of a segment left no gap, and every later event was replayed one place off,
                # silently; found by an independent check)
                if kind in ("step", "state") and batch.events and batch.held is None:
                    seq += 1
                    writes.put((batch, seq))
                batch = _Batch(self.run, issued, pays)
                if isinstance(item, threading.Event):
                    item.set()
            if kind == "stop":
                writes.put(None)
                writer.join()
                return

    def _write_loop(self, writes: queue.Queue) -> None:
        lower_thread_priority(self.config.saving.thread_nice)
        while True:
            job = writes.get()
            if job is None:
                return
            batch, what = job
            if batch is None:
                what.set()
                continue
            try:
                self._write(batch, what)
            except BaseException as exc:  # noqa: BLE001 - a gap in the log: replay stops before it
                log.error("checkrun: step log of %s: segment %d not written: %s", self.store.url(""), what, exc)
                self._error = exc

    def _write(self, batch: "_Batch", seq: int) -> None:
        header = {"run": self.run, "seq": seq, "lo": batch.lo, "hi": batch.hi, "events": batch.events,
                  "packs": batch.packs}
        if any("bufs" in ev for ev in batch.events):  # what the steps' ``bufs`` entries index
            header["buffers"] = [name for name, _, _ in self._buffers]
        if batch.rng is not None:  # the RNG states after its last step or flush point (a resume ends there)
            entry = rng.encode(batch.rng[2], *batch.rng[:2], parts := [], batch.size, RAW_PIPELINE.to_list())
            batch.extend(parts)
            if entry is not None:
                header["rng"] = entry
        data = segment_parts(header, batch.payload, batch.csum)
        self._segs.write_manifest(seg_name(self.run, seq, batch.lo, batch.hi), data, what="step-log segment")
        batch.payload.clear()
        self.bytes_logged += sum(memoryview(part).nbytes for part in data)
        self.segments += 1
