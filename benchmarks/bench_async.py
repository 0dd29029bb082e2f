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
  ``async_save``; durable = ``future.result()``; also with ``cache_staged_state_dict=True``.

Peak extra host memory = VmHWM - VmRSS before the warm-up save (VmHWM reset through
``/proc/self/clear_refs``), over the warm-up and the 3 saves.

Part 2 (training slowdown): an MLP (``--train-mb`` MB of weights + Adam) trained ``--steps``
steps on random data, checkpointing every ``--every`` steps; loop seconds vs no checkpointing
(each peer in its own subprocess; the final drain until durable is reported apart).

Run: ``python -m benchmarks.bench_async [--size 1024] [--train-mb 128] [--steps 30] [--every 10] [--rounds 3]``
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

from benchmarks.common import (MB, ROOT, cached_state, floor_copy, fresh, gpt_state, machine_header, med,
                               peak_rss, reset_peak_rss, rss, state_bytes, table, tensors, timed, verdict,
                               workdir)

PEERS = ["floor", "checkrun", "checkrun-noinc", "torch.save", "lightning-async", "dcp-async", "dcp-async-cached"]
TRAIN_PEERS = ["none", "checkrun", "torch.save", "lightning-async", "dcp-async"]
# checkrun with less background CPU (--train-peers): one worker thread; no compression
TRAIN_VARIANTS = ["checkrun-w1", "checkrun-raw"]


class Saver:
    """One peer: ``save(state, path)`` returns when the caller may continue; ``wait()`` = durable."""

    def __init__(self, peer: str, root: Path, fsync: bool = True) -> None:
        self.peer, self.root, self.pending, self.bufs, self.fsync = peer, root, None, None, fsync
        if peer.startswith("checkrun"):
            import ckpt_core
            over = {"checkrun-noinc": {"incremental": {"enabled": False}},
                    "checkrun-w1": {"saving": {"workers": 1}, "storage": {"io_threads": 1}},
                    "checkrun-raw": {"compression": {"compress": False}}}.get(peer, {})
            self.engine = ckpt_core.CheckpointEngine(over)
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


def worker_stall(peer: str, size: float, root: Path) -> dict:
    state = cached_state(f"gpt_{int(size)}mb", lambda: gpt_state(size))
    bump(state)
    floor_bufs = floor_copy(state, None)  # the adjacent floor (allocated before the baseline)
    base = rss()
    reset_peak_rss()
    saver = Saver(peer, root)
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
            "floor": med(floor), "x_floor": med(b / f for b, f in zip(block, floor))}


def mlp(train_mb: float, width: int = 2048) -> nn.Module:
    layers = max(1, round(train_mb * MB / 12 / (width * width)))
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def worker_train(peer: str, train_mb: float, steps: int, every: int, root: Path) -> dict:
    model = mlp(train_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    width = model[0].in_features
    gen = torch.Generator().manual_seed(0)
    saver = None if peer == "none" else Saver(peer, root, fsync=False)  # torch.save: no fsync, as usual

    def step():
        x = torch.randn(32, width, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: Adam state exists
    if saver is not None:  # warm-up save (allocations), not timed
        saver.save({"model": model.state_dict(), "opt": opt.state_dict()}, 0)
        saver.wait()
    stalls = []
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if saver is not None and i % every == 0:
            if peer.startswith("dcp"):
                saver.wait()  # DCP: one async_save in flight (as its docs do)
            s0 = time.perf_counter()
            saver.save({"model": model.state_dict(), "opt": opt.state_dict()}, i)
            if peer == "torch.save":
                saver.wait()  # closes the file
            stalls.append(time.perf_counter() - s0)
    loop = time.perf_counter() - t0
    if saver is not None:
        saver.close()
    drain = time.perf_counter() - t0 - loop
    ru1 = resource.getrusage(resource.RUSAGE_SELF)  # all threads: training + background saving
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
    state = sum(t.nbytes for t in tensors({"m": model.state_dict(), "o": opt.state_dict()}))
    return {"loop": loop, "drain": drain, "stall": med(stalls), "state": state, "cpu": cpu}


def spawn(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_async", *args], cwd=ROOT,
                         capture_output=True, text=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"worker {args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def part_stall(args, root: Path) -> None:
    res = {}
    for peer in PEERS:
        d = fresh(root / peer)
        d.mkdir()
        res[peer] = spawn(["--worker", peer, "--size", str(args.size), "--dir", str(d)])
        shutil.rmtree(d, ignore_errors=True)
        print(f"  {peer}: {res[peer]} (load {os.getloadavg()[0]:.2f})", flush=True)
    ts, state = res["torch.save"]["block"], res["floor"]["state"]
    rows = [[p, r["block"], r["floor"], r["x_floor"], r["block"] / ts, r["durable"], r["peak"] / MB,
             r["peak"] / state] for p, r in res.items()]
    print(f"\nstate: {state / MB:.0f} MB fp32 (GPT-like + Adam); medians of 3 saves after 1 warm-up\n")
    print(table(["peer", "blocking s", "adjacent floor s", "x floor", "x torch.save", "durable s",
                 "peak extra MB", "peak x state"], rows))
    print("\n(x floor: median over the 3 saves of blocking / a floor copy timed just before it, same process)")
    c = res["checkrun"]
    peers_async = min(res["lightning-async"]["block"], res["dcp-async"]["block"], res["dcp-async-cached"]["block"])
    print(f"\n- blocking {c['x_floor']:.2f}x floor (target <= 1.3x): {verdict(c['x_floor'] <= 1.3)}")
    print(f"- blocking {c['block'] / ts:.3f}x torch.save (target <= 0.1x): {verdict(c['block'] <= 0.1 * ts)}")
    print(f"- below both async peers ({peers_async:.3f} s): {verdict(c['block'] < peers_async)}")
    print(f"- peak extra memory {c['peak'] / state:.2f}x state (target <= 1.1x): "
          f"{verdict(c['peak'] <= 1.1 * state)}")


def part_train(args, root: Path) -> None:
    """Rounds of all peers (each in its own subprocess): the slowdown is taken against the run
    without checkpointing of the same round, then the median over rounds."""
    peers = args.train_peers.split(",")
    res = {p: [] for p in peers}
    for rnd in range(args.rounds):
        for peer in peers:
            d = fresh(root / f"train-{peer}")
            d.mkdir()
            res[peer].append(spawn(["--worker-train", peer, "--train-mb", str(args.train_mb), "--steps",
                                    str(args.steps), "--every", str(args.every), "--dir", str(d)]))
            shutil.rmtree(d, ignore_errors=True)
        print(f"  round {rnd}: " + ", ".join(f"{p} {res[p][-1]['loop']:.2f} s" for p in peers)
              + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    base = res["none"]
    print(f"\nMLP state {base[0]['state'] / MB:.0f} MB (weights + Adam), {args.steps} steps, checkpoint every "
          f"{args.every} steps, {args.rounds} rounds\n")
    rows = [[p, med(r["loop"] for r in rs), med(r["loop"] / b["loop"] for r, b in zip(rs, base)),
             med(r["stall"] for r in rs), med(r["drain"] for r in rs), med(r["cpu"] for r in rs),
             med(r["cpu"] / b["cpu"] for r, b in zip(rs, base))] for p, rs in res.items()]
    print(table(["peer", "loop s (median)", "slowdown x (median of per-round ratios)",
                 "median stall per save s", "final drain s", "process CPU s (loop + drain)", "CPU x none"], rows))
    print("\n(process CPU = user + sys of all threads of the worker, from getrusage: the work a peer adds,"
          " which external load does not inflate the way it inflates wall time)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="state size in MB for the stall part")
    ap.add_argument("--train-mb", type=float, default=128, help="MLP weights + Adam state in MB")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="training part: rounds over all peers")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--part", choices=["stall", "train", "all"], default="all")
    ap.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-train", choices=TRAIN_PEERS + TRAIN_VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--train-peers", default=",".join(TRAIN_PEERS),
                    help=f"training part peers ('none' first); also {', '.join(TRAIN_VARIANTS)}")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker_stall(args.worker, args.size, Path(args.dir))))
        return
    if args.worker_train:
        print(json.dumps(worker_train(args.worker_train, args.train_mb, args.steps, args.every, Path(args.dir))))
        return
    root = workdir(args.dir)
    print(machine_header("Async: blocking time, peak memory, training slowdown"))
    try:
        if args.part in ("stall", "all"):
            part_stall(args, root)
        if args.part in ("train", "all"):
            part_train(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
