"""Path handling shared by the plugin and the callbacks: URLs kept intact, Lightning's special names.

Lightning sometimes hands a remote URL through ``pathlib.Path`` (FSDP's full-state save does
``Path(filepath)``), which collapses ``s3://bucket/x`` into ``s3:/bucket/x``; :func:`normalize_path`
restores the scheme. Names Lightning uses for its own short-lived checkpoints are recognised here.
"""
from __future__ import annotations

import os
import re
from typing import Literal, Union

__all__ = ["normalize_path", "path_key", "checkpoint_kind", "parent_dir", "is_remote", "local_path"]

PathLike = Union[str, "os.PathLike[str]"]
Kind = Literal["regular", "temporary", "hpc"]

# Two or more scheme characters, so that a Windows drive ("C:/") is never taken for a URL.
_COLLAPSED_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/(?!/)")
# ddp_spawn's weights hand-over, the tuner's lr_find / scale_batch_size restore points.
_TEMPORARY = re.compile(r"^(\.temp|\.lr_find_[^/]*|\.scale_batch_size_[^/]*)\.ckpt$")
# SLURM auto-requeue: saved on SIGUSR1 right before the job is requeued.
_HPC = re.compile(r"^hpc_ckpt_\d+\.ckpt$")


def normalize_path(path: PathLike) -> str:
    """``path`` as a string; a URL whose ``//`` a ``pathlib.Path`` collapsed gets it back."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or os.PathLike, not {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError("checkpoint path must be text, not bytes")
    match = _COLLAPSED_URL.match(text) if "://" not in text else None
    if match:  # "file:/abs" is /abs: "file:///abs" (h142: "file://abs" was abs in the working directory)
        slashes = "///" if match.group(1).lower() in ("file", "local") else "//"
        text = f"{match.group(1)}:{slashes}{text[match.end():]}"
    return text


def is_remote(path: str) -> bool:
    """True for fsspec URLs other than ``file://``/``local://``."""
    return "://" in path and not path.startswith(("file://", "local://"))


def local_path(path: PathLike) -> str:
    """The absolute path of a local checkpoint path or ``file://``/``local://`` URL, ``~`` expanded: the
    file fsspec's local filesystem (so the engine, and ``TorchCheckpointIO``) reads and writes."""
    text = normalize_path(path)
    for prefix in ("file://", "local://"):
        text = text.removeprefix(prefix)
    return os.path.abspath(os.path.expanduser(text))


def path_key(path: PathLike) -> str:
    """A stable key for "the same checkpoint file": the local path for local spellings, the URL otherwise."""
    text = normalize_path(path)
    return text if is_remote(text) else local_path(text)


def parent_dir(path: PathLike) -> str:
    """The directory holding the checkpoint ``path``: a URL's for remote ones, else a local path."""
    text = normalize_path(path)
    if is_remote(text):
        return text.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(local_path(text))


def checkpoint_kind(path: PathLike) -> Kind:
    """``"temporary"`` (``.temp.ckpt``, ``.lr_find_*``, ``.scale_batch_size_*``), ``"hpc"`` or ``"regular"``."""
    name = normalize_path(path).rstrip("/").rsplit("/", 1)[-1]
    if _TEMPORARY.match(name):
        return "temporary"
    if _HPC.match(name):
        return "hpc"
    return "regular"
