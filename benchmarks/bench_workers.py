"""Lightning fit with DataLoader workers (``num_workers=2``) and a save every few steps: epoch times.

Why: a process forked while a save is in flight (each epoch's DataLoader workers, when
``persistent_workers=False``) must not inherit the engine's obligations. Before the fix each worker
forked during a save waited at exit for the parent's save until the DataLoader killed it (10.2 s
per epoch instead of 0.2 s). This prints the epoch times of the same fit with Lightning's
``TorchCheckpointIO``, checkrun's plugin (threads) and checkrun with the writer process, side by side.

Each configuration runs one fit of ``--epochs`` epochs on a small MLP (``--state-mb`` of weights and
Adam moments), with ``ModelCheckpoint(every_n_train_steps=--every, save_top_k=-1)`` to local disk.
Epoch time = wall time from ``on_train_epoch_start`` to ``on_train_epoch_end`` (includes the workers'
start and shutdown). The first epoch (warm-up) is left out. Configurations alternate over
``--rounds`` rounds; the table shows min / median / max over every measured epoch.

Run: ``python -m benchmarks.bench_workers [--epochs 6] [--rounds 2] [--every 2] [--state-mb 8]``.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_ckpt import CheckrunCheckpointIO  # noqa: E402

CONFIGS = ("torch", "checkrun", "checkrun-process")


class MLP(LightningModule):
    def __init__(self, width: int, steps: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.width, self.steps = width, steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(torch.randn(self.steps * 8, self.width), torch.randn(self.steps * 8, 1))
        return DataLoader(data, batch_size=8, num_workers=2)


class EpochTimer(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_epoch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def make_io(name: str) -> Optional[Any]:
    if name == "torch":
        return None  # Lightning's default TorchCheckpointIO
    if name == "checkrun":
        return CheckrunCheckpointIO()
    return CheckrunCheckpointIO(overrides={"saving.background": "process"})


def fit(name: str, args: argparse.Namespace, root: Path) -> list[float]:
    width = max(16, int((args.state_mb * 1e6 / 12) ** 0.5))
    timer = EpochTimer()
    io = make_io(name)
    trainer = Trainer(max_epochs=args.epochs, plugins=[io] if io is not None else None,
                      callbacks=[timer, ModelCheckpoint(dirpath=root / name, every_n_train_steps=args.every,
                                                        save_top_k=-1)],
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(root), accelerator="cpu", devices=1)
    trainer.fit(MLP(width, args.steps))
    return timer.times[1:]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8, help="training steps per epoch")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--state-mb", type=float, default=8.0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    names = args.configs.split(",")
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].extend(fit(name, args, Path(tmp) / f"r{r}"))
    print(f"Lightning fit, DataLoader num_workers=2, a save every {args.every} of {args.steps} steps per epoch, "
          f"{args.state_mb:g} MB state, {args.rounds} round(s) x {args.epochs - 1} measured epochs")
    print(f"{'config':<18}{'epochs':>7}{'min s':>9}{'median s':>10}{'max s':>9}{'vs torch':>10}")
    base = statistics.median(times["torch"]) if times.get("torch") else None
    for name in names:
        t = times[name]
        ratio = f"{statistics.median(t) / base:.2f}x" if base else "-"
        print(f"{name:<18}{len(t):>7}{min(t):>9.3f}{statistics.median(t):>10.3f}{max(t):>9.3f}{ratio:>10}")


if __name__ == "__main__":
    main()
