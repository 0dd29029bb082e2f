"""Truncating the step log: delete the segments, markers and run objects no retained checkpoint's
replay and no open log needs.

A replay from checkpoint C starts at C's marker (run R, event p) and reads R's segments after p, then
the runs that continue R. So, per run, everything up to the *floor* is garbage: the lowest event of a
live marker in the run, or the run's start if a live marker of an ancestor run precedes the branch
point. A run with neither has no segment any replay can reach.

Live markers: a retained checkpoint's, and, for a run that may still be logging, every one at or after
the event of its newest retained one (that save may still be in flight: ``save_last=True`` saves twice
at one step, and the first may commit, and collect, while the second is in flight). A run is *finished* once its run object
says ``closed`` (``StepLog.close`` writes it after the saves into the directory ended) or its process
is certainly gone (``meta.owner_gone``: same host only); a finished run has no save in flight, so its
markers of checkpoints no longer listed are garbage. A finished run's object goes too once no segment
or marker of it is left and no replay can enter it. An open log holds its run: its object says neither
(run objects of checkrun before format version 2 record no owner and are never collected).

No lease is needed for segments being written: a writer writes its run object before its segments
and a marker before the segments after it, and ``read_index`` lists segments before markers and runs,
so a segment this collection sees has every marker and run object that can make it needed seen too.
A malformed run object stops the collection (``StepLogFormatError``), deleting nothing. A malformed
marker is kept with the steps after it, as a retained checkpoint's (which checkpoint it marks is
unknown), with a warning naming it.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

from ..storage.store import Store
from .format import Marker, run_name
from .index import LogIndex, read_index
from .registry import log_store
from .meta import owner_gone

log = logging.getLogger("ckpt_core")


def collect_segments(store: Store, checkpoints: Callable[[], Iterable[Any]], dry_run: bool = False) -> list[str]:
    """Delete the step-log objects of ``store`` that no replay from ``checkpoints()`` (the directory's
    ``CheckpointEntry`` list after retention, listed after the log) and no open log needs; returns their
    names (segments, markers, run objects). Background or training thread."""
    segs = log_store(store)
    if not segs.is_directory():
        return []
    index = read_index(segs)
    finished = {run for run, info in index.runs.items() if info.closed or owner_gone(info.owner)}
    live = _live_markers(index, list(checkpoints()), finished)
    # which checkpoint a damaged marker marks is unknown (a read damaged in transit, too): it is kept, and
    # the steps after it (its name holds its run and event; h112: they were deleted)
    live.update(index.damaged)
    floors = {run: _floor(index, run, live) for run in set(index.segments) | set(index.runs)}
    lost = index.orphans()  # not provably garbage: kept (and named)
    if lost:
        log.warning(index.orphan_note(segs.url("")))
    victims = [s.name for run, segments in index.segments.items() if run not in lost
               for s in segments if s.hi <= floors[run]]
    victims += [m.name for m in index.markers if m.name not in live]
    if index.damaged:
        log.warning("checkrun: step log of %s: %s (kept, with the steps after them)", store.url(""),
                    index.damage_note())
    left = {s.run for run, segments in index.segments.items() for s in segments if s.hi > floors[run]}
    left |= {m.run for m in live.values()}
    victims += [run_name(run) for run in sorted(finished) if run not in left and floors[run] == math.inf]
    if not dry_run:
        for name in victims:
            segs.delete_manifest(name)
        if victims:
            log.info("checkrun: step log of %s: removed %d objects no retained checkpoint needs",
                     store.url(""), len(victims))
    return victims


def _live_markers(index: LogIndex, checkpoints: list[Any], finished: set[str]) -> dict[str, Marker]:
    stamps = {(e.name, _key(e.commit)) for e in checkpoints if e.error is None}  # parsed, or by its head
    unreadable = {e.name for e in checkpoints if e.error is not None}  # it may be a marked one: keep
    retained = [m for m in index.markers
                if (m.checkpoint, _key(m.commit)) in stamps or m.checkpoint in unreadable
                or (m.commit is None and any(n == m.checkpoint for n, _ in stamps))]
    newest: dict[str, int] = {}
    for m in retained:
        newest[m.run] = max(newest.get(m.run, -1), m.event)
    return {m.name: m for m in index.markers
            if m in retained or (m.run not in finished and m.event >= newest.get(m.run, -1))}


def _key(commit: dict | None) -> tuple | None:
    return None if commit is None else tuple(sorted(commit.items()))


def _floor(index: LogIndex, run: str, live: dict[str, Marker]) -> float:
    """Events of ``run`` up to this one are needed by no replay."""
    floor = min((m.event for m in live.values() if m.run == run), default=math.inf)
    info, seen = index.runs.get(run), {run}
    while info is not None and info.parent is not None and info.parent[0] not in seen:
        parent, branch = info.parent
        if any(m.run == parent and m.event <= branch for m in live.values()):
            start = index.runs[run].start
            return min(floor, start)
        seen.add(parent)
        info = index.runs.get(parent)
    return floor
