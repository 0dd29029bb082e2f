"""A misspelt checkrun setting: the ConfigError names the key and its nearest valid spelling.

docs/lightning.md ("LightningCLI: the plugin's own options, and typos") promises it for the plugin's
``config`` and ``overrides``, also through LightningCLI, whose output buries the message among ~90
lines of parser errors (docs/troubleshooting.md lists the message).
"""
from __future__ import annotations

import pytest

from ckpt_core import ConfigError, EngineConfig


@pytest.mark.parametrize("build", [
    lambda: EngineConfig.from_dict({"saving": {"asynchronus": False}}),
    lambda: EngineConfig().replace(**{"saving.asynchronus": False}),
    lambda: EngineConfig().replace(**{"savng.asynchronous": False}),  # a misspelt section
], ids=["from_dict", "replace", "replace-section"])
def test_engine_config_names_the_nearest_key(build):
    with pytest.raises(ConfigError, match="unknown config key") as err:
        build()
    assert "did you mean 'saving.asynchronous'?" in str(err.value)


def test_no_suggestion_for_a_key_like_none():
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict({"zzzz": 1})
    assert "did you mean" not in str(err.value) and "(known: compression," in str(err.value)


def test_plugin_names_the_nearest_key():
    pytest.importorskip("lightning")
    from lightning_ckpt import CheckrunCheckpointIO
    from lightning_ckpt.config import build_config

    for make in (lambda: build_config(overrides={"saving.asynchronus": False}),
                 lambda: CheckrunCheckpointIO(overrides={"saving.asynchronus": False}),
                 lambda: CheckrunCheckpointIO(config={"saving": {"asynchronus": False}})):
        with pytest.raises(ConfigError, match=r"unknown config key 'saving\.asynchronus'; "
                                              r"did you mean 'saving\.asynchronous'\?"):
            make()


def test_lightning_cli_shows_the_nearest_key(tmp_path, monkeypatch):
    """Through LightningCLI (as in docs/lightning.md): the message is in what the user sees."""
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    monkeypatch.chdir(tmp_path)
    plugin = ('[{"class_path": "lightning_ckpt.CheckrunCheckpointIO", '
              '"init_args": {"overrides": {"saving.asynchronus": false}}}]')
    with pytest.raises((ValueError, SystemExit)) as err:
        LightningCLI(BoringModel, BoringDataModule, run=False, save_config_callback=None,
                     args=["--trainer.logger", "false", "--trainer.plugins", plugin])
    assert "did you mean 'saving.asynchronous'?" in str(err.value)
