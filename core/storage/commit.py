"""Step 5's medium: how one file is made to appear atomically, as named strategies.

A ``Store`` chooses its strategy once, from its filesystem (``choose``):

* ``RenameCommit`` (local disks, where a written file is visible while it is written): a temp file
  in the final directory, fsynced, renamed over the target (``atomic.write_atomic``), then the
  directory fsynced - at once, or for blobs batched into ``sync`` before the manifest commit.
  Interrupted writes can leave temp files; ``scan_temp_files`` finds them for the janitor.
* ``SinglePutCommit`` (object stores, ``memory://``): one ``pipe_file``, atomic by itself. For a
  manifest on S3 the chunk size is raised so that s3fs never turns it into a multipart upload.
  No temp files ever.

Both run the commit's ``guard`` (``saving.fence.commit_guard``) as the last step before the
rename/PUT, and with ``resolve`` a rename/PUT that reports an error is checked by reading the
target back: if it holds exactly the bytes written, it landed (a lost response) and counts as done.
Methods may be called from any thread.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from typing import Any, Callable, Optional

import fsspec

from ..config import StorageConfig
from . import atomic
from .paths import BLOB_DIR, LEASE_DIR, STEPLOG_DIR, FileInfo, find_shards, is_local_fs, is_s3_fs, is_temp_file, join, mtime

_LOG = logging.getLogger("ckpt_core.storage.store")
# s3fs switches to multipart upload at 2*chunksize; a manifest must be one PUT (5 GiB max).
_S3_SINGLE_PUT_CHUNKSIZE = 5 * 2**30

Guard = Optional[Callable[[], None]]
Data = "bytes | memoryview | list[bytes | memoryview]"
"""What a write takes: the bytes, or a list of parts that follow each other (written one after another on
a local disk, joined for a PUT: the step log's segments, whose megabytes are not copied once more)."""


def joined(data: Any) -> bytes | memoryview:
    """``data`` (``Data``) as one buffer."""
    return b"".join(data) if isinstance(data, list) else data


def _write_all(f: Any, data: Any) -> None:
    for part in (data if isinstance(data, list) else (data,)):
        f.write(part)


class CommitStrategy:
    """How a file appears atomically on one filesystem (see the module docstring).

    ``display`` turns a filesystem path into what users see; ``holds(path, data)`` answers
    whether ``path`` holds exactly ``data`` now (one read, errors count as no)."""

    name = "abstract"
    leaves_temp_files = False
    """Whether an interrupted write can leave a temp file behind (that the janitor deletes)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, config: StorageConfig,
                 display: Callable[[str], str], holds: Callable[[str, bytes | memoryview], bool]) -> None:
        self.fs, self.config, self._display, self._holds = fs, config, display, holds

    def write(self, path: str, data: Data, *, single_put: bool, tmp_prefix: str = "",
              defer_dir_sync: bool = False, guard: Guard = None, resolve: bool = False) -> None:
        """Make ``path`` hold ``data`` atomically. ``single_put``: the object must be one PUT
        (manifests, leases); ``tmp_prefix`` starts the temp file name; ``defer_dir_sync`` leaves
        the directory fsync to ``sync``; ``guard`` and ``resolve`` as in the module docstring."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make the writes deferred by ``defer_dir_sync`` durable (no-op where nothing is deferred)."""

    def scan_temp_files(self, root: str) -> list[FileInfo]:
        """Temp files interrupted writes left in ``root``, its blob store, lease and step-log directories."""
        return []

    def _apply(self, path: str, data: Data, resolve: bool, step: Callable[[], Any]) -> None:
        """Run the step that makes ``path`` hold ``data`` (rename, PUT). If it fails and ``resolve``,
        look whether it was applied anyway (its answer lost): then it counts as done."""
        try:
            step()
        except Exception as exc:
            if not resolve or not self._holds(path, data):
                raise
            _LOG.warning("%s: the commit reported %s: %s, but it landed (the file holds exactly this "
                         "save's bytes): committed", self._display(path), type(exc).__name__, exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fs.protocol!r})"


class RenameCommit(CommitStrategy):
    """Local disks: temp file + fsync + rename + directory fsync (``storage.fsync`` decides the fsyncs)."""

    name = "rename"
    leaves_temp_files = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._unsynced: set[str] = set()  # blob directories whose new entries are not fsynced yet

    def write(self, path: str, data: Data, *, single_put: bool, tmp_prefix: str = "",
              defer_dir_sync: bool = False, guard: Guard = None, resolve: bool = False) -> None:
        # The temp file is opened through the filesystem object, so it gets the process umask like
        # any open() and a wrapped filesystem can inject faults; ``guard`` runs between its fsync
        # and the rename.
        directory = os.path.dirname(path)
        for again in (False, True):
            try:
                self._makedirs(directory)
                atomic.write_atomic(path, lambda f: _write_all(f, data), fsync=self.config.fsync, tmp_prefix=tmp_prefix,
                                    opener=lambda tmp: self.fs.open(tmp, "wb"), before_replace=guard,
                                    replace=lambda tmp, dst: self._apply(dst, data, resolve,
                                                                         lambda: os.replace(tmp, dst)))
                break
            except FileNotFoundError as exc:
                # The temp file (or its directory) vanished before the rename: a collection took it
                # while this writer was stopped for longer than retention.lease_seconds, or the folder
                # was removed meanwhile (Lightning's tuner cleanup, a user). Written again; the save's
                # lapsed lease then has every blob checked before the commit (lease.py).
                if again:
                    raise
                _LOG.warning("checkrun: %s: its temp file was deleted before the rename (%s); writing it again",
                             self._display(path), exc)
        if self.config.fsync:
            if defer_dir_sync:
                with self._lock:
                    self._unsynced.add(directory)
            else:
                atomic.fsync_dir(directory)

    def sync(self) -> None:
        with self._lock:
            dirs, self._unsynced = self._unsynced, set()
        for d in sorted(dirs):
            atomic.fsync_dir(d)

    def scan_temp_files(self, root: str) -> list[FileInfo]:
        root = root.rstrip("/")
        out = []
        listing = lambda d: self.fs.ls(d, detail=True)  # noqa: E731
        for base, finder in ((root, listing), (join(root, BLOB_DIR), lambda d: find_shards(self.fs, d)),
                             (join(root, LEASE_DIR), listing), (join(root, STEPLOG_DIR), listing)):
            self.fs.invalidate_cache(base)
            try:
                found = finder(base)
            except FileNotFoundError:
                continue
            for info in found.values() if isinstance(found, dict) else found:
                path = info["name"]
                if info.get("type") == "file" and is_temp_file(path.rsplit("/", 1)[-1]):
                    out.append(FileInfo(path[len(root) + 1:], int(info.get("size") or 0), mtime(info)))
        return out

    def _makedirs(self, directory: str) -> None:
        created = make_local_dirs(directory)
        if self.config.fsync:
            # A new directory is durable only once the entry in its parent is.
            for d in created:
                atomic.fsync_dir(os.path.dirname(d))


def make_local_dirs(directory: str) -> list[str]:
    """``os.makedirs(directory, exist_ok=True)`` on the local disk, each new folder shared as its parent is
    (``_share_like_parent``); the folders it made, outermost first."""
    created = []
    d = directory
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    if created:
        os.makedirs(directory, exist_ok=True)
    for d in reversed(created):
        _share_like_parent(d)
    return created[::-1]


def _share_like_parent(path: str) -> None:
    """A directory made in a group-shared one (setgid, group-writable: ``chmod 2775``) is group-writable
    too, whatever the umask of the process that made it (h144: a teammate's umask 022 made
    ``.checkrun/blobs/<xx>/`` that nobody else in the group could write or collect in; ``torch.save``
    writes only into the directory itself, which the group can write)."""
    try:
        parent = os.stat(os.path.dirname(path)).st_mode
        if parent & stat.S_ISGID and parent & stat.S_IWGRP:
            mode = os.stat(path).st_mode
            if (mode | parent) & 0o070 != mode & 0o070:
                os.chmod(path, (mode & 0o7777) | (parent & 0o070))
    except OSError:  # made by another user meanwhile, or gone: theirs to set
        pass


class SinglePutCommit(CommitStrategy):
    """Object stores and ``memory://``: one ``pipe_file`` is atomic by itself."""

    name = "single-put"

    def write(self, path: str, data: Data, *, single_put: bool, tmp_prefix: str = "",
              defer_dir_sync: bool = False, guard: Guard = None, resolve: bool = False) -> None:
        # bytes: botocore and other clients do not all accept memoryview bodies
        body = joined(data)
        body = bytes(body) if isinstance(body, memoryview) else body
        # One PUT up to S3's 5 GiB, blobs too: an interrupted multipart upload (a failed complete, a
        # killed writer) leaves parts that bill like objects and that no listing, hence no gc, sees.
        one_put = is_s3_fs(self.fs) and (single_put or len(body) <= _S3_SINGLE_PUT_CHUNKSIZE)
        kwargs = {"chunksize": _S3_SINGLE_PUT_CHUNKSIZE} if one_put else {}
        for attempt in range(CONDITION_ATTEMPTS):
            # A guarded PUT on S3 is conditional on the object the guard looked at (its ETag, taken first;
            # absent: none may appear): a writer paused between the guard and the PUT, or inside s3fs's
            # retries of it, replaced a newer manifest a restarted trainer had committed meanwhile (found by
            # an independent check). A failed condition means it changed: the guard looks again.
            condition = self._condition(path) if guard is not None and one_put else {}
            if guard is not None:
                guard()  # as close to the PUT as a check can be: see saving/fence.py
            try:
                self._apply(path, data, resolve, lambda: self.fs.pipe_file(path, body, **kwargs, **condition))
                return
            except OSError as exc:
                if not condition or attempt == CONDITION_ATTEMPTS - 1:
                    raise
                if _answer(exc) in _UNSUPPORTED:  # a store refusing conditional writes: as before, with a warning
                    _LOG.warning("checkrun: %s does not take conditional writes (%s): committing without; a writer "
                                 "paused before its PUT may replace a newer manifest of that name", self._display(path), exc)
                    self._conditional = False
                elif _answer(exc) not in _CHANGED:
                    raise
            finally:
                self.fs.invalidate_cache(path)

    def _condition(self, path: str) -> dict:
        """The PUT condition that ``path`` is still what it is now: ``IfMatch`` its ETag, or ``IfNoneMatch``."""
        if not getattr(self, "_conditional", True):
            return {}
        self.fs.invalidate_cache(path)
        try:
            etag = self.fs.info(path).get("ETag")
        except FileNotFoundError:
            etag = None
        if not _client_takes_conditions(self.fs):  # an older botocore drops them in silence (s3fs filters kwargs)
            _LOG.warning("checkrun: this botocore cannot send conditional PUTs (PutObject IfMatch, botocore >= 1.35.x); "
                         "committing manifests without: a writer paused before its PUT may replace a newer manifest "
                         "of that name. Upgrade s3fs/aiobotocore/botocore to close that window")
            self._conditional = False
            return {}
        return {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}


def _client_takes_conditions(fs: Any) -> bool:
    """Whether the s3fs client's botocore knows PutObject's ``IfMatch``/``IfNoneMatch`` (unknown: assume so)."""
    try:
        members = fs.s3.meta.service_model.operation_model("PutObject").input_shape.members
    except Exception:  # noqa: BLE001 - not an s3fs client we can inspect
        return True
    return "IfMatch" in members and "IfNoneMatch" in members


#: Conditional PUTs of one manifest tried before a commit gives up (each failed one: another writer's commit).
CONDITION_ATTEMPTS = 5
_CHANGED = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "409", "404")
"""Answers to a conditional PUT that mean the object changed since its ETag was read (412; 409: a racing
conditional write, which AWS says to retry; 404: deleted meanwhile): the check runs again."""
_UNSUPPORTED = ("NotImplemented", "InvalidArgument", "InvalidRequest", "400", "501")
"""Answers of S3-compatible stores that do not take ``If-Match``/``If-None-Match`` on a PUT (AWS, MinIO and R2 do)."""


def _answer(exc: BaseException) -> str | None:
    """The S3 error code behind an s3fs error (its cause chain), e.g. ``PreconditionFailed``; None if none."""
    seen = exc
    for _ in range(8):
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return "PreconditionFailed" if code == "PreconditionFailed" or status == 412 else code or str(status)
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            return "PreconditionFailed" if isinstance(exc, FileExistsError) else None
    return None


def choose(fs: fsspec.AbstractFileSystem) -> type[CommitStrategy]:
    """The strategy for ``fs``: rename on local disks, a single PUT everywhere else."""
    return RenameCommit if is_local_fs(fs) else SinglePutCommit
