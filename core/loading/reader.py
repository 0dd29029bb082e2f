"""Load and verify: read manifest -> fetch, verify and decode every blob in one pass (``decode``:
bases and delta links together, straight into the destination) -> place (``placement``:
``map_location`` for every tensor, those inside pickled values included). A load may decode into
the caller's live tensors (``into``: matched by ``into.match_into``).

Every byte is checked against the manifest's size and xxh3 checksum before a decoder sees it, and
every decoder is bounded by the size the manifest declares (already validated against limits).
"""
from __future__ import annotations

import dataclasses

import logging
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import xxhash

from ..codecs import Pipeline
from ..config import EngineConfig
from ..errors import (CheckrunError, CorruptCheckpointError, FormatError, NotACheckpointError, ResourceLimitError,
                      StorageError, UnsafeLoadError)
from ..storage.retry import is_outage
from ..format.manifest import DTYPES, BlobRef, ChunkRef, Manifest, TensorRecord
from ..format.limits import check_load_bytes, memory_limit
from ..format.objects import deserialize_object, object_load_bytes
from .decode import Pass, decode_limit, fetch_blob, pack_limit, read_manifest
from .into import finish_into, plan_into
from .vanished import copied_hint, vanished
from .placement import Placer, map_location_tensor, object_map_location  # noqa: F401 - engine's import
from ..saving.staging import empty_host
from ..storage.store import Store
from ..storage.paths import blob_url
from ..format.skeleton import unflatten, validate_skeleton

log = logging.getLogger("ckpt_core")


class Scratch:
    """Per-thread byte buffers reused by the chunks of one load, freed with it: decoding writes
    into them instead of allocating (and page-faulting) fresh memory per chunk."""

    def __init__(self, where: str = "") -> None:
        self._local = threading.local()
        self.where = where

    def get(self, slot: Hashable, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` for ``slot``, private to the calling thread."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(slot)
        if buf is None or buf.size < nbytes:
            buf = bufs[slot] = alloc_host(nbytes, torch.uint8, self.where, "decoding buffer").numpy()
        return memoryview(buf)[:nbytes]


def alloc_host(numel: int, dtype: torch.dtype, where: str, what: str) -> torch.Tensor:
    """``empty_host``, with an allocation failure (the sizes come from a manifest) as a CheckrunError."""
    try:
        return empty_host(numel, dtype)
    except (RuntimeError, MemoryError) as exc:
        raise ResourceLimitError(f"{where}: {what} of {numel * dtype.itemsize} bytes cannot be allocated: "
                                 f"{exc}") from None


def decode_chunk(store: Store, pipeline: Pipeline, chunk: ChunkRef, dtype: torch.dtype) -> torch.Tensor:
    """Fetch, verify and decode one chunk (a part of a pack included) into a new (rows, cols) tensor."""
    data = fetch_blob(store, chunk.blob)
    try:
        if chunk.part is None:
            return pipeline.decode(data, (chunk.rows, chunk.cols), dtype, decode_limit(chunk, dtype))
        start, total = chunk.part
        pack = pipeline.decode(data, (1, total // dtype.itemsize), dtype, pack_limit(total)).reshape(-1)
        first = start // dtype.itemsize
        return pack[first:first + chunk.rows * chunk.cols].clone().view(chunk.rows, chunk.cols)
    except FormatError as exc:
        raise FormatError(f"{blob_url(store, chunk.blob.key)}: {exc}") from None


def _pipeline(rec: TensorRecord, where: str) -> Pipeline:
    try:
        return Pipeline.from_list(list(rec.codecs))
    except FormatError as exc:
        raise FormatError(f"{where}: tensor {rec.key!r}: {exc}") from None


@dataclass
class LoadedTensor:
    record: TensorRecord
    flat: torch.Tensor
    delta_indices: list = field(default_factory=list)
    copy: torch.Tensor | None = None  # a second copy of the values, private to the engine


#: ``keep_copy(record, flat, live)``: whether ``load_tensors`` should also fill ``LoadedTensor.copy``
#: (``live``: ``flat`` is the caller's own CPU tensor, from ``into``).
KeepCopy = Callable[[TensorRecord, torch.Tensor, bool], bool]


def load_tensors(store: Store, manifest: Manifest, where: str, keep_copy: KeepCopy | None = None,
                 max_total_bytes: int | None = None,
                 alloc_copy: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                 into: dict[int, torch.Tensor] | None = None,
                 deferred: list[int] | None = None, reserve: int = 0) -> list[LoadedTensor]:
    """Fetch, verify and decode every tensor: one pass over the bases and every delta link
    (``decode.Pass``), each tensor's links applied in chain order as soon as its blobs are decoded.

    ``into`` (record index -> a contiguous CPU tensor of the record's shape and dtype): decoded
    straight into that tensor, which becomes ``LoadedTensor.flat``; the others are allocated here.
    Tensors ``keep_copy`` selects get a second copy (``LoadedTensor.copy``, never an alias of
    ``flat``), made on the io threads while the values are hot (the engine keeps it as the
    reference of the next row-delta save). What the manifest declares (tensors not in ``into``,
    row indices, the links' values, the copies) is checked against ``max_total_bytes``
    (``load.max_total_bytes``) before anything is allocated. ``alloc_copy(numel, dtype)`` allocates
    those copies where the caller keeps them (the writer process's shared memory), default: here.
    With ``deferred`` (a list), the records ``keep_copy`` selects are counted the same but appended
    to it instead of copied: the caller makes the copies later (``load_references``). ``reserve``:
    bytes of the same limit the caller holds already (the pickled values, ``fetch_objects``)."""
    into, limit, out = into or {}, memory_limit(max_total_bytes), []
    total = check_load_bytes(manifest, where, limit, reserve + tensor_bytes(manifest, into))
    scratch = Scratch(where)
    one_pass = Pass(store, where, scratch.get, lambda n, dtype, what: alloc_host(n, dtype, where, what))
    for i, rec in enumerate(manifest.tensors):
        dtype = DTYPES[rec.dtype]
        pipe = _pipeline(rec, where)
        live = into.get(i)
        flat = live.detach().view(-1) if live is not None else alloc_host(rec.numel, dtype, where, f"tensor {rec.key!r}")
        lt = LoadedTensor(rec, flat)
        if keep_copy is not None and keep_copy(rec, flat, live is not None):
            total = check_load_bytes(manifest, where, limit, total + rec.nbytes)
            if deferred is not None:
                deferred.append(i)
            else:
                lt.copy = (alloc_copy(rec.numel, dtype) if alloc_copy is not None
                           else alloc_host(rec.numel, dtype, where, f"copy of tensor {rec.key!r}"))
        out.append(lt)
        one_pass.add(lt, pipe, dtype)
    one_pass.run()
    return out


def tensor_bytes(manifest: Manifest, into: dict[int, torch.Tensor]) -> int:
    """Host memory that decoding the tensors takes, not counting kept copies: each tensor not
    decoded into ``into``, plus each delta's row indices and values (a pack is no larger than its
    members: ``limits.check_packs``)."""
    return sum((0 if i in into else rec.nbytes)
               + sum(d.n for d in rec.deltas) * (8 + rec.nbytes // max(1, rec.row_shape[0]))
               for i, rec in enumerate(manifest.tensors))


def load_references(store: Store, manifest: Manifest, where: str, indices: list[int],
                    alloc: Callable[[int, torch.dtype], torch.Tensor],
                    max_total_bytes: int | None = None, stop: threading.Event | None = None) -> list[LoadedTensor]:
    """Decode the tensors ``indices`` of ``manifest`` again, each into a buffer from ``alloc(numel,
    dtype)`` that becomes its ``copy`` (and ``flat``): the references of the next row-delta saves,
    rebuilt after a load returned (``engine.load``, ``load.reference``). Read and verified like a
    load; what the copies and the links need is checked against ``max_total_bytes`` first. Once
    ``stop`` is set, the blobs not read yet are not read (a CheckrunError is raised)."""
    recs = [manifest.tensors[i] for i in indices]
    check_load_bytes(manifest, where, memory_limit(max_total_bytes), sum(
        rec.nbytes + sum(d.n for d in rec.deltas) * (8 + rec.nbytes // max(1, rec.row_shape[0])) for rec in recs))
    scratch = Scratch(where)
    one_pass = Pass(store, where, scratch.get, lambda n, dtype, what: alloc_host(n, dtype, where, what), stop)
    out = []
    for rec in recs:
        dtype = DTYPES[rec.dtype]
        lt = LoadedTensor(rec, alloc(rec.numel, dtype))
        out.append(lt)
        one_pass.add(lt, _pipeline(rec, where), dtype)
    one_pass.run()
    for lt in out:
        lt.copy = lt.flat
    return out


def load_manifest_state(store: Store, name: str, manifest: Manifest, *, map_location: Any,
                        weights_only: bool | None, config: EngineConfig,
                        keep_copy: KeepCopy | None = None,
                        alloc_copy: Callable[[int, torch.dtype], torch.Tensor] | None = None,
                        into: Any = None, deferred: list[int] | None = None) -> tuple[Any, list[LoadedTensor]]:
    """Rebuild the saved state tree from a parsed manifest (``keep_copy``, ``alloc_copy``,
    ``deferred``: see ``load_tensors``). The CPU tensors of ``into`` that match a stored tensor (``into.plan_into``)
    receive its values in place and are the leaves returned; ``map_location`` places the others."""
    where = store.url(name)
    leaves = check_structure(manifest, where)
    plan = plan_into(manifest, leaves, into)
    try:  # a map_location naming a device this machine lacks fails here, before any blob is read
        object_location = object_map_location(map_location)
    except CheckrunError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    try:
        blobs, reserve = fetch_objects(store, manifest, where, config.load.max_total_bytes, plan.direct)
        loaded = load_tensors(store, manifest, where, keep_copy, config.load.max_total_bytes, alloc_copy,
                              plan.direct, deferred, reserve)
    except CorruptCheckpointError as exc:  # a missing or damaged blob: name the checkpoint too
        if (gone := vanished(store, name, manifest, config)) is not None:  # removed or replaced meanwhile
            raise gone from exc
        if where in str(exc):
            raise
        raise type(exc)(f"{where}: {exc}{copied_hint(store)}") from exc
    placer = Placer(map_location)
    try:
        tensors = [lt.flat.view(lt.record.shape) if i in plan.direct else
                   placer.place(lt.flat.view(lt.record.shape), lt.record.device) for i, lt in enumerate(loaded)]
    except CheckrunError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    finally:
        placer.finish()  # one wait per device for the copies queued
    finish_into(plan, tensors)
    objects = []
    for i, rec in enumerate(manifest.objects):
        data, blobs[i] = blobs[i], b""  # let each blob go once its value is built
        try:
            objects.append(deserialize_object(data, key=rec.key, type_name=rec.type, weights_only=weights_only,
                                              allowed_globals=config.load.allowed_globals,
                                              map_location=object_location))
        except CheckrunError as exc:  # name the checkpoint and blob
            raise type(exc)(f"{where}: {exc} ({blob_url(store, rec.blob.key)})") from exc
    try:
        state = unflatten(manifest.skeleton, [plan.leaves.get(j, tensors[i]) for j, i in enumerate(leaves)], objects)
    except CheckrunError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise FormatError(f"{where}: invalid state skeleton: {exc}") from None
    return state, loaded


def fetch_objects(store: Store, manifest: Manifest, where: str, max_total_bytes: int | None,
                  into: dict[int, torch.Tensor]) -> tuple[list[bytes], int]:
    """Fetch and verify the pickled values' blobs, before any tensor is decoded; returns them and the
    bytes charged for them. Their declared sizes, and what unpickling each may allocate (its zip
    directory: ``objects.object_load_bytes``), count against ``load.max_total_bytes`` together with
    the tensors (``tensor_bytes``): a value is refused (ResourceLimitError) before it is unpickled."""
    limit = memory_limit(max_total_bytes)
    left = limit - check_load_bytes(manifest, where, limit, tensor_bytes(manifest, into))  # tensors alone first
    need = sum(rec.blob.size for rec in manifest.objects)
    if need > left:
        raise ResourceLimitError(f"{where}: loading needs {need} bytes for the blobs of its pickled values, "
                                 f"more than the {max(0, left)} its tensors leave of the limit of {limit} "
                                 "(load.max_total_bytes)")
    blobs = []
    for rec in manifest.objects:
        try:
            data = fetch_blob(store, rec.blob)
        except CorruptCheckpointError as exc:
            raise type(exc)(f"{where}: {exc}{copied_hint(store)}") from exc
        try:
            need += object_load_bytes(data, key=rec.key, type_name=rec.type, max_bytes=left - need)
        except CheckrunError as exc:  # name the checkpoint and blob
            raise type(exc)(f"{where}: {exc} ({blob_url(store, rec.blob.key)})") from exc
        blobs.append(data)
    return blobs, need


def check_structure(manifest: Manifest, where: str) -> list[int]:
    """Validate the leaf table and the skeleton against the manifest's tensors and objects; returns the leaf table."""
    leaves = manifest.meta.get("leaves", list(range(len(manifest.tensors))))
    if not isinstance(leaves, list) or not all(isinstance(i, int) and 0 <= i < len(manifest.tensors)
                                               for i in leaves):
        raise FormatError(f"{where}: invalid leaf table")
    try:
        validate_skeleton(manifest.skeleton, len(leaves), len(manifest.objects))
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    return leaves


@dataclass
class VerifyReport:
    """Outcome of ``verify``: ``ok`` only if the manifest and every blob it needs are intact."""

    path: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0
    unreadable: bool = False
    """Some problem is the storage's (a ``StorageError`` after retries): the checkpoint may be intact."""
    unverified: bool = False
    """Every problem is a check that could not run within ``load.max_total_bytes`` (a tensor larger than
    it): the checkpoint is not known to be corrupt (before 2026-12-06 it was reported corrupt)."""
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    """The parsed manifest (None if it could not be read)."""
    foreign: bool = False
    """The file is not a checkrun checkpoint at all (a torch.save file): not damaged, not checkrun's."""

    def add(self, problem: str, unreadable: bool = False, unverified: bool = False) -> None:
        """Record ``problem`` (the checkpoint is then not ok); ``unreadable``: the storage failed to return it."""
        self.unverified = unverified and (self.unverified or self.ok)
        self.ok = False
        self.problems.append(problem)
        self.unreadable = self.unreadable or unreadable


def require_readable(unreadable: bool, url: str, error: str | None) -> None:
    """``latest`` skips a corrupt checkpoint, never one the storage failed to return: a resume would silently go
    back to an older one (and its saves overwrite the newer)."""
    if unreadable:
        raise StorageError(f"{url}: cannot read it ({error}); not skipping it for an older checkpoint: "
                           "retry when the storage answers (or, if it was not permitted, fix its permissions)")


@dataclass
class VerifyCache:
    """What verifying earlier checkpoints of a directory found intact, so that checkpoints sharing blobs and tensors
    (incremental saves) check each once: a ``checkrun verify DIR`` of 200 checkpoints of 200 tensors opened 40,000
    blob files for 399 distinct blobs. Only what was found intact is kept (a damaged blob: reported for each)."""

    blobs: set[bytes] = field(default_factory=set)
    """A digest of (the store's URL, reference) of each blob found intact: another store (a composite's
    parts, a linked manifest's directory) holds its own copy, checked there."""
    tensors: set[bytes] = field(default_factory=set)
    """A digest of (the store's URL, record without its key) of each tensor that decoded. Digests, 16
    bytes each, keep the cache small beside a directory of full (not incremental) saves."""

    def blob(self, here: str, ref: BlobRef) -> bytes:
        """What a blob's check depends on: the store's URL ``here`` and the reference (key, size, checksum)."""
        return xxhash.xxh3_128_digest(f"{here}\0{ref.key}\0{ref.size}\0{ref.csum}".encode("utf-8", "surrogatepass"))

    def tensor(self, here: str, rec: TensorRecord) -> bytes:
        """What decoding a record depends on: all but its key and what its save wrote."""
        text = f"{here}\0{dataclasses.replace(rec, key='', written=0)!r}"
        return xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass"))


#: A verify decodes the tensors in groups of about this many bytes, each freed before the next: a
#: checkpoint larger than the machine's memory can be verified.
VERIFY_GROUP_BYTES = 256 << 20


def _torch_save_file(store: Store, name: str) -> bool:
    """``name`` starts as a torch.save file (a zip archive, a pickle of the legacy format) or a safetensors
    file (an 8-byte header length, then its JSON: h160) does."""
    try:
        head = store.read_head(name, 10)
    except Exception:  # noqa: BLE001 - only a label: unknown stays "corrupt"
        return False
    return (head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))
            or (head[8:10] == b'{"' and 0 < int.from_bytes(head[:8], "little") < 1 << 40))


def verify_manifest(store: Store, name: str, config: EngineConfig, *, decode: bool = True,
                    progress: Callable[[int], None] | None = None, cache: VerifyCache | None = None,
                    blobs: bool = True) -> VerifyReport:
    """Check the manifest, then (unless ``blobs=False``) every blob's presence, size and checksum
    (and decodability); ``cache``: skip what an earlier verify with it found intact."""
    report = VerifyReport(store.url(name))
    try:
        manifest = report.manifest = read_manifest(store, name, config)
    except CheckrunError as exc:
        report.add(str(exc), is_outage(exc))
        report.foreign = isinstance(exc, NotACheckpointError) and _torch_save_file(store, name)
        return report
    if not blobs:
        return report
    # Every distinct reference, not one per key: references to one blob that disagree (size or
    # checksum) cannot all match it, so such a manifest fails.
    unique = list(dict.fromkeys(manifest.blobs()))
    cache, here = cache if cache is not None else VerifyCache(), store.url("")
    known = {ref for ref in unique if cache.blob(here, ref) in cache.blobs}
    for ref in known:
        report.blobs_checked += 1
        report.bytes_checked += ref.size
        if progress is not None:
            progress(ref.size)
    unique = [r for r in unique if r not in known]

    def check(ref: BlobRef) -> CheckrunError | None:
        try:
            fetch_blob(store, ref)
            return None
        except CheckrunError as exc:
            return exc
        finally:
            if progress is not None:
                progress(ref.size)

    for ref, problem in zip(unique, store.map(check, unique)):
        report.blobs_checked += 1
        report.bytes_checked += ref.size
        if problem:
            report.add(str(problem), is_outage(problem))
        else:
            cache.blobs.add(cache.blob(here, ref))
    if not report.ok and (gone := vanished(store, name, manifest, config)) is not None:  # not damaged
        return VerifyReport(report.path, False, [str(gone)], report.blobs_checked, report.bytes_checked)
    if not report.ok and (hint := copied_hint(store)):
        report.add(hint.strip(" ()"))
    if report.ok and decode:
        try:
            check_structure(manifest, report.path)
            if isinstance(manifest.meta.get("dcp"), dict):  # what a DCP load reads instead of the skeleton
                from ..dcp.format import decode_metadata
                decode_metadata(manifest.meta["dcp"], manifest, report.path)
            _decode_all(store, manifest, report.path, config, cache)
            _check_objects(store, manifest, report.path, config)
        except ResourceLimitError as exc:
            report.add(f"{exc}; not decoded, so not verified (the blobs' checksums matched)", unverified=True)
        except CheckrunError as exc:  # a blob gone since its checksum was read: removed meanwhile? (h167)
            gone = isinstance(exc, CorruptCheckpointError) and vanished(store, name, manifest, config)
            report.add(str(gone or exc), is_outage(exc))
    return report


def _decode_all(store: Store, manifest: Manifest, where: str, config: EngineConfig, cache: VerifyCache) -> None:
    """Decode every tensor the cache has not seen decode, in groups of ``VERIFY_GROUP_BYTES``."""
    group: list[TensorRecord] = []
    size, here = 0, store.url("")
    for rec in manifest.tensors + (None,):
        if rec is not None and cache.tensor(here, rec) in cache.tensors:
            continue
        if group and (rec is None or size + rec.nbytes > VERIFY_GROUP_BYTES):
            load_tensors(store, dataclasses.replace(manifest, tensors=tuple(group)), where,
                         max_total_bytes=config.load.max_total_bytes)
            cache.tensors.update(cache.tensor(here, r) for r in group)
            group, size = [], 0
        if rec is not None:
            group.append(rec)
            size += rec.nbytes


def _check_objects(store: Store, manifest: Manifest, where: str, config: EngineConfig) -> None:
    """Unpickle every pickled value as a load does (restricted): a blob whose checksum matches yet
    fails to load (damaged before it was checksummed) fails verify as it fails the load. A value
    torch's restricted unpickler refuses is not damage (allowing it is the caller's choice); DCP's byte
    values are the planner's to read."""
    for rec in manifest.objects:
        if rec.type == "dcp.bytes":
            continue
        data = fetch_blob(store, rec.blob)
        try:
            object_load_bytes(data, key=rec.key, type_name=rec.type, max_bytes=memory_limit(config.load.max_total_bytes))
            with warnings.catch_warnings():  # torch's beta/deprecation notes on sparse, quantized ... values
                warnings.simplefilter("ignore")
                deserialize_object(data, key=rec.key, type_name=rec.type, weights_only=True, map_location="cpu")
        except UnsafeLoadError:
            continue
        except CheckrunError as exc:
            raise type(exc)(f"{where}: {exc} ({blob_url(store, rec.blob.key)})") from exc
