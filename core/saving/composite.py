"""Step 5 for composite checkpoints: rank 0 commits the index once every part is durable, then step 6.

A composite checkpoint (``format.composite``) is one part per rank plus an index naming them; it
exists once the index is committed. :class:`CompositeCommitter` is the ``finish`` of a
``group.GroupCommitter`` job on rank 0 (its commit thread; the training thread in synchronous mode):
with every rank's ``PartOutcome`` it commits the index (a failed part: removes the parts instead),
removes the parts of an index it replaced, then runs ``retain.after_commit`` with the ``Composites``
policy (whole checkpoints beyond ``keep_last``). It never waits for a save in flight under the
checkpoint's folder: the index it commits is registered in flight until the verdict is out.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CheckrunError, NotACheckpointError
from ..format import composite
from ..format.manifest import Manifest
from ..retain import Memory, after_commit, collect
from ..retain.composites import Composites
from .fence import CommitStamp
from .group import GroupFigures, PartOutcome, Verdict
from .handles import SaveHandle

log = logging.getLogger("ckpt_core")


class IndexEngine(Protocol):
    """What the committer needs of a synchronous ``CheckpointEngine`` (its own, never retaining)."""

    def save(self, state: Any, path: str, storage_options: dict | None = None, *,
             stamp: CommitStamp | None = None) -> SaveHandle: ...

    def read_manifest(self, path: str, storage_options: dict | None = None) -> Manifest: ...

    def close(self) -> None: ...


class Placement(Protocol):
    """Where one composite checkpoint goes: ``folder`` holds the index (``index_url``), ``base`` the
    parts (``base/.checkrun/parts``); ``base == folder`` for a folder of its own (nothing to retain).
    ``name``: the checkpoint's name in ``base`` (what retention protects)."""

    base: str
    folder: str
    name: str

    @property
    def index_url(self) -> str: ...


class CompositeCommitter:
    """Commits indexes through ``engine`` (synchronous, ``retention.keep_last`` None: parts and
    indexes are retained here, as whole checkpoints); created on rank 0 only.

    ``keep_last()``: how many checkpoints to keep (None or 0: all); ``protected()``: checkpoint
    names retention must keep (being written, resumed from). Both are called on the commit thread."""

    def __init__(self, engine: IndexEngine, config: EngineConfig, storage_options: dict | None,
                 keep_last: Callable[[], int | None], protected: Callable[[], set[str]]) -> None:
        self.engine, self.config, self.storage_options = engine, config, storage_options
        self._keep_last, self._protected = keep_last, protected
        self._memory: dict[str, Memory] = {}  # parts directory URL -> what its collections carry over

    def finish(self, where: Placement, index: dict, outcomes: list[PartOutcome | None], blocking: float,
               started: float, stamp: CommitStamp | None = None) -> Verdict:
        """The verdict on one checkpoint: commit its index when every part is durable, else clean up.
        A None outcome: that rank did not save this checkpoint; the index then lists rank 0's part
        alone (a part in the index stands for its rank), and the others' parts are removed. ``stamp``:
        taken when the checkpoint was asked for; an index of this process asked for later, committed
        first (another checkpointer's, saving the same folder), stays: this one counts as replaced by
        it, as a synchronous save would have been (its parts are removed, no error)."""
        index_url = where.index_url
        parts = composite.part_urls(index_url, index)
        if any(o is None for o in outcomes):
            self._remove(where, [p for p, o in zip(parts[1:], outcomes[1:]) if o is not None])
            index, outcomes, parts = {**index, "parts": index["parts"][:1], "world_size": 1}, outcomes[:1], parts[:1]
        failed = [f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if o.error]
        if failed:
            self._remove(where, parts, collect_now=True)
            return Verdict(f"checkpoint {where.folder} not committed: " + "; ".join(failed))
        try:
            previous = self._previous_parts(index_url)
            info = self.engine.save(index, index_url, storage_options=self.storage_options, stamp=stamp).result()
        except Exception as exc:  # noqa: BLE001 - becomes the verdict on every rank
            self._remove(where, parts, collect_now=True)
            if getattr(exc.__cause__, "same_process", False):  # replaced by a later save_state of this process
                log.info("checkrun: %s: replaced by a later save of this process that committed first", index_url)
                return Verdict(None)
            return Verdict(f"checkpoint {where.folder} not committed: {exc}")
        self._remove(where, [p for p in previous if p not in parts])
        self._retain(where)
        figures = GroupFigures(where.folder, blocking, time.perf_counter() - started,
                               sum(o.tensor_bytes for o in outcomes), sum(o.written_bytes for o in outcomes)
                               + info.written_bytes, sum(o.stored_bytes for o in outcomes))
        return Verdict(None, figures)

    def _previous_parts(self, index_url: str) -> list[str]:
        """Parts of an index already at ``index_url`` (saving again under a name replaces it)."""
        try:
            manifest = self.engine.read_manifest(index_url, storage_options=self.storage_options)
            index = composite.index_of(manifest, index_url)
            if index is None:
                raise NotACheckpointError(f"{index_url} is a checkrun checkpoint but not a composite index")
            return composite.part_urls(index_url, index)
        except (CheckpointNotFoundError, FileNotFoundError, CheckrunError):
            return []

    def _retain(self, where: Placement) -> None:
        """Whole checkpoints beyond ``keep_last()`` of ``where.base`` (none in a folder of its own, no
        automatic naming), then a collection of their parts' blobs and of the parts removed since the
        last one (``retain.after_commit``): also the parts a save replaced in a folder saved into again,
        whose blobs nothing else collected (a fixed ``output_dir`` grew by every save)."""
        keep = self._keep_last() if where.base != where.folder else None
        retained = Composites(where.base, self.config, self.storage_options, keep,
                              frozenset(self._protected() | {where.name}), self.config.retention.gc_grace_seconds)
        try:
            with retained:
                store, name = retained.index_store(where.name)
                after_commit(store, name, self.config, memory=self._memory_of(retained.store.url("")),
                             retained=retained)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; retention retries next time
            log.warning("checkrun: retention in %s failed: %s", where.base, exc)

    def _remove(self, where: Placement, urls: list[str], collect_now: bool = False) -> None:
        """Best-effort removal of parts; their blobs become candidates of the next collection there.
        ``collect_now`` (the parts of a checkpoint that failed): that collection runs now. Nothing
        else records those blobs (the parts committed, their leases are gone), and the next commit may
        never come: a disk full of them fails every later save, and a process that ends forgets them."""
        if not urls:
            return
        with Composites(where.base, self.config, self.storage_options) as parts:
            for g in parts.remove_parts(urls):
                memory = self._memory_of(g.store.url(""))
                if g.candidates is None:
                    memory.full_due = True
                else:
                    memory.pending.update(g.candidates)
                if collect_now:
                    try:
                        collect(g.store, self.config, memory=memory,
                                candidates=None if memory.full_due else dict(memory.pending))
                    except CheckrunError as exc:  # the next commit's collection tries again
                        log.warning("checkrun: collecting the parts of %s failed: %s", where.folder, exc)

    def _memory_of(self, url: str) -> Memory:
        return self._memory.setdefault(url, Memory())

    def close(self) -> None:
        """Release the engine's threads."""
        self.engine.close()
