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


def test_overrides_given_as_a_nested_mapping_are_merged_not_replacing_the_section():
    """h136: ``replace(retention={"keep_last": 2})`` (the plugin's ``overrides`` written as a mapping, in
    LightningCLI YAML or Hydra) replaced the whole section: ``protect`` went back to its default and
    retention deleted the user's protected ``best.ckpt``. Mappings are merged key by key now."""
    from lightning_ckpt.config import build_config

    base = EngineConfig.from_dict({"retention": {"keep_last": 5, "protect": ["best*.ckpt"]},
                                   "saving": {"workers": 3}})
    cfg = base.replace(retention={"keep_last": 2}, saving={"background": "process"})
    assert cfg.retention.keep_last == 2 and cfg.retention.protect == ("best*.ckpt",) and cfg.saving.workers == 3
    cfg = build_config(config=base.to_dict(), overrides={"retention": {"keep_last": 2}})
    assert cfg.retention.keep_last == 2 and "best*.ckpt" in cfg.retention.protect
    with pytest.raises(ConfigError, match="quantization: expected a list of rules, got one rule"):
        build_config(quantization={"pattern": "*", "bits": 8})
    with pytest.raises(ConfigError, match="key 1 is not a dotted config key"):
        build_config(overrides={1: 2})


def test_one_quantization_rule_as_a_mapping_is_named_by_from_dict_and_yaml(tmp_path):
    """h136/s38: ``quantization: {pattern: ..., bits: 8}`` in YAML said "expected a list, got dict"."""
    with pytest.raises(ConfigError, match=r"^quantization: expected a list of rules, got one rule"):
        EngineConfig.from_dict({"quantization": {"pattern": "*", "bits": 8}})
    path = tmp_path / "engine.yaml"
    path.write_text("quantization:\n  pattern: emb.*\n  bits: 4\n")
    with pytest.raises(ConfigError, match=r"engine.yaml: quantization: expected a list of rules, got one rule"):
        EngineConfig.from_yaml(path)
    path.write_text("quantization:\n  - pattern: emb.*\n    bits: 4\n")
    assert EngineConfig.from_yaml(path).quantization[0].bits == 4
    with pytest.raises(ConfigError, match=r"^retention.protect: expected a list, got str"):
        EngineConfig.from_dict({"retention": {"protect": "best*.ckpt"}})


def test_a_config_built_in_python_is_checked_like_one_from_a_dict():
    """h136: ``EngineConfig(saving=SavingConfig(max_pending=0))`` was taken as is and the first save waited for
    ever; ``QuantRule(bits=5)`` failed only at save time. The engine checks it as ``from_dict`` does."""
    import ckpt_core
    from ckpt_core.config import SavingConfig

    with pytest.raises(ConfigError, match="saving.max_pending: must be > 0, got 0"):
        ckpt_core.CheckpointEngine(EngineConfig(saving=SavingConfig(max_pending=0)))
    with pytest.raises(ConfigError, match="bits: uniform supports 2, 3, 4 or 8 bits, got 5"):
        ckpt_core.CheckpointEngine(EngineConfig(quantization=(QuantRule(pattern="*", bits=5),)))


@pytest.mark.parametrize("data, message", [
    ({"compression": {"zstd_level": 100}}, r"compression.zstd_level: must be in \[-131072, 22\], got 100"),
    ({"compression": {"zstd_threads": 1000}}, r"zstd_threads: must be in \[0, 256\]"),
    ({"saving": {"thread_nice": 100}}, r"thread_nice: must be in \[0, 19\]"),
    ({"retention": {"lease_seconds": float("nan")}}, "lease_seconds: must be a finite number, got nan"),
    ({"step_log": {"flush_seconds": float("inf")}}, "flush_seconds: must be a finite number"),
    ({"storage": {"retry": {"initial_backoff_seconds": -1}}}, "initial_backoff_seconds: must be >= 0"),
    ({"saving": {"staging_budget_bytes": -1}}, "staging_budget_bytes: must be >= 0"),
    ({"saving": {"sigterm_grace_seconds": -5}}, "sigterm_grace_seconds: must be >= 0"),
    ({"quantization": [{"pattern": "*", "min_numel": -1}]}, r"quantization\[0\]: .*min_numel >= 0"),
    ({"saving": {True: 1}}, "saving: key True is not a name: quote it"),
])
def test_values_that_failed_only_at_the_first_save_are_refused_when_the_config_is_built(data, message):
    """h136: out-of-range values passed the config check and failed at the first save, after training had
    run (zstd level 100), or silently misbehaved (NaN lease_seconds, a negative retry backoff hid the storage
    error); a YAML key read as a boolean raised a raw TypeError."""
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(data)


def test_a_config_file_that_is_not_utf8_or_gives_a_key_twice_is_refused_naming_the_file(tmp_path):
    """h136: a Latin-1 comment (or a binary file given by mistake) raised a raw UnicodeDecodeError, and a
    second ``retention:`` block silently replaced the first (``keep_last`` lost: every checkpoint kept)."""
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("# r\xe9glages\nretention: {keep_last: 2}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.yaml: not a UTF-8 text file \(byte 3\)"):
        EngineConfig.from_yaml(latin)
    twice = tmp_path / "twice.yaml"
    twice.write_text("retention:\n  keep_last: 2\nsaving:\n  workers: 2\nretention:\n  protect: [best.ckpt]\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml: key .retention. appears twice in one mapping \(line 5"):
        EngineConfig.from_yaml(twice)
    onkey = tmp_path / "on.yaml"
    onkey.write_text("saving:\n  on: 1\n")
    with pytest.raises(ConfigError, match=r"on\.yaml: saving: key True is not a name"):
        EngineConfig.from_yaml(onkey)


def test_a_config_path_starting_with_a_tilde_is_the_home_directorys(tmp_path, monkeypatch):
    """h136: ``config="~/ck.yaml"`` said "No such file" though checkpoint paths expand ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ck.yaml").write_text("retention: {keep_last: 2}\n")
    assert EngineConfig.from_yaml("~/ck.yaml").retention.keep_last == 2


def test_yaml_merge_keys_a_dict_setting_replaced_whole_and_a_subclass_are_kept(tmp_path):
    """h137, regressions of the h136 fixes: ``<<: *defaults`` was refused as invalid YAML (the duplicate-key
    check built the merge key); ``replace(**{"storage.storage_options": {...}})`` merged into the old options
    (credentials could not be removed); an ``EngineConfig`` subclass with fields of its own was refused."""
    import dataclasses

    import ckpt_core
    from ckpt_core.yamlfile import read_yaml

    merged = tmp_path / "merge.yaml"
    merged.write_text("base: &b {keep_last: 5, protect: [best*.ckpt]}\nretention:\n  <<: *b\n  keep_last: 3\n")
    assert read_yaml(merged)["retention"] == {"keep_last": 3, "protect": ["best*.ckpt"]}
    chain = tmp_path / "chain.yaml"  # h138: an anchor merging another, nested: PyYAML merges it in place first
    chain.write_text("profiles:\n  base: &base {keep_last: 2}\n  group:\n    dev: &dev {<<: *base, keep_last: 4}\n"
                     "retention: {<<: *dev}\n")
    assert read_yaml(chain)["retention"] == {"keep_last": 4}
    inline = tmp_path / "inline.yaml"  # a key twice inside a merged mapping is still a key twice
    inline.write_text("retention:\n  <<: {keep_last: 5,\n        keep_last: 1}\n")
    with pytest.raises(ConfigError, match=r"inline\.yaml: key 'keep_last' appears twice in one mapping \(line 3"):
        read_yaml(inline)
    cfg = EngineConfig.from_dict({"storage": {"storage_options": {"key": "k", "secret": "s"}}})
    assert cfg.replace(**{"storage.storage_options": {"anon": True}}).storage.storage_options == {"anon": True}
    assert cfg.replace(storage={"storage_options": {}}).storage.storage_options == {}

    @dataclasses.dataclass(frozen=True)
    class MyConfig(EngineConfig):
        run_name: str = "x"

    mine = MyConfig()
    with ckpt_core.CheckpointEngine(mine) as engine:
        assert engine.config == mine and type(engine.config) is MyConfig
    # h138: a section given as a dict is built (the first save failed on it), replace() keeps the subclass
    built = ckpt_core.config.coerce_config(MyConfig(retention={"keep_last": 1}, run_name="r"))
    assert built.retention.keep_last == 1 and built.run_name == "r"
    again = built.replace(**{"retention.keep_last": 2})
    assert type(again) is MyConfig and again.run_name == "r" and again.retention.keep_last == 2


def test_a_config_file_nested_thousands_deep_is_a_config_error(tmp_path):
    """A YAML file of 5,000 nested lists raised a raw RecursionError from PyYAML's composer."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError, match=r"deep\.yaml: invalid YAML: nested too deeply"):
        EngineConfig.from_yaml(deep)


def test_yaml_keys_that_load_as_one_key_and_a_plugin_config_object_with_a_dict_section(tmp_path):
    """h139: the duplicate-key check compared keys as written: ``1`` and ``0x1`` (``true`` and ``on``) load as
    one key, the last silently winning; and ``CheckrunCheckpointIO(config=EngineConfig(retention={...}))``
    crashed with ``'dict' object has no attribute 'protect'`` (the plugin took the object unchecked)."""
    from ckpt_core.yamlfile import read_yaml
    from lightning_ckpt.config import build_config

    same = tmp_path / "same.yaml"
    same.write_text("storage:\n  storage_options:\n    1: a\n    0x1: b\n")
    with pytest.raises(ConfigError, match=r"same\.yaml: key '0x1' appears twice in one mapping \(line 4"):
        read_yaml(same)
    assert build_config(config=EngineConfig(retention={"keep_last": 2})).retention.keep_last == 2


@pytest.mark.parametrize("text, message", [
    ("retention:\n  !!set x: 1\n", "invalid YAML: .*unhashable"),
    ("retention:\n  keep_last: !!int abc\n", "invalid YAML: ValueError"),
    ("retention:\n  2026-13-45: 1\n", "invalid YAML: ValueError: month must be in 1..12"),
])
def test_yaml_keys_and_values_no_loader_builds_are_config_errors(tmp_path, text, message):
    """h140: a key tagged as a collection (``!!set x``) raised a bare TypeError from the duplicate-key check; bad
    scalars (``!!int abc``, the date 2026-13-45) a bare ValueError from PyYAML. A key ``=`` loads as a string."""
    from ckpt_core.yamlfile import read_yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"bad\.yaml: " + message):
        read_yaml(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("storage:\n  storage_options:\n    =: x\n")
    assert EngineConfig.from_yaml(ok).storage.storage_options == {"=": "x"}
