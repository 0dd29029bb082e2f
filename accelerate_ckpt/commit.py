"""Rank 0's side of a checkpoint: commit the index once every part is durable, then retention.

:class:`IndexCommitter` runs on rank 0's commit thread (the training thread in synchronous mode),
called by ``GroupCommitter`` with every rank's outcome. It never waits for a save in flight under
the checkpoint's folder: the index it commits is registered in flight until the verdict is out.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ckpt_core import CheckpointEngine, CheckpointNotFoundError, CheckrunError, EngineConfig

from . import layout
from .layout import Target

log = logging.getLogger("accelerate_ckpt")


class IndexCommitter:
    """Commits indexes with a synchronous engine of its own; created on rank 0 only."""

    def __init__(self, config: EngineConfig, storage_options: dict | None,
                 keep_last: Callable[[], int | None], protected: Callable[[], set[str]]) -> None:
        self.engine = CheckpointEngine(config.replace(**{
            "saving.asynchronous": False, "saving.sigterm_grace_seconds": None}))
        self.config, self.storage_options = config, storage_options
        self._keep_last, self._protected = keep_last, protected

    def finish(self, target: Target, index: dict, outcomes: list[dict], blocking: float, started: float) -> dict:
        """The verdict on one save: commit its index when every part is durable, else clean up."""
        index_url = target.index_url
        failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if o.get("error")]
        parts = layout.part_urls(index_url, index)
        if failed:
            self.remove(parts)
            return {"error": f"checkpoint {target.folder} not committed: " + "; ".join(failed)}
        try:
            previous = self._previous_parts(index_url)
            info = self.engine.save(index, index_url, storage_options=self.storage_options).result()
        except Exception as exc:  # noqa: BLE001 - becomes the verdict on every rank
            self.remove(parts)
            return {"error": f"checkpoint {target.folder} not committed: {exc}"}
        self.remove([p for p in previous if p not in parts])
        if target.base != target.folder:  # a folder of its own (no automatic naming): nothing to retain
            self._retain(target)
        m = layout.metrics(outcomes, info.written_bytes, blocking, time.perf_counter() - started, target.folder)
        return {"error": None, "metrics": m}

    def _previous_parts(self, index_url: str) -> list[str]:
        """Parts of an index already at ``index_url`` (saving again under a name replaces it)."""
        try:
            return layout.part_urls(index_url, layout.read_index(self.engine, index_url, self.storage_options,
                                                                 wait=False))
        except (CheckpointNotFoundError, FileNotFoundError, CheckrunError):
            return []

    def _retain(self, target: Target) -> None:
        keep = self._keep_last()
        if not keep:
            return
        protect = self._protected() | {target.name}
        try:
            removed = layout.apply_retention(self.engine, target.base, keep, protect, self.storage_options)
            if removed and self.config.retention.gc_after_save:
                layout.collect(self.engine, target.base, self.config.retention.gc_grace_seconds,
                               self.storage_options)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; retention retries next time
            log.warning("accelerate_ckpt: retention in %s failed: %s", target.base, exc)

    def remove(self, urls: list[str]) -> None:
        """Best-effort removal of parts (orphans go at a later ``collect``)."""
        for url in urls:
            try:
                self.engine.remove(url, storage_options=self.storage_options)
            except Exception as exc:  # noqa: BLE001 - best effort
                log.warning("accelerate_ckpt: could not remove %s: %s", url, exc)

    def close(self) -> None:
        """Release the engine's threads."""
        self.engine.close()
