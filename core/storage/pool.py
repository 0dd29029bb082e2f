"""Step 4's threads: the I/O pool of one ``Store`` (``Store.map``).

Threads start with the first ``map`` that needs them, all at once (``forksafe.started_executor``:
a fork never races one), and end at ``release_idle`` (the engine going idle) or ``close``, so an
idle engine holds none. Every method may be called from any thread,
including the pool's own threads (a nested ``map`` runs inline).
"""
from __future__ import annotations

import threading
import concurrent.futures.thread as _futures_thread
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Callable, Iterable, Optional, TypeVar

from .. import forksafe

T = TypeVar("T")
R = TypeVar("R")

#: Least total cost (bytes) of one pool task in ``Store.map(..., cost=...)``. Measured on 2 cores:
#: 1000 blobs of 3 KB loaded with 0.81 ms of CPU each as one task per blob on 4 threads, 0.2 ms on
#: one thread (several threads taking turns at the GIL for tiny blobs cost more than they gain); a
#: task of 4 MiB takes a few ms, so handing it over no longer counts.
BATCH_COST = 4 << 20


def batches(items: list[T], cost: Callable[[T], int]) -> list[list[T]]:
    """Consecutive runs of ``items`` whose costs add up to ``BATCH_COST`` or more (the last may
    be smaller); an item costing that much alone is a run of its own."""
    out: list[list[T]] = []
    run: list[T] = []
    total = 0
    for x in items:
        run.append(x)
        total += cost(x)
        if total >= BATCH_COST:
            out.append(run)
            run, total = [], 0
    if run:
        out.append(run)
    return out


def interpreter_exiting() -> bool:
    """The interpreter's exit has begun (``atexit`` handlers run): no executor takes new work then ("cannot
    schedule new futures after interpreter shutdown": a load in a user's ``atexit`` handler failed, h167)."""
    return bool(getattr(_futures_thread, "_shutdown", False))


class IOPool:
    """A thread pool of ``threads`` threads started on demand (named ``checkrun-io``)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._maps = 0  # map() calls using the pool now: release_idle() leaves their pool alone
        self._in_worker = threading.local()

    def map(self, fn: Callable[[T], R], items: Iterable[T],
            cost: Callable[[T], int] | None = None) -> list[R]:
        """``[fn(x) for x in items]`` on the pool; see ``Store.map``."""
        items = list(items)
        if cost is not None and len(items) > 1:
            runs = batches(items, cost)
            if len(runs) < len(items):
                return [r for part in self.map(lambda b: [fn(x) for x in b], runs) for r in part]
        if len(items) <= 1 or getattr(self._in_worker, "active", False) or interpreter_exiting():
            return [fn(x) for x in items]
        pool = self._acquire()
        try:
            futures = [pool.submit(self._run_in_worker, fn, x) for x in items]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)
            finally:
                if any(_failed(f) for f in futures) or not all(f.done() for f in futures):
                    for f in futures:
                        f.cancel()
                    wait(futures)
        finally:
            with self._lock:
                self._maps -= 1
        for f in futures:
            if _failed(f):
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]

    def _run_in_worker(self, fn: Callable[[T], R], item: T) -> R:
        self._in_worker.active = True
        try:
            return fn(item)
        finally:
            self._in_worker.active = False

    def _acquire(self) -> ThreadPoolExecutor:
        """The executor, for one ``map`` (counted until it ends)."""
        with self._lock:
            self._maps += 1
            if self.executor is None:
                self.executor = forksafe.started_executor(self.threads, "checkrun-io")
            return self.executor

    def release_idle(self) -> None:
        """Stop the threads unless a ``map`` is using them; a later ``map`` starts new ones."""
        with self._lock:
            if self._maps:
                return
            pool, self.executor = self.executor, None
        if pool is not None:
            forksafe.stop_executor(pool)

    def close(self) -> None:
        """Shut down after the running calls; a later ``map`` starts a new executor."""
        with self._lock:
            pool, self.executor = self.executor, None
        if pool is not None:
            forksafe.stop_executor(pool, cancel_futures=True)


def _failed(f: Future) -> bool:
    return f.done() and not f.cancelled() and f.exception() is not None
