"""Capturing one optimizer step on the training thread: gradients into reused staging, hyperparameters.

Called from the optimizer's step pre-hook, i.e. with the gradients exactly as ``step()`` will
consume them (after clipping and ``GradScaler.unscale_``). Everything lands in host buffers
allocated once and reused (``Staging``; fresh allocations cost page faults on every step):

* gradients (or their logged part: the rows of a sparse gradient, the non-zero rows of a mostly
  zero 2-D one, and row indices) under ``PACK_MAX_BYTES`` are copied by one ``torch.cat`` per
  dtype into that dtype's *pack*, a contiguous buffer; the encoder then shuffles a pack once and
  needs no per-tensor setup (a DLRM step has dozens of such tensors: per-tensor work on either
  thread holds the GIL the training thread needs);
* larger ones are copied into a buffer of their own, per parameter;
* a sparse gradient whose rows come in runs of equal adjacent rows (a pooled lookup, e.g.
  ``emb(ids).sum(1)`` or ``nn.EmbeddingBag``: every id of a bag gets the bag's row) is *folded* by
  the C kernel ``checkrun_fold_rows`` as it is copied: one row and its run length per run, so a
  bag of 8 ids costs the copy, the encoder and storage one row instead of 8. Replay repeats each
  row by its run length: the same uncoalesced gradient, bit for bit.
"""
from __future__ import annotations

import ctypes
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from ..codecs._common import CROWS_ABI, load_native, tensor_digest
from ..format.tree import flatten
from .format import StepLogError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_ROWS_FOR_SPARSE = 16
MIN_NUMEL_FOR_ROWS = 4096  # smaller gradients are copied whole: the row scan costs more than it saves
PACK_MAX_BYTES = 1 << 20
"""Tensors smaller than this go into their dtype's pack; larger ones get a buffer of their own
(their own encode is cheap next to their bytes, and a pack stays cache-sized)."""
_GROWTH = 1.25  # a growing buffer (sparse rows vary per step) is reallocated this much larger
FOLD_MAX_FRACTION = 0.75
"""A sparse gradient is folded when its runs are at most this fraction of its rows."""


def _load_fold():
    lib = load_native("_crows", "checkrun_crows_abi", CROWS_ABI, "sparse gradients are logged unfolded")
    if lib is None:
        return None
    fn = lib.checkrun_fold_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int64
    return fn


_FOLD = _load_fold()


@dataclass
class Grad:
    """One parameter's gradient of one step, as captured.

    The logged values (``kind`` dense: the whole gradient; rows/sparse: ``n`` rows) and, for
    rows/sparse, their int64 row indices are either a CPU tensor of their own (``data``/``idx``)
    or a span of a pack (``data_at``/``idx_at``: ``(start, numel)`` in the pack of their dtype)."""

    p: int
    kind: str  # none | dense | rows | sparse
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    data: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    coalesced: bool = False
    n: int = 0
    data_at: tuple[int, int] | None = None
    idx_at: tuple[int, int] | None = None
    runs: torch.Tensor | None = None
    """A folded sparse gradient's int32 run lengths (``u`` of them; ``data`` holds ``u`` rows), or
    ``runs_at``: their span of the int32 pack. Both None: not folded."""
    runs_at: tuple[int, int] | None = None
    u: int = 0


@dataclass
class StepRecord:
    """A captured step: its number, each parameter's gradient, and the packs they point into."""

    step: int
    grads: list[Grad]
    slot: int | None = None  # the staging set holding its gradients; given back after encoding
    nbytes: int = 0
    packs: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    """Per dtype, the filled part of that dtype's pack (1-D, CPU)."""
    bufs: list[Grad] = field(default_factory=list)
    """The forward-pass state (``forward_buffers``) as the step found it, dense, ``p`` indexing its names."""
    rng: Any = None
    """The RNG states as the step found them (``rng.capture``); a segment stores its last step's."""


@dataclass
class Staging:
    """``depth`` sets of reusable host buffers (per parameter, plus one pack per dtype); a step takes
    a free set and the encoder gives it back, so at most ``depth`` captured steps wait (backpressure)."""

    depth: int
    sets: list[dict[Any, torch.Tensor]] = field(default_factory=list)
    dense_streak: dict[int, int] = field(default_factory=dict)
    """Per parameter, how many row scans in a row found its gradient dense (``_rows``)."""
    fold_streak: dict[int, int] = field(default_factory=dict)
    """Per parameter, how many steps in a row its sparse gradient did not fold (``_fold``)."""
    _free: list[int] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.sets = [{} for _ in range(self.depth)]
        self._free = list(range(self.depth))

    def take(self, stop: threading.Event) -> int:
        """Training thread: a free set, waiting for the encoder if none is (unless it stopped)."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or stop.is_set())
            if not self._free:
                raise StepLogError("the step log was closed while this step waited for the encoder")
            return self._free.pop()

    def give(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def buffer(self, slot: int, p: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer of parameter ``p``'s dense gradient, shaped like ``like``."""
        buf = self.sets[slot].get(p)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")
            self.sets[slot][p] = buf
        return buf

    def span(self, slot: int, key: Any, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """The first ``numel`` elements of the growing 1-D buffer ``key`` (a pack, or a large sparse
        gradient's rows or indices, whose sizes change from step to step)."""
        buf = self.sets[slot].get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = max(numel, int(_GROWTH * buf.numel()) if buf is not None and buf.dtype == dtype else 0)
            buf = torch.empty(size, dtype=dtype, device="cpu", pin_memory=pin)
            self.sets[slot][key] = buf
        return buf[:numel]


    def scratch(self, slot: int, key: Any, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """A 1-D CPU buffer ``key`` of at least ``numel`` elements and its address, for a C kernel
        to fill (kept with its size and dtype: a hit costs no torch call)."""
        hit = self.sets[slot].get(key)
        if hit is None or hit[2] < numel or hit[3] != dtype:
            buf = torch.empty(max(numel, int(_GROWTH * hit[2]) if hit is not None else 0), dtype=dtype)
            hit = self.sets[slot][key] = (buf, buf.data_ptr(), buf.numel(), dtype)
        return hit[0], hit[1]


class _Packer:
    """The small tensors of one step, per dtype, until ``fill`` copies each dtype's with one ``cat``."""

    def __init__(self) -> None:
        self.srcs: dict[torch.dtype, list[torch.Tensor]] = {}
        self.sizes: dict[torch.dtype, int] = {}

    def add(self, t: torch.Tensor) -> tuple[int, int]:
        """Queue ``t`` (any shape); its ``(start, numel)`` in its dtype's pack."""
        flat = (t.detach() if t.requires_grad else t).reshape(-1)
        return self.add_flat(flat, t.dtype, flat.numel())

    def add_flat(self, flat: torch.Tensor, dtype: torch.dtype, numel: int) -> tuple[int, int]:
        """``add`` of a 1-D tensor that needs no detach, whose dtype and size the caller knows."""
        start = self.sizes.get(dtype, 0)
        self.srcs.setdefault(dtype, []).append(flat)
        self.sizes[dtype] = start + numel
        return start, numel

    def fill(self, staging: Staging, slot: int) -> dict[torch.dtype, torch.Tensor]:
        packs = {}
        for dtype, srcs in self.srcs.items():
            cpu = all(s.is_cpu for s in srcs)  # (``device.type`` costs 4x as much: ~40 tensors a step)
            pin = not cpu and any(s.is_cuda for s in srcs)
            pack = staging.span(slot, ("pack", dtype), self.sizes[dtype], dtype, pin)
            if cpu:
                torch.cat(srcs, out=pack)
            else:  # one device-side cat, one transfer (a cat cannot mix devices)
                pack.copy_(torch.cat([s.to(srcs[0].device) for s in srcs]))
            packs[dtype] = pack
        return packs


def flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order: a gradient's ``p`` is its index here."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def fingerprint(optimizer: Any) -> tuple:
    """What tells that the optimizer's parameters or state changed: each tensor's identity, version
    counter and dtype, and a digest of its bytes (``tensor_digest``): writes through ``.data``,
    ``vector_to_parameters`` or ``model.half().float()`` move no version (found by independent checks,
    also of the state's tensors), and a digest sees a permutation that a sum would not. Non-tensor state
    values as they are (their repr); an uninitialized lazy parameter as such. Computed at a log's close and
    a replay's end (one pass over the parameters and state)."""
    out: list = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(_digest(p))
            for k, v in (optimizer.state.get(p) or {}).items():  # ZeroRedundancyOptimizer: None (h162)
                out.append((k, _digest(v) if isinstance(v, torch.Tensor) else repr(v)))
    return tuple(out)


def _digest(t: torch.Tensor) -> tuple:
    if is_lazy(t):
        return (id(t), "lazy")
    plain = t.detach()
    # plain tensors only: a DTensor's digest would be of its shards, or a collective
    digest = (tensor_digest(plain) if type(plain) is torch.Tensor and plain.layout == torch.strided
              and not plain.is_meta else None)
    return (id(t), t._version, t.dtype, digest)


def group_scalars(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's plain-number hyperparameters (lr, betas, momentum, ...): replay sets them back,
    so the step is exact whatever changed them (scheduler, warm-up code). A one-element tensor
    hyperparameter (``lr=torch.tensor(0.01)``, as torch recommends with ``torch.compile``) is logged
    as its value (a float holds a float32/bf16/float64 value exactly); replay fills the tensor."""
    out = []
    for group in optimizer.param_groups:
        values = {}
        for k, v in group.items():
            if k == "params" or not isinstance(k, str) or len(k) > 64:
                continue
            if isinstance(v, (tuple, list)) and len(v) <= 8 and all(_plain(x) for x in v):
                values[k] = list(v)
            elif _plain(v):
                values[k] = v
            elif isinstance(v, torch.Tensor) and v.numel() == 1 and (v.dtype.is_floating_point or v.dtype == torch.int64):
                values[k] = v.item()
        out.append(values)
    return out


def sched_skeleton(state: dict) -> dict:
    """The scheduler's ``state_dict`` as tree skeletons (exact: int keys, tuples, nan), per key. Keys
    holding tensors or other objects (MultiStepLR's ``milestones`` Counter) are left out: they do
    not change as training steps, and replay keeps the loaded checkpoint's value for them."""
    out = {}
    for k, v in state.items():
        if not isinstance(k, str):
            continue
        if _tensor_values(v):  # ``_last_lr`` of a tensor lr: one-element tensors, logged as their values
            out[k] = {TENSOR_LIST: [t.item() for t in v], "dtype": str(v[0].dtype).removeprefix("torch.")}
            continue
        if _json_exact(v):  # a skeleton of itself (most scheduler fields): no flatten, ~10x cheaper
            out[k] = list(v) if isinstance(v, list) else v  # a copy: the scheduler may change its list
            continue
        flat = flatten(v)
        if not flat.tensors and not flat.objects:
            out[k] = flat.skeleton
    return out


#: Tag of a scheduler value that is a list of one-element tensors of one dtype (``replay`` rebuilds it).
TENSOR_LIST = "$steplog_tensors"


def _tensor_values(v: Any) -> bool:
    return (isinstance(v, list) and 0 < len(v) <= 1024 and all(isinstance(t, torch.Tensor) and t.numel() == 1
                                                             and t.dtype == v[0].dtype for t in v)
            and (v[0].dtype.is_floating_point or v[0].dtype == torch.int64))


def _json_exact(v: Any) -> bool:
    """Values that the tree skeleton writes as themselves: str, bool, None, ints within +-2**53,
    finite floats, and flat lists of those."""
    if isinstance(v, list):
        return len(v) <= 1024 and all(_json_scalar(x) for x in v)
    return _json_scalar(v)


def _json_scalar(v: Any) -> bool:
    t = type(v)
    if t is float:
        return math.isfinite(v)
    if t is int:
        return -2**53 < v < 2**53
    return t is str or t is bool or v is None


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int)) or (isinstance(v, float))


def forward_buffers(model: Any) -> list[tuple[str, Any, str]]:
    """``(name, module, attribute)`` of each buffer that ``model``'s forward pass updates in training:
    the running statistics of BatchNorm/InstanceNorm layers that track them (read per step through
    the module, so a ``model.to(...)`` that replaces the tensors is followed)."""
    from torch.nn.modules.batchnorm import _NormBase

    if not isinstance(model, torch.nn.Module):
        return []
    return [(f"{name}.{b}" if name else b, m, b) for name, m in model.named_modules()
            if isinstance(m, _NormBase) and m.track_running_stats for b, t in m.named_buffers(recurse=False)
            if t is not None]


def capture_step(optimizer: torch.optim.Optimizer, step: int, staging: Staging, slot: int,
                 sparse_max_fraction: float, buffers: list[tuple[str, Any, str]] = ()) -> StepRecord:
    """Training thread, inside the step pre-hook: copy what ``step()`` is about to consume, and the
    forward-pass state ``buffers`` (``forward_buffers``) as the step's forward passes left it."""
    grads, packer = [], _Packer()
    bufs = []
    for i, (_, module, attr) in enumerate(buffers):
        t = getattr(module, attr, None)
        if type(t) is torch.Tensor:  # plain tensors only (a DTensor's shards are not one value)
            bufs.append(Grad(i, "dense", tuple(t.shape), t.dtype, data_at=packer.add(t)))
    for i, p in enumerate(flat_params(optimizer)):
        g = p.grad
        if g is None:
            grads.append(Grad(i, "none"))
        elif g.is_sparse:
            grads.append(_sparse(i, g, staging, slot, packer, step))
        else:
            grads.append(_rows(i, g, sparse_max_fraction, staging, step, packer)
                         or _dense(i, g, staging, slot, packer))
    packs = packer.fill(staging, slot)
    nbytes = sum(t.numel() * t.element_size() for t in packs.values())
    nbytes += sum(t.numel() * t.element_size() for g in grads for t in (g.data, g.idx, g.runs) if t is not None)
    return StepRecord(step, grads, slot, nbytes, packs, bufs)


def _small(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() < PACK_MAX_BYTES


def _dense(i: int, g: torch.Tensor, staging: Staging, slot: int, packer: _Packer) -> Grad:
    if _small(g):
        return Grad(i, "dense", tuple(g.shape), g.dtype, data_at=packer.add(g))
    buf = staging.buffer(slot, i, g)
    buf.copy_(g.detach())
    return Grad(i, "dense", tuple(g.shape), g.dtype, buf)


def _sparse(i: int, g: torch.Tensor, staging: Staging, slot: int, packer: _Packer, step: int) -> Grad:
    # The uncoalesced form as it is: SGD adds duplicate rows one by one, and coalescing first
    # would round differently. Few torch calls: this runs per table and step on the training thread.
    if g.sparse_dim() != 1:
        raise StepLogError(f"step log: parameter {i} has a sparse gradient with {g.sparse_dim()} sparse "
                           "dimensions; only row-sparse gradients (nn.Embedding(sparse=True)) can be logged")
    if g.requires_grad:  # a gradient of a graph (backward(create_graph=True)): its parts would be too
        g = g.detach()
    idx, vals = g._indices(), g._values()
    dtype, shape = vals.dtype, vals.shape
    item = Grad(i, "sparse", tuple(g.shape), dtype, coalesced=g.is_coalesced(), n=shape[0])
    small = vals.numel() * vals.element_size() < PACK_MAX_BYTES  # its own size decides, folded or not
    folded = _fold(i, vals, shape, staging, slot, step)
    if small and folded is None:
        item.data_at, item.idx_at = packer.add(vals), packer.add_flat(idx.view(-1), torch.int64, shape[0])
        return item
    if small:
        rows, runs, item.u = folded
        item.data_at = packer.add_flat(rows, dtype, rows.numel())
        item.idx_at = packer.add_flat(idx.view(-1), torch.int64, shape[0])
        item.runs_at = packer.add_flat(runs, torch.int32, item.u)
        return item
    pin = g.device.type == "cuda"
    if folded is None:
        item.data = staging.span(slot, ("rows", i), vals.numel(), dtype, pin).view(shape)
        item.data.copy_(vals)
    else:
        item.data, item.runs, item.u = folded
    item.idx = staging.span(slot, ("idx", i), idx.numel(), idx.dtype, pin)
    item.idx.copy_(idx.view(-1))
    return item


def _fold(i: int, vals: torch.Tensor, shape: torch.Size, staging: Staging, slot: int,
          step: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(rows, run lengths, runs)`` of a CPU sparse gradient's values whose equal adjacent rows fold
    to at most ``FOLD_MAX_FRACTION`` of them, in this step's staging (both 1-D); else None (logged
    as they are). A parameter whose gradient did not fold 4 steps in a row is tried only every 8th
    step after that (a token embedding's rows never repeat: the pass would only cost a copy)."""
    n = shape[0]
    if (_FOLD is None or len(shape) < 2 or n < MIN_ROWS_FOR_SPARSE or n >= 2**31
            or (staging.fold_streak.get(i, 0) >= 4 and step % 8) or not vals.is_cpu
            or not vals.is_contiguous()):
        return None
    cols = shape[1] if len(shape) == 2 else math.prod(shape[1:])
    if not cols:
        return None
    limit = math.floor(FOLD_MAX_FRACTION * n)
    rows, rows_at = staging.scratch(slot, ("fold", i), limit * cols, vals.dtype)
    runs, runs_at = staging.scratch(slot, ("runs", i), limit, torch.int32)
    u = _FOLD(vals.data_ptr(), n, cols * vals.itemsize, limit, rows_at, runs_at)
    staging.fold_streak[i] = staging.fold_streak.get(i, 0) + 1 if u < 0 else 0
    return None if u < 0 else (rows[:u * cols], runs[:u], u)


def _rows(i: int, g: torch.Tensor, max_fraction: float, staging: Staging, step: int,
          packer: _Packer) -> Grad | None:
    """The non-zero rows of a 2-D gradient when few are; zero compared bit for bit (-0.0 is kept).

    The scan is a pass over the gradient: one found dense 4 times in a row is scanned only every
    8th step after that (a dense layer stays dense; a table that turns sparse is seen within 8 steps)."""
    if (g.dim() != 2 or g.shape[0] < MIN_ROWS_FOR_SPARSE or g.numel() < MIN_NUMEL_FOR_ROWS or max_fraction <= 0
            or g.layout != torch.strided):
        return None
    if staging.dense_streak.get(i, 0) >= 4 and step % 8:
        return None
    ints = _INT_OF_SIZE.get(g.element_size())
    if ints is None or g.dtype.is_complex:
        return None
    g = g.detach()
    touched = g.contiguous().view(ints).ne(0).any(dim=1)
    n = int(touched.sum())
    if n > math.floor(max_fraction * g.shape[0]):
        staging.dense_streak[i] = staging.dense_streak.get(i, 0) + 1
        return None
    staging.dense_streak[i] = 0
    idx = touched.nonzero().view(-1)
    rows = g.index_select(0, idx)  # fresh, so a pack or a fresh host copy (rarely large: few rows)
    item = Grad(i, "rows", tuple(g.shape), g.dtype, n=n)
    if _small(rows):
        item.data_at, item.idx_at = packer.add(rows), packer.add(idx)
    else:
        item.data, item.idx = rows.to("cpu").contiguous(), idx.to("cpu")
    return item


def forward_state(model: Any) -> list[str]:
    """Names of the buffers of ``model`` that its forward pass updates in training (running statistics
    of BatchNorm/InstanceNorm layers that track them): logged with each step when the log has the
    model (``step_log(model=)``), set by a replay given the model (``replay(model=)``)."""
    return [name for name, _, _ in forward_buffers(model)]


def warn_forward_state(model: Any, replayed: int, checkpoint: str, restored: bool = False) -> None:
    """After ``replayed`` > 0 steps into ``model``: warn if it has ``forward_state`` buffers and the last
    replayed step did not set them (``restored``: it did)."""
    names = forward_state(model) if replayed and not restored else []
    if names:
        warnings.warn(f"checkrun: replayed {replayed} logged step(s) after {checkpoint}, the last of them without "
                      f"logged running statistics (a log opened without model=, or by a checkrun before "
                      f"2026-12-05 16:00, step-log format < 5); {len(names)} buffer(s) "
                      f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) keep older values: those of the "
                      "checkpoint or of the last step that logged them", RuntimeWarning, stacklevel=3)
