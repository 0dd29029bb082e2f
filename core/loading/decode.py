"""One pass over the blobs of a load: every base chunk, pack and delta link of every tensor is
fetched, verified and decoded by one ``Store.map`` on the store's io threads, straight into its
destination (the tensor, or the link's own index and value buffers), never into a fresh tensor.

A tensor with deltas counts down its outstanding blobs; the io thread that decodes its last one
applies the links in chain order (``index_copy_``: where links change the same row, the newest
wins) and then makes the engine's second copy, while the other threads go on reading. A delta
chain therefore costs no round trip per link: its blobs are read in the same pass, before the
bases (``Pass.run``).

Every blob is checked against the manifest's size and xxh3 checksum before a decoder sees it, and
every decoder is bounded by the size the manifest declares.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch
import xxhash

from ..codecs import Pipeline, index_pipeline
from ..codecs._common import CROWS_ABI, load_native, tensor_bytes
from ..config import EngineConfig
from ..errors import CheckrunError, CorruptCheckpointError, FormatError
from ..format.limits import limits_for
from ..format.manifest import (SNIFF_BYTES, BlobRef, ChunkRef, DeltaRef, Manifest, is_manifest_head, looks_damaged,
                               parse_manifest)
from ..storage.paths import blob_url
from ..storage.store import Store

log = logging.getLogger("ckpt_core")

#: ``alloc(numel, dtype, what)``: a host tensor for a link's buffers (the load's allocator).
Alloc = Callable[[int, torch.dtype, str], torch.Tensor]
#: ``scratch(slot, nbytes)``: a per-thread reusable byte buffer (``reader.Scratch.get``).
ScratchGet = Callable[[Hashable, int], memoryview]


def read_manifest(store: Store, name: str, config: EngineConfig) -> Manifest:
    """Read and validate the manifest ``name`` of ``store`` (errors name its URL). One that does not
    check (checksum, cut short) is read once more, as ``fetch_blob`` reads a blob: bytes damaged in
    transit are not a damaged checkpoint (a flipped byte failed the load of an intact one: h102)."""
    first = None
    while True:
        try:
            data = store.read_manifest(name)
        except CorruptCheckpointError:  # larger than any manifest: a big file of another kind says so
            if not is_manifest_head(head := store.read_head(name, SNIFF_BYTES)) and not looks_damaged(head):
                parse_manifest(head, store.url(name))  # NotACheckpointError, as for a small such file
            raise
        try:
            manifest = parse_manifest(data, store.url(name), limits=limits_for(config))
        except CorruptCheckpointError as exc:
            if first is not None:
                raise
            first = exc
            continue
        if first is not None:
            log.warning("checkrun: %s on the first read, the second matched (bytes damaged in transit)", first)
        return manifest


def fetch_blob(store: Store, ref: BlobRef, buf: memoryview | None = None) -> bytes | memoryview:
    """Read one blob and check its size and checksum before anything uses it.

    With ``buf`` (at least ``ref.size + 1`` bytes) a local store reads into it and the result
    aliases it."""
    first = None
    for _ in (1, 2):  # a mismatch is read once more: bytes damaged or cut short in transit, not at rest
        data = store.get_blob(ref.key, ref.size) if buf is None else store.get_blob_into(ref.key, ref.size, buf)
        if len(data) != ref.size:  # a short read too (a body cut off, no response checksum: found by h57)
            what = "size mismatch"
            why = (f"size {len(data)} != {ref.size} declared in the manifest (truncated or replaced blob)"
                   if len(data) < ref.size else  # read one byte past the declared size: its real size is unknown
                   f"larger than the {ref.size} bytes declared in the manifest (replaced or appended to)")
        elif xxhash.xxh3_64_hexdigest(data) == ref.csum:
            if first is not None:
                log.warning("checkrun: %s: %s on the first read, the second matched (bytes damaged in transit)",
                            blob_url(store, ref.key), first)
            return data
        else:
            what, why = "checksum mismatch", "checksum mismatch (corrupted blob)"
        first = first or what
    raise CorruptCheckpointError(f"{blob_url(store, ref.key)}: {why}")


def decode_limit(chunk: ChunkRef, dtype: torch.dtype) -> int:
    """Most bytes any stage of a chunk's pipeline may produce (raw size, quantization scales)."""
    raw = chunk.rows * chunk.cols * dtype.itemsize
    return 2 * raw + 16 * chunk.rows + 4096


def pack_limit(total: int) -> int:
    """Most bytes any stage of a pack's pipeline may produce."""
    return 2 * total + 4096


@dataclass
class Link:
    """One delta of a tensor, decoded by the pass: its row indices and the new values of those rows."""

    ref: DeltaRef
    idx: torch.Tensor
    values: torch.Tensor | None


@dataclass
class Target:
    """What the pass fills for one tensor: ``flat`` (and ``copy``, the engine's second copy), then its
    links applied in order. ``loaded`` is the reader's ``LoadedTensor`` (gets ``delta_indices``)."""

    loaded: Any
    pipe: Pipeline
    links: list[Link] = field(default_factory=list)
    remaining: int = 0

    @property
    def flat(self) -> torch.Tensor:
        return self.loaded.flat

    @property
    def copy(self) -> torch.Tensor | None:
        return self.loaded.copy


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` (same dtype and size) in numpy: one thread, no torch intra-op pool."""
    if src.numel():
        np.copyto(np.frombuffer(tensor_bytes(dst), np.uint8), np.frombuffer(tensor_bytes(src), np.uint8))


class Pass:
    """The tasks of one load, run by ``run`` (one ``Store.map``); built by ``add`` per tensor."""

    def __init__(self, store: Store, where: str, scratch: ScratchGet, alloc: Alloc,
                 stop: threading.Event | None = None) -> None:
        self.store, self.where, self.scratch, self.alloc = store, where, scratch, alloc
        self.stop = stop  # set: every blob not fetched yet raises instead (the rest is cancelled; nobody wants it)
        self.tasks: list[tuple] = []  # (cost in bytes, method, its arguments): base chunks
        self._links: list[tuple] = []  # the same for delta links: read first (``run``)
        self._packs: dict[tuple, list] = {}
        self._index = index_pipeline()
        self._lock = threading.Lock()

    def add(self, loaded: Any, pipe: Pipeline, dtype: torch.dtype) -> None:
        """Queue every blob of ``loaded.record``: base chunks (parts of one pack together), and
        each link's index and value chunks, in chain order."""
        target = Target(loaded, pipe)
        rec = loaded.record
        for chunk in rec.base:
            if chunk.part is None:
                self.tasks.append((chunk.blob.size, self._base, (target, chunk, dtype)))
            else:
                key = (chunk.blob, chunk.part[1], pipe.spec_id, dtype.itemsize)
                self._packs.setdefault(key, []).append((target, chunk, dtype))
        if not rec.deltas:
            return
        cols = rec.row_shape[1]
        values = self.alloc(sum(d.n for d in rec.deltas) * cols, dtype, f"delta rows of tensor {rec.key!r}")
        start = 0
        for delta in rec.deltas:
            link = Link(delta, self.alloc(delta.n, torch.int64, f"delta row indices of tensor {rec.key!r}"),
                        values[start:start + delta.n * cols])
            start += delta.n * cols
            target.links.append(link)
            self._links.append((delta.idx.size, self._link_index, (target, link)))
            self._links.extend((chunk.blob.size, self._link_values, (target, link, chunk)) for chunk in delta.chunks)
        target.remaining = len(rec.base) + sum(1 + len(d.chunks) for d in rec.deltas)

    def run(self) -> None:
        """Fetch, verify and decode every queued blob on the store's io threads (errors: the first
        one raised, see ``Store.map``). The delta links go first: many small blobs, whose cold reads
        wait on the disk more per byte than the bases' large ones, are then read while the io
        threads have no decoding backlog, and the bases stream after them (DLRM state at the end of
        a chain of 8, cold, medians of 9: 0.312 s instead of 0.359 s; a full restore is unchanged)."""
        tasks = (self._links + self.tasks
                 + [(m[0][1].blob.size, self._pack, (m,)) for m in self._packs.values()])
        self.tasks, self._links, self._packs = [], [], {}
        self.store.map(lambda task: task[1](*task[2]), tasks, cost=lambda task: task[0])

    # -- tasks (io threads) ----------------------------------------------------------------------
    def _fetch(self, ref: BlobRef) -> bytes | memoryview:
        if self.stop is not None and self.stop.is_set():
            raise CheckrunError(f"{self.where}: stopped (the engine closed)")
        return fetch_blob(self.store, ref, self.scratch(-1, ref.size + 1))

    def _decode(self, pipe: Pipeline, ref: BlobRef, dest: torch.Tensor, limit: int) -> None:
        data = self._fetch(ref)
        try:
            pipe.decode_into(data, dest, limit, self.scratch)
        except FormatError as exc:
            raise FormatError(f"{blob_url(self.store, ref.key)}: {exc}") from None

    def _base(self, target: Target, chunk: ChunkRef, dtype: torch.dtype) -> None:
        n = chunk.rows * chunk.cols
        dest = target.flat[chunk.off:chunk.off + n].view(chunk.rows, chunk.cols)
        self._decode(target.pipe, chunk.blob, dest, decode_limit(chunk, dtype))
        if target.copy is not None and not target.links:  # while the chunk is hot in cache
            _copy_bytes(target.copy[chunk.off:chunk.off + n], dest)
        self._done(target)

    def _pack(self, members: list) -> None:
        first_target, first, dtype = members[0]
        total = first.part[1]
        data = self._fetch(first.blob)
        pack = torch.frombuffer(self.scratch(-2, total), dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        try:
            first_target.pipe.decode_into(data, pack.view(dtype).view(1, -1), pack_limit(total), self.scratch)
        except FormatError as exc:
            raise FormatError(f"{blob_url(self.store, first.blob.key)}: {exc}") from None
        for target, chunk, _ in members:
            n = chunk.rows * chunk.cols
            part = pack[chunk.part[0]:chunk.part[0] + n * dtype.itemsize]
            target.flat[chunk.off:chunk.off + n].view(torch.uint8).copy_(part)
            if target.copy is not None and not target.links:
                target.copy[chunk.off:chunk.off + n].view(torch.uint8).copy_(part)
            self._done(target)

    def _link_index(self, target: Target, link: Link) -> None:
        n, rows = link.ref.n, target.loaded.record.row_shape[0]
        self._decode(self._index, link.ref.idx, link.idx.view(1, n), decode_limit(ChunkRef(0, 1, n, link.ref.idx),
                                                                                  torch.int64))
        if n and (int(link.idx.min()) < 0 or int(link.idx.max()) >= rows):
            raise CorruptCheckpointError(f"{self.where}: tensor {target.loaded.record.key!r}: delta row index "
                                         f"out of range ({blob_url(self.store, link.ref.idx.key)})")
        self._done(target)

    def _link_values(self, target: Target, link: Link, chunk: ChunkRef) -> None:
        n = chunk.rows * chunk.cols
        dest = link.values[chunk.off:chunk.off + n].view(chunk.rows, chunk.cols)
        self._decode(target.pipe, chunk.blob, dest, decode_limit(chunk, dest.dtype))
        self._done(target)

    def _done(self, target: Target) -> None:
        """One blob of ``target`` decoded; the last one applies its links (this thread)."""
        if not target.links:
            return
        with self._lock:
            target.remaining -= 1
            last = target.remaining == 0
        if last:
            _apply(target)


def _load_scatter() -> Callable | None:
    """``checkrun_scatter_rows`` of the C kernel ``ckpt_core._crows`` (a ctypes call: the GIL is
    released while it copies), or None when it was not built (numpy then, holding the GIL)."""
    lib = load_native("_crows", "checkrun_crows_abi", CROWS_ABI, "delta links are applied in numpy")
    if lib is None:
        return None
    fn = lib.checkrun_scatter_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.restype = None
    return fn


_SCATTER = _load_scatter()


def _rows(t: torch.Tensor, rows: int) -> np.ndarray:
    """A contiguous tensor as ``rows`` numpy items of one row's bytes each (``np.void``)."""
    return np.frombuffer(tensor_bytes(t), np.dtype((np.void, t.nbytes // rows)))


def _apply(target: Target) -> None:
    """Apply the links in chain order onto the decoded base (a row changed by several links ends
    with the newest value), then copy the result once.

    The rows are moved by the C kernel's ``checkrun_scatter_rows`` (one memcpy per row, without the
    GIL, so the other io threads decode meanwhile), else as numpy items of one row's bytes (4x less
    CPU than ``index_copy_``: 8 links of 6,553 rows into a 131,072 x 64 float32 table, 3.8 ms
    instead of 16.8 ms, but holding the GIL)."""
    rec = target.loaded.record
    rows = rec.row_shape[0]
    flat = target.flat
    table = _rows(flat, rows) if flat.nbytes and _SCATTER is None else None
    for link in target.links:
        n = link.ref.n
        if n and flat.nbytes:
            if _SCATTER is not None:  # indices checked in _link_index; both buffers contiguous
                _SCATTER(link.values.data_ptr(), flat.data_ptr(), link.idx.data_ptr(), n, flat.nbytes // rows)
            else:
                table[link.idx.numpy()] = _rows(link.values, n)
        target.loaded.delta_indices.append(link.idx)
        link.values = None
    if target.copy is not None:
        _copy_bytes(target.copy, target.flat)
