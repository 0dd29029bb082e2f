"""A script that ends right after ``save_state()``: no ``wait_for_everyone()``, ``end_training()`` or
``close()``, as accelerate's examples and many users' scripts end. Launched by
tests/integration/test_accelerate_dropin.py (1 and 2 processes).

Rank 0 writes ``weights.pt`` (the weights at the save) before calling ``save_state(folder)``; the
checkpoint (16 MiB of weights, so its part is still being written when the script ends) must be
committed by the time the processes have exited.
"""
from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_ckpt import AcceleratorCheckpointer

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
model, opt = accelerator.prepare(model, opt)
AcceleratorCheckpointer(accelerator).attach()
accelerator.backward(model(torch.randn(4, 2048)).square().mean())
opt.step()
opt.zero_grad()
if accelerator.is_main_process:
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               f"{sys.argv[2]}/weights.pt")
accelerator.save_state(sys.argv[1])
