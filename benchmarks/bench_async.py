"""Async (issue 3): how long a save blocks training, its peak extra host memory, and how much
checkpointing every N steps slows a CPU training loop - checkrun vs its peers.

Part 1 (stall): the GPT-like fp32 state of ``bench_format`` (``--size`` MB). Each peer runs in its
own subprocess (clean RSS accounting): load the state, warm-up save (allocations), then 3 timed
saves; before each, every floating tensor is changed in place (a dense training step), and the
previous save is waited for, so blocking is the snapshot alone (no backpressure).

* floor: copy every tensor into buffers allocated once and reused (what any snapshot must do);
* checkrun: ``engine.save`` return (defaults: async, max_pending=1, incremental on), and with
  ``incremental.enabled=False``; durable = ``handle.result()``;
* torch.save: the call (page cache); durable = + fsync;
* Lightning ``AsyncCheckpointIO(TorchCheckpointIO())``: ``save_checkpoint`` return; durable =
  ``teardown()`` (joins its thread; no fsync);
* DCP ``async_save`` (gloo group of 1 on 127.0.0.1, ``FileSystemWriter``, fsync on): return of
  ``async_save``; durable = ``future.result()``; also with one reused ``DefaultStager``;
* checkrun-quant: checkrun with the tied token embedding (``state_dict.wte.weight``) quantized to
  4 bits (uniform, row-wise; not greedy, to keep the background short);
* accelerate: ``Accelerator(cpu=True).save_state(dir)`` of the same model + Adam (prepared), which is
  synchronous (blocking = durable, page cache).

``--sizes`` runs the stall part at several state sizes (blocking time vs state size).

Peak extra host memory = VmHWM - VmRSS before the warm-up save (VmHWM reset through
``/proc/self/clear_refs``), over the warm-up and the 3 saves.

Part 2 (training slowdown): an MLP (``--train-mb`` MB of weights + Adam) trained ``--steps``
steps on random data, checkpointing every ``--every`` steps; loop seconds vs the same loop without
checkpoints run just before it in the same process (each peer in its own subprocess, ``--rounds``
pairs; the final drain until durable is reported apart).

Run: ``python -m benchmarks.bench_async [--size 1024 | --sizes 256,512,1024] [--train-mb 128] [--steps 30]
[--every 10] [--rounds 3] [--json PATH]`` (``--json``: raw per-save and per-round measurements).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import (GPT, MB, ROOT, cached_state, floor_copy, fresh, gpt_state, machine_header,
                               machine_info, med, peak_rss, reset_peak_rss, rss, state_bytes, table, tensors, timed,
                               verdict, workdir, write_json)

PEERS = ["floor", "checkrun", "checkrun-noinc", "checkrun-quant", "torch.save", "lightning-async", "dcp-async",
         "dcp-async-cached", "accelerate"]
QUANT = {"pattern": "state_dict.wte.weight", "method": "uniform", "bits": 4, "greedy": False}
TRAIN_PEERS = ["checkrun", "torch.save", "lightning-async", "dcp-async"]
# checkrun with less background CPU (--train-peers): one worker thread; no compression
TRAIN_VARIANTS = ["checkrun-w1", "checkrun-raw"]


class Saver:
    """One peer: ``save(state, path)`` returns when the caller may continue; ``wait()`` = durable."""

    def __init__(self, peer: str, root: Path, fsync: bool = True, objects: tuple = ()) -> None:
        self.peer, self.root, self.pending, self.bufs, self.fsync = peer, root, None, None, fsync
        if peer.startswith("checkrun"):
            import ckpt_core
            over = {"checkrun-noinc": {"incremental": {"enabled": False}},
                    "checkrun-quant": {"quantization": [QUANT]},
                    "checkrun-w1": {"saving": {"workers": 1}, "storage": {"io_threads": 1}},
                    "checkrun-raw": {"compression": {"compress": False}}}.get(peer, {})
            self.engine = ckpt_core.CheckpointEngine(over)
        elif peer == "accelerate":  # objects = (model, optimizer), prepared here
            from accelerate import Accelerator
            self.acc = Accelerator(cpu=True)
            self.acc.prepare(*objects)
        elif peer == "lightning-async":
            from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
            self.io = AsyncCheckpointIO(TorchCheckpointIO())
        elif peer.startswith("dcp"):
            import torch.distributed as dist
            if not dist.is_initialized():
                store = dist.FileStore(str(root / "pg_store"), 1)
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def save(self, state, i: int) -> None:
        p = self.peer
        if p == "floor":
            self.bufs = floor_copy(state, self.bufs)
        elif p.startswith("checkrun"):
            self.pending = self.engine.save(state, self.root / "ckr" / f"step={i}.ckpt")
        elif p == "torch.save":  # the call blocks; durable after fsync (in wait)
            self.pending = open(fresh(self.root / f"t{i % 2}.pt"), "wb")
            torch.save(state, self.pending)
            self.pending.flush()
        elif p == "lightning-async":
            self.io.save_checkpoint(state, str(self.root / f"l{i % 2}.ckpt"))
        elif p == "accelerate":  # synchronous: model, optimizer, RNG states into a folder
            self.acc.save_state(str(fresh(self.root / f"acc{i % 2}")))
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter
            path = fresh(self.root / f"dcp{i % 2}")
            stager = None
            if p == "dcp-async-cached":  # one stager reused: it keeps its staging buffers
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
                if self.bufs is None:  # CPU only: no pinned/shared memory, no CUDA streams
                    self.bufs = DefaultStager(StagingOptions(False, False, False, False))
                stager = self.bufs
            self.pending = dcp.async_save(state, checkpoint_id=str(path), storage_writer=FileSystemWriter(str(path)),
                                          async_stager=stager)

    def wait(self) -> None:
        p = self.peer
        if p.startswith("checkrun") and self.pending is not None:
            self.pending.result()
        elif p == "lightning-async":
            self.io.teardown()
        elif p.startswith("dcp") and self.pending is not None:
            self.pending.result()
        elif p == "torch.save" and self.pending is not None:
            if self.fsync:
                os.fsync(self.pending.fileno())
            self.pending.close()
        self.pending = None

    def close(self) -> None:
        self.wait()
        if self.peer.startswith("checkrun"):
            self.engine.close()
        elif self.peer == "dcp-async-cached" and self.bufs is not None:
            self.bufs.close()


def bump(state) -> None:
    with torch.no_grad():
        for t in tensors(state):
            if t.is_floating_point():
                t.add_(1e-6)


def accelerate_objects(state: dict) -> tuple:
    """The live model + Adam behind ``state`` (accelerate saves objects, not a dict), and a dict whose
    tensors are theirs (so ``bump`` changes what accelerate saves)."""
    sd = state["state_dict"]  # the shape of the cached state (it may predate a change of gpt_model)
    vocab, d = sd["wte.weight"].shape
    layers = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    torch.manual_seed(0)
    model = GPT(vocab, d, layers)
    model.load_state_dict(sd)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt.load_state_dict(state["optimizer_states"][0])
    return (model, opt), {"model": model.state_dict(), "opt": opt.state_dict()}


def worker_stall(peer: str, size: float, root: Path) -> dict:
    state = cached_state(f"gpt_{int(size)}mb", lambda: gpt_state(size))
    objects: tuple = ()
    if peer == "accelerate":
        objects, state = accelerate_objects(state)
    bump(state)
    floor_bufs = floor_copy(state, None)  # the adjacent floor (allocated before the baseline)
    base = rss()
    reset_peak_rss()
    saver = Saver(peer, root, objects=objects)
    saver.save(state, 0)
    saver.wait()
    block, durable, floor = [], [], []
    for i in range(1, 4):
        bump(state)
        floor.append(timed(lambda: floor_copy(state, floor_bufs))[0])
        t0 = time.perf_counter()
        saver.save(state, i)
        block.append(time.perf_counter() - t0)
        saver.wait()
        durable.append(time.perf_counter() - t0)
    peak = peak_rss() - base
    saver.close()
    return {"block": med(block), "durable": med(durable), "peak": peak, "state": state_bytes(state),
            "floor": med(floor), "x_floor": med(b / f for b, f in zip(block, floor)),
            "raw": {"block": block, "durable": durable, "floor": floor}}


def worker_sizes(peer: str, sizes: list, root: Path) -> None:
    """One peer at every size in one process (process start-up is most of a small run's time), smallest
    first; peak memory is reset per size. Prints one JSON line per size as it finishes (a crash loses
    only the sizes not done); a size that fails is recorded and the next still runs."""
    import gc
    import traceback

    for size in sorted(sizes):
        d = root / f"{size:g}"
        d.mkdir(parents=True, exist_ok=True)
        try:
            r = worker_stall(peer, size, d)
        except Exception:  # noqa: BLE001 - reported in the results, the other sizes go on
            r = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps({"size": str(size), "result": r}), flush=True)
        gc.collect()


def mlp(train_mb: float, width: int = 2048) -> nn.Module:
    layers = max(1, round(train_mb * MB / 12 / (width * width)))
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def worker_train(peer: str, train_mb: float, steps: int, every: int, rounds: int, root: Path) -> list:
    """``rounds`` x (a loop without checkpoints, then the same loop checkpointing through ``peer``) in one
    process: each ratio compares two loops seconds apart (external load drifts less than between
    processes) and process start-up is paid once. Per round: both loop times, the per-save stalls, the
    final drain until durable and the process CPU seconds of each loop (+ drain)."""
    model = mlp(train_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    width = model[0].in_features
    gen = torch.Generator().manual_seed(0)
    saver = Saver(peer, root, fsync=False)  # torch.save: no fsync, as usual

    def step():
        x = torch.randn(32, width, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)  # all threads: training + background saving
        return ru.ru_utime + ru.ru_stime

    def loop(saving: bool, first: int) -> dict:
        stalls, c0, t0 = [], cpu(), time.perf_counter()
        for i in range(first, first + steps):
            step()
            if saving and (i + 1) % every == 0:
                if peer.startswith("dcp"):
                    saver.wait()  # DCP: one async_save in flight (as its docs do)
                s0 = time.perf_counter()
                saver.save({"model": model.state_dict(), "opt": opt.state_dict()}, i + 1)
                if peer == "torch.save":
                    saver.wait()  # closes the file
                stalls.append(time.perf_counter() - s0)
        seconds = time.perf_counter() - t0
        saver.wait()
        return {"loop": seconds, "drain": time.perf_counter() - t0 - seconds, "stalls": stalls, "cpu": cpu() - c0}

    step()  # warm-up: Adam state exists
    saver.save({"model": model.state_dict(), "opt": opt.state_dict()}, 0)  # warm-up save (allocations)
    saver.wait()
    out = []
    for r in range(rounds):
        base = loop(False, 2 * r * steps)
        run = loop(True, (2 * r + 1) * steps)
        out.append({**run, "stall": med(run["stalls"]), "base_loop": base["loop"], "base_cpu": base["cpu"]})
    saver.close()
    state = sum(t.nbytes for t in tensors({"m": model.state_dict(), "o": opt.state_dict()}))
    return [{**r, "state": state} for r in out]


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_async", *args], cwd=ROOT,
                         capture_output=True, text=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"worker {args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def stall_sizes(sizes: list, peers: list, root: Path) -> dict:
    """{size: {peer: result}}: each peer in its own subprocess (all sizes); a failing peer is recorded
    as ``{"error": ...}`` and the others still run."""
    out: dict = {str(size): {} for size in sizes}
    for peer in peers:
        d = fresh(root / peer)
        d.mkdir()
        cmd = [sys.executable, "-m", "benchmarks.bench_async", "--worker", peer, "--sizes",
               ",".join(map(str, sizes)), "--dir", str(d)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        got = {}
        for line in proc.stdout.splitlines():
            if line.startswith('{"size"'):
                item = json.loads(line)
                got[item["size"]] = item["result"]
        shutil.rmtree(d, ignore_errors=True)
        lost = {"error": f"worker exited with {proc.returncode} before this size:\n{proc.stderr[-3000:]}"}
        for size in sizes:
            out[str(size)][peer] = r = got.get(str(size), lost)
            shown = {k: v for k, v in r.items() if k != "raw"}
            print(f"  {size:g} MB {peer}: {shown} (load {os.getloadavg()[0]:.2f})", flush=True)
    return out


def part_stall(args, root: Path) -> dict:
    sizes = sorted(float(x) for x in args.sizes.split(",")) if args.sizes else [args.size]
    peers = args.peers.split(",")
    out = stall_sizes(sizes, peers, root)
    for size in sizes:
        res = out[str(size)]
        ok = {p: r for p, r in res.items() if "error" not in r}
        for p in sorted(set(res) - set(ok)):
            print(f"\n{p} FAILED at {size:g} MB:\n{res[p]['error']}")
        if "torch.save" not in ok or "checkrun" not in ok:
            continue
        ts, state = ok["torch.save"]["block"], ok["checkrun"]["state"]
        rows = [[p, r["block"], r["floor"], r["x_floor"], r["block"] / ts, r["durable"], r["peak"] / MB,
                 r["peak"] / state] for p, r in ok.items()]
        print(f"\nstate: {state / MB:.0f} MB fp32 (GPT-like + Adam); medians of 3 saves after 1 warm-up\n")
        print(table(["peer", "blocking s", "adjacent floor s", "x floor", "x torch.save", "durable s",
                     "peak extra MB", "peak x state"], rows))
        print("\n(x floor: median over the 3 saves of blocking / a floor copy timed just before it, same process)")
        c = ok["checkrun"]
        peers_async = min(ok[p]["block"] for p in ("lightning-async", "dcp-async", "dcp-async-cached") if p in ok)
        print(f"\n- blocking {c['x_floor']:.2f}x floor (target <= 1.3x): {verdict(c['x_floor'] <= 1.3)}")
        print(f"- blocking {c['block'] / ts:.3f}x torch.save (target <= 0.1x): {verdict(c['block'] <= 0.1 * ts)}")
        print(f"- below both async peers ({peers_async:.3f} s): {verdict(c['block'] < peers_async)}")
        print(f"- peak extra memory {c['peak'] / state:.2f}x state (target <= 1.1x): "
              f"{verdict(c['peak'] <= 1.1 * state)}")
    return out


def part_train(args, root: Path) -> dict:
    """Each peer in its own subprocess, ``--rounds`` rounds of (no checkpoints, checkpoints) loops; the
    slowdown is each round's ratio, then the median (and min-max) over rounds."""
    out = {}
    for peer in [p for p in args.train_peers.split(",") if p != "none"]:
        d = fresh(root / f"train-{peer}")
        d.mkdir()
        try:
            out[peer] = spawn(["--worker-train", peer, "--train-mb", str(args.train_mb), "--steps", str(args.steps),
                               "--every", str(args.every), "--rounds", str(args.rounds), "--dir", str(d)])["rounds"]
        except RuntimeError as e:  # recorded; the other peers still run
            out[peer] = [{"error": str(e)[-3000:]}]
        shutil.rmtree(d, ignore_errors=True)
        print(f"  {peer}: " + ", ".join(f"{r.get('loop', float('nan')):.2f} s vs {r.get('base_loop', float('nan')):.2f} s"
                                       for r in out[peer]) + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    ok = {p: rs for p, rs in out.items() if all("error" not in r for r in rs)}
    for p in sorted(set(out) - set(ok)):
        print(f"\n{p} FAILED: {out[p][0]['error']}")
    if not ok:
        return out
    state = next(iter(ok.values()))[0]["state"]
    print(f"\nMLP state {state / MB:.0f} MB (weights + Adam), {args.steps} steps, checkpoint every "
          f"{args.every} steps, {args.rounds} rounds\n")
    rows = [[p, med(r["base_loop"] for r in rs), med(r["loop"] for r in rs), med(r["loop"] / r["base_loop"] for r in rs),
             med(s for r in rs for s in r["stalls"]), med(r["drain"] for r in rs),
             med(r["cpu"] / r["base_cpu"] for r in rs)] for p, rs in ok.items()]
    print(table(["peer", "loop without checkpoints s", "loop s", "slowdown x (median of per-round ratios)",
                 "median stall per save s", "final drain s", "CPU x without"], rows))
    print("\n(process CPU = user + sys of all threads of the worker, from getrusage: the work a peer adds,"
          " which external load does not inflate the way it inflates wall time)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="state size in MB for the stall part")
    ap.add_argument("--sizes", default=None, help="comma-separated state sizes in MB (overrides --size)")
    ap.add_argument("--peers", default=",".join(PEERS), help="stall part peers")
    ap.add_argument("--json", default=None, help="write the raw measurements here")
    ap.add_argument("--train-mb", type=float, default=128, help="MLP weights + Adam state in MB")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="training part: rounds per peer")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--part", choices=["stall", "train", "all"], default="all")
    ap.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-train", choices=TRAIN_PEERS + TRAIN_VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--train-peers", default=",".join(TRAIN_PEERS),
                    help=f"training part peers; also {', '.join(TRAIN_VARIANTS)}")
    args = ap.parse_args(argv)
    if args.worker and args.sizes:
        worker_sizes(args.worker, [float(x) for x in args.sizes.split(",")], Path(args.dir))
        return
    if args.worker:
        print(json.dumps(worker_stall(args.worker, args.size, Path(args.dir))))
        return
    if args.worker_train:
        print(json.dumps({"rounds": worker_train(args.worker_train, args.train_mb, args.steps, args.every, args.rounds,
                                                 Path(args.dir))}))
        return
    root = workdir(args.dir)
    started = machine_info()
    print(machine_header("Async: blocking time, peak memory, training slowdown"))
    results = {}
    try:
        if args.part in ("stall", "all"):
            results["stall"] = part_stall(args, root)
            write_json(args.json, "async", args, results, started)  # kept if the training part fails
        if args.part in ("train", "all"):
            results["train"] = part_train(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, "async", args, results, started)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
