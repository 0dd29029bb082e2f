"""On-storage naming of an Accelerate checkpoint, its index, and retention by whole checkpoints.

::

    ROOT/checkpoint_3.ckpt                          index: the checkpoint (committed last)
    ROOT/parts/checkpoint_3.<run>-<seq>.rank0.ckpt  rank 0: replicated state + rank 0's RNG/dataloaders
    ROOT/parts/checkpoint_3.<run>-<seq>.rank1.ckpt  rank 1: its RNG/dataloaders
    ROOT/parts/.checkrun/blobs/...                  blobs shared by all parts (incremental, dedup)

The index is a tiny checkrun checkpoint (plain data only) listing its parts by relative name; it
is written only after every part is durable, so ``latest(ROOT)`` never returns a partial
checkpoint. ``<run>-<seq>`` is unique per save, so saving again under an existing name never
touches the parts the old index still points at.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable

from ckpt_core import CheckpointEngine, CheckrunError, NotACheckpointError

log = logging.getLogger("accelerate_ckpt")

PARTS_DIR = "parts"
INDEX_KEY = "accelerate_ckpt"
INDEX_FORMAT = 1
MIN_GC_GRACE_SECONDS = 600.0
"""Floor of the grace period when collecting part blobs: other ranks may be writing the next save."""


def join(root: str, rel: str) -> str:
    """``root/rel`` for local paths and URLs alike."""
    return f"{root.rstrip('/')}/{rel}"


def parent(url: str) -> str:
    """The directory of a checkpoint path or URL."""
    return url.rstrip("/").rpartition("/")[0]


def checkpoint_name(number: int) -> str:
    """``checkpoint_{number}`` (accelerate's automatic naming)."""
    return f"checkpoint_{number}"


def index_name(name: str) -> str:
    """File name of a checkpoint's index in ROOT."""
    return f"{name}.ckpt"


def part_names(name: str, token: str, seq: int, world: int) -> list[str]:
    """Relative names of the parts of one save, rank 0 first."""
    return [f"{PARTS_DIR}/{name}.{token}-{seq}.rank{r}.ckpt" for r in range(world)]


def make_index(name: str, parts: list[str], meta: dict) -> dict:
    """The index tree (plain data); ``meta`` holds step/iteration/... for listings."""
    return {INDEX_KEY: INDEX_FORMAT, "name": name, "parts": list(parts), "world_size": len(parts), **meta}


def read_index(engine: CheckpointEngine, url: str, storage_options: dict | None) -> dict:
    """Load and check an index; NotACheckpointError if ``url`` is not an accelerate_ckpt index."""
    index = engine.load(url, storage_options=storage_options)
    if not isinstance(index, dict) or INDEX_KEY not in index:
        raise NotACheckpointError(f"{url} is a checkrun checkpoint but not an accelerate_ckpt index "
                                  f"(no {INDEX_KEY!r} key)")
    if index[INDEX_KEY] > INDEX_FORMAT:
        raise NotACheckpointError(f"{url}: accelerate_ckpt index format {index[INDEX_KEY]} is newer than "
                                  f"this version supports ({INDEX_FORMAT}); upgrade checkrun")
    return index


def part_urls(index_url: str, index: dict) -> list[str]:
    """Absolute paths/URLs of an index's parts."""
    return [join(parent(index_url), rel) for rel in index["parts"]]


def remove_checkpoint(engine: CheckpointEngine, url: str, storage_options: dict | None,
                      parts: Iterable[str] | None = None) -> None:
    """Delete an index first (the checkpoint vanishes atomically), then its parts (blobs at gc)."""
    if parts is None:
        parts = part_urls(url, read_index(engine, url, storage_options))
    engine.remove(url, storage_options=storage_options)
    for p in parts:
        engine.remove(p, storage_options=storage_options)


def apply_retention(engine: CheckpointEngine, root: str, keep_last: int, protect: set[str],
                    storage_options: dict | None) -> list[str]:
    """Remove the oldest committed checkpoints of ``root`` beyond ``keep_last``.

    Only committed indexes are candidates, never one whose file name is in ``protect`` (the one just
    committed, the one this process resumed from). Runs on rank 0's helper thread."""
    entries = [e for e in engine.list(root, storage_options=storage_options) if e.manifest is not None]
    if len(entries) <= keep_last:
        return []
    removed = []
    for entry in entries[:-keep_last]:
        if entry.name in protect:
            continue
        try:
            remove_checkpoint(engine, entry.url, storage_options)
        except NotACheckpointError:
            continue  # somebody else's checkrun checkpoint in the same directory: not ours to remove
        removed.append(entry.url)
        log.info("accelerate_ckpt: retention removed %s (keep_last=%d)", entry.url, keep_last)
    return removed


def remove_orphan_parts(engine: CheckpointEngine, root: str, grace_seconds: float,
                        storage_options: dict | None) -> list[str]:
    """Remove parts no index of ``root`` lists and older than the grace (left by a crash before the
    commit); younger ones may belong to a save still in flight on some rank."""
    referenced: set[str] = set()
    for entry in engine.list(root, storage_options=storage_options):
        if entry.manifest is None:
            return []  # an unreadable index: its parts are unknown, keep everything
        try:
            referenced.update(p.rpartition("/")[2] for p in read_index(engine, entry.url, storage_options)["parts"])
        except NotACheckpointError:
            continue
    now, removed = time.time(), []
    for entry in engine.list(join(root, PARTS_DIR), storage_options=storage_options):
        if entry.name not in referenced and now - entry.mtime > grace_seconds:
            engine.remove(entry.url, storage_options=storage_options)
            removed.append(entry.url)
    return removed


def collect(engine: CheckpointEngine, root: str, grace_seconds: float, storage_options: dict | None) -> None:
    """Remove orphaned parts, then garbage-collect unreferenced blobs of the parts and of the index
    directory (grace floored at ``MIN_GC_GRACE_SECONDS``)."""
    grace = max(grace_seconds, MIN_GC_GRACE_SECONDS)
    try:
        orphans = remove_orphan_parts(engine, root, grace, storage_options)
        if orphans:
            log.info("accelerate_ckpt: removed %d orphaned part(s) in %s", len(orphans), root)
    except CheckrunError as exc:
        log.warning("accelerate_ckpt: orphan cleanup in %s failed: %s", root, exc)
    for directory in (join(root, PARTS_DIR), root):
        try:
            engine.gc(directory, grace_seconds=grace, storage_options=storage_options)
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
