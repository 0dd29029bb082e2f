"""Exact change tracking for embedding tables (Check-N-Run): copy only the rows looked up.

Without tracking, an incremental save compares every row of a table with what was saved last
(exact, but a full pass over the table in the blocking part). With an ``EmbeddingTracker`` the
engine copies only the rows that were looked up since the last save, so the snapshot grows with
what changed, not with the model.

Contract (why it is exact): a row of a tracked table, and the optimizer state of that row, change
only when the row is looked up and the optimizer then steps. That holds for sparse-gradient
training (``sparse=True`` with SGD / Adagrad / SparseAdam) and for dense gradients with optimizers
that leave zero-gradient rows untouched (SGD without momentum or weight decay, Adagrad without
weight decay). It does not hold for Adam/AdamW with dense gradients, momentum or weight decay:
use plain incremental saves there. ``verify_every=N`` makes every N-th save do the full comparison
and warns (and stops trusting the tracker for that table) if a row changed without a lookup.

Rows looked up since the last optimizer step stay marked across a save, so a save taken between
forward and ``optimizer.step()`` cannot lose the update that follows it.

The marks live on the table's device: the forward hook never copies indices to the host (that
would wait for the device on every step). Row deltas apply to CPU tables only, so a GPU table's
marks are never read back; they cost one small kernel per lookup.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

log = logging.getLogger("ckpt_core")


class _Table:
    """``touch[r]`` = the tracker's clock when row r was last looked up (clock ticks per snapshot),
    so each directory's stream can ask "rows touched since my last capture" independently."""

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self.touch = torch.full((weight.shape[0],), -1, dtype=torch.int64, device=weight.device)
        self.pending = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
        self.trusted = True

    def follow(self) -> torch.device:
        """Move the marks to the weight's device if the model moved (``model.to(...)``); that device."""
        device = self.weight.device
        if self.touch.device != device:
            self.touch, self.pending = self.touch.to(device), self.pending.to(device)
        return device


class EmbeddingTracker:
    """Tracks looked-up rows of ``nn.Embedding``/``nn.EmbeddingBag`` modules (training thread only).

    Create with the model (all embedding modules inside are tracked) and its optimizer, then
    register it with ``CheckpointEngine.track(tracker)``. ``close()`` removes the hooks.
    """

    def __init__(self, modules: nn.Module | Iterable[nn.Module], optimizer: torch.optim.Optimizer,
                 verify_every: int = 0, trust_optimizer: bool = False) -> None:
        if not trust_optimizer:
            _check_optimizer(optimizer)
        mods = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.verify_every = verify_every
        self._tables: dict[int, _Table] = {}
        self._optimizer = optimizer
        self._hooks = []
        self._saves = 0
        self.clock = 0
        for root in mods:
            for m in root.modules():
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
                    table = _Table(m.weight)
                    self._tables[id(m.weight)] = table
                    self._hooks.append(m.register_forward_pre_hook(self._make_hook(table)))
        if not self._tables:
            raise ValueError("EmbeddingTracker: no nn.Embedding or nn.EmbeddingBag found")
        self._hooks.append(optimizer.register_step_post_hook(self._after_step))

    def _make_hook(self, table: _Table):
        def hook(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                # On the table's device (where the lookup's indices already are): no host copy.
                rows = args[0].reshape(-1).to(table.follow(), torch.int64)
                table.touch[rows] = self.clock
                table.pending[rows] = True
        return hook

    def _after_step(self, optimizer, args, kwargs) -> None:
        for t in self._tables.values():
            t.pending.zero_()

    def _owner(self, t: torch.Tensor) -> _Table | None:
        """The table whose weight or per-row optimizer state ``t`` is (matched by memory)."""
        ptr = t.data_ptr()
        for table in self._tables.values():
            if table.weight.data_ptr() == ptr:
                return table
            state = self._optimizer.state.get(table.weight, {})
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.data_ptr() == ptr and v.shape[:1] == table.weight.shape[:1]:
                    return table
        return None

    def rows_for(self, t: torch.Tensor, since: int) -> torch.Tensor | None:
        """Rows of ``t`` looked up since clock ``since``, or None when ``t`` must be compared in full."""
        table = self._owner(t)
        if table is None or not table.trusted:
            return None
        if self.verify_every and self._saves % self.verify_every == self.verify_every - 1:
            return None
        rows = (table.touch >= since).nonzero().squeeze(1)
        return rows if rows.device == t.device else rows.to(t.device)

    def check(self, t: torch.Tensor, changed: torch.Tensor, since: int) -> None:
        """Verification pass: rows that changed without a lookup break the contract."""
        table = self._owner(t)
        if table is None or not changed.numel():
            return
        unexpected = (table.touch.to(changed.device)[changed] < since).sum().item()
        if unexpected:
            table.trusted = False
            log.warning("checkrun: %d row(s) of a tracked table changed without a lookup; the tracker's "
                        "contract does not hold for this optimizer, falling back to full comparison",
                        unexpected)

    def captured(self) -> None:
        """Called by the engine after a snapshot: tick the clock; rows looked up but not yet
        stepped count as touched in the new interval too."""
        self._saves += 1
        self.clock += 1
        for t in self._tables.values():
            t.follow()
            t.touch.masked_fill_(t.pending, self.clock)  # no boolean indexing: no device sync

    def close(self) -> None:
        """Stop tracking: remove the hooks this tracker put on the embedding modules and the optimizer (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers that change rows without a lookup (the tracker would miss those)."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        wd = group.get("weight_decay", 0) or 0
        if name == "SparseAdam":
            continue
        if name == "SGD" and not wd and not group.get("momentum", 0):
            continue
        if name == "Adagrad" and not wd:
            continue
        raise ValueError(
            f"EmbeddingTracker: {name} (weight_decay={wd}, momentum={group.get('momentum', 0)}) updates "
            "rows that were not looked up, so tracking lookups would miss changes. Use SGD without "
            "momentum/weight decay, Adagrad without weight decay or SparseAdam, or rely on plain "
            "incremental saves (exact comparison). trust_optimizer=True overrides this check.")
