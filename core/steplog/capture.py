"""Capturing one optimizer step on the training thread: gradients into reused staging, hyperparameters.

Called from the optimizer's step pre-hook, i.e. with the gradients exactly as ``step()`` will
consume them (after clipping and ``GradScaler.unscale_``). Dense gradients are copied into buffers
allocated once per parameter and reused (``Staging``); 2-D gradients with few non-zero rows and
torch sparse gradients are taken as (row indices, rows), fresh but small.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.tree import flatten
from .format import StepLogError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MIN_ROWS_FOR_SPARSE = 16
MIN_NUMEL_FOR_ROWS = 4096  # smaller gradients are copied whole: the row scan costs more than it saves


@dataclass
class Grad:
    """One parameter's gradient of one step, as captured (``data``/``idx`` are CPU tensors)."""

    p: int
    kind: str  # none | dense | rows | sparse
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    data: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    coalesced: bool = False


@dataclass
class StepRecord:
    """A captured step: its number and each parameter's gradient."""

    step: int
    grads: list[Grad]
    slot: int | None = None  # the staging set holding its dense gradients; given back after encoding
    nbytes: int = 0


@dataclass
class Staging:
    """``depth`` sets of reusable host buffers, one buffer per parameter; a step takes a free set and
    the encoder gives it back, so at most ``depth`` captured steps wait (backpressure)."""

    depth: int
    sets: list[dict[int, torch.Tensor]] = field(default_factory=list)
    dense_streak: dict[int, int] = field(default_factory=dict)
    """Per parameter, how many row scans in a row found its gradient dense (``_rows``)."""
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
        buf = self.sets[slot].get(p)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self.sets[slot][p] = buf
        return buf


def flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order: a gradient's ``p`` is its index here."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def group_scalars(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's plain-number hyperparameters (lr, betas, momentum, ...): replay sets them back,
    so the step is exact whatever changed them (scheduler, warm-up code)."""
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
        if _json_exact(v):  # a skeleton of itself (most scheduler fields): no flatten, ~10x cheaper
            out[k] = v
            continue
        flat = flatten(v)
        if not flat.tensors and not flat.objects:
            out[k] = flat.skeleton
    return out


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


def capture_step(optimizer: torch.optim.Optimizer, step: int, staging: Staging, slot: int,
                 sparse_max_fraction: float) -> StepRecord:
    """Training thread, inside the step pre-hook: copy what ``step()`` is about to consume."""
    grads, nbytes = [], 0
    for i, p in enumerate(flat_params(optimizer)):
        g = p.grad
        if g is None:
            grads.append(Grad(i, "none"))
            continue
        if g.is_sparse:
            item = _sparse(i, g)
        else:
            item = _rows(i, g, sparse_max_fraction, staging, step) or _dense(i, g, staging, slot)
        nbytes += item.data.numel() * item.data.element_size()
        if item.idx is not None:
            nbytes += item.idx.numel() * 8
        grads.append(item)
    return StepRecord(step, grads, slot, nbytes)


def _dense(i: int, g: torch.Tensor, staging: Staging, slot: int) -> Grad:
    buf = staging.buffer(slot, i, g)
    buf.copy_(g.detach())
    return Grad(i, "dense", tuple(g.shape), g.dtype, buf)


def _sparse(i: int, g: torch.Tensor) -> Grad:
    # The uncoalesced form as it is: SGD adds duplicate rows one by one, and coalescing first
    # would round differently.
    idx = g._indices().detach().to("cpu", copy=True).view(-1) if g.sparse_dim() == 1 else None
    if idx is None:
        raise StepLogError(f"step log: parameter {i} has a sparse gradient with {g.sparse_dim()} sparse "
                           "dimensions; only row-sparse gradients (nn.Embedding(sparse=True)) can be logged")
    vals = g._values().detach().to("cpu", copy=True).contiguous()
    return Grad(i, "sparse", tuple(g.shape), g.dtype, vals, idx, bool(g.is_coalesced()))


def _rows(i: int, g: torch.Tensor, max_fraction: float, staging: Staging, step: int) -> Grad | None:
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
    rows = g.index_select(0, idx).to("cpu").contiguous()
    return Grad(i, "rows", tuple(g.shape), g.dtype, rows, idx.to("cpu"))
