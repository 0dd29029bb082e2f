"""checkrun's engine: asynchronous, incremental, optionally quantized PyTorch checkpoints on fsspec.

Quick use::

    import ckpt_core
    with ckpt_core.CheckpointEngine({"retention": {"keep_last": 3}}) as engine:
        engine.save({"model": model.state_dict(), "step": 10}, "runs/a/step=10.ckpt")
        state = engine.load(engine.latest("runs/a"))
"""
from .config import (CompressionConfig, EngineConfig, IncrementalConfig, LoadConfig, QuantRule,
                     RetentionConfig, RetryConfig, SavingConfig, StorageConfig)
from .engine import CheckpointEngine, load, save
from .errors import (BackgroundSaveError, CheckpointNotFoundError, CheckrunError, ConfigError,
                     CorruptCheckpointError, FormatError, NotACheckpointError, StorageError,
                     UnsafeLoadError, UnsafePathError)
from .handles import SaveHandle, SaveInfo
from .reader import VerifyReport
from .retention import CheckpointEntry, GCReport
from .tracking import EmbeddingTracker

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "save", "load", "EngineConfig", "CompressionConfig", "StorageConfig",
    "RetryConfig", "SavingConfig", "IncrementalConfig", "QuantRule", "RetentionConfig", "LoadConfig",
    "EmbeddingTracker", "SaveHandle", "SaveInfo", "VerifyReport", "GCReport", "CheckpointEntry", "CheckrunError",
    "ConfigError", "StorageError", "CheckpointNotFoundError", "NotACheckpointError",
    "CorruptCheckpointError", "UnsafePathError", "FormatError", "UnsafeLoadError", "BackgroundSaveError",
]
