"""Retries with exponential backoff for transient storage errors.

``is_transient`` decides whether an error is worth retrying (timeouts, dropped connections,
HTTP 5xx and throttling answers of object stores); ``call_with_retry`` runs a callable under a
``RetryConfig`` and turns every failure into a ``StorageError`` that names what was being done.
botocore is imported lazily and optionally: s3fs is an extra, and the local and memory backends
must work without it. Both functions are thread-safe; they are called from the I/O pool threads.
"""
from __future__ import annotations

import errno
import functools
import logging
import random
import time
from typing import Callable, Optional, TypeVar

from ..config import RetryConfig
from ..errors import CheckrunError, StorageError

T = TypeVar("T")

_LOG = logging.getLogger("ckpt_core.storage.store")

_sleep: Callable[[float], None] = time.sleep
"""Module-level so tests can patch it; looked up at call time."""

_jitter = random.Random()
"""The backoff's own generator: drawing from the global one would shift the training's stream."""

_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
    "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "500", "502", "503", "504",
})
# Errors that say the request can never succeed as made, whatever their cause chain says.
_PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
                               errno.EROFS, errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR})
_MAX_CHAIN = 8


@functools.lru_cache(maxsize=1)
def _optional_transient_types() -> tuple[type, ...]:
    """Network error classes of optional dependencies (botocore, aiohttp) that are installed."""
    types: list[type] = []
    try:
        from botocore import exceptions as bex

        # HTTPClientError: ReadTimeoutError, ConnectionClosedError, ResponseStreamingError;
        # botocore's own ConnectionError: EndpointConnectionError, ConnectTimeoutError.
        types += [bex.HTTPClientError, bex.ConnectionError, bex.IncompleteReadError]
        # a response body whose checksum (x-amz-checksum-*) fails: damaged in transit, read again
        types += [getattr(bex, name) for name in ("FlexibleChecksumError", "ChecksumError") if hasattr(bex, name)]
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    except ImportError:
        pass
    try:
        from http.client import IncompleteRead

        types.append(IncompleteRead)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _has_transient_response(exc: BaseException) -> bool:
    """Duck-typed check of a botocore ClientError (or similar) carrying a 5xx/throttle answer."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error") or {}
        if str(error.get("Code", "")) in _TRANSIENT_CODES:
            return True
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status in _TRANSIENT_STATUS:
            return True
    # gcsfs HttpError (.code) and aiohttp ClientResponseError (.status) carry plain ints.
    for attr in ("status", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value in _TRANSIENT_STATUS:
            return True
    return False


def _is_transient_one(exc: BaseException) -> Optional[bool]:
    """True/False when this exception alone decides; None to look at its cause."""
    if isinstance(exc, CheckrunError):
        return False  # already final (e.g. a StorageError after exhausted retries)
    if isinstance(exc, (FileNotFoundError, PermissionError, ValueError, TypeError)):
        return False
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNOS:
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, _optional_transient_types()) or _has_transient_response(exc):
        return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` may succeed.

    Walks the ``__cause__`` chain because s3fs translates botocore errors into plain
    ``OSError``s (e.g. ``OSError(EBUSY)`` for SlowDown) with the ClientError as cause. The
    implicit ``__context__`` is not followed: an error raised while handling a timeout is not
    itself a timeout.
    """
    seen = 0
    current: Optional[BaseException] = exc
    while current is not None and seen < _MAX_CHAIN:
        verdict = _is_transient_one(current)
        if verdict is not None:
            return verdict
        current = current.__cause__
        seen += 1
    return False


def backoff_delay(attempt: int, config: RetryConfig) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based): exponential, jittered.

    Equal jitter (half fixed, half random) keeps a lower bound on the wait while still spreading
    out the retries of the many pool threads that hit the same throttled endpoint together.
    """
    cap = min(config.max_backoff_seconds, config.initial_backoff_seconds * (2 ** (attempt - 1)))
    return cap / 2 + _jitter.uniform(0, cap / 2)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``StorageError`` for a file the storage did not give, which may well be intact:
    every attempt failed with a transient error (no answer), or reading it was not permitted (h146: a
    teammate's checkpoint made with umask 077 was skipped as corrupt and the resume started over), as
    opposed to a bad request or a damaged file."""
    cause = exc.__cause__ if isinstance(exc, StorageError) else None
    return cause is not None and (is_transient(cause) or isinstance(cause, PermissionError))


def call_with_retry(fn: Callable[[], T], *, config: RetryConfig, what: str,
                    logger: logging.Logger = _LOG,
                    sleep: Optional[Callable[[float], None]] = None) -> T:
    """Call ``fn()`` until it succeeds, retrying transient errors with backoff.

    ``what`` describes the operation and its path/URL (``"write manifest s3://b/run/x.ckpt"``);
    it prefixes every log line and error message. ``CheckrunError``s and ``FileNotFoundError``
    pass through unchanged (callers translate "missing" into their own error); any other
    non-transient error is raised at once as ``StorageError`` with the original as ``__cause__``;
    a transient error on the last of ``config.max_attempts`` attempts raises
    ``StorageError("<what>: failed after N attempts: <error>")``.
    """
    attempt = 1
    while True:
        try:
            return fn()
        except (CheckrunError, FileNotFoundError):
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise StorageError(f"{what}: {type(exc).__name__}: {exc}") from exc
            if attempt >= config.max_attempts:
                raise StorageError(f"{what}: failed after {attempt} attempts: "
                                   f"{type(exc).__name__}: {exc}") from exc
            delay = backoff_delay(attempt, config)
            logger.warning("%s: transient error on attempt %d/%d, retrying in %.2fs: %s: %s",
                           what, attempt, config.max_attempts, delay, type(exc).__name__, exc)
            (sleep or _sleep)(delay)
            attempt += 1


def whole(data: bytes, size: int) -> bytes:
    """``data``, unless it is shorter than the ``size`` the storage reported just before: a body cut off
    in transit (no response checksum), raised as transient (``IncompleteRead``) so the read is tried
    again; a shorter file at rest reports the shorter size. Before, a manifest or blob read short counted
    as damaged, and ``latest()`` went back to an older checkpoint (found by a fault proxy before S3)."""
    if len(data) < size:
        from http.client import IncompleteRead

        raise IncompleteRead(data, size - len(data))
    return data
