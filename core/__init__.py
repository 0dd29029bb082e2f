"""checkrun's engine: asynchronous, incremental, optionally quantized PyTorch checkpoints on fsspec.

Quick use::

    import ckpt_core
    with ckpt_core.CheckpointEngine({"retain.retention": {"keep_last": 3}}) as engine:
        engine.save({"model": model.state_dict(), "step": 10}, "runs/a/step=10.ckpt")
        state = engine.load(engine.latest("runs/a"))

The names below are imported on first use (PEP 562), so that ``import ckpt_core.cli`` (the
``checkrun`` console script) answers ``--version`` and ``--help`` without importing torch. Add a
new public name to ``_EXPORTS`` (and ``__all__``), not as an import at the top of this file.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "config": ("CompressionConfig", "EngineConfig", "IncrementalConfig", "LoadConfig", "QuantRule",
               "RetentionConfig", "RetryConfig", "SavingConfig", "StorageConfig"),
    "engine": ("CheckpointEngine", "load", "save"),
    "errors": ("BackgroundSaveError", "CheckpointNotFoundError", "CheckrunError", "CommitRefusedError",
               "ConfigError", "CorruptCheckpointError", "FormatError", "LossyRefusedError", "NotACheckpointError",
               "ObjectLoadError", "OrphanedWriterError", "StorageError", "SupersededError", "UnsafeLoadError", "UnsafePathError"),
    "saving.handles": ("SaveHandle", "SaveInfo"),
    "saving.inflight": ("save_in_flight", "wait_for_save"),
    "loading.reader": ("VerifyCache", "VerifyReport"),
    "retain.retention": ("CheckpointEntry", "GCReport"),
    "saving.tracking": ("EmbeddingTracker",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "CheckpointEngine", "save", "load", "save_in_flight", "wait_for_save", "EngineConfig", "CompressionConfig", "StorageConfig",
    "RetryConfig", "SavingConfig", "IncrementalConfig", "QuantRule", "RetentionConfig", "LoadConfig",
    "EmbeddingTracker", "SaveHandle", "SaveInfo", "VerifyCache", "VerifyReport", "GCReport", "CheckpointEntry", "CheckrunError",
    "ConfigError", "StorageError", "CheckpointNotFoundError", "NotACheckpointError",
    "CorruptCheckpointError", "UnsafePathError", "FormatError", "UnsafeLoadError", "BackgroundSaveError",
    "CommitRefusedError", "SupersededError", "OrphanedWriterError", "LossyRefusedError", "ObjectLoadError",
]


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use), or a submodule (``ckpt_core.format.manifest``)."""
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and name.isidentifier():  # a submodule's name (``cli.__main__`` ran the CLI: h168)
        try:
            return importlib.import_module(f".{name}", __name__)
        except ImportError as exc:  # not a submodule; a C kernel loaded by ctypes (``_csig``) is none either
            native = str(exc.path or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
            if exc.name != f"{__name__}.{name}" or not (native or isinstance(exc, ModuleNotFoundError)):
                raise
    # Neither: the interpreter's own AttributeError (generic lookup, which does not come back here).
    return object.__getattribute__(sys.modules[__name__], name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .config import (CompressionConfig, EngineConfig, IncrementalConfig, LoadConfig, QuantRule,
                         RetentionConfig, RetryConfig, SavingConfig, StorageConfig)
    from .engine import CheckpointEngine, load, save
    from .errors import (BackgroundSaveError, CheckpointNotFoundError, CheckrunError, CommitRefusedError,
                         ConfigError, CorruptCheckpointError, FormatError, NotACheckpointError,
                         OrphanedWriterError, StorageError, SupersededError, UnsafeLoadError, UnsafePathError)
    from .saving.handles import SaveHandle, SaveInfo
    from .saving.inflight import save_in_flight, wait_for_save
    from .loading.reader import VerifyCache, VerifyReport
    from .retain.retention import CheckpointEntry, GCReport
    from .saving.tracking import EmbeddingTracker
