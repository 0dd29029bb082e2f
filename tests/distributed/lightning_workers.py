"""Per-rank bodies of the Lightning tests: a real Trainer on every process (gloo, CPU).

The harness sets LOCAL_RANK/WORLD_SIZE/MASTER_* and does not initialize the process group, so Lightning
sees processes created externally and initializes it itself, exactly as under torchrun.
"""
from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.dcp import CheckrunFSDPStrategy, CheckrunModelParallelStrategy


def _full(t: torch.Tensor) -> list:
    """A DTensor's full value; a plain tensor as it is (FSDP1: this rank's flat shard, maybe empty)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().reshape(-1).tolist()


def _moments(opt, module) -> list:
    return [_full(opt.state[p]["exp_avg"]) if "exp_avg" in opt.state.get(p, {}) else []
            for p in module.parameters()]


class Tiny(LightningModule):
    def __init__(self, fsdp2: bool) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if self.fsdp2:  # ModelParallelStrategy: the module shards itself on the strategy's mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        elif not isinstance(self.net, FSDP):
            # Lightning's FSDPStrategy wraps with a CUDA device id; a module wrapped already is used as is
            self.net = FSDP(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)),
                          batch_size=4)


class Record(Callback):
    """Full parameters and Adam moments at the start of training (after a resume loaded them)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step
        self.params = [_full(p) for p in pl_module.parameters()]
        opt = trainer.optimizers[0]
        self.moments = _moments(opt, pl_module)


def _strategy(kind: str):
    if kind == "model_parallel":
        return CheckrunModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return CheckrunFSDPStrategy()


def _trainer(kind: str, root: str, max_steps: int, callbacks: list) -> Trainer:
    return Trainer(accelerator="cpu", devices=2, strategy=_strategy(kind), max_steps=max_steps, logger=False,
                   callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, default_root_dir=root,
                   enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))


def fit_then_resume(rank: int, world: int, root: str, kind: str) -> dict:
    torch.manual_seed(0)
    model = Tiny(kind == "model_parallel")
    # saves step=1 and step=2; keeping the best one removes step=1 through the strategy
    mc = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=1, monitor="step",
                         mode="max")
    trainer = _trainer(kind, root, 2, [mc])
    trainer.fit(model)
    opt = trainer.optimizers[0]
    saved = {"params": [_full(p) for p in model.parameters()],
             "moments": _moments(opt, model)}
    torch.manual_seed(1)  # different initial weights: only the checkpoint can make them equal
    record = Record()
    resumed = _trainer(kind, root, 3, [record])
    resumed.fit(Tiny(kind == "model_parallel"), ckpt_path=f"{root}/step=2.ckpt")
    return {"saved": saved, "step": record.step, "params": record.params, "moments": record.moments,
            "final_step": resumed.global_step}
