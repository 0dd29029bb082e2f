"""Device backends for staging copies: their stream API, their events, and pinned host memory.

Every non-CPU tensor is a device tensor. A backend with streams and events (``torch.cuda``,
``torch.xpu``, a plug-in such as ``torch.hpu``) gets the side-stream copy into pinned memory; one
without (``mps``) gets a synchronous copy on the calling thread. Nothing here touches a device
unless a tensor of that device is being saved or loaded: a CPU-only job never creates a context.

Untested on GPU hardware until ``benchmarks/gpu_check.py`` has run on one (``docs/gpu.md``).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

log = logging.getLogger("ckpt_core")

_STREAM_API = ("Stream", "current_stream", "stream", "Event")

#: Pinned allocations below this size come from torch's pinned-memory cache (rounded up to a power
#: of two there, which costs little at this size); larger ones are registered at their exact size.
_REGISTER_MIN_BYTES = 1 << 20


def device_module(device_type: str) -> Any | None:
    """The backend module of ``device_type`` if it has streams and events (``torch.cuda``,
    ``torch.xpu``, ...), else None (``mps``, ``meta``): copies from it are then synchronous."""
    if device_type == "cpu":
        return None
    mod = torch.cuda if device_type == "cuda" else getattr(torch, device_type, None)
    if mod is None or not all(hasattr(mod, name) for name in _STREAM_API):
        return None
    try:
        return mod if mod.is_available() else None
    except Exception:  # noqa: BLE001 - a backend that cannot say: treat as without streams
        return None


def new_event(mod: Any) -> Any:
    """An event of backend ``mod`` whose ``synchronize`` blocks the waiting thread instead of
    spinning a core (``cudaEventBlockingSync``), where the backend offers it."""
    try:
        return mod.Event(blocking=True)
    except TypeError:
        return mod.Event()


def can_pin(device: torch.device) -> bool:
    """Whether host memory can be pinned for copies from ``device`` (its backend is present)."""
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device_module(device.type) is not None


def alloc_pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of pinned host memory (a flat uint8 tensor) for copies from ``device``.

    CUDA: ordinary host memory of exactly ``nbytes``, registered with ``cudaHostRegister`` and
    unregistered when its storage is freed (torch's pinned allocator would round it up to a power
    of two: up to 2x). Small sizes, other backends, or a failed registration: torch's pinned
    allocator. Raises what torch raises when no pinned memory can be had at all."""
    if device.type == "cuda" and nbytes >= _REGISTER_MIN_BYTES:
        t = _registered(nbytes)
        if t is not None:
            return t
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _registered(nbytes: int) -> torch.Tensor | None:
    from .staging import empty_host  # staging imports this module

    t = empty_host(nbytes, torch.uint8)
    error = register_host(t)
    if error is not None:
        log.debug("checkrun: cudaHostRegister of %d bytes failed (%s); using torch's pinned allocator",
                  nbytes, error)
        return None
    return t


def register_host(t: torch.Tensor) -> str | None:
    """Pin the host memory of ``t``'s storage in place (``cudaHostRegister``), so that copies from a
    CUDA device into it are asynchronous; unregistered when the storage is freed. Used for memory
    torch's pinned allocator cannot give: exact-size arenas, and the shared-memory buffers of a
    writer process (``saving.background: process``). Returns None when pinned, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        from torch.cuda import _pin_memory_utils as pin_utils  # what DCP's stager uses
    except ImportError as exc:
        return str(exc)
    storage = t.untyped_storage()
    try:
        pin_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    except (RuntimeError, AttributeError) as exc:
        return str(exc)
    # Unregistered when the memory goes (the storage outlives every view of it), never at exit:
    # the CUDA context may be gone by then.
    weakref.finalize(storage, pin_utils.unpin_memory, storage.data_ptr()).atexit = False
    return None


def arena_layout(specs: list[tuple[torch.dtype, int]], align: int = 64) -> tuple[list[int], int]:
    """Byte offsets of flat buffers of ``(dtype, numel)`` packed in one arena (each start aligned
    to ``align`` bytes, a cache line), and the arena's size."""
    offsets, pos = [], 0
    for dtype, numel in specs:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += numel * dtype.itemsize
    return offsets, pos
