"""torch.distributed.checkpoint writers side by side: DCP's FileSystemWriter vs checkrun's, 1 and 2 ranks.

Real processes (gloo on 127.0.0.1). The state, ``--state-mb`` of fp32 in total, is sharded over the ranks
as DTensors (Shard(0)): an embedding table (50%), dense weights (25%) and their Adam moments (25%),
values ~N(0, 0.02) like trained weights. Per writer, in its own directory, with fsync on both sides:

* ``save 1``: ``dcp.save`` of the full state;
* ``save 2``: after a fine-tuning step that changes the dense weights and moments but not the frozen
  embedding table (checkrun writes only chunks whose content changed; FileSystemWriter rewrites all);
* ``async 1``, ``async 2``: ``dcp.async_save`` after further steps (returns after the CPU staging copy;
  checkrun's writer keeps its staging buffers from the first to the second, ``cache_staged_state_dict``).

checkrun runs twice: with its default codecs (byte-shuffle + zstd-1) and with ``compress=False``
(still content-addressed, checksummed and incremental), since on a fast local disk and a slow CPU
compressing can cost more time than the bytes it saves.

Columns: blocking = how long ``save``/``async_save`` kept the calling (training) thread, slowest rank;
durable = until the checkpoint is committed; written = bytes the save added to the directory (all
ranks, the metadata/manifest included). Run:
``python benchmarks/bench_dcp.py [--state-mb 256] [--ranks 1 2] [--repeats 3] [--dir DIR] [--json PATH]``: each
writer's sequence of 4 saves runs ``--repeats`` times (fresh directories); the table shows medians (min-max).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

if __package__ in (None, ""):  # `python benchmarks/bench_dcp.py`: make `benchmarks` importable
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import machine_info, write_json  # noqa: E402
from ckpt_core.dcp import CheckrunSavePlanner, CheckrunStorageWriter  # noqa: E402

COLS = 1024
_RAW = {"compression": {"compress": False}}  # content addressing, checksums, incremental; no zstd


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def make_state(state_mb: int, mesh) -> dict:
    rows = max(2, state_mb * 2**20 // 4 // COLS // 4 // 2 * 2)  # 4 parts of equal size
    g = torch.Generator().manual_seed(0)

    def part(n_rows: int) -> torch.Tensor:
        return distribute_tensor(torch.randn(n_rows, COLS, generator=g) * 0.02, mesh, [Shard(0)])

    return {"model": {"emb.weight": part(2 * rows), "dense.weight": part(rows)},
            "optim": {"dense.weight.exp_avg": part(rows)}, "step": 1}


def fine_tune_step(state: dict) -> None:
    state["model"]["dense.weight"].to_local().add_(1e-3)
    state["optim"]["dense.weight.exp_avg"].to_local().mul_(0.9)
    state["step"] += 1


def writers():
    """(name, writer factory, planner class, checkpoint suffix). One writer per run, reused for every save
    (DCP resets it with each checkpoint_id). FileSystemWriter's cached staging pins memory and fails on
    CPU-only machines, so it stages into fresh buffers; checkrun's reuses its buffers."""
    yield "DCP FileSystemWriter", lambda: dcp.FileSystemWriter("unused", sync_files=True), None, ""
    yield ("checkrun CheckrunStorageWriter", lambda: CheckrunStorageWriter(cache_staged_state_dict=True),
           CheckrunSavePlanner, ".dcp")
    yield ("checkrun, compress=False", lambda: CheckrunStorageWriter(config=_RAW, cache_staged_state_dict=True),
           CheckrunSavePlanner, ".dcp")


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_writer(make_writer, planner_cls, suffix: str, root: Path, state_mb: int) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = make_state(state_mb, mesh)
    writer = make_writer()
    out = {}
    root.mkdir(parents=True, exist_ok=True)
    for label in ("save 1", "save 2", "async 1", "async 2"):
        if label != "save 1":
            fine_tune_step(state)
        path = str(root / label.replace(" ", "")) + suffix
        planner = planner_cls() if planner_cls else None
        before = dir_bytes(root)
        if label.startswith("save"):
            dt = timed(lambda: dcp.save(state, checkpoint_id=path, storage_writer=writer, planner=planner))
            blocking = durable = dt
        else:
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=path, storage_writer=writer, planner=planner)
            blocking = time.perf_counter() - t0
            fut.result()
            durable = time.perf_counter() - t0
        dist.barrier()
        out[label] = {"blocking": blocking, "durable": durable, "written": dir_bytes(root) - before}
    return out


def worker(rank: int, world: int, port: int, root: str, state_mb: int, out_dir: str, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=10))
    results: dict = {}
    for rep in range(repeats):
        for w, (name, make_writer, planner_cls, suffix) in enumerate(writers()):
            d = Path(root) / f"{w}-{rep}"
            results.setdefault(name, []).append(run_writer(make_writer, planner_cls, suffix, d, state_mb))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(world: int, state_mb: int, base: Path, repeats: int) -> dict:
    """{writer: {save label: {"blocking": [per repeat], "durable": [...], "written": [...]}}}; blocking and
    durable are the slowest rank's, written is the whole directory's (all ranks)."""
    root = base / f"ranks{world}"
    shutil.rmtree(root, ignore_errors=True)
    with tempfile.TemporaryDirectory() as out_dir:
        tmp.start_processes(worker, args=(world, free_port(), str(root), state_mb, out_dir, repeats), nprocs=world,
                            start_method="spawn")
        ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    merged: dict = {}
    for name, reps in ranks[0].items():
        merged[name] = {label: {"blocking": [max(r[name][i][label]["blocking"] for r in ranks)
                                             for i in range(len(reps))],
                                "durable": [max(r[name][i][label]["durable"] for r in ranks) for i in range(len(reps))],
                                "written": [reps[i][label]["written"] for i in range(len(reps))]}
                        for label in reps[0]}
    shutil.rmtree(root, ignore_errors=True)
    return merged


def spread(xs: list, digits: int = 2) -> str:
    xs = sorted(xs)
    mid = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return f"{mid:.{digits}f}" if len(xs) == 1 else f"{mid:.{digits}f} ({xs[0]:.{digits}f}-{xs[-1]:.{digits}f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=int, default=256)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each writer's sequence of saves")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the raw measurements here")
    args = parser.parse_args(argv)
    started = machine_info()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_dcp_"))
    print(f"state {args.state_mb} MiB fp32, sharded over the ranks; torch {torch.__version__}; {os.cpu_count()} CPUs; "
          f"medians (min-max) of {args.repeats} runs")
    print("| ranks | writer | save | blocking s | durable s | written MB | MB/s (state/median durable) |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for world in args.ranks:
        results[str(world)] = bench(world, args.state_mb, base, args.repeats)
        for name, rows in results[str(world)].items():
            for label, r in rows.items():
                rate = args.state_mb * 2**20 / 1e6 / sorted(r["durable"])[len(r["durable"]) // 2]
                print(f"| {world} | {name} | {label} | {spread(r['blocking'])} | {spread(r['durable'])} | "
                      f"{spread([w / 1e6 for w in r['written']], 1)} | {rate:.0f} |")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    write_json(args.json, "dcp", args, results, started)


if __name__ == "__main__":
    main()
