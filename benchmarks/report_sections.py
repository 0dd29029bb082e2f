"""Sections of the benchmark report: format, async (blocking vs size, training slowdown), incremental
(bytes per checkpoint, restore time) and quantization bytes. Each takes the module's JSON (or None
when it did not run or failed), the PNG folder and all results; returns (markdown, target rows).
Lightning, Accelerate and DCP live in ``report_peers``."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from benchmarks import plots
from benchmarks.common import table, verdict

MB = 1e6


# -- helpers ------------------------------------------------------------------------------------
def med(xs) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def ms(xs, digits: int = 3) -> str:
    """'median (min-max)' of raw values; NaN-only or empty lists give '-'."""
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return "-"
    f = lambda v: f"{v:.{digits}f}" if abs(v) < 1000 else f"{v:,.0f}"  # noqa: E731
    return f(statistics.median(xs)) if len(xs) == 1 else f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})"


def img(path: Optional[Path], alt: str) -> str:
    return f"![{alt}](benchmarks/{path.name})\n" if path else f"(plot not drawn: no data for {alt})\n"


def caption(res: dict) -> str:
    m = res.get("machine", {})
    load = m.get("loadavg", ["?"])[0], m.get("loadavg_end", ["?"])[0]
    return f"Measured on {plots.caption(m)}, load average {load[0]} at the start, {load[1]} at the end."


def args_text(res: dict) -> str:
    args = res.get("args", {})
    skip = {"part", "peers", "train_peers"} | ({"size"} if args.get("sizes") else set())
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items()
                    if v not in (None, False) and not k.startswith("worker") and k not in skip)


def missing(title: str, name: str, rows: list) -> tuple[str, list]:
    text = (f"{title}\n\nNot measured in this report: `bench_{name}` did not run or failed (see Runs above). "
            f"Run `python -m benchmarks --only {name}`.\n")
    return text, [[r[0], r[1], "not measured", "-"] for r in rows]


def target(issue: str, what: str, measured: str, ok: Optional[bool]) -> list:
    return [issue, what, measured, "INCONCLUSIVE" if ok is None else verdict(ok)]


# -- 1. format ------------------------------------------------------------------------------------
def paired(c: dict, t: dict, key: str) -> float:
    """Median of checkrun / torch over repetitions (bench_format runs them in alternation)."""
    ratios = [a / b for a, b in zip(c[key], t[key]) if a == a and b == b and b > 0]
    return med(ratios) if ratios else float("nan")


FORMAT_TARGETS = [["2", "stored bytes fp32 <= 0.87x torch.save"], ["2", "stored bytes bf16 <= 0.72x torch.save"],
                  ["2", "load <= 1.5x torch.load (local disk)"]]


def format_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 1. Format: full checkpoint vs torch.save (issue 2)"
    if not res:
        return missing(title, "format", FORMAT_TARGETS)
    r, rows, targets, loads = res["results"], [], [], []
    kind = "cold" if r.get("cold") else "warm"
    pairs = bool(r.get("paired"))  # older data: the torch runs all came before the checkrun runs
    ratio = paired if pairs else (lambda c, t, key: med(c[key]) / med(t[key]))
    for dt, d in r["dtypes"].items():
        t, c = d["torch"], d["checkrun"]
        rb = med(c["bytes"]) / med(t["bytes"])
        rows.append([dt, "torch.save / torch.load", d["state_bytes"] / MB, med(t["bytes"]) / MB, "1.000",
                     ms(t["call"]), ms(t["save"]), ms(t["cold"]), ms(t["warm"]), "1.00", "1.00"])
        rows.append([dt, "checkrun", d["state_bytes"] / MB, med(c["bytes"]) / MB, f"**{rb:.3f}**", ms(c["block"]),
                     ms(c["save"]), ms(c["cold"]), ms(c["warm"]), f"{ratio(c, t, 'cold'):.2f}",
                     f"{ratio(c, t, 'warm'):.2f}"])
        limit = 0.87 if dt == "fp32" else 0.72
        targets.append(target("2", f"stored bytes {dt} <= {limit}x torch.save", f"{rb:.3f}x", rb <= limit))
        loads.append((dt, ratio(c, t, kind)))
    worst = max(x for _, x in loads)
    targets.append(target("2", "load <= 1.5x torch.load (local disk)",
                          ", ".join(f"{dt} {x:.2f}x {kind}" for dt, x in loads), worst <= 1.5))
    text = (f"{title}\n\nA GPT-like state (weights + Adam moments after 2 real steps) in fp32 and cast to bf16: "
            "`torch.save` into a file + fsync vs a full checkrun save (incremental off, defaults: byte-shuffle + "
            "zstd-1, checksums, fsync), each timed 3 times after a warm-up"
            + ("; torch and checkrun in alternation, ratios = medians of the per-repetition ratios" if pairs else "")
            + f"; loads cold (page cache dropped) and warm. {caption(res)} Arguments: `{args_text(res)}`.\n\n"
            + table(["dtype", "writer", "state MB", "stored MB", "bytes x torch", "blocking s", "durable save s",
                     "cold load s", "warm load s", "cold load x torch", "warm load x torch"], rows, 1)
            + "\n\n(torch blocking = the torch.save call into the page cache; durable = until fsync'd / committed)\n")
    return text, targets


# -- 2. async -------------------------------------------------------------------------------------
ASYNC_TARGETS = [["3", "blocking <= 1.3x floor copy"], ["3", "blocking <= 0.1x torch.save"],
                 ["3", "blocking below both async peers (Lightning, DCP)"],
                 ["3", "peak extra host memory <= 1.1x state (max_pending=1)"]]
PEER_NAMES = {"floor": "floor (copy into reused buffers)", "checkrun": "checkrun async incremental (defaults)",
              "checkrun-noinc": "checkrun async full (incremental off)", "checkrun-quant": "checkrun quantized (4-bit wte)",
              "torch.save": "torch.save", "lightning-async": "Lightning AsyncCheckpointIO",
              "dcp-async": "DCP async_save", "dcp-async-cached": "DCP async_save, reused stager",
              "accelerate": "accelerate save_state"}


def stall_targets(top: dict) -> list:
    ok = {p: r for p, r in top.items() if "error" not in r}
    c = ok.get("checkrun")
    if not c:
        return [target(i, w, "checkrun failed", False) for i, w in ASYNC_TARGETS]
    xf = [b / f for b, f in zip(c["raw"]["block"], c["raw"]["floor"])]
    out = [target("3", ASYNC_TARGETS[0][1], f"{med(xf):.2f}x", med(xf) <= 1.3)]
    if "torch.save" in ok:
        x = med(c["raw"]["block"]) / med(ok["torch.save"]["raw"]["block"])
        out.append(target("3", ASYNC_TARGETS[1][1], f"{x:.3f}x", x <= 0.1))
    else:
        out.append(target("3", ASYNC_TARGETS[1][1], "torch.save failed", None))
    peers = {p: med(ok[p]["raw"]["block"]) for p in ("lightning-async", "dcp-async", "dcp-async-cached") if p in ok}
    if peers:
        best = min(peers, key=peers.get)
        mine = med(c["raw"]["block"])
        out.append(target("3", ASYNC_TARGETS[2][1], f"{mine:.3f} s vs {peers[best]:.3f} s ({best})",
                          mine < peers[best]))
    else:
        out.append(target("3", ASYNC_TARGETS[2][1], "peers failed", None))
    x = c["peak"] / c["state"]
    out.append(target("3", ASYNC_TARGETS[3][1], f"{x:.2f}x", x <= 1.1))
    return out


def stall_tables(stall: dict) -> str:
    sizes = sorted(stall, key=float)
    peers = list(dict.fromkeys(p for s in sizes for p in stall[s]))
    state = {s: next((r["state"] for r in stall[s].values() if "state" in r), float("nan")) for s in sizes}
    rows = [[PEER_NAMES.get(p, p)] + [ms(stall[s][p]["raw"]["block"]) if "raw" in stall[s].get(p, {}) else
                                       ("FAILED" if p in stall[s] else "-") for s in sizes] for p in peers]
    out = table(["method"] + [f"{state[s] / MB:,.0f} MB: blocking s" for s in sizes], rows)
    top = stall[sizes[-1]]
    ts = med(top["torch.save"]["raw"]["block"]) if "raw" in top.get("torch.save", {}) else float("nan")
    rows = []
    for p, r in top.items():
        if "error" in r:
            rows.append([PEER_NAMES.get(p, p), "FAILED", "", "", "", "", ""])
            continue
        raw = r["raw"]
        rows.append([PEER_NAMES.get(p, p), ms(raw["block"]), ms([b / f for b, f in zip(raw["block"], raw["floor"])], 2),
                     f"{med(raw['block']) / ts:.3f}", ms(raw["durable"]), f"{r['peak'] / MB:,.0f}",
                     f"{r['peak'] / r['state']:.2f}"])
    out += (f"\n\nAt {state[sizes[-1]] / MB:,.0f} MB:\n\n"
            + table(["method", "blocking s", "x floor (per save)", "x torch.save", "durable s", "peak extra MB",
                     "peak x state"], rows))
    fails = [f"- {p} at {s} MB failed: `{stall[s][p]['error'].strip().splitlines()[-1][:300]}`"
             for s in sizes for p in stall[s] if "error" in stall[s][p]]
    return out + ("\n\n" + "\n".join(fails) if fails else "")


def train_table(train: dict) -> str:
    rows = []
    for p, rs in train.items():
        if any("error" in r for r in rs):
            rows.append([p, "FAILED", "", "", "", "", ""])
            continue
        rows.append([p, ms([r["base_loop"] for r in rs], 2), ms([r["loop"] for r in rs], 2),
                     ms([r["loop"] / r["base_loop"] for r in rs], 2), ms([s for r in rs for s in r["stalls"]]),
                     ms([r["drain"] for r in rs], 2), ms([r["cpu"] / r["base_cpu"] for r in rs], 2)])
    return table(["checkpointing", "loop without checkpoints s", "loop s", "slowdown x", "stall per save s",
                  "final drain s", "process CPU x without"], rows)


def async_section(res: Optional[dict], png: Path, allres: dict) -> tuple[str, list]:
    title = "## 2. Asynchronous saving: blocking time vs state size, training slowdown (issue 3)"
    if not res:
        return missing(title, "async", ASYNC_TARGETS)
    r = res["results"]
    text, targets = [title, ""], []
    stall = r.get("stall")
    if stall:
        targets = stall_targets(stall[sorted(stall, key=float)[-1]])
        p = plots.blocking_vs_size(stall, res["machine"], png / "blocking_vs_size.png", PEER_NAMES)
        text += ["How long one save keeps the training thread, per method and state size (a GPT-like fp32 state; "
                 "each method in its own process: a warm-up save, then 3 timed saves, the state changed in place "
                 "before each and the previous save finished, so blocking is the snapshot alone). "
                 "Floor = copying every tensor into buffers allocated once; x floor = blocking / a floor copy timed "
                 "just before it in the same process. Peak extra = VmHWM over the saves - RSS before. "
                 f"{caption(res)} Arguments: `{args_text(res)}`.", "", img(p, "blocking time vs state size"),
                 stall_tables(stall), ""]
    else:
        targets = [[i, w, "not measured", "-"] for i, w in ASYNC_TARGETS]
    train = r.get("train")
    if train:
        p = plots.training_slowdown(train, res["machine"], png / "training_slowdown.png")
        a = res.get("args", {})
        text += ["### Training slowdown", "",
                 f"An MLP (~{a.get('train_mb')} MB of weights + Adam) trained {a.get('steps')} steps on CPU with a "
                 f"checkpoint every {a.get('every')} steps, each method in its own process: {a.get('rounds')} rounds of "
                 "(the loop without checkpoints, then the loop with them); slowdown = the ratio of the pair (median "
                 "and min-max over rounds), so load drifting between processes does not enter it; "
                 "final drain = waiting for the last save after the loop; process CPU = user + sys of all threads.",
                 "", img(p, "training slowdown"), train_table(train), ""]
    return "\n".join(text), targets
