"""The copy into staging buffers, on the training thread: host halves on a helper thread, device
tensors on a side stream per device (``pinned`` has the backends' side), and the event the
background waits on before it reads a snapshot.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from .. import forksafe
from . import pinned as _pinned

#: Host copies at least this large are split in two, the second half copied by a helper thread.
SPLIT_COPY_BYTES = 1 << 20

T = TypeVar("T")


class Copier:
    """Copies source tensors into flat staging buffers; one instance per engine (training thread).

    Host copies of ``SPLIT_COPY_BYTES`` or more are split in two: the helper thread copies the second
    half while this thread goes on (both without the GIL). One core's copy does not use the memory
    bandwidth: 32 MB took 9.2 ms on one thread, 5.7 ms on two, on the development VM. A dense source
    is copied as bytes (``memmove`` through ctypes), not by ``copy_``: torch runs every copy above 32K
    elements on its OpenMP team, whose threads sleep between a snapshot's tensors and compete with
    the helper, so the 120 copies of 160 KB of a LoRA state took 6.5-9 ms that way and 1.5-1.9 ms on
    one thread each (2026-12-03, 2 cores). Row streams' full copies go through ``copy`` too.
    ``finish`` waits for the helper.

    Every non-CPU source is a device tensor and is never split across threads. Where its backend
    has streams (``pinned.device_module``) it is copied non-blocking on a side stream per device
    that first waits for the training stream; the source's memory is recorded on the side stream
    (``record_stream``) so that the allocator cannot hand it to another tensor, should the caller
    free it right after ``save()``, before the copy ran. Other backends (``mps``) copy synchronously
    on this thread. ``finish`` makes each training stream wait for its side stream and records one
    event per device, not per tensor."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, object] = {}
        self._pending: dict[torch.device, tuple] = {}  # device -> (backend module, side stream)
        self._keep: list[torch.Tensor] = []  # sources whose backend has no record_stream
        self._mods: dict[str, object] = {}  # device type -> its backend module (or None)
        self._helper: ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()  # close() may come from the engine's coordinator
        self._halves: list[Future] = []

    def copy(self, src: torch.Tensor, dst_flat: torch.Tensor) -> None:
        """Copy ``src`` (any strides/device) into the flat contiguous ``dst_flat``."""
        if src.is_cpu:
            self._copy_host(src, dst_flat)
            return
        dst = dst_flat.view_as(src)  # not view(src.shape): parsing a torch.Size costs ~3 us more
        kind = src.device.type
        if kind not in self._mods:
            self._mods[kind] = _pinned.device_module(kind)
        mod = self._mods[kind]
        if mod is None:  # no streams (mps): a blocking copy, on this thread only
            dst.copy_(src)
            return
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = mod.Stream(src.device)
        if src.device not in self._pending:
            # The side stream must see every kernel already queued that writes a source; once per
            # device and snapshot (save() itself queues nothing on the training stream).
            stream.wait_stream(mod.current_stream(src.device))
        with mod.stream(stream):
            dst.copy_(src, non_blocking=True)
        try:
            src.record_stream(stream)
        except (RuntimeError, TypeError, NotImplementedError):
            self._keep.append(src)  # held until the copy is done instead
        self._pending[src.device] = (mod, stream)

    def _copy_host(self, src: torch.Tensor, dst_flat: torch.Tensor) -> None:
        n = src.nbytes
        if _plain_bytes(src, dst_flat):
            if n >= SPLIT_COPY_BYTES:
                half = n // 2 & ~63
                self._halves.append(self._submit(_memmove, dst_flat, src, half, n - half))
                n = half
            _memmove(dst_flat, src, 0, n)
            return
        dst = dst_flat.view_as(src)
        # Halves along dim 0 only where it is the outermost in memory: halves of a transposed view lose
        # torch's fast transpose copy (a 1 GiB .t() blocked 10 s instead of 0.6 s: found by an independent check)
        if n >= SPLIT_COPY_BYTES and src.dim() and src.shape[0] >= 2 and src.stride(0) == max(src.stride()):
            half = src.shape[0] // 2
            self._halves.append(self._submit(dst[half:].copy_, src[half:]))
            dst, src = dst[:half], src[:half]
        dst.copy_(src)

    def _submit(self, fn: Callable, *args) -> Future:
        with self._helper_lock:
            if self._helper is None:
                self._helper = forksafe.started_executor(1, "checkrun-copy")
            return self._helper.submit(fn, *args)

    def share(self, parts: list[Callable[[], T]]) -> Callable[[], list[T]]:
        """Queue ``parts`` (work without the GIL: a C kernel through ctypes) on the helper thread and
        return ``join``, which gives their results in order.

        ``join`` runs on this thread the parts the helper has not started, from the end of the list
        while the helper works from its start, and waits for the others. Until then this thread
        goes on with other tensors: their Python work overlaps the helper's memory-bound parts.
        ``finish``, ``settle`` and ``abort`` wait for every part started, joined or not."""
        futures = [self._submit(part) for part in parts]
        self._halves.extend(futures)

        def join() -> list[T]:
            out: list = [None] * len(parts)
            for i in range(len(parts) - 1, -1, -1):
                if futures[i].cancel():  # not started: this thread does it
                    out[i] = parts[i]()
            for i, future in enumerate(futures):
                if not future.cancelled():
                    out[i] = future.result()
            return out
        return join

    def finish(self) -> "_MultiEvent | None":
        """Wait for the host copies; order training after the device copies and return an event the
        background thread waits on (None without device copies)."""
        halves = self.settle()
        for future in halves:
            if not future.cancelled():  # a part ``share``'s join ran itself
                future.result()
        if not self._pending:
            return None
        events = []
        for device, (mod, stream) in self._pending.items():
            # Training kernels queued after save() returns must not overwrite a tensor mid-copy.
            mod.current_stream(device).wait_stream(stream)
            event = _pinned.new_event(mod)
            event.record(stream)
            events.append(event)
        self._pending = {}
        keep, self._keep = self._keep, []
        return _MultiEvent(events, keep)

    def settle(self) -> list[Future]:
        """Wait until no helper copy runs (also after an error: they write into staging buffers)."""
        halves, self._halves = self._halves, []
        for future in halves:
            if not future.cancelled():
                future.exception()
        return halves

    def abort(self) -> None:
        """After an error in the blocking part: wait for every copy queued since the last ``finish``
        (host halves and device copies), so its staging buffers can go back to the pool."""
        self.settle()
        pending, self._pending = self._pending, {}
        for device, (mod, stream) in pending.items():
            mod.current_stream(device).wait_stream(stream)
            stream.synchronize()  # the error path only: a buffer given back may be freed at once
        self._keep = []

    def close(self) -> None:
        """Stop the helper thread after its copies (a later copy starts a new one). Any thread."""
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            forksafe.stop_executor(helper)


def _plain_bytes(src: torch.Tensor, dst_flat: torch.Tensor) -> bool:
    """Whether ``src`` is its bytes in memory order (copied with a memmove): a dense host tensor of
    ``dst_flat``'s dtype and size, without a lazy conjugate or negative bit (``copy_`` applies those)."""
    return (src.layout == torch.strided and not src.is_quantized and src.dtype == dst_flat.dtype
            and src.is_contiguous() and not src.is_conj() and not src.is_neg() and src.numel() == dst_flat.numel())


def _memmove(dst: torch.Tensor, src: torch.Tensor, offset: int, nbytes: int) -> None:
    """Bytes ``offset:offset + nbytes`` of ``src`` into ``dst``: one thread, without the GIL (ctypes)."""
    if nbytes:
        ctypes.memmove(dst.data_ptr() + offset, src.data_ptr() + offset, nbytes)


class _MultiEvent:
    """One event per device of a snapshot; ``synchronize`` blocks until all copies are done, then
    lets go of the sources kept alive for backends without ``record_stream``."""

    def __init__(self, events: list, keep: list | None = None) -> None:
        self.events = events
        self._keep = keep or []

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()
        self._keep = []


class AfterCopy:
    """A snapshot's copy event followed by work that needs the copies done (reading a device
    "step" counter from its staged copy, pickling values whose tensors were staged).

    ``synchronize`` (the background thread, before it reads the snapshot) waits for ``event`` and
    runs ``then`` once; any thread, idempotent."""

    def __init__(self, event: "_MultiEvent | None", then: list) -> None:
        self.event, self._then = event, then
        self._lock = threading.Lock()

    def synchronize(self) -> None:
        with self._lock:
            if self.event is not None:
                self.event.synchronize()
            then, self._then = self._then, []
            for fn in then:
                fn()
