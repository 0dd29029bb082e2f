"""Conformance suite of ckpt_core.storage.store.Store over memory://, local disk and a real S3 endpoint
(moto's HTTP server), plus the retry policy of ckpt_core.storage.retry.

Faults are injected by wrapping the real fsspec filesystem (``FaultyFS``); no test sleeps: the
retry module's ``_sleep`` is replaced by a recorder for every test.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import logging
import os
import threading
import time

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from hypothesis import given, settings, strategies as st

from ckpt_core.storage import retry as retry_mod
from ckpt_core.config import RetryConfig, StorageConfig
from ckpt_core.errors import (CheckpointNotFoundError, CheckrunError, CorruptCheckpointError,
                              StorageError, SupersededError, UnsafePathError)
from ckpt_core.storage.retry import backoff_delay, call_with_retry, is_transient
from ckpt_core.storage.store import BlobInfo, FileInfo, Store

NOW_TOLERANCE = 30.0  # moto truncates LastModified to whole seconds; allow slow CI too


def key_of(data: bytes, n: int = 64) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


@pytest.fixture(autouse=True)
def sleeps(monkeypatch) -> list:
    """Every backoff sleep of the test, recorded instead of slept."""
    recorded: list = []
    monkeypatch.setattr(retry_mod, "_sleep", recorded.append)
    return recorded


def make_store(root, config: StorageConfig | None = None) -> Store:
    return Store.for_directory(root.url, root.storage_options, config or StorageConfig())


def all_paths(store: Store) -> list[str]:
    """Every file under the store root, hidden ones included (straight from the backend)."""
    fs = store.fs._real if isinstance(store.fs, FaultyFS) else store.fs
    fs.invalidate_cache()
    try:
        return sorted(fs.find(store.root))
    except FileNotFoundError:
        return []


class _FailingWriter:
    """A real open file whose first write raises ``exc`` (the temp file already exists)."""

    def __init__(self, real, exc: BaseException) -> None:
        self._real, self._exc = real, exc

    def write(self, data):
        raise self._exc

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()


class FaultyFS:
    """Wraps a real fsspec filesystem; raises queued exceptions on the next calls of an op.

    ops: "write" (pipe_file, or the first write to a file opened for writing), "cat_file",
    "info". ``calls`` counts every attempt of each op, ``kwargs`` records pipe_file keywords.
    """

    def __init__(self, real: fsspec.AbstractFileSystem, **faults: list) -> None:
        self._real = real
        self.faults = {op: list(excs) for op, excs in faults.items()}
        self.calls: collections.Counter = collections.Counter()
        self.kwargs: list = []
        self.open_modes: list = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _next_fault(self, op: str):
        self.calls[op] += 1
        queue = self.faults.get(op)
        return queue.pop(0) if queue else None

    def pipe_file(self, path, data, **kwargs):
        self.kwargs.append(kwargs)
        exc = self._next_fault("write")
        if exc is not None:
            raise exc
        return self._real.pipe_file(path, data, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        f = self._real.open(path, mode, **kwargs)
        if "r" in mode:
            return f
        self.open_modes.append(mode)
        exc = self._next_fault("write")
        return _FailingWriter(f, exc) if exc is not None else f

    def cat_file(self, path, *args, **kwargs):
        exc = self._next_fault("cat_file")
        if exc is not None:
            raise exc
        return self._real.cat_file(path, *args, **kwargs)

    def info(self, path, **kwargs):
        exc = self._next_fault("info")
        if exc is not None:
            raise exc
        return self._real.info(path, **kwargs)


def faulty_store(root, config: StorageConfig | None = None, **faults) -> tuple[Store, FaultyFS]:
    base = make_store(root, config)
    fs = FaultyFS(base.fs, **faults)
    return Store(fs, base.root, base.config, base.url_prefix), fs


def s3_slowdown_error() -> OSError:
    """What s3fs raises for a 503 SlowDown: OSError(EBUSY) caused by a botocore ClientError."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate"},
                       "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    return translate_boto_error(err)


# ---------------------------------------------------------------------------------- blobs
def test_blob_roundtrip(any_root):
    store = make_store(any_root)
    a, b = b"alpha" * 100, b"beta"
    ka, kb = key_of(a), key_of(b, 32)
    assert not store.has_blob(ka)
    store.put_blob(ka, a)
    store.put_blob(kb, memoryview(b))
    store.put_blob(ka, a)  # rewriting the same content is harmless
    assert store.has_blob(ka) and store.has_blob(kb)
    assert store.get_blob(ka, len(a)) == a and store.get_blob(kb, 1 << 20) == b
    assert store.blob_path(ka).endswith(f"/run/.checkrun/blobs/{ka[:2]}/{ka[2:]}")
    listed = store.list_blobs()
    assert [x.key for x in listed] == sorted([ka, kb])
    assert {x.key: x.size for x in listed} == {ka: len(a), kb: len(b)}
    for info in listed:
        assert isinstance(info, BlobInfo) and isinstance(info.mtime, float)
        assert abs(info.mtime - time.time()) < NOW_TOLERANCE
    store.delete_blob(ka)
    store.delete_blob(ka)  # missing is fine
    assert not store.has_blob(ka)
    assert [x.key for x in store.list_blobs()] == [kb]
    assert [x.name for x in store.list_files()] == []  # blobs are not manifests


def test_missing_blob_is_corrupt_and_names_path(any_root):
    store = make_store(any_root)
    key = key_of(b"nothing")
    with pytest.raises(CorruptCheckpointError) as info:
        store.get_blob(key, 100)
    assert f".checkrun/blobs/{key[:2]}/{key[2:]}" in str(info.value)
    assert store.url("") in str(info.value)


def test_blob_max_bytes_checked_before_reading(any_root):
    store, fs = faulty_store(any_root)
    data = bytes(range(100))
    store.put_blob(key_of(data), data)
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        store.get_blob(key_of(data), 99)
    assert fs.calls["cat_file"] == 0
    assert store.get_blob(key_of(data), 100) == data


def test_list_blobs_skips_temp_and_stray_files(any_root):
    store = make_store(any_root)
    key = key_of(b"x")
    store.put_blob(key, b"x")
    base = f"{store.root}/.checkrun/blobs"
    for stray in (f"{key[:2]}/.tmp-123", "zz/not-a-key", "README", f"{key[:2]}/sub/{key[2:]}"):
        if store.is_local:
            os.makedirs(os.path.dirname(f"{base}/{stray}"), exist_ok=True)
        store.fs.pipe_file(f"{base}/{stray}", b"junk")
    assert [b.key for b in store.list_blobs()] == [key]


def test_empty_or_missing_directory_lists_nothing(any_root):
    store = make_store(any_root)
    assert store.list_files() == [] and store.list_blobs() == []
    assert not store.manifest_exists("x.ckpt")


def test_concurrent_puts_of_the_same_blob(any_root):
    store = make_store(any_root, StorageConfig(io_threads=8))
    data = os.urandom(64 << 10)
    store.map(lambda _: store.put_blob(key_of(data), data), range(16))
    assert store.get_blob(key_of(data), len(data)) == data
    assert len(all_paths(store)) == 1  # no temp file survived any of the racing writers


BAD_KEYS = ["../x", "/abs", "s3://other/x", "AB" * 16, "ab" * 8, "a" * 65, "g" * 32,
            "ab" * 16 + "\n", "ab" * 16 + "/x", "../" + "ab" * 16, "", 12345]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_blob_key_validation(memory_root, key):
    store = Store.for_directory(memory_root, None, StorageConfig())
    calls = [store.blob_path, store.has_blob, lambda k: store.put_blob(k, b"x"),
             lambda k: store.get_blob(k, 10), store.delete_blob]
    for call in calls:
        with pytest.raises(UnsafePathError, match="unsafe blob key") as info:
            call(key)
        assert repr(key) in str(info.value)
    assert all_paths(store) == []


# ---------------------------------------------------------------------------------- manifests
def test_manifest_roundtrip(any_root):
    store = make_store(any_root)
    store.write_manifest("epoch=0-step=100.ckpt", b'{"v": 1}')
    store.write_manifest("epoch=0-step=100.ckpt", b'{"v": 2}')  # overwrite is atomic too
    store.copy_manifest("epoch=0-step=100.ckpt", "last.ckpt")
    store.put_blob(key_of(b"b"), b"b")
    assert store.read_manifest("epoch=0-step=100.ckpt") == b'{"v": 2}'
    assert store.read_manifest("last.ckpt") == b'{"v": 2}'
    assert store.manifest_exists("last.ckpt") and not store.manifest_exists("nope.ckpt")
    files = store.list_files()
    assert [f.name for f in files] == ["epoch=0-step=100.ckpt", "last.ckpt"]
    for f in files:
        assert isinstance(f, FileInfo) and f.size == 8 and isinstance(f.mtime, float)
        assert abs(f.mtime - time.time()) < NOW_TOLERANCE
    store.delete_manifest("epoch=0-step=100.ckpt")
    store.delete_manifest("epoch=0-step=100.ckpt")  # missing is fine
    assert [f.name for f in store.list_files()] == ["last.ckpt"]
    assert store.read_manifest("last.ckpt") == b'{"v": 2}'  # copies are independent
    assert store.url("last.ckpt") == f"{any_root.url}/last.ckpt"


def test_no_temp_files_visible_or_left(any_root):
    store = make_store(any_root)
    for i in range(3):
        store.write_manifest("last.ckpt", b"%d" % i)
    store.fs.pipe_file(f"{store.root}/.other.ckpt.tmp-abc", b"half")  # a crashed writer's
    assert [f.name for f in store.list_files()] == ["last.ckpt"]
    leftovers = [p for p in all_paths(store) if ".tmp-" in p and "other" not in p]
    assert leftovers == []


def test_read_missing_manifest(any_root):
    store = make_store(any_root)
    url = store.url("missing.ckpt")
    for call in (lambda: store.read_manifest("missing.ckpt"),
                 lambda: store.read_head("missing.ckpt", 4),
                 lambda: store.copy_manifest("missing.ckpt", "last.ckpt")):
        with pytest.raises(CheckpointNotFoundError) as info:
            call()
        assert url in str(info.value) and isinstance(info.value, FileNotFoundError)
    assert not store.manifest_exists("last.ckpt")


def test_read_head_and_manifest_max_bytes(any_root):
    store = make_store(any_root)
    store.write_manifest("a.ckpt", b"CKRN\x00rest-of-it!")
    store.write_manifest("empty.ckpt", b"")
    assert store.read_head("a.ckpt", 4) == b"CKRN"
    assert store.read_head("a.ckpt", 1000) == b"CKRN\x00rest-of-it!"
    assert store.read_head("empty.ckpt", 4) == b""
    with pytest.raises(CorruptCheckpointError, match="16 bytes"):
        store.read_manifest("a.ckpt", max_bytes=15)
    assert store.read_manifest("a.ckpt", max_bytes=16) == b"CKRN\x00rest-of-it!"


BAD_NAMES = ["a/b", "..", ".", "", ".checkrun", ".checkrun-x", ".x.ckpt.tmp-1", "a\\b", "a\0b"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_manifest_name_validation(memory_root, name):
    store = Store.for_directory(memory_root, None, StorageConfig())
    for call in (lambda: store.write_manifest(name, b"x"), lambda: store.read_manifest(name),
                 lambda: store.read_head(name, 1), lambda: store.manifest_exists(name),
                 lambda: store.delete_manifest(name), lambda: store.copy_manifest("a", name)):
        with pytest.raises(UnsafePathError):
            call()


def test_changes_by_other_writers_are_seen(any_root):
    """Listings cached by s3fs must not hide another process's writes or deletes."""
    store = make_store(any_root)
    assert store.list_files() == [] and not store.manifest_exists("x.ckpt")
    protocol = any_root.url.split("://")[0] if "://" in any_root.url else "file"
    other = fsspec.filesystem(protocol, skip_instance_cache=True, **any_root.storage_options)
    other.makedirs(store.root, exist_ok=True)
    other.pipe_file(f"{store.root}/x.ckpt", b"from elsewhere")
    assert store.manifest_exists("x.ckpt")
    assert [f.name for f in store.list_files()] == ["x.ckpt"]
    other.rm_file(f"{store.root}/x.ckpt")
    assert not store.manifest_exists("x.ckpt") and store.list_files() == []


def test_manifest_commit_is_one_put_or_one_rename(any_root):
    store, fs = faulty_store(any_root)
    store.write_manifest("last.ckpt", b"{}")
    if store.is_local:
        assert fs.open_modes == ["wb"] and fs.kwargs == []
    else:
        assert fs.calls["write"] == 1 and fs.open_modes == []
        # s3fs would switch to a multipart upload above 2 * chunksize; forbid it for manifests.
        assert fs.kwargs[0].get("chunksize", 0) >= (5 << 30 if any_root.backend == "s3" else 0)


def test_local_files_get_the_process_umask(tmp_path):
    store = Store.for_directory(tmp_path / "run", None, StorageConfig())
    old = os.umask(0o022)
    try:
        store.write_manifest("last.ckpt", b"{}")
        store.put_blob(key_of(b"x"), b"x")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "run" / "last.ckpt").st_mode & 0o777 == 0o644
    assert os.stat(store.blob_path(key_of(b"x"))).st_mode & 0o777 == 0o644


def test_local_without_fsync(tmp_path):
    store = Store.for_directory(str(tmp_path), None, StorageConfig(fsync=False))
    store.write_manifest("a.ckpt", b"1")
    store.put_blob(key_of(b"1"), b"1")
    assert store.read_manifest("a.ckpt") == b"1" and store.get_blob(key_of(b"1"), 1) == b"1"


def test_commit_strategy_is_chosen_once_from_the_filesystem(any_root):
    from ckpt_core.storage.commit import RenameCommit, SinglePutCommit

    store = make_store(any_root)
    expected = RenameCommit if any_root.backend == "local" else SinglePutCommit
    assert type(store.commit) is expected and store.commit.leaves_temp_files == (expected is RenameCommit)
    assert type(store.subdirectory("sub").commit) is expected
    assert store.shared_between_processes == (any_root.backend != "memory")


def test_atomic_write_leaves_the_old_file_and_no_temp_file_on_any_error(tmp_path):
    from ckpt_core.storage.atomic import write_atomic

    target = tmp_path / "out.bin"
    write_atomic(str(target), lambda f: f.write(b"old"))

    def half_then_fail(f):
        f.write(b"new but")
        raise KeyboardInterrupt  # ^C in the middle: BaseException too

    def refuse():
        raise SupersededError("refused by the fence")

    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(target), half_then_fail)
    with pytest.raises(SupersededError):
        write_atomic(str(target), lambda f: f.write(b"new"), before_replace=refuse)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    write_atomic(str(target), lambda f: f.write(b"new"), fsync=False, tmp_prefix=".x")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


# ---------------------------------------------------------------------------------- paths
def test_for_path_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store, name = Store.for_path("runs/epoch=1.ckpt", None, StorageConfig())
    assert name == "epoch=1.ckpt" and store.root == str(tmp_path / "runs")
    assert store.url(name) == str(tmp_path / "runs" / "epoch=1.ckpt")
    store2, name2 = Store.for_path(f"file://{tmp_path}/runs/last.ckpt", None, StorageConfig())
    assert store2.root == store.root and store2.url(name2) == str(tmp_path / "runs" / "last.ckpt")
    assert Store.for_path(tmp_path / "x.ckpt", None, StorageConfig())[1] == "x.ckpt"
    for bad in (".checkrun", ".x.ckpt.tmp-1"):
        with pytest.raises(UnsafePathError):
            Store.for_path(tmp_path / bad, None, StorageConfig())


class _OtherLocalFS(LocalFileSystem):
    """A LocalFileSystem subclass under its own protocol, as fault-injecting test doubles are."""

    protocol = ("ckothertestfile",)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("ckothertestfile://"))


def test_local_subclass_keeps_its_scheme_and_atomic_commit(tmp_path):
    fsspec.register_implementation("ckothertestfile", _OtherLocalFS, clobber=True)
    url = f"ckothertestfile://{tmp_path}/run/a.ckpt"
    store, name = Store.for_path(url, None, StorageConfig())
    assert store.is_local and store.url(name) == url
    store.write_manifest(name, b"m")
    assert os.listdir(tmp_path / "run") == ["a.ckpt"]
    again, _ = Store.for_path(store.url(name), None, StorageConfig())
    assert again.root == str(tmp_path / "run") and again.read_manifest(name) == b"m"


def test_for_path_round_trips_urls(any_root):
    url = f"{any_root.url}/epoch=0-step=5.ckpt"
    store, name = Store.for_path(url, any_root.storage_options, StorageConfig())
    store.write_manifest(name, b"m")
    again, name2 = Store.for_path(store.url(name), any_root.storage_options, StorageConfig())
    assert (again.root, name2) == (store.root, name)
    assert again.read_manifest(name2) == b"m"
    if any_root.backend == "s3":
        assert store.url(name) == url  # remote URLs keep their protocol, spelled as given


@pytest.mark.s3
def test_call_options_override_config_options(s3_root, s3_storage_options):
    bad = {**s3_storage_options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    config = StorageConfig(storage_options=bad)
    store, name = Store.for_path(f"{s3_root}/a.ckpt", s3_storage_options, config)
    store.write_manifest(name, b"ok")
    assert store.read_manifest(name) == b"ok"
    with pytest.raises(UnsafePathError, match="inside a directory"):
        Store.for_path("s3://just-a-bucket", s3_storage_options, config)


# ---------------------------------------------------------------------------------- faults
TRANSIENT = [TimeoutError("timed out"), ConnectionResetError(errno.ECONNRESET, "reset")]


def test_transient_write_errors_are_retried(any_root, sleeps, caplog):
    store, fs = faulty_store(any_root, write=list(TRANSIENT))
    with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
        store.write_manifest("last.ckpt", b"{}")
    assert fs.calls["write"] == 3 and len(sleeps) == 2
    assert store.read_manifest("last.ckpt") == b"{}"
    assert [p for p in all_paths(store) if ".tmp-" in p] == []
    messages = [r.getMessage() for r in caplog.records if r.name == "ckpt_core.storage.store"]
    assert len(messages) == 2 and all(store.url("last.ckpt") in m for m in messages)
    assert "TimeoutError" in messages[0] and "ConnectionResetError" in messages[1]


def test_s3fs_style_errors_and_read_faults_are_retried(any_root):
    pytest.importorskip("s3fs")
    data = b"payload"
    store, fs = faulty_store(any_root, write=[s3_slowdown_error()],
                             cat_file=[TimeoutError("read timed out")], info=[TimeoutError()])
    store.put_blob(key_of(data), data)
    assert store.get_blob(key_of(data), 100) == data
    assert (fs.calls["write"], fs.calls["cat_file"]) == (2, 2)


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 PermissionError(errno.EACCES, "Permission denied")],
                         ids=["ENOSPC", "EACCES"])
def test_permanent_write_errors_fail_at_once(any_root, sleeps, exc):
    store, fs = faulty_store(any_root, write=[exc])
    with pytest.raises(StorageError) as info:
        store.write_manifest("last.ckpt", b"{}")
    assert info.value.__cause__ is exc and store.url("last.ckpt") in str(info.value)
    assert fs.calls["write"] == 1 and sleeps == []
    assert all_paths(store) == []  # no temp file, no manifest
    store2, _ = faulty_store(any_root, write=[exc])
    with pytest.raises(StorageError):
        store2.put_blob(key_of(b"x"), b"x")
    assert all_paths(store2) == []


def test_retry_exhaustion_message(any_root, sleeps):
    config = StorageConfig(retry=RetryConfig(max_attempts=3, initial_backoff_seconds=0.5,
                                             max_backoff_seconds=0.75))
    store, fs = faulty_store(any_root, config, write=[TimeoutError("timed out")] * 5)
    with pytest.raises(StorageError) as info:
        store.write_manifest("x.ckpt", b"{}")
    url = store.url("x.ckpt")
    assert str(info.value) == f"write manifest {url}: failed after 3 attempts: TimeoutError: timed out"
    assert isinstance(info.value.__cause__, TimeoutError)
    assert fs.calls["write"] == 3 and len(sleeps) == 2
    assert 0.25 <= sleeps[0] <= 0.5 and 0.375 <= sleeps[1] <= 0.75
    assert not store.manifest_exists("x.ckpt")


# ---------------------------------------------------------------------------------- retry policy
def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def test_is_transient_builtin_errors():
    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert is_transient(ConnectionRefusedError()) and is_transient(OSError(errno.ETIMEDOUT, "t"))
    for exc in (FileNotFoundError(), PermissionError(), OSError(errno.ENOSPC, "full"),
                ValueError("x"), RuntimeError("x"), StorageError("gave up")):
        assert not is_transient(exc), exc
    wrapped = StorageError("failed after 5 attempts")
    wrapped.__cause__ = TimeoutError()
    assert not is_transient(wrapped)


def test_is_transient_botocore_and_s3fs_errors():
    bex = pytest.importorskip("botocore.exceptions")
    from s3fs.errors import translate_boto_error

    for code, status in [("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503),
                         ("RequestTimeout", 400), ("Throttling", 400), ("BadGateway", 502),
                         ("GatewayTimeout", 504)]:
        assert is_transient(_client_error(code, status)), code
        assert is_transient(translate_boto_error(_client_error(code, status))), code
    for code, status in [("NoSuchKey", 404), ("AccessDenied", 403), ("InvalidArgument", 400)]:
        assert not is_transient(_client_error(code, status)), code
        assert not is_transient(translate_boto_error(_client_error(code, status))), code
    assert is_transient(bex.EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(bex.ReadTimeoutError(endpoint_url="http://x"))
    assert is_transient(bex.ConnectTimeoutError(endpoint_url="http://x"))
    # a body damaged in transit (botocore's response checksum): read again (found by a fault proxy:
    # one flipped byte failed a load, and latest() went back to an older checkpoint)
    assert is_transient(bex.FlexibleChecksumError(error_msg="Expected checksum x did not match calculated checksum y"))


def test_call_with_retry_error_kinds():
    def raiser(exc):
        calls.append(1)
        raise exc

    config = RetryConfig(max_attempts=4)
    for exc in (CorruptCheckpointError("bad"), FileNotFoundError("gone")):
        calls: list = []
        with pytest.raises(type(exc)) as info:
            call_with_retry(lambda: raiser(exc), config=config, what="op")
        assert info.value is exc and len(calls) == 1
    calls = []
    with pytest.raises(StorageError, match=r"^read thing: ValueError: nope$") as info:
        call_with_retry(lambda: raiser(ValueError("nope")), config=config, what="read thing")
    assert isinstance(info.value.__cause__, ValueError) and len(calls) == 1
    assert isinstance(info.value, CheckrunError)


def test_call_with_retry_uses_injected_sleep():
    outcomes = [TimeoutError(), TimeoutError(), "done"]
    slept: list = []

    def fn():
        item = outcomes.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    assert call_with_retry(fn, config=RetryConfig(), what="op", sleep=slept.append) == "done"
    assert len(slept) == 2


@settings(max_examples=200, deadline=None)
@given(attempt=st.integers(1, 60), initial=st.floats(0.001, 10), cap=st.floats(0.001, 60))
def test_backoff_is_exponential_jittered_and_capped(attempt, initial, cap):
    config = RetryConfig(initial_backoff_seconds=initial, max_backoff_seconds=cap)
    bound = min(cap, initial * 2 ** (attempt - 1))
    assert bound / 2 <= backoff_delay(attempt, config) <= bound


# ---------------------------------------------------------------------------------- pool
def test_map_order_and_pool_reuse(memory_root):
    store = Store.for_directory(memory_root, None, StorageConfig(io_threads=3))
    names: set = set()

    def work(i):
        names.add(threading.current_thread().name)
        return i * i

    assert store.map(work, range(20)) == [i * i for i in range(20)]
    pool = store._pool
    assert store.map(work, iter(range(5))) == [0, 1, 4, 9, 16] and store._pool is pool
    assert names and all(n.startswith("checkrun-io") for n in names) and len(names) <= 3
    assert store.map(work, []) == []
    store.close()
    store.close()
    assert store._pool is None and store.map(work, [1, 2]) == [1, 4]  # a new pool
    store.close()


def test_map_raises_first_failure_after_the_rest_settled(memory_root):
    store = Store.for_directory(memory_root, None, StorageConfig(io_threads=4))
    started, finished = set(), set()
    lock = threading.Lock()

    def work(i):
        with lock:
            started.add(i)
        try:
            if i in (3, 7):
                raise KeyError(i)
            return i
        finally:
            with lock:
                finished.add(i)

    with store, pytest.raises(KeyError) as info:
        store.map(work, range(40))
    assert info.value.args == (3,)
    assert started == finished  # nothing still running after map raised


def test_map_with_cost_runs_small_items_together_in_order(memory_root):
    import ckpt_core.storage.pool as pool_mod

    store = Store.for_directory(memory_root, None, StorageConfig(io_threads=3))
    where: dict = {}

    def work(i):
        where[i] = threading.current_thread().name
        if i == 45:
            raise KeyError(i)
        return -i

    big = pool_mod.BATCH_COST
    sizes = [10] * 30 + [big] + [big // 2] * 3 + [10] * 6
    with store:
        assert store.map(work, range(40), cost=sizes.__getitem__) == [-i for i in range(40)]
        # the 30 small items are one pool task (one thread); the big one is alone
        assert len({where[i] for i in range(30)}) == 1
        assert pool_mod.batches(list(range(40)), sizes.__getitem__) == [
            list(range(31)), [31, 32], list(range(33, 40))]
        with pytest.raises(KeyError):  # an item's failure still surfaces from its batch
            store.map(work, range(40, 50), cost=lambda i: 1)
        assert store.map(work, [7], cost=lambda i: 1) == [-7]


def test_map_with_cost_on_an_object_store_runs_each_item_as_its_own_task(s3_root, s3_storage_options):
    """Grouping small items into one pool task (for local reads) made S3 requests run one after another:
    the blobs a repeat save reads back (Lightning's last.ckpt) took 3 x 50 ms in turn on moto. Three
    small items meet at a barrier only if they run at once (a group would break it at its timeout)."""
    barrier = threading.Barrier(3, timeout=60)  # a hang guard; passing costs no wait
    with Store.for_directory(s3_root, s3_storage_options, StorageConfig(io_threads=3)) as store:
        assert store.map(lambda i: barrier.wait() >= 0 and i, range(3), cost=lambda i: 10) == [0, 1, 2]


def test_map_nested_in_pool_does_not_deadlock(memory_root):
    with Store.for_directory(memory_root, None, StorageConfig(io_threads=2)) as store:
        out = store.map(lambda i: sum(store.map(lambda j: i * j, range(4))), range(6))
    assert out == [i * 6 for i in range(6)]


def test_blob_directories_are_fsynced_before_the_manifest_is_committed(tmp_path, monkeypatch):
    """put_blob defers its directory fsync; write_manifest must do them all before its rename."""
    import ckpt_core.storage.atomic as atomic_mod
    import torch

    import ckpt_core

    events: list[tuple[str, str]] = []
    real_fsync_dir, real_replace = atomic_mod.fsync_dir, os.replace
    monkeypatch.setattr(atomic_mod, "fsync_dir", lambda d: (events.append(("fsync", d)), real_fsync_dir(d)))
    monkeypatch.setattr(atomic_mod.os, "replace",
                        lambda a, b: (real_replace(a, b), events.append(("rename", os.path.dirname(b))))[0])
    state = {f"t{i}": torch.randn(64, 64) for i in range(6)}
    ckpt_core.save(state, tmp_path / "a.ckpt", config={"compression": {"chunk_bytes": 4096}})
    commit = max(i for i, (kind, d) in enumerate(events) if kind == "rename" and d == str(tmp_path))
    blob_dirs = {d for kind, d in events[:commit]  # lease objects are not fsynced: they matter only
                 if kind == "rename" and d != str(tmp_path) and "/.checkrun/leases" not in d}  # while their writer runs
    assert len(blob_dirs) > 3
    for d in blob_dirs:
        last_rename = max(i for i, e in enumerate(events) if e == ("rename", d))
        assert any(e == ("fsync", d) for e in events[last_rename:commit]), d


def test_a_missing_bucket_is_an_error_not_an_empty_directory(s3_root, s3_storage_options):
    """``latest("s3://tpyo/run")`` answered None, so a resume started afresh and only its first save
    said the bucket does not exist (found by a fault program on S3). A missing prefix of an existing
    bucket is still an empty directory (a first run)."""
    import torch

    from ckpt_core import CheckpointEngine

    with CheckpointEngine({"storage": {"storage_options": s3_storage_options}}) as engine:
        assert engine.latest(s3_root) is None and engine.list(s3_root) == []
        missing = "s3://no-such-bucket-" + s3_root.split("/")[2][5:] + "/run"
        with pytest.raises(CheckpointNotFoundError, match="the bucket 'no-such-bucket-.*' does not exist"):
            engine.latest(missing)
        engine.save({"w": torch.ones(2)}, f"{s3_root}/a.ckpt").result()
        assert engine.latest(s3_root) == f"{s3_root}/a.ckpt"


def test_local_reads_go_through_the_os_and_refuse_what_is_not_a_regular_file(tmp_path) -> None:
    """``storage.localio.read_file_into`` (the plain local disk's blob reads, without fsspec's per-blob
    ``info`` + ``open``): pieces fill the buffer, a longer file shows as a full buffer (the caller's
    size check), and anything but a regular file is "not a file" without blocking (a FIFO)."""
    import socket

    from ckpt_core.storage import localio

    data = bytes(range(256)) * 40
    (tmp_path / "blob").write_bytes(data)
    buf = memoryview(bytearray(len(data) + 1))
    assert bytes(localio.read_file_into(str(tmp_path / "blob"), buf, 1000)) == data
    short = memoryview(bytearray(100))
    assert bytes(localio.read_file_into(str(tmp_path / "blob"), short, 7)) == data[:100]
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for name in ("fifo", "dir", "sock", "missing"):
            with pytest.raises(FileNotFoundError):
                localio.read_file_into(str(tmp_path / name), buf, 1000)
    finally:
        sock.close()


def test_a_damaged_blob_on_s3_is_named_by_its_url(s3_root, s3_storage_options, _s3_admin):
    """Errors name a blob as every other message names objects: ``s3://bucket/...`` (h102: the bucket path
    without the scheme)."""
    import torch

    import ckpt_core

    path = f"{s3_root}/a.ckpt"
    ckpt_core.save({"w": torch.arange(4096.0)}, path, storage_options=s3_storage_options)
    with ckpt_core.CheckpointEngine() as engine:
        key = next(iter(engine.read_manifest(path, storage_options=s3_storage_options).blobs())).key
    blob = f"{s3_root}/.checkrun/blobs/{key[:2]}/{key[2:]}"
    data = bytearray(_s3_admin.cat_file(blob))
    data[-1] ^= 1
    _s3_admin.pipe_file(blob, bytes(data))
    with pytest.raises(CorruptCheckpointError) as err:
        ckpt_core.load(path, storage_options=s3_storage_options)
    assert f"{blob}: checksum mismatch" in str(err.value)


def test_folders_made_in_a_group_shared_directory_are_group_writable(tmp_path) -> None:
    """h144: in a directory shared by a group (``chmod 2775``), a teammate saving with umask 022 made
    ``.checkrun/blobs/<xx>/`` (and the other folders) 2755: the owner's next save and gc failed there with
    PermissionError. Folders made in a setgid, group-writable directory get its group bits."""
    import stat

    import torch
    from ckpt_core import CheckpointEngine, EngineConfig

    shared = tmp_path / "team"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    old = os.umask(0o022)
    try:
        with CheckpointEngine() as engine:
            engine.save({"w": torch.arange(64.0), "b": torch.ones(3)}, shared / "run" / "step=1.ckpt").result()
            log = engine.step_log(shared / "run", torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
            log.close()
    finally:
        os.umask(old)
    folders = [os.path.join(root, d) for root, dirs, _ in os.walk(shared) for d in dirs]
    assert any("/.checkrun/blobs/" in f for f in folders) and any(f.endswith("leases") for f in folders)
    for folder in folders:
        mode = os.stat(folder).st_mode
        assert mode & stat.S_IWGRP and mode & stat.S_ISGID, (folder, oct(mode))
    from ckpt_core.format.composite import make_folder

    old = os.umask(0o022)
    try:  # h146: accelerate_ckpt's checkpoint_N folders are made through make_folder
        make_folder(shared / "project" / "checkpoints" / "checkpoint_3", None, EngineConfig())
    finally:
        os.umask(old)
    for folder in ("project", "project/checkpoints", "project/checkpoints/checkpoint_3"):
        assert os.stat(shared / folder).st_mode & stat.S_IWGRP, folder
    private = tmp_path / "mine"  # not shared: the umask decides, as for any folder
    private.mkdir()
    os.chmod(private, 0o755)
    old = os.umask(0o022)
    try:
        with CheckpointEngine() as engine:
            engine.save({"w": torch.arange(64.0)}, private / "step=1.ckpt").result()
    finally:
        os.umask(old)
    assert not os.stat(private / ".checkrun").st_mode & stat.S_IWGRP

