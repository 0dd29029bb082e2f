"""A save that repeats the one still in flight to its directory, made without a copy or a wait.

Lightning's ``ModelCheckpoint(save_last=True)`` saves the same state twice in a row (the top-k file,
then ``last.ckpt``), and so do two checkpoint callbacks at one step. The second save would wait for
the first: it needs a ``saving.max_pending`` slot for its staging, and the row streams' buffers,
which the first save is still writing from. Yet its tensors are the very values that save staged.

So before it waits, ``save`` compares: when every tensor of the new state is bitwise equal to the
in-flight save's staged copy at the same key (same keys in the same order, shapes and dtypes, all on
the CPU), the new snapshot shares that save's staging (its ``Hold``: the buffers go back to the
pool when the last of the two is written) and takes no slot; its row-stream tensors have no changed
rows. Its pickled values are its own (``ModelCheckpoint``'s state differs between the two). Any
difference, and the save goes the usual way. Nothing is assumed from tensor identity or version
counters: ``state_dict()`` returns new tensor objects at every call, and an in-place change
through ``.data`` does not bump a version counter; the comparison is of the bytes.

The comparison reads the state once (about a copy's time) and stops at the first block that
differs. It is tried only while the previous save to the directory is in flight.

Its background part encodes nothing the save it repeats encoded: once that one committed, its tensor
records (``Hold.records``) are the repeat's (their blobs are checked as any reused blob: read back once per
engine, so one damaged in between is written again), so the repeat commits soon after it. Before 2026-12-07 every chunk
went through the pipeline again (encoded and hashed to find the blobs already there): Lightning's
``last.ckpt`` committed seconds after the top-k file on a large state, and a kill in between left
``ckpt_path="last"`` the previous one. Only the row-stream tensors are planned (no changed row).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ..format.tree import flatten, gc_paused
from .capture import Snapshot, StagedTensor, _device_objects, _meta, _sources, _stage_objects
from .quant_rules import tied_lossless
from ..config import EngineConfig
from .fence import CommitStamp, new_stamp
from .copier import Copier
from .streams import DirState, Share

#: Bytes compared per call: a difference found in the first block ends the comparison there.
BLOCK_BYTES = 8 << 20


def repeat_snapshot(state: Any, dirstate: DirState, coordinator: Any, copier: Copier,
                    stamp: CommitStamp | None = None, config: EngineConfig | None = None) -> Snapshot | None:
    """A snapshot of ``state`` sharing the staging of the save in flight to ``dirstate``'s directory,
    or None (no save in flight there, or ``state`` differs from it). ``coordinator``: the engine's, whose
    ``release_staging`` gives the staging back if the save in flight finished meanwhile;
    ``copier``: the engine's, whose helper thread compares half of each large tensor. Training
    thread. No slot, copy or wait (``config``: the engine's)."""
    leader = dirstate.leader
    snap: Snapshot | None = leader[1]() if leader is not None and not leader[0].done() else None
    if snap is None or dirstate.rebuilds:
        return None
    created = time.time()
    config = config or EngineConfig()
    flat = flatten(state, max_containers=config.load.max_manifest_elements // 4)
    with gc_paused():
        leaves, _, sources = _sources(flat.tensors)
    if len(sources) != len(snap.tensors) or _device_objects(flat.objects, sources):
        return None
    if not snap.hold.join():  # the save in flight gave its staging back: it is finishing
        return None
    try:
        try:
            staged = _same(sources, snap.tensors, dirstate, copier.share)
            if staged is not None:  # tied keys as this state ties them: the rules' verdict must be the same
                staged = tied_lossless(staged, flat, leaves, config.quantization)
                if any(a.lossless != b.lossless for a, b in zip(staged, snap.tensors)):
                    staged = None
        finally:
            copier.settle()
        if staged is not None:
            objects, _ = _stage_objects(flat.objects, {}, None, False)  # no device values: none later
            meta, _ = _meta(state, lambda t: None)
            return Snapshot(flat.skeleton, staged, objects, tuple(leaves), None, snap.charged, created, meta,
                            stamp or new_stamp(), snap.hold)
    except BaseException:
        coordinator.release_staging(snap)
        raise
    coordinator.release_staging(snap)
    return None


def _same(sources: list[tuple[str, torch.Tensor]], staged: tuple[StagedTensor, ...], dirstate: DirState,
          share: Share) -> tuple[StagedTensor, ...] | None:
    """``staged`` re-keyed for the new snapshot if every source equals its staged copy bitwise."""
    out = []
    for (key, t), st in zip(sources, staged):
        if (key != st.key or st.device != "cpu" or not t.is_cpu or tuple(t.shape) != st.shape
                or t.dtype != st.dtype or not t.is_contiguous()):
            return None
        if st.stream is not None and dirstate.streams.get(key) is not st.stream:
            return None  # a load replaced the stream meanwhile
        if not same_bytes(t, st.data, share):
            return None
        if st.stream is None:
            out.append(StagedTensor(key, st.shape, st.data, "cpu"))
        else:  # the stream's buffer holds these values: no row changed since the save in flight
            out.append(StagedTensor(key, st.shape, st.data, "cpu", st.stream, torch.empty(0, dtype=torch.int64)))
    return tuple(out)


def same_bytes(a: torch.Tensor, b: torch.Tensor, share: Share | None = None) -> bool:
    """Whether two contiguous tensors hold the same bytes (not values: ``-0.0`` differs from
    ``0.0``, and a NaN equals the same NaN), block by block: the first block that differs ends the
    comparison. ``share`` (``Copier.share``): a tensor of several blocks is compared half on the
    copier's helper thread (``torch.equal`` runs without the GIL), every block then compared."""
    x, y = _words(a), _words(b)
    if x.numel() != y.numel():
        return False
    step = max(1, BLOCK_BYTES // x.element_size())
    blocks = range(0, x.numel(), step)
    if share is not None and len(blocks) > 1:
        return all(share([lambda i=i: torch.equal(x[i:i + step], y[i:i + step]) for i in blocks])())
    return all(torch.equal(x[i:i + step], y[i:i + step]) for i in blocks)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of ``t``'s bytes, in 8-byte words where they divide it.    """
    flat = t.reshape(-1).resolve_conj().resolve_neg()  # a view's values, not its memory, are what a save stores
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    raw = flat.view(torch.uint8)
    if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0:
        return raw.view(torch.int64)
    return raw
