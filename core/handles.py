"""What a save returns: a handle on the background work and, once committed, its figures."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import BackgroundSaveError


@dataclass(frozen=True)
class SaveInfo:
    """Figures of one committed save (also passed to ``CheckpointEngine.add_callback`` callbacks)."""

    path: str
    tensor_bytes: int
    """Bytes of tensor data in the state (what a full uncompressed save would hold)."""
    written_bytes: int
    """Bytes this save actually wrote: new blobs plus the manifest."""
    stored_bytes: int
    """Bytes of all blobs this checkpoint references (its size if it were alone)."""
    blocking_seconds: float
    """Time the caller of ``save`` waited (snapshot, plus backpressure waits)."""
    background_seconds: float
    total_seconds: float
    new_blobs: int
    reused_blobs: int
    chain_depth: int
    quantized_tensors: int
    quantization_saved_bytes: int
    """Raw bytes minus stored bytes of the quantized tensors."""

    @property
    def compression_ratio(self) -> float:
        """Tensor bytes over stored bytes (>1 means smaller than raw)."""
        return self.tensor_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    @property
    def write_ratio(self) -> float:
        """Written bytes over tensor bytes (incremental saves are well below 1)."""
        return self.written_bytes / self.tensor_bytes if self.tensor_bytes else 0.0


class SaveHandle:
    """A pending or finished save. ``result`` waits for the commit and returns its ``SaveInfo``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._done = threading.Event()
        self._info: SaveInfo | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save committed or failed (without raising); False on timeout."""
        return self._done.wait(timeout)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._done.is_set()

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

    def take_error(self) -> BaseException | None:
        """The error if not surfaced yet (marks it surfaced); internal to the engine."""
        with self._lock:
            if self._error is None or self._observed:
                return None
            self._observed = True
            return self._error

    def _finish(self, info: SaveInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._done.set()
