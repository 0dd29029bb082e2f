"""``checkrun ls`` and ``checkrun inspect``: what is in a directory / a checkpoint (manifests only)."""
from __future__ import annotations

from typing import Any

from .cli_tree import Node, short_repr, walk
from .cli_util import (EXIT_OK, EXIT_PROBLEM, Context, CliError, codecs_text, emit_json, fmt_float,
                       fmt_ratio, human_size, human_time, iso_time, log, one_line, ratio, table)
from .manifest import DTYPES, Manifest, TensorRecord

# ----------------------------------------------------------------------------- ls


def _step(meta: dict) -> Any:
    return meta.get("global_step", meta.get("step"))


def _tensor_bytes(m: Manifest) -> int:
    tb = m.stats.get("tensor_bytes")
    return tb if isinstance(tb, int) else sum(r.nbytes for r in m.tensors)


def _chain(m: Manifest) -> int:
    depth = m.stats.get("chain_depth")
    return depth if isinstance(depth, int) else max((len(r.deltas) for r in m.tensors), default=0)


def _quantized(m: Manifest) -> bool:
    return any(r.quant for r in m.tensors)


def _ls_rows(ctx: Context, directory: str) -> tuple[list[dict], dict]:
    entries = ctx.engine.list(directory, storage_options=ctx.storage_options)
    users: dict[str, int] = {}        # blob key -> number of readable checkpoints referencing it
    sizes: dict[str, int] = {}
    for e in entries:
        if e.manifest is not None:
            for b in {b.key: b for b in e.manifest.blobs()}.values():
                users[b.key] = users.get(b.key, 0) + 1
                sizes[b.key] = b.size
    rows = []
    for e in entries:
        row = {"name": e.name, "url": e.url, "manifest_bytes": e.size, "mtime": e.mtime,
               "created": e.created, "created_iso": iso_time(e.created)}
        m = e.manifest
        if m is None:
            row.update(status="corrupt", error=one_line(e.error))
        else:
            keys = m.blob_keys()
            row.update(status="committed", step=_step(m.meta), epoch=m.meta.get("epoch"),
                       global_step=m.meta.get("global_step"), tensors=len(m.tensors),
                       tensor_bytes=_tensor_bytes(m),
                       stored_bytes=sum(sizes[k] for k in keys),
                       new_bytes=sum(sizes[k] for k in keys if users[k] == 1),
                       new_blobs=sum(1 for k in keys if users[k] == 1), blobs=len(keys),
                       chain_depth=_chain(m), quantized=_quantized(m))
        rows.append(row)
    manifests = sum(e.size for e in entries)
    blobs = sum(sizes.values())
    totals = {"checkpoints": len(entries), "corrupt": sum(1 for r in rows if r["status"] != "committed"),
              "logical_bytes": sum(r.get("tensor_bytes", 0) for r in rows),
              "blob_bytes": blobs, "manifest_bytes": manifests, "unreferenced_bytes": None,
              "unreferenced_blobs": None}
    if entries and not totals["corrupt"]:
        # What gc would free with no grace period: blobs the listing above does not account for.
        report = ctx.engine.gc(directory, grace_seconds=0, dry_run=True, storage_options=ctx.storage_options)
        if not report.problems:
            totals["unreferenced_bytes"] = report.freed_bytes
            totals["unreferenced_blobs"] = len(report.deleted)
    totals["used_bytes"] = blobs + manifests + (totals["unreferenced_bytes"] or 0)
    totals["dedup_ratio"] = ratio(totals["logical_bytes"], totals["used_bytes"])
    return rows, totals


def _verify_rows(ctx: Context, rows: list[dict]) -> None:
    """``ls --verify``: blob presence and checksums (no decoding) decide the status."""
    todo = [r for r in rows if r["status"] == "committed"]
    with ctx.bar(sum(r["stored_bytes"] for r in todo), "verifying") as bar:
        for r in todo:
            rep = ctx.engine.verify(r["url"], storage_options=ctx.storage_options, decode=False,
                                    progress=bar.update)
            if not rep.ok:
                r.update(status="corrupt", error=one_line(rep.problems[0]), problems=rep.problems)


def cmd_ls(ctx: Context) -> int:
    args = ctx.args
    kind = ctx.kind(args.directory)
    if kind == "file":
        raise CliError(f"{args.directory}: is a file; `checkrun ls` takes a checkpoint directory "
                       f"(use `checkrun inspect` for one checkpoint)", 2)
    if kind == "missing":
        raise CliError(f"{args.directory}: no such directory")
    rows, totals = _ls_rows(ctx, args.directory)
    if args.verify:
        _verify_rows(ctx, rows)
        totals["corrupt"] = sum(1 for r in rows if r["status"] != "committed")
    code = EXIT_PROBLEM if totals["corrupt"] else EXIT_OK
    if ctx.json:
        emit_json({"directory": args.directory, "checkpoints": rows, "totals": totals})
        return code
    if not rows:
        print(f"no checkrun checkpoints in {args.directory}")
        return code
    body = []
    for r in rows:
        ok = "tensor_bytes" in r  # the manifest is readable (blobs may still be bad under --verify)
        kind = ("quantized" if r.get("quantized") else "lossless") if ok else None
        body.append([r["name"], human_time(r["created"]), r.get("step"), r.get("epoch"),
                     human_size(r.get("tensor_bytes")) if ok else None,
                     human_size(r.get("new_bytes")) if ok else None, r.get("chain_depth"), kind, r["status"]])
    print(table(["NAME", "CREATED", "STEP", "EPOCH", "TENSORS", "NEW", "CHAIN", "KIND", "STATUS"],
                body, right=(2, 3, 4, 5, 6)))
    for r in rows:
        if r["status"] != "committed":
            err = r["error"]
            print(f"corrupt: {err if err.startswith(r['url']) else r['url'] + ': ' + err}")
    _print_totals(totals)
    return code


def _print_totals(t: dict) -> None:
    unref = t["unreferenced_bytes"]
    garbage = ("unknown (a manifest is unreadable)" if unref is None
               else f"{human_size(unref)} in {t['unreferenced_blobs']} blob(s)")
    print(f"\n{t['checkpoints']} checkpoint(s), {t['corrupt']} corrupt")
    print(f"logical size  {human_size(t['logical_bytes'])}  (tensor bytes of all checkpoints)")
    print(f"stored        {human_size(t['used_bytes'])}  (blobs {human_size(t['blob_bytes'])} + manifests "
          f"{human_size(t['manifest_bytes'])} + unreferenced {garbage})"
          + (f", {fmt_ratio(t['dedup_ratio'])} smaller" if t["dedup_ratio"] else ""))


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
    return (f"{q.get('method')}{q.get('bits') or ''}: max {fmt_float(q.get('max_abs_error'))}, "
            f"rel {fmt_float(q.get('rel_l2_error'))}")


def _node_row(node: Node) -> list:
    label = "  " * node.depth + node.label
    if node.kind == "tensor":
        rec = node.record
        if rec is None:
            return [label, "tensor (no record in the manifest)"]
        info = _tensor_info(rec)
        shape = "x".join(map(str, rec.shape)) or "scalar"
        what = f"{rec.dtype} [{shape}]" + (" param" if node.requires_grad is not None else "")
        return [label, what, info["pipeline"], human_size(rec.nbytes), human_size(info["stored_bytes"]),
                fmt_ratio(info["ratio"]), info["deltas"], _quant_text(rec.quant)]
    if node.kind == "object":
        return [label, f"<pickled {node.record.type}, {human_size(node.record.blob.size)}>"]
    if node.kind == "container":
        return [label, f"{node.value} ({node.size})"]
    return [label, "= " + short_repr(node.value, 100)]


def cmd_inspect(ctx: Context) -> int:
    path = ctx.checkpoint(ctx.args.checkpoint)
    m = ctx.engine.read_manifest(path, storage_options=ctx.storage_options)
    nodes = list(walk(m, path, collapse=0 if ctx.json else 72))
    stored = sum(b.size for b in {b.key: b for b in m.blobs()}.values())
    summary = {"path": path, "format_version": m.format_version, "created": m.created,
               "created_iso": iso_time(m.created), "meta": {k: v for k, v in m.meta.items() if k != "leaves"},
               "stats": m.stats, "tensors": len(m.tensors), "objects": len(m.objects),
               "tensor_bytes": _tensor_bytes(m), "stored_bytes": stored,
               "ratio": ratio(_tensor_bytes(m), stored), "chain_depth": _chain(m), "quantized": _quantized(m)}
    if ctx.json:
        summary["tree"] = [_node_json(n) for n in nodes]
        summary["values"] = {n.path: n.value for n in nodes if n.kind == "value"}
        emit_json(summary)
        return EXIT_OK
    meta = ", ".join(f"{k}={v}" for k, v in summary["meta"].items()) or "-"
    kind = "quantized" if summary["quantized"] else "lossless"
    print(f"checkpoint  {path}")
    print(f"created     {human_time(m.created)}   format v{m.format_version}   {meta}")
    print(f"tensors     {len(m.tensors)}: {human_size(summary['tensor_bytes'])} stored as "
          f"{human_size(stored)} ({fmt_ratio(summary['ratio'])}), chain depth {summary['chain_depth']}, {kind}")
    if m.objects:
        print(f"objects     {len(m.objects)} pickled value(s) (need --unsafe or allowed_globals to load)")
    print()
    print(table(["STATE", "TENSOR / VALUE", "CODECS", "SIZE", "STORED", "RATIO", "DELTAS", "QUANT ERROR"],
                [_node_row(n) for n in nodes], right=(3, 4, 5, 6)))
    if not nodes:
        log.info("checkrun: %s holds an empty state", path)
    return EXIT_OK

