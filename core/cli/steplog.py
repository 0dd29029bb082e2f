"""The step log (issue 23, docs/steplog.md) in the command line: ``ls`` (logged steps after each
checkpoint), ``inspect SEGMENT`` (a segment's header), ``verify DIR`` (every segment's checksums).

Segments are hostile input: they are parsed by ``ckpt_core.steplog.format`` only (``read_header``
reads a segment's header without its payload: two ranged reads, then ``format.parse_header``).
``inspect`` of segments: ``steplog_inspect``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .util import Context, human_size, one_line, safe
from ..errors import CheckpointNotFoundError, CheckrunError, CorruptCheckpointError, FormatError
from ..format.composite import PARTS_DIR, join
from ..format.dtypes import DTYPES
from ..steplog.format import (
    PREFIX_BYTES, Marker, SegmentDamaged, SegName, StepLogFormatError, check_seg_name, decode_limit, header_end,
    parse_header, parse_seg_name)
from ..steplog.index import LogIndex, find_marker, read_index
from ..storage.retry import is_outage
from ..steplog.registry import log_store
from ..storage.paths import STEPLOG_DIR
from ..steplog.replay import Payload, read_segment, unfold
from ..storage.store import Store

def is_segment_path(path: str) -> bool:
    """True for the path of a step-log segment object (``.../seg-<run>-<seq>-<lo>-<hi>.bin``)."""
    return parse_seg_name(os.fspath(path).replace("\\", "/").rstrip("/").rpartition("/")[2]) is not None


def is_log_dir(path: str) -> bool:
    """True for a step log's own folder (``DIR/.checkrun/steplog``)."""
    path = "/" + os.fspath(path).replace("\\", "/").rstrip("/")
    return path.endswith("/" + STEPLOG_DIR)


def segments_store(ctx: Context, directory: str) -> Store:
    """The store of ``<directory>/.checkrun/steplog``."""
    return log_store(Store.for_directory(directory, ctx.storage_options, ctx.engine.config.storage))


def shown_url(directory: str) -> str:
    """The step log's folder as the user spelt the directory (engine URLs of local files are absolute)."""
    return f"{os.fspath(directory).rstrip('/')}/{STEPLOG_DIR}"


def log_directory(ctx: Context, directory: str) -> str:
    """Where the step log of ``directory``'s checkpoints is: the directory itself, or the parts directory of
    Accelerate checkpoint folders (``.checkrun/parts``: h125, ``ls``/``verify DIR`` did not look there)."""
    parts = join(directory, PARTS_DIR)
    if has_log(segments_store(ctx, directory)) or not has_log(segments_store(ctx, parts)):
        return directory
    return parts


def has_log(segs: Store) -> bool:
    try:
        return segs.is_directory()
    except CheckrunError:
        return False


# ----------------------------------------------------------------------------- headers


def read_header(segs: Store, name: str) -> dict:
    """The checked header of segment ``name`` (two ranged reads, no payload). A header found damaged is read
    once more, as ``verify`` reads a segment: damage in transit (a corrupted GET, a HEAD that lied about the
    size the reads are cut to) is not damage at rest (before 2026-12-07 one such answer made ``ls`` say an
    intact log ended early: found by an independent check)."""
    try:
        return _header(segs, name)
    except (SegmentDamaged, CorruptCheckpointError):
        return _header(segs, name)


def _header(segs: Store, name: str) -> dict:
    where = segs.url(name)
    end = header_end(segs.read_head(name, PREFIX_BYTES))
    head = segs.read_head(name, end) if end else b""
    header = parse_header(head, where, 1 << 62)  # payload ranges are checked when it is read
    check_seg_name(header, name, where)
    return header


# ----------------------------------------------------------------------------- chains


@dataclass
class Chain:
    """What a replay from one marker would read: segments with the events used from each."""

    marker: Marker
    pieces: list[tuple[SegName, int, int]] = field(default_factory=list)  # (segment, first event, last event)
    gap: str | None = None  # a missing segment ends the chain


def chain_of(index: LogIndex, marker: Marker) -> Chain:
    """The segments a replay from ``marker`` reads, in order (as ``steplog.replay.replay_chain``
    walks them: the run's segments after the marker, then the newest run continuing it)."""
    out, run, event = Chain(marker), marker.run, marker.event
    if (looped := index.cycle(run, event)) is not None:
        out.gap = f"the parent of run {looped} closes a cycle of runs (a damaged or forged run object)"
        return out
    while True:
        target = next(iter(index.children(run, event)), None)
        stop_at = None if target is None else target.parent[1]
        for seg in index.segments.get(run, []):
            if seg.hi <= event or (stop_at is not None and event >= stop_at):
                continue
            if seg.lo > event:
                out.gap = f"events {event + 1}..{seg.lo} of run {run} (before {seg.name}) are missing"
                return out
            last = seg.hi if stop_at is None else min(seg.hi, stop_at)
            out.pieces.append((seg, event + 1, last))
            event = last
        end = getattr(index.runs.get(run), "end", None)  # a closed run's object says where it ended
        if target is None and end is not None and event < end[0]:
            out.gap = (f"events {event + 1}..{end[0]} of run {run} are missing (its object says they were logged "
                       "before it was closed)")
        if target is not None and out.gap is None and event < target.parent[1]:
            out.gap = (f"events {event + 1}..{target.parent[1]} of run {run} are missing (run {target.run} "
                       "continues after them)")
        if target is None or event != target.parent[1]:
            return out
        run = target.run


def chain_steps(segs: Store, chain: Chain, cache: dict) -> tuple[int, int, str | None]:
    """(steps logged after the marker, the last such step, why the log ends early or None); reads
    the headers of the chain's segments (``cache``: name -> header or the error)."""
    count, last, problem = 0, chain.marker.step, chain.gap
    for seg, first, end in chain.pieces:
        if seg.name not in cache:
            try:
                cache[seg.name] = read_header(segs, seg.name)
            except (SegmentDamaged, CheckrunError) as exc:
                if is_outage(exc):  # the storage failed: not where the log ends (the command fails)
                    raise
                cache[seg.name] = exc
        header = cache[seg.name]
        if isinstance(header, BaseException):
            text = one_line(header)  # damage messages name the segment already
            return count, last, text if segs.url(seg.name) in text else f"{segs.url(seg.name)}: {text}"
        for ev in header["events"][first - seg.lo - 1:end - seg.lo]:
            if ev["kind"] == "step":
                count, last = count + 1, ev["step"]
    return count, last, problem


def logged_after(ctx: Context, directory: str, rows: list[dict]) -> dict | None:
    """``ls``: per committed row, the steps logged after its checkpoint (``logged_steps_after``,
    ``logged_through_step``, ``step_log_problem``); a summary of the log, or None without one."""
    segs = segments_store(ctx, directory)
    if not has_log(segs):
        return None
    try:
        index = read_index(segs)
    except CheckrunError as exc:  # a malformed run or marker object: the listing stands without the log
        return {"url": shown_url(directory), "error": one_line(exc)}
    entries = {e.name: e for e in ctx.engine.list(directory, storage_options=ctx.storage_options)}
    cache: dict = {}
    for r in rows:
        e = entries.get(r["name"])
        marker = None if e is None or e.manifest is None else find_marker(index, e.name, e.manifest.commit)
        if marker is None:
            r.update(logged_steps_after=None, logged_through_step=None)
            continue
        count, last, problem = chain_steps(segs, chain_of(index, marker), cache)
        r.update(logged_steps_after=count, logged_through_step=last, logged_from_step=marker.step)
        if problem:
            r["step_log_problem"] = problem
    out = {"url": shown_url(directory), "segments": sum(len(s) for s in index.segments.values()),
           "markers": len(index.markers), "runs": len(index.runs)}
    if index.damaged:
        out["damaged"] = index.damage_note()
    return out


def logged_text(r: dict) -> str | None:
    """The ``ls`` line under a checkpoint that has a marker."""
    if r.get("logged_steps_after") is None:
        return None
    text = f"  +{r['logged_steps_after']} logged steps (through step {r['logged_through_step']})"
    if r.get("step_log_problem"):
        text += f"; the log ends early: {r['step_log_problem']}"
    return text


# ----------------------------------------------------------------------------- verify


def _decode_all(header: dict, payload: memoryview, where: str, max_bytes: int) -> None:
    """Decode every gradient (the format has no per-gradient checksum: decoding is the check)."""
    data = Payload(header, payload, max_bytes)
    for ev in header["events"]:
        for g in [*ev.get("grads", ()), *ev.get("bufs", ())] if ev["kind"] == "step" else ():
            if g["k"] == "none":
                continue
            numel = 1
            for d in g["shape"]:
                numel *= d
            try:
                if g["k"] == "dense":
                    data.tensor(g["data"], numel, DTYPES[g["dtype"]], where)
                else:
                    data.tensor(g["idx"], g["n"], torch.int64, where)
                    unfold(g, data, g["n"], numel // max(1, g["shape"][0]), DTYPES[g["dtype"]], where)
            except (FormatError, ValueError, RuntimeError) as exc:
                raise StepLogFormatError(f"{where}: step {ev['step']}, param {g['p']}: {one_line(exc)}") from None


def _start_step(index: LogIndex, seg: SegName, good: dict) -> int:
    """The step a replay through ``seg`` has reached when it gets there: the last step of the run's
    earlier segments, else the run's first step."""
    last = index.runs[seg.run].start_step if seg.run in index.runs else 0
    # Steps only grow along a run: a marker at or before the segment bounds it from below too (the
    # segments before a checkpoint's marker may have been truncated away).
    last = max([last] + [m.step for m in index.markers if m.run == seg.run and m.event <= seg.lo])
    for s in index.segments.get(seg.run, []):
        if s.seq >= seg.seq:
            break
        steps = [ev["step"] for ev in good.get(s.name, {}).get("events", []) if ev["kind"] == "step"]
        last = max(steps[-1], last) if steps else last
    return last


def _readers(ctx: Context, directory: str, index: LogIndex) -> tuple[dict[str, list[str]], dict[str, tuple]]:
    """Per segment, the committed checkpoints whose replay reads it; per gap in a replay's chain
    (segments missing between two that are there), ``(chain, the checkpoints whose replay stops there)``."""
    out: dict[str, list[str]] = {}
    gaps: dict[str, tuple] = {}
    for e in ctx.engine.list(directory, storage_options=ctx.storage_options):
        marker = None if e.manifest is None else find_marker(index, e.name, e.manifest.commit)
        chain = chain_of(index, marker) if marker is not None else None
        for seg, _, _ in chain.pieces if chain is not None else ():
            out.setdefault(seg.name, []).append(e.name)
        if chain is not None and chain.gap:
            gaps.setdefault(chain.gap, (chain, []))[1].append(e.name)
    return out, gaps


def verify_log(ctx: Context, directory: str, decode: bool) -> dict | None:
    """``verify DIR``: every run, marker and segment of the directory's step log; None without one."""
    segs = segments_store(ctx, directory)
    if not has_log(segs):
        return None
    result = {"url": shown_url(directory), "ok": True, "segments": 0, "bytes_checked": 0, "problems": [], "ends_early": []}
    try:
        index = read_index(segs)
    except CheckrunError as exc:
        result.update(ok=False, problems=[one_line(exc)])
        return result
    result["problems"] += [f"{one_line(m.checkpoint)} (a damaged marker: the checkpoint it marks cannot be resumed "
                           "through the log; gc keeps it, and the steps after it)" for m in index.damaged.values()]
    good: dict[str, dict] = {}
    readers, gaps = _readers(ctx, directory, index)
    max_bytes = decode_limit(ctx.engine.config.load)
    for run, run_segs in index.segments.items():
        for seg in run_segs:
            where = segs.url(seg.name)
            try:
                header, payload = read_segment(segs, seg.name, max_bytes)
                if decode:
                    _decode_all(header, payload, where, max_bytes)
                good[seg.name] = header
                result["segments"] += 1
                result["bytes_checked"] += len(payload)
            except CheckpointNotFoundError:
                continue  # removed since the listing (gc): gone, not damaged
            except SegmentDamaged as exc:
                step, needed_by = _start_step(index, seg, good), readers.get(seg.name, [])
                result["ends_early"].append({"segment": where, "stops_at_step": step, "error": one_line(exc),
                                             "needed_by": needed_by})
                whose = (f"replay from {', '.join(needed_by)}" if needed_by
                         else "no committed checkpoint's replay reads it; a replay")
                result["problems"].append(f"{one_line(exc)}: the log ends early here: {whose} stops at step {step}")
            except CheckrunError as exc:
                if is_outage(exc):  # not damage: the segment could not be read (reliability.md)
                    result["unreadable"] = True
                    result["problems"].append(f"{one_line(exc)} (the storage failed, not a damaged segment: "
                                              "verify again when it answers)")
                    continue
                result["problems"].append(f"{one_line(exc)} (hostile or invalid segment: replay raises)")
    for gap, (chain, needed_by) in gaps.items():  # a segment missing between two that are there
        step = chain_steps(segs, chain, dict(good))[1]
        result["ends_early"].append({"segment": None, "stops_at_step": step, "error": gap, "needed_by": needed_by})
        result["problems"].append(f"{segs.url('')}: {gap}: the log ends early here: replay from "
                                  f"{', '.join(needed_by)} stops at step {step}")
    if (note := index.orphan_note(segs.url(""))) is not None:
        result["problems"].append(note.removeprefix("checkrun: "))
    result["markers"], result["runs"] = len(index.markers), len(index.runs)
    result["ok"] = not result["problems"]
    return result


def print_log_report(rep: dict) -> None:
    """Text lines of ``verify_log``'s result."""
    what = f"{rep.get('segments', 0)} segments, {rep.get('markers', 0)} markers, {rep.get('runs', 0)} runs"
    if rep["ok"]:
        print(f"OK       {safe(rep['url'])}  (step log: {what}, {human_size(rep['bytes_checked'])})")
        return
    print(f"{'UNREADABLE' if rep.get('unreadable') else 'DAMAGED':8} {safe(rep['url'])}  (step log: {what} intact)")
    for p in rep["problems"]:
        print(f"  - {safe(p)}")


__all__ = ["STEPLOG_DIR", "chain_of", "chain_steps", "is_log_dir", "is_segment_path", "log_directory",
           "logged_after", "logged_text", "read_header", "segments_store", "verify_log"]
