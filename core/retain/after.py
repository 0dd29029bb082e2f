"""Step 6 right after a commit: retention, then collection of what it made garbage, for every save path.

``after_commit`` is the one place the engine's coordinator, the DCP coordinator rank and the Accelerate
adapter's index commit run retention and prompt garbage collection. What retention counts and removes
is a ``Retained`` policy: ``Manifests`` (the checkpoint files of one directory, ``retention.keep_last``)
or ``retain.composites.Composites`` (whole composite checkpoints: index, parts and folder). It returns
the ``Garbage`` it made: the blobs the removed checkpoints referenced, per blob store, collected at
once without listing the store (a *targeted* collection, see ``retention.collect_garbage``).

A ``GcMemory`` (the engine keeps one per directory: ``saving.streams.DirState``) carries what a
collection could not finish to the next commit there: candidates a live lease still protected, the
blobs of checkpoints ``remove`` deleted, and whether the next one must list everything.
Runs on the thread that committed (the engine's coordinator, DCP's coordinator rank, rank 0's commit
thread). A failure is logged, never raised: the checkpoint is committed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CheckrunError
from ..format.manifest import BlobRef
from ..storage.store import Store
from .retention import GCReport, apply_retention, blob_sizes, collect_garbage

log = logging.getLogger("ckpt_core")

Forget = Callable[[list[str]], None]
"""Told the keys of the blobs a collection deleted (e.g. the writer process's blob index)."""


class GcMemory(Protocol):
    """What a directory's collections carry from one to the next (``saving.streams.DirState`` is one)."""

    pending: dict
    """Blob key -> size: candidates of the next collection here."""
    full_due: bool
    """The next collection here lists every blob."""
    leases_seen: bool
    """The last collection here saw live leases of other saves: look again at the next commit."""

    def forget(self, keys: list[str]) -> None:
        """Blobs that garbage collection deleted."""


@dataclass
class Memory:
    """A ``GcMemory`` of its own, for a caller without a ``DirState`` (the Accelerate index commit)."""

    pending: dict = field(default_factory=dict)
    full_due: bool = False
    leases_seen: bool = False

    def forget(self, keys: list[str]) -> None:
        """Nothing else to forget here."""


@dataclass(frozen=True)
class Garbage:
    """Blobs that retention made unreferenced in one blob store."""

    store: Store
    candidates: dict[str, int] | None
    """Blob key -> size; None: unknown (a removed checkpoint could not be read): list every blob."""


class Retained(Protocol):
    """A retention policy: what it counts and removes after a commit, and where their blobs live."""

    store: Store
    """The blob store of the checkpoints it retains (its collections use the caller's ``GcMemory``)."""

    def remove_oldest(self, keep: set[str]) -> list[Garbage]:
        """Remove the oldest checkpoints beyond the limit, never one named in ``keep``."""


@dataclass(frozen=True)
class Manifests:
    """The checkpoint files of one directory, ``retention.keep_last`` of them kept."""

    store: Store
    config: EngineConfig

    def remove_oldest(self, keep: set[str]) -> list[Garbage]:
        """``retention.apply_retention``: their blobs are the candidates."""
        removed = apply_retention(self.store, self.config, keep=keep)
        return [Garbage(self.store, blob_sizes(removed))] if removed else []


def after_commit(store: Store, name: str, config: EngineConfig, *, memory: GcMemory | None = None,
                 forget: Forget | None = None, retained: Retained | None = None) -> None:
    """After the commit of ``name`` in ``store``: retention (``retained``, default ``Manifests``), then,
    with ``retention.gc_after_save``, a targeted collection of what it removed and of ``memory``'s
    pending candidates (a full one when ``memory.full_due`` or a removed checkpoint was unreadable).

    ``name`` itself is never removed. Without a ``memory`` nothing carries over: only retention's own
    garbage is collected. ``forget``: told the keys each collection deleted. Never raises."""
    retained = retained if retained is not None else Manifests(store, config)
    try:
        garbage = retained.remove_oldest({name})
        if not config.retention.gc_after_save:
            return
        home = retained.store
        rounds = _rounds(home, garbage, memory)
    except CheckrunError as exc:
        log.warning("checkrun: retention/gc after saving %s failed: %s", store.url(name), exc)
        return
    for store_, candidates in rounds:  # one failing store does not keep the others from collecting
        mine = store_.url("") == home.url("")  # memory and forget describe the home store only
        try:
            collect(store_, config, memory=memory if mine else None, candidates=candidates,
                    forget=forget if mine else None)
        except CheckrunError as exc:
            log.warning("checkrun: retention/gc after saving %s failed: %s", store.url(name), exc)


def _rounds(home: Store, garbage: list[Garbage], memory: GcMemory | None) -> list[tuple[Store, dict | None]]:
    """The collections to run: one per blob store with garbage, and ``home`` with ``memory``'s
    pending candidates or its lease to look at again."""
    merged: dict[str, tuple[Store, dict | None]] = {}
    for g in garbage:
        key = g.store.url("")
        seen = merged.get(key, (g.store, {}))[1]
        merged[key] = (g.store, None if seen is None or g.candidates is None else {**seen, **g.candidates})
    if memory is None:
        return list(merged.values())
    _, cands = merged.pop(home.url(""), (home, {}))
    rounds = list(merged.values())
    if memory.full_due or cands is None:
        return [(home, None), *rounds]
    cands = {**memory.pending, **cands}
    return [(home, cands), *rounds] if cands or memory.leases_seen else rounds


def note_removed(memory: GcMemory, blobs: Callable[[], Iterable[BlobRef]]) -> None:
    """A checkpoint is being removed: its ``blobs()`` become candidates of the next collection in its
    directory (every blob there, if its manifest cannot be read; none, if it is already gone)."""
    try:
        memory.pending.update((b.key, b.size) for b in blobs())
    except CheckpointNotFoundError:
        pass
    except CheckrunError:  # unreadable: its blobs are unknown, the next collection here lists them
        memory.full_due = True


def collect(store: Store, config: EngineConfig, *, memory: GcMemory | None = None,
            grace_seconds: float | None = None, dry_run: bool = False, candidates: dict[str, int] | None = None,
            forget: Forget | None = None, removed: frozenset = frozenset()) -> GCReport:
    """``retention.collect_garbage``, keeping ``memory`` up to date: what was left (leased, not
    reached) becomes its pending candidates, and deleted blobs are forgotten (``memory`` and
    ``forget``). ``candidates=None``: a full collection."""
    report = collect_garbage(store, config, grace_seconds=grace_seconds, dry_run=dry_run, candidates=candidates,
                             removed=removed)
    if dry_run:
        return report
    if memory is not None:
        if not report.problems:
            memory.pending = dict(report.pending)
            memory.full_due = memory.full_due and candidates is not None
            memory.leases_seen = report.leases > 0
        elif candidates is None:  # a round that collected nothing (a manifest unreadable or gone twice):
            memory.full_due = True  # its garbage is looked for again at the next one
        else:
            memory.pending.update(candidates)
        memory.forget(list(report.deleted))
    if forget is not None:
        forget(list(report.deleted))
    return report
