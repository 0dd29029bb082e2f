"""Report sections 3 and 4: bytes written per checkpoint over a run (full vs incremental vs
quantized), restore time (checkrun vs torch.load, full vs chain), fine-tuning, quantization bytes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from benchmarks import plots
from benchmarks.common import table
from benchmarks.report_sections import MB, args_text, caption, img, med, missing, ms, target

INC_TARGETS = [["4", "DLRM incremental writes <= 1/12 of torch.save"],
               ["4", "fine-tuning writes <= 1.2x trainable state"], ["4", "chain restore <= 1.5x full restore"]]
QUANT_TARGETS = [["5", "4-bit full checkpoint >= 6x smaller than torch.save"],
                 ["5", "4-bit incremental >= 17x less written than torch.save"]]


def byte_lines(inc: Optional[dict], quant: Optional[dict]) -> tuple[dict, Optional[float]]:
    """{label: bytes written per save} from both modules, and torch.save's bytes."""
    lines, tb = {}, None
    d = (inc or {}).get("results", {}).get("dlrm")
    if d:
        tb = med(d["torch"]["raw"]["bytes"])
        for policy, run in d["runs"].items():
            lines[f"checkrun incremental, {policy}"] = [s["written"] for s in run["saves"]]
        first = next(iter(d["runs"].values()))["saves"][0]["written"]
        n = len(next(iter(d["runs"].values()))["saves"])
        lines["checkrun full (every save a base = save 0)"] = [first] * n
    for run in (quant or {}).get("results", {}).get("runs", []):
        if run["config"] != "lossless":
            lines[f"checkrun {run['config']} quantized, {run['policy']}"] = [s["written"] for s in run["saves"]]
    if tb is None and quant:
        tb = med(quant["results"].get("torch", {}).get("bytes", [])) or None
    return lines, tb


def dlrm_tables(d: dict) -> tuple[str, list]:
    tb = med(d["torch"]["raw"]["bytes"])
    rows, targets = [], []
    for policy, run in d["runs"].items():
        saves = run["saves"]
        deltas = [s for s in saves if s["chain"] > 0]
        dw = med(s["written"] for s in deltas)
        amort = sum(s["written"] for s in saves) / len(saves)
        rows.append([policy, f"{saves[0]['written'] / MB:,.1f}", f"{dw / MB:,.1f}", f"{dw / tb:.3f} (1/{tb / dw:.1f})",
                     f"{max(s['written'] for s in deltas) / tb:.3f}", f"1/{tb / amort:.1f}",
                     ms([s["blocking"] for s in deltas]), ms([s["background"] for s in deltas], 2),
                     max(s["chain"] for s in saves)])
        targets.append(target("4", f"DLRM incremental writes <= 1/12 of torch.save ({policy})",
                              f"median 1/{tb / dw:.1f}", dw <= tb / 12))
    text = (f"torch.save of the same payload: {tb / MB:,.0f} MB, the call {ms(d['torch']['raw']['call'])} s, durable "
            f"{ms(d['torch']['raw']['durable'])} s; floor copy {ms(d['floor'])} s.\n\n"
            + table(["policy", "save 0 (base) MB", "median delta MB", "median delta x torch", "worst delta x torch",
                     "amortized (all saves)", "delta blocking s", "delta background s", "longest chain"], rows))
    return text, targets


def restore_rows(inc: Optional[dict], fmt: Optional[dict]) -> tuple[list, dict, list]:
    """Table rows, plot groups and chain targets for restore time."""
    rows, groups, targets = [], {}, []
    for dt, d in ((fmt or {}).get("results", {}).get("dtypes", {})).items():
        t, c = d["torch"], d["checkrun"]
        rows.append([f"GPT {dt} (full)", ms(t["cold"]), ms(c["cold"]), ms(t["warm"]), ms(c["warm"]), "-", "-"])
        groups[f"GPT {dt}\ncold"] = {"torch.load": t["cold"], "checkrun full": c["cold"]}
        groups[f"GPT {dt}\nwarm"] = {"torch.load": t["warm"], "checkrun full": c["warm"]}
    d = (inc or {}).get("results", {}).get("dlrm")
    if d:
        tr = d["torch"]["raw"]
        for policy, run in d["runs"].items():
            rr = run["restore"]
            depth = run["saves"][run["deepest"]]["chain"]
            cold_x = med(rr["chain_cold"]) / med(rr["full_cold"])
            warm_x = med(rr["chain_warm"]) / med(rr["full_warm"])
            rows.append([f"DLRM {policy}: full (save 0)", ms(tr["cold"]), ms(rr["full_cold"]), ms(tr["warm"]),
                         ms(rr["full_warm"]), "", ""])
            rows.append([f"DLRM {policy}: chain of {depth}", ms(tr["cold"]), ms(rr["chain_cold"]), ms(tr["warm"]),
                         ms(rr["chain_warm"]), f"{cold_x:.2f}", f"{warm_x:.2f}"])
            for kind in ("cold", "warm"):
                groups[f"DLRM {policy}\n{kind}"] = {"torch.load": tr[kind], "checkrun full": rr[f"full_{kind}"],
                                                   "checkrun chain": rr[f"chain_{kind}"]}
            worst = max(x for x in (cold_x, warm_x) if x == x)
            targets.append(target("4", f"chain restore <= 1.5x full restore ({policy}, chain of {depth})",
                                  f"{cold_x:.2f}x cold, {warm_x:.2f}x warm", worst <= 1.5))
    return rows, groups, targets


def finetune_table(f: dict) -> tuple[str, list]:
    tr, trainable = f["torch"]["raw"], f["trainable_bytes"]
    rows, targets = [], []
    for label, run in f["runs"].items():
        later = run["saves"][1:]
        w = med(s["written"] for s in later)
        rows.append([label, f"{w / MB:,.1f}", f"{w / trainable:.2f}", ms([s["blocking"] for s in later]),
                     f"{med(s['blocking'] for s in later) / med(f['floor']):.2f}", ms(run["restore"]["cold"]),
                     ms(run["restore"]["warm"]), ms(tr["cold"]), ms(tr["warm"])])
        if label.startswith("row deltas"):
            targets.append(target("4", INC_TARGETS[1][1], f"{w / trainable:.2f}x", w <= 1.2 * trainable))
    text = (f"Fine-tuning: {f['frozen_params'] / 1e6:.1f}M frozen parameters, trainable state (LoRA + Adam) "
            f"{trainable / MB:.1f} MB, torch.save {med(tr['bytes']) / MB:,.0f} MB.\n\n"
            + table(["config", "median write MB (saves 1..)", "x trainable state", "blocking s", "x floor",
                     "restore cold s", "restore warm s", "torch.load cold s", "torch.load warm s"], rows))
    return text, targets


def incremental_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 3. Incremental checkpoints: bytes per checkpoint, restore time (issue 4)"
    if not res:
        return missing(title, "incremental", INC_TARGETS)
    r, parts, targets = res["results"], [title, ""], []
    lines, tb = byte_lines(res, allres.get("quant"))
    p = plots.bytes_per_checkpoint(lines, tb, res["machine"], png / "bytes_per_checkpoint.png")
    parts += ["DLRM-like state: 8 embedding tables (dim 64), row-wise Adagrad (1-D), an MLP with Adam; between "
              "checkpoints 5% of each table's rows and every MLP parameter change. Bytes are exact (one run); "
              "seconds are medians (min-max) over the delta saves or the 3 restores. Quantized lines come from "
              f"section 4 (same state and updates). {caption(res)} Arguments: `{args_text(res)}`.", "",
              img(p, "bytes written per checkpoint")]
    if "dlrm" in r:
        text, t = dlrm_tables(r["dlrm"])
        parts += [text, ""]
        targets += t
    rows, groups, t = restore_rows(res, allres.get("format"))
    p = plots.grouped_bars(groups, "seconds (median, min-max of 3)", "Restore time: checkrun vs torch.load",
                           res["machine"], png / "restore_time.png")
    parts += ["### Restore time", "", "torch.load(weights_only=True) vs `ckpt_core.load` (every blob checksummed); "
              "cold = page cache dropped first. GPT rows come from section 1, DLRM rows from the incremental runs "
              "(full = the base save 0, chain = the save with the longest delta chain, checked bit for bit).", "",
              img(p, "restore time"),
              table(["checkpoint", "torch.load cold s", "checkrun cold s", "torch.load warm s", "checkrun warm s",
                     "chain/full cold", "chain/full warm"], rows), ""]
    targets += t
    if "finetune" in r:
        text, t = finetune_table(r["finetune"])
        parts += ["### Fine-tuning (frozen base + LoRA)", "", text, ""]
        targets += t
    else:
        targets.append(target("4", INC_TARGETS[1][1], "not measured", None))
    return "\n".join(parts), targets


def quant_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 4. Quantization: bytes (issue 5)"
    if not res:
        return missing(title, "quant", QUANT_TARGETS)
    r = res["results"]
    tb = med(r["torch"]["bytes"])
    rows, targets = [], []
    for run in r["runs"]:
        saves = run["saves"]
        inc = [s["written"] for s in saves[1:]]
        rows.append([run["config"], run["policy"], f"{saves[0]['written'] / MB:,.1f}",
                     f"{tb / saves[0]['written']:.2f}", f"{tb / med(inc):.1f}", f"{tb / max(inc):.1f}",
                     ms([s["blocking"] for s in saves]), f"{saves[0]['total']:.1f}", f"{run['rel_l2_error']:.3f}"])
        if run["config"] != "lossless":
            if run["policy"] == "intermittent":
                x = tb / saves[0]["written"]
                targets.append(target("5", QUANT_TARGETS[0][1], f"{x:.2f}x", x >= 6))
            targets.append(target("5", f"{QUANT_TARGETS[1][1]} ({run['policy']})", f"median {tb / med(inc):.1f}x",
                                  tb / med(inc) >= 17))
    probe = table(["torch threads", "greedy", "encode MB/s (16 MB chunk, median of 3)"], r.get("probe", []), 1)
    text = (f"{title}\n\nThe DLRM state of section 3 with the embedding tables quantized "
            "(`QuantRule('model.emb.*.weight', 'uniform', bits, greedy=True)`, one scale/offset per row); everything "
            f"else lossless. torch.save of the same payload: {tb / MB:,.0f} MB. {caption(res)} Arguments: "
            f"`{args_text(res)}`.\n\n"
            + table(["config", "policy", "full save MB", "full: x smaller than torch", "incremental (median): x less",
                     "incremental (worst): x less", "blocking s (all saves)", "full save to durable s",
                     "max rel L2 error"], rows)
            + f"\n\nEncoder speed by torch thread count:\n\n{probe}\n")
    return text, targets
