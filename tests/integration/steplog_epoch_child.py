"""Child process of test_steplog_lightning's epoch-end test: a small Lightning fit (10 batches an epoch,
3 epochs) with ``CheckrunCheckpointIO(step_log=True)`` and a ModelCheckpoint every 7 steps (+ last).

    python -m tests.integration.steplog_epoch_child train DIR N    after step N: wait for the saves,
        flush the log, SIGKILL itself
    python -m tests.integration.steplog_epoch_child resume DIR OUT  fit(ckpt_path="last") to the end
    python -m tests.integration.steplog_epoch_child reference OUT    the same fit, uninterrupted
Both ``resume`` and ``reference`` torch.save the final state (and the step and epoch it started at) to OUT.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import CheckrunCheckpointIO


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Watch(Callback):
    def __init__(self, kill_at: int) -> None:
        self.kill_at, self.started = kill_at, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = (trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.kill_at:
            io = trainer.strategy.checkpoint_io
            io.wait()
            io.step_log.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def fit(directory: str | None, kill_at: int = -1, ckpt_path: str | None = None) -> tuple:
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 1, generator=g)), batch_size=8)
    watch = Watch(kill_at)
    callbacks = [watch]
    plugins = []
    if directory is not None:
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=7, save_last=True))
        plugins.append(CheckrunCheckpointIO(step_log=True, overrides={"step_log.flush_every_steps": 1}))
    trainer = Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=directory is not None, plugins=plugins,
                      callbacks=callbacks)
    model = Net()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return {"started": watch.started, "global_step": trainer.global_step, "model": model.state_dict(),
            "opt": trainer.optimizers[0].state_dict()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, *args = sys.argv[1:]
    if mode == "train":
        fit(args[0], kill_at=int(args[1]))
    elif mode == "resume":
        torch.save(fit(args[0], ckpt_path="last"), args[1])
    else:
        torch.save(fit(None), args[0])
