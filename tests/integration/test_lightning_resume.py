"""Resume exactness: N steps + resume from ``last`` to 2N equals an uninterrupted 2N-step run, bit for bit
(weights, Adam state, LR scheduler, step counters), with asynchronous incremental lossless saves.

N is an epoch boundary: Lightning restarts a dataloader that is not resumable from the beginning of
the epoch, so a mid-epoch resume differs from an uninterrupted run with any CheckpointIO. Lightning's
own loop bookkeeping (``epoch_progress`` "ready"/"started" counts the restarted epoch once) differs
from an uninterrupted run as well; it is compared with the same resume done through TorchCheckpointIO.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch import seed_everything

from lightning_ckpt import CheckrunModelCheckpoint
from tests.integration.test_lightning_common import (TinyModel, close_plugins, join, lroot,  # noqa: F401
                                                     make_io, tensors_equal, trainer)

N = 8  # one epoch of 8 batches


def _run(root: str, plugin: Any, max_steps: int, ckpt_path: Optional[str] = None):
    seed_everything(7, verbose=False)
    model = TinyModel()
    mc = CheckrunModelCheckpoint(dirpath=join(root, "ckpts"), every_n_train_steps=4, save_last=True, save_top_k=-1)
    t = trainer(root, plugin, callbacks=[mc], max_steps=max_steps, deterministic=True)
    t.fit(model, ckpt_path=ckpt_path)
    return t


def _training_state(t) -> dict:
    loop = t.fit_loop.epoch_loop
    return {"weights": t.lightning_module.state_dict(), "optimizer": t.optimizers[0].state_dict(),
            "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(), "global_step": t.global_step,
            "epoch": t.current_epoch, "batches_that_stepped": loop._batches_that_stepped,
            "optim_progress": loop.automatic_optimization.optim_progress.state_dict()}


def test_resume_from_last_is_bit_exact(lroot, tmp_path) -> None:
    root, opts = lroot
    reference = _run(str(tmp_path / "reference"), TorchCheckpointIO(), 2 * N)
    _run(root, make_io(storage_options=opts), N)
    resumed = _run(root, make_io(storage_options=opts), 2 * N, ckpt_path="last")
    assert resumed.ckpt_path == join(root, "ckpts", "last.ckpt")
    ref, res = _training_state(reference), _training_state(resumed)
    for key in ref:
        assert tensors_equal(res[key], ref[key]), key

    _run(str(tmp_path / "torch"), TorchCheckpointIO(), N)
    torch_resumed = _run(str(tmp_path / "torch"), TorchCheckpointIO(), 2 * N, ckpt_path="last")
    assert tensors_equal(resumed.fit_loop.state_dict(), torch_resumed.fit_loop.state_dict())


def test_resume_with_a_writer_process_is_bit_exact(lroot, tmp_path) -> None:
    """The same with ``saving.background: process`` (the writer process saves on local disk and on S3)."""
    root, opts = lroot
    reference = _run(str(tmp_path / "reference"), TorchCheckpointIO(), 2 * N)
    overrides = {"saving.background": "process"}
    _run(root, make_io(storage_options=opts, overrides=overrides), N)
    resumed = _run(root, make_io(storage_options=opts, overrides=overrides), 2 * N, ckpt_path="last")
    assert resumed.ckpt_path == join(root, "ckpts", "last.ckpt")
    ref, res = _training_state(reference), _training_state(resumed)
    for key in ref:
        assert tensors_equal(res[key], ref[key]), key
