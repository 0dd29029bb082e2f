"""Step 6 of a save: listing checkpoints, retention (``keep_last``) and garbage collection of blobs.

Retention only ever removes manifests. Garbage collection deletes a blob only when no manifest in the
directory references it *and* no live lease protects it (``leases``): every save in flight, in any
process, holds a lease on the blobs it writes or reuses. So garbage goes at once, not after a grace
period. A collection is *targeted* (the engine after each commit: only candidates it knows of, the
blobs of the checkpoints it removed and of dead writers' leases; no listing of the blobs) or *full*
(``gc``: every blob of the directory, and temp files of interrupted writes).

Order within a round (the argument is in docs/operations.md, "Leases"): write this collection's
lease object, read the leases, read the manifests, delete within the round's window; a round that
runs out of time starts again with a fresh lease object and fresh reads. If any manifest or lease
object cannot be parsed, nothing is collected: what it protects is unknown. A manifest removed
between the listing and its read (another writer's retention) makes gc list once more; still listed
and gone (a stale listing, which may miss a newer manifest reusing its blobs), the round collects
nothing. ``retention.gc_grace_seconds`` keeps unreferenced blobs younger than it as well.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re

from ..storage import owner
from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CheckrunError, UnsafePathError
from ..storage.retry import is_outage
from . import keycache
from .leases import Collection, LeaseDir, Protection, WindowClosed, linked_blobs, read_protection, storage_now
from .report import CheckpointEntry, GCReport
from ..format.manifest import SNIFF_BYTES, checksum_matches, is_manifest_head, looks_damaged, parse_manifest
from ..format.limits import limits_for
from ..saving.fence import HEAD_BYTES, read_stamp
from ..storage.paths import META_DIR, bucket_of, check_name, join, refuse_read_only
from ..storage.store import WHOLE_READ_BYTES, BlobInfo, Store

log = logging.getLogger("ckpt_core")


def _require_bucket(store: Store) -> None:
    """An object store's missing prefix is an empty directory (a first run); a missing bucket is a
    typo, which must not make ``latest()`` answer None and a run start afresh (its first save would
    fail only at its first checkpoint). Only a definite "no such bucket" counts."""
    located = bucket_of(store.fs, store.root)  # h142: dir://run (its "bucket" was the folder run) raised
    if located is None:
        return
    fs, bucket = located
    try:
        found = store.retry(lambda: fs.exists(bucket), f"look for bucket {bucket}")
    except CheckrunError:
        return  # e.g. not allowed to look: the save will say what is wrong
    if not found:
        raise CheckpointNotFoundError(f"{store.url('')}: the bucket {bucket!r} does not exist")


#: The head of a canonical manifest up to its ``created`` (after the checksum and the optional stamp).
_HEAD_RE = re.compile(rb'\{"_checkrun":"manifest","checksum":"[0-9a-f]{32}",(?:"commit":\{[^{}]{0,160}\},)?'
                      rb'"created":(-?[0-9]{1,20}(?:\.[0-9]{1,20})?(?:[eE][-+]?[0-9]{1,3})?)[,}]')


def _head(data: bytes) -> tuple[float, dict | None] | None:
    """``(created, commit stamp)`` of an intact manifest's ``data`` (a damaged one orders nothing, h49), or None."""
    m = _HEAD_RE.match(data)
    if m is None or not checksum_matches(data):
        return None
    stamp = read_stamp(data[:HEAD_BYTES])
    return float(m.group(1)), stamp.to_json() if stamp is not None else None


def list_checkpoints(store: Store, config: EngineConfig, heads: bool = False,
                     keys: bool = False) -> list[CheckpointEntry]:
    """Every checkrun manifest in the directory, oldest first (other files are ignored). ``heads``: an
    intact manifest (its checksum matches) whose first bytes give its time and stamp is not parsed
    (``CheckpointEntry.head``): ``latest()`` parses only the candidates it tries, newest first (2,000
    manifests were all held parsed: 1 GB). ``keys``: each is parsed and only its blob keys kept
    (``CheckpointEntry.keys``; garbage collection)."""
    entries = []
    files = [f for f in store.list_files() if _nameable(f.name)]  # one listed empty is read too (h114: a LIST lie)
    if not files:
        _require_bucket(store)

    def read(info):
        try:  # a small file whole in one GET (not HEAD + GET twice); else its head first (a big torch file)
            small = store.read_listed(info.name, info.size) if 0 < info.size <= WHOLE_READ_BYTES else None
            head = small[:SNIFF_BYTES] if small is not None else store.read_head(info.name, SNIFF_BYTES)
            if len(head) < min(info.size, SNIFF_BYTES):  # the listing says more: read again, then an outage (h114:
                head = store.read_head(info.name, SNIFF_BYTES)  # a HEAD saying 0 bytes made gc collect its blobs)
            if len(head) < min(info.size, SNIFF_BYTES):
                why = f"{len(head)} bytes read, the listing shows {info.size}: the storage disagrees"
                return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None,
                                       f"{store.url(info.name)}: {why}", True)
        except CheckpointNotFoundError:
            return _gone(store, info, keys)
        except CheckrunError as exc:
            # Unreadable (after retries): it may well be a checkpoint. Dropping it would let gc
            # collect the blobs it needs; listed as broken, it makes gc collect nothing.
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None, str(exc),
                                   is_outage(exc))
        if not is_manifest_head(head):
            if not looks_damaged(head):
                return None  # another file (a torch checkpoint, the user's notes)
            why = "it starts with zero bytes (zeroed by a crash)" if head[:1] == b"\0" else (
                f"damaged manifest header {head[:16]!r}: not a checkrun manifest's, but close to one")
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None,
                                   f"{store.url(info.name)}: {why}")
        try:
            data = small if small is not None and checksum_matches(small) else _read_checked(store, info.name)
            top = _head(data) if heads else None
            if top is not None:
                return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None, head=top)
            if keys:  # one manifest parsed at a time per io thread, not all of them held; once per process
                got = keycache.parsed(data, store.url(info.name), limits_for(config))
                return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None,
                                       head=got[:2], keys=got[2])
            m = parse_manifest(data, store.url(info.name), limits=limits_for(config))
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, m)
        except CheckpointNotFoundError:
            return _gone(store, info, keys)
        except CheckrunError as exc:
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None, str(exc),
                                   is_outage(exc))

    for entry in store.map(read, files):
        if entry is not None:
            entries.append(entry)

    def check(e: CheckpointEntry) -> CheckpointEntry | None:  # a head that lifts others: parsed, or an error
        try:
            parse_manifest(_read_checked(store, e.name), e.url, limits=limits_for(config))
            return e
        except CheckpointNotFoundError:
            return None
        except CheckrunError as exc:
            return CheckpointEntry(e.name, e.url, e.mtime, e.size, None, str(exc), is_outage(exc))

    return oldest_first(entries, check if heads else None)


def _nameable(name: str) -> bool:
    """Whether a save could have written ``name`` (``check_name``; h104: a user's ``notes\\v2.txt``)."""
    try:
        return bool(check_name(name))
    except UnsafePathError:
        return False


def _read_checked(store: Store, name: str) -> bytes:
    """A manifest's bytes, read once more when they fail its checksum (damaged in transit, as ``read_manifest``
    reads them: one flipped byte made ``latest()`` skip an intact newest checkpoint)."""
    data = store.read_manifest(name)
    if checksum_matches(data) or not is_manifest_head(data[:SNIFF_BYTES]):
        return data
    again = store.read_manifest(name)
    if checksum_matches(again):
        log.warning("checkrun: %s: manifest checksum mismatch on the first read, the second matched (bytes "
                    "damaged in transit)", store.url(name))
    return again


_GONE = "listed, but gone when read"


def _gone(store: Store, info, keys: bool) -> CheckpointEntry | None:
    """A listed manifest removed before its read (another writer's retention): left out, except for gc
    (``keys``): an error entry (a stale listing, without a newer manifest reusing its blobs: ``_read_state``)."""
    log.debug("checkrun: %s was removed while listing", store.url(info.name))
    return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None,
                           f"{store.url(info.name)}: {_GONE} (a stale listing?)") if keys else None


def oldest_first(entries: list, check=None) -> list:
    """By commit time (``created``), except that one process's checkpoints keep the order of their
    capture (the commit stamp's sequence, as the commit fence compares them): a step back of that
    process's clock (an NTP step, a VM restored) made the checkpoints saved after it older than the
    ones before, so retention deleted the newest and ``latest()`` answered an older one (an independent
    check). Each checkpoint of a process counts as no older than its predecessor. ``check``: an entry
    listed by its head (unparsed) that lifts a later checkpoint of its process is checked first (its
    head's time could be a forgery's or an unreadable future format's: found by independent checks, h52);
    ``check`` returns it, its error entry, or None (gone), and the order is made again without it."""
    checked: set[str] = set()
    while True:
        runs: dict[str, list[CheckpointEntry]] = {}
        for e in entries:
            if e.commit is not None:
                runs.setdefault(e.commit["writer"], []).append(e)
        floor: dict[str, tuple[float, int]] = {}
        bad = None
        for run in runs.values():
            top = None  # the one with the latest time so far
            for e in sorted(run, key=lambda e: e.commit["seq"]):
                if (check is not None and top is not None and top.created > e.created and top.head is not None
                        and top.name not in checked):
                    checked.add(top.name)
                    got = check(top)
                    if got is not top:
                        bad = (top, got)
                        break
                top = e if top is None or e.created > top.created else top
                floor[e.name] = (top.created, e.commit["seq"])
            if bad is not None:
                break
        if bad is None:
            return sorted(entries, key=lambda e: (*floor.get(e.name, (e.created, 0)), e.mtime, e.name))
        entries = [x for x in (bad[1] if x is bad[0] else x for x in entries) if x is not None]


def apply_retention(store: Store, config: EngineConfig, keep: set[str]) -> list[CheckpointEntry]:
    """Remove the oldest committed manifests beyond ``keep_last``; never a name in ``keep`` nor one
    matching ``retention.protect`` (those are not counted either). Returns the removed entries (their
    manifests name the blobs that may have become garbage)."""
    keep_last = config.retention.keep_last
    if keep_last is None:
        return []
    protect = config.retention.protect
    # ordered by their heads; parsed only where it counts, newest first (every save parsed every
    # manifest: 2,000 checkpoints under keep_last 5000 or a protect pattern, 12 s per save)
    listed = [e for e in list_checkpoints(store, config, heads=True)
              if e.error is None and not any(fnmatch.fnmatchcase(e.name, p) for p in protect)]
    if len(listed) <= keep_last:
        return []
    kept, removable = 0, []
    for e in reversed(listed):  # a manifest that does not parse is not committed, as without heads
        if kept >= keep_last and e.name in keep:
            continue
        e = e if e.manifest is not None else _parsed(store, config, e)
        if e is not None and kept < keep_last:
            kept += 1
        elif e is not None:
            removable.append(e)
    removable.reverse()
    for e in removable:
        store.delete_manifest(e.name)
        log.info("checkrun: retention removed %s (keep_last=%d)", e.url, keep_last)
    return removable


def _parsed(store: Store, config: EngineConfig, e: CheckpointEntry) -> CheckpointEntry | None:
    """``e`` (listed by its head) with its manifest parsed; None if it is gone or does not parse."""
    try:
        data = _read_checked(store, e.name)
        return dataclasses.replace(e, manifest=keycache.manifest(data, e.url, limits_for(config)), head=None)
    except CheckrunError:
        return None


def blob_sizes(entries: list[CheckpointEntry]) -> dict[str, int]:
    """Key -> size of every blob the manifests of ``entries`` reference (collection candidates)."""
    return {b.key: b.size for e in entries if e.manifest is not None for b in e.manifest.blobs()}


def collect_garbage(store: Store, config: EngineConfig, *, grace_seconds: float | None = None, dry_run: bool = False,
                    candidates: dict[str, int] | None = None, removed: frozenset = frozenset()) -> GCReport:
    """Delete the blobs no manifest references and no live lease protects.

    ``candidates`` (key -> size): a targeted collection of those keys, without listing the blobs,
    unless a lease of a dead writer (or a failed save) is found: then, like ``None``, a full one
    (every blob, and temp files). ``grace_seconds`` (default ``retention.gc_grace_seconds``, 0):
    keep unreferenced blobs younger than this too. ``removed`` (names): manifests a dry run counts as gone."""
    ldir = LeaseDir(store)
    report = GCReport(store.url(""), dry_run)
    floor = config.retention.gc_grace_seconds if grace_seconds is None else grace_seconds
    refuse_read_only(store.fs, store.url(""), dry_run)
    if not candidates and not (store.is_directory() and store.at(join(store.root, META_DIR)).is_directory()):
        if candidates is None and store.is_directory():  # no blob, no lease object to leave (h132: a user's
            _collect_temp_files(store, config, floor, report, delete=not dry_run)  # folder); a killed save's temp
        return report  # file still goes (h134: beside a checkpoint of no tensor, which makes no .checkrun)
    linked = linked_blobs(store)
    if linked:
        report.problems.append(linked)
        return report
    gc = Collection(store, config.retention.lease_seconds)
    try:
        if not dry_run:
            gc.begin_round()
        state = _read_state(store, config, ldir, gc, report, removed)
        if state is None:
            return report
        if candidates is not None and state[0].writer_died:
            candidates = None  # a writer died here: collect everything it may have left (temp files too)
        if candidates is None and not dry_run:  # first: blobs a killed collection moved aside are back, and listed
            _collect_temp_files(store, config, floor, report)
        pool = _candidates(store, candidates, state[0])
        victims = _victims(store, pool, state, floor, report)
        if dry_run:
            _account(report, victims)
            if candidates is None:
                _collect_temp_files(store, config, floor, report, delete=False)
            _collect_steplog(store, config, report, dry_run)
            return report
        deleted, left = _delete_in_rounds(store, config, ldir, gc, victims, floor, report)
        _account(report, deleted)
        report.pending.update((b.key, b.size) for b in left)
        if not left:
            _drop_dead(ldir, state[0])
    finally:
        gc.end()
    _collect_steplog(store, config, report, dry_run)
    return report


def _read_state(store: Store, config: EngineConfig, ldir: LeaseDir, gc: Collection, report: GCReport,
                removed: frozenset = frozenset()) -> tuple[Protection, set[str]] | None:
    """Leases, then manifests (in this order: a lease released after its commit is seen, or its
    manifest is); None, with the problems reported, if any cannot be read."""
    try:
        prot = read_protection(ldir, exclude=gc.name, written=gc.written)
    except CheckrunError as exc:
        report.problems.append(str(exc))
        log.warning("checkrun: gc skipped in %s: a lease object cannot be read: %s", report.directory, exc)
        return None
    entries = list_checkpoints(store, config, keys=True)
    if any(_GONE in (e.error or "") for e in entries):  # removed meanwhile, or a stale listing: one more
        entries = list_checkpoints(store, config, keys=True)  # (a stale one stays so: nothing collected)
    entries = [e for e in entries if e.name not in removed]
    broken = [e for e in entries if e.error is not None]
    if broken:
        report.problems.extend(f"{e.url}: {e.error}" for e in broken)
        names = ", ".join(e.name for e in broken[:3]) + (f" and {len(broken) - 3} more" if len(broken) > 3 else "")
        log.warning("checkrun: gc skipped in %s: %d manifest(s) cannot be read: %s", report.directory, len(broken),
                    names)
        return None
    referenced: set[str] = set()
    for e in entries:
        referenced |= e.keys
    report.referenced = len(referenced)
    report.leases = prot.leases
    return prot, referenced


def _candidates(store: Store, candidates: dict[str, int] | None, prot: Protection) -> dict[str, BlobInfo]:
    """Blobs to consider: every stored one (full), or the candidates and the keys of dead leases."""
    if candidates is None:
        return {b.key: b for b in store.list_blobs()}
    pool = {k: BlobInfo(k, size, 0.0) for k, size in candidates.items()}
    for rec in prot.dead:
        for key in rec.keys:
            pool.setdefault(key, BlobInfo(key, 0, 0.0))
    return pool


def _victims(store: Store, pool: dict[str, BlobInfo], state: tuple[Protection, set[str]], floor: float,
             report: GCReport) -> list[BlobInfo]:
    prot, referenced = state
    victims = []
    for blob in pool.values():
        if blob.key in referenced:
            continue
        if blob.key in prot.live:
            report.kept_leased += 1
            report.pending[blob.key] = blob.size
            continue
        victims.append(blob)
    if floor > 0:  # only where a grace applies: look at the ages (a targeted pool has none yet)
        infos = store.map(lambda b: store.blob_info(b.key) if b.mtime == 0.0 else b, victims)
        now = storage_now(store)  # blobs are dated by the storage's clock (leases.read_protection)
        young = [i for i in infos if i is not None and now - i.mtime < floor]
        report.kept_young += len(young)
        victims = [i for i in infos if i is not None and now - i.mtime >= floor]
    return victims


def _delete_in_rounds(store: Store, config: EngineConfig, ldir: LeaseDir, gc: Collection,
                      victims: list[BlobInfo], floor: float, report: GCReport) -> tuple[list, list]:
    """Delete ``victims``, each within a round's window; a new round reads leases and manifests
    again and spares what became protected. Returns (deleted, not reached)."""
    deleted: list[BlobInfo] = []
    while victims:
        gone = store.map(lambda b: _delete(store, b, floor, gc), victims)
        deleted += [b for b, ok in zip(victims, gone) if ok is True]
        report.kept_young += sum(1 for ok in gone if ok == "young")
        left = [b for b, ok in zip(victims, gone) if ok is None]
        if not left:
            return deleted, []
        if len(left) == len(victims):
            if gc.window >= gc.lease_seconds / 4:
                # Nothing deleted in the widest window: reading the state (every manifest) takes longer
                # than a round may last. Stop; the blobs are left for a later collection (they cost
                # space, never data), instead of looping for ever (a commit's collection held the
                # coordinator, and training's next save waited on it).
                log.warning("checkrun: gc in %s stopped: reading its state took longer than a deletion window "
                            "(%.0f s); %d unreferenced blob(s) left for a later collection", report.directory,
                            gc.window, len(left))
                return deleted, left
            gc.widen()
        gc.begin_round()
        state = _read_state(store, config, ldir, gc, report)
        if state is None:
            return deleted, left
        prot, referenced = state
        for b in left:
            if b.key in prot.live:
                report.kept_leased += 1
                report.pending[b.key] = b.size
        victims = [b for b in left if b.key not in referenced and b.key not in prot.live]
    return deleted, []


def _delete(store: Store, blob: BlobInfo, floor: float, gc: Collection) -> bool | str | None:
    """Delete one victim: True; "young" if a save rewrote it meanwhile (grace directories only: their
    older writers refresh reused blobs); None if the round's window ended first."""
    try:
        if floor > 0:
            info = store.blob_info(blob.key)
            if info is None:
                return True
            if storage_now(store) - info.mtime < floor:
                return "young"
        store.delete_blob(blob.key, guard=gc.guard)
        return True
    except WindowClosed:
        return None


def _account(report: GCReport, blobs: list[BlobInfo]) -> None:
    report.deleted = [b.key for b in blobs]
    report.freed_bytes += sum(b.size for b in blobs)


def _drop_dead(ldir: LeaseDir, prot: Protection) -> None:
    """Remove the lease objects of dead writers once their keys were dealt with."""
    for rec in prot.dead:
        try:
            ldir.delete(rec.name)
        except CheckrunError as exc:
            log.warning("checkrun: could not remove the dead lease %s: %s", ldir.url(rec.name), exc)


def _collect_temp_files(store: Store, config: EngineConfig, floor: float, report: GCReport,
                        delete: bool = True) -> None:
    """A process killed while writing leaves its temp file (a torn blob, an unrenamed manifest):
    nothing reads them. Deleted when their process ended, or when older than ``lease_seconds``
    (and the grace): a live writer finishes a file much sooner."""
    age, now = max(floor, config.retention.lease_seconds), storage_now(store)
    stale = [t for t in store.list_temp_files() if owner.temp_writer_gone(t.name) or now - t.mtime >= age]
    if delete:
        store.map(lambda t: store.delete_temp_file(t.name), stale)
    report.temp_files = [t.name for t in stale]
    report.freed_bytes += sum(t.size for t in stale)


def _collect_steplog(store: Store, config: EngineConfig, report: GCReport, dry_run: bool) -> None:
    """Truncate the step log (docs/steplog.md): its segments before the oldest retained checkpoint."""
    from ..steplog.gc import collect_segments  # a later stage: imported where used

    try:
        report.step_log = collect_segments(store, lambda: list_checkpoints(store, config, heads=True), dry_run)
    except CheckrunError as exc:  # a malformed step-log object: delete none of it, say why
        report.problems.append(f"step log: {exc}")
