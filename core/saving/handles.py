"""What a save returns: a handle on the background work and, once committed, its figures."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import BackgroundSaveError
from ..units import fmt_bytes, fmt_percent


@dataclass(frozen=True)
class WriteStats:
    """What writing one save measured (step 4), as its manifest records them (``Manifest.stats``:
    plain JSON there, this typed copy between the writer, the commit and the engine)."""

    tensor_bytes: int
    written_bytes: int
    """Blob bytes this save wrote (the manifest not included)."""
    stored_bytes: int
    """Bytes of every blob the checkpoint references, each once."""
    chain_depth: int
    quantized: bool
    encode_seconds: float

    @classmethod
    def from_manifest(cls, stats: Mapping) -> "WriteStats":
        """From a manifest's ``stats`` (the keys ``SnapshotWriter.write`` sets)."""
        return cls(int(stats["tensor_bytes"]), int(stats["written_bytes"]), int(stats["stored_bytes"]),
                   int(stats["chain_depth"]), bool(stats.get("quantized", False)),
                   float(stats.get("encode_seconds", 0.0)))


class ByteRatios:
    """The ratios of a save's figures (``tensor_bytes``, ``written_bytes``, ``stored_bytes``)."""

    tensor_bytes: int
    written_bytes: int
    stored_bytes: int

    @property
    def compression_ratio(self) -> float:
        """Tensor bytes over referenced bytes (>1 means smaller than raw)."""
        return self.tensor_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @property
    def write_ratio(self) -> float:
        """Written bytes over tensor bytes (incremental saves are well below 1)."""
        return self.written_bytes / self.tensor_bytes if self.tensor_bytes else 0.0

    @property
    def referenced_bytes(self) -> int:
        """Bytes *referenced by this checkpoint* (the same number as ``stored_bytes``)."""
        return self.stored_bytes


@dataclass(frozen=True)
class SaveInfo(ByteRatios):
    """Figures of one committed save (also passed to ``CheckpointEngine.add_callback`` callbacks).

    The byte counts use the vocabulary of ``checkrun ls`` / ``inspect`` (``ckpt_core.units``):
    ``tensor_bytes`` (the state's raw tensors), ``written_bytes`` (*written by this save*, the
    ``WROTE`` column of ``checkrun ls``) and ``referenced_bytes`` (*referenced by this checkpoint*,
    the ``REFERENCED`` column; the field is named ``stored_bytes``). What a whole directory holds
    (*stored in the directory*) is only known to ``checkrun ls``: checkpoints share blobs."""

    path: str
    tensor_bytes: int
    """Bytes of tensor data in the state (what a full uncompressed save would hold)."""
    written_bytes: int
    """Bytes *written by this save*: its new blobs plus its manifest (``checkrun ls``: WROTE)."""
    stored_bytes: int
    """Bytes *referenced by this checkpoint*: every blob it needs, each once, new or reused (its size
    if it were alone). Also readable as ``referenced_bytes`` (``checkrun ls``: REFERENCED)."""
    blocking_seconds: float
    """Time the caller of ``save`` waited (snapshot, plus backpressure waits)."""
    background_seconds: float
    """Time the background part took (encoding, writing the blobs, the commit)."""
    total_seconds: float
    """From the call to ``save`` to the commit."""
    new_blobs: int
    """Tensors for which this save wrote data (a count of tensors, whatever their number of blobs)."""
    reused_blobs: int
    """The checkpoint's number of blobs minus ``new_blobs``: about the blobs it reuses from earlier saves."""
    chain_depth: int
    """Longest chain of row deltas on top of a base among the checkpoint's tensors."""
    quantized_tensors: int
    quantization_saved_bytes: int
    """Raw bytes minus stored bytes of the quantized tensors."""

    def summary(self) -> str:
        """One line in checkrun's words and units (``ckpt_core.units``), e.g. ``wrote 526.7 KiB (10.5% of
        4.9 MiB of tensors), references 2.8 MiB, blocked 5.8 ms``: ``checkrun ls`` shows the same
        figures in its WROTE, TENSORS and REFERENCED columns."""
        return (f"wrote {fmt_bytes(self.written_bytes)} ({fmt_percent(self.written_bytes, self.tensor_bytes)} "
                f"of {fmt_bytes(self.tensor_bytes)} of tensors), references {fmt_bytes(self.stored_bytes)}, "
                f"blocked {1000 * self.blocking_seconds:.1f} ms")


class SaveHandle:
    """A pending or finished save. ``result`` waits for the commit and returns its ``SaveInfo``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._info: SaveInfo | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._lock = threading.Lock()
        self._callbacks: list[Callable[["SaveHandle"], None]] = []
        self._finished = False  # the outcome is recorded (the done-callbacks run before waiters wake)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save committed or failed (without raising); False on timeout."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._done.is_set()

    def failed(self) -> bool:
        """True once the save failed (its error is not surfaced by asking: see ``result``)."""
        return self._finished and self._error is not None

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait for the commit; raise BackgroundSaveError (cause = original) if the save failed.

        An error raised here counts as surfaced: the engine does not raise it again later."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            self.take_error()
            raise BackgroundSaveError(f"checkpoint save to {self.path} failed: {self._error}") from self._error
        assert self._info is not None
        return self._info

    def add_done_callback(self, fn: Callable[["SaveHandle"], None], first: bool = False) -> None:
        """Call ``fn(handle)`` once the save committed or failed: on the engine's background thread right
        after the commit (before retention and garbage collection run, and before ``done()`` turns true
        and waiters wake), or at once if the outcome is known already. ``first``: before the callbacks
        added so far. An error ``fn`` raises is logged."""
        with self._lock:
            if not self._finished:
                self._callbacks.insert(0, fn) if first else self._callbacks.append(fn)
                return
        _call(fn, self)

    def take_error(self) -> BaseException | None:
        """The error if not surfaced yet (marks it surfaced); internal to the engine."""
        with self._lock:
            if self._error is None or self._observed:
                return None
            self._observed = True
            return self._error

    def settle(self, info: SaveInfo | None, error: BaseException | None) -> None:
        """Record the outcome (the coordinator, once per save: ``info`` as it commits, else ``error``) and run
        the done-callbacks; waiters wake at ``finish``. A kill between the commit and a callback (the removal
        of the checkpoint the save replaces) is as short as this makes it (found by an independent check:
        they waited for retention and collection, up to 0.3 s on S3)."""
        with self._lock:
            if self._finished:
                return
            self._info, self._error = info, error
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:  # before done(): what waits for the save sees their effects (a link swapped)
            _call(fn, self)

    def finish(self, info: SaveInfo | None, error: BaseException | None) -> None:
        """``settle`` unless done already, then wake every waiter."""
        self.settle(info, error)
        self._done.set()


def _call(fn: Callable[["SaveHandle"], None], handle: "SaveHandle") -> None:
    try:
        fn(handle)
    except BaseException:  # noqa: BLE001 - a callback must not end the engine's thread (waiters would hang)
        logging.getLogger("ckpt_core").exception("checkrun: a done-callback of the save to %s failed", handle.path)


def pending_error(failed: list[tuple[str, BaseException]], also: list[BaseException] = ()) -> BaseException | None:
    """The error to raise for ``failed`` (``(path, error)`` of each failed save not raised yet) and ``also``
    (step logs that failed as the engine closed them): one ``BackgroundSaveError`` for every failed save
    (the first as its cause: one per call made a loop that catches and goes on lose a save per error), the
    others named in its notes; without failed saves ``also``'s first; None if there is nothing."""
    if failed:
        more = "".join(f"; the save to {path} failed too: {err}" for path, err in failed[1:])
        err = BackgroundSaveError(f"checkpoint save to {failed[0][0]} failed: {failed[0][1]}{more}")
        err.__cause__ = failed[0][1]
    elif also:
        err, also = also[0], also[1:]
    else:
        return None
    for other in also:
        err.add_note(f"checkrun: closing a step log failed too: {other}")
    return err
