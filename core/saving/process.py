"""``saving.background: process``: the background part of every save runs in a writer process.

Why: in one process, the background threads need the GIL for every step between C calls (hash,
encode, checksum, open, write, fsync, rename: about 15 per blob) and the training thread waits for
each hand-off. Measured beside a Lightning fit on CPU (``benchmarks/bench_lightning.py``,
``--mode interleaved``), that cost the training loop several times the snapshot itself. In a
process of its own the writer competes only for cores.

How: the engine stages tensors into ``SharedBuffers`` (files under ``/dev/shm`` mapped by both
processes, reused from save to save like any staging buffer), then sends the snapshot with a
pickler that replaces each staging buffer by its file name, so only the tree, the small objects
and the names cross the pipe. The writer process (``python -m ckpt_core.saving.process``, started
with ``subprocess``: it never imports the training script) keeps its own store and blob index per
directory and storage options (``Store.cache_key``: a save with rotated credentials or another
endpoint reaches them), writes exactly as a background thread would (``commit.write_and_commit``),
and answers with a ``Committed``; the engine then releases the staging buffers, advances its row
streams and runs callbacks, retention and gc as usual. One step stays in the training process: the commit. When
the blobs are written (and synced), the writer sends the manifest's bytes; the engine's coordinator
thread runs the fence and the rename/PUT (``commit.publish_manifest``) and answers; only then does
the writer release the save's lease and reply. Loads and garbage collection tell the writer process
which blobs exist or are gone, in order, on the same pipe. A load never starts nor waits for the
writer process (what it tells is kept until the process starts for the next save), and the copies
it keeps as the row streams' references are made in shared memory in the first place, on the io
threads (``BufferPool.copy_allocator``), so adopting them copies nothing.

Lifetime: started at the first save, stopped by ``CheckpointEngine.close``. It ignores SIGINT and
SIGTERM (the engine decides when it stops; SIGTERM's grace is the engine's) and exits when the
engine's end of the pipe closes, deleting the shared buffers if the engine could not. If it dies,
the save in flight fails with a ``BackgroundSaveError`` naming its exit status and the next save
starts a new one. If the training process dies first, nothing more is committed: the writer
cannot commit by itself, wherever it was paused, so a restarted trainer's newer checkpoint is never
replaced by the dead one's older state (it also checks its parent pid before each save, so as not
to write blobs for nobody). Both pids own
the staging directory: if both die at once, the next engine to start deletes it
(``staging.remove_stale_directories``). Buffers the engine's pool frees (staging budget) are
unmapped here on an ``unmap`` message.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from .. import forksafe
from .capture import Snapshot
from ..config import EngineConfig
from .commit import publish_manifest, write_and_commit
from ..errors import CheckrunError, CommitRefusedError, ConfigError, OrphanedWriterError
from .shm_staging import SharedBuffers, map_shared
from ..storage.store import Store
from .streams import DirState

log = logging.getLogger("ckpt_core")


class _Pickler(pickle.Pickler):
    """Pickles staging buffers of ``shared`` as references to their files."""

    def __init__(self, file: io.BytesIO, shared: SharedBuffers) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:
            name = self.shared.name_of(obj)
            if name is not None:
                return (name, obj.dtype, obj.numel())
            if not obj.numel():  # a zero-size staging buffer is a plain tensor (no file): rebuilt, not pickled
                return (None, obj.dtype, tuple(obj.shape))  # (pickle fails for uint16/float8/complex32 tensors)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, directory: str, maps: dict) -> None:
        super().__init__(file)
        self.directory, self.maps = directory, maps

    def persistent_load(self, pid: Any) -> torch.Tensor:
        name, dtype, numel = pid
        if name is None:
            return torch.empty(numel, dtype=dtype)
        t = self.maps.get(name)
        if t is None:
            t = self.maps[name] = map_shared(self.directory, name, dtype, numel)
        return t


def check_store(store: Store) -> None:
    """Refuse a filesystem the writer process cannot share (``memory://``)."""
    if not store.shared_between_processes:
        raise ConfigError(f"saving.background 'process' cannot save to {store.url('')}: a memory:// "
                          "filesystem lives in one process; use saving.background 'thread'")


class WriterProcess:
    """The engine's side of the writer process. ``commit`` is called from the engine's coordinator
    thread; ``adopt`` and ``forget`` from any thread. Messages are handled in the order sent."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.shared = SharedBuffers()
        # Buffers the pool frees (staging budget): the writer process unmaps them, after every
        # save sent before (only buffers no save in flight uses are freed).
        self.shared.on_release = lambda names: self._notify(("unmap", names))
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._backlog: list[bytes] = []  # adopted blobs told before the writer process started
        self._lock = threading.Lock()

    def _start(self) -> Connection:
        with forksafe.churn():  # no fork meanwhile: a DataLoader worker forked while Popen waited for the exec
            return self._spawn()  # held its error pipe's write end, so Popen waited for that worker (h125: a hang)

    def _spawn(self) -> Connection:
        ours, theirs = socket.socketpair()
        # SIGINT/SIGTERM ignored before torch is imported (2-3 s), and a process group of its own: a Ctrl-C or
        # a preemption's signal to the trainer's group killed it while it started, losing the first save
        # (h110); the trainer's handlers wait for its saves, and it exits when the trainer is gone. SIGHUP
        # too: the kernel sends it to an orphaned process group holding a stopped process (the writer
        # SIGSTOPped, its trainer killed), which then died without deleting the staging files
        code = ("import signal; [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, "
                "signal.SIGHUP)]; import sys; sys.path[:0] = %r; "
                "from ckpt_core.saving.process import serve; serve(%d, %d)"
                % ([p for p in sys.path if p], theirs.fileno(), os.getpid()))
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                          stdin=subprocess.DEVNULL, **group)
        finally:
            theirs.close()
        # If the trainer dies with it, the next start deletes the staging files once both are gone.
        self.shared.add_owner(self._proc.pid)
        conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps((self.config, self.shared.directory)))
        for data in self._backlog:
            conn.send_bytes(data)
        self._backlog.clear()
        return conn

    def _send(self, message: tuple, start: bool = True) -> Connection | None:
        """Send ``message`` (starting the writer process if ``start``, else keeping it for its start)."""
        buf = io.BytesIO()
        _Pickler(buf, self.shared).dump(message)
        with self._lock:
            if self._conn is None and not start:
                self._backlog.append(buf.getvalue())
                return None
            if self._conn is None:
                self._conn = self._start()
            self._conn.send_bytes(buf.getbuffer())
            return self._conn

    def commit(self, snap: Snapshot, store: Store, name: str) -> Any:
        """Write and commit ``snap`` as ``name`` in ``store`` in the writer process; its ``Committed``."""
        check_store(store)
        if snap.event is not None:
            snap.event.synchronize()
            snap = dataclasses.replace(snap, event=None)
        refused, replaced = None, None  # the commit's own error, raised rather than the writer's report of it
        try:
            conn = self._send(("save", (store.fs, store.root, store.url_prefix, store.cache_key), name, snap))
            status, value = pickle.loads(conn.recv_bytes())
            if status == "publish":  # the blobs are written: the commit is this process's
                try:
                    replaced = publish_manifest(store, name, snap.stamp, value)
                except BaseException as exc:  # noqa: BLE001 - raised below, once the writer has its answer
                    refused = exc
                self._send(("published", None if refused is None else f"{type(refused).__name__}: {refused}"))
                status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise CheckrunError(f"the checkrun writer process died ({self._reap()}) while saving "
                                f"{store.url(name)}") from exc
        if refused is not None:
            raise refused
        if status == "error":
            raise value
        return dataclasses.replace(value, replaced=replaced)

    def adopt(self, store: Store, blobs: list, records: list, since: float) -> None:
        """Blobs and records of a checkpoint loaded from ``since`` on: the next save there reuses them."""
        if blobs:
            self._notify(("adopt", store.cache_key, blobs, records, since))

    def forget(self, store: Store, keys: list[str]) -> None:
        """Blobs garbage collection deleted."""
        if keys:
            self._notify(("forget", store.cache_key, keys))

    def _notify(self, message: tuple) -> None:
        """Tell the writer process, or, before it runs, its start (no process is started for it)."""
        try:
            self._send(message, start=False)
        except OSError:
            self._reap()  # reported by the next commit

    def _reap(self) -> str:
        """Forget a dead writer process (the next message starts a new one); its exit status."""
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()
        if proc is None:
            return "not running"
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        return f"exit status {code}"

    def close(self) -> None:
        """Stop the writer process (after the messages already sent) and delete the shared buffers."""
        with self._lock:
            conn = self._conn
        if conn is not None:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
            self._reap()
        self.shared.close()


#: Stores the writer process keeps at most: rotating credentials make a new one per rotation.
MAX_STORES = 16


def store_for(stores: dict, dirs: dict, key: tuple, make: Callable[[], Store]) -> Store:
    """The writer process's store for ``key`` (``Store.cache_key``: URL *and* storage options, so
    a save with rotated credentials or another endpoint gets a store of its own filesystem and a
    blob index of its own), made by ``make()`` if new. Beyond ``MAX_STORES`` the least recently
    used store is closed and its blob index dropped (the next save there checks what it reuses)."""
    store = stores.pop(key, None)
    if store is None:
        store = make()
        while len(stores) >= MAX_STORES:
            old = next(iter(stores))
            stores.pop(old).close()
            dirs.pop(old, None)
    stores[key] = store  # dicts keep insertion order: the most recently used is last
    return store


def _save(args: list, stores: dict, dirs: dict, config: EngineConfig, run: tuple,
          owner_alive: Callable[[], bool], answer: Callable[[bytes], str | None]) -> bytes:
    """One ``save`` message: write the blobs (unless the training process died), have the engine
    commit the manifest (``answer(data)``: None once committed, else why not); the pickled reply."""
    (fs, root, prefix, key), name, snap = args
    store = store_for(stores, dirs, key, lambda: Store(fs, root, config.storage, prefix, key[2]))
    state = dirs.setdefault(key, DirState())

    def orphaned() -> OrphanedWriterError:
        return OrphanedWriterError(f"{store.url(name)} not committed: the training process of this "
                                   "checkrun writer process died")

    def publish(data: bytes, guard: Callable[[], None]) -> None:
        store.sync()  # the blobs are durable before a manifest can point at them
        guard()
        try:
            refused = answer(data)
        except EOFError:
            raise orphaned() from None
        if refused is not None:
            raise CommitRefusedError(f"{store.url(name)} not committed: {refused}")

    try:
        if not owner_alive():  # no blobs written for a dead trainer (it could not commit them anyway)
            raise orphaned()
        reply = ("ok", write_and_commit(snap, store, name, state, config, *run, publish=publish))
    except BaseException as exc:  # noqa: BLE001 - reported to the engine
        if isinstance(exc, OrphanedWriterError):  # nobody is left to report it to
            log.warning("%s", exc)
        reply = ("error", exc)
    try:
        return pickle.dumps(reply)
    except Exception:  # an exception that does not pickle: its text
        return pickle.dumps(("error", CheckrunError(f"{type(reply[1]).__name__}: {reply[1]}")))


def serve(fd: int, parent: int | None = None) -> None:
    """The writer process: handle messages until the engine says stop or goes away. ``parent``: the
    engine's pid, as the engine saw it (a writer whose engine died while it started up has been
    re-parented already: ``os.getppid()`` at its start would name the reaper, and it would commit
    the dead engine's save)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from . import lifecycle
    from .quant_rules import RuleMatcher

    logging.basicConfig(level=logging.WARNING, format="checkrun writer process: %(levelname)s %(message)s")
    parent = os.getppid() if parent is None else parent
    conn = Connection(fd)
    try:
        config, directory = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the engine ended while this process started: nothing to write (no traceback)
        return
    lifecycle.lower_thread_priority(config.saving.thread_nice)
    torch.set_num_threads(1)
    matcher = RuleMatcher(config.quantization)
    workers = ThreadPoolExecutor(config.saving.workers, thread_name_prefix="checkrun-worker")
    stores: dict[tuple, Store] = {}
    dirs: dict[tuple, DirState] = {}
    maps: dict[str, torch.Tensor] = {}
    stopped = False  # the engine said stop: it deletes its buffers itself
    ended = False  # end of file: the engine's process is gone

    def receive() -> Any:
        """The next message other than a notice (handled here); EOFError when the engine is gone."""
        while True:
            try:
                raw = conn.recv_bytes()
            except OSError:  # the training process died mid-message (connection reset): gone, as EOF
                raise EOFError from None
            message = _Unpickler(io.BytesIO(raw), directory, maps).load()
            if message is None or message[0] not in ("unmap", "adopt", "forget"):
                return message
            kind, *args = message
            if kind == "unmap":  # buffers the engine freed: their memory goes when unmapped here
                for name in args[0]:
                    maps.pop(name, None)
            elif kind == "adopt":
                key, blobs, records, since = args
                state = dirs.setdefault(key, DirState())
                state.adopt_verified(blobs, since)  # the load checked every one of them
                state.records.update((r.key, r) for r in records)
            else:
                key, keys = args
                if key in dirs:
                    dirs[key].forget(keys)

    def answer(data: bytes) -> str | None:
        """Send ``publish`` with the manifest's bytes; the engine's answer (None: committed)."""
        nonlocal stopped
        try:
            conn.send_bytes(pickle.dumps(("publish", data)))
        except OSError:
            raise EOFError from None
        message = receive()
        if message is None:  # the engine stopped without committing: nothing is left to do
            stopped = True
            return "the checkrun engine was closed before the commit"
        return message[1]

    try:
        while True:
            try:
                message = receive()
            except EOFError:
                ended = True
                return
            if message is None:
                stopped = True
                return
            kind, *args = message
            message = None  # the snapshot's buffers: referenced by ``args`` only, until unmapped
            if kind == "save":
                data = _save(args, stores, dirs, config, (matcher, workers), lambda: os.getppid() == parent,
                             answer)
                args = None
                if stopped:
                    return
                try:
                    conn.send_bytes(data)
                except OSError:
                    ended = True
                    return  # the engine's process is gone
    except EOFError:  # from ``answer``: the engine's process is gone
        ended = True
    finally:
        workers.shutdown(wait=True)
        for store in stores.values():
            store.close()
        # End of file without a stop: the engine's process is gone, though getppid() may not say so
        # yet (an exiting process closes its files before its children are re-parented). Not on an
        # error of this process: its engine lives on and starts another writer on the same buffers (the
        # directory deleted under it failed every later save: found by an independent check).
        if (ended and not stopped) or os.getppid() != parent:  # nobody else deletes its buffers
            shutil.rmtree(directory, ignore_errors=True)

