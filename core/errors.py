"""The project's exception types. Every error checkrun raises on purpose derives from CheckrunError."""
from __future__ import annotations

import pickle


class CheckrunError(Exception):
    """Base class of every error raised by checkrun."""


class ConfigError(CheckrunError, ValueError):
    """A configuration key is unknown, has the wrong type or an invalid value."""


class StorageError(CheckrunError, OSError):
    """Reading or writing the storage failed (after retries where they apply)."""


class CheckpointNotFoundError(CheckrunError, FileNotFoundError):
    """The path names no committed checkpoint."""


class NotACheckpointError(CheckrunError):
    """The file exists but is not a checkrun manifest (for example a torch.save file)."""


class CorruptCheckpointError(CheckrunError):
    """A manifest or blob is truncated, tampered with, missing or fails its checksum."""


class UnsafePathError(CorruptCheckpointError):
    """A manifest names a blob outside the checkpoint's store (``../``, absolute path, other URL)."""


class FormatError(CorruptCheckpointError):
    """Unknown format version or codec, or a field that does not fit the format."""


class UnsafeLoadError(CheckrunError, pickle.UnpicklingError):
    """Loading a value needs pickle but ``weights_only=True`` and its type is not allow-listed. A
    ``pickle.UnpicklingError``, as torch's ``weights_only`` loading raises there."""


class BackgroundSaveError(CheckrunError):
    """A background save failed; the original exception is the ``__cause__``."""


class CommitRefusedError(CheckrunError):
    """A save wrote its blobs but did not commit its manifest, on purpose (see the subclasses)."""


class SupersededError(CommitRefusedError):
    """The save is older than the manifest of the same name already committed (by another engine or
    process): the newer checkpoint is kept and this save is not committed. ``same_process``: the newer
    one was asked for later in this same process (another engine's save)."""

    same_process: bool = False


class OrphanedWriterError(CommitRefusedError):
    """The writer process's training process died: the writer commits nothing of its saves."""


class ObjectLoadError(CheckrunError):
    """A pickled value's blob is intact (its checksum matches) but rebuilding it failed in this process: the
    class it names is missing or changed since the save, its own code refused (``__setstate__``), or
    ``map_location`` cannot place its tensors. torch.load's own exception is the last in its ``__cause__`` chain."""


class ResourceLimitError(CheckrunError):
    """Reading a checkpoint would need more memory than a configured limit allows
    (``load.max_total_bytes``); the checkpoint itself may be intact."""


class LossyRefusedError(CheckrunError, ValueError):
    """A lossy codec refuses a chunk it cannot quantize faithfully (inf/nan, a range or scale the
    stored parameters cannot hold): the writer stores that tensor lossless instead. Any other
    exception from a codec is a bug and fails the save."""
