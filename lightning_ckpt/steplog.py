"""The per-step update log (issue 23, docs/steplog.md) in the Lightning plugin: ``step_log=True``.

Design (docs/lightning.md, "Per-step recovery"): the plugin replays on the live objects after
Lightning restored them, then advances the loop counters by the steps replayed. Rebuilding the
checkpoint dict inside ``load_checkpoint`` instead would need the optimizer and scheduler objects
(their classes and constructor arguments are not in the dict, and ``LambdaLR`` holds code), and
Lightning calls ``load_checkpoint`` before its strategy creates the optimizers.

* Logging starts at the first regular save (``CheckpointIO.save_checkpoint``, global rank 0 only,
  as Lightning calls it), on the trainer's optimizer and LR scheduler, into the checkpoint's
  directory: every later save into it marks its position. Steps before the first checkpoint could
  not be replayed anyway.
* Lightning runs ``optimizer.step(closure=...)``: torch's step pre-hooks (where the log captures the
  gradients) run before the closure computes them. The logged optimizer gets an instance ``step``
  that runs the closure first and then the optimizer's own ``step()``, so the capture sees the
  gradients as the update consumes them (after clipping; LBFGS, which calls the closure several
  times, is refused).
* ``fit(ckpt_path="last")``: ``load_checkpoint`` of a ``last*.ckpt`` (every rank) arms a callback; at
  ``on_train_start`` (after Lightning restored optimizer, schedulers and loops, before the first
  batch) it replays the steps logged after that checkpoint on every rank, advances the training
  epoch loop's counters (``global_step`` is its optimizer-step count) by the steps replayed (or, when
  a ``GradScaler`` skipped steps, to the ``global_step`` logged with the last record replayed: the log
  records it with every state record), and rank 0 logs on, continuing the chain. Another
  ``ckpt_path`` loads that checkpoint exactly.
* The precision plugin's ``GradScaler`` (``16-mixed``; Lightning has one on CUDA only, and turns
  ``16-mixed`` on the CPU into ``bf16-mixed``, which has none) is logged and replayed with the
  optimizer; the LightningModule names the parameters in the log (``checkrun export --step``).
"""
from __future__ import annotations

import fnmatch
import logging
import os
import types
import warnings
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from ckpt_core import CheckpointEngine, CheckrunError
from ckpt_core.steplog import NoMarkerError

from .config import LAST_PATTERN
from .paths import is_remote, local_path, parent_dir

log = logging.getLogger("lightning_ckpt")

__all__ = ["StepLogSetupError", "LightningStepLog"]

_COUNTERS = ("ready", "started", "processed", "completed")


class StepLogSetupError(CheckrunError):
    """``step_log`` with a training setup the log cannot follow (several optimizers, LBFGS, no trainer)."""


def find_trainer(strategy: Any) -> Any:
    """The Trainer behind ``strategy`` (the plugin has no reference to it), or None."""
    module = getattr(strategy, "lightning_module", None) if strategy is not None else None
    return getattr(module, "_trainer", None) if module is not None else None


def targets(trainer: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The trainer's one optimizer and its LR scheduler (None if it has none)."""
    optimizers = list(trainer.optimizers)
    configs = list(trainer.lr_scheduler_configs)
    if len(optimizers) != 1 or len(configs) > 1:
        raise StepLogSetupError(f"CheckrunCheckpointIO(step_log=True): the trainer has {len(optimizers)} "
                                f"optimizer(s) and {len(configs)} LR scheduler(s); the step log follows exactly "
                                "one optimizer and at most one scheduler")
    optimizer = optimizers[0]
    if isinstance(optimizer, torch.optim.LBFGS):
        raise StepLogSetupError("CheckrunCheckpointIO(step_log=True): LBFGS evaluates its closure several times "
                                "per step; the step log cannot capture one set of gradients per step")
    return optimizer, (configs[0].scheduler if configs else None)


def grad_scaler(trainer: Any) -> Any:
    """The precision plugin's ``GradScaler`` (16-mixed), or None."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)


def _closure_first(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step(closure=c)`` run ``c`` before the step (and its pre-hooks), once. Wraps
    the current ``step``: LR schedulers put a counting wrapper of their own on the instance."""
    current = optimizer.step
    if getattr(current, "_checkrun_closure_first", False):
        return

    def step(self: Any, closure: Any = None, **kwargs: Any) -> Any:
        if closure is None:
            return current(**kwargs)
        with torch.enable_grad():
            loss = closure()
        current(**kwargs)
        return loss

    step._checkrun_closure_first = True  # type: ignore[attr-defined]
    if getattr(current, "_wrapped_by_lr_sched", False):  # a scheduler's counting wrapper is inside: it told
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # torch so (else it warns; h98)
    # a bound method, as torch's LR schedulers expect of ``optimizer.step`` (they wrap its ``__func__``): a
    # plain function broke a scheduler made after the log started, e.g. StochasticWeightAveraging's SWALR
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def advance_counters(trainer: Any, steps: int, batches: Optional[int] = None, acc: Optional[int] = None) -> None:
    """Move the fit loop's progress on by ``steps`` optimizer steps, as if Lightning had run them.
    Automatic optimization: batches (``accumulate_grad_batches`` each), optimizer steps and
    zero_grads, scheduler updates and the logging step counter (once per step); ``batches``: up to
    the batch of the last replayed step, as logged, and ``acc`` the logged run's ``accumulate_grad_batches``
    there (a ``GradientAccumulationScheduler`` sets the trainer's only at the next epoch start; a resume
    may change it: h111). Manual optimization,
    where the module decides when to step: ``batches`` batches (up to the one of the last replayed
    step, as logged), the optimizer steps, and the logging step counter (once per batch, as Lightning
    counts it there); Lightning leaves the schedulers to the module, so their progress stays.

    Where the replayed batches end decides the rest (``_position``): within the checkpoint's epoch,
    its counters move on; at or past an epoch's end (a checkpoint saved at an epoch end, as
    ``ModelCheckpoint`` does by default, or replayed steps that cross one), the loops stand as in a
    checkpoint Lightning saves at that batch's end (``_enter``): the rest of that epoch runs next, its
    dataloader from the start, as Lightning resumes a dataloader without state mid-epoch."""
    loop = trainer.fit_loop.epoch_loop
    automatic = trainer.lightning_module.automatic_optimization
    acc = max(1, int(acc or trainer.accumulate_grad_batches))
    logged = batches is not None
    if automatic:
        batches = steps * acc if batches is None else batches
        optim = loop.automatic_optimization.optim_progress.optimizer
        # Lightning zeroes the gradients at a window's first batch: a checkpoint inside a window counted
        # that window's zero_grad already
        ahead = max(0, optim.zero_grad.total.ready - optim.step.total.ready)
        per_step = [(optim.step, steps), (optim.zero_grad, steps - ahead)]
    else:
        batches = steps if batches is None else batches
        per_step = [(loop.manual_optimization.optim_step_progress, steps)]
    updates = _step_updates(trainer, steps) if automatic else 0
    stepped = _bts_after_reset(loop) + (steps if automatic else batches)
    position = _position(trainer, steps, batches, acc, logged)
    if position is None:  # counters Lightning's loops cannot take exactly (see _position)
        epoch = trainer.num_training_batches
        at_end = isinstance(epoch, int) and loop.batch_progress.current.ready >= epoch
        for progress, n in (*per_step, (loop.batch_progress, batches), (loop.scheduler_progress, updates)):
            _shift(progress, n, current=not at_end)
        loop._batches_that_stepped += steps if automatic else batches
        if at_end:
            log.info("lightning_ckpt: the checkpoint was saved at an epoch end: the %d replayed step(s) count in "
                     "the totals; the next epoch starts at its first batch", steps)
        elif isinstance(epoch, int) and loop.batch_progress.current.ready > epoch:
            warnings.warn(f"checkrun: the {steps} replayed step(s) run past the end of the epoch the checkpoint was "
                          "saved in; model and optimizer state are exact, the epoch counters are not",
                          RuntimeWarning, stacklevel=2)
        return
    finished, into, begun, batches = position
    epoch = trainer.fit_loop.epoch_progress.current
    # the first epoch the replay finishes; the checkpoint's own, if not over (one more after a behind one)
    behind = _behind(trainer)
    first = max(epoch.processed + behind, epoch.completed)
    for progress, n in per_step:  # manual optimization: Lightning never sets the current count back
        _shift(progress, n, current=not (begun and automatic))
    _shift(loop.batch_progress, batches, current=False)
    if automatic:
        ended = first > 0 and epoch.processed == epoch.started
        _shift(loop.scheduler_progress, updates + _epoch_updates(trainer, first, finished - (not into), ended),
               current=not begun)
    if begun:  # the counters of the epoch the replay ends in, which Lightning sets to 0 at its start
        steps_in = -(-(into or trainer.num_training_batches) // acc)
        for progress, _ in per_step if automatic else ():
            _set_current(progress, steps_in)
        if automatic:
            _set_current(loop.scheduler_progress, _step_updates(trainer, steps_in))
        loop.val_loop.batch_progress.total.reset()
    _enter(trainer, finished + behind, into or trainer.num_training_batches, stepped)


def _behind(trainer: Any) -> int:
    """1 for a checkpoint saved at its epoch's last batch (``on_train_batch_end``) by a fit that had itself
    resumed from an epoch end: Lightning started no epoch after that one, so its epoch counters stand
    one behind a fit that never stopped (ready == started == processed == the epoch's index), and its
    restore does not count the epoch over (``max_epochs``: not restarting) or counts it completed only
    (``max_steps``). A replay from it went on one epoch low (h155 with ``max_steps``, h160 ``max_epochs``)."""
    from lightning.pytorch.loops.fit_loop import RestartStage as FitStage

    fit = trainer.fit_loop
    batch, epoch, n = fit.epoch_loop.batch_progress.current, fit.epoch_progress.current, trainer.num_training_batches
    return int(isinstance(n, int) and batch.ready >= n > 0 and batch.completed < batch.processed
               and epoch.ready == epoch.started == epoch.processed
               and getattr(fit, "_restart_stage", None) != FitStage.RESTARTED_MID_EPOCH)


def _position(trainer: Any, steps: int, batches: int, acc: int,
              logged: bool) -> Optional[tuple[int, int, int, int]]:
    """Where the replayed steps (``batches`` batches: ``logged``, or one ``acc`` window per step) end: (epochs they finish,
    batches into the epoch after those (or into the checkpoint's own, if none), epochs begun after the
    checkpoint's, batches replayed); None where the loops cannot be set exactly (a Lightning without
    restart stages; an epoch of unknown length, unless the checkpoint ended one: the replayed steps are
    then taken to lie in the next one, not past its end). Automatic optimization steps at every
    ``accumulate_grad_batches``-th batch and at an epoch's last one: where the log holds no batch count
    (a log of before 2026-12-05), its steps are counted in windows of ``acc`` batches."""
    fit, loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    n = trainer.num_training_batches
    if not hasattr(fit, "_restart_stage") or not hasattr(loop, "_restart_stage"):
        return None
    at = loop.batch_progress.current.ready
    epoch = fit.epoch_progress.current
    if not isinstance(n, int):  # an epoch of unknown length: only a checkpoint at an epoch end says where
        # the replayed steps are (in the next epoch: it ran that epoch again, found by an independent check)
        over = epoch.ready == epoch.started == epoch.processed and loop.batch_progress.is_last_batch
        return (0, batches, 1, batches) if over and batches else None
    if n <= 0:
        return None
    ended = at >= n and epoch.ready == epoch.started == epoch.processed  # the checkpoint's epoch is over
    left = 0 if ended else n - at  # batches left in the checkpoint's epoch
    if trainer.lightning_module.automatic_optimization and not logged:
        # the epoch's steps done before the checkpoint: one inside an accumulation window (a resumed fit
        # saves again one batch in) is ended by the first replayed step (h105: counted from it, one batch on)
        done = 0 if ended else at // acc
        steps_left = 0 if ended else -(-n // acc) - done
        if steps < steps_left:  # within the checkpoint's epoch
            end = (done + steps) * acc
            return 0, end, 0, end - at
        finished, rest = divmod(steps - steps_left, -(-n // acc))
        into = rest * acc
    else:
        if batches < left:
            return 0, at + batches, 0, batches
        finished, into = divmod(batches - left, n)
    finished += 0 if ended else 1
    return finished, into, finished + (into > 0) - (not ended), left + (finished - (not ended)) * n + into


def _enter(trainer: Any, finished: int, at: int, stepped: int) -> None:
    """Stand the loops as Lightning's restore of a checkpoint saved at the end of batch ``at`` (its
    ``on_train_batch_end``, where ``ModelCheckpoint`` saves) leaves them, ``finished`` epochs after the
    checkpoint's: restarting mid-epoch, the batch processed but not completed (the epoch loop's
    ``reset`` completes it and counts its step in ``stepped``, the logging step counter); at an epoch's
    last batch that epoch is processed (``FitLoop.reset`` did it) and the next starts."""
    from lightning.pytorch.loops import _Loop
    from lightning.pytorch.loops.fit_loop import RestartStage as FitStage
    from lightning.pytorch.loops.training_epoch_loop import RestartStage as EpochStage

    fit, loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    last = at >= trainer.num_training_batches
    for tracker in (fit.epoch_progress.total, fit.epoch_progress.current):
        tracker.processed = max(tracker.processed + finished, tracker.completed)  # (see _behind)
        tracker.completed = tracker.processed
        tracker.ready = tracker.started = tracker.processed + (not last)
    progress = loop.batch_progress
    _set_current(progress, at, at - 1)
    progress.total.completed = progress.total.processed - 1
    progress.is_last_batch = last
    loop._batches_that_stepped = stepped - 1
    _Loop.restarting.fset(fit, True)  # and its child loops (the setter would say no for a processed epoch)
    fit._restart_stage, loop._restart_stage = FitStage.RESTARTED_MID_EPOCH, EpochStage.RESTARTED_ON_TRAIN_BATCH_END


def _step_updates(trainer: Any, steps: int) -> int:
    """Scheduler updates of ``steps`` optimizer steps: one per step-interval scheduler every
    ``frequency`` steps."""
    return sum(steps // max(1, c.frequency) for c in trainer.lr_scheduler_configs if c.interval == "step")


def _epoch_updates(trainer: Any, first: int, epochs: int, ended: bool = False) -> int:
    """Scheduler updates at the ends of ``epochs`` epochs from epoch ``first``. ``ended``: the checkpoint
    ended epoch ``first - 1`` (its last batch or its end), after which steps were replayed: a plateau
    scheduler's update of that epoch is among them, as the fit loop makes it after every hook where a
    checkpoint is saved (``FitLoop.on_advance_end``; the others step before the last batch's
    ``on_train_batch_end``; found by an independent check)."""
    return sum(1 for c in trainer.lr_scheduler_configs if c.interval == "epoch"
               for e in range(first - (ended and c.reduce_on_plateau), first + max(0, epochs))
               if (e + 1) % max(1, c.frequency) == 0)


def _set_current(progress: Any, value: int, completed: Optional[int] = None) -> None:
    for name in _COUNTERS:
        if hasattr(progress.current, name):
            setattr(progress.current, name, value if completed is None or name != "completed" else completed)


def _bts_after_reset(loop: Any) -> int:
    """The logging step counter as Lightning's restore leaves it: the epoch loop's ``reset`` adds the
    step of a checkpoint saved at a batch end, and finishing the batch of one saved at a validation's end
    within the epoch (``ModelCheckpoint`` with a validation loop) adds it there (an independent check
    found the logger's step one behind after replays from such checkpoints)."""
    epoch = loop.trainer.fit_loop.epoch_progress.current
    at_validation = getattr(loop, "restarted_on_last", False) and epoch.processed < epoch.started
    adds = loop.restarting and not loop._should_accumulate() and (
        getattr(loop, "restarted_on_train_batch_end", False) or not getattr(loop, "restarted_on_last", True)
        or at_validation)
    return loop._batches_that_stepped + int(adds)


def _shift(progress: Any, n: int, current: bool = True) -> None:
    for tracker in (progress.total, progress.current) if current else (progress.total,):
        for name in _COUNTERS:
            if hasattr(tracker, name):
                setattr(tracker, name, getattr(tracker, name) + n)


_LIGHTNING = ("lightning.", "pytorch_lightning.", "lightning_fabric.", "lightning_ckpt.")


def _is(callback: Any, names: tuple[str, ...]) -> bool:
    """``callback`` is (a subclass of) one of Lightning's callbacks ``names``, of either package (h160)."""
    import importlib

    kinds = []
    for package in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        kinds += [getattr(module, n) for n in names if hasattr(module, n)]
    return isinstance(callback, tuple(kinds))


def _averaging(callback: Any) -> bool:
    """A weight-averaging callback (``lightning`` or ``pytorch_lightning``), or one named so."""
    names = ("WeightAveraging", "StochasticWeightAveraging")
    return _is(callback, names) or "WeightAveraging" in type(callback).__name__


def _own(method: Any) -> bool:
    """``method`` is defined by the user's code, not by Lightning (either package) or checkrun."""
    return method is not None and not (getattr(method, "__module__", None) or "").startswith(_LIGHTNING)


def _user_state(trainer: Any) -> list[str]:
    """Callbacks whose ``state_dict`` is the user's own (not Lightning's, also through a subclass that
    overrides nothing of it: h160) and non-empty, and the LightningModule if its ``on_save_checkpoint``
    is its own: state that ``training_step`` or batch hooks may move, which a replay does not run."""
    found = []
    for cb in trainer.callbacks:
        if _averaging(cb) or not _own(getattr(type(cb), "state_dict", None)):
            continue
        try:
            if cb.state_dict():
                found.append(type(cb).__name__)
        except Exception:  # noqa: BLE001 - only a hint: a state_dict that fails here fails at the next save
            found.append(type(cb).__name__)
    module = trainer.lightning_module
    if _own(getattr(type(module), "on_save_checkpoint", None)):
        found.append(f"{type(module).__name__}.on_save_checkpoint")
    return found


def _pruned(trainer: Any) -> bool:
    """Whether the parameters of a ``ModelPruning`` callback hold zeros (read before a replay): it saves them
    pruned without masks. Without any zero nothing was pruned yet, and a replay moves nothing off zero (h168)."""
    for cb in trainer.callbacks:
        if not _is(cb, ("ModelPruning",)):
            continue
        targets = getattr(cb, "_parameters_to_prune", None)
        if not isinstance(targets, (list, tuple)) or not targets:
            return True  # not known which: say it
        for target in targets:
            t = getattr(target[0], target[1], None) if isinstance(target, tuple) and len(target) == 2 else None
            if not isinstance(t, torch.Tensor) or bool((t == 0).any()):
                return True
    return False


def _warn_unreplayed(trainer: Any, steps: int, pruned: bool = False) -> None:
    """A replay runs the optimizer steps (and schedulers), not ``training_step`` or the callbacks' hooks:
    say whose state is the checkpoint's. Weight-averaging callbacks (``EMAWeightAveraging``, any
    ``WeightAveraging`` subclass, ``StochasticWeightAveraging``) update their average in batch and epoch
    hooks (an independent check found the EMA average behind the uninterrupted run's, silently; a subclass
    named otherwise was missed until h156); a user's callback counting batches, or a module counter saved
    in ``on_save_checkpoint``, stays at the checkpoint's value (h156: a warm-up callback's LR was off);
    ``ModelPruning`` saves its weights pruned without their masks, so the replayed steps move the pruned
    weights off zero (h164)."""
    if not steps:
        return
    averaging = [type(cb).__name__ for cb in trainer.callbacks if _averaging(cb)]
    if averaging:
        warnings.warn(f"checkrun: {', '.join(averaging)} did not see the {steps} replayed step(s): its averaged "
                      "weights are those of the checkpoint (the model and optimizer are the resumed step's)",
                      RuntimeWarning, stacklevel=3)
    if pruned:  # ModelPruning's masks are in no checkpoint (h164)
        warnings.warn(f"checkrun: ModelPruning's masks are not in the checkpoint, so the {steps} replayed step(s) "
                      "moved the pruned weights off zero: the other weights are the resumed step's; the pruned ones "
                      "differ from a checkpoint saved at that step until it prunes again (its next pruning, as after "
                      "a stock resume)", RuntimeWarning, stacklevel=3)
    other = _user_state(trainer)
    if other:
        warnings.warn(f"checkrun: the {steps} replayed step(s) ran the optimizer and schedulers only, not "
                      f"training_step or hooks: the state of {', '.join(other)} is the checkpoint's (the model, "
                      "optimizer and loop counters are the resumed step's)", RuntimeWarning, stacklevel=3)


def _dir_key(directory: str) -> str:
    """One spelling of a directory: symlinks resolved for local ones (Lightning resolves a ModelCheckpoint's
    ``dirpath`` so; a symlinked scratch directory broke the chain), no trailing ``/`` for URLs."""
    return directory.rstrip("/") if is_remote(directory) else os.path.realpath(local_path(directory))


def _checkpoint_dirs(trainer: Any) -> set[str]:
    """The directories (``_dir_key``) the trainer's ``ModelCheckpoint``s save into. A resume goes on logging
    in the checkpoint's directory only if it is one of them: logging on in another run's directory (a
    fine-tune from its last.ckpt, a new ``version_N``) made a later resume of that run replay this one's
    steps (found by an independent check)."""
    return {_dir_key(str(cb.dirpath)) for cb in getattr(trainer, "checkpoint_callbacks", ())
            if getattr(cb, "dirpath", None)}


def _last_dirs(trainer: Any) -> set[str]:
    """The directories (``_dir_key``) of the trainer's ``ModelCheckpoint``s that keep a ``last.ckpt``."""
    return {_dir_key(str(cb.dirpath)) for cb in getattr(trainer, "checkpoint_callbacks", ())
            if getattr(cb, "save_last", None) and getattr(cb, "dirpath", None)}


class LightningStepLog:
    """The step log of one ``CheckrunCheckpointIO``: started at a save, replayed after a load."""

    def __init__(self) -> None:
        self.log: Any = None  # the engine's StepLog (global rank 0, once a save started it)
        self._hook: Any = None  # the optimizer pre-hook noting the batch of each step (with the log)
        self.directory: Optional[str] = None
        self.replayed_steps = 0
        """Optimizer steps the last resume replayed after its checkpoint."""

    def before_save(self, engine: CheckpointEngine, strategy: Any, url: str) -> None:
        """Rank 0, before saving ``url``: log into its directory from now on (so the save marks it),
        unless the log is open elsewhere and ``url`` is neither a ``last*.ckpt`` nor a save into the
        directory of a ``ModelCheckpoint`` with ``save_last`` (``"link"`` makes last.ckpt a link, not a
        save): the log stays with the checkpoints that ``ckpt_path="last"`` resumes from (a second
        ``ModelCheckpoint`` saving top-k files into another directory took the log there, and a resume
        from ``last`` lost every step logged after that save)."""
        directory = parent_dir(url)
        if self.log is not None and self.log.closed:  # its directory was deleted (shutil.rmtree closes it)
            self.close()
        if self.log is not None and self.directory == directory:
            return
        trainer = find_trainer(strategy)
        if trainer is None or not trainer.optimizers:  # e.g. trainer.save_checkpoint before fit
            return
        if self.log is not None and not (fnmatch.fnmatch(url.rpartition("/")[2], LAST_PATTERN)
                                         or _dir_key(directory) in _last_dirs(trainer)):
            return
        optimizer, scheduler = targets(trainer)
        self.close()
        self._open(engine, directory, trainer, optimizer, scheduler)

    def after_load(self, engine: CheckpointEngine, strategy: Any, url: str) -> None:
        """Every rank, after loading ``url``: arm the replay if it is a ``last*.ckpt`` of a Trainer."""
        if not fnmatch.fnmatch(url.rpartition("/")[2], LAST_PATTERN):
            return
        trainer = find_trainer(strategy)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:  # validate/test: load it exactly
            return
        callback = next((c for c in trainer.callbacks if isinstance(c, _Replay)), None)
        if callback is None:
            callback = _Replay()
            trainer.callbacks.insert(0, callback)  # first: the other callbacks' on_train_start see the resumed state
        if not is_remote(url) and os.path.islink(local_path(url)):  # save_last="link": the marks are the target's
            url = os.path.realpath(local_path(url))
        callback.arm(self, engine, url)

    def replay(self, engine: CheckpointEngine, trainer: Any, url: str) -> int:
        """Every rank: apply the steps logged after ``url`` to the restored objects, advance the loops."""
        optimizer, scheduler = targets(trainer)
        directory = parent_dir(url)
        if trainer.is_global_zero:
            self.close()
        steps, logged = 0, {}
        # a fit with a smaller max_steps than the logged run's stops there, as it would from a checkpoint:
        # by the logged global_step, which counts the steps a GradScaler skipped too (h113)
        until = None if trainer.max_steps < 0 else lambda c: c.get("global_step", -1) >= trainer.max_steps
        pruned = _pruned(trainer)
        try:
            with warnings.catch_warnings():  # the fit ends at the limit: no random number is drawn after it
                warnings.filterwarnings("ignore", r"checkrun: the RNG states are not set .* inside a segment")
                steps = engine.replay(directory, optimizer, scheduler, after=url, scaler=grad_scaler(trainer),
                                      counters=logged, model=trainer.lightning_module, until=until)
        except NoMarkerError as exc:
            warnings.warn(f"checkrun: no step log after {url}: resumed at the checkpoint itself ({exc})",
                          RuntimeWarning, stacklevel=2)
        self.replayed_steps = steps
        _warn_unreplayed(trainer, steps, pruned)
        # Lightning's global_step also counts the steps a GradScaler skipped (no optimizer.step(), so not
        # in the log): the logged global_step says how far the loop had come
        moved = max(steps, logged.get("global_step", 0) - trainer.global_step)
        if moved:
            # the batches up to the one of the last replayed step (the log's "batch" counter; manual
            # optimization: the batches after it are to run again, their gradients are not logged)
            batch, acc = logged.get("batch"), logged.get("acc")
            if batch is not None and trainer.lightning_module.automatic_optimization:
                # steps replayed after the last state record applied (a replay stopped early, before
                # the record after its last step): one window each
                behind = trainer.global_step + steps - logged.get("global_step", 0)
                # and steps a GradScaler skipped after the last one applied (no post-hook ran: h116)
                skipped = logged.get("global_step", 0) - logged.get("stepped", logged.get("global_step", 0))
                batch += (max(0, behind) + max(0, skipped)) * max(1, int(acc or trainer.accumulate_grad_batches))
            batches = None if batch is None else max(0, batch - self._batch_at(trainer))
            advance_counters(trainer, moved, batches, acc)
        if trainer.is_global_zero and _dir_key(directory) in _checkpoint_dirs(trainer):
            try:  # else another run's checkpoint (a fine-tune from it): the log starts at the first save
                self._open(engine, directory, trainer, optimizer, scheduler)
            except Exception as exc:  # noqa: BLE001 - the resume stands (a read-only directory)
                warnings.warn(f"checkrun: the step log does not go on in {directory} after the resume ({exc}); "
                              "it starts at the next save", RuntimeWarning, stacklevel=2)
        log.info("lightning_ckpt: replayed %d logged step(s) after %s (global_step %d)", steps, url,
                 trainer.global_step)
        return steps

    @staticmethod
    def _batch_at(trainer: Any) -> int:
        """The fit loop's batch count: the batch in progress during a step, the checkpoint's after a load."""
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)

    def _open(self, engine: CheckpointEngine, directory: str, trainer: Any, optimizer: Any, scheduler: Any) -> None:
        _closure_first(optimizer)
        # the batch of the newest optimizer step that completed, logged with every state record
        # ("batch"): a post-hook, so the record a step's pre-hook makes (its segment closed there: the
        # state after the previous step) holds the previous step's batch, not the one in progress; a
        # record made at a flush after batches that did not step keeps the last step's batch
        # and its accumulate_grad_batches (a record made after the next epoch started holds the batch of
        # the previous epoch's last step: a GradientAccumulationScheduler may have changed it since; h113)
        at = [self._batch_at(trainer), int(trainer.accumulate_grad_batches), trainer.global_step]

        def stepped(*_: Any) -> None:  # and the global_step after it: more in a record counts the steps a
            at[:] = [self._batch_at(trainer), int(trainer.accumulate_grad_batches), trainer.global_step + 1]
        self._hook = optimizer.register_step_post_hook(stepped)  # GradScaler skipped since (h116)
        self.log = engine.step_log(directory, optimizer, scheduler, scaler=grad_scaler(trainer),
                                   model=trainer.lightning_module,
                                   counters=lambda: {"global_step": trainer.global_step, "batch": at[0], "acc": at[1],
                                                     "stepped": at[2]})
        self.directory = directory

    def close(self) -> None:
        """Flush and stop the log (idempotent)."""
        slog, self.log = self.log, None
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        if slog is not None:
            slog.close()


class _Replay(Callback):
    """Installed by the plugin on the trainer it loads a ``last*.ckpt`` for: replays at train start."""

    def __init__(self) -> None:
        self._armed: Optional[tuple[LightningStepLog, CheckpointEngine, str]] = None

    def arm(self, owner: LightningStepLog, engine: CheckpointEngine, url: str) -> None:
        self._armed = (owner, engine, url)

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``/pickle of ``trainer.callbacks``, as callbacks may do at fit start)
        is not armed: the engine, which holds threads, stays with the trainer that loaded."""
        return {**self.__dict__, "_armed": None}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            owner, engine, url = armed
            before = torch.get_rng_state()
            owner.replay(engine, trainer, url)
            _draw_epoch_order_again(trainer, before)

    def state_dict(self) -> dict:
        return {}


def _draw_epoch_order_again(trainer: Any, before: torch.Tensor) -> None:
    """After a replay that set the RNG states to the last replayed step's and ended at an epoch's end: make
    the dataloader iterator again. Lightning made it before ``on_train_start`` (a ``RandomSampler`` draws its
    seed from the global generator then), from the RNG states the replay then replaced; the uninterrupted
    run made it after that step, so the epoch's order and every later draw were one draw off (found by an
    independent check: weights differed one epoch after such a resume). Mid-epoch resumes are left alone:
    the epoch's order is not resumable there anyway (Lightning restarts the dataloader)."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or torch.equal(before, torch.get_rng_state()):
        return
    at, epoch = trainer.fit_loop.epoch_loop.batch_progress.current.ready, trainer.num_training_batches
    if at == 0 or (isinstance(epoch, int) and at >= epoch):  # the next batch starts an epoch
        iter(fetcher)
