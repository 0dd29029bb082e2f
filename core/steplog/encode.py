"""Encoder thread: captured steps into the bytes of a segment (layout: format.py).

What matters for the cost is the GIL: the training thread gives it up at every torch op, and every
line of Python the encoder runs meanwhile is time the training thread may wait for it, as is every
return from a call that released it (measured on the DLRM benchmark: encoding ~30 small tensors
one by one cost the step about twice the encoder's own CPU). So the small tensors of a step (all
that ``capture`` packed) are not encoded one by one: each dtype's *pack* of the step is one chunk,
encoded whole, and each tensor's entry names its span (``{"pack": dtype, "at": element offset}``).
The chunks of a segment are listed per dtype in its header (``packs``); ``at`` counts along them.

A step's chunks take a few calls whatever its number of tensors: one byte-shuffle per pack, then
the byte planes of every pack compressed by one ``multi_compress_to_buffer`` call (one GIL
release), put together as ``shuffle_zstd`` blobs (a plane is stored as its frame where that is
smaller). A plane that stayed incompressible 3 steps in a row (a float gradient's low mantissa
bytes: 3 of a float32 pack's 4 planes) is stored raw without trying, and tried every 64th step
(``Pays``): zstd over them was half of the encoder's CPU on the DLRM benchmark. Other pipelines (compression off, 1-byte dtypes, zstd threads) go through
``Pipeline.encode``, as do tensors with a buffer of their own (large: few per step), each one
payload range (``[offset, length, codecs]``).

Work is spread evenly over the steps, not put off to the segment's end: one segment's worth of
compression at once (tens of MB) slowed the training steps it overlapped by up to 2x.
"""
from __future__ import annotations

import numpy as np
import torch
import zstandard

from ..codecs import Pipeline, RawCodec, index_pipeline, lossless_pipeline
from ..codecs.shuffle import shuffle_many
from ..codecs.shuffle_zstd import _RAW, _ZSTD, ShuffleZstdCodec, _varint
from ..codecs.zstd import _compressor
from ..config import CompressionConfig
from ..format.dtypes import dtype_name
from .capture import StepRecord

RAW_PIPELINE = Pipeline(RawCodec(), ())

Chunks = dict  # dtype name -> (numel, payload range): one step's pack chunks


class StepEncoder:
    """Turns ``StepRecord``s into gradient entries, pack chunks and payload parts (encoder thread only)."""

    def __init__(self, compression: CompressionConfig) -> None:
        self.compression = compression
        self.pays = Pays()
        self._pipes: dict[torch.dtype, tuple[Pipeline, list]] = {}
        self._index = index_pipeline()
        self._index_list = self._index.to_list()
        self._raw_list = RAW_PIPELINE.to_list()
        self._scratch = np.empty(0, np.uint8)  # the shuffled packs of the step being encoded, reused

    def encode(self, rec: StepRecord, parts: list[bytes], ranges: list[list]) -> tuple[list[dict], Chunks]:
        """The gradient entries of ``rec`` and its pack chunks. Encoded bytes are appended to
        ``parts`` and their ranges (offsets relative to the step's first part) to ``ranges``; a
        pack reference's ``at`` counts from the step's own chunk (``_Batch`` adds the segment's
        elements before it). The caller gives the step's staging back afterwards: nothing returned
        refers to it."""
        chunks = self._chunks(rec, parts, ranges)
        out = []
        for g in rec.grads:
            if g.kind == "none":
                out.append({"p": g.p, "k": "none"})
                continue
            name = dtype_name(g.dtype)
            entry = {"p": g.p, "k": g.kind, "dtype": name, "shape": list(g.shape)}
            if g.data is not None:
                compress = self.pays.compress(g.p)
                pipeline, spec = self._pipeline(g.dtype) if compress else (RAW_PIPELINE, self._raw_list)
                data = _encode(g.data, pipeline)
                if compress:
                    self.pays.record(g.p, len(data), g.data.numel() * g.dtype.itemsize)
                entry["data"] = _put(data, spec, parts, ranges)
            else:
                entry["data"] = {"pack": name, "at": g.data_at[0]}
            if g.kind != "dense":
                entry["idx"] = (_put(_encode(g.idx, self._index), self._index_list, parts, ranges) if g.idx is not None
                                else {"pack": "int64", "at": g.idx_at[0]})
                entry["n"] = g.n
            if g.kind == "sparse":
                entry["coalesced"] = g.coalesced
            if g.runs is not None or g.runs_at is not None:  # folded: ``u`` rows, each repeated by its run
                entry["u"] = g.u
                if g.runs is None:
                    entry["runs"] = {"pack": "int32", "at": g.runs_at[0]}
                else:
                    pipeline, spec = self._pipeline(torch.int32)
                    entry["runs"] = _put(_encode(g.runs, pipeline), spec, parts, ranges)
            out.append(entry)
        return out, chunks

    @staticmethod
    def buffers(rec: StepRecord) -> list[dict]:
        """The step's forward-pass state entries (dense, packed: ``capture_step``)."""
        return [{"p": b.p, "k": "dense", "dtype": dtype_name(b.dtype), "shape": list(b.shape),
                 "data": {"pack": dtype_name(b.dtype), "at": b.data_at[0]}} for b in rec.bufs]

    def _chunks(self, rec: StepRecord, parts: list[bytes], ranges: list[list]) -> Chunks:
        """Each non-empty pack of ``rec`` as one chunk; shuffle_zstd ones in one zstd call."""
        fast, out = [], {}
        for dtype, t in rec.packs.items():
            if not t.numel():
                continue
            key = ("pack", dtype)
            compress = self.pays.compress(key)
            pipeline, spec = self._pipeline(dtype) if compress else (RAW_PIPELINE, self._raw_list)
            codec = pipeline.stages[0] if len(pipeline.stages) == 1 else None
            if (isinstance(codec, ShuffleZstdCodec) and codec.itemsize == dtype.itemsize and not codec.threads
                    and pipeline.stages == (codec,)):
                fast.append((dtype, t, codec, spec))
                continue
            data = _encode(t, pipeline)
            if compress:
                self.pays.record(key, len(data), t.numel() * dtype.itemsize)
            out[dtype_name(dtype)] = (t.numel(), _put(data, spec, parts, ranges))
        if fast:
            for (dtype, t, _, spec), data in zip(fast, self._shuffle_zstd(fast)):
                self.pays.record(("pack", dtype), len(data), t.numel() * dtype.itemsize)
                out[dtype_name(dtype)] = (t.numel(), _put(data, spec, parts, ranges))
        return out

    def _shuffle_zstd(self, packs: list[tuple]) -> list[bytes]:
        """The ``shuffle_zstd`` blobs of whole-element packs: shuffled into the scratch buffer, all
        planes compressed by one call (the level of the first pack's codec: all come from one
        ``CompressionConfig``)."""
        need = sum(t.numel() * dtype.itemsize for dtype, t, _, _ in packs)
        if self._scratch.size < need:
            self._scratch = np.empty(need, np.uint8)
        planes, segs, keys, pos = [], [], [], 0
        for dtype, t, _, _ in packs:
            k, n = dtype.itemsize, t.numel()
            planes.append(list(self._scratch[pos:pos + k * n].reshape(k, n)))
            for i in range(k):  # a plane that did not compress lately (a float's low mantissa bytes) is not tried
                keys.append(("plane", dtype, i) if self.pays.compress(("plane", dtype, i)) else None)
                if keys[-1] is not None:
                    segs.append((pos + i * n, n))
            pos += k * n
        shuffle_many([(t.view(torch.uint8).numpy(), mine) for (_, t, _, _), mine in zip(packs, planes)])
        frames = (_compressor(packs[0][2].level, 0, True).multi_compress_to_buffer(
            zstandard.BufferWithSegments(self._scratch, np.array(segs, np.uint64).tobytes())) if segs else ())
        blobs, j, keys = [], 0, iter(keys)
        for mine in planes:
            stored = []
            for plane in mine:
                key = next(keys)
                if key is None:
                    stored.append((_RAW, plane))
                    continue
                frame = frames[j]
                j += 1
                self.pays.record(key, len(frame), plane.size)
                stored.append((_ZSTD, frame) if len(frame) < plane.size else (_RAW, plane))
            stored.append((_RAW, b""))  # whole elements: the tail is empty
            header = b"".join(_varint(2 * memoryview(s).nbytes + kind) for kind, s in stored)
            blobs.append(b"".join([header, *(s for _, s in stored)]))
        return blobs

    def _pipeline(self, dtype: torch.dtype) -> tuple[Pipeline, list]:
        if dtype not in self._pipes:
            pipe = lossless_pipeline(dtype, self.compression)
            self._pipes[dtype] = (pipe, pipe.to_list())
        return self._pipes[dtype]


def _encode(t: torch.Tensor, pipeline: Pipeline) -> bytes:
    flat = t.reshape(1, -1) if t.numel() else t.reshape(0, 1)
    data, _ = pipeline.encode(flat.contiguous())
    return bytes(data)


def _put(data: bytes, spec: list, parts: list[bytes], ranges: list[list]) -> list:
    r = [ranges[-1][0] + ranges[-1][1] if ranges else 0, len(data), spec]  # parts and ranges pair up
    parts.append(data)
    ranges.append(r)
    return r


class Pays:
    """Whether compressing a parameter's gradient (or a dtype's pack) pays (encoder thread). Dense
    gradients hardly compress (~1.0-1.1x, all mantissa), and shuffle + zstd of them costs more CPU
    than the log's copy: one that stayed above 90% of its size 3 times in a row is stored raw, and
    tried again every 64th time (DESIGN: compress where it pays)."""

    def __init__(self) -> None:
        self.misses: dict = {}
        self.seen: dict = {}

    def compress(self, key) -> bool:
        self.seen[key] = self.seen.get(key, 0) + 1
        return self.misses.get(key, 0) < 3 or self.seen[key] % 64 == 0

    def record(self, key, stored: int, raw: int) -> None:
        self.misses[key] = self.misses.get(key, 0) + 1 if stored > 0.9 * raw else 0
