"""State tree <-> JSON skeleton plus tensor and object leaves (decoding: ``skeleton``).

A checkpoint state (any nesting of dict / list / tuple / OrderedDict holding tensors and
plain values) is split into a JSON skeleton, the tensors, and the non-plain objects. Plain
values live in the skeleton and never need pickle; tensors and objects become index refs.
All functions are pure and may be called from any thread.

Skeleton: str, finite float, int within +-2**53, bool, null and list stand for themselves;
every JSON object is a tag (so user keys such as "$t" are never ambiguous)::

    {"$d": [k1, v1, k2, v2]}    dict (keys are encoded values: "a", 3, {"$tuple": [1, 2]})
    {"$od": [k1, v1], "$meta": m}  OrderedDict; "$meta" (optional) is its _metadata
    {"$t": 3}  tensor 3          {"$p": [3, true]}  nn.Parameter(tensor 3, requires_grad)
    {"$t": [3, true]}  tensor 3 with requires_grad (a leaf, as torch.load rebuilds it)
    {"$o": 0}  object 0          {"$tuple": [...]}  {"$f": "nan"|"inf"|"-inf"|"nan:<bits>"}
    {"$i": "-0x1f"}  big int     {"$b": "<base64>"}  {"$c": [re, im]}  complex
    {"$dtype": "float32"}        {"$size": [2, 3]}   {"$device": "cuda:0"}
    {"$np": ["float64", "000000000000d03f"]}  numpy scalar: dtype, its bytes (little endian) in hex
    {"$nd": ["int32", [2, 3], "<base64>"]}  small numpy array: dtype, shape, C-order little-endian bytes (up to
    ``NDARRAY_INLINE_BYTES`` of them in all)

Order lives in lists only, so the skeleton survives ``json.dumps(sort_keys=True)``.
``max_depth`` bounds the skeleton's JSON nesting depth (a dict level costs 2); flatten
enforces it as well, so whatever it produces loads and json stays far from recursion limits.
"""
from __future__ import annotations

import base64
import contextlib
import gc
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from ..errors import FormatError
from .dtypes import ALL_DTYPES, DTYPES

__all__ = ["TensorLeaf", "ObjectLeaf", "Flattened", "flatten"]

T_DICT, T_ODICT, T_META, T_TUPLE = "$d", "$od", "$meta", "$tuple"
T_TENSOR, T_PARAM, T_OBJECT = "$t", "$p", "$o"
T_FLOAT, T_INT, T_BYTES, T_COMPLEX = "$f", "$i", "$b", "$c"
T_DTYPE, T_SIZE, T_DEVICE, T_NUMPY, T_NDARRAY = "$dtype", "$size", "$device", "$np", "$nd"
_KEY_FORBIDDEN = frozenset({T_TENSOR, T_PARAM, T_OBJECT, T_DICT, T_ODICT, T_NDARRAY})  # unhashable

# Beyond 2**53, JSON tools that read numbers as doubles (jq, JavaScript) would corrupt ints.
_SAFE_INT, _INT64 = 2**53, 2**63
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_NAN_BITS = re.compile(r"nan:[0-9a-f]{16}")
_CANONICAL_NAN_BITS = 0x7FF8000000000000
_NOT_PLAIN, _EXIT, _FINISH, _MISSING = object(), object(), object(), object()


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor of the state (the original object); ``key`` is its unique flattened path."""

    key: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class ObjectLeaf:
    """A non-plain value of the state (pickled by the engine); ``type_name`` is module.qualname."""

    key: str
    obj: Any
    type_name: str


@dataclass(frozen=True)
class Flattened:
    """Result of :func:`flatten`: ``$t``/``$p`` refs index ``tensors``, ``$o`` refs ``objects``."""

    skeleton: Any
    tensors: tuple[TensorLeaf, ...]
    objects: tuple[ObjectLeaf, ...]
    repeats: tuple[tuple[int, str], ...] = ()
    """(tensor index, key) of each further place a tensor object appears (tied weights under two keys)."""


# ----------------------------------------------------------------------------- encoding


def _float_name(x: float) -> str:
    if not math.isnan(x):
        return "inf" if x > 0 else "-inf"
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return "nan" if bits == _CANONICAL_NAN_BITS else f"nan:{bits:016x}"


def _encode_scalar(x: Any) -> Any:
    """JSON form of a plain non-container value, or _NOT_PLAIN."""
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -_SAFE_INT <= x <= _SAFE_INT else {T_INT: hex(x)}
    if t is float:
        return x if math.isfinite(x) else {T_FLOAT: _float_name(x)}
    if t is complex:
        return {T_COMPLEX: [_encode_scalar(x.real), _encode_scalar(x.imag)]}
    if t is bytes:
        return {T_BYTES: base64.b64encode(x).decode("ascii")}
    if t is torch.dtype:
        name = str(x).removeprefix("torch.")
        return {T_DTYPE: name} if ALL_DTYPES.get(name) is x else _NOT_PLAIN
    if t is torch.device:
        return {T_DEVICE: str(x)}
    if t is torch.Size and all(-_INT64 <= d < _INT64 for d in x):
        return {T_SIZE: list(x)}
    if isinstance(x, np.generic) and x.dtype.name in NUMPY_SCALARS:  # np.float64(0.5): plain data, no pickle
        return {T_NUMPY: [x.dtype.name, x.astype(x.dtype.newbyteorder("<")).tobytes().hex()]}
    if t is np.ndarray and x.dtype.name in NUMPY_SCALARS and x.nbytes <= NDARRAY_MAX_BYTES and x.ndim <= 32:
        raw = np.ascontiguousarray(x, x.dtype.newbyteorder("<")).tobytes()
        return {T_NDARRAY: [x.dtype.name, list(x.shape), base64.b64encode(raw).decode("ascii")]}
    return _NOT_PLAIN


#: numpy scalar types stored as plain data (``$np``: dtype and raw bytes, bit for bit), and the dtypes
#: of numpy arrays of at most ``NDARRAY_MAX_BYTES`` stored so (``$nd``); others (``longdouble``,
#: strings, datetimes, objects, larger arrays) are pickled values, as torch.save writes them.
NUMPY_SCALARS = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                           "float16", "float32", "float64", "complex64", "complex128"})
NDARRAY_MAX_BYTES = 1 << 16
#: Bytes of numpy arrays stored as plain data in one manifest, in all (base64 in its JSON: 4/3 of them,
#: half the 64 MiB a manifest may hold); the arrays after those are pickled, as larger ones are (before
#: 2026-12-07 a state of 1,200 arrays of 64 KiB made a 105 MB manifest, refused at commit: found by an
#: independent check).
NDARRAY_INLINE_BYTES = 24 << 20


def _scalar_depth(enc: Any) -> int:
    """JSON depth of a scalar encoding (at most 3, so the recursion is bounded)."""
    if type(enc) is dict:
        return 1 + _scalar_depth(next(iter(enc.values())))
    if type(enc) is list:
        return 1 + max((_scalar_depth(e) for e in enc), default=0)
    return 0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC (process-wide): walks and staging create many acyclic objects, and every
    collection they trigger would rescan each live tensor (over half of flatten's time at 100k
    tensors), on the training thread. Blocking waits belong outside."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _text(value: Any, convert: Any = str) -> str:
    try:
        return convert(value)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        return hex(value) if type(value) is int else f"<{type(value).__name__}>"


def _stored_as_tensor(t: torch.Tensor) -> bool:
    """Whether a tensor is stored as a tensor (chunks, row deltas): a dense (strided) one of a dtype
    the format names. Sparse, nested and quantized tensors and other dtypes (``bits8``)
    are pickled values, exactly as ``torch.save`` writes them (``objects``)."""
    return t.layout is torch.strided and t.dtype in _STORED_DTYPES and not t.is_nested


_STORED_DTYPES = frozenset(DTYPES.values())


KeyPath = Optional[tuple]
"""A key path while walking a state: None (the root) or (parent path, key or index). A path as text
per pending item cost its depth x key length each (a list of 5,000 items under 200 dicts with
80-character keys: 78 MB to save); ``_render`` makes the text of the few that need it."""


def _render(path: KeyPath) -> str | None:
    """The dotted key of ``path`` (str keys as they are, others as ``_text``); None for the root."""
    if path is None:
        return None
    parts = []
    while path is not None:
        path, component = path
        parts.append(component if type(component) is str else _text(component))
    return ".".join(reversed(parts))


def _containers(value: Any) -> int:
    """JSON lists and objects in an encoded value (a tagged scalar, a reference, a key)."""
    t = type(value)
    if t is dict:
        return 1 + sum(_containers(v) for v in value.values())
    if t is list:
        return 1 + sum(_containers(v) for v in value)
    return 0


def _where(path: KeyPath) -> str:
    """``_render`` for a message: at most ~200 characters (1,000 levels made a 2 KB error)."""
    text = _render(path) or "<root>"
    return text if len(text) <= 200 else f"{text[:96]}...{text[-96:]}"


#: Values larger than these without tensors go to a blob as objects (pickled, loaded like any object,
#: under ``weights_only``), not into the manifest: inline, a sampler's 4M-index permutation or a 70 MB
#: string made a manifest that loads refuse (``load.max_manifest_elements``, the 64 MiB manifest cap).
SPILL_ITEMS = 1 << 16
SPILL_CHARS = 1 << 20
_FLAT = (int, float, str, bool, type(None))


def _spilled(value: Any, t: type) -> bool:
    """A long string/bytes, or a list/tuple/dict of more than ``SPILL_ITEMS`` items with no tensor
    anywhere inside (tensors stay tensor leaves: chunked, incremental, quantizable)."""
    if t is str or t is bytes:
        return len(value) > SPILL_CHARS
    if t is not list and t is not tuple and t is not dict:
        return False
    if len(value) <= SPILL_ITEMS:
        return False
    todo = [value]
    while todo:  # iterative: as deep as the state goes
        v = todo.pop()
        tv = type(v)
        if tv in _FLAT:
            continue
        if isinstance(v, torch.Tensor):
            return False
        if tv is list or tv is tuple:
            todo.extend(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
    return True


class _NotPlainKey(Exception):
    """A dict key the skeleton cannot hold; the whole dict then becomes an object."""


class _Encoder:
    """Iterative pre-order walk (no recursion limit); leaf indices follow traversal order.

    Work items are (value, out, slot, path, depth): the encoding goes to ``out[slot]`` and
    ``depth`` is the JSON depth of ``out``. ``path`` is a ``KeyPath``, made into text only where a
    leaf gets its key or an error names it.
    """

    def __init__(self, max_depth: int, max_containers: int | None = None) -> None:
        self.max_depth, self.max_containers = max_depth, max_containers
        self.containers = 0  # JSON lists and objects written: a shared container's once per place it appears
        self.inline_bytes = 0  # of numpy arrays stored as plain data (``NDARRAY_INLINE_BYTES``)
        self.tensors: list[TensorLeaf] = []
        self.objects: list[ObjectLeaf] = []
        self._tensor_ids: dict[int, int] = {}
        self.repeats: list[tuple[int, str]] = []
        self._object_ids: dict[int, int] = {}
        self._used: set[str] = set()
        self._active: set[int] = set()

    def run(self, root: Any, depth: int = 0, key_mode: bool = False) -> Any:
        holder = [None]
        stack: list[tuple] = [(root, holder, 0, None, depth)]
        while stack:
            item = stack.pop()
            if item[0] is _EXIT:
                self._active.discard(item[1])
            else:
                self._visit(*item, stack, key_mode)
        return holder[0]

    def _check(self, depth: int, path: KeyPath) -> None:
        if depth > self.max_depth:
            raise FormatError(f"cannot save state: {_where(path)} nests deeper than "
                              f"max_depth={self.max_depth}")

    def _enter(self, value: Any, path: KeyPath, stack: list) -> None:
        # Containers are written by value, so a cycle would never end.
        if id(value) in self._active:
            raise FormatError(f"cannot save state: reference cycle at {_where(path)}")
        # a list is one JSON container, a dict or tuple two ({"$d": [...]}). One shared n times is written n
        # times: 2**n for a chain of shared pairs
        self._add(1 if type(value) is list else 2, path)
        self._active.add(id(value))
        stack.append((_EXIT, id(value)))

    def _add(self, n: int, path: KeyPath) -> None:
        """Count ``n`` more JSON lists and objects (tagged values and references too: {"$np": [...]} is two,
        found by an independent check, 600k numpy scalars passed ``save()`` and failed at commit)."""
        self.containers += n
        if self.max_containers is not None and self.containers > self.max_containers:
            raise FormatError(f"cannot save state: its lists, tuples, dicts and tagged values take more than "
                              f"{self.max_containers} JSON lists and objects, more than a load accepts "
                              "(load.max_manifest_elements / 4); they are stored by value, so one that appears at "
                              "several places counts at each (at "
                              f"{_where(path)}): keep large or shared plain structures as tensors, "
                              "or as one pickled object")

    def _visit(self, value: Any, out: Any, slot: Any, path: KeyPath, depth: int, stack: list,
               key_mode: bool) -> None:
        t = type(value)
        if t is torch.Tensor and not key_mode and _stored_as_tensor(value):  # the common leaf first
            self._check(depth + 1, path)
            out[slot] = ref = self._tensor_ref(value, path)
            self._add(_containers(ref), path)
            return
        if not key_mode and _spilled(value, t):
            self._check(depth + 1, path)
            out[slot] = {T_OBJECT: self._object_ref(value, path)}
            self._add(1, path)
            return
        enc = _encode_scalar(value)
        if t is np.ndarray and enc is not _NOT_PLAIN:
            self.inline_bytes += value.nbytes
            if self.inline_bytes > NDARRAY_INLINE_BYTES:  # the manifest's room is for structure, not data
                enc = _NOT_PLAIN
        if enc is not _NOT_PLAIN:
            self._check(depth + _scalar_depth(enc), path)
            out[slot] = enc
            if type(enc) is dict:
                self._add(_containers(enc), path)
            return
        if t is tuple or (t is list and not key_mode):
            inner = depth + (2 if t is tuple else 1)
            self._check(inner, path)
            items = [None] * len(value)
            out[slot] = {T_TUPLE: items} if t is tuple else items
            self._enter(value, path, stack)
            for i in range(len(value) - 1, -1, -1):
                stack.append((value[i], items, i, (path, i), inner))
        elif key_mode:
            raise _NotPlainKey
        elif (t is dict or t is OrderedDict) and self._mapping(value, out, slot, path, depth, stack):
            pass
        elif (t is torch.Tensor or t is torch.nn.Parameter) and _stored_as_tensor(value):
            self._check(depth + (2 if t is torch.nn.Parameter else 1), path)
            out[slot] = ref = self._tensor_ref(value, path)
            self._add(_containers(ref), path)
        else:
            self._check(depth + 1, path)
            out[slot] = {T_OBJECT: self._object_ref(value, path)}
            self._add(1, path)

    def _mapping(self, value: dict, out: Any, slot: Any, path: KeyPath, depth: int, stack: list) -> bool:
        """Encode a dict/OrderedDict; False when a key is not plain (caller stores an object)."""
        self._check(depth + 2, path)
        items = list(value.items())
        flat: list = [None] * (2 * len(items))
        try:
            for i, (k, _) in enumerate(items):
                flat[2 * i] = k if type(k) is str else self._key(k, depth + 2)
        except _NotPlainKey:
            return False
        self._add(sum(_containers(k) for k in flat[::2] if type(k) is not str), path)
        self._enter(value, path, stack)
        tag = T_ODICT if type(value) is OrderedDict else T_DICT
        node = out[slot] = {tag: flat}
        meta = getattr(value, "_metadata", _MISSING) if tag == T_ODICT else _MISSING
        if meta is not _MISSING:  # pushed first, so visited after the entries
            node[T_META] = None
            stack.append((meta, node, T_META, (path, "_metadata"), depth + 1))
        for i in range(len(items) - 1, -1, -1):
            stack.append((items[i][1], flat, 2 * i + 1, (path, items[i][0]), depth + 2))
        return True

    def _key(self, key: Any, depth: int) -> Any:
        enc = _encode_scalar(key)
        if enc is not _NOT_PLAIN:
            self._check(depth + _scalar_depth(enc), None)
            return enc
        if type(key) is not tuple:
            raise _NotPlainKey
        return _Encoder(self.max_depth).run(key, depth, key_mode=True)

    def _unique(self, path: KeyPath) -> str:
        # Keys are stream identities in the engine: 1 and "1" must not share one.
        key = _render(path) or ""
        if key in self._used:
            n = 2
            while f"{key}#{n}" in self._used:
                n += 1
            key = f"{key}#{n}"
        self._used.add(key)
        return key

    def _tensor_ref(self, tensor: torch.Tensor, path: KeyPath) -> dict:
        # The leaves list keeps each tensor alive, so an id() cannot be reused during the walk.
        index = self._tensor_ids.get(id(tensor))
        if index is None:
            index = self._tensor_ids[id(tensor)] = len(self.tensors)
            self.tensors.append(TensorLeaf(self._unique(path), tensor))
        else:
            self.repeats.append((index, _render(path) or ""))
        if type(tensor) is torch.nn.Parameter:
            return {T_PARAM: [index, bool(tensor.requires_grad)]}
        if tensor.requires_grad:  # a plain tensor that requires grad (a learnable scalar) keeps the flag
            return {T_TENSOR: [index, True]}
        return {T_TENSOR: index}

    def _object_ref(self, obj: Any, path: KeyPath) -> int:
        index = self._object_ids.get(id(obj))
        if index is None:
            index = self._object_ids[id(obj)] = len(self.objects)
            type_name = f"{type(obj).__module__}.{type(obj).__qualname__}"
            self.objects.append(ObjectLeaf(self._unique(path), obj, type_name))
        return index


def flatten(state: Any, *, max_depth: int = 512, max_containers: int | None = None) -> Flattened:
    """Split ``state`` into a JSON skeleton, its tensors and its non-plain objects.

    Tensors and nn.Parameters are deduplicated by identity (tied weights share one index),
    and so are objects. Dicts with a non-plain key, tensor subclasses other than Parameter
    and all other non-plain values become :class:`ObjectLeaf` s. Leaves hold the original
    objects (no copy). Raises FormatError for a reference cycle, nesting beyond ``max_depth`` or more
    than ``max_containers`` lists, tuples and dicts (each place a shared one appears counts).
    """
    enc = _Encoder(max_depth, max_containers)
    with gc_paused():
        skeleton = enc.run(state)
    return Flattened(skeleton, tuple(enc.tensors), tuple(enc.objects), tuple(enc.repeats))
