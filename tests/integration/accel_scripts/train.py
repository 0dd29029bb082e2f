"""Training script launched by tests/integration/test_accelerate.py with a real ``accelerate launch``.

Two models, one AdamW over both, a LR scheduler, a registered custom object, a shuffled prepared
DataLoader, gradient accumulation (so ``accelerator.step`` counts), and noise drawn from python
``random``, numpy and torch every batch (so every RNG stream matters for the result).

Run 1 (``--save-epochs 1,2 --epochs 4``): saves with ``accelerator.save_state()`` after epochs 1 and
2, keeps training to epoch 4 without saving, dumps its final state: the uninterrupted reference.
Run 2 (``--resume``): ``accelerator.load_state()`` (newest committed), trains the remaining epochs,
dumps its final state; the test compares both dumps bit for bit, per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration
from torch import nn

from accelerate_ckpt import AcceleratorCheckpointer
from accelerate_ckpt.config import as_plain


class Progress:
    """The registered custom object: epoch counter and loss history."""

    def __init__(self) -> None:
        self.epoch = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.losses = state["epoch"], list(state["losses"])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--out", required=True, help="directory for final_rank{r}.pt and report.json")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--save-epochs", default="", help="comma-separated epochs after which to save")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--config", default=None, help="YAML for AcceleratorCheckpointer (else $CHECKRUN_CONFIG)")
    p.add_argument("--storage-options", default=None, help="JSON fsspec storage options")
    return p.parse_args()


def build(args: argparse.Namespace):
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False),
    )
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model_a, model_b = nn.Linear(8, 16), nn.Linear(16, 1)
    opt = torch.optim.AdamW(list(model_a.parameters()) + list(model_b.parameters()), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model_a, model_b, opt, sched, loader = accelerator.prepare(model_a, model_b, opt, sched, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    return accelerator, (model_a, model_b), opt, sched, loader, progress


def train_epoch(accelerator, models, opt, sched, loader, progress) -> None:
    model_a, model_b = models
    for x, y in loader:
        with accelerator.accumulate(model_a, model_b):
            noise = torch.randn_like(x) * 0.01 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = nn.functional.mse_loss(model_b(torch.relu(model_a(x + noise))), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        # registered objects are replicated state (saved from rank 0): keep them equal on all ranks
        progress.losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    progress.epoch += 1


def dump(accelerator, models, opt, sched, loader, progress, out: str) -> None:
    unwrap = accelerator.unwrap_model
    gen = getattr(loader, "synchronized_generator", None)
    state = {
        "models": [{k: v.clone() for k, v in unwrap(m).state_dict().items()} for m in models],
        "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "progress": progress.state_dict(),
        "python_rng": random.getstate(), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(),
        "step": accelerator.step, "iteration": accelerator.save_iteration,
        "loader_iteration": loader.iteration, "loader_generator": gen.get_state() if gen is not None else None,
    }
    torch.save(state, os.path.join(out, f"final_rank{accelerator.process_index}.pt"))


def main() -> int:
    args = parse()
    accelerator, models, opt, sched, loader, progress = build(args)
    options = json.loads(args.storage_options) if args.storage_options else None
    ckpt = AcceleratorCheckpointer(accelerator, args.config, storage_options=options).attach()
    loaded = accelerator.load_state() if args.resume else None
    saves = {int(e) for e in args.save_epochs.split(",") if e}
    saved = []
    while progress.epoch < args.epochs:
        train_epoch(accelerator, models, opt, sched, loader, progress)
        if progress.epoch in saves:
            saved.append(accelerator.save_state())
    dump(accelerator, models, opt, sched, loader, progress, args.out)
    accelerator.end_training()  # flushes pending checkpoints (attach wraps it), restores the methods
    assert not ckpt.attached and ckpt._group.pending == 0
    if accelerator.is_main_process:
        report = {"saved": saved, "loaded": loaded, "config_source": ckpt.config_source,
                  "config": as_plain(ckpt.config, ckpt.options), "history": ckpt.history,
                  "num_processes": accelerator.num_processes,
                  "distributed_type": str(accelerator.distributed_type)}
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
