"""Fault injection that wraps the *real* storage: the local filesystem and s3fs's botocore client.

``FaultFS`` (``faultfile://`` URLs, local paths underneath) is a LocalFileSystem whose every
storage operation first asks the installed ``policy`` (class-level: one scenario at a time per
process) what to do: nothing, raise, or block. The engine sees it as a local filesystem, so it
keeps its temp-file + fsync + rename commit; the bytes land on the real disk.

Operations reported to a policy: ``on(op, kind, path)`` with op in ``info`` (a stat of one path),
``stat`` (a stat of each entry inside a listing), ``read``, ``list``,
``open`` (a file opened for writing, after it exists), ``close`` (a written file, after flush and
fsync, before the engine renames it), ``delete``; ``kind`` is ``"blob"``, ``"lease"`` (lease objects,
``.checkrun/leases/``) or ``"manifest"`` (anything else).
Written data goes through ``data(kind, path, buf, write)`` so a policy can write part of it
(ENOSPC after a quota, a torn write before a kill).

``S3Faults`` registers a botocore ``before-send`` handler on the s3fs client the engine uses: the
request is answered by a real HTTP error response (503 SlowDown, 500 InternalError, 403
AccessDenied) that botocore parses into a ``ClientError`` and s3fs translates, exactly as if
the server had sent it. No sleeps anywhere: gates are threading.Events.
"""
from __future__ import annotations

import collections
import errno
import os
import threading

import xxhash

import fsspec
from fsspec.implementations.local import LocalFileSystem

BLOB_MARK = "/.checkrun/blobs"
LEASE_MARK = "/.checkrun/leases"


def kind_of(path: str) -> str:
    path = str(path)
    return "blob" if BLOB_MARK in path else "lease" if LEASE_MARK in path else "manifest"


def group_of(path: str) -> str:
    """Writes go to fresh temp names; faults are budgeted per final directory/name instead."""
    path = str(path)
    head, _, name = path.rpartition("/")
    if ".tmp-" in name:
        return head + "/" + name.split(".tmp-")[0]
    return path


def uniform(seed: int, *parts) -> float:
    """A deterministic number in [0, 1) for these parts (independent of thread scheduling)."""
    return xxhash.xxh64_intdigest("|".join(map(str, (seed, *parts))).encode()) / 2.0**64


class Policy:
    """Does nothing; subclasses override ``on`` and/or ``data``."""

    def on(self, op: str, kind: str, path: str) -> None:
        pass

    def data(self, kind: str, path: str, buf, write) -> None:
        write(buf)


class _File:
    """A real file opened for writing whose writes and close go through the policy."""

    def __init__(self, real, kind: str, path: str) -> None:
        self._real, self._kind, self._path = real, kind, path

    def write(self, buf):
        policy = FaultFS.policy or Policy()
        policy.data(self._kind, self._path, buf, self._write_through)
        return len(memoryview(buf).cast("B"))

    def _write_through(self, buf) -> None:
        self._real.write(buf)
        self._real.flush()  # what was written is in the OS: a SIGKILL right after cannot lose it

    def close(self):
        if not self._real.closed:
            self._real.flush()
            (FaultFS.policy or Policy()).on("close", self._kind, self._path)
        self._real.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:  # the engine is unwinding (ENOSPC...): just close, no hook
            self._real.close()
        else:
            self.close()

    def __getattr__(self, name):
        return getattr(self._real, name)


class FaultFS(LocalFileSystem):
    protocol = ("faultfile",)
    root_marker = "/"
    policy: Policy | None = None

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("faultfile://"):
            path = path[len("faultfile://"):]
        return super()._strip_protocol(path)

    def _on(self, op: str, path) -> None:
        policy = FaultFS.policy
        if policy is not None:
            policy.on(op, kind_of(path), str(path))

    def info(self, path, **kwargs):
        if isinstance(path, os.DirEntry):  # LocalFileSystem.ls(detail=True) stats each entry
            self._on("stat", path.path)
        else:
            self._on("info", self._strip_protocol(path))
        return super().info(path, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        self._on("read", self._strip_protocol(path))
        return super().cat_file(path, start=start, end=end, **kwargs)

    def ls(self, path, detail=False, **kwargs):
        self._on("list", self._strip_protocol(path))
        return super().ls(path, detail=detail, **kwargs)

    def rm_file(self, path):
        self._on("delete", self._strip_protocol(path))
        return super().rm_file(path)

    def open(self, path, mode="rb", **kwargs):
        f = super().open(path, mode, **kwargs)
        if "w" not in mode and "a" not in mode:
            return f
        stripped = self._strip_protocol(path)
        try:
            self._on("open", stripped)
        except BaseException:
            f.close()
            raise
        return _File(f, kind_of(stripped), stripped)


fsspec.register_implementation("faultfile", FaultFS, clobber=True)


# ------------------------------------------------------------------------------------ policies
def transient_error(i: int) -> BaseException:
    """The transient errors storage clients really raise, in rotation."""
    which = i % 4
    if which == 0:
        return TimeoutError("injected: read timed out")
    if which == 1:
        return ConnectionResetError(errno.ECONNRESET, "injected: connection reset by peer")
    try:
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error
    except ImportError:  # pragma: no cover - s3fs is a dev dependency
        return TimeoutError("injected: timed out")
    code, status = ("SlowDown", 503) if which == 2 else ("InternalError", 500)
    err = ClientError({"Error": {"Code": code, "Message": f"injected {code}"},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return translate_boto_error(err)  # an OSError whose __cause__ is the ClientError, like s3fs


class Transient(Policy):
    """Fail ``fraction`` of the calls of ``ops`` with transient errors, deterministically.

    The n-th call on one path (temp names folded to their final name) fails when
    ``uniform(seed, op, path, n) < fraction`` and at most ``max_per_path`` times, so every
    operation succeeds within the engine's retry budget whatever the thread schedule.
    """

    def __init__(self, fraction: float, ops=("open", "close", "read", "info", "stat", "delete", "list"),
                 seed: int = 0, max_per_path: int = 2) -> None:
        self.fraction, self.ops, self.seed, self.max_per_path = fraction, set(ops), seed, max_per_path
        self.calls: collections.Counter = collections.Counter()
        self.injected: collections.Counter = collections.Counter()
        self._per_path: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def on(self, op: str, kind: str, path: str) -> None:
        if op not in self.ops:
            return
        group = (op, group_of(path))
        with self._lock:
            self.calls[op] += 1
            n = self._per_path[group]
            self._per_path[group] += 1
            fail = n < self.max_per_path and uniform(self.seed, op, group, n) < self.fraction
            if fail:
                self.injected[op] += 1
                total = sum(self.injected.values())
        if fail:
            raise transient_error(total)


class Permanent(Policy):
    """Raise ``exc`` on every call of ``ops`` on paths of ``kind`` (None = both kinds)."""

    def __init__(self, exc: BaseException, ops=("open",), kind: str | None = None) -> None:
        self.exc, self.ops, self.kind = exc, set(ops), kind
        self.raised = 0

    def on(self, op: str, kind: str, path: str) -> None:
        if op in self.ops and self.kind in (None, kind):
            self.raised += 1
            raise self.exc


class DiskFull(Policy):
    """A disk with ``free`` bytes left: the write that crosses it writes what fits, then ENOSPC.

    ``kind``: only writes of that kind count (``"manifest"``: the disk fills up at the commit)."""

    def __init__(self, free: int, kind: str | None = None) -> None:
        self.free, self.kind, self.failures = free, kind, 0
        self._lock = threading.Lock()

    def data(self, kind: str, path: str, buf, write) -> None:
        if self.kind not in (None, kind):
            write(buf)
            return
        view = memoryview(buf).cast("B")
        with self._lock:
            fits = min(self.free, view.nbytes)
            self.free -= fits
        write(view[:fits])
        if fits < view.nbytes:
            with self._lock:
                self.failures += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)


class Gate(Policy):
    """Block the ``n``-th call of ``op`` on ``kind`` (on paths containing ``match``) until
    ``release()``; ``entered`` says it is held.

    Every other call passes. Waiting for ``entered`` is the synchronisation (no sleeps); tests
    bound that wait only as a watchdog against a hang."""

    def __init__(self, op: str, kind: str | None = None, n: int = 1, also: Policy | None = None,
                 match: str = "") -> None:
        self.op, self.kind, self.n, self.also, self.match = op, kind, n, also, match
        self.count = 0
        self.entered = threading.Event()
        self._open = threading.Event()
        self.held_path: str | None = None
        self._lock = threading.Lock()

    def on(self, op: str, kind: str, path: str) -> None:
        if self.also is not None:
            self.also.on(op, kind, path)
        if op != self.op or self.kind not in (None, kind) or self.match not in path:
            return
        with self._lock:
            self.count += 1
            mine = self.count == self.n
        if mine:
            self.held_path = path
            self.entered.set()
            self._open.wait()

    def release(self) -> None:
        self._open.set()


class BlockAll(Policy):
    """Hold every call of ``op`` on ``kind`` until released; counts callers that are held."""

    def __init__(self, op: str, kind: str | None = None) -> None:
        self.op, self.kind = op, kind
        self.held = 0
        self.first = threading.Event()
        self._open = threading.Event()
        self._lock = threading.Lock()

    def on(self, op: str, kind: str, path: str) -> None:
        if op != self.op or self.kind not in (None, kind):
            return
        with self._lock:
            self.held += 1
        self.first.set()
        self._open.wait()

    def release(self) -> None:
        self._open.set()


# ------------------------------------------------------------------------------------------ S3
class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def read(self, *args) -> bytes:
        return self._data

    def stream(self, **kwargs):  # pragma: no cover - error bodies are read whole
        yield self._data


_ERRORS = {503: ("SlowDown", "Please reduce your request rate."),
           500: ("InternalError", "We encountered an internal error. Please try again."),
           403: ("AccessDenied", "Access Denied")}


class S3Faults:
    """Answer ``fraction`` of the ``operations`` of an s3fs filesystem with an HTTP ``status`` error.

    Installed as a botocore ``before-send`` handler on the very client the engine uses (fsspec
    caches filesystem instances, so ``fsspec.filesystem("s3", **opts)`` is the engine's): the
    response goes through botocore's parser and s3fs's error translation unchanged. The retries
    of botocore and s3fs are switched off on that instance (``retries=1``, and the caller's
    storage options set ``config_kwargs.retries.total_max_attempts=1``) so that the engine's own
    policy (``storage.retry``) is what retries. ``remove()`` restores the instance.
    """

    def __init__(self, fs, fraction: float, operations=("PutObject",), status: int = 503,
                 seed: int = 0, max_per_key: int = 2) -> None:
        from aiobotocore.awsrequest import AioAWSResponse

        self.fs, self.fraction, self.status, self.seed = fs, fraction, status, seed
        self.max_per_key = max_per_key
        self.calls: collections.Counter = collections.Counter()
        self.injected: collections.Counter = collections.Counter()
        self._per_key: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._response_cls = AioAWSResponse
        fs.connect()
        self._client = fs.s3
        self._saved_retries = fs.retries
        fs.retries = 1
        self._handlers = []
        for op in operations:
            handler = self._make_handler(op)
            self._client.meta.events.register(f"before-send.s3.{op}", handler)
            self._handlers.append((f"before-send.s3.{op}", handler))

    def _make_handler(self, op: str):
        def handler(request, **kwargs):
            key = request.url.split("?")[0]
            with self._lock:
                self.calls[op] += 1
                n = self._per_key[(op, key)]
                self._per_key[(op, key)] += 1
                fail = n < self.max_per_key and uniform(self.seed, op, key, n) < self.fraction
                if fail:
                    self.injected[op] += 1
            if not fail:
                return None
            code, message = _ERRORS[self.status]
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                    f"<Message>{message}</Message><RequestId>injected</RequestId></Error>").encode()
            headers = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
            return self._response_cls(request.url, self.status, headers, _Body(body))
        return handler

    def remove(self) -> None:
        for event, handler in self._handlers:
            self._client.meta.events.unregister(event, handler)
        self.fs.retries = self._saved_retries


def s3_fault_options(base: dict) -> dict:
    """Storage options that switch botocore's own retries off (so the engine's policy is tested)."""
    return {**base, "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}
