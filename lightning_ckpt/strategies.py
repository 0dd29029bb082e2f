"""Which Lightning strategies route checkpoints through a ``CheckpointIO`` plugin, and which do not.

Lightning gives a ``CheckpointIO`` no ``setup`` hook and no reference to its strategy, so the plugin
finds the strategy that is calling it by looking at its caller's frame (``Strategy.save_checkpoint``,
``load_checkpoint``, ``remove_checkpoint`` and ``teardown`` all call the plugin as
``self.checkpoint_io.<method>(...)``). :func:`check_strategy` is also public, so a callback's ``setup``
(``CheckpointMetrics``, ``CheckrunModelCheckpoint``) can refuse an unsupported strategy before training.

Supported: single device, DDP (and its spawn/fork variants), Fabric with those. Refused, in Lightning and
Fabric alike: DeepSpeed (writes its own checkpoints), FSDP and ModelParallel - sharded checkpoints are written
with torch.distributed.checkpoint and never reach the plugin, and full-state checkpoints are saved through
the plugin but loaded back by the strategy with ``torch.load`` (``_lazy_load``), which cannot read checkrun's
files, so a run could save but never resume (``lightning_ckpt.dcp``'s strategies are the checkrun way to
write sharded checkpoints; combined with this plugin they are accepted in sharded mode). XLA needs its own
``XLACheckpointIO``.
"""
from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, Optional

from ckpt_core.errors import CheckrunError

__all__ = ["UnsupportedStrategyError", "check_strategy", "calling_strategy", "calling_instance",
           "called_by_async_wrapper"]

_ASYNC_MODULES = frozenset({"lightning.pytorch.plugins.io.async_plugin",
                            "pytorch_lightning.plugins.io.async_plugin"})


class UnsupportedStrategyError(CheckrunError, RuntimeError):
    """The Trainer's strategy bypasses ``CheckpointIO``, so checkrun would silently not be used.

    A ``CheckrunError`` like every error checkrun raises on purpose; still a ``RuntimeError``, as it
    was documented before (``except RuntimeError`` keeps catching it)."""


def _is_strategy(obj: Any) -> bool:
    for mod in ("lightning.pytorch.strategies", "lightning.fabric.strategies", "pytorch_lightning.strategies",
                "lightning_fabric.strategies"):
        module = sys.modules.get(mod)
        if module is not None and isinstance(obj, getattr(module, "Strategy", ())):
            return True
    return False


def calling_instance(predicate: Callable[[Any], bool], depth: int = 8) -> Optional[Any]:
    """The ``self`` of the nearest of the ``depth`` callers for which ``predicate(self)`` holds (best effort)."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if candidate is not None and predicate(candidate):
            return candidate
        frame = frame.f_back
    return None


def calling_strategy(depth: int = 8) -> Optional[Any]:
    """The Lightning/Fabric ``Strategy`` object among the ``depth`` nearest callers, if any (best effort)."""
    return calling_instance(_is_strategy, depth)


def called_by_async_wrapper(depth: int = 8) -> bool:
    """True when one of the ``depth`` nearest callers is Lightning's ``AsyncCheckpointIO``."""
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") in _ASYNC_MODULES:
            return True
        frame = frame.f_back
    return False


def _writes_sharded(strategy: Any) -> bool:
    if getattr(strategy, "_state_dict_type", None) == "sharded":
        return True
    return bool(getattr(strategy, "_save_distributed_checkpoint", False))


def check_strategy(strategy: Any) -> None:
    """Raise :class:`UnsupportedStrategyError` if ``strategy`` would bypass the plugin.

    Called with the Trainer's (or Fabric's) strategy; does nothing for strategies that both save and load
    through ``CheckpointIO`` (single device, DDP and its spawn/fork variants).
    """
    name = type(strategy).__name__
    mro = {cls.__name__ for cls in type(strategy).__mro__}
    if "DeepSpeedStrategy" in mro:
        raise UnsupportedStrategyError(
            f"{name}: DeepSpeed writes its own checkpoints (deepspeed_engine.save_checkpoint) and never "
            "calls CheckpointIO.save_checkpoint, so CheckrunCheckpointIO would be silently ignored. "
            "Remove the plugin, or train with DDP.")
    if "_CheckrunDCP" in mro and _writes_sharded(strategy):
        return  # lightning_ckpt.dcp's strategies save and load sharded checkpoints through checkrun themselves
    for sharded in ("FSDPStrategy", "ModelParallelStrategy"):
        if sharded in mro:
            raise UnsupportedStrategyError(
                f"{name}: sharded checkpoints are written by torch.distributed.checkpoint, not through "
                "CheckpointIO, and full-state checkpoints are loaded back by the strategy with torch.load "
                "(not through CheckpointIO), which cannot read checkrun's files: training could save but "
                "never resume. Use lightning_ckpt.dcp.CheckrunFSDPStrategy / CheckrunModelParallelStrategy "
                "(sharded checkpoints through checkrun) instead of CheckrunCheckpointIO, or train with DDP.")
    if "XLAStrategy" in mro or "SingleDeviceXLAStrategy" in mro:
        raise UnsupportedStrategyError(
            f"{name}: XLA tensors must be saved with XLACheckpointIO (xm.save); checkrun does not support XLA.")
