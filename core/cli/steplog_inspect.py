"""``checkrun inspect SEGMENT`` (one step-log segment's header and checksums) and ``checkrun inspect
DIR/.checkrun/steplog`` (its segments, one row each, and its markers): docs/cli.md."""
from __future__ import annotations

import os

from .steplog import STEPLOG_DIR, has_log, read_header, segments_store
from .util import EXIT_OK, CliError, Context, codecs_text, emit_json, human_size, one_line, safe, table
from ..errors import CheckpointNotFoundError, CheckrunError
from ..steplog.format import (PREFIX_BYTES, RunInfo, SegmentDamaged, check_seg_name, header_end, parse_header,
                               split_segment)
from ..steplog.index import read_index
from ..storage.store import Store


# ----------------------------------------------------------------------------- inspect


def _grad_info(g: dict) -> dict:
    out = {"param": g["p"], "kind": g["k"]}
    if g["k"] == "none":
        return out
    out.update(shape=g["shape"], dtype=g["dtype"])
    if isinstance(g["data"], dict):  # a span of its dtype's pack (the pack's codecs are listed with it)
        out["pack"] = {"dtype": g["data"]["pack"], "at": g["data"]["at"]}
    else:
        out.update(encoded_bytes=g["data"][1] + (g["idx"][1] if isinstance(g.get("idx"), list) else 0),
                   codecs=g["data"][2])
    if "n" in g:
        out["rows"] = g["n"]
    if "u" in g:  # folded: the rows stored, each repeated by its run length
        out["stored_rows"] = g["u"]
    return out


def describe(header: dict) -> dict:
    """A segment header as the JSON of ``inspect``: runs, events, steps, gradients."""
    events = []
    for i, ev in enumerate(header["events"]):
        item = {"event": header["lo"] + i + 1, "kind": ev["kind"]}
        if ev["kind"] == "step":
            item.update(step=ev["step"], grads=[_grad_info(g) for g in ev["grads"]])
            if "bufs" in ev:  # the forward-pass state (format 5): each buffer by name
                item["buffers"] = [{**_grad_info(b), "name": header["buffers"][b["p"]]} for b in ev["bufs"]]
        else:
            item.update(groups=ev["groups"], scheduler=ev["sched"])
        events.append(item)
    steps = [e["step"] for e in events if e["kind"] == "step"]
    return {"run": header["run"], "seq": header["seq"], "events": [header["lo"] + 1, header["hi"]],
            "steps": [steps[0], steps[-1]] if steps else None, "step_count": len(steps),
            "payload_bytes": header["payload_bytes"], "payload_csum": header["payload_csum"],
            "packs": {name: {"chunks": len(chunks), "numel": sum(c["numel"] for c in chunks),
                             "encoded_bytes": sum(c["data"][1] for c in chunks), "codecs": chunks[0]["data"][2]}
                      for name, chunks in header.get("packs", {}).items()}, "records": events,
            "rng": _rng_info(header.get("rng"))}


def _rng_info(r: dict | None) -> dict | None:
    """The RNG states a segment holds (format 7): after which event (of which step's pre-hook, or of a
    flush point: step None) and rank, which generators."""
    if r is None:
        return None
    return {"event": r["event"], "step": r["step"], "rank": r["rank"], "generators": ["python", "numpy", "torch"]
            + [f"cuda:{i}" for i in range(len(r["cuda"]))]}


def examine(data: bytes, where: str) -> tuple[dict, str]:
    """(header, payload status) of a segment's bytes: "ok", or what is wrong with the payload.
    Raises ``CliError`` when not even the header can be read."""
    try:
        header = parse_header(data[:header_end(data[:PREFIX_BYTES])], where, len(data))
        check_seg_name(header, where.rpartition("/")[2], where)
    except (SegmentDamaged, CheckrunError) as exc:
        raise CliError(one_line(exc)) from None
    try:
        split_segment(data, where)
    except SegmentDamaged as exc:
        return header, one_line(exc)
    except CheckrunError as exc:
        raise CliError(one_line(exc)) from None
    return header, "ok"


def read_segment_file(ctx: Context, path: str) -> tuple[str, bytes]:
    store, name = Store.for_path(path, ctx.storage_options, ctx.engine.config.storage)
    try:
        return store.url(name), store.read_manifest(name, ctx.engine.config.load.max_blob_bytes)
    except CheckpointNotFoundError:
        raise CliError(f"{path}: no such step-log segment") from None


def grad_row(g: dict) -> list:
    info = _grad_info(g)
    if info["kind"] == "none":
        return [info["param"], "none", "", "", "", ""]
    stored = human_size(info["encoded_bytes"]) if "encoded_bytes" in info else f"in pack {info['pack']['dtype']}"
    return [info["param"], info["kind"], "x".join(map(str, info["shape"])) or "()", info["dtype"],
            info.get("rows", ""), stored]


def cmd_inspect_segment(ctx: Context, path: str) -> int:
    """``checkrun inspect SEGMENT``: the header of one segment and its checksums' status."""
    where, data = read_segment_file(ctx, path)
    header, status = examine(data, where)
    info = describe(header)
    info.update(segment=path, bytes=len(data), header_csum="ok", payload_status=status, ok=status == "ok")
    if ctx.json:
        emit_json(info)
    else:
        steps = info["steps"]
        print(f"segment   {safe(path)}")
        print(safe(f"run       {info['run']}   seq {info['seq']}   events {info['events'][0]}..{info['events'][1]}   "
              f"steps {f'{steps[0]}..{steps[1]}' if steps else '-'} ({info['step_count']})"))
        shown = "checksum ok" if status == "ok" else f"DAMAGED ({status.removeprefix(where + ': ')})"
        print(safe(f"payload   {human_size(info['payload_bytes'])}, xxh3 {info['payload_csum']}: {shown}; "
                   "header checksum ok"))
        if info["packs"]:
            print("packs     " + safe("; ".join(f"{name}: {p['numel']} elements in {p['chunks']} chunks, "
                                         f"{human_size(p['encoded_bytes'])} ({codecs_text(p['codecs'])})"
                                         for name, p in info["packs"].items())))
        print()
        body = [[ev["step"] if i == 0 else "", *grad_row(g)] for ev in header_steps(header)
                for i, g in enumerate(ev["grads"])]
        print(table(["STEP", "PARAM", "KIND", "SHAPE", "DTYPE", "ROWS", "ENCODED"], body, right=(0, 1, 5, 6)))
        if header.get("buffers"):
            print("\n" + safe(f"running statistics of {len(header['buffers'])} buffer(s) with each step "
                       f"({', '.join(header['buffers'][:3])}{', ...' if len(header['buffers']) > 3 else ''}; "
                       "--json lists them)"))
        if info["rng"]:
            r = info["rng"]
            at = f"step {r['step']}'s" if r["step"] is not None else "a flush point's"
            print("\n" + safe(f"RNG states after event {r['event']} ({at}, rank {r['rank']}): "
                               f"{', '.join(r['generators'])}"))
        states = sum(1 for ev in header["events"] if ev["kind"] == "state")
        if states:
            print(f"\n{states} state record(s): optimizer hyperparameters and scheduler state (--json shows them)")
    if status != "ok":
        raise CliError(status)
    return EXIT_OK


def cmd_inspect_log(ctx: Context, path: str) -> int:
    """``checkrun inspect DIR/.checkrun/steplog``: one row per segment (headers only)."""
    base = os.fspath(path).replace("\\", "/").rstrip("/")
    directory = base[:-len(STEPLOG_DIR)].rstrip("/") or "."
    segs = segments_store(ctx, directory)
    if not has_log(segs):
        raise CliError(f"{path}: no step log here")
    index, rows = read_index(segs), []
    for run, run_segs in index.segments.items():
        for seg in run_segs:
            row = {"segment": f"{base}/{seg.name}", "run": run, "seq": seg.seq, "events": [seg.lo + 1, seg.hi]}
            try:
                info = describe(read_header(segs, seg.name))
                row.update(steps=info["steps"], payload_bytes=info["payload_bytes"], error=None)
            except (SegmentDamaged, CheckrunError) as exc:
                row.update(steps=None, payload_bytes=None, error=one_line(exc))
            rows.append(row)
    runs = [_run_info(info) for info in sorted(index.runs.values(), key=lambda r: r.created)]
    if ctx.json:
        emit_json({"step_log": base, "segments": rows, "markers": [m.__dict__ for m in index.markers], "runs": runs})
        return EXIT_OK
    print(table(["SEGMENT", "EVENTS", "STEPS", "PAYLOAD"],
                [[r["segment"].rpartition("/")[2], "{}..{}".format(*r["events"]),
                  "{}..{}".format(*r["steps"]) if r["steps"] else ("unreadable" if r["error"] else "-"),
                  human_size(r["payload_bytes"]) if r["payload_bytes"] is not None else ""] for r in rows]))
    for m in index.markers:
        print(safe(f"marker: {m.checkpoint} after step {m.step} (run {m.run}, event {m.event})"))
    for r in runs:
        names = "" if r["param_names"] is None else f", {sum(map(len, r['param_names']))} named parameters"
        after = f"continues run {r['parent']['run']} after event {r['parent']['event']}" if r["parent"] else "first run"
        print(safe(f"run {r['run']}: {r['optimizer'] or 'optimizer class not recorded'}{names}; {after}; "
                   f"{'closed' if r['closed'] else 'open or ended without close'}"))
    return EXIT_OK


def _run_info(info: RunInfo) -> dict:
    """A run object as ``inspect DIR/.checkrun/steplog --json`` shows it."""
    return {"run": info.run, "created": info.created, "start_step": info.start_step,
            "parent": None if info.parent is None else {"run": info.parent[0], "event": info.parent[1]},
            "optimizer": info.optimizer, "closed": info.closed,
            "param_names": None if info.param_names is None else [list(g) for g in info.param_names]}


def header_steps(header: dict) -> list[dict]:
    return [ev for ev in header["events"] if ev["kind"] == "step"]
