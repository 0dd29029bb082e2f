"""Pickled blobs for the non-plain values of a state (ObjectLeaf), loaded under torch's rules.

Only values the skeleton cannot hold (Enum, Path, numpy, user classes, ...) come here.
Loading follows ``torch.load``'s ``weights_only`` contract: with ``weights_only=True`` a type
outside torch's allow-list is refused unless the caller allow-lists it.
"""
from __future__ import annotations

import io
import pickle
import re
import sys
import threading
import warnings
from typing import Any, Sequence

import torch

from .errors import CorruptCheckpointError, UnsafeLoadError

__all__ = ["serialize_object", "deserialize_object"]

# torch's extra safe globals are one process-wide set and its context manager removes on exit
# what it added; serialising our loads keeps one thread's exit from revoking another's allowance.
_SAFE_GLOBALS_LOCK = threading.Lock()
_ZIP_MAGIC = b"PK\x03\x04"
_NEEDED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


def serialize_object(obj: Any) -> bytes:
    """Pickle ``obj`` with ``torch.save`` (tensors inside it are kept as tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _resolve_global(name: str) -> Any:
    """The object named ``module.QualName``, looked up only in modules already imported.

    Uses ``__dict__`` lookups so no module ``__getattr__`` can import anything.
    """
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        obj = sys.modules.get(".".join(parts[:split]))
        if obj is None:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, "__dict__", {}).get(attr)
            if obj is None:
                return None
        return obj if callable(obj) else None
    return None


def _resolve_globals(names: Sequence[str]) -> list[Any]:
    resolved = []
    for name in names:
        obj = _resolve_global(name) if isinstance(name, str) else None
        if obj is None:
            warnings.warn(f"load.allowed_globals: {name!r} is not a class or function of an already "
                          "imported module; ignored (import its module before loading)",
                          RuntimeWarning, stacklevel=3)
        else:
            resolved.append(obj)
    return resolved


def _unsafe_message(key: str, type_name: str, exc: BaseException) -> str:
    match = _NEEDED_GLOBAL.search(str(exc))
    needed = match.group(1) if match else type_name
    also = f" (unpickling it needs {needed})" if needed != type_name else ""
    return (f"refusing to load the value at key {key!r} of type {type_name}{also}: weights_only=True "
            f"allows only tensors, plain data and allow-listed types. If you trust this checkpoint, "
            f"load it with weights_only=False, or allow the type: add {needed!r} to the config's "
            f"load.allowed_globals, or call torch.serialization.add_safe_globals([...]).")


def deserialize_object(data: bytes, *, key: str, type_name: str, weights_only: bool,
                       allowed_globals: Sequence[str] = (), map_location: Any = None) -> Any:
    """Load a blob written by :func:`serialize_object`.

    ``weights_only=True`` uses torch's restricted unpickler; ``allowed_globals`` ("module.QualName")
    are allowed for this call only, if their module is already imported (others are ignored with
    a warning). Raises UnsafeLoadError (naming key and type, and how to allow it) when torch
    refuses, CorruptCheckpointError when the blob is not a torch.save archive.
    Safe to call from several threads.
    """
    if not weights_only:
        return _load(data, key, type_name, weights_only=False, map_location=map_location)
    extra = _resolve_globals(allowed_globals)
    with _SAFE_GLOBALS_LOCK:
        # Only add what is not allowed yet: leaving the context removes what it added, which
        # would otherwise revoke the user's own add_safe_globals entries.
        already = torch.serialization.get_safe_globals()
        new = [g for g in extra if g not in already]
        with torch.serialization.safe_globals(new):
            return _load(data, key, type_name, weights_only=True, map_location=map_location)


def _load(data: bytes, key: str, type_name: str, *, weights_only: bool, map_location: Any) -> Any:
    # serialize_object writes zip archives only; without this check torch's legacy-format path
    # would report random bytes as a weights_only refusal instead of as corruption.
    if not data.startswith(_ZIP_MAGIC):
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a torch.save archive")
    try:
        return torch.load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    except pickle.UnpicklingError as exc:
        if weights_only:  # torch reports every refusal of its restricted unpickler this way
            raise UnsafeLoadError(_unsafe_message(key, type_name, exc)) from exc
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) cannot be unpickled: "
                                     f"{exc}") from exc
    except RuntimeError as exc:
        if weights_only and "weights_only" in str(exc).replace(" ", "_").lower():
            raise UnsafeLoadError(_unsafe_message(key, type_name, exc)) from exc
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a valid torch.save "
                                     f"blob: {exc}") from exc
    except EOFError as exc:
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is truncated") from exc
