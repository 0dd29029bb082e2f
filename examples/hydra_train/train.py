"""Hydra + Lightning + checkrun: everything, the checkpoint plugin included, is built with ``_target_``.

Run (from the same directory each time: checkpoints go to ./checkpoints, Hydra's logs to
./outputs/<date>/<time>)::

    python examples/hydra_train/train.py                                   # trains to step 30
    python examples/hydra_train/train.py resume=last trainer.max_steps=60  # resumes at 30, trains to 60

Give both runs the same ``ckpt_dir=...`` (a folder or an ``s3://`` URL) to keep checkpoints elsewhere.
``resume=last`` with no last checkpoint in ``ckpt_dir`` stops with an error instead of silently starting
over (Lightning itself only warns). ``hydra.utils.instantiate(cfg.trainer)`` builds the Trainer, its
``CheckrunCheckpointIO`` plugin and the callbacks recursively (the plugin accepts the OmegaConf
containers Hydra passes).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import fsspec
import hydra
from lightning.pytorch import seed_everything
from omegaconf import DictConfig

import ckpt_core

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples/


def resume_path(cfg: DictConfig) -> Optional[str]:
    """``cfg.resume``, with ``"last"`` resolved to the newest ``last*.ckpt`` in ``cfg.ckpt_dir``.

    Raises SystemExit if there is none: a resume that would silently start over is a mistake.
    """
    if cfg.resume != "last":
        return cfg.resume
    fs, root = fsspec.core.url_to_fs(cfg.ckpt_dir)
    found = fs.glob(f"{root.rstrip('/')}/last*.ckpt") if fs.exists(root) else []
    if not found:
        raise SystemExit(f"resume=last: no last checkpoint in {cfg.ckpt_dir}; run once without resume "
                         "(with the same ckpt_dir) first")
    newest = max(found, key=fs.modified)
    return newest if "://" not in cfg.ckpt_dir else fs.unstrip_protocol(newest)


def saved_step(path: str) -> Optional[int]:
    """The ``global_step`` recorded in a checkrun checkpoint's manifest (None for other files)."""
    try:
        with ckpt_core.CheckpointEngine() as engine:
            return engine.read_manifest(path).meta.get("global_step")
    except ckpt_core.CheckrunError:
        return None


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Instantiate model, data and trainer from ``cfg`` and fit (resuming if ``cfg.resume`` is set)."""
    seed_everything(cfg.seed, verbose=False)
    ckpt_path = resume_path(cfg)
    if ckpt_path is not None:
        print(f"resuming from {ckpt_path} at step {saved_step(ckpt_path)}")
    model = hydra.utils.instantiate(cfg.model)
    data = hydra.utils.instantiate(cfg.data)
    trainer = hydra.utils.instantiate(cfg.trainer)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    metrics = next(cb for cb in trainer.callbacks if type(cb).__name__ == "CheckpointMetrics")
    for info in metrics.history:
        print(f"saved {info.path}: {info.summary()}")
    print(f"trained to step {trainer.global_step}; checkpoints in {cfg.ckpt_dir}")


if __name__ == "__main__":
    main()
