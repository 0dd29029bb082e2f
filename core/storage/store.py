"""Step 4: one checkpoint directory on any fsspec filesystem - manifests, content-addressed blobs.

Layout: ``run/<name>.ckpt`` manifests (a manifest is the checkpoint and appears only when complete) next
to ``run/.checkrun/blobs/ab/cdef...`` blobs shared by all manifests in ``run/``. ``Store`` is the facade
the other stages use; how a file appears atomically is its ``commit`` strategy's (rename on local disks,
one PUT on object stores and ``memory://``), its threads are ``pool.IOPool``'s, addresses and kinds of
filesystem ``paths``', the options merge ``options``'. A manifest commit runs its ``guard``
(``saving.fence.commit_guard``) right before the rename/PUT; a rename/PUT that reports an error is
resolved by reading the manifest back: holding exactly the bytes written, it landed.

s3fs answers ``info``/``exists`` from cached listings (``dircache``), which would hide files written or
deleted since: Store invalidates a path's cache before every query and after every mutation. Every
method may be called from any thread, including the pool threads of ``map``.
"""
from __future__ import annotations

import errno
import logging
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..config import StorageConfig
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError, UnsafePathError
from ..format.dtypes import is_blob_key
from . import aside, commit as _commit, localio
from .atomic import temp_prefix
from .options import options_key
from .paths import (BLOB_DIR, LEASE_DIR, META_DIR, BlobInfo, FileInfo, changed, check_name, dated, display_root,
                    find_shards, in_process_only, is_local_fs, is_temp_file, is_temp_name, join, mtime, resolve,
                    version)
from .pool import IOPool
from .retry import call_with_retry, whole

__all__ = ["Store", "BlobInfo", "FileInfo", "LEASE_DIR"]

T = TypeVar("T")
R = TypeVar("R")

_LOG = logging.getLogger("ckpt_core.storage.store")
_DEFAULT_MANIFEST_MAX = 64 << 20
WHOLE_READ_BYTES = 1 << 20  # files known to be at most this large are read whole at once (not head first)
READ_PIECE = 1 << 20
"""Bytes per ``readinto`` of a local blob: in 1 MiB pieces the kernel's read-ahead runs ahead of the copy (one
call per 14 MB blob waited for each window: the DLRM's 239 MB 0.13 s, not 0.18 s, benchmarks/bench_restore.py)."""


class Store:
    """One checkpoint directory: manifests directly in it, blobs under ``.checkrun/blobs``.

    ``root`` is the directory as the filesystem spells it (``fs._strip_protocol``: an absolute
    path for local, ``bucket/key`` for s3); ``url_prefix`` is put in front of paths to show them
    to users (``"s3://"``; empty for local paths). Build one with ``for_path``/``for_directory``.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, config: StorageConfig,
                 url_prefix: str = "", options: str | None = None) -> None:
        self.fs = fs
        # canonical key of the options fs was opened with (paths.resolve); default: its options now
        self.options = options if options is not None else options_key(getattr(fs, "storage_options", None))
        self.root = root.rstrip("/") or "/"
        self.config = config
        self.url_prefix = url_prefix
        self.is_local = is_local_fs(fs)
        self._groups = self.is_local or in_process_only(fs)  # map(cost=) groups calls (no requests)
        self._plain_local = type(fs) is LocalFileSystem  # not a wrapper or subclass (tests inject faults so)
        self.pool = IOPool(config.io_threads)
        self._display_root = display_root(fs, self.root, url_prefix)
        # Through a weak proxy: a cycle store <-> strategy would keep every short-lived store (and
        # its I/O threads) until the cyclic GC runs.
        me = weakref.proxy(self)
        self.commit: _commit.CommitStrategy = _commit.choose(fs)(
            fs, config, lambda path: me._display(path), lambda path, data: me._holds(path, data))

    def __repr__(self) -> str:
        return f"Store({self.url('')!r})"

    @classmethod
    def for_path(cls, path: str | os.PathLike, storage_options: Optional[dict],
                 config: StorageConfig, follow_link: bool = False) -> tuple["Store", str]:
        """Split a checkpoint path/URL into (store of its parent directory, manifest name).

        ``storage_options`` are merged over ``config.storage_options`` (``options.merge_options``).
        ``follow_link`` (reads): a local symlink means its target, whose blobs are beside it (as torch.load
        follows it); saves and removals replace or remove the link itself."""
        text = os.fspath(path)
        fs, fspath, prefix, options = resolve(text, storage_options, config)
        if follow_link and is_local_fs(fs) and os.path.islink(fspath):
            fspath = os.path.realpath(fspath)
        parent, _, name = fspath.rstrip("/").rpartition("/")
        if not parent and not fspath.startswith("/"):
            raise UnsafePathError(f"{text!r} does not name a file inside a directory")
        return cls(fs, parent or "/", config, prefix, options), check_name(name)

    @classmethod
    def for_directory(cls, directory: str | os.PathLike, storage_options: Optional[dict],
                      config: StorageConfig) -> "Store":
        """The store of a checkpoint directory (path or URL)."""
        fs, fspath, prefix, options = resolve(os.fspath(directory), storage_options, config)
        return cls(fs, fspath, config, prefix, options)

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """(URL, filesystem class, canonical storage options): caches of stores use it, so a store built
        with other options (rotated credentials, another endpoint) is never taken for this one."""
        return (self.url(""), f"{type(self.fs).__module__}.{type(self.fs).__qualname__}", self.options)

    @property
    def shared_between_processes(self) -> bool:
        """Whether another process sees what this store writes (not so for ``memory://``)."""
        return not in_process_only(self.fs)

    def url(self, name: str) -> str:
        """User-facing path/URL of ``name`` in this directory (``url('')`` is the directory)."""
        return self._display(join(self.root, name) if name else self.root)

    def _display(self, path: str) -> str:
        if path == self.root or path.startswith(self.root.rstrip("/") + "/"):
            return self._display_root + path[len(self.root):] if self.url_prefix else path
        return self.url_prefix + path

    def subdirectory(self, name: str) -> "Store":
        """The store of the directory ``name`` inside this one (same filesystem and options)."""
        return self.at(join(self.root, check_name(name)))

    def at(self, root: str) -> "Store":
        """The store of the directory ``root`` (as the filesystem spells it), same filesystem and options."""
        return Store(self.fs, root, self.config, self.url_prefix, self.options)

    def is_directory(self) -> bool:
        """Whether this store's root exists as a directory (a prefix with objects on S3)."""
        def probe() -> bool:  # not fs.isdir: it answers False for a transient error
            self.fs.invalidate_cache(self.root)
            try:
                info = self.fs.info(self.root)  # http: a directory is an index page (h145)
                return info.get("type") == "directory" or info.get("mimetype") == "text/html"
            except FileNotFoundError:
                return False

        return bool(self.retry(probe, f"stat {self.url('')}"))

    def blob_path(self, key: str) -> str:
        """Filesystem path of a blob; rejects anything that is not a lowercase hex digest."""
        if not is_blob_key(key):
            raise UnsafePathError(f"unsafe blob key {key!r} in {self.url('')}: expected 32-64 lowercase hex digits")
        return join(self.root, BLOB_DIR, key[:2], key[2:])

    def _manifest_path(self, name: str) -> str:
        return join(self.root, check_name(name))

    def has_blob(self, key: str) -> bool:
        """Whether the blob exists."""
        path = self.blob_path(key)
        return self.retry(lambda: self._is_file(path), f"check blob {self._display(path)}")

    def put_blob(self, key: str, data: bytes | memoryview) -> None:
        """Write a blob atomically (readers see all of it or nothing); overwrites."""
        path = self.blob_path(key)
        self.retry(lambda: self._write(path, data, single_put=False, defer_dir_sync=True),
                    f"write blob {self._display(path)}")

    def sync(self) -> None:
        """fsync (once each) the directories ``put_blob`` added blobs to; ``write_manifest`` calls it first (a manifest
        never points at a blob a power loss takes back), DCP ranks themselves. Only local with ``storage.fsync``."""
        self.commit.sync()

    def get_blob(self, key: str, max_bytes: int) -> bytes:
        """Read a blob; a missing one or one larger than ``max_bytes`` is CorruptCheckpointError."""
        path = self.blob_path(key)
        try:
            return self.retry(lambda: self._read(path, max_bytes, "blob"), f"read blob {self._display(path)}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"missing blob {self._display(path)}") from exc

    def get_blob_into(self, key: str, size: int, buf: memoryview) -> bytes | memoryview:
        """Read a blob expected to hold ``size`` bytes; local stores read into ``buf`` (``size + 1`` bytes or more: a
        longer file shows) and return the filled part, others ``get_blob``'s bytes. The caller checks the size."""
        if not self.is_local:
            return self.get_blob(key, size)
        path = self.blob_path(key)

        def read() -> memoryview:
            if self._plain_local:  # os calls (fsspec's info + open cost ~20-130 us of Python a blob)
                return localio.read_file_into(path, buf, READ_PIECE)
            self._file_size(path)  # a regular file: opening a FIFO (or a link to one) would block for ever
            with self.fs.open(path, "rb") as f:
                return localio.fill(f.readinto, buf, READ_PIECE)

        try:
            return self.retry(read, f"read blob {self._display(path)}")
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"missing blob {self._display(path)}") from exc

    def blob_info(self, key: str) -> Optional[BlobInfo]:
        """Size, modification time and version of a blob, or None if it does not exist (one HEAD/stat)."""
        path = self.blob_path(key)

        def stat() -> Optional[BlobInfo]:
            self.fs.invalidate_cache(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return None
            n = int(info.get("size") or 0)
            return None if info.get("type") != "file" else BlobInfo(key, n, mtime(info), version(info), changed(info))

        return self.retry(stat, f"check blob {self._display(path)}")

    def delete_blob(self, key: str, guard: Optional[Callable[[], None]] = None) -> None:
        """Delete a blob; a missing blob is not an error. ``guard`` runs before every attempt and
        refuses it by raising (garbage collection's deletion window, ``retention``)."""
        path = self.blob_path(key)

        def delete() -> None:
            if guard is not None:
                guard()
                if self.is_local:  # moved aside, checked again, then deleted (storage/aside.py)
                    return aside.remove_within(self.fs, path, guard, self._remove)
            self._remove(path)

        self._delete(path, delete, f"delete blob {self._display(path)}")

    def list_blobs(self) -> list[BlobInfo]:
        """All blobs of the store (temp files and stray names skipped), sorted by key."""
        base = join(self.root, BLOB_DIR)

        def scan() -> dict:
            self.fs.invalidate_cache(base)
            try:  # local: fsspec's find would omit a directory whose listing failed
                return find_shards(self.fs, base) if self.is_local else self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}

        found = self.retry(scan, f"list blobs in {self._display(base)}")
        out = []
        for path, info in found.items():
            shard, _, rest = path[len(base) + 1:].partition("/")
            key = shard + rest
            if (path.startswith(base + "/") and len(shard) == 2 and "/" not in rest and not rest.startswith(".")
                    and is_blob_key(key) and info.get("type", "file") == "file"):
                out.append(BlobInfo(key, int(info.get("size") or 0), mtime(info), sized=info.get("size") is not None))
        return sorted(out, key=lambda b: b.key)

    def list_temp_files(self) -> list[FileInfo]:
        """Temp files that interrupted local writes left in the directory and the blob store (``name``:
        relative to the directory). Object stores and ``memory://`` write in one call and have none."""
        if not self.commit.leaves_temp_files:
            return []
        found = self.retry(lambda: self.commit.scan_temp_files(self.root), f"list temp files in {self.url('')}")
        return sorted(found, key=lambda f: f.name)

    def delete_temp_file(self, name: str) -> None:
        """Delete a temp file found by ``list_temp_files``; a missing one is not an error."""
        if not is_temp_file(name.rsplit("/", 1)[-1]) or ".." in name.split("/"):
            raise UnsafePathError(f"not a temp file of {self.url('')}: {name!r}")
        path = join(self.root, name)
        blob = aside.original(path) if self.is_local else None  # moved aside by a killed collection
        self.retry(lambda: aside.put_back(path, blob, self._remove) if blob else self._remove(path),
                   f"delete {self._display(path)}")

    def write_manifest(self, name: str, data: bytes | memoryview | list, guard: Optional[Callable[[], None]] = None,
                       what: str = "manifest") -> None:
        """Commit a manifest atomically: rename on local filesystems, one PUT on object stores.

        ``what`` names the file in errors (the step log's segments too); ``data``: ``commit.Data``.
        ``guard`` (``fence.commit_guard``) runs right before each rename/PUT attempt and refuses
        the commit by raising. A rename/PUT that reports an error although it was applied (a lost
        response, an NFS rename retried after its reply was lost) is resolved by reading the
        manifest back: holding exactly ``data``, it is committed; otherwise the error stands."""
        path = self._manifest_path(name)
        self.sync()
        self.retry(lambda: self._write(path, data, single_put=True, tmp_prefix=temp_prefix(name),
                                        guard=guard, resolve=True),
                    f"write {what} {self._display(path)}")

    def read_manifest(self, name: str, max_bytes: int = _DEFAULT_MANIFEST_MAX, what: str = "manifest") -> bytes:
        """Read a manifest (``what``: how errors name it, e.g. a step-log segment); CheckpointNotFoundError
        if absent, CorruptCheckpointError if huge."""
        return self._read_named(name, lambda path: self._read(path, max_bytes, what), f"{what} ")

    def read_head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of a file (fewer if it is shorter), e.g. to sniff a magic."""
        def read(path: str) -> bytes:
            size = min(n, self._file_size(path))
            return whole(self.fs.cat_file(path, start=0, end=size), size) if size > 0 else b""

        return self._read_named(name, read)

    def read_listed(self, name: str, size: int) -> bytes | None:
        """A file listed with ``size`` (> 0) bytes, read whole in one request (no HEAD); None unless it holds exactly
        ``size`` (a byte more is asked for: a listing showing less is seen). CheckpointNotFoundError if gone."""
        def read(path: str) -> bytes:
            if self.is_local:
                self._file_size(path)  # a regular file (a FIFO would block)
            return self.fs.cat_file(path, start=0, end=size + 1)

        data = self._read_named(name, read)
        return data if len(data) == size else None

    def _read_named(self, name: str, read: Callable[[str], R], what: str = "") -> R:
        """``read(path)`` of the file ``name`` under retry; CheckpointNotFoundError if it does not exist."""
        path = self._manifest_path(name)
        try:
            return self.retry(lambda: read(path), f"read {what}{self._display(path)}")
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"no checkpoint at {self._display(path)}") from exc

    def manifest_exists(self, name: str) -> bool:
        """Whether a file of that name exists in the directory."""
        path = self._manifest_path(name)
        return self.retry(lambda: self._is_file(path), f"check {self._display(path)}")

    def put_file(self, name: str, data: bytes) -> None:
        """Write a small file of this directory (a plain name) atomically in one step: rename on local
        filesystems, one PUT on object stores. Unlike ``write_manifest`` no blob is synced first and a
        lost response is not resolved by reading back: for files rewritten often, such as leases."""
        path = self._manifest_path(name)
        self.retry(lambda: self._write(path, data, single_put=True, tmp_prefix=temp_prefix(name)),
                    f"write {self._display(path)}")

    def delete_manifest(self, name: str) -> None:
        """Delete a manifest (or a file ``put_file`` wrote); a missing one is not an error."""
        path = self._manifest_path(name)
        self._delete(path, lambda: self._remove(path), f"delete {self._display(path)}")

    def _delete(self, path: str, fn: Callable[[], None], what: str) -> None:
        """``fn()`` (deleting ``path``) under retry; every answer lost, gone is done (h114, h115)."""
        try:
            self.retry(fn, what)
        except StorageError:
            if self.retry(lambda: self.fs.invalidate_cache(path) or self.fs.exists(path), f"check {path}"):
                raise

    def copy_manifest(self, src_name: str, dst_name: str) -> None:
        """Copy a manifest; ``dst_name`` appears atomically, like ``write_manifest``."""
        check_name(dst_name)
        self.write_manifest(dst_name, self.read_manifest(src_name))

    def list_files(self, include_temp: bool = False) -> list[FileInfo]:
        """Regular files directly in the directory (no ``.checkrun``; temp files only with
        ``include_temp``), by name."""
        root = self.root.rstrip("/")

        def scan() -> list:
            self.fs.invalidate_cache(self.root)
            try:
                return self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return []

        out = []
        for info in self.retry(scan, f"list {self.url('')}"):
            parent, _, name = info["name"].rstrip("/").rpartition("/")
            # s3fs lists a *file* at root as itself; keep only entries inside the directory.
            if (parent != root or info.get("type") != "file" or not name
                    or name.startswith(META_DIR) or (is_temp_name(name) and not include_temp)):
                continue
            out.append(FileInfo(name, int(info.get("size") or 0), mtime(info), dated(info)))
        return sorted(out, key=lambda f: f.name)

    def map(self, fn: Callable[[T], R], items: Iterable[T],
            cost: Callable[[T], int] | None = None) -> list[R]:
        """``[fn(x) for x in items]`` on the store's pool of ``config.io_threads`` threads.

        Results are in item order. If any call raises, calls not yet started are cancelled, the
        running ones are waited for, then the exception of the first failed item is raised.
        Called from inside ``fn`` (a pool thread) it runs inline, so nesting cannot deadlock.

        With ``cost`` (an item's size in bytes, say), consecutive items of a local (or in-memory)
        store are grouped into pool tasks of at least ``pool.BATCH_COST`` each: handing a task over
        costs more than reading a blob of a few KB. Elsewhere a call is a request whose round trip
        outweighs that: each item is a task (grouped, S3 reads ran one after another).
        """
        return self.pool.map(fn, items, cost if self._groups else None)

    @property
    def _pool(self) -> Optional[ThreadPoolExecutor]:
        """The pool's running executor, None while it holds no thread (what tests look at)."""
        return self.pool.executor

    def release_idle(self) -> None:
        """Stop the pool's threads unless a ``map`` uses it (a later one starts a new pool): an idle engine's call."""
        self.pool.release_idle()

    def close(self) -> None:
        """Shut down the pool after its running calls; a later ``map`` starts a new one."""
        self.pool.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def retry(self, fn: Callable[[], R], what: str) -> R:
        """``fn()`` under ``storage.retry`` (``retry.call_with_retry``); ``what`` names the operation
        and its path in log lines and errors. For calls on ``self.fs`` made outside this class."""
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
            return self._file_size(path) >= 0
        except FileNotFoundError:
            return False

    def _read(self, path: str, max_bytes: int, kind: str) -> bytes:
        size = self._file_size(path)  # checked before reading: a hostile or damaged store cannot make us allocate
        if size > max_bytes:
            raise CorruptCheckpointError(f"{kind} {self._display(path)} is {size} bytes, more than the allowed "
                                         f"{max_bytes}")
        # a range read on object stores: s3fs would HEAD once more (local: f.read(n) would allocate n bytes)
        ranged = not self.is_local and size > 0  # (an empty object answers a range with an error)
        data = whole(self.fs.cat_file(path, start=0, end=max_bytes + 1) if ranged else self.fs.cat_file(path), size)
        if len(data) > max_bytes:  # grew between info and read
            raise CorruptCheckpointError(f"{kind} {self._display(path)} is larger than the allowed {max_bytes} bytes")
        return data

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        finally:
            self.fs.invalidate_cache(path)

    def _write(self, path: str, data: bytes | memoryview | list, *, single_put: bool,
               tmp_prefix: str = "", defer_dir_sync: bool = False,
               guard: Optional[Callable[[], None]] = None, resolve: bool = False) -> None:
        """Write ``path`` atomically with this store's commit strategy (``commit.CommitStrategy.write``)."""
        self.commit.write(path, data, single_put=single_put, tmp_prefix=tmp_prefix,
                          defer_dir_sync=defer_dir_sync, guard=guard, resolve=resolve)

    def _holds(self, path: str, data: bytes | memoryview | list) -> bool:
        """Whether ``path`` holds exactly ``data`` (``commit.Data``) now (one read; an error counts as no)."""
        try:
            return self._read(path, len(data := _commit.joined(data)), "manifest") == data
        except Exception:  # noqa: BLE001 - unreadable: not known to hold it, the error stands
            return False
