"""Incremental (issue 4): bytes written and blocking time per checkpoint in one run, and restore
time from the longest delta chain vs a full checkpoint - checkrun vs torch.save.

DLRM: ``--size`` MB of fp32 embedding tables (8 tables, dim 64), TorchRec-style row-wise Adagrad
state (one fp32 per row, 1-D) and a small MLP with Adam. Between checkpoints ``--frac`` (5%) of
each table's rows and their Adagrad entries change; every MLP parameter changes (dense).
Policies: ``consecutive`` (delta vs the previous save) and the default ``intermittent``
(cumulative delta vs the last base, new base when predicted cheaper), both ``max_chain=8``,
``row_delta_min_rows=1024`` (the default: tables are row streams, MLP layers use chunk dedup).

Fine-tuning: 24 frozen 2048x2048 linear layers (100.7M params) + rank-20 LoRA adapters (2.0M
trainable) with Adam, 2 real training steps between checkpoints; once with the default
``row_delta_min_rows=1024`` (frozen weights are row streams, compared on every save) and once
with row deltas off (frozen weights are copied and deduplicated by content hash).

torch.save: the payload into a file + fsync (medians of 3). Restores: ``ckpt_core.load`` with the
config of the run (checksums verified; cold = page cache dropped first), medians of 3.

Run: ``python -m benchmarks.bench_incremental [--size 1024] [--saves 10] [--part dlrm|finetune|all]
[--ft-layers 24] [--json PATH]`` (``--json``: raw per-save and per-restore measurements).
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import (MB, dir_bytes, dlrm_interval, dlrm_payload, dlrm_state, drop_caches,
                               engine_config, floor_copy, fresh, machine_header, machine_info, med, table, tensors,
                               timed, torch_save_file, verdict, workdir, write_json)


def clone(x):
    return [t.clone() for t in tensors(x)]


def same(saved: list, loaded) -> bool:
    lt = tensors(loaded)
    return len(saved) == len(lt) and all(torch.equal(a, b) for a, b in zip(saved, lt))


def torch_reference(payload, root: Path, reps: int = 3) -> dict:
    out = {"bytes": [], "call": [], "durable": [], "cold": [], "warm": []}
    for r in range(reps):
        p = fresh(root / "torch.pt")
        call, durable = torch_save_file(payload, p)
        out["bytes"].append(p.stat().st_size)
        out["call"].append(call)
        out["durable"].append(durable)
        drop_caches()
        out["cold"].append(timed(lambda: torch.load(p, weights_only=True))[0])
        out["warm"].append(timed(lambda: torch.load(p, weights_only=True))[0])
        p.unlink()
    return {**{k: med(v) for k, v in out.items()}, "raw": out}


def floor_seconds(payload) -> list:
    """3 copies of the payload into buffers allocated once (the floor of any snapshot): seconds each."""
    bufs = floor_copy(payload, None)
    return [timed(lambda: floor_copy(payload, bufs))[0] for _ in range(3)]


def restore_times(path: Path, cfg, reps: int = 3) -> tuple[list, list]:
    import ckpt_core

    cold, warm = [], []
    for _ in range(reps):
        dropped = drop_caches()
        t, out = timed(lambda: ckpt_core.load(path, config=cfg))
        del out
        cold.append(t if dropped else float("nan"))
        warm.append(timed(lambda: ckpt_core.load(path, config=cfg))[0])
    return cold, warm


def run_chain(make_state, step, payload_of, cfg, root: Path, saves: int, keep_at: int) -> dict:
    """Save ``saves`` checkpoints with ``step`` between them; keep a copy of the state at save
    ``keep_at`` to check its restore is exact. Returns per-save SaveInfos and restore checks."""
    import ckpt_core

    st = make_state()
    infos, kept = [], None
    with ckpt_core.CheckpointEngine(cfg) as engine:
        for i in range(saves):
            if i:
                step(st, i)
            info = engine.save(payload_of(st), root / f"step={i}.ckpt").result()
            infos.append(info)
            if i == keep_at:
                kept = clone(payload_of(st))
    del st
    deepest = max(range(saves), key=lambda i: (infos[i].chain_depth, -i))
    if kept is not None and deepest == keep_at:
        assert same(kept, ckpt_core.load(root / f"step={deepest}.ckpt", config=cfg)), "chain restore differs"
    del kept
    return {"infos": infos, "deepest": deepest}


def chain_table(name: str, infos, torch_bytes: float, floor: float) -> list:
    rows = []
    for i, inf in enumerate(infos):
        kind = "base" if inf.chain_depth == 0 and (i == 0 or inf.written_bytes > 0.3 * torch_bytes) else "delta"
        rows.append([name, i, kind, inf.chain_depth, inf.written_bytes / MB, inf.written_bytes / torch_bytes,
                     inf.blocking_seconds, inf.blocking_seconds / floor, inf.background_seconds])
    return rows


HEAD = ["run", "save", "kind", "chain", "written MB", "x torch bytes", "blocking s", "x floor copy",
        "background s"]


def save_rows(infos) -> list:
    return [{"written": i.written_bytes, "stored": i.stored_bytes, "tensor_bytes": i.tensor_bytes,
             "blocking": i.blocking_seconds, "background": i.background_seconds, "total": i.total_seconds,
             "chain": i.chain_depth} for i in infos]


def part_dlrm(args, root: Path) -> dict:
    make = lambda: dlrm_state(args.size)  # noqa: E731
    st = make()
    payload = dlrm_payload(st)
    ref = torch_reference(payload, root)
    floors = floor_seconds(payload)
    floor = med(floors)
    out = {"torch": ref, "floor": floors, "runs": {}}
    del st, payload
    print(f"DLRM state: torch.save {ref['bytes'] / MB:.0f} MB, blocks {ref['call']:.2f} s, durable "
          f"{ref['durable']:.2f} s; floor copy {floor:.3f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    rows, summary = [], []
    for policy in ("consecutive", "intermittent"):
        cfg = engine_config(**{"incremental.policy": policy, "incremental.max_chain": 8})
        d = fresh(root / policy)
        res = run_chain(make, lambda s, i: dlrm_interval(s, args.frac, seed=i), dlrm_payload, cfg, d,
                        args.saves, keep_at=8)
        infos = res["infos"]
        rows += chain_table(policy, infos, ref["bytes"], floor)
        deltas = [inf.written_bytes for inf in infos if inf.chain_depth > 0]
        full_cr, full_wr = restore_times(d / "step=0.ckpt", cfg)
        chain_cr, chain_wr = restore_times(d / f"step={res['deepest']}.ckpt", cfg)
        out["runs"][policy] = {"saves": save_rows(infos), "deepest": res["deepest"],
                               "restore": {"full_cold": full_cr, "full_warm": full_wr, "chain_cold": chain_cr,
                                           "chain_warm": chain_wr}}
        full_c, full_w, chain_c, chain_w = med(full_cr), med(full_wr), med(chain_cr), med(chain_wr)
        summary.append([policy, med(deltas) / MB, med(deltas) / ref["bytes"], max(deltas) / ref["bytes"],
                        sum(i.written_bytes for i in infos) / len(infos) / ref["bytes"],
                        infos[res["deepest"]].chain_depth, full_c, chain_c, chain_c / full_c,
                        full_w, chain_w, chain_w / full_w, ref["cold"]])
        print(f"  {policy} done (load {os.getloadavg()[0]:.2f}); dir {dir_bytes(d) / MB:.0f} MB", flush=True)
        shutil.rmtree(d)
    print(table(HEAD, rows))
    print()
    print(table(["policy", "median delta MB", "median delta x torch", "max delta x torch",
                 "amortized x torch (all saves)", "longest chain", "full restore cold s",
                 "chain restore cold s", "chain/full cold", "full warm s", "chain warm s", "chain/full warm",
                 "torch.load cold s"], summary))
    for s in summary:
        print(f"- {s[0]}: median incremental write {s[2]:.4f}x torch.save = 1/{1 / s[2]:.1f} (target <= 1/12): "
              f"{verdict(s[2] <= 1 / 12)}; amortized incl. bases 1/{1 / s[4]:.1f}; chain restore "
              f"{s[8]:.2f}x full cold, {s[11]:.2f}x warm (target <= 1.5x): {verdict(max(s[8], s[11]) <= 1.5)}")
    return out


class LoRALinear(nn.Module):
    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) * d ** -0.5, requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(r, d) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(d, r))

    def forward(self, x):
        return torch.relu(x @ self.weight.t() + (x @ self.lora_A.t()) @ self.lora_B.t())


def finetune_state(layers: int = 24, d: int = 2048, r: int = 20) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[LoRALinear(d, r) for _ in range(layers)])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    st = {"model": model, "opt": opt, "gen": torch.Generator().manual_seed(0), "d": d}
    finetune_step(st, 0)
    return st


def finetune_step(st: dict, i: int, steps: int = 2) -> None:
    for _ in range(steps):
        x = torch.randn(8, st["d"], generator=st["gen"])
        st["model"](x).pow(2).mean().backward()
        st["opt"].step()
        st["opt"].zero_grad(set_to_none=True)


def finetune_payload(st: dict) -> dict:
    return {"state_dict": st["model"].state_dict(), "optimizer": st["opt"].state_dict()}


def part_finetune(args, root: Path) -> dict:
    st = finetune_state(layers=args.ft_layers)
    payload = finetune_payload(st)
    trainable = sum(p.numel() * 4 * 3 for p in st["model"].parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in st["model"].parameters() if not p.requires_grad)
    ref = torch_reference(payload, root)
    floors = floor_seconds(payload)
    floor = med(floors)
    out = {"torch": ref, "floor": floors, "trainable_bytes": trainable, "frozen_params": frozen, "runs": {}}
    del st, payload
    print(f"\nFine-tuning: {frozen / 1e6:.1f}M frozen params, trainable state (params + Adam) "
          f"{trainable / MB:.1f} MB; torch.save {ref['bytes'] / MB:.0f} MB; floor copy {floor:.3f} s", flush=True)
    rows, summary = [], []
    for label, over in (("row deltas (default)", {}), ("chunk dedup only", {"incremental.row_delta_min_rows": 1 << 40})):
        cfg = engine_config(**over)
        d = fresh(root / "ft")
        res = run_chain(lambda: finetune_state(layers=args.ft_layers), finetune_step, finetune_payload, cfg, d,
                        args.saves, keep_at=-1)
        infos = res["infos"]
        rows += chain_table(label, infos, ref["bytes"], floor)
        later = infos[1:]
        w = med(i.written_bytes for i in later)
        cold_r, warm_r = restore_times(d / f"step={args.saves - 1}.ckpt", cfg)
        out["runs"][label] = {"saves": save_rows(infos), "restore": {"cold": cold_r, "warm": warm_r}}
        cold, warm = med(cold_r), med(warm_r)
        summary.append([label, w / MB, w / trainable, med(i.blocking_seconds for i in later),
                        med(i.blocking_seconds for i in later) / floor, cold, cold / ref["cold"], warm,
                        warm / ref["warm"]])
        shutil.rmtree(d)
    print(table(HEAD, rows))
    print()
    print(table(["config", "median write MB (saves 1..)", "x trainable state", "median blocking s", "x floor",
                 "restore cold s", "x torch.load", "restore warm s", "x torch.load warm"], summary))
    for s in summary:
        print(f"- {s[0]}: writes {s[2]:.2f}x the trainable state (target <= 1.2x): {verdict(s[2] <= 1.2)}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="DLRM embedding tables in MB")
    ap.add_argument("--saves", type=int, default=10, help="checkpoints per run (first is full)")
    ap.add_argument("--frac", type=float, default=0.05, help="fraction of rows changed per interval")
    ap.add_argument("--part", choices=["dlrm", "finetune", "all"], default="all")
    ap.add_argument("--ft-layers", type=int, default=24, help="fine-tuning part: frozen 2048x2048 layers")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    root = workdir(args.dir)
    started, results = machine_info(), {}
    print(machine_header("Incremental: bytes per checkpoint, blocking, chain restore"))
    if not drop_caches():
        print("page cache cannot be dropped here: cold restores are not measured\n")
    try:
        if args.part in ("dlrm", "all"):
            results["dlrm"] = part_dlrm(args, root)
            write_json(args.json, "incremental", args, results, started)
        if args.part in ("finetune", "all"):
            results["finetune"] = part_finetune(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, "incremental", args, results, started)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
