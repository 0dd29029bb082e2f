"""Drop-in: Lightning users' habits keep working with checkrun (issue 19, points 2, 3, 4, 5 and 9).

Every test uses a real Trainer (or Fabric) on CPU with tiny models. Saves are held "in flight" by gated
storage (``gatefile://``, ckpt_core.testing.faults) where the outcome depends on it; the gate opens when a
loader starts waiting for the save (``open_gate_on_wait``), so a loader that does not wait sees no
checkpoint and fails, and one that waits gets it - no sleeps, no timing.
"""
from __future__ import annotations

import errno
import io
import os
import re
import signal
import threading
from typing import Any, Callable

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.utilities import cloud_io
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import ckpt_core
import lightning_ckpt
from ckpt_core import UnsafeLoadError
from ckpt_core.saving import inflight
from lightning_ckpt import dropin
from ckpt_core.testing.faults import FaultFS as FaultyFS
from ckpt_core.testing.faults import Permanent
from tests.integration.test_lightning_common import (TinyDataModule, TinyModel, close_plugins,  # noqa: F401
                                                     ls, make_io, tensors_equal, trainer)
from tests.integration.test_lightning_examples import EXAMPLES, manifest, run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain_trainer(**kwargs: Any) -> Trainer:
    """A quiet CPU Trainer WITHOUT the checkrun plugin (Lightning's TorchCheckpointIO)."""
    defaults: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                    enable_model_summary=False, enable_checkpointing=False, max_epochs=-1,
                                    num_sanity_val_steps=0)
    defaults.update(kwargs)
    return Trainer(**defaults)


def checkrun_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("checkrun"))


@pytest.fixture
def open_gate_on_wait(gate, monkeypatch) -> threading.Event:
    """Open the gate as soon as anything waits for a save in flight (``ckpt_core.saving.inflight.wait``)."""
    original = inflight.wait

    def wait(url: str, timeout: float | None = None) -> bool:
        gate.set()
        return original(url, timeout)

    monkeypatch.setattr(inflight, "wait", wait)
    return gate


def saved_in_flight(tmp_path, name: str = "final.ckpt") -> tuple[str, TinyModel, TinyDataModule]:
    """Fit 3 steps with the plugin, then ``trainer.save_checkpoint`` to gated storage: returned in flight."""
    model, dm = TinyModel(hidden=6, lr=0.01), TinyDataModule(note="saved")
    t = trainer(str(tmp_path), make_io(), max_steps=3)
    t.fit(model, datamodule=dm)
    path = f"gatefile://{tmp_path}/ckpts/{name}"
    t.save_checkpoint(path)
    assert ckpt_core.save_in_flight(path) and not os.path.exists(f"{tmp_path}/ckpts/{name}")
    return path, model, dm


# ------------------------------------------------------------------------------------------------ point 2
LOADERS: dict[str, Callable[[Trainer, "Probe", str], Any]] = {
    "fit": lambda t, m, p: t.fit(m, ckpt_path=p),
    "validate": lambda t, m, p: t.validate(m, ckpt_path=p),
    "test": lambda t, m, p: t.test(m, ckpt_path=p),
    "predict": lambda t, m, p: t.predict(m, ckpt_path=p),
}


class Probe(TinyModel):
    """Records the ``global_step`` of the checkpoint a Trainer restored into it."""

    restored_step = -1

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.restored_step = checkpoint["global_step"]


@pytest.mark.parametrize("with_plugin", [True, False], ids=["plugin", "no-plugin"])
@pytest.mark.parametrize("how", list(LOADERS))
def test_another_trainer_loads_a_save_in_flight(tmp_path, open_gate_on_wait, how: str, with_plugin: bool) -> None:
    path, model, _ = saved_in_flight(tmp_path)
    other = trainer(None, make_io(), max_steps=4) if with_plugin else plain_trainer(max_steps=4)
    probe = Probe(hidden=6, lr=0.01)
    LOADERS[how](other, probe, path)
    assert probe.restored_step == 3
    if how != "fit":
        assert tensors_equal(probe.state_dict(), model.state_dict())


@pytest.mark.parametrize("how", ["lightning_ckpt.load_from_checkpoint", "LightningModule.load_from_checkpoint",
                                 "ckpt_core.load", "cloud_io._load"])
def test_loaders_get_a_save_in_flight(tmp_path, open_gate_on_wait, how: str) -> None:
    path, model, _ = saved_in_flight(tmp_path)
    if how == "lightning_ckpt.load_from_checkpoint":
        state = lightning_ckpt.load_from_checkpoint(TinyModel, path).state_dict()
    elif how == "LightningModule.load_from_checkpoint":
        state = TinyModel.load_from_checkpoint(path).state_dict()
    elif how == "ckpt_core.load":
        state = ckpt_core.load(path)["state_dict"]
    else:
        state = cloud_io._load(path)["state_dict"]
    assert tensors_equal(state, model.state_dict())


# ------------------------------------------------------------------------------------------------ point 3
class HoldSaves(Callback):
    """Keeps the storage gate closed from the start of training to its end: every save of the fit is in
    flight while ModelCheckpoint picks the next name."""

    def __init__(self, gate: threading.Event, plugin: lightning_ckpt.CheckrunCheckpointIO, saves: int) -> None:
        self.gate, self.plugin, self.saves = gate, plugin, saves

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.gate.clear()

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        assert self.plugin.engine.pending == self.saves
        self.gate.set()


def test_stock_model_checkpoint_sees_saves_in_flight(tmp_path, gate) -> None:
    """Four saves, all in flight while Lightning's own ModelCheckpoint picks the next name: each gets its
    own file (-v1, -v2, -v3), as with synchronous saves; before, all four went to ``epoch=0.ckpt``."""
    ckpt_dir = f"gatefile://{tmp_path}/ckpts"
    plugin = make_io(max_pending=4)
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", monitor="step", mode="max", save_top_k=-1,
                         every_n_train_steps=2)
    trainer(str(tmp_path), plugin, callbacks=[mc, HoldSaves(gate, plugin, 4)], max_steps=8).fit(TinyModel())
    names = ["epoch=0.ckpt", "epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0-v3.ckpt"]
    assert sorted(mc.best_k_models) == sorted(f"{ckpt_dir}/{n}" for n in names)
    assert ls(str(tmp_path / "ckpts")) == sorted([".checkrun", *names])
    assert sorted(plugin.load_checkpoint(f"{ckpt_dir}/{n}")["global_step"] for n in names) == [2, 4, 6, 8]


def test_stock_model_checkpoint_rerun_fit_keeps_every_checkpoint(tmp_path, gate) -> None:
    """The issue's case: ``fit`` run again on the same Trainer with ``save_top_k=-1`` and names that repeat
    within an epoch: four checkpoints, not two."""
    ckpt_dir = f"gatefile://{tmp_path}/ckpts"
    plugin = make_io(max_pending=4)
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", monitor="step", mode="max", save_top_k=-1,
                         every_n_train_steps=4)
    t = trainer(str(tmp_path), plugin, callbacks=[mc, HoldSaves(gate, plugin, 2)], max_steps=8)
    t.fit(TinyModel())
    t.fit_loop.epoch_loop.max_steps = 16  # 8 steps per epoch: the second fit trains epoch 1
    t.fit(TinyModel())
    names = ["epoch=0.ckpt", "epoch=0-v1.ckpt", "epoch=1.ckpt", "epoch=1-v1.ckpt"]
    assert ls(str(tmp_path / "ckpts")) == sorted([".checkrun", *names])
    assert sorted(mc.best_k_models) == sorted(f"{ckpt_dir}/{n}" for n in names)


class FailSavesFrom(Callback):
    """At ``global_step == step``: wait until every save so far is committed, then make every later
    write fail with ENOSPC (the disk is full)."""

    def __init__(self, plugin: lightning_ckpt.CheckrunCheckpointIO, step: int) -> None:
        self.plugin, self.step = plugin, step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.plugin.wait()
            FaultyFS.policy = Permanent(OSError(errno.ENOSPC, "No space left on device"), ops=("open",))


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_failed_save_keeps_the_checkpoint_model_checkpoint_removes_after_it(tmp_path, background: str) -> None:
    """ModelCheckpoint removes the previous top-k file right after save_checkpoint returns; with an
    asynchronous save that later fails (disk full), the removal must not happen: as with
    TorchCheckpointIO, whose torch.save raises before the removal, the committed checkpoint stays.
    Before: step 5's checkpoint was removed and step 10's save failed: no checkpoint left. A run whose
    saves commit still ends with the newest file only (the removal waits, then is made)."""
    for fail in (True, False):
        root = tmp_path / ("fail" if fail else "ok")
        ckpt_dir = f"faultfile://{root}/ckpts"
        plugin = make_io(overrides={"saving.background": background})
        mc = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=1)
        callbacks = [mc, FailSavesFrom(plugin, 7)] if fail else [mc]
        t = trainer(str(root), plugin, callbacks=callbacks, max_steps=12)
        try:
            if fail:
                with pytest.raises(ckpt_core.BackgroundSaveError, match="No space left"):
                    t.fit(TinyModel())
            else:
                t.fit(TinyModel())
        finally:
            FaultyFS.reset()
        names = ls(str(root / "ckpts"))
        step = 5 if fail else 10
        assert len(names) == 2 and names[0] == ".checkrun" and names[1].endswith(f"-step={step}.ckpt"), names
        assert make_io().load_checkpoint(f"{root}/ckpts/{names[1]}")["global_step"] == step


@pytest.mark.parametrize("save_last", [False, "link"])
def test_a_save_that_failed_before_its_removal_was_asked_for_keeps_the_checkpoint(tmp_path, monkeypatch,
                                                                                  save_last) -> None:
    """The same when the save fails fast, before ModelCheckpoint asks for the removal: no save was in flight
    any more, so the removal was made at once and no checkpoint was left (seen once in a full test run);
    and ``save_last="link"`` swapped last.ckpt to the failed file (an independent check)."""
    from ckpt_core.storage.store import Store

    ckpt_dir, plugin, full = tmp_path / "ckpts", make_io(), threading.Event()
    save, commit = lightning_ckpt.CheckrunCheckpointIO.save_checkpoint, Store.write_manifest

    def save_and_settle(self, checkpoint, path, storage_options=None):  # the save's outcome known at return
        save(self, checkpoint, path, storage_options)
        handle = self.pending_save(path)
        if handle is not None:
            handle.wait()

    def disk_full(self, name, *args, **kwargs):  # from step 7 on, no checkpoint commits
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device", name)
        return commit(self, name, *args, **kwargs)

    class Fill(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 7:
                plugin.wait()
                full.set()

    monkeypatch.setattr(lightning_ckpt.CheckrunCheckpointIO, "save_checkpoint", save_and_settle)
    monkeypatch.setattr(Store, "write_manifest", disk_full)
    mc = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_top_k=1, save_last=save_last)
    with pytest.raises(ckpt_core.BackgroundSaveError, match="No space left"):
        trainer(str(tmp_path), plugin, callbacks=[mc, Fill()], max_steps=12).fit(TinyModel())
    names = sorted(os.listdir(ckpt_dir))
    assert names == [".checkrun", "epoch=0-step=5.ckpt", *(["last.ckpt"] if save_last else [])], names
    assert make_io().load_checkpoint(str(ckpt_dir / "epoch=0-step=5.ckpt"))["global_step"] == 5
    if save_last:
        assert os.readlink(ckpt_dir / "last.ckpt") == "epoch=0-step=5.ckpt"


def test_hooks_are_installed_once_and_defer_to_lightning() -> None:
    import lightning.fabric.plugins.io.torch_io as torch_io
    import lightning.pytorch.core.saving as saving

    assert dropin.installed()
    hooked = cloud_io._load
    dropin.install()
    dropin.install()
    assert cloud_io._load is hooked is saving.pl_load is torch_io.pl_load
    original = getattr(hooked, "__checkrun_original__")
    assert getattr(original, "__checkrun_original__", None) is None  # wraps Lightning's function, once
    assert original.__module__ == "lightning.fabric.utilities.cloud_io"
    assert getattr(ModelCheckpoint.file_exists, "__checkrun_original__").__qualname__ == "ModelCheckpoint.file_exists"
    dropin.uninstall()
    try:
        assert cloud_io._load is original is saving.pl_load and not dropin.installed()
    finally:
        dropin.install()
    assert dropin.installed()


# ------------------------------------------------------------------------------------------------ point 4
@pytest.fixture
def committed(tmp_path) -> tuple[str, TinyModel, TinyDataModule]:
    model, dm = TinyModel(hidden=6, lr=0.01), TinyDataModule(note="saved")
    plugin = make_io()
    t = trainer(str(tmp_path), plugin, max_steps=3)
    t.fit(model, datamodule=dm)
    path = str(tmp_path / "final.ckpt")
    t.save_checkpoint(path)
    plugin.wait()
    assert lightning_ckpt.is_checkrun_file(path)
    return path, model, dm


def test_lightning_load_from_checkpoint_reads_checkrun(committed) -> None:
    path, model, dm = committed
    loaded = TinyModel.load_from_checkpoint(path, lr=0.5)
    assert loaded.hparams.hidden == 6 and loaded.hparams.lr == 0.5
    assert tensors_equal(loaded.state_dict(), model.state_dict())
    dm2 = TinyDataModule.load_from_checkpoint(path)
    assert dm2.hparams.note == "saved" and dm2.served == dm.served == 1
    raw = cloud_io._load(path, map_location="cpu")
    assert raw["global_step"] == 3 and tensors_equal(raw["state_dict"], model.state_dict())


def test_trainer_without_plugin_resumes_from_checkrun(committed) -> None:
    path, model, _ = committed
    probe = Probe(hidden=6, lr=0.01)
    plain_trainer(max_steps=5).fit(probe, ckpt_path=path)
    assert probe.restored_step == 3
    probe = Probe(hidden=6, lr=0.01)
    plain_trainer().validate(probe, ckpt_path=path, verbose=False)
    assert tensors_equal(probe.state_dict(), model.state_dict())


class Payload:
    """Not plain data: loading it needs pickle (refused unless the caller opts in)."""

    def __init__(self, value: int) -> None:
        self.value = value


class WithPayload(TinyModel):
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["payload"] = Payload(7)


def test_weights_only_semantics_are_kept(tmp_path) -> None:
    plugin = make_io()
    t = trainer(str(tmp_path), plugin, max_steps=1)
    t.fit(WithPayload())
    path = str(tmp_path / "payload.ckpt")
    t.save_checkpoint(path)
    with pytest.raises(UnsafeLoadError):
        WithPayload.load_from_checkpoint(path)  # weights_only=None: nothing unpickled
    with pytest.raises(UnsafeLoadError):
        cloud_io._load(path, weights_only=True)
    assert cloud_io._load(path, weights_only=False)["payload"].value == 7
    assert WithPayload.load_from_checkpoint(path, weights_only=False).hparams.hidden == 8


def test_torch_files_still_go_to_lightning(tmp_path) -> None:
    """A TorchCheckpointIO checkpoint, a file object and a missing path behave exactly as without checkrun."""
    model = TinyModel(hidden=5)
    t = plain_trainer(max_steps=2, default_root_dir=str(tmp_path))
    t.fit(model)
    path = str(tmp_path / "torch.ckpt")
    t.save_checkpoint(path)
    assert not lightning_ckpt.is_checkrun_file(path)
    assert tensors_equal(TinyModel.load_from_checkpoint(path).state_dict(), model.state_dict())
    with open(path, "rb") as f:
        assert cloud_io._load(io.BytesIO(f.read()))["global_step"] == 2
    with pytest.raises(FileNotFoundError):
        TinyModel.load_from_checkpoint(str(tmp_path / "missing.ckpt"))
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        plain_trainer().validate(TinyModel(hidden=5), ckpt_path=str(tmp_path / "missing.ckpt"), verbose=False)


def test_torch_load_of_a_manifest_fails_as_documented(committed) -> None:
    """``torch.load`` itself cannot read a manifest; docs/troubleshooting.md gives the error and the fix."""
    path, _, _ = committed
    import pickle

    with pytest.raises(pickle.UnpicklingError, match=re.escape("invalid load key, '{'")):
        torch.load(path, weights_only=False)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported operand 123"):
        torch.load(path)
    with open(os.path.join(ROOT, "docs", "troubleshooting.md")) as f:
        doc = f.read()
    assert "invalid load key, '{'" in doc and "Unsupported operand 123" in doc


# ------------------------------------------------------------------------------------------------ point 5
@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_no_thread_left_after_saves_outside_fit(tmp_path, asynchronous: bool) -> None:
    assert checkrun_threads() == []
    plugin = make_io(asynchronous=asynchronous)
    t = trainer(str(tmp_path), plugin, max_steps=2)
    t.fit(TinyModel())
    assert checkrun_threads() == []  # teardown closed the engine
    for i in range(2):  # the second save is incremental: its reuse checks use the storage's thread pool
        t.save_checkpoint(str(tmp_path / f"after-fit-{i}.ckpt"))
    if asynchronous:
        plugin.wait()
    assert checkrun_threads() == []
    t.validate(TinyModel(), verbose=False)
    t.save_checkpoint(str(tmp_path / "after-validate.ckpt"))
    if asynchronous:
        ckpt_core.wait_for_save(str(tmp_path / "after-validate.ckpt"))
        plugin.wait()
    assert checkrun_threads() == []
    assert ckpt_core.load(str(tmp_path / "after-validate.ckpt"))["global_step"] == 2


@pytest.mark.parametrize("step_log", [False, True], ids=["plain", "step-log"])
@pytest.mark.parametrize("pools_first", [True, False], ids=["pools-first", "owner-first"])
def test_threads_left_by_saves_outside_fit_end_when_a_thread_police_stops_them(tmp_path, pools_first, step_log) -> None:
    """Lightning's own tests end with a check that stops every daemon thread a test left that has a
    callable ``stop`` (and expects it dead after), lets ``ThreadPoolExecutor-`` threads be, and fails
    on any other thread ("Test left zombie thread"). A save outside ``fit`` without a wait used to
    leave checkrun's coordinator and workers for 30 s: those tests failed at teardown. Checked here
    in both orders the police may visit the threads in; the saves commit before their threads end.
    With ``step_log`` the save after ``fit`` starts a step log: its threads stop by closing it."""
    before = set(threading.enumerate())
    plugin = make_io(step_log=step_log)
    t = trainer(str(tmp_path), plugin, max_steps=2)
    t.fit(TinyModel())
    big = {"w": torch.randn(1024, 512)}  # > 1 MiB: the snapshot's copy helper runs too
    plugin.save_checkpoint({"state_dict": big, "global_step": 7}, str(tmp_path / "outside.ckpt"))
    t.save_checkpoint(str(tmp_path / "after-fit.ckpt"))  # no wait: the test ends here
    left = sorted(set(threading.enumerate()) - before, key=lambda th: ("ThreadPoolExecutor-" in th.name) != pools_first)
    assert any(th.name.startswith("checkrun-coordinator") for th in left)
    for th in left:
        stop = getattr(th, "stop", None)
        if th.daemon and callable(stop):
            stop()
            assert not th.is_alive(), th.name
        else:
            assert "ThreadPoolExecutor-" in th.name, f"a thread the police would call a zombie: {th.name}"
    assert checkrun_threads() == []
    assert ckpt_core.load(str(tmp_path / "after-fit.ckpt"))["global_step"] == 2
    assert tensors_equal(ckpt_core.load(str(tmp_path / "outside.ckpt"))["state_dict"], big)


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_no_thread_left_after_fabric_saves(tmp_path, asynchronous: bool) -> None:
    plugin = make_io(asynchronous=asynchronous)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(torch.nn.Linear(64, 64))
    big = torch.nn.Linear(1024, 512)  # > 1 MiB: the snapshot splits its copy with a helper thread
    for step in range(3):
        fabric.save(str(tmp_path / "fabric.ckpt"), {"model": model, "big": big.state_dict(), "step": step})
    if asynchronous:
        plugin.wait()
    assert checkrun_threads() == []
    state = {"model": model, "big": {}, "step": -1}
    fabric.load(str(tmp_path / "fabric.ckpt"), state)
    assert state["step"] == 2 and tensors_equal(state["big"], big.state_dict())
    assert checkrun_threads() == []


# ------------------------------------------------------------------------------------------------ point 9
@pytest.mark.parametrize("fn", ["fit", "validate"])
def test_a_missing_ckpt_path_fails_with_lightnings_message(tmp_path, fn: str) -> None:
    """Code written against Lightning matches on its ``FileNotFoundError`` text."""
    missing = str(tmp_path / "non_existing.ckpt")
    t = trainer(str(tmp_path), make_io(), max_steps=1)
    with pytest.raises(FileNotFoundError, match=f"^Checkpoint file not found: {re.escape(missing)}$"):
        getattr(t, fn)(TinyModel(), ckpt_path=missing)


def test_lightning_ckpt_load_from_checkpoint_accepts_torch_files(tmp_path) -> None:
    model, dm = TinyModel(hidden=5), TinyDataModule(note="torch")
    t = plain_trainer(max_steps=2, default_root_dir=str(tmp_path))
    t.fit(model, datamodule=dm)
    path = str(tmp_path / "torch.ckpt")
    t.save_checkpoint(path)
    loaded = lightning_ckpt.load_from_checkpoint(TinyModel, path)
    assert loaded.hparams.hidden == 5 and tensors_equal(loaded.state_dict(), model.state_dict())
    assert lightning_ckpt.load_from_checkpoint(TinyDataModule, path).hparams.note == "torch"
    assert lightning_ckpt.load_checkpoint_dict(path)["global_step"] == 2


def test_torch_files_larger_than_a_manifest_may_be_load(tmp_path) -> None:
    """A torch.save checkpoint over checkrun's manifest size limit (64 MiB) is still a torch file."""
    path = str(tmp_path / "big.ckpt")
    torch.save({"state_dict": {"w": torch.arange(17 << 20, dtype=torch.float32)}, "global_step": 5}, path)
    assert make_io().load_checkpoint(path)["global_step"] == 5
    assert lightning_ckpt.load_checkpoint_dict(path)["state_dict"]["w"][-1] == (17 << 20) - 1


def _documented_commands(script: str) -> list[list[str]]:
    """The ``python <script> ...`` lines of the script's docstring, as argument lists (comments dropped)."""
    with open(script) as f:
        text = f.read()
    doc = text.split('"""')[1]
    rel = os.path.relpath(script, ROOT)
    return [line.split("#", 1)[0].split()[2:] for line in doc.splitlines()
            if line.strip().startswith(f"python {rel}")]


def test_hydra_example_documented_resume_resumes(monkeypatch, tmp_path, capsys) -> None:
    """Runs the docstring's commands as written (from a fresh directory), plus only a smaller data set and
    quiet logging: the second one resumes the first one's run."""
    pytest.importorskip("hydra")
    script = os.path.join(EXAMPLES, "hydra_train", "train.py")
    commands = _documented_commands(script)
    assert len(commands) >= 2 and any("resume=last" in c for c in commands)
    monkeypatch.chdir(tmp_path)
    quiet = ["data.samples=5120", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    outs = []
    for args in commands[:2]:
        run_script(monkeypatch, script, *args, *quiet)
        outs.append(capsys.readouterr().out)
    assert "trained to step 30" in outs[0]
    ckpts = str(tmp_path / "checkpoints")
    assert f"resuming from {ckpts}/last.ckpt at step 30" in outs[1] and "trained to step 60" in outs[1]
    assert "step=10" not in outs[1]  # no save of a fresh start
    assert manifest(os.path.join(ckpts, "last.ckpt")).meta["global_step"] == 60


def test_hydra_example_refuses_to_start_over_silently(monkeypatch, tmp_path) -> None:
    pytest.importorskip("hydra")
    monkeypatch.chdir(tmp_path)
    script = os.path.join(EXAMPLES, "hydra_train", "train.py")
    with pytest.raises(SystemExit, match="no last checkpoint"):
        run_script(monkeypatch, script, "resume=last", "hydra/job_logging=none", "hydra/hydra_logging=none")


_SIGTERM_AFTER_FIT = """
import os, signal, sys, threading, torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
import ckpt_core
from ckpt_core.testing.faults import FaultFS as FaultyFS
from lightning_ckpt import CheckrunCheckpointIO

d = sys.argv[1]
Trainer(max_epochs=1, default_root_dir=d, plugins=[CheckrunCheckpointIO()], logger=False, enable_progress_bar=False,
        enable_model_summary=False).fit(BoringModel())  # its ModelCheckpoint's save (inside fit) installs the handler
engine = ckpt_core.CheckpointEngine({"saving": {"sigterm_grace_seconds": 60}})
FaultyFS.gate = threading.Event()
engine.save({"w": torch.arange(10)}, "gatefile://" + d + "/after_fit.ckpt")  # returned: the writes wait at the gate
FaultyFS.entered.acquire()
threading.Timer(0, FaultyFS.gate.set).start()
os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice
print("not reached", flush=True)
"""


def test_sigterm_after_a_fit_still_waits_for_the_saves_in_flight(tmp_path) -> None:
    """checkrun's SIGTERM handler (wait up to ``saving.sigterm_grace_seconds`` for pending saves) was
    installed once, at the first asynchronous save: inside a fit, whose end puts back the handler Lightning
    found at its start (the default), so every later save was lost to a SIGTERM (found by an independent
    check). It is installed again where the default handler replaced it."""
    import subprocess
    import sys

    script = tmp_path / "sigterm_after_fit.py"
    script.write_text(_SIGTERM_AFTER_FIT)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGTERM, p.stderr[-3000:]
    assert "not reached" not in p.stdout
    assert torch.equal(ckpt_core.load(tmp_path / "after_fit.ckpt")["w"], torch.arange(10))


_PREEMPTED = """
import os, signal, sys
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_ckpt import CheckrunCheckpointIO

class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.max_epochs > 1 and self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice, delivered at a known step
        return super().training_step(batch, batch_idx)

d = sys.argv[1]
kw = dict(plugins=[CheckrunCheckpointIO()], logger=False, enable_progress_bar=False, enable_model_summary=False)
model = Model()
first = Trainer(max_epochs=1, enable_checkpointing=False, **kw)
first.fit(model)
first.save_checkpoint(os.path.join(d, "stage1.ckpt"))  # checkrun's SIGTERM handler is installed here
Trainer(max_epochs=50, callbacks=[OnExceptionCheckpoint(dirpath=d)], **kw).fit(model)
"""


def test_sigterm_during_a_later_fit_is_lightnings_graceful_stop(tmp_path) -> None:
    """A save outside fit installs checkrun's SIGTERM handler (wait for pending saves, then the
    previous handler: the default, ending the process). A later fit's signal connector found it and
    called it in its own chain, so a SIGTERM killed the process (exit -15) instead of Lightning's
    graceful stop, and OnExceptionCheckpoint saved nothing. Called by another handler, checkrun's
    now only waits; the process ends as with TorchCheckpointIO (exit 0, on_exception.ckpt saved)."""
    import subprocess
    import sys

    script = tmp_path / "preempted.py"
    script.write_text(_PREEMPTED)
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    state = ckpt_core.load(tmp_path / "on_exception.ckpt")
    assert state["global_step"] == 4  # as TorchCheckpointIO saves it: the step that got the signal completes


def test_a_spec_mock_wrapping_the_plugin_counts_the_calls_like_lightnings_own_test(tmp_path):
    """Lightning's test_checkpoint_plugin_called wraps its plugin in ``MagicMock(wraps=plugin, spec=cls)``: with
    checkrun's, the stock ModelCheckpoint's first save raised "Mock object has no attribute 'config'" (found by
    an independent check, running Lightning's own tests with the plugin)."""
    from unittest.mock import MagicMock

    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import SingleDeviceStrategy

    plugin = MagicMock(wraps=lightning_ckpt.CheckrunCheckpointIO(), spec=lightning_ckpt.CheckrunCheckpointIO)
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu",
                      strategy=SingleDeviceStrategy("cpu", checkpoint_io=plugin),
                      callbacks=ModelCheckpoint(dirpath=tmp_path, save_last=True), max_epochs=2,
                      limit_train_batches=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(BoringModel())
    assert plugin.save_checkpoint.call_count == 4 and plugin.remove_checkpoint.call_count == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ckpt") == ["epoch=1-step=2.ckpt", "last.ckpt"]
