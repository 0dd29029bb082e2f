"""``checkrun diff A B``: which tensors (and rows) and which plain values differ between checkpoints.

Tensors whose manifest records name the same blobs (and dtype/shape/codecs) are equal without
reading anything; only when some tensor needs a look are both states loaded. A composite
(accelerate_ckpt) is compared part by part: its keys are ``parts.N.<key>``, its index's values
``checkpoint.<key>``. Rows are the first
dimension (the elements of a 1-D tensor; a 0-d tensor is one row). NaN equals NaN here.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .composite import View, open_view
from .tree import short_repr
from .util import EXIT_OK, EXIT_PROBLEM, Context, emit_json, fmt_float, table
from ..format.manifest import TensorRecord
from ..format.tree import flatten

_BLOCK_ELEMS = 1 << 22


def _same_blobs(a: TensorRecord, b: TensorRecord) -> bool:
    # A pack (several tensors in one blob) holds the same bytes for both only at the same part.
    return (a.dtype == b.dtype and a.shape == b.shape and list(a.codecs) == list(b.codecs)
            and [x.key for x in a.blobs()] == [x.key for x in b.blobs()]
            and [c.part for c in a.base] == [c.part for c in b.base])


def compare_tensors(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Changed rows/elements and the max abs difference of two same-shaped tensors (blockwise)."""
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
        else:
            wide = torch.complex128 if x.is_complex() else torch.float64
            x, y = x.to(wide), y.to(wide)
            ne = (x != y) & ~(torch.isnan(x) & torch.isnan(y))
            diff = (x - y).abs()  # real for complex inputs too
        changed_rows += int(ne.any(dim=1).sum()) if ne.numel() else 0
        changed_elems += int(ne.sum())
        if ne.any():
            block_max = float(diff[ne].max())
            max_diff = block_max if math.isnan(block_max) else max(max_diff, block_max)
    return {"rows": rows, "changed_rows": changed_rows, "elements": a.numel(), "changed_elements": changed_elems,
            "max_abs_diff": max_diff}


def _load_tensors(ctx: Context, view: View, unsafe: bool) -> dict[str, torch.Tensor]:
    out = {}
    for piece in view.pieces:
        state = ctx.engine.load(piece.url, map_location="cpu", weights_only=not unsafe,
                                storage_options=ctx.storage_options)
        out.update({piece.prefix + leaf.key: leaf.tensor for leaf in flatten(state).tensors})
    return out


def _tensor_diffs(ctx: Context, va: View, vb: View) -> list[dict]:
    ra, rb = va.records(), vb.records()
    out, todo = [], []
    for key in list(ra) + [k for k in rb if k not in ra]:
        x, y = ra.get(key), rb.get(key)
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
            todo.append(item)
    if not todo:
        return out
    with ctx.bar(2 + len(todo), "comparing", unit="step") as bar:
        ta = _load_tensors(ctx, va, ctx.args.unsafe)
        bar.update(1)
        tb = _load_tensors(ctx, vb, ctx.args.unsafe)
        bar.update(1)
        for item in todo:
            x, y = ta.get(item["key"]), tb.get(item["key"])
            if x is None or y is None:  # pragma: no cover - keys come from the same flatten()
                item.update(status="unknown", how="tensor not found after loading")
            else:
                item.update(compare_tensors(x, y))
                item["status"] = "changed" if item["changed_elements"] else "same"
                item["how"] = "values"
            bar.update(1)
    return out


def _value_diffs(a: View, b: View) -> list[dict]:
    va, vb = a.values(), b.values()
    out = []
    for key in list(va) + [k for k in vb if k not in va]:
        if key not in vb:
            out.append({"key": key, "status": "removed", "a": va[key]})
        elif key not in va:
            out.append({"key": key, "status": "added", "b": vb[key]})
        elif not _equal(va[key], vb[key]):
            out.append({"key": key, "status": "changed", "a": va[key], "b": vb[key]})
    return out


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


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
    tensors = _tensor_diffs(ctx, va, vb)
    values = _value_diffs(va, vb)
    counts = {s: sum(1 for t in tensors if t["status"] == s)
              for s in ("same", "changed", "added", "removed", "retyped")}
    counts["skipped_by_blobs"] = sum(1 for t in tensors if t.get("how") == "blobs")
    differ = bool(values) or any(t["status"] != "same" for t in tensors)
    if ctx.json:
        emit_json({"a": a, "b": b, "identical": not differ, "counts": counts, "tensors": tensors,
                   "values": values})
    else:
        print(f"A  {a}\nB  {b}\n")
        shown = [t for t in tensors if args.all or t["status"] != "same"]
        if shown:
            print(table(["TENSOR", "STATUS", "ROWS CHANGED", "ELEMENTS CHANGED", "MAX ABS DIFF / DETAIL"],
                        [_row(t) for t in shown], right=(2, 3)))
            print()
        if values:
            print(table(["VALUE", "STATUS", "A", "B"],
                        [[v["key"], v["status"], short_repr(v["a"], 40) if "a" in v else None,
                          short_repr(v["b"], 40) if "b" in v else None] for v in values]))
            print()
        print(f"{len(tensors)} tensors: {counts['changed']} changed, {counts['added']} added, "
              f"{counts['removed']} removed, {counts['retyped']} reshaped/retyped, {counts['same']} identical "
              f"({counts['skipped_by_blobs']} by blob refs, not loaded); {len(values)} value(s) differ")
    return EXIT_PROBLEM if (differ and args.exit_code) else EXIT_OK
