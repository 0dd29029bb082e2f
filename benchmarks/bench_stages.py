"""CPU cost per MB of each stage of the lossless pipeline, on one thread (docs/performance.md).

Chunks: ``--chunks`` 16 MiB pieces of a trained GPT-like state (``benchmarks.common.gpt_state``,
weights + Adam moments), in fp32 and cast to bf16. Per stage, thread CPU seconds (``time.thread_time``,
so other load on the machine moves the figures less than wall time would), median of ``--reps``,
divided by the chunk's MB:

* save: content hash (xxh3-128, the blob's address), byte-shuffle, zstd (the configured level),
  checksum (xxh3-64 of the encoded blob);
* load: checksum, zstd, unshuffle (into the destination);
* the same bytes through ``torch.save`` / ``torch.load`` into / from memory, for scale.

Run: ``python -m benchmarks.bench_stages [--chunks 4] [--reps 5] [--size 256] [--level N]``.
"""
from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cached_state, gpt_state, machine_header, table, tensors  # noqa: E402
from ckpt_core import EngineConfig  # noqa: E402
from ckpt_core.codecs.shuffle import ShuffleCodec  # noqa: E402
from ckpt_core.codecs.zstd import ZstdCodec  # noqa: E402

CHUNK = 16 << 20


def cpu(fn, reps: int) -> float:
    """Median thread CPU seconds of ``fn()``."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def chunks_of(flat: torch.Tensor, n: int) -> list[np.ndarray]:
    """``n`` 16 MiB byte views spread over ``flat``."""
    per = CHUNK // flat.element_size()
    starts = np.linspace(0, flat.numel() - per, n).astype(int)
    return [flat[s:s + per].contiguous().view(torch.uint8).numpy() for s in starts]


def stage_costs(chunks: list[np.ndarray], itemsize: int, level: int, reps: int) -> dict[str, float]:
    """CPU seconds per MB of each stage, summed over ``chunks``."""
    import xxhash

    shuffle, zstd = ShuffleCodec(itemsize), ZstdCodec(level=level)
    mb = sum(c.nbytes for c in chunks) / 1e6
    shuffled = [np.frombuffer(shuffle.encode(c), np.uint8) for c in chunks]
    blobs = [zstd.encode(s) for s in shuffled]
    scratch, dest = np.empty(CHUNK, np.uint8), np.empty(CHUNK, np.uint8)
    tensors_ = [torch.from_numpy(c) for c in chunks]

    def torch_save():
        for t in tensors_:
            torch.save(t, io.BytesIO())

    saved = []
    for t in tensors_:
        buf = io.BytesIO()
        torch.save(t, buf)
        saved.append(buf.getvalue())

    stages = {
        "save: content hash (xxh3-128)": lambda: [xxhash.xxh3_128_hexdigest(c) for c in chunks],
        "save: byte-shuffle": lambda: [shuffle.encode(c) for c in chunks],
        f"save: zstd level {level}": lambda: [zstd.encode(s) for s in shuffled],
        "save: checksum (xxh3-64)": lambda: [xxhash.xxh3_64_hexdigest(b) for b in blobs],
        "load: checksum (xxh3-64)": lambda: [xxhash.xxh3_64_hexdigest(b) for b in blobs],
        f"load: zstd": lambda: [zstd.decode_into(b, memoryview(scratch)[:c.nbytes]) for b, c in zip(blobs, chunks)],
        "load: unshuffle": lambda: [shuffle.decode_into(s, memoryview(dest)[:s.nbytes]) for s in shuffled],
        "torch.save to memory": torch_save,
        "torch.load from memory": lambda: [torch.load(io.BytesIO(b), weights_only=True) for b in saved],
    }
    out = {name: cpu(fn, reps) / mb for name, fn in stages.items()}
    out["ratio"] = sum(len(b) for b in blobs) / sum(c.nbytes for c in chunks)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size", type=float, default=256, help="fp32 state size in MB to take chunks from")
    ap.add_argument("--level", type=int, default=None, help="zstd level (default: the engine's default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    level = EngineConfig().compression.zstd_level if args.level is None else args.level
    state = cached_state(f"gpt_{int(args.size)}mb", lambda: gpt_state(args.size))
    flat = torch.cat([t.reshape(-1) for t in tensors(state) if t.dtype == torch.float32])
    print(machine_header("CPU cost per MB of each pipeline stage (one thread)"))
    results = {"fp32": stage_costs(chunks_of(flat, args.chunks), 4, level, args.reps),
               "bf16": stage_costs(chunks_of(flat.to(torch.bfloat16), args.chunks), 2, level, args.reps)}
    names = [k for k in results["fp32"] if k != "ratio"]
    rows = [[n, results["fp32"][n] * 1e3, results["bf16"][n] * 1e3] for n in names]
    rows.append(["stored / raw bytes (shuffle + zstd)", results["fp32"]["ratio"], results["bf16"]["ratio"]])
    print(table(["stage", "fp32 ms CPU per MB", "bf16 ms CPU per MB"], rows))


if __name__ == "__main__":
    main()
