"""Build the engine configuration of the plugin from a config (object, dict or YAML) plus overrides.

Precedence, lowest first: engine defaults < ``config`` (an ``EngineConfig``, a dict, or a YAML path,
optionally one ``config_section`` of it) < ``overrides`` (dotted keys) < the plugin's explicit keyword
arguments (``keep_last``, ``asynchronous``, ...) when they are not ``None``.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

from ckpt_core import ConfigError, EngineConfig
from ckpt_core.config import coerce_config
from ckpt_core.storage.options import merge_options

__all__ = ["build_config", "lossless_config"]

#: Lightning's ``ModelCheckpoint`` names its last checkpoint ``last.ckpt`` (``last-v1.ckpt``, ...).
LAST_PATTERN = "last*.ckpt"

ConfigLike = Union[EngineConfig, dict, str, "os.PathLike[str]", None]


def _base_config(config: ConfigLike, section: Optional[str]) -> EngineConfig:
    if section is not None and (config is None or isinstance(config, EngineConfig)):
        raise ConfigError(f"config_section {section!r} needs a config to read it from (a dict or a YAML path), "
                          f"not {'None' if config is None else 'an EngineConfig'}")
    if config is None:
        return EngineConfig()
    if isinstance(config, EngineConfig):
        return coerce_config(config)  # checked and built as the engine's (h139: a section given as a dict)
    if isinstance(config, dict):
        return EngineConfig.from_dict(section_of(config, section))
    if isinstance(config, (str, os.PathLike)):
        return EngineConfig.from_yaml(config, section=section)
    raise ConfigError(f"config must be an EngineConfig, a dict, a YAML path or None, "
                      f"not {type(config).__name__}")


def section_of(data: dict, section: Optional[str]) -> dict:
    """``data[section]`` (an empty dict if it is empty) or ``data`` itself when no section is given. A
    section the mapping lacks is a ``ConfigError``, as in a YAML file (before 2026-12-07 a misspelt
    ``config_section`` of a dict meant every default, the step log off: found by an independent check)."""
    if section is None:
        return data
    if section not in data:
        raise ConfigError(f"config: no top-level section {section!r} (it has {sorted(map(str, data))})")
    value = data.get(section) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"config section {section!r} must be a mapping")
    return value


def build_config(config: ConfigLike = None, *, config_section: Optional[str] = None,
                 overrides: Optional[dict] = None, keep_last: Optional[int] = None,
                 asynchronous: Optional[bool] = None, incremental: Optional[bool] = None,
                 quantization: Optional[list] = None, storage_options: Optional[dict] = None,
                 max_pending: Optional[int] = None, workers: Optional[int] = None) -> EngineConfig:
    """The ``EngineConfig`` the plugin uses; raises ``ConfigError`` naming any bad key or value.

    ``storage_options`` are merged key by key over ``storage.storage_options`` of ``config``, nested
    mappings such as ``client_kwargs`` recursively (``ckpt_core.storage.options.merge_options``);
    ``quantization`` (a list of rule dicts) replaces the config's rules.
    """
    cfg = _base_config(config, config_section)
    if overrides:  # checked whole, also a key an explicit argument below sets again
        overrides = dict(overrides)
        bad = next((k for k in overrides if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"overrides: key {bad!r} is not a dotted config key such as 'retention.keep_last'")
        if "quantization" in overrides:
            overrides["quantization"] = _rules(overrides["quantization"])
        cfg = cfg.replace(**overrides)
    dotted: dict[str, Any] = {}
    explicit = {"retention.keep_last": keep_last, "saving.asynchronous": asynchronous,
                "incremental.enabled": incremental, "saving.max_pending": max_pending,
                "saving.workers": workers, "quantization": quantization}
    dotted.update({k: v for k, v in explicit.items() if v is not None})
    if storage_options is not None:
        if not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a mapping, not {type(storage_options).__name__}")
        dotted["storage.storage_options"] = merge_options(cfg.storage.storage_options, storage_options)
    if "quantization" in dotted:
        dotted["quantization"] = _rules(dotted["quantization"])
    cfg = cfg.replace(**dotted) if dotted else cfg
    if LAST_PATTERN not in cfg.retention.protect:  # keep_last never deletes what ckpt_path="last" needs
        cfg = cfg.replace(**{"retention.protect": (*cfg.retention.protect, LAST_PATTERN)})
    return cfg


def _rules(rules: Any) -> Any:
    """A list of quantization rules as dicts (h136: one rule given as a mapping was blamed on its keys)."""
    if hasattr(rules, "keys") or getattr(rules, "__dataclass_fields__", None) is not None:
        raise ConfigError("quantization: expected a list of rules, got one rule: put it in a list ([{...}])")
    return [_rule_dict(r) for r in rules] if isinstance(rules, (list, tuple)) else rules


def _rule_dict(rule: Any) -> Any:
    fields = getattr(rule, "__dataclass_fields__", None)
    if fields is not None:  # a QuantRule object
        return {name: getattr(rule, name) for name in fields}
    return dict(rule) if hasattr(rule, "keys") else rule


def lossless_config(cfg: EngineConfig) -> EngineConfig:
    """``cfg`` without quantization rules and retention: for Lightning's temporary and HPC checkpoints."""
    if not cfg.quantization and cfg.retention.keep_last is None:
        return cfg
    return cfg.replace(**{"quantization": [], "retention.keep_last": None})
