"""What ``CheckpointEngine.step_log`` and ``CheckpointEngine.replay`` delegate to (training thread).

The engine keeps ``_steplogs`` (the open logs, told of each ``save`` by the hook in
``CheckpointEngine.save``), created here on first use. Where a replay into an optimizer, or its closed
log, ended is kept per optimizer (``log.ENDED``): the next log of it continues that chain.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable

from ..errors import CheckpointNotFoundError, CheckrunError
from ..storage.store import Store
from .index import dir_key, find_marker, read_index
from .format import NoMarkerError, StepLogError, StepLogFormatError, decode_limit
from . import rng as rng_states
from .capture import fingerprint, warn_forward_state
from .log import StepLog
from .registry import ENDED, active_log, log_store, open_logs
from .replay import replay_chain

log = logging.getLogger("ckpt_core")


def open_log(engine: Any, directory: str | os.PathLike, optimizer: Any, scheduler: Any = None,
             storage_options: dict | None = None, *, scaler: Any = None, model: Any = None,
             counters: Any = None) -> StepLog:
    """Start logging every ``optimizer.step()`` (and ``scheduler.step()``, ``scaler``'s state, and the
    caller's ``counters()``) into ``directory``; ``model`` names the parameters in the log when the
    optimizer's groups do not."""
    engine._check_open()
    if scaler is not None and scaler.is_enabled() and getattr(optimizer, "_step_supports_amp_scaling", False):
        # GradScaler.step then hands step() scaled gradients and the scale (fused=True): the log holds neither
        raise StepLogError(f"step log of {directory}: {type(optimizer).__name__} unscales its gradients inside step() "
                           "(fused=True) when a GradScaler drives it; the log records gradients as step() receives "
                           "them, so it cannot replay that: use the optimizer without fused=True")
    store = engine._dir_store(directory, storage_options)
    logs = engine.__dict__.setdefault("_steplogs", [])
    key = dir_key(store)
    other = next((lg for lg in logs if not lg._stop.is_set() and dir_key(lg.store) == key
                  and lg.optimizer is not optimizer), None)
    if other is not None:  # a save would mark both logs; replay could not tell whose steps are whose
        raise StepLogError(f"step log of {store.url('')}: a log of another optimizer "
                           f"({type(other.optimizer).__name__}) is open in this directory; one step log per "
                           "directory: close it first, or log one optimizer per checkpoint directory")
    # where this optimizer's last replay or last closed log here ended, if untouched since (taken: a
    # later log continues this one instead; found by independent checks: a log closed and opened again
    # started a chain of its own, and a replay's end went to the next log of any optimizer, or to every log)
    resume = ended_at(optimizer, key)
    slog = StepLog(store, optimizer, scheduler, engine.config, parent=resume, scaler=scaler, model=model,
                   counters=counters)
    ENDED.get(optimizer, {}).pop(key, None)  # taken by this log (one that failed to open left it for a retry)
    logs[:] = [lg for lg in logs if not lg._stop.is_set()] + [slog]
    return slog


def replay(engine: Any, directory: str | os.PathLike, optimizer: Any, scheduler: Any = None,
           after: str | os.PathLike | None = None, storage_options: dict | None = None, *,
           scaler: Any = None, counters: dict | None = None, model: Any = None, rng: bool = True,
           max_steps: int | None = None, until: Callable[[dict], bool] | None = None) -> int:
    """Apply the steps logged after checkpoint ``after`` (default: the newest committed checkpoint of
    ``directory`` that the log marks), at most ``max_steps`` of them (None: all), and none from a step
    before which ``until(counters)`` is true (the logged counters so far); returns how many optimizer
    steps were replayed. ``scaler`` (a
    ``GradScaler``) ends in the logged state; ``counters`` (a dict) receives the logged counters of the
    last state record applied; ``model`` receives the logged forward-pass state (running statistics)
    of the last step replayed, when the log has it (``step_log(model=)``); warns when it cannot. ``rng``:
    set the RNG states (python, numpy, torch, CUDA) to those logged with the last step replayed, when
    its segment holds them and this process has the logging process's rank (``steplog.rng``)."""
    engine._check_open()
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 0):
        raise ValueError(f"replay: max_steps must be a non-negative int or None, got {max_steps!r}")
    store = engine._dir_store(directory, storage_options)
    engine._wait_dir(store)  # a checkpoint in flight here commits (or fails) first
    _commit_others(store, optimizer)
    index = read_index(log_store(store))
    marker, manifest = _start(engine, store, index, after, storage_options)
    if (note := index.damage_note()) is not None:  # not this checkpoint's: its marker is intact
        log.warning("checkrun: step log of %s: %s", store.url(""), note)
        warnings.warn(f"checkrun: step log of {store.url('')}: {note}", RuntimeWarning, stacklevel=3)
    def limit(pos: Any) -> bool:
        return (max_steps is not None and pos.replayed >= max_steps) or (until is not None and until(pos.counters or {}))

    pos = replay_chain(log_store(store), index, marker, optimizer, scheduler, decode_limit(engine.config.load),
                       scaler, model, limit if max_steps is not None or until is not None else None)
    if rng and pos.rng is not None and pos.rng.rank == rng_states.rank():
        rng_states.restore(pos.rng, pos.rng.where)
    elif rng and pos.rng_lost:
        warnings.warn(f"checkrun: the RNG states are not set after replaying to step {pos.step} of {store.url('')}'s "
                      f"step log: the log's last ones do not hold there ({pos.rng_lost}); random numbers drawn from "
                      "here on differ from the uninterrupted run's (call log.flush() after such a batch, or save)",
                      RuntimeWarning, stacklevel=3)
    where = store.url(marker.checkpoint)
    lossy = sum(1 for r in manifest.tensors if r.quant)
    if lossy and pos.replayed:  # the replay starts from the checkpoint's values, exactly as loaded
        warnings.warn(f"checkrun: {where} stores {lossy} tensor(s) quantized (lossy): the {pos.replayed} replayed "
                      "step(s) start from the quantized values, so the state is not the uninterrupted run's bit "
                      "for bit", RuntimeWarning, stacklevel=3)
    if model is not None:
        warn_forward_state(model, pos.replayed, where, pos.buffers_set)
    elif pos.buffers_left:
        warnings.warn(f"checkrun: the step log after {where} holds the running statistics of the steps it replayed; "
                      "pass model= to replay to set them", RuntimeWarning, stacklevel=3)
    if counters is not None:
        counters.clear()
        counters.update(pos.counters or {})
    slog = active_log(optimizer)  # a log opened before the replay continues the chain too
    if slog is None or dir_key(slog.store) != dir_key(store):
        ENDED.setdefault(optimizer, {})[dir_key(store)] = ((pos.run, pos.event, pos.step), fingerprint(optimizer))
    elif not slog.continue_chain((pos.run, pos.event, pos.step)):  # it logged already: a chain of its own
        warnings.warn(f"checkrun: the step log open in {store.url('')} logged before this replay (a flush, a step or "
                      f"a save), so it does not continue the replayed chain: a resume from a checkpoint before the "
                      f"next save there ends at step {pos.step}; open the log after replay()", RuntimeWarning,
                      stacklevel=3)
    return pos.replayed


def ended_at(optimizer: Any, key: str) -> tuple[str, int, int] | None:
    """``(run, event, step)`` where the last replay into ``optimizer`` or its last closed log in the
    directory ``key`` (``dir_key``) ended, if neither its parameters nor its state changed since (else
    None: a new log starts a chain of its own). ``step_log`` takes it once its log is open."""
    ended = ENDED.get(optimizer, {}).get(key)
    if ended is None:
        return None
    if ended[1] != fingerprint(optimizer):
        log.info("checkrun: the optimizer's parameters or state changed since its last replay or step log in %s "
                 "ended at step %d: the new log starts a chain of its own (replays from earlier checkpoints end "
                 "at step %d)", key, ended[0][2], ended[0][2])
        return None
    return ended[0]


#: How long a replay waits for another open log of the process to commit what it holds.
COMMIT_OTHERS_SECONDS = 60.0


def _commit_others(store: Store, optimizer: Any) -> None:
    """Commit the steps the other logs of this process open in ``url`` hold (a second Accelerator or
    Trainer of the process: found by an independent check), each within ``COMMIT_OTHERS_SECONDS``; one
    that cannot (its writer paused or failing, a flush already under way) is replayed without them."""
    url = store.url("")
    for other in open_logs(store):
        if other.optimizer is optimizer:
            continue
        try:
            done = other.commit_for(COMMIT_OTHERS_SECONDS)
        except CheckrunError as exc:
            done = exc
        if done is not True:
            warnings.warn(f"checkrun: another step log of this process open in {url} did not commit the steps it "
                          f"holds{'' if done is False else f' ({done})'}: the replay goes without them",
                          RuntimeWarning, stacklevel=4)


def _start(engine: Any, store: Store, index: Any, after: Any, storage_options: dict | None) -> tuple[Any, Any]:
    """The marker to replay after, and its checkpoint's manifest."""
    if after is not None:
        name = os.fspath(after).replace("\\", "/").rstrip("/").rpartition("/")[2]
        manifest = engine.read_manifest(store.url(name), storage_options)
        marker = find_marker(index, name, manifest.commit, strict=True)
        if marker is None and index.damaged:  # perhaps its marker
            raise StepLogFormatError(f"the step log of {store.url('')} has no intact marker for checkpoint "
                                     f"{store.url(name)}: {index.damage_note()}")
        if marker is None:
            others = sum(m.checkpoint == name for m in index.markers)
            why = (f"it has {others} marker(s) of that name, none of this save's commit stamp: saved again "
                   "without the log, or the marker was damaged" if others else
                   "saved by another engine, before engine.step_log was called, or again over a checkpoint "
                   "the log marked, whose marker went with it")
            raise NoMarkerError(f"the step log of {store.url('')} has no marker for checkpoint {store.url(name)} "
                               f"({why})")
        return marker, manifest
    for entry in reversed(engine.list(store.url(""), storage_options)):
        if entry.manifest is None:
            continue
        marker = find_marker(index, entry.name, entry.manifest.commit, strict=True)
        if marker is not None:
            return marker, entry.manifest
        if index.damaged:  # perhaps its marker: an older checkpoint's would replay onto the wrong state (h100)
            raise StepLogFormatError(f"the step log of {store.url('')} has no intact marker for checkpoint "
                                     f"{entry.url} (its newest): {index.damage_note()}")
    if index.damaged:
        raise StepLogFormatError(f"{store.url('')}: no committed checkpoint that the step log marks with an intact "
                                 f"marker: {index.damage_note()}")
    raise CheckpointNotFoundError(f"{store.url('')}: no committed checkpoint that the step log marks")


def close_logs(engine: Any) -> list[BaseException]:
    """Close every open step log of ``engine`` (``engine.close``): each is flushed and its threads end even
    where one before it fails (a log whose directory ``rmtree`` deleted keeps its error for this close);
    returns their errors in order (found by an independent check: the first failure left the others open)."""
    errors: list[BaseException] = []
    for slog in engine.__dict__.get("_steplogs", ()):
        try:
            slog.close()
        except Exception as exc:  # noqa: BLE001 - raised by engine.close once everything is closed
            errors.append(exc)
    return errors
