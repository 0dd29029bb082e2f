"""Train with Hugging Face Accelerate; checkpoints go through checkrun (async, incremental, any fsspec URL).

The training loop is plain Accelerate: it calls ``accelerator.save_state()`` / ``accelerator.load_state()``.
The only checkrun line is ``AcceleratorCheckpointer(accelerator).attach()``. Settings come from YAML,
either way:

(a) one file, accelerate's config plus a ``checkpointing:`` section::

        accelerate-ckpt launch --config_file examples/accelerate_config.yaml examples/accelerate_train.py

(b) a separate checkrun file named by $CHECKRUN_CONFIG, with plain ``accelerate launch``::

        CHECKRUN_CONFIG=examples/accelerate_checkrun.yaml accelerate launch examples/accelerate_train.py

Run it again and it resumes from the newest committed checkpoint. Two CPU processes:
``accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu``.
"""
from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn

from accelerate_ckpt import AcceleratorCheckpointer
from ckpt_core.units import fmt_bytes


class Model(nn.Module):
    """An embedding table (few rows change per step: incremental saves pay) and an MLP."""

    def __init__(self, rows: int = 4096, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(idx)).squeeze(-1)


class Progress:
    """Registered for checkpointing: the global step survives a restart."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--project-dir", default="runs/accelerate_example")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="force CPU (e.g. two gloo processes without GPUs)")
    args = p.parse_args()

    accelerator = Accelerator(cpu=args.cpu, project_config=ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    ckpt = AcceleratorCheckpointer(accelerator).attach()   # the one checkrun line
    resumed = None
    if ckpt.latest() is not None:
        resumed = accelerator.load_state()                 # newest committed checkpoint

    saved = []
    while progress.step < args.steps:
        idx = torch.randint(0, 4096, (256,), device=accelerator.device)
        loss = nn.functional.binary_cross_entropy_with_logits(model(idx), (idx % 7 == 0).float())
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        if progress.step % args.save_every == 0:
            saved.append(str(accelerator.save_state()))     # returns after the in-memory snapshot
    accelerator.end_training()                              # waits until every checkpoint is committed

    for m in ckpt.history:
        accelerator.print(f"{m['checkrun/checkpoint']}: blocked {m['checkrun/blocking_seconds'] * 1e3:.1f} ms, "
                          f"wrote {fmt_bytes(m['checkrun/written_bytes'])} of "
                          f"{fmt_bytes(m['checkrun/tensor_bytes'])} of tensors, references "
                          f"{fmt_bytes(m['checkrun/stored_bytes'])}")
    accelerator.print("RESULT " + json.dumps({"resumed": resumed, "saved": saved, "step": progress.step,
                                              "config": ckpt.config_source,
                                              "keep_last": ckpt.config.retention.keep_last}))


if __name__ == "__main__":
    main()
