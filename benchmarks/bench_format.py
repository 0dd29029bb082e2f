"""Format (issue 2): bytes, durable save time and load time of a full checkpoint vs torch.save.

State: a GPT-2-like model (tied embeddings, N(0, 0.02) init) after 2 real Adam steps on random
tokens - weights + exp_avg + exp_avg_sq, ``--size`` MB in fp32 - and the same state cast to bf16.

* torch: ``torch.save`` into a file, then flush + fsync (durable, for fairness); ``torch.load``
  (weights_only=True).
* checkrun: a fresh directory per save, ``incremental.enabled=False`` (every save is a full one),
  otherwise the defaults; save seconds = ``engine.save(...).result()`` (committed, fsync'd);
  load = ``ckpt_core.load`` (checksums verified) with the same config. One warm-up save first.
* the two alternate: repetition r of torch, then repetition r of checkrun; "x torch" columns are
  medians of the per-repetition ratios (a machine whose disk or CPU speed drifts during the run
  moves both sides of each ratio); seconds columns are medians.
* cold loads drop the page cache before each load (``/proc/sys/vm/drop_caches``, root only;
  the table says when that was impossible and loads were warm).

Run: ``python -m benchmarks.bench_format [--size 1024] [--variants] [--json PATH]`` (``--json``: raw per-save
and per-load measurements).
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import time

import torch

from benchmarks.common import (MB, cached_state, cast_state, drop_caches, engine_config, fresh, gpt_state,
                               machine_header, machine_info, med, state_bytes, table, tensors, timed,
                               torch_save_file, verdict, workdir, write_json)

TARGET_BYTES = {"fp32": 0.87, "bf16": 0.72}
TARGET_LOAD = 1.5
VARIANTS = [
    {},
    {"compression.zstd_level": 3},
    {"compression.chunk_bytes": 4 << 20},
    {"compression.chunk_bytes": 64 << 20},
    {"storage.io_threads": 2},
    {"saving.workers": 4, "storage.io_threads": 8},
    {"compression.shuffle": False},
    {"compression.compress": False},
]


def same(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb))


def load_times(load, cold: bool) -> tuple[float, float, object]:
    """(cold seconds, warm seconds, loaded state); cold = after dropping the page cache."""
    dropped = drop_caches() if cold else False
    t_cold, out = timed(load)
    del out
    t_warm, out = timed(load)
    return (t_cold if dropped else float("nan")), t_warm, out


def torch_rep(state, root, res: dict, cold: bool) -> None:
    """One torch.save + fsync and its cold and warm torch.load, appended to ``res``."""
    path = fresh(root / "torch.pt")
    call, durable = torch_save_file(state, path)
    res["call"].append(call)
    res["save"].append(durable)
    res["bytes"].append(path.stat().st_size)
    c, w, out = load_times(lambda: torch.load(path, weights_only=True), cold)
    res["cold"].append(c)
    res["warm"].append(w)
    del out
    path.unlink()


_REP_NUMBERS = itertools.count()


def checkrun_rep(engine, cfg, state, root, res: dict, cold: bool, check: bool) -> None:
    """One full checkrun save (committed) and its cold and warm load, appended to ``res``."""
    import ckpt_core

    # A new directory per repetition, all deleted at the end: the engine remembers what it wrote
    # where, and on ext4 without a journal (the development VM) creating files right after many
    # deletions nearby is slow (see bench_lightning.fit_once).
    d = fresh(root / f"ckr-{next(_REP_NUMBERS)}")
    t0 = time.perf_counter()
    info = engine.save(state, d / "x.ckpt").result()
    res["save"].append(time.perf_counter() - t0)
    res["block"].append(info.blocking_seconds)
    res["bytes"].append(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))
    c, w, out = load_times(lambda: ckpt_core.load(d / "x.ckpt", config=cfg), cold)
    res["cold"].append(c)
    res["warm"].append(w)
    if check and not same(state, out):
        raise AssertionError("checkrun did not restore the state bit-identically")
    del out


def bench_pair(state, root, reps: int, cold: bool, overrides: dict, check: bool) -> tuple[dict, dict]:
    """torch and checkrun measured in alternation (rep r of each back to back), so that a change of
    the machine's speed during the run moves both sides of a ratio; (torch, checkrun) results."""
    import ckpt_core

    cfg = engine_config(**{"incremental.enabled": False, **overrides})
    t = {"bytes": [], "call": [], "save": [], "cold": [], "warm": []}
    c = {"bytes": [], "block": [], "save": [], "cold": [], "warm": []}
    torch_save_file(state, fresh(root / "warm.pt"))  # warm-ups: allocator, file system, staging buffers
    (root / "warm.pt").unlink()
    with ckpt_core.CheckpointEngine(cfg) as engine:
        engine.save(state, fresh(root / "warm") / "x.ckpt").result()
        shutil.rmtree(root / "warm")
        for r in range(reps):
            torch_rep(state, root, t, cold)
            checkrun_rep(engine, cfg, state, root, c, cold, check and r == 0)
    return ({**{k: med(v) for k, v in t.items()}, "raw": t}, {**{k: med(v) for k, v in c.items()}, "raw": c})


def paired(c: dict, t: dict, key: str) -> float:
    """Median over repetitions of checkrun / torch for ``key`` (NaN when nothing was measured)."""
    ratios = [a / b for a, b in zip(c["raw"][key], t["raw"][key]) if b == b and a == a and b > 0]
    return med(ratios) if ratios else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="fp32 state size in MB (default 1024)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache before loads")
    ap.add_argument("--variants", action="store_true", help="also try config variations")
    ap.add_argument("--json", default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    root = workdir(args.dir)
    started, results = machine_info(), {"cold": None, "paired": True, "dtypes": {}}
    cold = not args.warm
    states = {"fp32": cached_state(f"gpt_{int(args.size)}mb", lambda: gpt_state(args.size))}
    states["bf16"] = cast_state(states["fp32"], torch.bfloat16)
    print(machine_header("Format: full checkpoint vs torch.save"))
    if cold and not drop_caches():
        print("page cache cannot be dropped here: 'cold' loads are warm\n")
        cold = False
    rows, misses = [], []
    try:
        for name, st in states.items():
            t, c = bench_pair(st, root, args.reps, cold, {}, check=True)
            size = state_bytes(st)
            results["dtypes"][name] = {"state_bytes": size, "torch": t["raw"], "checkrun": c["raw"]}
            rows.append([name, "torch.save/load", size / MB, t["bytes"] / MB, 1.0, t["call"], t["save"], 1.0,
                         t["cold"], t["warm"], 1.0, 1.0])
            rb, rs = c["bytes"] / t["bytes"], paired(c, t, "save")
            rc, rw = paired(c, t, "cold"), paired(c, t, "warm")
            rows.append([name, "checkrun", size / MB, c["bytes"] / MB, rb, c["block"], c["save"], rs,
                         c["cold"], c["warm"], rc, rw])
            misses += [f"{name} bytes {rb:.3f}x torch.save (target <= {TARGET_BYTES[name]}x): "
                       f"{verdict(rb <= TARGET_BYTES[name])}",
                       f"{name} load {rc if cold else rw:.2f}x torch.load ({'cold' if cold else 'warm'}, "
                       f"target <= {TARGET_LOAD}x): {verdict((rc if cold else rw) <= TARGET_LOAD)}"]
            print(f"  {name} done, load average {__import__('os').getloadavg()[0]:.2f}", flush=True)
        print(table(["dtype", "writer", "state MB", "stored MB", "bytes x torch", "blocking s",
                     "durable save s", "save x torch", "cold load s", "warm load s", "cold x torch",
                     "warm x torch"], rows))
        print("\n(torch blocking s = the torch.save call into the page cache; durable = + fsync)\n")
        print("\n".join(f"- {m}" for m in misses))
        results["cold"] = cold
        write_json(args.json, "format", args, results, started)
        if args.variants:
            variants(states, root, args.reps, cold)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())}")


def variants(states: dict, root, reps: int, cold: bool) -> None:
    print("\n### Config variations (checkrun, incremental off; ratios vs torch in the same run)\n")
    rows = []
    for name, st in states.items():
        for ov in VARIANTS:
            t, c = bench_pair(st, root, reps, cold, ov, check=False)
            label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in ov.items()) or "defaults"
            rows.append([name, label, c["bytes"] / t["bytes"], c["save"], paired(c, t, "save"),
                         paired(c, t, "cold") if cold else float("nan"), paired(c, t, "warm")])
            print(f"  {name} {label} done", flush=True)
    print(table(["dtype", "config", "bytes x torch", "durable save s", "save x torch", "cold load x torch",
                 "warm load x torch"], rows))


if __name__ == "__main__":
    main()
