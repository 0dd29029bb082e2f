"""Drop-in hooks: Lightning's own loaders and ``ModelCheckpoint`` see checkrun checkpoints and saves in flight.

Lightning reads and checks checkpoint files in four places that never reach a ``CheckpointIO`` plugin:

* ``LightningModule/LightningDataModule.load_from_checkpoint`` call ``pl_load`` (Lightning's
  ``lightning.fabric.utilities.cloud_io._load``, imported under that name by
  ``lightning.pytorch.core.saving`` and ``lightning.fabric.plugins.io.torch_io``), i.e. ``torch.load``;
* ``TorchCheckpointIO.load_checkpoint`` (a Trainer or Fabric *without* the plugin) checks ``fs.exists``,
  then calls the same loader;
* ``ModelCheckpoint.file_exists`` decides the ``-vN`` names with ``fs.exists``: an asynchronous save is
  not a file until it commits, so a second save would reuse (overwrite) its name;
* ``ModelCheckpoint._link_checkpoint`` (``save_last="link"``) points ``last.ckpt`` at the top-k file
  just saved: with that save in flight, a kill before its commit left a link to nothing, and
  ``fit(ckpt_path="last")`` started from scratch.

:func:`install` wraps exactly these, once (it runs when ``lightning_ckpt`` is imported and is
idempotent), in ``lightning`` and in the standalone ``pytorch_lightning``/``lightning_fabric`` packages
(``PACKAGES``); each wrapper defers to Lightning's original for anything that is not checkrun's:

* the loader: a path (local or fsspec URL, not http) with a save in flight in this process is waited
  for; a file whose first bytes are a checkrun manifest header is loaded by the engine (every byte
  verified; ``weights_only=None`` means True, torch's default, so nothing is unpickled unless the caller
  opts in). Anything else (a ``torch.save`` file, a file object, an http URL) goes to Lightning's function
  with the same arguments.
* ``TorchCheckpointIO.load_checkpoint``: waits for a save in flight to the path, then runs Lightning's.
* ``ModelCheckpoint.file_exists``: on global rank 0, a path with a save in flight counts as existing
  (the decision is still reduced across ranks, as Lightning's does); otherwise Lightning's check.
* ``ModelCheckpoint._link_checkpoint``: when the plugin's save of the target is in flight, the link is
  swapped (by Lightning's own code) once that save commits, on the engine's thread; until then it keeps
  pointing at the previous, committed checkpoint; if the save fails it stays so, with a warning. The
  barrier across ranks runs at once, as Lightning's does.
* ``LightningCLI._parse_ckpt_path`` (``--ckpt_path FILE`` reads the file's hyper-parameters with a raw
  ``torch.load`` before the Trainer and its plugin exist): during that call its module's ``torch.load``
  reads a checkrun file through checkrun (same ``weights_only``); any other file goes to torch.

:func:`uninstall` restores Lightning's functions. ``torch.load`` itself is not changed: ``torch.load`` of a
manifest fails with "invalid load key, '{'" (docs/troubleshooting.md).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import sys
from types import SimpleNamespace
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint

from ckpt_core import wait_for_save

from .callbacks import find_plugin, in_flight, removal_waiting
from .loading import is_checkrun_file, load_checkpoint_dict
from .paths import normalize_path

__all__ = ["install", "uninstall", "installed"]

log = logging.getLogger("lightning_ckpt")
_ORIGINAL = "__checkrun_original__"
"""Attribute of each wrapper holding the function it replaced (also the idempotency mark)."""


def _is_path(value: Any) -> bool:
    """A path or fsspec URL (what the engine can read); file objects and what Lightning sends to
    ``torch.hub`` (a path starting with "http", its own test) stay Lightning's."""
    return isinstance(value, (str, os.PathLike)) and not str(value).startswith("http")


def _wrap_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        if _is_path(path_or_url):
            path = normalize_path(path_or_url)
            wait_for_save(path)
            if is_checkrun_file(path):
                return load_checkpoint_dict(path, map_location=map_location, weights_only=weights_only,
                                            fallback_to_torch=False)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    return _load


def _wrap_torch_io_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_checkpoint(self: TorchCheckpointIO, path: _PATH, *args: Any, **kwargs: Any) -> Any:
        if _is_path(path):
            wait_for_save(normalize_path(path))  # before Lightning's fs.exists check
        return original(self, path, *args, **kwargs)

    return load_checkpoint


def _wrap_file_exists(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def file_exists(self: ModelCheckpoint, filepath: _PATH, trainer: "pl.Trainer") -> bool:
        if trainer.is_global_zero and removal_waiting(filepath, trainer):
            # removed by ModelCheckpoint, the file (or its save) still there until the saves the removal waits
            # for commit: its name is free, as stock's would be (else "-v1" names depended on timing: an
            # independent check). Same collective as Lightning's own check: the other ranks reduce theirs.
            return trainer.strategy.reduce_boolean_decision(False, all=False)
        if trainer.is_global_zero and in_flight(filepath, trainer):
            return trainer.strategy.reduce_boolean_decision(True, all=False)
        if trainer.is_global_zero and find_plugin(trainer) is not None:
            # checkrun writes through a filesystem object of its own: s3fs answers Lightning's exists() from
            # the listing it cached before those writes, and the "-vN" name was reused, overwriting a
            # committed checkpoint (found by an independent check on S3)
            self._fs.invalidate_cache(str(filepath))
        return original(self, filepath, trainer)

    return file_exists


def _wrap_link_checkpoint(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def _link_checkpoint(trainer: "pl.Trainer", filepath: str, linkpath: str) -> None:
        plugin = find_plugin(trainer) if trainer.is_global_zero else None
        handle = plugin.save_handle(filepath) if plugin is not None else None
        if handle is None:
            return original(trainer, filepath, linkpath)
        # in flight: swapped at its commit, first (before the removal of the top-k file the link points at
        # now, which would dangle in between); done: at once, unless it failed (it may fail before this call)
        handle.add_done_callback(lambda h: _relink(original, h, filepath, linkpath), first=True)
        trainer.strategy.barrier()
        return None

    return _link_checkpoint


def _relink(original: Callable[..., None], handle: Any, filepath: str, linkpath: str) -> None:
    """Lightning's link swap, on global rank 0 alone (no barrier: the ranks passed theirs), once the save of
    ``filepath`` is done; if it failed, the link keeps pointing at the previous checkpoint."""
    if handle.failed():
        log.warning("lightning_ckpt: kept %s as it was: the save of %s, which it was to point at, failed", linkpath, filepath)
        return
    alone = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda *a, **k: None))
    original(alone, filepath, linkpath)


class _TorchReadingCheckrun:
    """``torch`` as ``LightningCLI._parse_ckpt_path`` sees it during that call: its ``torch.load`` of
    ``--ckpt_path`` (to read the model's hyper-parameters) reads a checkrun file through checkrun, with
    the caller's ``weights_only``; every other attribute and file is torch's."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and _is_path(f):
            path = normalize_path(f)
            wait_for_save(path)
            if is_checkrun_file(path):
                return load_checkpoint_dict(path, map_location=kwargs.get("map_location"),
                                            weights_only=kwargs.get("weights_only"), fallback_to_torch=False)
        return self._torch.load(f, *args, **kwargs)


def _wrap_cli_parse_ckpt_path(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _parse_ckpt_path(self: Any) -> None:
        module = sys.modules[original.__module__]
        torch_module = module.torch
        module.torch = _TorchReadingCheckrun(torch_module)
        try:
            return original(self)
        finally:
            module.torch = torch_module

    return _parse_ckpt_path


PACKAGES = (("lightning.fabric", "lightning.pytorch"), ("lightning_fabric", "pytorch_lightning"))
"""(Fabric, Trainer) packages hooked: ``lightning``'s, and the standalone ``lightning_fabric`` and
``pytorch_lightning`` (``import pytorch_lightning as pl``: the same code under other names, with classes
of their own), where installed (``lightning`` installs them)."""


def _targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    """(owner, attribute, wrapper factory) of every hook, in every package of ``PACKAGES`` that imports.
    A package's three loader names share one wrapper. Importing a package points Lightning's shared
    rank-zero logger (``lightning_utilities``) at that package's: it is pointed back afterwards, so a
    user who silenced ``lightning.pytorch`` does not see its messages again under ``pytorch_lightning``'s
    logger (found by an independent check)."""
    shared = sys.modules.get("lightning_utilities.core.rank_zero")
    before = getattr(shared, "log", None)
    try:
        return _import_targets()
    finally:
        if before is not None:
            shared.log = before


def _import_targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    targets = []
    for fabric, pytorch in PACKAGES:
        try:
            cloud_io = importlib.import_module(f"{fabric}.utilities.cloud_io")
            torch_io = importlib.import_module(f"{fabric}.plugins.io.torch_io")
            saving = importlib.import_module(f"{pytorch}.core.saving")
            checkpoint = importlib.import_module(f"{pytorch}.callbacks").ModelCheckpoint
        except ImportError:  # a standalone package that is not installed
            continue
        targets += [(cloud_io, "_load", _wrap_loader), (saving, "pl_load", _wrap_loader),
                    (torch_io, "pl_load", _wrap_loader), (torch_io.TorchCheckpointIO, "load_checkpoint",
                                                          _wrap_torch_io_load),
                    (checkpoint, "file_exists", _wrap_file_exists)]
        if hasattr(checkpoint, "_link_checkpoint"):  # save_last="link" (Lightning >= 2.4)
            targets.append((checkpoint, "_link_checkpoint", _wrap_link_checkpoint))
        cli = getattr(sys.modules.get(f"{pytorch}.cli"), "LightningCLI", None)
        if cli is None:
            try:  # LightningCLI's module imports without jsonargparse (an extra); skip it if it does not
                cli = importlib.import_module(f"{pytorch}.cli").LightningCLI
            except Exception:  # noqa: BLE001 - no CLI: nothing to hook there
                cli = None
        if cli is not None and hasattr(cli, "_parse_ckpt_path"):
            targets.append((cli, "_parse_ckpt_path", _wrap_cli_parse_ckpt_path))
    return targets


def install() -> None:
    """Install every hook that is not installed yet (idempotent; called when ``lightning_ckpt`` is imported)."""
    wrapped: dict[int, Callable[..., Any]] = {}
    for owner, name, factory in _targets():
        current = getattr(owner, name)
        if getattr(current, _ORIGINAL, None) is not None:
            continue
        wrapper = wrapped.get(id(current))
        if wrapper is None:
            wrapper = wrapped[id(current)] = factory(current)
            setattr(wrapper, _ORIGINAL, current)
        setattr(owner, name, staticmethod(wrapper) if _static(owner, name) else wrapper)


def uninstall() -> None:
    """Put Lightning's original functions back (``install`` puts the hooks in again)."""
    for owner, name, _ in _targets():
        original = getattr(getattr(owner, name), _ORIGINAL, None)
        if original is not None:
            setattr(owner, name, staticmethod(original) if _static(owner, name) else original)


def _static(owner: Any, name: str) -> bool:
    return isinstance(owner, type) and isinstance(inspect.getattr_static(owner, name), staticmethod)


def installed() -> bool:
    """Whether every hook is in place."""
    return all(getattr(getattr(owner, name), _ORIGINAL, None) is not None for owner, name, _ in _targets())
