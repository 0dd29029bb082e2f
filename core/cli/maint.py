"""``checkrun verify`` and ``checkrun gc``: integrity checks (through composite indexes to their parts)
and blob garbage collection (of a directory of checkpoint folders: its parts no index lists first)."""
from __future__ import annotations

from .composite import folders, open_view, verify_view
from .steplog import log_directory, print_log_report, verify_log
from .util import (
    EXIT_OK, EXIT_PROBLEM, Context, CliError, dangling, emit_json, human_size, log, one_line, points_beside, safe)
from ..format.composite import INDEX_NAME, PARTS_DIR, join
from ..retain.composites import Composites
from ..errors import CheckrunError
from ..loading.reader import VerifyCache

# ----------------------------------------------------------------------------- verify


def _stored(ctx: Context, url: str) -> int | None:
    """Bytes of the blobs a checkpoint (with its parts) needs, for the progress bar; None if unreadable."""
    try:
        return sum(b.size for b in open_view(ctx, url).blobs())
    except CheckrunError:  # verify reports it with its file
        return None


def _targets(ctx: Context, path: str) -> tuple[bool, list[dict]]:
    """(is_directory, [{"url", "error" | "stored"}]) for a checkpoint path or a directory: the
    manifests in it and the checkpoint folders (``checkpoint_N/checkrun.ckpt``) in it."""
    kind = ctx.kind(path)
    if kind == "missing":
        raise CliError(f"{path}: no such checkpoint or directory")
    if kind == "file":
        return False, [{"url": path, "error": None, "stored": _stored(ctx, path)}]
    out = []
    base = path.rstrip("/")
    for e in ctx.engine.list(path, storage_options=ctx.storage_options, heads=True):  # not all held parsed
        # The directory as the user spelt it (engine URLs of local files are absolute).
        url = f"{base}/{e.name}"
        out.append({"url": url, "error": e.error, "stored": _stored(ctx, url) if e.error is None else 0})
    for f in folders(ctx, path):
        url = f"{base}/{f.name}/{INDEX_NAME}"
        out.append({"url": url, "error": f.error, "stored": _stored(ctx, url) if f.error is None else 0})
    for k in ctx.links(path):  # a link to a checkpoint is checked as its target; one to nothing is a problem
        url = f"{base}/{k['name']}"
        if not k["ok"]:
            out.append({"url": url, "error": f"{url}: {dangling(url)}", "stored": 0})
        elif not points_beside(ctx.fs(path)[1], k["target"]):  # h134: its target, out of the directory, was unchecked
            out.append({"url": url, "error": None, "stored": _stored(ctx, url)})
    return True, out


def cmd_verify(ctx: Context) -> int:
    args = ctx.args
    is_dir, targets = _targets(ctx, args.path)
    results = []
    total = sum(t["stored"] or 0 for t in targets) if is_dir else targets[0]["stored"]
    cache = VerifyCache()  # blobs and tensors the checkpoints share are checked once
    with ctx.bar(total, "verifying") as bar:
        for t in targets:
            if t["error"] is not None:  # a manifest list() could not parse: nothing more to check
                results.append({"path": t["url"], "ok": False, "problems": [one_line(t["error"])],
                                "blobs_checked": 0, "bytes_checked": 0, "parts": None})
                continue
            rep = verify_view(ctx, t["url"], decode=not args.no_decode, progress=bar.update, cache=cache)
            if is_dir and not rep["ok"] and ctx.kind(t["url"]) == "missing":
                # Removed since the listing (retention of another writer): gone, not corrupt.
                log.debug("checkrun: %s was removed while verifying", t["url"])
                continue
            rep["problems"] = [one_line(p) for p in rep["problems"]]
            results.append(rep)
    step_log = verify_log(ctx, log_directory(ctx, args.path), decode=not args.no_decode) if is_dir else None
    ok = bool(results) and all(r["ok"] for r in results) and (step_log is None or step_log["ok"])
    if ctx.json:
        out = {"path": args.path, "ok": ok, "checkpoints": results}
        if step_log is not None:
            out["step_log"] = step_log
        emit_json(out)
    elif not results:
        print(f"no checkrun checkpoints in {safe(args.path)}")
    else:
        for r in results:
            parts = f"{len(r['parts'])} part(s), " if r.get("parts") is not None else ""
            if r["ok"]:
                print(f"OK       {safe(r['path'])}  ({parts}{r['blobs_checked']} blobs, {human_size(r['bytes_checked'])})")
            elif r.get("foreign"):  # a torch.save file beside checkrun's (a project that switched): not damage
                print(f"FOREIGN  {safe(r['path'])}  (not a checkrun checkpoint: a torch.save or safetensors file "
                      "loads with torch.load or safetensors; `checkrun import` converts one)")
            else:  # UNVERIFIED: only checks that could not run within load.max_total_bytes failed
                print(f"{'UNVERIFIED' if r.get('unverified') else 'CORRUPT':8} {safe(r['path'])}")
                for p in r["problems"]:
                    print(f"  - {safe(p)}")
        if step_log is not None:
            print_log_report(step_log)
        foreign = sum(1 for r in results if r.get("foreign"))
        bad = sum(1 for r in results if not r["ok"] and not r.get("unverified")) - foreign
        unverified = sum(1 for r in results if not r["ok"] and r.get("unverified"))
        print(f"\n{len(results) - bad - unverified - foreign} intact, {bad} corrupt"
              + (f", {foreign} not a checkrun checkpoint" if foreign else "")
              + (f", {unverified} not verified (load.max_total_bytes)" if unverified else "")
              + ("" if step_log is None else "; step log " + ("intact" if step_log["ok"] else "unreadable"
                                                            if step_log.get("unreadable") else "damaged")))
    return EXIT_OK if ok else EXIT_PROBLEM


# ----------------------------------------------------------------------------- gc


def cmd_gc(ctx: Context) -> int:
    args = ctx.args
    kind = ctx.kind(args.directory)
    if kind == "file":
        raise CliError(f"{args.directory}: is a file; `checkrun gc` takes a checkpoint directory", 2)
    if kind == "missing":
        raise CliError(f"{args.directory}: no such directory")
    if args.grace is not None and not args.grace >= 0:  # nan too
        raise CliError("--grace must be >= 0 seconds", 2)
    grace = ctx.engine.config.retention.gc_grace_seconds if args.grace is None else args.grace
    directory, orphans = args.directory, _orphaned_parts(ctx, args.directory, grace)
    if orphans is not None:  # checkpoint folders (Accelerate): their parts' blobs are in the parts directory
        directory = join(args.directory, PARTS_DIR)
    with ctx.bar(None, "collecting garbage", unit="blob") as bar:
        report = ctx.engine.gc(directory, grace_seconds=args.grace, dry_run=args.dry_run,
                               storage_options=ctx.storage_options, removed=orphans or ())
        bar.update(len(report.deleted))
    code = EXIT_PROBLEM if report.problems else EXIT_OK
    if ctx.json:
        emit_json({"directory": report.directory, "dry_run": report.dry_run, "grace_seconds": grace,
                   "orphaned_parts": orphans or [],
                   "deleted": report.deleted, "deleted_blobs": len(report.deleted),
                   "temp_files": report.temp_files,
                   "freed_bytes": report.freed_bytes, "kept_young": report.kept_young,
                   "kept_leased": report.kept_leased, "leases": report.leases,
                   "referenced": report.referenced, "step_log": report.step_log,
                   "problems": [one_line(p) for p in report.problems]})
        return code
    if report.problems:
        print(f"gc skipped {safe(report.directory)}: a manifest cannot be read, so its blobs may still be needed")
        for p in report.problems:
            print(f"  - {safe(one_line(p))}")
        return code
    verb = "would delete" if report.dry_run else "deleted"
    if orphans:
        print(f"{verb} {len(orphans)} part(s) of checkpoint folders that no longer exist (no index lists them):")
        for name in orphans:
            print(f"  {safe(name)}")
    for key in report.deleted:
        log.info("checkrun: %s blob %s", verb, key)
    temps = f" and {len(report.temp_files)} temp file(s) of interrupted writes" if report.temp_files else ""
    print(f"{verb} {len(report.deleted)} unreferenced blob(s){temps}, "
          f"{'would free' if report.dry_run else 'freed'} {human_size(report.freed_bytes)}")
    print(f"kept {report.referenced} referenced blob(s), {report.kept_leased} leased by "
          f"{report.leases} save(s) in flight, {report.kept_young} younger than the grace ({grace:g} s)")
    if report.step_log:  # segments, markers and run objects of the step log no replay needs
        print(f"{verb} {len(report.step_log)} step-log object(s) no retained checkpoint or open log needs:")
        for name in report.step_log:
            print(f"  {safe(name)}")
    return code


def _orphaned_parts(ctx: Context, directory: str, grace: float) -> list[str] | None:
    """For a directory of checkpoint folders (``.checkrun/parts`` in it; what Accelerate writes): the
    parts no index lists (their folder was deleted by hand), older than the grace and at least an hour
    (a younger one may belong to a save in flight on another rank), removed unless ``--dry-run``;
    None for any other directory."""
    if ctx.kind(join(directory, PARTS_DIR)) != "dir":
        return None
    with Composites(directory, ctx.engine.config, ctx.storage_options, orphan_grace=grace) as found:
        try:
            orphans = found.orphans()
        except CheckrunError as exc:
            raise CliError(f"{directory}: {one_line(exc)}") from None
        if not ctx.args.dry_run:
            found.remove_parts([e.url for e in orphans])
    return [e.name for e in orphans]
