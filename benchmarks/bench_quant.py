"""Quantization size (issue 5): bytes of 4-bit row-wise quantized DLRM checkpoints vs torch.save.

State and update pattern: ``bench_incremental``'s DLRM (``--size`` MB of fp32 embedding tables,
dim 64, row-wise Adagrad, MLP + Adam; ``--frac`` of the rows change per interval). The embedding
weights match ``QuantRule(pattern="model.emb.*.weight", method="uniform", bits=4, greedy=True)``
(Check-N-Run: quantize the embedding tables); everything else (Adagrad state, MLP, Adam) stays
lossless. ``--saves`` checkpoints per run, first full; policies ``intermittent`` (default) and
``consecutive``, ``max_chain=8``. A lossless run with the same pattern is the in-run reference.
Also reported: seconds to write the full quantized base (greedy search cost) and the relative L2
error the manifest records.

The background encoder runs torch ops with torch's intra-op threads; on two busy cores that made
4-bit greedy encoding 5-10x slower than with one thread (the probe table below measures it), so
this benchmark sets ``torch.set_num_threads(--threads)`` (default 1) to finish in minutes. Bytes
do not depend on it.

Run: ``python -m benchmarks.bench_quant [--size 1024] [--saves 5] [--bits 4] [--no-greedy] [--threads 1]
[--json PATH]`` (``--json``: raw per-save measurements).
"""
from __future__ import annotations

import argparse
import os
import shutil

from benchmarks.common import (MB, dlrm_interval, dlrm_payload, dlrm_state, engine_config, fresh,
                               machine_header, machine_info, med, table, torch_save_file, verdict, workdir,
                               write_json)

PATTERN = "model.emb.*.weight"


def run(cfg, args, root) -> list:
    import ckpt_core

    st = dlrm_state(args.size)
    infos = []
    with ckpt_core.CheckpointEngine(cfg) as engine:
        for i in range(args.saves):
            if i:
                dlrm_interval(st, args.frac, seed=i)
            infos.append(engine.save(dlrm_payload(st), root / f"step={i}.ckpt").result())
        rel = [r.quant["rel_l2_error"] for r in engine.read_manifest(root / "step=0.ckpt").tensors if r.quant]
    return infos, (max(rel) if rel else 0.0)


def encode_probe(bits: int, greedy: bool) -> list:
    """MB/s of the uniform codec on one 16 MB chunk of a table (64-wide rows), per torch thread count."""
    import time

    import torch

    from ckpt_core.codecs.uniform import UniformCodec

    x = torch.randn(65536, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    saved, rows = torch.get_num_threads(), []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for g in sorted({False, greedy}):
            codec, ts = UniformCodec(bits=bits, greedy=g), []
            for _ in range(3):
                t0 = time.perf_counter()
                codec.encode(x)
                ts.append(time.perf_counter() - t0)
            rows.append([threads, g, x.nbytes / MB / med(ts)])
    torch.set_num_threads(saved)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1024, help="DLRM embedding tables in MB")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--frac", type=float, default=0.05)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--no-greedy", action="store_true")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the docstring)")
    ap.add_argument("--json", default=None, help="write the raw measurements here")
    args = ap.parse_args(argv)
    root = workdir(args.dir)
    started = machine_info()
    print(machine_header(f"Quantization size: {args.bits}-bit rows vs torch.save"))
    probe = encode_probe(args.bits, not args.no_greedy)
    print(table(["torch threads", "greedy", "encode MB/s (16 MB chunk, median of 3)"], probe))
    results = {"probe": probe, "runs": []}
    import torch
    torch.set_num_threads(args.threads)
    print(f"\nbenchmark runs with torch.set_num_threads({args.threads})\n", flush=True)
    try:
        st = dlrm_state(args.size)
        sizes, calls = [], []
        for _ in range(3):
            p = fresh(root / "torch.pt")
            calls.append(torch_save_file(dlrm_payload(st), p)[1])
            sizes.append(p.stat().st_size)
            p.unlink()
        del st
        tb = med(sizes)
        results["torch"] = {"bytes": sizes, "durable": calls}
        print(f"torch.save: {tb / MB:.0f} MB, durable in {med(calls):.2f} s (load {os.getloadavg()[0]:.2f})\n",
              flush=True)
        rule = {"pattern": PATTERN, "method": "uniform", "bits": args.bits, "greedy": not args.no_greedy}
        runs = [("lossless", "intermittent", []), (f"{args.bits}-bit", "intermittent", [rule]),
                (f"{args.bits}-bit", "consecutive", [rule])]
        rows, summary = [], []
        for label, policy, rules in runs:
            cfg = engine_config(**{"incremental.policy": policy, "incremental.max_chain": 8,
                                   "quantization": rules})
            d = fresh(root / f"{label}-{policy}")
            infos, rel = run(cfg, args, d)
            shutil.rmtree(d)
            results["runs"].append({"config": label, "policy": policy, "rel_l2_error": rel, "saves": [
                {"written": i.written_bytes, "blocking": i.blocking_seconds, "total": i.total_seconds,
                 "chain": i.chain_depth} for i in infos]})
            for i, inf in enumerate(infos):
                rows.append([label, policy, i, inf.chain_depth, inf.written_bytes / MB, tb / inf.written_bytes,
                             inf.blocking_seconds, inf.total_seconds])
            inc = [inf.written_bytes for inf in infos[1:]]
            summary.append([label, policy, tb / infos[0].written_bytes, tb / med(inc), tb / max(inc),
                            infos[0].total_seconds, rel])
            print(f"  {label} {policy} done (load {os.getloadavg()[0]:.2f})", flush=True)
        print(table(["config", "policy", "save", "chain", "written MB", "torch / written", "blocking s",
                     "save to durable s"], rows))
        print()
        print(table(["config", "policy", "full: x smaller", "incremental (median): x less",
                     "incremental (worst): x less", "full save s", "max rel L2 err (tables)"], summary))
        q = summary[1:]
        print(f"\n- full checkpoint {q[0][2]:.1f}x smaller than torch.save (target >= 6x): {verdict(q[0][2] >= 6)}")
        for s in q:
            print(f"- {s[1]}: incremental writes {s[3]:.1f}x less than torch.save (median; worst {s[4]:.1f}x) "
                  f"(target >= 17x): {verdict(s[3] >= 17)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, "quant", args, results, started)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
