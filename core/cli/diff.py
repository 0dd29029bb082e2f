"""``checkrun diff A B``: which tensors (and rows) and which plain values differ between checkpoints.

Tensors whose manifest records name the same blobs (and dtype/shape/codecs) are equal without
reading anything; only when some tensor needs a look are both states loaded. A composite
(accelerate_ckpt) is compared part by part: its keys are ``parts.N.<key>``, its index's values
``checkpoint.<key>``. Rows are the first
dimension (the elements of a 1-D tensor; a 0-d tensor is one row). NaN equals NaN here.

Tensors and values are paired by their real path in the state (the keys from the root, each with
its type), never by the dotted text shown: ``{"a.b": x}`` and ``{"a": {"b": y}}`` are two leaves,
as are the keys ``2`` and ``"2"``. Names that would read the same are shown as subscripts
(``['a.b']``, ``['a']['b']``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .composite import View, open_view
from .tree import short_repr, tensor_items, walk
from .util import EXIT_OK, EXIT_PROBLEM, Context, emit_json, fmt_float, safe, safe_repr, table, text
from ..format.manifest import TensorRecord

_BLOCK_ELEMS = 1 << 22
_BITWISE = frozenset(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


def _same_blobs(a: TensorRecord, b: TensorRecord) -> bool:
    # A pack (several tensors in one blob) holds the same bytes for both only at the same part.
    return (a.dtype == b.dtype and a.shape == b.shape and list(a.codecs) == list(b.codecs)
            and [x.key for x in a.blobs()] == [x.key for x in b.blobs()]
            and [c.part for c in a.base] == [c.part for c in b.base])


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Changed rows/elements and the max abs difference of two same-shaped tensors (blockwise);
    the difference is None for packed dtypes (``float4_e2m1fn_x2``), compared bit for bit."""
    rows = a.shape[0] if a.dim() else 1
    if a.numel() == 0:  # reshape(rows, -1) is undefined for empty tensors; nothing can differ
        return {"rows": rows, "changed_rows": 0, "elements": 0, "changed_elements": 0, "max_abs_diff": 0.0}
    a2, b2 = a.detach().reshape(rows, -1), b.detach().reshape(rows, -1)
    cols = a2.shape[1] if a2.dim() == 2 else 1
    step = max(1, _BLOCK_ELEMS // max(cols, 1))
    changed_rows = changed_elems = 0
    max_diff = 0.0
    for start in range(0, rows, step):
        x, y = a2[start:start + step], b2[start:start + step]
        if x.dtype == torch.bool:
            ne = x != y
            diff = ne.to(torch.float64)
        elif x.dtype in _BITWISE:  # packed values torch cannot convert: compared bit for bit, no difference
            ne = x.view(torch.uint8) != y.view(torch.uint8)
            diff = None
        else:
            wide = torch.complex128 if x.is_complex() else torch.float64
            x, y = x.to(wide), y.to(wide)
            ne = (x != y) & ~(torch.isnan(x) & torch.isnan(y))
            diff = (x - y).abs()  # real for complex inputs too
        changed_rows += int(ne.any(dim=1).sum()) if ne.numel() else 0
        changed_elems += int(ne.sum())
        if diff is None:
            max_diff = None
        elif ne.any() and max_diff is not None:
            block_max = float(diff[ne].max())
            max_diff = block_max if math.isnan(block_max) else max(max_diff, block_max)
    return {"rows": rows, "changed_rows": changed_rows, "elements": a.numel(), "changed_elements": changed_elems,
            "max_abs_diff": max_diff}


Leaf = tuple
"""Identity of a leaf: its view prefix, then (type name, repr) of every key from the root."""


def _leaf(prefix: str, keys: tuple, memo: dict) -> Leaf:
    """``memo``: ``id(key) -> (key, its identity)``; the leaves under one container share its keys'
    objects, so a deep tree costs a tuple of pointers per leaf, not its keys' reprs again."""
    out = [prefix]
    for k in keys:
        hit = memo.get(id(k))
        if hit is None or hit[0] is not k:
            hit = memo[id(k)] = (k, (type(k).__name__, safe_repr(k)))
        out.append(hit[1])
    return tuple(out)


@dataclass(frozen=True)
class Pickled:
    """A pickled value, compared by its content-addressed blob (never unpickled by ``diff``)."""

    type: str
    blob: str

    def __repr__(self) -> str:
        return f"<pickled {self.type}, blob {self.blob[:12]}>"


def _leaves(view: View) -> tuple[dict[Leaf, tuple], dict[Leaf, tuple]]:
    """(tensor records, plain values) of a view by leaf identity, each as ``(prefix, keys, item)``;
    a tensor tied to several paths is counted once, at its first path (as ``flatten`` does)."""
    tensors: dict[Leaf, tuple] = {}
    values: dict[Leaf, tuple] = {}
    seen: set[int] = set()
    memo: dict[int, tuple] = {}
    sources = [("checkpoint.", view.url, view.manifest)] if view.composite else []
    for prefix, url, manifest in sources + [(p.prefix, p.url, p.manifest) for p in view.pieces]:
        for node in walk(manifest, url, collapse=0, lists=True):
            if node.kind == "value":
                values[_leaf(prefix, node.keys, memo)] = (prefix, node.keys, node.value)
            elif node.kind == "object" and node.record is not None:  # pickled: equal iff its blob is
                values[_leaf(prefix, node.keys, memo)] = (prefix, node.keys, Pickled(node.record.type, node.record.blob.key))
            elif node.kind == "tensor" and node.record is not None and prefix != "checkpoint.":
                if id(node.record) not in seen:
                    seen.add(id(node.record))
                    tensors[_leaf(prefix, node.keys, memo)] = (prefix, node.keys, node.record)
    return tensors, values


def _names(*maps: dict[Leaf, tuple]) -> dict[Leaf, str]:
    """Printable names: dotted (``model.0.weight``); where two leaves would read the same, subscripts
    (``['a.b']`` / ``['a']['b']``, ``[2]`` / ``['2']``). Control characters are escaped."""
    dotted: dict[Leaf, str] = {}
    for m in maps:
        for leaf, (prefix, keys, _) in m.items():
            dotted.setdefault(leaf, prefix + ".".join(text(k) for k in keys))
    count: dict[str, int] = {}
    for name in dotted.values():
        count[name] = count.get(name, 0) + 1
    out = {}
    for leaf, name in dotted.items():
        if count[name] > 1:
            keys = next(m[leaf][1] for m in maps if leaf in m)
            name = leaf[0] + "".join(f"[{safe_repr(k)}]" for k in keys)
        out[leaf] = safe(name)
    return out


def _load_tensors(ctx: Context, view: View, unsafe: bool) -> dict[Leaf, torch.Tensor]:
    out: dict[Leaf, torch.Tensor] = {}
    memo: dict[int, tuple] = {}
    for piece in view.pieces:
        state = ctx.engine.load(piece.url, map_location="cpu", weights_only=not unsafe,
                                storage_options=ctx.storage_options)
        for keys, tensor in tensor_items(state):
            out.setdefault(_leaf(piece.prefix, keys, memo), tensor)
    return out


def _tensor_diffs(ctx: Context, va: View, vb: View, ra: dict, rb: dict, names: dict) -> list[dict]:
    out, todo = [], []
    for leaf in list(ra) + [k for k in rb if k not in ra]:
        key = names[leaf]
        x, y = (ra[leaf][2] if leaf in ra else None), (rb[leaf][2] if leaf in rb else None)
        if x is None or y is None:
            rec = x or y
            out.append({"key": key, "status": "removed" if y is None else "added", "dtype": rec.dtype,
                        "shape": list(rec.shape)})
        elif x.dtype != y.dtype or x.shape != y.shape:
            out.append({"key": key, "status": "retyped", "dtype": [x.dtype, y.dtype],
                        "shape": [list(x.shape), list(y.shape)]})
        elif _same_blobs(x, y):
            out.append({"key": key, "status": "same", "how": "blobs", "dtype": x.dtype, "shape": list(x.shape)})
        else:
            item = {"key": key, "dtype": x.dtype, "shape": list(x.shape)}
            out.append(item)
            todo.append((leaf, item))
    if not todo:
        return out
    with ctx.bar(2 + len(todo), "comparing", unit="step") as bar:
        ta = _load_tensors(ctx, va, ctx.args.unsafe)
        bar.update(1)
        tb = _load_tensors(ctx, vb, ctx.args.unsafe)
        bar.update(1)
        for leaf, item in todo:
            x, y = ta.get(leaf), tb.get(leaf)
            if x is None or y is None:  # pragma: no cover - both walks follow the same containers
                item.update(status="unknown", how="tensor not found after loading")
            else:
                item.update(compare_tensors(x, y))
                item["status"] = "changed" if item["changed_elements"] else "same"
                item["how"] = "values"
            bar.update(1)
    return out


def _value_diffs(va: dict, vb: dict, names: dict) -> list[dict]:
    out = []
    for leaf in list(va) + [k for k in vb if k not in va]:
        key = names[leaf]
        if leaf not in vb:
            out.append({"key": key, "status": "removed", "a": va[leaf][2]})
        elif leaf not in va:
            out.append({"key": key, "status": "added", "b": vb[leaf][2]})
        elif not _equal(x := va[leaf][2], y := vb[leaf][2]):
            out.append({"key": key, "status": "changed", "a": x, "b": y})
            if isinstance(x, (list, tuple)):  # where they part: the first item that differs
                out[-1]["index"] = next((i for i, (p, q) in enumerate(zip(x, y)) if not _equal(p, q)),
                                        min(len(x), len(y)))
    return out


def _shown(v: dict, side: str) -> str | None:
    """A value as the table shows it; a list that changed from its first differing item on."""
    if side not in v:
        return None
    value, i = v[side], v.get("index")
    if i is None:
        return short_repr(value, 40)
    item = short_repr(value[i], 20) if i < len(value) else "(ends)"
    return f"[{i}] {item} of {len(value)} items"


def _equal(x: Any, y: Any) -> bool:
    """Equal plain values of the same type; NaN equals NaN (numpy's too); arrays elementwise."""
    if type(x) is not type(y):
        return False
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc")
    if isinstance(x, (list, tuple)):  # of scalars (walk(lists=True)): compared whole, item by item
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, (float, complex, np.inexact)) and _nan(x) and _nan(y):
        return True
    return bool(x == y)


def _nan(x: Any) -> bool:
    return x != x  # a nan in any float or complex part


def _row(d: dict) -> list:
    st = d["status"]
    if st == "changed":
        return [d["key"], st, f"{d['changed_rows']}/{d['rows']}", f"{d['changed_elements']}/{d['elements']}",
                fmt_float(d["max_abs_diff"])]
    if st == "retyped":
        (da, db), (sa, sb) = d["dtype"], d["shape"]
        return [d["key"], "shape/dtype", None, None, f"{da}{sa} -> {db}{sb}"]
    if st == "same":
        return [d["key"], "same" + (" (blobs)" if d["how"] == "blobs" else ""), "0", "0", "0"]
    return [d["key"], st, None, None, f"{d['dtype']} {d['shape']}"]


def cmd_diff(ctx: Context) -> int:
    args = ctx.args
    a, b = ctx.checkpoint(args.a), ctx.checkpoint(args.b)
    va, vb = open_view(ctx, a), open_view(ctx, b)
    (ta, xa), (tb, xb) = _leaves(va), _leaves(vb)
    names = _names(ta, tb, xa, xb)
    tensors = _tensor_diffs(ctx, va, vb, ta, tb, names)
    values = _value_diffs(xa, xb, names)
    counts = {s: sum(1 for t in tensors if t["status"] == s)
              for s in ("same", "changed", "added", "removed", "retyped")}
    counts["skipped_by_blobs"] = sum(1 for t in tensors if t.get("how") == "blobs")
    differ = bool(values) or any(t["status"] != "same" for t in tensors)
    if ctx.json:
        emit_json({"a": a, "b": b, "identical": not differ, "counts": counts, "tensors": tensors,
                   "values": values})
    else:
        print(f"A  {safe(a)}\nB  {safe(b)}\n")
        shown = [t for t in tensors if args.all or t["status"] != "same"]
        if shown:
            print(table(["TENSOR", "STATUS", "ROWS CHANGED", "ELEMENTS CHANGED", "MAX ABS DIFF / DETAIL"],
                        [_row(t) for t in shown], right=(2, 3)))
            print()
        if values:
            print(table(["VALUE", "STATUS", "A", "B"],
                        [[v["key"], v["status"], _shown(v, "a"), _shown(v, "b")] for v in values]))
            print()
        print(f"{len(tensors)} tensors: {counts['changed']} changed, {counts['added']} added, "
              f"{counts['removed']} removed, {counts['retyped']} reshaped/retyped, {counts['same']} identical "
              f"({counts['skipped_by_blobs']} by blob refs, not loaded); {len(values)} value(s) differ")
    return EXIT_PROBLEM if (differ and args.exit_code) else EXIT_OK
