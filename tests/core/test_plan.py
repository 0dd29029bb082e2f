"""The save plan (``saving.plan``): frozen plain data, the same decisions as before, one writer
for ordinary and DCP saves."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.codecs import lossless_pipeline
from ckpt_core.config import CompressionConfig, IncrementalConfig, QuantRule
from ckpt_core.format.manifest import BlobRef, ChunkRef, TensorRecord
from ckpt_core.saving.capture import StagedTensor
from ckpt_core.saving.plan import Planner, Span, WritePlan, chunk_spans, pipeline_for_rule
from ckpt_core.saving.quant_rules import RuleMatcher
from ckpt_core.saving.streams import RowStream, plan_rows

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

COMP = CompressionConfig(chunk_bytes=4096, pack_bytes=1024)
RULE = QuantRule("emb.*", method="uniform", bits=4, min_numel=16)


def _planner(*rules: QuantRule) -> Planner:
    return Planner(RuleMatcher(rules), COMP, IncrementalConfig())


def _staged(key: str, t: torch.Tensor, stream: RowStream | None = None,
            changed: torch.Tensor | None = None) -> StagedTensor:
    return StagedTensor(key, tuple(t.shape), t.reshape(-1).clone(), "cpu", stream, changed)


def _stream(t: torch.Tensor, spec_id: str) -> RowStream:
    """A row stream whose last committed record is a full base of ``t``."""
    base = (ChunkRef(0, t.shape[0], t.shape[1], BlobRef("a" * 32, 10, "0" * 16)),)
    record = TensorRecord("emb.w", "float32", tuple(t.shape), (), base)
    return RowStream(t.reshape(-1).clone(), t.dtype, tuple(t.shape), spec_id=spec_id, valid=True, record=record)


def test_plans_are_frozen() -> None:
    plan = _planner(RULE).snapshot([_staged("emb.w", torch.randn(64, 32)), _staged("a", torch.ones(3)),
                                    _staged("b", torch.ones(5))])
    assert isinstance(plan, WritePlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tensors = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tensors[0].force = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.tensors[0].spans[0].rows = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.packs[0].size = 0
    assert isinstance(plan.tensors, tuple) and isinstance(plan.tensors[0].spans, tuple)


def test_quantization_rules_choose_the_pipeline() -> None:
    planner = _planner(RULE)
    t = torch.randn(64, 32)
    lossy = planner.tensor("emb.w", t.dtype, tuple(t.shape))
    assert lossy.lossy and lossy.rule == RULE
    assert lossy.pipeline == pipeline_for_rule(RULE, torch.float32, 2, COMP)
    for key, dtype, shape in [("dense.w", torch.float32, (64, 32)),  # no rule matches
                              ("emb.ids", torch.int64, (64, 32)),  # never quantized: not a float
                              ("emb.step", torch.float32, (64, 32)),  # never quantized: a step counter
                              ("emb.small", torch.float32, (3, 3))]:  # under min_numel
        plan = planner.tensor(key, dtype, shape)
        assert not plan.lossy and plan.rule is None and plan.pipeline == lossless_pipeline(dtype, COMP), key
    refused = planner.tensor("emb.w", t.dtype, tuple(t.shape), lossless=True)
    assert not refused.lossy and refused.pipeline == lossless_pipeline(torch.float32, COMP)
    adaptive = pipeline_for_rule(QuantRule("*", method="adaptive", expected_restores=50), torch.float32, 2, COMP)
    assert adaptive.array.bits == 8


def test_spans_cover_the_tensor_in_chunks() -> None:
    t = torch.randn(100, 16)  # 64 bytes a row: 64 rows a 4096-byte chunk
    plan = _planner().tensor("w", t.dtype, tuple(t.shape))
    assert plan.spans == (Span(0, 64, 16), Span(64 * 16, 36, 16))
    assert [tuple(dataclasses.astuple(s)) for s in plan.spans] == chunk_spans(100, 16, 4, 4096)
    wide = _planner().tensor("w", torch.float32, (2, 3000))  # a row larger than a chunk: slices
    assert [s.cols for s in wide.spans] == [1024] * 5 + [880] and {s.rows for s in wide.spans} == {1}


def test_row_streams_plan_base_or_delta_as_plan_rows_does() -> None:
    planner = _planner()
    t = torch.randn(1000, 8)
    spec = lossless_pipeline(torch.float32, COMP).spec_id
    stream = _stream(t, spec)
    changed = torch.tensor([3, 700])
    delta = planner.staged(_staged("emb.w", t, stream, changed))
    expected = plan_rows(stream, changed, IncrementalConfig(), spec, 8 * 4)
    assert delta.delta and not expected.full and torch.equal(delta.rows.rows, expected.rows)
    assert delta.base == stream.record.base and delta.spans == (Span(0, 2, 8),)  # only the changed rows
    unknown = planner.staged(_staged("emb.w", t, stream, None))  # changes unknown: a full base
    forced = planner.staged(_staged("emb.w", t, stream, changed), force=True)
    other = planner.staged(_staged("emb.w", t, _stream(t, "another-spec"), changed))  # pipeline changed
    dense = planner.staged(_staged("emb.w", t, stream, torch.arange(900)))
    for plan in (unknown, forced, other, dense):
        assert not plan.delta and plan.rows.full and plan.base == () and plan.spans[0] == Span(0, 128, 8)
    assert forced.force and not unknown.force


def test_small_lossless_tensors_are_packed_and_lossy_ones_are_not() -> None:
    tensors = [_staged("a", torch.ones(10)), _staged("emb.w", torch.randn(8, 8)), _staged("b", torch.ones(20)),
               _staged("big", torch.ones(600)), _staged("c", torch.ones(3, dtype=torch.float64))]
    plan = _planner(RULE).snapshot(tensors)
    assert len(plan.packs) == 1 and plan.packs[0].members == (0, 2) and plan.packs[0].size == 120
    assert plan.tensors[0].pack.start == 0 and plan.tensors[2].pack.start == 40
    # lossy, over pack_bytes, alone in its group (float64): tensors of their own
    assert [plan.tensors[i].pack for i in (1, 3, 4)] == [None] * 3
    assert plan.tensors[1].lossy and all(plan.tensors[i].spans for i in (1, 3, 4))


def _tensor_blobs(path: str, key: str) -> list[BlobRef]:
    with ckpt_core.CheckpointEngine() as engine:
        rec = next(r for r in engine.read_manifest(path).tensors if r.key == key)
    return [c.blob for c in rec.base]


def test_dcp_and_ordinary_saves_store_identical_blobs(tmp_path) -> None:
    g = torch.Generator().manual_seed(5)
    state = {"emb": {"w": torch.randn(300, 32, generator=g)}, "dense": torch.randn(200, 16, generator=g)}
    config = {"compression": {"chunk_bytes": 8192},
              "quantization": [{"pattern": "emb.*", "bits": 4, "min_numel": 16}]}
    ckpt_core.save(state, tmp_path / "plain" / "a.ckpt", config=config)
    cdcp.save(state, str(tmp_path / "dcp" / "a.dcp"), config=config)
    for key in ("emb.w", "dense"):
        plain = _tensor_blobs(str(tmp_path / "plain" / "a.ckpt"), key)
        dist = _tensor_blobs(str(tmp_path / "dcp" / "a.dcp"), key)
        assert len(plain) > 1 and plain == dist, key  # same keys, sizes and checksums, chunk by chunk
        for ref in plain:
            files = [os.path.join(root, f) for sub in ("plain", "dcp")
                     for root, _, names in os.walk(tmp_path / sub / ".checkrun")
                     for f in names if os.path.basename(root) + f == ref.key]
            assert len(files) == 2 and open(files[0], "rb").read() == open(files[1], "rb").read()
    # the same content in the same directory: the DCP save reuses every blob the ordinary one wrote
    info = cdcp.save(state, str(tmp_path / "plain" / "b.dcp"), config=config)
    assert info.written_bytes == 0


def _imports(path) -> set[str]:
    """Absolute names of the ckpt_core modules a source file imports (relative imports resolved)."""
    import ast
    from pathlib import Path

    path = Path(path)
    package = ["ckpt_core", *path.parent.relative_to(Path(ckpt_core.__file__).parent).parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            names.add(".".join([*base, *([node.module] if node.module else [])]))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_save_path_imports_point_forward() -> None:
    from pathlib import Path

    core = Path(ckpt_core.__file__).parent
    for f in (core / "codecs").glob("*.py"):
        assert not any(n.startswith("ckpt_core.saving") for n in _imports(f)), f  # codecs hold no policy
    for name in ("plan", "write", "blobwrite", "quant_rules", "quant_error", "blobcheck"):
        f = core / "saving" / f"{name}.py"
        assert not any(n.startswith("ckpt_core.loading") for n in _imports(f)), f  # saving never reads loading
