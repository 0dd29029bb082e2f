"""Process-wide registry of saves in flight (step 1-5 of a save, any engine of this process).

Why process-wide: Lightning and Accelerate users save with one object and load with another (a second
Trainer's ``ckpt_path=``, ``load_from_checkpoint``, another Accelerator). A load, remove or existence
check of a path must see a save to it that any engine of this process has not committed yet.

Keys are store URLs (``Store.url(name)``), the same string a ``SaveHandle.path`` holds. Called from
any thread. A forked child (DataLoader workers, Lightning's ddp_fork ranks) starts with an empty
registry: it inherits no engine obligations. But it may load what the parent is still saving
(``trainer.save_checkpoint(p)`` then ``validate(ckpt_path=p)`` with ddp_fork forks the ranks at
once): each save in flight holds a pipe whose write end only the parent keeps (a child closes its
copy at fork); a child's ``wait`` of a URL the parent was saving at fork time reads the pipe, which
ends when the parent's save ends (or the parent dies).

Across processes: under torch.distributed (world > 1) a save is also counted in the job's key-value
store (per URL and in total), ``wait`` waits for the other processes' saves of that URL too, and
``wait_job`` for all of them. Lightning's DDP saves on rank 0 only and then every rank loads
(``trainer.save_checkpoint(p)`` then ``validate(ckpt_path=p)``): rank 1 read before rank 0's save
committed. Lightning's ``save_checkpoint`` ends in a barrier, so the count is there before any
other rank looks. And at the end of ``fit`` rank 1 went on while rank 0 still wrote: a second
``fit(ckpt_path="last")`` on rank 1 found no ``last.ckpt`` and trained from step 0, out of step with
rank 0 (the plugin's teardown now calls ``wait_job`` on every rank).

Deleting: ``shutil.rmtree`` of a directory (``tempfile.TemporaryDirectory`` at the end of its
block) waits for this process's saves in flight under it (``_rmtree_after_saves``, installed at
import): otherwise the writer creates files in the tree being deleted ("Directory not empty").
"""
from __future__ import annotations

import collections
import logging
import os
import select
import shutil
import threading
import time
from typing import Any, Callable

log = logging.getLogger("ckpt_core")
#: Longest pause between two looks at another process's count (starting at 1 ms, doubling).
SHARED_POLL_SECONDS = 0.05

_cond = threading.Condition()
_paths: collections.Counter = collections.Counter()
_pipes: dict[str, collections.deque] = {}
"""URL -> (read fd, write fd) of each of its saves in flight, oldest first (see the module docstring)."""
_keys: dict[str, collections.deque] = {}
"""URL as given to ``begin`` -> the key each of its saves in flight was registered under, oldest first."""
_parents: dict[str, list[int]] = {}
"""In a forked child: URL -> read fds of the saves the parent had in flight at fork time."""
_counted: dict[str, collections.deque] = {}
"""URL -> the key-value store each of its saves in flight was counted in (None: none), oldest
first: ``end`` takes the count back where ``begin`` put it, even if the process group changed
in between (destroyed, or another one initialized), instead of driving a new job's count below
zero, which would hide that job's next save from its loads."""


def _key(url: str) -> str:
    """The registry's key of ``url``: one file spelt several ways (``run/./a.ckpt``,
    ``run/sub/../a.ckpt``, a symlinked directory) is one key; local paths are resolved, URLs of
    other filesystems are kept as given (an object store's ``a/./b`` is another object)."""
    if "://" in url and not url.startswith("file://"):
        return url
    path = url.removeprefix("file://")
    if path.endswith("/"):
        return os.path.realpath(path) + "/"
    head, name = os.path.split(path)  # the file itself is not resolved: a symlink (save_last="link") is its own name
    return os.path.join(os.path.realpath(head or "."), name)


def begin(url: str) -> None:
    """Record a save to ``url`` (called by the engine before ``save`` returns)."""
    given, url = url, _key(url)
    store = _shared_store()
    with _cond:
        _keys.setdefault(given, collections.deque()).append(url)
        _paths[url] += 1
        _counted.setdefault(url, collections.deque()).append(store)
        _pipes.setdefault(url, collections.deque()).append(_pipe())
    _shared_add(store, url, 1)


def _pipe() -> tuple[int, int] | None:
    try:
        return os.pipe()  # not inherited across exec
    except OSError as exc:  # out of descriptors: a forked child then does not wait for this save
        log.debug("checkrun: no pipe for a save in flight: %s", exc)
        return None


def end(url: str) -> None:
    """The save to ``url`` committed or failed: wake whoever waits for it."""
    with _cond:
        keys = _keys.get(url)
        given, url = url, keys.popleft() if keys else _key(url)  # the key ``begin`` used, whatever moved since
        if not keys:
            _keys.pop(given, None)
        _paths[url] -= 1
        if _paths[url] <= 0:
            del _paths[url]
        stores = _counted.get(url)
        store = stores.popleft() if stores else None
        if not stores:
            _counted.pop(url, None)
        pipes = _pipes.get(url)
        pipe = pipes.popleft() if pipes else None
        if not pipes:
            _pipes.pop(url, None)
        for fd in pipe or ():
            os.close(fd)  # the write end's close is what a forked child's wait reads
        _cond.notify_all()
    _shared_add(store, url, -1)


def pending(url: str) -> bool:
    """True while a save to ``url`` is in flight in this process."""
    url = _key(url)
    with _cond:
        return _paths[url] > 0 if url in _paths else False


def pending_under(prefix: str) -> list[str]:
    """URLs (resolved, see ``_key``) with a save in flight under ``prefix`` (a directory's URL)."""
    prefix = _key(prefix)
    with _cond:
        return [u for u in _paths if u.startswith(prefix)]


def wait(url: str, timeout: float | None = None) -> bool:
    """Block until no save to ``url`` is in flight in this process or, under torch.distributed, in
    another process of the job; False on timeout."""
    url = _key(url)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cond:
        if not _cond.wait_for(lambda: url not in _paths, timeout):
            return False
    if not _wait_parent([url], deadline):
        return False
    pause = 0.001
    while _shared_add(_shared_store(), url, 0) > 0:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)  # another process's save: nothing to be woken by here
        pause = min(2 * pause, SHARED_POLL_SECONDS)
    return True


def wait_here(timeout: float | None = None) -> bool:
    """Block until no save is in flight in this process (any URL); False on timeout."""
    with _cond:
        return _cond.wait_for(lambda: not _paths, timeout)


def _shared_store() -> Any:
    """The job's key-value store under torch.distributed with world > 1 (else None)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no usable store: this process only
        return None


def wait_job(timeout: float | None = None) -> bool:
    """Block until no save is in flight in this process or, under torch.distributed, in any process
    of the job (e.g. rank 0's saves, at every rank's end of ``fit``); False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cond:
        if not _cond.wait_for(lambda: not _paths, timeout):
            return False
    pause = 0.001
    while _shared_add(_shared_store(), None, 0) > 0:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, SHARED_POLL_SECONDS)
    return True


def _shared_add(store: Any, url: str | None, delta: int) -> int:
    """Add ``delta`` to the job-wide count in ``store`` of saves to ``url`` in flight (``url`` None:
    of all saves; a URL's change is added to the total too); the count (0 without a store)."""
    if store is None:
        return 0
    prefix = _shared_prefix()
    try:
        if url is None or delta:
            total = int(store.add(f"{prefix}-total", delta))
            if url is None:
                return total
        return int(store.add(f"{prefix}/{url}", delta))
    except Exception as exc:  # noqa: BLE001 - the store's host ended: no other process to wait for
        log.debug("checkrun: cannot count the save of %s across processes: %s", url, exc)
        return 0


def _shared_prefix() -> str:
    """The keys' prefix: of this attempt of a torchelastic job (``torchrun --max-restarts``), whose
    restarted workers reuse the agent's store, where a killed rank's count of a save in flight would
    stay for good (every load of that path, and every end of ``fit``, waited for ever)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"checkrun-inflight@{attempt}" if attempt else "checkrun-inflight"


def wait_under(prefix: str, timeout: float | None = None) -> bool:
    """Block until no save to a URL under ``prefix`` is in flight (in a forked child: nor one the
    parent had in flight at fork time); False on timeout."""
    prefix = _key(prefix)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _cond:
        if not _cond.wait_for(lambda: not any(u.startswith(prefix) for u in _paths), timeout):
            return False
    return _wait_parent([u for u in list(_parents) if u.startswith(prefix)], deadline)


def _wait_parent(urls: list[str], deadline: float | None) -> bool:
    """In a forked child: wait for the parent's saves to ``urls`` that were in flight at fork time."""
    for url in urls:
        for fd in list(_parents.get(url, ())):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return False
            with _cond:  # ended (EOF) or the parent died: never wait for it again
                if fd in _parents.get(url, ()):
                    _parents[url].remove(fd)
                    os.close(fd)
    return True


_forking = {"held": False}


def _before_fork() -> None:
    # No begin/end half done: every save's pipe is registered, or not yet made. Bounded: the lock is
    # only held for a few dict operations, but a fork must never hang on it.
    _forking["held"] = _cond.acquire(timeout=5.0)


def _after_fork_in_parent() -> None:
    if _forking["held"]:
        _forking["held"] = False
        _cond.release()


def _reset_in_child() -> None:
    # The parent's saves belong to the parent: a child never finishes them, only waits for them to
    # end (its copies of their write ends are closed, so only the parent's close ends a pipe). A child
    # that starts a process group of its own (ddp_fork ranks) counts its own saves there.
    global _cond, _paths, _counted, _pipes, _parents, _keys
    _forking["held"] = False
    parents: dict[str, list[int]] = {url: list(fds) for url, fds in _parents.items()}
    for url, pipes in _pipes.items():
        for pipe in pipes:
            if pipe is not None:
                os.close(pipe[1])
                parents.setdefault(url, []).append(pipe[0])
    _cond, _paths, _counted, _pipes, _parents, _keys = (threading.Condition(), collections.Counter(), {}, {},
                                                        parents, {})


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_reset_in_child)


# -- deleting a directory a save is writing into ---------------------------------------------------
_RMTREE = shutil.rmtree
_OWN_THREADS = ("checkrun", "accelerate-ckpt")
_BEFORE_RMTREE: list[Callable[[str], None]] = []


def before_rmtree(hook: Callable[[str], None]) -> None:
    """Have ``hook(prefix)`` run before ``shutil.rmtree`` deletes a directory (``prefix``: its key, with a
    trailing ``/``), after the saves in flight under it committed: the step log closes its logs there."""
    _BEFORE_RMTREE.append(hook)


def _rmtree_after_saves(path: Any, *args: Any, **kwargs: Any) -> Any:
    """``shutil.rmtree`` that first waits for this process's saves in flight under ``path``.

    Users delete a checkpoint directory right after saving into it (``with TemporaryDirectory()``
    around a training script, accelerate's own tests): the background writer then created files
    and directories in the tree being deleted, and rmtree failed with "Directory not empty" (11 of
    20 runs of 11 ``save_state`` calls with ``total_limit=2`` in a TemporaryDirectory). Calls from
    checkrun's own threads (named ``checkrun-...``; the Accelerate adapter's ``accelerate-ckpt-commit``,
    whose retention removes folders while it commits) and ``dir_fd``-relative ones do not wait: a
    save's own work never waits for that save. The ``before_rmtree`` hooks then run (the step logs
    open under ``path`` are closed: their writer created segments there too, found by an independent
    check with ``step_log.enabled`` and a ``TemporaryDirectory``)."""
    if kwargs.get("dir_fd") is None and not threading.current_thread().name.startswith(_OWN_THREADS):
        prefix: Any = None
        try:
            prefix = os.fspath(path)
            waits = isinstance(prefix, str) and bool(_paths) and bool(pending_under(prefix.rstrip("/") + "/"))
        except (TypeError, ValueError, OSError):
            waits = False
        if waits:
            log.info("checkrun: %s: waiting for the saves in flight under it before deleting it", prefix)
            wait_under(prefix.rstrip("/") + "/")
        if _BEFORE_RMTREE and isinstance(prefix, str) and not os.path.islink(prefix):  # rmtree refuses links
            for hook in _BEFORE_RMTREE:
                try:
                    hook(_key(prefix.rstrip("/") + "/"))
                except Exception as exc:  # noqa: BLE001 - the user's rmtree goes on
                    log.warning("checkrun: %s: before deleting it: %s", prefix, exc)
    return _RMTREE(path, *args, **kwargs)


_rmtree_after_saves.avoids_symlink_attacks = getattr(_RMTREE, "avoids_symlink_attacks", False)  # type: ignore[attr-defined]
_rmtree_after_saves.__wrapped__ = _RMTREE  # type: ignore[attr-defined]
if getattr(shutil.rmtree, "__wrapped__", None) is None:
    shutil.rmtree = _rmtree_after_saves


def _url(path: "str | os.PathLike", storage_options: dict | None) -> str:
    from ..config import StorageConfig
    from ..storage.store import Store

    text = os.fspath(path)
    try:
        store, name = Store.for_path(text, storage_options, StorageConfig())
    except Exception:  # noqa: BLE001 - not a checkpoint path we could be saving to
        return text
    return store.url(name)


def save_in_flight(path: "str | os.PathLike", storage_options: dict | None = None) -> bool:
    """Whether any engine of this process has a save to ``path`` that is not committed yet.

    Frameworks' callbacks count such a path as existing (Lightning's ``ModelCheckpoint`` picks
    ``-vN`` names with it). Called from any thread."""
    return pending(_url(path, storage_options))


def wait_for_save(path: "str | os.PathLike", storage_options: dict | None = None,
                  timeout: float | None = None) -> bool:
    """Block until no engine of this process has a save to ``path`` in flight; False on timeout.

    Does not raise the save's error (its engine surfaces it once, at its next call)."""
    return wait(_url(path, storage_options), timeout)
