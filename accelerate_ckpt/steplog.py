"""The per-step update log (issue 23, docs/steplog.md) in the Accelerate adapter: ``step_log.enabled``.

Where the log lives: the engine marks a checkpoint's position in a log only for saves into the log's
own directory, and the part that holds the optimizer is rank 0's, written into
``BASE/.checkrun/parts`` (``layout``). So rank 0 logs into that parts directory, and the marker of
each checkpoint is the one of its rank 0 part. Gradients are equal on every rank after DDP's
all-reduce: one rank (0) logs, every rank replays the same log into its own optimizer.

Order of the calls (all on the training thread, every rank, like ``save_state``/``load_state``):

* ``before_save(directory)``: rank 0 starts the log on the parts directory of the save if it is
  not logging there (the first save of a run: steps before the first checkpoint could not be replayed anyway);
* ``before_load()``: rank 0 closes its log (a flush: the other ranks read every step logged so far
  after the broadcast that follows, which orders them after it);
* ``after_load(part, saved)``: every rank replays the steps logged after ``part`` (the loaded rank 0
  part); rank 0 then starts logging again, continuing the chain the replay ended on (the engine
  remembers it), so a second crash resumes through both runs.

The prepared ``GradScaler`` (``accelerator.scaler``, fp16 mixed precision) is logged and replayed with
the optimizer; the one prepared model (unwrapped) names the parameters in the log.

``optimizer_steps`` counts the optimizer's steps (a step post-hook: steps a ``GradScaler`` skipped
are not counted); it is saved in the replicated tree and restored on load, plus what was replayed.
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch

from ckpt_core import CheckpointEngine, CheckrunError
from ckpt_core.steplog import NoMarkerError, warn_forward_state
from ckpt_core.format.composite import parent

log = logging.getLogger("accelerate_ckpt")
TREE_KEY = "steplog"
"""Key, in the replicated tree, of ``{"optimizer_steps": n}``."""


class StepLogSetupError(CheckrunError):
    """``step_log.enabled`` with prepared objects the log cannot follow (several optimizers or schedulers)."""


def _inner(obj: Any, attr: str) -> Any:
    """The torch object an Accelerate wrapper holds (``AcceleratedOptimizer.optimizer``, ...)."""
    return getattr(obj, attr, obj)


def batches_of_steps(steps: int, start_batch: int, batches_per_epoch: int, accumulation: int,
                     sync_with_dataloader: bool = True) -> int:
    """The batches ``steps`` optimizer steps take from batch ``start_batch`` of an epoch of
    ``batches_per_epoch``: ``accumulation`` per step; with ``sync_with_dataloader`` (accelerate's
    default) an epoch's last window is cut at its end (h110: the documented ``steps x accumulation``
    skipped too many batches across an epoch end)."""
    if batches_per_epoch < 1 or not 0 <= start_batch <= batches_per_epoch:
        raise ValueError(f"replayed_batches: start_batch must be in [0, batches_per_epoch] and batches_per_epoch "
                         f">= 1, got {start_batch} and {batches_per_epoch}")
    accumulation = max(1, int(accumulation))
    if not sync_with_dataloader:
        return steps * accumulation
    taken, at = 0, start_batch
    while steps > 0:
        windows = -(-(batches_per_epoch - at) // accumulation)  # steps left in this epoch
        if steps < windows:
            return taken + steps * accumulation
        taken, steps, at = taken + batches_per_epoch - at, steps - windows, 0
    return taken


class AccelerateStepLog:
    """The step log of one ``AcceleratorCheckpointer`` (built only when ``step_log.enabled``)."""

    def __init__(self, accelerator: Any, engine: CheckpointEngine, rank: int,
                 storage_options: dict | None) -> None:
        self._accelerator, self.engine, self.rank = weakref.ref(accelerator), engine, rank
        self.storage_options = storage_options
        self.log: Any = None  # the engine's StepLog (rank 0, once a save or load started it)
        self.directory: str | None = None
        self.optimizer_steps = 0
        self.replayed_steps = 0
        self._counted: Any = None
        self._hook: Any = None
        self._replaying = self._warned = False

    @property
    def accelerator(self) -> Any:
        """The Accelerator, held weakly as by the checkpointer (None once it is gone)."""
        return self._accelerator()

    # -- the prepared objects ---------------------------------------------------------------------
    def targets(self) -> tuple[Any, Any]:
        """The torch optimizer and scheduler inside the prepared ones (one optimizer, at most one
        scheduler: the log and its markers follow one optimizer per directory)."""
        acc = self.accelerator
        if not acc._optimizers:  # an evaluation script sharing the training config: nothing to log
            if not self._warned:
                self._warned = True
                warnings.warn("accelerate_ckpt: step_log.enabled, but the Accelerator has no prepared optimizer: "
                              "no step is logged or replayed", RuntimeWarning, stacklevel=4)
            return None, None
        if len(acc._optimizers) != 1 or len(acc._schedulers) > 1:
            raise StepLogSetupError(
                f"step_log.enabled: the Accelerator has {len(acc._optimizers)} prepared optimizer(s) and "
                f"{len(acc._schedulers)} scheduler(s); the step log follows exactly one optimizer and at "
                "most one scheduler (set step_log.enabled: false, or prepare one of each)")
        optimizer = _inner(acc._optimizers[0], "optimizer")
        registered = _registered(acc, (acc._optimizers[0], optimizer))
        if acc._schedulers and registered is not None:
            raise StepLogSetupError("step_log.enabled: the Accelerator has a prepared scheduler and a registered one "
                                    "(register_for_checkpointing) of the same optimizer; the step log follows at "
                                    "most one scheduler (set step_log.enabled: false, or keep one)")
        scheduler = _inner(acc._schedulers[0], "scheduler") if acc._schedulers else registered
        self._count(optimizer)
        return optimizer, scheduler

    def _count(self, optimizer: Any) -> None:
        if self._counted is optimizer:
            return
        if self._hook is not None:
            self._hook.remove()
        self._hook = optimizer.register_step_post_hook(self._on_step)
        self._counted = optimizer

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._replaying:  # replayed steps are counted by after_load
            self.optimizer_steps += 1

    # -- save / load ------------------------------------------------------------------------------
    def before_save(self, directory: str) -> dict:
        """Rank 0: log into ``directory`` (where rank 0's part goes) from now on. Returns what the
        replicated tree keeps of the log (every rank calls it; only rank 0's is saved)."""
        optimizer, scheduler = self.targets()
        if optimizer is not None and self.rank == 0 and (self.log is None or self.log.closed
                                                         or self.directory != directory):
            self.close()
            self._open(directory, optimizer, scheduler)
        return {"optimizer_steps": self.optimizer_steps}

    def before_load(self) -> None:
        """Rank 0: commit and stop logging before any rank replays."""
        self.targets()
        if self.rank == 0:
            self.close()

    def after_load(self, part_url: str, saved: dict | None, replay: bool = True, own: bool = True,
                   branch: bool = False) -> int:
        """Every rank: replay the steps logged after ``part_url`` (rank 0's part of the loaded
        checkpoint) into the live optimizer and scheduler; returns how many. ``replay=False`` (an older
        checkpoint loaded by name: a rewind; or asked for): none; rank 0's log starts a chain of its own there.
        ``branch`` (the newest checkpoint loaded with ``replay=False``: a rollback): that chain branches off at the
        checkpoint, so a later resume from it follows the steps logged from now on (h168); a rewind does not
        (the newer checkpoints stay the ones to resume: a branch there made the next resume warn of a late commit,
        h169).
        ``own``: the checkpoint is in the directory this Accelerator saves to, where rank 0 logs on at
        once; else (another project's checkpoint, a folder of its own) the log starts at the next save,
        in its directory (logging on in the loaded one made a later resume of that project replay this
        run's steps: found by an independent check). A log that cannot start here (a read-only
        directory) is a warning: loading works, the next save starts it."""
        optimizer, scheduler = self.targets()
        if optimizer is None:
            return 0
        directory = parent(part_url)
        replayed = 0
        self._replaying = True
        try:
            if not replay:
                log.info("accelerate_ckpt: %s loaded as saved, no step replayed (older than the newest checkpoint, "
                         "or replay=False; load_state() resumes to the newest logged step)", part_url)
                if branch:  # a replay of no step: the chain ends at the checkpoint (see the docstring)
                    self.engine.replay(directory, optimizer, scheduler, after=part_url, max_steps=0, rng=False,
                                       storage_options=self.storage_options)
            else:
                replayed = self.engine.replay(directory, optimizer, scheduler, after=part_url,
                                              storage_options=self.storage_options, scaler=self.accelerator.scaler,
                                              model=self._model())
        except NoMarkerError as exc:
            # saved without the log (or by a run that had it off): nothing to replay after it
            if replay:
                warnings.warn(f"accelerate_ckpt: no step log after {part_url}: resumed at the checkpoint itself "
                              f"({exc})", RuntimeWarning, stacklevel=3)
        finally:
            self._replaying = False
        self.replayed_steps = replayed
        # registered modules (an EMA's AveragedModel) are updated by the user's loop, which a replay does
        # not run: say so (h156: the average stayed the checkpoint's, silently); plain registered objects
        # (a progress record) stay the checkpoint's as the docs' resume loop expects
        modules = [type(o).__name__ for o in getattr(self.accelerator, "_custom_objects", ())
                   if isinstance(o, torch.nn.Module)]
        if replayed and modules:
            warnings.warn(f"accelerate_ckpt: {', '.join(modules)} (registered for checkpointing) did not see the "
                          f"{replayed} replayed step(s): its state is the checkpoint's (the model, optimizer and "
                          "scheduler are the resumed step's)", RuntimeWarning, stacklevel=3)
        if self._model() is None:  # several models: the log has none of their running statistics
            models = [self.accelerator.unwrap_model(m) for m in self.accelerator._models]
            warn_forward_state(torch.nn.ModuleList(models), replayed, part_url)
        self.optimizer_steps = int((saved or {}).get("optimizer_steps", 0)) + replayed
        if self.rank == 0 and own:
            try:
                self._open(directory, optimizer, scheduler)
            except Exception as exc:  # noqa: BLE001 - the load stands; the next save starts the log
                warnings.warn(f"accelerate_ckpt: the step log does not go on in {directory} after the load "
                              f"({exc}); it starts at the next save_state", RuntimeWarning, stacklevel=3)
        return replayed

    def _open(self, directory: str, optimizer: Any, scheduler: Any) -> None:
        self.log = self.engine.step_log(directory, optimizer, scheduler, storage_options=self.storage_options,
                                        scaler=self.accelerator.scaler, model=self._model())
        self.directory = directory
        if scheduler is not None:
            _track_window_ends()
            _WINDOW_LOGS[scheduler] = self.log

    def _model(self) -> Any:
        """The one prepared model, unwrapped (its names are the state dict's), or None."""
        models = self.accelerator._models
        return self.accelerator.unwrap_model(models[0]) if len(models) == 1 else None

    def close(self) -> None:
        """Flush and stop the log (rank 0; idempotent)."""
        slog, self.log = self.log, None
        if slog is not None:
            slog.close()


#: The open log of each logged LR scheduler (the torch one inside a prepared ``AcceleratedScheduler``).
_WINDOW_LOGS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _track_window_ends() -> None:
    """Wrap ``AcceleratedScheduler.step`` (once, on the class) to tell the log of its scheduler, after each
    call, that the work of the last logged optimizer step is done (``StepLog.window_end``): with
    ``step_scheduler_with_optimizer=False`` the scheduler steps at every micro-batch, and the state at the
    next flush included the steps of an accumulation window a resume runs again."""
    from accelerate.scheduler import AcceleratedScheduler

    step = AcceleratedScheduler.step
    if getattr(step, "_checkrun", False):
        return

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = step(self, *args, **kwargs)
        slog = _WINDOW_LOGS.get(getattr(self, "scheduler", None))
        if slog is not None and not getattr(self, "step_with_optimizer", True):  # stepped per micro-batch
            slog.window_end()  # (with the optimizer: the state at the flush, hyperparameters set after it too)
        return out
    wrapped._checkrun = True  # type: ignore[attr-defined]
    wrapped.__doc__, wrapped.__name__ = step.__doc__, step.__name__
    AcceleratedScheduler.step = wrapped


def _registered(acc: Any, optimizers: tuple) -> Any:
    """An LR scheduler of the logged optimizer (``optimizers``: the prepared one and the torch one
    inside it, either may be the scheduler's) registered with ``register_for_checkpointing`` (it is
    saved and loaded with the checkpoint, so the log must step it too: unlogged, the replay left it
    at the checkpoint's step, silently); None if there is none."""
    found = [o for o in acc._custom_objects if isinstance(o, torch.optim.lr_scheduler.LRScheduler)
             and any(getattr(o, "optimizer", None) is opt for opt in optimizers)]
    if len(found) > 1:
        raise StepLogSetupError(f"step_log.enabled: {len(found)} LR schedulers of the optimizer are registered "
                                "with register_for_checkpointing; the step log follows at most one scheduler "
                                "(set step_log.enabled: false, or register one)")
    return found[0] if found else None
