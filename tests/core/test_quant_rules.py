"""Quantization rule matching: order, filters, never-quantized tensors, unmatched-rule tracking."""
from __future__ import annotations

import threading

import pytest
import torch

from ckpt_core.config import QuantRule
from ckpt_core.errors import ConfigError
from ckpt_core.saving.quant_rules import RuleMatcher, adaptive_bits, match_rule

EMB = "model.embeddings.table_0.weight"


@pytest.mark.parametrize("restores,bits", [(1, 2), (2, 3), (3, 3), (4, 4), (20, 4), (21, 8), (10_000, 8)])
def test_adaptive_bits(restores, bits):
    assert adaptive_bits(restores) == bits


def test_first_matching_rule_wins():
    a = QuantRule("model.embeddings.*", bits=2, min_numel=1)
    b = QuantRule("*", bits=8, min_numel=1)
    assert match_rule(EMB, torch.float32, 4096, 2, (a, b)) is a
    assert match_rule(EMB, torch.float32, 4096, 2, (b, a)) is b
    assert match_rule("model.fc.weight", torch.float32, 4096, 2, (a, b)) is b
    assert match_rule(EMB, torch.float32, 4096, 2, ()) is None


def test_glob_is_case_sensitive_and_star_crosses_dots():
    rule = QuantRule("model.*.weight", min_numel=1)
    assert match_rule("model.layers.0.attn.weight", torch.float32, 10, 2, (rule,)) is rule
    assert match_rule("model.layers.0.attn.bias", torch.float32, 10, 2, (rule,)) is None
    assert match_rule("Model.layers.weight", torch.float32, 10, 2, (rule,)) is None
    upper = QuantRule("*Embedding*", min_numel=1)
    assert match_rule("model.embedding.weight", torch.float32, 10, 2, (upper,)) is None


def test_dtype_filter_falls_through_to_later_rules():
    only32 = QuantRule("*", dtype="float32", bits=2, min_numel=1)
    rest = QuantRule("*", bits=8, min_numel=1)
    assert match_rule(EMB, torch.float32, 100, 2, (only32, rest)) is only32
    assert match_rule(EMB, torch.bfloat16, 100, 2, (only32, rest)) is rest
    for spelling, dtype in [("torch.float32", torch.float32), ("float", torch.float32),
                            ("half", torch.float16), ("bfloat16", torch.bfloat16)]:
        rule = QuantRule("*", dtype=spelling, min_numel=1)
        assert match_rule(EMB, dtype, 100, 2, (rule,)) is rule


def test_unknown_dtype_name_is_a_config_error():
    bad = QuantRule("*", dtype="float33")
    with pytest.raises(ConfigError, match="float33"):
        match_rule(EMB, torch.float32, 4096, 2, (bad,))
    with pytest.raises(ConfigError):
        RuleMatcher((bad,))
    with pytest.raises(ConfigError):
        RuleMatcher((QuantRule("*", dtype="Tensor"),))


def test_min_numel_boundary():
    rule = QuantRule("*", min_numel=1024)
    assert match_rule(EMB, torch.float32, 1024, 2, (rule,)) is rule
    assert match_rule(EMB, torch.float32, 1023, 2, (rule,)) is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
                                   torch.complex64, torch.complex128]
                         + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []), ids=str)
def test_non_float_dtypes_are_never_quantized(dtype):
    assert match_rule(EMB, dtype, 1 << 20, 2, (QuantRule("*", min_numel=0),)) is None


def test_scalars_and_step_counters_are_never_quantized():
    anything = (QuantRule("*", min_numel=0),)
    assert match_rule("loss_scale", torch.float32, 1, 0, anything) is None
    assert match_rule("optimizer_states.0.state.3.step", torch.float32, 1 << 20, 1, anything) is None
    assert match_rule("step", torch.float32, 1 << 20, 1, anything) is None
    for key in ("optimizer_states.0.state.3.exp_avg", "model.stepper.weight", "x.steps", "x.step_size"):
        assert match_rule(key, torch.float32, 1 << 20, 1, anything) is anything[0]


def test_rule_matcher_tracks_unmatched_rules():
    used = QuantRule("*.weight", bits=2)
    shadowed = QuantRule("model.fc.*", bits=8)   # every key it matches is taken by `used` first
    typo = QuantRule("modle.*", bits=4)
    twin = QuantRule("*.weight", bits=2)         # equal to `used`, tracked separately by position
    matcher = RuleMatcher([used, shadowed, typo, twin])
    assert matcher.unmatched_rules() == (used, shadowed, typo, twin)
    assert matcher.select("model.fc.weight", torch.zeros(64, 64)) is used
    assert matcher.select("model.fc.bias", torch.zeros(64)) is None        # < min_numel
    assert matcher.select("opt.step", torch.zeros(64, 64)) is None
    unmatched = matcher.unmatched_rules()
    assert len(unmatched) == 3 and unmatched[0] is shadowed and unmatched[1] is typo and unmatched[2] is twin
    # a rule whose pattern names a tensor no rule may touch (a step counter) is no typo: not reported (h148)
    assert matcher.select("model.fc.step", torch.zeros(64, 64)) is None
    assert matcher.unmatched_rules() == (typo, twin)


def test_rule_matcher_is_thread_safe():
    rules = tuple(QuantRule(f"layer{i}.*", min_numel=1) for i in range(8))
    matcher = RuleMatcher(rules)
    tensor = torch.zeros(4, 4)

    def work(i):
        for _ in range(200):
            assert matcher.select(f"layer{i}.weight", tensor) is rules[i]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(0, 8, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert matcher.unmatched_rules() == rules[1::2]


def test_a_rule_that_matches_nothing_warns_once(tmp_path):
    import warnings

    import torch

    from ckpt_core import CheckpointEngine

    cfg = {"quantization": [{"pattern": "model.emb*", "bits": 4, "min_numel": 1},
                            {"pattern": "modle.typo*", "bits": 4}]}
    with CheckpointEngine(cfg) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                engine.save({"model": {"emb": torch.randn(64, 8)}}, tmp_path / f"{i}.ckpt").result()
    messages = [str(w.message) for w in caught if "matched no tensor" in str(w.message)]
    assert len(messages) == 1 and "'modle.typo*'" in messages[0] and "0.ckpt" in messages[0]
