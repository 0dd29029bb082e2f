"""Replay: apply the logged steps after a checkpoint's marker to the optimizer it was loaded into.

Training thread. The caller has loaded the checkpoint into model, optimizer and scheduler. The
chain starts at the checkpoint's marker (its run and event), follows that run's segments and, where a
later run continues it (a resume that replayed and logged on), switches to the newest such run at its
branch point. A damaged segment (checksum, truncation) or a missing one ends the replay with a
warning naming it (segments whose run object is missing are named too); one whose checksums hold but
whose content is invalid raises ``StepLogFormatError`` naming it. A ``GradScaler`` takes each logged
scaler state in turn (steps it skipped for inf/nan are not logged: only its scale changed).
"""
from __future__ import annotations

import bisect
import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs import Pipeline
from ..errors import CheckpointNotFoundError, CheckrunError, FormatError, StorageError
from ..format.dtypes import DTYPES
from ..format.skeleton import unflatten
from ..storage.store import Store
from .capture import TENSOR_LIST, flat_params, forward_buffers
from .format import Marker, SegmentDamaged, SegName, StepLogError, StepLogFormatError, check_seg_name, run_name
from .format import split_segment
from . import rng
from .index import LogIndex
from .registry import active_log

log = logging.getLogger("ckpt_core")


@dataclass
class Position:
    """Where a replay ended: run, events and optimizer steps of the chain so far."""

    run: str
    event: int
    step: int
    replayed: int = 0
    stopped: bool = False
    counters: dict | None = None
    """The logged counters of the last state record applied (``step_log(counters=)``), if any."""
    buffers_set: bool = False
    """Whether the last replayed step set its logged forward-pass state (all of it) into the model."""
    buffers_left: int = 0
    """Replayed steps whose logged forward-pass state was not set (replay without ``model``)."""
    rng: Any = None
    """The logged RNG states that hold after the last event applied (``rng.RngState``), if any do."""
    rng_lost: str | None = None
    """Why the log's RNG states do not hold there (``_track_rng``)."""
    scale: float | None = None
    """The GradScaler scale of the last state record applied: a lower one next means a skipped step."""
    limit: Any = None  # ``limit(self)`` true before a step: the replay ends (``replay(max_steps=, until=)``)


def replay_chain(segs: Store, index: LogIndex, start: Marker, optimizer: Any, scheduler: Any,
                 max_bytes: int, scaler: Any = None, model: Any = None, limit: Any = None) -> Position:
    """Apply every logged event after ``start`` (and the logged forward-pass state to ``model``'s
    buffers, if given), up to a step before which ``limit(position)`` is true; returns where it ended."""
    if (looped := index.cycle(start.run, start.event)) is not None:  # before anything is applied
        raise StepLogFormatError(f"{segs.url(run_name(looped))}: its parent closes a cycle of step-log runs "
                                 "(each run continues an older one): a damaged or forged run object")
    _warn_superseded(segs, index, start)
    if (note := index.orphan_note(segs.url(""), {start.run})) is not None:
        _warn(note)
    pos = Position(start.run, start.event, start.step, limit=limit)
    buffers = None if model is None else {name: getattr(m, a) for name, m, a in forward_buffers(model)}
    slog = active_log(optimizer)
    if slog is not None:
        slog._paused = True  # replayed steps are not logged again
    try:
        while not pos.stopped:
            target = next(iter(index.children(pos.run, pos.event)), None)
            _apply_run(segs, index, pos, (optimizer, scheduler, scaler, buffers), max_bytes,
                       None if target is None else target.parent[1])
            if target is not None and not pos.stopped and pos.event < target.parent[1]:  # lost before the branch
                _stop(pos, segs.url(f"seg-{pos.run}-*.bin"), f"missing: events {pos.event + 1}..{target.parent[1]} "
                      f"of run {pos.run}, after which run {target.run} continues it")  # (h100: no warning)
            if target is None or pos.stopped or pos.event != target.parent[1]:
                break
            pos.run = target.run
    finally:
        if slog is not None:
            slog._paused = False
        for p in flat_params(optimizer):
            p.grad = None
    return pos


def _warn_superseded(segs: Store, index: LogIndex, start: Marker) -> None:
    """Warn of a run that resumed from an earlier point of ``start``'s run than ``start``'s checkpoint: its
    trainer was superseded by a restart (paused, then woken); the newer run's steps are not on this path."""
    newer = [r for r in index.runs.values() if r.parent is not None and r.parent[0] == start.run
             and r.parent[1] < start.event]
    if newer:  # a Python warning too, as every other end of a replay short of the newest step (h99)
        _warn(f"checkrun: checkpoint {start.checkpoint} was saved by step-log run {start.run} after the step where "
              f"run {newer[0].run} resumed from that run (a restart while its trainer was paused or still running, "
              "which committed the checkpoint late): the newer run's logged steps are not replayed after it (resume "
              "from the checkpoint that run resumed from to replay them)")


def _apply_run(segs: Store, index: LogIndex, pos: Position, targets: tuple, max_bytes: int,
               stop_at: int | None) -> None:
    optimizer, scheduler, scaler, buffers = targets
    prev = 0
    for seg in index.segments.get(pos.run, []):
        if seg.hi <= pos.event:
            prev = seg.seq
            continue
        if stop_at is not None and pos.event >= stop_at:
            return
        if seg.lo > pos.event:  # segments missing by number, or events never written (a failed encoding)
            gap = f"events {pos.event + 1}..{seg.lo} of run {pos.run}, before {seg.name}"
            if seg.seq > prev + 1:
                _stop(pos, segs.url(f"seg-{pos.run}-{prev + 1:08d}" + ("" if seg.seq == prev + 2 else
                                                                       f"..{seg.seq - 1:08d}")), f"missing: {gap}")
            else:
                _stop(pos, f"checkrun: step log {segs.url('')}: {gap}, were never written (logging them failed: "
                           f"the training saw a StepLogError); replay stopped after step {pos.step} (event "
                           f"{pos.event}): {pos.replayed} step(s) replayed after the checkpoint")
            return
        prev = seg.seq
        header, payload = _read_segment(segs, seg, pos, max_bytes)
        if header is None:
            return
        data = Payload(header, payload, max_bytes)
        states = header.get("rng")  # after its last step or flush point
        for i, ev in enumerate(header["events"]):
            event = seg.lo + i + 1
            if event <= pos.event:
                continue
            if stop_at is not None and event > stop_at:
                return
            if ev["kind"] == "step" and pos.limit is not None and pos.limit(pos):
                pos.stopped = True  # the state records after the last step were applied: its scheduler's too
                if pos.rng is None and pos.rng_lost is None and pos.replayed:
                    pos.rng_lost = f"step {pos.step} is inside a segment, the log holds them at segment ends"
                return
            try:
                nbuf = apply_event(ev, data, optimizer, scheduler, segs.url(seg.name), max_bytes, scaler, buffers)
            except GroupsChanged as exc:  # from here on the log holds another optimizer layout
                _stop(pos, f"checkrun: {exc}: the optimizer's parameter groups changed in the logged run (a callback "
                           "such as BackboneFinetuning adds one when it unfreezes); replay stopped after step "
                           f"{pos.step} (event {pos.event}): {pos.replayed} step(s) replayed after the checkpoint, "
                           "training goes on from there")
                return
            pos.event = event
            rng.track(pos, ev, event, states, segs.url(seg.name),
                      lambda r, n: _decode(r, payload, n, torch.uint8, f"{segs.url(seg.name)}: field 'rng'",
                                           max_bytes))
            if ev.get("counters") is not None:
                pos.counters = dict(ev["counters"])
            if ev["kind"] == "step":
                pos.step = ev["step"]
                pos.replayed += 1
                pos.buffers_set = bool(nbuf)
                pos.buffers_left += bool(ev.get("bufs")) and not nbuf
    if stop_at is None and (end := getattr(index.runs.get(pos.run), "end", None)) and pos.event < end[0]:
        _stop(pos, segs.url(f"seg-{pos.run}-{prev + 1:08d}" + ("" if end[1] <= prev + 1 else f"..{end[1]:08d}")),
              f"missing: events {pos.event + 1}..{end[0]} of run {pos.run}, which its object {run_name(pos.run)} "
              "says were logged before it was closed")


def read_segment(segs: Store, name: str, max_bytes: int) -> tuple[dict, memoryview]:
    """``split_segment`` of a segment's bytes, read once more when they fail a checksum or length
    (damaged in transit: a flipped byte on a store without response checksums, a short read),
    as blobs are; ``SegmentDamaged`` when the second read fails too (damaged at rest).
    ``StepLogFormatError`` when its header's run, number or events are not its name's (h112: verify took it)."""
    where = segs.url(name)
    try:
        header, payload = split_segment(segs.read_manifest(name, max_bytes, "step-log segment"), where)
    except SegmentDamaged as exc:
        header, payload = split_segment(segs.read_manifest(name, max_bytes, "step-log segment"), where)
        log.warning("checkrun: step log segment %s failed its check once (%s); read again, it matched", where, exc)
    check_seg_name(header, name, where)
    return header, payload


def _read_segment(segs: Store, seg: SegName, pos: Position, max_bytes: int) -> tuple[Any, Any]:
    where = segs.url(seg.name)
    try:
        header, payload = read_segment(segs, seg.name, max_bytes)
    except (SegmentDamaged, CheckpointNotFoundError) as exc:
        _stop(pos, where, str(exc))
        return None, None
    except (FormatError, StorageError):  # hostile, or an outage (through every retry): never an early stop
        raise
    except CheckrunError as exc:  # larger than max_bytes
        _stop(pos, where, str(exc))
        return None, None
    return header, payload


class GroupsChanged(StepLogError):
    """A logged event names more parameter groups or parameters than the optimizer has. The replay
    stops before it, with a warning: a callback added a group mid-run (``BackboneFinetuning``), and the
    resumed training adds it again where it did (it raised, and ``fit(ckpt_path="last")`` failed for
    good; found by an independent check)."""


def _stop(pos: Position, where: str, why: str = "") -> None:
    """End the replay here with a warning: a damaged or missing segment ``where`` (``why``), or the
    whole message as ``where``."""
    pos.stopped = True
    msg = where if not why else (
        f"checkrun: step log segment {where} is damaged or missing ({why}); replay stopped after "
        f"step {pos.step} (event {pos.event}) of the log's run, counted from its start: {pos.replayed} "
        "step(s) replayed after the checkpoint")
    _warn(msg)


def _warn(msg: str) -> None:
    """To the log and as a ``UserWarning`` (the caller of ``engine.replay``'s line)."""
    log.warning(msg)
    warnings.warn(msg, UserWarning, stacklevel=5)


class Payload:
    """A checked segment's payload (``split_segment``): the tensors its gradient entries name, each
    a range of its own or a span of one chunk of its dtype's pack (version 3). The last chunk decoded
    of each dtype is kept (a step's tensors share its chunk; the next step has its own), so memory
    stays at one chunk per dtype whatever a header's references say."""

    def __init__(self, header: dict, payload: memoryview, max_bytes: int) -> None:
        self.view, self.max_bytes = payload, max_bytes
        self.chunks: dict[str, list[dict]] = header.get("packs", {})
        self.buffers: list[str] = header.get("buffers", [])  # what step events' ``bufs`` index
        self._ends = {name: list(itertools.accumulate(c["numel"] for c in chunks))
                      for name, chunks in self.chunks.items()}
        self._decoded: dict[str, tuple[int, torch.Tensor]] = {}

    def tensor(self, ref: list | dict, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """The 1-D tensor of ``numel`` elements that ``ref`` names (checked by ``split_segment``)."""
        if numel * dtype.itemsize > self.max_bytes:
            raise StepLogFormatError(f"{what}: {numel} elements, more than load.max_blob_bytes or max_total_bytes "
                                     "allow")
        if not isinstance(ref, dict):
            return _decode(ref, self.view, numel, dtype, what, self.max_bytes)
        if not numel:
            return torch.empty(0, dtype=dtype)
        name, ends = ref["pack"], self._ends[ref["pack"]]
        j = bisect.bisect_right(ends, ref["at"])
        if self._decoded.get(name, (None,))[0] != j:
            self._decoded.pop(name, None)  # freed before the next one is decoded
            chunk = self.chunks[name][j]
            self._decoded[name] = (j, _decode(chunk["data"], self.view, chunk["numel"], dtype,
                                              f"{what}: chunk {j} of pack {name}", self.max_bytes))
        start = ref["at"] - (ends[j - 1] if j else 0)
        return self._decoded[name][1][start:start + numel]


def apply_event(ev: dict, payload: Payload, optimizer: Any, scheduler: Any, where: str,
                max_bytes: int, scaler: Any = None, buffers: dict | None = None) -> int:
    """Apply one checked event of a segment (``split_segment``'s header and payload, as ``Payload``): a ``state``
    event sets the groups' hyperparameters and the scheduler's state, a ``step`` event sets every
    parameter's ``.grad`` to the logged gradient and calls ``optimizer.step()``, then copies its logged
    forward-pass state into ``buffers`` (name -> tensor, if given). Returns how many buffers it set.
    Training thread."""
    if ev["kind"] == "state":
        _apply_state(ev, optimizer, scheduler, where)
        if scaler is not None and ev.get("scaler") is not None:
            _apply_scaler(ev["scaler"], scaler, where)
        return 0
    what = f"{where}: step {ev['step']}"
    params = flat_params(optimizer)
    grads: dict[int, torch.Tensor] = {}
    for g in ev["grads"]:
        if g["p"] >= len(params):
            raise GroupsChanged(f"{what}: gradient of parameter {g['p']}, the optimizer has {len(params)}")
        if g["k"] != "none":
            grads[g["p"]] = _grad(g, params[g["p"]], payload, f"{what}, parameter {g['p']}", max_bytes)
    # every buffer is checked and decoded before the step: a mismatch changes nothing
    stats = [] if buffers is None else [_buffer(b, buffers, payload, what) for b in ev.get("bufs", ())]
    for i, p in enumerate(params):
        p.grad = grads.get(i)
    try:
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 - a logged step the optimizer refuses: say which one
        raise StepLogError(f"{what}: {type(optimizer).__name__}.step() failed on the logged gradients and "
                           f"hyperparameters: {type(exc).__name__}: {exc}") from exc
    with torch.no_grad():
        for target, value in stats:
            target.copy_(value)
    return len(stats)


def _buffer(b: dict, buffers: dict, payload: Payload, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's buffer, its logged value) of one ``bufs`` entry, checked against each other."""
    name = payload.buffers[b["p"]]
    target, shape, dtype = buffers.get(name), tuple(b["shape"]), DTYPES[b["dtype"]]
    if target is None or tuple(target.shape) != shape or target.dtype != dtype:
        raise StepLogError(f"{what}: logged running statistics {name!r} ({b['dtype']} {list(shape)}), the model "
                           + ("has no such buffer" if target is None else
                              f"holds {str(target.dtype).removeprefix('torch.')} {list(target.shape)} there"))
    return target, payload.tensor(b["data"], _numel(shape), dtype, f"{what}, buffer {name}").view(shape)


def _apply_state(ev: dict, optimizer: Any, scheduler: Any, where: str) -> None:
    """Set the logged hyperparameters of each group and the scheduler's logged state."""
    if len(ev["groups"]) != len(optimizer.param_groups):
        raise GroupsChanged(f"{where}: logged for {len(ev['groups'])} parameter groups, the optimizer has "
                            f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, ev["groups"]):
        for k, v in values.items():
            if k not in group:
                continue
            if k == "params" or not _same_kind(group[k], v):  # (never logged: a forged segment's, h128)
                raise StepLogFormatError(f"{where}: logged hyperparameter {k!r} is {str(v)[:40]}, the optimizer "
                                         f"holds a {type(group[k]).__name__} there")
            if isinstance(group[k], torch.Tensor):  # a tensor lr: the same tensor, its logged value
                with torch.no_grad():
                    group[k].fill_(v)
            else:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    if scheduler is not None and ev["sched"] is not None:
        full = scheduler.state_dict()
        for k, skeleton in ev["sched"].items():
            try:
                value = _tensor_list(skeleton) if isinstance(skeleton, dict) and TENSOR_LIST in skeleton \
                    else unflatten(skeleton, (), ())
            except FormatError as exc:
                raise StepLogFormatError(f"{where}: scheduler state {k!r}: {exc}") from None
            # load_state_dict sets every key as an attribute: none of its methods or its optimizer
            if not _sched_key(scheduler, k) or (k in full and not _sched_kind(full[k], value)):
                raise StepLogFormatError(f"{where}: logged scheduler state {k!r} is {str(value)[:40]}, which "
                                         f"{type(scheduler).__name__}'s state does not hold there")
            full[k] = value
        try:
            scheduler.load_state_dict(full)
        except Exception as exc:  # noqa: BLE001 - a log of another scheduler: say which segment
            raise StepLogError(f"{where}: the logged scheduler state does not fit {type(scheduler).__name__}: "
                               f"{exc}") from exc


def _tensor_list(skeleton: dict) -> list[torch.Tensor]:
    """A scheduler value logged as one-element tensors' values (``capture.sched_skeleton``)."""
    values, dtype = skeleton.get(TENSOR_LIST), DTYPES.get(skeleton.get("dtype"))
    if (set(skeleton) != {TENSOR_LIST, "dtype"} or dtype is None or not isinstance(values, list)
            or not 0 < len(values) <= 1024
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)):
        raise FormatError(f"invalid list of tensor values {str(skeleton)[:80]}")
    return [torch.tensor(x, dtype=dtype) for x in values]


def _same_kind(held: Any, logged: Any) -> bool:
    """Whether a logged hyperparameter can replace the group's: numbers for numbers (an int lr may
    become a float), a flag for a flag (bool or None: ``foreach=None`` means the default), lists of
    those for tuples or lists as long."""
    if isinstance(held, (list, tuple)):
        return isinstance(logged, list) and len(logged) == len(held) and all(map(_same_kind, held, logged))
    if held is None:  # may become a number (a user's clip=None set later in training, h129) or a flag
        return logged is None or isinstance(logged, (bool, int, float))
    if isinstance(held, bool):
        return logged is None or isinstance(logged, bool)
    if isinstance(held, (int, float)) or (isinstance(held, torch.Tensor) and held.numel() == 1):
        return isinstance(logged, (int, float)) and not isinstance(logged, bool)
    return False  # anything else: not among what the log records (group_scalars), so never logged (h128)


def _sched_key(scheduler: Any, key: Any) -> bool:
    """Whether ``load_state_dict`` may set ``key`` as an attribute: any name of the scheduler's state
    (one a scheduler sets only later too), not its optimizer, a dunder or what its class defines as
    a method or property."""
    return (isinstance(key, str) and key.isidentifier() and key != "optimizer" and not key.startswith("__")
            and not isinstance(getattr(type(scheduler), key, None), (property, type(_sched_key), classmethod,
                                                                     staticmethod)))


def _sched_kind(held: Any, logged: Any) -> bool:
    """Whether a logged scheduler value may replace the scheduler's: a number or None for a number,
    a list or None for a list (their contents are the scheduler's own to check)."""
    if logged is None:
        return True
    if isinstance(held, (int, float)) and not isinstance(held, bool):
        return isinstance(logged, (int, float)) and not isinstance(logged, bool)
    if isinstance(held, (list, tuple)):
        return isinstance(logged, (list, tuple))
    return True


def _apply_scaler(state: dict, scaler: Any, where: str) -> None:
    if not scaler.is_enabled():  # a disabled scaler has no state (state_dict() is empty)
        return
    try:
        scaler.load_state_dict(dict(state))
    except Exception as exc:  # noqa: BLE001 - not a torch GradScaler: say which segment
        raise StepLogError(f"{where}: the logged GradScaler state does not load into "
                           f"{type(scaler).__name__}: {exc}") from exc


def _grad(g: dict, p: torch.Tensor, payload: Payload, what: str, max_bytes: int) -> torch.Tensor:
    dtype, shape = DTYPES[g["dtype"]], tuple(g["shape"])
    if shape != tuple(p.shape):
        raise StepLogError(f"{what}: logged shape {list(shape)}, the parameter has {list(p.shape)}")
    if g["k"] == "dense":  # a copy: a span of a pack must not alias the gradient optimizer.step() gets
        return payload.tensor(g["data"], _numel(shape), dtype, what).view(shape).to(p.device, copy=True)
    n, cols = g["n"], _numel(shape[1:])
    idx = payload.tensor(g["idx"], n, torch.int64, what)
    rows = unfold(g, payload, n, cols, dtype, what).view(n, *shape[1:])
    if n and (int(idx.min()) < 0 or int(idx.max()) >= shape[0]):
        raise StepLogFormatError(f"{what}: row index outside [0, {shape[0]})")
    if g["k"] == "sparse":
        if g["coalesced"] and n > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise StepLogFormatError(f"{what}: a coalesced sparse gradient with unsorted or repeated rows")
        return torch.sparse_coo_tensor(idx.view(1, -1).clone(), rows.clone(), shape, is_coalesced=g["coalesced"],
                                       check_invariants=True).to(p.device)
    out = torch.zeros(shape, dtype=dtype)
    out.index_copy_(0, idx, rows)
    return out.to(p.device)


def unfold(g: dict, payload: Payload, n: int, cols: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A rows/sparse entry's ``n * cols`` values; a folded one's ``u`` stored rows repeated by their
    run lengths (each >= 1, summing to ``n``: checked before anything of size ``n`` is allocated)."""
    if "runs" not in g:
        return payload.tensor(g["data"], n * cols, dtype, what)
    if n * cols * dtype.itemsize > payload.max_bytes:
        raise StepLogFormatError(f"{what}: {n * cols} elements, more than load.max_blob_bytes or max_total_bytes allow")
    runs = payload.tensor(g["runs"], g["u"], torch.int32, what).to(torch.int64)
    if g["u"] and (int(runs.min()) < 1 or int(runs.sum()) != n):
        raise StepLogFormatError(f"{what}: run lengths of a folded gradient must be >= 1 and sum to {n} rows")
    rows = payload.tensor(g["data"], g["u"] * cols, dtype, what).view(g["u"], cols)
    return rows.repeat_interleave(runs, dim=0, output_size=n).view(-1)


def _decode(r: list, payload: memoryview, numel: int, dtype: torch.dtype, what: str, max_bytes: int) -> torch.Tensor:
    off, size, codecs = r
    if numel * torch.empty((), dtype=dtype).element_size() > max_bytes:
        raise StepLogFormatError(f"{what}: {numel} elements, more than load.max_blob_bytes or max_total_bytes allow")
    try:
        pipeline = Pipeline.from_list(codecs)
        if pipeline.lossy:
            raise FormatError(f"lossy codec {pipeline.array.name!r} in a step log")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return pipeline.decode(payload[off:off + size], (1, numel), dtype, max_bytes).view(-1)
    except FormatError as exc:
        raise StepLogFormatError(f"{what}: {exc}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
