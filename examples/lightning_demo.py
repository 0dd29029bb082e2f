"""A small recommender-style LightningModule and DataModule shared by the Lightning examples.

An embedding table (``rows`` x ``dim``) plus an MLP, trained with Adagrad on random item ids: each step
touches only the rows in its batch, so checkrun's incremental saves write a fraction of the table.
Everything is deterministic (fixed generator seeds) and runs on CPU in seconds.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RandomIds(Dataset):
    """``length`` batches' worth of (item id, click) pairs drawn from a fixed seed."""

    def __init__(self, rows: int, length: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, rows, (length,), generator=g)
        self.clicks = (self.ids % 7 == 0).float()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i], self.clicks[i]


class DemoDataModule(LightningDataModule):
    """Random ids over ``rows`` items; ``samples`` per epoch, in batches of ``batch_size``."""

    def __init__(self, rows: int = 20000, samples: int = 25600, batch_size: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        data = RandomIds(self.hparams.rows, self.hparams.samples)
        return DataLoader(data, batch_size=self.hparams.batch_size)


class DemoModel(LightningModule):
    """Embedding + MLP click model (Adagrad: rows without a gradient stay bit-identical)."""

    def __init__(self, rows: int = 20000, dim: int = 32, hidden: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.emb = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, clicks = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(ids), clicks)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(self.parameters(), lr=self.hparams.lr)
