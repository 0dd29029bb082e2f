"""What a directory's step log holds: its runs, segments (by name) and markers, read and validated.

Listing order matters to garbage collection (``gc``): segments are listed first, then markers, then
runs. An encoder writes a run object before its segments and a marker before the segments after it,
so every segment listed has its run object and the markers before it listed too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage.store import Store
from .format import (MARK_RE, MAX_RUN_BYTES, MAX_SMALL_BYTES, RUN_RE, Marker, RunInfo, SegName, StepLogError,
                     StepLogFormatError, parse_marker, parse_run, parse_seg_name)


def dir_key(store: Store) -> str:
    """A checkpoint directory's identity: a local one by its real path (a log opened through a symlink
    and a save through the real path are one directory: found by an independent fault program), others
    by URL."""
    return os.path.realpath(store.root) if store.is_local else store.url("")


@dataclass
class LogIndex:
    segments: dict[str, list[SegName]] = field(default_factory=dict)
    """Per run, its segments by sequence number."""
    markers: list[Marker] = field(default_factory=list)
    runs: dict[str, RunInfo] = field(default_factory=dict)
    damaged: dict[str, Marker] = field(default_factory=dict)
    """Markers that do not parse (read twice), by name: what their names tell (run, event), ``checkpoint``
    the error. Which checkpoint one marks is unknown: a replay that finds its own marker goes on (warned),
    one that does not raises the error; gc keeps each, and the steps after it, as a retained checkpoint's."""

    def damage_note(self) -> str | None:
        """A line naming the damaged markers, or None."""
        if not self.damaged:
            return None
        return (f"{len(self.damaged)} step-log marker(s) do not parse and are ignored: "
                + "; ".join(m.checkpoint for m in list(self.damaged.values())[:3]))

    def children(self, run: str, after: int) -> list[RunInfo]:
        """Runs that continue ``run`` from an event at or after ``after``, newest first."""
        out = [r for r in self.runs.values() if r.parent is not None and r.parent[0] == run and r.parent[1] >= after]
        return sorted(out, key=lambda r: r.created, reverse=True)

    def orphans(self) -> dict[str, list[SegName]]:
        """Per run, segments whose run object is missing: deleted or lost (a writer writes it before its
        segments, and gc deletes it after them), so no replay can place them on a chain."""
        return {run: segs for run, segs in self.segments.items() if run not in self.runs}

    def orphan_note(self, url: str, marked: Iterable[str] | None = None) -> str | None:
        """A warning naming the orphaned runs of the step log at ``url`` (``orphans``), or None. A run
        that a checkpoint's marker names (``marked``, default: every marker's) is replayed from that
        checkpoint even without its object (h112: the warning said its steps were not replayed)."""
        lost = self.orphans()
        if not lost:
            return None
        marked = {m.run for m in self.markers} if marked is None else set(marked)
        notes = []
        for run in sorted(set(lost) & marked):
            segs = lost.pop(run)
            notes.append(f"checkrun: step log {url}: run {run}, which a checkpoint's marker names, has no run object "
                         f"(deleted or lost): the steps of its {len(segs)} segment(s) (events {segs[0].lo}-"
                         f"{segs[-1].hi}) after that checkpoint are replayed, but a lost last segment, or a run that "
                         "continued it, cannot be seen")
        if lost:
            runs = "; ".join(f"run {run}: {len(segs)} segment(s), events {segs[0].lo}-{segs[-1].hi}"
                             for run, segs in sorted(lost.items()))
            notes.append(f"checkrun: step log {url}: segments without their run object (deleted or lost), which no "
                         f"replay can place on a chain: {runs}; their steps are not replayed, so a replay may end "
                         "before the newest logged step, and gc keeps them")
        return "; ".join(notes)

    def cycle(self, run: str, event: int) -> str | None:
        """The run whose parent closes a cycle on the chain continuing ``run`` after ``event`` (each
        run continues an older one; a cycle is a damaged or forged run object), or None."""
        seen = {run}
        while (target := next(iter(self.children(run, event)), None)) is not None:
            if target.run in seen:
                return target.run
            seen.add(target.run)
            run, event = target.run, target.parent[1]
        return None


def find_marker(index: LogIndex, name: str, commit: dict | None, strict: bool = False) -> Marker | None:
    """The marker of checkpoint ``name`` whose commit stamp is ``commit`` (the manifest's); for a
    manifest without a stamp, the newest marker of that name. ``strict`` (a replay): StepLogError
    when one save is marked by several runs (logs of two optimizers in one directory)."""
    same = [m for m in index.markers if m.checkpoint == name]
    if commit is not None:
        same = [m for m in same if m.commit == commit]
        if strict and len({m.run for m in same}) > 1:  # one save, two logs open in the directory (two optimizers)
            raise StepLogError(f"checkpoint {name} is marked by {len({m.run for m in same})} step-log runs at once "
                               "(two logs, e.g. of two optimizers, were open in its directory): replay cannot "
                               "tell which one is this optimizer's; log one optimizer per directory")
    return max(same, key=lambda m: (index.runs[m.run].created if m.run in index.runs else 0.0, m.event),
               default=None)


def read_index(segs: Store) -> LogIndex:
    """List and read the step log of one directory. A malformed run object raises ``StepLogFormatError``
    naming it, a malformed marker goes to ``damaged``; objects whose names match no pattern are ignored."""
    index = LogIndex()
    files = segs.list_files()
    for f in files:
        seg = parse_seg_name(f.name)
        if seg is not None:
            index.segments.setdefault(seg.run, []).append(seg)
    for run_segs in index.segments.values():
        run_segs.sort(key=lambda s: s.seq)
    names = [f.name for f in segs.list_files()]  # listed again: markers written since count (see above)
    for name in names:
        m = MARK_RE.fullmatch(name)
        if m:
            for attempt in (1, 2):  # read once more: damaged in transit, not at rest (as segments and blobs)
                try:
                    data = _read(segs, name, MAX_SMALL_BYTES)
                    if data is not None:
                        index.markers.append(parse_marker(data, segs.url(name), name))
                    break
                except (StepLogFormatError, CorruptCheckpointError) as exc:  # one blocked every replay (h99)
                    if attempt == 2:
                        index.damaged[name] = Marker(name, m.group(1), int(m.group(2)), -1, str(exc), None)
    for name in names:
        m = RUN_RE.fullmatch(name)
        if m:
            data = _read(segs, name, MAX_RUN_BYTES)
            if data is not None:
                index.runs[m.group(1)] = parse_run(data, segs.url(name), m.group(1))
    if index.orphans():  # a concurrent gc deletes a run's segments, then its object: those gone are not orphans
        now = {f.name for f in segs.list_files()}
        for run in list(index.orphans()):
            index.segments[run] = [s for s in index.segments[run] if s.name in now]
            if not index.segments[run]:
                del index.segments[run]
    return index


def _read(segs: Store, name: str, limit: int) -> bytes | None:
    try:
        return segs.read_manifest(name, limit + 1, "step-log object")
    except CheckpointNotFoundError:  # deleted since the listing (gc): as if never listed
        return None
