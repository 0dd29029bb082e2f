"""Encoder thread: a captured step's gradients into the bytes of a segment (layout: format.py).

Every logged tensor is one payload range, the bytes of its own lossless pipeline, as a reader
decodes it. What matters for the cost is the GIL: the training thread gives it up at every torch
op, and each time the encoder comes back from a call that released it (a zstd frame, a shuffle)
while training runs Python, one thread waits for the other and is woken again (measured on the
DLRM benchmark: ~64 zstd calls per step cost the step more than their CPU). So a step is
encoded with few such calls, whatever its number of tensors:

* tensors in a pack (``capture``) are byte-shuffled once per pack (shuffle_zstd) and every byte
  plane of every tensor is compressed by one ``multi_compress_to_buffer`` call (one GIL release);
  row indices (``index_pipeline``: shuffle, then one frame) likewise, with one more call;
* each blob is then put together as ``ShuffleZstdCodec.encode`` / ``index_pipeline`` would write it
  for the tensor alone, byte for byte (a plane is stored as a frame where that is smaller; planes
  of 256 KiB and more are probed first, as the codec does).

Other pipelines (compression off, 1-byte dtypes, zstd threads) and tensors with a buffer of their
own (large: few per step) go through ``Pipeline.encode``.
"""
from __future__ import annotations

from typing import Callable, Union

import numpy as np
import torch
import zstandard

from ..codecs import Pipeline, RawCodec, index_pipeline, lossless_pipeline
from ..codecs.shuffle import ShuffleCodec, shuffle_into
from ..codecs.shuffle_zstd import _PROBE_FROM, _RAW, _ZSTD, ShuffleZstdCodec, _varint
from ..codecs.zstd import ZstdCodec, _compressor
from ..config import CompressionConfig
from ..format.dtypes import dtype_name
from .capture import StepRecord

RAW_PIPELINE = Pipeline(RawCodec(), ())
Blob = Union[bytes, Callable[[], bytes]]  # ready, or put together once the step's frames exist


class _Frames:
    """Ranges of one buffer to compress with one zstd context in a single call (one GIL release)."""

    def __init__(self, cctx: zstandard.ZstdCompressor) -> None:
        self.cctx = cctx
        self.buf: np.ndarray | None = None
        self.segs: list[tuple[int, int]] = []
        self.out: list = []

    def add(self, buf: np.ndarray, off: int, n: int) -> int:
        assert self.buf is None or self.buf is buf  # one buffer per call
        self.buf = buf
        self.segs.append((off, n))
        return len(self.segs) - 1

    def run(self) -> None:
        if self.segs:
            segs = zstandard.BufferWithSegments(self.buf, np.array(self.segs, np.uint64).tobytes())
            result = self.cctx.multi_compress_to_buffer(segs)
            self.out = [result[i] for i in range(len(self.segs))]


class StepEncoder:
    """Turns ``StepRecord``s into gradient entries and payload parts (encoder thread only)."""

    def __init__(self, compression: CompressionConfig) -> None:
        self.compression = compression
        self.pays = Pays()
        self._pipes: dict[torch.dtype, tuple[Pipeline, list]] = {}
        self._index = index_pipeline()
        self._index_list = self._index.to_list()
        self._raw_list = RAW_PIPELINE.to_list()
        self._scratch = np.empty(0, np.uint8)  # shuffled packs of the step being encoded, reused
        self._idx_scratch = np.empty(0, np.uint8)  # row indices, shuffled tensor by tensor

    def encode(self, rec: StepRecord, parts: list[bytes], ranges: list[list]) -> list[dict]:
        """The gradient entries of ``rec``; their encoded bytes are appended to ``parts`` and
        their ranges (offsets relative to the step's first part) to ``ranges``. The caller gives
        the step's staging back afterwards: nothing returned refers to it."""
        self._begin(rec)
        out, blobs = [], []
        for g in rec.grads:
            if g.kind == "none":
                out.append({"p": g.p, "k": "none"})
                continue
            compress = self.pays.compress(g.p)
            pipeline, spec = self._pipeline(g.dtype) if compress else (RAW_PIPELINE, self._raw_list)
            entry = {"p": g.p, "k": g.kind, "dtype": dtype_name(g.dtype), "shape": list(g.shape)}
            raw = (g.data.numel() if g.data is not None else g.data_at[1]) * g.dtype.itemsize
            blob = self._blob(g.dtype, g.data, g.data_at, pipeline)
            blobs.append((entry, "data", spec, blob, g.p if compress else None, raw))
            if g.kind != "dense":
                blobs.append((entry, "idx", self._index_list, self._index_blob(g.idx, g.idx_at), None, 0))
                entry["n"] = g.n
            if g.kind == "sparse":
                entry["coalesced"] = g.coalesced
            out.append(entry)
        for frames in self._frames.values():
            frames.run()
        for entry, key, spec, blob, p, raw in blobs:
            data = blob if isinstance(blob, bytes) else blob()
            entry[key] = _put(data, spec, parts, ranges)
            if p is not None:
                self.pays.record(p, len(data), raw)
        self._arrays, self._planes, self._frames = {}, {}, {}
        return out

    def _begin(self, rec: StepRecord) -> None:
        need = sum(t.numel() * t.element_size() for t in rec.packs.values())
        if self._scratch.size < need:
            self._scratch = np.empty(need, np.uint8)
        # each pack as bytes, once: torch calls release the GIL, numpy slicing does not
        self._arrays = {d: _tensor_array(t) for d, t in rec.packs.items()}
        self._planes: dict[torch.dtype, list[np.ndarray]] = {}
        self._used = 0
        self._frames: dict[tuple, _Frames] = {}

    def _pipeline(self, dtype: torch.dtype) -> tuple[Pipeline, list]:
        if dtype not in self._pipes:
            pipe = lossless_pipeline(dtype, self.compression)
            self._pipes[dtype] = (pipe, pipe.to_list())
        return self._pipes[dtype]

    def _frames_for(self, key: tuple) -> _Frames:
        if key not in self._frames:
            self._frames[key] = _Frames(_compressor(key[1], 0, key[0] == "planes"))
        return self._frames[key]

    def _blob(self, dtype: torch.dtype, own: torch.Tensor | None, at: tuple[int, int] | None,
              pipeline: Pipeline) -> Blob:
        """The encoded bytes of one tensor (its own buffer, or ``at`` in ``dtype``'s pack)."""
        if own is not None:
            return _encode(own, pipeline)
        start, numel = at
        arr = self._arrays[dtype]
        k = dtype.itemsize
        stages = pipeline.stages
        if not stages:
            return arr[start * k:(start + numel) * k].tobytes()
        codec = stages[0]
        if (numel == 0 or len(stages) != 1 or not isinstance(codec, ShuffleZstdCodec) or codec.itemsize != k
                or codec.threads):
            return _encode(self._tensor(dtype, start, numel), pipeline)
        if dtype not in self._planes:
            planes = list(self._scratch[self._used:self._used + arr.size].reshape(k, arr.size // k))
            shuffle_into(arr, planes)
            self._planes[dtype], self._used = planes, self._used + arr.size
        frames = self._frames_for(("planes", codec.level))
        items = []
        for plane in self._planes[dtype]:
            part = plane[start:start + numel]
            if part.size >= _PROBE_FROM:  # the codec's own rule (a probe first): rare in a pack
                items.append((part, codec._compressed(part)))
            else:
                items.append((part, frames.add(self._scratch, _offset(part, self._scratch), part.size)))
        return lambda: _shuffle_zstd_blob(items, frames)

    def _index_blob(self, own: torch.Tensor | None, at: tuple[int, int] | None) -> Blob:
        """Row indices through ``index_pipeline`` (shuffle(8), then one zstd frame)."""
        shuffle, zstd = self._index.stages
        if own is not None or not at[1] or not isinstance(shuffle, ShuffleCodec) or not isinstance(zstd, ZstdCodec) \
                or zstd.threads or shuffle.itemsize != 8:
            return _encode(own if own is not None else self._tensor(torch.int64, *at), self._index)
        start, numel = at
        src = self._arrays[torch.int64][start * 8:(start + numel) * 8]
        if self._idx_scratch.size < self._arrays[torch.int64].size:
            self._idx_scratch = np.empty(self._arrays[torch.int64].size, np.uint8)
        dst = self._idx_scratch[start * 8:(start + numel) * 8]
        dst.reshape(8, numel)[:] = src.reshape(numel, 8).T  # shuffled: byte k of every index, k = 0..7
        frames = self._frames_for(("index", zstd.level))
        j = frames.add(self._idx_scratch, start * 8, numel * 8)
        return lambda: bytes(frames.out[j])

    def _tensor(self, dtype: torch.dtype, start: int, numel: int) -> torch.Tensor:
        k = dtype.itemsize
        if not numel:
            return torch.empty(0, dtype=dtype)
        return torch.from_numpy(self._arrays[dtype][start * k:(start + numel) * k].copy()).view(dtype)


def _shuffle_zstd_blob(items: list[tuple[np.ndarray, object]], frames: _Frames) -> bytes:
    """The ``shuffle_zstd`` blob of the whole elements whose byte planes are ``items``' parts:
    each plane as its frame where that is smaller, else raw; then the empty tail."""
    segments = []
    for part, frame in items:
        if isinstance(frame, int):
            frame = frames.out[frame]
            frame = frame if len(frame) < part.size else None
        segments.append((_RAW, part) if frame is None else (_ZSTD, frame))
    segments.append((_RAW, b""))
    header = b"".join(_varint(2 * memoryview(s).nbytes + kind) for kind, s in segments)
    return b"".join([header, *(s for _, s in segments)])


def _offset(view: np.ndarray, base: np.ndarray) -> int:
    return view.__array_interface__["data"][0] - base.__array_interface__["data"][0]


def _tensor_array(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)


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
    """Whether compressing a parameter's gradient pays (encoder thread). Dense gradients hardly
    compress (~1.0-1.1x, all mantissa), and shuffle + zstd of them costs more CPU than the log's
    copy: a gradient that stayed above 90% of its size 3 times in a row is stored raw, and tried
    again every 64th step (DESIGN: compress where it pays)."""

    def __init__(self) -> None:
        self.misses: dict[int, int] = {}
        self.seen: dict[int, int] = {}

    def compress(self, p: int) -> bool:
        self.seen[p] = self.seen.get(p, 0) + 1
        return self.misses.get(p, 0) < 3 or self.seen[p] % 64 == 0

    def record(self, p: int, stored: int, raw: int) -> None:
        self.misses[p] = self.misses.get(p, 0) + 1 if stored > 0.9 * raw else 0
