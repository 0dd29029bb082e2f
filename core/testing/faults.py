"""Testing (any stage): the one fault-injecting filesystem, wrapping the *real* local disk.

``FaultFS`` is a ``LocalFileSystem`` reached as ``faultfile://<local path>`` or ``gatefile://<local
path>`` (the same class under both names; the bytes land on the real disk). The engine sees a local
filesystem, so it keeps its temp file + fsync + rename commit. Faults are class-level (one scenario
at a time per process) and two kinds of control are offered:

* ``FaultFS.policy``: a :class:`Policy` asked before every storage operation what to do: nothing,
  raise, or block. Operations reported: ``on(op, kind, path)`` with op in ``info`` (a stat of one
  path), ``stat`` (a stat of each entry inside a listing), ``read``, ``list``, ``open`` (a file
  opened for writing, after it exists), ``close`` (a written file, after flush and fsync, before the
  engine renames it), ``delete``, ``move`` (a collection moving a blob aside before deleting it); ``kind`` is ``"blob"``, ``"lease"`` (``.checkrun/leases/``) or
  ``"manifest"`` (anything else). Written data goes through ``data(kind, path, buf, write)`` so a
  policy can write part of it (ENOSPC after a quota, a torn write before a kill). Ready-made:
  :class:`Transient`, :class:`Permanent`, :class:`DiskFull`, :class:`Gate`, :class:`BlockAll`.
* the write knobs, checked when a file is opened for writing (before it exists): ``gate`` (a
  ``threading.Event`` every write waits on; ``entered`` is released as each write reaches it),
  ``fail_writes`` (raised for paths containing ``fail_match``). ``FaultFS.reset()`` clears all.

Faults on a real S3 endpoint: ``s3faults.S3Faults``. No sleeps anywhere: gates are
``threading.Event``s. No pytest import.
"""
from __future__ import annotations

import collections
import errno
import os
import threading
from typing import Any, Callable, Optional

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

__all__ = ["FaultFS", "Policy", "Transient", "Permanent", "DiskFull", "Gate", "BlockAll", "transient_error",
           "kind_of", "group_of", "uniform"]

BLOB_MARK = "/.checkrun/blobs"
LEASE_MARK = "/.checkrun/leases"
_PROTOCOLS = ("faultfile", "gatefile")


def kind_of(path: str) -> str:
    """``"blob"``, ``"lease"`` or ``"manifest"`` (anything else) for a path in a checkpoint directory."""
    path = str(path)
    return "blob" if BLOB_MARK in path else "lease" if LEASE_MARK in path else "manifest"


def group_of(path: str) -> str:
    """The final name a temp file is written for: faults are budgeted per final name, because every
    attempt of a write goes to a fresh temp name."""
    path = str(path)
    head, _, name = path.rpartition("/")
    if ".tmp-" in name:
        return head + "/" + name.split(".tmp-")[0]
    return path


def uniform(seed: int, *parts: Any) -> float:
    """A deterministic number in [0, 1) for these parts (independent of thread scheduling)."""
    return xxhash.xxh64_intdigest("|".join(map(str, (seed, *parts))).encode()) / 2.0**64


class Policy:
    """Does nothing; subclasses override ``on`` and/or ``data``. Called from the engine's threads."""

    def on(self, op: str, kind: str, path: str) -> None:
        """Called before (``open``: right after) each operation; raise or block to inject a fault."""

    def data(self, kind: str, path: str, buf: Any, write: Callable[[Any], None]) -> None:
        """Called with each buffer written; ``write`` puts (part of) it on disk."""
        write(buf)


class _File:
    """A real file opened for writing whose writes and close go through the policy."""

    def __init__(self, real: Any, kind: str, path: str) -> None:
        self._real, self._kind, self._path = real, kind, path

    def write(self, buf: Any) -> int:
        policy = FaultFS.policy or Policy()
        policy.data(self._kind, self._path, buf, self._write_through)
        return len(memoryview(buf).cast("B"))

    def _write_through(self, buf: Any) -> None:
        self._real.write(buf)
        self._real.flush()  # what was written is in the OS: a SIGKILL right after cannot lose it

    def close(self) -> None:
        if not self._real.closed:
            self._real.flush()
            (FaultFS.policy or Policy()).on("close", self._kind, self._path)
        self._real.close()

    def __enter__(self) -> "_File":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # the engine is unwinding (ENOSPC...): just close, no hook
            self._real.close()
        else:
            self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class FaultFS(LocalFileSystem):
    """The local filesystem with injected faults (see the module docstring); state is class-level."""

    protocol = _PROTOCOLS
    root_marker = "/"
    policy: Optional[Policy] = None
    gate: Optional[threading.Event] = None
    fail_writes: Optional[BaseException] = None
    fail_match: str = ""
    entered = threading.Semaphore(0)

    @classmethod
    def reset(cls) -> None:
        """No policy, no gate, no failing writes (tests call it before and after a scenario)."""
        FaultFS.policy, FaultFS.gate, FaultFS.fail_writes, FaultFS.fail_match = None, None, None, ""
        FaultFS.entered = threading.Semaphore(0)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        for proto in _PROTOCOLS:
            if path.startswith(proto + "://"):
                path = path[len(proto) + 3:]
                break
        return super()._strip_protocol(path)

    def _on(self, op: str, path: Any) -> None:
        policy = FaultFS.policy
        if policy is not None:
            policy.on(op, kind_of(path), str(path))

    def _write_knobs(self, path: str) -> None:
        gate = FaultFS.gate
        if gate is not None:
            FaultFS.entered.release()  # only while gated: nobody waits for it otherwise
            gate.wait()
        if FaultFS.fail_writes is not None and FaultFS.fail_match in path:
            raise FaultFS.fail_writes

    def info(self, path: Any, **kwargs: Any) -> dict:
        if isinstance(path, os.DirEntry):  # LocalFileSystem.ls(detail=True) stats each entry
            self._on("stat", path.path)
        else:
            self._on("info", self._strip_protocol(path))
        return super().info(path, **kwargs)

    def cat_file(self, path: Any, start: Optional[int] = None, end: Optional[int] = None,
                 **kwargs: Any) -> bytes:
        self._on("read", self._strip_protocol(path))
        return super().cat_file(path, start=start, end=end, **kwargs)

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> list:
        self._on("list", self._strip_protocol(path))
        return super().ls(path, detail=detail, **kwargs)

    def rm_file(self, path: Any) -> None:
        self._on("delete", self._strip_protocol(path))
        return super().rm_file(path)

    def mv(self, path1: Any, path2: Any, **kwargs: Any) -> None:
        self._on("move", self._strip_protocol(path1))
        return super().mv(path1, path2, **kwargs)

    def open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        writing = "w" in mode or "a" in mode
        stripped = self._strip_protocol(path)
        if writing:
            self._write_knobs(stripped)
        f = super().open(path, mode, **kwargs)
        if not writing:
            return f
        try:
            self._on("open", stripped)
        except BaseException:
            f.close()
            raise
        return _File(f, kind_of(stripped), stripped)


class _GateFS(FaultFS):
    """``gatefile://``: the same filesystem and state; its own class only so that paths it gives back
    (``unstrip_protocol``) keep the scheme the caller used."""

    protocol = ("gatefile", "faultfile")


fsspec.register_implementation("faultfile", FaultFS, clobber=True)
fsspec.register_implementation("gatefile", _GateFS, clobber=True)


# ------------------------------------------------------------------------------------ policies
def transient_error(i: int) -> BaseException:
    """The transient errors storage clients really raise, in rotation (the ``i``-th of them)."""
    which = i % 4
    if which == 0:
        return TimeoutError("injected: read timed out")
    if which == 1:
        return ConnectionResetError(errno.ECONNRESET, "injected: connection reset by peer")
    try:
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error
    except ImportError:  # pragma: no cover - without s3fs, a timeout stands for its errors
        return TimeoutError("injected: timed out")
    code, status = ("SlowDown", 503) if which == 2 else ("InternalError", 500)
    err = ClientError({"Error": {"Code": code, "Message": f"injected {code}"},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    return translate_boto_error(err)  # an OSError whose __cause__ is the ClientError, like s3fs


class Transient(Policy):
    """Fail ``fraction`` of the calls of ``ops`` with transient errors, deterministically.

    The n-th call on one path (temp names folded to their final name) fails when
    ``uniform(seed, op, path, n) < fraction`` and at most ``max_per_path`` times, so every
    operation succeeds within the engine's retry budget whatever the thread schedule. The stats a
    listing makes of its entries count against the listing (its directory), not each entry: one
    listing fails at most ``max_per_path`` times however many files it finds.
    """

    def __init__(self, fraction: float, ops: tuple = ("open", "close", "read", "info", "stat", "delete", "list"),
                 seed: int = 0, max_per_path: int = 2) -> None:
        self.fraction, self.ops, self.seed, self.max_per_path = fraction, set(ops), seed, max_per_path
        self.calls: collections.Counter = collections.Counter()
        self.injected: collections.Counter = collections.Counter()
        self._per_path: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def on(self, op: str, kind: str, path: str) -> None:
        if op not in self.ops:
            return
        # A listing stats every entry it finds: those stats share the listing's budget (one retried call).
        group = ("list", path.rpartition("/")[0]) if op == "stat" else (op, group_of(path))
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
    """Raise ``exc`` on every call of ``ops`` on paths of ``kind`` (None = every kind)."""

    def __init__(self, exc: BaseException, ops: tuple = ("open",), kind: Optional[str] = None) -> None:
        self.exc, self.ops, self.kind = exc, set(ops), kind
        self.raised = 0

    def on(self, op: str, kind: str, path: str) -> None:
        if op in self.ops and self.kind in (None, kind):
            self.raised += 1
            raise self.exc


class DiskFull(Policy):
    """A disk with ``free`` bytes left: the write that crosses it writes what fits, then ENOSPC.

    ``kind``: only writes of that kind count (``"manifest"``: the disk fills up at the commit)."""

    def __init__(self, free: int, kind: Optional[str] = None) -> None:
        self.free, self.kind, self.failures = free, kind, 0
        self._lock = threading.Lock()

    def data(self, kind: str, path: str, buf: Any, write: Callable[[Any], None]) -> None:
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
    ``release()``; ``entered`` says it is held, ``held_path`` which path.

    Every other call passes (through ``also`` first, when given). Waiting for ``entered`` is the
    synchronisation (no sleeps); tests bound that wait only as a watchdog against a hang."""

    def __init__(self, op: str, kind: Optional[str] = None, n: int = 1, also: Optional[Policy] = None,
                 match: str = "") -> None:
        self.op, self.kind, self.n, self.also, self.match = op, kind, n, also, match
        self.count = 0
        self.entered = threading.Event()
        self._open = threading.Event()
        self.held_path: Optional[str] = None
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
        """Let the held call (and any later one) go on."""
        self._open.set()


class BlockAll(Policy):
    """Hold every call of ``op`` on ``kind`` until released; ``held`` counts the callers held."""

    def __init__(self, op: str, kind: Optional[str] = None) -> None:
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
        """Let every held call go on."""
        self._open.set()
