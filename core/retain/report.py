"""``GCReport``: what a garbage collection (``retention.collect_garbage``) found and deleted."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    """Live leases of saves in flight seen."""
    pending: dict = field(default_factory=dict)
    """Candidates neither deleted nor referenced (leased, or not reached): worth trying again."""
    step_log: list[str] = field(default_factory=list)
    """Step-log objects (segments, markers, run objects) deleted (or, ``dry_run``, that would be)."""
