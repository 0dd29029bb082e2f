"""Per-step update log (issue 23): training overhead, bytes per step, recovery time.

Two real training loops, one torch thread (the other core is left to checkrun's background work,
as a GPU job leaves the host CPU), run side by side in one process:

* dlrm: 8 embedding tables with sparse gradients (``nn.Embedding(sparse=True)``; each step's ids
  touch <= 5% of the rows) + an MLP, one Adagrad optimizer, StepLR;
* gpt: the GPT-like dense model of ``benchmarks.common`` with Adam, StepLR.

For each: step time without any checkpointing and with ``engine.step_log`` (file://, defaults),
measured in alternating rounds (none, log, none, log, ...: both see the same machine). The step time
of a mode is the mean over every step of all its rounds (total time / steps: a segment write every
16 steps counts in full), with min-max of the rounds' means; the overhead is the ratio of those means
(on a shared 2-core VM single rounds move by more than the log costs: many short alternating rounds
average that out). Also stored bytes logged per step against a full checkpoint's stored bytes, and
recovery per round: load the checkpoint + ``replay`` of the logged steps, against re-running those
steps.

Run: ``python -m benchmarks.bench_steplog [--steps 24] [--rounds 10] [--table-mb 128] [--gpt-mb 48]
[--json PATH]``. The JSON's ``results`` hold one object per model with the keys model, step_ms,
step_log_ms (means over all steps), overhead_pct, bytes_per_step, checkpoint_bytes, touched_rows_pct,
replayed, load_s, replay_s, rerun_s (medians over the rounds) and ``<time>_min`` / ``<time>_max`` for
each of the five times (of the rounds).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import MB, gpt_model, machine_header, machine_info, table, write_json

BATCH, IDS_PER_TABLE, TABLES, DIM = 256, 8, 8, 32


class DLRM(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, DIM, sparse=True) for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(13, 256), nn.ReLU(), nn.Linear(256, DIM))
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        embs = [t(ids[:, i]).sum(1) for i, t in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *embs], 1))


def dlrm_setup(table_mb: float):
    torch.manual_seed(0)
    rows = int(table_mb * MB / 4 / DIM / TABLES)
    model = DLRM(rows)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.9)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        dense = torch.randn(BATCH, 13, generator=g)
        ids = torch.randint(0, rows, (BATCH, TABLES, IDS_PER_TABLE), generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(dense, ids), torch.randn(BATCH, 1, generator=g)).backward()
        opt.step()
        sched.step()

    touched = BATCH * IDS_PER_TABLE / rows
    return model, opt, sched, step, touched


def gpt_setup(state_mb: float):
    model = gpt_model(state_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.9)
    vocab = model.wte.num_embeddings

    def step(i: int) -> None:
        idx = torch.randint(vocab, (2, 65), generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        logits = model(idx[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        sched.step()

    return model, opt, sched, step, None


def _state(model, opt, sched) -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def _dir_bytes(path: Path, sub: str = "") -> int:
    base = path / sub if sub else path
    return sum(f.stat().st_size for f in base.rglob("*") if f.is_file())


def _spread(values: dict[str, list[float]]) -> dict:
    """Median of each time under its own key, min and max under ``<key>_min`` / ``<key>_max``."""
    out = {}
    for k, v in values.items():
        out.update({k: statistics.median(v), f"{k}_min": min(v), f"{k}_max": max(v)})
    return out


def measure(name: str, setup, size: float, steps: int, rounds: int, work: Path) -> dict:
    from ckpt_core import CheckpointEngine

    model, opt, sched, step, touched = setup(size)
    for i in range(3):  # warm-up: allocator, optimizer state
        step(i)
    times = {"none": [], "log": []}  # per round, the mean step time
    total = {"none": 0.0, "log": 0.0}
    logged = saved = 0
    firsts = []  # per round, the step before the logged ones (recovery re-runs from there)
    i = 100
    for r in range(rounds):
        for mode in ("none", "log"):
            d = work / f"{name}-{r}-{mode}"
            shutil.rmtree(d, ignore_errors=True)
            with CheckpointEngine() as engine:
                slog = None
                if mode == "log":  # the log first: the save marks its position in it
                    slog = engine.step_log(str(d), opt, sched)
                    engine.save(_state(model, opt, sched), f"{d}/base.ckpt").result()
                    saved = _dir_bytes(d) - _dir_bytes(d, ".checkrun/steplog")
                t0 = time.perf_counter()
                for _ in range(steps):
                    i += 1
                    step(i)
                took = time.perf_counter() - t0
                times[mode].append(took / steps)
                total[mode] += took
                if slog is not None:
                    slog.close()
                    logged = slog.bytes_logged / steps
                if mode == "log":
                    firsts.append(i - steps)
    recovery: dict[str, list] = {"load_s": [], "replay_s": [], "rerun_s": []}
    replayed = 0
    for r, first in enumerate(firsts):
        rec = _recovery(name, setup, size, work / f"{name}-{r}-log", first, steps)
        replayed = rec.pop("replayed")
        for k, v in rec.items():
            recovery[k].append(v)
    spread = _spread({"step_ms": [t * 1e3 for t in times["none"]], "step_log_ms": [t * 1e3 for t in times["log"]],
                      **recovery})
    spread["step_ms"], spread["step_log_ms"] = (1e3 * total[m] / (steps * rounds) for m in ("none", "log"))
    return {"model": name, **spread, "overhead_pct": 100 * (total["log"] / total["none"] - 1),
            "bytes_per_step": logged, "checkpoint_bytes": saved,
            "touched_rows_pct": None if touched is None else 100 * touched, "replayed": replayed}


def _recovery(name: str, setup, size: float, d: Path, first: int, steps: int) -> dict:
    """Load + replay of ``steps`` logged steps vs re-running them (fresh objects, same shapes)."""
    from ckpt_core import CheckpointEngine

    model, opt, sched, step, _ = setup(size)
    with CheckpointEngine() as engine:
        t0 = time.perf_counter()
        st = engine.load(f"{d}/base.ckpt")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        t_load = time.perf_counter() - t0
        n = engine.replay(str(d), opt, sched, after=f"{d}/base.ckpt")
        t_replay = time.perf_counter() - t0 - t_load
    t0 = time.perf_counter()
    for i in range(first + 1, first + 1 + steps):
        step(i)
    return {"replayed": n, "load_s": t_load, "replay_s": t_replay, "rerun_s": time.perf_counter() - t0}


def _mmm(r: dict, key: str) -> str:
    return f"{r[key + '_min']:.1f}-{r[key]:.1f}-{r[key + '_max']:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--table-mb", type=float, default=128.0)
    ap.add_argument("--gpt-mb", type=float, default=48.0)
    ap.add_argument("--workdir", default="/tmp/checkrun-bench-steplog")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    started = machine_info()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results = [measure("dlrm", dlrm_setup, args.table_mb, args.steps, args.rounds, work),
               measure("gpt", gpt_setup, args.gpt_mb, args.steps, args.rounds, work)]
    print(machine_header("step log: per-step overhead, bytes per step, recovery"))
    rows = [[r["model"], r["touched_rows_pct"] if r["touched_rows_pct"] is not None else "dense",
             _mmm(r, "step_ms"), _mmm(r, "step_log_ms"), f"{r['overhead_pct']:+.1f}%", r["bytes_per_step"] / MB,
             r["checkpoint_bytes"] / MB, f"{100 * r['bytes_per_step'] / r['checkpoint_bytes']:.1f}%",
             r["replayed"], r["load_s"] + r["replay_s"], r["rerun_s"]] for r in results]
    print(table(["model", "rows touched %", "step ms (min-mean-max)", "+log ms (min-mean-max)", "overhead",
                 "MB/step", "ckpt MB", "step/ckpt", "steps", "load+replay s", "re-run s"], rows))
    print("\nstep ms: min-max of the rounds' means and the mean over all steps; overhead: of those means; one torch "
          "thread, the other core left to the log's threads; load+replay and re-run: medians over the rounds")
    shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, "steplog", args, results, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
