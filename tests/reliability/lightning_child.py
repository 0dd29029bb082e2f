"""Child process of the crash harness: a Lightning ``Trainer`` that checkpoints through
``lightning_ckpt.CheckrunCheckpointIO`` (ModelCheckpoint every epoch, top-2 + last; unreferenced blobs
collected at teardown), resumes with ``fit(ckpt_path="last")``, and stops at the armed kill point like
``crash_child.train_main`` (same phases; ``step`` is a training batch, ``committed`` an epoch checkpoint).

Resuming is compared at epoch boundaries: Lightning restarts a non-resumable dataloader from the
start of the epoch, so a checkpoint taken mid-epoch cannot resume bit for bit with any CheckpointIO.
"""
from __future__ import annotations

import os
import traceback

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import CheckrunCheckpointIO

from . import crash_child as cc
from ckpt_core.testing import faults as faultfs

SAMPLES, BATCH = 32, 8


class LitNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = cc.Net()
        self.net.drop.p = 0.0  # Lightning does not checkpoint the global RNG: no randomness in training

    def training_step(self, batch, batch_idx):
        ids, target = batch
        return torch.nn.functional.mse_loss(self.net(ids), target)

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(cc.SEED)
        ids = torch.randint(0, cc.ROWS, (SAMPLES, cc.IDS), generator=g)
        return DataLoader(TensorDataset(ids, ids.float().mean(1, keepdim=True) / cc.ROWS), batch_size=BATCH)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["marker"] = cc.Marker(self.current_epoch)  # pickled inside save(): the capture phase


def training_digest(state_dict, optimizer_state) -> str:
    return cc.digest({"state_dict": state_dict, "optimizer": optimizer_state})


class _Probe(Callback):
    def __init__(self, reference: bool) -> None:
        self.reference = reference

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.ckpt_path:  # resumed: the checkpoint was taken at the end of the previous epoch
            cc.send(("resumed", trainer.current_epoch - 1))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        cc.fire("step", trainer.global_step)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.reference:
            cc.send(("saved", trainer.current_epoch,
                     training_digest(pl_module.state_dict(), trainer.optimizers[0].state_dict())))


def plugin_overrides() -> dict:
    return {"compression.chunk_bytes": 32768, "retention.gc_grace_seconds": 0.0,
            "saving.sigterm_grace_seconds": None,
            "load.allowed_globals": [f"{cc.Marker.__module__}.Marker"]}


def lightning_main(conn, root: str | None, spec: dict) -> None:
    """Fit to ``spec["total_steps"]`` epochs (resuming from ``last``), or the reference run."""
    cc._Kill.conn = conn
    cc._redirect_stderr(spec.get("log"))
    try:
        torch.set_num_threads(1)
        kill = spec.get("kill")
        cc._Kill.phase, cc._Kill.n = (kill[0], int(kill[1])) if kill else (None, 0)
        faultfs.FaultFS.policy = cc.CrashPolicy()
        seed_everything(cc.SEED, verbose=False)
        model, epochs, reference = LitNet(), int(spec["total_steps"]), bool(spec.get("reference"))
        kwargs = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, max_epochs=epochs, num_sanity_val_steps=0,
                      deterministic=True)
        if reference:
            trainer = Trainer(enable_checkpointing=False, callbacks=[_Probe(True)], **kwargs)
            trainer.fit(model)
        else:
            # Retention by ModelCheckpoint(save_top_k) as the plugin recommends; gc at teardown.
            plugin = CheckrunCheckpointIO(overrides=plugin_overrides())
            plugin.add_save_callback(_committed)
            mc = ModelCheckpoint(dirpath=root, filename="{epoch}", every_n_epochs=1, save_top_k=2,
                                 monitor="step", mode="max", save_last=True)
            trainer = Trainer(plugins=[plugin], callbacks=[_Probe(False), mc], **kwargs)
            trainer.fit(model, ckpt_path="last")
        cc.send(("done", epochs, training_digest(model.state_dict(), trainer.optimizers[0].state_dict()), []))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the trial
        cc.send(("error", traceback.format_exc()))
        raise


def _committed(info) -> None:
    name = os.path.basename(info.path)
    if name.startswith("epoch="):  # epoch=3.ckpt, or epoch=3-v1.ckpt when an epoch is saved again
        epoch = int(name[len("epoch="):].split(".")[0].split("-")[0])
        cc.send(("committed", epoch))
        cc.fire("committed", epoch)
