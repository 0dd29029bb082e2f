"""Load and verify: read manifest -> fetch blobs in parallel -> verify -> decode -> apply deltas ->
place (``placement``: ``map_location`` for every tensor, those inside pickled values included).

Every byte is checked against the manifest's size and xxh3 checksum before a decoder sees it, and
every decoder is bounded by the size the manifest declares (already validated against limits).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch
import xxhash

from ..codecs import Pipeline, index_pipeline
from ..codecs._common import tensor_bytes
from ..config import EngineConfig
from ..errors import CheckrunError, CorruptCheckpointError, FormatError, ResourceLimitError
from ..format.manifest import DTYPES, BlobRef, ChunkRef, Manifest, TensorRecord, parse_manifest
from ..format.limits import check_load_bytes, limits_for, memory_limit
from ..format.objects import deserialize_object
from .placement import Placer, map_location_tensor, object_map_location  # noqa: F401 - engine's import
from ..saving.staging import empty_host
from ..storage.store import Store
from ..format.tree import unflatten, validate_skeleton

log = logging.getLogger("ckpt_core")


def read_manifest(store: Store, name: str, config: EngineConfig) -> Manifest:
    """Read and validate the manifest ``name`` of ``store`` (errors name its URL)."""
    data = store.read_manifest(name)
    return parse_manifest(data, store.url(name), limits=limits_for(config))


def fetch_blob(store: Store, ref: BlobRef, buf: memoryview | None = None) -> bytes | memoryview:
    """Read one blob and check its size and checksum before anything uses it.

    With ``buf`` (at least ``ref.size + 1`` bytes) a local store reads into it and the result
    aliases it."""
    data = store.get_blob(ref.key, ref.size) if buf is None else store.get_blob_into(ref.key, ref.size, buf)
    if len(data) != ref.size:
        raise CorruptCheckpointError(f"{store.blob_path(ref.key)}: size {len(data)} != {ref.size} declared "
                                     "in the manifest (truncated or replaced blob)")
    if xxhash.xxh3_64_hexdigest(data) != ref.csum:
        raise CorruptCheckpointError(f"{store.blob_path(ref.key)}: checksum mismatch (corrupted blob)")
    return data


class Scratch:
    """Per-thread byte buffers reused by the chunks of one load, freed with it: decoding writes
    into them instead of allocating (and page-faulting) fresh memory per chunk."""

    def __init__(self, where: str = "") -> None:
        self._local = threading.local()
        self.where = where

    def get(self, slot: Hashable, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` for ``slot``, private to the calling thread."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(slot)
        if buf is None or buf.size < nbytes:
            buf = bufs[slot] = alloc_host(nbytes, torch.uint8, self.where, "decoding buffer").numpy()
        return memoryview(buf)[:nbytes]


def alloc_host(numel: int, dtype: torch.dtype, where: str, what: str) -> torch.Tensor:
    """``empty_host``, with an allocation failure (the sizes come from a manifest) as a CheckrunError."""
    try:
        return empty_host(numel, dtype)
    except (RuntimeError, MemoryError) as exc:
        raise ResourceLimitError(f"{where}: {what} of {numel * dtype.itemsize} bytes cannot be allocated: "
                                 f"{exc}") from None


def _decode_limit(chunk: ChunkRef, dtype: torch.dtype) -> int:
    """Most bytes any stage of a chunk's pipeline may produce (raw size, quantization scales)."""
    raw = chunk.rows * chunk.cols * dtype.itemsize
    return 2 * raw + 16 * chunk.rows + 4096


def decode_chunk(store: Store, pipeline: Pipeline, chunk: ChunkRef, dtype: torch.dtype) -> torch.Tensor:
    """Fetch, verify and decode one chunk (a part of a pack included) into a new (rows, cols) tensor."""
    data = fetch_blob(store, chunk.blob)
    try:
        if chunk.part is None:
            return pipeline.decode(data, (chunk.rows, chunk.cols), dtype, _decode_limit(chunk, dtype))
        start, total = chunk.part
        pack = pipeline.decode(data, (1, total // dtype.itemsize), dtype, _pack_limit(total)).reshape(-1)
        first = start // dtype.itemsize
        return pack[first:first + chunk.rows * chunk.cols].clone().view(chunk.rows, chunk.cols)
    except FormatError as exc:
        raise FormatError(f"{store.blob_path(chunk.blob.key)}: {exc}") from None


def _pack_limit(total: int) -> int:
    return 2 * total + 4096


def _pipeline(rec: TensorRecord, where: str) -> Pipeline:
    try:
        return Pipeline.from_list(list(rec.codecs))
    except FormatError as exc:
        raise FormatError(f"{where}: tensor {rec.key!r}: {exc}") from None


@dataclass
class LoadedTensor:
    record: TensorRecord
    flat: torch.Tensor
    delta_indices: list = field(default_factory=list)
    copy: torch.Tensor | None = None  # a second copy of the values, private to the engine


#: ``keep_copy(record, flat)``: whether ``load_tensors`` should also fill ``LoadedTensor.copy``.
KeepCopy = Callable[[TensorRecord, torch.Tensor], bool]


def load_tensors(store: Store, manifest: Manifest, where: str, keep_copy: KeepCopy | None = None,
                 max_total_bytes: int | None = None) -> list[LoadedTensor]:
    """Fetch, verify and decode every tensor (bases in parallel, then deltas in order).

    Tensors ``keep_copy`` selects get a second copy (``LoadedTensor.copy``), made chunk by chunk
    on the io threads right after each chunk is decoded (the engine keeps it as the reference of
    the next row-delta save). What the manifest declares is checked against ``max_total_bytes``
    (``load.max_total_bytes``) before anything is allocated."""
    limit = memory_limit(max_total_bytes)
    total = check_load_bytes(manifest, where, limit)
    out, tasks, packs = [], [], {}
    for rec in manifest.tensors:
        dtype = DTYPES[rec.dtype]
        pipe = _pipeline(rec, where)
        flat = alloc_host(rec.numel, dtype, where, f"tensor {rec.key!r}")
        lt = LoadedTensor(rec, flat)
        if keep_copy is not None and keep_copy(rec, flat):
            total = check_load_bytes(manifest, where, limit, total + rec.nbytes)
            lt.copy = alloc_host(rec.numel, dtype, where, f"copy of tensor {rec.key!r}")
        out.append(lt)
        for chunk in rec.base:
            if chunk.part is None:
                tasks.append((lt, pipe, chunk, dtype))
            else:  # parts of one pack are decoded together, once
                packs.setdefault((chunk.blob, chunk.part[1], pipe.spec_id, dtype.itemsize), []).append(
                    (lt, pipe, chunk, dtype))
    tasks.extend(packs.values())

    scratch = Scratch(where)

    def pack_task(members: list) -> None:
        _, pipe, first, dtype = members[0]
        total = first.part[1]
        data = fetch_blob(store, first.blob, scratch.get(-1, first.blob.size + 1))
        pack = torch.frombuffer(scratch.get(-2, total), dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        try:
            pipe.decode_into(data, pack.view(dtype).view(1, -1), _pack_limit(total), scratch.get)
        except FormatError as exc:
            raise FormatError(f"{store.blob_path(first.blob.key)}: {exc}") from None
        for lt, _, chunk, _ in members:
            n = chunk.rows * chunk.cols
            part = pack[chunk.part[0]:chunk.part[0] + n * dtype.itemsize]
            lt.flat[chunk.off:chunk.off + n].view(torch.uint8).copy_(part)
            if lt.copy is not None:
                lt.copy[chunk.off:chunk.off + n].view(torch.uint8).copy_(part)

    def base_task(task) -> None:
        if isinstance(task, list):
            pack_task(task)
            return
        lt, pipe, chunk, dtype = task
        dest = lt.flat[chunk.off:chunk.off + chunk.rows * chunk.cols].view(chunk.rows, chunk.cols)
        data = fetch_blob(store, chunk.blob, scratch.get(-1, chunk.blob.size + 1))
        try:
            pipe.decode_into(data, dest, _decode_limit(chunk, dtype), scratch.get)
        except FormatError as exc:
            raise FormatError(f"{store.blob_path(chunk.blob.key)}: {exc}") from None
        if lt.copy is not None and dest.numel():  # numpy: one thread, while the chunk is hot
            np.copyto(np.frombuffer(tensor_bytes(lt.copy[chunk.off:chunk.off + dest.numel()]), np.uint8),
                      np.frombuffer(tensor_bytes(dest), np.uint8))

    store.map(base_task, tasks, cost=lambda task: (task[0] if isinstance(task, list) else task)[2].blob.size)
    del scratch
    index_pipe = index_pipeline()
    for lt in out:
        if lt.record.deltas:
            _apply_deltas(store, lt, _pipeline(lt.record, where), index_pipe, where)
    return out


def _apply_deltas(store: Store, lt: LoadedTensor, pipe: Pipeline, index_pipe: Pipeline, where: str) -> None:
    rec = lt.record
    rows, cols = rec.row_shape
    t2d = lt.flat.view(rows, cols)
    for delta in rec.deltas:
        idx = decode_chunk(store, index_pipe, ChunkRef(0, 1, delta.n, delta.idx), torch.int64).reshape(-1)
        if delta.n and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise CorruptCheckpointError(f"{where}: tensor {rec.key!r}: delta row index out of range")
        parts = store.map(lambda c: decode_chunk(store, pipe, c, lt.flat.dtype), list(delta.chunks))
        values = torch.cat([p.reshape(-1, cols) for p in parts]) if parts else t2d[:0]
        t2d.index_copy_(0, idx, values)
        if lt.copy is not None:
            lt.copy.view(rows, cols).index_copy_(0, idx, values)
        lt.delta_indices.append(idx)


def load_manifest_state(store: Store, name: str, manifest: Manifest, *, map_location: Any,
                        weights_only: bool, config: EngineConfig,
                        keep_copy: KeepCopy | None = None) -> tuple[Any, list[LoadedTensor]]:
    """Rebuild the saved state tree from a parsed manifest (``keep_copy``: see ``load_tensors``)."""
    where = store.url(name)
    leaves = check_structure(manifest, where)
    loaded = load_tensors(store, manifest, where, keep_copy, config.load.max_total_bytes)
    placer = Placer(map_location)
    try:
        tensors = [placer.place(lt.flat.view(lt.record.shape), lt.record.device) for lt in loaded]
    except CheckrunError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    finally:
        placer.finish()  # one wait per device for the copies queued
    objects = []
    object_location = object_map_location(map_location)
    for rec in manifest.objects:
        data = fetch_blob(store, rec.blob)
        try:
            objects.append(deserialize_object(data, key=rec.key, type_name=rec.type, weights_only=weights_only,
                                              allowed_globals=config.load.allowed_globals,
                                              map_location=object_location))
        except CheckrunError as exc:  # name the checkpoint and blob
            raise type(exc)(f"{where}: {exc} ({store.blob_path(rec.blob.key)})") from exc
    try:
        state = unflatten(manifest.skeleton, [tensors[i] for i in leaves], objects)
    except CheckrunError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise FormatError(f"{where}: invalid state skeleton: {exc}") from None
    return state, loaded


def check_structure(manifest: Manifest, where: str) -> list[int]:
    """Validate the leaf table and the skeleton against the manifest's tensors and objects;
    returns the leaf table. No blob is read."""
    leaves = manifest.meta.get("leaves", list(range(len(manifest.tensors))))
    if not isinstance(leaves, list) or not all(isinstance(i, int) and 0 <= i < len(manifest.tensors)
                                               for i in leaves):
        raise FormatError(f"{where}: invalid leaf table")
    try:
        validate_skeleton(manifest.skeleton, len(leaves), len(manifest.objects))
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    return leaves


@dataclass
class VerifyReport:
    """Outcome of ``verify``: ``ok`` only if the manifest and every blob it needs are intact."""

    path: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0

    def add(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)


def verify_manifest(store: Store, name: str, config: EngineConfig, *, decode: bool = True,
                    progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check the manifest, then every blob's presence, size and checksum (and decodability)."""
    report = VerifyReport(store.url(name))
    try:
        manifest = read_manifest(store, name, config)
    except CheckrunError as exc:
        report.add(str(exc))
        return report
    # Every distinct reference, not one per key: references to one blob that disagree (size or
    # checksum) cannot all match it, so such a manifest fails.
    unique = list(dict.fromkeys(manifest.blobs()))

    def check(ref: BlobRef) -> str | None:
        try:
            fetch_blob(store, ref)
            return None
        except CheckrunError as exc:
            return str(exc)
        finally:
            if progress is not None:
                progress(ref.size)

    for ref, problem in zip(unique, store.map(check, unique)):
        report.blobs_checked += 1
        report.bytes_checked += ref.size
        if problem:
            report.add(problem)
    if report.ok and decode:
        try:
            check_structure(manifest, report.path)
            load_tensors(store, manifest, report.path, max_total_bytes=config.load.max_total_bytes)
        except CheckrunError as exc:
            report.add(str(exc))
    return report


