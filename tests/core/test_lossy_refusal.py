"""A lossy codec's refusal is typed (``LossyRefusedError``) and is the only thing that makes a save
store a tensor lossless; any other exception inside a codec fails the save, nothing committed."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.codecs import CastCodec, Int8BlockCodec, UniformCodec, lossless_pipeline
from ckpt_core.config import CompressionConfig
from ckpt_core.errors import BackgroundSaveError, CheckrunError, LossyRefusedError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = {"quantization": [{"pattern": "emb.*", "bits": 4, "min_numel": 16}], "saving": {"asynchronous": True}}


def _state(bad: float | None = None) -> dict:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    if bad is not None:
        w[5, 7] = bad
    return {"emb": {"w": w}, "dense": torch.ones(8, 8)}


def test_public_and_typed() -> None:
    assert ckpt_core.LossyRefusedError is LossyRefusedError and "LossyRefusedError" in ckpt_core.__all__
    assert issubclass(LossyRefusedError, CheckrunError)


@pytest.mark.parametrize("codec, values", [
    (UniformCodec(4), torch.tensor([[1.0, float("nan")]])),
    (UniformCodec(4), torch.tensor([[1.0, float("inf")]])),
    (UniformCodec(4, scale_dtype="fp16"), torch.tensor([[-1e6, 1e6]])),  # a step fp16 cannot hold
    (Int8BlockCodec(64), torch.tensor([[0.0, float("-inf")]])),
    (CastCodec("float16"), torch.tensor([[1e6, 0.0]])),  # overflows float16
    # values that underflow: found by a check of lossy saves (decoded to all zeros, no warning)
    (UniformCodec(4, scale_dtype="fp16"), torch.randn(20, 16, generator=torch.Generator().manual_seed(0)) * 1e-8),
    (UniformCodec(4, scale_dtype="fp16", greedy=False), torch.tensor([[1e-7, 2e-7, 3e-7]])),
    (UniformCodec(4, scale_dtype="fp16"), torch.full((4, 16), 1e-9)),  # its min is not an fp16 value
    (CastCodec("float16"), torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) * 1e-20),  # exp_avg_sq
    (CastCodec("float16"), torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 1e-6),  # subnormal
    # bf16 rounds fp16's 65408..65504 up to 65536, inf once decoded to fp16: the save committed a
    # checkpoint that no load accepted (found by a check of today's changes)
    (CastCodec("bfloat16"), torch.tensor([[65504.0, 1.0]], dtype=torch.float16)),
    # values near float32's limit: their squares overflowed the error statistics and the manifest's
    # JSON ("Out of range float values"): the whole save failed (found by a check of today's changes)
    (Int8BlockCodec(16), torch.full((4, 16), 3e38).to(torch.bfloat16)),
    (UniformCodec(8, scale_dtype="fp32"), torch.rand(4, 16, generator=torch.Generator().manual_seed(0)) * 3e38),
    (CastCodec("bfloat16"), torch.full((4, 16), 3e38)),
])
def test_codecs_refuse_with_the_typed_error(codec, values) -> None:
    with pytest.raises(LossyRefusedError):
        codec.encode(values)


def test_a_refused_tensor_is_stored_lossless_and_its_record_says_so(tmp_path, caplog) -> None:
    state = _state(float("inf"))
    path = tmp_path / "a.ckpt"
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        ckpt_core.save(state, path, config=CONFIG)
    with ckpt_core.CheckpointEngine(CONFIG) as engine:
        recs = {r.key: r for r in engine.read_manifest(path).tensors}
        loaded = engine.load(path)
    assert recs["emb.w"].quant is None
    assert list(recs["emb.w"].codecs) == lossless_pipeline(torch.float32, CompressionConfig()).to_list()
    assert torch.equal(loaded["emb"]["w"], state["emb"]["w"])  # bit-exact, the inf included
    assert any("emb.w stored lossless" in r.getMessage() and "inf or nan" in r.getMessage() for r in caplog.records)
    ckpt_core.save(_state(), tmp_path / "b.ckpt", config=CONFIG)  # finite values: quantized as ever
    with ckpt_core.CheckpointEngine(CONFIG) as engine:
        assert next(r for r in engine.read_manifest(tmp_path / "b.ckpt").tensors if r.key == "emb.w").quant


@pytest.mark.parametrize("error", [RuntimeError("codec bug"), ValueError("codec bug, not a refusal")])
def test_any_other_codec_exception_fails_the_save_and_commits_nothing(tmp_path, monkeypatch, error) -> None:
    def broken(self, array):
        raise error

    monkeypatch.setattr(UniformCodec, "encode", broken)
    path = tmp_path / "a.ckpt"
    with ckpt_core.CheckpointEngine(CONFIG) as engine:
        handle = engine.save(_state(), path)
        with pytest.raises(BackgroundSaveError) as info:
            handle.result()
        assert info.value.__cause__ is error
        assert engine.latest(str(tmp_path)) is None
    assert not path.exists()


def test_dcp_refusal_is_lossless_and_a_codec_bug_fails_the_save(tmp_path, monkeypatch) -> None:
    state = _state(float("nan"))
    cdcp.save(state, str(tmp_path / "a.dcp"), config=CONFIG)
    with ckpt_core.CheckpointEngine() as engine:
        rec = next(r for r in engine.read_manifest(tmp_path / "a.dcp").tensors if r.key == "emb.w")
    assert rec.quant is None and list(rec.codecs) == lossless_pipeline(torch.float32, CompressionConfig()).to_list()
    loaded = cdcp.load_state_dict(str(tmp_path / "a.dcp"))
    assert torch.equal(loaded["emb"]["w"].view(torch.int32), state["emb"]["w"].view(torch.int32))  # nan too

    def broken(self, array):
        raise RuntimeError("codec bug")

    monkeypatch.setattr(UniformCodec, "encode", broken)
    with pytest.raises(CheckpointException, match="codec bug"):
        cdcp.save(_state(), str(tmp_path / "b.dcp"), config=CONFIG)
    assert not (tmp_path / "b.dcp").exists()


@pytest.mark.parametrize("codec, values", [
    (UniformCodec(4, scale_dtype="fp16"), torch.randn(20, 16, generator=torch.Generator().manual_seed(0)) * 1e-3),
    (UniformCodec(4, scale_dtype="fp32"), torch.randn(20, 16, generator=torch.Generator().manual_seed(0)) * 1e-8),
    (UniformCodec(4, scale_dtype="fp16"), torch.full((4, 16), 0.5)),  # constant rows: step 0, exact
    (CastCodec("float16"), torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02),  # weights
    (CastCodec("bfloat16"), torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) * 1e-20),
])
def test_small_but_representable_values_are_still_quantized(codec, values) -> None:
    data, stats = codec.encode(values)
    back = codec.decode(data, tuple(values.shape), values.dtype)
    assert float((back - values).norm()) <= 0.1 * float(values.norm())


@pytest.mark.parametrize("codec", [UniformCodec(4, scale_dtype="fp16"), UniformCodec(4, scale_dtype="fp32"),
                                   Int8BlockCodec(16)])
def test_finite_but_forged_parameters_that_decode_to_inf_are_refused(codec) -> None:
    """Checksums are recomputed by a forger: a step (or scale) of 3e38 / 65504 is finite and
    non-negative, yet ``q * s + m`` overflows. Found by a check of lossy saves (loaded with inf
    values; verify said ok)."""
    values = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).half()
    data = bytearray(codec.encode(values)[0])
    if isinstance(codec, Int8BlockCodec):
        torch.frombuffer(data, dtype=torch.float32, count=4)[:] = 3e38
    else:
        _, steps = codec.params(bytes(data), (4, 16))
        sdt = steps.dtype
        size = steps.numel() * steps.element_size()
        torch.frombuffer(data, dtype=sdt, count=steps.numel(), offset=size)[:] = torch.finfo(sdt).max
    with pytest.raises(ckpt_core.errors.FormatError, match="decodes to inf or nan"):
        codec.decode(bytes(data), (4, 16), torch.float16)


def test_an_encoding_whose_reconstruction_overflows_is_refused() -> None:
    from ckpt_core.codecs._common import finite_encoding
    from ckpt_core.codecs.base import EncodeStats

    with pytest.raises(LossyRefusedError, match="overflow"):
        finite_encoding(EncodeStats(float("inf"), 0.0, 1.0), "uniform")
    assert finite_encoding(EncodeStats(0.5, 1.0, 2.0), "uniform").max_abs_error == 0.5


def test_an_older_bf16_cast_of_fp16_values_near_65504_still_loads() -> None:
    """checkrun before 2026-12-05 stored fp16 values near 65504 cast to bf16 as 65536 (inf once
    decoded); the decode-time finite check (for forged uniform/int8_block parameters) made those
    checkpoints unloadable, their lossless tensors with them (found by an upgrade check). A cast
    stores values, not parameters: it decodes them as they are."""
    from ckpt_core.codecs._common import tensor_bytes

    old = tensor_bytes(torch.tensor([[65536.0, 1.0]], dtype=torch.bfloat16))
    out = CastCodec("bfloat16").decode(old, (1, 2), torch.float16)
    assert torch.isinf(out[0, 0]) and out[0, 1] == 1.0
