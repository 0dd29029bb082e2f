"""Child process of test_steplog_lightning: a real ``Trainer`` with ``CheckrunCheckpointIO(step_log=True)``.

    python -m tests.integration.steplog_lightning_child train DIR KIND
        ModelCheckpoint every 7 steps (+ last), gradient clipping by the Trainer, an LR scheduler
        stepped every step; prints ``step N`` after each batch, ``flushed N`` after
        ``plugin.step_log.flush()`` returned (every 5 steps), ``committed N`` once a checkpoint is
        committed; runs until killed
    python -m tests.integration.steplog_lightning_child resume DIR KIND OUT
        ``fit(ckpt_path="last")``; at ``on_train_start`` (the resumed state) each rank torch.saves model,
        optimizer, scheduler, ``global_step`` and the fit loop's state to OUT.rank{r}, and the fit stops;
        prints ``resumed N``
    python -m tests.integration.steplog_lightning_child reference KIND N OUT
        an uninterrupted run to step N saves a checkpoint there with Lightning's own CheckpointIO; the
        same state, from it, to OUT

``STEPLOG_DEVICES=2`` in the environment: DDP on 2 CPU processes (rank 0 prints and saves);
``STEPLOG_ACCUMULATE=k``: ``accumulate_grad_batches=k`` (an optimizer step every k batches);
``STEPLOG_KILL_AT=n``: ``train`` SIGKILLs itself after global step n and never flushes the log.
The batches are a deterministic function of the batch index (tests.core.steplog_train.batch) and an
epoch is longer than any test runs, so the resume is compared within the epoch.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import threading

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_ckpt import CheckrunCheckpointIO
from tests.core.steplog_train import Net, batch

CKPT_EVERY, FLUSH_EVERY, EPOCH = 7, 5, 10_000
DEVICES = int(os.environ.get("STEPLOG_DEVICES", "1"))
ACCUMULATE = int(os.environ.get("STEPLOG_ACCUMULATE", "1"))
KILL_AT = int(os.environ.get("STEPLOG_KILL_AT", "0"))
_SAY = threading.Lock()


def say(line: str) -> None:
    """One whole line (the engine's commit thread prints too)."""
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class Batches(Dataset):
    def __len__(self) -> int:
        return EPOCH

    def __getitem__(self, i: int):
        return batch(i + 1)


class Lit(LightningModule):
    """``kind`` "bn": Adam, with a BatchNorm layer in the MLP. "manual": manual optimization, the optimizer stepped every 2nd batch (gradients of two
    batches accumulated), clipped by the module, a scheduler declared with interval "step" and stepped
    by the module after each optimizer step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net, self.kind = Net(), kind
        if kind == "bn":  # running statistics change in the forward pass: logged with each step, set on replay
            self.net.mlp.insert(1, torch.nn.BatchNorm1d(32))
        self.automatic_optimization = kind != "manual"

    def training_step(self, b, batch_idx):
        ids, y = b
        loss = torch.nn.functional.mse_loss(self.net(ids), y)
        if self.automatic_optimization:
            return loss
        opt, sched = self.optimizers(), self.lr_schedulers()
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()
        return loss

    def configure_optimizers(self):
        if self.kind in ("adam", "manual", "bn"):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=5e-2, momentum=0.9, nesterov=True)
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Batches(), batch_size=None)


def _trainer(manual: bool = False, **kwargs) -> Trainer:
    """``manual``: for the "manual" kind (the module clips; Lightning refuses clipping by the Trainer)."""
    if DEVICES > 1:  # Lightning's launcher runs this script again for the other ranks, same environment
        kwargs.setdefault("strategy", "ddp")
    return Trainer(accelerator="cpu", devices=DEVICES, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=None if manual else 0.5,
                   accumulate_grad_batches=ACCUMULATE, **kwargs)


def plugin() -> CheckrunCheckpointIO:
    return CheckrunCheckpointIO(step_log=True, overrides={"step_log.flush_every_steps": 3,
                                                          "saving.sigterm_grace_seconds": None})


class Progress(Callback):
    def __init__(self, io: CheckrunCheckpointIO) -> None:
        self.io = io

    def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        if KILL_AT and step >= KILL_AT:  # no flush: the segments the resume finds were closed at step pre-hooks
            os.kill(os.getpid(), signal.SIGKILL)
        if step % FLUSH_EVERY == 0 and self.io.step_log is not None and not KILL_AT:
            self.io.step_log.flush()
            say(f"flushed {step}")
        else:
            say(f"step {step}")


def train(directory: str, kind: str) -> None:
    io = plugin()
    io.add_save_callback(lambda info: say(f"committed {info.path}"))
    mc = ModelCheckpoint(dirpath=directory, every_n_train_steps=CKPT_EVERY, save_last=True)
    _trainer(kind == "manual", plugins=[io], callbacks=[Progress(io), mc], max_steps=1_000_000).fit(Lit(kind))


def _state(trainer: Trainer, module: Lit) -> dict:
    """What a checkpoint saved now would hold of the training state (the live objects)."""
    return copy.deepcopy({"model": module.state_dict(), "opt": trainer.optimizers[0].state_dict(),
                          "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                          "global_step": trainer.global_step, "fit_loop": trainer.fit_loop.state_dict()})


def _saved(path: str) -> dict:
    """The same, from a checkpoint Lightning saved (TorchCheckpointIO)."""
    ck = torch.load(path, weights_only=False)
    return {"model": ck["state_dict"], "opt": ck["optimizer_states"][0], "sched": ck["lr_schedulers"][0],
            "global_step": ck["global_step"], "fit_loop": ck["loops"]["fit_loop"]}


class Snapshot(Callback):
    """Takes each rank's resumed state at ``on_train_start``, then stops the fit."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        torch.save(_state(trainer, pl_module), f"{self.out}.rank{trainer.global_rank}")
        trainer.should_stop = True  # the resumed state is all this run is for


def resume(directory: str, kind: str, out: str) -> None:
    mc = ModelCheckpoint(dirpath=directory, every_n_train_steps=CKPT_EVERY, save_last=True)
    trainer = _trainer(kind == "manual", plugins=[plugin()], callbacks=[Snapshot(out), mc], max_steps=1_000_000)
    trainer.fit(Lit(kind), ckpt_path="last")
    if trainer.is_global_zero:
        say(f"resumed {trainer.global_step}")


def reference(kind: str, steps: str, out: str) -> None:
    """Uninterrupted to ``steps``, saving there with Lightning's own CheckpointIO: what "as if saved at
    that step" means, loop counters included."""
    ref = ModelCheckpoint(dirpath=f"{out}.dir", filename="ref", every_n_train_steps=int(steps))
    trainer = _trainer(kind == "manual", callbacks=[ref], max_steps=int(steps))
    trainer.fit(Lit(kind))
    if trainer.is_global_zero:
        torch.save(_saved(f"{out}.dir/ref.ckpt"), out)


if __name__ == "__main__":
    torch.set_num_threads(1)  # the same kernels in every process: bit-exact comparisons across them
    mode, *args = sys.argv[1:]
    {"train": train, "resume": resume, "reference": reference}[mode](*args)
