"""``CheckrunCheckpointIO``: Lightning's ``CheckpointIO`` interface mapped onto ``ckpt_core.CheckpointEngine``.

Threads and ranks: Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global rank 0 only (the
strategy checks ``is_global_zero``), ``load_checkpoint`` on every rank, all from the training thread;
``teardown`` at the end of every ``fit``/``validate``/``test``/``predict`` (``Strategy.teardown``).
The engine commits saves on its own background thread.

Lightning's own short-lived checkpoints (``.temp.ckpt`` of ddp_spawn, the tuner's ``.lr_find_*`` and
``.scale_batch_size_*``) and SLURM's ``hpc_ckpt_*`` are saved lossless (no quantization rules, no
retention) and synchronously: Lightning reads the former right back, and requeues the job right after
the latter.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional, Union

import fsspec

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH

from ckpt_core import (CheckpointEngine, CheckpointNotFoundError, CheckrunError, CorruptCheckpointError,
                       EngineConfig, NotACheckpointError, SaveHandle, SaveInfo)
from ckpt_core.saving import inflight, lifecycle
from ckpt_core.storage.options import open_options
from ckpt_core.storage.paths import META_DIR

from .config import build_config, lossless_config
from .loading import is_checkrun_file, torch_load
from .paths import checkpoint_kind, is_remote, normalize_path, parent_dir, path_key
from .steplog import LightningStepLog, find_trainer
from .strategies import called_by_async_wrapper, calling_instance, calling_strategy, check_strategy

log = logging.getLogger("lightning_ckpt")

__all__ = ["CheckrunCheckpointIO"]


def _plain(value: Any) -> Any:
    """OmegaConf containers (Hydra passes them by default) as plain dicts/lists."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is not None and isinstance(value, omegaconf.Container):
        return omegaconf.OmegaConf.to_container(value, resolve=True)
    return value


class CheckrunCheckpointIO(CheckpointIO):
    """Asynchronous, incremental, optionally quantized checkpoints for Lightning (``Trainer(plugins=[...])``).

    Args:
        config: engine settings: a dict, an ``EngineConfig``, or the path of a YAML file; None = defaults
            (lossless, asynchronous, incremental).
        config_section: read only this top-level section of the dict/YAML (e.g. ``"checkpointing"``).
        keep_last: engine retention: keep this many newest checkpoints per directory, not counting
            ``last*.ckpt``, which it never removes; prefer ``ModelCheckpoint(save_top_k=...)``.
        asynchronous: False = every save is committed before ``save_checkpoint`` returns.
        incremental: False = every save writes full tensors (still deduplicated by content).
        quantization: opt-in lossy rules, e.g. ``[{"pattern": "*.emb.weight", "bits": 4}]``.
        storage_options: fsspec options for every storage call (e.g. an S3 endpoint), merged over the
            config's ``storage.storage_options``.
        max_pending: saves in flight before ``save_checkpoint`` blocks (backpressure).
        workers: background threads that encode and upload.
        overrides: any other engine setting as dotted keys, e.g. ``{"compression.zstd_level": 3}``.
        fallback_to_torch: load a checkpoint that is not checkrun's (a ``torch.save`` file from
            ``TorchCheckpointIO``) with ``torch.load`` instead of failing.
        step_log: True = log every optimizer step between checkpoints (``step_log.enabled``), so that
            ``fit(ckpt_path="last")`` resumes at the newest logged step (docs/lightning.md,
            "Per-step recovery").

    Explicit keyword arguments win over ``overrides``, which win over ``config``.
    """

    def __init__(self, config: Union[dict, EngineConfig, os.PathLike, str, None] = None,
                 config_section: Optional[str] = None, keep_last: Optional[int] = None, asynchronous: Optional[bool] = None,
                 incremental: Optional[bool] = None, quantization: Optional[list[dict]] = None,
                 storage_options: Optional[dict] = None, max_pending: Optional[int] = None,
                 workers: Optional[int] = None, overrides: Optional[dict] = None,
                 fallback_to_torch: bool = True, step_log: Optional[bool] = None) -> None:
        super().__init__()
        overrides = dict(_plain(overrides) or {})
        if step_log is not None:
            overrides["step_log.enabled"] = bool(step_log)
        self.config: EngineConfig = build_config(
            _plain(config), config_section=config_section, overrides=overrides,
            keep_last=keep_last, asynchronous=asynchronous, incremental=incremental,
            quantization=_plain(quantization), storage_options=_plain(storage_options),
            max_pending=max_pending, workers=workers)
        self.fallback_to_torch = fallback_to_torch
        self._exit_pid: Optional[int] = None  # the process whose exit hook runs _close_at_exit
        self._reset_runtime()
        self._warned_async_wrapper = False
        self._warned_remote_last = False
        self.saves = 0
        """Number of ``save_checkpoint`` calls this process handled (Lightning calls it on rank 0 only)."""

    def _reset_runtime(self, keep_callbacks: bool = False) -> None:
        """Everything that holds threads or per-run bookkeeping (dropped on pickling, at teardown and in
        a forked child)."""
        self._pid = os.getpid()
        self._engine: Optional[CheckpointEngine] = None
        self._lossless: Optional[CheckpointEngine] = None
        if not keep_callbacks:
            self._save_callbacks: list[Callable[[SaveInfo], None]] = []
        self._pending: dict[str, SaveHandle] = {}
        self._deferred: dict[str, tuple[str, list[SaveHandle]]] = {}
        self._deferred_lock = threading.Lock()  # the training thread and the engine's (_remove_on_commit)
        """Removals waiting for the saves in flight in their directory: path key -> (url, those saves)."""
        self._save_steps: dict[str, Optional[int]] = {}
        self._removed_dirs: set[str] = set()
        self._fresh_meta: set[str] = set()  # local directories whose .checkrun/ a temporary checkpoint made
        self._steplog = LightningStepLog() if self.config.step_log.enabled else None

    # -- engines ------------------------------------------------------------------------------
    @property
    def engine(self) -> CheckpointEngine:
        """The engine for regular checkpoints (created on first use, closed at ``teardown``)."""
        self._after_fork()
        if self._engine is None:
            self._engine = self._new_engine(self.config)
        return self._engine

    @property
    def lossless_engine(self) -> CheckpointEngine:
        """The engine for Lightning's temporary and HPC checkpoints (the main one if already lossless)."""
        self._after_fork()
        cfg = lossless_config(self.config)
        if cfg is self.config:
            return self.engine
        if self._lossless is None:
            self._lossless = self._new_engine(cfg)
        return self._lossless

    def _after_fork(self) -> None:
        """In a process forked from the one that made the engines (ddp_fork/ddp_notebook ranks, forked
        by Lightning from the process that saved or loaded before the launch): start afresh, as a
        ddp_spawn rank's unpickled copy does. The parent's saves stay the parent's; a load in the
        child waits for them (``inflight``)."""
        if self._pid != os.getpid():
            self._reset_runtime(keep_callbacks=True)

    def _new_engine(self, cfg: EngineConfig) -> CheckpointEngine:
        engine = CheckpointEngine(cfg)
        for fn in self._save_callbacks:
            engine.add_callback(fn)
        return engine

    def _engine_for(self, path: str) -> CheckpointEngine:
        return self.engine if checkpoint_kind(path) == "regular" else self.lossless_engine

    def add_save_callback(self, fn: Callable[[SaveInfo], None]) -> None:
        """Call ``fn(SaveInfo)`` on the engine's background thread after each committed save.

        Registered again on the engines created after a ``teardown``; adding the same ``fn`` twice is a no-op.
        """
        if any(fn == known for known in self._save_callbacks):
            return
        self._save_callbacks.append(fn)
        for engine in (self._engine, self._lossless):
            if engine is not None:
                engine.add_callback(fn)

    # -- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` and write it to ``path`` (str, Path or fsspec URL) in the background.

        Returns once the state is copied (the training loop may change it right after). Raises the error
        of an earlier failed background save, once. ``storage_options`` (a dict) are merged over the
        configured ones for this save.
        """
        self._check_caller()
        if not self._warned_async_wrapper and called_by_async_wrapper():
            self._warned_async_wrapper = True
            warnings.warn("CheckrunCheckpointIO is already asynchronous: wrapping it in AsyncCheckpointIO adds a "
                          "full clone of the state per save and a second thread, AsyncCheckpointIO.teardown "
                          "does not wait for checkrun's saves, and ModelCheckpoint's top-k removals and loads in "
                          "this process do not see saves still queued in the wrapper (a removed file comes "
                          "back). Pass CheckrunCheckpointIO(...) directly to "
                          "Trainer(plugins=[...]).", UserWarning, stacklevel=2)
        url = normalize_path(path)
        options = self._storage_options(storage_options)
        if is_remote(url):
            self._warn_remote_last()
        else:
            # As TorchCheckpointIO does, synchronously: ModelCheckpoint(save_last="link") symlinks into the
            # directory right after this returns, before the background save has created it.
            os.makedirs(parent_dir(url), exist_ok=True)
        self.saves += 1
        if self.saves == 1:
            _warn_artifact_loggers(find_trainer(calling_strategy()))
        if checkpoint_kind(url) != "regular":
            if checkpoint_kind(url) == "temporary" and not is_remote(url) and not os.path.exists(_meta_dir(url)):
                self._fresh_meta.add(parent_dir(url))  # this save makes the directory's .checkrun/
            try:
                self.lossless_engine.save(checkpoint, url, storage_options=options).result()
            except CheckrunError as exc:  # h126: SIGUSR1 again during the requeue handler's save: its save of
                if not getattr(exc.__cause__, "same_process", False):  # the same hpc_ckpt_N name committed first
                    raise
                log.info("lightning_ckpt: %s: a later save of this process to that name was committed; kept", url)
            return
        if self._steplog is not None:  # before the save, so that it marks its position in the log
            self._steplog.before_save(self.engine, calling_strategy(), url)
        with self._deferred_lock:  # a new save to a path replaces it: no removal after it
            self._deferred.pop(path_key(url), None)
        handle = self.engine.save(checkpoint, url, storage_options=options)
        self._track(url, handle, checkpoint)
        self._remove_ready()  # the save waited for its slot: earlier saves are likely done

    def load_checkpoint(self, path: _PATH, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the checkpoint at ``path``; waits for a pending save to it; every byte is verified.

        ``map_location=None`` puts tensors on the CPU (like ``TorchCheckpointIO``); ``weights_only=None``
        means True as in ``torch.load`` (and its TORCH_FORCE_*_WEIGHTS_ONLY_LOAD switches apply): values
        that need pickle are refused unless allow-listed.
        Raises ``FileNotFoundError`` if there is no checkpoint at ``path``.
        """
        self._check_caller()
        url = normalize_path(path)
        location = "cpu" if map_location is None else map_location
        strategy = calling_strategy()
        engine = self._engine_for(url)
        if not getattr(strategy, "is_global_zero", True):
            # Lightning's strategies save through the plugin on global rank 0 only: another rank keeps no
            # copy of what it loaded for a next incremental save it never makes (a full copy of the
            # row-delta tensors for the whole run, found by an independent check with Fabric DDP)
            engine._keep_loaded = False
        try:
            loaded = engine.load(url, map_location=location, weights_only=weights_only)
            if self._steplog is not None and checkpoint_kind(url) == "regular":
                self._steplog.after_load(self.engine, strategy, url)
            return loaded
        except CheckpointNotFoundError as exc:  # Lightning's own wording (code matches on it), then ours
            detail = "" if str(exc).startswith(f"no checkpoint at {url}") and str(exc).endswith(url) else f" ({exc})"
            raise type(exc)(f"Checkpoint file not found: {url}{detail}") from None
        except (NotACheckpointError, CorruptCheckpointError):
            # A torch file over the manifest size limit is refused as an oversized manifest.
            if not self.fallback_to_torch or is_checkrun_file(url, self.config.storage.storage_options):
                raise
        log.info("lightning_ckpt: %s is not a checkrun checkpoint; loading it with torch.load", url)
        return torch_load(url, map_location=location, weights_only=weights_only,
                          storage_options=self.config.storage.storage_options)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete the checkpoint at ``path`` (after a pending save to it); a missing one is ignored.

        ``ModelCheckpoint`` removes a checkpoint right after saving the one that replaces it. While a
        save to the same directory is in flight, the removal waits for it: it is made once those saves
        committed (as the last of them commits, on the engine's thread), and dropped, keeping
        the checkpoint, if one of them failed; so a failed background save never costs the checkpoint it
        was to replace (as with ``TorchCheckpointIO``, whose failing ``torch.save`` raises before the
        removal). A new save to ``path`` cancels a removal still waiting.

        Its blobs that no other checkpoint references are deleted in the background step of the next
        save (``retention.gc_after_save``) and at ``teardown``; those of Lightning's temporary
        checkpoints right away.
        """
        self._check_caller()
        url = normalize_path(path)
        try:
            self._remove_ready()
        finally:  # an earlier removal that fails (raised after this one is taken) must not lose this one
            self._remove_or_defer(url)

    def _remove_or_defer(self, url: str) -> None:
        key, directory = path_key(url), path_key(parent_dir(url))
        with self._deferred_lock:  # the engine's thread pops from _pending (_remove_on_commit)
            mine = [h for k, h in self._pending.items() if k != key and path_key(parent_dir(h.path)) == directory]
        failed = next((h.path for h in mine if h.failed()), None)  # since the last save call: that save
        if failed is not None and checkpoint_kind(url) == "regular":  # failed already, before its removal
            log.warning("lightning_ckpt: kept %s: the save of %s, after which it was to be removed, failed", url, failed)
            return
        saves = [h for h in mine if not h.done()]
        if saves and checkpoint_kind(url) == "regular":
            with self._deferred_lock:
                self._deferred[key] = (url, saves)
            for handle in saves:  # the last of them to finish makes it, on the engine's thread
                handle.add_done_callback(lambda h, key=key: self._remove_on_commit(key, h))
            if self._exit_pid != os.getpid():  # a process that ends without teardown still makes it
                lifecycle.register_owner(self._close_at_exit)
                self._exit_pid = os.getpid()
            log.debug("lightning_ckpt: removal of %s waits for %d save(s) in flight in its directory", url, len(saves))
            return
        self._remove_now(url)

    def _remove_ready(self, block: bool = False) -> None:
        """Make the waiting removals whose saves are done (all of them with ``block``); drop those
        whose saves did not all commit."""
        for key, (url, saves) in list(self._deferred.items()):
            if block:
                for handle in saves:
                    handle.wait()
            if not all(handle.done() for handle in saves):
                continue
            failed = next((handle.path for handle in saves if handle.failed()), None)
            if failed is not None:
                with self._deferred_lock:
                    self._deferred.pop(key, None)
                log.warning("lightning_ckpt: kept %s: the save of %s, after which it was to be removed, failed",
                            url, failed)
                continue
            self._remove_now(url)  # dropped only once done: an error or ^C in it leaves it to the next call
            with self._deferred_lock:
                self._deferred.pop(key, None)

    def _remove_on_commit(self, key: str, finishing: SaveHandle) -> None:
        """The engine's thread, as a save a waiting removal waits for finishes: once all of them did, the
        removal is made now, not at the plugin's next call (a kill in between left the old top-k file for
        good, one per kill; found by an independent kill/resume loop); dropped if one failed. If it fails
        it stays waiting, for the plugin's next call (unless a new save to the path came meanwhile)."""
        with self._deferred_lock:
            entry = self._deferred.get(key)
            if entry is None or not all(h is finishing or h.done() for h in entry[1]):
                return  # cancelled by a new save to the path, made already, or a later save makes it
            del self._deferred[key]
            mine = self._pending.get(key)
        url, saves = entry
        failed = next((h.path for h in saves if h.failed()), None)
        if failed is not None:
            log.warning("lightning_ckpt: kept %s: the save of %s, after which it was to be removed, failed", url, failed)
            return
        try:
            self._engine_for(url).remove(url, wait=False)
        except (CheckpointNotFoundError, FileNotFoundError):
            return
        except BaseException as exc:  # noqa: BLE001 - the engine's thread: left to the plugin's next call
            log.warning("lightning_ckpt: could not remove %s after the save it waited for (%s); trying again at "
                        "the next call", url, exc)
            with self._deferred_lock:
                if self._pending.get(key) is mine:  # no new save to that path since
                    self._deferred.setdefault(key, entry)
            return
        with self._deferred_lock:
            self._pending.pop(key, None)
            self._removed_dirs.add(parent_dir(url))

    def _close_at_exit(self) -> None:
        """At interpreter exit, before the engines are flushed: the removals still waiting (a ddp_spawn
        rank whose fit raised ends without teardown, which Lightning runs in the launching process)."""
        try:
            self._remove_ready(block=True)
        except Exception as exc:  # noqa: BLE001 - nobody can catch it at exit
            log.error("lightning_ckpt: removal waiting for a save failed at interpreter exit: %s", exc)

    def _remove_now(self, url: str) -> None:
        engine = self._engine_for(url)
        try:
            engine.remove(url)
        except (CheckpointNotFoundError, FileNotFoundError):
            log.debug("lightning_ckpt: %s was already gone", url)
            return
        except CheckrunError as exc:
            if _denied(exc):  # h142: the best checkpoint of another run, on a bucket this run may only read
                log.warning("lightning_ckpt: %s was not removed (%s); training goes on", url, exc)
            elif not self._remove_directory(url):
                raise
            return
        with self._deferred_lock:
            self._pending.pop(path_key(url), None)
        if checkpoint_kind(url) == "temporary":
            self._collect_temporary(engine, parent_dir(url))
        else:
            self._removed_dirs.add(parent_dir(url))

    def _remove_directory(self, url: str) -> bool:
        """A directory given to ``remove_checkpoint`` (a sharded checkpoint another IO wrote): removed
        whole, as ``TorchCheckpointIO`` does; False if ``url`` is not a directory."""
        fs, path = fsspec.core.url_to_fs(url, **open_options(url, self.config.storage.storage_options))
        if not fs.isdir(path):
            return False
        log.info("lightning_ckpt: %s is a directory, not a checkrun checkpoint: removing it whole, as "
                 "TorchCheckpointIO does", url)
        fs.rm(path, recursive=True)
        return True

    def teardown(self) -> None:
        """Wait for every pending save, collect garbage, release the engines' threads and buffers.

        A background save error is raised here unless another exception is already propagating
        (Lightning tears down while handling the user's error): then it is logged, never masking it.
        The plugin stays usable: the next save or load creates a fresh engine.
        """
        propagating = _propagating()
        errors: list[BaseException] = []
        try:
            self._check_caller()
        except RuntimeError as exc:
            errors.append(exc)
        if self._steplog is not None:
            try:
                self._steplog.close()
            except CheckrunError as exc:
                errors.append(exc)
        try:
            self._remove_ready(block=True)
        except CheckrunError as exc:
            errors.append(exc)
        for engine in self._open_engines():
            errors.extend(_close(engine, self._removed_dirs if engine is self._engine else set()))
        inflight.wait_job()  # DDP: every rank waits for global rank 0's saves (the next fit may look for them)
        self._reset_runtime(keep_callbacks=True)
        if not errors:
            return
        for err in errors if propagating else errors[1:]:
            log.error("lightning_ckpt: error at teardown (not raised: %s): %s",
                      "another exception is propagating" if propagating else "only the first one is", err)
        if not propagating:
            raise errors[0]

    # -- queries ------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every pending save is committed (and the removals waiting for them are made);
        raise a background error not yet surfaced."""
        try:
            for engine in self._open_engines():
                engine.wait()
        finally:
            self._remove_ready(block=True)

    def is_pending(self, path: _PATH) -> bool:
        """True while a save to ``path`` started by this plugin is not committed yet."""
        return self.pending_save(path) is not None

    def removal_waiting(self, path: _PATH) -> bool:
        """True while a removal of ``path`` waits for saves in flight: ``ModelCheckpoint`` counts it removed
        (its file is still there until they commit), so its name is free, as after stock Lightning's removal."""
        with self._deferred_lock:
            return path_key(normalize_path(path)) in self._deferred

    def save_handle(self, path: _PATH) -> Optional[SaveHandle]:
        """The handle of this plugin's latest save to ``path`` since its previous save call, done or not, else None."""
        with self._deferred_lock:
            return self._pending.get(path_key(path))

    def pending_save(self, path: _PATH) -> Optional[SaveHandle]:
        """The handle of this plugin's save to ``path`` while it is not committed (or failed) yet, else None."""
        handle = self._pending.get(path_key(path))
        return handle if handle is not None and not handle.done() else None

    @property
    def step_log(self) -> Any:
        """With ``step_log``: the engine's ``StepLog`` on global rank 0 once the first checkpoint save
        started it (``flush()`` commits the steps logged so far), else None."""
        return self._steplog.log if self._steplog is not None else None

    def step_of(self, saved_path: str) -> Optional[int]:
        """The ``global_step`` of the checkpoint that was saved to ``saved_path`` (``SaveInfo.path``), once."""
        return self._save_steps.pop(saved_path, None)

    # -- internals ----------------------------------------------------------------------------
    def _warn_remote_last(self) -> None:
        """Once: Lightning's own ModelCheckpoint saving ``last`` to remote storage cannot find it again."""
        if self._warned_remote_last:
            return
        mc = calling_instance(lambda o: hasattr(o, "_find_last_checkpoints") and hasattr(o, "save_last"))
        if mc is None or not mc.save_last or getattr(mc, "finds_remote_last", False):
            return
        self._warned_remote_last = True
        warnings.warn("Lightning's ModelCheckpoint cannot find last.ckpt on remote storage: fit(ckpt_path='last') "
                      "would warn 'no last checkpoint available' and start from scratch. Use "
                      "lightning_ckpt.CheckrunModelCheckpoint (same arguments), or pass the path explicitly.",
                      UserWarning, stacklevel=3)

    def _check_caller(self) -> None:
        # first of all: a forked or spawned rank's copy starts afresh (engines, step log) before any
        # of it is used, or a step log opened on the state the reset then drops is lost
        self._after_fork()
        strategy = calling_strategy()
        if strategy is not None:
            check_strategy(strategy)

    def _storage_options(self, storage_options: Any) -> Optional[dict]:
        storage_options = _plain(storage_options)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict of fsspec options, not {type(storage_options).__name__}")
        return storage_options

    def _track(self, url: str, handle: SaveHandle, checkpoint: Any) -> None:
        with self._deferred_lock:
            self._pending = {k: h for k, h in self._pending.items() if not h.done()}
            self._pending[path_key(url)] = handle
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        if len(self._save_steps) > 1000:  # nobody is reading them (no CheckpointMetrics)
            self._save_steps.clear()
        self._save_steps[handle.path] = step if isinstance(step, int) else None

    def _collect_temporary(self, engine: CheckpointEngine, directory: str) -> None:
        """Delete the blobs of a removed temporary checkpoint now (only those: no listing of the
        blobs; saves in flight are protected by their leases)."""
        try:
            engine.gc(directory, full=False)
            if directory in self._fresh_meta and not engine.list(directory):
                _remove_empty_dirs(_meta_dir(os.path.join(directory, "x")))  # as Lightning's tuner leaves it
        except CheckrunError as exc:
            log.warning("lightning_ckpt: cleaning up after a temporary checkpoint in %s failed: %s", directory, exc)
        self._fresh_meta.discard(directory)

    def _open_engines(self) -> list[CheckpointEngine]:
        return [e for e in (self._engine, self._lossless) if e is not None]

    def __getstate__(self) -> dict:
        """Picklable for ddp_spawn: engines, handles and callbacks stay in this process. Pickling
        waits until no save is in flight in this process: the copy goes to processes (spawned ranks)
        that may load at once what this process (this plugin, or another Trainer's) is still saving,
        and cannot see its saves."""
        if self._pid == os.getpid():
            inflight.wait_here()
            self._remove_ready(block=True)
        state = self.__dict__.copy()
        state.update(_engine=None, _lossless=None, _save_callbacks=[], _pending={}, _deferred={}, _save_steps={},
                     _removed_dirs=set(), _fresh_meta=set(), _steplog=LightningStepLog() if self._steplog is not None else None)
        del state["_deferred_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._deferred_lock = threading.Lock()


def _meta_dir(url: str) -> str:
    """The ``.checkrun/`` folder beside the local checkpoint ``url``."""
    return os.path.join(parent_dir(url), META_DIR)


def _remove_empty_dirs(top: str) -> None:
    """The empty folders of ``top`` (itself included), deepest first; ``rmdir`` never removes a file."""
    for base, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(base)


def _close(engine: CheckpointEngine, removed_dirs: set[str]) -> list[BaseException]:
    """Wait for ``engine``, collect garbage in ``removed_dirs``, close it; return the errors."""
    errors: list[BaseException] = []
    try:
        engine.wait()
    except CheckrunError as exc:
        errors.append(exc)
    if engine.config.retention.gc_after_save:
        for directory in sorted(removed_dirs):
            try:
                engine.gc(directory)
            except CheckrunError as exc:
                log.warning("lightning_ckpt: garbage collection in %s failed: %s", directory, exc)
    try:
        engine.close()
    except CheckrunError as exc:
        errors.append(exc)
    return errors


def _propagating() -> bool:
    """Whether teardown runs because an exception propagates out of the Trainer's entry point: the
    trainer says so (``_interrupt`` marks it interrupted before its teardown). ``sys.exc_info()`` also
    holds an exception the caller merely handles around ``fit`` (retry code: ``except ...: fit()``),
    where a failed background save was then only logged and ``fit`` returned as if it had saved
    (found by an independent check); it decides only without a trainer (Fabric, a direct call)."""
    trainer = find_trainer(calling_strategy())
    if trainer is None:
        return sys.exc_info()[1] is not None
    from lightning.pytorch.trainer.states import TrainerStatus

    return trainer.state.status == TrainerStatus.INTERRUPTED


def _warn_artifact_loggers(trainer: Any) -> None:
    """Experiment loggers that upload each checkpoint file (``log_model``: MLflow, W&B, Neptune) would
    upload manifests: say so once, at the first save (docs/lightning.md, known limits)."""
    names = [type(lg).__name__ for lg in getattr(trainer, "loggers", None) or () if getattr(lg, "_log_model", False)]
    if names:
        warnings.warn(f"checkrun: {', '.join(names)} with log_model uploads each checkpoint file as an artifact; "
                      "with CheckrunCheckpointIO that file is a manifest whose tensors stay in the directory's "
                      ".checkrun/blobs, so the artifact does not load on its own: upload the directory, or a "
                      "file made by `checkrun export`", UserWarning, stacklevel=3)


def _denied(exc: BaseException) -> bool:
    """Whether a removal failed because the storage does not allow it (PermissionError behind the engine's
    error). Lightning removes a resumed run's previous best checkpoint wherever it lives (remote paths are
    never checked against ``dirpath``); ``TorchCheckpointIO`` on s3fs ignores the refusal, this plugin warns."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, PermissionError):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
