"""Staging buffers in shared memory, for a writer process (``saving.background: process``).

Files under ``/dev/shm`` (or the temp directory) that the engine and its writer process both map;
``staging.BufferPool`` allocates them through ``SharedBuffers`` and releases them within the staging
budget. A directory whose owners all died (the training process and its writer process, killed
together) is deleted by the next ``SharedBuffers`` created on the machine.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
from typing import Callable

import torch

from ..errors import StorageError
from .staging import advise_huge_pages


class SharedBuffers:
    """Host buffers in shared memory, for a writer process (``saving.background: process``).

    Each buffer is a file of its own in a private directory (under ``/dev/shm`` where it exists),
    space reserved up front (``posix_fallocate``: a full ``/dev/shm`` is a clear error here, not a
    SIGBUS when a page is first touched), mapped shared. ``name_of`` gives the file name of a buffer
    allocated here, which the writer process maps once (``map_shared``). ``release`` frees buffers
    the pool no longer wants (their files go, ``on_release`` tells the writer process to unmap them).
    ``close`` deletes the directory; the writer process also deletes it when its parent goes away
    without closing. The directory is named after this process (``checkrun-staging-<pid namespace>-
    <pid>-...``) and ``add_owner`` records other processes using it (the writer process): when they
    all die at once (a group kill), the next ``SharedBuffers`` created deletes it
    (``remove_stale_directories``).
    """

    def __init__(self) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        base = base or tempfile.gettempdir()
        remove_stale_directories(base)
        self.directory = tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{_pid_namespace()}-{os.getpid()}-",
                                          dir=base)
        self._names: dict[int, str] = {}
        # Held until released or closed, and forgotten by ``name_of`` before the last reference
        # goes: a freed buffer's address may be reused by another allocation, which ``name_of``
        # must never take for this buffer.
        self._buffers: dict[str, torch.Tensor] = {}
        self._count = 0
        self._lock = threading.Lock()
        self.on_release: Callable[[list[str]], None] | None = None
        """Called with the names of released buffers (the writer process unmaps them)."""

    def add_owner(self, pid: int) -> None:
        """Record another process that maps these buffers: the directory is stale only once it
        is dead too."""
        with open(os.path.join(self.directory, f"{_OWNER_MARK}{pid}"), "w"):
            pass

    def release(self, buffers: list[torch.Tensor]) -> None:
        """Free buffers that no save uses any more: forget them, delete their files (the memory
        goes once no process maps them), then tell ``on_release``."""
        names = []
        with self._lock:
            for t in buffers:
                name = self._names.pop(t.data_ptr(), None) if t.numel() else None
                if name is not None:
                    self._buffers.pop(name, None)
                    names.append(name)
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))
        if names and self.on_release is not None:
            self.on_release(names)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
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
                where = ("Enlarge it (docker: --shm-size)" if self.directory.startswith("/dev/shm/") else
                         "/dev/shm is missing or not writable, so the temp directory is used: free space there "
                         "or point TMPDIR elsewhere")  # h144: --shm-size was suggested for $TMPDIR
                raise StorageError(
                    f"saving.background 'process': cannot reserve {nbytes} bytes of shared memory in "
                    f"{self.directory} ({free} bytes free): {exc}. {where}, or use saving.background "
                    "'thread'") from exc
        finally:
            os.close(fd)
        t = _map(path, nbytes, dtype, numel)
        advise_huge_pages(t)
        with self._lock:
            self._names[t.data_ptr()] = name
            self._buffers[name] = t
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
    return _map(path, os.path.getsize(path), dtype, numel)


def _map(path: str, nbytes: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` items of ``dtype`` at the start of the file ``path`` (``nbytes`` long), mapped shared; the
    mapping lives as long as the tensor. torch's mapping closes its file at once (h144: Python's ``mmap``
    keeps a descriptor per map, and a state of ~1,000 tensors hit the usual limit of 1,024 open files)."""
    try:
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    except RuntimeError as exc:  # h146: ENOMEM at ~65,000 maps (vm.max_map_count), a raw torch error before
        raise StorageError(f"saving.background 'process': cannot map staging buffer {path}: {exc} (one map per "
                           "tensor: a state of ~60,000 or more tensors exceeds the kernel's vm.max_map_count, "
                           "65,530 by default; raise it, or use saving.background 'thread')") from exc
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (numel * dtype.itemsize,), (1,))
    return raw.view(dtype)  # through bytes: no torch warning for complex32 (empty_host does the same)


_STAGING_PREFIX = "checkrun-staging-"
_OWNER_MARK = "owner-"


@functools.lru_cache(maxsize=1)
def _pid_namespace() -> str:
    """This process's pid namespace (its inode; "0" if unknown): pids of another namespace (another
    container sharing ``/dev/shm``) say nothing about processes here."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True


def remove_stale_directories(base: str) -> list[str]:
    """Delete the staging directories in ``base`` whose owners are all dead; the paths deleted.

    A directory's owners are the pid in its name (the training process) and the pids recorded in
    it (``SharedBuffers.add_owner``: its writer process). Only directories of this user and pid
    namespace are considered, and one with any owner alive (or a recycled pid: ``os.kill(pid, 0)``
    succeeds) is kept. Directories of older checkrun versions (no pid in the name) are left alone.
    """
    prefix = f"{_STAGING_PREFIX}{_pid_namespace()}-"
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            owners = [int(pid)] + [int(n[len(_OWNER_MARK):]) for n in os.listdir(path)
                                   if n.startswith(_OWNER_MARK) and n[len(_OWNER_MARK):].isdigit()]
        except OSError:  # gone meanwhile, or not a directory of ours
            continue
        if not any(_alive(p) for p in owners):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
