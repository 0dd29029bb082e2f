"""Step 4/5 on a local disk: THE atomic file write (temp file in the target's directory, fsync,
rename) and the directory fsync that makes a rename durable.

Used by the rename commit (``commit.RenameCommit``: blobs, manifests, lease objects) and by the
CLI's local outputs (``ckpt-convert``/export files), so that every file checkrun creates on a
local disk appears whole or not at all and leaves no temp file behind on any error.
"""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import BinaryIO, Callable, Optional

from .owner import temp_tag
from .paths import TMP_MARK


def temp_prefix(name: str) -> str:
    """``.<name>`` cut to 64 bytes (whole characters): with the tag and uuid a temp file's name stays
    within the 255 bytes a file name may have, whatever characters ``name`` uses."""
    return "." + os.fsencode(name)[:64].decode("utf-8", "ignore")


def temp_path(path: str, tmp_prefix: Optional[str] = None) -> str:
    """A fresh temp file name next to ``path``: ``<dir>/<prefix>.tmp-<owner tag>-<uuid>``.

    The prefix defaults to ``.<file name>``; the owner tag names this process, so garbage
    collection deletes the temp files of processes that ended (``owner``, ``Store.list_temp_files``)."""
    directory, base = os.path.split(path)
    prefix = temp_prefix(base) if tmp_prefix is None else tmp_prefix
    return os.path.join(directory, f"{prefix}{TMP_MARK}{temp_tag()}-{uuid.uuid4().hex}")


def write_atomic(path: str, produce: Callable[[BinaryIO], object], *, fsync: bool = True,
                 tmp_prefix: Optional[str] = None,
                 opener: Optional[Callable[[str], BinaryIO]] = None,
                 before_replace: Optional[Callable[[], None]] = None,
                 replace: Optional[Callable[[str, str], None]] = None) -> None:
    """Make the local file ``path`` hold what ``produce(f)`` writes, atomically.

    ``produce`` writes into a temp file in ``path``'s directory (which must exist), opened by
    ``opener`` (default ``open(tmp, "wb")``; a filesystem's ``open`` gets the umask and lets tests
    inject faults). The file is flushed, fsynced if ``fsync``, then ``before_replace()`` runs (the
    commit fence) and ``replace(tmp, path)`` (default ``os.replace``) renames it. On any error,
    ^C included, the temp file is removed and the error raised. The directory is not fsynced:
    callers batch that (``fsync_dir``)."""
    tmp = temp_path(path, tmp_prefix)
    try:
        with (opener or _open_new)(tmp) as f:
            produce(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        (replace or os.replace)(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never leave a temp file (ENOSPC, EACCES, ^C)
            os.remove(tmp)
        raise


def _open_new(path: str) -> BinaryIO:
    return open(path, "wb")


def fsync_dir(directory: str) -> None:
    """Make the directory entries (renames, new files) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # platforms that cannot open directories (Windows) have no directory fsync
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
