"""AcceleratorCheckpointer: an Accelerator's whole state through checkrun, on every rank.

Construct it on every process after ``Accelerator(...)`` (the constructor is collective when
torch.distributed runs), ``prepare`` and ``register_for_checkpointing`` as usual, then ``attach()``:
the instance's ``save_state`` / ``load_state`` now go through checkrun and training scripts keep
calling them unchanged. All public methods are called from the training thread, on every rank,
in the same order (they are collective like accelerate's own ``save_state``).
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import time
import warnings
import weakref
from typing import Any

import ckpt_core
from ckpt_core import BackgroundSaveError, CheckpointEngine, CheckpointNotFoundError, CheckrunError, EngineConfig

from . import layout, state
from .config import AdapterOptions, resolve
from .group import GroupCommitter, Job, make_group

log = logging.getLogger("accelerate_ckpt")
_PATCHED = ("save_state", "load_state", "end_training")
_MISSING = object()


class UnsupportedDistributedTypeError(CheckrunError, NotImplementedError):
    """The Accelerator runs a distributed type whose state checkrun cannot hold (FSDP, DeepSpeed, ...)."""


class AcceleratorCheckpointer:
    """Saves and loads an ``accelerate.Accelerator``'s state with checkrun (see ``docs/accelerate.md``).

    ``config``: ``EngineConfig``, dict or YAML path (else ``$CHECKRUN_CONFIG``, else defaults).
    ``directory`` / ``storage_options`` override the config's adapter directory / storage options.
    """

    def __init__(self, accelerator: Any, config: EngineConfig | dict | str | os.PathLike | None = None, *,
                 directory: str | os.PathLike | None = None, storage_options: dict | None = None) -> None:
        self.accelerator = accelerator
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
        self._last_root: str | None = None
        self._seq = 0
        self._unwrapped: dict[int, tuple] = {}
        self._closed = False
        if self.unsupported:
            return
        # The engine's own retention would count parts and indexes alike: whole checkpoints are
        # retained here instead (layout.apply_retention).
        engine_cfg = self.config.replace(**{"retention.keep_last": None})
        self._engine = CheckpointEngine(engine_cfg)
        group, self.rank, self.world = make_group(self.options.collective_timeout_seconds)
        self._group = GroupCommitter(group, self.rank, self.world)
        self._token = self._group.token()
        self._committer = CheckpointEngine(engine_cfg.replace(**{
            "saving.asynchronous": False, "saving.sigterm_grace_seconds": None})) if self.rank == 0 else None
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._close_at_exit())

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
        acc = self.accelerator
        if not self._originals:
            self._originals = {n: acc.__dict__.get(n, _MISSING) for n in _PATCHED}
        acc.save_state = self._save_state
        acc.load_state = self._load_state
        acc.end_training = self._end_training
        return self

    def detach(self) -> None:
        """Give the Accelerator back its own ``save_state`` / ``load_state`` (pending saves continue)."""
        acc = self.accelerator
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

    # -- save ------------------------------------------------------------------------------------
    def save(self, step: int | None = None, *, output_dir: str | os.PathLike | None = None) -> str:
        """Snapshot the whole state and return the checkpoint's index path; the write continues in
        the background and commits once every rank's part is durable.

        Named ``checkpoint_{step}`` when ``step`` is given, else ``checkpoint_{iteration}``; the
        iteration counter advances like accelerate's. Raises a failed earlier save's error first."""
        if self.unsupported:
            return self._native_save(output_dir)
        started = time.perf_counter()
        self._before_call()
        acc = self.accelerator
        root = self._save_root(output_dir)
        iteration = acc.project_configuration.iteration
        name = layout.checkpoint_name(iteration if step is None else step)
        parts = layout.part_names(name, self._token, self._seq, self.world)
        self._seq += 1
        weights = state.model_weights(acc, self._unwrapped)
        for hook in acc._save_model_state_pre_hook.values():
            hook(acc._models, weights, root)
        tree = {"rank": state.gather_rank(acc)}
        if self.rank == 0:
            tree["replicated"] = state.gather_replicated(acc, weights, iteration + 1)
        handle = self._engine_save(tree, layout.join(root, parts[self.rank]))
        acc.project_configuration.iteration = iteration + 1
        index_url = layout.join(root, layout.index_name(name))
        meta = {"step": int(acc.step), "iteration": iteration + 1,
                "distributed_type": state.distributed_type_name(acc)}
        if step is not None:
            meta["global_step"] = int(step)
        blocking = time.perf_counter() - started
        finish = None
        if self.rank == 0:
            index = layout.make_index(name, parts, meta)
            finish = lambda outcomes: self._finish(root, index_url, index, outcomes, blocking, started)  # noqa: E731
        self._group.submit(Job(handle, finish))
        self._last_root = root
        return index_url

    def wait(self) -> None:
        """Block until every pending checkpoint is committed (or failed) on all ranks; raise its error."""
        if self.unsupported:
            return
        self._group.wait()
        self._before_call()

    # -- load ------------------------------------------------------------------------------------
    def load(self, path: str | os.PathLike | None = "latest", **model_kwargs: Any) -> str:
        """Restore the whole state; returns the checkpoint's index path.

        ``path``: ``"latest"``/None (newest committed checkpoint of the default directory), an index
        file (a path ending in ``.ckpt``), or any other path: a directory, whose newest is loaded.
        Pending saves are waited for first. ``model_kwargs`` go to each model's ``load_state_dict``
        (e.g. ``strict=False``). The checkpoint loaded is never removed by this process's retention."""
        if self.unsupported:
            return self._native_load(path, model_kwargs)
        self.wait()
        url = self._raise_or(self._group.broadcast(self._resolve(path) if self.rank == 0 else None))
        index = layout.read_index(self._engine, url, self.storage_options)
        urls = layout.part_urls(url, index)
        acc = self.accelerator
        first = self._load_part(urls[0], own=self.rank == 0)
        mine = first if self.rank == 0 else (
            self._load_part(urls[self.rank], own=True) if self.rank < len(urls) else None)
        replicated = first["replicated"]
        models = list(acc._models)
        for hook in acc._load_model_state_pre_hook.values():
            hook(models, layout.parent(url))
        state.apply_replicated(acc, replicated, models, model_kwargs)
        if mine is not None:
            state.apply_rank(acc, mine["rank"])
        else:
            warnings.warn(f"{url} was saved by {len(urls)} process(es): rank {self.rank} has no RNG/dataloader "
                          "state in it and keeps its current one", RuntimeWarning, stacklevel=2)
        self._resumed.add(url.rpartition("/")[2])
        return url

    def latest(self, directory: str | os.PathLike | None = None) -> str | None:
        """The newest committed checkpoint of ``directory`` (default: where ``load()`` looks), or None.

        Collective: rank 0 looks, every rank gets its answer. Pending saves are waited for first."""
        if self.unsupported:
            raise UnsupportedDistributedTypeError(f"accelerate_ckpt: {self.unsupported}")
        self.wait()
        found = self._group.broadcast(self._resolve(directory) if self.rank == 0 else None)
        return None if isinstance(found, CheckpointNotFoundError) else self._raise_or(found)

    # -- close -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending checkpoints, restore the Accelerator's methods, release threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.detach()
        if self.unsupported:
            return
        try:
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
                    **save_model_func_kwargs: Any) -> str:
        """``Accelerator.save_state`` through checkrun (``safe_serialization``: always no pickle)."""
        if save_model_func_kwargs:
            log.debug("accelerate_ckpt: ignoring save_state kwargs %s", sorted(save_model_func_kwargs))
        return self.save(output_dir=output_dir)

    def _load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                    **load_model_func_kwargs: Any) -> str:
        """``Accelerator.load_state`` through checkrun; ``input_dir=None`` resumes the newest checkpoint."""
        load_model_func_kwargs.pop("map_location", None)  # tensors land where the live objects are
        return self.load(input_dir, **load_model_func_kwargs)

    def _end_training(self) -> None:
        """``Accelerator.end_training`` after every pending checkpoint is committed."""
        try:
            self.close()
        finally:
            self.accelerator.end_training()

    # -- internals ---------------------------------------------------------------------------------
    def _before_call(self) -> None:
        """Log metrics of committed saves, then raise the first failed save's error (on every rank)."""
        for m in self._group.take_metrics():
            self.history.append(m)
            if getattr(self.accelerator, "trackers", None):
                self.accelerator.log({k: v for k, v in m.items() if isinstance(v, (int, float))
                                      and not (isinstance(v, float) and math.isinf(v))})
        errors = self._group.take_errors()
        if errors:
            raise BackgroundSaveError("; ".join(errors))

    def _engine_save(self, tree: dict, url: str) -> ckpt_core.SaveHandle:
        try:
            return self._engine.save(tree, url, storage_options=self.storage_options)
        except BackgroundSaveError:
            # An earlier part's failure, surfaced by the engine before the helper thread read it: that
            # error reaches every rank through the group, so raising here (this rank only) would
            # desynchronise the ranks. The engine raised before snapshotting: just save again.
            return self._engine.save(tree, url, storage_options=self.storage_options)

    def _finish(self, root: str, index_url: str, index: dict, outcomes: list[dict], blocking: float,
                started: float) -> dict:
        """Rank 0, helper thread: commit the index once every part is durable, then retention."""
        failed = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if o.get("error")]
        parts = layout.part_urls(index_url, index)
        if failed:
            self._cleanup(parts)
            return {"error": f"checkpoint {index_url} not committed: " + "; ".join(failed)}
        try:
            previous = self._previous_parts(index_url)
            info = self._committer.save(index, index_url, storage_options=self.storage_options).result()
        except Exception as exc:  # noqa: BLE001 - becomes the verdict on every rank
            self._cleanup(parts)
            return {"error": f"checkpoint {index_url} not committed: {exc}"}
        self._cleanup([p for p in previous if p not in parts])
        self._retain(root, index_url)
        m = layout.metrics(outcomes, info.written_bytes, blocking, time.perf_counter() - started, index_url)
        return {"error": None, "metrics": m}

    def _previous_parts(self, index_url: str) -> list[str]:
        """Parts of an index already at ``index_url`` (saving again under a name replaces it)."""
        try:
            return layout.part_urls(index_url, layout.read_index(self._committer, index_url, self.storage_options))
        except (CheckpointNotFoundError, FileNotFoundError, CheckrunError):
            return []

    def _retain(self, root: str, index_url: str) -> None:
        keep = self.config.retention.keep_last or self.accelerator.project_configuration.total_limit
        if not keep:
            return
        protect = self._resumed | {index_url.rpartition("/")[2]}
        try:
            removed = layout.apply_retention(self._committer, root, keep, protect, self.storage_options)
            if removed and self.config.retention.gc_after_save:
                layout.collect(self._committer, root, self.config.retention.gc_grace_seconds,
                               self.storage_options)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; retention retries next time
            log.warning("accelerate_ckpt: retention in %s failed: %s", root, exc)

    def _cleanup(self, urls: list[str]) -> None:
        for url in urls:
            try:
                self._committer.remove(url, storage_options=self.storage_options)
            except Exception as exc:  # noqa: BLE001 - best effort: orphans go at a later collect()
                log.warning("accelerate_ckpt: could not remove %s: %s", url, exc)

    def _default_root(self) -> str | None:
        pc = self.accelerator.project_configuration
        if self.options.directory:
            return self.options.directory
        if pc.automatic_checkpoint_naming and pc.project_dir:
            return layout.join(os.fspath(pc.project_dir), "checkpoints")
        return None

    def _save_root(self, output_dir: str | os.PathLike | None) -> str:
        root = self._default_root() or (os.fspath(output_dir) if output_dir is not None else None)
        if root is None:
            raise ValueError("no checkpoint directory: pass output_dir, set automatic_checkpoint_naming "
                             "with a project_dir, or configure checkpointing.accelerate.directory")
        return root.rstrip("/")

    def _resolve(self, path: str | os.PathLike | None) -> str | BaseException:
        """Rank 0: the index to load (an exception object is broadcast and raised on every rank)."""
        try:
            if path is None or path == "latest":
                root = self._default_root() or self._last_root
                if root is None:
                    raise ValueError("no checkpoint directory to resume from: pass a path, or set "
                                     "automatic_checkpoint_naming / checkpointing.accelerate.directory")
            else:
                root = os.fspath(path).rstrip("/")
                if root.endswith(".ckpt"):
                    return root
            latest = self._engine.latest(root, storage_options=self.storage_options)
            if latest is None:
                raise CheckpointNotFoundError(f"no committed checkpoint in {root}")
            return latest
        except Exception as exc:  # noqa: BLE001 - raised on every rank after the broadcast
            return exc

    @staticmethod
    def _raise_or(value: Any) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    def _load_part(self, url: str, own: bool) -> dict:
        if own:  # the next save of this rank is incremental against what it loaded
            return self._engine.load(url, storage_options=self.storage_options)
        return ckpt_core.load(url, config=self._engine.config, storage_options=self.storage_options)

    def _native_save(self, output_dir: Any) -> str:
        root = output_dir or self._default_root()
        if root is not None and "://" in os.fspath(root):
            raise UnsupportedDistributedTypeError(f"accelerate_ckpt: {self.unsupported}; accelerate's own "
                                                  f"save_state cannot write to {root}")
        return str(type(self.accelerator).save_state(self.accelerator, root))

    def _native_load(self, path: Any, model_kwargs: dict) -> str:
        path = None if path == "latest" else path
        type(self.accelerator).load_state(self.accelerator, path, **model_kwargs)
        return str(path)

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nobody can catch it at exit
            log.error("accelerate_ckpt: pending checkpoint failed at interpreter exit: %s", exc)


def attach(accelerator: Any, config: EngineConfig | dict | str | os.PathLike | None = None,
           **kwargs: Any) -> AcceleratorCheckpointer:
    """``AcceleratorCheckpointer(accelerator, config, **kwargs).attach()``."""
    return AcceleratorCheckpointer(accelerator, config, **kwargs).attach()
