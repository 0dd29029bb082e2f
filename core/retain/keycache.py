"""What garbage collection keeps of each manifest it parses, by the manifest's content, for the process.

A collection must know every blob the directory's manifests reference, so each one parsed all of them
again: after every save that retention or a removal made garbage (thousands of protected checkpoints:
seconds of background CPU per save, growing with the run). The same bytes always parse to the same
keys, so a collection keeps ``(created, commit stamp, blob keys)`` per manifest under the xxh3-128 of
its bytes (and the limits it was parsed under) and later collections of this process parse only the
manifests that are new or changed. Bounded by ``MAX_KEYS`` blob keys in all (least recently used go).
"""
from __future__ import annotations

import collections
import sys
import threading
from typing import Any

import xxhash

from ..format.manifest import parse_manifest

MAX_KEYS = 1 << 20
"""Blob keys held in all; the least recently used manifests' entries go first."""
_lock = threading.Lock()
_entries: "collections.OrderedDict[tuple, tuple[float, dict | None, frozenset[str]]]" = collections.OrderedDict()
_held = 0


def get(data: bytes, limits: Any) -> tuple[float, dict | None, frozenset[str]] | None:
    """``(created, commit, keys)`` of a manifest with exactly these bytes parsed under ``limits``, if held."""
    key = (xxhash.xxh3_128_digest(data), limits)
    with _lock:
        hit = _entries.get(key)
        if hit is not None:
            _entries.move_to_end(key)
    return None if hit is None else (hit[0], None if hit[1] is None else dict(hit[1]), hit[2])


def put(data: bytes, limits: Any, created: float, commit: dict | None,
        keys: frozenset[str]) -> tuple[float, dict | None, frozenset[str]]:
    """Hold what a parse of ``data`` gave; returns it (as ``get`` would)."""
    global _held
    key = (xxhash.xxh3_128_digest(data), limits)
    with _lock:
        if key not in _entries and len(keys) <= MAX_KEYS:
            _entries[key] = (created, None if commit is None else dict(commit), keys)
            _held += len(keys)
            while _held > MAX_KEYS:
                _held -= len(_entries.popitem(last=False)[1][2])
    return created, None if commit is None else dict(commit), keys


def parsed(data: bytes, url: str, limits: Any) -> tuple[float, dict | None, frozenset[str]]:
    """``(created, commit, keys)`` of the manifest ``data`` read from ``url``: held, or parsed and held."""
    got = get(data, limits)
    if got is None:  # retention after the same save may hold it parsed; else parsed here, not held (a
        with _lock:  # collection of thousands of manifests holds their keys only)
            m = _manifests.get((xxhash.xxh3_128_digest(data), limits))
        m = m if m is not None else parse_manifest(data, url, limits=limits)
        got = put(data, limits, m.created, m.commit, frozenset(map(sys.intern, m.blob_keys())))
    return got


MAX_RECORDS = 1 << 15
"""Tensor records of whole parsed manifests held in all (``manifest``); a larger manifest is not held."""
_manifests: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()
_records = 0


def manifest(data: bytes, url: str, limits: Any) -> Any:
    """The ``Manifest`` parsed from ``data`` (read from ``url``), held for the process by its bytes: retention
    parses the newest ``keep_last`` manifests after every save, the same bytes each time (a small state saved
    every step spent most of its background CPU there: h157). Callers must not change what it holds."""
    global _records
    key = (xxhash.xxh3_128_digest(data), limits)
    with _lock:
        hit = _manifests.get(key)
        if hit is not None:
            _manifests.move_to_end(key)
            return hit
    m = parse_manifest(data, url, limits=limits)
    n = len(m.tensors) + len(m.objects) + 1
    with _lock:
        if key not in _manifests and n <= MAX_RECORDS:
            _manifests[key] = m
            _records += n
            while _records > MAX_RECORDS:
                old = _manifests.popitem(last=False)[1]
                _records -= len(old.tensors) + len(old.objects) + 1
    return m


def clear() -> None:
    """Forget everything held (tests)."""
    global _held, _records
    with _lock:
        _entries.clear()
        _manifests.clear()
        _held = _records = 0
