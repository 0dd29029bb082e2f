"""Accelerate's own checkpoint habits, unchanged, launched by tests/integration/test_accelerate_dropin.py.

The script is what an Accelerate user writes: ``automatic_checkpoint_naming`` with ``total_limit``, a
DataLoader with worker processes, ``save_state()``, ``load_state(<the folder accelerate names>)``
(absolute, then relative), ``load_state()`` with no argument. ``--native`` runs it with accelerate's
own saving; without it, checkrun is attached (the one added line). Each rank writes
``report_rank{R}.json``: the paths ``save_state`` returned, whether each folder existed right after the
call, whether every load restored exactly the weights saved there, and the listing of the
checkpoints directory at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--native", action="store_true", help="accelerate's own save_state/load_state")
    p.add_argument("--resume", action="store_true", help="only load_state() the newest and report it")
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--total-limit", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args()


def weights(accelerator: Accelerator, model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    args = parse()
    project = os.path.abspath(args.project_dir)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=args.total_limit))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=args.workers)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if not args.native:
        from accelerate_ckpt import attach

        attach(accelerator)  # the one line a checkrun user adds
    report: dict = {"rank": accelerator.process_index, "world": accelerator.num_processes}
    if args.resume:
        accelerator.load_state()
        report["resumed_weights"] = {k: v.tolist() for k, v in weights(accelerator, model).items()}
    else:
        report.update(run(args, accelerator, model, opt, loader, project))
    accelerator.end_training()
    checkpoints = os.path.join(project, "checkpoints")
    report["listing"] = sorted(os.listdir(checkpoints))
    report["final_weights"] = {k: v.tolist() for k, v in weights(accelerator, model).items()}
    with open(os.path.join(args.out, f"report_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    return 0


def run(args, accelerator, model, opt, loader, project: str) -> dict:
    saved, existed, types, snaps = [], [], [], {}
    for _ in range(args.saves):
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
        snap = weights(accelerator, model)
        returned = accelerator.save_state()
        types.append(type(returned).__name__)
        path = str(returned)
        existed.append(os.path.isdir(path))  # right after the call, as accelerate leaves it
        saved.append(path)
        snaps[path] = snap
    loads = {}
    accelerator.wait_for_everyone()  # accelerate's own save_state needs it before another rank reads
    accelerator.load_state(saved[-1])  # absolute, straight after save_state: waits for the commit
    loads["absolute"] = same(weights(accelerator, model), snaps[saved[-1]])
    os.chdir(project)
    accelerator.load_state(os.path.join("checkpoints", os.path.basename(saved[-2])))  # relative
    loads["relative"] = same(weights(accelerator, model), snaps[saved[-2]])
    accelerator.load_state()  # no argument: the newest
    loads["newest"] = same(weights(accelerator, model), snaps[saved[-1]])
    return {"saved": saved, "existed": existed, "types": types, "loads": loads}


if __name__ == "__main__":
    sys.exit(main())
