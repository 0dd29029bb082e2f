"""Testing (step 4, store): real HTTP error responses injected into the s3fs client the engine uses.

:class:`S3Faults` registers a botocore ``before-send`` handler on that client: the request is answered
by a real HTTP error response (503 SlowDown, 500 InternalError, 403 AccessDenied) that botocore parses
into a ``ClientError`` and s3fs translates, exactly as if the server had sent it. The local-disk
counterpart is ``faults.FaultFS``. No pytest import; aiobotocore is imported when one is created.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from .faults import uniform

__all__ = ["S3Faults", "s3_fault_options"]


class _Body:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def read(self, *args: Any) -> bytes:
        return self._data

    def stream(self, **kwargs: Any) -> Any:  # pragma: no cover - error bodies are read whole
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
    storage options set ``config_kwargs.retries.total_max_attempts=1``: :func:`s3_fault_options`)
    so that the engine's own policy (``storage.retry``) is what retries. ``remove()`` restores it.
    """

    def __init__(self, fs: Any, fraction: float, operations: tuple = ("PutObject",), status: int = 503,
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

    def _make_handler(self, op: str) -> Callable[..., Any]:
        def handler(request: Any, **kwargs: Any) -> Any:
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
        """Unregister the handlers and restore the filesystem's own retries."""
        for event, handler in self._handlers:
            self._client.meta.events.unregister(event, handler)
        self.fs.retries = self._saved_retries


def s3_fault_options(base: dict) -> dict:
    """Storage options that switch botocore's own retries off (so the engine's policy is tested)."""
    return {**base, "config_kwargs": {"retries": {"total_max_attempts": 1, "mode": "standard"}}}
