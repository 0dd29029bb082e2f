"""Threads that a fork cannot catch half started or half ended.

CPython 3.11 can deadlock a forked child in its after-fork cleanup (``PyOS_AfterFork_Child`` ->
``_PyThreadState_DeleteExcept``) when the fork races another thread's start or end, and DataLoader
workers fork at every epoch while saves run in the background. So checkrun starts and ends threads
only inside :func:`churn`, and ``os.fork`` waits (before it forks) until no such section runs:

- :func:`started_executor` starts all of a pool's threads at once, inside the section, so that a
  later ``submit`` (from a background thread) never starts one;
- :func:`stop_executor` ends them inside the section;
- a thread that ends by itself announces it (``lifecycle.retiring``); a fork joins it first.

A section is short (threads starting, or idle threads ending). A fork that still finds one after
``FORK_WAIT_SECONDS`` goes ahead with a warning.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

log = logging.getLogger("ckpt_core")
FORK_WAIT_SECONDS = 30.0
_churn = threading.Lock()
_held = threading.local()  # this thread is inside churn(): a nested section does not wait for itself
_fork = {"acquired": False}
_pools = itertools.count()


@contextlib.contextmanager
def churn() -> Iterator[None]:
    """Hold while this thread starts or ends threads: ``os.fork`` waits until it is over."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    with _churn:
        _held.depth = 1
        try:
            yield
        finally:
            _held.depth = 0


def started_executor(workers: int, prefix: str, initializer: Callable[..., Any] | None = None,
                     initargs: tuple = ()) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads, every one of them running when it returns
    (each held at a barrier until all have started): a later ``submit`` starts no thread.

    Its threads are named ``<prefix> (ThreadPoolExecutor-N)_K``: ours by their start, executor
    threads by the rest, as tools that look for threads a test left behind know them (Lightning's
    test suite lets ``ThreadPoolExecutor-`` threads be; the thread that owns them has ``stop``)."""
    with churn():
        pool = ThreadPoolExecutor(workers, thread_name_prefix=f"{prefix} (ThreadPoolExecutor-{next(_pools)})",
                                  initializer=initializer, initargs=initargs)
        gate = threading.Barrier(workers + 1, timeout=FORK_WAIT_SECONDS)
        try:
            for _ in range(workers):
                pool.submit(gate.wait)
        except BaseException:  # h144: a thread could not start (process limit): the started ones waited
            gate.abort()  # FORK_WAIT_SECONDS at the barrier, and the process as long at exit
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        gate.wait()
    return pool


def stop_executor(pool: ThreadPoolExecutor, cancel_futures: bool = False) -> None:
    """``pool.shutdown(wait=True)`` inside :func:`churn` (call when no task is running)."""
    with churn():
        pool.shutdown(wait=True, cancel_futures=cancel_futures)


def _before_fork() -> None:
    if getattr(_held, "depth", 0):  # forking from inside a section: nothing of ours to wait for
        return
    _fork["acquired"] = _churn.acquire(timeout=FORK_WAIT_SECONDS)
    if not _fork["acquired"]:
        log.warning("checkrun: forking while a background thread still starts or ends threads")


def _after_in_parent() -> None:
    if _fork["acquired"]:
        _fork["acquired"] = False
        _churn.release()


def _after_in_child() -> None:
    global _churn, _held
    _churn, _held, _fork["acquired"] = threading.Lock(), threading.local(), False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
