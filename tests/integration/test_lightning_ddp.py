"""Real multi-process training on CPU (gloo): DDP with 2 processes and ddp_spawn.

DDP: Lightning's launcher re-runs this module as a script for rank 1, so the DDP run lives in
``main()`` below and the test starts it once with ``python -m`` for both local disk and S3. Each rank writes what its plugin did to a
JSON file: only global rank 0 saves (``Strategy.save_checkpoint`` checks ``is_global_zero``), every
rank loads when resuming. On S3 the endpoint reaches both processes through ``FSSPEC_S3_ENDPOINT_URL``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import fsspec.config
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_ckpt import CheckrunModelCheckpoint
from tests.integration.test_lightning_common import (TinyModel, close_plugins, join, ls,  # noqa: F401
                                                     make_io, tensors_equal, trainer)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class StartStep(Callback):
    """Records the global step each rank (re)started training at (a resumed rank loaded the checkpoint)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def _ddp_fit(root: str, max_steps: int, ckpt_path: str | None) -> dict:
    plugin = make_io()
    start = StartStep()
    mc = CheckrunModelCheckpoint(dirpath=join(root, "ckpts"), every_n_train_steps=2, save_last=True, save_top_k=2,
                                 monitor="step", mode="max")
    t = trainer(root, plugin, callbacks=[mc, start], strategy="ddp", devices=2, max_steps=max_steps)
    t.fit(TinyModel(), ckpt_path=ckpt_path)
    return {"rank": t.global_rank, "saves": plugin.saves, "start": start.step, "global_step": t.global_step,
            "ckpt_path": str(t.ckpt_path), "weights": {k: v.tolist() for k, v in t.lightning_module.state_dict().items()}}


def _ddp_save_then_validate(root: str) -> dict:
    """``trainer.save_checkpoint(p)`` then ``validate(ckpt_path=p)`` on every rank: rank 0 saves
    (asynchronously, ~30 MB so that the write is still going), the barrier after the save lets rank 1
    on at once, and rank 1's load must wait for rank 0's commit (it raised FileNotFoundError)."""
    t = trainer(root, make_io(), strategy="ddp", devices=2, max_steps=1)
    model = TinyModel(hidden=400_000)
    t.fit(model)
    path = join(root, "ckpts", "manual.ckpt")
    t.save_checkpoint(path)
    t.validate(model, ckpt_path=path, verbose=False)
    return {"validated": str(t.ckpt_path) == path}


def main() -> None:
    """Entry point of the DDP run (both ranks): per root, fit 4 steps, then resume from ``last`` to 6."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--roots", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results, rank = {}, None
    for root in args.roots:  # one launch for every backend: starting 2 processes costs most of the time
        first = _ddp_fit(root, 4, None)
        second = _ddp_fit(root, 6, "last")
        third = _ddp_save_then_validate(root)
        results[root], rank = {"first": first, "second": second, "third": third}, first["rank"]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.mark.s3
def test_ddp_two_processes_local_and_s3(tmp_path, s3_root, s3_server, s3_storage_options, monkeypatch) -> None:
    roots = [str(tmp_path / "run"), s3_root]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "FSSPEC_S3_ENDPOINT_URL": s3_server}  # both ranks reach moto through fsspec's env config
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_lightning_ddp", "--roots", *roots,
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3_storage_options))  # for this process's checks
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for root in roots:
        runs = [r[root] for r in ranks]
        assert [r["first"]["saves"] for r in runs] == [4, 0]  # steps 2, 4, each + last.ckpt: rank 0 only
        assert [r["second"]["saves"] for r in runs] == [2, 0]  # step 6 + last.ckpt
        last = join(root, "ckpts", "last.ckpt")
        for r in runs:  # every rank loaded the checkpoint it resumed from
            assert (r["second"]["ckpt_path"], r["second"]["start"], r["second"]["global_step"]) == (last, 4, 6)
        assert runs[0]["second"]["weights"] == runs[1]["second"]["weights"]
        assert [r["third"]["validated"] for r in runs] == [True, True]
        assert ls(join(root, "ckpts")) == [".checkrun", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt",
                                           "manual.ckpt"]  # 4 batches per rank and epoch


def test_ddp_spawn_pickles_plugin_and_returns_weights(tmp_path) -> None:
    """ddp_spawn pickles the Trainer (the plugin drops its engine), rank 0 hands the final weights back
    through ``.temp.ckpt`` (saved lossless and synchronously, loaded and removed in the main process)."""
    plugin = make_io(quantization=[{"pattern": "state_dict.*", "bits": 8, "min_numel": 1}])
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_last=True)
    t = trainer(str(tmp_path), plugin, callbacks=[mc], strategy="ddp_spawn", devices=1, max_steps=4)
    model = TinyModel()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    t.fit(model)
    assert "last.ckpt" in ls(str(tmp_path / "ckpts"))
    assert not tensors_equal(model.state_dict(), initial)  # the main process got the trained weights
    saved = plugin.load_checkpoint(str(tmp_path / "ckpts" / "last.ckpt"))["state_dict"]
    quantized_close = all(torch.allclose(saved[k], v, atol=0.05) for k, v in model.state_dict().items())
    assert quantized_close and not tensors_equal(saved, model.state_dict())  # last.ckpt: 8-bit; .temp: exact
    plugin.teardown()


def test_ddp_spawn_with_the_step_log_saves_top_k_and_last(tmp_path) -> None:
    """A spawned rank's plugin (unpickled, its creator's pid) starts afresh at its first engine use;
    ``save_checkpoint`` read its step log before that, opened the log on the object the reset then
    dropped, and the second save of the same step (last.ckpt) failed: "this optimizer already has
    an open step log" (found by an independent check; ddp_fork the same)."""
    plugin = make_io(step_log=True)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_last=True)
    t = trainer(str(tmp_path), plugin, callbacks=[mc], strategy="ddp_spawn", devices=1, max_steps=5)
    t.fit(TinyModel())
    assert [n for n in ls(str(tmp_path / "ckpts")) if n.endswith(".ckpt")] == ["epoch=0-step=4.ckpt", "last.ckpt"]
    plugin.teardown()


class _CrashAtStep(TinyModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step >= 6:
            raise RuntimeError("crash in a spawned rank")
        return super().training_step(batch, batch_idx)


def test_a_spawned_rank_that_raises_still_removes_what_top_k_dropped(tmp_path) -> None:
    """ddp_spawn: Lightning tears the strategy down in the launching process, so a rank whose fit raises
    ends without the plugin's teardown. A top-k removal waiting for the save in flight (the newer
    checkpoint) was then dropped, and the older checkpoint stayed for good (found by Lightning's own SWA
    test, test_swa_resume_training_from_checkpoint_ddp); it is now made at the rank's exit."""
    plugin = make_io()
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_top_k=1, monitor="step",
                         mode="max")
    t = trainer(str(tmp_path), plugin, callbacks=[mc], strategy="ddp_spawn", devices=1, max_steps=10)
    with pytest.raises(Exception, match="crash in a spawned rank"):
        t.fit(_CrashAtStep(hidden=200_000))  # ~10 MB a save: the removal finds it in flight
    assert [n for n in ls(str(tmp_path / "ckpts")) if n.endswith(".ckpt")] == ["epoch=0-step=6.ckpt"]
    plugin.teardown()


if __name__ == "__main__":
    main()


def test_ranks_that_never_save_keep_no_copy_of_what_they_loaded(tmp_path) -> None:
    """Lightning's and Fabric's strategies save through the plugin on global rank 0 only; every rank's
    engine kept a copy of the row-delta tensors it loaded, for a next incremental save that only rank 0
    makes: a full copy of those tensors per rank for the whole run, as Fabric tears nothing down (found
    by an independent check: +150 MiB per rank after loading a 144 MiB state)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.fabric_ddp_child", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert ranks == [{"exact": True, "streams": 1}, {"exact": True, "streams": 0}]
