"""Step 1 of a save, on the training thread: flatten the state and copy it into staging buffers.

Everything after this works only on the snapshot, so the caller may mutate or free the state as
soon as ``take_snapshot`` returns.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig
from .errors import FormatError
from .manifest_limits import DEVICE_TYPES
from .fence import CommitStamp, new_stamp
from .objects import serialize_object
from .staging import BufferPool, Copier, MemoryBudget
from .streams import DirState, RowStream, row_eligible
from .tree import flatten


@dataclass(frozen=True)
class StagedTensor:
    """One tensor's snapshot: a flat host buffer plus what the row stream learned while copying."""

    key: str
    shape: tuple[int, ...]
    data: torch.Tensor
    device: str
    stream: RowStream | None = None
    changed: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class StagedObject:
    key: str
    type_name: str
    data: bytes


@dataclass(frozen=True)
class Snapshot:
    skeleton: Any
    tensors: tuple[StagedTensor, ...]
    objects: tuple[StagedObject, ...]
    leaves: tuple[int, ...]
    event: Any
    charged: int
    created: float
    meta: dict
    stamp: CommitStamp | None = None
    """Orders this snapshot's commit against other saves of the same name (``fence``)."""


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else (id(t),)


def take_snapshot(state: Any, dirstate: DirState, pool: BufferPool, copier: Copier,
                  budget: MemoryBudget, config: EngineConfig, trackers: tuple = ()) -> Snapshot:
    """Flatten ``state`` and stage every tensor. Runs on the caller's (training) thread."""
    created = time.time()
    stamp = new_stamp()
    flat = flatten(state)
    leaves: list[int] = []
    unique: dict[tuple, int] = {}
    sources: list[tuple[str, torch.Tensor]] = []
    for leaf in flat.tensors:
        # Views of the same memory with the same layout (tied weights) are stored once.
        k = _alias_key(leaf.tensor)
        if k not in unique:
            if leaf.tensor.device.type not in DEVICE_TYPES:  # a load would refuse the manifest
                raise FormatError(f"{leaf.key}: cannot save a tensor on {leaf.tensor.device}: checkrun saves "
                                  f"tensors of {', '.join(DEVICE_TYPES)} devices (move it to the CPU first)")
            unique[k] = len(sources)
            sources.append((leaf.key, leaf.tensor.detach()))
        leaves.append(unique[k])
    charged = sum(t.nbytes for _, t in sources)
    budget.acquire(charged)
    try:
        staged = tuple(_stage(key, t, dirstate, pool, copier, config, trackers) for key, t in sources)
        event = copier.finish()
        for tracker in trackers:
            tracker.captured()
        objects = tuple(StagedObject(o.key, o.type_name, serialize_object(o.obj)) for o in flat.objects)
    except BaseException:
        copier.settle()
        budget.release(charged)
        raise
    return Snapshot(flat.skeleton, staged, objects, tuple(leaves), event, charged, created, _meta(state),
                    stamp)


def _stage(key: str, t: torch.Tensor, dirstate: DirState, pool: BufferPool, copier: Copier,
           config: EngineConfig, trackers: tuple) -> StagedTensor:
    shape = tuple(t.shape)
    if row_eligible(key, t, config.incremental):
        stream = dirstate.streams.get(key)
        if stream is None or stream.buffer.numel() != t.numel() or stream.buffer.dtype != t.dtype:
            if stream is not None:  # no save in flight uses it: the engine waited (_wait_streams)
                pool.free_host(stream.buffer)
            stream = RowStream(pool.new_host(t.numel(), t.dtype), t.dtype, shape)
            dirstate.streams[key] = stream
        rows = None
        for tracker in trackers:
            rows = tracker.rows_for(t, stream.tracker_since)
            if rows is not None:
                break
        changed = stream.capture(t, rows, config.incremental, copier.copy)
        if rows is None and changed is not None:
            for tracker in trackers:
                tracker.check(t, changed, stream.tracker_since)
        stream.tracker_since = max((tr.clock + 1 for tr in trackers), default=0)
        return StagedTensor(key, shape, stream.buffer, str(t.device), stream, changed)
    buf = pool.take(t.dtype, t.numel(), for_cuda=t.device.type == "cuda")
    copier.copy(t, buf)
    return StagedTensor(key, shape, buf, str(t.device))


def _meta(state: Any) -> dict:
    """Loop counters worth showing in listings (Lightning's global_step/epoch, plain step)."""
    meta = {}
    if isinstance(state, Mapping):
        for name in ("global_step", "step", "epoch"):
            v = state.get(name)
            if isinstance(v, int) and not isinstance(v, bool):
                meta[name] = v
            elif isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
                meta[name] = int(v)
    return meta
