"""checkrun for PyTorch Lightning: asynchronous, incremental, optionally quantized checkpoints by adding
one plugin::

    from lightning.pytorch import Trainer
    from lightning_ckpt import CheckrunCheckpointIO

    trainer = Trainer(plugins=[CheckrunCheckpointIO(keep_last=None, storage_options=None)])

``ModelCheckpoint``, ``ckpt_path="last"``, the tuner, ddp_spawn and DDP keep working. Extras:
``CheckpointMetrics`` (save figures to the loggers), ``CheckrunModelCheckpoint`` (versioned names with
asynchronous saves, ``last`` on remote filesystems) and ``load_from_checkpoint`` (the counterpart of
``LightningModule.load_from_checkpoint``, which bypasses CheckpointIO). See docs/lightning.md.
"""
from .callbacks import CheckpointMetrics, CheckrunModelCheckpoint, find_plugin
from .config import build_config
from .io import CheckrunCheckpointIO
from .loading import load_checkpoint_dict, load_from_checkpoint
from .strategies import UnsupportedStrategyError, check_strategy

__all__ = [
    "CheckrunCheckpointIO", "CheckpointMetrics", "CheckrunModelCheckpoint", "load_from_checkpoint",
    "load_checkpoint_dict", "build_config", "check_strategy", "find_plugin", "UnsupportedStrategyError",
]
