"""``save_state()`` on the main process only, as diffusers' training scripts do, launched by
tests/integration/test_accelerate_dropin.py with 2 processes.

``save``: DDP training where only ``accelerator.is_main_process`` calls ``save_state(folder)``; rank 0
writes ``report.pt`` with the weights at each save. ``resume``: every rank loads the last folder and
writes ``resumed_rank{R}.pt``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_ckpt import attach


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    attach(accelerator, {"accelerate": {"participation_timeout_seconds": 2}})
    weights = lambda: {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}  # noqa: E731
    if args.phase == "resume":
        accelerator.load_state(os.path.join(args.out, "step5"))
        torch.save(weights(), os.path.join(args.out, f"resumed_rank{accelerator.process_index}.pt"))
    else:
        saved = {}
        g = torch.Generator().manual_seed(accelerator.process_index)
        for step in range(6):
            accelerator.backward(model(torch.randn(4, 4, generator=g)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if step % 2 == 1 and accelerator.is_main_process:
                accelerator.save_state(os.path.join(args.out, f"step{step}"))
                saved[f"step{step}"] = weights()
        if accelerator.is_main_process:
            torch.save(saved, os.path.join(args.out, "report.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
