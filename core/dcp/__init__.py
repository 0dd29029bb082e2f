"""checkrun as a torch.distributed.checkpoint (DCP) storage layer.

DCP does the distributed part (planning, DTensor/FSDP sharding, resharding on load, coordination);
checkrun stores what each rank writes: content-addressed, checksummed, compressed chunks (the engine's
codec pipelines and quantization rules), a chunk already in the store is not written again (once its
stored bytes were checked, once per process; a rotted one is), on any fsspec URL, and the coordinator
commits one manifest after every rank's data is durable. See docs/distributed.md.

Plain DCP (every rank)::

    import torch.distributed.checkpoint as dcp
    from ckpt_core.dcp import CheckrunStorageWriter, CheckrunStorageReader, CheckrunSavePlanner

    dcp.save(state, storage_writer=CheckrunStorageWriter("s3://b/run/step=100.dcp"),
             planner=CheckrunSavePlanner())                    # planner optional: spreads replicated tensors
    dcp.load(state, storage_reader=CheckrunStorageReader("s3://b/run/step=100.dcp"))

or the helpers below (same thing, safe unpickling on load): ``save``, ``async_save``, ``load``,
``load_state_dict`` (whole checkpoint into one process, no process group needed), ``is_dcp_checkpoint``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from concurrent.futures import Future
from typing import Any, Iterator

import torch
import torch.distributed as _dist
import torch.distributed.checkpoint as _dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import EngineConfig, coerce_config
from .format import FORMAT
from .planner import CheckrunLoadPlanner, CheckrunSavePlanner, spread_save_plans
from .reader import CheckrunStorageReader
from .writer import CheckrunStorageWriter, DcpSaveInfo
from ..errors import CheckrunError, FormatError, ResourceLimitError
from ..format.limits import memory_limit
from ..loading.reader import read_manifest
from ..saving.staging import empty_host
from ..storage.store import Store

__all__ = ["CheckrunStorageWriter", "CheckrunStorageReader", "CheckrunSavePlanner", "CheckrunLoadPlanner",
           "DcpSaveInfo", "save", "async_save", "load", "load_state_dict", "is_dcp_checkpoint",
           "spread_save_plans", "FORMAT"]

PathLike = str | os.PathLike
ConfigLike = EngineConfig | dict | str | None


@contextlib.contextmanager
def _checkrun_errors(reader: CheckrunStorageReader | None = None) -> Iterator[None]:
    """DCP reports every rank's failure as one CheckpointException (a BaseException); when a checkrun
    error (corrupt blob, unsafe value, missing checkpoint) caused it, raise that error instead. A
    failed metadata read reaches DCP's exception only as text: ``reader`` keeps the error itself (and
    DCP's warnings about it, tracebacks of the fallback it tries, are left out: the error says it)."""
    def keep(record: logging.LogRecord) -> bool:
        return not (reader is not None and reader.metadata_error is not None
                    and str(record.msg).startswith(("Global metadata is not found", "Rank local metadata")))

    root = logging.getLogger()  # where torch's state_dict_loader logs them
    root.addFilter(keep)
    try:
        yield
    except CheckpointException as exc:
        rank = _dist.get_rank() if _dist.is_available() and _dist.is_initialized() else 0
        failures = sorted(exc.failures.items(), key=lambda kv: kv[0] != rank)
        for _, (err, _trace) in failures:
            if isinstance(err, CheckrunError):
                raise err from exc
        if reader is not None and reader.metadata_error is not None:
            raise reader.metadata_error from exc
        raise
    finally:
        root.removeFilter(keep)


def _planner(spread_replicated: bool, min_piece_bytes: int | None) -> CheckrunSavePlanner:
    kwargs = {} if min_piece_bytes is None else {"min_piece_bytes": min_piece_bytes}
    return CheckrunSavePlanner(spread_replicated=spread_replicated, **kwargs)


_PENDING: dict[Future, threading.Event] = {}  # this process's async_save futures -> set once their callback ran


def _wait_pending() -> None:
    """Wait for this process's ``async_save`` futures before another save or load: DCP's background
    thread and the new call would run collectives on the same process group at once (with 2 gloo
    ranks both wait for ever through checkrun; DCP's own FileSystemWriter aborts in gloo). An
    earlier save's failure is not raised here: its own future reports it (a KeyboardInterrupt or a
    signal handler's exception while waiting is: h145). Its lease is released before this returns (a
    reused writer's next save must not have its own lease released by the earlier save's callback)."""
    for future, released in list(_PENDING.items()):
        with contextlib.suppress(Exception, CheckpointException):
            future.result()
        released.wait()


def save(state_dict: dict[str, Any], path: PathLike, *, config: ConfigLike = None,
         storage_options: dict | None = None, spread_replicated: bool = True, min_piece_bytes: int | None = None,
         writer: CheckrunStorageWriter | None = None, process_group: Any = None) -> DcpSaveInfo | None:
    """``dcp.save`` of ``state_dict`` to the checkrun checkpoint ``path``; call on every rank.

    Returns the coordinator's :class:`DcpSaveInfo` (None on other ranks). Raises DCP's
    ``CheckpointException`` on every rank if any rank failed; then nothing is committed.
    ``writer``: reuse one writer across saves (optional)."""
    writer = writer or CheckrunStorageWriter(path, config, storage_options)
    writer.last_save = None
    _wait_pending()
    try:
        _dcp.save(state_dict, checkpoint_id=path, storage_writer=writer,
                  planner=_planner(spread_replicated, min_piece_bytes), process_group=process_group)
    except BaseException:
        writer.release_lease(committed=False)
        raise
    writer.release_lease()  # committed on every rank's return: the manifest protects the blobs
    return writer.last_save


def async_save(state_dict: dict[str, Any], path: PathLike, *, config: ConfigLike = None,
               storage_options: dict | None = None, spread_replicated: bool = True,
               min_piece_bytes: int | None = None, writer: CheckrunStorageWriter | None = None,
               process_group: Any = None) -> Future:
    """``dcp.async_save``: returns after the state is staged (copied to CPU); the future completes
    when the manifest is committed (or raises). Call on every rank; the process group needs a CPU
    backend (gloo). Pass a ``writer`` built with ``cache_staged_state_dict=True`` to reuse buffers.
    A save, async_save or load of this module waits for the async_saves before it first."""
    writer = writer or CheckrunStorageWriter(path, config, storage_options)
    _wait_pending()
    result = _dcp.async_save(state_dict, checkpoint_id=path, storage_writer=writer,
                             planner=_planner(spread_replicated, min_piece_bytes), process_group=process_group)
    future = getattr(result, "upload_completion", result)
    released = _PENDING[future] = threading.Event()

    def finished(f: Future) -> None:
        try:
            writer.release_lease(committed=not f.cancelled() and f.exception() is None)
        finally:
            _PENDING.pop(f, None)
            released.set()

    future.add_done_callback(finished)
    return future


def load(state_dict: dict[str, Any], path: PathLike, *, config: ConfigLike = None,
         storage_options: dict | None = None, weights_only: bool | None = None, allow_partial_load: bool = False,
         process_group: Any = None) -> None:
    """``dcp.load`` in place into ``state_dict`` (its tensors/DTensors give the target sharding; any
    world size); call on every rank. Non-tensor values are unpickled with torch's restricted
    unpickler unless ``weights_only=False`` (``config.load.allowed_globals`` extends it). A checkrun
    error behind DCP's CheckpointException (corruption, refused value) is raised as itself."""
    cfg = coerce_config(config)
    planner = CheckrunLoadPlanner(weights_only=weights_only, allowed_globals=cfg.load.allowed_globals,
                                  allow_partial_load=allow_partial_load)
    reader = CheckrunStorageReader(path, cfg, storage_options)
    _wait_pending()
    with _checkrun_errors(reader):
        _dcp.load(state_dict, checkpoint_id=path, storage_reader=reader, planner=planner,
                  process_group=process_group)


def load_state_dict(path: PathLike, *, config: ConfigLike = None, storage_options: dict | None = None,
                    weights_only: bool | None = None, keys: set[str] | None = None) -> dict[str, Any]:
    """The whole saved state (every shard reassembled into plain tensors, nested as saved) in this
    process, without a process group: for inspection, conversion, or resuming on a single process.
    ``keys``: only the entries under these top-level or dotted keys (e.g. ``{"model"}``)."""
    cfg = coerce_config(config)
    reader = CheckrunStorageReader(path, cfg, storage_options)
    metadata = reader.read_metadata()
    planned = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {fqn: _key_path(planned, fqn, reader.path) for fqn in metadata.state_dict_metadata}
    wanted = {fqn: md for fqn, md in metadata.state_dict_metadata.items() if keys is None or any(
        ".".join(map(str, paths[fqn][:i + 1])) in keys for i in range(len(paths[fqn])))}
    need = sum(md.size.numel() * md.properties.dtype.itemsize for md in wanted.values()
               if isinstance(md, TensorStorageMetadata))
    if need > memory_limit(cfg.load.max_total_bytes):  # before allocating: the sizes come from the manifest
        raise ResourceLimitError(f"{reader.path}: the tensors of this DCP checkpoint need {need} bytes of host "
                                 f"memory, more than the limit of {memory_limit(cfg.load.max_total_bytes)} "
                                 "(load.max_total_bytes)")
    flat: dict[str, Any] = {}
    for fqn, md in wanted.items():
        tensor = isinstance(md, TensorStorageMetadata)
        flat[fqn] = empty_host(md.size.numel(), md.properties.dtype).view(md.size) if tensor else None
    planner = CheckrunLoadPlanner(weights_only=weights_only, allowed_globals=cfg.load.allowed_globals)
    with _checkrun_errors(reader), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    state: dict[str, Any] = {}
    try:
        for fqn, value in flat.items():
            set_element(state, paths[fqn], value)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # paths that cross each other
        raise FormatError(f"{reader.path}: DCP planner_data: key paths do not nest: {exc}") from None
    return state


def _key_path(planned: dict, fqn: str, where: str | None) -> tuple:
    """Where ``fqn`` goes in the nested state (DCP's planner_data), checked: keys are str or int."""
    path = planned.get(fqn, (fqn,))
    if not isinstance(path, (list, tuple)) or not path or not all(
            isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**31) for k in path):
        raise FormatError(f"{where}: DCP planner_data: the key path of {fqn!r} is not a list of keys: {path!r}"[:400])
    return tuple(path)


def is_dcp_checkpoint(path: PathLike, *, config: ConfigLike = None, storage_options: dict | None = None) -> bool:
    """True if ``path`` is a committed, valid checkrun manifest written through DCP."""
    cfg = coerce_config(config)
    try:
        store, name = Store.for_path(path, storage_options, cfg.storage)
        return isinstance(read_manifest(store, name, cfg).meta.get("dcp"), dict)
    except (CheckrunError, OSError, ValueError):
        return False
