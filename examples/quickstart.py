"""Quickstart: a short plain-PyTorch training run that checkpoints through checkrun, then resumes.

Run: ``bash .ci/main`` (sets up .venv) or ``python examples/quickstart.py [--dir DIR]``.
It trains a small model with an embedding table for a few steps, saves every few steps
asynchronously (incremental: only changed rows/chunks are written), simulates a restart by loading
the latest checkpoint into fresh objects, checks the resume is exact, and prints what was saved.
"""
from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from torch import nn

import ckpt_core


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
    parser.add_argument("--dir", default=None, help="checkpoint directory or fsspec URL (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    directory = args.dir or tempfile.mkdtemp(prefix="checkrun-quickstart-")
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
            print(f"  {i.path.rsplit('/', 1)[-1]:>16}: {i.tensor_bytes / 1e6:6.2f} MB of tensors, "
                  f"wrote {i.written_bytes / 1e6:6.3f} MB ({100 * i.write_ratio:5.1f}%), "
                  f"blocked {1000 * i.blocking_seconds:6.1f} ms, chain depth {i.chain_depth}")

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
        tmp = tempfile.mkdtemp(prefix="checkrun-reference-")
        train_steps(model_ref, opt_ref, 0, args.steps, scratch, tmp, args.steps)
    exact = all(torch.equal(resumed[k], v) for k, v in model_ref.state_dict().items())
    print(f"resume exact vs an uninterrupted run: {exact}")
    with ckpt_core.CheckpointEngine(config) as engine:
        for e in engine.list(directory):
            print(f"  kept {e.name}: step {e.manifest.meta.get('step')}, "
                  f"{e.manifest.stats['written_bytes'] / 1e6:.3f} MB written")
    if not exact:
        raise SystemExit("resume was not exact")


if __name__ == "__main__":
    main()
