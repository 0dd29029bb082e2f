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
is allocated; anything malformed is a ``StepLogFormatError`` naming the object (the checks of a
segment's events, gradient entries and packs: ``checks``).
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import FormatError
from ..format.limits import ManifestLimits, check_json, memory_limit
from .checks import (_HEX16, MAX_EVENTS, MAX_GRADS, NoMarkerError, StepLogError, StepLogFormatError, _hex16,
                     _index, check_event, check_packs)
from .meta import check_optimizer, check_owner, check_param_names
from .rng import check as check_rng

FORMAT_VERSION = 7
"""Written by this checkrun for segments. Versions 1-5 are read too: version 1 (checkrun before 2026-12-04)
lacks the run header's metadata and the ``scaler`` of ``state`` events (``meta``); segments before
version 3 have no ``packs`` (every gradient is a payload range of its own); before version 4 no
sparse gradient is folded (``u``/``runs``); before version 5 no step holds the forward-pass state
(``bufs``, named by the header's ``buffers``); before version 7 (2026-12-06) no header holds the RNG
states of its last step (``rng``). No segment has version 6 (a version of run and marker objects), so
a checkrun that reads up to 6 refuses a version 7 segment by its version."""
OBJECT_VERSION = 6
"""Run and marker objects: version 6 (2026-12-05) carries a ``checksum`` (xxh3-64 of the object's
canonical JSON without it), so a damaged one is refused instead of read as another valid one;
versions 1-5 of them, without, are read too."""
RUN_END_VERSION = 8
"""A run object that ``close`` rewrote with ``end`` (its last event and segment; 2026-12-06): version 8, so
that a missing last segment of a closed run is told apart from a run that logged no further (a checkrun
that reads up to 7 refuses it by its version). Other run and marker objects stay at ``OBJECT_VERSION``."""
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)
PLAIN_VERSION = 3
"""Written for what format 4 did not change (run and marker objects, segments without a folded
gradient), so that a checkrun that reads up to version 3 still replays such a log."""


def _written(folded: bool, buffers: bool = False, states: bool = False) -> int:
    """The lowest version that holds a segment: 7 with RNG states, 5 with forward-pass state, 4 with a
    folded gradient."""
    return min(FORMAT_VERSION, FORMAT_VERSION if states else 5 if buffers else 4 if folded else PLAIN_VERSION)
SEG_MAGIC = b"CKRSLOG\x01"
MAX_HEADER_BYTES = 16 << 20
MAX_SMALL_BYTES = 64 << 10  # marker objects
MAX_RUN_BYTES = 8 << 20  # run objects: their parameter names (``meta.MAX_NAMES``)
HEADER_LIMITS = ManifestLimits(max_bytes=MAX_HEADER_BYTES, max_elements=2_000_000, kind="step-log segment header")
_SMALL_LIMITS = ManifestLimits(max_bytes=MAX_SMALL_BYTES, max_elements=10_000, kind="step-log object")
_RUN_LIMITS = ManifestLimits(max_bytes=MAX_RUN_BYTES, max_elements=250_000, kind="step-log run object")
_PREFIX = struct.Struct("<8sI")
_CSUM = struct.Struct("<Q")
PREFIX_BYTES = _PREFIX.size  # magic + header length: what header_end needs

RUN_RE = re.compile(r"run-([0-9a-f]{16})\.json")
SEG_RE = re.compile(r"seg-([0-9a-f]{16})-([0-9]{8})-([0-9]{12})-([0-9]{12})\.bin")
MARK_RE = re.compile(r"mark-([0-9a-f]{16})-([0-9]{12})-([0-9]{8})\.json")
_HEX32 = re.compile(r"[0-9a-f]{1,32}")


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

    @property
    def key(self) -> tuple[str, int, int, int]:
        return self.run, self.seq, self.lo, self.hi


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
    end: tuple[int, int] | None = None
    """``(event, seq)``: the run's last event and last segment, as ``close`` left them (version 8)."""


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


def _sealed(body: dict, version: int = OBJECT_VERSION) -> bytes:
    """A run or marker object's bytes: ``version``, with its checksum."""
    body = {**body, "format_version": version}
    return _dump({**body, "checksum": xxhash.xxh3_64_hexdigest(_dump(body))})


def run_to_bytes(info: RunInfo) -> bytes:
    parent = None if info.parent is None else {"run": info.parent[0], "event": info.parent[1]}
    names = None if info.param_names is None else [list(g) for g in info.param_names]
    body = {"_checkrun": "steplog-run", "run": info.run, "created": info.created, "start": info.start,
            "start_step": info.start_step, "parent": parent, "optimizer": info.optimizer, "param_names": names,
            "owner": info.owner, "closed": info.closed}
    if info.end is None:
        return _sealed(body)
    return _sealed({**body, "end": {"event": info.end[0], "seq": info.end[1]}}, RUN_END_VERSION)


def marker_to_bytes(m: Marker) -> bytes:
    return _sealed({"_checkrun": "steplog-marker", "run": m.run,
                  "event": m.event, "step": m.step, "checkpoint": m.checkpoint, "commit": m.commit})


_RUN_KEYS = {"_checkrun", "format_version", "run", "created", "start", "start_step", "parent"}
_RUN_KEYS_V2 = {"optimizer", "param_names", "owner", "closed"}  # optional from version 2 (and "end" from 8)


def _check_json(data: bytes, where: str, limits: ManifestLimits) -> None:
    try:
        check_json(data, where, limits)
    except FormatError as exc:  # a step-log object's, as every other refusal of one
        raise StepLogFormatError(str(exc)) from None


def _load_small(data: bytes, where: str, magic: str, keys: set[str], optional: set[str] = frozenset(),
                limits: ManifestLimits = _SMALL_LIMITS, newest: int = OBJECT_VERSION) -> dict:
    if len(data) > limits.max_bytes:
        raise StepLogFormatError(f"{where}: {len(data)} bytes, more than the limit of {limits.max_bytes}")
    _check_json(data, where, limits)
    body = _json(data, where)
    if not isinstance(body, dict) or body.get("_checkrun") != magic:
        raise StepLogFormatError(f"{where}: not a checkrun {magic} object")
    version = _version(body, where)
    if version > newest or version == 7:  # version 7 is only segments'
        raise StepLogFormatError(f"{where}: unsupported {magic} format_version {version} (this checkrun reads 1 to "
                                 f"{newest}" + (", not 7)" if newest > 7 else ")"))
    keys = keys | ({"checksum"} if version >= OBJECT_VERSION else set())
    allowed = keys | (optional if version >= 2 else set()) | ({"end"} if version >= RUN_END_VERSION else set())
    if not keys <= set(body) <= allowed:
        raise StepLogFormatError(f"{where}: keys {sorted(body)[:20]}, expected {sorted(keys)}"
                                 + (f" and optionally {sorted(allowed - keys)}" if allowed != keys else ""))
    if version >= OBJECT_VERSION:
        rest = {k: v for k, v in body.items() if k != "checksum"}
        if body["checksum"] != xxhash.xxh3_64_hexdigest(_dump(rest)):
            raise StepLogFormatError(f"{where}: checksum mismatch (damaged {magic} object)")
    return body


def parse_run(data: bytes, where: str, run: str) -> RunInfo:
    body = _load_small(data, where, "steplog-run", _RUN_KEYS, _RUN_KEYS_V2, _RUN_LIMITS, RUN_END_VERSION)
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
    start, end = _index(body["start"], where, "start"), body.get("end")
    if end is not None:
        if not isinstance(end, dict) or set(end) != {"event", "seq"} or not closed:
            raise StepLogFormatError(f"{where}: field 'end' must be {{event, seq}}, in a closed run's object")
        end = (_index(end["event"], where, "end.event"), _index(end["seq"], where, "end.seq"))
        if end[0] < start:
            raise StepLogFormatError(f"{where}: field 'end' ends before the run's start")
    return RunInfo(run, float(created), start, _index(body["start_step"], where, "start_step"), parent, *meta,
                   closed, end)


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
def segment_parts(header: dict, payload: list[bytes | memoryview], csum: Any = None) -> list[bytes | memoryview]:
    """The parts of one segment, in order (``Store.write_manifest`` writes them one after another on a
    local disk: the payload's megabytes are not copied into one buffer first); ``header`` gets the
    payload's length and checksum added. ``csum``: an ``xxhash.xxh3_64`` already fed with ``payload``
    (the encoder hashes each part as it makes it, while it is in cache); None: computed here."""
    size = sum(memoryview(part).nbytes for part in payload)
    if csum is None:
        csum = xxhash.xxh3_64()
        for part in payload:
            csum.update(part)
    folded = any("runs" in g for ev in header.get("events", ()) if isinstance(ev, dict)
                 for g in ev.get("grads", ()) if isinstance(g, dict))
    version = _written(folded, "buffers" in header, "rng" in header)
    header = {**header, "_checkrun": "steplog-segment", "format_version": version,
              "payload_bytes": size, "payload_csum": csum.hexdigest()}
    text = _dump(header)
    return [_PREFIX.pack(SEG_MAGIC, len(text)), text, _CSUM.pack(xxhash.xxh3_64_intdigest(text)), *payload]


def pack_segment(header: dict, payload: list[bytes | memoryview]) -> bytes:
    """The bytes of one segment (``segment_parts`` joined)."""
    return b"".join(segment_parts(header, payload))


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
    _check_json(text, where, HEADER_LIMITS)
    header = _json(text, where)
    _check_header(header, where, payload_len)
    return header


def check_seg_name(header: dict, name: str, where: str) -> None:
    """``StepLogFormatError`` when a segment's header does not name its run, number and events as its
    file name ``name`` does (a segment copied or renamed over another: only replay refused it; h112, h113)."""
    seg = parse_seg_name(name)
    if seg is not None and (header["run"], header["seq"], header["lo"], header["hi"]) != seg.key:
        raise StepLogFormatError(f"{where}: header says run {header['run']} seq {header['seq']} events "
                                 f"({header['lo']}, {header['hi']}], its name says otherwise")


def decode_limit(load: Any) -> int:
    """The most bytes a segment (and each tensor or pack chunk in it) may take: ``load.max_blob_bytes``,
    and ``load.max_total_bytes`` (this machine's memory when None), as a checkpoint's tensors (h112: a
    forged chunk of zeros took 4 GiB whatever ``max_total_bytes`` said)."""
    return min(load.max_blob_bytes, memory_limit(load.max_total_bytes))


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


def _check_header(h: Any, where: str, payload_len: int) -> None:
    if not isinstance(h, dict) or h.get("_checkrun") != "steplog-segment":
        raise StepLogFormatError(f"{where}: not a checkrun step-log segment header")
    version = _version(h, where)
    if version > FORMAT_VERSION:  # a run object's version, not a segment's
        raise StepLogFormatError(f"{where}: unsupported step-log segment format_version {version} (this checkrun "
                                 f"reads 1 to {FORMAT_VERSION})")
    optional = ({"packs", "buffers", "rng"} if version >= 7 else {"packs", "buffers"} if version >= 5
                else {"packs"} if version >= 3 else set())
    if not _SEG_KEYS <= set(h) <= _SEG_KEYS | optional:
        raise StepLogFormatError(f"{where}: header keys {sorted(h)[:20]}, expected {sorted(_SEG_KEYS)}"
                                 + (f" and optionally {', '.join(sorted(optional))}" if optional else ""))
    try:
        buffers = check_param_names([h.get("buffers", [])], "field 'buffers'")[0]
    except FormatError as exc:
        raise StepLogFormatError(f"{where}: {exc}") from None
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
    packs = check_packs(h.get("packs", {}), where, payload)
    if "rng" in h:
        check_rng(h["rng"], where, payload, lo, hi)
    grads = 0
    for i, ev in enumerate(events):
        grads += check_event(ev, f"{where}: event {lo + i + 1}", payload, version, packs, len(buffers))
        if grads > MAX_GRADS * max(1, len(events)):  # pragma: no cover - bounded by the JSON limits
            raise StepLogFormatError(f"{where}: too many gradients")


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
