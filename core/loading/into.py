"""Loading into live tensors (``load(..., into=state)``): which tensors of the caller's ``state``
receive which stored tensor, in place, like ``torch.distributed.checkpoint.load(state)``.

The saved skeleton and ``into`` are walked together: a tensor leaf of ``into`` at the same path
(dict keys, list/tuple positions) as a stored tensor, on the CPU, with the same shape and dtype,
is where that tensor is decoded. Every other leaf (another shape or dtype, another device, a path
``into`` lacks, elements sharing memory: an expanded view) loads as without ``into``, decided before
any leaf is written. Pure functions of the calling thread.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckrunError
from ..format.manifest import DTYPES, Manifest
from ..format.skeleton import unflatten

_LIST, _TUPLE, _DICT, _ODICT, _TENSOR, _PARAM = list, "$tuple", "$d", "$od", "$t", "$p"


@dataclass
class IntoPlan:
    """Where each stored tensor goes. ``direct``: record index -> the tensor of ``into`` decoded
    into (contiguous; no two overlap); ``leaves``: leaf position -> the tensor of ``into`` returned
    at that position; ``copies``: (tensor of ``into``, record index) filled by a copy after decoding
    (a non-contiguous tensor, or one more tensor at another path of the same stored tensor)."""

    direct: dict[int, torch.Tensor] = field(default_factory=dict)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    copies: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def _fits(t: Any, rec: Any) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.device.type == "cpu" and t.dtype == DTYPES[rec.dtype] and tuple(t.shape) == tuple(rec.shape)
            and _distinct_elements(t))


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, so it can hold a stored tensor's values.

    An expanded view (stride 0) or an ``as_strided`` overlap cannot: ``copy_`` refuses it. Dims are
    taken by increasing stride, each stride must step over everything the smaller ones span (true of
    every contiguous, permuted or sliced tensor; a rare interleaved layout that fails it loads as a
    new tensor, like any other leaf that does not fit)."""
    if t.numel() <= 1:
        return True
    span = 0
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= span:
            return False
        span += stride * (size - 1)
    return True


def _key(node: Any) -> Any:
    """A skeleton dict key as the Python value (None where it cannot be one)."""
    if type(node) is str:
        return node
    try:
        return unflatten(node, (), ())
    except (CheckrunError, TypeError, ValueError):
        return None


def _children(node: Any, target: Any):
    """(child node, child of ``target``) pairs at the same paths."""
    if type(node) is list or (type(node) is dict and _TUPLE in node):
        items = node if type(node) is list else node[_TUPLE]
        if isinstance(target, (list, tuple)) and type(items) is list:
            return zip(items, target)
        return ()
    tag = _DICT if _DICT in node else _ODICT if _ODICT in node else None
    if tag is None or not isinstance(target, Mapping) or type(node[tag]) is not list:
        return ()
    flat = node[tag]
    pairs = ((_key(flat[i]), flat[i + 1]) for i in range(0, len(flat) - 1, 2))
    return ((child, target[k]) for k, child in pairs if k is not None and k in target)


def leaf_matches(manifest: Manifest, leaves: list[int], into: Any) -> dict[int, torch.Tensor]:
    """{leaf position: the tensor of ``into`` at that leaf's path} where it fits (``_fits``).

    ``leaves`` is the manifest's leaf table (``reader.check_structure``: the skeleton is valid)."""
    out: dict[int, torch.Tensor] = {}
    stack = [(manifest.skeleton, into)]
    while stack:
        node, target = stack.pop()
        if type(node) is dict and (_TENSOR in node or _PARAM in node):
            ref = node[_TENSOR] if _TENSOR in node else node[_PARAM]
            pos = ref[0] if type(ref) is list else ref
            if _fits(target, manifest.tensors[leaves[pos]]):
                out[pos] = target
        elif type(node) in (list, dict):
            stack.extend(_children(node, target))
    return out


def plan_into(manifest: Manifest, leaves: list[int], into: Any) -> IntoPlan:
    """Match ``into`` against the manifest (see the module docstring)."""
    plan = IntoPlan()
    if into is None:
        return plan
    first: dict[int, torch.Tensor] = {}
    for pos, t in sorted(leaf_matches(manifest, leaves, into).items()):
        plan.leaves[pos] = t
        rec = leaves[pos]
        if first.get(rec) is t:
            continue
        if rec in first or not t.is_contiguous() or t.is_conj() or t.is_neg():  # copy_ writes a view's values
            plan.copies.append((t, rec))
        else:
            first[rec] = t
    end = 0  # tensors sharing memory (another view of one buffer) must not be decoded into twice
    for rec, t in sorted(first.items(), key=lambda item: item[1].data_ptr()):
        if t.nbytes and t.data_ptr() < end:
            plan.copies.append((t, rec))
            continue
        plan.direct[rec] = t
        end = max(end, t.data_ptr() + t.nbytes)
    return plan


def finish_into(plan: IntoPlan, tensors: list[torch.Tensor]) -> None:
    """Fill the tensors of ``plan.copies`` from the loaded ones (``tensors``: one per record)."""
    with torch.no_grad():
        for t, rec in plan.copies:
            t.copy_(tensors[rec])
