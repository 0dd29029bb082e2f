"""The decoding half of the state tree (``tree``): an untrusted JSON skeleton back into the state.

``unflatten`` rebuilds the state from a skeleton, its tensors and its loaded objects;
``validate_skeleton`` checks a skeleton without building anything. Both walk iteratively, bound the
depth and name the key path of anything wrong in one FormatError; nothing is evaluated or imported.
The skeleton's tags are documented in ``tree``.
"""
from __future__ import annotations

import base64
import binascii
import math
import struct
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import FormatError
from .dtypes import ALL_DTYPES
from .tree import (_FINISH, _HEX_INT, _INT64, _KEY_FORBIDDEN, _NAN_BITS, NDARRAY_MAX_BYTES, NUMPY_SCALARS, T_BYTES,
                   T_COMPLEX, T_DEVICE, T_DICT, T_DTYPE, T_FLOAT, T_INT, T_META, T_NDARRAY, T_NUMPY, T_OBJECT, T_ODICT,
                   T_PARAM, T_SIZE, T_TENSOR, T_TUPLE, _text, gc_paused)

__all__ = ["unflatten", "validate_skeleton"]


def _short(value: Any) -> str:
    text = _text(value, repr)
    return text if len(text) <= 60 else text[:57] + "..."


#: A key path while decoding: None (the root) or (parent path, key or index), made into text only
#: for an error (``_where``). A string per pending item cost depth x key length each: a 218 KB
#: hostile skeleton (100,000 items 240 dicts deep) took 2 GB to load.
Path = Optional[tuple]


def _where(path: Path) -> str:
    """The dotted text of ``path`` (each key cut to 80 characters), its last 200 characters."""
    parts: list[str] = []
    size = 0
    while path is not None and size <= 200:
        path, component = path
        text = _text(component)
        parts.append(text if len(text) <= 80 else text[:77] + "...")
        size += len(parts[-1]) + 1
    where = "..." + ".".join(reversed(parts)) if path is not None else ".".join(reversed(parts)) or "<root>"
    return where if len(where) <= 200 else "..." + where[-197:]


def _fail(path: Path, message: str) -> None:
    raise FormatError(f"skeleton at {_where(path)}: {message}")


def _djoin(path: Path, component: Any) -> Path:
    return (path, component)


def _decode_scalar(tag: str, v: Any, path: Path) -> Any:
    """Decode a scalar tag's value; every malformed value ends in one FormatError."""
    t = type(v)
    try:
        if tag == T_FLOAT and t is str:
            if v in ("nan", "inf", "-inf"):
                return float(v)  # a fresh object each time, so two nan dict keys stay distinct
            if _NAN_BITS.fullmatch(v) and math.isnan(x := struct.unpack(">d", bytes.fromhex(v[4:]))[0]):
                return x
        elif tag == T_INT and t is str and _HEX_INT.fullmatch(v):
            return int(v, 16)
        elif tag == T_BYTES and t is str:
            return base64.b64decode(v, validate=True)
        elif tag == T_COMPLEX and t is list and len(v) == 2:
            return complex(*(_complex_part(p, path) for p in v))
        elif tag == T_DTYPE and t is str and v in ALL_DTYPES:
            return ALL_DTYPES[v]
        elif tag == T_DEVICE and t is str and len(v) <= 64:
            return torch.device(v)
        elif tag == T_SIZE and t is list and all(type(d) is int and -_INT64 <= d < _INT64 for d in v):
            return torch.Size(v)
        elif (tag == T_NUMPY and t is list and len(v) == 2 and v[0] in NUMPY_SCALARS and type(v[1]) is str
              and len(raw := bytes.fromhex(v[1])) == np.dtype(v[0]).itemsize):  # fromhex skips spaces: count bytes
            return np.frombuffer(raw, np.dtype(v[0]).newbyteorder("<")).astype(v[0])[0]
        elif tag == T_NDARRAY and t is list and len(v) == 3 and (array := _ndarray(*v)) is not None:
            return array
    except (binascii.Error, RuntimeError, ValueError, TypeError, OverflowError, IndexError):
        pass
    _fail(path, f"bad {tag} value {_short(v)}")


def _ndarray(dtype: Any, shape: Any, data: Any) -> np.ndarray | None:
    """A ``$nd`` value: a numeric array of at most ``NDARRAY_MAX_BYTES``, its size checked before
    decoding; None for a malformed one (a binascii.Error of its base64 is left to the caller)."""
    if (dtype not in NUMPY_SCALARS or type(shape) is not list or len(shape) > 32 or type(data) is not str
            or not all(type(d) is int and 0 <= d <= NDARRAY_MAX_BYTES for d in shape)
            or len(data) > 4 * (NDARRAY_MAX_BYTES // 3 + 1)):
        return None
    raw = base64.b64decode(data, validate=True)
    if len(raw) != math.prod(shape) * np.dtype(dtype).itemsize:
        return None
    return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)


def _complex_part(p: Any, path: Path) -> float:
    if type(p) is float or type(p) is int:
        return float(p)
    if type(p) is dict and len(p) == 1 and T_FLOAT in p:
        return _decode_scalar(T_FLOAT, p[T_FLOAT], path)
    _fail(path, f"bad {T_COMPLEX} part {_short(p)}")


_SCALAR_TAGS = frozenset({T_FLOAT, T_INT, T_BYTES, T_COMPLEX, T_DTYPE, T_DEVICE, T_SIZE, T_NUMPY, T_NDARRAY})
_ONE_KEY_TAGS = frozenset(_SCALAR_TAGS) | {T_TENSOR, T_PARAM, T_OBJECT, T_TUPLE, T_DICT, T_ODICT}


def _tag_of(node: dict, path: Path) -> str:
    if len(node) == 1:
        (tag,) = node
        if tag in _ONE_KEY_TAGS:
            return tag
    elif len(node) == 2 and T_ODICT in node and T_META in node:
        return T_ODICT
    _fail(path, f"unknown tag {_short(list(node)[:3])}")


class _AttrSlot:
    """Lets ``out[slot] = value`` set an attribute (OrderedDict._metadata)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.obj, name, value)


class _Decoder:
    """Iterative walk over an untrusted skeleton; ``tensors=None`` validates only.

    Work items are (node, out, slot, path, depth) like the encoder's; tuples are built as
    lists and frozen by a _FINISH item once their children are done.
    """

    def __init__(self, tensors: Sequence | None, n_tensors: int, objects: Sequence | None,
                 n_objects: int, max_depth: int) -> None:
        self.tensors, self.n_tensors = tensors, n_tensors
        self.objects, self.n_objects = objects, n_objects
        self.max_depth = max_depth
        self._params: dict[tuple[int, bool], torch.nn.Parameter] = {}

    def run(self, root: Any, depth: int = 0, path: Path = None, key_mode: bool = False) -> Any:
        holder = [None]
        stack: list[tuple] = [(root, holder, 0, path, depth)]
        while stack:
            item = stack.pop()
            if item[0] is _FINISH:
                _, items, out, slot = item
                out[slot] = tuple(items)
            else:
                self._visit(*item, stack, key_mode)
        return holder[0]

    def _check(self, depth: int, path: Path) -> None:
        if depth > self.max_depth:
            _fail(path, f"nesting deeper than max_depth={self.max_depth}")

    def _visit(self, node: Any, out: Any, slot: Any, path: Path, depth: int, stack: list,
               key_mode: bool) -> None:
        t = type(node)
        if node is None or t is bool or t is int or t is float or t is str:
            out[slot] = node
            return
        if t is not dict and t is not list:
            _fail(path, f"unexpected {t.__name__} in skeleton")
        self._check(depth + 1, path)
        tag = _tag_of(node, path) if t is dict else None
        if key_mode and (tag is None or tag in _KEY_FORBIDDEN):
            _fail(path, f"{tag or 'a list'} cannot be a dict key")
        if t is list:
            out[slot] = items = [None] * len(node)
            self._push(node, items, path, depth + 1, stack)
        elif tag in _SCALAR_TAGS:
            out[slot] = _decode_scalar(tag, node[tag], path)
        elif tag == T_TUPLE:
            if type(node[tag]) is not list:
                _fail(path, f"{T_TUPLE} needs a list")
            self._check(depth + 2, path)
            items = [None] * len(node[tag])
            stack.append((_FINISH, items, out, slot))
            self._push(node[tag], items, path, depth + 2, stack)
        elif tag == T_DICT or tag == T_ODICT:
            out[slot] = self._mapping(node, tag, path, depth + 1, stack)
        else:
            out[slot] = self._leaf(tag, node[tag], path)

    @staticmethod
    def _push(node: list, items: list, path: Path, depth: int, stack: list) -> None:
        for i in range(len(node) - 1, -1, -1):
            stack.append((node[i], items, i, _djoin(path, i), depth))

    def _mapping(self, node: dict, tag: str, path: Path, depth: int, stack: list) -> dict:
        flat = node[tag]
        if type(flat) is not list or len(flat) % 2:
            _fail(path, f"{tag} needs a flat [key, value, ...] list")
        self._check(depth + 1, path)
        target: dict = OrderedDict() if tag == T_ODICT else {}
        for i in range(0, len(flat), 2):
            key = flat[i] if type(flat[i]) is str else self.run(flat[i], depth + 1, path, key_mode=True)
            if key in target:
                _fail(path, f"duplicate key {_short(key)}")
            target[key] = None  # fixes the order now; values arrive later
        keys = list(target)
        for i in range(len(keys) - 1, -1, -1):
            stack.append((flat[2 * i + 1], target, keys[i], _djoin(path, keys[i]), depth + 1))
        if T_META in node:
            stack.append((node[T_META], _AttrSlot(target), "_metadata", _djoin(path, "_metadata"), depth))
        return target

    def _leaf(self, tag: str, v: Any, path: Path) -> Any:
        if tag == T_OBJECT:
            if type(v) is not int or not 0 <= v < self.n_objects:
                _fail(path, f"object ref {_short(v)} out of range (have {self.n_objects})")
            return None if self.objects is None else self.objects[v]
        grad = False
        if tag == T_PARAM or type(v) is list:
            if type(v) is not list or len(v) != 2 or type(v[1]) is not bool:
                _fail(path, f"{tag} needs [index, requires_grad], got {_short(v)}")
            v, grad = v
        if type(v) is not int or not 0 <= v < self.n_tensors:
            _fail(path, f"tensor ref {_short(v)} out of range (have {self.n_tensors})")
        if self.tensors is None:
            return None
        if tag == T_TENSOR:
            return self._grad_tensor(v, path) if grad else self.tensors[v]
        param = self._params.get((v, grad))
        live = self.tensors[v]
        if param is None and type(live) is torch.nn.Parameter and live.requires_grad == grad:
            param = live  # a Parameter of ``load(into=...)``, filled in place: the leaf returned (ENGINE_API.md)
        if param is None:
            try:
                param = torch.nn.Parameter(self.tensors[v].detach(), requires_grad=grad)
            except RuntimeError as exc:  # e.g. requires_grad on an integer tensor
                _fail(path, f"cannot rebuild nn.Parameter: {exc}")
            self._params[(v, grad)] = param  # tied parameters stay one object
        return param

    def _grad_tensor(self, v: int, path: Path) -> torch.Tensor:
        """Tensor ``v`` as a leaf that requires grad (one object for every ref to it)."""
        tensor = self._params.get((v, "tensor"))
        if tensor is None:
            tensor = self.tensors[v]
            if not (tensor.requires_grad and tensor.is_leaf):
                try:
                    tensor = tensor.detach().requires_grad_(True)
                except RuntimeError as exc:  # e.g. an integer tensor
                    _fail(path, f"cannot make tensor {v} require grad: {exc}")
            self._params[(v, "tensor")] = tensor
        return tensor


def _check_counts(n_tensors: int, n_objects: int, max_depth: int) -> None:
    for name, n in (("n_tensors", n_tensors), ("n_objects", n_objects), ("max_depth", max_depth)):
        if type(n) is not int or n < 0:
            raise TypeError(f"{name} must be a non-negative int, got {n!r}")


def validate_skeleton(skeleton: Any, n_tensors: int, n_objects: int, *, max_depth: int = 512) -> None:
    """Check an untrusted skeleton (e.g. from a tampered manifest) without building the state.

    Verifies tags, value types, ref ranges, dtype and device names, duplicate keys and depth;
    never evaluates or imports anything. Raises FormatError naming the key path.
    """
    _check_counts(n_tensors, n_objects, max_depth)
    with gc_paused():
        _Decoder(None, n_tensors, None, n_objects, max_depth).run(skeleton)


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor], objects: Sequence[Any], *,
              max_depth: int = 512) -> Any:
    """Rebuild the state from a skeleton, its tensors and its (already loaded) objects.

    Refs to one index yield one object: ``$t`` the given tensor itself, ``$p`` a single
    nn.Parameter sharing that tensor's data. The skeleton is untrusted: every problem
    raises FormatError naming the key path.
    """
    _check_counts(len(tensors), len(objects), max_depth)
    with gc_paused():
        return _Decoder(tensors, len(tensors), objects, len(objects), max_depth).run(skeleton)
