"""Resume, then train with DataLoader workers (a real Lightning ``Trainer``): the copy that the first
save after the resume compares against is rebuilt after the load (``load.reference``), while the
workers fork. Nothing hangs, and that save is a row delta that loads back as the trained model."""
from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckpt_core
from tests.integration.test_lightning_common import close_plugins, make_io, record_worker_shutdown  # noqa: F401

ROWS = 4096


class _Recommender(LightningModule):
    """An embedding table (a row stream: each batch changes a few rows) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(ROWS, 16)
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        ids, y = batch
        return torch.nn.functional.mse_loss(self.head(self.emb(ids)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randint(0, ROWS, (32,), generator=g), torch.randn(32, 1, generator=g))
        return DataLoader(data, batch_size=8, num_workers=2)


def _trainer(tmp_path, epochs: int, plugin) -> Trainer:
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1, save_last=True)
    return Trainer(max_epochs=epochs, plugins=[plugin], callbacks=[mc], logger=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path))


def test_resume_with_dataloader_workers_then_a_row_delta(tmp_path, monkeypatch) -> None:
    _trainer(tmp_path, 2, make_io()).fit(_Recommender())
    shut_down, terminated = record_worker_shutdown(monkeypatch)
    plugin = make_io()
    model = _Recommender()
    trainer = _trainer(tmp_path, 3, plugin)
    trainer.fit(model, ckpt_path="last")  # a second Trainer in the same process resumes
    plugin.wait()
    assert shut_down and terminated == [], f"{len(terminated)} of {len(shut_down)} DataLoader workers hung"
    path = tmp_path / "ckpts" / "epoch=2-step=12.ckpt"
    with ckpt_core.CheckpointEngine() as engine:
        emb = {r.key: r for r in engine.read_manifest(path).tensors}["state_dict.emb.weight"]
        state = engine.load(path)
    assert emb.deltas and sum(d.n for d in emb.deltas) <= 32  # only the rows the epoch's ids touched
    assert torch.equal(state["state_dict"]["emb.weight"], model.emb.weight.detach())
