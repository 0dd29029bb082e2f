"""PNG plots of the benchmark report (matplotlib, Agg backend; ``pip install checkrun[bench]``).

Called by ``benchmarks.report`` with the JSON results of the bench modules (see their ``--json``).
Every figure's title names the machine (cores, RAM, torch) and the date of the measurement; points
are medians with min-max error bars. Each function returns the written path, or None when its data
is missing (the report then says so instead of linking a picture).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

MB = 1e6


def caption(machine: dict) -> str:
    """'2 cores, 23 GiB RAM, torch 2.13.0+cpu, 2026-12-02 16:10' from ``common.machine_info()``."""
    return (f"{machine.get('cores')} cores, {machine.get('ram_gib')} GiB RAM, torch {machine.get('torch')}, "
            f"{str(machine.get('date', '?')).replace('T', ' ')[:16]}")


def spread(xs: list) -> tuple[float, float, float]:
    """(median, median - min, max - median): a point and its asymmetric min-max error bar."""
    xs = [x for x in xs if x == x]  # drop NaN (e.g. cold loads where the cache could not be dropped)
    if not xs:
        return float("nan"), 0.0, 0.0
    m = statistics.median(xs)
    return m, m - min(xs), max(xs) - m


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def blocking_vs_size(stall: dict, machine: dict, path: Path, names: Optional[dict] = None) -> Optional[Path]:
    """stall = bench_async results["stall"]: {size: {peer: worker result}}; names: legend labels."""
    series: dict = {}
    for size in sorted(stall, key=float):
        for peer, r in stall[size].items():
            if "error" not in r:
                series.setdefault(peer, []).append((r["state"] / MB, spread(r["raw"]["block"])))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    for peer, pts in series.items():
        style = "--" if peer == "floor" else "-"
        ax.errorbar([p[0] for p in pts], [p[1][0] for p in pts], yerr=[[p[1][1] for p in pts], [p[1][2] for p in pts]],
                    marker="o", linestyle=style, capsize=3, label=(names or {}).get(peer, peer))
    ax.set_xscale("log")
    ax.set_yscale("log")
    xs = sorted({round(p[0]) for pts in series.values() for p in pts})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("state size, MB (GPT-like weights + Adam, fp32)")
    ax.set_ylabel("blocking time per save, s (median, min-max of 3)")
    ax.set_title(f"Blocking time per save vs state size\n{caption(machine)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def training_slowdown(train: dict, machine: dict, path: Path) -> Optional[Path]:
    """train = bench_async results["train"]: {peer: [per round: loop, base_loop, ...]}."""
    peers = [p for p, rs in train.items() if rs and all("error" not in r for r in rs)]
    if not peers:
        return None
    pts = [spread([r["loop"] / r["base_loop"] for r in train[p]]) for p in peers]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(peers, [p[0] for p in pts], yerr=[[p[1] for p in pts], [p[2] for p in pts]], capsize=4, color="tab:blue")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("training loop time / without checkpoints\n(median, min-max over rounds)")
    ax.set_title(f"Training slowdown from checkpointing\n{caption(machine)}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def bytes_per_checkpoint(lines: dict, torch_bytes: Optional[float], machine: dict, path: Path) -> Optional[Path]:
    """lines = {label: [bytes written by save 0, 1, ...]} (exact counts: no spread)."""
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, ys in lines.items():
        ax.plot(range(len(ys)), [y / MB for y in ys], marker="o", label=label)
    if torch_bytes:
        ax.axhline(torch_bytes / MB, color="black", linestyle="--", linewidth=1, label="torch.save (every save)")
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint number in the run (0 = first, full)")
    ax.set_ylabel("bytes written by the save, MB (exact)")
    ax.set_title(f"Bytes written per checkpoint (DLRM, 5% of rows change per interval)\n{caption(machine)}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def grouped_bars(groups: dict, ylabel: str, title: str, machine: dict, path: Path) -> Optional[Path]:
    """groups = {group label: {bar label: [raw seconds]}}: one cluster of bars per group."""
    groups = {g: bars for g, bars in groups.items() if bars}
    if not groups:
        return None
    labels = list(dict.fromkeys(b for bars in groups.values() for b in bars))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(groups) + 3), 4.5))
    for i, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for g, bars in enumerate(groups.values()):
            if label in bars:
                m, a, b = spread(bars[label])
                xs.append(g + (i - (len(labels) - 1) / 2) * width)
                ys.append(m)
                lo.append(a)
                hi.append(b)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{caption(machine)}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
