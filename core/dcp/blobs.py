"""Per-rank chunk storage for DCP saves: content addressing before encoding, shared blob store.

Each rank runs one :class:`ItemWriter` per ``write_data`` call. A tensor item (DTensor shard, piece of
a replicated tensor, whole tensor) is planned and written by the ordinary saves' code (``saving.plan``,
``saving.write``): cut into the engine's chunks (``plan.chunk_spans``); each chunk's content key is
computed from its raw bytes (``blobwrite.blob_key``, the same address the engine uses), and only
chunks whose key is not already in ``DIR/.checkrun/blobs/`` are encoded and written. What this process
knows is in :data:`KNOWN` (per directory, a ``DirState``: blob refs of the last save or load, seeded
from the newest manifest of the directory on first use, and the blobs already checked). A stored blob
is reused only if it exists (``has_blob``: garbage collection between two saves cannot leave a manifest
dangling) and its stored bytes were checked against the reference about to be written (``blobcheck``:
once per process and blob; blobs a DCP load verified count as checked); a rotted one is written again.
Each rank's save holds a lease (``save_lease``): a key is named by it before the blob is looked at or
written, so no collection takes it until the coordinator's manifest references it.
"""
from __future__ import annotations

import io
import logging
import threading
from collections import deque
from concurrent.futures import Executor, Future
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..codecs import EncodeStats
from ..config import EngineConfig
from .format import ItemResult, record_key
from ..errors import CheckrunError
from ..format.manifest import HEAD_BYTES, BlobRef, ObjectRecord, TensorRecord, is_manifest_head, parse_manifest
from ..saving.blobwrite import BlobWriter
from ..saving.plan import Planner, TensorPlan
from ..saving.quant_rules import RuleMatcher
from ..saving.lease import SaveLease
from ..storage.store import Store
from ..saving.streams import DirState
from ..saving.write import Pending, Replan, TensorWriter

log = logging.getLogger("ckpt_core")
_DEFAULT_WINDOW = 256 << 20


class BlobIndex:
    """Process-wide map directory URL -> ``DirState``: the blob refs of the latest save or load
    (``index``), encode stats of lossy chunks (``stats``) and the blobs whose stored bytes this
    process checked (``verified``, see ``blobcheck``).

    Thread-safe. Holds the blobs of the latest save or load per directory, so memory stays
    proportional to one checkpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: dict[tuple, DirState] = {}  # by Store.cache_key: URL and options

    def view(self, store: Store, config: EngineConfig) -> tuple[dict[str, BlobRef], dict[str, EncodeStats], DirState]:
        """Copies of the directory's refs and stats (stable during a save), and its ``DirState``,
        whose ``verified`` a save updates in place as it checks blobs."""
        key = store.cache_key
        with self._lock:
            state = self._dirs.get(key)
        if state is None:
            seeded = DirState(index=_seed(store, config))
            with self._lock:
                state = self._dirs.setdefault(key, seeded)
        with self._lock:
            return dict(state.index), dict(state.stats), state

    def remember(self, store: Store, refs: Iterable[BlobRef], stats: dict[str, EncodeStats] | None = None,
                 replace: bool = True) -> None:
        new = {r.key: r for r in refs}
        with self._lock:
            state = self._state(store)
            if replace:
                state.index = new
                for key in [k for k in list(state.verified) if k not in new]:
                    state.distrust(key)
            else:
                state.index.update(new)
            if stats:
                state.stats.update(stats)

    def adopt_verified(self, store: Store, refs: Iterable[BlobRef], since: float) -> None:
        """Blobs a load that started at ``since`` read and verified: the next save reuses them
        without reading them again (unless modified since)."""
        with self._lock:
            self._state(store).adopt_verified(list(refs), since)

    def _state(self, store: Store) -> DirState:
        return self._dirs.setdefault(store.cache_key, DirState())


def _seed(store: Store, config: EngineConfig) -> dict[str, BlobRef]:
    """Blob refs of the newest readable manifest of the directory (an empty dict if there is none)."""
    try:
        files = sorted(store.list_files(), key=lambda f: f.mtime, reverse=True)
    except CheckrunError:
        return {}
    for info in files[:16]:
        try:
            if not is_manifest_head(store.read_head(info.name, HEAD_BYTES)):
                continue
            m = parse_manifest(store.read_manifest(info.name), store.url(info.name),
                               max_blob_bytes=config.load.max_blob_bytes)
        except (CheckrunError, OSError) as exc:
            log.debug("checkrun: not seeding the blob index from %s: %s", info.name, exc)
            continue
        return {b.key: b for b in m.blobs()}
    return {}


KNOWN = BlobIndex()


class ItemWriter:
    """Stores the items of one rank's plan with the ordinary saves' writer (``saving.write``): each
    tensor item is planned (``saving.plan.Planner``) and its plan executed by a ``TensorWriter``
    on a ``BlobWriter`` that looks at the store before reusing a blob (``look_first``). Created
    and used on the thread running ``write_data``; chunk work runs on ``workers``. ``known`` must
    not change while it runs; ``dirstate.verified`` (the process's checked blobs of this
    directory) is updated as blobs are checked or written."""

    def __init__(self, store: Store, config: EngineConfig, matcher: RuleMatcher, rank: int, workers: Executor,
                 known: dict[str, BlobRef], known_stats: dict[str, EncodeStats], dirstate: DirState,
                 lease: SaveLease) -> None:
        self.config, self.rank, self.workers = config, rank, workers
        self.known_stats = known_stats
        self.new_stats: dict[str, EncodeStats] = {}
        self.planner = Planner(matcher, config.compression)
        self.blobs = BlobWriter(store, dirstate, lease, config.load.max_blob_bytes, known=known,
                                stats_of=self._stats_of, look_first=True)
        self.tensors = TensorWriter(self.blobs, workers.submit, self.new_stats)
        self.touched = self.blobs.touched
        self.written = 0

    # -- items -----------------------------------------------------------------------------------
    def write(self, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Resolve each item lazily, keeping at most ``staging_budget_bytes`` (default 256 MiB) of
        resolved tensors in flight, and return one WriteResult per item, in plan order."""
        window = self.config.saving.staging_budget_bytes or _DEFAULT_WINDOW
        pending: deque = deque()
        inflight, results = 0, []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                pending.append((item, self.workers.submit(self._object, item, planner.resolve_data(item)), 0))
                continue
            tensor = _cpu(planner.resolve_data(item))
            job = self._tensor_job(item, tensor)
            pending.append((item, job, tensor.nbytes))
            inflight += tensor.nbytes
            while inflight > window and len(pending) > 1:
                inflight -= self._finish(pending.popleft(), results)
        while pending:
            self._finish(pending.popleft(), results)
        return results

    def _finish(self, entry: tuple, results: list[WriteResult]) -> int:
        item, job, nbytes = entry
        if isinstance(job, Future):
            record, written = job.result()
        else:
            done = self.tensors.settle(*job, "cpu")
            record, written = done.record, done.written
        self.written += written
        size = sum(b.size for b in record.blobs()) if isinstance(record, TensorRecord) else record.blob.size
        results.append(WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data=ItemResult(record, self.rank, written)))
        return nbytes

    def _object(self, item: WriteItem, data: Any) -> tuple[ObjectRecord, int]:
        payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        ref, written = self.blobs.put_object(payload)
        return ObjectRecord(record_key(item.index, True), "dcp.bytes", ref), written

    # -- tensors ---------------------------------------------------------------------------------
    def _tensor_job(self, item: WriteItem, t: torch.Tensor) -> tuple[Pending, Replan]:
        """Plan a tensor item and submit its chunks; (the pending tensor, how to plan it again)."""
        td = item.tensor_data
        if td is None or tuple(t.shape) != tuple(td.chunk.sizes):
            raise CheckrunError(f"DCP item {item.index.fqn!r}: resolved tensor of shape {tuple(t.shape)} does "
                                f"not match its chunk {None if td is None else tuple(td.chunk.sizes)}")
        whole = list(td.chunk.sizes) == list(td.size) and not any(td.chunk.offsets)
        key, shape = record_key(item.index, whole), tuple(t.shape)

        def replan(force: bool, lossless: bool) -> TensorPlan:
            return self.planner.tensor(key, t.dtype, shape, rule_key=item.index.fqn, force=force, lossless=lossless)

        plan = replan(False, False)
        return self.tensors.start(plan, t.reshape(plan.grid)), replan

    def _stats_of(self, key: str) -> EncodeStats | None:
        return self.new_stats.get(key) or self.known_stats.get(key)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    # A conjugate or negative view keeps its values behind a flag that byte views cannot carry.
    return t.resolve_conj().resolve_neg().contiguous()
