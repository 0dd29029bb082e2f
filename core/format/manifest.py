"""The manifest: a small, versioned JSON file that *is* the checkpoint.

It lists every blob the checkpoint needs (full bases and row deltas), so deleting any manifest never
breaks another. Parsing is the hostile-input boundary: every field is type- and range-checked, the
manifest's own checksum is verified, and sizes are validated before anything is allocated.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import FormatError, NotACheckpointError, UnsafePathError
from .dtypes import DTYPES, dtype_name, is_blob_key, row_shape  # noqa: F401 - dtype_name: callers import it here
from .limits import MIN_DELTAS, ManifestLimits, check_deltas, check_device, check_json, check_packs, resolve_limits

_WRITER_RE = re.compile(r"[0-9a-f]{1,32}")

MAGIC, MAGIC_KEY = "manifest", "_checkrun"
MAGIC_PREFIX = b'{"_checkrun":'
HEAD_BYTES = len(MAGIC_PREFIX) + 8  # how many leading bytes ``is_manifest_head`` needs (after some white space)
FORMAT_VERSION = 2  # 2: chunks may be parts of a pack (ChunkRef.part); everything else as in 1
SUPPORTED_VERSIONS = (1, 2)

@dataclass(frozen=True)
class BlobRef:
    """One stored blob: content key, stored size and checksum (xxh3-64 of the stored bytes)."""

    key: str
    size: int
    csum: str


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of a tensor: elements [off, off + rows*cols) seen as a (rows, cols) array.

    ``part`` (format 2, lossless base chunks only): the blob is a *pack* of several small tensors
    and this chunk is bytes ``[part[0], part[0] + rows*cols*itemsize)`` of its decoded content,
    which is ``part[1]`` bytes long. None: the blob decodes to exactly this chunk.
    """

    off: int
    rows: int
    cols: int
    blob: BlobRef
    part: tuple[int, int] | None = None

    def stored_share(self, itemsize: int) -> float:
        """Stored bytes attributable to this chunk (a pack's size split by raw bytes)."""
        if self.part is None:
            return float(self.blob.size)
        return self.blob.size * self.rows * self.cols * itemsize / max(1, self.part[1])


@dataclass(frozen=True)
class DeltaRef:
    """Rows replaced on top of the base: ``n`` row indices (int64 blob) and their new values."""

    n: int
    idx: BlobRef
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class TensorRecord:
    key: str
    dtype: str
    shape: tuple[int, ...]
    codecs: tuple[dict, ...]
    base: tuple[ChunkRef, ...]
    deltas: tuple[DeltaRef, ...] = ()
    written: int = 0
    quant: dict | None = None
    device: str = "cpu"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def row_shape(self) -> tuple[int, int]:
        """The (rows, cols) view deltas work on: rows = first dim for ndim >= 2."""
        return row_shape(self.shape)

    def blobs(self) -> list[BlobRef]:
        out = [c.blob for c in self.base]
        for d in self.deltas:
            out.append(d.idx)
            out.extend(c.blob for c in d.chunks)
        return out


@dataclass(frozen=True)
class ObjectRecord:
    key: str
    type: str
    blob: BlobRef


@dataclass(frozen=True)
class Manifest:
    created: float
    skeleton: Any
    tensors: tuple[TensorRecord, ...]
    objects: tuple[ObjectRecord, ...] = ()
    stats: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    commit: dict | None = None
    """The commit stamp fencing commits of one name (``fence.CommitStamp.to_json``); optional."""

    def blobs(self) -> list[BlobRef]:
        out = [b for t in self.tensors for b in t.blobs()]
        out.extend(o.blob for o in self.objects)
        return out

    def blob_keys(self) -> set[str]:
        return {b.key for b in self.blobs()}

    def to_bytes(self) -> bytes:
        body = {
            MAGIC_KEY: MAGIC,
            "format_version": self.format_version,
            "created": self.created,
            "skeleton": self.skeleton,
            "tensors": [_tensor_to_json(t) for t in self.tensors],
            "objects": [{"key": o.key, "type": o.type, "blob": _blob_to_json(o.blob)} for o in self.objects],
            "stats": self.stats,
            "meta": self.meta,
        }
        if self.commit is not None:
            body["commit"] = self.commit
        text = _canonical_bytes(body)
        return _with_checksum(text, xxhash.xxh3_128_hexdigest(text))


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def _body_checksum(body: dict) -> str:
    """xxh3-128 of the canonical JSON of ``body`` without its ``checksum`` field."""
    return xxhash.xxh3_128_hexdigest(_canonical_bytes({k: v for k, v in body.items() if k != "checksum"}))


# Canonical JSON sorts keys, and "checksum" sorts right after MAGIC_KEY ("_checkrun"): the bytes with
# the checksum are the bytes without it plus one field after the first, so neither writing nor
# reading a manifest serializes it twice.
_HEAD = b"{" + json.dumps(MAGIC_KEY).encode() + b":" + json.dumps(MAGIC).encode() + b","
_FIELD = b'"checksum":'


def _with_checksum(text: bytes, checksum: str) -> bytes:
    """Canonical bytes of a body from those of the body without ``checksum``."""
    return _HEAD + _FIELD + json.dumps(checksum).encode() + b"," + text[len(_HEAD):]


def _without_checksum(canonical: bytes, checksum: Any) -> bytes | None:
    """Inverse of ``_with_checksum``; None if ``canonical`` does not start that way."""
    head = _HEAD + _FIELD + json.dumps(checksum).encode() + b","
    return _HEAD + canonical[len(head):] if canonical.startswith(head) else None


_CHECKSUM_AT = re.compile(rb'"checksum":"([0-9a-f]{32})"')


def checksum_matches(data: bytes) -> bool:
    """Whether ``data`` carries a checksum that matches its bytes (no parsing: intact, not validated)."""
    m = _CHECKSUM_AT.match(data, len(_HEAD))
    rest = _without_checksum(data, m.group(1).decode()) if m and data.startswith(_HEAD) else None
    return rest is not None and xxhash.xxh3_128_hexdigest(rest) == m.group(1).decode()


# Written out by hand: dataclasses.asdict deep-copies every leaf and took ~40% of the Python time
# of a save of a 64-tensor state (tests/core/test_manifest_json.py checks they equal asdict's output).
def _blob_to_json(b: BlobRef) -> dict:
    return {"key": b.key, "size": b.size, "csum": b.csum}


def _chunk_to_json(c: ChunkRef) -> dict:
    d = {"off": c.off, "rows": c.rows, "cols": c.cols, "blob": _blob_to_json(c.blob)}
    if c.part is not None:
        d["part"] = list(c.part)
    return d


def _tensor_to_json(t: TensorRecord) -> dict:
    return {
        "key": t.key, "dtype": t.dtype, "shape": list(t.shape),
        "codecs": [dict(c) for c in t.codecs],
        "base": [_chunk_to_json(c) for c in t.base],
        "deltas": [{"n": d.n, "idx": _blob_to_json(d.idx), "chunks": [_chunk_to_json(c) for c in d.chunks]}
                   for d in t.deltas],
        "written": t.written,
        "quant": None if t.quant is None else dict(t.quant),
        "device": t.device,
    }


def is_manifest_head(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first ``HEAD_BYTES`` or more) is a checkrun manifest
    by its header: the one sniffing test of parsing, listing, ``checkrun import`` and the adapters'
    loaders (a torch.save zip or any other file answers False; the body is not validated)."""
    return head.lstrip().startswith(MAGIC_PREFIX)


FUTURE_SLACK_SECONDS = 300.0
"""How far ahead of this host's clock a manifest's ``created`` (or commit stamp) may lie and still be
believed. A checkpoint claiming a later time (a writer whose clock runs ahead, a forged manifest) is
ordered by its file's modification time instead (``CheckpointEntry.created``), and its stamp does not
fence later commits of its name (``saving.fence``): otherwise it would stay the newest for years,
``latest()`` would return it and retention would delete the checkpoints committed after it."""

SNIFF_BYTES = 64  # how many leading bytes listing reads to tell a damaged manifest from another file


def looks_damaged(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first ``SNIFF_BYTES``; not empty) that
    ``is_manifest_head`` refuses is still most likely a checkrun manifest whose first bytes were
    damaged (a flipped bit, a few overwritten bytes, a cut in the header: 3 of every 4 bytes of the header
    every manifest starts with, ``{"_checkrun":"manifest","checksum":"``, in place, after any zero bytes it
    starts with: a crash zeroes a file from its start): listed as a broken checkpoint, not another file."""
    signature = _HEAD + _FIELD + b'"'
    n, z = min(len(head), len(signature)), len(head) - len(head.lstrip(b"\0"))
    return n > 0 and (z >= n or 4 * sum(head[i] == signature[i] for i in range(z, n)) >= 3 * (n - z))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # json.loads would accept NaN/Infinity


def parse_manifest(data: bytes, where: str, *, max_blob_bytes: int | None = None,
                   limits: ManifestLimits | None = None) -> Manifest:
    """Parse and fully validate manifest bytes read from ``where`` (named in every error) within
    ``limits`` (``manifest_limits.limits_for(config)``; ``max_blob_bytes`` replaces theirs)."""
    limits = resolve_limits(limits, max_blob_bytes)
    if not is_manifest_head(data):
        if data[:1] == b"\0" and looks_damaged(data[:SNIFF_BYTES]):
            raise FormatError(f"{where}: damaged checkpoint: it starts with zero bytes (zeroed by a crash)")
        raise NotACheckpointError(f"{where}: not a checkrun checkpoint (no checkrun manifest header)")
    check_json(data, where, limits)  # json.loads builds every value: bound them first
    try:
        body = json.loads(data, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: manifest is truncated or not valid JSON: {exc}") from None
    if not isinstance(body, dict) or body.get(MAGIC_KEY) != MAGIC:
        raise NotACheckpointError(f"{where}: not a checkrun manifest")
    version = body.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        raise FormatError(f"{where}: manifest format version {_brief(version)} is not supported "
                          f"(this checkrun reads {SUPPORTED_VERSIONS})")
    try:
        canonical = _canonical_bytes(body)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: manifest cannot be checked: {exc}") from None
    # The checksum covers the parsed body; requiring the canonical bytes too catches changes that
    # parse to the same body (the 17th digit of a float, "e" vs "E" in an exponent).
    rest = _without_checksum(canonical, body.get("checksum")) if canonical == data.strip() else None
    if rest is None or body.get("checksum") != xxhash.xxh3_128_hexdigest(rest):
        raise FormatError(f"{where}: manifest checksum mismatch (tampered or corrupted){_duplicated(data)}")
    try:
        return _manifest_from_json(body, limits)
    except UnsafePathError as exc:
        raise UnsafePathError(f"{where}: {exc}") from None
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise FormatError(f"{where}: malformed manifest: {type(exc).__name__}: {exc}") from None


def _duplicated(data: bytes) -> str:
    """Why a manifest may not match its checksum: a key twice in one object (JSON keeps the last)."""
    found: list[str] = []

    def pairs(items: list) -> dict:
        out = dict(items)
        if len(out) < len(items) and not found:
            seen: set[str] = set()
            found.append(next(k for k, _ in items if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
        return out

    json.loads(data, object_pairs_hook=pairs, parse_constant=_no_constants)  # parsed once already: cannot fail
    return f": key {_brief(found[0])} appears twice in one object" if found else ""


def _canonical_bytes(body: dict) -> bytes:
    """The bytes ``Manifest.to_bytes`` writes for this body."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


_PIPELINES: dict[str, tuple] = {}


def _shared(codecs: tuple) -> tuple:
    """One tuple per pipeline, across manifests (records' own codec dicts: a quarter of their memory)."""
    key = repr(codecs)
    found = _PIPELINES.get(key)
    if found is None:
        if len(_PIPELINES) >= 256:
            _PIPELINES.clear()
        found = _PIPELINES[key] = codecs
    return found


def _brief(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to about ``limit`` characters (a hostile 200,000-dimension shape: 600 KB)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 30]}... ({len(text)} characters)"


def _req(d: Any, name: str, typ: type | tuple, what: str) -> Any:
    if not isinstance(d, dict) or name not in d:
        raise FormatError(f"{what}: missing field {name!r}")
    v = d[name]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ in (int, float, (int, float))):
        raise FormatError(f"{what}: field {name!r} has the wrong type ({type(v).__name__})")
    return v


def _nonneg(d: dict, name: str, what: str, limit: int | None = None) -> int:
    v = _req(d, name, int, what)
    if v < 0 or (limit is not None and v > limit):
        raise FormatError(f"{what}: field {name!r} out of range ({_brief(v)})")
    return v


def _blob(d: Any, what: str, max_blob_bytes: int) -> BlobRef:
    key = _req(d, "key", str, what)
    if not is_blob_key(key):  # a key is a path component in the store: nothing else
        raise UnsafePathError(f"{what}: unsafe blob key {key[:80]!r}: expected 32-64 lowercase hex digits")
    csum = _req(d, "csum", str, what)
    return BlobRef(key, _nonneg(d, "size", what, max_blob_bytes), csum)


def _chunk(d: Any, what: str, itemsize: int, max_blob_bytes: int, parts: bool = False) -> ChunkRef:
    """A chunk; ``parts``: whether it may be part of a pack (format 2, lossless base chunk)."""
    rows, cols = _nonneg(d, "rows", what), _nonneg(d, "cols", what)
    if rows * cols * itemsize > max_blob_bytes:
        raise FormatError(f"{what}: chunk of {rows}x{cols} exceeds the blob size limit")
    part = d.get("part")
    if part is not None:
        if not parts:
            raise FormatError(f"{what}: field 'part' is not allowed here (format version 2, lossless base "
                              "chunks only)")
        if (not isinstance(part, list) or len(part) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in part)):
            raise FormatError(f"{what}: field 'part' must be [start, total], two non-negative integers")
        start, total = part
        if total > max_blob_bytes or total % itemsize or start % itemsize or start + rows * cols * itemsize > total:
            raise FormatError(f"{what}: part {_brief(part)} does not fit in a pack of {total} bytes of "
                              f"{itemsize}-byte elements (limit {max_blob_bytes})")
        part = (start, total)
    return ChunkRef(_nonneg(d, "off", what), rows, cols, _blob(d.get("blob"), what + ".blob", max_blob_bytes),
                    part)


def _tensor_from_json(d: Any, max_blob_bytes: int, version: int = FORMAT_VERSION,
                      max_deltas: int = MIN_DELTAS) -> TensorRecord:
    key = _req(d, "key", str, "tensor")
    what = f"tensor {_brief(key)}"
    dtype = _req(d, "dtype", str, what)
    if dtype not in DTYPES:
        raise FormatError(f"{what}: unknown dtype {_brief(dtype)}")
    shape = tuple(_req(d, "shape", list, what))
    if (len(shape) > 64 or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 63 for s in shape)
            or math.prod(s for s in shape if s) >= 1 << 63):  # (torch multiplies all: [2**40, 2**40, 0] overflowed)
        raise FormatError(f"{what}: invalid shape {_brief(list(shape))}")
    isz = _itemsize(dtype)
    codecs = tuple(_req(d, "codecs", list, what))
    if len(codecs) > 64 or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                   and all(isinstance(k, str) for k in c) for c in codecs):
        raise FormatError(f"{what}: invalid codec pipeline (a list of objects with a 'name')")
    codecs = _shared(codecs)
    parts = version >= 2 and bool(codecs) and isinstance(codecs[0], dict) and codecs[0].get("name") == "raw"
    base = tuple(_chunk(c, f"{what} chunk", isz, max_blob_bytes, parts) for c in _req(d, "base", list, what))
    deltas = []
    for dd in check_deltas(d.get("deltas") or [], what, max_deltas):
        n = _nonneg(dd, "n", f"{what} delta")
        chunks = tuple(_chunk(c, f"{what} delta chunk", isz, max_blob_bytes)
                       for c in _req(dd, "chunks", list, f"{what} delta"))
        deltas.append(DeltaRef(n, _blob(dd.get("idx"), f"{what} delta idx", max_blob_bytes), chunks))
    quant = d.get("quant")
    if quant is not None and not isinstance(quant, dict):
        raise FormatError(f"{what}: field 'quant' has the wrong type")
    device = check_device(d.get("device", "cpu"), what)
    rec = TensorRecord(key, dtype, shape, codecs, base, tuple(deltas), _nonneg(d, "written", what), quant,
                       device)
    _check_coverage(rec, what)
    return rec


def _check_coverage(rec: TensorRecord, what: str) -> None:
    """Chunks must tile the tensor exactly; delta chunks must tile their rows (no gaps, no overlap)."""
    pos = 0
    for c in sorted(rec.base, key=lambda c: c.off):
        if c.off != pos:
            raise FormatError(f"{what}: chunks do not tile the tensor (gap or overlap at element {pos})")
        pos += c.rows * c.cols
    if pos != rec.numel:
        raise FormatError(f"{what}: chunks cover {pos} elements, the shape needs {rec.numel}")
    rows, cols = rec.row_shape
    for d in rec.deltas:
        if d.n > rows:
            raise FormatError(f"{what}: delta declares {d.n} rows, tensor has {rows}")
        pos = 0
        for c in sorted(d.chunks, key=lambda c: c.off):
            if c.off != pos or c.cols != cols:
                raise FormatError(f"{what}: delta chunks do not tile the changed rows")
            pos += c.rows * c.cols
        if pos != d.n * cols:
            raise FormatError(f"{what}: delta chunks cover {pos} elements, {d.n} rows need {d.n * cols}")


def _manifest_from_json(body: dict, limits: ManifestLimits) -> Manifest:
    created = _req(body, "created", (int, float), "manifest")
    version, max_blob_bytes = body["format_version"], limits.max_blob_bytes
    tensors = tuple(_tensor_from_json(t, max_blob_bytes, version, limits.max_deltas)
                    for t in _req(body, "tensors", list, "manifest"))
    check_packs(tensors)
    objects = []
    for o in _req(body, "objects", list, "manifest"):
        key = _req(o, "key", str, "object")
        objects.append(ObjectRecord(key, _req(o, "type", str, f"object {_brief(key)}"),
                                    _blob(o.get("blob"), f"object {_brief(key)}", max_blob_bytes)))
    stats = body.get("stats") or {}
    meta = body.get("meta") or {}
    if not isinstance(stats, dict) or not isinstance(meta, dict):
        raise FormatError("manifest: 'stats'/'meta' must be mappings")
    return Manifest(float(created), body.get("skeleton"), tensors, tuple(objects), stats, meta,
                    body["format_version"], _commit_field(body.get("commit")))


def _commit_field(commit: Any) -> dict | None:
    """The optional commit stamp, kept as written (so a manifest round-trips), shape checked."""
    if commit is None:
        return None
    if (not isinstance(commit, dict) or set(commit) != {"ns", "seq", "writer"}
            or not all(type(commit[k]) is int and 0 <= commit[k] < 2**64 for k in ("ns", "seq"))
            or not isinstance(commit["writer"], str) or not _WRITER_RE.fullmatch(commit["writer"])):
        raise FormatError("manifest: field 'commit' must be {ns, seq, writer}: two integers and a hex id")
    return dict(commit)
