"""``accelerate launch`` script of test_steplog_accelerate: training with ``step_log.enabled``.

    train  --project P --progress F --kind K   save_state every 7 steps (then ``committed N``), and
                                               ``ckpt.step_log.flush()`` every 5 steps (rank 0; then
                                               ``flushed N``: step N is in the log for good), else
                                               ``step N``: rank 0 appends the line to F and prints it
                                               after each step; runs until killed
    resume --project P --out O --kind K        load_state() (checkpoint + replay), then an uninterrupted
                                               run's state at the resumed step, built the same way;
                                               each rank torch.saves both to O/rank{r}.pt

Every rank draws the same batch at each step (tests.core.steplog_train.batch), so DDP's averaged
gradients are the single-process ones and the comparison is exact on every rank.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from accelerate_ckpt import AcceleratorCheckpointer
from tests.core.steplog_train import batch, make

CKPT_EVERY, FLUSH_EVERY = 7, 5
CONFIG = {"step_log": {"enabled": True, "flush_every_steps": 3},
          "saving": {"sigterm_grace_seconds": None}}


def _prepared(acc: Accelerator, kind: str) -> tuple:
    net, opt, sched = make(kind)
    return acc.prepare(net, opt, sched)


def _step(acc: Accelerator, net, opt, sched, step: int) -> None:
    ids, y = batch(step)
    opt.zero_grad()
    acc.backward(torch.nn.functional.mse_loss(net(ids), y))
    acc.clip_grad_norm_(net.parameters(), 0.5)
    opt.step()
    sched.step()


def _state(acc: Accelerator, net, opt, sched) -> dict:
    return {"model": acc.unwrap_model(net).state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def train(args: argparse.Namespace) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(args.project, automatic_checkpoint_naming=True))
    net, opt, sched = _prepared(acc, args.kind)
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    progress = open(args.progress, "a") if acc.is_main_process else None
    for step in range(1, 100_000):
        _step(acc, net, opt, sched, step)
        line = f"step {step}"
        if step % CKPT_EVERY == 0:
            acc.save_state()
            ckpt.wait()  # so the test knows a checkpoint to resume from exists
            line = f"committed {step}"
        if step % FLUSH_EVERY == 0 and ckpt.step_log is not None:
            ckpt.step_log.flush()
            line = f"flushed {step}"
        if progress is not None:
            progress.write(line + "\n")
            progress.flush()
            print(line, flush=True)


def resume(args: argparse.Namespace) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(args.project, automatic_checkpoint_naming=True))
    net, opt, sched = _prepared(acc, args.kind)
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    folder = acc.load_state()
    resumed, steps, replayed = _state(acc, net, opt, sched), ckpt.optimizer_steps, ckpt.replayed_steps
    ckpt.close()
    ref_net, ref_opt, ref_sched = _prepared(acc, args.kind)  # uninterrupted, the same wrappers and kernels
    for step in range(1, steps + 1):
        _step(acc, ref_net, ref_opt, ref_sched, step)
    torch.save({"resumed": resumed, "reference": _state(acc, ref_net, ref_opt, ref_sched), "steps": steps,
                "replayed": replayed, "folder": str(folder), "world": acc.num_processes},
               Path(args.out) / f"rank{acc.process_index}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)  # the same kernels in every process: bit-exact comparisons across them
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume"])
    parser.add_argument("--project", required=True)
    parser.add_argument("--kind", default="adam")
    parser.add_argument("--progress")
    parser.add_argument("--out")
    a = parser.parse_args()
    os.makedirs(a.project, exist_ok=True)
    (train if a.mode == "train" else resume)(a)
