"""``CheckrunCheckpointIO`` itself: configuration, Lightning's exact signatures, paths and URLs,
error surfacing at teardown, reuse after teardown, pickling, wrapping, strategies, Fabric."""
from __future__ import annotations

import os
import inspect
import logging
import pickle
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

import lightning_ckpt
from ckpt_core import BackgroundSaveError, ConfigError, CorruptCheckpointError, EngineConfig, NotACheckpointError
from lightning_ckpt import CheckrunCheckpointIO, UnsupportedStrategyError, check_strategy
from lightning_ckpt.paths import checkpoint_kind, normalize_path
from ckpt_core.testing.faults import FaultFS as FaultyFS
from tests.integration.test_lightning_common import (TinyModel, close_plugins, make_io,  # noqa: F401
                                                     tensors_equal, trainer)


def test_signatures_match_lightning() -> None:
    for name in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
        ours = inspect.signature(getattr(CheckrunCheckpointIO, name))
        theirs = inspect.signature(getattr(CheckpointIO, name))
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def test_config_sources_and_precedence(tmp_path) -> None:
    yaml_path = tmp_path / "checkrun.yaml"
    yaml_path.write_text("checkpointing:\n  retention: {keep_last: 5}\n  saving: {max_pending: 3}\n")
    plugin = make_io(str(yaml_path), config_section="checkpointing", keep_last=2,
                                  overrides={"saving.max_pending": 4, "retention.keep_last": 9},
                                  storage_options={"anon": True}, quantization=[{"pattern": "*.emb*", "bits": 4}])
    cfg = plugin.config
    assert cfg.retention.keep_last == 2 and cfg.saving.max_pending == 4  # explicit > overrides > file
    assert cfg.storage.storage_options == {"anon": True} and cfg.quantization[0].pattern == "*.emb*"
    base = EngineConfig.from_dict({"storage": {"storage_options": {"a": 1}}, "saving": {"asynchronous": False}})
    merged = make_io(base, storage_options={"b": 2}).config
    assert merged.storage.storage_options == {"a": 1, "b": 2} and merged.saving.asynchronous is False
    assert make_io({"incremental": {"enabled": False}}).config.incremental.enabled is False
    assert make_io().config == EngineConfig().replace(**{"retention.protect": ("last*.ckpt",)})
    with pytest.raises(ConfigError, match="retention.keep_last"):
        make_io(keep_last=0)


def test_a_dict_config_without_the_named_section_or_a_bad_shadowed_override_is_refused() -> None:
    """A misspelt ``config_section`` of a dict config (an inline ``config:`` in LightningCLI YAML) meant
    every default (the step log off); a bad ``overrides`` value that an explicit argument shadowed was never
    checked (found by an independent check). Both are ``ConfigError``s, as in a YAML file."""
    with pytest.raises(ConfigError, match="no top-level section 'checkpointng' .*'checkpointing'"):
        make_io({"checkpointing": {"step_log": {"enabled": True}}}, config_section="checkpointng")
    assert make_io({"checkpointing": {"step_log": {"enabled": True}}},
                   config_section="checkpointing").config.step_log.enabled
    assert make_io({"checkpointing": None}, config_section="checkpointing").config.saving.max_pending == 1
    with pytest.raises(ConfigError, match="max_pending"):
        make_io(max_pending=2, overrides={"saving.max_pending": "x"})
    for config in (None, EngineConfig()):  # nothing to read a section from: ignored before (next check)
        with pytest.raises(ConfigError, match="config_section 'checkpointing' needs a config"):
            make_io(config, config_section="checkpointing")
    with pytest.raises(ConfigError, match="unknown config key"):
        make_io({"savings": {}})


def test_a_file_url_root_saves_there_and_resumes_from_last(tmp_path, monkeypatch) -> None:
    """h142: ``Trainer(default_root_dir="file:///abs")``: Lightning hands the plugin ``file:/abs/checkpoints``
    (a pathlib join), which the plugin made ``file://abs/...``: the checkpoints went to ``abs/...`` under the
    working directory and ``ckpt_path="last"`` started over with a warning."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    root, cwd = tmp_path / "run", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    first = trainer(f"file://{root}", max_steps=4, callbacks=[ModelCheckpoint(every_n_train_steps=2, save_last=True)])
    first.fit(TinyModel())
    assert {"last.ckpt", "epoch=0-step=4.ckpt"} <= set(os.listdir(root / "checkpoints"))
    assert not any(files for _, _, files in os.walk(cwd))
    again = trainer(f"file://{root}", max_steps=6, callbacks=[ModelCheckpoint(every_n_train_steps=2, save_last=True)])
    model = TinyModel()
    seen = []
    model.on_train_start = lambda: seen.append(again.global_step)
    again.fit(model, ckpt_path="last")
    assert seen == [4] and again.global_step == 6


def test_a_removal_the_storage_refuses_warns_and_keeps_the_checkpoint(tmp_path, caplog) -> None:
    """h142: resuming from a read-only bucket into a writable dirpath, Lightning removes the other run's best
    checkpoint there (a remote path is never checked against dirpath); TorchCheckpointIO on s3fs ignores the
    refusal, the plugin raised it from the fit. It warns now; other removal errors still raise."""
    from ckpt_core.testing.faults import FaultFS, Permanent

    plugin = make_io()
    path = f"faultfile://{tmp_path}/best.ckpt"
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, path)
    plugin.remove_checkpoint(str(tmp_path / "nothing.ckpt"))
    try:
        FaultFS.policy = Permanent(PermissionError(13, "Access Denied"), ops=("delete",), kind="manifest")
        with caplog.at_level(logging.WARNING, logger="lightning_ckpt"):
            plugin.remove_checkpoint(path)
        assert f"{tmp_path}/best.ckpt was not removed" in caplog.text and "Access Denied" in caplog.text
        assert (tmp_path / "best.ckpt").exists()
        FaultFS.policy = Permanent(OSError(5, "I/O error"), ops=("delete",), kind="manifest")
        with pytest.raises(Exception, match="I/O error"):
            plugin.remove_checkpoint(path)
    finally:
        FaultFS.reset()
    plugin.remove_checkpoint(path)
    assert not (tmp_path / "best.ckpt").exists()
    plugin.teardown()


def test_paths_str_path_and_urls(tmp_path) -> None:
    assert normalize_path(Path("s3://bucket/run/x.ckpt")) == "s3://bucket/run/x.ckpt"  # Path collapsed "//"
    assert normalize_path("memory://a/b.ckpt") == "memory://a/b.ckpt"
    assert normalize_path(Path("/tmp/a.ckpt")) == "/tmp/a.ckpt"
    assert normalize_path(Path("file:///tmp/run/a.ckpt")) == "file:///tmp/run/a.ckpt"  # h142: was file://tmp/...
    assert normalize_path(Path("local:///tmp/a.ckpt")) == "local:///tmp/a.ckpt"
    assert checkpoint_kind("s3://b/run/.lr_find_1234-ab.ckpt") == "temporary"
    assert checkpoint_kind(Path("/x/.temp.ckpt")) == "temporary"
    assert checkpoint_kind("/x/.scale_batch_size_9.ckpt") == "temporary"
    assert checkpoint_kind("/x/hpc_ckpt_3.ckpt") == "hpc"
    assert checkpoint_kind("/x/last.ckpt") == "regular"

    plugin = make_io()
    state = {"state_dict": {"w": torch.arange(6.0)}, "global_step": 3, "name": "x"}
    for path in (str(tmp_path / "a.ckpt"), tmp_path / "b.ckpt", Path(f"memory://{tmp_path.name}/c.ckpt")):
        plugin.save_checkpoint(state, path)
        assert tensors_equal(plugin.load_checkpoint(path), state)
        plugin.remove_checkpoint(path)
        with pytest.raises(FileNotFoundError):
            plugin.load_checkpoint(path)
        plugin.remove_checkpoint(path)  # already gone: ignored, like TorchCheckpointIO
    sharded = tmp_path / "sharded.ckpt"  # a directory-shaped checkpoint: removed whole, like TorchCheckpointIO
    (sharded / "shard").mkdir(parents=True)
    (sharded / "shard" / "0.distcp").write_bytes(b"x")
    plugin.remove_checkpoint(str(sharded))
    assert not sharded.exists()
    with pytest.raises(TypeError):
        plugin.save_checkpoint(state, str(tmp_path / "d.ckpt"), storage_options="not a dict")
    plugin.teardown()


def test_per_call_storage_options_reach_s3(s3_root, s3_storage_options) -> None:
    """Trainer.save_checkpoint(..., storage_options=...) is passed through to the engine."""
    plugin = make_io()  # no endpoint configured anywhere else
    t = trainer(None, plugin, max_steps=1, default_root_dir=None)
    t.fit(TinyModel())
    path = f"{s3_root}/manual.ckpt"
    t.save_checkpoint(path, storage_options=s3_storage_options)
    plugin.teardown()
    loaded = lightning_ckpt.load_checkpoint_dict(path, storage_options=s3_storage_options)
    assert loaded["global_step"] == 1


class FailingSave(Callback):
    """At the given step, saves once to a storage path whose writes fail in the background."""

    def __init__(self, path: str, step: int, then_raise: bool = False) -> None:
        self.path, self.step, self.then_raise = path, step, then_raise

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            if self.then_raise:
                raise ValueError("the user's own error")


@pytest.fixture
def failing_writes():
    FaultyFS.reset()
    FaultyFS.fail_writes = OSError("injected write failure")
    FaultyFS.fail_match = "/bad/"
    yield
    FaultyFS.reset()


def test_teardown_raises_background_error_then_plugin_keeps_working(tmp_path, failing_writes) -> None:
    plugin = make_io()
    bad = f"gatefile://{tmp_path}/bad/x.ckpt"
    t = trainer(str(tmp_path), plugin, callbacks=[FailingSave(bad, step=2)], max_steps=2)
    with pytest.raises(BackgroundSaveError, match="injected write failure"):
        t.fit(TinyModel())
    assert plugin.engine.pending == 0  # teardown waited, and a fresh engine serves the next fit
    t2 = trainer(str(tmp_path), plugin, max_steps=2)
    t2.fit(TinyModel())
    t2.save_checkpoint(str(tmp_path / "ok.ckpt"))
    plugin.teardown()
    assert plugin.load_checkpoint(str(tmp_path / "ok.ckpt"))["global_step"] == 2


def test_teardown_logs_background_error_while_user_error_propagates(tmp_path, failing_writes, caplog) -> None:
    plugin = make_io()
    bad = f"gatefile://{tmp_path}/bad/x.ckpt"
    t = trainer(str(tmp_path), plugin, callbacks=[FailingSave(bad, step=1, then_raise=True)], max_steps=3)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(ValueError, match="the user's own error"):
            t.fit(TinyModel())
    # Logged (by the engine's or the plugin's logger), not raised over the user's error.
    assert any("injected write failure" in r.getMessage() and "x.ckpt" in r.getMessage()
               and r.levelno == logging.ERROR for r in caplog.records)
    assert plugin._engine is None  # teardown still closed the engine


def test_a_fit_run_while_the_caller_handles_an_exception_still_raises_a_failed_save(tmp_path, failing_writes) -> None:
    """Retry code: ``except SomeError: trainer.fit(...)``. Teardown took the exception being handled
    for one propagating out of fit and only logged the failed save: fit returned as if it had saved
    (found by an independent check). Lightning's own interrupted teardown is told apart by the trainer."""
    plugin = make_io()
    bad = f"gatefile://{tmp_path}/bad/x.ckpt"
    t = trainer(str(tmp_path), plugin, callbacks=[FailingSave(bad, step=2)], max_steps=2)
    try:
        raise KeyError("an earlier attempt failed")
    except KeyError:
        with pytest.raises(BackgroundSaveError, match="injected write failure"):
            t.fit(TinyModel())


def test_pickle_drops_engine_and_second_fit_works(tmp_path) -> None:
    plugin = make_io(keep_last=3)
    plugin.save_checkpoint({"w": torch.ones(3)}, str(tmp_path / "a.ckpt"))
    plugin.wait()
    clone = pickle.loads(pickle.dumps(plugin))
    assert clone.config == plugin.config and clone._engine is None
    assert tensors_equal(clone.load_checkpoint(str(tmp_path / "a.ckpt")), {"w": torch.ones(3)})
    clone.teardown()
    plugin.teardown()
    for steps in (2, 4):  # a second fit (and the first) on the same plugin
        trainer(str(tmp_path), plugin, max_steps=steps).fit(TinyModel())


def test_warns_when_wrapped_in_async_checkpoint_io(tmp_path) -> None:
    plugin = make_io()
    t = trainer(str(tmp_path), AsyncCheckpointIO(plugin), max_steps=1)
    t.fit(TinyModel())
    with pytest.warns(UserWarning, match="already asynchronous"):
        t.save_checkpoint(str(tmp_path / "a.ckpt"))
        t.strategy.checkpoint_io.teardown()  # joins AsyncCheckpointIO's thread (the warning is raised there)
    plugin.teardown()
    assert plugin.load_checkpoint(str(tmp_path / "a.ckpt"))["global_step"] == 1


def test_strategies_that_bypass_checkpoint_io_are_refused() -> None:
    check_strategy(DDPStrategy())
    check_strategy(DDPStrategy(start_method="spawn"))
    check_strategy(SingleDeviceStrategy("cpu"))
    check_strategy(FabricDDPStrategy())
    for strategy in (FSDPStrategy(state_dict_type="full"), FSDPStrategy(state_dict_type="sharded"),
                     ModelParallelStrategy(save_distributed_checkpoint=False), ModelParallelStrategy(),
                     FabricFSDPStrategy()):
        with pytest.raises(UnsupportedStrategyError, match="never resume"):
            check_strategy(strategy)
    dcp = pytest.importorskip("lightning_ckpt.dcp")  # sharded checkpoints through checkrun (its own tests)
    check_strategy(dcp.CheckrunFSDPStrategy())
    with pytest.raises(UnsupportedStrategyError):
        check_strategy(dcp.CheckrunFSDPStrategy(state_dict_type="full"))


def test_plugin_finds_its_calling_strategy(tmp_path) -> None:
    """The plugin checks the strategy that calls it (Lightning gives CheckpointIO no setup hook).

    Real strategy objects call the plugin directly (a Trainer with FSDP needs a GPU): DDP saves through
    it; sharded FSDP never calls save (it writes with torch.distributed.checkpoint) but does call
    remove_checkpoint, where the plugin refuses it."""
    plugin = make_io()
    DDPStrategy(checkpoint_io=plugin).save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    assert plugin.saves == 1
    sharded = FSDPStrategy(state_dict_type="sharded", checkpoint_io=plugin)
    with pytest.raises(UnsupportedStrategyError, match="torch.distributed.checkpoint"):
        sharded.remove_checkpoint(str(tmp_path / "a.ckpt"))
    plugin.teardown()


def test_reads_torch_checkpoints_of_the_default_plugin(tmp_path) -> None:
    """Migrating: a ``.ckpt`` written by TorchCheckpointIO resumes under CheckrunCheckpointIO."""
    t = trainer(str(tmp_path), TorchCheckpointIO(), max_steps=2)
    t.fit(TinyModel())
    old = str(tmp_path / "torch.ckpt")
    t.save_checkpoint(old)
    t2 = trainer(str(tmp_path), make_io(), max_steps=3)
    t2.fit(TinyModel(), ckpt_path=old)
    assert t2.global_step == 3
    with pytest.raises(Exception, match="not a checkrun|manifest"):
        make_io(fallback_to_torch=False).load_checkpoint(old)


def test_a_zeroed_or_emptied_checkpoint_gets_checkrun_s_error_not_torch_load_s(tmp_path) -> None:
    """A checkpoint zeroed by a crash fell through to torch.load, whose error advised
    ``weights_only=False``; an emptied one gave a bare EOFError (h106)."""
    t = trainer(str(tmp_path), make_io(), max_steps=1)
    t.fit(TinyModel())
    path = tmp_path / "zeroed.ckpt"
    t.save_checkpoint(str(path))
    t.strategy.checkpoint_io.teardown()
    path.write_bytes(b"\0" * path.stat().st_size)
    with pytest.raises(CorruptCheckpointError, match="zeroed.ckpt: damaged checkpoint: it starts with zero bytes"):
        make_io().load_checkpoint(str(path))
    path.write_bytes(b"")
    with pytest.raises(NotACheckpointError, match="zeroed.ckpt: an empty file: not a checkpoint"):
        make_io().load_checkpoint(str(path))


def test_fabric_save_and_load(tmp_path) -> None:
    plugin = make_io()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model, opt = fabric.setup(model, opt)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 7})
    model2 = fabric.setup_module(torch.nn.Linear(3, 2))
    state = {"model": model2}
    rest = fabric.load(path, state)
    assert rest["step"] == 7 and tensors_equal(model2.state_dict(), model.state_dict())
    plugin.teardown()


def test_home_and_local_url_spellings_make_no_stray_folders(tmp_path, monkeypatch) -> None:
    """``fabric.save("~/ckpts/a.ckpt")`` and ``local://`` URLs land where TorchCheckpointIO puts them (fsspec
    expands ``~``) and nothing else is created: before, the folder made synchronously for them was a
    literal ``./~/ckpts`` (an invitation to ``rm -rf ~``) and ``./local:/...`` in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    plugin = make_io()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(torch.nn.Linear(3, 2))
    fabric.save("~/ckpts/a.ckpt", {"model": model})
    fabric.save(f"local://{tmp_path}/out/b.ckpt", {"model": model})
    plugin.teardown()
    assert sorted(os.listdir(work)) == []
    for path in (home / "ckpts" / "a.ckpt", tmp_path / "out" / "b.ckpt"):
        assert tensors_equal(fabric.load(path)["model"], model.state_dict())


def test_a_logger_that_uploads_checkpoint_files_gets_a_warning(tmp_path) -> None:
    """MLflow/W&B/Neptune loggers with ``log_model`` copy each ``.ckpt`` file as an artifact: with
    checkrun a manifest that does not load on its own (found by a check of LightningCLI/Trainer use;
    documented, not changed). The plugin says so at its first save; a plain logger gets no warning."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    class Uploading(CSVLogger):
        _log_model = "all"

    for logger, expected in ((Uploading(str(tmp_path / "a")), True), (CSVLogger(str(tmp_path / "b")), False)):
        t = trainer(str(tmp_path), logger=logger, max_steps=2, limit_val_batches=0,
                    callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck" / str(expected)), every_n_train_steps=1)])
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            t.fit(TinyModel())
        hits = [w for w in seen if "uploads each checkpoint file as an artifact" in str(w.message)]
        assert len(hits) == (1 if expected else 0), [str(w.message) for w in seen]
        assert not expected or "Uploading" in str(hits[0].message)


def test_a_deferred_removal_interrupted_midway_is_made_at_the_next_call(tmp_path) -> None:
    """A removal waiting for a save in flight (ModelCheckpoint's top-k replacement) was dropped from
    the waiting list before it ran: a ^C or an error inside it left the checkpoint for good (found by
    an independent check: 4 top-k files kept with save_top_k=2). It stays waiting until made."""
    import threading

    from ckpt_core import CheckrunError

    gate = threading.Event()
    FaultyFS.reset()
    FaultyFS.gate = gate
    plugin = make_io()
    d = f"gatefile://{tmp_path}/ckpts"
    try:
        gate.set()
        plugin.save_checkpoint({"w": torch.ones(3)}, f"{d}/a.ckpt")
        plugin.wait()
        gate.clear()
        plugin.save_checkpoint({"w": torch.full((3,), 2.0)}, f"{d}/b.ckpt")  # held at the gate
        plugin.remove_checkpoint(f"{d}/a.ckpt")  # waits for b's save
        real, calls = plugin.engine.remove, []

        def remove(url, *args, wait=True, **kwargs):
            if not wait:  # the attempt on the engine's thread as b commits fails: it stays waiting
                raise CheckrunError("injected: the storage failed")
            calls.append(url)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(url, *args, **kwargs)

        plugin.engine.remove = remove
        gate.set()
        with pytest.raises(KeyboardInterrupt):
            plugin.wait()
        plugin.wait()
        assert len(calls) == 2 and not (tmp_path / "ckpts" / "a.ckpt").exists()
        assert plugin.load_checkpoint(f"{d}/b.ckpt")["w"][0] == 2.0
        # a removal asked for while an earlier waiting one fails is made all the same (it was lost)
        plugin.save_checkpoint({"w": torch.ones(3)}, f"{d}/c.ckpt")
        plugin.wait()
        gate.clear()
        plugin.save_checkpoint({"w": torch.ones(3)}, f"{d}/e.ckpt")  # held
        plugin.remove_checkpoint(f"{d}/b.ckpt")  # waits for e
        gate.set()
        plugin.engine.wait()
        calls.clear()
        with pytest.raises(KeyboardInterrupt):  # b's removal fails; c's is made
            plugin.remove_checkpoint(f"{d}/c.ckpt")
        assert not (tmp_path / "ckpts" / "c.ckpt").exists()
        plugin.wait()
        assert not (tmp_path / "ckpts" / "b.ckpt").exists()
    finally:
        gate.set()
        FaultyFS.reset()
        plugin.teardown()


def test_importing_the_plugin_keeps_lightnings_rank_zero_logger() -> None:
    """Hooking the standalone pytorch_lightning package imported it, which points Lightning's shared
    rank-zero logger at pytorch_lightning's: a user who silenced "lightning.pytorch" saw its messages
    again (found by an independent check)."""
    import subprocess
    import sys

    for package in ("lightning.pytorch", "pytorch_lightning"):  # the one a user imported and silenced first
        code = (f"import logging, {package}\n"
                "import lightning_utilities.core.rank_zero as r\n"
                "name = r.log.name\n"
                "import lightning_ckpt\n"
                f"assert r.log.name == name == '{package}.utilities.rank_zero', (name, r.log.name)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def test_an_hpc_save_superseded_by_a_later_one_of_this_process_is_no_error(tmp_path, monkeypatch) -> None:
    """h126: SIGUSR1 again while Lightning's requeue handler saved ``hpc_ckpt_1.ckpt`` ran a second handler
    whose save of the same name (``hpc_save_path`` saw no file yet) committed first; the first one's save
    was then refused as older and the fit failed with "another writer" (stock overwrites the file). The
    later of the two is kept, and the older save is not an error."""
    import ckpt_core.engine as engine_mod
    from ckpt_core.saving.fence import new_stamp

    io = CheckrunCheckpointIO()
    path = tmp_path / "hpc_ckpt_1.ckpt"
    older = new_stamp()  # the first handler's save, asked for first
    io.save_checkpoint({"w": torch.full((2,), 2.0)}, path)  # the second handler's, committed first
    monkeypatch.setattr(engine_mod, "new_stamp", lambda: older)
    io.save_checkpoint({"w": torch.full((2,), 1.0)}, path)
    assert io.load_checkpoint(path)["w"][0].item() == 2.0
    io.teardown()
