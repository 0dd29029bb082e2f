"""The checks of a step-log segment's events: state records, gradient entries and their pack
references, and the field checks the step log's objects share (hostile input: everything is bounded
and typed before use; anything else is a ``StepLogFormatError`` naming the object and field).
Used by ``format``, which also re-exports the error classes defined here."""
from __future__ import annotations

import bisect
import re
from typing import Any

from ..errors import CheckrunError, FormatError
from ..format.dtypes import DTYPES
from .meta import check_counters, check_scaler

MAX_EVENTS = 1_000_000
MAX_GRADS = 100_000
MAX_DIMS = 8
MAX_PACK_NUMEL = 1 << 40
_MAX_INDEX = 10**12 - 1
_SCALAR = (int, float, bool, type(None))
_HEX16 = re.compile(r"[0-9a-f]{16}")


class StepLogFormatError(FormatError):
    """A step-log object whose content is malformed or outside the limits (hostile input)."""


class StepLogError(CheckrunError):
    """Misuse of the step log, or a log that does not fit the optimizer it is replayed into."""


class NoMarkerError(StepLogError):
    """``replay(after=checkpoint)`` of a checkpoint the log holds no marker for (saved before the log
    was opened, or by another engine): there is nothing to replay after it. Adapters catch it to
    resume at the checkpoint itself."""


def check_packs(packs: Any, where: str, payload: int) -> dict[str, list[int]]:
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


def check_event(ev: Any, what: str, payload: int, version: int,
                 packs: dict[str, list[int]] | None = None, buffers: int = 0) -> int:
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
    if not {"kind", "step", "grads"} <= set(ev) <= {"kind", "step", "grads", "bufs"} or ("bufs" in ev) > (version >= 5):
        raise StepLogFormatError(f"{what}: a 'step' event holds exactly step, grads (and bufs from version 5)")
    _index(ev["step"], what, "step")
    grads, bufs = ev["grads"], ev.get("bufs", [])
    if not isinstance(grads, list) or len(grads) > MAX_GRADS:
        raise StepLogFormatError(f"{what}: 'grads' must be a list of at most {MAX_GRADS}")
    for g in grads:
        check_grad(g, what, payload, packs or {})
    if not isinstance(bufs, list) or len(bufs) > buffers:
        raise StepLogFormatError(f"{what}: 'bufs' must be a list of at most the {buffers} the header names")
    for b in bufs:  # the forward-pass state: dense values of the header's ``buffers``
        check_grad(b, f"{what}, buffer", payload, packs or {})
        if b["k"] != "dense" or b["p"] >= buffers:
            raise StepLogFormatError(f"{what}: buffer entry {str(b['p'])[:20]} must be dense and index the header's "
                                     f"{buffers} buffer names")
    if len({b["p"] for b in bufs}) != len(bufs):
        raise StepLogFormatError(f"{what}: 'bufs' holds a buffer twice")
    return len(grads) + len(bufs)


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
_FOLDED = _GRAD_KEYS["sparse"] | {"u", "runs"}  # a folded sparse gradient (``capture._fold``; version 4)


def check_grad(g: Any, what: str, payload: int, packs: dict[str, list[int]]) -> None:
    """One gradient entry: kind, shape, dtype, and its tensors inside ``payload`` bytes (a range) or
    inside one chunk of the pack of their dtype (``packs``: ``check_packs``)."""
    if not isinstance(g, dict) or not isinstance(g.get("k"), str) or g["k"] not in _GRAD_KEYS \
            or set(g) not in (_GRAD_KEYS[g["k"]], _FOLDED if g["k"] == "sparse" else None):
        raise StepLogFormatError(f"{what}: malformed gradient entry "
                                 f"(keys {sorted(g)[:10] if isinstance(g, dict) else str(g)[:40]})")
    what = f"{what}, param {str(g['p'])[:20]}"
    _index(g["p"], what, "p")
    if g["k"] == "none":
        return
    if not isinstance(g["dtype"], str) or g["dtype"] not in DTYPES:
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
        if "runs" in g:  # folded (version 4): u rows, row j repeated runs[j] times (checked on decode)
            u = _index(g["u"], what, "u")
            if u > n or (u == 0) != (n == 0):
                raise StepLogFormatError(f"{what}: a folded gradient of {n} rows stores {u}")
            _ref(g["runs"], what, "runs", payload, packs, "int32", u)
            numel = u * shape[1]
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


def _hex16(v: Any, where: str, name: str) -> str:
    if not isinstance(v, str) or not _HEX16.fullmatch(v):
        raise StepLogFormatError(f"{where}: field {name!r} must be 16 hex digits")
    return v


def _index(v: Any, where: str, name: str) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_INDEX:
        raise StepLogFormatError(f"{where}: field {name!r} must be an integer in [0, {_MAX_INDEX}]")
    return v
