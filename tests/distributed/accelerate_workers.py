"""Per-rank body of the Accelerate test: a real multi-process ``Accelerator`` (MULTI_CPU, gloo) with an
FSDP2-sharded model. Accelerate enables its own FSDP only on GPUs, so the model is sharded with
``fully_shard`` on a CPU mesh and passed to the helpers explicitly (on GPUs they default to the
prepared models)."""
from __future__ import annotations

import random

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from accelerate_ckpt.dcp import load_sharded_state, save_sharded_state


def _model(seed: int, mesh) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _snapshot(model, opt, sched, accelerator) -> dict:
    return {"params": [p.full_tensor().reshape(-1).tolist() for p in model.parameters()],
            "moments": [opt.state[p]["exp_avg"].full_tensor().reshape(-1).tolist() for p in model.parameters()],
            "lr": sched.get_last_lr(), "step": accelerator.step, "rand": random.random()}


def save_then_load(rank: int, world: int, path: str) -> dict:
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world and accelerator.distributed_type == "MULTI_CPU"
    mesh = init_device_mesh("cpu", (world,))
    model = _model(0, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step(), opt.zero_grad(), sched.step()
    accelerator.step = 2
    parts = dict(models=[model], optimizers=[opt], schedulers=[sched])
    random.seed(123 + rank)
    save_sharded_state(accelerator, path, **parts)
    saved = _snapshot(model, opt, sched, accelerator)
    model2 = _model(1, mesh)  # other weights, a fresh optimizer and scheduler, other RNG state
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    model2(torch.randn(8, 16)).sum().backward()
    opt2.step()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    accelerator.step = 0
    random.seed(999)
    load_sharded_state(accelerator, path, models=[model2], optimizers=[opt2], schedulers=[sched2])
    return {"saved": saved, "loaded": _snapshot(model2, opt2, sched2, accelerator)}
