"""The step logs open in this process, per optimizer, and where closed ones ended (``ENDED``): what a
later log or replay of the same optimizer, or a replay of another optimizer in the same directory, needs
to find. Training thread (``close`` of a log may come from any thread)."""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

import torch

from ..saving import inflight
from ..storage.paths import STEPLOG_DIR
from ..storage.store import Store
from .index import dir_key

log = logging.getLogger("ckpt_core")
_ACTIVE: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
"""Per optimizer, its open ``StepLog``."""


def log_store(store: Store) -> Store:
    """The store of ``<dir>/.checkrun/steplog`` for the checkpoint directory ``store``."""
    return store.at(store.root.rstrip("/") + "/" + STEPLOG_DIR)


def active_log(optimizer: Any) -> "Any":
    return _ACTIVE.get(optimizer)


def open_logs(store: Store) -> list[Any]:
    """The logs of this process (any engine) open in the checkpoint directory of ``store``."""
    return [lg for lg in list(_ACTIVE.values()) if lg.key == dir_key(store) and not lg._stop.is_set()]


def _close_under(prefix: str) -> None:
    """``shutil.rmtree`` of ``prefix`` (an ``inflight`` key) is about to delete the logs open under it."""
    for lg in list(_ACTIVE.values()):
        if not lg._stop.is_set() and inflight._key(lg.store.url("").rstrip("/") + "/").startswith(prefix):
            log.info("checkrun: closing the step log of %s: its directory is being deleted", lg.store.url(""))
            lg._close(check=False)  # its error stays for its owner's next close(); inflight logs one of closing


inflight.before_rmtree(_close_under)

#: Per optimizer, per directory: where its last log there ended when closed, and the optimizer's
#: ``fingerprint`` then (a log opened later continues that chain while the fingerprint holds).
ENDED: "weakref.WeakKeyDictionary[Any, dict[str, tuple]]" = weakref.WeakKeyDictionary()


# torch's wrapper that runs the step hooks around a class's step(): a subclass whose step() calls
# super().step() runs the hooks once per class, nested (found by checking a step that raises)
_HOOK_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__


def _inner_call(optimizer: Any) -> bool:
    """Whether the step hook being run belongs to a ``step()`` called inside another ``step()`` of
    ``optimizer`` (a subclass's ``super().step()``): only the outermost one is logged, as replay
    calls it. Walks the caller's frames (a few microseconds per step)."""
    outer, frame = 0, sys._getframe(2)
    while frame is not None:
        if frame.f_code is _HOOK_WRAPPER and frame.f_locals.get("self") is optimizer:
            outer += 1
            if outer > 1:
                return True
        frame = frame.f_back
    return False
