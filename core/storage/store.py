"""One checkpoint directory on any fsspec filesystem: manifests, content-addressed blobs, a pool.

Layout: ``run/<name>.ckpt`` manifests (a manifest is the checkpoint and appears only when
complete) next to ``run/.checkrun/blobs/ab/cdef...`` blobs shared by all manifests in ``run/``.
Atomicity: on local filesystems a file is written to a hidden temp file in its final directory,
fsynced and ``os.replace``d, then the directory is fsynced; on object stores and ``memory://`` one
``pipe_file`` (for manifests always a single PUT) is atomic by itself. A manifest commit runs its
``guard`` (``fence.commit_guard``) right before the rename/PUT, and a rename/PUT that reports an
error is resolved by reading the manifest back: if it holds exactly the bytes written, it landed.

s3fs answers ``info``/``exists`` from cached directory listings (``dircache``), which would hide
files written or deleted since - by us or by another process. Store invalidates a path's cache
before every query and after every mutation (a no-op for local and memory filesystems).
Every method may be called from any thread, including the pool threads of ``map``.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import logging
import os
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, TypeVar

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from ..config import StorageConfig
from .owner import temp_tag
from ..format.dtypes import is_blob_key
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError
from .retry import call_with_retry

T = TypeVar("T")
R = TypeVar("R")

_LOG = logging.getLogger("ckpt_core.storage.store")
_META_DIR = ".checkrun"
_BLOB_DIR = ".checkrun/blobs"
LEASE_DIR = ".checkrun/leases"
"""Where ``leases`` keeps its objects (its temp files are listed here with the others)."""
_TMP_MARK = ".tmp-"
_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# s3fs switches to multipart upload at 2*chunksize; a manifest must be one PUT (5 GiB max).
_S3_SINGLE_PUT_CHUNKSIZE = 5 * 2**30
_DEFAULT_MANIFEST_MAX = 64 << 20


@dataclass(frozen=True)
class BlobInfo:
    """A blob in the store: its key, size in bytes and modification time (epoch seconds)."""
    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class FileInfo:
    """A regular file directly in the checkpoint directory (normally a manifest)."""
    name: str
    size: int
    mtime: float


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    # Subclasses (other protocol) and wrappers (same protocol) of LocalFileSystem are local too:
    # tests inject faults that way, and they must still get the temp-file + rename commit.
    return isinstance(fs, LocalFileSystem) or bool({"file", "local"} & set(_protocols(fs)))


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts]) if root.rstrip("/") else "/" + "/".join(parts)


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


def _check_name(name: str) -> str:
    """Validate a manifest name: a plain file name inside the directory, never a path."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name or name.startswith(_META_DIR) or _is_temp_name(name)):
        raise UnsafePathError(f"unsafe checkpoint file name {name!r}: must be a plain file name")
    return name


def _to_epoch(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            value = _dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:  # object stores report UTC without saying so
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    return None


def _mtime(info: dict) -> float:
    """Modification time from an fsspec info dict (local 'mtime', s3 'LastModified', memory
    'created', gcs 'updated'). Unknown -> now: garbage collection must never think a blob it
    cannot date is old."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        if info.get(key) is not None:
            stamp = _to_epoch(info[key])
            if stamp is not None:
                return stamp
    return time.time()


def _fsync_dir(directory: str) -> None:
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


#: Least total cost (bytes) of one pool task in ``Store.map(..., cost=...)``. Measured on 2 cores:
#: 1000 blobs of 3 KB loaded with 0.81 ms of CPU each as one task per blob on 4 threads, 0.2 ms on
#: one thread (several threads taking turns at the GIL for tiny blobs cost more than they gain); a
#: task of 4 MiB takes a few ms, so handing it over no longer counts.
BATCH_COST = 4 << 20


def _batches(items: list[T], cost: Callable[[T], int]) -> list[list[T]]:
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


class Store:
    """One checkpoint directory: manifests directly in it, blobs under ``.checkrun/blobs``.

    ``root`` is the directory as the filesystem spells it (``fs._strip_protocol``: an absolute
    path for local, ``bucket/key`` for s3); ``url_prefix`` is put in front of paths to show them
    to users (``"s3://"``; empty for local paths). Build one with ``for_path``/``for_directory``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, config: StorageConfig,
                 url_prefix: str = "") -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.config = config
        self.url_prefix = url_prefix
        self.is_local = _is_local(fs)
        self._is_s3 = bool(_S3_PROTOCOLS & set(_protocols(fs)))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._maps = 0  # map() calls using the pool now: release_idle() leaves their pool alone
        self._unsynced: set[str] = set()  # blob directories whose new entries are not fsynced yet
        self._in_worker = threading.local()
        self._display_root = self._user_root()

    def __repr__(self) -> str:
        return f"Store({self.url('')!r})"

    @classmethod
    def for_path(cls, path: str | os.PathLike, storage_options: Optional[dict],
                 config: StorageConfig) -> tuple["Store", str]:
        """Split a checkpoint path/URL into (store of its parent directory, manifest name).

        ``storage_options`` override ``config.storage_options`` key by key.
        """
        text = os.fspath(path)
        fs, fspath, prefix = cls._resolve(text, storage_options, config)
        parent, _, name = fspath.rstrip("/").rpartition("/")
        if not parent and not fspath.startswith("/"):
            raise UnsafePathError(f"{text!r} does not name a file inside a directory")
        return cls(fs, parent or "/", config, prefix), _check_name(name)

    @classmethod
    def for_directory(cls, directory: str | os.PathLike, storage_options: Optional[dict],
                      config: StorageConfig) -> "Store":
        """The store of a checkpoint directory (path or URL)."""
        fs, fspath, prefix = cls._resolve(os.fspath(directory), storage_options, config)
        return cls(fs, fspath, config, prefix)

    @staticmethod
    def _resolve(text: str, storage_options: Optional[dict],
                 config: StorageConfig) -> tuple[fsspec.AbstractFileSystem, str, str]:
        opts = merge_options(config.storage_options, storage_options)
        fs, fspath = url_to_fs(text, **opts)
        # Keep the user's scheme (even chains such as "simplecache::s3://") for display, except
        # for plain local files: those are shown as absolute paths.
        scheme = text[: text.index("://")] if "://" in text else ""
        if _is_local(fs) and scheme in ("", "file", "local"):
            return fs, fspath, ""
        return fs, fspath, f"{scheme or _protocols(fs)[0]}://"

    def url(self, name: str) -> str:
        """User-facing path/URL of ``name`` in this directory (``url('')`` is the directory)."""
        return self._display(_join(self.root, name) if name else self.root)

    def _display(self, path: str) -> str:
        if not self.url_prefix:
            return path
        if path == self.root or path.startswith(self.root.rstrip("/") + "/"):
            return self._display_root + path[len(self.root):]
        return self.url_prefix + path

    def _user_root(self) -> str:
        """The root as a URL, preferring ``memory://run`` to the equivalent ``memory:///run``."""
        if self.url_prefix and self.root.startswith("/"):
            short = self.url_prefix + self.root.lstrip("/")
            if short != self.url_prefix and self.fs._strip_protocol(short) == self.root:
                return short
        return self.url_prefix + self.root

    def subdirectory(self, name: str) -> "Store":
        """The store of the directory ``name`` inside this one (same filesystem and options)."""
        return Store(self.fs, _join(self.root, _check_name(name)), self.config, self.url_prefix)

    def is_directory(self) -> bool:
        """Whether this store's root exists as a directory (a prefix with objects on S3)."""
        def probe() -> bool:  # not fs.isdir: it answers False for a transient error
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.info(self.root).get("type") == "directory"
            except FileNotFoundError:
                return False

        return bool(self._retry(probe, f"stat {self.url('')}"))

    def blob_path(self, key: str) -> str:
        """Filesystem path of a blob; rejects anything that is not a lowercase hex digest."""
        if not is_blob_key(key):
            raise UnsafePathError(f"unsafe blob key {key!r} in {self.url('')}: "
                                  "expected 32-64 lowercase hex digits")
        return _join(self.root, _BLOB_DIR, key[:2], key[2:])

    def _manifest_path(self, name: str) -> str:
        return _join(self.root, _check_name(name))

    def has_blob(self, key: str) -> bool:
        """Whether the blob exists."""
        path = self.blob_path(key)
        return self._retry(lambda: self._is_file(path), f"check blob {self._display(path)}")

    def put_blob(self, key: str, data: bytes | memoryview) -> None:
        """Write a blob atomically (readers see all of it or nothing); overwrites."""
        path = self.blob_path(key)
        self._retry(lambda: self._write(path, data, single_put=False, defer_dir_sync=True),
                    f"write blob {self._display(path)}")

    def sync(self) -> None:
        """Make the blobs written so far durable: fsync (once each) the directories ``put_blob``
        added entries to. ``write_manifest`` calls it first, so a committed manifest never points
        at a blob a power loss could take back; a process writing blobs for another's manifest
        (DCP ranks) calls it itself. No-op unless local with ``storage.fsync``."""
        with self._pool_lock:
            dirs, self._unsynced = self._unsynced, set()
        for d in sorted(dirs):
            _fsync_dir(d)

    def get_blob(self, key: str, max_bytes: int) -> bytes:
        """Read a blob; a missing one or one larger than ``max_bytes`` is CorruptCheckpointError."""
        path = self.blob_path(key)
        try:
            return self._retry(lambda: self._read(path, max_bytes, "blob"),
                               f"read blob {self._display(path)}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"missing blob {self._display(path)}") from exc

    def get_blob_into(self, key: str, size: int, buf: memoryview) -> bytes | memoryview:
        """Read a blob expected to hold ``size`` bytes; local stores read into ``buf`` (at least
        ``size + 1`` bytes, so a longer file shows) and return the filled part, others return
        ``get_blob``'s bytes. The caller checks the size; errors as ``get_blob``."""
        if not self.is_local:
            return self.get_blob(key, size)
        path = self.blob_path(key)

        def read() -> memoryview:
            try:
                f = self.fs.open(path, "rb")
            except IsADirectoryError as exc:  # not a blob: missing, as get_blob says
                raise FileNotFoundError(str(exc)) from exc
            with f:
                got = 0
                while got < buf.nbytes:
                    n = f.readinto(buf[got:])
                    if not n:
                        break
                    got += n
            return buf[:got]

        try:
            return self._retry(read, f"read blob {self._display(path)}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"missing blob {self._display(path)}") from exc

    def blob_info(self, key: str) -> Optional[BlobInfo]:
        """Size and modification time of a blob, or None if it does not exist (one HEAD/stat)."""
        path = self.blob_path(key)

        def stat() -> Optional[BlobInfo]:
            self.fs.invalidate_cache(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return None
            if info.get("type") != "file":
                return None
            return BlobInfo(key, int(info.get("size") or 0), _mtime(info))

        return self._retry(stat, f"check blob {self._display(path)}")

    def delete_blob(self, key: str, guard: Optional[Callable[[], None]] = None) -> None:
        """Delete a blob; a missing blob is not an error. ``guard`` runs before every attempt and
        refuses it by raising (garbage collection's deletion window, ``retention``)."""
        path = self.blob_path(key)

        def delete() -> None:
            if guard is not None:
                guard()
            self._remove(path)

        self._retry(delete, f"delete blob {self._display(path)}")

    def list_blobs(self) -> list[BlobInfo]:
        """All blobs of the store (temp files and stray names skipped), sorted by key."""
        base = _join(self.root, _BLOB_DIR)

        def scan() -> dict:
            self.fs.invalidate_cache(base)
            try:
                # on_error: fsspec's walk would omit a directory whose listing failed (transiently)
                return self.fs.find(base, detail=True, **({"on_error": "raise"} if self.is_local else {}))
            except FileNotFoundError:
                return {}

        found = self._retry(scan, f"list blobs in {self._display(base)}")
        out = []
        for path, info in found.items():
            if not path.startswith(base + "/"):
                continue
            shard, _, rest = path[len(base) + 1:].partition("/")
            key = shard + rest
            if (len(shard) == 2 and "/" not in rest and not rest.startswith(".")
                    and is_blob_key(key) and info.get("type", "file") == "file"):
                out.append(BlobInfo(key, int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda b: b.key)

    def list_temp_files(self) -> list[FileInfo]:
        """Temp files that interrupted local writes left behind (a killed process never removes
        them), in the directory and in the blob store; ``name`` is relative to the directory.
        Object stores and ``memory://`` write in one call and have none."""
        if not self.is_local:
            return []
        root = self.root.rstrip("/")

        def scan() -> list:
            out = []
            for base, finder in ((root, self.fs.ls), (_join(self.root, _BLOB_DIR), self.fs.find),
                                 (_join(self.root, LEASE_DIR), self.fs.ls)):
                self.fs.invalidate_cache(base)
                try:
                    found = finder(base, detail=True, **({"on_error": "raise"} if finder == self.fs.find else {}))
                except FileNotFoundError:
                    continue
                for info in found.values() if isinstance(found, dict) else found:
                    path = info["name"]
                    if info.get("type") == "file" and _is_temp_name(path.rsplit("/", 1)[-1]):
                        out.append(FileInfo(path[len(root) + 1:], int(info.get("size") or 0), _mtime(info)))
            return out

        return sorted(self._retry(scan, f"list temp files in {self.url('')}"), key=lambda f: f.name)

    def delete_temp_file(self, name: str) -> None:
        """Delete a temp file found by ``list_temp_files``; a missing one is not an error."""
        if not _is_temp_name(name.rsplit("/", 1)[-1]) or ".." in name.split("/"):
            raise UnsafePathError(f"not a temp file of {self.url('')}: {name!r}")
        path = _join(self.root, name)
        self._retry(lambda: self._remove(path), f"delete {self._display(path)}")

    def write_manifest(self, name: str, data: bytes, guard: Optional[Callable[[], None]] = None) -> None:
        """Commit a manifest atomically: rename on local filesystems, one PUT on object stores.

        ``guard`` (``fence.commit_guard``) runs right before each rename/PUT attempt and refuses
        the commit by raising. A rename/PUT that reports an error although it was applied (a lost
        response, an NFS rename retried after its reply was lost) is resolved by reading the
        manifest back: holding exactly ``data``, it is committed; otherwise the error stands."""
        path = self._manifest_path(name)
        self.sync()
        self._retry(lambda: self._write(path, data, single_put=True, tmp_prefix=f".{name[:64]}",
                                        guard=guard, resolve=True),
                    f"write manifest {self._display(path)}")

    def read_manifest(self, name: str, max_bytes: int = _DEFAULT_MANIFEST_MAX) -> bytes:
        """Read a manifest; CheckpointNotFoundError if absent, CorruptCheckpointError if huge."""
        path = self._manifest_path(name)
        try:
            return self._retry(lambda: self._read(path, max_bytes, "manifest"),
                               f"read manifest {self._display(path)}")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"no checkpoint at {self._display(path)}") from exc

    def read_head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of a file (fewer if it is shorter), e.g. to sniff a magic."""
        path = self._manifest_path(name)

        def read() -> bytes:
            size = self._file_size(path)
            return self.fs.cat_file(path, start=0, end=min(n, size)) if size and n > 0 else b""

        try:
            return self._retry(read, f"read {self._display(path)}")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"no checkpoint at {self._display(path)}") from exc

    def manifest_exists(self, name: str) -> bool:
        """Whether a file of that name exists in the directory."""
        path = self._manifest_path(name)
        return self._retry(lambda: self._is_file(path), f"check {self._display(path)}")

    def delete_manifest(self, name: str) -> None:
        """Delete a manifest; a missing one is not an error."""
        path = self._manifest_path(name)
        self._retry(lambda: self._remove(path), f"delete {self._display(path)}")

    def copy_manifest(self, src_name: str, dst_name: str) -> None:
        """Copy a manifest; ``dst_name`` appears atomically, like ``write_manifest``."""
        _check_name(dst_name)
        self.write_manifest(dst_name, self.read_manifest(src_name))

    def list_files(self) -> list[FileInfo]:
        """Regular files directly in the directory (no temp files, no ``.checkrun``), by name."""
        root = self.root.rstrip("/")

        def scan() -> list:
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return []

        out = []
        for info in self._retry(scan, f"list {self.url('')}"):
            parent, _, name = info["name"].rstrip("/").rpartition("/")
            # s3fs lists a *file* at root as itself; keep only entries inside the directory.
            if (parent != root or info.get("type") != "file" or not name
                    or name.startswith(_META_DIR) or _is_temp_name(name)):
                continue
            out.append(FileInfo(name, int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda f: f.name)

    def map(self, fn: Callable[[T], R], items: Iterable[T],
            cost: Callable[[T], int] | None = None) -> list[R]:
        """``[fn(x) for x in items]`` on the store's pool of ``config.io_threads`` threads.

        Results are in item order. If any call raises, calls not yet started are cancelled, the
        running ones are waited for, then the exception of the first failed item is raised.
        Called from inside ``fn`` (a pool thread) it runs inline, so nesting cannot deadlock.

        With ``cost`` (an item's size in bytes, say), consecutive items are grouped into pool
        tasks of at least ``BATCH_COST`` each: handing a task to a pool thread and the GIL
        switches around it cost more than reading and decoding a blob of a few KB.
        """
        items = list(items)
        if cost is not None and len(items) > 1:
            batches = _batches(items, cost)
            if len(batches) < len(items):
                return [r for part in self.map(lambda b: [fn(x) for x in b], batches) for r in part]
        if len(items) <= 1 or getattr(self._in_worker, "active", False):
            return [fn(x) for x in items]
        pool = self._get_pool()
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
            with self._pool_lock:
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

    def _get_pool(self) -> ThreadPoolExecutor:
        """The pool, for one ``map`` (counted until it ends)."""
        with self._pool_lock:
            self._maps += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.config.io_threads,
                                                thread_name_prefix="checkrun-io")
            return self._pool

    def release_idle(self) -> None:
        """Stop the pool's threads unless a ``map`` is using it; a later ``map`` starts a new pool.
        The engine calls it when it goes idle, so that an idle engine holds no thread."""
        with self._pool_lock:
            if self._maps:
                return
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def close(self) -> None:
        """Shut down the pool after its running calls; a later ``map`` starts a new one."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retry(self, fn: Callable[[], R], what: str) -> R:
        return call_with_retry(fn, config=self.config.retry, what=what, logger=_LOG)

    def _file_size(self, path: str) -> int:
        """Size of a regular file; FileNotFoundError for anything else (missing, directory)."""
        self.fs.invalidate_cache(path)  # pops the cached listings of all its parents (s3fs)
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise FileNotFoundError(errno.ENOENT, "not a file", path)
        return int(info["size"])

    def _is_file(self, path: str) -> bool:
        try:
            self._file_size(path)
            return True
        except FileNotFoundError:
            return False

    def _read(self, path: str, max_bytes: int, kind: str) -> bytes:
        size = self._file_size(path)
        # Checked before reading so that a hostile or damaged store cannot make us allocate.
        if size > max_bytes:
            raise CorruptCheckpointError(f"{kind} {self._display(path)} is {size} bytes, "
                                         f"more than the allowed {max_bytes}")
        data = self.fs.cat_file(path)
        if len(data) > max_bytes:  # grew between info and read
            raise CorruptCheckpointError(f"{kind} {self._display(path)} is larger than "
                                         f"the allowed {max_bytes} bytes")
        return data

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        finally:
            self.fs.invalidate_cache(path)

    def _write(self, path: str, data: bytes | memoryview, *, single_put: bool,
               tmp_prefix: str = "", defer_dir_sync: bool = False,
               guard: Optional[Callable[[], None]] = None, resolve: bool = False) -> None:
        """Write ``path`` atomically; ``guard`` and ``resolve`` as in ``write_manifest``."""
        if self.is_local:
            self._write_local(path, data, tmp_prefix, defer_dir_sync, guard, resolve)
            return
        kwargs = {"chunksize": _S3_SINGLE_PUT_CHUNKSIZE} if single_put and self._is_s3 else {}
        # bytes: botocore and other clients do not all accept memoryview bodies
        body = bytes(data) if isinstance(data, memoryview) else data
        if guard is not None:
            guard()  # as close to the PUT as a check can be: see fence.py for the race left
        try:
            self._apply(path, data, resolve, lambda: self.fs.pipe_file(path, body, **kwargs))
        finally:
            self.fs.invalidate_cache(path)

    def _apply(self, path: str, data: bytes | memoryview, resolve: bool, commit: Callable[[], Any]) -> None:
        """Run the step that makes ``path`` hold ``data`` (rename, PUT). If it fails and ``resolve``,
        look whether it was applied anyway (its answer lost): then it counts as done."""
        try:
            commit()
        except Exception as exc:
            if not resolve or not self._holds(path, data):
                raise
            _LOG.warning("%s: the commit reported %s: %s, but it landed (the file holds exactly this "
                         "save's bytes): committed", self._display(path), type(exc).__name__, exc)

    def _holds(self, path: str, data: bytes | memoryview) -> bool:
        """Whether ``path`` holds exactly ``data`` now (one read; an error counts as no)."""
        try:
            return self._read(path, len(data), "manifest") == data
        except Exception:  # noqa: BLE001 - unreadable: not known to hold it, the error stands
            return False

    def _write_local(self, path: str, data: bytes | memoryview, tmp_prefix: str,
                     defer_dir_sync: bool = False, guard: Optional[Callable[[], None]] = None,
                     resolve: bool = False) -> None:
        """Temp file in the same directory + fsync + rename + directory fsync (if configured;
        ``defer_dir_sync`` leaves the directory fsync to ``sync``).

        The temp file (a fresh uuid name) is opened through the filesystem object, so it gets
        the process umask like any open() and a wrapped filesystem can inject faults. ``guard``
        runs between the fsync of the temp file and the rename.
        """
        directory = os.path.dirname(path)
        self._makedirs_local(directory)
        # The tag names this process: gc deletes the temp files of processes that ended (``owner``).
        tmp = os.path.join(directory, f"{tmp_prefix}{_TMP_MARK}{temp_tag()}-{uuid.uuid4().hex}")
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.config.fsync:
                    os.fsync(f.fileno())
            if guard is not None:
                guard()  # the last step before the rename: see fence.py for the race left
            self._apply(path, data, resolve, lambda: os.replace(tmp, path))
        except BaseException:
            with contextlib.suppress(OSError):  # never leave a temp file (ENOSPC, EACCES, ^C)
                os.remove(tmp)
            raise
        if self.config.fsync:
            if defer_dir_sync:
                with self._pool_lock:
                    self._unsynced.add(directory)
            else:
                _fsync_dir(directory)

    def _makedirs_local(self, directory: str) -> None:
        if os.path.isdir(directory):
            return
        created = []
        d = directory
        while not os.path.isdir(d) and os.path.dirname(d) != d:
            created.append(d)
            d = os.path.dirname(d)
        os.makedirs(directory, exist_ok=True)
        if self.config.fsync:
            # A new directory is durable only once the entry in its parent is.
            for d in reversed(created):
                _fsync_dir(os.path.dirname(d))


def _failed(f: Future) -> bool:
    return f.done() and not f.cancelled() and f.exception() is not None


def merge_options(base: Optional[dict], override: Optional[dict]) -> dict:
    """Deep-merge storage options: a call's ``client_kwargs`` adds to the config's, not replaces it."""
    out = dict(base or {})
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = value
    return out
