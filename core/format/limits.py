"""Bounds on what reading a manifest may cost, checked before anything is allocated.

The stdlib JSON parser builds every value it reads: 60 MB of ``[],`` took +1.6-3 GB of RSS, and a
manifest's declared shapes and delta chains size what a load allocates. A manifest is refused (with
a ``FormatError`` naming the file and the limit) when

- it is larger than ``MAX_MANIFEST_BYTES`` (the store refuses to read bigger ones anyway),
- its JSON nests deeper than ``MAX_JSON_DEPTH`` or holds more than ``load.max_manifest_elements``
  elements (``,``, ``:`` and containers) or a quarter as many containers (lists, objects):
  counted on the raw bytes, outside strings, before ``json.loads``,
- a tensor has more deltas than ``max_deltas`` (from ``incremental.max_chain``, see ``deltas_limit``),
- a tensor's device is not one checkrun writes (``DEVICE_TYPES``).

Loading also refuses (``ResourceLimitError``) a checkpoint whose tensors declare more bytes than
``load.max_total_bytes`` (``check_load_bytes``), before allocating them.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import numpy as np

from ..errors import FormatError, ResourceLimitError

#: Same as the store's cap on a manifest read (``storage._DEFAULT_MANIFEST_MAX``).
MAX_MANIFEST_BYTES = 64 << 20
#: The skeleton's own limit (``tree.flatten(max_depth=512)``) plus the manifest's levels above it.
MAX_JSON_DEPTH = 520
#: ``load.max_manifest_elements``'s default. Parsing costs ~50-200 bytes per element (an empty
#: list 74, a one-key object 200): the worst manifest within the limits measured costs +0.5 GB to
#: parse (4M 12-character strings, 58 MB), 1M one-key objects +0.2 GB.
MAX_JSON_ELEMENTS = 4_000_000
#: Deltas per tensor allowed whatever ``incremental.max_chain`` says (a reader may use a smaller
#: chain than the writer did).
MIN_DELTAS = 64

#: Device types a manifest may name: those whose tensors the writer stages with a plain copy and
#: that a load can restore to the CPU when this machine lacks them (``reader.map_location_tensor``).
#: ``meta`` has no data; ``xla``/``hpu``/``lazy``/... need out-of-tree backends to even name.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
_DEVICE_RE = re.compile(r"(cpu|cuda|mps|xpu)(:(0|[1-9][0-9]{0,2}))?")


@dataclass(frozen=True)
class ManifestLimits:
    """What ``parse_manifest`` accepts; ``limits_for(config)`` builds it from an ``EngineConfig``.

    A manifest has ~16 elements and 2 containers per chunk and ~60 elements and 11 containers per
    tensor (measured), so the defaults admit ~65k tensors or ~250k chunks (4 TiB in 16 MiB chunks)."""

    max_blob_bytes: int = 1 << 34
    max_deltas: int = MIN_DELTAS
    max_bytes: int = MAX_MANIFEST_BYTES
    max_depth: int = MAX_JSON_DEPTH
    max_elements: int = MAX_JSON_ELEMENTS
    kind: str = "manifest"
    """What messages call the object (a step-log object's limits are the format's own, no setting)."""

    @property
    def max_containers(self) -> int:
        """Lists and objects cost the most to parse; a manifest has ~1 per 5 elements."""
        return self.max_elements // 4


def deltas_limit(max_chain: int) -> int:
    """Most deltas per tensor a manifest may list: the writer stops at ``max_chain``; the margin
    lets a job read checkpoints written with a longer chain than its own."""
    return max(MIN_DELTAS, 4 * max_chain)


def limits_for(config) -> ManifestLimits:
    """The limits an ``EngineConfig`` implies."""
    return ManifestLimits(max_blob_bytes=config.load.max_blob_bytes,
                          max_deltas=deltas_limit(config.incremental.max_chain),
                          max_elements=config.load.max_manifest_elements)


def resolve_limits(limits: ManifestLimits | None, max_blob_bytes: int | None) -> ManifestLimits:
    limits = limits or ManifestLimits()
    return limits if max_blob_bytes is None else dataclasses.replace(limits, max_blob_bytes=max_blob_bytes)


def check_device(device: object, what: str) -> str:
    """``device`` if a manifest may name it (``DEVICE_TYPES``), else FormatError."""
    if not isinstance(device, str) or _DEVICE_RE.fullmatch(device) is None:
        raise FormatError(f"{what}: invalid device {str(device)[:64]!r} in field 'device' (checkrun saves and "
                          f"loads tensors of {', '.join(DEVICE_TYPES)} devices)")
    return device


def check_deltas(deltas: list, what: str, max_deltas: int) -> list:
    """``deltas`` unless there are more than ``max_deltas``: each is decoded and its row indices kept."""
    if len(deltas) > max_deltas:
        raise FormatError(f"{what}: {len(deltas)} deltas, more than the limit of {max_deltas} "
                          "(4 x incremental.max_chain, at least 64)")
    return deltas


# ------------------------------------------------------------------------------ JSON pre-scan
# Byte classes of the scan (a ``bytes.translate`` table): 1 opens a container, 2 closes one,
# 3 separates elements, 0 anything else.
_CLASSES = bytearray(256)
for _c, _k in ((b"[", 1), (b"{", 1), (b"]", 2), (b"}", 2), (b",", 3), (b":", 3)):
    _CLASSES[_c[0]] = _k
_CLASSES = bytes(_CLASSES)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_WINDOW = 1 << 20  # bytes scanned at once: bounds the scan's own temporaries (~20 MB)


def check_json(data: bytes, where: str, limits: ManifestLimits) -> None:
    """Refuse manifest bytes whose JSON would cost more than the limits, before it is parsed.

    Every element takes at least one byte, so manifests no longer than ``max_containers`` bytes
    are scanned only when they hold more brackets than ``max_depth`` (with a recursion limit raised
    by the program, a deep one under 1 MB crashed ``json.loads`` with a C stack overflow: found by an
    independent check)."""
    kind, settings = limits.kind, limits.kind == "manifest"
    if len(data) > limits.max_bytes:
        raise FormatError(f"{where}: {kind} is {len(data)} bytes, more than the limit of {limits.max_bytes}")
    if len(data) <= limits.max_containers and data.count(b"[") + data.count(b"{") <= limits.max_depth:
        return
    state = _ScanState()
    for start in range(0, len(data), _WINDOW):
        state.window(data[start:start + _WINDOW])
        for value, limit, what, name in (
                (state.max_depth, limits.max_depth, "JSON nesting depth", "manifest_limits.MAX_JSON_DEPTH"),
                (state.containers, limits.max_containers, "JSON lists and objects",
                 "load.max_manifest_elements / 4"),
                (state.elements, limits.max_elements, "JSON elements", "load.max_manifest_elements")):
            if value > limit:  # stop at once: the rest of a hostile manifest is not even scanned
                source = name if settings or "DEPTH" in name else "the step-log format's own limit"
                raise FormatError(f"{where}: {kind} has more {what} than the limit of {limit} ({source})")


def json_shape(data: bytes) -> tuple[int, int, int]:
    """(containers, elements, deepest nesting) of JSON text, ignoring what is inside strings.

    Exact for valid JSON, and for the valid prefix of invalid JSON (all that ``json.loads`` builds
    before it fails), so it bounds what parsing allocates. Vectorized over windows of the bytes."""
    state = _ScanState()
    for start in range(0, len(data), _WINDOW):
        state.window(data[start:start + _WINDOW])
    return state.containers, state.elements, state.max_depth


class _ScanState:
    """What one window hands to the next: string parity, trailing backslashes, depth."""

    def __init__(self) -> None:
        self.in_string = 0
        self.backslashes = 0
        self.depth = self.max_depth = self.containers = self.elements = 0

    def window(self, w: bytes) -> None:
        a = np.frombuffer(w, np.uint8)
        quotes = a == _QUOTE
        if self.backslashes or w.find(b"\\") >= 0:
            self._unescape(a, quotes)
        at = np.flatnonzero(quotes)
        cls = np.frombuffer(w.translate(_CLASSES), np.uint8)
        pos = np.flatnonzero(cls != 0)
        # A byte is inside a string when an odd number of unescaped quotes precede it.
        kinds = cls[pos[(np.searchsorted(at, pos) + self.in_string) % 2 == 0]]
        self.in_string = (self.in_string + at.size) % 2
        if not kinds.size:
            return
        opened = kinds == 1
        n_open = int(np.count_nonzero(opened))
        self.containers += n_open
        self.elements += n_open + int(np.count_nonzero(kinds == 3))
        levels = np.cumsum(opened.astype(np.int64) - (kinds == 2)) + self.depth
        self.max_depth = max(self.max_depth, int(levels.max()))
        self.depth = int(levels[-1])

    def _unescape(self, a: np.ndarray, quotes: np.ndarray) -> None:
        """Clear the quotes escaped by an odd run of backslashes (runs may span windows)."""
        last_other = np.maximum.accumulate(np.where(a != _BACKSLASH, np.arange(a.size), -1))
        at = np.flatnonzero(quotes)
        if at.size:
            before = np.where(at > 0, last_other[np.maximum(at - 1, 0)], -1)
            run = at - 1 - before + np.where(before < 0, self.backslashes, 0)
            quotes[at[run % 2 == 1]] = False
        end = int(last_other[-1])
        self.backslashes = a.size - 1 - end + (self.backslashes if end < 0 else 0)


# ------------------------------------------------------------------------------ load memory
def memory_limit(configured: int | None) -> int:
    """``load.max_total_bytes``, or this machine's physical memory when it is None."""
    if configured is not None:
        return configured
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf: no limit beyond the allocator's
        return 1 << 62


def check_load_bytes(manifest, where: str, limit: int, total: int | None = None) -> int:
    """Refuse to decode a checkpoint whose tensors need more than ``limit`` bytes of host memory;
    returns what they need: ``total`` if given (the caller adds second copies to it), else every
    tensor plus the row indices its deltas keep (8 bytes a row)."""
    if total is None:
        total = sum(rec.nbytes + 8 * sum(d.n for d in rec.deltas) for rec in manifest.tensors)
    if total > limit:
        raise ResourceLimitError(f"{where}: loading needs {total} bytes for its tensors and the copies it keeps "
                                 f"(row indices, reference copies for later incremental saves), more than the "
                                 f"limit of {limit} (load.max_total_bytes)")
    return total


def check_packs(tensors) -> None:
    """A pack (``ChunkRef.part``: small tensors stored as one blob) is exactly its members (``saving.plan``):
    FormatError for one declared larger than the parts of it the manifest's tensors list (h128: a 32-element
    tensor declared a part of a 4 GiB pack, which a load decoded whole whatever ``load.max_total_bytes``)."""
    packs: dict[str, list[int]] = {}  # blob key -> [size declared, bytes of its parts]
    for rec in tensors:
        for c in (c for c in rec.base if c.part is not None):
            p = packs.setdefault(c.blob.key, [0, 0])
            p[0], p[1] = max(p[0], c.part[1]), p[1] + c.rows * c.cols * (rec.nbytes // max(1, rec.numel))
    for key, (declared, covered) in packs.items():
        if declared > covered:
            raise FormatError(f"pack {key} declares {declared} bytes, its parts cover {covered}")
