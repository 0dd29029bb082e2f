"""Fork safety (issue 19.1): a process forked while a save is in flight inherits no engine obligations.

Storage is gated (``gatefile://``, ckpt_core.testing.faults) so that the save is surely in flight when the
child is forked; the gate opens only after the child's fate is known. Before the fix, each child
waited at exit for the parent's save (which only the parent's threads can finish): DataLoader workers
hung until the DataLoader terminated them.
"""
from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import ckpt_core
from ckpt_core.testing.faults import FaultFS as FaultyFS
from tests.integration.test_lightning_common import close_plugins, make_io, record_worker_shutdown  # noqa: F401

HANG_GUARD_S = 120  # only bounds a broken run; a passing child exits at once


def _child_exits(engine: ckpt_core.CheckpointEngine, path: str, out) -> None:
    try:
        engine.save({"x": torch.zeros(3)}, path)
        out.put("saved")
    except ckpt_core.CheckrunError as exc:
        out.put(f"refused: {exc}")


def test_forked_child_neither_waits_nor_writes(tmp_path, gate) -> None:
    root = f"gatefile://{tmp_path}"
    engine = ckpt_core.CheckpointEngine()
    handle = engine.save({"w": torch.arange(1000.0)}, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()  # the background save is inside a storage write, held by the gate
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_exits, args=(engine, f"{root}/child.ckpt", out))
    child.start()
    child.join(HANG_GUARD_S)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive, "the forked child waited at exit for the parent's in-flight save"
    assert child.exitcode == 0
    message = out.get(timeout=HANG_GUARD_S)
    assert message.startswith("refused:") and "forked child" in message
    assert not handle.done()  # the parent's save is still held by the gate, yet the child is gone
    gate.set()
    assert handle.result().path.endswith("a.ckpt")
    engine.close()
    assert not (tmp_path / "child.ckpt").exists()
    assert ckpt_core.load(f"{tmp_path}/a.ckpt")["w"].equal(torch.arange(1000.0))


class _Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        return DataLoader(data, batch_size=4, num_workers=2)


class _GatePerEpoch(Callback):
    """Keeps each epoch-end save in flight through the next epoch (its DataLoader workers are
    forked and shut down meanwhile), then lets it finish before the next save."""

    def __init__(self, gate: threading.Event, plugin) -> None:
        self.gate, self.plugin = gate, plugin

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.gate.set()
        self.plugin.wait()
        self.gate.clear()

    def on_train_end(self, trainer, pl_module) -> None:
        self.gate.set()  # the plugin's teardown waits for the last save


def test_dataloader_workers_exit_cleanly_during_a_save(tmp_path, gate, monkeypatch) -> None:
    shut_down, terminated = record_worker_shutdown(monkeypatch)
    plugin = make_io()
    mc = ModelCheckpoint(dirpath=f"gatefile://{tmp_path}/ckpts", every_n_epochs=1, save_top_k=-1)
    trainer = Trainer(max_epochs=3, plugins=[plugin], callbacks=[_GatePerEpoch(gate, plugin), mc],
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(_Model())
    gate.set()
    plugin.wait()
    # epochs 2 and 3 forked their workers while the previous epoch's save was held by the gate
    assert len(shut_down) >= 6
    assert terminated == [], f"{len(terminated)} of {len(shut_down)} DataLoader workers hung at exit"
    assert sorted(p.name for p in (tmp_path / "ckpts").glob("*.ckpt")) == [
        "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]


def _child_loads(url: str, path: str, out) -> None:
    out.put(("waits", not ckpt_core.wait_for_save(url, timeout=0)))  # the parent's save is in flight
    ckpt_core.wait_for_save(url)  # (an engine's load of ``url`` waits the same way)
    try:
        with ckpt_core.CheckpointEngine() as engine:
            out.put(("loaded", engine.load(path)["w"].sum().item()))
    except ckpt_core.CheckrunError as exc:
        out.put(("failed", str(exc)))


def test_a_forked_child_that_loads_waits_for_the_parents_save(tmp_path, gate) -> None:
    """Lightning's ddp_fork/ddp_notebook ranks are forked by the process that may have just saved
    (``trainer.save_checkpoint(p)`` then ``validate(ckpt_path=p)``): a child's load of a path the
    parent was saving at fork time waits for that save (before: CheckpointNotFoundError)."""
    url, path = f"gatefile://{tmp_path}/a.ckpt", f"{tmp_path}/a.ckpt"  # the child reads past the gate
    engine = ckpt_core.CheckpointEngine()
    try:
        handle = engine.save({"w": torch.arange(1000.0)}, url)
        FaultyFS.entered.acquire()  # the save is inside a storage write, held by the gate
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_child_loads, args=(url, path, out))
        child.start()
        assert out.get(timeout=HANG_GUARD_S) == ("waits", True)
        gate.set()
        handle.result()
        assert out.get(timeout=HANG_GUARD_S) == ("loaded", float(torch.arange(1000.0).sum()))
        child.join(HANG_GUARD_S)
        assert child.exitcode == 0
        # a child forked after the save ended has nothing to wait for
        later = ctx.Process(target=_child_loads, args=(url, path, out))
        later.start()
        assert out.get(timeout=HANG_GUARD_S) == ("waits", False)
        assert out.get(timeout=HANG_GUARD_S)[0] == "loaded"
        later.join(HANG_GUARD_S)
    finally:
        gate.set()
        engine.close()


def _plugin_child(plugin, path: str, out) -> None:
    try:
        out.put(("loaded", plugin.load_checkpoint(path)["step"]))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put(("failed", f"{type(exc).__name__}: {exc}"))


def test_a_plugin_used_before_a_fork_works_in_the_forked_child(tmp_path) -> None:
    """ddp_fork ranks inherit the plugin of the process that saved or loaded before the launch:
    the child makes engines of its own (before: "this CheckpointEngine belongs to process P")."""
    plugin = make_io()
    plugin.save_checkpoint({"step": 7}, str(tmp_path / "a.ckpt"))
    plugin.load_checkpoint(str(tmp_path / "a.ckpt"))  # the engine exists in the parent
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_plugin_child, args=(plugin, str(tmp_path / "a.ckpt"), out))
    child.start()
    assert out.get(timeout=HANG_GUARD_S) == ("loaded", 7)
    child.join(HANG_GUARD_S)
    assert child.exitcode == 0


def test_pickling_the_plugin_for_spawned_ranks_waits_for_saves_in_flight(tmp_path, monkeypatch) -> None:
    """ddp_spawn ranks get a pickled copy of the plugin and cannot see this process's saves: pickling
    waits until none is in flight (any engine of the process)."""
    import pickle

    from ckpt_core.saving import inflight

    calls = []
    original = inflight.wait_here
    monkeypatch.setattr(inflight, "wait_here", lambda *a, **k: calls.append(a) or original(*a, **k))
    plugin = make_io()
    plugin.save_checkpoint({"step": 1}, str(tmp_path / "a.ckpt"))
    copy_ = pickle.loads(pickle.dumps(plugin))
    assert calls and copy_._engine is None
    assert copy_.load_checkpoint(str(tmp_path / "a.ckpt"))["step"] == 1
