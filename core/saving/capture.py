"""Step 1 of a save, on the training thread: flatten the state and copy it into staging buffers.

Everything after this works only on the snapshot, so the caller may mutate or free the state as
soon as ``take_snapshot`` returns. Nothing here waits for a device: device tensors are copied
non-blocking into one pinned arena per device, and what needs their values on the host (a device
"step" counter for the listing, values pickled with device tensors inside) is done by the snapshot's
event after the copies (``staging.AfterCopy``), on the background thread. An error here gives back
everything taken: budget, buffers, and the row streams' claim to match what is committed.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import EngineConfig
from ..errors import FormatError
from ..format.limits import DEVICE_TYPES, MAX_MANIFEST_BYTES
from .fence import CommitStamp, new_stamp
from ..format.objects import DeferredObject, device_storage_bytes, serialize_object
from .pinned import arena_layout, can_pin
from .quant_rules import tied_lossless
from .staging import AfterCopy, BufferPool, Copier, MemoryBudget, empty_host
from .streams import DirState, RowStream, row_eligible
from ..format.tree import flatten, gc_paused


@dataclass(frozen=True)
class StagedTensor:
    """One tensor's snapshot: a flat host buffer plus what the row stream learned while copying."""

    key: str
    shape: tuple[int, ...]
    data: torch.Tensor
    device: str
    stream: RowStream | None = None
    changed: torch.Tensor | None = None
    tied: tuple[str, ...] = ()
    """Its other keys that other rules match (``tied_lossless``): those rules count as used."""
    lossless: bool = False
    """Stored lossless whatever the rules say: they treat its keys differently (``tied_lossless``)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class StagedObject:
    """A pickled value: its torch.save bytes, or a ``_Later`` that builds them after the copies."""

    key: str
    type_name: str
    payload: "bytes | _Later"

    @property
    def data(self) -> bytes:
        return self.payload if isinstance(self.payload, bytes) else self.payload.get()

    def __reduce__(self):  # to a writer process: the bytes themselves
        return (StagedObject, (self.key, self.type_name, self.data))


class _Later:
    """Bytes made once, after ``settle`` (the snapshot's copy event) returned; any thread."""

    def __init__(self, make: Callable[[], bytes]) -> None:
        self._make: Callable[[], bytes] = make
        self._data: bytes | None = None
        self.settle: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def get(self) -> bytes:
        with self._lock:
            if self._data is None:
                if self.settle is not None:
                    self.settle()
                self._data = self._make()  # a failure fails the save, here or at a retry
            return self._data


@dataclass(frozen=True)
class Snapshot:
    skeleton: Any
    tensors: tuple[StagedTensor, ...]
    objects: tuple[StagedObject, ...]
    leaves: tuple[int, ...]
    event: Any
    charged: int
    created: float
    meta: dict
    stamp: CommitStamp | None = None
    """Orders this snapshot's commit against other saves of the same name (``fence``)."""
    hold: "Hold" = field(default_factory=lambda: Hold())
    """The staging buffers' owners: this snapshot and the saves that repeat it (``repeat``)."""


class Hold:
    """Shared ownership of a snapshot's staging buffers and budget charge: a save that repeats the
    one in flight (``repeat``) stages nothing and shares them; the last of them to finish gives them
    back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners = 1
        self.records: dict[str, Any] = {}
        """Once the first of its saves committed: its tensors' records by key (row streams' aside), which
        the saves repeating it reuse instead of encoding the same staging again (``write``)."""

    def join(self) -> bool:
        """One more owner; False once they were given back (then nothing changed)."""
        with self._lock:
            if self._owners == 0:
                return False
            self._owners += 1
            return True

    def leave(self) -> bool:
        """One owner less; True for the last one, who gives the buffers back."""
        with self._lock:
            self._owners -= 1
            return self._owners == 0

    def __reduce__(self):  # to a writer process, which gives nothing back: a hold of its own
        return (Hold, ())


def _alias_key(t: torch.Tensor) -> tuple:
    """Equal for tensors that read the same values from the same memory (tied weights); a conjugate or
    negative view reads other values than its base."""
    if not t.numel():
        return (id(t),)
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


def take_snapshot(state: Any, dirstate: DirState, pool: BufferPool, copier: Copier,
                  budget: MemoryBudget, config: EngineConfig, trackers: tuple = (),
                  stamp: CommitStamp | None = None) -> Snapshot:
    """Flatten ``state`` and stage every tensor. Runs on the caller's (training) thread. ``stamp``:
    the commit stamp (``fence``), taken when the save was asked for (default: now); a save that
    waited for a slot meanwhile is still older than a checkpoint another writer committed then, and its
    ``created`` is that time too (h127: an Accelerate index, captured after its parts, was dated then)."""
    stamp = stamp or new_stamp()
    created = stamp.ns / 1e9  # (a process's stamps increase: a clock stepped back or behind another's, fence.observe)
    flat = flatten(state, max_containers=config.load.max_manifest_elements // 4)
    with gc_paused():
        leaves, unique, sources = _sources(flat.tensors)
    check_manifest_room(len(sources), len(flat.objects), config, sum(len(k) for k, _ in sources),
                        flat.skeleton)  # before anything is staged or written
    deferred = _device_objects(flat.objects, sources)
    charged = _staging_bytes(sources) + sum(deferred.values())
    budget.acquire(charged)
    taken: list[torch.Tensor] = []  # staging buffers from the pool: given back on an error
    try:
        with gc_paused():
            staged = tied_lossless(_stage_all(sources, dirstate, pool, copier, config, trackers, taken),
                                   flat, leaves, config.quantization)
        objects, later = _stage_objects(flat.objects, deferred, copier, pool.pin_memory)
        meta, late_meta = _meta(state, lambda t: _staged_copy(t, unique, staged))
        event = copier.finish()
        for obj in objects:
            if isinstance(obj.payload, _Later):
                obj.payload.settle = event.synchronize if event is not None else None
        if late_meta or later:
            event = AfterCopy(event, late_meta + later)
        for tracker in trackers:  # last: the snapshot is taken, the trackers start a new interval
            tracker.captured()
    except BaseException:
        copier.abort()
        for buf in taken:
            pool.give(buf)
        if any(row_eligible(key, t, config.incremental) for key, t in sources):
            dirstate.invalidate()  # row streams moved on from what is committed: next save is full
        budget.release(charged)
        raise
    return Snapshot(flat.skeleton, staged, objects, tuple(leaves), event, charged, created, meta, stamp)


#: Fewest JSON elements one stored tensor adds to a manifest: its record with one chunk and its
#: skeleton leaf (measured: 44 without compression or packs, 57-60 by default); a pickled value: 12.
MIN_TENSOR_ELEMENTS, MIN_OBJECT_ELEMENTS = 44, 12
#: Fewest manifest bytes one small tensor's record adds besides its key: measured 250 with compression or
#: packs off, 320 with both on (the default; one-element tensors, keys of 1-41 characters). The skeleton
#: adds its own (a flat dict names each key again; nested ones each level's own name, so a long shared
#: prefix counts once). A state that needs more than ``MAX_MANIFEST_BYTES`` even at this rate is refused
#: by ``save()`` itself; ``commit`` checks the exact manifest. Before 2026-12-06 a typical 370 bytes were
#: assumed (states of 181k-222k tensors that compression off saves were refused); before 2026-12-07 the 250
#: for every config and no skeleton: 200,000 tensors with 12-character keys (78.8 MB by default) were told to
#: raise load.max_manifest_elements, then failed at commit after writing every blob (independent checks).
MIN_TENSOR_BYTES, MIN_TENSOR_BYTES_PACKED = 250, 315


def check_manifest_room(tensors: int, objects: int, config: EngineConfig, key_chars: int = 0,
                        skeleton: Any = None) -> None:
    """Refuse a state whose manifest is sure to hold more JSON elements than a load accepts
    (``load.max_manifest_elements``), counted from its records alone (a lower bound), or more bytes than
    a manifest may hold (``key_chars``: the length of the tensors' keys in all; ``skeleton``: the state's,
    whose JSON is counted once the records alone take half of it), so such a save fails in ``save()``
    instead of after writing every blob (``commit`` checks the exact manifest)."""
    least = MIN_TENSOR_ELEMENTS * tensors + MIN_OBJECT_ELEMENTS * objects
    limit = config.load.max_manifest_elements
    packed = config.compression.compress and config.compression.pack_bytes
    least_bytes = (MIN_TENSOR_BYTES_PACKED if packed else MIN_TENSOR_BYTES) * tensors + key_chars  # keys in full
    if least_bytes > MAX_MANIFEST_BYTES // 2 and skeleton is not None:
        least_bytes += len(json.dumps(skeleton, separators=(",", ":")))
    if least_bytes > MAX_MANIFEST_BYTES:  # whatever the limit: no setting raises the bytes
        raise FormatError(f"cannot save state: its {tensors} tensors need a manifest of at least "
                          f"{least_bytes >> 20} MiB, more than a manifest may hold ({MAX_MANIFEST_BYTES >> 20} MiB, "
                          "whatever load.max_manifest_elements says): group small tensors into fewer, larger ones")
    if least > limit:
        enough = -(-(64 * tensors + 16 * objects) // 1_000_000) * 1_000_000  # the default's ~60 a tensor, rounded up
        raise FormatError(f"cannot save state: its {tensors} tensors and {objects} pickled values need a manifest "
                          f"of at least {least} JSON elements, more than a load accepts (load.max_manifest_elements: "
                          f"{limit}); set load.max_manifest_elements to about {enough} where you save and where you "
                          "load, or group small tensors into fewer, larger ones")


def _sources(leaves: tuple) -> tuple[list[int], dict[tuple, int], list[tuple[str, torch.Tensor]]]:
    """(leaf -> source index, alias key -> source index, the distinct (key, tensor) sources)."""
    indices: list[int] = []
    unique: dict[tuple, int] = {}
    sources: list[tuple[str, torch.Tensor]] = []
    for leaf in leaves:
        # Views of the same memory with the same layout (tied weights) are stored once.
        k = _alias_key(leaf.tensor)
        if k not in unique:
            # is_cpu first: ``device.type`` costs a device object per tensor (~0.6 us, many small tensors)
            if not leaf.tensor.is_cpu and leaf.tensor.device.type not in DEVICE_TYPES:  # a load would refuse it
                raise FormatError(f"{leaf.key}: cannot save a tensor on {leaf.tensor.device}: checkrun saves "
                                  f"tensors of {', '.join(DEVICE_TYPES)} devices (move it to the CPU first)")
            _check_overlap(leaf.key, leaf.tensor)
            unique[k] = len(sources)
            sources.append((leaf.key, leaf.tensor.detach()))
        indices.append(unique[k])
    return indices, unique, sources


#: A tensor whose elements share memory (``expand``, ``as_strided``) is stored as its values, as it loads
#: (contiguous); above this many bytes, and twice its memory, it is refused instead of taking that memory.
OVERLAP_MAX_BYTES = 64 << 20


def _check_overlap(key: str, t: torch.Tensor) -> None:
    """The memory compared is what the view spans, not its storage: ``table[0].expand(n, d)`` of a large
    table spans one row (found by an independent check)."""
    nbytes = t.numel() * t.element_size()
    if nbytes <= OVERLAP_MAX_BYTES:
        return
    span = (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
    memory = min(span, t.untyped_storage().nbytes())
    if nbytes > 2 * memory:
        raise FormatError(f"{key}: cannot save an expanded tensor (shape {list(t.shape)}, strides {list(t.stride())}): "
                          f"its {nbytes} bytes of values share {memory} bytes of memory, and "
                          "checkrun stores and loads tensors contiguous; save the tensor it expands (or a .clone() "
                          "to store every value)")


def _by_device(sources: list[tuple[str, torch.Tensor]]) -> dict[torch.device, list[int]]:
    """Indices of the device (non-CPU) sources, per device."""
    out: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(sources):
        if not t.is_cpu:
            out.setdefault(t.device, []).append(i)
    return out


def _staging_bytes(sources: list[tuple[str, torch.Tensor]]) -> int:
    """What staging ``sources`` takes: host tensors' bytes, and per device its arena (the device
    tensors' bytes with their alignment)."""
    host = sum(t.nbytes for _, t in sources if t.is_cpu)
    return host + sum(arena_layout([(sources[i][1].dtype, sources[i][1].numel()) for i in idxs])[1]
                      for idxs in _by_device(sources).values())


def _stage_all(sources: list[tuple[str, torch.Tensor]], dirstate: DirState, pool: BufferPool, copier: Copier,
               config: EngineConfig, trackers: tuple, taken: list) -> tuple[StagedTensor, ...]:
    """Stage every source: device tensors into one pinned arena per device, host tensors into
    their own buffers or row streams."""
    arena: dict[int, torch.Tensor] = {}
    for device, idxs in _by_device(sources).items():
        views = pool.take_arena([(sources[i][1].dtype, sources[i][1].numel()) for i in idxs], device)
        taken.extend(views)
        arena.update(zip(idxs, views))
    out: list = []
    for i, (key, t) in enumerate(sources):
        buf = arena.get(i)
        if buf is not None:
            copier.copy(t, buf)
            out.append(StagedTensor(key, tuple(t.shape), buf, str(t.device)))
        else:
            out.append(_stage(key, t, dirstate, pool, copier, config, trackers, taken))
    # Comparisons the copier's helper may still run: joined last, so that this thread staged every
    # other tensor meanwhile.
    return tuple(o() if callable(o) else o for o in out)


def _stage(key: str, t: torch.Tensor, dirstate: DirState, pool: BufferPool, copier: Copier, config: EngineConfig,
           trackers: tuple, taken: list) -> "StagedTensor | Callable[[], StagedTensor]":
    """Stage the host tensor ``t``: into its row stream, or a buffer from the pool. A callable when
    the row stream's comparison still runs on the copier's helper thread (it waits for it)."""
    shape = tuple(t.shape)
    if row_eligible(key, t, config.incremental):
        t = t.resolve_conj().resolve_neg()  # a view's values (a copy, this tensor's only): the rows compare memory
        stream = dirstate.streams.get(key)
        if stream is None or stream.buffer.numel() != t.numel() or stream.buffer.dtype != t.dtype:
            if stream is not None:  # no save in flight uses it: the engine waited (save)
                pool.free_host(stream.buffer)
            stream = RowStream(pool.new_host(t.numel(), t.dtype), t.dtype, shape)
            dirstate.streams[key] = stream
        rows = None
        for tracker in trackers:
            rows = tracker.rows_for(t, stream.tracker_since)
            if rows is not None:
                break
        found = stream.capture(t, rows, config.incremental, copier.copy, copier.share)
        since, stream.tracker_since = stream.tracker_since, max((tr.clock + 1 for tr in trackers), default=0)

        def staged() -> StagedTensor:
            changed = found() if callable(found) else found
            if rows is None and changed is not None:
                for tracker in trackers:
                    tracker.check(t, changed, since)
            return StagedTensor(key, shape, stream.buffer, "cpu", stream, changed)
        return staged if callable(found) else staged()
    buf = pool.take(t.dtype, t.numel(), for_cuda=False)
    taken.append(buf)
    copier.copy(t, buf)
    return StagedTensor(key, shape, buf, "cpu")


def _devices_in_use(sources: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether a pickled value may hold device tensors: a device tensor is saved, or a device
    backend is initialised (no device tensor exists without). Never initialises one."""
    if any(not t.is_cpu for _, t in sources) or torch.cuda.is_initialized():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _device_objects(objects: tuple, sources: list) -> dict[int, int]:
    """Index -> device bytes of the pickled values that hold device tensors (staged, not pickled
    inside save())."""
    if not objects or not _devices_in_use(sources):
        return {}
    found = {}
    for i, o in enumerate(objects):
        nbytes = device_storage_bytes(o.obj)
        if nbytes is not None:
            found[i] = nbytes
    return found


def _stage_objects(objects: tuple, deferred: dict[int, int], copier: Copier,
                   pin: bool) -> tuple[tuple[StagedObject, ...], list[Callable[[], Any]]]:
    """Pickle the values now, or, for those holding device tensors, stage their storages and
    pickle them after the copies (the callables returned)."""
    out, later = [], []
    for i, o in enumerate(objects):
        if i not in deferred:
            out.append(StagedObject(o.key, o.type_name, serialize_object(o.obj, o.key)))
            continue
        lazy = _Later(DeferredObject(o.obj, lambda src: _stage_storage(src, copier, pin)).serialize)
        later.append(lazy.get)
        out.append(StagedObject(o.key, o.type_name, lazy))
    return tuple(out), later


def _stage_storage(src: torch.Tensor, copier: Copier, pin: bool) -> torch.Tensor:
    """A host buffer for the flat uint8 device tensor ``src``, its copy queued (pinned: non-blocking).
    From torch's pinned-memory cache: such values are rare and small, and the cache reuses the
    memory from save to save (an exact-size registration would be made again every save)."""
    n = src.numel()
    if pin and n and can_pin(src.device):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    else:
        host = empty_host(n, torch.uint8)
    copier.copy(src, host)
    return host


def _staged_copy(t: torch.Tensor, unique: dict[tuple, int], staged: tuple) -> torch.Tensor | None:
    """The staged host copy of the tensor leaf ``t``, or None (not a leaf of this snapshot)."""
    idx = unique.get(_alias_key(t.detach()))
    return staged[idx].data if idx is not None else None


def _meta(state: Any, staged_copy: Callable[[torch.Tensor], torch.Tensor | None]
          ) -> tuple[dict, list[Callable[[], None]]]:
    """Loop counters worth showing in listings (Lightning's global_step/epoch, plain step), and
    what fills in device counters from their staged copies once copied (reading the device
    tensor here would wait for the device)."""
    meta: dict = {}
    later: list[Callable[[], None]] = []
    if isinstance(state, Mapping):
        for name in ("global_step", "step", "epoch"):
            v = state.get(name)
            if isinstance(v, int) and not isinstance(v, bool):
                meta[name] = v
            elif (isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point()
                  and not v.is_complex() and v.dtype != torch.uint64):  # int(): an int64 (2**63 and up overflow)
                if v.device.type == "cpu":
                    meta[name] = int(v)
                    continue
                host = staged_copy(v)
                if host is not None:
                    later.append(lambda name=name, host=host: meta.__setitem__(name, int(host.view(-1)[0])))
    return meta, later
