"""Step 6 of a save: listing checkpoints, retention (``keep_last``) and garbage collection of blobs.

Retention only ever removes manifests. Garbage collection deletes a blob only when no manifest in the
directory references it *and* it is older than the grace period, so blobs written by a save that has
not committed yet (in this or another process) survive. If any manifest cannot be parsed, nothing
is collected: its references are unknown. One removed between the listing and its read (retention
of another writer) is gone, not unreadable: it is left out and does not stop gc.
"""
from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass, field

from .config import EngineConfig
from .errors import CheckpointNotFoundError, CheckrunError
from .manifest import MAGIC_PREFIX, Manifest, parse_manifest
from .manifest_limits import limits_for
from .storage import Store

log = logging.getLogger("ckpt_core")


@dataclass(frozen=True)
class CheckpointEntry:
    """One manifest file of a directory; ``manifest`` is None and ``error`` set if it is corrupt."""

    name: str
    url: str
    mtime: float
    size: int
    manifest: Manifest | None
    error: str | None = None

    @property
    def created(self) -> float:
        return self.manifest.created if self.manifest is not None else self.mtime


def list_checkpoints(store: Store, config: EngineConfig) -> list[CheckpointEntry]:
    """Every checkrun manifest in the directory, oldest first (other files are ignored)."""
    entries = []
    files = [f for f in store.list_files() if f.size > 0]

    def read(info):
        try:
            head = store.read_head(info.name, len(MAGIC_PREFIX) + 8)
        except CheckpointNotFoundError:
            log.debug("checkrun: %s was removed while listing", store.url(info.name))
            return None
        except CheckrunError as exc:
            # Unreadable (after retries): it may well be a checkpoint. Dropping it would let gc
            # collect the blobs it needs; listed as broken, it makes gc collect nothing.
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None, str(exc))
        if not head.lstrip().startswith(MAGIC_PREFIX):
            return None
        try:
            data = store.read_manifest(info.name)
            m = parse_manifest(data, store.url(info.name), limits=limits_for(config))
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, m)
        except CheckpointNotFoundError:
            # Removed between the listing and this read (retention of another writer): it is
            # gone, not corrupt, and gc must not stop because of it.
            log.debug("checkrun: %s was removed while listing", store.url(info.name))
            return None
        except CheckrunError as exc:
            return CheckpointEntry(info.name, store.url(info.name), info.mtime, info.size, None, str(exc))

    for entry in store.map(read, files):
        if entry is not None:
            entries.append(entry)
    entries.sort(key=lambda e: (e.created, e.mtime, e.name))
    return entries


def apply_retention(store: Store, config: EngineConfig, keep: set[str]) -> list[str]:
    """Remove the oldest committed manifests beyond ``keep_last``; never a name in ``keep`` nor one
    matching ``retention.protect`` (those are not counted either)."""
    keep_last = config.retention.keep_last
    if keep_last is None:
        return []
    protect = config.retention.protect
    committed = [e for e in list_checkpoints(store, config)
                 if e.manifest is not None and not any(fnmatch.fnmatchcase(e.name, p) for p in protect)]
    removable = [e for e in committed[:-keep_last] if e.name not in keep] if len(committed) > keep_last else []
    for e in removable:
        store.delete_manifest(e.name)
        log.info("checkrun: retention removed %s (keep_last=%d)", e.url, keep_last)
    return [e.name for e in removable]


@dataclass
class GCReport:
    """What garbage collection found and (unless ``dry_run``) deleted."""

    directory: str
    dry_run: bool
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_young: int = 0
    referenced: int = 0
    problems: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    """Temp files of interrupted writes older than the grace (deleted unless ``dry_run``)."""


def collect_garbage(store: Store, config: EngineConfig, *, grace_seconds: float | None = None,
                    dry_run: bool = False) -> GCReport:
    """Delete blobs no manifest references and older than the grace period."""
    grace = config.retention.gc_grace_seconds if grace_seconds is None else grace_seconds
    report = GCReport(store.url(""), dry_run)
    entries = list_checkpoints(store, config)
    broken = [e for e in entries if e.manifest is None]
    if broken:
        report.problems.extend(f"{e.url}: {e.error}" for e in broken)
        log.warning("checkrun: gc skipped in %s: %d manifest(s) cannot be read", report.directory, len(broken))
        return report
    referenced: set[str] = set()
    for e in entries:
        referenced |= e.manifest.blob_keys()
    report.referenced = len(referenced)
    now = time.time()
    victims = []
    for blob in store.list_blobs():
        if blob.key in referenced:
            continue
        if now - blob.mtime < grace:
            report.kept_young += 1
            continue
        victims.append(blob)
    if not dry_run:
        gone = store.map(lambda b: _delete_if_still_old(store, b.key, grace), victims)
        report.kept_young += gone.count(False)
        victims = [b for b, deleted in zip(victims, gone) if deleted]
    report.deleted = [b.key for b in victims]
    report.freed_bytes = sum(b.size for b in victims)
    # A process killed while writing leaves its temp file (a torn blob, an unrenamed manifest):
    # nothing reads them, and a writer still busy with one keeps it younger than the grace.
    stale = [t for t in store.list_temp_files() if time.time() - t.mtime >= grace]
    if not dry_run:
        store.map(lambda t: store.delete_temp_file(t.name), stale)
    report.temp_files = [t.name for t in stale]
    report.freed_bytes += sum(t.size for t in stale)
    return report


def _delete_if_still_old(store: Store, key: str, grace: float) -> bool:
    """Delete a victim unless a save rewrote it since the listing to reuse it (SnapshotWriter
    refreshes reused blobs older than half the grace): its mtime is looked at again right before."""
    info = store.blob_info(key)
    if info is None or time.time() - info.mtime < grace:
        return False
    store.delete_blob(key)
    return True
