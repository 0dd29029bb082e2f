"""The Lightning examples run as scripts (``__main__``, in this process to spare a torch import each):
examples/lightning_train.py, the LightningCLI example with its YAML, the Hydra example."""
from __future__ import annotations

import os
import runpy
import sys

import fsspec.config
import pytest

from ckpt_core import CheckpointEngine
from tests.integration.test_lightning_common import ls

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def run_script(monkeypatch, path: str, *args: str) -> None:
    """Run ``path`` as ``__main__`` with ``args`` on its command line."""
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.syspath_prepend(os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")


def manifest(path: str):
    with CheckpointEngine() as engine:
        return engine.read_manifest(path)


@pytest.mark.s3
def test_lightning_train_example_on_s3(monkeypatch, capsys, s3_root, s3_server) -> None:
    """The README's main job, against S3 configured the documented way (fsspec's s3 config only)."""
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server})  # = FSSPEC_S3_ENDPOINT_URL
    run_script(monkeypatch, os.path.join(EXAMPLES, "lightning_train.py"), "--dir", s3_root, "--steps", "6",
               "--every", "3")
    out = capsys.readouterr().out
    assert f"resumed from {s3_root}/last.ckpt and trained to step 12" in out
    assert out.count("last.ckpt:") == 4 and "x less than full saves" in out
    assert f"checkpoints: {s3_root}\nlook at them: checkrun ls {s3_root}" in out and " MB" not in out
    assert manifest(f"{s3_root}/last.ckpt").meta["global_step"] == 12


def test_lightning_cli_example_with_yaml(monkeypatch, tmp_path) -> None:
    script = os.path.join(EXAMPLES, "lightning_cli.py")
    common = ["--config", os.path.join(EXAMPLES, "lightning_cli.yaml"), "--trainer.default_root_dir",
              str(tmp_path), "--data.samples", "5120"]
    run_script(monkeypatch, script, "fit", *common, "--trainer.max_steps", "20")
    run_script(monkeypatch, script, "fit", *common, "--trainer.max_steps", "30", "--ckpt_path", "last")
    ckpts = str(tmp_path / "checkpoints")
    # 20 batches per epoch; top-2 by step: step 10 was removed when step 30 was saved after the resume.
    assert ls(ckpts) == [".checkrun", "epoch=0-step=20.ckpt", "epoch=1-step=30.ckpt", "last.ckpt"]
    last = manifest(os.path.join(ckpts, "last.ckpt"))
    assert last.meta["global_step"] == 30
    quantized = {r.key: r.quant for r in last.tensors if r.quant}
    assert list(quantized) == ["state_dict.emb.weight"] and quantized["state_dict.emb.weight"]["bits"] == 8


def test_lightning_cli_with_an_explicit_ckpt_path(monkeypatch, tmp_path) -> None:
    """``--ckpt_path FILE``: LightningCLI reads the file's hyper-parameters with a raw torch.load before
    the Trainer (and its plugin) exists; a checkrun file must work there too (before: UnpicklingError
    "Unsupported operand 123")."""
    script = os.path.join(EXAMPLES, "lightning_cli.py")
    common = ["--config", os.path.join(EXAMPLES, "lightning_cli.yaml"), "--trainer.default_root_dir",
              str(tmp_path), "--data.samples", "640"]
    run_script(monkeypatch, script, "fit", *common, "--trainer.max_steps", "10")
    last = str(tmp_path / "checkpoints" / "last.ckpt")
    run_script(monkeypatch, script, "fit", *common, "--trainer.max_steps", "15", "--ckpt_path", last)
    assert manifest(last).meta["global_step"] == 15


def test_hydra_example(monkeypatch, tmp_path, capsys) -> None:
    pytest.importorskip("hydra")
    ckpt_dir = str(tmp_path / "ckpts")
    run_script(monkeypatch, os.path.join(EXAMPLES, "hydra_train", "train.py"), f"ckpt_dir={ckpt_dir}",
               f"hydra.run.dir={tmp_path / 'out'}", "trainer.max_steps=20", "data.samples=5120",
               "hydra/job_logging=none", "hydra/hydra_logging=none")
    run_script(monkeypatch, os.path.join(EXAMPLES, "hydra_train", "train.py"), f"ckpt_dir={ckpt_dir}",
               f"hydra.run.dir={tmp_path / 'out2'}", "trainer.max_steps=30", "data.samples=5120", "resume=last",
               "hydra/job_logging=none", "hydra/hydra_logging=none")
    out = capsys.readouterr().out
    assert "trained to step 20" in out and "trained to step 30" in out
    assert manifest(os.path.join(ckpt_dir, "last.ckpt")).meta["global_step"] == 30


def test_lightning_cli_keeps_a_config_path_a_path(monkeypatch, tmp_path, capsys) -> None:
    """h136: ``--trainer.plugins.init_args.config engine.yaml``: LightningCLI read the file itself (``dict`` is
    in the type hint), so ``--print_config`` (and the config.yaml it saves in the run folder) held the file's
    credentials, and a typo in it was reported without the file's name. The path stays a path now."""
    engine_yaml = tmp_path / "engine.yaml"
    engine_yaml.write_text("storage:\n  storage_options: {key: AKIAEXAMPLE, secret: TOPSECRET123}\n")
    script = os.path.join(EXAMPLES, "lightning_cli.py")
    common = ["--config", os.path.join(EXAMPLES, "lightning_cli.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        run_script(monkeypatch, script, "fit", *common, "--trainer.plugins.init_args.config", str(engine_yaml),
                   "--print_config")
    out = capsys.readouterr().out
    assert "TOPSECRET123" not in out and f"config: {engine_yaml}" in out
    engine_yaml.write_text("savng: {workers: 2}\n")
    with pytest.raises((SystemExit, ValueError)) as raised:  # LightningCLI's parser error, in this process
        run_script(monkeypatch, script, "fit", *common, "--trainer.plugins.init_args.config", str(engine_yaml),
                   "--trainer.max_steps", "1")
    assert f"{engine_yaml}: unknown config key 'savng'" in str(raised.value) + capsys.readouterr().err


def test_lightning_cli_takes_an_inline_config_mapping(monkeypatch, tmp_path, capsys) -> None:
    """h137: with a path type in the hint (to keep a path a path), jsonargparse turned an inline ``config:``
    mapping into a string and the Trainer could not be built. Both forms work."""
    script = os.path.join(EXAMPLES, "lightning_cli.py")
    common = ["--config", os.path.join(EXAMPLES, "lightning_cli.yaml"), "--trainer.default_root_dir", str(tmp_path),
              "--trainer.plugins.init_args.config", "{retention: {keep_last: 1}}"]
    with pytest.raises(SystemExit):
        run_script(monkeypatch, script, "fit", *common, "--print_config")
    out = capsys.readouterr().out
    assert "config:\n        retention:\n          keep_last: 1" in out, out
    run_script(monkeypatch, script, "fit", *common, "--trainer.max_steps", "2", "--data.samples", "64")
