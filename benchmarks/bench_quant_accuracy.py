"""Quantization accuracy (issue 5): does restoring from quantized checkpoints hurt a DLRM model?

Data: synthetic clicks from a fixed-seed hidden model (``--tables`` categorical features with
Zipf-like popularity over ``--rows`` ids each + 13 dense features; logit = pairwise dot products
of hidden embeddings + a per-id bias + a linear term; label ~ Bernoulli(sigmoid)). Batch ``i`` is generated from
seed ``i``, so replaying steps after a restore sees the same data.

Model: DLRM (embedding tables dim 16 with sparse Adagrad, bottom MLP 13-64-16, dot interaction,
top MLP 52-64-32-1 with Adam). Training ``--steps`` steps of batch 512, a checkrun checkpoint every
``--every`` steps (async, default incremental). A failure at step f: the engine is dropped, a new
one loads ``latest(dir)``, training resumes from that checkpoint's step (lost steps are replayed).
``k`` failures are spread evenly over training after the first checkpoint. Quantized runs use
``QuantRule("model.emb.*.weight", method, bits, greedy=True)``: only the embedding weights are
lossy; Adagrad state, MLP and Adam are lossless.

Reported: final eval log-loss and AUC (rank formula, 50k held-out samples) and their relative
change vs the lossless run without failures. The lossless run with 20 failures must match it
exactly (lossless restore + deterministic replay). Target: degradation < 0.1% at 4 bits, 20 restores.

Run: ``python -m benchmarks.bench_quant_accuracy [--steps 1500] [--every 60] [--extra] [--json PATH]``
(``--json``: the table's rows, the two verdicts and the run time, for ``benchmarks.report``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks.common import engine_config, machine_header, machine_info, table, verdict, workdir, write_json

DIM, DENSE, BATCH = 16, 13, 512


class Hidden:
    """The fixed-seed click model that generates the data."""

    def __init__(self, tables: int, rows: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tables, self.rows = tables, rows
        self.bias = [torch.randn(rows, generator=g) * 0.5 for _ in range(tables)]  # per-id click rates
        self.emb = [torch.randn(rows, 4, generator=g) * 0.4 for _ in range(tables)]
        self.w = torch.randn(DENSE, generator=g) * 0.3
        self.pop = [torch.randperm(rows, generator=g) for _ in range(tables)]  # popular ids differ

    def batch(self, seed: int, n: int = BATCH):
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(n, DENSE, generator=g)
        u = torch.rand(n, self.tables, generator=g)
        ranks = (u.pow(3) * self.rows).long().clamp_(max=self.rows - 1)  # Zipf-like skew
        ids = torch.stack([self.pop[t][ranks[:, t]] for t in range(self.tables)], 1)
        vecs = torch.stack([self.emb[t][ids[:, t]] for t in range(self.tables)], 1)
        inter = torch.triu(vecs @ vecs.transpose(1, 2), 1).sum((1, 2))
        bias = sum(self.bias[t][ids[:, t]] for t in range(self.tables))
        logit = bias + inter * 0.3 + dense @ self.w - 0.5
        y = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return dense, ids, y


class DLRM(nn.Module):
    def __init__(self, tables: int, rows: int) -> None:
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(rows, DIM, sparse=True) for _ in range(tables))
        for e in self.emb:
            nn.init.uniform_(e.weight, -rows ** -0.5, rows ** -0.5)
        self.bot = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM), nn.ReLU())
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(DIM + n * (n - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                 nn.Linear(32, 1))
        self.iu = torch.triu_indices(n, n, 1)

    def forward(self, dense, ids):
        d = self.bot(dense)
        vecs = torch.stack([d] + [e(ids[:, t]) for t, e in enumerate(self.emb)], 1)
        inter = (vecs @ vecs.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return self.top(torch.cat([d, inter], 1)).squeeze(1)


def auc(y: np.ndarray, s: np.ndarray) -> float:
    """Rank-based AUC (Mann-Whitney U), ties get their average rank."""
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = y == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(model: DLRM, data) -> tuple[float, float]:
    dense, ids, y = data
    with torch.no_grad():
        s = model(dense, ids)
        loss = nn.functional.binary_cross_entropy_with_logits(s, y).item()
    return loss, auc(y.numpy(), s.numpy())


def train(args, hidden: Hidden, evalset, rules: list, failures: int, root: Path) -> dict:
    import ckpt_core

    torch.manual_seed(0)
    model = DLRM(args.tables, args.rows)
    sparse = torch.optim.Adagrad(list(model.emb.parameters()), lr=0.05)
    dense = torch.optim.Adam(list(model.bot.parameters()) + list(model.top.parameters()), lr=1e-3)
    cfg = engine_config(quantization=rules)
    engine = ckpt_core.CheckpointEngine(cfg)
    span = args.steps - args.every  # failures after the first checkpoint, spread evenly
    fail_at = sorted({args.every + round((j + 1) * span / (failures + 1)) for j in range(failures)})
    step, restores, rel_err, t0 = 0, 0, 0.0, time.perf_counter()
    while step < args.steps:
        if fail_at and step == fail_at[0]:
            fail_at.pop(0)
            engine.close()  # the process dies; a new one restores the latest checkpoint
            engine = ckpt_core.CheckpointEngine(cfg)
            latest = engine.latest(root)
            state = engine.load(latest)
            errs = [r.quant["rel_l2_error"] for r in engine.read_manifest(latest).tensors if r.quant]
            rel_err = max([rel_err] + errs)
            model.load_state_dict(state["model"])
            sparse.load_state_dict(state["sparse"])
            dense.load_state_dict(state["dense"])
            step, restores = state["step"], restores + 1
            continue
        x, ids, y = hidden.batch(step)
        loss = nn.functional.binary_cross_entropy_with_logits(model(x, ids), y)
        loss.backward()
        sparse.step()
        dense.step()
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        step += 1
        if step % args.every == 0:
            engine.save({"model": model.state_dict(), "sparse": sparse.state_dict(), "dense": dense.state_dict(),
                         "step": step}, root / f"step={step}.ckpt")
    engine.close()
    loss, a = evaluate(model, evalset)
    return {"loss": loss, "auc": a, "restores": restores, "rel_err": rel_err, "seconds": time.perf_counter() - t0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--every", type=int, default=60, help="checkpoint interval in steps")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--extra", action="store_true", help="also 2-bit, 3-bit and adaptive")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    root = workdir(args.dir)
    torch.set_num_threads(1)  # deterministic and leaves a core to the background saver
    started, t_start = machine_info(), time.perf_counter()
    hidden = Hidden(args.tables, args.rows)
    g_eval = hidden.batch(10**9, 50_000)
    print(machine_header("Quantization accuracy: DLRM trained through quantized restores"))
    q = lambda bits, method="uniform", er=1: [{"pattern": "model.emb.*.weight", "method": method,  # noqa: E731
                                              "bits": bits, "greedy": True, "expected_restores": er}]
    runs = [("lossless", [], 0), ("lossless", [], 20), ("4-bit", q(4), 1), ("4-bit", q(4), 3), ("4-bit", q(4), 20)]
    if args.extra:
        runs += [("2-bit", q(2), 1), ("3-bit", q(3), 3), ("adaptive (2/3/4 bits)", q(4, "adaptive", 1), 1),
                 ("adaptive (2/3/4 bits)", q(4, "adaptive", 3), 3), ("adaptive (2/3/4 bits)", q(4, "adaptive", 20), 20)]
    res = []
    try:
        for label, rules, k in runs:
            d = root / f"run{len(res)}"
            shutil.rmtree(d, ignore_errors=True)
            r = train(args, hidden, g_eval, rules, k, d)
            shutil.rmtree(d, ignore_errors=True)
            res.append((label, k, r))
            print(f"  {label} k={k}: {r} (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base, r20 = res[0][2], res[4][2]
    heads = ["embeddings", "failures", "restores", "max rel L2 err restored", "eval loss", "loss +%", "AUC",
             "AUC -%", "run s"]
    rows = [[label, k, r["restores"], r["rel_err"], r["loss"], 100 * (r["loss"] / base["loss"] - 1), r["auc"],
             100 * (1 - r["auc"] / base["auc"]), r["seconds"]] for label, k, r in res]
    identical = res[1][2]["loss"] == base["loss"] and res[1][2]["auc"] == base["auc"]
    deg = max(r20["loss"] / base["loss"] - 1, 1 - r20["auc"] / base["auc"])
    minutes = (time.perf_counter() - t_start) / 60
    print(f"\n{args.steps} steps x {BATCH}, checkpoint every {args.every}, {args.tables} tables x {args.rows} rows "
          f"x {DIM}\n")
    print(table(heads, rows, 5))
    print("\n(loss +%: relative increase of eval loss vs lossless without failures; AUC -%: relative decrease;"
          " negative = better; rel L2 err: the largest error the manifests of the restored checkpoints record)")
    print(f"\n- lossless with 20 restores identical to no failures: {verdict(identical)}")
    print(f"- 4-bit, 20 restores: worst relative degradation {100 * deg:.4f}% (target < 0.1%): {verdict(deg < 1e-3)}")
    print(f"\nrun time {minutes:.1f} min; load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    keys = ["embeddings", "failures", "restores", "max_rel_l2_err", "eval_loss", "loss_pct", "auc", "auc_drop_pct",
            "seconds"]
    write_json(args.json, "quant_accuracy", args, {
        "runs": [dict(zip(keys, row)) for row in rows], "lossless_restores_identical": identical,
        "degradation_4bit_20": deg, "target_met": deg < 1e-3, "minutes": round(minutes, 2)}, started)


if __name__ == "__main__":
    main()
