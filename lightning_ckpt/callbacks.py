"""Callbacks that go with ``CheckrunCheckpointIO``: save metrics for the loggers, and a ``ModelCheckpoint``
that copes with asynchronous saves and remote ``last`` checkpoints.

Threads: the engine reports each committed save on its background thread; ``CheckpointMetrics`` only
queues it there and logs from the training thread (batch/epoch ends and ``teardown``), where loggers
may be used.
"""
from __future__ import annotations

import collections
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ckpt_core import SaveInfo, save_in_flight
from ckpt_core.storage.paths import is_local_fs

from .io import CheckrunCheckpointIO
from .paths import checkpoint_kind, normalize_path
from .strategies import check_strategy

__all__ = ["CheckpointMetrics", "CheckrunModelCheckpoint", "find_plugin", "in_flight"]


def find_plugin(trainer: "pl.Trainer") -> Optional[CheckrunCheckpointIO]:
    """The ``CheckrunCheckpointIO`` the trainer's strategy uses (also inside a wrapping CheckpointIO)."""
    io: Any = trainer.strategy.checkpoint_io
    for _ in range(4):
        if isinstance(io, CheckrunCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def in_flight(filepath: _PATH, trainer: "pl.Trainer") -> bool:
    """Whether a save to ``filepath`` is in flight in this process, by any engine (resolved with the
    storage options of the trainer's ``CheckrunCheckpointIO``, if it has one)."""
    config = getattr(find_plugin(trainer), "config", None)  # None too for a MagicMock(spec=...) of the plugin
    options = config.storage.storage_options if config is not None else None
    return save_in_flight(normalize_path(filepath), storage_options=options or None)


def removal_waiting(filepath: _PATH, trainer: "pl.Trainer") -> bool:
    """Whether the trainer's ``CheckrunCheckpointIO`` holds a removal of ``filepath`` waiting for saves in
    flight: ``ModelCheckpoint`` removed it, so its name is free (stock's file would be gone)."""
    plugin = find_plugin(trainer)
    return plugin is not None and plugin.removal_waiting(filepath)


class CheckpointMetrics(Callback):
    """Log each checkpoint save's figures to the Trainer's loggers.

    Per committed save, at the save's ``global_step``: ``{prefix}blocking_seconds`` (time the training
    loop waited), ``{prefix}background_seconds``, ``{prefix}tensor_bytes`` (the state's raw tensors),
    ``{prefix}written_bytes`` (*written by this save*: new blobs plus manifest, ``checkrun ls``'s
    WROTE), ``{prefix}referenced_bytes`` (*referenced by this checkpoint*: every blob it needs,
    ``checkrun ls``'s REFERENCED), ``{prefix}write_ratio`` (written / tensor bytes) and
    ``{prefix}compression_ratio`` (tensor / referenced bytes). Bytes are exact counts; to print them
    use ``SaveInfo.summary()`` or ``ckpt_core.units.fmt_bytes`` (binary units, as ``checkrun`` does).
    ``history`` keeps the last ``history_size`` ``SaveInfo`` objects.

    Args:
        prefix: metric name prefix.
        log_temporary: also log Lightning's temporary checkpoints (tuner, ddp_spawn).
        history_size: how many ``SaveInfo`` to keep in ``history``.
    """

    def __init__(self, prefix: str = "checkrun/", log_temporary: bool = False, history_size: int = 1000) -> None:
        self.prefix = prefix
        self.log_temporary = log_temporary
        self.history: collections.deque = collections.deque(maxlen=history_size)
        self._queue: collections.deque = collections.deque()
        self._plugin: Optional[CheckrunCheckpointIO] = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Find the plugin (refusing unsupported strategies) and subscribe to its saves."""
        self._plugin = find_plugin(trainer)
        if self._plugin is None:
            rank_zero_warn("CheckpointMetrics: the Trainer does not use CheckrunCheckpointIO; nothing to log.")
            return
        check_strategy(trainer.strategy)
        self._plugin.add_save_callback(self._on_save)

    def _on_save(self, info: SaveInfo) -> None:
        # Background thread: deque.append is atomic; the training thread pops.
        self._queue.append(info)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Log the saves committed since the last call."""
        self.flush(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Log the saves committed since the last call."""
        self.flush(trainer)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Log the last saves (the strategy's teardown already waited for them), before loggers finalize."""
        self.flush(trainer)

    def flush(self, trainer: "pl.Trainer") -> list[SaveInfo]:
        """Log every queued ``SaveInfo`` to ``trainer.loggers``; return them. Training thread only."""
        logged = []
        while self._queue:
            info = self._queue.popleft()
            if not self.log_temporary and checkpoint_kind(info.path) != "regular":
                continue
            step = self._plugin.step_of(info.path) if self._plugin is not None else None
            metrics = self.metrics(info)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step if step is None else step)
            self.history.append(info)
            logged.append(info)
        return logged

    def metrics(self, info: SaveInfo) -> dict[str, float]:
        """The logged figures of one save."""
        p = self.prefix
        return {f"{p}blocking_seconds": info.blocking_seconds, f"{p}background_seconds": info.background_seconds,
                f"{p}tensor_bytes": float(info.tensor_bytes), f"{p}written_bytes": float(info.written_bytes),
                f"{p}referenced_bytes": float(info.referenced_bytes), f"{p}write_ratio": info.write_ratio,
                f"{p}compression_ratio": info.compression_ratio}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_queue=collections.deque(), _plugin=None)
        return state


class CheckrunModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for asynchronous and remote checkpoints (same arguments as ``ModelCheckpoint``).

    Two differences, both about Lightning's own file checks:

    * a save still in flight counts as an existing file, so versioned names (``-v1``) come out as with
      synchronous saves (since ``lightning_ckpt.dropin``, Lightning's own ``ModelCheckpoint`` does this too);
    * ``ckpt_path="last"`` finds ``last.ckpt`` on remote filesystems: Lightning drops the URL scheme of
      what ``fs.ls`` returns (``bucket/run/last.ckpt``) and then looks for it on the local disk. Give
      ``dirpath`` for a remote directory (the filesystem is chosen from it before ``setup``).

    It also refuses strategies that bypass the plugin in ``setup``, before any training. Its
    ``state_key`` is the one ``ModelCheckpoint`` would have, so either class resumes the other's state.
    """

    _checkrun: Optional[CheckrunCheckpointIO] = None
    finds_remote_last = True
    """Marks this class for the plugin, which warns about Lightning's ModelCheckpoint on remote storage."""

    @property
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key for the same settings (callback state survives switching classes)."""
        return "ModelCheckpoint" + super().state_key[len(type(self).__qualname__):]

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """As ``ModelCheckpoint.setup``; also finds the plugin and checks the strategy."""
        super().setup(trainer, pl_module, stage)
        self._checkrun = find_plugin(trainer)
        if self._checkrun is not None:
            check_strategy(trainer.strategy)

    def file_exists(self, filepath: _PATH, trainer: "pl.Trainer") -> bool:
        """True if ``filepath`` exists or a save to it is in flight, not if its removal waits for saves in
        flight (decided on rank 0, shared by all)."""
        local = False
        if trainer.is_global_zero:
            pending = in_flight(filepath, trainer)
            if not pending:
                self._fs.invalidate_cache(str(filepath))  # s3fs answers exists() from stale listings
            local = not removal_waiting(filepath, trainer) and (pending or self._fs.exists(filepath))
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    def _find_last_checkpoints(self, trainer: "pl.Trainer") -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        if is_local_fs(self._fs):
            return found
        return {p if "://" in p else self._fs.unstrip_protocol(p) for p in found}
