"""``CheckrunStorageReader``: loads a checkrun DCP checkpoint through torch.distributed.checkpoint.

DCP's call order (``dcp.load``): ``reset(checkpoint_id)``, ``read_metadata`` (every rank reads and
validates the manifest itself: magic, format version, checksum, every field and reference),
``set_up_storage_reader``, ``prepare_local_plan``/``prepare_global_plan`` (unchanged: DCP's planner does
the resharding), ``read_data``. ``read_data`` fetches only the chunks of a stored shard that overlap
what this rank asks for, checks each blob's size and xxh3 checksum before decoding it, and copies the
requested hypercube into the planner's tensors. Any world size may load any checkpoint.
"""
from __future__ import annotations

import io
import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..codecs import Pipeline
from ..config import EngineConfig, coerce_config
from .blobs import KNOWN
from .format import CheckpointIdMixin, decode_metadata
from ..errors import CheckrunError, CorruptCheckpointError, FormatError, NotACheckpointError, ResourceLimitError
from ..format.limits import memory_limit
from ..format.manifest import DTYPES, BlobRef, Manifest, ObjectRecord
from ..loading.reader import check_structure, decode_chunk, fetch_blob, read_manifest
from ..saving.fence import observe
from ..storage.paths import blob_url, is_local_fs, join
from ..storage.store import Store

__all__ = ["CheckrunStorageReader"]
_BATCH_BYTES = 256 << 20


class CheckrunStorageReader(CheckpointIdMixin, StorageReader):
    """Reads a checkpoint written by :class:`CheckrunStorageWriter`:
    ``dcp.load(sd, storage_reader=CheckrunStorageReader("run/step=100.dcp"))``.

    Args:
        path: the checkpoint's manifest path or URL (``checkpoint_id`` given to ``dcp.load`` replaces it).
        config: ``EngineConfig``, dict, YAML path or None (storage threads/retries, ``load.max_blob_bytes``).
        storage_options: fsspec options, merged over ``config.storage.storage_options``.

    Non-tensor values are handed to the planner's ``load_bytes``: DCP's DefaultLoadPlanner unpickles them
    with ``weights_only=False``; ``ckpt_core.dcp.CheckrunLoadPlanner`` (used by ``ckpt_core.dcp.load``)
    uses torch's restricted unpickler instead.
    """

    def __init__(self, path: str | os.PathLike | None = None, config: EngineConfig | dict | str | None = None,
                 storage_options: dict | None = None) -> None:
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self.config = coerce_config(config)
        self.storage_options = storage_options
        self.storage_data: dict[MetadataIndex, str] = {}
        self.manifest: Manifest | None = None
        self.metadata_error: CheckrunError | None = None
        """What made the last ``read_metadata`` fail (a checkrun error), or None."""
        self._store: Store | None = None
        self._name = ""

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self._store = None
        self.storage_data, self.manifest = {}, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """(every rank) Read and validate the manifest; DCP's Metadata comes from its JSON, no pickle."""
        if kwargs.get("rank") is not None:  # DCP's fallback after a failed global read: that failure stands
            raise self.metadata_error or CheckrunError(
                "checkrun DCP checkpoints have one global manifest, no per-rank metadata")
        self.metadata_error = None
        try:
            store, name = self._resolve()
            _refuse_directory(store, name)
            manifest = read_manifest(store, name, self.config)
            dcp = manifest.meta.get("dcp")
            if not isinstance(dcp, dict):
                raise NotACheckpointError(f"{store.url(name)} is a checkrun checkpoint but was not written "
                                          "through torch.distributed.checkpoint: load it with ckpt_core.load")
            check_structure(manifest, store.url(name))  # unused by DCP, checked as verify does
            metadata, storage = decode_metadata(dcp, manifest, store.url(name))
        except CheckrunError as exc:
            # dcp.load keeps only this error's text (in an AssertionError); ckpt_core.dcp.load raises it
            self.metadata_error = exc
            raise
        self.manifest, self.storage_data = manifest, storage
        observe(manifest.commit)  # this process's next checkpoints are newer than the one it loads (h134)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.manifest is None:
            self.read_metadata()
        if metadata.storage_data is not None:
            self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(every rank) Fetch, verify and decode what ``plan`` asks for; returns a completed future."""
        store, name = self._resolve()
        assert self.manifest is not None
        where, since = store.url(name), time.time()
        tensors = {t.key: t for t in self.manifest.tensors}
        objects = {o.key: o for o in self.manifest.objects}
        by_record: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            key = self.storage_data.get(req.storage_index)
            if key is None:
                raise FormatError(f"{where}: no stored item for {req.storage_index}")
            by_record.setdefault(key, []).append(req)
        byte_keys = [k for k, reqs in by_record.items() if reqs[0].type == LoadItemType.BYTE_IO]
        fetched = [_object(objects, k, where).blob for k in byte_keys]
        payloads = store.map(lambda ref: fetch_blob(store, ref), fetched)
        for key, data in zip(byte_keys, payloads):
            for req in by_record[key]:
                try:
                    planner.load_bytes(req, io.BytesIO(data))
                except CheckrunError as exc:  # name the checkpoint and blob
                    blob = blob_url(store, _object(objects, key, where).blob.key)
                    raise type(exc)(f"{where}: {exc} ({blob})") from exc
        batch, size = [], 0
        for key, reqs in by_record.items():
            if reqs[0].type == LoadItemType.BYTE_IO:
                continue
            rec = tensors.get(key)
            if rec is None:
                raise FormatError(f"{where}: item {key!r} has no tensor record")
            batch.append((rec, reqs))
            size += rec.nbytes
            if size >= _BATCH_BYTES:
                fetched += self._read_batch(store, batch, planner, where)
                batch, size = [], 0
        if batch:
            fetched += self._read_batch(store, batch, planner, where)
        KNOWN.remember(store, self.manifest.blobs(), replace=False)
        KNOWN.adopt_verified(store, fetched, since)  # read and checked: a save reuses them without reading again
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # -- internals -------------------------------------------------------------------------------
    def _resolve(self) -> tuple[Store, str]:
        if self.path is None:
            raise CheckrunError("CheckrunStorageReader has no path: pass one or a checkpoint_id to dcp.load")
        if self._store is None:
            self._store, self._name = Store.for_path(self.path, self.storage_options, self.config.storage)
        return self._store, self._name

    def _read_batch(self, store: Store, batch: list, planner: LoadPlanner, where: str) -> list[BlobRef]:
        """Decode the needed chunks of a batch of records in parallel, then copy on this thread.
        Returns the blobs it read (each verified against its checksum)."""
        tasks, buffers = [], []
        need, limit = sum(rec.nbytes for rec, _ in batch), memory_limit(self.config.load.max_total_bytes)
        if need > limit:  # the stored tensors this batch decodes at once (DCP's own tensors are the caller's)
            raise ResourceLimitError(f"{where}: reading {', '.join(repr(rec.key) for rec, _ in batch[:3])} needs "
                                     f"{need} bytes of host memory, more than the limit of {limit} "
                                     "(load.max_total_bytes)")
        for rec, reqs in batch:
            dtype = DTYPES[rec.dtype]
            try:
                pipe = Pipeline.from_list(list(rec.codecs))
            except FormatError as exc:
                raise FormatError(f"{where}: tensor {rec.key!r}: {exc}") from None
            try:
                flat = torch.empty(rec.numel, dtype=dtype)
            except (RuntimeError, MemoryError) as exc:  # a hostile or damaged manifest's size
                raise CorruptCheckpointError(f"{where}: tensor {rec.key!r} declares {rec.nbytes} bytes, which "
                                             f"cannot be allocated: {exc}") from None
            buffers.append(flat)
            spans = [_flat_span(rec.shape, r.storage_offsets, r.lengths) for r in reqs]
            for chunk in rec.base:
                end = chunk.off + chunk.rows * chunk.cols
                if any(s < end and chunk.off < e for s, e in spans if e > s):
                    tasks.append((flat, pipe, chunk, dtype))

        def decode(task) -> None:
            flat, pipe, chunk, dtype = task
            flat[chunk.off:chunk.off + chunk.rows * chunk.cols] = decode_chunk(store, pipe, chunk, dtype).reshape(-1)

        store.map(decode, tasks)
        for (rec, reqs), flat in zip(batch, buffers):
            view = flat.view(rec.shape)
            for req in reqs:
                src = _narrow(view, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != src.size():
                    raise FormatError(f"{where}: {rec.key!r}: request of size {tuple(target.size())} does not "
                                      f"match the stored region {tuple(src.size())}")
                target.copy_(src)
                planner.commit_tensor(req, target)
        return [chunk.blob for _, _, chunk, _ in tasks]


def _object(objects: dict[str, ObjectRecord], key: str, where: str) -> ObjectRecord:
    rec = objects.get(key)
    if rec is None:
        raise FormatError(f"{where}: item {key!r} has no object record")
    return rec


def _flat_span(shape: tuple[int, ...], offsets, lengths) -> tuple[int, int]:
    """Smallest [start, end) of row-major element indices holding the hypercube (offsets, lengths)."""
    if len(offsets) != len(shape) or len(lengths) != len(shape):
        raise FormatError(f"read request of rank {len(offsets)} for a tensor of shape {shape}")
    if any(l == 0 for l in lengths):
        return 0, 0
    if any(o + l > d for o, l, d in zip(offsets, lengths, shape)):
        raise FormatError(f"read request {list(offsets)}+{list(lengths)} outside the stored shape {shape}")
    start = end = 0
    for o, l, d in zip(offsets, lengths, shape):
        start, end = start * d + o, end * d + o + l - 1
    return start, end + 1


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, l) in enumerate(zip(offsets, lengths)):
        if o != 0 or l != t.size(dim):
            t = t.narrow(dim, o, l)
    return t


def _refuse_directory(store: Store, name: str) -> None:
    """A local directory where the checkpoint file should be: say so (and what it may hold) instead of
    "no checkpoint at" it."""
    path = join(store.root, name)
    if not (is_local_fs(store.fs) and os.path.isdir(path)):
        return
    hint = ("; it holds a .metadata file: a checkpoint of DCP's FileSystemWriter, which dcp.load reads without "
            "a checkrun storage reader" if os.path.isfile(os.path.join(path, ".metadata")) else "")
    raise NotACheckpointError(f"{store.url(name)} is a directory, not a checkrun DCP checkpoint (one file, e.g. "
                              f"{store.url(name)}/step=100.dcp){hint}")
