"""Fork safety (issue 19.1): a process forked while a save is in flight inherits no engine obligations.

Storage is gated (``gatefile://``, ckpt_core.testing.faults) so that the save is surely in flight when the
child is forked; the gate opens only after the child's fate is known. Before the fix, each child
waited at exit for the parent's save (which only the parent's threads can finish): DataLoader workers
hung until the DataLoader terminated them.
"""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckpt_core
from ckpt_core.testing.faults import FaultFS as FaultyFS
from tests.integration.test_lightning_common import close_plugins, make_io, record_worker_shutdown  # noqa: F401

HANG_GUARD_S = 120  # only bounds a broken run; a passing child exits at once


def _child_exits(engine: ckpt_core.CheckpointEngine, path: str, out) -> None:
    try:
        engine.save({"x": torch.zeros(3)}, path)
        out.put("saved")
    except ckpt_core.CheckrunError as exc:
        out.put(f"refused: {exc}")


def test_forked_child_neither_waits_nor_writes(tmp_path, gate) -> None:
    root = f"gatefile://{tmp_path}"
    engine = ckpt_core.CheckpointEngine()
    handle = engine.save({"w": torch.arange(1000.0)}, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()  # the background save is inside a storage write, held by the gate
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_exits, args=(engine, f"{root}/child.ckpt", out))
    child.start()
    child.join(HANG_GUARD_S)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child waited at exit for the parent's in-flight save"
    assert child.exitcode == 0
    message = out.get(timeout=HANG_GUARD_S)
    assert message.startswith("refused:") and "forked child" in message
    assert not handle.done()  # the parent's save is still held by the gate, yet the child is gone
    gate.set()
    assert handle.result().path.endswith("a.ckpt")
    engine.close()
    assert not (tmp_path / "child.ckpt").exists()
    assert ckpt_core.load(f"{tmp_path}/a.ckpt")["w"].equal(torch.arange(1000.0))


class _Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        return DataLoader(data, batch_size=4, num_workers=2)


class _GatePerEpoch(Callback):
    """Keeps each epoch-end save in flight through the next epoch (its DataLoader workers are
    forked and shut down meanwhile), then lets it finish before the next save."""

    def __init__(self, gate: threading.Event, plugin) -> None:
        self.gate, self.plugin = gate, plugin

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.gate.set()
        self.plugin.wait()
        self.gate.clear()

    def on_train_end(self, trainer, pl_module) -> None:
        self.gate.set()  # the plugin's teardown waits for the last save


def test_dataloader_workers_exit_cleanly_during_a_save(tmp_path, gate, monkeypatch) -> None:
    shut_down, terminated = record_worker_shutdown(monkeypatch)
    plugin = make_io()
    mc = ModelCheckpoint(dirpath=f"gatefile://{tmp_path}/ckpts", every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(max_epochs=3, plugins=[plugin], callbacks=[_GatePerEpoch(gate, plugin), mc],
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(_Model())
    gate.set()
    plugin.wait()
    # epochs 2 and 3 forked their workers while the previous epoch's save was held by the gate
    assert len(shut_down) >= 6
    assert terminated == [], f"{len(terminated)} of {len(shut_down)} DataLoader workers hung at exit"
    assert sorted(p.name for p in (tmp_path / "ckpts").glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
