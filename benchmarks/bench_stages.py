"""CPU cost per MB of each stage of the lossless pipeline, on one thread (docs/performance.md).

Chunks: ``--chunks`` 16 MiB pieces of a trained GPT-like state (``benchmarks.common.gpt_state``,
weights + Adam moments), in fp32 and cast to bf16. Per stage, thread CPU seconds (``time.thread_time``,
so other load on the machine moves the figures less than wall time would), median of ``--reps``
repetitions that each run every stage once, divided by the chunk's MB:

* save: content hash (xxh3-128, the blob's address), the ``shuffle_zstd`` codec (byte-shuffle, then
  zstd on the planes that compress) and, within it, the byte-shuffle alone; checksum (xxh3-64 of
  the encoded blob);
* load: checksum, ``shuffle_zstd`` decoding into the destination and, within it, the unshuffle;
* the pipeline of earlier versions (``shuffle``, then one zstd frame per chunk with a content
  checksum), encode and decode, for comparison;
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
import zstandard

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cached_state, gpt_state, machine_header, table, tensors  # noqa: E402
from ckpt_core import EngineConfig  # noqa: E402
from ckpt_core.codecs.shuffle import ShuffleCodec, shuffle_into, unshuffle_into  # noqa: E402
from ckpt_core.codecs.shuffle_zstd import ShuffleZstdCodec  # noqa: E402
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

    codec = ShuffleZstdCodec(itemsize, level)
    mb = sum(c.nbytes for c in chunks) / 1e6
    blobs = [bytes(codec.encode(c)) for c in chunks]
    n = CHUNK // itemsize
    planes = [np.empty(n, np.uint8) for _ in range(itemsize)]
    dest, spare = np.empty(CHUNK, np.uint8), memoryview(np.empty(CHUNK, np.uint8))
    # The earlier default: shuffle, then one zstd frame with a content checksum.
    old_zstd = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        level, write_checksum=1, write_content_size=1, **({"hash_log": 10} if level <= 1 else {})))
    old_shuffle = ShuffleCodec(itemsize)
    old_blobs = [old_zstd.compress(old_shuffle.encode(c)) for c in chunks]
    scratch = np.empty(CHUNK, np.uint8)
    tensors_ = [torch.from_numpy(c) for c in chunks]

    def torch_save():
        for t in tensors_:
            torch.save(t, io.BytesIO())

    saved = []
    for t in tensors_:
        buf = io.BytesIO()
        torch.save(t, buf)
        saved.append(buf.getvalue())

    def old_decode():
        for b, c in zip(old_blobs, chunks):
            ZstdCodec().decode_into(b, memoryview(scratch)[:c.nbytes])
            old_shuffle.decode_into(memoryview(scratch)[:c.nbytes], memoryview(dest)[:c.nbytes])

    stages = {
        "save: content hash (xxh3-128)": lambda: [xxhash.xxh3_128_hexdigest(c) for c in chunks],
        f"save: shuffle_zstd, level {level}": lambda: [codec.encode(c) for c in chunks],
        "save:   of which byte-shuffle": lambda: [shuffle_into(c, planes) for c in chunks],
        "save: checksum (xxh3-64)": lambda: [xxhash.xxh3_64_hexdigest(b) for b in blobs],
        "load: checksum (xxh3-64)": lambda: [xxhash.xxh3_64_hexdigest(b) for b in blobs],
        "load: shuffle_zstd": lambda: [codec.decode_into(b, memoryview(dest)[:c.nbytes], lambda k: spare[:k])
                                       for b, c in zip(blobs, chunks)],
        "load:   of which unshuffle": lambda: [unshuffle_into(planes, dest) for _ in chunks],
        "earlier versions' save: shuffle + zstd": lambda: [old_zstd.compress(old_shuffle.encode(c)) for c in chunks],
        "earlier versions' load: zstd + unshuffle": old_decode,
        "torch.save to memory": torch_save,
        "torch.load from memory": lambda: [torch.load(io.BytesIO(b), weights_only=True) for b in saved],
    }
    # Repetitions interleave the stages, so a drift in the machine's speed moves them all alike.
    times: dict[str, list[float]] = {name: [] for name in stages}
    for _ in range(reps):
        for name, fn in stages.items():
            times[name].append(cpu(fn, 1))
    out = {name: statistics.median(ts) / mb for name, ts in times.items()}
    out["ratio"] = sum(len(b) for b in blobs) / sum(c.nbytes for c in chunks)
    out["old ratio"] = sum(len(b) for b in old_blobs) / sum(c.nbytes for c in chunks)
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
    names = [k for k in results["fp32"] if "ratio" not in k]
    rows = [[n, results["fp32"][n] * 1e3, results["bf16"][n] * 1e3] for n in names]
    rows.append(["stored / raw bytes (shuffle_zstd)", results["fp32"]["ratio"], results["bf16"]["ratio"]])
    rows.append(["stored / raw bytes (earlier versions)", results["fp32"]["old ratio"], results["bf16"]["old ratio"]])
    print(table(["stage", "fp32 ms CPU per MB", "bf16 ms CPU per MB"], rows))


if __name__ == "__main__":
    main()
