"""Where accelerate_ckpt's settings come from: an ``EngineConfig`` plus a few adapter options.

Accepted forms (first match wins):

1. ``AcceleratorCheckpointer(accelerator, config=...)`` with an ``EngineConfig``, a dict or a YAML path;
2. the YAML file named by the ``CHECKRUN_CONFIG`` environment variable (set it yourself with plain
   ``accelerate launch``; ``accelerate-ckpt launch`` sets it from the ``checkpointing:`` section of
   the accelerate config file);
3. defaults (lossless, asynchronous, incremental).

A YAML file may be the ``EngineConfig`` mapping itself, or any file with a top-level
``checkpointing:`` section (so the combined accelerate config file works too). Inside it, an
optional ``accelerate:`` mapping holds the adapter options of :class:`AdapterOptions`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional

from ckpt_core import ConfigError, EngineConfig
from ckpt_core.yamlfile import read_yaml as read_config_yaml

CONFIG_ENV = "CHECKRUN_CONFIG"
"""Environment variable naming a YAML file with checkrun's settings."""
SECTION = "checkpointing"
"""Top-level key of the checkrun section in an accelerate config file."""
ADAPTER_KEY = "accelerate"
"""Key, inside the section, of the adapter options."""


@dataclass(frozen=True)
class AdapterOptions:
    """Settings of the Accelerate integration itself (not of the engine)."""

    directory: Optional[str] = None
    """Checkpoint directory (path or fsspec URL). Default: ``{project_dir}/checkpoints`` with
    ``automatic_checkpoint_naming``, else the ``output_dir`` given to ``save_state``."""
    on_unsupported: Literal["fallback", "error"] = "fallback"
    """FSDP / DeepSpeed / Megatron-LM / XLA: use accelerate's own save_state with a warning, or raise."""
    collective_timeout_seconds: float = 1800.0
    """How long a rank waits for rank 0 (its verdict on a checkpoint, a load's broadcast)."""
    participation_timeout_seconds: float = 10.0
    """How long rank 0 waits for another rank's part of a checkpoint before committing it without
    (that rank did not call ``save_state``: e.g. under ``if accelerator.is_main_process``)."""
    fallback_to_accelerate: bool = True
    """``load_state`` of a local folder that accelerate's own ``save_state`` wrote (``model.safetensors``,
    ``optimizer.bin``, ``random_states_0.pkl``...; a project from before checkrun was attached), or,
    with no checkrun checkpoint, of the newest such folder: load it with accelerate's own
    ``load_state`` (which unpickles ``register_for_checkpointing`` objects, as it always does). False:
    raise ``CheckpointNotFoundError`` instead."""

    @classmethod
    def from_dict(cls, data: dict | None) -> "AdapterOptions":
        """Validate ``data`` (unknown keys and bad values raise ConfigError naming the key)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown key(s) {unknown} in {SECTION}.{ADAPTER_KEY} "
                              f"(known: {', '.join(sorted(known))})")
        opts = cls(**data)
        if opts.on_unsupported not in ("fallback", "error"):
            raise ConfigError(f"{SECTION}.{ADAPTER_KEY}.on_unsupported: must be 'fallback' or 'error', "
                              f"got {opts.on_unsupported!r}")
        if not isinstance(opts.fallback_to_accelerate, bool):
            raise ConfigError(f"{SECTION}.{ADAPTER_KEY}.fallback_to_accelerate: expected true or false")
        if opts.directory is not None and not isinstance(opts.directory, str):
            raise ConfigError(f"{SECTION}.{ADAPTER_KEY}.directory: expected a string")
        for key in ("collective_timeout_seconds", "participation_timeout_seconds"):
            value = getattr(opts, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"{SECTION}.{ADAPTER_KEY}.{key}: must be a number of seconds > 0, got {value!r}")
        return opts


def read_yaml(path: str | os.PathLike) -> dict:
    """The mapping in a YAML file (empty file = empty mapping)."""
    data = read_config_yaml(path) or {}  # unreadable, not UTF-8, invalid, a key twice: ConfigError naming the file
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def split_sections(data: dict) -> tuple[dict, dict | None]:
    """Split an accelerate config mapping into (accelerate's keys, the ``checkpointing`` section)."""
    rest = {k: v for k, v in data.items() if k != SECTION}
    section = data.get(SECTION) if SECTION in data else None
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"{SECTION}: expected a mapping, got {type(section).__name__}")
    return rest, ((section or {}) if SECTION in data else None)  # an empty section: the defaults


def from_mapping(data: dict, origin: str = "config") -> tuple[EngineConfig, AdapterOptions]:
    """An ``EngineConfig`` mapping (optionally wrapped in ``checkpointing:``) -> settings."""
    if SECTION in data:
        stray = sorted(k for k in data if k == ADAPTER_KEY or k in {f.name for f in fields(EngineConfig)})
        if stray:  # beside the section they were dropped silently (found by an independent check)
            raise ConfigError(f"{origin}: {', '.join(map(repr, stray))} beside a {SECTION!r} section: put the "
                              f"settings under {SECTION}: (the keys beside it are accelerate's own)")
        data = {} if data[SECTION] is None else data[SECTION]
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: {SECTION}: expected a mapping, got {type(data).__name__}")
    data = dict(data)
    adapter = data.pop(ADAPTER_KEY, None)
    if adapter is not None and not isinstance(adapter, dict):
        raise ConfigError(f"{origin}: {ADAPTER_KEY}: expected a mapping, got {type(adapter).__name__}")
    try:
        return EngineConfig.from_dict(data), AdapterOptions.from_dict(adapter)
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None


def resolve(config: EngineConfig | dict | str | os.PathLike | None = None,
            env: dict | None = None) -> tuple[EngineConfig, AdapterOptions, str]:
    """Settings from ``config``, else ``$CHECKRUN_CONFIG``, else defaults; plus where they came from."""
    env = os.environ if env is None else env
    if isinstance(config, EngineConfig):
        return config, AdapterOptions(), "EngineConfig argument"
    if isinstance(config, dict):
        engine, adapter = from_mapping(config, "config argument")
        return engine, adapter, "dict argument"
    if isinstance(config, (str, os.PathLike)):
        engine, adapter = from_mapping(read_yaml(config), os.fspath(config))
        return engine, adapter, os.fspath(config)
    if config is not None:
        raise ConfigError(f"config must be EngineConfig, dict, YAML path or None, not {type(config).__name__}")
    path = env.get(CONFIG_ENV)
    if path:
        engine, adapter = from_mapping(read_yaml(path), f"${CONFIG_ENV}={path}")
        return engine, adapter, f"${CONFIG_ENV}={path}"
    return EngineConfig(), AdapterOptions(), "defaults"


def as_plain(engine: EngineConfig, adapter: AdapterOptions) -> dict[str, Any]:
    """The settings as one plain mapping (what a ``checkpointing:`` section would contain)."""
    data = engine.to_dict()
    data[ADAPTER_KEY] = {f.name: getattr(adapter, f.name) for f in fields(adapter)}
    return data
