"""Sharded Lightning checkpoints (FSDP ``state_dict_type="sharded"``, ModelParallel) through checkrun.

Those two strategies never call ``CheckpointIO``: their ``save_checkpoint`` hands the sharded state to
``torch.distributed.checkpoint.save`` with a local folder. These subclasses route the same DCP save and
load through ``ckpt_core.dcp`` instead::

    from lightning_ckpt.dcp import CheckrunFSDPStrategy, CheckrunModelParallelStrategy

    trainer = Trainer(strategy=CheckrunModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                             checkrun_config={"retention": {"keep_last": 3}}),
                      callbacks=[ModelCheckpoint(dirpath="s3://bucket/run", every_n_train_steps=500)])
    trainer.fit(model, ckpt_path="last")      # or a path: resumes from a checkrun DCP checkpoint

What changes: a checkpoint is ONE manifest file (``epoch=0-step=500.ckpt``) that appears when every rank's
shards are durable, next to the shared ``.checkrun/blobs/`` (incremental, compressed, checksummed, any
fsspec URL: ``dirpath`` may be ``s3://...``); Lightning's own metadata (loops, callbacks, epoch, ...)
is one value of the same DCP save instead of a separate ``meta.pt``. Loading restores model, optimizers
and metadata like Lightning's own sharded path, and falls back to it for checkpoints checkrun did not
write. ``weights_only=None`` means True (non-tensor values use torch's restricted unpickler; allow
extra types with ``checkrun_config={"load": {"allowed_globals": [...]}}``). ``remove_checkpoint`` deletes
the manifest and collects its blobs that no other checkpoint references (leases protect saves in flight).

Every rank calls these methods (Lightning's FSDP/ModelParallel save and load are collective).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.config import EngineConfig, coerce_config
from ckpt_core.storage.options import merge_options

__all__ = ["CheckrunFSDPStrategy", "CheckrunModelParallelStrategy", "META_KEY"]

META_KEY = "lightning"
"""Key of Lightning's non-tensor checkpoint content (one value) in the DCP state."""


class _CheckrunDCP:
    """Save/load of a Lightning checkpoint dict through ckpt_core.dcp (mixed into the strategies)."""

    checkrun_config: EngineConfig
    checkrun_storage_options: Optional[dict]

    def _setup_checkrun(self, config: Any, storage_options: Optional[dict], spread_replicated: bool,
                        min_piece_bytes: Optional[int]) -> None:
        self.checkrun_config = coerce_config(config)
        self.checkrun_storage_options = storage_options
        self.spread_replicated = spread_replicated
        self.min_piece_bytes = min_piece_bytes

    def _options(self, storage_options: Optional[dict] = None) -> Optional[dict]:
        """The strategy's storage options with a call's merged over them (``merge_options``)."""
        if storage_options is None:
            return self.checkrun_storage_options
        return merge_options(self.checkrun_storage_options, storage_options)

    def _save_dcp(self, converted: dict, rest: dict, filepath: _PATH, storage_options: Optional[dict]) -> None:
        path = self.broadcast(os.fspath(filepath))
        # A tuple is a leaf for DCP: Lightning's metadata stays one value (empty dicts, int keys intact)
        state = {**converted, META_KEY: (rest,)}
        cdcp.save(state, path, config=self.checkrun_config, storage_options=self._options(storage_options),
                  spread_replicated=self.spread_replicated, min_piece_bytes=self.min_piece_bytes)

    def _is_ours(self, path: str) -> bool:
        return cdcp.is_dcp_checkpoint(path, config=self.checkrun_config, storage_options=self._options())

    def _load_dcp(self, state: dict, path: str, weights_only: Optional[bool]) -> None:
        cdcp.load(state, path, config=self.checkrun_config, storage_options=self._options(),
                  weights_only=weights_only)

    def _load_meta(self, path: str, weights_only: Optional[bool]) -> dict:
        holder: dict = {META_KEY: None}
        self._load_dcp(holder, path, weights_only)
        return dict(holder[META_KEY][0])

    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module.trainer.state.fn == TrainerFn.FITTING

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._is_ours(os.fspath(filepath)):
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            path = os.fspath(filepath)
            with ckpt_core.CheckpointEngine(self.checkrun_config) as engine:
                engine.remove(path, storage_options=self._options())
                if self.checkrun_config.retention.gc_after_save:
                    engine.gc(path.rsplit("/", 1)[0], storage_options=self._options(), full=False)
        return None


class CheckrunFSDPStrategy(_CheckrunDCP, FSDPStrategy):
    """``FSDPStrategy`` whose sharded checkpoints (the default here: ``state_dict_type="sharded"``) are
    checkrun DCP checkpoints. ``state_dict_type="full"`` behaves exactly like FSDPStrategy.

    Args:
        checkrun_config: ``EngineConfig``, dict or YAML path (compression, quantization, storage, retention).
        checkrun_storage_options: fsspec options (e.g. an S3 endpoint) for every save/load/remove.
        spread_replicated: spread replicated tensors over ranks when writing (``CheckrunSavePlanner``).
        min_piece_bytes: smallest piece a replicated tensor is cut into (default 16 MiB).
        *args, **kwargs: ``FSDPStrategy``'s.
    """

    def __init__(self, *args: Any, checkrun_config: Any = None, checkrun_storage_options: Optional[dict] = None,
                 spread_replicated: bool = True, min_piece_bytes: Optional[int] = None,
                 state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)
        self._setup_checkrun(checkrun_config, checkrun_storage_options, spread_replicated, min_piece_bytes)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if self._state_dict_type != "sharded":
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        converted = {"model": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self._save_dcp(converted, checkpoint, filepath, storage_options)
        return None

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        if not self._is_ours(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        assert self.model is not None and self.lightning_module is not None
        with _get_sharded_state_dict_context(self.model):
            module_state = {"model": self.model.state_dict()}
            self._load_dcp(module_state, path, weights_only)
            self.model.load_state_dict(module_state["model"], strict=self.lightning_module.strict_loading)
            if self._fitting() and self.optimizers:
                reader = cdcp.CheckrunStorageReader(path, self.checkrun_config, self._options())
                planner = cdcp.CheckrunLoadPlanner(weights_only=weights_only,
                                                   allowed_globals=self.checkrun_config.load.allowed_globals)
                for idx, optim in enumerate(self.optimizers):
                    key = f"optimizer_{idx}"
                    optim_state = load_sharded_optimizer_state_dict(
                        model_state_dict=module_state["model"], optimizer_key=key, storage_reader=reader,
                        planner=planner)
                    optim.load_state_dict(FSDP.optim_state_dict_to_load(
                        optim_state_dict=optim_state[key], model=self.model, optim=optim))
        return self._load_meta(path, weights_only)


class CheckrunModelParallelStrategy(_CheckrunDCP, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose distributed checkpoints (``save_distributed_checkpoint=True``, the
    default) are checkrun DCP checkpoints. Arguments as :class:`CheckrunFSDPStrategy`, plus
    ``ModelParallelStrategy``'s (``data_parallel_size``, ``tensor_parallel_size``, ...)."""

    def __init__(self, *args: Any, checkrun_config: Any = None, checkrun_storage_options: Optional[dict] = None,
                 spread_replicated: bool = True, min_piece_bytes: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup_checkrun(checkrun_config, checkrun_storage_options, spread_replicated, min_piece_bytes)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self._save_dcp(converted, checkpoint, filepath, storage_options)
        return None

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        if not self._is_ours(path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        assert self.model is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(self.model)}
        self._load_dcp(module_state, path, weights_only)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        if self._fitting():
            for idx, optim in enumerate(self.optimizers):
                key = f"optimizer_{idx}"
                optim_state = {key: get_optimizer_state_dict(self.model, optim)}
                self._load_dcp(optim_state, path, weights_only)
                set_optimizer_state_dict(self.model, optim, optim_state_dict=optim_state[key],
                                         options=StateDictOptions(cpu_offload=True))
        return self._load_meta(path, weights_only)
