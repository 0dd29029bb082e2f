"""``load_from_checkpoint``: ``LightningModule/LightningDataModule.load_from_checkpoint`` with engine options.

Lightning's ``load_from_checkpoint`` reads the file with ``pl_load``, not through the Trainer's
``CheckpointIO``; once ``lightning_ckpt`` is imported, that loader reads checkrun checkpoints with the
default engine settings (``lightning_ckpt.dropin``). This function does the same with an engine
``config`` and ``storage_options`` (an S3 endpoint), then hands the dict to the same Lightning code that
builds the object (``_load_state``: hyper-parameters, ``strict`` loading, the datamodule's
``load_state_dict``). Like the plugin, it loads a ``torch.save`` checkpoint with ``torch.load``.
"""
from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

import fsspec
import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH
from lightning.pytorch.core.saving import _default_map_location, _load_state, load_hparams_from_tags_csv, \
    load_hparams_from_yaml
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

from ckpt_core import CheckpointEngine, CorruptCheckpointError, EngineConfig, NotACheckpointError
from ckpt_core.format.manifest import is_manifest_head, looks_damaged
from ckpt_core.storage.options import open_options

from .config import build_config
from .paths import normalize_path

__all__ = ["load_from_checkpoint", "load_checkpoint_dict", "is_checkrun_file", "torch_load"]

_HEAD_BYTES = 64

T = TypeVar("T", "pl.LightningModule", "pl.LightningDataModule")


def is_checkrun_file(path: _PATH, storage_options: Optional[dict] = None) -> bool:
    """Whether the file at ``path`` starts with a checkrun manifest header, or is a damaged checkrun
    manifest (``looks_damaged``: its header damaged, or zeroed); reads its first bytes only.

    False for a missing file or a directory: the caller's own loader then reports it as it always did.
    """
    url = normalize_path(path)
    fs, fspath = fsspec.core.url_to_fs(url, **open_options(url, storage_options))
    try:
        head = fs.cat_file(fspath, start=0, end=_HEAD_BYTES)
    except (OSError, ValueError):  # missing, a directory, unreadable: not ours to report
        return False
    return is_manifest_head(head) or looks_damaged(head)  # h106: a zeroed one went to torch.load, whose
    # error advised weights_only=False


def torch_load(path: _PATH, map_location: _MAP_LOCATION_TYPE = None, weights_only: Optional[bool] = None,
               storage_options: Optional[dict] = None) -> Any:
    """``torch.load`` of a ``torch.save`` file at ``path`` (local or fsspec URL with ``storage_options``).

    ``weights_only=None`` means True (torch's default since 2.6, and its environment switches): nothing
    is unpickled unless asked for.
    """
    url = normalize_path(path)
    fs, fspath = fsspec.core.url_to_fs(url, **open_options(url, storage_options))
    with fs.open(fspath, "rb") as f:
        if not f.read(1):  # torch.load's error would be a bare EOFError
            raise NotACheckpointError(f"{url}: an empty file: not a checkpoint (a crash or the storage may have "
                                      "emptied it)")
        f.seek(0)
        return torch.load(f, map_location=map_location, weights_only=weights_only)


def _lightning_default(map_location: Any) -> bool:
    """Whether ``map_location`` is ``_default_map_location`` of ``lightning.pytorch`` or of the standalone
    ``pytorch_lightning`` (two objects; the drop-in serves both)."""
    return (getattr(map_location, "__name__", None) == "_default_map_location"
            and getattr(map_location, "__module__", None) in ("lightning.pytorch.core.saving", "pytorch_lightning.core.saving"))


def load_checkpoint_dict(path: _PATH, map_location: _MAP_LOCATION_TYPE = None, weights_only: Optional[bool] = None,
                         config: Union[str, dict, EngineConfig, None] = None,
                         storage_options: Optional[dict] = None, fallback_to_torch: bool = True) -> dict[str, Any]:
    """The raw checkpoint dict at ``path`` (verified; waits for a save to it in flight in this process).

    ``weights_only=None`` means True (as in ``torch.load``). With ``fallback_to_torch``, a file that is not a checkrun manifest
    (a ``torch.save`` checkpoint, of any size) is read with :func:`torch_load` instead.
    """
    cfg = build_config(config, storage_options=storage_options)
    url = normalize_path(path)
    with CheckpointEngine(cfg) as engine:
        try:  # Lightning's default (saved device; MPS to the CPU where absent) is the engine's own rule
            return engine.load(url, map_location=None if _lightning_default(map_location) else map_location,
                               weights_only=weights_only)
        except (NotACheckpointError, CorruptCheckpointError):
            # A torch file over the manifest size limit is refused as an oversized manifest.
            if not fallback_to_torch or is_checkrun_file(url, cfg.storage.storage_options):
                raise
    return torch_load(url, map_location=map_location, weights_only=weights_only,
                      storage_options=cfg.storage.storage_options)


def load_from_checkpoint(cls: type[T], checkpoint_path: _PATH, map_location: _MAP_LOCATION_TYPE = None,
                         hparams_file: Optional[_PATH] = None, strict: Optional[bool] = None,
                         weights_only: Optional[bool] = None, *,
                         config: Union[str, dict, EngineConfig, None] = None,
                         storage_options: Optional[dict] = None, **kwargs: Any) -> T:
    """Build ``cls`` (a LightningModule or LightningDataModule class) from a checkrun checkpoint.

    Same arguments and behaviour as ``cls.load_from_checkpoint`` (``kwargs`` override saved
    hyper-parameters), plus ``config``/``storage_options`` for the engine (e.g. an S3 endpoint).
    A LightningModule is moved to the device of its saved tensors after ``map_location``. A
    ``torch.save`` checkpoint (from ``TorchCheckpointIO``) is loaded with ``torch.load``.
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
