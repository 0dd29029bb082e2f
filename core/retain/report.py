"""``GCReport``: what a garbage collection (``retention.collect_garbage``) found and deleted; ``CheckpointEntry``:
one manifest file of a directory as ``retention.list_checkpoints`` lists it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..format.manifest import FUTURE_SLACK_SECONDS, Manifest


@dataclass
class GCReport:
    """What garbage collection found and (unless ``dry_run``) deleted."""

    directory: str
    dry_run: bool
    deleted: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_young: int = 0
    """Unreferenced blobs kept because younger than the grace (directories of older versions, or an
    explicit ``grace_seconds``)."""
    referenced: int = 0
    problems: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    """Temp files of interrupted writes (deleted unless ``dry_run``): of a process that ended, or older
    than ``lease_seconds`` (and the grace)."""
    kept_leased: int = 0
    """Unreferenced blobs kept because a live lease protects them (saves in flight)."""
    leases: int = 0
    """Processes with saves in flight whose live leases were seen (a save of more than 1,024 blobs holds
    several lease objects; two saves in flight in one process count once)."""
    pending: dict = field(default_factory=dict)
    """Candidates neither deleted nor referenced (leased, or not reached): worth trying again."""
    step_log: list[str] = field(default_factory=list)
    """Step-log objects (segments, markers, run objects) deleted (or, ``dry_run``, that would be)."""


@dataclass(frozen=True)
class CheckpointEntry:
    """One manifest file of a directory; ``manifest`` is None and ``error`` set if it is corrupt."""

    name: str
    url: str
    mtime: float
    size: int
    manifest: Manifest | None
    error: str | None = None
    unreadable: bool = False
    """``error`` is the storage's (a ``StorageError`` after retries), not the file's: it may be intact."""
    head: tuple[float, dict | None] | None = None
    """``(created, commit)`` from the manifest's first bytes (``list_checkpoints(heads=True)``, with
    ``manifest`` None and no ``error``): ordered without parsing it, not checked yet; or, with ``keys``,
    from the parsed manifest."""
    keys: frozenset[str] | None = None
    """``list_checkpoints(keys=True)``: the blob keys the parsed manifest references (``manifest`` None:
    not held)."""

    @property
    def created(self) -> float:
        """The manifest's commit time; its file's time when it has none or claims one later than
        ``FUTURE_SLACK_SECONDS`` ahead of this host's clock (if that is earlier)."""
        if self.manifest is None and self.head is None:
            return self.mtime
        created = self.manifest.created if self.manifest is not None else self.head[0]
        return min(created, self.mtime) if created > time.time() + FUTURE_SLACK_SECONDS else created

    @property
    def commit(self) -> dict | None:
        """The manifest's commit stamp (``saving.fence``), if it has one."""
        return self.manifest.commit if self.manifest is not None else self.head[1] if self.head else None
