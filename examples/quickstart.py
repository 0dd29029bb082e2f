"""Quickstart: a short plain-PyTorch training run that checkpoints through checkrun, then resumes.

Run: ``python examples/quickstart.py [--dir DIR]`` with checkrun installed (README.md, "Install";
``bash .ci/setup`` makes the project's .venv). No CI job runs this file as a program: the main job,
``bash .ci/main``, runs ``examples/lightning_train.py``, and the test suite runs this one
(tests/integration/test_quickstart.py).

It trains a small model with an embedding table for a few steps, saves every few steps
asynchronously (incremental: only changed rows/chunks are written), simulates a restart by loading
the latest checkpoint into fresh objects, checks the resume is exact, and prints what was saved.
Without ``--dir`` the checkpoints go to a temporary folder that is removed at the end; every folder it
creates for itself (also the uninterrupted reference run's) is removed, even on an error.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile

import torch
from torch import nn

import ckpt_core
from ckpt_core.units import fmt_bytes


class Model(nn.Module):
    def __init__(self, rows: int = 20000, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(idx)).squeeze(-1)


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    return model, opt


def train_steps(model, opt, start: int, stop: int, engine, directory: str, every: int) -> list:
    infos = []
    gen = torch.Generator().manual_seed(1234)
    for step in range(stop):
        idx = torch.randint(0, 20000, (256,), generator=gen)  # consume the stream identically
        if step < start:
            continue
        y = (idx % 7 == 0).float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(idx), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}
            infos.append(engine.save(state, f"{directory}/step={step + 1}.ckpt"))
    return infos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None,
                        help="checkpoint directory or fsspec URL (default: a temporary folder, removed at the end)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with contextlib.ExitStack() as temporary:  # the folders made here are removed, also on an error
        run(args, temporary)


def run(args: argparse.Namespace, temporary: contextlib.ExitStack) -> None:
    directory = args.dir or temporary.enter_context(tempfile.TemporaryDirectory(prefix="checkrun-quickstart-"))
    config = ckpt_core.EngineConfig.from_dict({"retention": {"keep_last": 3},
                                               "incremental": {"row_delta_min_rows": 1024}})
    half = args.steps // 2

    with ckpt_core.CheckpointEngine(config) as engine:
        model, opt = make()
        handles = train_steps(model, opt, 0, half, engine, directory, args.every)
        engine.wait()
        print(f"checkpoints in {directory}:")
        for h in handles:
            i = h.result()
            print(f"  {i.path.rsplit('/', 1)[-1]:>16}: {i.summary()}, chain depth {i.chain_depth}")

    # "Restart": a new engine and fresh objects resume from the newest committed checkpoint.
    with ckpt_core.CheckpointEngine(config) as engine:
        latest = engine.latest(directory)
        state = engine.load(latest)
        model, opt = make(seed=99)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        print(f"resumed from {latest} at step {state['step']}")
        train_steps(model, opt, state["step"], args.steps, engine, directory, args.every)
        engine.wait()
        resumed = model.state_dict()

    model_ref, opt_ref = make()
    with ckpt_core.CheckpointEngine({"incremental": {"enabled": False}}) as scratch:
        tmp = temporary.enter_context(tempfile.TemporaryDirectory(prefix="checkrun-reference-"))
        train_steps(model_ref, opt_ref, 0, args.steps, scratch, tmp, args.steps)
    exact = all(torch.equal(resumed[k], v) for k, v in model_ref.state_dict().items())
    print(f"resume exact vs an uninterrupted run: {exact}")
    with ckpt_core.CheckpointEngine(config) as engine:
        for e in engine.list(directory):
            print(f"  kept {e.name}: step {e.manifest.meta.get('step')}, "
                  f"its save wrote {fmt_bytes(e.manifest.stats['written_bytes'] + e.size)}")
    if not exact:
        raise SystemExit("resume was not exact")


if __name__ == "__main__":
    main()
