"""Step 5 of a save: the commit of the manifest, under the save's lease, and what it reports.

``write_and_commit`` runs on the engine's coordinator thread or in the writer process: it takes the
save's lease (``save_lease``), has ``writer.SnapshotWriter`` store every blob, then has the manifest
published in one atomic step (``publish_manifest``: fenced by ``fence`` and with the lease checked
right before the rename/PUT, ``_guard``). The writer process publishes through the training process
(``process.WriterProcess.commit``), so a writer whose trainer died commits nothing. After the commit
the lease is released (the manifest protects the blobs); after a failure it is marked expired, so
the next collection deletes what no manifest references.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

from .capture import Snapshot
from ..config import EngineConfig
from ..errors import CheckrunError, FormatError
from ..format.limits import MAX_MANIFEST_BYTES, check_json, json_shape, limits_for
from .fence import CommitStamp, ReplacedManifest, commit_guard
from .handles import WriteStats
from ..format.manifest import Manifest
from .quant_rules import RuleMatcher
from .lease import SaveLease
from ..storage.paths import blob_url
from ..storage.store import Store
from .streams import DirState
from .write import SnapshotWriter

log = logging.getLogger("ckpt_core")


@dataclass(frozen=True)
class Committed:
    """What the background part of one save reports (from a thread or from the writer process)."""

    stats: WriteStats
    manifest_bytes: int
    new_blobs: int
    reused_blobs: int
    quantized_tensors: int
    quantization_saved_bytes: int
    stream_updates: dict
    """Row stream key -> (plan, record, spec id, detected): applied by ``commit_streams``."""
    unmatched_rules: tuple
    replaced: bytes | None = None
    """The manifest the commit replaced at its name (``fence.ReplacedManifest``): its blobs are collection candidates."""


Publish = Callable[[bytes, Callable[[], None]], None]
"""``publish(data, guard)``: make the manifest ``data`` the checkpoint, running ``guard`` first."""


def write_and_commit(snap: Snapshot, store: Store, name: str, dirstate: DirState, config: EngineConfig,
                     matcher: RuleMatcher, workers: Executor, publish: Publish | None = None) -> Committed:
    """Write every blob of ``snap``, then commit its manifest as ``name`` and remember what it holds.

    ``publish`` commits the manifest's bytes (default: ``publish_manifest`` here; the writer process
    hands them to the training process). The commit is fenced (``fence``): it raises
    ``SupersededError`` instead of replacing a newer manifest of that name. The save's lease is held
    from its first blob to the commit."""
    lease = SaveLease(store, config)
    try:
        writer = SnapshotWriter(snap, store, dirstate, config, matcher, workers, lease)
        manifest, stats = writer.write()
        if snap.stamp is not None:
            manifest = dataclasses.replace(manifest, commit=snap.stamp.to_json())
        data = manifest.to_bytes()
        _check_loadable(data, store.url(name), config, manifest)
        guard = lambda: _guard(store, lease, manifest)  # noqa: E731
        replaced = None
        if publish is None:
            replaced = publish_manifest(store, name, snap.stamp, data, guard)
        else:
            publish(data, guard)
        check_after(store, name, lease, manifest, data)
    except BaseException:
        lease.abandon()  # its keys become candidates of the next collection
        raise
    lease.release()  # the manifest protects the blobs from now on
    writer.adopt(manifest)
    snap.hold.records = {st.key: rec for st, rec in zip(snap.tensors, manifest.tensors) if st.stream is None}
    new = sum(1 for r in manifest.tensors if r.written)
    quantized = [r for r in manifest.tensors if r.quant]
    return Committed(WriteStats.from_manifest(stats), len(data), new, len(manifest.blobs()) - new, len(quantized),
                     sum(r.nbytes - sum(b.size for b in r.blobs()) for r in quantized),
                     writer.stream_updates, matcher.unmatched_rules(), replaced)


def _check_loadable(data: bytes, url: str, config: EngineConfig, manifest: Manifest) -> None:
    """Refuse to commit a manifest that loads would refuse (``limits.check_json``): the save fails now,
    not the resume later (``capture.check_manifest_room`` refused most such states before any blob
    was written). The message says what filled it: the records of its tensors and pickled values,
    or plain values (large flat lists and strings go to blobs, ``tree.SPILL_ITEMS``, so these are
    very many small plain containers)."""
    try:
        check_json(data, url, limits_for(config))
    except FormatError as exc:
        plain = json_shape(json.dumps(manifest.skeleton).encode())[1]
        records = json_shape(data)[1] - plain
        if plain > records or len(json.dumps(manifest.skeleton)) > len(data) // 2:
            fix = "keep large plain values (nested lists and dicts of numbers, strings) as tensors"
        elif len(data) > MAX_MANIFEST_BYTES:
            fix = "group small tensors into fewer, larger ones (a manifest is at most 64 MiB, ~400 bytes a tensor)"
        else:
            fix = ("raise load.max_manifest_elements where you save and where you load, or group small "
                   "tensors into fewer, larger ones")
        raise FormatError(f"cannot save {url}: its manifest would not load ({exc}): the records of its "
                          f"{len(manifest.tensors)} tensors and {len(manifest.objects)} pickled values take "
                          f"{records} JSON elements, the state's structure and plain values {plain}; {fix}") from None


def publish_manifest(store: Store, name: str, stamp: CommitStamp | None, data: bytes,
                     guard: Callable[[], None] | None = None) -> bytes | None:
    """Commit the manifest ``data`` as ``name`` (``Store.write_manifest``); right before the
    rename/PUT, ``guard`` runs, then the fence (``fence.commit_guard``) of a stamped save. Returns the
    manifest it replaced, as the fence read it (None: none there, or not read)."""
    replaced = ReplacedManifest()
    fence = commit_guard(store, name, stamp, replaced) if stamp is not None else None

    def check() -> None:
        if guard is not None:
            guard()
        if fence is not None:
            fence()

    store.write_manifest(name, data, guard=check)
    return replaced.data


def _guard(store: Store, lease: SaveLease, manifest: Manifest) -> None:
    """Right before the commit's rename/PUT: if the lease lapsed since the writer's last check
    (renewals failing while the commit waited), take it again and make sure every blob still
    exists."""
    if not lease.intact():
        lease.refresh()
        keys = sorted(manifest.blob_keys())
        gone = [k for k, info in zip(keys, store.map(store.blob_info, keys)) if info is None]
        if gone:
            raise CheckrunError(f"{len(gone)} blob(s) of the save to {store.url('')} were collected "
                                f"while its lease had lapsed (e.g. {blob_url(store, gone[0])}); not committed")


def check_after(store: Store, name: str, lease: SaveLease, manifest: Manifest, data: bytes) -> None:
    """Right after the rename/PUT: if the lease lapsed meanwhile (the process paused between the guard
    and the commit longer than the lease), a collection may have deleted blobs the new manifest needs.
    Take the lease again and look: if any is gone, remove the manifest (when it still holds this save's
    bytes) and fail, instead of reporting a checkpoint done that cannot load."""
    if lease.intact():
        return
    lease.refresh()
    keys = sorted(manifest.blob_keys())
    gone = [k for k, info in zip(keys, store.map(store.blob_info, keys)) if info is None]
    if not gone:
        return
    try:
        if store.read_manifest(name) == data:
            store.delete_manifest(name)
    except CheckrunError as exc:
        log.warning("checkrun: could not remove %s after its blobs were collected: %s", store.url(name), exc)
    raise CheckrunError(f"{len(gone)} blob(s) of the save to {store.url(name)} were collected while its commit "
                        f"was paused past its lease (e.g. {blob_url(store, gone[0])}); the manifest was removed: "
                        "not committed")


def commit_streams(snap: Snapshot, done: Committed, max_chain: int) -> None:
    """Advance the snapshot's row streams to what was committed (on the engine's side)."""
    streams = {st.key: st.stream for st in snap.tensors if st.stream is not None}
    for key, (plan, rec, spec_id, detected) in done.stream_updates.items():
        streams[key].commit(plan, rec, spec_id, detected, max_chain)
