"""Hydra + Lightning + checkrun: everything, the checkpoint plugin included, is built with ``_target_``.

Run::

    python examples/hydra_train/train.py                      # outputs under ./outputs/<date>/<time>
    python examples/hydra_train/train.py ckpt_dir=/tmp/run resume=last trainer.max_steps=60

``hydra.utils.instantiate(cfg.trainer)`` builds the Trainer, its ``CheckrunCheckpointIO`` plugin and the
callbacks recursively (the plugin accepts the OmegaConf containers Hydra passes).
"""
from __future__ import annotations

import os
import sys

import hydra
from lightning.pytorch import seed_everything
from omegaconf import DictConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Instantiate model, data and trainer from ``cfg`` and fit (resuming if ``cfg.resume`` is set)."""
    seed_everything(cfg.seed, verbose=False)
    model = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    trainer = hydra.utils.instantiate(cfg.trainer)
    trainer.fit(model, datamodule=data, ckpt_path=cfg.resume)
    metrics = next(cb for cb in trainer.callbacks if type(cb).__name__ == "CheckpointMetrics")
    for info in metrics.history:
        print(f"saved {info.path}: wrote {info.written_bytes / 1e6:.3f} MB of {info.tensor_bytes / 1e6:.2f} MB")
    print(f"trained to step {trainer.global_step}; checkpoints in {cfg.ckpt_dir}")


if __name__ == "__main__":
    main()
