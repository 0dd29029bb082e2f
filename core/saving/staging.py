"""Host staging memory: reusable buffers, a byte budget with backpressure, and the copy itself.

The copy into staging is the only part of a save the training thread waits for. Buffers are reused
across saves (fresh allocations cost ~4x a copy in page faults); for device sources (any non-CPU
tensor) they are carved from one pinned arena per snapshot and filled by non-blocking copies on a
side stream that the training stream then waits on, so training kernels queued after ``save()``
cannot overwrite a tensor before it has been copied (``pinned`` has the backends' side).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from . import pinned as _pinned
from .copier import SPLIT_COPY_BYTES, AfterCopy, Copier  # noqa: F401 - the copy is part of staging

log = logging.getLogger("ckpt_core")

if TYPE_CHECKING:
    from .shm_staging import SharedBuffers

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=None)
def _madvise() -> "ctypes._CFuncPtr | None":
    """libc's ``madvise`` when transparent huge pages are in ``madvise`` mode (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[madvise]" not in f.read():  # "always": the kernel does it; "never": nothing to do
                return None
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for transparent huge pages under a host tensor nothing has touched yet; True if asked.

    Only the 2 MiB-aligned pages inside a tensor of 4 MiB or more are advised (``MADV_HUGEPAGE``),
    and only where the kernel's mode is ``madvise``. Filling such memory then takes one page fault
    per 2 MiB instead of one per 4 KiB (measured: 244 MB filled with 0.03-0.05 s of kernel time
    instead of 0.12-0.16 s). A hint: without it the memory is ordinary memory.
    """
    madvise = _madvise() if t.device.type == "cpu" and t.nbytes >= 2 * _HUGE_PAGE else None
    if madvise is None:
        return False
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    return end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0


def empty_host(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype)`` on the host, on huge pages where offered
    (``advise_huge_pages``): load outputs, load scratch and staging buffers are made with it."""
    # Bytes viewed as dtype: the same memory, without torch's "experimental" warning on complex32.
    t = torch.empty(numel * dtype.itemsize, dtype=torch.uint8).view(dtype)
    advise_huge_pages(t)
    return t


class MemoryBudget:
    """Bytes of staging memory charged by in-flight saves; ``acquire`` blocks while over the limit.

    Charged on the training thread when staging starts, refunded by the background thread after
    the save's blobs are written. A single request larger than the whole budget is admitted when
    nothing else is charged (otherwise it could never run).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            if self.limit is not None:
                self._cond.wait_for(lambda: self.in_use == 0 or self.in_use + nbytes <= self.limit)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= nbytes
            self._cond.notify_all()


_warned_unpinned = False


def _pin_shared(buf: torch.Tensor) -> None:
    """Register a writer process's shared staging buffer for CUDA copies as pinned; if that fails,
    warn once: each copy from the GPU is then synchronous and ``save()`` waits for the GPU queue."""
    global _warned_unpinned
    error = _pinned.register_host(buf)
    if error is not None and not _warned_unpinned:
        _warned_unpinned = True
        log.warning("checkrun: saving.background 'process': shared staging memory could not be pinned "
                    "(%s); copies from the GPU are synchronous, so save() waits for the GPU's queued work. "
                    "Use saving.background 'thread' for GPU training (docs/gpu.md)", error)


@dataclass
class BufferPool:
    """Host staging buffers reused from save to save, keyed by (dtype, numel, pinned).

    Bounded: the pool holds at most ``bound()`` bytes, buffers lent to saves in flight and free ones
    together. Before allocating, it frees the least recently returned free buffers until the new one
    fits (and on ``give`` while over the bound, after a snapshot larger than the budget was admitted
    alone). Only free buffers are freed: a buffer comes back once no worker of its save uses it any
    more, and in a writer process's shared memory only after the writer process answered for it.
    The bound is ``budget.limit`` (``saving.staging_budget_bytes``), or, without a limit, the most
    staging memory charged at once so far (``budget.peak``: the largest snapshot, or the largest
    ``max_pending`` of them in flight together) - what the saves needed, never every size seen.
    Pinned buffers go back to torch's pinned-memory cache, which reuses them for later pinned ones.

    Device sources are staged by ``take_arena``: one pinned allocation per snapshot, of the exact
    size of its device tensors (``pinned.alloc_pinned``), not one per tensor rounded up to a power
    of two by torch's pinned allocator; the arena counts as one buffer here (reused by the next
    snapshot of the same sizes) and comes back once every view of it was given back.

    ``shared``: allocate every buffer there instead (``SharedBuffers``, for a writer process);
    buffers for CUDA sources are then registered as pinned in place (``pinned.register_host``), one
    per tensor (the writer process maps buffers, not views of an arena); if registration fails, a
    warning says once that the copies from the GPU are synchronous. ``allocations`` counts fresh allocations, ``allocated_bytes``
    the bytes the pool holds now, ``peak_bytes`` their maximum, ``evictions`` buffers freed to stay
    within the bound. ``take`` runs on the training thread, ``give`` on the coordinator thread.
    Whether a buffer is pinned is remembered, never asked (``is_pinned()`` can create a CUDA
    context in a CPU-only job)."""

    pin_memory: bool = True
    shared: "SharedBuffers | None" = field(default=None, repr=False)
    budget: "MemoryBudget | None" = field(default=None, repr=False)
    allocations: int = 0
    allocated_bytes: int = 0
    peak_bytes: int = 0
    evictions: int = 0
    # key -> deque of free buffers, oldest first; id(buf) -> (key, buf), oldest first
    _free: dict = field(default_factory=dict, repr=False)
    _lru: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # id(buf) -> (key, buf) of buffers lent by ``take``; id(view) -> its _Arena for ``take_arena``
    _lent: dict = field(default_factory=dict, repr=False)
    _views: dict = field(default_factory=dict, repr=False)
    # id(buf) -> buf: copies ``copy_allocator`` made that ``host_copy`` has not adopted yet
    _unadopted: dict = field(default_factory=dict, repr=False)

    def bound(self) -> int | None:
        """Most bytes the pool may hold (None: no budget object, unbounded)."""
        if self.budget is None:
            return None
        return self.budget.limit if self.budget.limit is not None else self.budget.peak

    def take(self, dtype: torch.dtype, numel: int, for_cuda: bool) -> torch.Tensor:
        """A flat buffer of ``numel`` elements: a free one of that size, else a new one."""
        pinned = for_cuda and self.pin_memory and torch.cuda.is_available()
        key = (dtype, numel, pinned)
        nbytes = numel * dtype.itemsize
        with self._lock:
            buf = self._reuse(key)
            if buf is not None:
                self._lent[id(buf)] = (key, buf)
                return buf
            evicted = self._charge(nbytes)
        self._release(evicted)  # before allocating: the memory is given back first
        try:
            if pinned and self.shared is None:
                buf = torch.empty(numel, dtype=dtype, pin_memory=True)
            else:
                buf = self.new_host(numel, dtype)
                if pinned:
                    _pin_shared(buf)
        except BaseException:
            with self._lock:
                self.allocated_bytes -= nbytes
            raise
        with self._lock:
            self._lent[id(buf)] = (key, buf)
        return buf

    def take_arena(self, specs: list[tuple[torch.dtype, int]], device: torch.device) -> list[torch.Tensor]:
        """Flat buffers of ``(dtype, numel)`` for the tensors of one snapshot copied from ``device``:
        views of one pinned arena (free, of that size, else new), given back one by one with ``give``.
        Without pinning (``pin_memory`` off, shared memory, no backend) or bytes: ``take`` each."""
        offsets, total = _pinned.arena_layout(specs)
        if self.shared is not None and device.type == "cuda":
            return [self.take(dtype, numel, for_cuda=True) for dtype, numel in specs]
        if not (total and self.pin_memory and self.shared is None and _pinned.can_pin(device)):
            return [self.take(dtype, numel, for_cuda=False) for dtype, numel in specs]
        key = ("arena", device.type, total)
        with self._lock:
            arena = self._reuse(key)
            evicted = self._charge(total) if arena is None else []
        if arena is None:
            self._release(evicted)
            try:
                arena = _pinned.alloc_pinned(total, device)
            except BaseException:
                with self._lock:
                    self.allocated_bytes -= total
                raise
        views = [arena[off:off + numel * dtype.itemsize].view(dtype)
                 for off, (dtype, numel) in zip(offsets, specs)]
        lent = _Arena(key, arena, len(views))
        with self._lock:
            for v in views:
                self._views[id(v)] = (lent, v)
        return views

    def _reuse(self, key: tuple) -> torch.Tensor | None:
        """A free buffer of ``key`` taken out of the free lists, or None (lock held)."""
        free = self._free.get(key)
        if not free:
            return None
        buf = free.pop()
        del self._lru[id(buf)]
        if not free:
            del self._free[key]
        return buf

    def _charge(self, nbytes: int) -> list[torch.Tensor]:
        """Count a new allocation of ``nbytes``; the free buffers to release first (lock held)."""
        evicted = self._evict(nbytes)
        self.allocations += 1
        self.allocated_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return evicted

    def new_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer outside the pool (a row stream's own): shared memory where the pool uses it."""
        return self.shared.allocate(numel, dtype) if self.shared is not None else empty_host(numel, dtype)

    def free_host(self, buf: torch.Tensor) -> None:
        """A buffer from ``new_host`` or ``host_copy`` that no save uses any more (a row stream's
        buffer replaced when its tensor changed size): shared memory is released at once."""
        self._release([buf])

    def copy_allocator(self) -> Callable[[int, torch.dtype], torch.Tensor] | None:
        """How a load allocates the copies of the tensors that become row streams (``load_tensors``'s
        ``alloc_copy``; training thread, one load at a time): in shared memory where the pool uses it,
        so that ``host_copy`` adopts them without copying; None (the reader's own memory) otherwise.

        Copies of an earlier load that ``host_copy`` never adopted (that load failed) are released
        first: nothing else refers to them."""
        if self.shared is None:
            return None
        with self._lock:
            stale, self._unadopted = list(self._unadopted.values()), {}
        self._release(stale)
        shared = self.shared

        def alloc(numel: int, dtype: torch.dtype) -> torch.Tensor:
            buf = shared.allocate(numel, dtype)
            with self._lock:
                self._unadopted[id(buf)] = buf
            return buf

        return alloc

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself where it can serve as a row stream's buffer (no shared memory, or a copy
        ``copy_allocator`` made), else a copy of it in shared memory."""
        if self.shared is None:
            return t
        with self._lock:
            if self._unadopted.get(id(t)) is t:
                del self._unadopted[id(t)]
                return t
        out = self.shared.allocate(t.numel(), t.dtype)
        out.copy_(t.reshape(-1))
        return out

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from ``take`` or ``take_arena`` once no save uses it any more."""
        with self._lock:
            view = self._views.pop(id(buf), None)
            if view is not None:
                arena = view[0]
                arena.out -= 1
                if arena.out:
                    return
                key, buf = arena.key, arena.buf
            else:
                key, _ = self._lent.pop(id(buf), ((buf.dtype, buf.numel(), False), None))
            self._free.setdefault(key, deque()).append(buf)
            self._lru[id(buf)] = (key, buf)
            evicted = self._evict(0)
        self._release(evicted)

    def _evict(self, extra: int) -> list[torch.Tensor]:
        """Take least recently returned free buffers out until ``extra`` more bytes fit (lock held)."""
        bound = self.bound()
        out: list[torch.Tensor] = []
        while bound is not None and self._lru and self.allocated_bytes + extra > bound:
            _, (key, buf) = self._lru.popitem(last=False)
            free = self._free[key]
            # Both are in return order and ``take`` pops the newest: the oldest of a key is first.
            i = next(i for i, b in enumerate(free) if b is buf)
            del free[i]
            if not free:
                del self._free[key]
            self.allocated_bytes -= buf.nbytes
            self.evictions += 1
            out.append(buf)
        return out

    def _release(self, buffers: list[torch.Tensor]) -> None:
        if buffers and self.shared is not None:
            self.shared.release(buffers)  # deletes the files; the writer process unmaps them

    def clear(self) -> None:
        """Forget every free buffer (the engine closes: shared files go with their directory)."""
        with self._lock:
            self._free.clear()
            self._lru.clear()
            self._lent.clear()
            self._views.clear()
            self._unadopted.clear()
            self.allocated_bytes = 0


@dataclass
class _Arena:
    """A pinned arena lent to one snapshot: ``out`` views of it not given back yet."""

    key: tuple
    buf: torch.Tensor
    out: int
