"""AcceleratorCheckpointer: an Accelerator's whole state through checkrun, on every rank.

Construct it on every process after ``Accelerator(...)`` (the constructor is collective when
torch.distributed runs), ``prepare`` and ``register_for_checkpointing`` as usual, then ``attach()``:
the instance's ``save_state`` / ``load_state`` now go through checkrun and training scripts keep
calling them unchanged. All public methods are called from the training thread, on every rank,
in the same order (they are collective like accelerate's own ``save_state``).
"""
from __future__ import annotations

import functools
import logging
import math
import os
import pathlib
import re
import threading
import time
import warnings
import weakref
from typing import Any

import ckpt_core
import torch
import torch.distributed as dist
from ckpt_core import BackgroundSaveError, CheckpointEngine, CheckpointNotFoundError, CheckrunError, EngineConfig
from ckpt_core.format import composite
from ckpt_core.saving import inflight, lifecycle
from ckpt_core.saving.composite import CompositeCommitter
from ckpt_core.saving.fence import CommitStamp, new_stamp
from ckpt_core.saving.group import FailedPart, GroupCommitter, Job, make_group

from . import layout, resolve as paths, state
from .config import AdapterOptions, resolve
from .layout import Target
from .steplog import TREE_KEY, AccelerateStepLog, batches_of_steps

log = logging.getLogger("accelerate_ckpt")
_PATCHED = ("save_state", "load_state", "end_training")
_MISSING = object()


class UnsupportedDistributedTypeError(CheckrunError, NotImplementedError):
    """The Accelerator runs a distributed type whose state checkrun cannot hold (FSDP, DeepSpeed, ...)."""


class CheckpointExistsError(CheckrunError, ValueError):
    """``save_state()`` with automatic naming found its ``checkpoint_{N}`` folder already there (a
    rerun into the same project without ``load_state``): refused, as accelerate refuses it."""


class NoCheckpointError(CheckpointNotFoundError, ValueError):
    """``load_state`` found no checkpoint to load: checkrun's ``CheckpointNotFoundError`` (a
    ``FileNotFoundError``) and a ``ValueError``, which accelerate's own ``load_state`` raises there."""


class _Routed:
    """A checkpointer's method installed on an Accelerator instance by ``attach``. Accelerators can
    be pickled (accelerate tests it; spawned workers and ``copy.deepcopy`` do it): a copy gets the
    class's own method instead, so it is a plain Accelerator, and the checkpointer (threads, locks,
    engines) stays with the original."""

    def __init__(self, method: Any, accelerator: Any, name: str) -> None:
        # the Accelerator holds this object: a strong reference back would make a cycle that keeps a
        # dropped Accelerator (its models, optimizers) alive until the cyclic GC runs
        self.method, self.accelerator, self.name = method, weakref.ref(accelerator), name
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return _own_method, (self.accelerator(), self.name)


def _own_method(accelerator: Any, name: str) -> Any:
    """The Accelerator class's own method ``name``, bound to ``accelerator``."""
    return getattr(type(accelerator), name).__get__(accelerator)


def _names(index_url: str) -> tuple[str, str]:
    """An index URL's file and folder names: what stays of it across spellings of its directory."""
    folder = layout.folder_of(index_url).rstrip("/")
    return index_url.rstrip("/").rpartition("/")[2], folder.rpartition("/")[2]


def _dir_key(directory: str) -> str:
    """One spelling of a directory: ``file://`` and plain local paths alike, symlinks resolved."""
    text = directory[len("file://"):] if directory.startswith("file://") else directory
    return text.rstrip("/") if "://" in text else os.path.realpath(text)


class AcceleratorCheckpointer:
    """Saves and loads an ``accelerate.Accelerator``'s state with checkrun (see ``docs/accelerate.md``).

    ``config``: ``EngineConfig``, dict or YAML path (else ``$CHECKRUN_CONFIG``, else defaults).
    ``directory`` / ``storage_options`` override the config's adapter directory / storage options.
    """

    def __init__(self, accelerator: Any, config: EngineConfig | dict | str | os.PathLike | None = None, *,
                 directory: str | os.PathLike | None = None, storage_options: dict | None = None) -> None:
        self._accelerator = weakref.ref(accelerator)
        self._project_config = accelerator.project_configuration  # for commits after the Accelerator is gone
        self.config, self.options, self.config_source = resolve(config)
        if directory is not None:
            self.options = AdapterOptions(**{**vars(self.options), "directory": os.fspath(directory)})
        self.storage_options = storage_options
        self.unsupported = state.unsupported_reason(accelerator)
        if self.unsupported and self.options.on_unsupported == "error":
            raise UnsupportedDistributedTypeError(f"accelerate_ckpt: {self.unsupported}")
        self.history: list[dict] = []
        self._originals: dict[str, Any] = {}
        self._resumed: set[str] = set()
        self._writing: list[str] = []  # names of checkpoints submitted, not committed yet
        self._names_lock = threading.Lock()
        self._last_root: str | None = None
        self._seq = 0
        self._unwrapped: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._closed = False
        self._close_lock = threading.Lock()  # a second close() waits for the first (exit vs a dropped Accelerator)
        self._steplog: AccelerateStepLog | None = None
        self._ended = False  # end_training() ran: its trackers are finished (nothing is logged to them after)
        self._reopenable = False  # closed by end_training(), not since by close(): a later call starts it again
        if self.unsupported:
            return
        self._start(accelerator)
        lifecycle.register_owner(self._close_at_exit)  # at exit, before the engines it commits with
        lifecycle.register_busy(self._uncommitted)  # the SIGTERM grace waits for the indexes too
        # an Accelerator dropped without end_training() (a trial function that returns, a notebook cell
        # run again): its pending checkpoints commit and the engines' threads and memory go
        weakref.finalize(accelerator, _closer, self, os.getpid()).atexit = False  # at exit: the exit hook above

    def _start(self, accelerator: Any) -> None:
        """The engines, the group committer and the step log's engine (at ``__init__``; again when a
        ``save_state`` / ``load_state`` after ``end_training()`` reopens this checkpointer)."""
        # The engine's own retention would count parts and indexes alike: whole checkpoints are
        # retained by the committer instead (ckpt_core.retain.composites).
        engine_cfg = self.config.replace(**{"retention.keep_last": None})
        self._engine = CheckpointEngine(engine_cfg)
        self._sync = not self.config.saving.asynchronous
        group, self.rank, self.world = make_group(self.options.collective_timeout_seconds)
        self._group = GroupCommitter(group, self.rank, self.world, synchronous=self._sync,
                                     thread_name="accelerate-ckpt-commit",
                                     timeout_seconds=self.options.collective_timeout_seconds,
                                     participation_seconds=self.options.participation_timeout_seconds)
        self._token = self._group.token()
        self._committer = None
        if self.rank == 0:  # rank 0 commits the indexes with a synchronous engine of its own
            # an index holds no tensors: no quantization rules (each save warned that they matched none of it),
            # and no writer process of its own (h110: a second one, 0.2 GB and 2-3 s to start, for a small file)
            index_cfg = engine_cfg.replace(**{"saving.asynchronous": False, "saving.sigterm_grace_seconds": None,
                                              "quantization": [], "saving.background": "thread"})
            self._committer = CompositeCommitter(CheckpointEngine(index_cfg), engine_cfg, self.storage_options,
                                                 self._keep_last, self._protected)
        if self._steplog is not None:  # reopened: the same log state (its step count), the new engine
            self._steplog.engine = self._engine
        elif self.config.step_log.enabled:  # docs/accelerate.md "Per-step recovery"
            self._steplog = AccelerateStepLog(accelerator, self._engine, self.rank, self.storage_options)

    @property
    def accelerator(self) -> Any:
        """The Accelerator (held weakly: dropping it frees it and closes this checkpointer); None once gone."""
        return self._accelerator()

    # -- attach / detach ------------------------------------------------------------------------
    def attach(self) -> "AcceleratorCheckpointer":
        """Route this Accelerator instance's ``save_state`` / ``load_state`` through checkrun.

        Replaces the bound methods on the instance only (and ``end_training``, to flush first).
        Under FSDP/DeepSpeed/Megatron-LM/XLA nothing is replaced: accelerate's own saving stays, with
        a warning (or an error with ``on_unsupported: error``)."""
        if self.unsupported:
            warnings.warn(f"accelerate_ckpt: {self.unsupported}; falling back to accelerate's own "
                          "save_state/load_state (local, synchronous)", RuntimeWarning, stacklevel=2)
            return self
        self._reopen_if_ended("attach")  # after end_training(): started again (it was closed)
        acc = self.accelerator
        if acc is None:  # held weakly (h133: AcceleratorCheckpointer(Accelerator()).attach() raised AttributeError)
            raise CheckrunError("accelerate_ckpt: the Accelerator of this checkpointer no longer exists (it is held "
                                "weakly): keep a reference to it, e.g. accelerator = Accelerator(); attach(accelerator)")
        if not self._originals:  # end_training's reopen routes are not the Accelerator's own (found by an independent check)
            self._originals = {n: _MISSING if self._is_reopen(acc.__dict__.get(n)) else acc.__dict__.get(n, _MISSING)
                               for n in _PATCHED}
        for name, method in zip(_PATCHED, (self._save_state, self._load_state, self._end_training)):
            setattr(acc, name, _Routed(method, acc, name))
        state.track_epoch_starts(acc)  # a save inside an epoch stores the generator the epoch started from
        if self._steplog is not None and acc._optimizers:
            self._steplog.targets()  # checks the prepared objects now, and counts steps from here
        return self

    def detach(self) -> None:
        """Give the Accelerator back its own ``save_state`` / ``load_state`` (pending saves continue; after
        ``end_training()``, a later call no longer reopens checkrun)."""
        acc = self.accelerator
        if acc is None:
            self._originals = {}
            return
        for name in ("save_state", "load_state"):  # the routes end_training left (_reopen)
            if self._is_reopen(acc.__dict__.get(name)):
                del acc.__dict__[name]
        for name, original in self._originals.items():
            if original is _MISSING:
                acc.__dict__.pop(name, None)
            else:
                setattr(acc, name, original)
        self._originals = {}

    @property
    def attached(self) -> bool:
        """Whether ``attach()`` replaced the instance's methods."""
        return bool(self._originals)

    @property
    def step_log(self) -> Any:
        """The engine's ``StepLog`` of rank 0 with ``step_log.enabled`` (``flush()`` commits what is
        logged), once the first save or load started it; else None."""
        return self._steplog.log if self._steplog is not None else None

    @property
    def replayed_steps(self) -> int:
        """Optimizer steps the last ``load_state`` replayed from the step log after the checkpoint."""
        return self._steplog.replayed_steps if self._steplog is not None else 0

    def replayed_batches(self, batches_per_epoch: int, start_batch: int = 0) -> int:
        """The batches the steps the last ``load_state`` replayed took, counted from batch ``start_batch``
        of the checkpoint's epoch (the batches it had done there) in epochs of ``batches_per_epoch``
        (``len(dataloader)``): ``gradient_accumulation_steps`` per step, fewer for an epoch's last
        window, which accelerate ends with its dataloader. Skip ``start_batch`` + this many batches,
        carried over epochs (docs/accelerate.md, "The resumed step")."""
        acc = self.accelerator
        return batches_of_steps(self.replayed_steps, start_batch, batches_per_epoch, acc.gradient_accumulation_steps,
                                acc.gradient_state.sync_with_dataloader)

    @property
    def optimizer_steps(self) -> int | None:
        """With ``step_log.enabled``: the optimizer steps taken so far (counted since ``attach``; a load
        sets it to the checkpoint's count plus the steps replayed). None when the log is off."""
        return self._steplog.optimizer_steps if self._steplog is not None else None

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int | None = None, *, output_dir: str | os.PathLike | None = None) -> str:
        """Snapshot the whole state and return the checkpoint's folder (what accelerate's ``save_state``
        returns); the write continues in the background and commits once every rank's part is durable
        (with ``saving.asynchronous: false``: before this returns).

        The folder exists when this returns; its index appears at the commit, and a load of it meanwhile
        (any Accelerator or engine of this process) waits for the commit. Named ``checkpoint_{step}``
        when ``step`` is given, else ``checkpoint_{iteration}``; the iteration counter advances like
        accelerate's. Raises a failed earlier save's error first."""
        if self.unsupported:
            return self._native_save(output_dir)
        self._reopen_if_ended("save")
        started = time.perf_counter()
        # at most saving.max_pending checkpoints without a verdict: as accelerate's total_limit, the
        # folders beyond it are gone by the next save_state (after the commit, never before)
        self._group.wait_below(self.config.saving.max_pending)
        self._before_call()
        acc = self.accelerator
        iteration = acc.project_configuration.iteration
        output_dir = _home(output_dir)
        target = self._target(output_dir, iteration if step is None else step)
        if step is None and target.base != target.folder:
            self._refuse_existing(target)
        stale = paths.native_files(target.folder) if self.rank == 0 else []  # accelerate's own, replaced
        composite.make_folder(target.folder, self.storage_options, self.config)
        rel_base, rel_index = target.part_names(self._token, self._seq, self.world)
        self._seq += 1
        key = composite.store_url(target.index_url, self.storage_options, self.config)
        part = layout.join(target.base, rel_base[self.rank])
        self._begin(target.name, key)
        # announced before anything of this rank's part runs (hooks, snapshot): rank 0 then waits for
        # it, and learns of its failure (abandon) instead of committing without it
        round_key = self._group.announce(key)
        queued = False
        try:
            # the hooks get the checkpoint's folder, as the caller named it when it is theirs (a pathlib.Path
            # stays one), as with accelerate; with a root (automatic naming, a configured directory) the
            # folder in it, where output_dir is not used (accelerate ignores it under automatic naming)
            local = output_dir is not None and "://" not in os.fspath(output_dir) and target.base == target.folder
            tree = self._tree(target, layout.join(target.base, rel_base[0]), iteration,
                              output_dir if local else target.folder)
            handle = self._engine_save(tree, part)
            blocking = time.perf_counter() - started
            finish = None
            if self.rank == 0:
                meta = {"step": int(acc.step), "iteration": iteration + 1,
                        "distributed_type": state.distributed_type_name(acc)}
                if step is not None:
                    meta["global_step"] = int(step)
                index = composite.make_index(target.name, rel_index, meta)
                stamp = new_stamp()  # orders this index by when save_state was called, as accelerate's own saves are
                finish = lambda outcomes: self._finish(target, index, outcomes, blocking, started, stale, stamp)  # noqa: E731
            job = Job(handle, finish, lambda: self._end(target.name, key), key=round_key)
            self._group.submit(job)  # from here on, the job's verdict ends the registration
            queued = True
        except BaseException as exc:  # KeyboardInterrupt included: nothing may stay pending for ever
            if not queued:
                self._group.abandon(round_key, part, exc)
                self._end(target.name, key)
            raise
        acc.project_configuration.iteration = iteration + 1
        self._last_root = target.base
        if self._sync:
            self._before_call()
        return self._shown(output_dir, target)

    def _finish(self, target: Target, index: dict, outcomes: list, blocking: float, started: float,
                stale: list[tuple[str, tuple]], stamp: CommitStamp) -> Any:
        """Rank 0's commit; once committed, the files accelerate's own save left in the folder go. The
        index names each rank's part as that rank wrote it: the per-rank save counters in the names differ
        once rank 0 saved alone (``if is_main_process: save_state()``), and the index named parts no rank
        wrote, so later checkpoints committed corrupt (found by an independent check)."""
        parts = list(index["parts"])
        for r, o in enumerate(outcomes):
            name = o.path.rpartition("/")[2] if r and o is not None and o.path else ""
            if re.fullmatch(rf"{re.escape(target.name)}\.{re.escape(self._token)}-[0-9]+\.rank{r}\.ckpt", name):
                parts[r] = f"{parts[r].rpartition('/')[0]}/{name}"
        verdict = self._committer.finish(target, {**index, "parts": parts}, outcomes, blocking, started, stamp)
        if stale and verdict.error is None:
            paths.remove_native(stale)
        return verdict

    def _tree(self, target: Target, first_part: str, iteration: int, hook_dir: Any) -> dict:
        """This rank's part: its own state, rank 0's also the replicated state (after the save hooks)."""
        acc = self.accelerator
        weights = state.model_weights(acc, self._unwrapped)
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, hook_dir)
        state.track_epoch_starts(acc)
        tree = {"rank": state.gather_rank(acc)}
        if self.rank == 0:
            tree["replicated"] = state.gather_replicated(acc, weights, iteration + 1)
        if self._steplog is not None:  # before the save: its marker goes into the log started here
            kept = self._steplog.before_save(layout.parent(first_part))
            if self.rank == 0:
                tree["replicated"][TREE_KEY] = kept
        return tree

    def wait(self) -> None:
        """Block until every pending checkpoint is committed (or failed) on all ranks; raise its error."""
        if self.unsupported:
            return
        self._group.wait()
        self._before_call()

    # -- load ------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None = "latest", *, load_kwargs: dict | None = None,
             replay: bool = True, **model_kwargs: Any) -> str:
        """Restore the whole state; returns the checkpoint's folder (an earlier release's: its index).

        ``path``: ``"latest"``/None (newest committed checkpoint of the default directory), a checkpoint
        folder (``.../checkpoints/checkpoint_3``, absolute or relative, as accelerate names it), an index
        file (a path ending in ``.ckpt``), or a directory of checkpoints (its newest). Pending saves of
        this checkpointer are waited for first, a save in flight to that checkpoint by another one of
        this process too. ``model_kwargs`` go to each model's ``load_state_dict`` (e.g. ``strict=False``).
        ``load_kwargs`` (accelerate's): passed on whole to accelerate's ``load_state`` for a folder it
        wrote; of a checkrun checkpoint only ``weights_only`` counts (``False`` unpickles values whose
        types are not allow-listed; see ``load.allowed_globals``). ``replay=False`` (step log on): load the
        checkpoint exactly as saved, also the newest one, replaying none of the steps logged after it (a
        rollback; accelerate's own tests load a checkpoint back that way).
        The checkpoint loaded is never removed by this process's retention."""
        load_kwargs = dict(load_kwargs or {})
        if self.unsupported:
            return self._native_load(path, model_kwargs, load_kwargs)
        self._reopen_if_ended("load")
        self.wait()
        self._group.release_strays(f"it loads {path if path is not None else 'the latest checkpoint'} now")
        if self._steplog is not None:  # rank 0 commits its log before any rank replays it
            self._steplog.before_load()
        found, resumes = self._group.broadcast(self._resolve_resume(path) if self.rank == 0 else None)
        url = self._raise_or(found)
        if isinstance(url, paths.NativeFolder):
            return self._load_native(url.path, model_kwargs, load_kwargs)
        index = layout.read_index(self._engine, url, self.storage_options)
        urls = layout.part_urls(url, index)
        acc = self.accelerator
        safe = load_kwargs.get("weights_only")  # None: as torch.load (True unless its switch says otherwise)
        first = self._load_part(urls[0], own=self.rank == 0, weights_only=safe)
        mine = first if self.rank == 0 else (
            self._load_part(urls[self.rank], own=True, weights_only=safe) if self.rank < len(urls) else None)
        state.check_parts(first, mine, (urls[0], urls[min(self.rank, len(urls) - 1)]))
        replicated = first["replicated"]
        models = list(acc._models)
        folder = layout.folder_of(url)
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, folder if folder != url else layout.parent(url))
        state.apply_replicated(acc, replicated, models, model_kwargs)
        if mine is not None:
            state.apply_rank(acc, mine["rank"])
        else:
            warnings.warn(f"{url} was saved by {len(urls)} process(es): rank {self.rank} has no RNG/dataloader "
                          "state in it and keeps its current one", RuntimeWarning, stacklevel=2)
        with self._names_lock:
            self._resumed.add(layout.checkpoint_key(url))
        if self._steplog is not None:  # every rank: the steps logged after it, into the live objects
            self._steplog.after_load(urls[0], replicated.get(TREE_KEY), replay=resumes and replay,
                                     own=self._saves_into(url), branch=resumes and not replay)
        return folder

    def latest(self, directory: str | os.PathLike | None = None) -> str | None:
        """The newest committed checkpoint's folder in ``directory`` (default: where ``load()`` looks),
        or None. Collective: rank 0 looks, every rank gets its answer. Pending saves are waited for first."""
        if self.unsupported:
            raise UnsupportedDistributedTypeError(f"accelerate_ckpt: {self.unsupported}")
        self._reopen_if_ended("latest")  # after end_training() with ranks: a CheckrunError, not the group's ValueError
        self.wait()
        found = self._group.broadcast(self._resolve(directory) if self.rank == 0 else None)
        if isinstance(found, paths.NativeFolder):
            return found.path
        return None if isinstance(found, CheckpointNotFoundError) else layout.folder_of(self._raise_or(found))

    # -- close -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending checkpoints, restore the Accelerator's methods, release threads. Idempotent;
        a call while another thread closes returns once that close is done."""
        with self._close_lock:
            if self._closed:
                self._reopenable = False
                self.detach()  # closed by end_training(): its routes that reopen checkrun go too
                return
            self._closed = True
            self.detach()
            if self.unsupported:
                return
            try:
                if self._steplog is not None:
                    self._steplog.close()
                self._group.close()
            finally:
                self._engine.close()
                if self._committer is not None:
                    self._committer.close()
        self._before_call()

    def __enter__(self) -> "AcceleratorCheckpointer":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except CheckrunError as err:
            if exc_type is None:
                raise
            log.error("accelerate_ckpt: checkpoint error while handling another exception: %s", err)

    # -- accelerate-compatible replacements ----------------------------------------------------------
    def _save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                    **save_model_func_kwargs: Any) -> "pathlib.Path | str":
        """``Accelerator.save_state`` through checkrun (``safe_serialization``: always no pickle). Returns
        the folder as accelerate does: a ``pathlib.Path`` (a ``str`` for a URL, which Path would mangle)."""
        if save_model_func_kwargs:
            log.debug("accelerate_ckpt: ignoring save_state kwargs %s", sorted(save_model_func_kwargs))
        folder = self.save(output_dir=output_dir)
        return folder if "://" in folder else pathlib.Path(folder)

    def _load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                    **load_model_func_kwargs: Any) -> str:
        """``Accelerator.load_state`` through checkrun; ``input_dir=None`` resumes the newest checkpoint."""
        # Parts load onto the CPU and the values land where the live objects are (_load_part).
        if load_model_func_kwargs.pop("map_location", None) not in (None, "cpu", "on_device"):  # as accelerate's (h133)
            raise TypeError("Unsupported optimizer map location passed, please choose one of `None`, `'cpu'`, or "
                            "`'on_device'`")
        replay = load_model_func_kwargs.pop("replay", True)  # checkrun's: load_state(folder, replay=False)
        return self.load(input_dir, load_kwargs=load_kwargs, replay=replay, **load_model_func_kwargs)

    def _end_training(self) -> None:
        """``Accelerator.end_training`` after every pending checkpoint is committed (this checkpointer is
        closed). accelerate's ``save_state`` / ``load_state`` still work after it (in one process): a
        later call reopens checkrun on the Accelerator, with the same settings (``_reopen``)."""
        try:
            self.close()
        finally:
            acc = self.accelerator
            self._ended = self._reopenable = True
            acc.end_training()
            if not self.unsupported:
                for name in ("save_state", "load_state"):
                    setattr(acc, name, _Routed(functools.partial(self._reopen, name), acc, name))

    def _reopen(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A ``save_state`` / ``load_state`` after ``end_training()``: this checkpointer starts again (what it
        knew stays: the folder to resume from, the step log's step count, ``history``) and is attached.
        Before 2026-12-06 the Accelerator's own methods were back, and they failed on the project's checkrun
        folders (``IndexError`` listing ``checkpoints/.checkrun``; found by an independent check)."""
        acc = self.accelerator
        self._reopen_if_ended(name)
        for n in ("save_state", "load_state"):
            acc.__dict__.pop(n, None)  # the Accelerator's own methods are what a later detach() gives back
        self.attach()
        return getattr(acc, name)(*args, **kwargs)

    def _reopen_if_ended(self, name: str) -> None:
        """Start this checkpointer again if ``end_training()`` closed it (and no ``close()`` since): its own
        ``save``/``load``/``attach`` after it, as accelerate's methods (before 2026-12-07 they failed on the
        closed engine: found by an independent check)."""
        if not (self._closed and self._reopenable):
            return
        if self.world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise CheckrunError(f"accelerate_ckpt: {name}() after end_training() with {self.world} processes: "
                                "accelerate's end_training() destroyed the process group the ranks save with")
        with self._close_lock:
            if self._closed:
                self._start(self.accelerator)
                self._closed = self._reopenable = False

    def _is_reopen(self, route: Any) -> bool:
        return isinstance(route, _Routed) and getattr(route.method, "func", None) == self._reopen

    # -- internals ---------------------------------------------------------------------------------
    def _before_call(self) -> None:
        """Log metrics of committed saves, then raise the first failed save's error (on every rank)."""
        for figures in self._group.take_figures():
            m = figures.as_metrics()
            self.history.append(m)
            # not once the Accelerator is gone, nor after end_training() finished its trackers (a reopened
            # checkpointer logged to them: MLflow/W&B runs that had ended; found by an independent check)
            if getattr(self.accelerator, "trackers", None) and not self._ended:
                self.accelerator.log({k: v for k, v in m.items() if isinstance(v, (int, float))
                                      and not (isinstance(v, float) and math.isinf(v))})
        errors = self._group.take_errors()
        if errors:
            raise BackgroundSaveError("; ".join(errors))

    def _engine_save(self, tree: dict, url: str) -> "ckpt_core.SaveHandle | FailedPart":
        try:
            return self._engine.save(tree, url, storage_options=self.storage_options)
        except BackgroundSaveError as exc:
            if self._sync:  # this very save failed (on this rank): the group learns it from the part
                return FailedPart(url, exc)
            # An earlier part's failure, surfaced by the engine before the helper thread read it: that
            # error reaches every rank through the group, so raising here (this rank only) would
            # desynchronise the ranks. The engine raised before snapshotting: just save again.
            return self._engine.save(tree, url, storage_options=self.storage_options)

    def _begin(self, name: str, key: str) -> None:
        """A checkpoint is being written: its index counts as in flight for every load of this process,
        and retention leaves a checkpoint of that name alone."""
        with self._names_lock:
            self._writing.append(name)
        inflight.begin(key)

    def _end(self, name: str, key: str) -> None:
        """The verdict is known (any thread): undo ``_begin``."""
        with self._names_lock:
            self._writing.remove(name)
        inflight.end(key)

    def _protected(self) -> set[str]:
        """Checkpoints retention must keep: resumed from, or being written (commit thread)."""
        with self._names_lock:
            return self._resumed | set(self._writing)

    def _project(self) -> Any:
        """The Accelerator's ``project_configuration``; once the Accelerator is gone (its pending
        checkpoints commit after it was dropped), the last one seen."""
        acc = self.accelerator
        if acc is not None:
            self._project_config = acc.project_configuration
        return self._project_config

    def _keep_last(self) -> int | None:
        # accelerate's total_limit=0 deletes every older folder before a save: the newest one stays
        limit = self._project().total_limit
        return self.config.retention.keep_last or (None if limit is None else max(1, limit))

    def _default_root(self) -> str | None:
        pc = self._project()
        if self.options.directory:
            return self.options.directory
        if pc.automatic_checkpoint_naming and pc.project_dir:
            return _home(os.path.join(os.fspath(pc.project_dir), "checkpoints"))
        return None

    def _saves_into(self, url: str) -> bool:
        """Whether the checkpoint ``url`` is in the directory where ``save_state()`` saves (automatic naming
        or a configured directory); False with neither (each ``save_state(output_dir)`` has its own)."""
        root = self._default_root()
        return root is not None and _dir_key(layout.parent(layout.folder_of(url))) == _dir_key(root)

    def _target(self, output_dir: str | os.PathLike | None, number: int) -> Target:
        """Where this save goes: ``ROOT/checkpoint_{number}`` when there is a ROOT, else ``output_dir``."""
        root = self._default_root()
        if root is not None:
            return Target.in_root(root, layout.checkpoint_name(number))
        if output_dir is None:
            raise ValueError("no checkpoint directory: pass output_dir, set automatic_checkpoint_naming "
                             "with a project_dir, or configure checkpointing.accelerate.directory")
        return Target.folder_only(output_dir)

    def _refuse_existing(self, target: Target) -> None:
        """Before any load, automatic naming never replaces a folder already there, nor numbers its
        checkpoints below one (a rerun into the same project: a checkpoint of an earlier run, checkrun's
        or accelerate's; with ``total_limit`` the earlier run's lowest numbers are gone, and its newer
        folders would be pruned as the older ones). After a checkrun ``load_state`` the iteration
        continues from the checkpoint loaded (unless this process's iteration is already further), and
        a save replaces a later one of that name (a rewind). Every rank looks before any creates its
        own, and all raise if one found it (a gather on the training's process group, as accelerate's
        ``wait_for_everyone``). A rewind never replaces a folder accelerate's own ``save_state`` wrote
        (as the docs promise: accelerate raises there too)."""
        ours = int(target.name.rpartition("_")[2])
        later = [name for name in composite.folder_names(target.base, self.storage_options, self.config)
                 if (m := re.fullmatch(r"checkpoint_(\d+)", name)) and int(m.group(1)) >= ours]
        if self._resumed:
            later = [name for name in later if paths.native_files(layout.join(target.base, name))]
        found = int(bool(later))
        if self.world > 1:
            acc = self.accelerator
            found = int(acc.gather(torch.tensor([found], device=acc.device)).sum().item())
        if found and self._resumed:
            raise CheckpointExistsError(
                f"{layout.join(target.base, later[0]) if later else target.folder} holds a checkpoint accelerate's own "
                "save_state wrote: save_state() with automatic checkpoint naming does not replace it, as accelerate "
                "does not. load_state() that folder by its path to resume from it (load_state() without one loads the "
                "newest checkrun checkpoint), or set accelerator.project_configuration.iteration past it")
        if found:
            raise CheckpointExistsError(
                f"{target.folder} or a later checkpoint_N already exists in {target.base} (an earlier run's, or "
                f"one whose save failed before its commit: a folder without {layout.INDEX_NAME}, or one whose "
                f"{layout.INDEX_NAME} cannot be read: load_state() names it): save_state() with "
                f"automatic checkpoint naming does not replace it, as accelerate does not. Resume with load_state() "
                f"first (it sets the iteration), set accelerator.project_configuration.iteration to the next free "
                f"number, delete a folder that holds no checkpoint, or use another project_dir")

    def _shown(self, output_dir: str | os.PathLike | None, target: Target) -> str:
        """The folder spelt as accelerate's ``save_state`` returns it (a relative path stays relative)."""
        root = self._default_root()
        if root is None:
            return os.fspath(output_dir)
        return layout.join(root, target.name) if "://" in root else os.path.join(root, target.name)

    def _resolve(self, path: str | os.PathLike | None) -> str | paths.NativeFolder | BaseException:
        """Rank 0: the index to load, or a folder accelerate itself wrote (``fallback_to_accelerate``);
        an exception object is broadcast and raised on every rank."""
        root = self._default_root() or self._last_root
        local = None if path is None or path == "latest" or "://" in os.fspath(path) else os.fspath(path)
        if local is not None and os.path.isfile(local) and not local.endswith(".ckpt"):
            return NoCheckpointError(f"{local} is a file, not a checkpoint folder: load_state() takes the folder "
                                     "save_state() returned")
        try:
            index = paths.index_for(self._engine, path, root, self.storage_options)
            if (path is None or path == "latest") and self.options.fallback_to_accelerate:
                _warn_newer_native(index, paths.native_folder(path, root))
            return index
        except CheckpointNotFoundError as exc:
            native = paths.native_folder(path, root) if self.options.fallback_to_accelerate else None
            return NoCheckpointError(str(exc)) if native is None else native
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the broadcast
            return exc

    def _resolve_resume(self, path: str | os.PathLike | None) -> tuple[Any, bool]:
        """Rank 0: ``_resolve(path)``, and whether loading it resumes (the step log replays the steps
        logged after it): ``load_state()``, or a folder holding the newest checkpoint of its directory. An
        older one is a rewind, loaded as it was saved, as the Lightning plugin replays for ``last*.ckpt``
        only (before 2026-12-06 its replay ran on through the newer checkpoints to the newest logged step)."""
        found = self._resolve(path)
        if self._steplog is None or not isinstance(found, str) or path is None or path == "latest":
            return found, True
        try:
            newest = paths.newest(self._engine, layout.parent(layout.folder_of(found)), self.storage_options)
        except Exception:  # noqa: BLE001 - no directory of checkpoints around it: a folder of its own
            return found, True
        # by name in that directory (file://, memory:/// and plain spellings of one URL differ; found by h66)
        return found, _names(newest) == _names(found)

    @staticmethod
    def _raise_or(value: Any) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    def _load_part(self, url: str, own: bool, weights_only: "bool | None" = None) -> dict:
        """One part, onto the CPU: ``load_state_dict`` then copies each value where its live
        tensor is (as accelerate places them), and no rank materialises rank 0's replicated
        state on the GPU it was saved from (all ranks on cuda:0, out of memory on big models)."""
        try:
            if own:  # the next save of this rank is incremental against what it loaded
                return self._engine.load(url, map_location="cpu", storage_options=self.storage_options,
                                         weights_only=weights_only)
            return ckpt_core.load(url, map_location="cpu", config=self._engine.config,
                                  storage_options=self.storage_options, weights_only=weights_only)
        except CheckpointNotFoundError as exc:
            parts = layout.parent(url)
            if "://" in parts or os.path.isdir(parts):
                raise
            raise CheckpointNotFoundError(
                f"{exc} (a checkpoint folder holds only its index; its parts are in the {layout.PARTS_DIR} "
                "of the directory it was saved in, and there is none here: was the folder copied or moved "
                "alone? Copy the whole directory, or make a self-contained file with `checkrun export "
                "FOLDER out.pt` where it was saved)") from exc

    def _native_save(self, output_dir: Any) -> str:
        root = output_dir or self._default_root()
        if root is not None and "://" in os.fspath(root):
            raise UnsupportedDistributedTypeError(f"accelerate_ckpt: {self.unsupported}; accelerate's own "
                                                  f"save_state cannot write to {root}")
        return str(type(self.accelerator).save_state(self.accelerator, root))

    def _load_native(self, folder: str, model_kwargs: dict, load_kwargs: dict) -> str:
        """Every rank: a folder accelerate's own ``save_state`` wrote, loaded by accelerate's own
        ``load_state``; automatic naming then continues after it, as after a checkrun load."""
        log.info("accelerate_ckpt: %s was written by accelerate's own save_state; loading it with "
                 "accelerate's load_state", folder)
        type(self.accelerator).load_state(self.accelerator, folder, load_kwargs=load_kwargs or None, **model_kwargs)
        number = re.fullmatch(r"checkpoint_(\d+)", os.path.basename(folder.rstrip("/")))
        if number is not None and self.accelerator.project_configuration.automatic_checkpoint_naming:
            pc = self.accelerator.project_configuration
            pc.iteration = max(int(number.group(1)) + 1, int(pc.iteration))
        with self._names_lock:  # a resume: a later folder of the user's own does not stop the next save (h155)
            self._resumed.add(layout.checkpoint_key(folder))
        return folder

    def _native_load(self, path: Any, model_kwargs: dict, load_kwargs: dict) -> str:
        path = None if path == "latest" else path
        type(self.accelerator).load_state(self.accelerator, path, load_kwargs=load_kwargs or None, **model_kwargs)
        return str(path)

    def _uncommitted(self) -> int:
        """Checkpoints of this checkpointer not committed yet (lock-free, for the SIGTERM handler)."""
        group = getattr(self, "_group", None)
        return group.pending_unlocked() if group is not None else 0

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nobody can catch it at exit
            log.error("accelerate_ckpt: pending checkpoint failed at interpreter exit: %s", exc)


def _closer(checkpointer: AcceleratorCheckpointer, pid: int) -> None:
    """The Accelerator of ``checkpointer`` was collected: close it on a thread of its own (a finalizer may
    run on any thread, one of the engine's own included, where waiting for its saves would never end).
    At exit, the exit hook's ``close`` waits for this one. Not in a forked child (a DataLoader worker),
    which inherits no saves to finish."""
    if not checkpointer._closed and os.getpid() == pid:
        threading.Thread(target=checkpointer._close_at_exit, name="accelerate-ckpt-close", daemon=True).start()


def attach(accelerator: Any, config: EngineConfig | dict | str | os.PathLike | None = None,
           **kwargs: Any) -> AcceleratorCheckpointer:
    """``AcceleratorCheckpointer(accelerator, config, **kwargs).attach()``."""
    return AcceleratorCheckpointer(accelerator, config, **kwargs).attach()


def _home(path: Any) -> Any:
    """A local path with ``~`` expanded, where the engine writes it (a ``pathlib.Path`` stays one), so
    the folder ``save_state`` returns and the hooks get exists; accelerate itself expands ``~`` only in
    ``load_state(input_dir)``, and its saves make a folder named ``~`` in the working directory."""
    if isinstance(path, pathlib.PurePath):
        return path.expanduser()
    return os.path.expanduser(path) if isinstance(path, str) and "://" not in path else path


def _warn_newer_native(index: str, native: paths.NativeFolder | None) -> None:
    """``load_state()`` takes the newest checkrun checkpoint; say so when accelerate's own ``save_state``
    wrote a later ``checkpoint_N`` (a project where checkrun was turned off and on again: that newer
    folder was skipped without a word, found by an independent check)."""
    ours = re.search(r"checkpoint_(\d+)(?=/|$)", index.replace("\\", "/"))
    theirs = None if native is None else re.search(r"checkpoint_(\d+)$", native.path.rstrip("/"))
    if ours is not None and theirs is not None and int(theirs.group(1)) > int(ours.group(1)):
        warnings.warn(f"checkrun: {native.path} (written by accelerate's own save_state) is newer than the newest "
                      f"checkrun checkpoint {index}, which load_state() loads; load_state({native.path!r}) resumes "
                      "from accelerate's", RuntimeWarning, stacklevel=4)
