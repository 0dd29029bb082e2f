"""On-storage naming of an Accelerate checkpoint and its index (retention by whole checkpoints is
core's: ``ckpt_core.retain.composites``, run by ``ckpt_core.saving.composite.CompositeCommitter``).

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

import os
from dataclasses import dataclass

from ckpt_core import CheckpointEngine
from ckpt_core.format import composite
from ckpt_core.format.composite import INDEX_NAME, PARTS_DIR, Composite, join, parent
from ckpt_core.retain.composites import checkpoint_key, list_in

__all__ = ["Target", "join", "parent", "checkpoint_key", "INDEX_NAME", "PARTS_DIR"]


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


def folder_of(index_url: str) -> str:
    """What ``load_state``/``latest`` report for an index: its folder (legacy: the index itself)."""
    return parent(index_url) if index_url.rpartition("/")[2] == INDEX_NAME else index_url


def read_index(engine: CheckpointEngine, url: str, storage_options: dict | None) -> dict:
    """Load and check an index (waits for a save to ``url`` in flight in this process)."""
    index = engine.load(url, map_location="cpu", storage_options=storage_options)
    return composite.check_index(index, url)


def part_urls(index_url: str, index: dict) -> list[str]:
    """Absolute paths/URLs of an index's parts."""
    return composite.part_urls(index_url, index)


def list_checkpoints(engine: CheckpointEngine, root: str, storage_options: dict | None) -> list[Composite]:
    """Committed (and unreadable) checkpoints of ``root``, oldest first (no waiting)."""
    return list_in(root, storage_options, engine.config)
