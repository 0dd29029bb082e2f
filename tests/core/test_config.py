"""EngineConfig: validation names the key, YAML and dict round trips, the reference doc is current."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_core import ConfigError, EngineConfig, QuantRule
from ckpt_core.docgen import render


def test_defaults_round_trip():
    cfg = EngineConfig()
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg


def test_nested_values_and_rules():
    cfg = EngineConfig.from_dict({"retention": {"keep_last": 3}, "saving": {"staging_budget_bytes": None},
                                  "quantization": [{"pattern": "*emb*", "bits": 2}]})
    assert cfg.retention.keep_last == 3
    assert cfg.quantization == (QuantRule(pattern="*emb*", bits=2),)
    assert cfg.replace(**{"retention.keep_last": 5}).retention.keep_last == 5


@pytest.mark.parametrize("data, match", [
    ({"retention": {"keep_lst": 3}}, "retention.keep_lst"),
    ({"nope": 1}, "'nope'"),
    ({"saving": {"max_pending": "2"}}, "saving.max_pending"),
    ({"saving": {"asynchronous": 1}}, "saving.asynchronous"),
    ({"incremental": {"policy": "sometimes"}}, "incremental.policy"),
    ({"quantization": [{"pattern": "*", "bits": 5}]}, "bits"),
    ({"quantization": [{"method": "uniform"}]}, "pattern"),
    ({"retention": {"keep_last": 0}}, "keep_last"),
    ({"compression": {"chunk_bytes": 0}}, "compression.chunk_bytes"),
])
def test_bad_config_names_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_dict(data)


def test_from_yaml_and_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("compute_environment: LOCAL_MACHINE\ncheckpointing:\n  retention: {keep_last: 2}\n")
    assert EngineConfig.from_yaml(p, section="checkpointing").retention.keep_last == 2
    p.write_text("retention: {keep_last: x}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*retention\.keep_last"):
        EngineConfig.from_yaml(p)


def test_configuration_reference_is_current():
    doc = Path(__file__).parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == render(), "run: python -m ckpt_core.docgen > docs/configuration.md"
