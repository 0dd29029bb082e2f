"""Sharded Accelerate state (FSDP ``SHARDED_STATE_DICT``, FSDP2) as checkrun DCP checkpoints.

Accelerate's FSDP ``save_state`` writes sharded state with ``torch.distributed.checkpoint`` and a
``FileSystemWriter`` it builds itself, with no hook to change the writer; ``AcceleratorCheckpointer``
therefore leaves FSDP to accelerate. These two helpers are the checkrun way for sharded models: call
them on every process instead of ``save_state``/``load_state``::

    from accelerate_ckpt.dcp import save_sharded_state, load_sharded_state

    save_sharded_state(accelerator, f"s3://bucket/run/step={step}.dcp", storage_options=opts)
    ...
    load_sharded_state(accelerator, "s3://bucket/run/step=1000.dcp", storage_options=opts)

What is saved (one checkrun DCP checkpoint: one manifest + shared blobs): every model's sharded state
dict and every optimizer's (``torch.distributed.checkpoint.state_dict``: FSDP1, FSDP2/DTensor, DDP and
plain modules), every scheduler's and ``register_for_checkpointing`` object's ``state_dict()``,
``accelerator.step``, and each rank's RNG states (python, numpy, torch CPU and CUDA when available).
Loading works with another world size (DCP reshards); RNG states are restored only for ranks that
saved them. Models/optimizers/schedulers default to the ones ``accelerator.prepare`` returned; pass
them explicitly for modules sharded outside ``prepare``.
"""
from __future__ import annotations

import os
import random
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from ckpt_core import dcp as cdcp

from .state import restore_device_states

__all__ = ["save_sharded_state", "load_sharded_state"]


def _owner(optimizer: Any, models: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """The model whose parameters the optimizer updates (get/set_optimizer_state_dict need it)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wrapper
    ids = {id(p) for group in opt.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in ids for p in model.parameters()):
            return model
    raise ValueError("an optimizer updates none of the models' parameters; pass models= and optimizers=")


def _parts(accelerator: Any, models, optimizers, schedulers) -> tuple[list, list, list]:
    models = list(accelerator._models if models is None else models)
    optimizers = list(accelerator._optimizers if optimizers is None else optimizers)
    schedulers = list(accelerator._schedulers if schedulers is None else schedulers)
    return models, [getattr(o, "optimizer", o) for o in optimizers], schedulers


def _rng_state() -> dict:
    """RNG states as tensors and plain data (loadable with ``weights_only=True``, no numpy pickles)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (str(name), torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    name, key, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        restore_device_states(torch.cuda, "cuda", rng["cuda"])  # fewer GPUs now: the rest warned about


def save_sharded_state(accelerator: Any, path: str | os.PathLike, *, models: Optional[Sequence] = None,
                       optimizers: Optional[Sequence] = None, schedulers: Optional[Sequence] = None,
                       config: Any = None, storage_options: Optional[dict] = None, spread_replicated: bool = True,
                       asynchronous: bool = False) -> Any:
    """Save the accelerator's (sharded) training state to the checkrun DCP checkpoint ``path``.

    Call on every process. Returns ``DcpSaveInfo`` on the main process (None elsewhere) or, with
    ``asynchronous=True``, a Future that completes when the checkpoint is committed (the state is
    copied to CPU before this returns)."""
    models, optimizers, schedulers = _parts(accelerator, models, optimizers, schedulers)
    options = StateDictOptions(cpu_offload=asynchronous)
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = get_model_state_dict(model, options=options)
    for j, opt in enumerate(optimizers):
        state[f"optimizer_{j}"] = get_optimizer_state_dict(_owner(opt, models), opt, options=options)
    # tuples are leaves for DCP: each of these is stored as one value, exactly as given
    for k, sched in enumerate(schedulers):
        state[f"scheduler_{k}"] = (sched.state_dict(),)
    for n, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        state[f"custom_{n}"] = (obj.state_dict(),)
    state["accelerator"] = ({"step": int(getattr(accelerator, "step", 0))},)
    state[f"rng_{accelerator.process_index}"] = (_rng_state(),)  # per rank: not deduplicated
    kwargs = dict(config=config, storage_options=storage_options, spread_replicated=spread_replicated)
    if asynchronous:
        return cdcp.async_save(state, path, **kwargs)
    return cdcp.save(state, path, **kwargs)


def load_sharded_state(accelerator: Any, path: str | os.PathLike, *, models: Optional[Sequence] = None,
                       optimizers: Optional[Sequence] = None, schedulers: Optional[Sequence] = None,
                       config: Any = None, storage_options: Optional[dict] = None, weights_only: bool = True,
                       load_rng: bool = True) -> None:
    """Restore what :func:`save_sharded_state` saved, in place; call on every process (any world size).

    ``weights_only=True`` loads non-tensor values with torch's restricted unpickler (allow more types
    with the config's ``load.allowed_globals``)."""
    models, optimizers, schedulers = _parts(accelerator, models, optimizers, schedulers)
    kwargs = dict(config=config, storage_options=storage_options, weights_only=weights_only)
    for i, model in enumerate(models):
        sd = {f"model_{i}": get_model_state_dict(model)}
        cdcp.load(sd, path, **kwargs)
        set_model_state_dict(model, sd[f"model_{i}"])
    for j, opt in enumerate(optimizers):
        owner = _owner(opt, models)
        osd = {f"optimizer_{j}": get_optimizer_state_dict(owner, opt)}
        cdcp.load(osd, path, **kwargs)
        set_optimizer_state_dict(owner, opt, optim_state_dict=osd[f"optimizer_{j}"])
    values: dict[str, Any] = {f"scheduler_{k}": None for k in range(len(schedulers))}
    values.update({f"custom_{n}": None for n in range(len(getattr(accelerator, "_custom_objects", [])))})
    values["accelerator"] = None
    rng_key = f"rng_{accelerator.process_index}"
    if load_rng:
        values[rng_key] = None
    cdcp.load(values, path, allow_partial_load=True, **kwargs)
    for k, sched in enumerate(schedulers):
        sched.load_state_dict(values[f"scheduler_{k}"][0])
    for n, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        obj.load_state_dict(values[f"custom_{n}"][0])
    if values["accelerator"] is not None:
        accelerator.step = values["accelerator"][0]["step"]
    if load_rng and values.get(rng_key) is not None:
        _set_rng_state(values[rng_key][0])
