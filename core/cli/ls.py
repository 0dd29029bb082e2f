"""``checkrun ls``: the checkpoints of a directory with sizes and dedup totals (manifests only).

Per checkpoint: its tensor bytes, the bytes its save wrote (WROTE, = ``SaveInfo.written_bytes``),
the bytes of the blobs it references (REFERENCED, = ``SaveInfo.stored_bytes``) and of those no
other checkpoint of the directory references (UNIQUE: what removing it alone frees); the totals
say what is stored in the directory (vocabulary and units: ``ckpt_core.units``).

A directory may hold ordinary manifests, composite indexes (accelerate_ckpt; ``ckpt_core.format.composite``)
and checkpoint folders (accelerate's ``checkpoint_N/`` holding a ``checkrun.ckpt`` index), or be
such a folder itself. A composite is one row, its figures summed over its parts.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..format import composite
from .composite import folders, verify_view
from .steplog import logged_after, logged_text
from .inspect import chain_depth, is_quantized, step_of, tensor_bytes, written_bytes
from .util import (
    EXIT_OK, EXIT_PROBLEM, Context, CliError, emit_json, fmt_less, human_size, human_time, iso_time,
    one_line, ratio, safe, table)
from ..errors import CheckrunError
from ..storage.paths import mtime
from ..format.manifest import Manifest


@dataclass
class _Item:
    """One checkpoint of the listing; ``manifests`` is None when it (or one of its parts) is unreadable."""

    name: str
    url: str
    size: int
    mtime: float
    created: float
    manifests: list[Manifest] | None
    error: str | None = None
    parts: list[str] | None = None
    meta: dict | None = None
    """The listed manifest's meta (a composite's: its index's step, epoch ...)."""


def _composite_item(ctx: Context, name: str, url: str, size: int, mtime: float, m: Manifest, index: dict,
                    part_dirs: set[str]) -> _Item:
    urls = composite.part_urls(url, index)
    part_dirs.update(composite.parent(u) for u in urls)
    try:
        manifests = [ctx.engine.read_manifest(u, storage_options=ctx.storage_options) for u in urls]
    except CheckrunError as exc:
        return _Item(name, url, size, mtime, m.created, None, str(exc), urls)
    return _Item(name, url, size, mtime, m.created, manifests, None, urls, m.meta)


def _stat(ctx: Context, url: str) -> tuple[int, float]:
    """(size, modification time) of a file; (0, 0.0) when it cannot be read."""
    fs, path = ctx.fs(url)
    try:
        info = fs.info(path)
    except (OSError, ValueError):
        return 0, 0.0
    return int(info.get("size") or 0), mtime(info)


def _items(ctx: Context, directory: str) -> tuple[list[_Item], set[str]]:
    """Every checkpoint of ``directory`` (oldest first) and the directories holding composites' parts."""
    items: list[_Item] = []
    part_dirs: set[str] = set()
    for e in ctx.engine.list(directory, storage_options=ctx.storage_options):
        if e.manifest is None:
            items.append(_Item(e.name, e.url, e.size, e.mtime, e.created, None, e.error))
            continue
        try:
            index = composite.index_of(e.manifest, e.url)
        except CheckrunError as exc:
            items.append(_Item(e.name, e.url, e.size, e.mtime, e.created, None, str(exc)))
            continue
        if index is None:
            items.append(_Item(e.name, e.url, e.size, e.mtime, e.created, [e.manifest], meta=e.manifest.meta))
        else:
            items.append(_composite_item(ctx, e.name, e.url, e.size, e.mtime, e.manifest, index, part_dirs))
    for f in folders(ctx, directory):
        if f.manifest is None or f.index is None:  # dated by its index file, as a damaged manifest is
            size, when = _stat(ctx, f.url)
            items.append(_Item(f"{f.name}/", f.url, size, when, when, None, f.error))
            continue
        size = len(f.manifest.to_bytes())
        items.append(_composite_item(ctx, f"{f.name}/", f.url, size, f.created, f.manifest, f.index, part_dirs))
    items.sort(key=lambda i: (i.created, i.name))
    return items, part_dirs


def _blobs(item: _Item) -> dict[str, int]:
    return {b.key: b.size for m in item.manifests or () for b in m.blobs()}


def _written(item: _Item, part_bytes: dict[str, int]) -> int:
    """Bytes the save of ``item`` wrote: every manifest's new blobs plus the manifests (a composite's
    index and parts, as accelerate_ckpt's ``checkrun/written_bytes`` counts them)."""
    ms = item.manifests or ()
    if item.parts is None:
        return sum(written_bytes(m, item.size) for m in ms)
    return item.size + sum(written_bytes(m, part_bytes.get(u)) for m, u in zip(ms, item.parts))


def _row(item: _Item, users: dict[str, int], part_bytes: dict[str, int]) -> dict:
    row = {"name": item.name, "url": item.url, "manifest_bytes": item.size, "mtime": item.mtime,
           "created": item.created, "created_iso": iso_time(item.created)}
    if item.parts is not None:
        row["parts"] = item.parts
    if item.manifests is None:
        row.update(status="corrupt", error=one_line(item.error))
        return row
    blobs, ms, meta = _blobs(item), item.manifests, item.meta or {}
    referenced = sum(blobs.values())
    unique = sum(s for k, s in blobs.items() if users[k] == 1)
    row.update(status="committed", step=step_of(meta), epoch=meta.get("epoch"),
               global_step=meta.get("global_step"), tensors=sum(len(m.tensors) for m in ms),
               tensor_bytes=sum(tensor_bytes(m) for m in ms), written_bytes=_written(item, part_bytes),
               referenced_bytes=referenced, unique_bytes=unique,
               stored_bytes=referenced, new_bytes=unique,  # older names of referenced_bytes, unique_bytes
               new_blobs=sum(1 for k in blobs if users[k] == 1), blobs=len(blobs),
               chain_depth=max(chain_depth(m) for m in ms), quantized=any(is_quantized(m) for m in ms))
    return row


def _checked_row(item: _Item, users: dict[str, int], part_bytes: dict[str, int]) -> dict:
    """``_row``; a manifest whose figures cannot be summed or shown (values no save writes, which its
    parser let through) is listed as corrupt with the reason, and the listing goes on."""
    try:
        return _row(item, users, part_bytes)
    except (ArithmeticError, ValueError, TypeError) as exc:
        item.manifests, item.error = None, f"{item.url}: odd values in the manifest: {one_line(exc)}"
        return _row(item, users, part_bytes)


def _ls_rows(ctx: Context, directory: str) -> tuple[list[dict], dict]:
    items, part_dirs = _items(ctx, directory)
    users: dict[str, int] = {}        # blob key -> number of readable checkpoints referencing it
    sizes: dict[str, int] = {}
    for item in items:
        for key, size in _blobs(item).items():
            users[key] = users.get(key, 0) + 1
            sizes[key] = size
    part_bytes = {e.url: e.size for d in sorted(part_dirs)
                  for e in ctx.engine.list(d, storage_options=ctx.storage_options)}
    rows = [_checked_row(i, users, part_bytes) for i in items]
    for item in items:  # the rows hold what is shown: the gc dry run below reads the manifests again
        item.manifests = None
    manifests = sum(i.size for i in items) + sum(part_bytes.get(u, 0) for i in items for u in i.parts or ())
    blobs = sum(sizes.values())
    totals = {"checkpoints": len(items), "corrupt": sum(1 for r in rows if r["status"] != "committed"),
              "logical_bytes": sum(r.get("tensor_bytes", 0) for r in rows),
              "blob_bytes": blobs, "manifest_bytes": manifests, "unreferenced_bytes": None,
              "unreferenced_blobs": None, "temp_files": None}
    if items and not totals["corrupt"]:
        # What gc would free with no grace period: blobs the listing above does not account for.
        reports = [ctx.engine.gc(d, grace_seconds=0, dry_run=True, storage_options=ctx.storage_options)
                   for d in [directory, *sorted(part_dirs)]]
        problems = [p for r in reports for p in r.problems]
        if problems:  # why the unreferenced total is unknown (a lease, the blob folder, ...)
            totals["unreferenced_unknown"] = one_line(problems[0])
        else:
            totals["unreferenced_bytes"] = sum(r.freed_bytes for r in reports)
            totals["unreferenced_blobs"] = sum(len(r.deleted) for r in reports)
            totals["temp_files"] = sum(len(r.temp_files) for r in reports)
    totals["used_bytes"] = blobs + manifests + (totals["unreferenced_bytes"] or 0)
    totals["dedup_ratio"] = ratio(totals["logical_bytes"], totals["used_bytes"])
    return rows, totals


def _verify_rows(ctx: Context, rows: list[dict]) -> None:
    """``ls --verify``: blob presence and checksums (no decoding) decide the status. A checkpoint
    removed since the listing (retention of another writer) is dropped from ``rows``: gone, not corrupt."""
    todo = [r for r in rows if r["status"] == "committed"]
    gone: set[int] = set()
    with ctx.bar(sum(r["stored_bytes"] for r in todo), "verifying") as bar:
        for r in todo:
            rep = verify_view(ctx, r["url"], decode=False, progress=bar.update)
            if not rep["ok"] and ctx.kind(r["url"]) == "missing":
                gone.add(id(r))
            elif not rep["ok"]:
                r.update(status="corrupt", error=one_line(rep["problems"][0]), problems=rep["problems"])
    rows[:] = [r for r in rows if id(r) not in gone]


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
        totals["checkpoints"] = len(rows)
        totals["corrupt"] = sum(1 for r in rows if r["status"] != "committed")
    code = EXIT_PROBLEM if totals["corrupt"] else EXIT_OK
    step_log = logged_after(ctx, args.directory, rows)
    if ctx.json:
        out = {"directory": args.directory, "checkpoints": rows, "totals": totals}
        if step_log is not None:
            out["step_log"] = step_log
        emit_json(out)
        return code
    if not rows:
        print(f"no checkrun checkpoints in {safe(args.directory)}")
        return code
    body = []
    for r in rows:
        ok = "tensor_bytes" in r  # the manifest is readable (blobs may still be bad under --verify)
        kind = ("quantized" if r.get("quantized") else "lossless") if ok else None
        if ok and "parts" in r:
            kind += f", {len(r['parts'])} part(s)"
        sizes = [human_size(r[k]) if ok else None
                 for k in ("tensor_bytes", "written_bytes", "referenced_bytes", "unique_bytes")]
        body.append([r["name"], human_time(r["created"]), r.get("step"), r.get("epoch"), *sizes,
                     r.get("chain_depth"), kind, r["status"]])
    print(table(HEADERS, body, right=(2, 3, 4, 5, 6, 7, 8)))
    if step_log is not None:
        _print_logged(rows, step_log)
    for r in rows:
        if r["status"] != "committed":
            err = r["error"]
            print(f"corrupt: {safe(err if err.startswith(r['url']) else r['url'] + ': ' + err)}")
    _print_totals(totals)
    return code


HEADERS = ["NAME", "CREATED", "STEP", "EPOCH", "TENSORS", "WROTE", "REFERENCED", "UNIQUE", "CHAIN", "KIND",
           "STATUS"]
"""TENSORS: tensor bytes; WROTE: written by the save that made the checkpoint; REFERENCED: bytes of
the blobs it references; UNIQUE: of those, the blobs no other checkpoint here references."""


def _print_logged(rows: list[dict], step_log: dict) -> None:
    """Per checkpoint that the step log marks: the steps logged after it (docs/steplog.md)."""
    if "error" in step_log:
        print(f"\nstep log {safe(step_log['url'])}: unreadable: {safe(one_line(step_log['error']))}")
        return
    print(f"\nstep log {safe(step_log['url'])}: {step_log['segments']} segment(s), {step_log['markers']} marker(s)")
    for r in rows:
        text = logged_text(r)
        if text is not None:
            print(safe(f"{r['name']}{text}"))


def _print_totals(t: dict) -> None:
    unref = t["unreferenced_bytes"]
    garbage = (f"unknown ({safe(t.get('unreferenced_unknown', 'a manifest is unreadable'))})" if unref is None
               else f"{human_size(unref)} in {t['unreferenced_blobs']} blob(s)"
               + (f" and {t['temp_files']} temp file(s) of interrupted writes" if t["temp_files"] else ""))
    less = f" ({fmt_less(t['logical_bytes'], t['used_bytes'])} than the tensor bytes)" if t["dedup_ratio"] else ""
    print(f"\n{t['checkpoints']} checkpoint(s), {t['corrupt']} corrupt")
    print(f"tensor bytes  {human_size(t['logical_bytes'])}  (all checkpoints: what full uncompressed saves hold)")
    print(f"stored        {human_size(t['used_bytes'])} in the directory{less}:")
    print(f"              referenced blobs {human_size(t['blob_bytes'])} + manifests "
          f"{human_size(t['manifest_bytes'])} + unreferenced {garbage}")
