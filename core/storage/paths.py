"""Step 4's addresses: where things live in a checkpoint directory, how a path or URL becomes a
filesystem, and what kind of filesystem that is.

Every question about the kind of storage (local disk, object store, ``memory://``) is answered by
a function here or by the commit strategy (``commit``); nothing outside ``ckpt_core.storage``
looks at protocols or filesystem classes.
"""
from __future__ import annotations

import datetime as _dt
import errno
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import fsspec
from fsspec.core import url_to_fs
from fsspec.implementations.cached import CachingFileSystem
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from ..config import StorageConfig
from ..errors import ConfigError, StorageError, UnsafePathError
from .options import merge_options, open_options, options_key

META_DIR = ".checkrun"
BLOB_DIR = ".checkrun/blobs"
LEASE_DIR = ".checkrun/leases"
"""Where ``leases`` keeps its objects (its temp files are listed here with the others)."""
STEPLOG_DIR = ".checkrun/steplog"
"""Where a directory's step log keeps its segments, markers and run objects (``steplog.log``)."""
TMP_MARK = ".tmp-"
_S3_PROTOCOLS = frozenset({"s3", "s3a"})
_BUCKET_PROTOCOLS = _S3_PROTOCOLS | {"gs", "gcs", "abfs", "abfss", "az", "adl"}
_IN_PROCESS_PROTOCOLS = frozenset({"memory"})


@dataclass(frozen=True)
class BlobInfo:
    """A blob in the store: its key, size in bytes and modification time (epoch seconds), and
    ``version``: what changes when its stored file is written again (``version``)."""
    key: str
    size: int
    mtime: float
    version: tuple = ()
    changed: float = 0.0
    """The latest of its modification and (local disks) inode change times: a rewrite in place that puts its
    mtime back (``cp -p``, ``rsync -a``, ``touch -r``) still moves its ctime."""
    sized: bool = True
    """False when the listing gave no size (``size`` is then 0): an http index page (h147)."""


@dataclass(frozen=True)
class FileInfo:
    """A regular file directly in the checkpoint directory (normally a manifest)."""
    name: str
    size: int
    mtime: float
    dated: bool = True
    """False when the listing gave no time (``mtime`` is then the time of the listing: ``mtime``)."""


def protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The protocol names of a filesystem (fsspec gives a string or a tuple)."""
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk, where a file appears atomically only by rename."""
    # Subclasses (other protocol) and wrappers (same protocol) of LocalFileSystem are local too:
    # tests inject faults that way, and they must still get the temp-file + rename commit.
    return isinstance(fs, LocalFileSystem) or bool({"file", "local"} & set(protocols(fs)))


def is_s3_fs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` speaks S3 (its uploads turn multipart above a chunk size)."""
    return bool(_S3_PROTOCOLS & set(protocols(fs)))


def bucket_of(fs: fsspec.AbstractFileSystem, root: str) -> tuple[fsspec.AbstractFileSystem, str] | None:
    """(filesystem, bucket) of a directory of an object store, also under ``dir://`` (h145: a mistyped bucket
    there was not looked for); None elsewhere."""
    if isinstance(fs, DirFileSystem):
        fs, root = fs.fs, fs._join(root)
    bucket = root.lstrip("/").split("/", 1)[0]
    return (fs, bucket) if bucket and _BUCKET_PROTOCOLS & set(protocols(fs)) else None


def refuse_read_only(fs: fsspec.AbstractFileSystem, url: str, dry_run: bool = False) -> None:
    """Before a collection (not a dry run): storage that can only read (http(s): published checkpoints) is a
    clear error (h145: gc reported "deleted 0, kept 0 referenced blob(s)" for a served directory)."""
    if not dry_run and {"http", "https"} & set(protocols(fs)):
        raise StorageError(f"{url}: {protocols(fs)[0]}:// storage is read-only: nothing can be collected there "
                           "(run gc where the files are written)")


def in_process_only(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether the files of ``fs`` live in this process's memory (another process cannot see them)."""
    return bool(_IN_PROCESS_PROTOCOLS & set(protocols(fs)))


def resolve(text: str, storage_options: Optional[dict],
            config: StorageConfig) -> tuple[fsspec.AbstractFileSystem, str, str, str]:
    """(filesystem, path as it spells it, display prefix, canonical key of the options) of a path or
    URL; ``storage_options`` merged over ``config.storage_options`` (``options.merge_options``).

    The key is taken from the options given, not from ``fs.storage_options`` later: a filesystem may
    change those in place (botocore adds ``retries.mode`` when s3fs connects)."""
    opened = open_options(text, merge_options(config.storage_options, storage_options))
    key = options_key(opened)
    if _local_with_colons(text):  # a folder "exp::lr=0.1": torch.save writes in it, fsspec reads a chain
        fs, fspath = fsspec.filesystem("file", **opened), LocalFileSystem._strip_protocol(text)
    else:
        fs, fspath = url_to_fs(text, **opened)
    if _caches(fs):
        # a cache kept serving the manifest it read first (a resume got an old last.ckpt, silently), and
        # saves through one failed (found by an independent check)
        raise ConfigError(f"{text!r}: fsspec caching filesystems (simplecache::, filecache::, blockcache::) are not "
                          "supported for checkpoints: manifests change in place and a cache would keep serving old "
                          "ones; use the URL without the cache")
    if isinstance(fs, DirFileSystem) and is_local_fs(fs.fs):
        # dir:// over the local disk is the local disk under its path: saved as local (temp file + rename, folders
        # made); h142: it got the object-store commit, which makes no folders, and every save failed
        return fs.fs, fs._join(fspath), "", key
    # Keep the user's scheme for display, except for plain local files (shown as absolute paths) and
    # URLs fsspec keeps whole (http: h142 saw http://http://...).
    scheme = text[: text.index("://")] if "://" in text else ""
    if (is_local_fs(fs) and scheme in ("", "file", "local")) or "://" in fspath:
        return fs, fspath, "", key
    return fs, fspath, f"{scheme or protocols(fs)[0]}://", key


def _caches(fs: Any, depth: int = 8) -> bool:
    """Whether ``fs`` or a filesystem it wraps (``dir::simplecache::...``) is an fsspec cache."""
    for _ in range(depth):
        if fs is None or isinstance(fs, CachingFileSystem):
            return fs is not None
        fs = getattr(fs, "fs", None)
    return False


def _local_with_colons(text: str) -> bool:
    """A local path with ``::`` in a name: a part before a ``::`` is a path, not a protocol or URL (an
    fsspec chain, ``simplecache::s3://b/x``, has protocols or URLs there; for a path it would write every
    checkpoint into one file named after the part before ``::``)."""
    return any("/" in head and "://" not in head for head in text.split("::")[:-1])


def blob_url(store: Any, key: str) -> str:
    """A blob as messages name it: spelled as ``store.url`` spells paths (``s3://`` included)."""
    return store.url(join(BLOB_DIR, key[:2], key[2:]))


def refuse_directory(store: Any, name: str, dcp: bool = False) -> None:
    """Before a save writes anything to ``name`` of ``store``: a local directory there fails now, not
    at the commit after every blob was written (the manifest cannot replace a directory). ``dcp``:
    the words for ``torch.distributed.checkpoint``, whose own writer takes a directory."""
    path = join(store.root, name)
    if not (is_local_fs(store.fs) and os.path.isdir(path)) or os.path.islink(path):  # a link: the save replaces it
        return
    url = store.url(name)
    if dcp:
        raise StorageError(f"{url} is a directory: a checkrun DCP checkpoint is one file, not a folder as with "
                           f"DCP's FileSystemWriter; pass a file path inside it, e.g. {url}/step=100.dcp")
    raise StorageError(f"{url} is a directory: a checkpoint is one file; save to a file inside it, "
                       f"e.g. {url}/step=100.ckpt")


def join(root: str, *parts: str) -> str:
    """``root/part/...`` with exactly one slash between the pieces."""
    return "/".join([root.rstrip("/"), *parts]) if root.rstrip("/") else "/" + "/".join(parts)


_TEMP_RE = re.compile(r"\.(?:.*\.)?tmp-[0-9a-fps-]+")
_OUR_TEMP_RE = re.compile(r"\.(?:.*\.)?tmp-(?:[0-9a-f]{8}p[0-9]{1,10}s[0-9]{1,20}-)?[0-9a-f]{32}")


def is_temp_name(name: str) -> bool:
    """Whether a file name looks like one of our temp files (``.<prefix>.tmp-`` then hex digits, ``p``, ``s``
    and ``-``): never a checkpoint name, nor listed as a checkpoint; a user's ``.notes.tmp-old`` is not one."""
    return _TEMP_RE.fullmatch(name) is not None


def is_temp_file(name: str) -> bool:
    """Whether a file name is exactly one a checkrun write gives its temp file (``.<prefix>.tmp-<owner
    tag>-<uuid hex>``, or ``.<prefix>.tmp-<uuid hex>`` of earlier releases; 32 hex digits): only these may
    garbage collection delete (h132: a user's ``.last.ckpt.tmp-1`` backup and ``.notes.tmp-2026-12-01`` were;
    h134: ``.last.ckpt.tmp-<time.time_ns()>`` and ``.notes.tmp-<token_hex(8)>``, 16-32 digits, were)."""
    return _OUR_TEMP_RE.fullmatch(name) is not None


def check_name(name: str) -> str:
    """Validate a manifest name: a plain file name inside the directory, never a path."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name or name.startswith(META_DIR) or is_temp_name(name)):
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


def find_shards(fs: fsspec.AbstractFileSystem, base: str) -> dict[str, dict]:
    """The entries of ``base`` and of each directory in it (the blob layout: ``base/<shard>/<key>``),
    ``{path: info}`` as fsspec's ``find(detail=True)`` gives them, listed with ``fs.ls``. A shard
    whose listing fails raises: ``find`` omits it silently, even with ``on_error="raise"`` (fsspec's
    walk does not pass that on below the top), and a blob missing from a listing made
    ``latest(verify=False)`` skip the newest checkpoint. A shard that vanished meanwhile (gc) is
    skipped; FileNotFoundError if ``base`` itself is missing, NotADirectoryError if it is a file."""
    out = {}
    for info in fs.ls(base, detail=True):
        if info["name"].rstrip("/") == base.rstrip("/"):  # base is a file: every blob would look missing
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", base)
        if info.get("type") != "directory":
            out[info["name"]] = info
            continue
        try:
            out.update((entry["name"], entry) for entry in fs.ls(info["name"], detail=True))
        except FileNotFoundError:  # deleted meanwhile
            continue
    return out


def dated(info: dict) -> bool:
    """Whether an fsspec info dict gives a modification time (``mtime`` falls back to now)."""
    return any(info.get(key) is not None and _to_epoch(info[key]) is not None for key in _TIME_KEYS)


_TIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def mtime(info: dict) -> float:
    """Modification time from an fsspec info dict (local 'mtime', s3 'LastModified', memory
    'created', gcs 'updated'). Unknown -> now: garbage collection must never think a blob it
    cannot date is old."""
    for key in _TIME_KEYS:
        if info.get(key) is not None:
            stamp = _to_epoch(info[key])
            if stamp is not None:
                return stamp
    return time.time()


_VERSION_KEYS = ("mtime", "created", "ino", "LastModified", "ETag", "VersionId", "last_modified",
                 "updated", "modified", "generation", "etag", "md5Hash", "crc32c")


def changed(info: dict) -> float:
    """``BlobInfo.changed`` of an fsspec info dict (the local filesystem reports ctime as ``created``)."""
    ctime = info.get("created")
    return max(mtime(info), float(ctime) if isinstance(ctime, (int, float)) else 0.0)


def version(info: dict) -> tuple:
    """What changes when a stored file is written again, from an fsspec info dict: its size and
    whatever the filesystem reports of times, inode, entity tag or generation (compared, never
    interpreted: a local file rewritten in place changes its mtime and ctime, a replaced one its
    inode, an object its ETag and LastModified)."""
    return (info.get("size"),) + tuple(f"{k}={info[k]}" for k in _VERSION_KEYS if info.get(k) is not None)


def display_root(fs: fsspec.AbstractFileSystem, root: str, url_prefix: str) -> str:
    """The root as a URL, preferring ``memory://run`` to the equivalent ``memory:///run``."""
    if url_prefix and root.startswith("/"):
        short = url_prefix + root.lstrip("/")
        if short != url_prefix and fs._strip_protocol(short) == root:
            return short
    return url_prefix + root

