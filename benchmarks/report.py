"""Render docs/benchmarks.md and its PNG plots from the bench modules' JSON results.

``python -m benchmarks`` runs the modules with ``--json`` into ``docs/benchmarks/data/`` and then calls
``render``; ``python -m benchmarks.report`` re-renders from the JSON files already there (no
measuring). Every number is a median with its min-max spread, "1.23 (1.10-1.40)", over the runs the
module repeats (3 saves, 3 rounds, ...); byte counts are exact. The targets table computes MET /
MISSED from the numbers. Two hand-written sections of the existing docs/benchmarks.md are carried
over verbatim: "## 5. Quantization: accuracy" (with the accuracy benchmark's tables appended when its
JSON is present) and "## Engine problems found".
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any, Optional

from benchmarks import plots
from benchmarks.common import ROOT, table, verdict
from benchmarks.report_bytes import incremental_section, quant_section
from benchmarks.report_peers import accelerate_section, dcp_section, lightning_section
from benchmarks.report_sections import async_section, format_section
from benchmarks.report_wait import restore_section, steplog_section

DOC = ROOT / "docs" / "benchmarks.md"
DATA = ROOT / "docs" / "benchmarks" / "data"
ACCURACY = "## 5. Quantization: accuracy"
PROBLEMS = "## Engine problems found"
ORDER = ("format", "async", "incremental", "quant", "quant_accuracy", "lightning", "accelerate", "dcp", "restore",
         "steplog")


def load_results(data: Path) -> tuple[dict, dict]:
    """({bench: its JSON}, run status from ``runs.json``); unreadable files count as missing."""
    results = {}
    for name in ORDER:
        try:
            results[name] = json.loads((data / f"{name}.json").read_text())
        except (OSError, ValueError):
            pass
    try:
        runs = json.loads((data / "runs.json").read_text())
    except (OSError, ValueError):
        runs = {}
    return results, runs


def sections_of(text: str) -> dict:
    """{'## heading line': the section's text (heading included)} of a markdown file."""
    out, head, buf = {}, None, []
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            if head:
                out[head] = "".join(buf)
            head, buf = line.rstrip("\n"), [line]
        elif head:
            buf.append(line)
    if head:
        out[head] = "".join(buf)
    return out


def carried(old: dict, prefix: str) -> Optional[str]:
    """The section starting with ``prefix`` from the current report, or from the committed one when the
    current one lacks it or has only its heading (e.g. caught in the middle of a hand edit)."""
    for source in (old, committed_sections()):
        for head, text in source.items():
            if head.startswith(prefix) and text.strip() != head.strip():
                return text.rstrip() + "\n"
    return None


def committed_sections() -> dict:
    try:
        text = subprocess.run(["git", "show", f"HEAD:{DOC.relative_to(ROOT).as_posix()}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return sections_of(text)


REGENERATED = "### Regenerated in this report"


def accuracy_section(old: dict, res: Optional[dict]) -> str:
    """The hand-written section, intact; with the accuracy JSON present, its tables are appended under
    REGENERATED (a previous such part is replaced, so regenerating does not pile them up)."""
    text = carried(old, ACCURACY) or f"{ACCURACY} (issue 5)\n\n(no hand-written description found)\n"
    text = text.split(f"\n{REGENERATED}\n")[0].rstrip() + "\n"
    if not res:
        return text
    return (f"{text}\n{REGENERATED}\n\nThe text above was written by hand for an earlier run; these numbers come from "
            f"this report's run of `bench_quant_accuracy`.\n\n{generic_tables(res)}\n")


def generic_tables(res: dict) -> str:
    """The accuracy benchmark's JSON (its schema is its own): lists of flat dicts become tables."""
    body = res.get("results", res)
    lines = [f"Measured on {plots.caption(res.get('machine', {}))} (from `{DATA.relative_to(ROOT)}/quant_accuracy.json`)."]
    items = body.items() if isinstance(body, dict) else [("results", body)]
    bullets = []
    for key, value in items:
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            heads = list(dict.fromkeys(k for v in value for k in v if not isinstance(v[k], (dict, list))))
            lines += ["", f"{key} (one training run each):", "",
                      table(heads, [[v.get(h, "") for h in heads] for v in value], 5)]
        elif not isinstance(value, (dict, list)):
            bullets.append(f"- {key}: {value}")
    return "\n".join(lines + [""] + bullets)


def accuracy_target(res: Optional[dict]) -> list:
    """The issue 5 accuracy row, when the accuracy JSON carries a ``degradation`` (fraction) figure."""
    body = (res or {}).get("results", {})
    deg = body.get("degradation_4bit_20") if isinstance(body, dict) else None
    if deg is None:
        return [["5", "accuracy degradation < 0.1% (4-bit, 20 restores)", "see section 5", "see section 5"]]
    return [["5", "accuracy degradation < 0.1% (4-bit, 20 restores)", f"{100 * deg:.4f}%", verdict(deg < 1e-3)]]


def status_table(runs: dict, results: dict) -> str:
    rows = []
    for name in ORDER:
        r, res = runs.get("modules", {}).get(name), results.get(name)
        when = plots.caption(res["machine"]) if res else "-"
        state = "not run" if r is None else ("ok" if r.get("rc") == 0 else f"FAILED (rc {r.get('rc')})")
        shown = " ".join(r.get("args", [])).split(" --json ")[0] if r else "-"  # not the machine's path
        rows.append([name, state, f"{r['seconds']:.0f}" if r else "-", shown, when])
    text = table(["benchmark", "status", "seconds", "arguments", "measured on"], rows)
    for name, r in runs.get("modules", {}).items():
        if r.get("rc") != 0 and r.get("tail"):
            text += f"\n\n`{name}` failed; the end of its output:\n\n```\n{r['tail'].rstrip()}\n```"
    return text


def header(runs: dict, results: dict) -> str:
    cmd = runs.get("command", "python -m benchmarks")
    total = runs.get("seconds")
    machine = next((r["machine"] for r in results.values() if r and "machine" in r), {})
    smoke = runs.get("smoke")
    lines = ["# Benchmarks", "",
             "<!-- Generated by `python -m benchmarks` (benchmarks/report.py): edit the generator, not this file;"
             " sections '5. Quantization: accuracy' and 'Engine problems found' are carried over by hand. -->", ""]
    if smoke:
        lines += [f"> **SMOKE RUN** (`{cmd}`): small states on a shared, loaded machine. These numbers only show "
                  "that the tooling works end to end; they are not the project's measurements. Regenerate with "
                  "`python -m benchmarks` on a quiet machine.", ""]
    # Timing benchmarks only: the accuracy experiment measures loss and AUC, which load does not move.
    loads = [x for name, r in results.items() if r and name != "quant_accuracy"
             for x in (r["machine"].get("loadavg", [0])[0], r["machine"].get("loadavg_end", [0])[0])]
    cores = machine.get("cores") or 1
    if loads and max(loads) > 1.5 * cores:  # the benchmark itself keeps about `cores` busy
        lines += [f"> **Loaded machine**: the load average reached {max(loads):.1f} on {cores} cores during these runs "
                  "(other work was running), so seconds are inflated and noisy; byte counts are not affected.", ""]
    lines += [
        "checkrun (`ckpt_core`) against the usual ways of checkpointing PyTorch training state, in one command:",
        "", "```", "python -m benchmarks              # default --size 256 (MB): for a 2-core, 24 GiB machine",
        "python -m benchmarks --size 4096  # larger machines; --only NAME,... reruns some modules",
        "python -m benchmarks --accuracy   # also the quantization accuracy training runs (long)",
        "python -m benchmarks.report       # re-render this page from docs/benchmarks/data/*.json", "```", "",
        f"This report: `{cmd}`" + (f", {total / 60:.1f} min in all" if total else "") +
        f", on {plots.caption(machine)} ({machine.get('arch', '?')}, python {machine.get('python', '?')}). "
        "Every number is the median of the runs the benchmark repeats, with the min-max spread in brackets, "
        "'1.23 (1.10-1.40)'; byte counts are exact. Ratios compare peers measured in the same run. Each "
        "module runs in its own process; its raw measurements are in `docs/benchmarks/data/NAME.json`, so "
        "`python -m benchmarks.report` re-renders this page without measuring. Methods, earlier full-size "
        "runs and their analysis: [benchmark-notes.md](benchmark-notes.md).", "",
        "## Runs", "", status_table(runs, results), ""]
    return "\n".join(lines)


def render(data: Path = DATA, out: Path = DOC, png: Optional[Path] = None) -> str:
    """Write ``out`` (and the PNGs next to it under docs/benchmarks/) from the JSON in ``data``."""
    png = png or out.parent / "benchmarks"
    results, runs = load_results(data)
    old = sections_of(out.read_text()) if out.exists() else {}
    targets: list = []
    parts = []
    for fn, key in ((format_section, "format"), (async_section, "async"), (incremental_section, "incremental"),
                    (quant_section, "quant")):
        text, rows = fn(results.get(key), png, results)
        parts.append(text)
        targets += rows
    parts.append(accuracy_section(old, results.get("quant_accuracy")))
    targets += accuracy_target(results.get("quant_accuracy"))
    for fn, key in ((lightning_section, "lightning"), (accelerate_section, "accelerate"), (dcp_section, "dcp"),
                    (steplog_section, "steplog"), (restore_section, "restore")):
        text, rows = fn(results.get(key), png, results)
        parts.append(text)
        targets += rows
    summary = ("## Summary of targets\n\nComputed from the numbers below (medians); a target whose benchmark did not "
               "run or failed says so.\n\n" + table(["issue", "target", "measured", "verdict"], targets) + "\n")
    problems = carried(old, PROBLEMS) or f"{PROBLEMS}\n\n(none recorded)\n"
    doc = "\n".join([header(runs, results), summary, *parts, problems])
    out.write_text(doc)
    return doc


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description="Re-render docs/benchmarks.md from docs/benchmarks/data/*.json")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(DOC))
    args = ap.parse_args(argv)
    render(Path(args.data), Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
