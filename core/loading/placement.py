"""Where a load puts each tensor: torch.load's ``map_location`` semantics, and the copies to devices.

Every tensor a load returns goes through ``map_location`` - the engine's own tensors here, tensors
inside pickled values through torch.load with ``object_map_location``. Copies to a CUDA device go
through two small pinned bounce buffers, non-blocking on the device's current stream, with one wait
per device at the end (``Placer.finish``); a callable ``map_location``'s result is the tensor's
storage, used as it is (torch.load does the same), never copied again.

Runs on the thread that loads. The CUDA path is untested on GPU hardware until
``benchmarks/gpu_check.py`` has run on one (``docs/gpu.md``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import CheckrunError
from ..saving.pinned import new_event

#: Bytes of each of the two pinned bounce buffers of a CUDA copy (powers of two: no rounding waste).
BOUNCE_BYTES = 16 << 20

# Device counts of the backends a manifest may name (``manifest_limits.DEVICE_TYPES``), 0 if absent.
_BACKENDS: dict[str, Callable[[], int]] = {
    "cuda": lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0,
    "mps": lambda: int(torch.backends.mps.is_available()),
    "xpu": lambda: torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0,
}


def restore_device(saved: str) -> str:
    """Where ``map_location=None`` puts a tensor saved from ``saved``: there, or the CPU on a machine
    without that backend at all (a CUDA checkpoint read on a CPU-only machine)."""
    device = torch.device(saved)
    count = _BACKENDS.get(device.type, lambda: -1)()
    if count == 0:
        return "cpu"
    if count > 0 and device.index is not None and device.index >= count:
        raise CheckrunError(f"tensor saved from {saved}, but this machine has {count} {device.type} "
                            "device(s): pass map_location")
    return saved


def object_map_location(map_location: Any) -> Any:
    """The ``map_location`` to give torch.load for pickled values: the caller's, or for None the
    engine's own rule (``restore_device``: the CPU where the saving backend is absent)."""
    if isinstance(map_location, (str, torch.device)):
        usable_device(torch.device(map_location))
    if map_location is not None:
        return map_location

    def restore(storage: Any, location: str) -> Any:
        return storage if restore_device(location) == "cpu" else None  # None: torch's default

    restore.engine_default = True  # type: ignore[attr-defined]  # objects._load: the rule, not a caller's
    return restore


def target_device(saved: str, map_location: Any) -> torch.device:
    """Where a tensor saved from ``saved`` goes, for every ``map_location`` but a callable."""
    if map_location is None:
        return torch.device(restore_device(saved))
    if isinstance(map_location, dict):  # an unmapped location is restored like a saved one; a mapped one
        # must exist, as torch.load requires (it fell back to the CPU in silence: found by an independent check)
        return usable_device(_named(map_location[saved])) if saved in map_location else \
            torch.device(restore_device(saved))
    return usable_device(_named(map_location))


def _named(value: Any) -> torch.device:
    """``torch.device(value)``; a clear error for what names no device (torch's RuntimeError lists them all)."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise CheckrunError(f"map_location {value!r} names no device: {exc}") from None


def usable_device(device: torch.device) -> torch.device:
    """``device`` if this process can put tensors there; a clear error for a ``map_location`` naming
    a backend this machine lacks or a device index beyond its count (torch would fail deep inside
    the copy, naming neither)."""
    count = _BACKENDS.get(device.type, lambda: -1)()
    if count == 0:
        raise CheckrunError(f"map_location {str(device)!r}: this machine has no {device.type} device "
                            "(load with map_location='cpu')")
    if count > 0 and device.index is not None and device.index >= count:
        raise CheckrunError(f"map_location {str(device)!r}: this machine has {count} {device.type} device(s)")
    return device


def _storage_device(result: Any) -> torch.device:
    if not isinstance(result, (torch.UntypedStorage, torch.storage.TypedStorage, torch.Tensor)):
        raise CheckrunError(f"map_location returned a {type(result).__name__}: a callable map_location "
                            "must return a storage (or None), as with torch.load")
    return result.device


def _from_storage(t: torch.Tensor, result: Any) -> torch.Tensor:
    """``t``'s values on the storage a callable ``map_location`` returned (``t`` if it is t's)."""
    _storage_device(result)  # refuses what is not a storage
    if isinstance(result, torch.storage.TypedStorage):
        result = result._untyped_storage
    elif isinstance(result, torch.Tensor):
        result = result.untyped_storage()
    own = t.untyped_storage()
    if result.nbytes() != own.nbytes():
        raise CheckrunError(f"map_location returned a storage of {result.nbytes()} bytes for one of "
                            f"{own.nbytes()} bytes")
    if result.device == own.device and result.data_ptr() == own.data_ptr():
        return t
    out = torch.empty(0, dtype=t.dtype, device=result.device)
    return out.set_(result, t.storage_offset(), t.shape, t.stride())


def map_location_tensor(t: torch.Tensor, saved_device: str, map_location: Any) -> torch.Tensor:
    """Apply torch.load's ``map_location`` semantics to one CPU tensor saved from ``saved_device``
    (a plain ``.to``; ``Placer`` batches the copies of a whole load).

    A tensor without elements (such as the engine's probe of where a tensor will land, made before
    its values are decoded) gives a callable an empty storage: nothing is copied for it."""
    if callable(map_location):
        if t.numel() == 0:
            result = map_location(torch.UntypedStorage(0), saved_device)
            if result is None:
                return map_location_tensor(t, saved_device, None)
            return torch.empty(t.shape, dtype=t.dtype, device=_storage_device(result))
        result = map_location(t.untyped_storage(), saved_device)
        return map_location_tensor(t, saved_device, None) if result is None else _from_storage(t, result)
    target = target_device(saved_device, map_location)
    return t if target.type == "cpu" else t.to(target)


class Placer:
    """Places the host tensors of one load where ``map_location`` says (calling thread).

    ``place`` returns each tensor (on a CUDA device: allocated, its copy queued); ``finish`` waits
    once per device used, after which every tensor placed is ready on any stream."""

    def __init__(self, map_location: Any) -> None:
        self.map_location = map_location
        self._uploads: dict[torch.device, _Upload] = {}

    def place(self, t: torch.Tensor, saved_device: str) -> torch.Tensor:
        ml = self.map_location
        if callable(ml):
            result = ml(t.untyped_storage(), saved_device)
            if result is not None:
                return _from_storage(t, result)
            target = target_device(saved_device, None)
        else:
            target = target_device(saved_device, ml)
        if target.type == "cpu":
            return t
        if target.type == "cuda" and torch.cuda.is_available():
            if target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
            upload = self._uploads.get(target)
            if upload is None:
                upload = self._uploads[target] = _Upload(target)
            return upload.copy(t)
        return t.to(target)

    def finish(self) -> None:
        uploads, self._uploads = self._uploads, {}
        for upload in uploads.values():
            upload.finish()


class _Upload:
    """Host-to-device copies to one CUDA device through two pinned bounce buffers: the host copy
    into one overlaps the DMA out of the other; an event per chunk says when a buffer is free."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = [None, None]
        self._next = 0

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        n = t.numel() * t.element_size()
        if n == 0:
            return out
        src = t.contiguous().reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            for off in range(0, n, BOUNCE_BYTES):
                size = min(BOUNCE_BYTES, n - off)
                buf = self._buffer(size)
                buf[:size].copy_(src[off:off + size])
                dst[off:off + size].copy_(buf[:size], non_blocking=True)
                event = new_event(torch.cuda)
                event.record(stream)
                self._events[self._next] = event
                self._next ^= 1
        return out

    def _buffer(self, size: int) -> torch.Tensor:
        """The next bounce buffer, once the copy out of it queued last time is done."""
        if len(self._bufs) < 2:
            self._bufs.append(torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True))
        event = self._events[self._next]
        if event is not None:
            event.synchronize()  # a blocking event: this thread sleeps, no core spins
        return self._bufs[self._next]

    def finish(self) -> None:
        if self._bufs:  # copies were queued (not after a failed first allocation on the device)
            torch.cuda.current_stream(self.device).synchronize()
