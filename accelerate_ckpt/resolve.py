"""Which index a ``load_state(path)`` means (rank 0, training thread).

``path`` may be what accelerate itself takes (a checkpoint folder such as
``{project_dir}/checkpoints/checkpoint_3``, absolute or relative), an index file (``...ckpt``: the
folder's ``checkrun.ckpt`` or an earlier release's ``ROOT/checkpoint_3.ckpt``), or a directory of
checkpoints (its newest committed one whose parts are readable and whose blobs all exist; older
ones are tried when not). A save in flight anywhere in this process counts: the
folder it writes resolves to its index (whose load then waits for the commit), and a directory is
listed only once no save under it is in flight.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import ckpt_core
from ckpt_core import CheckpointEngine, CheckpointNotFoundError, CheckrunError
from ckpt_core.errors import StorageError
from ckpt_core.loading.reader import require_readable
from ckpt_core.format import composite
from ckpt_core.saving import inflight
from ckpt_core.storage.store import Store

from . import layout
from .layout import INDEX_NAME, join

log = logging.getLogger("accelerate_ckpt")


def index_for(engine: CheckpointEngine, path: str | os.PathLike | None, default_root: str | None,
              storage_options: dict | None) -> str:
    """The index URL to load for ``path`` (None/"latest": the newest in ``default_root``)."""
    if path is None or path == "latest":
        if default_root is None:
            raise ValueError("no checkpoint directory to resume from: pass a path, or set "
                             "automatic_checkpoint_naming / checkpointing.accelerate.directory")
        return newest(engine, default_root, storage_options)
    text = layout.normalize(path)
    if text.endswith(".ckpt"):
        return text
    index = join(text, INDEX_NAME)
    if ckpt_core.save_in_flight(index, storage_options) or _exists(engine, index, storage_options):
        return index
    return newest(engine, text, storage_options)


def newest(engine: CheckpointEngine, root: str, storage_options: dict | None) -> str:
    """The newest committed checkpoint of ``root`` (after every save under it in this process)."""
    root = layout.normalize(root)
    inflight.wait_under(composite.dir_url(root, storage_options, engine.config))
    entries = layout.list_checkpoints(engine, root, storage_options)
    for e in entries:  # an index the storage failed to return may be the newest: never resume an older one
        require_readable(e.unreadable, e.url, e.error)
        if e.manifest is None:
            log.warning("accelerate_ckpt: skipping unreadable checkpoint %s: %s", e.url, e.error)
    if not any(e.manifest is not None for e in entries):  # a damaged only one is named (h112: it was not)
        damaged = "; ".join(str(e.error) if str(e.error).startswith(e.url) else f"{e.url}: {e.error}" for e in entries)
        raise CheckpointNotFoundError(f"no committed checkpoint in {root} (looked for folders holding "
                                      f"{INDEX_NAME} and for earlier releases' index files)"
                                      + (f"; unreadable: {damaged}" if damaged else ""))
    sizes: dict[str, dict[str, int]] = {}
    for e in reversed([e for e in entries if e.manifest is not None]):
        problem = _part_problem(engine, e.url, e.index, storage_options, sizes)
        if problem is None:
            return e.url
        log.warning("accelerate_ckpt: skipping checkpoint %s: %s", e.url, problem)
    raise CheckpointNotFoundError(f"no loadable checkpoint in {root}: every committed one has a part "
                                  "that is missing or unreadable, or misses blobs (warnings above)")


def _part_problem(engine: CheckpointEngine, url: str, index: dict | None, storage_options: dict | None,
                  sizes: dict[str, dict[str, int]]) -> str | None:
    """Why the checkpoint of index ``url`` cannot load, or None: each part must be a valid manifest
    whose blobs all exist with their size (as ``CheckpointEngine.latest(verify=False)`` checks a
    plain checkpoint; checksums are checked by the load). ``sizes``: blob sizes per blob store,
    listed once per call of ``newest``."""
    try:
        for part in composite.part_urls(url, composite.check_index(index, url)):
            manifest = engine.read_manifest(part, storage_options=storage_options)
            store = Store.for_directory(composite.parent(part), storage_options, engine.config.storage)
            have = sizes.get(store.cache_key)
            if have is None:
                have = sizes[store.cache_key] = {b.key: b.size if b.sized else -1 for b in store.list_blobs()}
            for b in manifest.blobs():
                if have.get(b.key) not in (b.size, -1):  # -1: a listing without sizes (http)
                    return f"missing or truncated blob {store.blob_path(b.key)} (part {part})"
    except StorageError:
        raise  # the storage failed, not the checkpoint: never resume an older one for it (as engine.latest)
    except CheckrunError as exc:
        return str(exc)
    return None


def _exists(engine: CheckpointEngine, index: str, storage_options: dict | None) -> bool:
    try:
        engine.read_manifest(index, storage_options=storage_options)
    except CheckpointNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class NativeFolder:
    """A checkpoint folder accelerate's own ``save_state`` wrote (what ``load_state`` then loads with
    accelerate's own loader, ``fallback_to_accelerate``)."""
    path: str


#: The names accelerate's own ``save_state`` gives its files (accelerate/checkpointing.py), exactly:
#: a user's ``model_best.pt`` or ``optimizer.pt`` in the folder is not one of them.
_RNG_NAME = re.compile(r"random_states_\d+\.pkl")
_NATIVE_NAME = re.compile(r"(?:model(?:_\d+)?\.safetensors|(?:pytorch_model|optimizer|scheduler|sampler|dl_state_dict)"
                          r"(?:_\d+)?\.bin|scaler\.pt|(?:random_states|custom_checkpoint)_\d+\.pkl)")


def native_folder(path: str | os.PathLike | None, default_root: str | None) -> NativeFolder | None:
    """For a ``load_state(path)`` that found no checkrun checkpoint: the local folder accelerate wrote
    that accelerate itself would load (``path`` itself; for None/"latest", or a directory of folders,
    its ``checkpoint_N`` with the highest N, as accelerate picks), or None."""
    text = default_root if path is None or path == "latest" else layout.normalize(path)
    if text is None or ("://" in text and not text.startswith("file://")):
        return None
    text = text.removeprefix("file://")
    if _is_native(text):
        return NativeFolder(text)
    try:
        numbered = [(int(m.group(1)), name) for name in os.listdir(text)
                    if (m := re.fullmatch(r"checkpoint_(\d+)", name)) and _is_native(os.path.join(text, name))]
    except OSError:
        return None
    return NativeFolder(os.path.join(text, max(numbered)[1])) if numbered else None


def _is_native(folder: str) -> bool:
    """A folder accelerate's own ``save_state`` wrote: its file names and the RNG states every such
    save writes. A folder holding only what a save hook wrote (``model.safetensors`` of a
    ``save_pretrained``) before the checkrun save that started it committed is not one: it was taken
    for one, and ``load_state()`` loaded its weights, then failed on the missing optimizer.bin (found
    by an independent check)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return INDEX_NAME not in names and any(_RNG_NAME.fullmatch(n) for n in names) and bool(_native_names(names))


def _native_names(names: list[str]) -> list[str]:
    return [n for n in names if _NATIVE_NAME.fullmatch(n)]


def native_files(folder: str) -> list[tuple[str, tuple]]:
    """The files accelerate's own ``save_state`` wrote in a local ``folder`` (a checkrun save into it
    replaces them once committed, as accelerate's save overwrites them), each with its identity now
    (``remove_native`` removes only those still unchanged), or []: also for a folder checkrun saved
    into before, whose files of such names a save hook or the user wrote, and for a folder without
    the RNG states every accelerate ``save_state`` writes (``save_model``'s ``model.safetensors``
    there is the user's inference copy)."""
    local = folder.removeprefix("file://")
    if "://" in local:
        return []
    try:
        names = os.listdir(local)
    except OSError:
        return []
    if INDEX_NAME in names or not any(_RNG_NAME.fullmatch(n) for n in names):
        return []  # checkrun saved here before, or accelerate's save_state never did
    found = []
    for name in _native_names(names):
        path = os.path.join(local, name)
        try:
            found.append((path, _identity(path)))
        except OSError:
            pass
    return found


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def remove_native(files: list[tuple[str, tuple]]) -> None:
    """Remove accelerate's files of a folder whose checkrun checkpoint just committed: the folder then
    holds one checkpoint, not checkrun's beside accelerate's older one. A file written since the save
    began is kept: a save hook wrote it (``save_pretrained`` into a reused ``output_dir``)."""
    for path, identity in files:
        try:
            if _identity(path) == identity:
                os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the checkpoint is committed; only the stale file stays
            log.warning("accelerate_ckpt: cannot remove %s, left from accelerate's own save_state: %s", path, exc)
