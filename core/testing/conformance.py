"""Testing (step 4, store): the storage conformance suite - what checkrun needs from a filesystem.

Run it on a URL of the backend you want checkrun to write to (an fsspec protocol you wrote, a
bucket of another object store); it builds ``Store``s over it with your ``storage_options`` and
checks, each in a fresh subdirectory of the URL:

- ``blobs``: put/get/exists/delete of content-addressed blobs, sizes, missing ones;
- ``manifests``: a committed manifest reads back exactly, lists, is replaced whole and deleted;
- ``commit_visibility``: while a manifest is overwritten, a reader sees one whole version or the
  other, never a part; a second ``Store`` (another process's view) sees commits and deletions at once;
- ``listing``: listings skip temp files, stray names and ``.checkrun/``, sorted by name/key;
- ``temp_cleanup``: writes leave no temp files behind; a temp file an interrupted write left
  (local filesystems) is listed by ``list_temp_files`` and removed by ``delete_temp_file``.

A failed check raises :class:`ConformanceError` (an ``AssertionError`` too, so test runners report it
as a failure) naming the check, the URL and what was wrong. Plain functions, no pytest import; with
pytest, parametrize over :data:`CHECK_NAMES` and call :func:`run_check` (docs/storage.md).
Checks run on the calling thread (``commit_visibility`` adds one reader thread).
"""
from __future__ import annotations

import hashlib
import threading
import uuid
from typing import Callable, Iterable, NoReturn, Optional

from ..config import StorageConfig
from ..errors import CheckpointNotFoundError, CheckrunError, CorruptCheckpointError
from ..storage.store import Store

__all__ = ["ConformanceError", "CHECK_NAMES", "run_check", "run_conformance"]


class ConformanceError(CheckrunError, AssertionError):
    """A storage backend does not behave as checkrun needs (the message names check, URL and fault)."""


class _Ctx:
    """One check's directory: ``store()`` opens another Store on it (a fresh view, same options)."""

    def __init__(self, name: str, url: str, storage_options: Optional[dict], config: StorageConfig) -> None:
        self.name, self.url, self.options, self.config = name, url, storage_options, config
        self.main = self.store()

    def store(self) -> Store:
        return Store.for_directory(self.url, self.options, self.config)

    def fail(self, what: str) -> NoReturn:
        raise ConformanceError(f"storage conformance check {self.name!r} failed on {self.url}: {what}")

    def expect(self, ok: object, what: str) -> None:
        if not ok:
            self.fail(what)

    def raises(self, exc_type: type, fn: Callable[[], object], what: str) -> BaseException:
        try:
            fn()
        except exc_type as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - a wrong error type is the finding
            self.fail(f"{what}: raised {type(exc).__name__}: {exc}, expected {exc_type.__name__}")
        self.fail(f"{what}: raised nothing, expected {exc_type.__name__}")


def _key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_blobs(c: _Ctx) -> None:
    s = c.main
    a, b = b"alpha" * 1000, b"beta"
    ka, kb = _key(a), _key(b)[:32]
    c.expect(not s.has_blob(ka), "has_blob is True for a blob never written")
    s.put_blob(ka, a)
    s.put_blob(kb, memoryview(b))
    s.put_blob(ka, a)  # rewriting the same content must be harmless
    c.expect(s.has_blob(ka) and s.has_blob(kb), "has_blob is False right after put_blob")
    c.expect(s.get_blob(ka, len(a)) == a, "get_blob does not return the bytes put_blob wrote")
    c.expect(s.get_blob(kb, 1 << 20) == b, "get_blob of a blob written from a memoryview differs")
    info = s.blob_info(ka)
    c.expect(info is not None and info.size == len(a), f"blob_info gives {info}, expected size {len(a)}")
    c.raises(CorruptCheckpointError, lambda: s.get_blob(ka, len(a) - 1),
             "get_blob of a blob larger than max_bytes")
    c.expect({(x.key, x.size) for x in s.list_blobs()} == {(ka, len(a)), (kb, len(b))},
             f"list_blobs gives {s.list_blobs()}, expected the two blobs written")
    s.delete_blob(ka)
    s.delete_blob(ka)  # a missing blob is not an error
    c.expect(not s.has_blob(ka) and s.blob_info(ka) is None, "a deleted blob still exists")
    exc = c.raises(CorruptCheckpointError, lambda: s.get_blob(ka, len(a)), "get_blob of a deleted blob")
    c.expect(ka[2:] in str(exc), f"the missing-blob error does not name the blob: {exc}")
    c.expect([x.key for x in c.store().list_blobs()] == [kb], "another Store still lists a deleted blob")


def _check_manifests(c: _Ctx) -> None:
    s = c.main
    first, second = b'{"_checkrun":"manifest","n":1}', b'{"_checkrun":"manifest","n":22}'
    c.raises(CheckpointNotFoundError, lambda: s.read_manifest("a.ckpt"), "read_manifest of a missing name")
    c.expect(not s.manifest_exists("a.ckpt"), "manifest_exists is True before any write")
    s.write_manifest("a.ckpt", first)
    c.expect(s.manifest_exists("a.ckpt"), "manifest_exists is False right after write_manifest")
    c.expect(s.read_manifest("a.ckpt") == first, "read_manifest differs from what was written")
    c.expect(s.read_head("a.ckpt", 5) == first[:5], "read_head does not return the first bytes")
    s.write_manifest("a.ckpt", second)
    c.expect(s.read_manifest("a.ckpt") == second, "an overwritten manifest does not read back the new bytes")
    s.copy_manifest("a.ckpt", "last.ckpt")
    c.expect([(f.name, f.size) for f in s.list_files()] == [("a.ckpt", len(second)), ("last.ckpt", len(second))],
             f"list_files gives {s.list_files()}")
    s.delete_manifest("a.ckpt")
    s.delete_manifest("a.ckpt")  # a missing manifest is not an error
    c.expect(not s.manifest_exists("a.ckpt"), "a deleted manifest still exists")
    c.expect([f.name for f in c.store().list_files()] == ["last.ckpt"], "another Store lists a deleted manifest")


def _check_commit_visibility(c: _Ctx) -> None:
    s, other = c.main, c.store()
    versions = [bytes([65 + i]) * (65536 + 4099 * i) for i in range(12)]
    s.write_manifest("m.ckpt", versions[0])
    c.expect(other.read_manifest("m.ckpt") == versions[0], "a second Store does not see a committed manifest")
    seen: list = []
    done = threading.Event()
    errors: list = []

    def reader() -> None:
        try:
            while not done.is_set():
                seen.append(other.read_manifest("m.ckpt"))
        except Exception as exc:  # noqa: BLE001 - reported on the checking thread
            errors.append(exc)

    thread = threading.Thread(target=reader, name="checkrun-conformance-reader", daemon=True)
    thread.start()
    try:
        for data in versions[1:]:
            s.write_manifest("m.ckpt", data)
    finally:
        done.set()
        thread.join()
    c.expect(not errors, f"reading a manifest while it was replaced failed: {errors[:1]}")
    partial = [len(d) for d in seen if d not in versions]
    c.expect(not partial, f"a reader saw a manifest that is no version written (sizes {partial[:5]})")
    c.expect(other.read_manifest("m.ckpt") == versions[-1], "a second Store does not see the last commit")
    s.delete_manifest("m.ckpt")
    c.expect(not other.manifest_exists("m.ckpt"), "a second Store still sees a deleted manifest")


def _check_listing(c: _Ctx) -> None:
    s = c.main
    data = b"x" * 10
    key = _key(data)
    s.put_blob(key, data)
    for name in ("b.ckpt", "a.ckpt", "c.json"):
        s.write_manifest(name, data)
    base = f"{s.root.rstrip('/')}/.checkrun/blobs"
    for stray in (f"{key[:2]}/.tmp-{uuid.uuid4().hex}", "zz/not-a-key", "README", f"{key[:2]}/sub/{key[2:]}"):
        _put_raw(s, f"{base}/{stray}", b"junk")
    _put_raw(s, f"{s.root.rstrip('/')}/.a.ckpt.tmp-{uuid.uuid4().hex}", b"junk")
    c.expect([b.key for b in s.list_blobs()] == [key], f"list_blobs gives {s.list_blobs()}, expected only {key}")
    names = [f.name for f in s.list_files()]
    c.expect(names == ["a.ckpt", "b.ckpt", "c.json"], f"list_files gives {names}")
    c.expect(c.store().subdirectory("nothing-here").list_files() == [], "a missing directory does not list empty")


def _check_temp_cleanup(c: _Ctx) -> None:
    s = c.main
    for i in range(4):
        data = f"blob {i}".encode()
        s.put_blob(_key(data), data)
        s.write_manifest(f"{i}.ckpt", data)
    left = [p for p in _all_paths(s) if ".tmp-" in p.rsplit("/", 1)[-1]]
    c.expect(not left, f"writes left temp files behind: {left[:5]}")
    c.expect(s.list_temp_files() == [], f"list_temp_files gives {s.list_temp_files()} after clean writes")
    if not s.is_local:
        return  # object stores write in one request: no temp files exist to clean
    name = f".0.ckpt.tmp-{uuid.uuid4().hex}"
    _put_raw(s, f"{s.root.rstrip('/')}/{name}", b"interrupted")
    listed = [f.name for f in s.list_temp_files()]
    c.expect(listed == [name], f"list_temp_files gives {listed}, expected [{name!r}]")
    s.delete_temp_file(name)
    c.expect(s.list_temp_files() == [], "delete_temp_file left the temp file")


def _put_raw(store: Store, path: str, data: bytes) -> None:
    """Write straight through the filesystem (stray files the engine never writes)."""
    parent = path.rsplit("/", 1)[0]
    store.fs.makedirs(parent, exist_ok=True)
    store.fs.pipe_file(path, data)
    store.fs.invalidate_cache(parent)


def _all_paths(store: Store) -> list:
    store.fs.invalidate_cache(store.root)
    try:
        return sorted(store.fs.find(store.root))
    except FileNotFoundError:
        return []


_CHECKS: dict = {"blobs": _check_blobs, "manifests": _check_manifests,
                 "commit_visibility": _check_commit_visibility, "listing": _check_listing,
                 "temp_cleanup": _check_temp_cleanup}
CHECK_NAMES: tuple = tuple(_CHECKS)
"""The names of the checks, in the order ``run_conformance`` runs them."""


def run_check(name: str, url: str, storage_options: Optional[dict] = None,
              config: Optional[StorageConfig] = None) -> None:
    """Run one check in the fresh subdirectory ``<url>/<name>-<random>`` (left behind for inspection).

    ``url`` is a directory URL of the backend (``memory://x``, ``/tmp/x``, ``s3://bucket/x``);
    raises :class:`ConformanceError` on the first fault, or the backend's own error."""
    if name not in _CHECKS:
        raise ConformanceError(f"no storage conformance check {name!r} (known: {', '.join(CHECK_NAMES)})")
    directory = f"{str(url).rstrip('/')}/{name}-{uuid.uuid4().hex[:8]}"
    ctx = _Ctx(name, directory, storage_options, config or StorageConfig())
    try:
        _CHECKS[name](ctx)
    finally:
        ctx.main.close()


def run_conformance(url: str, storage_options: Optional[dict] = None, config: Optional[StorageConfig] = None,
                    only: Optional[Iterable[str]] = None) -> list:
    """Run every check (or those named in ``only``) on ``url``; returns the names that passed.

    Stops at the first failed check with its :class:`ConformanceError`."""
    names = list(only) if only is not None else list(CHECK_NAMES)
    for name in names:
        run_check(name, url, storage_options, config)
    return names
