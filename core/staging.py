"""Host staging memory: reusable buffers, a byte budget with backpressure, and the copy itself.

The copy into staging is the only part of a save the training thread waits for. Buffers are reused
across saves (fresh allocations cost ~4x a copy in page faults); for CUDA sources they are pinned and
filled by non-blocking copies on a side stream that the training stream then waits on, so training
kernels queued after ``save()`` cannot overwrite a tensor before it has been copied.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import shutil
import sys
import tempfile
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .errors import StorageError

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
    t = torch.empty(numel, dtype=dtype)
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


@dataclass
class BufferPool:
    """Free host buffers keyed by (dtype, numel, pinned); ``allocations`` counts fresh allocations.

    ``shared``: allocate every buffer there instead (``SharedBuffers``, for a writer process);
    such buffers are never pinned."""

    pin_memory: bool = True
    shared: "SharedBuffers | None" = None
    allocations: int = 0
    allocated_bytes: int = 0
    _free: dict = field(default_factory=lambda: defaultdict(list))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, dtype: torch.dtype, numel: int, for_cuda: bool) -> torch.Tensor:
        pinned = for_cuda and self.pin_memory and self.shared is None and torch.cuda.is_available()
        with self._lock:
            free = self._free[(dtype, numel, pinned)]
            if free:
                return free.pop()
            self.allocations += 1
            buf = torch.empty(numel, dtype=dtype, pin_memory=True) if pinned else self.new_host(numel, dtype)
            self.allocated_bytes += buf.nbytes
            return buf

    def new_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer outside the pool (a row stream's own): shared memory where the pool uses it."""
        return self.shared.allocate(numel, dtype) if self.shared is not None else empty_host(numel, dtype)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or a copy of it in shared memory where the pool uses shared memory."""
        if self.shared is None:
            return t
        out = self.shared.allocate(t.numel(), t.dtype)
        out.copy_(t.reshape(-1))
        return out

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free[(buf.dtype, buf.numel(), buf.is_pinned())].append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.allocated_bytes = 0


#: Host copies at least this large are split in two, the second half copied by a helper thread.
SPLIT_COPY_BYTES = 1 << 20


class Copier:
    """Copies source tensors into flat staging buffers; one instance per engine (training thread).

    Host copies of ``SPLIT_COPY_BYTES`` or more are split along the first dimension: the helper
    thread copies the second half while this thread goes on (``copy_`` runs without the GIL). One
    core's copy does not use the memory bandwidth: 32 MB took 9.2 ms on one thread, 5.7 ms on two,
    on the development VM. Row streams' full copies go through ``copy`` too. ``finish`` waits for
    the helper."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, "torch.cuda.Stream"] = {}
        self._pending: list[tuple[torch.device, "torch.cuda.Stream"]] = []
        self._helper: ThreadPoolExecutor | None = None
        self._halves: list[Future] = []

    def copy(self, src: torch.Tensor, dst_flat: torch.Tensor) -> None:
        """Copy ``src`` (any strides/device) into the flat contiguous ``dst_flat``."""
        dst = dst_flat.view(src.shape)
        if src.device.type != "cuda":
            if dst.nbytes >= SPLIT_COPY_BYTES and src.dim() and src.shape[0] >= 2:
                if self._helper is None:
                    self._helper = ThreadPoolExecutor(1, thread_name_prefix="checkrun-copy")
                half = src.shape[0] // 2
                self._halves.append(self._helper.submit(dst[half:].copy_, src[half:]))
                dst = dst[:half]
                src = src[:half]
            dst.copy_(src)
            return
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(src.device)
        # The side stream must see every kernel already queued that writes src.
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self._pending.append((src.device, stream))

    def finish(self) -> "torch.cuda.Event | None":
        """Wait for the host copies; order training after the device copies and return an event the
        background thread waits on (None without device copies)."""
        halves = self.settle()
        for future in halves:
            future.result()
        if not self._pending:
            return None
        events = []
        for device, stream in dict(self._pending).items():
            # Training kernels queued after save() returns must not overwrite a tensor mid-copy.
            torch.cuda.current_stream(device).wait_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        self._pending.clear()
        return _MultiEvent(events)

    def settle(self) -> list[Future]:
        """Wait until no helper copy runs (also after an error: they write into staging buffers)."""
        halves, self._halves = self._halves, []
        for future in halves:
            future.exception()
        return halves

    def close(self) -> None:
        """Stop the helper thread (a later copy starts a new one)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=True)


class _MultiEvent:
    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class SharedBuffers:
    """Host buffers in shared memory, for a writer process (``saving.background: process``).

    Each buffer is a file of its own in a private directory (under ``/dev/shm`` where it exists),
    space reserved up front (``posix_fallocate``: a full ``/dev/shm`` is a clear error here, not a
    SIGBUS when a page is first touched), mapped shared. ``name_of`` gives the file name of a buffer
    allocated here, which the writer process maps once (``map_shared``). ``close`` deletes the
    directory; the writer process also deletes it when its parent goes away without closing.
    """

    def __init__(self) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.directory = tempfile.mkdtemp(prefix="checkrun-staging-", dir=base)
        self._names: dict[int, str] = {}
        # Held until close: a freed buffer's address could be reused by another allocation, which
        # ``name_of`` would then take for this buffer (its file stays until close anyway).
        self._buffers: list[torch.Tensor] = []
        self._count = 0
        self._lock = threading.Lock()

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            self._count += 1
            name = f"{self._count}.buf"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                os.unlink(path)
                free = shutil.disk_usage(self.directory).free
                raise StorageError(
                    f"saving.background 'process': cannot reserve {nbytes} bytes of shared memory in "
                    f"{self.directory} ({free} bytes free): {exc}. Enlarge it (docker: --shm-size) or "
                    "use saving.background 'thread'") from exc
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        t = torch.frombuffer(mm, dtype=dtype, count=numel)  # keeps the mapping alive
        advise_huge_pages(t)
        with self._lock:
            self._names[t.data_ptr()] = name
            self._buffers.append(t)
        return t

    def name_of(self, t: torch.Tensor) -> str | None:
        """The file name of a buffer allocated here (or a flat view of its start), else None."""
        name = self._names.get(t.data_ptr()) if t.numel() else None
        return name if name is not None and t.dim() == 1 and t.is_contiguous() else None

    def close(self) -> None:
        """Delete the files (mappings stay valid until the tensors that use them are gone)."""
        with self._lock:
            self._buffers.clear()
            self._names.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def map_shared(directory: str, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Map a buffer of ``SharedBuffers`` in another process (the writer process)."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=dtype, count=numel)
