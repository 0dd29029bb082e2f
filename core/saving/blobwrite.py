"""Stage: write. ``BlobWriter`` puts the blobs of a save: chunks, packs, row indices, objects.

Shared by every save path (``write.SnapshotWriter``, ``dcp.blobs.ItemWriter``): a chunk's content
address is computed from its raw bytes before encoding; a blob of the index is reused once its
stored bytes were checked (``blobcheck``), a stored blob of the same content adopted, anything
else encoded and written under the save's lease.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import xxhash

from ..codecs import EncodeStats, Pipeline, index_pipeline
from ..format.manifest import BlobRef, ChunkRef
from ..storage.store import Store
from .blobcheck import StoredBlob, adoptable, notice, trusted
from .lease import SaveLease
from .streams import DirState


@dataclass(frozen=True)
class ChunkResult:
    ref: ChunkRef
    written: int
    stats: EncodeStats | None


def blob_key(prefix: str, data: torch.Tensor | bytes) -> str:
    h = xxhash.xxh3_128(prefix.encode())
    h.update(memoryview(data.numpy()) if isinstance(data, torch.Tensor) else data)
    return h.hexdigest()


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.numel() else t.view(torch.uint8)


class BlobWriter:
    """Puts the blobs of one save into ``store`` under its ``lease``; any thread.

    ``known``: the blob index a chunk may be reused from (default ``dirstate.index``); ``stats_of``:
    the encode stats of a known lossy blob (default ``dirstate.stats``). ``look_first`` (DCP ranks,
    which have no pass over all blobs before their commit): name each key in the lease and check
    that its blob exists before reusing it, and store each content once per save (identical chunks,
    zeros, are common) while other threads wait for it."""

    def __init__(self, store: Store, dirstate: DirState, lease: SaveLease, max_blob_bytes: int, *,
                 known: Mapping[str, BlobRef] | None = None,
                 stats_of: Callable[[str], EncodeStats | None] | None = None, look_first: bool = False) -> None:
        self.store, self.dir, self.lease, self.max_blob_bytes = store, dirstate, lease, max_blob_bytes
        self.known = dirstate.index if known is None else known
        self.stats_of = dirstate.stats.get if stats_of is None else stats_of
        self.look_first = look_first
        self.written: dict[str, BlobRef] = {}
        """Blobs this save wrote (key -> reference): trusted by this save only."""
        self.touched: dict[str, BlobRef] = {}
        """Every blob this save's chunks and objects reference."""
        self._inflight: dict[str, Future] | None = {} if look_first else None
        self._lock = threading.Lock()

    def put_chunk(self, array2d: torch.Tensor, off: int, pipeline: Pipeline, prefix: str,
                  force: bool = False) -> ChunkResult:
        """Store one chunk, or reuse its stored blob once that was checked (``blobcheck``).
        ``force``: write it whatever is stored."""
        self.lease.renew_if_due()  # the save's threads renew its lease as they work
        rows, cols = array2d.shape
        key = blob_key(f"{prefix}|{rows}x{cols}|", _as_bytes_view(array2d).reshape(-1))
        if self._inflight is None:
            ref, written, stats = self._store(key, array2d, pipeline, force)
        else:
            ref, written, stats = self._store_once(key, array2d, pipeline, force)
        self.touched[key] = ref
        return ChunkResult(ChunkRef(off, rows, cols, ref), written, stats if pipeline.lossy else None)

    def _store_once(self, key: str, array2d: torch.Tensor, pipeline: Pipeline, force: bool):
        with self._lock:
            owner = self._inflight.get(key)
            if owner is None:
                self._inflight[key] = mine = Future()
        if owner is not None:
            ref, _, stats = owner.result()
            return ref, 0, stats
        try:
            out = self._store(key, array2d, pipeline, force)
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        mine.set_result(out)
        return out

    def _store(self, key: str, array2d: torch.Tensor, pipeline: Pipeline, force: bool):
        """A blob in the index is reused without encoding once its stored bytes match the indexed
        reference and (lossy) its error is known; otherwise the chunk is encoded, and the stored
        blob adopted if it holds the same content, else (missing, rotted, ``force``) written."""
        stored = StoredBlob(self.store, key, self.max_blob_bytes)
        exists = True  # an ordinary save checks existence of all reused blobs at once before its commit
        if self.look_first:
            self.lease.cover([key])  # before looking: once named, a blob found stays
            info = self.store.blob_info(key)
            notice(self.dir, [info])
            exists = info is not None
        known = None if force or not exists else self.known.get(key)
        if known is not None and trusted(self.dir, known, stored):
            stats = self.stats_of(key)
            if stats is not None or not pipeline.lossy:
                return known, 0, stats
        data, stats = pipeline.encode(array2d)
        fresh = BlobRef(key, len(data), xxhash.xxh3_64_hexdigest(data))
        ref = None if force or not exists else adoptable(self.dir, fresh, data, array2d, pipeline, stored)
        if ref is not None:
            return ref, 0, stats
        self.write_blob(fresh, data)
        return fresh, len(data), stats

    def write_blob(self, ref: BlobRef, data: bytes | memoryview) -> None:
        """Put a blob, once the lease names it (no collection can take it)."""
        self.lease.cover([ref.key])
        self.store.put_blob(ref.key, data)
        # Written, not read back: the first save that reuses it checks it.
        self.dir.distrust(ref.key)
        self.written[ref.key] = ref

    def put_pack(self, parts: list[torch.Tensor], pipeline: Pipeline) -> ChunkResult:
        """Concatenate the bytes of ``parts`` (same element size) and store them as one blob."""
        buf = torch.empty(sum(p.nbytes for p in parts), dtype=torch.uint8)
        pos = 0
        for p in parts:
            buf[pos:pos + p.nbytes] = p.reshape(-1).view(torch.uint8)
            pos += p.nbytes
        data = buf.view(parts[0].dtype).view(1, -1)
        return self.put_chunk(data, 0, pipeline, f"{pipeline.spec_id}|pack")

    def put_index(self, idx: torch.Tensor) -> tuple[BlobRef, int]:
        """Store the row indices of a delta (always the fixed ``index_pipeline``)."""
        pipeline = index_pipeline()
        res = self.put_chunk(idx.view(1, -1), 0, pipeline, f"{pipeline.spec_id}|index")
        return res.ref.blob, res.written

    def put_object(self, payload: bytes) -> tuple[BlobRef, int]:
        """Store a serialized object; (its reference, bytes written)."""
        key = blob_key("object|", payload)
        ref = BlobRef(key, len(payload), xxhash.xxh3_64_hexdigest(payload))
        self.touched[key] = ref
        # Objects are few and small: always look at the stored blob, never trust the index, and
        # compare its bytes once per engine (the object's own bytes are its only valid encoding).
        stored = StoredBlob(self.store, key, self.max_blob_bytes)
        self.lease.cover([key])  # before looking: once named, a blob found stays
        info = self.store.blob_info(key)
        notice(self.dir, [info])
        if info is not None and trusted(self.dir, ref, stored):
            return ref, 0
        self.write_blob(ref, payload)
        return ref, len(payload)
