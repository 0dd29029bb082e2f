"""Storage (any stage): deleting a local blob within a collection's deletion window, even when the
collecting process pauses between its window check and the deletion.

A collection deletes a blob only within its round's window (``retain.leases``); a save that reuses a
blob waits out the windows it saw, then checks that the blob exists. A collector paused right after
its window check (SIGSTOP, a suspended job, a frozen VM, a stalled call) deleted the blob once it
woke, long after its window, under a checkpoint committed meanwhile that reused it (found by an
independent fault program). On a local filesystem the blob is therefore first *moved aside* (an
atomic rename to a temp name), the window is checked again, and only then is it deleted; a move that
came after the window is undone (``put_back``). A process killed between the move and the second
check leaves the temp file: garbage collection's temp-file pass puts it back when the blob is missing
(``Store.delete_temp_file``), else deletes it. Object stores have no atomic rename: there, a deletion
issued after the window stays the documented limit (docs/operations.md).
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

from .atomic import temp_path, temp_prefix

log = logging.getLogger("ckpt_core")

_MARK = ".gc"
_ASIDE_RE = re.compile(r"\.([0-9a-f]+)\.gc\.tmp-[0-9a-fps-]+")


def remove_within(fs: Any, path: str, guard: Callable[[], None], remove: Callable[[str], None]) -> None:
    """Delete the local blob ``path`` only if ``guard`` (the window check) still passes once the blob
    is out of the way; otherwise give it back its name and raise what ``guard`` raised."""
    aside = temp_path(path, temp_prefix(os.path.basename(path)) + _MARK)
    try:
        fs.mv(path, aside)
    except FileNotFoundError:
        return
    try:
        guard()
    except BaseException:
        put_back(aside, path, remove)
        raise
    remove(aside)


def original(path: str) -> str | None:
    """The blob path that ``path`` was moved aside from, if it is such a temp file."""
    directory, name = os.path.split(path)
    found = _ASIDE_RE.fullmatch(name)
    return None if found is None else os.path.join(directory, found.group(1))


def put_back(aside: str, path: str, remove: Callable[[str], None]) -> None:
    """Give the moved-aside blob its name back, unless a save wrote it again meanwhile (the same bytes:
    a blob is named by its content; never replaced), then drop the temp file."""
    try:
        os.link(aside, path)  # fails if the name exists: never replaces a blob written since
        log.warning("checkrun: put back blob %s, moved aside by a collection whose window ended before it "
                    "deleted it (a checkpoint may reference it)", path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        return
    except OSError:  # no hard links on this filesystem
        if os.path.exists(path):
            remove(aside)
            return
        os.rename(aside, path)
        return
    remove(aside)
