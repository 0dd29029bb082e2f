"""``checkrun inspect``: what is in a checkpoint (manifests only; a composite index with its parts)."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from .composite import View, open_view
from .tree import Node, short_repr, walk
from .util import (
    EXIT_OK, Context, codecs_text, emit_json, fmt_float, fmt_less, fmt_ratio, human_size, human_time,
    iso_time, log, output_width, ratio, safe, shorten_end, table)
from ..format.manifest import DTYPES, Manifest, TensorRecord
from ..saving.streams import DENSE_META


def step_of(meta: dict) -> Any:
    """The step a listing shows: ``global_step``, else ``step``."""
    return meta.get("global_step", meta.get("step"))


def _count(value: Any) -> int | None:
    """A figure of a manifest's ``stats`` when it is a plausible count (an int in [0, 2**63)); None
    for anything else (forged, or a future release's), so the figure is computed from the records."""
    return value if type(value) is int and 0 <= value < 1 << 63 else None


def tensor_bytes(m: Manifest) -> int:
    """Raw bytes of the tensors of a manifest."""
    tb = _count(m.stats.get("tensor_bytes"))
    return tb if tb is not None else sum(r.nbytes for r in m.tensors)


def written_bytes(m: Manifest, manifest_bytes: int | None = None) -> int:
    """Bytes *written by the save* that made ``m``: its new blobs (``stats.written_bytes``, else the
    tensors' ``written``) plus its manifest (``manifest_bytes``, else the length of ``m``'s bytes).
    The same figure as that save's ``SaveInfo.written_bytes``."""
    w = _count(m.stats.get("written_bytes"))
    if w is None:
        w = sum(r.written for r in m.tensors)
    return w + (len(m.to_bytes()) if manifest_bytes is None else manifest_bytes)


def chain_depth(m: Manifest) -> int:
    """Length of the longest delta chain of a manifest."""
    depth = _count(m.stats.get("chain_depth"))
    return depth if depth is not None else max((len(r.deltas) for r in m.tensors), default=0)


def is_quantized(m: Manifest) -> bool:
    """Whether any tensor of a manifest is stored quantized."""
    return any(r.quant for r in m.tensors)


# ----------------------------------------------------------------------------- inspect


def _tensor_info(rec: TensorRecord) -> dict:
    # A pack (several small tensors in one blob) is split among its members by raw bytes.
    itemsize = DTYPES[rec.dtype].itemsize
    shares = {(c.blob.key, c.part): c.stored_share(itemsize) for c in rec.base}
    shares.update({(b.key, None): float(b.size) for b in rec.blobs()[len(rec.base):]})
    stored = round(sum(shares.values()))
    return {"key": rec.key, "dtype": rec.dtype, "shape": list(rec.shape), "device": rec.device,
            "codecs": list(rec.codecs), "pipeline": codecs_text(rec.codecs), "nbytes": rec.nbytes,
            "stored_bytes": stored, "ratio": ratio(rec.nbytes, stored), "deltas": len(rec.deltas),
            "delta_rows": sum(d.n for d in rec.deltas), "chunks": len(rec.base), "quant": rec.quant,
            "lossless": not rec.quant}


def _node_json(node: Node) -> dict:
    out: dict[str, Any] = {"path": node.path, "kind": node.kind}
    if node.kind == "tensor" and node.record is not None:
        out.update(_tensor_info(node.record))
        if node.requires_grad is not None:
            out["parameter"] = True
            out["requires_grad"] = node.requires_grad
    elif node.kind == "object":
        out.update(type=node.record.type, stored_bytes=node.record.blob.size)
    elif node.kind == "container":
        out.update(type=node.value, items=node.size)
    else:
        out["value"] = node.value
    return out


def _quant_text(q: dict | None) -> str:
    if not q:
        return "-"
    # max abs error, relative L2 error (the method and its bits are in the CODECS column)
    return f"{fmt_float(q.get('max_abs_error'))}, {fmt_float(q.get('rel_l2_error'))}"


def _node_row(node: Node, quant_column: bool) -> list:
    label = "  " * node.depth + node.label
    if node.kind == "tensor":
        rec = node.record
        if rec is None:
            return [label, "tensor (no record in the manifest)"]
        info = _tensor_info(rec)
        shape = "x".join(map(str, rec.shape)) or "scalar"
        what = f"{rec.dtype} [{shape}]" + (" param" if node.requires_grad is not None else "")
        row = [label, what, info["pipeline"], human_size(rec.nbytes), human_size(info["stored_bytes"]),
               fmt_ratio(info["ratio"]), info["deltas"]]
        return row + [_quant_text(rec.quant)] if quant_column else row
    if node.kind == "object":
        return [label, f"<pickled {safe(node.record.type)}, {human_size(node.record.blob.size)}>"]
    if node.kind == "container":
        return [label, f"{node.value} ({node.size})"]
    return [label, "= " + short_repr(node.value, 100)]


def _view_nodes(view: View, collapse: int) -> list[Node]:
    """Tree rows of every piece; a composite's parts become top-level ``parts.N`` containers."""
    if not view.composite:
        return list(walk(view.manifest, view.url, collapse=collapse))
    nodes = []
    for piece in view.pieces:
        inner = list(walk(piece.manifest, piece.url, collapse=collapse))
        name = piece.prefix.rstrip(".")
        nodes.append(Node(name, name, 0, "container", value="part", size=sum(1 for n in inner if n.depth == 0)))
        nodes.extend(replace(n, path=piece.prefix + n.path, depth=n.depth + 1) for n in inner)
    return nodes


def _summary(view: View) -> dict:
    m, manifests = view.manifest, [p.manifest for p in view.pieces]
    stored = sum(b.size for b in view.blobs())
    raw = sum(tensor_bytes(x) for x in manifests)
    written = sum(written_bytes(x) for x in manifests) + (len(m.to_bytes()) if view.composite else 0)
    meta = ({k: v for k, v in view.index.items() if k != "parts"} if view.composite
            else {k: v for k, v in m.meta.items() if k not in ("leaves", DENSE_META)})
    out = {"path": view.url, "format_version": m.format_version, "created": m.created,
           "created_iso": iso_time(m.created), "meta": meta, "stats": m.stats,
           "tensors": sum(len(x.tensors) for x in manifests), "objects": sum(len(x.objects) for x in manifests),
           "tensor_bytes": raw, "written_bytes": written, "referenced_bytes": stored,
           "stored_bytes": stored, "ratio": ratio(raw, stored),
           "chain_depth": max(chain_depth(x) for x in manifests), "quantized": any(is_quantized(x) for x in manifests)}
    if view.composite:
        out["parts"] = [p.url for p in view.pieces]
    return out


# Shortened to fit: CODECS first (parameters dropped, then cut at the end), while STATE keeps 40
# columns; then STATE (in the middle) down to 24, CODECS to 16.
_SHRINK = ({0: 40, 2: 18}, {0: 24, 2: 16})
_PARAMS = re.compile(r"\((?!bits=)[^()]*\)")


def _short_codecs(text: str, width: int) -> str:
    """``raw > shuffle_zstd(level=1)`` -> ``raw > shuffle_zstd``; quantization keeps its bits."""
    return shorten_end(_PARAMS.sub("", text), width)
_HEADERS = ["STATE", "TENSOR / VALUE", "CODECS", "SIZE", "STORED", "RATIO", "DELTAS", "QUANT ERROR"]


def cmd_inspect(ctx: Context) -> int:
    from .steplog import is_log_dir, is_segment_path
    from .steplog_inspect import cmd_inspect_log, cmd_inspect_segment

    if is_segment_path(ctx.args.checkpoint):  # a step-log segment (docs/steplog.md)
        return cmd_inspect_segment(ctx, ctx.args.checkpoint)
    if is_log_dir(ctx.args.checkpoint):
        return cmd_inspect_log(ctx, ctx.args.checkpoint)
    path = ctx.checkpoint(ctx.args.checkpoint)
    view = open_view(ctx, path)
    wide = bool(getattr(ctx.args, "wide", False))
    nodes = _view_nodes(view, 0 if ctx.json else 72)
    summary = _summary(view)
    if ctx.json:
        summary["tree"] = [_node_json(n) for n in nodes]
        summary["values"] = {n.path: n.value for n in nodes if n.kind == "value"}
        emit_json(summary)
        return EXIT_OK
    width = None if wide else output_width()

    def fit(text: str) -> str:
        return text if width is None else shorten_end(text, width)

    m = view.manifest
    meta = ", ".join(f"{safe(k)}={safe(v)}" for k, v in summary["meta"].items()) or "-"
    kind = "quantized" if summary["quantized"] else "lossless"
    print(f"checkpoint  {safe(path)}")
    print(fit(f"created     {human_time(m.created)}   format v{m.format_version}   {meta}"))
    if view.composite:
        print(fit(f"parts       {len(view.pieces)}: " + ", ".join(safe(p.url) for p in view.pieces)))
    print(fit(f"tensors     {summary['tensors']}: {human_size(summary['tensor_bytes'])} of tensor bytes, chain depth "
              f"{summary['chain_depth']}, {kind}"))
    print(fit(f"referenced  {human_size(summary['referenced_bytes'])} of blobs "
              f"({fmt_less(summary['tensor_bytes'], summary['referenced_bytes'])} than the tensor bytes); "
              f"its save wrote {human_size(summary['written_bytes'])}"))
    if summary["objects"]:
        print(fit(f"objects     {summary['objects']} pickled value(s) (loaded under torch's weights_only rules; "
                  "other types need --unsafe or allowed_globals)"))
    print()
    quant = summary["quantized"]
    headers = _HEADERS if quant else _HEADERS[:-1]
    print(table(headers, [_node_row(n, quant) for n in nodes], right=(3, 4, 5, 6), width=width,
                shrink=[{i: w for i, w in stage.items() if i < len(headers)} for stage in _SHRINK],
                shorten={2: _short_codecs}))
    if not nodes:
        log.info("checkrun: %s holds an empty state", path)
    return EXIT_OK
