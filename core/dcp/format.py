"""On-storage form of a checkpoint written through torch.distributed.checkpoint (DCP).

The checkpoint is one ordinary checkrun manifest (``_checkrun: "manifest"``, format version 1, JSON,
xxh3 checksum) whose ``meta["dcp"]`` holds DCP's ``Metadata`` as JSON, never pickled:

- ``state``: one entry per state-dict key, in DCP's order: ``{"fqn", "kind": "tensor", "dtype",
  "size", "props", "chunks": [[offsets, sizes], ...]}`` or ``{"fqn", "kind": "bytes"}``;
- ``items``: the storage index, ``[fqn, offsets | null, record key, rank]`` per stored item (the
  ``MetadataIndex`` -> record map, and which rank wrote it);
- ``planner_data`` (the planner's key mappings, as a checkrun tree skeleton: plain data only),
  ``storage_meta``, ``version``, ``world_size``.

Every stored item is a regular record of the manifest: a tensor chunk (a DTensor shard, a piece of a
replicated tensor, a whole tensor) is a ``TensorRecord`` whose shape is the chunk's, a non-tensor value
(bytes DCP's planner produced with ``torch.save``) an ``ObjectRecord``. So ``latest``, ``verify``,
``list``, ``gc`` and the CLI treat it like any checkpoint, and ``ckpt_core.load`` of it gives a flat
``{record key: shard tensor or value}`` dict. Decoding is the hostile-input boundary: every field is
type-checked and every reference resolved before DCP sees anything.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Union

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..errors import FormatError
from ..format.manifest import DTYPES, Manifest, ObjectRecord, TensorRecord, dtype_name
from ..format.skeleton import unflatten
from ..format.tree import flatten

FORMAT = "torch.distributed.checkpoint"
DCP_VERSION = "1.0.0"
_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve": torch.preserve_format}

Record = Union[TensorRecord, ObjectRecord]


@dataclass(frozen=True)
class ItemResult:
    """What a rank stored for one WriteItem: sent to the coordinator as ``WriteResult.storage_data``."""

    record: Record
    rank: int
    written: int
    """Bytes this rank wrote for the item (0 when every blob was already in the store)."""


class CheckpointIdMixin:
    """DCP's ``checkpoint_id`` protocol for the storage reader and writer (their ``path``)."""

    path: str | None

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and bool(os.fspath(checkpoint_id))


def record_key(index: MetadataIndex, whole: bool) -> str:
    """Record name of an item: its fqn for a whole tensor or a value, ``fqn@o0,o1`` for a chunk."""
    if index.offset is None or whole:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _name(value: Any, table: dict) -> str:
    for name, obj in table.items():
        if obj == value:
            return name
    raise FormatError(f"cannot store tensor property {value!r} (supported: {sorted(table)})")


def _props_to_json(p: TensorProperties) -> dict:
    return {"requires_grad": bool(p.requires_grad), "layout": _name(p.layout, _LAYOUTS),
            "memory_format": _name(p.memory_format, _MEMORY_FORMATS), "pin_memory": bool(p.pin_memory)}


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > 64 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise FormatError(f"{what}: expected a list of non-negative ints, got {value!r}")
    return value


def _field(d: Any, name: str, typ: type | tuple, what: str) -> Any:
    value = d.get(name) if isinstance(d, dict) else None
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        raise FormatError(f"{what}: missing or invalid field {name!r}")
    return value


def _plain_to_json(value: Any, what: str) -> Any:
    flat = flatten(value)
    if flat.tensors or flat.objects:
        raise FormatError(f"{what} holds tensors or non-plain objects; checkrun stores DCP metadata as JSON "
                          "and never pickles it (use a planner whose planner_data is plain data)")
    return flat.skeleton


def encode_metadata(metadata: Metadata, items: list[tuple[MetadataIndex, str, int]], world_size: int) -> dict:
    """The JSON form of DCP's Metadata plus the storage index (``items``: index, record key, rank)."""
    state = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state.append({"fqn": fqn, "kind": "bytes"})
        elif isinstance(md, TensorStorageMetadata):
            state.append({"fqn": fqn, "kind": "tensor", "dtype": dtype_name(md.properties.dtype),
                          "size": list(md.size), "props": _props_to_json(md.properties),
                          "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]})
        else:
            raise FormatError(f"unsupported DCP storage metadata for {fqn!r}: {type(md).__name__}")
    sm = metadata.storage_meta
    storage_meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "modules": [str(m) for m in sm.modules]}
    return {
        "version": metadata.version or DCP_VERSION,
        "world_size": world_size,
        "state": state,
        "planner_data": _plain_to_json(metadata.planner_data, "planner_data"),
        "storage_meta": storage_meta,
        "items": [[i.fqn, None if i.offset is None else list(i.offset), key, rank] for i, key, rank in items],
    }


def _tensor_md(entry: dict, what: str) -> TensorStorageMetadata:
    dtype = _field(entry, "dtype", str, what)
    if dtype not in DTYPES:
        raise FormatError(f"{what}: unknown dtype {dtype!r}")
    size = _ints(_field(entry, "size", list, what), f"{what} size")
    props = _field(entry, "props", dict, what)
    layout = _LAYOUTS.get(props.get("layout", "strided"))
    memory_format = _MEMORY_FORMATS.get(props.get("memory_format", "contiguous"))
    if layout is None or memory_format is None:
        raise FormatError(f"{what}: unknown layout or memory format")
    properties = TensorProperties(dtype=DTYPES[dtype], layout=layout,
                                  requires_grad=bool(props.get("requires_grad", False)),
                                  memory_format=memory_format, pin_memory=bool(props.get("pin_memory", False)))
    if math.prod(size) * DTYPES[dtype].itemsize >= MAX_TENSOR_BYTES:
        raise FormatError(f"{what}: size {size} is too large ({math.prod(size)} elements)")
    boxes, chunks = [], []
    listed = _field(entry, "chunks", list, what)
    if len(listed) > MAX_CHUNKS:
        raise FormatError(f"{what}: {len(listed)} chunks, more than {MAX_CHUNKS}")
    for c in listed:
        if not isinstance(c, list) or len(c) != 2:
            raise FormatError(f"{what}: invalid chunk {c!r}")
        offsets, sizes = _ints(c[0], f"{what} chunk"), _ints(c[1], f"{what} chunk")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise FormatError(f"{what}: chunk {c!r} does not fit the tensor size {size}")
        boxes.append((offsets, sizes))
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    _check_tiling(size, boxes, what)
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


MAX_TENSOR_BYTES = 1 << 62
MAX_CHUNKS = 1 << 16
"""Most chunks one tensor of a DCP checkpoint may list (one per rank of a 65,536-rank job)."""


def _check_tiling(size: list[int], boxes: list[tuple[list[int], list[int]]], what: str) -> None:
    """The chunks cover every element of the tensor exactly once, as DCP saves them: their elements add
    up to the tensor's and no two overlap. A hostile or damaged index with holes made a load return
    uninitialised memory as values (found by a check of hostile inputs). Overlaps are looked for among
    the chunks whose ranges along dim 0 meet (sorted by their start there: one or a few each, as DCP
    shards along dim 0 or on a grid)."""
    total, covered = math.prod(size), sum(math.prod(s) for _, s in boxes)
    full = [(o, s) for o, s in boxes if math.prod(s)]
    overlap = False
    if covered == total and len(full) > 1 and size:
        lo = np.array([o for o, _ in full], dtype=np.int64)
        hi = lo + np.array([s for _, s in full], dtype=np.int64)
        order = np.argsort(lo[:, 0], kind="stable")
        lo, hi = lo[order], hi[order]
        ends = np.searchsorted(lo[:, 0], hi[:, 0], side="left")  # chunks after i that start before i ends
        for i in np.flatnonzero(ends > np.arange(1, len(lo) + 1)):
            if np.all((lo[i + 1:ends[i]] < hi[i]) & (lo[i] < hi[i + 1:ends[i]]), axis=1).any():
                overlap = True
                break
    if covered != total or overlap:
        raise FormatError(f"{what}: its chunks do not cover the tensor size {size} exactly once (they "
                          f"{'overlap' if overlap else f'cover {covered} of its {total} elements'})")


def decode_metadata(dcp: Any, manifest: Manifest, where: str) -> tuple[Metadata, dict[MetadataIndex, str]]:
    """Rebuild DCP's Metadata and the storage index from ``meta["dcp"]``; FormatError for anything
    malformed, including an index entry whose record is absent or does not fit its chunk."""
    try:
        return _decode(dcp, manifest)
    except FormatError as exc:
        raise FormatError(f"{where}: DCP metadata: {exc}") from None


def _decode(dcp: Any, manifest: Manifest) -> tuple[Metadata, dict[MetadataIndex, str]]:
    state: dict = {}
    for entry in _field(dcp, "state", list, "dcp"):
        fqn = _field(entry, "fqn", str, "state entry")
        kind = _field(entry, "kind", str, f"state {fqn!r}")
        if fqn in state or kind not in ("tensor", "bytes"):
            raise FormatError(f"state {fqn!r}: duplicate key or unknown kind {kind!r}")
        state[fqn] = BytesStorageMetadata() if kind == "bytes" else _tensor_md(entry, f"state {fqn!r}")
    tensors = {t.key: t for t in manifest.tensors}
    objects = {o.key: o for o in manifest.objects}
    storage: dict[MetadataIndex, str] = {}
    for item in _field(dcp, "items", list, "dcp"):
        if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str) \
                or not isinstance(item[2], str):
            raise FormatError(f"invalid storage index entry {item!r}")
        fqn, offset, key = item[0], item[1], item[2]
        md = state.get(fqn)
        if isinstance(md, TensorStorageMetadata):
            offsets = _ints(offset, f"item {key!r}")
            chunk = next((c for c in md.chunks if list(c.offsets) == offsets), None)
            rec = tensors.get(key)
            if chunk is None or rec is None or list(rec.shape) != list(chunk.sizes) \
                    or DTYPES[rec.dtype] != md.properties.dtype:
                raise FormatError(f"item {key!r} does not match a chunk of {fqn!r} and a tensor record")
            storage[MetadataIndex(fqn, offsets)] = key
        elif isinstance(md, BytesStorageMetadata) and offset is None and key in objects:
            storage[MetadataIndex(fqn)] = key
        else:
            raise FormatError(f"item {key!r} names no state key or record of its kind")
    sm = dcp.get("storage_meta")
    storage_meta = StorageMeta() if not isinstance(sm, dict) else StorageMeta(
        checkpoint_id=sm.get("checkpoint_id") if isinstance(sm.get("checkpoint_id"), str) else None,
        save_id=sm.get("save_id") if isinstance(sm.get("save_id"), str) else None,
        modules=[m for m in sm.get("modules") or [] if isinstance(m, str)])
    version = dcp.get("version")
    metadata = Metadata(state_dict_metadata=state, planner_data=unflatten(dcp.get("planner_data"), [], []),
                        storage_data=storage, storage_meta=storage_meta,
                        version=version if isinstance(version, str) else None)
    return metadata, storage


def build_manifest(metadata: Metadata, results: list[ItemResult], world_size: int,
                   indices: list[MetadataIndex]) -> Manifest:
    """The manifest committing one DCP save: records, skeleton, the JSON metadata and stats.

    ``indices[i]`` is the MetadataIndex of ``results[i]`` (from the WriteResult). A record key
    taken already (a state key that reads like another's chunk name: ``"w@2,0"`` beside a sharded
    ``"w"``) gets a ``#n`` suffix: the stored index names each item's record, so any unique name
    serves."""
    tensors, objects, skeleton, items, seen = [], [], [], [], set()
    rank_written = [0] * world_size
    for index, res in zip(indices, results):
        record, key = res.record, res.record.key
        n = 1
        while key in seen:
            n += 1
            key = f"{record.key}#{n}"
        if key != record.key:
            record = replace(record, key=key)
        seen.add(key)
        if isinstance(record, TensorRecord):
            skeleton += [key, {"$t": len(tensors)}]
            tensors.append(record)
        else:
            skeleton += [key, {"$o": len(objects)}]
            objects.append(record)
        items.append((index, key, res.rank))
        if 0 <= res.rank < world_size:
            rank_written[res.rank] += res.written
    dcp = encode_metadata(metadata, items, world_size)
    unique = {b.key: b for t in tensors for b in t.blobs()}
    unique.update({o.blob.key: o.blob for o in objects})
    stats = {"tensor_bytes": sum(t.nbytes for t in tensors), "written_bytes": sum(rank_written),
             "stored_bytes": sum(b.size for b in unique.values()), "chain_depth": 0,
             "quantized": any(t.quant for t in tensors), "rank_written_bytes": rank_written}
    return Manifest(time.time(), {"$d": skeleton}, tuple(tensors), tuple(objects), stats,
                    {"format": FORMAT, "dcp": dcp})
