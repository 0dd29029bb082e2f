"""DCP planners: spreading replicated tensors over ranks (save) and restricted unpickling (load).

Save: DCP's DefaultSavePlanner gives every replicated item (a DDP parameter, a Replicate() DTensor,
any value present on several ranks) to exactly one rank: with ``dedup_save_to_lowest_rank=True`` all to
rank 0, by default to the rank with the least planned bytes so far, in state-dict order and one whole
tensor at a time. :class:`CheckrunSavePlanner` instead cuts each large replicated tensor into row ranges
(at most one per holding rank, each at least ``min_piece_bytes``) and hands the pieces, largest first, to
the least-loaded rank (longest-processing-time scheduling, as torchsnapshot and Check-N-Run spread writes),
so write bandwidth grows with the number of ranks even for one huge embedding table. Every piece is an
ordinary DCP chunk (``WriteItemType.SHARD`` with its offsets), so DCP's load planner reassembles and
reshards it like any sharded tensor, with any reader.

Load: DCP's DefaultLoadPlanner unpickles non-tensor values with ``torch.load(weights_only=False)``;
:class:`CheckrunLoadPlanner` uses torch's restricted (``weights_only``) unpickler, with checkrun's
``load.allowed_globals`` contract.
"""
from __future__ import annotations

import dataclasses
import io
import math
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (ReadItem, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from ..codecs._common import tensor_digest
from ..format.objects import deserialize_object

__all__ = ["CheckrunSavePlanner", "CheckrunLoadPlanner", "spread_save_plans"]

_NOMINAL_VALUE_BYTES = 1024  # planned cost of a non-tensor value (its size is unknown when planning)


def _chunk_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        return _NOMINAL_VALUE_BYTES
    return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)


def _split(item: WriteItem, holders: int, min_piece_bytes: int) -> list[WriteItem]:
    """Row ranges of a replicated tensor item: at most ``holders`` pieces of >= ``min_piece_bytes``."""
    td = item.tensor_data
    if td is None or len(td.chunk.sizes) == 0:
        return [item]
    rows = int(td.chunk.sizes[0])
    k = min(holders, rows, _chunk_bytes(item) // max(1, min_piece_bytes))
    if k <= 1:
        return [item]
    base, extra = divmod(rows, k)
    pieces, start = [], 0
    for i in range(k):
        length = base + (1 if i < extra else 0)
        offsets = torch.Size([td.chunk.offsets[0] + start, *td.chunk.offsets[1:]])
        sizes = torch.Size([length, *td.chunk.sizes[1:]])
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=sizes)
        pieces.append(WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                tensor_data=TensorWriteData(chunk=chunk, properties=td.properties, size=td.size)))
        start += length
    return pieces


def spread_save_plans(all_plans: list[SavePlan], min_piece_bytes: int,
                      fingerprints: Sequence[dict] | None = None) -> list[SavePlan]:
    """Deduplicate the ranks' plans so each replicated item (or piece of it) is written by one rank,
    balancing the planned bytes per rank. Items only one rank has stay with it. Deterministic.

    An item the ranks hold with different shapes, or (``fingerprints``: per rank, fqn -> a digest of
    the content of each item large enough to be cut) different content, is not replicated: the lowest
    rank holding it writes its own whole, as DCP's deduplication does (pieces cut from each rank's
    copy wrote a tensor that never existed on any rank, silently; another shape failed the save:
    found by an independent check)."""
    holders: dict[MetadataIndex, list[int]] = {}
    items: dict[MetadataIndex, list[WriteItem]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            items.setdefault(item.index, []).append(item)
    load = [0] * len(all_plans)
    assigned: list[list[WriteItem]] = [[] for _ in all_plans]
    shared: list[tuple[WriteItem, list[int]]] = []
    for index, ranks in holders.items():
        item = items[index][0]
        if len(ranks) > 1 and not _replicated(index, items[index], ranks, fingerprints):
            ranks = ranks[:1]
        if len(ranks) == 1:
            assigned[ranks[0]].append(item)
            load[ranks[0]] += _chunk_bytes(item)
        else:
            shared.extend((piece, ranks) for piece in _split(item, len(ranks), min_piece_bytes))
    shared.sort(key=lambda pr: -_chunk_bytes(pr[0]))  # stable: equal sizes keep state-dict order
    for piece, ranks in shared:
        rank = min(ranks, key=lambda r: (load[r], r))
        assigned[rank].append(piece)
        load[rank] += _chunk_bytes(piece)
    return [dataclasses.replace(plan, items=items) for plan, items in zip(all_plans, assigned)]


def _replicated(index: MetadataIndex, held: list[WriteItem], ranks: list[int],
                fingerprints: Sequence[dict] | None) -> bool:
    """Whether every rank holds item ``index`` alike: the same chunk, dtype and (where digested) content."""
    if any(h.tensor_data != held[0].tensor_data for h in held[1:]):
        return False
    if fingerprints is None or held[0].tensor_data is None:
        return True
    digests = {repr(fingerprints[r].get(index.fqn)) for r in ranks}
    return len(digests) == 1


class CheckrunSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner whose replicated tensors are written by all ranks that hold them.

    Args:
        spread_replicated: False = DCP's own deduplication (``dedup_save_to_lowest_rank`` applies).
        min_piece_bytes: smallest piece a replicated tensor is cut into (default 16 MiB); tensors
            smaller than twice this are written whole, by the least-loaded rank.
        **kwargs: DefaultSavePlanner's (``flatten_state_dict``, ``dedup_save_to_lowest_rank``, ...).

    Every rank must use it (it plans on the coordinator and resolves pieces on each rank).
    """

    def __init__(self, spread_replicated: bool = True, min_piece_bytes: int = 16 << 20, **kwargs: Any) -> None:
        if spread_replicated and kwargs.get("enable_plan_caching"):
            raise ValueError("CheckrunSavePlanner(spread_replicated=True) does not support enable_plan_caching")
        super().__init__(**kwargs)
        self.spread_replicated = spread_replicated
        self.min_piece_bytes = int(min_piece_bytes)
        self._local: dict[str, list[WriteItem]] = {}
        self._local_boxes: set[tuple] = set()

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._local, self._local_boxes = {}, set()
        digests = {}
        for item in self.plan.items:
            if item.tensor_data is not None:
                self._local.setdefault(item.index.fqn, []).append(item)
                self._local_boxes.add(_box(item))
                if self.spread_replicated and _chunk_bytes(item) >= 2 * self.min_piece_bytes:
                    digests[item.index.fqn] = tensor_digest(self.lookup_object(item.index))
        if self.spread_replicated:  # carried to the coordinator with the plan, unwrapped there
            plan = dataclasses.replace(plan, planner_data=_Digests(plan.planner_data, digests))
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        if self.spread_replicated:
            digests = [p.planner_data.digests if isinstance(p.planner_data, _Digests) else {} for p in all_plans]
            all_plans = [dataclasses.replace(p, planner_data=p.planner_data.inner)
                         if isinstance(p.planner_data, _Digests) else p for p in all_plans]
            all_plans = spread_save_plans(all_plans, self.min_piece_bytes, digests)
        return super().create_global_plan(all_plans)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.tensor_data is None or _box(write_item) in self._local_boxes:
            return super().resolve_data(write_item)
        parent = self._parent(write_item)
        tensor = super().resolve_data(parent)
        piece, outer = write_item.tensor_data.chunk, parent.tensor_data.chunk
        for dim, (o, po, n) in enumerate(zip(piece.offsets, outer.offsets, piece.sizes)):
            if o != po or n != tensor.size(dim):
                tensor = tensor.narrow(dim, o - po, n)
        return tensor

    def _parent(self, item: WriteItem) -> WriteItem:
        box = item.tensor_data.chunk
        for cand in self._local.get(item.index.fqn, []):
            c = cand.tensor_data.chunk
            if all(co <= o and o + n <= co + cn for o, n, co, cn in zip(box.offsets, box.sizes, c.offsets, c.sizes)):
                return cand
        raise ValueError(f"no local tensor of {item.index.fqn!r} holds the piece at {list(box.offsets)}: "
                         "every rank must save with CheckrunSavePlanner")


@dataclasses.dataclass(frozen=True)
class _Digests:
    """A local plan's ``planner_data`` (DCP's flattening mappings) with the content digests of its
    large tensors (``tensor_digest``), for the coordinator's ``spread_save_plans``."""

    inner: Any
    digests: dict


def _box(item: WriteItem) -> tuple:
    c = item.tensor_data.chunk
    return item.index.fqn, tuple(c.offsets), tuple(c.sizes)


class CheckrunLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with torch's restricted unpickler.

    Args:
        weights_only: True (or None, the default: as torch.load, True unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
            is set) refuses types outside torch's allow-list and ``allowed_globals``
            (raising ``UnsafeLoadError`` naming the key); False = DCP's own ``weights_only=False``.
        allowed_globals: ``"module.QualName"`` types to allow (their modules must be imported).
        **kwargs: DefaultLoadPlanner's (``allow_partial_load``, ...).
    """

    def __init__(self, *, weights_only: bool | None = None, allowed_globals: Sequence[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weights_only = weights_only
        self.allowed_globals = tuple(allowed_globals)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = deserialize_object(value.getvalue(), key=fqn, type_name="value", weights_only=self.weights_only,
                                 allowed_globals=self.allowed_globals)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

