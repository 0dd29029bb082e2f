"""Report sections on what users wait for: per-step recovery (issue 23, ``bench_steplog``) and restore /
blocking side by side with the peers (issue 24, ``bench_restore``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from benchmarks import plots
from benchmarks.common import table
from benchmarks.report_sections import MB, args_text, caption, img, med, missing, ms, target

STEPLOG_TARGETS = [["23", "step-log overhead <= 5% of step time (DLRM-style, <= 5% rows touched)"]]
MODEL_NAMES = {"dlrm": "DLRM-style (embedding tables, sparse grads, Adagrad)", "gpt": "GPT-like dense (Adam)"}


def spread_of(r: dict, key: str) -> list:
    """The per-round values of ``key`` when the JSON has them, else [min, median, max], else [median]."""
    runs = r.get(f"{key}_runs")
    if runs:
        return list(runs)
    if f"{key}_min" in r and f"{key}_max" in r:
        return [r[f"{key}_min"], r[key], r[f"{key}_max"]]
    return [r[key]]


def steplog_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 9. Per-step recovery: the step log (issue 23)"
    if not res:
        return missing(title, "steplog", STEPLOG_TARGETS)
    rows, groups, recovery = [], {}, {}
    for r in res["results"]:
        name = MODEL_NAMES.get(r["model"], r["model"])
        touched = "dense" if r.get("touched_rows_pct") is None else f"{r['touched_rows_pct']:.1f}%"
        rows.append([name, touched, ms(spread_of(r, "step_ms"), 1), ms(spread_of(r, "step_log_ms"), 1),
                     f"{r['overhead_pct']:+.1f}%", f"{r['bytes_per_step'] / MB:.2f}",
                     f"{r['checkpoint_bytes'] / MB:.1f}", r["replayed"], f"{r['load_s'] + r['replay_s']:.2f}",
                     f"{r['rerun_s']:.2f}"])
        groups[r["model"]] = {"no checkpointing": spread_of(r, "step_ms"),
                              "with the step log": spread_of(r, "step_log_ms")}
        recovery.setdefault(f"{r['model']}: {r['replayed']} steps", {}).update(
            {"load + replay": [r["load_s"] + r["replay_s"]], "re-run the steps": [r["rerun_s"]]})
    p = plots.grouped_bars(groups, "ms per training step (mean over all steps, min-max of the rounds' means)",
                           "Training step time with and without the step log", res["machine"],
                           png / "steplog_overhead.png")
    q = plots.grouped_bars(recovery, "seconds", "Recovery: load + replay vs re-running the lost steps",
                           res["machine"], png / "steplog_recovery.png")
    dlrm = next((r for r in res["results"] if r["model"] == "dlrm"), None)
    targets = [target("23", STEPLOG_TARGETS[0][1], "not measured", None) if dlrm is None else
               target("23", STEPLOG_TARGETS[0][1], f"{dlrm['overhead_pct']:+.1f}%", dlrm["overhead_pct"] <= 5.0)]
    text = (f"{title}\n\nTwo real training loops, one torch thread (the other core is left to checkrun's "
            "background work, as a GPU job leaves the host CPU): a DLRM-style model and a GPT-like dense one. "
            "Rounds alternate the loop without any checkpointing and the loop with `engine.step_log` (file://, "
            "defaults), many short rounds; step time = the mean over every step of a mode's rounds (min-max: of "
            "the rounds' means); overhead = mean with / mean without. Logged = stored bytes per step; recovery = "
            "load the checkpoint + `engine.replay` of the logged steps, against re-running those steps. "
            f"{caption(res)} Arguments: `{args_text(res)}`. See [steplog.md](steplog.md).\n\n"
            f"{img(p, 'step-log overhead')}{img(q, 'step-log recovery')}\n"
            + table(["model", "rows touched per step", "step ms", "with the log ms", "overhead", "logged MB/step",
                     "full checkpoint MB", "steps replayed", "load + replay s", "re-run s"], rows) + "\n")
    return text, targets


RESTORE_TARGETS = [["24", "restore (cold, into live tensors, threads) <= DCP: DLRM, dense, fine-tune"],
                   ["24", "process-mode restore within +-10% of threads mode"],
                   ["24", "DLRM restore at the end of a chain of 8 deltas <= 1.5x its full restore"],
                   ["24", "blocking <= 1.3x the copy floor and < DCP async_save (incremental on)"]]


def _ratio(a: list, b: list) -> float:
    return med(a) / med(b) if med(b) > 0 else float("nan")


def _ratios_text(pairs: dict) -> str:
    return ", ".join(f"{k} {v:.2f}x" for k, v in pairs.items())


def restore_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    """``bench_restore``: results = {restore: {state: {method: [s]}}, blocking: {state: {method: {blocking,
    durable}}}, chain: {depth, written, full: [s], chain: [s]}}."""
    from benchmarks.restore_methods import RESTORE_LABELS, SAVE_LABELS, STATE_LABELS

    title = "## 10. Where users wait: restore and blocking side by side (issue 24)"
    if not res:
        return missing(title, "restore", RESTORE_TARGETS)
    body, parts, targets = res["results"], [], []
    restore, blocking, chain = body.get("restore", {}), body.get("blocking", {}), body.get("chain")
    if restore:
        states = list(restore)
        methods = list(dict.fromkeys(m for s in states for m in restore[s]))
        parts.append("Restore s (cold: page cache dropped before each; into the live tensors):\n\n" + table(
            ["method", *(STATE_LABELS.get(s, s) for s in states)],
            [[RESTORE_LABELS.get(m, m), *(ms(restore[s].get(m, [])) for s in states)] for m in methods]))
        p = plots.grouped_bars({STATE_LABELS.get(s, s): {RESTORE_LABELS.get(m, m): v for m, v in restore[s].items()}
                                for s in states}, "seconds (median, min-max)", "Cold restore into live tensors",
                               res["machine"], png / "restore_peers.png")
        parts.append(img(p, "restore side by side"))
        vs_dcp = {STATE_LABELS.get(s, s): _ratio(restore[s]["threads"], restore[s]["dcp"]) for s in states
                  if "threads" in restore[s] and "dcp" in restore[s]}
        vs_threads = {STATE_LABELS.get(s, s): _ratio(restore[s]["process"], restore[s]["threads"]) for s in states
                      if "threads" in restore[s] and "process" in restore[s]}
        targets.append(target("24", RESTORE_TARGETS[0][1], _ratios_text(vs_dcp) + " of DCP",
                              all(v <= 1.0 for v in vs_dcp.values()) if vs_dcp else None))
        targets.append(target("24", RESTORE_TARGETS[1][1], _ratios_text(vs_threads) + " of threads",
                              all(v <= 1.1 for v in vs_threads.values()) if vs_threads else None))
    if chain and chain.get("full") and chain.get("chain"):
        r = _ratio(chain["chain"], chain["full"])
        parts.append(f"DLRM restore at the end of a chain of {chain['depth']} consecutive deltas (checkrun threads, "
                     f"cold): full {ms(chain['full'])} s, end of chain {ms(chain['chain'])} s: {r:.2f}x.")
        if chain.get("read"):  # (bases, links) bytes of the blobs each restore reads
            (fb, fl), (cb, cl) = chain["read"]["full"], chain["read"]["chain"]
            parts[-1] += (f" Blobs read: full {(fb + fl) / 1e6:.1f} MB, end of chain {cb / 1e6:.1f} MB of bases + "
                          f"{cl / 1e6:.1f} MB of delta links ({(cb + cl) / max(1, fb + fl):.2f}x the bytes).")
        floor = ""
        if chain.get("raw_full") and chain.get("raw_chain"):  # the same blob files read whole, cold, no decoding
            rr = _ratio(chain["raw_chain"], chain["raw_full"])
            parts[-1] += (f" Reading those blob files whole (cold, on the io threads, no decoding) took "
                          f"{ms(chain['raw_full'])} s and {ms(chain['raw_chain'])} s: {rr:.2f}x, the disk's floor "
                          "for the ratio.")
            floor = f" (raw reads of its blob files: {rr:.2f}x)"
        targets.append(target("24", RESTORE_TARGETS[2][1], f"{r:.2f}x{floor}", r <= 1.5))
    if blocking:
        states = list(blocking)
        methods = list(dict.fromkeys(m for s in states for m in blocking[s]))
        parts.append("Blocking s per save (how long `save` keeps the training thread; incremental on):\n\n" + table(
            ["method", *(STATE_LABELS.get(s, s) for s in states)],
            [[SAVE_LABELS.get(m, m), *(ms(blocking[s].get(m, {}).get("blocking", [])) for s in states)]
             for m in methods]))
        got = {}
        for s in states:
            b = blocking[s]
            if all(k in b for k in ("threads", "floor", "dcp")):
                got[STATE_LABELS.get(s, s)] = (_ratio(b["threads"]["blocking"], b["floor"]["blocking"]),
                                               _ratio(b["threads"]["blocking"], b["dcp"]["blocking"]))
        text = ", ".join(f"{k} {f:.2f}x floor / {d:.2f}x DCP" for k, (f, d) in got.items())
        targets.append(target("24", RESTORE_TARGETS[3][1], text or "not measured",
                              all(f <= 1.3 and d < 1.0 for f, d in got.values()) if got else None))
    text = (f"{title}\n\n`python -m benchmarks.bench_restore` (one process; every method saves once, then rounds "
            "of restores in turn, each into the same live tensors and checked against the saved values). DLRM: 8 "
            "embedding tables (dim 64) + row-wise Adagrad + an MLP with Adam; dense: GPT-like weights + Adam; "
            "fine-tune: a frozen GPT-like base + LoRA adapters with Adam. Copy floor: one raw file read with "
            "`readinto` into the live tensors / a copy into buffers allocated once. checkrun restores with "
            "`engine.load(path, into=live)` the second save of an engine, one training interval after its first "
            "(as a job's restored checkpoint usually is: for DLRM a delta on a base); torch.load is followed by `copy_` into the live tensors (what "
            f"Lightning's `load_state_dict` does). {caption(res)} Arguments: `{args_text(res)}`.\n\n"
            + "\n\n".join(parts) + "\n")
    return text, targets
