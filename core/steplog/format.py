"""The step log's objects on storage, and the parse code that treats them as hostile input.

Under ``<dir>/.checkrun/steplog/`` (see docs/format.md, "Step log"):

* ``run-<run>.json``: one logging run (one ``engine.step_log`` call): its parent (the run and event
  it continues after a replay) or null, and its first event index; from version 2 also the
  optimizer's class, its parameter names, the logging process and whether the log was closed
  (``meta``). Written before its segments (and again at ``close``).
* ``seg-<run>-<seq>-<lo>-<hi>.bin``: events ``lo+1 .. hi`` of the run, committed atomically (rename /
  one PUT). Layout: ``MAGIC | u32 header length | header JSON | u64 xxh3 of the header | payload``;
  the header lists the events and, per gradient, where its encoded bytes lie in the payload and
  their xxh3-64; it also holds the payload's length and xxh3-64.
* ``mark-<run>-<event>-<seq>.json``: checkpoint ``name`` (commit stamp ``commit``) was saved when
  the run had logged ``event`` events (``step`` optimizer steps).

Names are matched against fixed patterns, never used as paths. Sizes are bounded before anything
is allocated; anything malformed is a ``StepLogFormatError`` naming the object.
"""
from __future__ import annotations

import bisect
import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CheckrunError, FormatError
from ..format.dtypes import DTYPES
from ..format.limits import ManifestLimits, check_json
from .meta import check_counters, check_optimizer, check_owner, check_param_names, check_scaler

FORMAT_VERSION = 3
"""Written by this checkrun. Versions 1 and 2 are read too: version 1 (checkrun before 2026-12-04)
lacks the run header's metadata and the ``scaler`` of ``state`` events (``meta``); segments before
version 3 have no ``packs`` (every gradient is a payload range of its own)."""
READ_VERSIONS = (1, 2, 3)
SEG_MAGIC = b"CKRSLOG\x01"
MAX_HEADER_BYTES = 16 << 20
MAX_SMALL_BYTES = 64 << 10  # marker objects
MAX_RUN_BYTES = 8 << 20  # run objects: their parameter names (``meta.MAX_NAMES``)
MAX_EVENTS = 1_000_000
MAX_GRADS = 100_000
MAX_DIMS = 8
HEADER_LIMITS = ManifestLimits(max_bytes=MAX_HEADER_BYTES, max_elements=2_000_000)
_SMALL_LIMITS = ManifestLimits(max_bytes=MAX_SMALL_BYTES, max_elements=10_000)
_RUN_LIMITS = ManifestLimits(max_bytes=MAX_RUN_BYTES, max_elements=250_000)
_PREFIX = struct.Struct("<8sI")
_CSUM = struct.Struct("<Q")
PREFIX_BYTES = _PREFIX.size  # magic + header length: what header_end needs

RUN_RE = re.compile(r"run-([0-9a-f]{16})\.json")
SEG_RE = re.compile(r"seg-([0-9a-f]{16})-([0-9]{8})-([0-9]{12})-([0-9]{12})\.bin")
MARK_RE = re.compile(r"mark-([0-9a-f]{16})-([0-9]{12})-([0-9]{8})\.json")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{1,32}")
_MAX_INDEX = 10**12 - 1
_SCALAR = (int, float, bool, type(None))


class StepLogFormatError(FormatError):
    """A step-log object whose content is malformed or outside the limits (hostile input)."""


class StepLogError(CheckrunError):
    """Misuse of the step log, or a log that does not fit the optimizer it is replayed into."""


class NoMarkerError(StepLogError):
    """``replay(after=checkpoint)`` of a checkpoint the log holds no marker for (saved before the log
    was opened, or by another engine): there is nothing to replay after it. Adapters catch it to
    resume at the checkpoint itself."""


def seg_name(run: str, seq: int, lo: int, hi: int) -> str:
    return f"seg-{run}-{seq:08d}-{lo:012d}-{hi:012d}.bin"


def mark_name(run: str, event: int, seq: int) -> str:
    return f"mark-{run}-{event:012d}-{seq:08d}.json"


def run_name(run: str) -> str:
    return f"run-{run}.json"


@dataclass(frozen=True)
class SegName:
    """What a segment's name says: run, sequence number and its events ``(lo, hi]``."""

    name: str
    run: str
    seq: int
    lo: int
    hi: int


def parse_seg_name(name: str) -> SegName | None:
    m = SEG_RE.fullmatch(name)
    if m is None or int(m.group(3)) > int(m.group(4)):
        return None
    return SegName(name, m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))


# ----------------------------------------------------------------------------- small objects
@dataclass(frozen=True)
class RunInfo:
    run: str
    created: float
    start: int
    """Events logged before this run's first one (0, or the parent's event it continues from)."""
    start_step: int
    parent: tuple[str, int] | None
    optimizer: str | None = None
    """``module.qualname`` of the optimizer's class (version 2; None: not recorded)."""
    param_names: tuple[tuple[str, ...], ...] | None = None
    """The names of the optimizer's parameters per group, when known (version 2)."""
    owner: dict | None = None
    """The logging process (writer, pid, start, host: as a lease records it; version 2)."""
    closed: bool = False
    """Rewritten true by ``close`` once no save into the directory was in flight (version 2)."""


@dataclass(frozen=True)
class Marker:
    name: str
    run: str
    event: int
    step: int
    checkpoint: str
    commit: dict | None


def _dump(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def run_to_bytes(info: RunInfo) -> bytes:
    parent = None if info.parent is None else {"run": info.parent[0], "event": info.parent[1]}
    names = None if info.param_names is None else [list(g) for g in info.param_names]
    return _dump({"_checkrun": "steplog-run", "format_version": FORMAT_VERSION, "run": info.run,
                  "created": info.created, "start": info.start, "start_step": info.start_step,
                  "parent": parent, "optimizer": info.optimizer, "param_names": names, "owner": info.owner,
                  "closed": info.closed})


def marker_to_bytes(m: Marker) -> bytes:
    return _dump({"_checkrun": "steplog-marker", "format_version": FORMAT_VERSION, "run": m.run,
                  "event": m.event, "step": m.step, "checkpoint": m.checkpoint, "commit": m.commit})


_RUN_KEYS = {"_checkrun", "format_version", "run", "created", "start", "start_step", "parent"}
_RUN_KEYS_V2 = {"optimizer", "param_names", "owner", "closed"}  # optional from version 2


def _load_small(data: bytes, where: str, magic: str, keys: set[str], optional: set[str] = frozenset(),
                limits: ManifestLimits = _SMALL_LIMITS) -> dict:
    if len(data) > limits.max_bytes:
        raise StepLogFormatError(f"{where}: {len(data)} bytes, more than the limit of {limits.max_bytes}")
    check_json(data, where, limits)
    body = _json(data, where)
    if not isinstance(body, dict) or body.get("_checkrun") != magic:
        raise StepLogFormatError(f"{where}: not a checkrun {magic} object")
    allowed = keys | (optional if _version(body, where) >= 2 else set())
    if not keys <= set(body) <= allowed:
        raise StepLogFormatError(f"{where}: keys {sorted(body)[:20]}, expected {sorted(keys)}"
                                 + (f" and optionally {sorted(allowed - keys)}" if allowed != keys else ""))
    return body


def parse_run(data: bytes, where: str, run: str) -> RunInfo:
    body = _load_small(data, where, "steplog-run", _RUN_KEYS, _RUN_KEYS_V2, _RUN_LIMITS)
    if body["run"] != run:
        raise StepLogFormatError(f"{where}: field 'run' is {str(body['run'])[:40]!r}, its name says {run!r}")
    created = body["created"]
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < 1e11:
        raise StepLogFormatError(f"{where}: field 'created' must be a time in seconds")
    parent = body["parent"]
    if parent is not None:
        if not isinstance(parent, dict) or set(parent) != {"run", "event"}:
            raise StepLogFormatError(f"{where}: field 'parent' must be null or {{run, event}}")
        parent = (_hex16(parent["run"], where, "parent.run"), _index(parent["event"], where, "parent.event"))
    closed = body.get("closed", False)
    if not isinstance(closed, bool):
        raise StepLogFormatError(f"{where}: field 'closed' must be true/false")
    try:
        meta = (check_optimizer(body.get("optimizer")), check_param_names(body.get("param_names")),
                check_owner(body.get("owner")))
    except FormatError as exc:  # meta's checks: named here
        raise StepLogFormatError(f"{where}: {exc}") from None
    return RunInfo(run, float(created), _index(body["start"], where, "start"),
                   _index(body["start_step"], where, "start_step"), parent, *meta, closed)


def parse_marker(data: bytes, where: str, name: str) -> Marker:
    body = _load_small(data, where, "steplog-marker", {"_checkrun", "format_version", "run", "event",
                                                         "step", "checkpoint", "commit"})
    m = MARK_RE.fullmatch(name)
    run, event = _hex16(body["run"], where, "run"), _index(body["event"], where, "event")
    if m is None or (m.group(1), int(m.group(2))) != (run, event):
        raise StepLogFormatError(f"{where}: fields run/event do not match its name")
    ckpt = body["checkpoint"]
    if not isinstance(ckpt, str) or not 0 < len(ckpt) <= 1024 or "/" in ckpt or "\0" in ckpt:
        raise StepLogFormatError(f"{where}: field 'checkpoint' must be a plain file name")
    commit = body["commit"]
    if commit is not None and (not isinstance(commit, dict) or set(commit) != {"ns", "seq", "writer"}
                               or not all(type(commit[k]) is int and 0 <= commit[k] < 2**64 for k in ("ns", "seq"))
                               or not isinstance(commit["writer"], str) or not _HEX32.fullmatch(commit["writer"])):
        raise StepLogFormatError(f"{where}: field 'commit' must be null or {{ns, seq, writer}}")
    return Marker(name, run, event, _index(body["step"], where, "step"), ckpt, commit)


# ----------------------------------------------------------------------------- segments
def pack_segment(header: dict, payload: list[bytes | memoryview]) -> bytes:
    """The bytes of one segment; ``header`` gets the payload's length and checksum added."""
    h = xxhash.xxh3_64()
    size = 0
    for part in payload:
        h.update(part)
        size += memoryview(part).nbytes
    header = {**header, "_checkrun": "steplog-segment", "format_version": FORMAT_VERSION,
              "payload_bytes": size, "payload_csum": h.hexdigest()}
    text = _dump(header)
    return b"".join([_PREFIX.pack(SEG_MAGIC, len(text)), text, _CSUM.pack(xxhash.xxh3_64_intdigest(text)),
                     *payload])


class SegmentDamaged(Exception):
    """Internal: the bytes of a segment are torn or corrupt (checksum, length); replay stops there."""


def header_end(head: bytes | memoryview) -> int:
    """Offset of the payload, given at least a segment's first ``PREFIX_BYTES`` bytes (0 if they are
    not a segment's): how many bytes to read for ``parse_header``."""
    if len(head) < _PREFIX.size or bytes(head[:8]) != SEG_MAGIC:
        return 0
    return _PREFIX.size + min(_PREFIX.unpack_from(head, 0)[1], MAX_HEADER_BYTES) + _CSUM.size


def parse_header(head: bytes | memoryview, where: str, payload_len: int) -> dict:
    """The checked header of a segment from its first bytes (prefix, header, header checksum; the
    payload may follow or not): everything ``split_segment`` checks but the payload. The payload
    ranges the header names must fit in ``payload_len`` bytes (a reader of the header alone passes
    a large number: they are checked again when the payload is read). Same errors as ``split_segment``."""
    if len(head) < _PREFIX.size or bytes(head[:8]) != SEG_MAGIC:
        raise SegmentDamaged(f"{where}: no step-log segment magic (truncated or not a segment)")
    _, hlen = _PREFIX.unpack_from(head, 0)
    if hlen > MAX_HEADER_BYTES:
        raise StepLogFormatError(f"{where}: header of {hlen} bytes, more than the limit of {MAX_HEADER_BYTES}")
    end = _PREFIX.size + hlen
    if len(head) < end + _CSUM.size:
        raise SegmentDamaged(f"{where}: truncated inside the header")
    text = bytes(head[_PREFIX.size:end])
    if _CSUM.unpack_from(head, end)[0] != xxhash.xxh3_64_intdigest(text):
        raise SegmentDamaged(f"{where}: header checksum mismatch")
    check_json(text, where, HEADER_LIMITS)
    header = _json(text, where)
    _check_header(header, where, payload_len)
    return header


def split_segment(data: bytes, where: str) -> tuple[dict, memoryview]:
    """Header (checked: checksums, shape, bounds) and payload of a segment's bytes.

    ``SegmentDamaged`` for bytes that fail a checksum or length (corruption, truncation);
    ``StepLogFormatError`` for a header whose checksum holds but whose content is invalid."""
    view = memoryview(data)
    end = header_end(view)
    header = parse_header(view, where, len(view) - end)
    payload = view[end:]
    if len(payload) != header["payload_bytes"]:
        raise SegmentDamaged(f"{where}: payload is {len(payload)} bytes, the header says {header['payload_bytes']}")
    if xxhash.xxh3_64_hexdigest(payload) != header["payload_csum"]:
        raise SegmentDamaged(f"{where}: payload checksum mismatch")
    return header, payload


_SEG_KEYS = {"_checkrun", "format_version", "run", "seq", "lo", "hi", "events", "payload_bytes", "payload_csum"}
MAX_PACK_NUMEL = 1 << 40


def _check_header(h: Any, where: str, payload_len: int) -> None:
    if not isinstance(h, dict) or h.get("_checkrun") != "steplog-segment":
        raise StepLogFormatError(f"{where}: not a checkrun step-log segment header")
    version = _version(h, where)
    if not _SEG_KEYS <= set(h) <= (_SEG_KEYS | {"packs"} if version >= 3 else _SEG_KEYS):
        raise StepLogFormatError(f"{where}: header keys {sorted(h)[:20]}, expected {sorted(_SEG_KEYS)}"
                                 + (" and optionally packs" if version >= 3 else ""))
    _hex16(h["run"], where, "run")
    lo, hi = _index(h["lo"], where, "lo"), _index(h["hi"], where, "hi")
    _index(h["seq"], where, "seq")
    size = _index(h["payload_bytes"], where, "payload_bytes")
    if not isinstance(h["payload_csum"], str) or not _HEX16.fullmatch(h["payload_csum"]):
        raise StepLogFormatError(f"{where}: field 'payload_csum' must be 16 hex digits")
    events = h["events"]
    if not isinstance(events, list) or len(events) > MAX_EVENTS or len(events) != hi - lo:
        raise StepLogFormatError(f"{where}: field 'events' must list hi - lo = {hi - lo} events")
    payload = max(size, payload_len)
    packs = _check_packs(h.get("packs", {}), where, payload)
    grads = 0
    for i, ev in enumerate(events):
        grads += _check_event(ev, f"{where}: event {lo + i + 1}", payload, version, packs)
        if grads > MAX_GRADS * max(1, len(events)):  # pragma: no cover - bounded by the JSON limits
            raise StepLogFormatError(f"{where}: too many gradients")


def _check_packs(packs: Any, where: str, payload: int) -> dict[str, list[int]]:
    """Version 3's ``packs``: per dtype name, its chunks ``{"numel", "data": range}`` in order; per
    dtype name, the element offsets where its chunks end."""
    if not isinstance(packs, dict) or len(packs) > len(DTYPES):
        raise StepLogFormatError(f"{where}: field 'packs' must map dtype names to lists of chunks")
    out = {}
    for name, chunks in packs.items():
        if name not in DTYPES or not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_EVENTS:
            raise StepLogFormatError(f"{where}: pack {str(name)[:32]!r} must be a known dtype's list of chunks")
        ends, total = [], 0
        for chunk in chunks:
            if not isinstance(chunk, dict) or set(chunk) != {"numel", "data"} or type(chunk["numel"]) is not int \
                    or not 0 < chunk["numel"] <= MAX_PACK_NUMEL:
                raise StepLogFormatError(f"{where}: a chunk of pack {name!r} must be {{numel, data}} with numel in "
                                         f"[1, {MAX_PACK_NUMEL}]")
            _range(chunk["data"], f"{where}: pack {name!r}", "data", payload)
            total += chunk["numel"]
            ends.append(total)
        out[name] = ends
    return out


def _check_event(ev: Any, what: str, payload: int, version: int = FORMAT_VERSION,
                 packs: dict[str, list[int]] | None = None) -> int:
    if not isinstance(ev, dict) or ev.get("kind") not in ("step", "state"):
        raise StepLogFormatError(f"{what}: must be an object of kind 'step' or 'state'")
    if ev["kind"] == "state":
        groups = ev.get("groups")
        keys = {"kind", "groups", "sched"}
        optional = {"scaler", "counters"} if version >= 3 else {"scaler"} if version >= 2 else set()
        if not keys <= set(ev) <= keys | optional or not isinstance(groups, list) \
                or len(groups) > 10_000 or not all(_scalars(g) for g in groups):
            raise StepLogFormatError(f"{what}: a 'state' event holds 'groups' (mappings of names to scalars) "
                                     "and 'sched' (and optionally 'scaler' from version 2, 'counters' from version 3)")
        if ev["sched"] is not None and not isinstance(ev["sched"], dict):
            raise StepLogFormatError(f"{what}: field 'sched' must be null or a mapping")
        try:
            check_scaler(ev.get("scaler"))
            check_counters(ev.get("counters"))
        except FormatError as exc:  # meta's checks: named here
            raise StepLogFormatError(f"{what}: {exc}") from None
        return 0
    if set(ev) != {"kind", "step", "grads"}:
        raise StepLogFormatError(f"{what}: a 'step' event holds exactly step, grads")
    _index(ev["step"], what, "step")
    grads = ev["grads"]
    if not isinstance(grads, list) or len(grads) > MAX_GRADS:
        raise StepLogFormatError(f"{what}: 'grads' must be a list of at most {MAX_GRADS}")
    for g in grads:
        check_grad(g, what, payload, packs or {})
    return len(grads)


def _scalars(group: Any) -> bool:
    return (isinstance(group, dict) and len(group) <= 64
            and all(isinstance(k, str) and len(k) <= 64 and _hyper(v) for k, v in group.items()))


def _hyper(v: Any) -> bool:
    if isinstance(v, list):
        return len(v) <= 8 and all(isinstance(x, _SCALAR) for x in v)
    return isinstance(v, _SCALAR)


_GRAD_KEYS = {"none": {"p", "k"}, "dense": {"p", "k", "dtype", "shape", "data"},
              "rows": {"p", "k", "dtype", "shape", "data", "idx", "n"},
              "sparse": {"p", "k", "dtype", "shape", "data", "idx", "n", "coalesced"}}


def check_grad(g: Any, what: str, payload: int, packs: dict[str, list[int]]) -> None:
    """One gradient entry: kind, shape, dtype, and its tensors inside ``payload`` bytes (a range) or
    inside one chunk of the pack of their dtype (``packs``: ``_check_packs``)."""
    if not isinstance(g, dict) or g.get("k") not in _GRAD_KEYS or set(g) != _GRAD_KEYS[g["k"]]:
        raise StepLogFormatError(f"{what}: malformed gradient entry (keys {sorted(g)[:10] if isinstance(g, dict) else g!r})")
    what = f"{what}, param {g['p']!r}"
    _index(g["p"], what, "p")
    if g["k"] == "none":
        return
    if g["dtype"] not in DTYPES:
        raise StepLogFormatError(f"{what}: unknown dtype {str(g['dtype'])[:32]!r}")
    shape = g["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < 2**40 for d in shape):
        raise StepLogFormatError(f"{what}: field 'shape' must list at most {MAX_DIMS} sizes")
    numel = 1
    for d in shape:
        numel *= d
    if g["k"] in ("rows", "sparse"):
        n = _index(g["n"], what, "n")
        if len(shape) != 2 or (g["k"] == "rows" and n > shape[0]):
            raise StepLogFormatError(f"{what}: {g['k']} gradient needs a 2-D shape and n <= rows")
        _ref(g["idx"], what, "idx", payload, packs, "int64", n)
        numel = n * shape[1]
    _ref(g["data"], what, "data", payload, packs, g["dtype"], numel)
    if g["k"] == "sparse" and not isinstance(g["coalesced"], bool):
        raise StepLogFormatError(f"{what}: field 'coalesced' must be true/false")


def _ref(r: Any, what: str, name: str, payload: int, packs: dict[str, list[int]], dtype: str, numel: int) -> None:
    """A tensor's bytes: a payload range, or ``{"pack": dtype, "at": offset}`` (version 3): ``numel``
    elements of the segment's pack of its dtype from element ``at``, all inside one chunk."""
    if not isinstance(r, dict):
        _range(r, what, name, payload)
        return
    if set(r) != {"pack", "at"} or type(r["at"]) is not int or not 0 <= r["at"] <= MAX_PACK_NUMEL * MAX_EVENTS:
        raise StepLogFormatError(f"{what}: field {name!r} must be [offset, length, codecs] or {{pack, at}}")
    if r["pack"] != dtype:
        raise StepLogFormatError(f"{what}: field {name!r} names pack {str(r['pack'])[:32]!r}, its dtype is {dtype}")
    if not numel:
        return
    ends = packs.get(dtype)
    if not ends:
        raise StepLogFormatError(f"{what}: field {name!r} names pack {dtype}, the segment has none")
    j = bisect.bisect_right(ends, r["at"])
    if j == len(ends) or r["at"] + numel > ends[j]:
        raise StepLogFormatError(f"{what}: field {name!r} reaches element {r['at'] + numel} of pack {dtype}, "
                                 f"past the end of its chunk ({ends[j] if j < len(ends) else ends[-1]})")


def _range(r: Any, what: str, name: str, payload: int) -> None:
    if (not isinstance(r, list) or len(r) != 3 or not all(type(x) is int and x >= 0 for x in r[:2])
            or not isinstance(r[2], list) or len(r[2]) > 4):
        raise StepLogFormatError(f"{what}: field {name!r} must be [offset, length, codecs]")
    if r[0] + r[1] > payload:
        raise StepLogFormatError(f"{what}: field {name!r} reaches byte {r[0] + r[1]}, the payload has {payload}")


def _json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise StepLogFormatError(f"{where}: invalid JSON: {str(exc)[:200]}") from None


def _version(body: dict, where: str) -> int:
    v = body.get("format_version")
    if type(v) is not int or v not in READ_VERSIONS:
        raise StepLogFormatError(f"{where}: unsupported step-log format_version {str(v)[:20]!r} "
                                 f"(this checkrun reads {', '.join(map(str, READ_VERSIONS))})")
    return v


def _hex16(v: Any, where: str, name: str) -> str:
    if not isinstance(v, str) or not _HEX16.fullmatch(v):
        raise StepLogFormatError(f"{where}: field {name!r} must be 16 hex digits")
    return v


def _index(v: Any, where: str, name: str) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_INDEX:
        raise StepLogFormatError(f"{where}: field {name!r} must be an integer in [0, {_MAX_INDEX}]")
    return v
