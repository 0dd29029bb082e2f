"""``load_from_checkpoint``: ``LightningModule/LightningDataModule.load_from_checkpoint`` for checkrun files.

Lightning's ``load_from_checkpoint`` reads the file with ``torch.load`` (``pl_load``), not through the
Trainer's ``CheckpointIO``, so it cannot read a checkrun checkpoint (a JSON manifest). This function
loads it with the engine and then hands the dict to the same Lightning code that builds the object
(``_load_state``: hyper-parameters, ``strict`` loading, the datamodule's ``load_state_dict``).
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH
from lightning.pytorch.core.saving import _default_map_location, _load_state, load_hparams_from_tags_csv, \
    load_hparams_from_yaml
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

from ckpt_core import CheckpointEngine, EngineConfig

from .config import build_config
from .paths import normalize_path

__all__ = ["load_from_checkpoint", "load_checkpoint_dict"]

T = TypeVar("T", "pl.LightningModule", "pl.LightningDataModule")


def load_checkpoint_dict(path: _PATH, map_location: _MAP_LOCATION_TYPE = None, weights_only: Optional[bool] = None,
                         config: Union[str, dict, EngineConfig, None] = None,
                         storage_options: Optional[dict] = None) -> dict[str, Any]:
    """The raw checkpoint dict at ``path`` (verified); ``weights_only=None`` means True."""
    cfg = build_config(config, storage_options=storage_options)
    with CheckpointEngine(cfg) as engine:
        return engine.load(normalize_path(path), map_location=map_location,
                           weights_only=True if weights_only is None else weights_only)


def load_from_checkpoint(cls: type[T], checkpoint_path: _PATH, map_location: _MAP_LOCATION_TYPE = None,
                         hparams_file: Optional[_PATH] = None, strict: Optional[bool] = None,
                         weights_only: Optional[bool] = None, *,
                         config: Union[str, dict, EngineConfig, None] = None,
                         storage_options: Optional[dict] = None, **kwargs: Any) -> T:
    """Build ``cls`` (a LightningModule or LightningDataModule class) from a checkrun checkpoint.

    Same arguments and behaviour as ``cls.load_from_checkpoint`` (``kwargs`` override saved
    hyper-parameters), plus ``config``/``storage_options`` for the engine (e.g. an S3 endpoint).
    A LightningModule is moved to the device of its saved tensors after ``map_location``.
    """
    if not (isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise TypeError(f"cls must be a LightningModule or LightningDataModule class, got {cls!r}")
    path = normalize_path(checkpoint_path)
    checkpoint = load_checkpoint_dict(path, map_location=map_location or _default_map_location,
                                      weights_only=weights_only, config=config, storage_options=storage_options)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    if hparams_file is not None:
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = _read_hparams_file(hparams_file)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model


def _read_hparams_file(hparams_file: _PATH) -> Any:
    extension = str(hparams_file).rsplit(".", 1)[-1].lower()
    if extension == "csv":
        return load_hparams_from_tags_csv(hparams_file)
    if extension in ("yml", "yaml"):
        return load_hparams_from_yaml(hparams_file)
    raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
