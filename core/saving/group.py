"""Step 5 across processes: one checkpoint = one commit, a helper thread per rank.

Every rank that saves a checkpoint saves its part through its own engine (asynchronously) and hands
the handle to :class:`GroupCommitter` (the Accelerate adapter does; ``composite.CompositeCommitter``
is the ``finish`` that commits the index). On each rank a helper thread, in submission order:

1. waits until its part is durable (``SaveHandle.result()``): a ``PartOutcome``,
2. posts it in torch.distributed's key-value store (ranks > 0),
3. on rank 0 only, collects the other ranks' outcomes and calls the job's ``finish``: it commits the
   checkpoint's index manifest when every part is durable (that file is what ``latest`` finds), or
   cleans up; then posts its ``Verdict`` for the other ranks, which wait for it,
4. calls the job's ``on_done`` (e.g. the index leaves the in-flight registry).

Not every rank has to save: a script that calls ``save_state()`` under ``if is_main_process`` (as
diffusers' training scripts do) works as with accelerate. Rank 0 waits for another rank's part until
``participation_seconds`` have passed, or until that rank has closed its committer; a rank that did
not post its part by then is left out (the index lists rank 0's part alone; a part posted later is
an orphan that retention removes). A rank without rank 0's verdict after ``timeout_seconds`` (a
rank 0 that died, or never saved that checkpoint) records an error; a peer on this host whose process
has ended is not waited for (each rank posts its identity, ``owner.identity``): under torchrun the store
outlives rank 0, and a SIGTERM grace waited 30 s for its verdict (found by an independent check).
The store is used, not collectives: a collective with a rank that never comes would wait forever, and
take the training's next DDP step with it.

With ``synchronous=True`` (``saving.asynchronous: false``) ``submit`` runs these steps on the calling
thread and returns after the verdict: no helper thread. Otherwise the training thread only ever
enqueues; it reads verdicts with :meth:`take_errors` / :meth:`take_metrics` and blocks only in
:meth:`wait`. Collectives on the group from the training
thread (see :meth:`broadcast`) are allowed only while the helper is idle (after ``wait``).
"""
from __future__ import annotations

import logging
import json
import pickle
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ..storage import owner
from . import lifecycle
from .handles import ByteRatios, SaveHandle

log = logging.getLogger("ckpt_core")


@dataclass(frozen=True)
class PartOutcome:
    """One rank's part of a checkpoint: durable (with its figures) or failed (``error``)."""

    path: str
    error: str | None = None
    written_bytes: int = 0
    tensor_bytes: int = 0
    stored_bytes: int = 0
    background_seconds: float = 0.0


@dataclass(frozen=True)
class GroupFigures(ByteRatios):
    """Figures of one committed checkpoint summed over its parts (plus the index)."""

    checkpoint: str
    blocking_seconds: float
    total_seconds: float
    tensor_bytes: int
    written_bytes: int
    stored_bytes: int

    def as_metrics(self, prefix: str = "checkrun/") -> dict:
        """The figures as a trackers' metrics dict (keys ``checkrun/tensor_bytes``, ...)."""
        values = {"blocking_seconds": self.blocking_seconds, "total_seconds": self.total_seconds,
                  "tensor_bytes": self.tensor_bytes, "written_bytes": self.written_bytes,
                  "stored_bytes": self.stored_bytes, "compression_ratio": self.compression_ratio,
                  "write_ratio": self.write_ratio, "checkpoint": self.checkpoint}
        return {prefix + k: v for k, v in values.items()}


@dataclass(frozen=True)
class Verdict:
    """Rank 0's verdict on one checkpoint, the same on every rank: committed (``figures``) or not."""

    error: str | None = None
    figures: GroupFigures | None = None


Finish = Callable[[list[PartOutcome]], Verdict]
"""Rank 0: ``finish(outcomes) -> Verdict``; must not raise."""


def make_group(timeout_seconds: float) -> tuple[Any, int, int]:
    """``(group, rank, world)``; a new gloo group when torch.distributed runs with world > 1 (for the
    training thread's broadcasts of loads; commits go through the key-value store).

    Collective: call on every rank, in the same order relative to other group creations."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, 0, 1
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
    return group, dist.get_rank(), dist.get_world_size()


#: Longest pause between two looks at the key-value store while waiting for a key (the pauses
#: start at 1 ms and double; a store wait with a timeout would log a c10d warning at each timeout).
STORE_POLL_SECONDS = 0.05
#: How often a wait for a peer's key looks whether the peer's process still exists.
PEER_LOOK_SECONDS = 0.25


@dataclass
class Job:
    """One checkpoint's part on this rank; ``finish`` is used on rank 0 only; ``on_done`` runs on
    every rank once the verdict is known (it must not raise)."""

    handle: "SaveHandle | FailedPart"
    finish: Finish | None
    on_done: Callable[[], None] | None = None
    key: str = ""
    """The checkpoint, the same on every rank (e.g. its index URL)."""


class FailedPart:
    """Stands in for the handle of a part whose synchronous save raised on this rank, so that the
    failure still reaches the group (every rank must take part in the collectives)."""

    def __init__(self, path: str, error: BaseException) -> None:
        self.path, self.error = path, error

    def result(self) -> Any:
        """Raise the save's error (what ``SaveHandle.result`` does for a failed save)."""
        raise self.error


class GroupCommitter:
    """The helper thread of one rank. Create on every rank with the same group."""

    def __init__(self, group: Any, rank: int, world: int, synchronous: bool = False,
                 thread_name: str = "checkrun-group-commit", timeout_seconds: float = 1800.0,
                 participation_seconds: float = 10.0) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.synchronous, self.thread_name = synchronous, thread_name
        self.timeout_seconds, self.participation_seconds = timeout_seconds, participation_seconds
        self._store: Any = None  # set by token()
        self._rounds: dict[str, int] = {}  # saves per checkpoint key on this rank
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0
        self._errors: list[str] = []
        self._figures: list[GroupFigures] = []
        self._broken: str | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- training thread ----------------------------------------------------------------------
    def token(self) -> str:
        """A run token chosen by rank 0 and known to all ranks (collective; call before any submit)."""
        token = self.broadcast(uuid.uuid4().hex[:8])
        if self.world > 1:
            self._store = dist.PrefixStore(f"checkrun-commit/{token}/", dist.distributed_c10d._get_default_store())
            self._store.set(f"who/{self.rank}", json.dumps(owner.identity()).encode())
        return token

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (collective; only while no job is pending)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def announce(self, key: str) -> str:
        """This rank starts saving checkpoint ``key`` (before its snapshot, which may wait for staging
        memory): from now on rank 0 waits for its part however long that takes. Returns the key of
        this round (saving the same checkpoint again is another round), for the ``Job``."""
        rounds = self._rounds[key] = self._rounds.get(key, 0) + 1
        key = f"{key}#{rounds}"
        if self._store is not None and self.rank != 0:
            self._store.set(f"called/{key}/{self.rank}", b"1")
            self._store.set(f"name/{self.rank}", key.encode())  # rank 0 sees a checkpoint it never saves (strays)
        return key

    def release_strays(self, doing: str) -> None:
        """Rank 0, before a collective (``doing``: a load): a checkpoint another rank started that this
        rank never did is one it will not save now; that rank gets a failed verdict at once instead of
        waiting for one for ``timeout_seconds`` while this rank waits for it in the collective (ranks
        that passed folders of their own to save_state: found by running Accelerate's own tests)."""
        if self._store is None or self.rank != 0:
            return
        for r in range(1, self.world):
            if not self._store.check([f"name/{r}"]):
                continue
            key = self._store.get(f"name/{r}").decode()
            name = key.rpartition("#")[0]
            if name in self._rounds or self._store.check([f"verdict/{key}/{r}"]):
                continue
            text = (f"checkpoint {name} not committed: rank 0 did not save it ({doing}): every rank must pass the same "
                    "folder to save_state() (one checkpoint = one commit of every rank's part)")
            self._store.set(f"verdict/{key}/{r}", pickle.dumps(Verdict(text)))
            self._store.delete_key(f"name/{r}")

    def abandon(self, key: str, path: str, error: BaseException) -> None:
        """This rank announced ``key`` but raised before submitting its part: rank 0 gets it as a failed
        part; a rank 0 that raised posts the failure as its verdict (the others' helpers stop waiting)."""
        if self._store is None:
            return
        text = f"rank {self.rank} did not save its part: {type(error).__name__}: {error}"
        if self.rank != 0:
            self._store.set(f"part/{key}/{self.rank}", pickle.dumps(PartOutcome(path, text)))
            return
        verdict = pickle.dumps(Verdict(f"checkpoint {key.rpartition('#')[0]} not committed: {text}"))
        for r in range(1, self.world):
            self._store.set(f"verdict/{key}/{r}", verdict)

    def submit(self, job: Job) -> None:
        """Queue a part (``job.key`` from :meth:`announce`) for the group commit; returns at once
        (synchronous: after the verdict)."""
        if self._closed:
            raise RuntimeError("GroupCommitter is closed")
        if self.synchronous:
            with self._cond:
                self._pending += 1
            self._record(job, self._process(job))
            return
        if self._thread is None or self._thread.ident is None:  # started before the job counts: a
            self._thread = threading.Thread(target=self._loop, name=self.thread_name, daemon=True)
            self._thread.start()  # KeyboardInterrupt here leaves no pending job without a verdict
        with self._cond:
            self._pending += 1
        self._queue.put(job)

    def wait_below(self, limit: int) -> None:
        """Block until fewer than ``limit`` jobs are without a verdict (``saving.max_pending`` applied
        to whole checkpoints: their commit and retention lag the training by at most that many)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending < limit)

    def wait(self) -> None:
        """Block until every submitted job has its verdict."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    @property
    def pending(self) -> int:
        """Jobs without a verdict yet."""
        with self._cond:
            return self._pending

    def pending_unlocked(self) -> int:
        """``pending`` without taking the lock (a signal handler's look: ``lifecycle.register_busy``)."""
        return self._pending

    def take_errors(self) -> list[str]:
        """Errors of failed checkpoints not taken yet (the same on every rank)."""
        with self._cond:
            out, self._errors = self._errors, []
        return out

    def take_figures(self) -> list[GroupFigures]:
        """Figures of committed checkpoints not taken yet (the same on every rank)."""
        with self._cond:
            out, self._figures = self._figures, []
        return out

    def close(self) -> None:
        """Wait for all jobs, then stop the thread. Idempotent."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self._store is not None:  # rank 0 stops waiting for parts of ours that will not come
            try:
                self._store.set(f"closed/{self.rank}", b"1")
            except Exception as exc:  # noqa: BLE001 - rank 0 then waits out participation_seconds
                log.debug("checkrun: cannot post the end of rank %d: %s", self.rank, exc)

    # -- helper thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._record(job, self._process(job))
            del job  # not held while waiting: its callbacks reach the adapter (an Accelerator, its models)

    def _record(self, job: Job, verdict: Verdict) -> None:
        try:
            if job.on_done is not None:
                job.on_done()
        finally:
            with self._cond:
                if verdict.error:
                    self._errors.append(verdict.error)
                if verdict.figures is not None:
                    self._figures.append(verdict.figures)
                self._pending -= 1
                self._cond.notify_all()
            lifecycle.settle()  # the last work of a checkpoint may end here: SIGTERM ends an idle process again

    def _process(self, job: Job) -> Verdict:
        mine = _part_outcome(job.handle)
        if self._broken is not None:
            return Verdict(f"checkpoint not committed: the commit group failed earlier: {self._broken}")
        verdict, posted = None, False  # rank 0's, once it decided; whether this rank's part reached rank 0
        try:
            if self.world == 1:
                return self._finish(job, [mine])
            if self.rank != 0:
                self._store.set(f"part/{job.key}/{self.rank}", pickle.dumps(mine))
                posted = True
                return self._verdict(job.key)
            outcomes = [mine] + [self._part(job.key, r) for r in range(1, self.world)]
            verdict = self._finish(job, outcomes)
            for r in range(1, self.world):
                self._store.set(f"verdict/{job.key}/{r}", pickle.dumps(verdict))
            return verdict
        except Exception as exc:  # noqa: BLE001 - the store is gone (rank 0 died): no later commit is safe
            self._broken = f"{type(exc).__name__}: {exc}"
            log.error("checkrun: commit group failed on rank %d: %s", self.rank, exc)
            if verdict is not None:  # rank 0 decided (and committed) before the other ranks could be told (h110)
                return verdict
            return Verdict(f"checkpoint {'commit unknown' if posted else 'not committed'}: commit group failed: "
                           f"{exc}" + (" before rank 0's verdict came (rank 0 may have committed it: load it or run "
                                       "`checkrun verify` to tell)" if posted else ""))

    @staticmethod
    def _finish(job: Job, outcomes: list["PartOutcome | None"]) -> Verdict:
        """Rank 0's verdict; never raises, so every rank waiting for it gets one."""
        if job.finish is None:
            return Verdict()
        try:
            return job.finish(outcomes)
        except Exception as exc:  # noqa: BLE001 - becomes the verdict on every rank
            log.exception("checkrun: committing a checkpoint failed")
            return Verdict(f"checkpoint not committed: {type(exc).__name__}: {exc}")

    def _part(self, key: str, rank: int) -> PartOutcome | None:
        """Rank 0: ``rank``'s outcome for ``key``, or None if that rank did not start saving it within
        ``participation_seconds``, or closed first (it did not save this checkpoint). A rank that
        started is waited for up to ``timeout_seconds``."""
        called, wanted = f"called/{key}/{rank}", f"part/{key}/{rank}"
        if self._await(called, self.participation_seconds, closed=f"closed/{rank}", peer=rank):
            if not self._await(wanted, self.timeout_seconds, closed=f"closed/{rank}", peer=rank):
                raise TimeoutError(f"rank {rank} started saving {key} but posted no outcome " + (
                    "(its process ended)" if self._gone(rank) else f"within {self.timeout_seconds} s"))
            out = pickle.loads(self._store.get(wanted))
            for k in (called, wanted):
                self._store.delete_key(k)
            return out
        log.info("checkrun: rank %d did not save %s: committed without its part", rank, key.rpartition("#")[0])
        return None

    def _verdict(self, key: str) -> Verdict:
        """Ranks > 0: rank 0's verdict on ``key`` (an error if none comes within ``timeout_seconds``)."""
        wanted = f"verdict/{key}/{self.rank}"
        if not self._await(wanted, self.timeout_seconds, closed="closed/0", peer=0):
            return Verdict(f"checkpoint {key.rpartition('#')[0]} not committed: no verdict from rank 0 "
                           f"(it did not save this checkpoint, or ended)")
        verdict = pickle.loads(self._store.get(wanted))
        self._store.delete_key(wanted)
        return verdict

    def _await(self, wanted: str, seconds: float, closed: str, peer: int) -> bool:
        """Whether ``wanted`` is posted within ``seconds`` (False early once ``closed`` is posted, or once
        the process of rank ``peer`` is known to have ended)."""
        deadline, pause, look = time.monotonic() + seconds, 0.001, time.monotonic() + PEER_LOOK_SECONDS
        while not self._store.check([wanted]):
            if time.monotonic() >= deadline or self._store.check([closed]):
                return self._store.check([wanted])
            if time.monotonic() >= look:
                if self._gone(peer):
                    return self._store.check([wanted])
                look = time.monotonic() + PEER_LOOK_SECONDS
            time.sleep(pause)  # polling a remote store from the helper thread, never the training one
            pause = min(2 * pause, STORE_POLL_SECONDS)
        return True

    def _gone(self, rank: int) -> bool:
        """Whether rank ``rank``'s process certainly ended (on this host only; ``owner.is_gone``)."""
        try:
            if not self._store.check([f"who/{rank}"]):
                return False
            who = json.loads(self._store.get(f"who/{rank}"))
            return owner.is_gone(str(who["host"]), int(who["pid"]), int(who["start"]))
        except (ValueError, KeyError, TypeError):
            return False


def _part_outcome(handle: "SaveHandle | FailedPart") -> PartOutcome:
    """This rank's part: durable (with its figures) or failed (with the error text)."""
    try:
        info = handle.result()
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 and surfaced on every rank
        return PartOutcome(handle.path, f"{exc}")
    return PartOutcome(handle.path, None, info.written_bytes, info.tensor_bytes, info.stored_bytes,
                       info.background_seconds)
