"""On-storage naming of an Accelerate checkpoint, its index, and retention by whole checkpoints.

::

    ROOT/checkpoint_3/                                 the folder accelerate names (exists when
                                                       save_state returns; hooks may write into it)
    ROOT/checkpoint_3/checkrun.ckpt                    index: the checkpoint (committed last)
    ROOT/.checkrun/parts/checkpoint_3.<run>-<seq>.rank0.ckpt   rank 0: replicated + its RNG/dataloaders
    ROOT/.checkrun/parts/checkpoint_3.<run>-<seq>.rank1.ckpt   rank 1: its RNG/dataloaders
    ROOT/.checkrun/parts/.checkrun/blobs/...           blobs shared by the parts of every checkpoint

``ROOT`` is ``{project_dir}/checkpoints`` (automatic naming) or the configured directory. Without
either, ``save_state(output_dir)`` makes ``output_dir`` the folder and keeps the parts in
``output_dir/.checkrun/parts`` (saving there again replaces the checkpoint, as accelerate does).
The index format and the reading rules are ``ckpt_core.format.composite``'s (the CLI reads them too).
``<run>-<seq>`` is unique per save, so saving again under an existing name never touches the parts
the old index still points at. Earlier releases' ``ROOT/checkpoint_3.ckpt`` + ``ROOT/parts/`` load.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

from ckpt_core import CheckpointEngine, CheckrunError, NotACheckpointError
from ckpt_core.format import composite
from ckpt_core.format.composite import INDEX_NAME, PARTS_DIR, Composite, join, parent

log = logging.getLogger("accelerate_ckpt")

LEGACY_PARTS_DIR = "parts"
MIN_GC_GRACE_SECONDS = 3600.0
"""Age below which a part no index lists is kept: it may belong to a save whose other ranks are still
writing (their blobs are protected by leases, the committed part manifests only by this age; it was
the effective age before leases too, ``gc_grace_seconds``' old default)."""

__all__ = ["Target", "join", "parent", "INDEX_NAME", "PARTS_DIR"]


def normalize(path: str | os.PathLike) -> str:
    """A local path made absolute (``~`` expanded, as accelerate does); URLs unchanged."""
    text = os.fspath(path)
    if "://" in text or "::" in text:
        return text.rstrip("/")
    return os.path.abspath(os.path.expanduser(text))


@dataclass(frozen=True)
class Target:
    """Where one save goes: ``folder`` holds the index, ``base`` the ``.checkrun/parts`` of the parts."""

    base: str
    folder: str
    name: str

    @classmethod
    def in_root(cls, root: str, name: str) -> "Target":
        """``ROOT/name`` (automatic naming or a configured directory): parts shared across the ROOT."""
        root = normalize(root)
        return cls(root, join(root, name), name)

    @classmethod
    def folder_only(cls, folder: str | os.PathLike) -> "Target":
        """``save_state(output_dir)`` without automatic naming: the folder is the checkpoint."""
        folder = normalize(folder)
        return cls(folder, folder, folder.rpartition("/")[2])

    @property
    def index_url(self) -> str:
        """The index file in the folder."""
        return join(self.folder, INDEX_NAME)

    def part_names(self, token: str, seq: int, world: int) -> tuple[list[str], list[str]]:
        """Names of this save's parts, rank 0 first: (relative to ``base``, relative to ``folder``)."""
        rel = [f"{PARTS_DIR}/{self.name}.{token}-{seq}.rank{r}.ckpt" for r in range(world)]
        up = "" if self.base == self.folder else "../"
        return rel, [up + p for p in rel]


def checkpoint_name(number: int) -> str:
    """``checkpoint_{number}`` (accelerate's automatic naming)."""
    return f"checkpoint_{number}"


def checkpoint_key(index_url: str) -> str:
    """How retention names a checkpoint: its folder's name, or a legacy index's file name."""
    head, _, name = index_url.rstrip("/").rpartition("/")
    return head.rpartition("/")[2] if name == INDEX_NAME else name


def folder_of(index_url: str) -> str:
    """What ``load_state``/``latest`` report for an index: its folder (legacy: the index itself)."""
    return parent(index_url) if index_url.rpartition("/")[2] == INDEX_NAME else index_url


def read_index(engine: CheckpointEngine, url: str, storage_options: dict | None, wait: bool = True) -> dict:
    """Load and check an index. ``wait``: wait for a save to ``url`` in flight in this process (never
    on the commit thread: the index being committed is registered in flight until its verdict)."""
    if wait:
        index = engine.load(url, map_location="cpu", storage_options=storage_options)
        return composite.check_index(index, url)
    index = composite.index_of(engine.read_manifest(url, storage_options=storage_options), url)
    if index is None:
        raise NotACheckpointError(f"{url} is a checkrun checkpoint but not an accelerate_ckpt index "
                                  f"(no {composite.INDEX_KEY!r} key)")
    return index


def part_urls(index_url: str, index: dict) -> list[str]:
    """Absolute paths/URLs of an index's parts."""
    return composite.part_urls(index_url, index)


def list_checkpoints(engine: CheckpointEngine, root: str, storage_options: dict | None) -> list[Composite]:
    """Committed (and unreadable) checkpoints of ``root``, oldest first (no waiting)."""
    return composite.list_in(root, storage_options, engine.config)


def remove_checkpoint(engine: CheckpointEngine, entry: Composite, storage_options: dict | None,
                      parts: Iterable[str] | None = None) -> None:
    """Delete an index first (the checkpoint vanishes atomically), then its parts (blobs at gc),
    then its folder with whatever hooks wrote into it (as accelerate's ``total_limit`` does)."""
    if parts is None:
        parts = part_urls(entry.url, entry.index) if entry.index is not None else []
    engine.remove(entry.url, storage_options=storage_options)
    for p in parts:
        engine.remove(p, storage_options=storage_options)
    if entry.folder is not None:
        composite.remove_folder(entry.folder, storage_options, engine.config)


def apply_retention(engine: CheckpointEngine, root: str, keep_last: int, protect: set[str],
                    storage_options: dict | None) -> list[str]:
    """Remove the oldest committed checkpoints of ``root`` beyond ``keep_last``.

    Only committed indexes are candidates, never one whose ``checkpoint_key`` is in ``protect`` (the
    one just committed, ones being written, the one this process resumed from). Runs on rank 0's
    commit thread."""
    entries = [e for e in list_checkpoints(engine, root, storage_options) if e.manifest is not None]
    removed = []
    for entry in entries[:-keep_last] if len(entries) > keep_last else []:
        if checkpoint_key(entry.url) in protect:
            continue
        remove_checkpoint(engine, entry, storage_options)
        removed.append(entry.url)
        log.info("accelerate_ckpt: retention removed %s (keep_last=%d)", entry.folder or entry.url, keep_last)
    return removed


def remove_orphan_parts(engine: CheckpointEngine, root: str, grace_seconds: float,
                        storage_options: dict | None) -> list[str]:
    """Remove parts no index of ``root`` lists and older than the grace (left by a crash before the
    commit); younger ones may belong to a save still in flight on some rank."""
    referenced: set[str] = set()
    for entry in list_checkpoints(engine, root, storage_options):
        if entry.index is None:
            return []  # an unreadable index: its parts are unknown, keep everything
        referenced.update(u.rpartition("/")[2] for u in part_urls(entry.url, entry.index))
    now, removed = time.time(), []
    for entry in engine.list(join(root, PARTS_DIR), storage_options=storage_options):
        if entry.name not in referenced and now - entry.mtime > grace_seconds:
            engine.remove(entry.url, storage_options=storage_options)
            removed.append(entry.url)
    return removed


def collect(engine: CheckpointEngine, root: str, grace_seconds: float, storage_options: dict | None) -> None:
    """Remove orphaned parts older than the grace (floored at ``MIN_GC_GRACE_SECONDS``: a part no
    index lists yet may belong to a save still in flight on some rank), then collect the blobs of
    the parts this engine removed (leases protect those of saves in flight: no grace, no listing of
    the blobs); the parts folder of earlier releases gets a full collection. Never collects ``root``
    itself: indexes are registered in flight there."""
    grace = max(grace_seconds, MIN_GC_GRACE_SECONDS)
    try:
        orphans = remove_orphan_parts(engine, root, grace, storage_options)
        if orphans:
            log.info("accelerate_ckpt: removed %d orphaned part(s) in %s", len(orphans), root)
    except CheckrunError as exc:
        log.warning("accelerate_ckpt: orphan cleanup in %s failed: %s", root, exc)
    for directory, full in ((join(root, PARTS_DIR), False), (join(root, LEGACY_PARTS_DIR), True)):
        try:
            engine.gc(directory, storage_options=storage_options, full=full)
        except CheckrunError as exc:
            log.warning("accelerate_ckpt: gc of %s failed: %s", directory, exc)


def metrics(outcomes: list[dict[str, Any]], index_bytes: int, blocking_seconds: float,
            total_seconds: float, checkpoint: str) -> dict:
    """Figures of one committed checkpoint summed over ranks (keys prefixed ``checkrun/``)."""
    tensor = sum(o["tensor_bytes"] for o in outcomes)
    stored = sum(o["stored_bytes"] for o in outcomes)
    written = sum(o["written_bytes"] for o in outcomes) + index_bytes
    return {
        "checkrun/blocking_seconds": blocking_seconds,
        "checkrun/total_seconds": total_seconds,
        "checkrun/tensor_bytes": tensor,
        "checkrun/written_bytes": written,
        "checkrun/stored_bytes": stored,
        "checkrun/compression_ratio": tensor / stored if stored else float("inf"),
        "checkrun/write_ratio": written / tensor if tensor else 0.0,
        "checkrun/checkpoint": checkpoint,
    }
