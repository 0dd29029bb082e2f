"""Stage: plan. What a save will write, decided before anything is encoded: frozen plain data.

Every quantization decision of a save is made here: which rule (``quant_rules``) a tensor falls
under and so which pipeline encodes it, whether a row stream writes a full base or a row delta
(``streams.plan_rows``), which small tensors share a pack, and how each tensor is cut into chunks.
``write`` executes a ``WritePlan`` (ordinary saves) or one ``TensorPlan`` at a time (DCP items) and
makes no decision of its own; when an outcome asks for another plan (a lossy codec refused a
tensor, the error of a delta chain is unknown, a reused blob is gone) it asks the ``Planner`` again.
Like torch DCP's planner/storage split: the planner says what, the writer does it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..codecs import Pipeline, lossless_pipeline, lossy_pipeline
from ..config import CompressionConfig, IncrementalConfig, QuantRule
from ..format.dtypes import row_shape
from ..format.manifest import ChunkRef, dtype_name
from .capture import StagedTensor
from .quant_rules import RuleMatcher, adaptive_bits
from .streams import RowPlan, RowStream, plan_rows


@dataclass(frozen=True)
class Span:
    """One chunk: ``rows`` x ``cols`` elements from element ``off`` of the flat source (the
    tensor, or the rows a delta gathers)."""

    off: int
    rows: int
    cols: int


@dataclass(frozen=True)
class PackSlot:
    """Where a packed tensor lives: bytes [start, start + its size) of pack ``pack``."""

    pack: int
    start: int


@dataclass(frozen=True)
class PackPlan:
    """Small lossless tensors (indices into the snapshot, in order) concatenated into one blob."""

    members: tuple[int, ...]
    pipeline: Pipeline
    size: int


@dataclass(frozen=True)
class TensorPlan:
    """How one tensor is written: its pipeline (and the rule that chose it), its chunks, and for
    a row stream the base/delta decision (``rows``; ``base``: the chunks a delta builds on)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pipeline: Pipeline
    rule: QuantRule | None
    spans: tuple[Span, ...] = ()
    rows: RowPlan | None = None
    base: tuple[ChunkRef, ...] = ()
    force: bool = False
    pack: PackSlot | None = None

    @property
    def lossy(self) -> bool:
        """Whether a rule made this tensor lossy (its record carries a quantization entry)."""
        return self.rule is not None and self.pipeline.lossy

    @property
    def delta(self) -> bool:
        """A row delta on top of ``base`` rather than a full record."""
        return self.rows is not None and not self.rows.full

    @property
    def prefix(self) -> str:
        """What content addresses of its chunks mix in besides the bytes (``write.blob_key``)."""
        return f"{self.pipeline.spec_id}|{dtype_name(self.dtype)}"

    @property
    def grid(self) -> tuple[int, int]:
        """The (rows, cols) the tensor is stored as."""
        return row_shape(tuple(self.shape))


@dataclass(frozen=True)
class WritePlan:
    """A whole snapshot: one plan per tensor (in snapshot order), and the packs."""

    tensors: tuple[TensorPlan, ...]
    packs: tuple[PackPlan, ...] = ()


def chunk_spans(rows: int, cols: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(element offset, rows, cols) pieces: whole rows when a row fits, else slices of one row."""
    if rows * cols == 0:
        return [(0, rows, cols)]
    row_bytes = cols * itemsize
    if row_bytes <= chunk_bytes:
        step = max(1, chunk_bytes // row_bytes)
        return [(r * cols, min(step, rows - r), cols) for r in range(0, rows, step)]
    step = max(1, chunk_bytes // itemsize)
    total = rows * cols
    return [(off, 1, min(step, total - off)) for off in range(0, total, step)]


def pipeline_for_rule(rule: QuantRule, dtype: torch.dtype, ndim: int,
                      compression: CompressionConfig) -> Pipeline:
    """The lossy pipeline of a matched quantization rule (``adaptive``: the bit width for its
    ``expected_restores``). ``ndim`` is the tensor's own rank (see ``codecs.lossy_pipeline``).
    ValueError for dtypes the lossy codecs do not take (``match_rule`` never selects those)."""
    method = rule.method
    bits = rule.bits
    if method == "adaptive":
        method, bits = "uniform", adaptive_bits(rule.expected_restores)
    return lossy_pipeline(method, dtype, ndim, compression, bits=bits, block_size=rule.block_size,
                          scale_dtype=rule.scale_dtype, greedy=rule.greedy)


class Planner:
    """Makes the plans of one engine's (or one DCP rank's) saves. Thread-safe (``RuleMatcher``)."""

    def __init__(self, matcher: RuleMatcher, compression: CompressionConfig,
                 incremental: IncrementalConfig | None = None) -> None:
        self.matcher, self.compression, self.incremental = matcher, compression, incremental

    def pipeline(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Pipeline, QuantRule | None]:
        """The pipeline of a tensor, and the rule that made it lossy (None: lossless)."""
        numel = 1
        for d in shape:
            numel *= d
        rule = self.matcher.choose(key, dtype, numel, len(shape)) if self.matcher.rules else None
        if rule is None:
            return lossless_pipeline(dtype, self.compression), None
        return pipeline_for_rule(rule, dtype, len(shape), self.compression), rule

    def tensor(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], *, rule_key: str | None = None,
               stream: RowStream | None = None, changed: torch.Tensor | None = None, force: bool = False,
               lossless: bool = False) -> TensorPlan:
        """The plan of one tensor. ``rule_key``: the key rules match (default ``key``); ``stream``,
        ``changed``: its row stream and the rows changed since its record (None: unknown);
        ``force``: a full base whose blobs are all written again; ``lossless``: ignore the rules
        (a lossy codec refused the tensor's values)."""
        if lossless:
            pipeline, rule = lossless_pipeline(dtype, self.compression), None
        else:
            pipeline, rule = self.pipeline(rule_key or key, dtype, shape)
        rows, cols = row_shape(tuple(shape))
        itemsize = dtype.itemsize
        rplan: RowPlan | None = None
        if stream is not None:
            assert self.incremental is not None, "row streams need an IncrementalConfig"
            rplan = plan_rows(stream, None if force else changed, self.incremental, pipeline.spec_id,
                              cols * itemsize)
        if rplan is not None and not rplan.full:
            n = int(rplan.rows.numel())
            spans = self._spans(n, cols, itemsize) if n else ()
            return TensorPlan(key, dtype, tuple(shape), pipeline, rule, spans, rplan,
                              tuple(stream.record.base), force)
        return TensorPlan(key, dtype, tuple(shape), pipeline, rule, self._spans(rows, cols, itemsize), rplan,
                          (), force)

    def staged(self, st: StagedTensor, force: bool = False, lossless: bool = False) -> TensorPlan:
        """``tensor`` for a tensor of a snapshot (one stored lossless for its tied keys counts as matched by the
        rules of its keys: their "matched no tensor" warning would send the user to a pattern that is right)."""
        for key in (st.key, *st.tied) if st.tied else ():
            self.matcher.choose(key, st.dtype, st.data.numel(), len(st.shape))
        return self.tensor(st.key, st.dtype, tuple(st.shape), stream=st.stream, changed=st.changed,
                           force=force, lossless=lossless or st.lossless)

    def snapshot(self, tensors: Sequence[StagedTensor]) -> WritePlan:
        """The plan of a whole snapshot: packs first (see ``_packs``), then every other tensor."""
        packs, packed = self._packs(tensors)
        return WritePlan(tuple(packed.get(i) or self.staged(st) for i, st in enumerate(tensors)), packs)

    def _spans(self, rows: int, cols: int, itemsize: int) -> tuple[Span, ...]:
        return tuple(Span(*s) for s in chunk_spans(rows, cols, itemsize, self.compression.chunk_bytes))

    def _packs(self, tensors: Sequence[StagedTensor]) -> tuple[tuple[PackPlan, ...], dict[int, TensorPlan]]:
        """Small lossless tensors without a row stream, grouped by pipeline and element size, are
        concatenated into packs of up to ``chunk_bytes``; each gets one chunk that is a part of
        its pack's blob (``ChunkRef.part``). A group of one stays a tensor of its own."""
        limit = min(self.compression.pack_bytes, self.compression.chunk_bytes)
        groups: dict[tuple[str, int], list[tuple[int, StagedTensor, Pipeline]]] = {}
        for i, st in enumerate(tensors):
            if st.stream is not None or not 0 < st.nbytes <= limit:
                continue
            pipeline, rule = self.pipeline(st.key, st.dtype, tuple(st.shape))
            if rule is None:
                groups.setdefault((pipeline.spec_id, st.data.element_size()), []).append((i, st, pipeline))
        packs: list[PackPlan] = []
        packed: dict[int, TensorPlan] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            bins: list[list[tuple[int, StagedTensor, Pipeline]]] = [[]]
            total = 0
            for m in members:
                if total + m[1].nbytes > self.compression.chunk_bytes and bins[-1]:
                    bins.append([])
                    total = 0
                bins[-1].append(m)
                total += m[1].nbytes
            for group in bins:
                start = 0
                for i, st, pipeline in group:
                    packed[i] = TensorPlan(st.key, st.dtype, tuple(st.shape), pipeline, None,
                                           pack=PackSlot(len(packs), start))
                    start += st.nbytes
                packs.append(PackPlan(tuple(i for i, _, _ in group), group[0][2], start))
        return tuple(packs), packed
