"""A fault-injecting fsspec filesystem wrapping the real local filesystem (for tests).

``gatefile://`` paths are local paths. Class-level knobs (reset by ``FaultyFS.reset()``):
- ``gate``: a threading.Event every blob/manifest write waits on (controls "slow storage" without sleeps);
- ``fail_writes``: exception to raise on writes whose path contains ``fail_match``;
- ``transient``: number of upcoming writes that raise TimeoutError first (retry tests).
"""
from __future__ import annotations

import threading

import fsspec
from fsspec.implementations.local import LocalFileSystem


class FaultyFS(LocalFileSystem):
    protocol = ("gatefile",)
    root_marker = "/"
    gate: threading.Event | None = None
    fail_writes: BaseException | None = None
    fail_match: str = ""
    transient: int = 0
    writes: int = 0
    entered = threading.Semaphore(0)
    _lock = threading.Lock()

    @classmethod
    def reset(cls) -> None:
        cls.gate, cls.fail_writes, cls.fail_match, cls.transient, cls.writes = None, None, "", 0, 0
        cls.entered = threading.Semaphore(0)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("gatefile://"):
            path = path[len("gatefile://"):]
        return super()._strip_protocol(path)

    def _fault(self, path: str) -> None:
        cls = type(self)
        with cls._lock:
            cls.writes += 1
            if cls.transient > 0:
                cls.transient -= 1
                raise TimeoutError(f"injected transient timeout writing {path}")
        cls.entered.release()
        if cls.gate is not None:
            cls.gate.wait()
        if cls.fail_writes is not None and cls.fail_match in path:
            raise cls.fail_writes

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        self._fault(path)
        return super().pipe_file(path, value, **kwargs)

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode or "a" in mode:
            self._fault(path)
        return super().open(path, mode, **kwargs)


fsspec.register_implementation("gatefile", FaultyFS, clobber=True)
