"""checkrun for PyTorch Lightning: asynchronous, incremental, optionally quantized checkpoints by adding
one plugin::

    from lightning.pytorch import Trainer
    from lightning_ckpt import CheckrunCheckpointIO

    trainer = Trainer(plugins=[CheckrunCheckpointIO(keep_last=None, storage_options=None)])

``ModelCheckpoint``, ``ckpt_path="last"``, the tuner, ddp_spawn and DDP keep working. Importing this
package installs the drop-in hooks of :mod:`lightning_ckpt.dropin` (once): ``LightningModule`` and
``LightningDataModule.load_from_checkpoint`` and a Trainer without the plugin read checkrun checkpoints,
and Lightning's ``ModelCheckpoint`` counts a save in flight as an existing file. Extras:
``CheckpointMetrics`` (save figures to the loggers), ``CheckrunModelCheckpoint`` (``last`` on remote
filesystems) and ``load_from_checkpoint`` (with engine ``config``/``storage_options``). See docs/lightning.md.
"""
import sys as _sys

# Importing a Lightning package points Lightning's shared rank-zero logger at that package's own: the one
# in use before this import is put back at its end (``_restore_rank_zero_logger``), so logging levels a
# user set keep applying (found by an independent check: silenced messages came back)
_SHARED_RANK_ZERO = _sys.modules.get("lightning_utilities.core.rank_zero")
_RANK_ZERO_LOG = getattr(_SHARED_RANK_ZERO, "log", None)

from .callbacks import CheckpointMetrics, CheckrunModelCheckpoint, find_plugin  # noqa: E402
from .config import build_config  # noqa: E402
from .dropin import install as _install_dropin_hooks  # noqa: E402
from .io import CheckrunCheckpointIO  # noqa: E402
from .loading import is_checkrun_file, load_checkpoint_dict, load_from_checkpoint  # noqa: E402
from .steplog import StepLogSetupError  # noqa: E402
from .strategies import UnsupportedStrategyError, check_strategy  # noqa: E402

__all__ = [
    "CheckrunCheckpointIO", "CheckpointMetrics", "CheckrunModelCheckpoint", "load_from_checkpoint",
    "load_checkpoint_dict", "is_checkrun_file", "build_config", "check_strategy", "find_plugin",
    "UnsupportedStrategyError", "StepLogSetupError",
]

_install_dropin_hooks()


def _register_standalone() -> None:
    """``pytorch_lightning.Trainer`` and ``lightning_fabric.Fabric`` (the standalone packages, which
    ``lightning`` installs) accept only their own ``CheckpointIO``: the plugin is registered as one (an ABC's
    virtual subclass), so ``import pytorch_lightning as pl`` code takes it as it is."""
    try:
        from lightning_fabric.plugins import CheckpointIO as StandaloneCheckpointIO
    except ImportError:  # not installed
        return
    StandaloneCheckpointIO.register(CheckrunCheckpointIO)


_register_standalone()
if _RANK_ZERO_LOG is not None:
    _SHARED_RANK_ZERO.log = _RANK_ZERO_LOG
