"""Pickled blobs for the non-plain values of a state (ObjectLeaf), loaded under torch's rules.

Only values the skeleton cannot hold (Enum, Path, numpy, user classes, ...) come here.
Loading follows ``torch.load``'s ``weights_only`` contract: with ``weights_only=True`` a type
outside torch's allow-list is refused unless the caller allow-lists it, and ``map_location``
applies to the tensors inside them as to every other tensor of a load.

A value holding device tensors (a defaultdict of CUDA tensors) is not pickled inside ``save()``:
torch.save would copy each tensor to the host and wait for the device. ``DeferredObject`` pickles
its structure there with the storages left out, stages each storage through the snapshot's copier
(non-blocking, like any device tensor), and builds the torch.save bytes in the background once the
copies are done, each storage tagged with the device it came from (what torch.save would write).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import pickletools
import re
import sys
import threading
import warnings
import zipfile
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import (CheckrunError, ConfigError, CorruptCheckpointError, FormatError, ObjectLoadError,
                      ResourceLimitError, UnsafeLoadError)

__all__ = ["serialize_object", "deserialize_object", "resolve_weights_only", "object_load_bytes",
           "device_storage_bytes", "DeferredObject"]

# torch's extra safe globals are one process-wide set and its context manager removes on exit
# what it added; serialising our loads keeps one thread's exit from revoking another's allowance.
_SAFE_GLOBALS_LOCK = threading.Lock()
_ZIP_MAGIC = b"PK\x03\x04"
#: Starts every central-directory entry of a zip: counting it bounds the entries a parser can build.
_CENTRAL_ENTRY = b"PK\x01\x02"
#: Bytes charged per zip entry: zipfile builds a ZipInfo per entry, ~560 bytes measured (1M entries
#: of one-character names, an 82 MB blob: +536 MiB), so a blob of bare entries costs ~12x its size.
ZIP_ENTRY_COST = 1024
#: What torch's refusal names as missing: a global to allow, or a class it was asked to build (numpy's dtype
#: classes, ``numpy.dtypes.Float32DType``, once ``_reconstruct``, ``ndarray`` and ``dtype`` are allowed).
_NEEDED_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global|but got <class '([^']+)'>")
_BLOCKED_GLOBAL = re.compile(r"GLOBAL (\S+) whose module (\S+) is blocked")
_FORCE, _FORCE_NO = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _env_set(name: str) -> bool:
    return os.getenv(name, "0").lower() in ("1", "y", "yes", "true")  # torch.load's reading of them


def resolve_weights_only(weights_only: bool | None) -> bool:
    """``torch.load``'s rule for ``weights_only``: None (not given) means True; the environment variable
    TORCH_FORCE_WEIGHTS_ONLY_LOAD forces True even over an explicit False, and
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns None (only None) into False, with torch's warning.
    ConfigError when both are set (torch.load refuses too)."""
    force, force_no = _env_set(_FORCE), _env_set(_FORCE_NO)
    if force and force_no:
        raise ConfigError(f"both {_FORCE} and {_FORCE_NO} are set in the environment: set only one (torch.load "
                          "refuses both too)")
    if force:
        return True
    if weights_only is None:
        if force_no:
            warnings.warn(f"checkrun: {_FORCE_NO} is set and weights_only was not given: loading with "
                          "weights_only=False (pickled values are unpickled without restriction, as torch.load "
                          "does)", UserWarning, stacklevel=3)
        return not force_no
    return bool(weights_only)


def serialize_object(obj: Any, key: str | None = None) -> bytes:
    """Pickle ``obj`` with ``torch.save`` (tensors inside it are kept as tensors). An error keeps its type
    (as torch.save raises it) with a note naming ``key``, the value's place in the state."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as exc:
        if key is not None:
            exc.add_note(f"checkrun: while saving the {type(obj).__name__} value at {key!r} (pickled with torch.save)")
        raise
    return buf.getvalue()


def _staged_device(device: torch.device) -> bool:
    """Whether a storage on ``device`` is staged by a copy instead of pickled inside ``save()``."""
    return device.type not in ("cpu", "meta")


def _storage_of(obj: Any) -> tuple[torch.UntypedStorage, torch.dtype | None] | None:
    """``(untyped storage, dtype or None)`` when the pickler meets a storage, else None."""
    if isinstance(obj, torch.storage.TypedStorage):
        return obj._untyped_storage, obj.dtype
    if isinstance(obj, torch.UntypedStorage):
        return obj, None
    return None


class _NullSink:
    def write(self, b: bytes) -> int:
        return len(b)


class _StorageFinder(pickle.Pickler):
    """Walks a value as pickle would (no bytes kept, no storage pickled) and sums the bytes of the
    distinct device storages in it."""

    def __init__(self) -> None:
        super().__init__(_NullSink(), protocol=5, buffer_callback=lambda b: None)  # out of band: no copy
        self.seen: dict[tuple, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        found = _storage_of(obj)
        if found is None:
            return None
        untyped = found[0]
        if _staged_device(untyped.device):
            self.seen[(untyped.device, untyped.data_ptr(), untyped.nbytes())] = untyped.nbytes()
        return 0


def device_storage_bytes(obj: Any) -> int | None:
    """Bytes of the device storages inside ``obj``, or None when it holds none (or cannot be
    pickled: ``serialize_object`` reports that). Runs on the training thread; reads no device."""
    finder = _StorageFinder()
    try:
        finder.dump(obj)
    except Exception:  # noqa: BLE001 - torch.save raises it again, with its own message
        return None
    return sum(finder.seen.values()) if finder.seen else None


class _Snapshotter(pickle.Pickler):
    """Pickles a value's structure; each storage becomes a reference to its staged host copy."""

    def __init__(self, file: io.BytesIO, stage: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(file, protocol=2)
        self.stage = stage
        self.hosts: list[tuple[torch.Tensor, str]] = []
        self._index: dict[tuple, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        found = _storage_of(obj)
        if found is None or found[0].device.type == "meta":
            return None
        untyped, dtype = found
        key = (untyped.device, untyped.data_ptr(), untyped.nbytes())
        idx = self._index.get(key)
        if idx is None:
            src = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
            host = self.stage(src) if _staged_device(untyped.device) else src.clone()
            idx = self._index[key] = len(self.hosts)
            self.hosts.append((host, torch.serialization.location_tag(untyped)))
        return ("checkrun-storage", idx, dtype)


class _Restorer(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, hosts: list[tuple[torch.Tensor, str]]) -> None:
        super().__init__(file)
        self.hosts = hosts

    def persistent_load(self, pid: Any) -> Any:
        _, idx, dtype = pid
        untyped = self.hosts[idx][0].untyped_storage()
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class DeferredObject:
    """A value holding device tensors, snapshotted by ``save()`` and pickled after the copies.

    ``__init__`` (training thread) pickles the structure; ``stage(src)`` must start a copy of the
    flat uint8 device tensor ``src`` into a host buffer and return that buffer (the copier's
    non-blocking copy). ``serialize`` (background, once the copies are done) rebuilds the value on
    the host copies and returns its torch.save bytes, every storage tagged with its source device."""

    def __init__(self, obj: Any, stage: Callable[[torch.Tensor], torch.Tensor]) -> None:
        buf = io.BytesIO()
        pickler = _Snapshotter(buf, stage)
        pickler.dump(obj)
        self._pickle = buf.getvalue()
        self._hosts: list[tuple[torch.Tensor, str]] = pickler.hosts

    def serialize(self) -> bytes:
        """The torch.save bytes (once; the host copies are let go after it)."""
        hosts = self._hosts
        obj = _Restorer(io.BytesIO(self._pickle), hosts).load()
        tags = {h.untyped_storage().data_ptr(): tag for h, tag in hosts if h.numel()}
        with _tagging(tags):
            data = serialize_object(obj)
        self._hosts = []
        return data


# torch.save asks its registered taggers for each storage's location; ours answers only inside
# ``_tagging`` on the calling thread, for the host copies of device storages.
_TAGS = threading.local()
_TAGGER_LOCK = threading.Lock()
_TAGGER_PRIORITY = -1_000_026  # before torch's own "cpu" tagger (10); no tie with another package
_tagger_registered = False


def _tag(storage: Any) -> str | None:
    tags = getattr(_TAGS, "tags", None)
    if not tags:
        return None
    try:
        return tags.get(storage.data_ptr())
    except Exception:  # noqa: BLE001 - a storage without a pointer: not ours
        return None


def _no_restore(storage: Any, location: str) -> None:
    return None  # loading is left to torch's own deserializers


@contextlib.contextmanager
def _tagging(tags: dict[int, str]) -> Iterator[None]:
    global _tagger_registered
    with _TAGGER_LOCK:
        if not _tagger_registered:
            torch.serialization.register_package(_TAGGER_PRIORITY, _tag, _no_restore)
            _tagger_registered = True
    _TAGS.tags = tags
    try:
        yield
    finally:
        _TAGS.tags = None


def _resolve_global(name: str) -> Any:
    """The object named ``module.QualName``, looked up only in modules already imported.

    Uses ``__dict__`` lookups so no module ``__getattr__`` can import anything.
    """
    parts = name.split(".")
    if len(parts) == 1:  # a bare name ("frozenset"), as torch's refusal names builtins
        parts = ["builtins", name]
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
    blocked = _BLOCKED_GLOBAL.search(str(exc))
    if blocked:  # os.system and the like: no allow-list admits them (found by an independent check)
        forced = f" ({_FORCE} is set: it forces weights_only=True)" if _env_set(_FORCE) else ""
        return (f"refusing to load the value at key {key!r} of type {type_name}: unpickling it calls "
                f"{blocked.group(1)}, and torch's weights_only unpickler blocks every global of module "
                f"{blocked.group(2)} (load.allowed_globals cannot allow it). Only weights_only=False loads it, "
                f"which runs that call: do that only if you trust this checkpoint{forced}.")
    match = _NEEDED_GLOBAL.search(str(exc))
    needed = (match.group(1) or match.group(2)) if match else type_name
    also = f" (unpickling it needs {needed})" if needed != type_name else ""
    if "." not in needed:  # torch names builtins bare ("frozenset"); the allow-list takes module.name
        needed = f"builtins.{needed}"
    trust = (f"unset {_FORCE} (it forces weights_only=True) and load it with weights_only=False" if _env_set(_FORCE)
             else "load it with weights_only=False")
    return (f"refusing to load the value at key {key!r} of type {type_name}{also}: weights_only=True "
            f"allows only tensors, plain data and allow-listed types. If you trust this checkpoint, "
            f"{trust}, or allow the type: add {needed!r} to the config's "
            f"load.allowed_globals, or call torch.serialization.add_safe_globals([...]).")


def deserialize_object(data: bytes, *, key: str, type_name: str, weights_only: bool | None,
                       allowed_globals: Sequence[str] = (), map_location: Any = None) -> Any:
    """Load a blob written by :func:`serialize_object`.

    ``weights_only=True`` uses torch's restricted unpickler; ``allowed_globals`` ("module.QualName")
    are allowed for this call only, if their module is already imported (others are ignored with
    a warning). Raises UnsafeLoadError (naming key and type, and how to allow it) when torch
    refuses, CorruptCheckpointError when the blob is not a torch.save archive.
    Safe to call from several threads.
    """
    weights_only = resolve_weights_only(weights_only)  # None and torch's switches, as torch.load reads them
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


def _check_zip(data: bytes, key: str, type_name: str) -> None:
    # serialize_object writes zip archives only; without this check torch's legacy-format path
    # would report random bytes as a weights_only refusal instead of as corruption.
    if not data.startswith(_ZIP_MAGIC):
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a torch.save archive")


def object_load_bytes(data: bytes, *, key: str, type_name: str, max_bytes: int) -> int:
    """Bytes that unpickling the blob ``data`` may allocate: the sizes its zip directory declares
    for its records (torch.load allocates each storage at its declared size) plus ``ZIP_ENTRY_COST``
    per entry. Reads the directory only, before anything is unpickled: ResourceLimitError when that
    exceeds ``max_bytes`` (what the load has left of ``load.max_total_bytes``), FormatError for a
    record torch.save never writes (compressed: a small blob could inflate to any size),
    CorruptCheckpointError when it is no torch.save archive. Any thread."""
    _check_zip(data, key, type_name)
    need = data.count(_CENTRAL_ENTRY) * ZIP_ENTRY_COST  # before zipfile builds an object per entry
    if need <= max_bytes:
        try:
            infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError) as exc:
            raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a valid torch.save "
                                         f"blob: {exc}") from None
        for info in infos:
            name = info.filename[:64]
            if info.compress_type != zipfile.ZIP_STORED:
                raise FormatError(f"value at key {key!r} ({type_name}): record {name!r} is compressed "
                                  f"(zip method {info.compress_type}); torch.save writes stored records only")
            if info.file_size != info.compress_size:
                raise FormatError(f"value at key {key!r} ({type_name}): record {name!r} declares "
                                  f"{info.file_size} bytes but stores {info.compress_size}")
            need += info.file_size
    if need > max_bytes:
        raise ResourceLimitError(f"value at key {key!r} ({type_name}): unpickling it may allocate {need} "
                                 f"bytes, more than the {max_bytes} left of the limit (load.max_total_bytes)")
    return need


def _load(data: bytes, key: str, type_name: str, *, weights_only: bool, map_location: Any) -> Any:
    _check_zip(data, key, type_name)
    try:
        return torch.load(io.BytesIO(data), weights_only=weights_only, map_location=map_location)
    except pickle.UnpicklingError as exc:
        if weights_only:  # torch reports every refusal of its restricted unpickler this way
            raise UnsafeLoadError(_unsafe_message(key, type_name, exc)) from exc
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) cannot be unpickled: "
                                     f"{exc}") from exc
    except RuntimeError as exc:
        if callable(map_location) and "Callable map_location not supported" in str(exc):
            # torch rebuilds tensor subclasses (wrapper subclasses, DTensor) only with a device or None: the
            # engine's rule by a device (the CPU where CUDA is absent); a caller's callable (Lightning passes
            # one by default) cannot apply: said, not dropped in silence
            where = None if torch.cuda.is_available() else "cpu"
            if not getattr(map_location, "engine_default", False):
                warnings.warn(f"checkrun: value at key {key!r} ({type_name}): torch rebuilds this tensor subclass "
                              "only with a device, a dict or None as map_location, not the callable given: placed "
                              f"{'where it was saved' if where is None else 'on the CPU'}", RuntimeWarning,
                              stacklevel=2)
            return _load(data, key, type_name, weights_only=weights_only, map_location=where)
        if weights_only and "weights_only" in str(exc).replace(" ", "_").lower():
            raise UnsafeLoadError(_unsafe_message(key, type_name, exc)) from exc
        _raise_if_rebuild(exc, data, key, type_name)
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a valid torch.save "
                                     f"blob: {exc}") from exc
    except EOFError as exc:
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is truncated") from exc
    except (CheckrunError, MemoryError):
        raise  # checkrun's own (map_location checks) say what is wrong already
    except Exception as exc:  # noqa: BLE001 - a value's own code may raise anything; damage is told apart below
        # what torch.load raises on a well-formed zip with malformed records (a damaged byte order
        # or storage alignment record, say), whose blob checksum was forged or computed after the damage
        _raise_if_rebuild(exc, data, key, type_name)
        raise CorruptCheckpointError(f"value at key {key!r} ({type_name}) is not a valid torch.save "
                                     f"blob: {type(exc).__name__}: {exc}") from exc


def _well_formed(data: bytes) -> bool:
    """Whether the archive's pickle is a complete, valid opcode stream (``pickletools.genops``, which
    calls nothing) and its small records (byte order, alignment, versions) hold what torch.save writes.
    The blob matched its checksum: a failure to load a well-formed one comes from running it (the classes
    and functions it names, map_location), not from damage."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            for name in names:  # torch.save's small records hold exactly these
                base = name.rpartition("/")[2]
                if base == "byteorder" and archive.read(name) not in (b"little", b"big"):
                    return False
                if base in (".storage_alignment", ".format_version", "version") and \
                        not archive.read(name).strip().isdigit():
                    return False
            name = next(n for n in names if n.endswith("/data.pkl") or n == "data.pkl")
            for _ in pickletools.genops(archive.read(name)):
                pass
        return True
    except Exception:  # noqa: BLE001 - anything malformed: not well formed
        return False


#: What torch's archive reader says of a storage record that is missing or of the wrong size: damage.
_RECORD_DAMAGE = ("PytorchStreamReader", "record size", "does not match expected size", "failed locating file")


def _raise_if_rebuild(exc: BaseException, data: bytes, key: str, type_name: str) -> None:
    """ObjectLoadError when torch.load's ``exc`` came from rebuilding a well-formed value in this process
    (a class pickle cannot find, renamed, moved or changed since the save; a ``__setstate__`` or
    ``__init__`` that refuses; a device ``map_location`` cannot give), not from a malformed blob. An intact
    checkpoint was reported as corrupt, with the advice to use an older one (found by independent checks).
    A storage record missing or cut short stays corruption (h154)."""
    if any(text in str(exc) for text in _RECORD_DAMAGE) or not _well_formed(data):
        return
    raise ObjectLoadError(f"value at key {key!r} ({type_name}) could not be rebuilt in this process: "
                          f"{type(exc).__name__}: {exc}. Its bytes are those the save recorded (checksum) and form "
                          "a valid pickle, so the checkpoint is most likely not damaged: the class it names is "
                          "missing or changed since the save, its own code refused (__setstate__), or "
                          "map_location cannot place its tensors on this machine") from exc
