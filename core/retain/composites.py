"""Step 6 for composite checkpoints: retention by whole checkpoints (index, parts and folder).

A composite checkpoint (``format.composite``: an index naming one part per rank, what accelerate_ckpt
writes) is retained or removed as one: ``Composites`` is the ``Retained`` policy that
``after.after_commit`` applies after an index is committed. It removes the index first (the
checkpoint vanishes atomically), then its parts (their blobs are the candidates of the collection in
the parts directory), then its folder with whatever hooks wrote into it (as Accelerate's
``total_limit`` does). Once it removed a checkpoint it also removes orphaned parts (no index lists
them; left by a crash before the commit) older than ``orphan_grace``, and asks for a full collection
of the parts directory of earlier releases. Runs on the thread that committed the index.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CheckrunError
from ..storage.retry import is_outage
from ..format import composite
from ..format.composite import INDEX_NAME, LEGACY_PARTS_DIR, PART_REL, PARTS_DIR, Composite, index_of, join
from ..loading.reader import read_manifest
from ..format.manifest import FUTURE_SLACK_SECONDS, parse_manifest
from ..format.limits import limits_for
from ..storage.store import Store
from .after import Garbage
from .retention import list_checkpoints, oldest_first

log = logging.getLogger("ckpt_core")

MIN_ORPHAN_GRACE_SECONDS = 3600.0
"""Age below which a part no index lists is kept: it may belong to a save whose other ranks are still
writing (their blobs are protected by leases, the committed part manifests only by this age; it was
the effective age before leases too, ``gc_grace_seconds``' old default)."""


def checkpoint_key(index_url: str) -> str:
    """How retention names a composite checkpoint: its folder's name, or a legacy index's file name."""
    head, _, name = index_url.rstrip("/").rpartition("/")
    return head.rpartition("/")[2] if name == INDEX_NAME else name


@dataclass(frozen=True)
class Composites:
    """The composite checkpoints of ``root``, ``keep_last`` of them kept (``Retained``).

    ``protect``: checkpoint keys (``checkpoint_key``: folder names) never removed (they count towards
    ``keep_last``, as Accelerate's ``total_limit`` counts every checkpoint). ``orphan_grace``: floored
    at ``MIN_ORPHAN_GRACE_SECONDS``. Use as a context manager: it closes the stores it opened."""

    root: str
    config: EngineConfig
    storage_options: dict | None = None
    keep_last: int = 0
    protect: frozenset = frozenset()
    orphan_grace: float = 0.0
    _stores: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def store(self) -> Store:
        """The parts directory: the blobs of every part of ``root``."""
        return self._dir(join(self.root, PARTS_DIR))

    def index_store(self, name: str) -> tuple[Store, str]:
        """Where the index of checkpoint ``name`` of ``root`` is committed: ``(store, file name)``."""
        return self._file(join(join(self.root, name), INDEX_NAME))

    def close(self) -> None:
        """Stop the I/O threads of the stores it opened."""
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    def __enter__(self) -> "Composites":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def remove_parts(self, urls: list[str]) -> list[Garbage]:
        """Remove parts (of a checkpoint that failed, or of an index that was replaced); best effort:
        a part that cannot be removed is logged and left to the orphan cleanup."""
        garbage = []
        for url in urls:
            try:
                found = self._remove_part(url)
            except Exception as exc:  # noqa: BLE001 - best effort
                log.warning("checkrun: could not remove %s: %s", url, exc)
                continue
            if found is not None:
                garbage.append(found)
        return garbage

    def remove_oldest(self, keep: set[str]) -> list[Garbage]:
        """Remove the oldest committed checkpoints beyond ``keep_last`` (never one whose key is in
        ``protect`` or ``keep``), then orphaned parts; the garbage is their parts' blobs."""
        if not self.keep_last:
            return []
        protect = set(self.protect) | set(keep)
        entries = [e for e in list_in(self.root, self.storage_options, self.config)
                   if e.manifest is not None]
        garbage: list[Garbage] = []
        removed = 0
        doomed = [e for e in (entries[:-self.keep_last] if len(entries) > self.keep_last else [])
                  if checkpoint_key(e.url) not in protect]
        gone = {id(e) for e in doomed}
        kept = {url for e in entries if id(e) not in gone and e.index is not None
                for url in composite.part_urls(e.url, e.index)}
        for entry in doomed:
            garbage += self._remove(entry, kept)
            removed += 1
            log.info("checkrun: retention removed %s (keep_last=%d)", entry.folder or entry.url, self.keep_last)
        if not removed:
            return []
        garbage += self._remove_orphans()
        return [*garbage, Garbage(self._dir(join(self.root, LEGACY_PARTS_DIR)), None)]

    def _remove(self, entry: Composite, kept: set[str]) -> list[Garbage]:
        """Index first (the checkpoint vanishes atomically), then its parts, then its folder. A part
        that is not a file of the parts directory, or that a kept checkpoint's index lists too (a
        damaged or forged index), is left alone with a warning: retention deletes only its own parts."""
        parts = []
        if entry.index is not None:
            for rel, url in zip(entry.index["parts"], composite.part_urls(entry.url, entry.index)):
                if PART_REL.fullmatch(rel) and url not in kept:
                    parts.append(url)
                else:
                    log.warning("checkrun: retention of %s: not deleting its part %r (%s)", entry.url, rel,
                                "listed by a kept checkpoint too" if url in kept else "not in the parts directory")
        index_store, index_name = self._file(entry.url)
        index_store.delete_manifest(index_name)
        garbage = [self._remove_part(url) for url in parts]
        if entry.folder is not None:
            composite.remove_folder(entry.folder, self.storage_options, self.config)
        return [g for g in garbage if g is not None]

    def _remove_part(self, url: str) -> Garbage | None:
        """Delete a part's manifest; its blobs are candidates (all of them, unknown, if unreadable)."""
        store, name = self._file(url)
        try:
            manifest = parse_manifest(store.read_manifest(name), url, limits=limits_for(self.config))
            found = Garbage(store, {b.key: b.size for b in manifest.blobs()})
        except CheckpointNotFoundError:
            found = None
        except CheckrunError:  # unreadable: its blobs are unknown, the collection lists them all
            found = Garbage(store, None)
        store.delete_manifest(name)
        return found

    def orphans(self) -> list:
        """The parts (``list_checkpoints`` entries of the parts directory) no index of ``root`` lists,
        older than the grace (a younger one may belong to a save still in flight on some rank; a
        folder deleted by hand leaves its parts); none while an index is unreadable (its parts are
        unknown). Raises ``CheckrunError`` when the directory cannot be listed."""
        referenced: set[str] = set()
        for entry in list_in(self.root, self.storage_options, self.config):
            if entry.index is None:
                return []
            referenced.update(u.rpartition("/")[2] for u in composite.part_urls(entry.url, entry.index))
        grace = max(self.orphan_grace, MIN_ORPHAN_GRACE_SECONDS)
        now = time.time()
        return [e for e in list_checkpoints(self.store, self.config)
                if e.name not in referenced and now - e.mtime > grace]

    def _remove_orphans(self) -> list[Garbage]:
        """Remove the ``orphans``; the garbage is their blobs."""
        try:
            garbage = [self._remove_part(entry.url) for entry in self.orphans()]
        except CheckrunError as exc:
            log.warning("checkrun: orphan cleanup in %s failed: %s", self.root, exc)
            return []
        if garbage:
            log.info("checkrun: removed %d orphaned part(s) in %s", len(garbage), self.root)
        return [g for g in garbage if g is not None]

    def _dir(self, url: str) -> Store:
        """One ``Store`` per directory (collections compare them by URL)."""
        probe = Store.for_directory(os.fspath(url), self.storage_options, self.config.storage)
        return self._stores.setdefault(probe.url(""), probe)

    def _file(self, url: str) -> tuple[Store, str]:
        store, name = Store.for_path(url, self.storage_options, self.config.storage)
        return self._stores.setdefault(store.url(""), store), name


# -- listing the composite checkpoints of a directory ------------------------------------------------
def _subfolders(store: Store) -> list[str]:
    """Names of the folders directly in the store's directory (hidden ones left out)."""
    fs, root = store.fs, store.root.rstrip("/")
    fs.invalidate_cache(root)
    try:
        found = store.retry(lambda: fs.ls(root, detail=True), f"list {store.url('')}")
    except FileNotFoundError:
        return []
    names = []
    for info in found:
        path = info["name"].rstrip("/")
        head, _, name = path.rpartition("/")
        if info.get("type") == "directory" and head == root and name and not name.startswith("."):
            names.append(name)
    return sorted(names)


def _folder_entry(store: Store, name: str, config: EngineConfig) -> Composite | None:
    sub = store.at(join(store.root, name))
    url = sub.url(INDEX_NAME)
    try:
        manifest = read_manifest(sub, INDEX_NAME, config)
        index = index_of(manifest, url)
    except CheckpointNotFoundError:
        return None  # a folder without an index: a save in flight, one that crashed, or not ours
    except CheckrunError as exc:
        return Composite(name, url, sub.url(""), None, None, str(exc), is_outage(exc))
    if index is None:
        return None
    mtime = 0.0  # its file's time, only where the index claims a time far ahead (Composite.created)
    if manifest.created > time.time() + FUTURE_SLACK_SECONDS:
        mtime = next((f.mtime for f in sub.list_files() if f.name == INDEX_NAME), 0.0)
    return Composite(name, url, sub.url(""), manifest, index, mtime=mtime)


def list_composites(store: Store, config: EngineConfig, legacy: bool = True) -> list[Composite]:
    """Committed composite checkpoints of a directory, oldest first, unreadable ones with their error.

    Folders holding an ``INDEX_NAME`` (format 2) and, with ``legacy``, index manifests directly in
    the directory (format 1). Other folders and ordinary manifests are left out."""
    out = [e for e in (_folder_entry(store, n, config) for n in _subfolders(store)) if e is not None]
    if legacy:
        for entry in list_checkpoints(store, config):
            if entry.manifest is None:
                continue
            try:
                index = index_of(entry.manifest, entry.url)
            except CheckrunError as exc:
                out.append(Composite(entry.name, entry.url, None, None, None, str(exc)))
                continue
            if index is not None:
                out.append(Composite(entry.name, entry.url, None, entry.manifest, index, mtime=entry.mtime))
    return oldest_first(out)  # as checkpoint files: one process's in the order it asked for them (h127)


def list_in(directory: str, storage_options: dict | None, config: EngineConfig,
            legacy: bool = True) -> list[Composite]:
    """``list_composites`` of a directory given as a path or URL."""
    return list_composites(Store.for_directory(os.fspath(directory), storage_options, config.storage),
                           config, legacy)
