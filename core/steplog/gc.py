"""Truncating the step log: delete the segments and markers no retained checkpoint's replay needs.

A replay from checkpoint C starts at C's marker (run R, event p) and reads R's segments after p, then
the runs that continue R. So, per run, everything up to the *floor* is garbage: the lowest event of a
live marker in the run (a retained checkpoint's, or one newer than every retained one of the run:
its save may still be in flight), or the run's start if a live marker of an ancestor run precedes
the branch point. A run with neither has no segment any replay can reach.

No lease is needed for segments being written: a writer writes its run object before its segments
and a marker before the segments after it, and ``read_index`` lists segments before markers and runs,
so a segment this collection sees has every marker and run object that can make it needed seen too.
A malformed marker or run object stops the collection (``StepLogFormatError``), deleting nothing.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

from ..storage.store import Store
from .format import Marker
from .index import LogIndex, read_index
from .log import log_store

log = logging.getLogger("ckpt_core")


def collect_segments(store: Store, checkpoints: Callable[[], Iterable[Any]], dry_run: bool = False) -> list[str]:
    """Delete the step-log objects of ``store`` that no replay from ``checkpoints()`` (the directory's
    ``CheckpointEntry`` list after retention, listed after the log) needs; returns their names. Background or training thread."""
    segs = log_store(store)
    if not segs.is_directory():
        return []
    index = read_index(segs)
    live = _live_markers(index, list(checkpoints()))
    victims = [s.name for run, segments in index.segments.items()
               for s in segments if s.hi <= _floor(index, run, live)]
    victims += [m.name for m in index.markers if m.name not in live]
    if not dry_run:
        for name in victims:
            segs.delete_manifest(name)
        if victims:
            log.info("checkrun: step log of %s: removed %d objects no retained checkpoint needs",
                     store.url(""), len(victims))
    return victims


def _live_markers(index: LogIndex, checkpoints: list[Any]) -> dict[str, Marker]:
    stamps = {(e.name, _key(e.manifest.commit)) for e in checkpoints if e.manifest is not None}
    unreadable = {e.name for e in checkpoints if e.manifest is None}  # it may be a marked one: keep
    retained = [m for m in index.markers
                if (m.checkpoint, _key(m.commit)) in stamps or m.checkpoint in unreadable
                or (m.commit is None and any(n == m.checkpoint for n, _ in stamps))]
    newest: dict[str, int] = {}
    for m in retained:
        newest[m.run] = max(newest.get(m.run, -1), m.event)
    return {m.name: m for m in index.markers if m in retained or m.event > newest.get(m.run, -1)}


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
