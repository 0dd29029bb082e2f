"""All of checkrun's settings in one explicit dataclass tree (no hidden environment knobs).

``EngineConfig.from_dict`` / ``from_yaml`` validate every key and type and name the dotted key
of anything wrong; ``to_dict`` gives back plain data that ``from_dict`` accepts.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from .errors import ConfigError
from .yamlfile import read_yaml

ChainPolicy = Literal["intermittent", "one_shot", "consecutive"]
QuantMethod = Literal["uniform", "adaptive", "bf16", "fp16", "int8_block"]


@dataclass(frozen=True)
class CompressionConfig:
    """How tensor chunks are encoded when no quantization rule applies (lossless)."""

    zstd_level: int = 1
    """zstd level (1 is fast and, after byte-shuffle, within a few % of higher levels)."""
    zstd_threads: int = 0
    """zstd worker threads per frame (0 = compress on the calling worker thread)."""
    shuffle: bool = True
    """Group the bytes of each element into planes and zstd each plane that compresses, storing the
    others raw (ZipNN/Blosc style; the ``shuffle_zstd`` codec); pays ~1.2x on floats."""
    compress: bool = True
    """Set False to store raw bytes (still chunked, content-addressed and checksummed)."""
    chunk_bytes: int = 16 * 1024 * 1024
    """Target size of one chunk of raw tensor data; the unit of dedup, parallelism and retries."""
    pack_bytes: int = 64 * 1024
    """Lossless tensors of at most this many bytes (biases, norms, step counters) are stored
    together, up to ``chunk_bytes`` per blob ("packs", format 2), instead of one blob each: a blob
    costs about 1 ms of CPU per save beyond its bytes. 0 turns packing off."""


@dataclass(frozen=True)
class RetryConfig:
    """Retries with exponential backoff for transient storage errors."""

    max_attempts: int = 8
    """Attempts per storage call. With the defaults a call is retried over ~8-16 s in all: an S3 outage of a
    few seconds is ridden out, as botocore's and s3fs's retries ride it out for stock Lightning (before
    2026-12-06: 5 attempts from 0.1 s, 0.75-1.5 s: a 5 s outage failed the save, and the fit)."""
    initial_backoff_seconds: float = 0.2
    """Backoff after the first failed attempt, doubled after each (equal jitter: half fixed, half random)."""
    max_backoff_seconds: float = 5.0


@dataclass(frozen=True)
class StorageConfig:
    """Where and how bytes are moved."""

    storage_options: dict = field(default_factory=dict)
    """Passed to fsspec for every call (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``)."""
    io_threads: int = 4
    """Parallel blob reads/writes."""
    fsync: bool = True
    """fsync blobs and manifests on local filesystems before the commit rename."""
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass(frozen=True)
class SavingConfig:
    """The asynchronous save pipeline."""

    asynchronous: bool = True
    """False: ``save`` returns only after the checkpoint is committed."""
    max_pending: int = 1
    """Saves in flight at once; a further ``save`` waits (backpressure)."""
    staging_budget_bytes: Optional[int] = None
    """Cap on host staging memory shared by the saves in flight (a save waits until its snapshot fits);
    one snapshot larger than the cap is admitted alone. None = whatever ``max_pending`` snapshots need."""
    workers: int = 2
    """Threads that hash, encode and upload chunks in the background."""
    background: Literal["thread", "process"] = "thread"
    """Where the background part of a save runs. ``thread``: threads of the training process.
    ``process``: a writer process of its own, fed through shared-memory staging buffers
    (``/dev/shm``), so the training thread never waits for the GIL the writer holds: use it when
    training runs Python on the CPU (measured in docs/performance.md). Not for ``memory://``."""
    thread_nice: int = 10
    """Linux: the background threads run this much nicer than the training loop, so encoding yields
    the CPU to training on busy cores (the save then takes longer in the background; 0 = same
    priority). Ignored where per-thread priorities do not exist."""
    pin_memory: bool = True
    """Use pinned staging buffers for CUDA tensors (ignored on CPU-only machines)."""
    sigterm_grace_seconds: Optional[float] = 30.0
    """On SIGTERM, wait this long for pending saves to commit; None = install no handler."""


@dataclass(frozen=True)
class IncrementalConfig:
    """Write only what changed since the previous save to the same directory."""

    enabled: bool = True
    policy: ChainPolicy = "intermittent"
    """``one_shot``: delta vs the last full base; ``consecutive``: delta vs the previous save;
    ``intermittent``: one-shot deltas, new base when predicted cheaper (Check-N-Run)."""
    max_chain: int = 8
    """Most deltas on top of one base before a new full base is taken (a save in which no row of a
    tensor changed keeps that tensor's record: no link, and it does not count)."""
    row_delta_min_rows: int = 1024
    """2-D tensors with at least this many rows get row-level deltas; others chunk-level dedup."""
    rebase_ratio: float = 0.5
    """intermittent: take a new base when the delta would exceed this fraction of a full save."""
    row_delta_keys: tuple = ("*",)
    """Glob patterns (on the flattened key) of tensors eligible for row deltas."""


@dataclass(frozen=True)
class QuantRule:
    """Opt-in lossy encoding for the tensors whose flattened key matches ``pattern``."""

    pattern: str
    method: QuantMethod = "uniform"
    bits: int = 4
    """uniform: 2, 3, 4 or 8."""
    dtype: Optional[str] = None
    """Only match tensors of this dtype (e.g. ``"float32"``)."""
    min_numel: int = 1024
    """Tensors with fewer elements are stored lossless."""
    greedy: bool = True
    """uniform: greedy range search per row (Guan et al. 2019)."""
    scale_dtype: Literal["fp16", "fp32"] = "fp16"
    block_size: int = 256
    """Block length for 1-D tensors (uniform) and for int8_block."""
    expected_restores: int = 1
    """adaptive: 2 bits for 1 restore, 3 up to 3, 4 up to 20, 8 beyond."""


@dataclass(frozen=True)
class RetentionConfig:
    """What to keep and when unreferenced blobs may be deleted."""

    keep_last: Optional[int] = None
    """Keep this many newest committed checkpoints in a directory (None = keep all)."""
    protect: tuple = ()
    """Glob patterns of checkpoint names that retention neither counts nor removes (the Lightning
    plugin adds ``last*.ckpt``, so ``keep_last`` never deletes the checkpoint ``ckpt_path="last"``
    resumes from)."""
    lease_seconds: float = 300.0
    """How long the lease of a save in flight protects its blobs from garbage collection without
    being renewed. A save renews its lease as it works, once a quarter of this has passed, so a slow
    save is never cut short (one that went 3/4 of it without renewing checks its blobs again before
    its commit); only the lease of a writer that died (SIGKILL, lost node) runs out, and the blobs it
    protected become collectable after this long (at once where its process is known gone: same
    host). Clocks of hosts writing one directory must agree within a quarter of it. See
    docs/operations.md."""
    gc_grace_seconds: float = 0.0
    """Garbage collection also keeps unreferenced blobs younger than this. Leases protect saves in
    flight, so 0 is safe; set it (e.g. 3600, the default of versions without leases) while a writer
    of such a version may still write to the directory: it takes no leases."""
    gc_after_save: bool = True
    """After each commit, in the save's background step: retention, then deletion of the blobs of
    the checkpoints it removed (or ``remove`` removed, or a failed save wrote) that no manifest
    references and no live lease protects, without listing the blobs; a collection that finds the
    lease of a dead writer also lists them and deletes what that writer left (like ``gc``)."""


@dataclass(frozen=True)
class LoadConfig:
    """Loading safety."""

    allowed_globals: tuple = ()
    """Extra ``module.QualName`` types allowed when loading with ``weights_only=True``."""
    max_blob_bytes: int = 1 << 34
    """Refuse any blob or chunk whose declared size exceeds this (hostile manifests)."""
    max_total_bytes: Optional[int] = None
    """Refuse to load (or decode in ``verify``) a checkpoint whose tensors, delta row indices, kept
    copies and pickled values (an object blob and what its records declare) need more host memory
    than this, before allocating any (None = this machine's physical memory)."""
    reference: Literal["auto", "background", "inline"] = "auto"
    """When a load makes the copy of the tensors the next row-delta save compares against (the
    reference): ``inline``, during the load; ``background``, after the load returned, on a thread that
    reads and decodes their blobs again (the next save waits for it); ``auto``: ``background`` on a
    local filesystem (the blobs are in the page cache), ``inline`` elsewhere (an object store would
    download them twice). docs/performance.md "Restore path"."""
    max_manifest_elements: int = 4_000_000
    """Refuse, before parsing it, a manifest whose JSON holds more elements than this, or lists and
    objects more than a quarter of it: each costs 50-200 bytes of memory to parse, and a checkpoint
    has ~60 per tensor and ~16 per chunk (the default admits ~65k tensors)."""


@dataclass(frozen=True)
class StepLogConfig:
    """The per-step update log (docs/steplog.md): what each optimizer step consumed, between checkpoints."""

    enabled: bool = False
    """Turn the log on where an adapter starts it from the config (Lightning, Accelerate); plain
    PyTorch starts it with ``engine.step_log(directory, optimizer)`` whatever this says."""
    flush_every_steps: int = 16
    """Commit a segment after this many optimizer steps: a crash loses at most these steps."""
    flush_seconds: float = 30.0
    """Also commit a segment once its oldest record is this old (bounds the loss in wall time)."""
    queue_steps: int = 2
    """Captured steps waiting for the background encoder; a further step waits (backpressure).
    Each costs one copy of the gradients in host memory."""
    sparse_max_fraction: float = 0.5
    """A 2-D gradient with at most this fraction of non-zero rows is logged as those rows only."""
    rng: bool = True
    """Log the RNG states (python, numpy, torch, CUDA) of each segment's last step; a replay that ends
    there sets them. Off: ~45 us less per step, and the segments stay readable by checkrun before 2026-12-06."""


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of checkrun. Build with ``EngineConfig()``, ``from_dict`` or ``from_yaml``."""

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    saving: SavingConfig = field(default_factory=SavingConfig)
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)
    quantization: tuple = ()
    """Tuple of ``QuantRule``; first match wins; empty = lossless."""
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    step_log: StepLogConfig = field(default_factory=StepLogConfig)

    @classmethod
    def from_dict(cls, data: dict | None) -> "EngineConfig":
        """Build from plain data; unknown keys and wrong types raise ConfigError naming the key."""
        return _build(cls, data or {}, "")

    @classmethod
    def from_yaml(cls, path: str | Path, section: str | None = None) -> "EngineConfig":
        """Read a YAML file (optionally one top-level ``section`` of it, e.g. ``checkpointing``)."""
        data = read_yaml(path) or {}
        if section is not None:
            if not isinstance(data, dict) or section not in data:  # a typo must not silently mean "defaults"
                keys = sorted(map(str, data))[:10] if isinstance(data, dict) else []
                raise ConfigError(f"{path}: no top-level section {section!r} (it has {keys})")
            data = data[section] or {}
        if not isinstance(data, dict):
            where = f"in section {section!r}" if section else "at the top level"
            raise ConfigError(f"{path}: expected a mapping {where}")
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_dict(self) -> dict:
        """Plain data (lists for tuples) that ``from_dict`` turns back into an equal config."""
        return _to_plain(self)

    def replace(self, **overrides: Any) -> "EngineConfig":
        """A copy with dotted-key overrides, e.g. ``replace(**{"retention.keep_last": 3})``; a mapping given for a
        section is merged into it key by key (``replace(retention={"keep_last": 3})`` keeps ``protect``)."""
        data = _own_plain(self)
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                if not isinstance(node.get(p), dict):
                    raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(dotted, _dotted_keys(data))}")
                node = node[p]
            node[leaf] = _merged(node.get(leaf), value, leaf)
        return _checked(self, data)


def coerce_config(config: "EngineConfig | dict | str | Path | None") -> EngineConfig:
    """Accept an EngineConfig, a dict, a YAML path or None (defaults)."""
    if config is None:
        return EngineConfig()
    if isinstance(config, EngineConfig):  # built in Python: checked as from_dict checks (h136: max_pending=0 hung)
        return _checked(config, _own_plain(config))
    if isinstance(config, dict):
        return EngineConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return EngineConfig.from_yaml(config)
    raise ConfigError(f"config must be EngineConfig, dict, YAML path or None, not {type(config).__name__}")


def _own_plain(config: EngineConfig) -> dict:  # a subclass's fields of its own left out
    return {f.name: _to_plain(getattr(config, f.name)) for f in dataclasses.fields(EngineConfig)}


def _checked(config: EngineConfig, data: dict) -> EngineConfig:
    """``data`` built and checked as ``from_dict`` does, as ``config``'s class (a subclass keeps its own fields)."""
    built = EngineConfig.from_dict(data)
    own = {f.name: getattr(built, f.name) for f in dataclasses.fields(EngineConfig)}
    return built if type(config) is EngineConfig else dataclasses.replace(config, **own)


_DICT_SETTINGS = {"storage_options"}  # settings whose value is a mapping: replaced whole (sections are merged)


def _merged(base: Any, new: Any, key: str) -> Any:
    """``new`` laid over the section ``base`` key by key, nested sections too (overrides given as a mapping: h136)."""
    if key in _DICT_SETTINGS or not isinstance(base, dict) or not isinstance(new, dict):
        return new
    return {**base, **{k: _merged(base.get(k), v, k) for k, v in new.items()}}


def _did_you_mean(key: str, names: "typing.Iterable[str]", prefix: str = "") -> str:
    """``"; did you mean 'saving.asynchronous'?"`` for the valid key nearest to a misspelt one, else ``""``."""
    match = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    return f"; did you mean {prefix + match[0]!r}?" if match else ""


def _dotted_keys(data: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a ``to_dict`` tree (sections and settings), for suggestions."""
    return [k for key, value in data.items() for k in [prefix + key] + (
        _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and key != "storage_options" else [])]


_TUPLE_ITEM_TYPES = {("EngineConfig", "quantization"): QuantRule}


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str):  # YAML reads on/yes/no/1/null unquoted as non-strings (h136: a TypeError)
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: key {key!r} is not a name: quote it if it is one")
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(key, names, prefix)} "
                              f"(known: {', '.join(sorted(names))})")
        item_type = _TUPLE_ITEM_TYPES.get((cls.__name__, key))
        kwargs[key] = _check(hints[key], value, dotted, item_type)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: missing required key(s) {', '.join(missing)}")
    obj = cls(**kwargs)
    _validate_values(obj, prefix)
    return obj


def _check(tp: Any, value: Any, dotted: str, item_type: type | None = None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(arg, value, dotted)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{dotted}: invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{dotted}: must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, dotted + ".")
    if tp is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            one = item_type is not None and isinstance(value, dict)  # one quantization rule, not in a list
            raise ConfigError(f"{dotted}: expected a list of rules, got one rule: put it in a list ([{{...}}])" if one
                              else f"{dotted}: expected a list, got {type(value).__name__}")
        if item_type is not None:
            return tuple(_build(item_type, v, f"{dotted}[{i}].") for i, v in enumerate(value))
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise ConfigError(f"{dotted}[{i}]: expected a string, got {type(v).__name__}")
        return tuple(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{dotted}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{dotted}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{dotted}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{dotted}: expected a string, got {value!r}")
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    raise ConfigError(f"{dotted}: unsupported config type {tp!r}")  # pragma: no cover


_POSITIVE = {
    "compression.chunk_bytes", "storage.io_threads", "storage.retry.max_attempts",
    "saving.max_pending", "saving.workers", "incremental.max_chain", "load.max_blob_bytes",
    "load.max_manifest_elements", "load.max_total_bytes", "retention.lease_seconds",
    "step_log.flush_every_steps", "step_log.flush_seconds", "step_log.queue_steps",
}
_NON_NEGATIVE = {"compression.zstd_threads", "compression.pack_bytes", "saving.thread_nice",
                 "incremental.row_delta_min_rows", "retention.gc_grace_seconds", "saving.staging_budget_bytes",
                 "storage.retry.initial_backoff_seconds", "storage.retry.max_backoff_seconds",
                 "saving.sigterm_grace_seconds"}
_RANGES = {"compression.zstd_level": (-(1 << 17), 22), "compression.zstd_threads": (0, 256),
           "saving.thread_nice": (0, 19)}


def _validate_values(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        dotted = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):  # h136: NaN lease_seconds passed every check
            raise ConfigError(f"{dotted}: must be a finite number, got {value!r}")
        if dotted in _POSITIVE and value is not None and value <= 0:
            raise ConfigError(f"{dotted}: must be > 0, got {value!r}")
        if dotted in _NON_NEGATIVE and value is not None and value < 0:
            raise ConfigError(f"{dotted}: must be >= 0, got {value!r}")
        low, high = _RANGES.get(dotted, (None, None))
        if low is not None and not low <= value <= high:  # h136: zstd_level 100 failed at the first save
            raise ConfigError(f"{dotted}: must be in [{low}, {high}], got {value!r}")
    if isinstance(obj, RetentionConfig) and obj.keep_last is not None and obj.keep_last < 1:
        raise ConfigError(f"{prefix}keep_last: must be >= 1 or null, got {obj.keep_last!r}")
    if isinstance(obj, QuantRule):
        if obj.method == "uniform" and obj.bits not in (2, 3, 4, 8):
            raise ConfigError(f"{prefix}bits: uniform supports 2, 3, 4 or 8 bits, got {obj.bits!r}")
        if obj.block_size <= 0 or obj.expected_restores < 1 or obj.min_numel < 0:
            raise ConfigError(f"{prefix.rstrip('.')}: block_size and expected_restores must be positive, "
                              "min_numel >= 0")
        from .saving.quant_rules import rule_dtype  # a misspelt dtype failed only at the first save (h148)
        rule_dtype(obj)
    if isinstance(obj, StepLogConfig) and not 0 <= obj.sparse_max_fraction <= 1:
        raise ConfigError(f"{prefix}sparse_max_fraction: must be in [0, 1], got {obj.sparse_max_fraction!r}")
    if isinstance(obj, IncrementalConfig) and not 0 < obj.rebase_ratio <= 1:
        raise ConfigError(f"{prefix}rebase_ratio: must be in (0, 1], got {obj.rebase_ratio!r}")


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj
