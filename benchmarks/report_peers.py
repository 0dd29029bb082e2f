"""Report sections 6-8: Lightning fit time (issue 6), accelerate save_state (issue 7) and DCP storage
writers, each against the framework's own checkpointing in the same run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from benchmarks import plots
from benchmarks.common import overheads, table
from benchmarks.report_sections import MB, args_text, caption, img, med, missing, ms, target

LIGHTNING_TARGETS = [["6", "Lightning fit-time overhead of checkrun <= 1/3 of TorchCheckpointIO's"]]
ACCEL_TARGETS = [["7", "accelerate save_state blocking <= 0.1x accelerate's own"]]
LIGHTNING_NAMES = {"none": "none (no checkpointing)", "torch": "TorchCheckpointIO (default)",
                   "async": "AsyncCheckpointIO(TorchCheckpointIO)", "checkrun": "CheckrunCheckpointIO (defaults)",
                   "checkrun-raw": "CheckrunCheckpointIO, compress=False",
                   "checkrun-process": "CheckrunCheckpointIO, background=process", "noop": "noop (writes nothing)"}


def lightning_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 6. Lightning: fit time with checkpoints every k steps (issue 6)"
    if not res:
        return missing(title, "lightning", LIGHTNING_TARGETS)
    if "interleaved" in res["results"]:
        return _lightning_interleaved(title, res)
    configs, rows = res["results"]["configs"], []
    over = {n: med(r["overhead"] for r in runs) for n, runs in configs.items() if n != "none" and runs}
    for name, runs in configs.items():
        blocked = [b for r in runs for b in r["blocked"]]
        ratio = f"{over[name] / over['torch']:.2f}" if name in over and over.get("torch", 0) > 0 else "-"
        rows.append([LIGHTNING_NAMES.get(name, name), ms([r["fit"] for r in runs], 2),
                     ms([r["overhead"] for r in runs], 2) if name != "none" else "0",
                     ms([r["extra_cpu"] for r in runs], 2) if name != "none" else "0", ms(blocked),
                     len(blocked) // max(1, len(runs)), f"{med(r['written'] for r in runs) / MB:,.1f}", ratio])
    t, c = over.get("torch"), over.get("checkrun")
    if t is None or c is None:
        targets = [target("6", LIGHTNING_TARGETS[0][1], "not measured", None)]
    elif t <= 0:
        targets = [target("6", LIGHTNING_TARGETS[0][1], f"torch's overhead {t:.2f} s (noise)", None)]
    else:
        targets = [target("6", LIGHTNING_TARGETS[0][1], f"{c:.2f} s vs {t:.2f} s ({c / t:.2f}x)", c <= t / 3)]
    groups = {"fit overhead vs no checkpointing": {LIGHTNING_NAMES.get(n, n): [r["overhead"] for r in runs]
                                                   for n, runs in configs.items() if n != "none"}}
    p = plots.grouped_bars(groups, "seconds added to Trainer.fit (median, min-max)",
                           "Lightning fit-time overhead of checkpointing", res["machine"],
                           png / "lightning_fit_overhead.png")
    a = res.get("args", {})
    text = (f"{title}\n\nA GPT-like LightningModule ({res['results']['state_mb']:.0f} MB of weights + Adam) trained "
            f"{a.get('steps')} steps on CPU with `ModelCheckpoint(every_n_train_steps={a.get('every')}, save_top_k=2)`. "
            "Each fit with checkpoints is paired with the no-checkpoint fits just before and after it: overhead = its "
            "fit time - their mean (medians and min-max over the rounds; blocked per save over all saves). "
            f"{caption(res)} Arguments: `{args_text(res)}`.\n\n{img(p, 'Lightning fit overhead')}\n"
            + table(["CheckpointIO", "fit s", "overhead s", "extra CPU s", "blocked per save s", "saves per fit",
                     "on disk MB", "overhead / torch's"], rows) + "\n")
    return text, targets


def _lightning_interleaved(title: str, res: dict) -> tuple[str, list]:
    """``bench_lightning --mode interleaved``: per-save overheads from one fit (see its docstring)."""
    r = res["results"]["interleaved"]
    iv = r["intervals"]
    stats = overheads(iv, "noop")
    over = {n: o for n, (o, _) in stats.items()}
    rows = []
    for name, v in iv.items():
        se = stats[name][1]
        ratio = f"{over[name] / over['torch']:.2f}" if over.get("torch", 0) > 0 and name != "noop" else "-"
        blocked = r["blocked"][name]
        rows.append([LIGHTNING_NAMES.get(name, name), len(v), f"{over[name] * 1e3:.1f} +- {se * 1e3:.1f}",
                     f"{med(blocked) * 1e3:.1f}" if blocked else "-", r["spilled"][name], ratio])
    t = over.get("torch", 0)
    targets = []
    for name in ("checkrun", "checkrun-process"):
        if name in over:
            label = f"{LIGHTNING_TARGETS[0][1]} ({LIGHTNING_NAMES[name]})"
            targets.append(target("6", label, f"{over[name] * 1e3:.1f} vs {t * 1e3:.1f} ms per save "
                                  f"({over[name] / t:.2f}x)" if t > 0 else "torch's overhead not measured (noise)",
                                  over[name] <= t / 3 if t > 0 else None))
    a = res.get("args", {})
    text = (f"{title}\n\nA GPT-like LightningModule ({res['results']['state_mb']:.0f} MB of weights + Adam) trained on "
            f"CPU in one fit of {r['steps']} steps ({r['fit']:.0f} s) with `ModelCheckpoint(every_n_train_steps="
            f"{a.get('every')})`; the CheckpointIO rotates among the configurations save by save, so all of them "
            "share the machine's drifts. Overhead per save = mean time of the "
            f"{a.get('every')} steps starting with its saves - the same after saves of a CheckpointIO that writes "
            "nothing (Lightning's own work around a save is in both), +- one standard error; 'still running' counts "
            f"saves whose background work was not done when the next save began. {caption(res)} Arguments: "
            f"`{args_text(res)}`.\n\n"
            + table(["CheckpointIO", "saves", "overhead per save ms", "blocked per save ms", "still running",
                     "overhead / torch's"], rows) + "\n")
    return text, targets or [target("6", LIGHTNING_TARGETS[0][1], "not measured", None)]


def accelerate_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 7. Accelerate: save_state blocking time (issue 7)"
    if not res:
        return missing(title, "accelerate", ACCEL_TARGETS)
    r = res["results"]
    base = r["results"][0]
    base_block = med(x["blocking"] for x in base["raw"])
    rows = []
    for s in r["results"]:
        raw = s["raw"]
        rows.append([s["name"], ms([x["blocking"] for x in raw]), f"{med(x['blocking'] for x in raw) / base_block:.3f}",
                     ms([x["durable"] for x in raw], 2), f"{raw[0]['written'] / MB:,.1f}",
                     ms([x["written"] / MB for x in raw[1:]], 1), f"{s['ratio']:.2f}"])
    mine = [s for s in r["results"] if s["name"].startswith("checkrun")]
    targets = []
    for s in mine:
        x = med(v["blocking"] for v in s["raw"]) / base_block
        targets.append(target("7", ACCEL_TARGETS[0][1], f"{x:.3f}x", x <= 0.1))
    text = (f"{title}\n\n`accelerator.save_state()` of an MLP + AdamW (~{r['state_mb']:.0f} MB), one training step "
            "between saves: accelerate's own (synchronous, page cache) vs the same call with checkrun attached "
            "(`AcceleratorCheckpointer`; blocking = the snapshot, durable = committed and fsync'd). "
            f"{caption(res)} Arguments: `{args_text(res)}`.\n\n"
            + table(["save_state", "blocking s", "x accelerate", "durable s", "1st save written MB",
                     "later saves written MB", "compression"], rows)
            + f"\n\nCopying the same tensors into preallocated buffers (the floor of any snapshot): "
            f"{r['copy_floor_s']:.3f} s.\n")
    return text, targets or [target("7", ACCEL_TARGETS[0][1], "checkrun row missing", None)]


def dcp_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 8. torch.distributed.checkpoint: DCP's FileSystemWriter vs checkrun's storage writer"
    if not res:
        return missing(title, "dcp", [])
    rows = []
    for world, writers in res["results"].items():
        for name, saves in writers.items():
            for label, r in saves.items():
                rows.append([world, name, label, ms(r["blocking"], 2), ms(r["durable"], 2),
                             ms([w / MB for w in r["written"]], 1)])
    a = res.get("args", {})
    text = (f"{title}\n\nReal gloo processes; a {a.get('state_mb')} MiB fp32 state sharded as DTensors. Per writer: "
            "`dcp.save` (full), `dcp.save` after a step that leaves the embedding unchanged, then two `async_save`. "
            "Blocking/durable = the slowest rank; written = bytes the save added (all ranks). "
            f"{caption(res)} Arguments: `{args_text(res)}`.\n\n"
            + table(["ranks", "writer", "save", "blocking s", "durable s", "written MB"], rows) + "\n")
    return text, []
