"""Quantization of values near the bottom of float32's range, and rule checks (found by an independent check,
h148): the error statistics squared such values in float32 and read 0, so an fp16 cast zeroed a tensor of
~1e-25 values (Adam's exp_avg_sq) without being refused and every method recorded an error of 0; int8_block
had no check for scales below float32's range; subnormal rows were refused as "values too large" with numpy
warnings; a misspelt rule dtype failed only at the first save; a rule for step counters warned that it
matched nothing."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import ConfigError


def _save_load(tmp_path, t: torch.Tensor, rule: dict, caplog) -> tuple[torch.Tensor, dict | None]:
    with caplog.at_level(logging.WARNING, logger="ckpt_core"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's overflow warnings must not reach the user
        with CheckpointEngine({"quantization": [dict(pattern="t", min_numel=0, **rule)]}) as engine:
            engine.save({"t": t}, tmp_path / "a.ckpt").result()
            quant = engine.read_manifest(tmp_path / "a.ckpt").tensors[0].quant
            return engine.load(tmp_path / "a.ckpt")["t"], quant


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_fp16_cast_of_values_whose_squares_underflow_is_refused(tmp_path, caplog):
    v = torch.rand(256, 256, generator=torch.Generator().manual_seed(0)) * 1e-24 + 1e-26
    out, quant = _save_load(tmp_path, v, {"method": "fp16"}, caplog)
    assert quant is None and torch.equal(out, v)  # before: all zeros, recorded error 0
    assert "cast to float16: values below its normal range" in caplog.text


@pytest.mark.parametrize("rule", [{"method": "uniform", "bits": 4, "scale_dtype": "fp32"},
                                  {"method": "uniform", "bits": 8, "scale_dtype": "fp32", "greedy": False},
                                  {"method": "int8_block"}, {"method": "bf16"}])
def test_the_recorded_error_of_tiny_values_is_the_real_one(tmp_path, caplog, rule):
    x = torch.rand(512, 64, generator=torch.Generator().manual_seed(1)) * 1e-24 + 1e-26
    out, quant = _save_load(tmp_path, x, rule, caplog)
    assert quant is not None and quant["rel_l2_error"] == pytest.approx(_rel(out, x), rel=1e-3)
    assert quant["rel_l2_error"] > 0


@pytest.mark.parametrize("t", [torch.full((64, 64), 1e-50, dtype=torch.float64),
                               torch.linspace(1e-40, 2e-37, 4096).view(64, 64)])
def test_int8_block_refuses_scales_below_float32s_range(tmp_path, caplog, t):
    out, quant = _save_load(tmp_path, t, {"method": "int8_block"}, caplog)
    assert quant is None and torch.equal(out, t)  # before: zeros (float64) or each block's largest value
    assert "int8_block: block scales underflow float32" in caplog.text


def test_uniform_on_subnormal_rows_is_refused_for_what_it_is(tmp_path, caplog):
    t = torch.zeros(64, 64)
    t[:, ::2] = 1e-40  # each row spans 0..1e-40: a subnormal step
    out, quant = _save_load(tmp_path, t, {"method": "uniform", "bits": 4, "scale_dtype": "fp32"}, caplog)
    assert quant is None and torch.equal(out, t)
    assert "quantization steps underflow float32 (rows of values too small for it); they cannot be quantized" \
        in caplog.text


def test_bf16_refusal_does_not_advise_bf16(tmp_path, caplog):
    t = torch.full((64, 64), 1e-50, dtype=torch.float64)
    out, quant = _save_load(tmp_path, t, {"method": "bf16"}, caplog)
    assert quant is None and torch.equal(out, t)
    assert "keep the tensor lossless" in caplog.text and "use bf16" not in caplog.text


def test_a_misspelt_rule_dtype_is_refused_when_the_config_is_built():
    with pytest.raises(ConfigError, match="unknown dtype 'flaot32'"):
        EngineConfig.from_dict({"quantization": [{"pattern": "x", "dtype": "flaot32"}]})
    with pytest.raises(ConfigError, match=r"^quantization\[0\]: missing required key\(s\) pattern"):
        EngineConfig.from_dict({"quantization": [{"method": "bf16"}]})


def test_a_rule_for_step_counters_does_not_warn_that_it_matched_nothing(tmp_path):
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(256, 256)}}}}
    cfg = {"quantization": [{"pattern": "optimizer.state.*.step", "method": "uniform", "min_numel": 0}]}
    with warnings.catch_warnings(record=True) as caught:  # the warning comes from the engine's thread
        warnings.simplefilter("always")
        with CheckpointEngine(cfg) as engine:
            engine.save(state, tmp_path / "a.ckpt").result()
    assert not [w for w in caught if "matched no tensor" in str(w.message)]
    with pytest.warns(UserWarning, match="matched no tensor"):  # a real typo still warns
        with CheckpointEngine({"quantization": [{"pattern": "optimizer.stat.*", "method": "uniform"}]}) as engine:
            engine.save(state, tmp_path / "b.ckpt").result()


@pytest.mark.parametrize("method", ["bf16", "fp16"])
def test_a_cast_of_float64_values_whose_squares_underflow_float64_is_refused(tmp_path, caplog, method):
    t = torch.full((64, 64), 1e-200, dtype=torch.float64)  # h152: squares of 1e-200 are 0 even scaled back
    out, quant = _save_load(tmp_path, t, {"method": method}, caplog)
    assert quant is None and torch.equal(out, t)
    assert "values below its normal range" in caplog.text and "relative error 1)" in caplog.text


def test_a_rule_that_admits_no_tensor_still_warns_when_its_pattern_covers_exempt_ones(tmp_path):
    """Only a rule that would have taken an exempt tensor (pattern, dtype and min_numel) counts as matching it
    (h152: a rule whose dtype or min_numel excluded every tensor was silenced by a step counter it covers)."""
    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(256, 256)}}}}
    for rule in ({"pattern": "optimizer.state.*", "method": "int8_block", "dtype": "float16"},
                 {"pattern": "optimizer.*", "method": "int8_block", "min_numel": 10 ** 9}):
        with pytest.warns(UserWarning, match="matched no tensor"):
            with CheckpointEngine({"quantization": [rule]}) as engine:
                engine.save(state, tmp_path / "a.ckpt").result()
