"""What an Accelerator's checkpoint holds, as plain state trees, and how it is put back.

Two trees per save:

* the *replicated* tree (written by rank 0 only): prepared models (unwrapped state dicts, so a
  checkpoint taken under DDP loads into a single process and back), optimizers, schedulers, the
  GradScaler, objects from ``register_for_checkpointing`` and the step/iteration counters;
* the *per-rank* tree (written by every rank): RNG streams (python ``random``, numpy, torch CPU,
  the accelerator device) and the prepared dataloaders' epoch counter, sampler generator and
  stateful-dataloader state.

Both trees hold only tensors and plain data, so they load with ``weights_only=True``. All functions
run on the training thread; they read or write the Accelerator's objects and do no I/O.
"""
from __future__ import annotations

import random
import sys
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from ckpt_core.errors import FormatError

FORMAT = 1
"""Version of the trees below (stored in every checkpoint's index)."""

_SUPPORTED = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
              "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"}


def distributed_type_name(accelerator: Any) -> str:
    """The Accelerator's ``DistributedType`` as a plain string (e.g. ``"MULTI_GPU"``)."""
    dt = accelerator.distributed_type
    return str(getattr(dt, "value", dt))


def unsupported_reason(accelerator: Any) -> str | None:
    """Why checkrun cannot hold this Accelerator's whole state, or None when it can.

    Sharded engines (FSDP, DeepSpeed, Megatron-LM) keep model/optimizer shards that only their own
    ``save_checkpoint`` code reads and writes; XLA tensors are not captured by the engine.
    """
    name = distributed_type_name(accelerator)
    if name in _SUPPORTED and getattr(accelerator.state, "fsdp_plugin", None) is None \
            and getattr(accelerator.state, "deepspeed_plugin", None) is None:
        return None
    return (f"distributed_type={name}: model and optimizer state are sharded/owned by "
            f"{name.replace('_', '-')}'s own checkpoint code, which accelerate_ckpt does not replace")


def gather_replicated(accelerator: Any, weights: list[dict], iteration: int) -> dict:
    """The replicated tree; ``weights`` are the model state dicts left after the user's pre-hooks."""
    return {
        "format": FORMAT,
        "models": weights,
        "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "step": int(accelerator.step),
        "iteration": int(iteration),
    }


def gather_rank(accelerator: Any) -> dict:
    """The per-rank tree of the calling process."""
    active = [d for d in accelerator.gradient_state.dataloader_references if d is not None]
    return {"rank": int(accelerator.process_index), "rng": _rng_state(),
            "dataloaders": [_dataloader_state(dl, active) for dl in accelerator._dataloaders]}


def track_epoch_starts(accelerator: Any) -> None:
    """Note, whenever a dataloader starts an epoch, its sampler generator's state before the epoch
    draws its order (idempotent). Accelerate calls ``GradientState._add_dataloader`` from each
    dataloader's ``begin()``, after synchronizing the generator across ranks and before the sampler
    draws; every dataloader of the process goes through it, ``skip_first_batches``' ones included.
    A save in the middle of an epoch then stores the state the epoch started from, so the resumed
    epoch draws the interrupted one's order (``_dataloader_state``)."""
    cls = type(accelerator.gradient_state)
    # On the class, not the instance: every GradientState shares one __dict__, and a bound method of
    # the first one stored there made pickle.dumps of a later Accelerator rebuild that first one from
    # the half-built dict (its copy lost keys; found by an independent check)
    for name, wrap in (("_add_dataloader", _epoch_starts), ("_remove_dataloader", _epoch_ends)):
        fn = getattr(cls, name, None)
        if fn is not None and not getattr(fn, "_checkrun", False):
            wrapped = wrap(fn)
            wrapped._checkrun = True  # type: ignore[attr-defined]
            setattr(cls, name, wrapped)


#: Prepared dataloaders a load put back inside an epoch (saved mid-epoch): until a copy of one
#: (``skip_first_batches``) finishes that epoch, the original's epoch counter stays at it.
_RESUMED_MID_EPOCH: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _epoch_ends(remove: Any) -> Any:
    """``GradientState._remove_dataloader`` (called as a dataloader's epoch ends) advancing the epoch
    counter of the original of a ``skip_first_batches`` copy that finished the resumed epoch: the copy
    counts it, the original did not, and its next epoch called ``set_epoch`` with the finished epoch
    again (a ``SeedableRandomSampler`` then repeated that epoch's order; ``dataset.set_epoch`` too)."""

    def _remove_dataloader(self: Any, dataloader: Any) -> Any:
        done = getattr(dataloader, "iteration", None)
        for original in list(_RESUMED_MID_EPOCH) if getattr(dataloader, "end_of_dataloader", False) else ():
            if original is not dataloader and isinstance(done, int) and _shares_order(original, dataloader) \
                    and getattr(original, "iteration", done) == done - 1:
                original.iteration = done
                _RESUMED_MID_EPOCH.discard(original)
        return remove(self, dataloader)

    return _remove_dataloader


def _shares_order(a: Any, b: Any) -> bool:
    """Whether two dataloaders draw their order from one sampler generator or seedable sampler, or
    iterate one dataset object (an ``IterableDataset`` dispatched by rank 0: its ``set_epoch``)."""
    dataset = getattr(a, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and dataset is getattr(b, "dataset", None):
        return True
    gen = getattr(a, "synchronized_generator", None)
    if gen is not None and gen is getattr(b, "synchronized_generator", None):
        return True
    sampler = _seedable_sampler(a)
    return sampler is not None and sampler is _seedable_sampler(b)


#: Prepared dataloaders a load put back on the last batch of an epoch: {dataloader: (the generator's state
#: after that epoch drew its order, the next epoch)}, until the next epoch of one of them starts.
_LAST_BATCH: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _after_last_batch(dataloader: Any) -> None:
    """A checkpoint saved on an epoch's last batch is resumed two ways, and both are the uninterrupted run:
    a ``skip_first_batches`` copy goes through that epoch again (skipping all of it: its order is drawn from
    the epoch's start, then the original's counter advances, ``_epoch_ends``), or the dataloader itself
    starts the next epoch (accelerate's examples, whose step count is a multiple of its length): then its
    counter is the next epoch and its generator where the finished epoch left it; so does a copy skipping
    fewer batches than an epoch has (accelerate's examples: ``skip_first_batches(dl, 0)``). Before 2026-12-07
    only the second was right (found by independent checks: the first drew each later epoch's order one
    epoch ahead, the third one epoch behind)."""
    for original, (after, epoch) in list(_LAST_BATCH.items()):
        if original is not dataloader and not _shares_order(original, dataloader):
            continue
        del _LAST_BATCH[original]
        if original is not dataloader and _skipped(dataloader) and _skipped(dataloader) >= _length(original, 0):
            # the finished epoch again, all of it skipped: drawn from its start, as loaded. A copy that yields
            # nothing ends without counting the epoch (accelerate), so the original's counter is set here
            original.iteration = epoch
            _RESUMED_MID_EPOCH.discard(original)
            continue
        # the next epoch: the original itself, or a copy skipping fewer batches than an epoch has (accelerate's
        # examples resume a step count that is a multiple of the length with ``skip_first_batches(dl, 0)``)
        gen = getattr(original, "synchronized_generator", None)
        if isinstance(gen, torch.Generator) and isinstance(after, torch.Tensor):
            gen.set_state(after)
        original.iteration = dataloader.iteration = epoch  # __iter__ calls set_epoch(iteration) after begin()
        if original is dataloader:
            _RESUMED_MID_EPOCH.discard(original)  # (a copy's end advances the original's counter: _epoch_ends)


def _length(dataloader: Any, unknown: int) -> int:
    """``len(dataloader)``, or ``unknown`` (an ``IterableDataset`` without ``__len__``)."""
    try:
        return len(dataloader)
    except TypeError:
        return unknown


def _skipped(dataloader: Any) -> int:
    """The batches a ``skip_first_batches`` copy skips (its own count, or its ``SkipBatchSampler``'s)."""
    for holder in (dataloader, getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None)):
        n = getattr(holder, "skip_batches", None)
        if isinstance(n, int) and n:
            return n
    return 0


def _epoch_starts(add: Any) -> Any:
    """``GradientState._add_dataloader`` noting the dataloader's generator state first."""

    def _add_dataloader(self: Any, dataloader: Any) -> Any:
        _after_last_batch(dataloader)
        gen = getattr(dataloader, "synchronized_generator", None)
        if isinstance(gen, torch.Generator):
            dataloader._checkrun_epoch_start = gen.get_state()
        return add(self, dataloader)

    return _add_dataloader


def model_weights(accelerator: Any, cache: dict | None = None) -> list[dict]:
    """Unwrapped state dicts of the prepared models (what the save pre-hooks receive).

    ``cache`` (owned by the caller, a ``weakref.WeakKeyDictionary``) remembers each prepared model's
    unwrapped module: accelerate's ``unwrap_model`` probes installed packages on every call (~10 ms,
    on the training thread). Weakly, both ways: ``free_memory()``/``clear()`` still release the model."""
    cache = weakref.WeakKeyDictionary() if cache is None else cache
    out = []
    for model in accelerator._models:
        ref = cache.get(model)
        unwrapped = ref() if ref is not None else None
        if unwrapped is None:
            unwrapped = _unwrap(accelerator, model)
            cache[model] = weakref.ref(unwrapped)
        out.append(unwrapped.state_dict())
    return out


def _unwrap(accelerator: Any, model: Any) -> Any:
    """``accelerator.unwrap_model(model)``; where no ``torch.compile`` ran in this process (it imports
    ``torch._dynamo``), only the DDP/DataParallel wrappers, without accelerate's check for a compiled
    module, whose import of ``torch._dynamo`` blocked the first ``save_state()`` for ~0.5 s (accelerate's
    own ``save_state`` does not unwrap)."""
    if "torch._dynamo" in sys.modules:
        return accelerator.unwrap_model(model)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def check_parts(first: Any, mine: Any, where: tuple[str, str]) -> None:
    """Before anything is applied: FormatError naming the part file (``where``: rank 0's part URL,
    this rank's) when a loaded part (``mine``: None when this rank has none) is not what a save
    writes (forged, or damaged before its checksums were computed). The RNG and generator states
    are tried on scratch generators, so one that cannot be restored fails here, not halfway through."""
    counted = ("models", "optimizers", "schedulers", "custom")
    replicated = first.get("replicated") if isinstance(first, dict) else None
    if (not isinstance(replicated, dict) or any(not isinstance(replicated.get(k), list) for k in counted)
            or any(not isinstance(replicated.get(k), int) for k in ("step", "iteration"))
            or not isinstance(replicated.get("scaler", {}), (dict, type(None)))):
        raise FormatError(f"{where[0]}: the replicated state is not what accelerate_ckpt saves "
                          f"(lists {', '.join(counted)} and the step/iteration counters)")
    if mine is None:
        return
    try:
        problem = _rank_problem(mine["rank"])
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise FormatError(f"{where[1]}: invalid RNG/dataloader state: {problem}")


def _rank_problem(rank: dict) -> str | None:
    """What is wrong with a per-rank tree, or None; restoring its states on scratch generators
    raises for states that cannot be restored."""
    rng = rank["rng"]
    random.Random().setstate(rng["python"])
    key = rng["numpy"]["key"]
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or bool(((key < 0) | (key >= 2**32)).any()):
        return "the numpy key is not 32-bit words"  # astype(uint32) would wrap silently
    np.random.RandomState().set_state(_numpy_state(rng["numpy"]))
    torch.Generator().set_state(rng["torch"])
    for st in rank["dataloaders"]:
        if not isinstance(st["iteration"], int) or not all(isinstance(st["sampler"][k], int) for k in (
                "epoch", "initial_seed") if "sampler" in st):
            return f"dataloader counters {st!r}"[:200]
        if "generator" in st:
            torch.Generator().set_state(st["generator"])
    return None


def apply_replicated(accelerator: Any, tree: dict, models: list, model_kwargs: dict) -> None:
    """Load the replicated tree into the Accelerator's objects (``models``: left after pre-hooks)."""
    _check_counts(accelerator, tree, models)
    for model, weights in zip(models, tree["models"]):
        accelerator.unwrap_model(model).load_state_dict(weights, **model_kwargs)
    for opt, st in zip(accelerator._optimizers, tree["optimizers"]):
        opt.load_state_dict(st)
    for sched, st in zip(accelerator._schedulers, tree["schedulers"]):
        sched.load_state_dict(st)
    if accelerator.scaler is not None and tree.get("scaler") is not None:
        accelerator.scaler.load_state_dict(tree["scaler"])
    for obj, st in zip(accelerator._custom_objects, tree["custom"]):
        obj.load_state_dict(st)
    accelerator.step = int(tree["step"])
    pc = accelerator.project_configuration  # never back: an iteration set or reached in this process stays
    pc.iteration = max(int(tree["iteration"]), int(pc.iteration))


def apply_rank(accelerator: Any, tree: dict) -> None:
    """Restore the per-rank tree (RNG streams and dataloader positions) of the calling process."""
    _set_rng_state(tree["rng"])
    for dl, st in zip(accelerator._dataloaders, tree["dataloaders"]):
        _load_dataloader_state(dl, st)


def _check_counts(accelerator: Any, tree: dict, models: list) -> None:
    have = {"models": len(models), "optimizers": len(accelerator._optimizers),
            "schedulers": len(accelerator._schedulers), "custom": len(accelerator._custom_objects)}
    wrong = {k: (len(tree[k]), n) for k, n in have.items() if len(tree[k]) != n}
    if wrong:
        detail = ", ".join(f"{k}: checkpoint has {a}, accelerator has {b}" for k, (a, b) in wrong.items())
        raise RuntimeError(f"checkpoint does not match the prepared objects ({detail}); prepare and "
                           "register the same objects, in the same order, as the run that saved it")


# -- RNG ------------------------------------------------------------------------------------------
def _device_rng() -> tuple[str | None, Any]:
    """The accelerator device's RNG module (``torch.cuda`` ...), as accelerate picks it."""
    try:
        from accelerate.utils import get_torch_accelerator_backend
    except ImportError:  # older accelerate
        return ("cuda", torch.cuda) if torch.cuda.is_available() else (None, None)
    device_type, module = get_torch_accelerator_backend()
    if device_type is not None and module is getattr(torch, "accelerator", None):
        module = torch.get_device_module(device_type)
    return device_type, module


def _rng_state() -> dict:
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # The key as an int64 tensor: numpy arrays would need pickle (not weights_only-safe).
        "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    device_type, module = _device_rng()
    if device_type is not None:
        getter = getattr(module, "get_rng_state_all", None)
        state["device"] = {"type": device_type,
                           "states": getter() if getter else [module.get_rng_state()]}
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    device = state.get("device")
    device_type, module = _device_rng()
    if device is not None and device_type == device["type"]:
        restore_device_states(module, device_type, device["states"])


def _numpy_state(st: dict) -> tuple:
    return (st["name"], st["key"].numpy().astype(np.uint32), st["pos"], st["has_gauss"], st["gauss"])


def restore_device_states(module: Any, device_type: str, states: list) -> None:
    """Set the RNG state of each visible device from ``states`` (one per device of the run that
    saved them); states of devices not visible now are skipped with a warning, not an
    "invalid device ordinal" (a resume with fewer GPUs)."""
    count = _device_count(module, len(states))
    for index, st in enumerate(states[:count]):
        module.set_rng_state(st, index)
    if len(states) > count:
        warnings.warn(f"the checkpoint holds RNG states of {len(states)} {device_type} device(s) and "
                      f"{count} are visible: restored the first {count}, the others are not used",
                      RuntimeWarning, stacklevel=3)


def _device_count(module: Any, default: int) -> int:
    count = getattr(module, "device_count", None)
    try:
        return int(count()) if count is not None else default
    except Exception:  # noqa: BLE001 - a backend that cannot say: assume all are there
        return default


# -- dataloaders ----------------------------------------------------------------------------------
def _seedable_sampler(dl: Any) -> Any:
    try:
        from accelerate.data_loader import SeedableRandomSampler
    except ImportError:  # pragma: no cover - older accelerate
        return None
    sampler = dl.get_sampler() if hasattr(dl, "get_sampler") else None
    inner = getattr(dl, "batch_sampler", None)
    for _ in range(8):  # a skip_first_batches copy: SkipBatchSampler(batch_sampler) around the original's
        if isinstance(sampler, SeedableRandomSampler) or inner is None:
            break
        sampler, inner = getattr(inner, "sampler", None), getattr(inner, "batch_sampler", None)
    return sampler if isinstance(sampler, SeedableRandomSampler) else None


def _dataloader_state(dl: Any, active: list) -> dict:
    """Epoch counter, sampler generator and stateful-dataloader state of one prepared dataloader.
    ``active``: the dataloaders iterating now. While one of them that draws from the same generator
    (``dl`` itself, or its ``skip_first_batches`` copy) is inside an epoch, the generator's state from
    that epoch's start (``track_epoch_starts``); else its state now, which the next epoch draws from."""
    state: dict = {"iteration": int(getattr(dl, "iteration", 0))}
    inside = [a for a in active if _shares_order(dl, a)]  # an epoch's dataloaders leave ``active`` as it ends
    if inside:
        state["in_epoch"] = True  # saved inside epoch ``iteration`` (read by _epoch_ends after a load)
        if all(getattr(a, "end_of_dataloader", False) for a in inside):
            state["last_batch"] = True  # accelerate reads a batch ahead: on the last one it says the end
    gen = getattr(dl, "synchronized_generator", None)
    if isinstance(gen, torch.Generator):
        start = next((getattr(a, "_checkrun_epoch_start", None) for a in inside
                      if getattr(a, "synchronized_generator", None) is gen), None)
        state["generator"] = start if start is not None else gen.get_state()
        if state.get("last_batch"):
            state["generator_next"] = gen.get_state()  # what the next epoch draws from (``_after_last_batch``)
    sampler = _seedable_sampler(dl)
    if sampler is not None:
        state["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(dl, "use_stateful_dataloader", False):
        state["stateful"] = dl.state_dict()
    return state


def _load_dataloader_state(dl: Any, state: dict) -> None:
    if hasattr(dl, "set_epoch"):
        dl.set_epoch(state["iteration"])
    elif hasattr(dl, "iteration"):
        dl.iteration = state["iteration"]
    if state.get("in_epoch") is True:
        _RESUMED_MID_EPOCH.add(dl)
    else:
        _RESUMED_MID_EPOCH.discard(dl)
    if state.get("last_batch") is True:
        _LAST_BATCH[dl] = (state.get("generator_next"), state["iteration"] + 1)
    else:
        _LAST_BATCH.pop(dl, None)
    gen = getattr(dl, "synchronized_generator", None)
    if isinstance(gen, torch.Generator) and "generator" in state:
        gen.set_state(state["generator"])
    sampler = _seedable_sampler(dl)
    if sampler is not None and "sampler" in state:
        sampler.epoch = state["sampler"]["epoch"]
        sampler.initial_seed = state["sampler"]["initial_seed"]
    if "stateful" in state and getattr(dl, "use_stateful_dataloader", False):
        dl.load_state_dict(state["stateful"])
