"""Why blobs a checkpoint needs are missing: the checkpoint was removed or replaced while it was read, or its
manifest was copied without its directory.

A process reading a directory that a trainer saves into (an evaluation job polling for new checkpoints) can
read a checkpoint that the trainer's retention (``keep_last``) removes, or a ``last.ckpt`` that its next save
replaces, while the blobs are read: the blobs only that checkpoint used go with it. That is no damage, so the
load raises ``CheckpointNotFoundError`` saying what happened and ``verify`` reports it, where both said
"missing blob" (found by h165).
"""
from __future__ import annotations

from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CheckrunError
from ..format.manifest import Manifest
from ..storage.paths import BLOB_DIR, join
from ..storage.store import Store
from .decode import read_manifest


def vanished(store: Store, name: str, manifest: Manifest, config: EngineConfig) -> CheckpointNotFoundError | None:
    """The error to raise instead of a missing blob when the manifest ``manifest`` read from ``name`` is no
    longer there (or another save's is); None if it still is (or cannot be read again: the first error stands)."""
    try:
        if not store.manifest_exists(name):
            what, advice = "was removed", "load a newer one (latest())"
        else:
            now = read_manifest(store, name, config)
            if now.commit == manifest.commit and now.blob_keys() == manifest.blob_keys():
                return None
            what, advice = "was replaced by a newer save", "load it again"
    except CheckrunError:
        return None
    return CheckpointNotFoundError(
        f"{store.url(name)}: {what} while it was being read (the blobs only it used went with it: retention of a "
        f"process saving into this directory, e.g. keep_last); not damaged: {advice}")


def copied_hint(store: Store) -> str:
    """For a load that misses blobs: a hint when the directory has no blobs at all (a manifest
    copied or downloaded alone: ``torch.hub``, ``cp last.ckpt elsewhere``)."""
    try:
        alone = not store.fs.isdir(join(store.root, BLOB_DIR))
        if alone and store.fs.isfile(first := join(store.root, BLOB_DIR.split("/")[0])):
            return f" ({first} is a file, not the folder of the blobs)"
    except Exception:  # noqa: BLE001 - only a hint: the error it adds to stands
        return ""
    return (f" (there is no {BLOB_DIR} folder beside the manifest: a checkrun .ckpt file holds no tensors, the "
            "folder does; copy the whole directory, or make a self-contained file with `checkrun export` where "
            "the directory is)"
            if alone else "")
