"""The Lightning plugin's step log with a ``GradScaler`` (issue 23): a real ``Trainer`` with
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`` (Lightning has a scaler on CUDA only by
itself; given one, it drives it on the CPU too) and a forced overflow that the scaler skips.
``fit(ckpt_path="last")`` replays the steps logged after the last checkpoint: model, optimizer and
the scaler's scale and growth tracker equal the uninterrupted run's at its end, bit for bit, and so
does ``global_step``, which counts the skipped step too (the log records it with each state record)."""
from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from tests.core.steplog_train import assert_bit_equal
from tests.integration.steplog_lightning_child import Lit, _trainer, plugin

CKPT_EVERY, STEPS = 5, 13


def _precision() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2))


class Overflow(Callback):
    """An inf gradient in batch ``at``: the scaler skips that optimizer step and backs its scale off."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.current.ready == self.at:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")


def _state(trainer, module) -> dict:
    return copy.deepcopy({"model": module.state_dict(), "opt": trainer.optimizers[0].state_dict(),
                          "scaler": trainer.precision_plugin.scaler.state_dict(),
                          "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                          "global_step": trainer.global_step})


class Snapshot(Callback):
    def __init__(self) -> None:
        self.state: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:  # after the plugin's replay (it runs first)
        self.state = _state(trainer, pl_module)
        trainer.should_stop = True


@pytest.mark.parametrize("inf_at", [3, 12])  # a skipped step before the last checkpoint (10), and after it
def test_lightning_replays_the_grad_scaler(tmp_path, inf_at):
    torch.set_num_threads(1)
    directory = str(tmp_path / "ckpts")
    mc = ModelCheckpoint(dirpath=directory, every_n_train_steps=CKPT_EVERY, save_last=True)
    module = Lit("adam")
    trainer = _trainer(plugins=[plugin(), _precision()], callbacks=[Overflow(inf_at), mc], max_steps=STEPS)
    trainer.fit(module)
    want = _state(trainer, module)
    assert want["global_step"] == STEPS and want["scaler"]["scale"] != 2.0**12

    snap = Snapshot()
    mc = ModelCheckpoint(dirpath=directory, every_n_train_steps=CKPT_EVERY, save_last=True)
    resumed = _trainer(plugins=[plugin(), _precision()], callbacks=[snap, mc], max_steps=STEPS + 1)
    resumed.fit(Lit("adam"), ckpt_path="last")
    assert_bit_equal(snap.state, want)  # global_step too: the logged steps after step 10 replayed
