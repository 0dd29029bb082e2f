"""Shared pieces of the Lightning integration tests (no tests here): tiny models, trainers, S3 setup.

Every model is a few hundred parameters on CPU so that a ``fit`` takes well under a second.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt

N_SAMPLES = 32
_made: list = []


def make_io(*args: Any, **kwargs: Any) -> lightning_ckpt.CheckrunCheckpointIO:
    """A ``CheckrunCheckpointIO`` that ``close_plugins`` tears down after the test, even a failed one
    (so no save is left pending when the S3 server stops)."""
    plugin = lightning_ckpt.CheckrunCheckpointIO(*args, **kwargs)
    _made.append(plugin)
    return plugin


@pytest.fixture(autouse=True)
def close_plugins():
    """Tear down every plugin made with ``make_io`` in the test (import this fixture into test modules)."""
    yield
    while _made:
        try:
            _made.pop().teardown()
        except Exception:  # noqa: BLE001 - the test itself reports what went wrong
            pass


def dataset(n: int = N_SAMPLES, seed: int = 0) -> TensorDataset:
    """A fixed regression data set (same on every call and every rank)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyModel(LightningModule):
    """Linear-ReLU-Linear regression with Adam and a per-step StepLR scheduler; logs train/val loss."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(8, seed=1), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(dataset(8, seed=2), batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(dataset(8, seed=3), batch_size=4)


class TinyDataModule(LightningDataModule):
    """A datamodule with hyper-parameters and a state dict (to test saving and restoring it)."""

    def __init__(self, batch_size: int = 4, note: str = "dm") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.served = 0

    def train_dataloader(self) -> DataLoader:
        self.served += 1
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state_dict: dict) -> None:
        self.served = state_dict["served"]


def trainer(root: Optional[str], plugin: Any = None, **kwargs: Any) -> Trainer:
    """A quiet CPU Trainer (no logger, no progress bar, no summary) with the checkrun plugin."""
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, max_epochs=-1, num_sanity_val_steps=0)
    defaults.update(kwargs)
    # No implicit ModelCheckpoint: tests add the one they check.
    defaults.setdefault("enable_checkpointing", any(isinstance(cb, ModelCheckpoint)
                                                    for cb in defaults.get("callbacks") or []))
    if root is not None:
        defaults.setdefault("default_root_dir", root)
    plugins = [plugin if plugin is not None else make_io()]
    return Trainer(plugins=plugins, **defaults)


def join(root: str, *parts: str) -> str:
    """Join path parts under a local path or URL."""
    return "/".join([root.rstrip("/"), *parts]) if "://" in root else os.path.join(root, *parts)


def ls(path: str) -> list[str]:
    """Names of the files directly in ``path`` (local or URL), fresh from the storage."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    fs.invalidate_cache(p)
    if not fs.exists(p):
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False))


def files_under(path: str) -> list[str]:
    """Every file below ``path`` (recursively; empty directories do not count), fresh from the storage."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(path)
    fs.invalidate_cache()
    return sorted(fs.find(p)) if fs.exists(p) else []


def tensors_equal(a: Any, b: Any) -> bool:
    """Deep equality of nested state (tensors compared bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def lroot(request: pytest.FixtureRequest, tmp_path, monkeypatch) -> tuple[str, dict]:
    """``(root, storage_options)`` on local disk and on S3 (moto).

    For S3, Lightning's own fsspec calls (ModelCheckpoint's exists/ls, ``ckpt_path="last"``) reach the
    same endpoint through fsspec's global config, exactly as docs/lightning.md tells users to do.
    """
    if request.param == "local":
        return str(tmp_path / "run"), {}
    import fsspec.config

    options = request.getfixturevalue("s3_storage_options")
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(options))
    return request.getfixturevalue("s3_root"), options


def record_worker_shutdown(monkeypatch) -> tuple[list, list]:
    """(workers shut down, workers the DataLoader had to terminate: hung ones), filled as DataLoader
    iterators end their workers; observes, changes nothing."""
    from torch.utils.data import dataloader as dl_module

    shut_down, terminated = [], []
    original = dl_module._MultiProcessingDataLoaderIter._shutdown_workers

    def recording(self):
        for w in getattr(self, "_workers", []):
            shut_down.append(w.pid)
            # the DataLoader terminates only workers still alive after their grace: hung ones
            w.terminate = lambda w=w, term=w.terminate: (terminated.append(w.pid), term())[1]
        original(self)

    monkeypatch.setattr(dl_module._MultiProcessingDataLoaderIter, "_shutdown_workers", recording)
    return shut_down, terminated
