"""A short training run with the per-step update log on (docs/steplog.md), for the ``checkrun`` examples
of docs/cli.md: ``checkrun ls`` / ``verify`` / ``inspect`` / ``export --step`` on what it leaves.

Run: ``python examples/steplog_demo.py DIR [--steps N] [--checkpoint-every K]``. It trains a tiny
model (an embedding table and a linear layer, Adam built from ``named_parameters()`` so that the
checkpoint records its parameter names, a StepLR scheduler) for N steps, logs every step into DIR's
step log (a segment per 8 steps) and saves a checkpoint every K steps. The steps after the last
checkpoint exist only in the log: ``checkrun export DIR OUT --step N --optimizer Adam`` rebuilds them.
"""
from __future__ import annotations

import argparse

import torch

from ckpt_core import CheckpointEngine


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The model, its optimizer and scheduler, seeded: every run starts from the same state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 16), torch.nn.Flatten(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.named_parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    return model, opt, sched


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, step: int) -> None:
    """One step on batch ``step`` (the batch is a function of the step: a rerun sees the same data)."""
    g = torch.Generator().manual_seed(step)
    ids, y = torch.randint(0, 1000, (32, 4), generator=g), torch.randn(32, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(ids), y).backward()
    opt.step()
    sched.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()
    model, opt, sched = make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 8}}) as engine:
        log = engine.step_log(args.directory, opt, sched)
        for step in range(1, args.steps + 1):
            train_step(model, opt, sched, step)
            if step % args.checkpoint_every == 0:
                engine.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                            f"{args.directory}/step{step}.ckpt")
        log.close()
    print(f"trained {args.steps} steps into {args.directory}")


if __name__ == "__main__":
    main()
