"""The state tree of a checkpoint as seen from its manifest alone (no blob is read).

The skeleton is rebuilt with :func:`ckpt_core.format.skeleton.unflatten` over placeholders: one distinct
1-element tensor per tensor leaf and an :class:`ObjectRef` per pickled object. Plain values come
back as the real Python values (int dict keys, tuples, inf/nan ...), tensor leaves are recognised
by their storage, so ``nn.Parameter`` leaves map back to their manifest record too.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import FormatError
from ..format.manifest import Manifest, ObjectRecord, TensorRecord
from ..format.skeleton import unflatten
from .util import safe, safe_repr, text


@dataclass(frozen=True)
class ObjectRef:
    """Placeholder of a pickled (non-plain) value: its manifest record."""

    record: ObjectRecord


@dataclass(frozen=True)
class Node:
    """One row of the tree: ``kind`` is "container", "tensor", "object" or "value"."""

    path: str
    label: str
    depth: int
    kind: str
    value: Any = None          # the plain value ("value"), container type name ("container")
    record: Any = None         # TensorRecord ("tensor") or ObjectRecord ("object")
    requires_grad: bool | None = None
    size: int = 0              # number of items of a container
    keys: tuple = ()           # the real keys (list indices, int/str/tuple dict keys) from the root


def skeleton_state(manifest: Manifest, where: str) -> tuple[Any, dict[int, TensorRecord]]:
    """The state with placeholders, and a map ``data_ptr -> TensorRecord`` to recognise leaves."""
    leaves = manifest.meta.get("leaves", list(range(len(manifest.tensors))))
    if not isinstance(leaves, list) or not all(
            type(i) is int and 0 <= i < len(manifest.tensors) for i in leaves):
        raise FormatError(f"{where}: invalid leaf table")
    placeholders = [torch.zeros(1) for _ in leaves]
    objects = [ObjectRef(rec) for rec in manifest.objects]
    try:
        state = unflatten(manifest.skeleton, placeholders, objects)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    by_ptr = {t.untyped_storage().data_ptr(): manifest.tensors[i] for t, i in zip(placeholders, leaves)}
    return state, by_ptr


def _is_container(value: Any) -> bool:
    return type(value) in (dict, OrderedDict, list, tuple)


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else list(enumerate(value))


def _small(value: Any, limit: int) -> bool:
    """Whether ``value`` has few enough items anywhere inside for its repr to fit ``limit`` chars
    (each item takes 2 or more); stops counting there, so a deep or long tree is not walked whole
    at each of its levels."""
    stack, budget = [value], limit // 2
    while stack:
        v = stack.pop()
        if _is_container(v):
            budget -= len(v)
            if budget < 0:
                return False
            stack.extend(x for _, x in _items(v))
    return True


def _collapsible(value: Any, by_ptr: dict, limit: int) -> bool:
    """Plain containers with a short repr, and plain lists/tuples of scalars (shortened), are one row."""
    if _scalars(value):
        return True
    return _small(value, limit) and _plain(value) and len(repr(value)) <= limit


def _plain(value: Any) -> bool:
    """True if ``value`` holds no tensor and no pickled object (iterative: no recursion limit)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (torch.Tensor, ObjectRef)):
            return False
        if _is_container(v):
            stack.extend(x for _, x in _items(v))
    return True


def _scalars(value: Any) -> bool:
    """A list or tuple of plain scalars only (no container, tensor or pickled object in it)."""
    return isinstance(value, (list, tuple)) and not any(
        _is_container(v) or isinstance(v, (torch.Tensor, ObjectRef)) for v in value)


def walk(manifest: Manifest, where: str, collapse: int = 72, lists: bool = False) -> Iterator[Node]:
    """Pre-order rows of the state tree. Plain containers whose repr fits ``collapse`` chars and
    plain lists of scalars become one "value" row; ``collapse=0`` expands every container, except
    lists and tuples of plain scalars with ``lists=True`` (one value each)."""
    state, by_ptr = skeleton_state(manifest, where)
    # A pending item holds its parent's (path, keys), made once per container, and its own key: its
    # path is built when it is reached. Built for every pending item, a skeleton of 218 KB (100,000
    # list items under 240 dicts with 80-character keys) took gigabytes before its first row.
    stack: list[tuple[Any, tuple | None, Any, str, int]] = [(state, None, None, "<root>", -1)]
    while stack:
        value, parent, key, label, depth = stack.pop()
        path, keys = (None, ()) if parent is None else (
            text(key) if parent[0] is None else f"{parent[0]}.{text(key)}", parent[1] + (key,))
        if isinstance(value, torch.Tensor):
            rec = by_ptr.get(value.untyped_storage().data_ptr())
            grad = value.requires_grad if isinstance(value, torch.nn.Parameter) else None
            yield Node(path or "", label, depth, "tensor", record=rec, requires_grad=grad, keys=keys)
        elif isinstance(value, ObjectRef):
            yield Node(path or "", label, depth, "object", record=value.record, keys=keys)
        elif _is_container(value) and not ((collapse and _collapsible(value, by_ptr, collapse))
                                           or (lists and _scalars(value))):
            items = _items(value)
            if depth >= 0:
                yield Node(path or "", label, depth, "container", value=type(value).__name__,
                           size=len(items), keys=keys)
            frame = (path, keys)
            stack.extend((child, frame, k, _label(k, value), depth + 1) for k, child in reversed(items))
        else:
            yield Node(path or "", label, depth, "value", value=value, keys=keys)


_NO_KEY = object()


def tensor_items(state: Any) -> Iterator[tuple[tuple, torch.Tensor]]:
    """``(keys, tensor)`` of every tensor in a loaded state, pre-order, with the keys :func:`walk`
    gives the same tensor's node (the same containers are descended: dict, OrderedDict, list, tuple)."""
    stack: list[tuple[Any, tuple, Any]] = [(state, (), _NO_KEY)]  # keys made when reached, as in walk
    while stack:
        value, parent, key = stack.pop()
        keys = parent if key is _NO_KEY else parent + (key,)
        if isinstance(value, torch.Tensor):
            yield keys, value
        elif _is_container(value):
            stack.extend((child, keys, k) for k, child in reversed(_items(value)))


def _label(key: Any, parent: Any) -> str:
    """A key as the tree shows it: ``[3]`` for a list index, a str key as it is, others as repr;
    control characters escaped (a key must not move the cursor or start a line of its own)."""
    if isinstance(parent, (list, tuple)):
        return f"[{key}]"
    return safe(key) if isinstance(key, str) else safe_repr(key)


def plain_values(manifest: Manifest, where: str) -> dict[str, Any]:
    """Every non-container plain leaf of the state by its dotted path (tensors/objects left out)."""
    out: dict[str, Any] = {}
    for node in walk(manifest, where, collapse=0):
        if node.kind == "value":
            out[node.path] = node.value
    return out


def short_repr(value: Any, limit: int = 72) -> str:
    """``repr(value)`` in at most ``limit`` characters (control characters escaped, never raising)."""
    shown = safe_repr(value)
    if len(shown) <= limit:
        return shown
    extra = f" ({len(value)} items)" if _is_container(value) else ""
    return shown[: limit - 3 - len(extra)] + "..." + extra
