"""``save_state()`` on the main process only, as diffusers' training scripts do, launched by
tests/integration/test_accelerate_dropin.py with 2 processes.

``save``: DDP training where only ``accelerator.is_main_process`` calls ``save_state(folder)``; rank 0
writes ``report.pt`` with the weights at each save. ``resume``: every rank loads the last folder and
writes ``resumed_rank{R}.pt``. ``hookfail``: every rank saves ``good``, ``bad1`` (its save hook raises
on rank 1) and ``bad0`` (raises on rank 0), and waits after each; each rank writes
``hookfail_rank{R}.json`` (what raised, what ``wait()`` raised). ``perrank``: each rank saves into a
folder of its own (as accelerate's own test_stateful_dataloader_save_state does) and writes
``perrank_rank{R}.json`` (what ``load_state`` of it raised). ``mainthenall``: rank 0 saves ``s1`` alone, then
every rank saves ``s2`` and loads it; each rank writes ``mainthenall_rank{R}.json`` (what raised, if anything).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch import nn

from accelerate_ckpt import attach
from ckpt_core import BackgroundSaveError


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "resume", "hookfail", "perrank", "mainthenall"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    # main-only saves wait out the window (rank 1 never saves): short; hookfail: ranks that all save,
    # whose announcements must not depend on the window (a loaded machine could be 2 s late)
    window = {"hookfail": 10, "perrank": 10, "mainthenall": 5}.get(args.phase, 2)
    ckpt = attach(accelerator, {"accelerate": {"participation_timeout_seconds": window,
                                               "collective_timeout_seconds": 30}})
    weights = lambda: {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}  # noqa: E731
    if args.phase == "hookfail":
        def hook(models, weights, folder) -> None:
            if folder.endswith(f"bad{accelerator.process_index}"):
                raise RuntimeError(f"hook failed on rank {accelerator.process_index}")
        accelerator.register_save_state_pre_hook(hook)
        report = {"raised": [], "wait": []}
        for name in ("good", "bad1", "bad0"):
            try:
                accelerator.save_state(os.path.join(args.out, name))
            except RuntimeError as exc:
                report["raised"].append(f"{name}: {exc}")
            try:
                ckpt.wait()
            except BackgroundSaveError as exc:
                report["wait"].append(f"{name}: {exc}")
        with open(os.path.join(args.out, f"hookfail_rank{accelerator.process_index}.json"), "w") as f:
            json.dump(report, f)
    elif args.phase == "perrank":
        folder = os.path.join(args.out, f"rank{accelerator.process_index}")
        accelerator.save_state(folder)
        try:
            accelerator.load_state(folder)
            error = None
        except Exception as exc:  # noqa: BLE001 - rank 1: the verdict; rank 0: its peer left the broadcast
            error = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(args.out, f"perrank_rank{accelerator.process_index}.json"), "w") as f:
            json.dump({"load": error}, f)
        os._exit(0)  # the ranks left the collective at different points: no orderly shutdown
    elif args.phase == "mainthenall":
        error = None
        try:
            if accelerator.is_main_process:
                accelerator.save_state(os.path.join(args.out, "s1"))
            accelerator.wait_for_everyone()
            accelerator.save_state(os.path.join(args.out, "s2"))
            ckpt.wait()
            accelerator.load_state(os.path.join(args.out, "s2"))
        except Exception as exc:  # noqa: BLE001 - reported, checked by the test
            error = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(args.out, f"mainthenall_rank{accelerator.process_index}.json"), "w") as f:
            json.dump({"error": error}, f)
    elif args.phase == "resume":
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
