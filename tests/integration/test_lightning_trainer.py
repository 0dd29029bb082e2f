"""A real ``Trainer`` with ``CheckrunCheckpointIO`` on local disk and on S3 (moto): ModelCheckpoint
(top-k, every-n-steps, last, link, versioned names), resuming, validate/test/predict from a path,
the tuner's temporary checkpoints, SLURM's hpc checkpoint, metrics and ``load_from_checkpoint``."""
from __future__ import annotations

import csv
import os
import re
import threading

import fsspec
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner

import lightning_ckpt
from ckpt_core import CheckrunError
from lightning_ckpt import CheckrunModelCheckpoint
from ckpt_core.testing.faults import FaultFS as FaultyFS
from tests.integration.test_lightning_common import (TinyDataModule, TinyModel, close_plugins,  # noqa: F401
                                                     files_under, join, lroot, ls, make_io,
                                                     tensors_equal, trainer)

QUANTIZE_WEIGHTS = [{"pattern": "state_dict.*", "method": "uniform", "bits": 8, "min_numel": 1}]


class StartStep(Callback):
    """Records the global step at which training (re)started."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def saved_step(plugin, path: str) -> int:
    """The global step of a committed checkpoint, from its manifest alone (one small read)."""
    return plugin.engine.read_manifest(path).meta["global_step"]


def test_topk_every_n_steps_last_and_resume(lroot) -> None:
    root, opts = lroot
    ckpt_dir = join(root, "ckpts")
    plugin = make_io(storage_options=opts)
    mc = ModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", save_top_k=2, every_n_train_steps=2,
                         save_last=True)
    t = trainer(root, plugin, callbacks=[mc], max_steps=6)
    t.fit(TinyModel())
    kept = sorted(os.path.basename(p) for p in mc.best_k_models)
    assert len(kept) == 2 and ls(ckpt_dir) == sorted([".checkrun", "last.ckpt", *kept])  # the 3rd was removed
    assert sorted(saved_step(plugin, p) for p in mc.best_k_models) == sorted(int(re.search(r"step=(\d+)", n).group(1)) for n in kept)
    state = plugin.load_checkpoint(join(ckpt_dir, "last.ckpt"))
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"} <= state.keys()
    assert state["global_step"] == 6

    # Resume from an explicit path (a top-k file), then from "last", each on a new Trainer.
    best = mc.best_model_path
    start = StartStep()
    t2 = trainer(root, plugin, callbacks=[start], max_steps=7)
    t2.fit(TinyModel(), ckpt_path=best)
    assert start.step == saved_step(plugin, best) and t2.global_step == 7

    start = StartStep()
    # Same settings as ``mc``: Lightning restores its state (best_k_models, last_model_path) on resume.
    mc3 = CheckrunModelCheckpoint(dirpath=ckpt_dir, monitor="train_loss", save_top_k=2, every_n_train_steps=2,
                                  save_last=True)
    t3 = trainer(root, plugin, callbacks=[mc3, start], max_steps=8)
    t3.fit(TinyModel(), ckpt_path="last")
    assert start.step == 6 and t3.global_step == 8
    assert saved_step(plugin, join(ckpt_dir, "last.ckpt")) == 8
    assert len(mc3.best_k_models) == 2 and all(p.startswith(ckpt_dir) for p in mc3.best_k_models)


def test_keep_last_never_removes_last_ckpt(tmp_path) -> None:
    """keep_last counts the other checkpoints only: the one ``ckpt_path="last"`` needs survives."""
    plugin = make_io(keep_last=1, asynchronous=False)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer(str(tmp_path), plugin, callbacks=[mc], max_steps=6).fit(TinyModel())
    # Without protection the save of step=6 would evict last.ckpt (older), then last.ckpt step=6.
    assert ls(str(tmp_path / "ckpts")) == [".checkrun", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert saved_step(plugin, str(tmp_path / "ckpts" / "last.ckpt")) == 6


def test_validate_test_predict_from_checkpoint(lroot) -> None:
    root, opts = lroot
    plugin = make_io(storage_options=opts)
    t = trainer(root, plugin, max_steps=3)
    model = TinyModel()
    t.fit(model)
    path = join(root, "manual.ckpt")
    t.save_checkpoint(path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for fn in ("validate", "test", "predict"):
        fresh = TinyModel()
        out = getattr(trainer(root, plugin), fn)(fresh, ckpt_path=path)
        assert out  # metrics (validate/test) or predictions (predict) were produced
        assert tensors_equal(fresh.state_dict(), saved), fn


def test_versioned_names_across_runs(lroot) -> None:
    root, opts = lroot
    ckpt_dir = join(root, "ckpts")
    plugin = make_io(storage_options=opts)
    for _ in range(2):
        mc = ModelCheckpoint(dirpath=ckpt_dir, filename="model", every_n_train_steps=4, save_last=True)
        trainer(root, plugin, callbacks=[mc], max_steps=4).fit(TinyModel())
    assert ls(ckpt_dir) == [".checkrun", "last-v1.ckpt", "last.ckpt", "model-v1.ckpt", "model.ckpt"]
    assert mc.best_model_path == join(ckpt_dir, "model-v1.ckpt")
    for name in ("last-v1.ckpt", "model.ckpt"):
        assert plugin.load_checkpoint(join(ckpt_dir, name))["global_step"] == 4


def test_versioned_names_in_one_fit_into_a_directory_listed_before(lroot) -> None:
    """On S3 Lightning's ``exists`` answered from the listing s3fs cached when ModelCheckpoint first looked
    at the (non-empty) directory; checkrun writes through a filesystem object of its own, so the stock
    ModelCheckpoint reused "fixed.ckpt" and overwrote a committed checkpoint (found by an independent check;
    stock TorchCheckpointIO writes through Lightning's object, whose cache follows)."""
    import fsspec

    root, opts = lroot
    ckpt_dir = join(root, "ckpts")
    fs, path = fsspec.core.url_to_fs(join(ckpt_dir, "README.txt"), **opts)
    fs.makedirs(path.rpartition("/")[0], exist_ok=True)
    fs.pipe_file(path, b"a file of the user's, so the directory is listed (and cached) at setup")
    plugin = make_io(storage_options=opts)
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="fixed", every_n_train_steps=2, save_top_k=-1, monitor="step",
                         mode="max")
    trainer(root, plugin, callbacks=[mc], max_steps=6).fit(TinyModel())
    assert ls(ckpt_dir) == [".checkrun", "README.txt", "fixed-v1.ckpt", "fixed-v2.ckpt", "fixed.ckpt"]
    steps = [plugin.load_checkpoint(join(ckpt_dir, n))["global_step"] for n in ("fixed.ckpt", "fixed-v1.ckpt",
                                                                                 "fixed-v2.ckpt")]
    assert steps == [2, 4, 6]


def test_versioned_names_while_saves_are_in_flight(tmp_path) -> None:
    """Every save stays pending (storage gate closed) while ModelCheckpoint picks the next name:
    pending saves count as existing files, so names get -v1, -v2, ..., with Lightning's own
    ModelCheckpoint (lightning_ckpt.dropin) as with CheckrunModelCheckpoint."""
    ckpt_dir = f"gatefile://{tmp_path}/ckpts"
    gate = threading.Event()

    class OpenGate(Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            gate.set()

    def fit(checkpoint_class: type) -> ModelCheckpoint:
        FaultyFS.reset()
        FaultyFS.gate = gate
        gate.clear()
        try:
            mc = checkpoint_class(dirpath=ckpt_dir, filename="{epoch}", monitor="step", mode="max", save_top_k=-1,
                                  every_n_train_steps=2)
            trainer(str(tmp_path), plugin, callbacks=[mc, OpenGate()], max_steps=8).fit(TinyModel())
            return mc
        finally:
            gate.set()
            FaultyFS.reset()

    plugin = make_io(max_pending=4)
    names = ["epoch=0.ckpt", "epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0-v3.ckpt"]
    for checkpoint_class in (ModelCheckpoint, CheckrunModelCheckpoint):
        mc = fit(checkpoint_class)
        assert sorted(mc.best_k_models) == sorted(f"{ckpt_dir}/{n}" for n in names)
        steps = sorted(plugin.load_checkpoint(f"{ckpt_dir}/{n}")["global_step"] for n in names)
        assert steps == [2, 4, 6, 8]
        for n in names:
            plugin.remove_checkpoint(f"{ckpt_dir}/{n}")


def test_save_last_true_repeats_the_topk_save_in_flight(tmp_path) -> None:
    """``save_last=True`` saves the state twice at one step; with every write held (storage gate
    closed for the whole fit) and the default one ``max_pending`` slot, the last.ckpt save still
    returns: it repeats the top-k save in flight (``ckpt_core.saving.repeat``) instead of waiting
    for it. Both files then hold the same tensors, bit for bit."""
    ckpt_dir = f"gatefile://{tmp_path}/ckpts"
    gate = threading.Event()
    pending_at_end: list[int] = []
    plugin = make_io()

    class OpenGate(Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            pending_at_end.append(plugin.engine.pending)
            gate.set()

    FaultyFS.reset()
    FaultyFS.gate = gate
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            mc = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=True)
            trainer(str(tmp_path), plugin, callbacks=[mc, OpenGate()], max_steps=2).fit(TinyModel())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        runner = threading.Thread(target=fit, daemon=True)
        runner.start()
        runner.join(120)  # watchdog only: a save that waited for the held one would never return
        assert not runner.is_alive(), "the last.ckpt save waited for the top-k save held at the gate"
    finally:
        gate.set()
        FaultyFS.reset()
    assert not errors, errors
    assert pending_at_end == [2]  # both saves were in flight together
    topk = plugin.load_checkpoint(f"{ckpt_dir}/epoch=0-step=2.ckpt")
    last = plugin.load_checkpoint(f"{ckpt_dir}/last.ckpt")
    assert topk["global_step"] == last["global_step"] == 2
    assert tensors_equal(topk["state_dict"], last["state_dict"])
    assert tensors_equal(topk["optimizer_states"], last["optimizer_states"])


def test_save_last_link(tmp_path) -> None:
    ckpt_dir = str(tmp_path / "ckpts")
    plugin = make_io()
    mc = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, monitor="step", mode="max", every_n_train_steps=2,
                         save_last="link")
    trainer(str(tmp_path), plugin, callbacks=[mc], max_steps=6).fit(TinyModel())
    last = os.path.join(ckpt_dir, "last.ckpt")
    assert os.path.islink(last) and os.path.realpath(last) == os.path.realpath(mc.best_model_path)
    assert plugin.load_checkpoint(last)["global_step"] == 6
    start = StartStep()
    mc2 = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1, monitor="step", mode="max", save_last="link")
    t = trainer(str(tmp_path), plugin, callbacks=[mc2, start], max_steps=8)
    t.fit(TinyModel(), ckpt_path="last")
    assert start.step == 6 and t.global_step == 8


def _hold_commit(monkeypatch, held_name: str) -> threading.Event:
    """Hold the manifest commit of ``held_name`` until the returned event is set."""
    from ckpt_core.saving import commit as commit_module

    release, publish = threading.Event(), commit_module.publish_manifest

    def held(store, name, *args, **kwargs):
        if name == held_name:
            assert release.wait(120)  # watchdog only
        return publish(store, name, *args, **kwargs)

    monkeypatch.setattr(commit_module, "publish_manifest", held)
    return release


def test_save_last_link_points_at_a_committed_checkpoint_while_the_newest_is_in_flight(tmp_path, monkeypatch) -> None:
    """``save_last="link"``: Lightning swaps the link to the top-k file it just saved; with that save in flight,
    a kill before its commit left ``last.ckpt`` pointing at nothing, and ``fit(ckpt_path="last")`` started
    from scratch although older checkpoints were committed (found by an independent check). The link is
    swapped once the save commits; until then it points at the previous checkpoint."""
    ckpt_dir = tmp_path / "ckpts"
    last = ckpt_dir / "last.ckpt"
    release, seen = _hold_commit(monkeypatch, "step=4.ckpt"), []
    plugin = make_io()

    class Look(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 4 and not seen:  # the save of step 4 is held at its commit
                seen.append(os.readlink(last))
                release.set()
                plugin.wait()
                seen.append(os.readlink(last))

    mc = ModelCheckpoint(dirpath=str(ckpt_dir), filename="{step}", every_n_train_steps=2, save_top_k=-1,
                         save_last="link")
    try:
        trainer(str(tmp_path), plugin, callbacks=[mc, Look()], max_steps=6).fit(TinyModel())
    finally:
        release.set()
    assert seen == ["step=2.ckpt", "step=4.ckpt"]
    assert os.readlink(last) == "step=6.ckpt" and plugin.load_checkpoint(str(last))["global_step"] == 6


def test_a_removal_waiting_for_a_save_is_made_when_that_save_commits(tmp_path, monkeypatch) -> None:
    """``ModelCheckpoint`` removes the old top-k file right after saving the new one; with that save in flight the
    removal waited for the plugin's next call (the next save), so a kill in between, nearly any kill, left the old
    file for good: one extra file per kill (found by an independent kill/resume loop). It is made as the save
    commits, on the engine's thread."""
    ckpt_dir = tmp_path / "ckpts"
    release, seen = _hold_commit(monkeypatch, "step=4.ckpt"), []
    plugin = make_io()

    class Look(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 4 and not seen:  # step=4 held at its commit; step=2's removal waits
                seen.append((ckpt_dir / "step=2.ckpt").exists())
                handle = plugin.pending_save(str(ckpt_dir / "step=4.ckpt"))
                release.set()
                handle.wait()  # no call into the plugin: the removal is the engine thread's
                seen.append((ckpt_dir / "step=2.ckpt").exists())

    mc = ModelCheckpoint(dirpath=str(ckpt_dir), filename="{step}", every_n_train_steps=2, save_top_k=1,
                         monitor="step", mode="max")
    try:
        trainer(str(tmp_path), plugin, callbacks=[mc, Look()], max_steps=6).fit(TinyModel())
    finally:
        release.set()
    assert seen == [True, False]
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["step=6.ckpt"]


def test_the_removal_and_the_link_swap_come_right_at_the_commit_link_first(tmp_path, monkeypatch) -> None:
    """They waited for the commit's retention and collection (8-18 ms locally, up to 0.3 s on S3): a kill
    there left the old top-k file for good; and the removal came before the link swap, so ``last.ckpt``
    pointed at a removed file in between (found by an independent check). Both are made as the save commits,
    the link first."""
    from ckpt_core import CheckpointEngine
    from ckpt_core.saving import coordinator

    ckpt_dir, seen = tmp_path / "ckpts", []
    after, remove = coordinator.after_commit, CheckpointEngine.remove

    def look_after(store, name, *args, **kwargs):  # retention and gc of each commit start here
        if name == "step=4.ckpt":
            seen.append(("after commit", (ckpt_dir / "step=2.ckpt").exists(), os.readlink(ckpt_dir / "last.ckpt")))
        return after(store, name, *args, **kwargs)

    def look_remove(self, path, *args, **kwargs):
        if str(path).endswith("step=2.ckpt"):
            seen.append(("removal", os.readlink(ckpt_dir / "last.ckpt")))
        return remove(self, path, *args, **kwargs)

    monkeypatch.setattr(coordinator, "after_commit", look_after)
    monkeypatch.setattr(CheckpointEngine, "remove", look_remove)
    release = _hold_commit(monkeypatch, "step=4.ckpt")  # so that the removal of step=2 waits for its commit

    class Release(Callback):
        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step == 4:
                release.set()

    mc = ModelCheckpoint(dirpath=str(ckpt_dir), filename="{step}", every_n_train_steps=2, save_top_k=1,
                         monitor="step", mode="max", save_last="link")
    try:
        trainer(str(tmp_path), make_io(max_pending=2), callbacks=[mc, Release()], max_steps=6).fit(TinyModel())
    finally:
        release.set()
    # (Lightning asks for the removal of step=2 again later: the file is gone by then, nothing to do)
    assert seen[:2] == [("removal", "step=4.ckpt"), ("after commit", False, "step=4.ckpt")]
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["last.ckpt", "step=6.ckpt"]


@pytest.mark.parametrize("callback", [ModelCheckpoint, CheckrunModelCheckpoint])
def test_a_name_whose_removal_waits_is_free_as_after_stock_removal(tmp_path, monkeypatch, callback) -> None:
    """``ModelCheckpoint`` asks whether a file name is taken (``-v1`` if so); a file it removed while a save was
    in flight was still there, so the name counted as taken: names got ``-v1`` depending on timing, where
    stock reuses the name (found by an independent check)."""
    ckpt_dir = tmp_path / "ckpts"
    release = _hold_commit(monkeypatch, "flip=1.ckpt")  # the removal of flip=0 waits for its commit

    class Flip(TinyModel):
        def training_step(self, batch, batch_idx):
            self.log("flip", float(self.global_step % 2))
            return super().training_step(batch, batch_idx)

    class Release(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 3:  # after ModelCheckpoint's: flip=0 of step 2 named while flip=1 was held
                release.set()

    mc = callback(dirpath=str(ckpt_dir), filename="{flip:.0f}", every_n_train_steps=1, save_top_k=1)
    try:
        trainer(str(tmp_path), make_io(max_pending=2), callbacks=[mc, Release()], max_steps=3).fit(Flip())
    finally:
        release.set()
    assert mc.best_model_path == str(ckpt_dir / "flip=0.ckpt")  # step 2's save, under its own name
    assert sorted(p.name for p in ckpt_dir.glob("*.ckpt")) == ["flip=0.ckpt"]


def test_last_on_remote_storage(s3_root, s3_storage_options, monkeypatch) -> None:
    """Lightning's ModelCheckpoint drops the scheme of remote listings, so ``ckpt_path="last"`` on S3
    finds nothing (it warns and starts from scratch); CheckrunModelCheckpoint finds it."""
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(s3_storage_options))
    ckpt_dir = join(s3_root, "ckpts")
    plugin = make_io()  # the endpoint comes from fsspec's config alone
    mc = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_last=True)
    with pytest.warns(UserWarning, match="Use lightning_ckpt.CheckrunModelCheckpoint"):  # told at the first save
        trainer(s3_root, plugin, callbacks=[mc], max_steps=3).fit(TinyModel())
    assert "last.ckpt" in ls(ckpt_dir)

    start = StartStep()
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        trainer(s3_root, plugin, callbacks=[ModelCheckpoint(dirpath=ckpt_dir), start], max_steps=4).fit(
            TinyModel(), ckpt_path="last")
    assert start.step == 0  # Lightning's own behaviour on remote storage

    start = StartStep()
    t = trainer(s3_root, plugin, callbacks=[CheckrunModelCheckpoint(dirpath=ckpt_dir), start], max_steps=5)
    t.fit(TinyModel(), ckpt_path="last")
    assert start.step == 3 and t.ckpt_path == join(ckpt_dir, "last.ckpt")


def test_tuner_temporary_checkpoints_are_lossless_and_cleaned(lroot) -> None:
    root, opts = lroot
    plugin = make_io(storage_options=opts, quantization=QUANTIZE_WEIGHTS)
    model = TinyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tuner = Tuner(trainer(root, plugin, max_steps=20))
    tuner.lr_find(model, min_lr=1e-4, max_lr=1e-1, num_training=4, update_attr=False)
    assert tensors_equal(model.state_dict(), before)  # restored exactly: the 8-bit rule was not used
    tuner = Tuner(trainer(root, plugin, max_steps=20))
    tuner.scale_batch_size(model, mode="power", steps_per_trial=1, max_trials=2, init_val=2)
    assert tensors_equal(model.state_dict(), before)
    assert files_under(root) == []  # no temporary manifest left, and no blob of one
    if not opts:  # nor the empty folders they were in: the directory is as Lightning's tuner leaves it
        assert os.listdir(root) == []


def test_hpc_checkpoint_is_synchronous_and_lossless(tmp_path) -> None:
    plugin = make_io(quantization=QUANTIZE_WEIGHTS)
    t = trainer(str(tmp_path), plugin, max_steps=2)
    model = TinyModel()
    t.fit(model)
    path = t._checkpoint_connector.hpc_save_path(str(tmp_path))
    assert os.path.basename(path) == "hpc_ckpt_1.ckpt"
    t.save_checkpoint(path)
    assert os.path.exists(path)  # committed before save_checkpoint returned
    assert tensors_equal(plugin.load_checkpoint(path)["state_dict"], model.state_dict())
    regular = str(tmp_path / "regular.ckpt")
    t.save_checkpoint(regular)
    assert not tensors_equal(plugin.load_checkpoint(regular)["state_dict"], model.state_dict())  # quantized

    # A failing hpc save raises from save_checkpoint itself: nothing is left in the background.
    FaultyFS.reset()
    FaultyFS.fail_writes = OSError("injected write failure")
    try:
        with pytest.raises(CheckrunError, match="injected write failure"):
            t.save_checkpoint(f"gatefile://{tmp_path}/bad/hpc_ckpt_2.ckpt")
    finally:
        FaultyFS.reset()


def test_checkpoint_metrics_are_logged(tmp_path) -> None:
    plugin = make_io()
    metrics = lightning_ckpt.CheckpointMetrics()
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_top_k=-1, every_n_train_steps=2)
    logger = CSVLogger(str(tmp_path), name="logs", version=0)
    trainer(str(tmp_path), plugin, callbacks=[mc, metrics], logger=logger, max_steps=8).fit(TinyModel())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("checkrun/written_bytes")]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    for r in rows:
        assert float(r["checkrun/written_bytes"]) > 0 and float(r["checkrun/tensor_bytes"]) > 0
        assert float(r["checkrun/blocking_seconds"]) >= 0 and float(r["checkrun/compression_ratio"]) > 0
    assert len(metrics.history) == 4 and all(i.path.endswith(".ckpt") for i in metrics.history)


def test_load_from_checkpoint_module_and_datamodule(lroot) -> None:
    root, opts = lroot
    plugin = make_io(storage_options=opts)
    model, dm = TinyModel(hidden=6, lr=0.01), TinyDataModule(note="saved")
    t = trainer(root, plugin, max_steps=3)
    t.fit(model, datamodule=dm)
    path = join(root, "final.ckpt")
    t.save_checkpoint(path)
    loaded = lightning_ckpt.load_from_checkpoint(TinyModel, path, storage_options=opts, lr=0.5)
    assert loaded.hparams.hidden == 6 and loaded.hparams.lr == 0.5
    assert tensors_equal(loaded.state_dict(), model.state_dict())
    dm2 = lightning_ckpt.load_from_checkpoint(TinyDataModule, path, storage_options=opts)
    assert dm2.hparams.note == "saved" and dm2.served == dm.served == 1
    if not root.startswith("s3://"):  # Lightning's own loader reads checkrun files (lightning_ckpt.dropin)
        assert tensors_equal(TinyModel.load_from_checkpoint(path).state_dict(), model.state_dict())
    with pytest.raises(TypeError):
        lightning_ckpt.load_from_checkpoint(torch.nn.Linear, path)
