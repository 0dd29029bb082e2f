"""Where users wait (issue 24): cold restore into live tensors and blocking per save, peers side by side.

One run, one process, three states of ``--size`` MB of fp32 (DLRM: 8 tables of dim 64 + row-wise
Adagrad + an MLP with Adam; dense: a GPT-like model + Adam; fine-tune: frozen 2048x2048 layers + rank-16
LoRA adapters with Adam) and five methods (``benchmarks.restore_methods``):

1. restore s (cold): each method saves the state once (checkrun: the second save of an engine, one
   training interval after its first, as the checkpoint a job restores usually is); then ``--reps`` rounds, each restoring with every
   method in turn (page cache dropped before each restore; live tensors zeroed, outside the clock, and
   checked equal to the saved state after the last round). checkrun restores with a fresh engine
   each time (a restarted job; the engine is built before the clock) and ``engine.load(path, into=)``
   where that exists, else load + ``copy_``.
   In every round the order of the methods rotates, and before each timed restore or save the
   previous method's garbage is collected and its dirty pages written back (``gc.collect()``,
   ``os.sync()``, outside the clock): DCP's saves leave a cyclic-GC pass to whatever allocates next,
   which otherwise added 6-9 ms to the save timed after DCP's.
2. blocking s per save (incremental on): a warm-up save per method, then ``--reps`` rounds of (one
   training interval, then a save by every method in turn, each durable before the next); blocking =
   until the call returns, durable = until committed / fsync'd.
3. chain: checkrun threads, DLRM, ``incremental.policy: consecutive``: 9 saves with an interval between
   them (a base + a chain of 8 deltas); cold restores of the last and of the base, alternating.
4. fresh: the DLRM checkpoint loaded by a new process per load (a restarted job), threads vs process
   mode in alternation, cold (the interpreter start and the torch import are outside the clock).

Run: ``python -m benchmarks.bench_restore [--size 256] [--reps 3] [--only restore,blocking,chain,fresh]
[--states dlrm,dense,ft] [--methods floor,torch,dcp,threads,process] [--dir DIR] [--json PATH]``.
Cells are median (min-max) of the reps; ratios are of medians.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (MB, drop_caches, floor_copy, loadavg, machine_header, machine_info, med, table,
                               tensors, timed, verdict, workdir, write_json)
from benchmarks.restore_methods import (CHECKRUN, METHODS, RESTORE_LABELS, SAVE_LABELS, STATE_LABELS, STATES, BenchState,
                                        Saver, build_state, engine_load_into, has_into, restorer)

SECTIONS = ("restore", "blocking", "chain", "fresh")
CHAIN = {"incremental": {"policy": "consecutive", "max_chain": 8}}
CHAIN_SAVES = 9  # a base and 8 consecutive deltas
REF_LABELS = {"dcp": "DCP", "floor": "floor"}


def cell(xs: list[float]) -> str:
    """median (min-max) of ``xs``; just the value for one rep; '-' for none."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return "-"
    return f"{med(xs):.3f}" if len(xs) == 1 else f"{med(xs):.3f} ({xs[0]:.3f}-{xs[-1]:.3f})"


def ratio(a: list[float], b: list[float]) -> float:
    return med(a) / med(b) if a and b and med(b) > 0 else float("nan")


def same_as(ref: list[torch.Tensor], payload: dict) -> bool:
    live = tensors(payload)
    return len(ref) == len(live) and all(torch.equal(a, b) for a, b in zip(ref, live))


def zero(payload: dict) -> None:
    with torch.no_grad():
        for t in tensors(payload):
            t.zero_()


def cold_restore(method: str, r, payload: dict, ref: list[torch.Tensor], ready: dict) -> float:
    """Seconds of one restore of ``r`` into ``payload`` (page cache dropped first), checked against ``ref``.
    checkrun: ``ready[method]`` gets the seconds until the next save's references were rebuilt too
    (in the background after the load returned, ``load.reference``; nothing else runs meanwhile)."""
    zero(payload)  # outside the clock: a restore that does not write the live tensors fails the check
    if method in ("threads", "process"):
        r.prepare()
    drop_caches()
    gc.collect()  # no garbage of the method before falls on this one (as in the blocking rounds)
    t, _ = timed(lambda: r.restore(payload))
    if method in ("threads", "process"):
        ready[method].append(t + timed(r.references_ready)[0])
        r.finish()
    assert same_as(ref, payload), f"{method}: the restored state differs from the saved one"
    return t


def rotated(methods: list[str], i: int) -> list[str]:
    """The methods in round ``i``'s order: rotated each round, so no method always follows the same one
    (a save's background effects, such as the kernel's write-back, fall on the next method timed)."""
    k = i % len(methods)
    return methods[k:] + methods[:k]


# -- 1. restore ---------------------------------------------------------------------------------
def restore_state(bs: BenchState, methods: list[str], reps: int, root: Path) -> dict:
    """{method: [seconds per rep]} for state ``bs``; every method's files exist at once (rounds)."""
    rs = {m: restorer(m, root) for m in methods}
    for m in methods:  # checkrun: a save, a training interval, then the restored save (see history)
        if hasattr(rs[m], "history"):
            rs[m].history(bs.payload)
    bs.change(0)
    ref = floor_copy(bs.payload, None)  # the saved values, to check each restore landed in place
    for m in methods:
        rs[m].save(bs.payload)
    out: dict = {m: [] for m in methods}
    ready: dict = {m: [] for m in methods}
    for i in range(reps):
        for m in rotated(methods, i):
            out[m].append(cold_restore(m, rs[m], bs.payload, ref, ready))
    out.update({f"{m}+ready": v for m, v in ready.items() if v})
    for p in root.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def print_restore(res: dict, states: list[str], methods: list[str], cold: bool) -> None:
    how = "cold" if cold else "warm (could not drop caches)"
    print(f"\n### restore s ({how}, into live tensors), median (min-max)\n")
    print(table(["method", *(STATE_LABELS[s] for s in states)],
                [[RESTORE_LABELS[m], *(cell(res[s][m]) for s in states)] for m in methods]))
    for m in methods:
        if any(f"{m}+ready" in res[s] for s in states):
            print(f"- {RESTORE_LABELS[m]}: the next save's references (rebuilt in the background after the load "
                  "returned, `load.reference`) ready after " +
                  ", ".join(f"{STATE_LABELS[s]} {cell(res[s].get(f'{m}+ready', []))} s" for s in states))
    refs = [b for b in ("dcp", "floor") if b in methods]
    if not refs:
        return
    print("\n### restore ratios (median / median)\n")
    heads = [f"{STATE_LABELS[s]} x {REF_LABELS[b]}" for b in refs for s in states]
    rows = [[RESTORE_LABELS[m], *(ratio(res[s][m], res[s][b]) for b in refs for s in states)]
            for m in methods if m not in refs]
    print(table(["method", *heads], rows, digits=2))


# -- 2. blocking --------------------------------------------------------------------------------
def blocking_state(bs: BenchState, methods: list[str], reps: int, root: Path) -> dict:
    """{method: {"blocking": [...], "durable": [...]}}: a warm-up save, then ``reps`` rounds."""
    savers = {m: Saver(m, root) for m in methods}
    out = {m: {"blocking": [], "durable": []} for m in methods}
    try:
        for m in methods:
            savers[m].timed_save(bs.payload, 0)
        for i in range(1, reps + 1):
            bs.change(i)
            for m in rotated(methods, i):
                os.sync()  # the previous method's dirty pages are written back before this save, not during it
                gc.collect()  # and its garbage collected: DCP's leaves a cyclic GC pass to whoever allocates next
                b, d = savers[m].timed_save(bs.payload, i)
                out[m]["blocking"].append(b)
                if m != "floor":  # a copy in memory is never durable: its column stays empty
                    out[m]["durable"].append(d)
    finally:
        for s in savers.values():
            s.close()
        for p in root.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def print_blocking(res: dict, states: list[str], methods: list[str]) -> None:
    for key in ("blocking", "durable"):
        print(f"\n### {key} s per save (incremental on), median (min-max)\n")
        print(table(["method", *(STATE_LABELS[s] for s in states)],
                    [[SAVE_LABELS[m], *(cell(res[s][m][key]) for s in states)] for m in methods]))
    refs = [b for b in ("floor", "dcp") if b in methods]
    if refs:
        print("\n### blocking ratios (median / median; targets: <= 1.3x floor and < 1x DCP)\n")
        heads = [f"{STATE_LABELS[s]} x {REF_LABELS[b]}" for b in refs for s in states]
        rows = [[SAVE_LABELS[m], *(ratio(res[s][m]["blocking"], res[s][b]["blocking"]) for b in refs
                                   for s in states)] for m in methods if m not in refs]
        print(table(["method", *heads], rows, digits=2))


# -- 3. chain -----------------------------------------------------------------------------------
def chain_restore(bs: BenchState, reps: int, root: Path) -> dict:
    """Cold restores of the base and of the end of a chain of 8 consecutive deltas (checkrun threads)."""
    import ckpt_core

    with ckpt_core.CheckpointEngine(CHAIN) as engine:
        infos = []
        for i in range(CHAIN_SAVES):
            if i:
                bs.change(100 + i)
            infos.append(engine.save(bs.payload, root / f"step={i}.ckpt").result())
    ref = floor_copy(bs.payload, None)
    last = root / f"step={CHAIN_SAVES - 1}.ckpt"
    out = {"depth": infos[-1].chain_depth, "written": [i.written_bytes for i in infos], "full": [], "chain": [],
           "read": {k: _blob_bytes(root / f"step={i}.ckpt") for k, i in (("full", 0), ("chain", CHAIN_SAVES - 1))},
           "raw_full": [], "raw_chain": []}
    files = {key: _blob_files(root, path) for key, path in (("full", root / "step=0.ckpt"), ("chain", last))}
    for _ in range(reps):
        for key, path in (("full", root / "step=0.ckpt"), ("chain", last)):
            zero(bs.payload)
            with ckpt_core.CheckpointEngine(CHAIN) as engine:
                drop_caches()
                out[key].append(timed(lambda: engine_load_into(engine, path, bs.payload))[0])
            drop_caches()
            out[f"raw_{key}"].append(timed(lambda: _read_all(files[key]))[0])
    assert same_as(ref, bs.payload), f"{last}: the chain restore differs from the state it saved"
    shutil.rmtree(root)
    return out


def _blob_bytes(path: Path) -> tuple[int, int]:
    """(base bytes, delta-link bytes) of the blobs a restore of ``path`` reads."""
    import ckpt_core

    with ckpt_core.CheckpointEngine() as engine:
        m = engine.read_manifest(path)
    sizes = {b.key: b.size for b in m.blobs()}  # each blob once (packs, deduplicated chunks)
    links = {k for r in m.tensors for d in r.deltas for k in (d.idx.key, *(c.blob.key for c in d.chunks))}
    link_bytes = sum(sizes[k] for k in links)
    return sum(sizes.values()) - link_bytes, link_bytes


def _blob_files(root: Path, path: Path) -> list[Path]:
    """The blob files a restore of ``path`` reads (each once), largest first."""
    import ckpt_core

    with ckpt_core.CheckpointEngine() as engine:
        m = engine.read_manifest(path)
    sizes = {b.key: b.size for b in m.blobs()}
    return [root / ".checkrun" / "blobs" / k[:2] / k[2:] for k in sorted(sizes, key=lambda k: -sizes[k])]


def _read_all(files: list[Path]) -> int:
    """Read every file whole on as many threads as checkrun's io threads: the raw-read floor."""
    from concurrent.futures import ThreadPoolExecutor

    import ckpt_core

    def read(p: Path) -> int:
        with open(p, "rb", buffering=0) as f:
            return len(f.read())
    with ThreadPoolExecutor(ckpt_core.EngineConfig().storage.io_threads) as pool:
        return sum(pool.map(read, files))


def print_chain(res: dict, dcp_full: list[float] | None, cold: bool) -> None:
    print(f"\n### DLRM restore at the end of a chain of {res['depth']} consecutive deltas (checkrun threads, "
          f"{'cold' if cold else 'warm (could not drop caches)'})\n")
    r = ratio(res["chain"], res["full"])
    rows = [["full (base)", cell(res["full"]), 1.0], ["end of chain", cell(res["chain"]), r]]
    heads = ["checkpoint", "restore s", "x full"]
    if dcp_full:
        heads.append("x DCP full")
        rows = [row + [ratio(res[k], dcp_full)] for row, k in zip(rows, ("full", "chain"))]
    print(table(heads, rows, digits=2))
    print(f"\n- chain restore {r:.2f}x the full restore (target <= 1.5x): {verdict(r <= 1.5)}")
    (fb, fl), (cb, cl) = res["read"]["full"], res["read"]["chain"]
    print(f"- blobs read: full {fb / MB:.1f} MB; end of chain {cb / MB:.1f} MB of bases + {cl / MB:.1f} MB of "
          f"delta links = {(cb + cl) / max(1, fb + fl):.2f}x the bytes (cold restores here are bound by bytes)")
    if res.get("raw_full") and res.get("raw_chain"):
        print(f"- raw reads of the same blob files ({'cold' if cold else 'warm'}, whole files on the io threads, "
              f"no decoding): full "
              f"{cell(res['raw_full'])} s, end of chain {cell(res['raw_chain'])} s: "
              f"{ratio(res['raw_chain'], res['raw_full']):.2f}x (the disk's floor for the ratio above)")


# -- 4. a restarted job ---------------------------------------------------------------------------
_CHILD = ("import json, sys, time, ckpt_core\n"
          "engine = ckpt_core.CheckpointEngine(json.loads(sys.argv[1]))\n"
          "t0 = time.perf_counter(); engine.load(sys.argv[2]); print(time.perf_counter() - t0)\n"
          "engine.close()\n")


def fresh_restore(bs: BenchState, reps: int, root: Path) -> dict:
    """{mode: [s]}: ``engine.load`` of the DLRM checkpoint in a new process per restore (a restarted job:
    one load, fresh memory; the interpreter and torch import are outside the clock), cold, threads vs
    process mode in alternation."""
    import json
    import subprocess

    import ckpt_core

    path = root / "step=0.ckpt"
    with ckpt_core.CheckpointEngine() as engine:
        engine.save(bs.payload, path).result()
    out: dict = {m: [] for m in ("threads", "process")}
    for i in range(reps):
        for m in rotated(list(out), i):
            drop_caches()
            done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CHECKRUN[m]), str(path)],
                                  capture_output=True, text=True, check=True)
            out[m].append(float(done.stdout.split()[-1]))
    shutil.rmtree(root)
    return out


def print_fresh(res: dict) -> None:
    print("\n### DLRM restore by a restarted job (a new process per load, `engine.load`, cold)\n")
    print(table(["mode", "restore s", "x threads"], [[m, cell(v), ratio(v, res["threads"])] for m, v in res.items()],
                digits=2))


# -- driver -------------------------------------------------------------------------------------
def pick(arg: str, allowed: tuple, what: str) -> list[str]:
    names = [n.strip() for n in arg.split(",") if n.strip()]
    bad = sorted(set(names) - set(allowed))
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (expected some of {', '.join(allowed)})")
    return [n for n in allowed if n in names]


def run(args: argparse.Namespace, root: Path) -> dict:
    sections, states = pick(args.only, SECTIONS, "section"), pick(args.states, STATES, "state")
    methods = pick(args.methods, METHODS, "method")
    cold, into = drop_caches(), has_into()
    print(f"checkrun restores with {'engine.load(path, into=live)' if into else 'engine.load(path) + copy_'}; "
          f"page cache {'dropped before each restore' if cold else 'NOT dropped (warm restores)'}\n")
    results: dict = {"cold": cold, "into": into, "restore": {}, "blocking": {}}
    for s in states if {"restore", "blocking"} & set(sections) else []:
        t0 = time.perf_counter()
        bs = build_state(s, args.size)
        nbytes = sum(t.nbytes for t in tensors(bs.payload))
        print(f"{STATE_LABELS[s]}: {nbytes / 2**20:.0f} MiB in {len(tensors(bs.payload))} tensors "
              f"(built in {time.perf_counter() - t0:.0f} s, load {loadavg()})", flush=True)
        if "restore" in sections:
            results["restore"][s] = restore_state(bs, methods, args.reps, root)
        if "blocking" in sections:
            results["blocking"][s] = blocking_state(bs, methods, args.reps, root)
        del bs
        gc.collect()
    if "restore" in sections:
        print_restore(results["restore"], states, methods, cold)
    if "blocking" in sections:
        print_blocking(results["blocking"], states, methods)
    if "chain" in sections:
        results["chain"] = chain_restore(build_state("dlrm", args.size), args.reps, root / "chain")
        print_chain(results["chain"], results["restore"].get("dlrm", {}).get("dcp"), cold)
    if "fresh" in sections:
        results["fresh"] = fresh_restore(build_state("dlrm", args.size), args.reps, root / "fresh")
        print_fresh(results["fresh"])
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=256, help="MB of fp32 in each state (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="timed restores / saves per cell (default 3)")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections: restore,blocking,chain,fresh")
    ap.add_argument("--states", default=",".join(STATES), help="states: dlrm,dense,ft")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods: floor,torch,dcp,threads,process")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under /tmp; removed)")
    ap.add_argument("--json", default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    started = machine_info()
    print(machine_header(f"Where users wait: restore and blocking, {args.size:g} MB states"))
    root = workdir(args.dir)
    try:
        results = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, "restore", args, results, started)
    print(f"\nload average at the end: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
