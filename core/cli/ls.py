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

import sys
from dataclasses import dataclass

from ..format import composite
from .composite import folders, verify_view
from .steplog import log_directory, logged_after, logged_text
from .inspect import chain_depth, is_quantized, step_of, tensor_bytes, written_bytes
from .util import (
    EXIT_OK, EXIT_PROBLEM, Context, CliError, emit_json, fmt_less, human_size, human_time, iso_time,
    one_line, ratio, safe, table)
from ..errors import CheckpointNotFoundError, CheckrunError
from ..storage.paths import mtime
from ..format.manifest import Manifest


@dataclass
class _Item:
    """One checkpoint of the listing. Its manifests are parsed one checkpoint at a time and dropped once
    measured (``_measure``): ``row`` holds its figures but those that depend on the other checkpoints,
    ``keys`` the blob keys it references (one string per key for the whole listing). ``row`` is None
    when it (or one of its parts) is unreadable (``error``)."""

    name: str
    url: str
    size: int
    mtime: float
    created: float
    error: str | None = None
    parts: list[str] | None = None
    row: dict | None = None
    keys: tuple[str, ...] = ()
    parts_written: list[int] | None = None
    """A composite's parts: the bytes of each one's new blobs (its manifest's size is added once known)."""


class _Measure:
    """Pass 1 of the listing: each checkpoint's figures, without holding every manifest parsed at once
    (1,000s of checkpoints: hundreds of MB before, 2026-12-06)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.sizes: dict[str, int] = {}  # blob key -> size, the key string shared by every item
        self.part_dirs: set[str] = set()

    def entry(self, e) -> _Item | None:
        """None: removed since the listing (retention of another writer): gone, not corrupt."""
        item = _Item(e.name, e.url, e.size, e.mtime, e.created, e.error)
        if e.error is not None:
            return item
        try:
            m = e.manifest or self.ctx.engine.read_manifest(e.url, storage_options=self.ctx.storage_options)
            index = composite.index_of(m, e.url)
        except CheckpointNotFoundError:
            return None
        except CheckrunError as exc:
            item.error = str(exc)
            return item
        if index is None:
            return self.measure(item, [m], m.meta)
        return self.composite(item, m, index)

    def folder(self, f) -> _Item:
        if f.manifest is None or f.index is None:  # dated by its index file, as a damaged manifest is
            size, when = _stat(self.ctx, f.url)
            return _Item(f"{f.name}/", f.url, size, when, when, f.error)
        return self.composite(_Item(f"{f.name}/", f.url, len(f.manifest.to_bytes()), f.created, f.created),
                              f.manifest, f.index)

    def composite(self, item: _Item, m: Manifest, index: dict) -> _Item:
        item.parts = composite.part_urls(item.url, index)
        self.part_dirs.update(composite.parent(u) for u in item.parts)
        try:
            manifests = [self.ctx.engine.read_manifest(u, storage_options=self.ctx.storage_options)
                         for u in item.parts]
        except CheckrunError as exc:
            item.error = str(exc)
            return item
        return self.measure(item, manifests, m.meta)

    def measure(self, item: _Item, ms: list[Manifest], meta: dict | None) -> _Item:
        """The figures of a readable checkpoint; one whose figures cannot be summed or shown (values no
        save writes, which its parser let through) is listed as corrupt with the reason."""
        try:
            blobs = {b.key: b.size for m in ms for b in m.blobs()}
            meta = meta or {}
            item.row = dict(step=step_of(meta), epoch=meta.get("epoch"), global_step=meta.get("global_step"),
                            tensors=sum(len(m.tensors) for m in ms), tensor_bytes=sum(tensor_bytes(m) for m in ms),
                            referenced_bytes=sum(blobs.values()), blobs=len(blobs),
                            chain_depth=max(chain_depth(m) for m in ms), quantized=any(is_quantized(m) for m in ms))
            if item.parts is None:
                item.row["written_bytes"] = sum(written_bytes(m, item.size) for m in ms)
            else:
                item.parts_written = [written_bytes(m, 0) for m in ms]
        except (ArithmeticError, ValueError, TypeError) as exc:
            item.row, item.error = None, f"{item.url}: odd values in the manifest: {one_line(exc)}"
            return item
        item.keys = tuple(sys.intern(k) for k in blobs)  # one string per key, however many reference it
        self.sizes.update(zip(item.keys, blobs.values()))
        return item


def _stat(ctx: Context, url: str) -> tuple[int, float]:
    """(size, modification time) of a file; (0, 0.0) when it cannot be read."""
    fs, path = ctx.fs(url)
    try:
        info = fs.info(path)
    except (OSError, ValueError):
        return 0, 0.0
    return int(info.get("size") or 0), mtime(info)


def _items(ctx: Context, directory: str) -> tuple[list[_Item], _Measure]:
    """Every checkpoint of ``directory`` (oldest first), measured one at a time (``_Measure``): its
    ordinary manifests, composite indexes (accelerate_ckpt) and checkpoint folders."""
    measure = _Measure(ctx)
    items = [i for e in ctx.engine.list(directory, storage_options=ctx.storage_options, heads=True)
             if (i := measure.entry(e)) is not None]
    items += [measure.folder(f) for f in folders(ctx, directory)]
    items.sort(key=lambda i: (i.created, i.name))
    return items, measure


def _row(item: _Item, users: dict[str, int], sizes: dict[str, int], part_bytes: dict[str, int]) -> dict:
    row = {"name": item.name, "url": item.url, "manifest_bytes": item.size, "mtime": item.mtime,
           "created": item.created, "created_iso": iso_time(item.created)}
    if item.parts is not None:
        row["parts"] = item.parts
    if item.row is None:
        row.update(status="corrupt", error=one_line(item.error))
        return row
    unique = [k for k in item.keys if users[k] == 1]
    row.update(status="committed", **item.row)
    if item.parts_written is not None:  # the index, and each part's new blobs and manifest
        row["written_bytes"] = item.size + sum(w + part_bytes.get(u, 0) for w, u in zip(item.parts_written, item.parts))
    row.update(unique_bytes=sum(sizes[k] for k in unique), new_blobs=len(unique))
    row.update(stored_bytes=row["referenced_bytes"], new_bytes=row["unique_bytes"])  # older names of those two
    return {k: row[k] for k in _ORDER if k in row}  # the keys in the order they always had


_ORDER = ("name", "url", "manifest_bytes", "mtime", "created", "created_iso", "parts", "status", "step", "epoch",
          "global_step", "tensors", "tensor_bytes", "written_bytes", "referenced_bytes", "unique_bytes", "stored_bytes",
          "new_bytes", "new_blobs", "blobs", "chain_depth", "quantized")


def _ls_rows(ctx: Context, directory: str) -> tuple[list[dict], dict]:
    items, measure = _items(ctx, directory)
    users: dict[str, int] = {}        # blob key -> number of readable checkpoints referencing it
    for item in items:
        for key in item.keys:
            users[key] = users.get(key, 0) + 1
    sizes = {k: measure.sizes[k] for k in users}
    part_dirs = measure.part_dirs
    part_bytes = {e.url: e.size for d in sorted(part_dirs)
                  for e in ctx.engine.list(d, storage_options=ctx.storage_options, heads=True)}
    rows = [_row(i, users, sizes, part_bytes) for i in items]
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
    links = ctx.links(args.directory)
    totals["dangling_links"] = sum(1 for k in links if not k["ok"])
    code = EXIT_PROBLEM if totals["corrupt"] or totals["dangling_links"] else EXIT_OK
    step_log = logged_after(ctx, log_directory(ctx, args.directory), rows)
    if ctx.json:
        out = {"directory": args.directory, "checkpoints": rows, "totals": totals, "links": links}
        if step_log is not None:
            out["step_log"] = step_log
        emit_json(out)
        return code
    if not rows:
        print(f"no checkrun checkpoints in {safe(args.directory)}")
        _print_links(links)
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
    _print_links(links)
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


def _print_links(links: list[dict]) -> None:
    """Symbolic links (``last.ckpt`` of ``save_last="link"``): where each points; one that points at nothing."""
    if links:
        print()
    for k in links:
        gone = "" if k["ok"] else f"  (dangling: {k['problem']})" if k["problem"] != "not a regular file" else (
            "  (not a regular file: not a checkpoint)")
        print(safe(f"{k['name']} -> {k['target']}{gone}"))


def _print_logged(rows: list[dict], step_log: dict) -> None:
    """Per checkpoint that the step log marks: the steps logged after it (docs/steplog.md)."""
    if "error" in step_log:
        print(f"\nstep log {safe(step_log['url'])}: unreadable: {safe(one_line(step_log['error']))}")
        return
    print(f"\nstep log {safe(step_log['url'])}: {step_log['segments']} segment(s), {step_log['markers']} marker(s)")
    if step_log.get("damaged"):
        print(f"step log {safe(step_log['url'])}: unreadable marker(s): {safe(step_log['damaged'])}")
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
    dangling = f", {t['dangling_links']} dangling link(s)" if t["dangling_links"] else ""
    print(f"\n{t['checkpoints']} checkpoint(s), {t['corrupt']} corrupt{dangling}")
    print(f"tensor bytes  {human_size(t['logical_bytes'])}  (all checkpoints: what full uncompressed saves hold)")
    print(f"stored        {human_size(t['used_bytes'])} in the directory{less}:")
    print(f"              referenced blobs {human_size(t['blob_bytes'])} + manifests "
          f"{human_size(t['manifest_bytes'])} + unreferenced {garbage}")
