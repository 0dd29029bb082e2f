"""Checks of a stored blob before a save reuses it instead of writing it.

Why: content addressing skips writing a blob whose key exists, so a blob whose stored bytes rotted
(a flipped bit, a truncation) would otherwise be referenced by every later checkpoint of the same
content, each of which would then fail to load. A save therefore reuses a stored blob only once its
bytes were read and found to match the reference it is about to write into the manifest; a bad one
is written again (``Store.put_blob`` is atomic), which also repairs the older checkpoints that
referenced it, since encodings are deterministic.

Cost: one read of each reused blob per engine (per ``DirState``, so per directory and process):
the first save that reuses a blob reads it, later saves trust the cached result
(``DirState.verified``) as long as the stored file is the one that was read: every save looks at
each blob it reuses anyway (a stat/HEAD, to see that it exists before its commit), and a blob whose
size, times, inode or ETag changed since it was checked (rewritten in place, truncated, replaced:
``BlobInfo.version``) is read again (``notice``). Blobs the engine wrote itself count as unchecked
until that first reuse; blobs a load read and verified count as checked, with the version the next
save sees. Reads are bounded by ``load.max_blob_bytes``.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
import xxhash

from ..codecs import Pipeline
from ..errors import CorruptCheckpointError
from ..format.manifest import BlobRef
from ..storage.paths import BlobInfo
from ..storage.store import Store
from .streams import DirState

log = logging.getLogger("ckpt_core")


class StoredBlob:
    """The stored bytes of one blob, read at most once and only when first asked for."""

    def __init__(self, store: Store, key: str, max_bytes: int, info: BlobInfo | None = None) -> None:
        self.store, self.key, self.max_bytes = store, key, max_bytes
        self._info = info  # a look taken just before (the save's existence check): not taken again
        self._read = False
        self._data: bytes | None = None
        self.version: tuple | None = None
        """The stored file's ``BlobInfo.version``, taken before its bytes were read (a change
        after the read shows as another version at the next look)."""

    def data(self) -> bytes | None:
        """The stored bytes, or None if the blob is missing or larger than ``max_bytes``
        (either way it has to be written)."""
        if not self._read:
            self._read = True
            info = self._info or self.store.blob_info(self.key)
            try:
                self._data = None if info is None else self.store.get_blob(self.key, self.max_bytes)
            except CorruptCheckpointError:
                self._data = None
            self.version = None if info is None else info.version
        return self._data

    def matches(self, ref: BlobRef) -> bool:
        """Whether the stored bytes are exactly those ``ref`` describes (size and checksum)."""
        data = self.data()
        return data is not None and len(data) == ref.size and xxhash.xxh3_64_hexdigest(data) == ref.csum

    def ref(self) -> BlobRef:
        """The reference of the stored bytes as they are (call only when ``data()`` is not None)."""
        data = self.data()
        assert data is not None
        return BlobRef(self.key, len(data), xxhash.xxh3_64_hexdigest(data))


def trusted(dirstate: DirState, ref: BlobRef, stored: StoredBlob) -> bool:
    """Whether the stored blob is ``ref``: checked before by this engine (or a load), or now."""
    if dirstate.verified.get(ref.key) == ref:
        return True
    if stored.matches(ref):
        _checked(dirstate, ref, stored)
        return True
    return False


def _checked(dirstate: DirState, ref: BlobRef, stored: StoredBlob) -> None:
    dirstate.verified[ref.key] = ref
    if stored.version is not None:
        dirstate.seen[ref.key] = stored.version


CLOCK_MARGIN = 2.0
"""Seconds before a load's start from which a blob's modification time counts as "modified since
the load read it": covers coarse file timestamps and an object store's clock a little behind ours
(a blob written just before the load is read once more, in the background, by the next save)."""


def notice(dirstate: DirState, infos: Iterable[BlobInfo | None]) -> None:
    """What a save's look at blobs it reuses found (``Store.blob_info``; None: missing): a checked
    blob whose stored file has another version than when it was checked, or (checked by a load)
    was modified after the load started, counts as unchecked again, so the save reads it before
    trusting it; otherwise its version now is the one later looks compare with."""
    for info in infos:
        if info is None or info.key not in dirstate.verified:
            continue
        seen = dirstate.seen.get(info.key)
        if isinstance(seen, float):  # ctime too: a rewrite that put the mtime back was trusted (independent check)
            changed = max(info.mtime, info.changed) >= seen - CLOCK_MARGIN
        else:
            changed = seen is not None and seen != info.version
        if changed:
            log.info("checkrun: blob %s changed since it was checked; reading it again", info.key)
            dirstate.distrust(info.key)
        else:
            dirstate.seen[info.key] = info.version


def adoptable(dirstate: DirState, fresh: BlobRef, data: bytes | memoryview, array2d: torch.Tensor,
              pipeline: Pipeline, stored: StoredBlob) -> BlobRef | None:
    """The reference to write for a chunk whose blob may already be stored, or None to write it.

    ``fresh`` describes ``data``, this save's encoding of ``array2d``. A stored blob with the same
    bytes is adopted; one with other bytes is adopted only if it decodes to what ``data`` decodes
    to (an encoder of another version wrote it, and older checkpoints reference its checksum, so
    it must not be overwritten); anything else (missing, rotted, truncated) is written again."""
    if trusted(dirstate, fresh, stored):
        return fresh
    raw = stored.data()
    if raw is None or not same_content(raw, data, array2d, pipeline):
        return None
    ref = stored.ref()
    _checked(dirstate, ref, stored)
    return ref


def same_content(stored: bytes, data: bytes | memoryview, array2d: torch.Tensor, pipeline: Pipeline) -> bool:
    """Whether ``stored`` decodes to the same values as ``data`` (the encoding of ``array2d``)."""
    shape, dtype = tuple(array2d.shape), array2d.dtype
    limit = 2 * array2d.numel() * array2d.element_size() + 16 * shape[0] + 4096
    try:
        got = pipeline.decode(stored, shape, dtype, limit)
        want = pipeline.decode(data, shape, dtype, limit) if pipeline.lossy else array2d
    except Exception:  # noqa: BLE001 - whatever a damaged blob makes a decoder raise: not valid
        return False
    return torch.equal(_bytes(got), _bytes(want))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else torch.empty(0, dtype=torch.uint8)


def check_reused(store: Store, dirstate: DirState, refs: list[BlobRef], max_bytes: int,
                 infos: dict[str, BlobInfo] | None = None) -> list[bool]:
    """For references a save keeps without passing them through its encoder (the base and older
    deltas of a row-delta save): whether each stored blob matches. Unchecked ones are read in
    parallel on the store's io threads (``Store.map``). ``infos``: the save's look at them just
    before (key -> ``BlobInfo``), whose version a read records instead of looking again."""
    def check(ref: BlobRef) -> bool:
        return trusted(dirstate, ref, StoredBlob(store, ref.key, max_bytes, (infos or {}).get(ref.key)))

    todo = [r for r in refs if dirstate.verified.get(r.key) != r]
    bad = {r for r, ok in zip(todo, store.map(check, todo, cost=lambda r: r.size)) if not ok}
    return [r not in bad for r in refs]
