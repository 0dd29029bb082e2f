"""Process-wide registry of saves in flight (step 1-5 of a save, any engine of this process).

Why process-wide: Lightning and Accelerate users save with one object and load with another (a second
Trainer's ``ckpt_path=``, ``load_from_checkpoint``, another Accelerator). A load, remove or existence
check of a path must see a save to it that any engine of this process has not committed yet.

Keys are store URLs (``Store.url(name)``), the same string a ``SaveHandle.path`` holds. Called from
any thread. A forked child (DataLoader workers) starts with an empty registry: it inherits no
engine obligations (``lifecycle`` clears it after fork).
"""
from __future__ import annotations

import collections
import os
import threading

_cond = threading.Condition()
_paths: collections.Counter = collections.Counter()


def begin(url: str) -> None:
    """Record a save to ``url`` (called by the engine before ``save`` returns)."""
    with _cond:
        _paths[url] += 1


def end(url: str) -> None:
    """The save to ``url`` committed or failed: wake whoever waits for it."""
    with _cond:
        _paths[url] -= 1
        if _paths[url] <= 0:
            del _paths[url]
        _cond.notify_all()


def pending(url: str) -> bool:
    """True while a save to ``url`` is in flight in this process."""
    with _cond:
        return _paths[url] > 0 if url in _paths else False


def pending_under(prefix: str) -> list[str]:
    """URLs with a save in flight whose URL starts with ``prefix`` (a directory's URL)."""
    with _cond:
        return [u for u in _paths if u.startswith(prefix)]


def wait(url: str, timeout: float | None = None) -> bool:
    """Block until no save to ``url`` is in flight; False on timeout."""
    with _cond:
        return _cond.wait_for(lambda: url not in _paths, timeout)


def wait_under(prefix: str, timeout: float | None = None) -> bool:
    """Block until no save to a URL under ``prefix`` is in flight; False on timeout."""
    with _cond:
        return _cond.wait_for(lambda: not any(u.startswith(prefix) for u in _paths), timeout)


def _reset_in_child() -> None:
    # The parent's saves belong to the parent: a child never waits for them (and its copy of the
    # condition's lock may have been held by a parent thread at fork time).
    global _cond, _paths
    _cond, _paths = threading.Condition(), collections.Counter()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


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
