"""``import pytorch_lightning as pl`` and ``lightning_fabric``: the standalone packages (``lightning`` installs
them) hold the same code as ``lightning.pytorch``/``lightning.fabric`` under other names, with classes of
their own. Before, ``pl.Trainer(plugins=[CheckrunCheckpointIO()])`` raised "Found invalid type for
plugin", and their loaders could not read a checkrun checkpoint (found by a Fabric users' check)."""
from __future__ import annotations

import lightning_fabric
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel

from lightning_ckpt import CheckrunCheckpointIO
from tests.integration.test_lightning_common import tensors_equal


def _trainer(root, plugins, epochs: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(default_root_dir=str(root), plugins=plugins, callbacks=list(callbacks), accelerator="cpu",
                      max_epochs=epochs, limit_train_batches=3, limit_val_batches=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_pytorch_lightning_trains_resumes_and_loads_through_the_plugin(tmp_path) -> None:
    plugin = CheckrunCheckpointIO()
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_last=True)
    model = BoringModel()
    _trainer(tmp_path, [plugin], 2, [mc]).fit(model)
    last = tmp_path / "ckpts" / "last.ckpt"
    assert last.read_bytes().startswith(b'{"_checkrun"')  # written by checkrun, not torch.save
    resumed = _trainer(tmp_path, [CheckrunCheckpointIO()], 3, [ModelCheckpoint(dirpath=str(tmp_path / "ckpts"))])
    resumed.fit(BoringModel(), ckpt_path=str(last))
    assert resumed.global_step == 9
    loaded = BoringModel.load_from_checkpoint(str(last))  # pytorch_lightning's own loader
    assert tensors_equal(loaded.state_dict(), model.state_dict())
    stock = _trainer(tmp_path, None, 3)  # a pytorch_lightning Trainer without the plugin
    stock.fit(BoringModel(), ckpt_path=str(last))
    assert stock.global_step == 9


def test_lightning_fabric_saves_and_loads_through_the_plugin(tmp_path) -> None:
    plugin = CheckrunCheckpointIO()
    fabric = lightning_fabric.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(torch.nn.Linear(3, 2))
    fabric.save(tmp_path / "f.ckpt", {"model": model, "step": 7})
    plugin.teardown()
    assert (tmp_path / "f.ckpt").read_bytes().startswith(b'{"_checkrun"')
    other = fabric.setup_module(torch.nn.Linear(3, 2))
    rest = fabric.load(tmp_path / "f.ckpt", {"model": other})
    assert rest == {"step": 7} and tensors_equal(other.state_dict(), model.state_dict())
