"""The step log in the Lightning plugin across epoch ends: a run stopped at step K (the log flushed, no
save at the end, as after a kill) resumes with ``fit(ckpt_path="last")`` from a checkpoint saved at an
epoch end (``ModelCheckpoint``'s default) or from one whose replayed steps cross an epoch end. The
resumed fit must go on exactly as Lightning's own resume of a checkpoint saved at step K does (stock
``TorchCheckpointIO``, ``ModelCheckpoint(every_n_train_steps=K)``): the fit loop's whole state when
training starts, and after the fit the model, the loop state and ``global_step``.

Before 2026-12-05 the replayed steps of an epoch-end checkpoint counted in the totals only and the
next epoch started at its first batch again (33 steps in a 30-step fit), and replayed steps that
crossed an epoch end warned that the epoch counters were not exact."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, GradientAccumulationScheduler, ModelCheckpoint, WeightAveraging
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt import CheckrunCheckpointIO


class Net(LightningModule):
    def __init__(self, scheduler: str | None = None, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.scheduler = scheduler
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        if self.scheduler == "plateau":
            self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        if batch_idx % 2 == 0:  # manual optimization: a step every 2nd batch
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        if self.scheduler is None:
            return opt
        if self.scheduler == "plateau":  # stepped by the fit loop after the epoch's checkpoint hooks
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "train_loss"}}
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.scheduler}}


def _data(iterable: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 1, generator=g))
    return DataLoader(_Stream(data) if iterable else data, batch_size=8)


class _Stream(torch.utils.data.IterableDataset):
    """An iterable dataset without ``__len__``: Lightning does not know the epoch's length."""

    def __init__(self, data) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)


class _Stopped(Exception):
    pass


class _Stop(Callback):
    """Stops the fit before the batch after step ``at`` (after that step's saves; the log flushed)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            io = trainer.strategy.checkpoint_io
            if isinstance(io, CheckrunCheckpointIO):
                io.wait()
                io.step_log.flush()
            raise _Stopped


class _AtStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.loops = _loops(trainer)


def _loops(trainer: Trainer) -> dict:
    fit = trainer.fit_loop
    return {"state": json.loads(json.dumps(fit.state_dict(), default=str)), "global_step": trainer.global_step,
            "stages": (fit._restart_stage, fit.epoch_loop._restart_stage)}


def _fit(callbacks: list, plugins: list, module: dict, validate: bool, ckpt_path=None, iterable=False, net=None,
         **trainer_kwargs):
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=callbacks, plugins=plugins, **trainer_kwargs)
    model = (net or Net)(**module)
    try:
        trainer.fit(model, _data(iterable), _data() if validate else None, ckpt_path=ckpt_path)
    except _Stopped:
        pass
    return trainer, model


CASES = {  # name: (stop at step K, checkrun's ModelCheckpoint arguments, module, validate, Trainer arguments)
    "epoch_end_checkpoint": (13, {}, {}, False, {}),
    "replay_crosses_an_epoch_end": (13, {"every_n_train_steps": 7}, {}, False, {}),
    "replay_of_more_than_an_epoch": (35, {"every_n_epochs": 2}, {}, False, {"max_epochs": 5}),
    "epoch_scheduler": (13, {}, {"scheduler": "epoch"}, False, {}),
    "step_scheduler_crossing": (13, {"every_n_train_steps": 7}, {"scheduler": "step"}, False, {}),
    # ReduceLROnPlateau steps after every checkpoint hook of its epoch (FitLoop.on_advance_end): from a
    # checkpoint at an epoch's end its update lies in the replayed range (found by an independent check)
    "plateau_scheduler": (13, {}, {"scheduler": "plateau"}, False, {}),
    "plateau_last_batch_checkpoint": (13, {"every_n_train_steps": 10}, {"scheduler": "plateau"}, False, {}),
    "plateau_crossing": (13, {"every_n_train_steps": 7}, {"scheduler": "plateau"}, False, {}),
    "plateau_over_an_epoch": (35, {"every_n_epochs": 2}, {"scheduler": "plateau"}, False, {"max_epochs": 5}),
    "checkpoint_at_validation_end": (13, {}, {}, True, {}),
    "validation_replayed_over": (13, {"every_n_train_steps": 7}, {}, True, {}),
    "accumulate_grad_batches": (11, {}, {}, False, {"accumulate_grad_batches": 3}),
    # 10 batches, a step every 3rd and at the last: an epoch's last step takes one batch
    "accumulation_crossing": (5, {"every_n_train_steps": 3}, {}, False, {"accumulate_grad_batches": 3}),
    "accumulation_over_an_epoch": (15, {"every_n_epochs": 2}, {}, False, {"accumulate_grad_batches": 3,
                                                                          "max_epochs": 5}),
    "manual_optimization": (7, {}, {"manual": True}, False, {}),
    "iterable_dataset_without_len": (13, {}, {}, False, {"iterable": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_resume_across_an_epoch_end_goes_on_as_lightnings_own_checkpoint_at_that_step(tmp_path, name):
    stop, checkpointing, module, validate, kwargs = CASES[name]
    kwargs = {"max_epochs": 3, "default_root_dir": str(tmp_path), **kwargs}
    # Lightning alone: a checkpoint at step `stop`, resumed
    stock_dir = str(tmp_path / "stock")
    _fit([ModelCheckpoint(dirpath=stock_dir, filename="k", every_n_train_steps=stop, save_top_k=-1), _Stop(stop)],
         [], module, validate, **kwargs)
    stock_start = _AtStart()
    stock, stock_model = _fit([stock_start], [], module, validate, ckpt_path=f"{stock_dir}/k.ckpt", **kwargs)
    # checkrun: the newest checkpoint before `stop`, then the logged steps replayed
    directory = str(tmp_path / "ckpts")

    def io() -> CheckrunCheckpointIO:
        return CheckrunCheckpointIO(step_log=True)

    _fit([ModelCheckpoint(dirpath=directory, save_last=True, **checkpointing), _Stop(stop)], [io()], module, validate,
         **kwargs)
    start = _AtStart()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="checkrun", category=RuntimeWarning)
        resumed, model = _fit([start, ModelCheckpoint(dirpath=directory, save_last=True, **checkpointing)], [io()],
                              module, validate, ckpt_path="last", **kwargs)
    assert start.loops["global_step"] == stop
    if name == "validation_replayed_over":  # the validation run at epoch 0's end was replayed over, not run:
        for loops in (start.loops, stock_start.loops):  # its counters are the checkpoint's (docs/lightning.md)
            loops["state"].pop("epoch_loop.val_loop.batch_progress")
    assert start.loops == stock_start.loops
    assert resumed.global_step == stock.global_step
    assert _loops(resumed) == _loops(stock)
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


class _Backbone(Net):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(4, 4)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(self.backbone(batch[0])), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01, momentum=0.9)


def test_a_parameter_group_added_mid_log_ends_the_replay_before_it(tmp_path):
    """BackboneFinetuning adds the backbone's parameter group when it unfreezes it (epoch 1 here):
    the steps logged after that name two groups, the restored optimizer has one until the callback
    adds it again at that epoch's start. fit(ckpt_path="last") raised StepLogError ("logged for 2
    parameter groups, the optimizer has 1") on every try (found by an independent check). The replay
    stops before the first such step with a warning; the fit goes on from there as Lightning's own
    resume of that step's checkpoint does (2 epochs: from a checkpoint at an epoch's last batch,
    Lightning skips the next epoch's on_train_epoch_start, so BackboneFinetuning fails at epoch 2 after
    either resume; docs/lightning.md)."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def fit(plugins, checkpoint, stop=None, ckpt_path=None):
        callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1), checkpoint]
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_epochs=2, default_root_dir=str(tmp_path), plugins=plugins,
                          callbacks=callbacks + ([_Stop(stop)] if stop else []))
        model = _Backbone()
        try:
            trainer.fit(model, _data(), ckpt_path=ckpt_path)
        except _Stopped:
            pass
        return trainer, model

    stock_dir, ours = str(tmp_path / "stock"), str(tmp_path / "ours")
    fit([], ModelCheckpoint(dirpath=stock_dir, filename="k", every_n_train_steps=10, save_top_k=-1), stop=13)  # at 10
    stock, stock_model = fit([], ModelCheckpoint(dirpath=stock_dir, filename="k2"), ckpt_path=f"{stock_dir}/k.ckpt")
    fit([CheckrunCheckpointIO(step_log=True)], ModelCheckpoint(dirpath=ours, every_n_train_steps=7, save_last=True),
        stop=13)  # last.ckpt at step 7; steps 8-10 logged with one group, 11-13 (epoch 1) with two
    with pytest.warns(UserWarning, match="parameter groups changed in the logged run"):
        resumed, model = fit([CheckrunCheckpointIO(step_log=True)], ModelCheckpoint(dirpath=ours, save_last=True),
                             ckpt_path="last")
    assert resumed.global_step == stock.global_step == 20
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


class EMA(WeightAveraging):
    """A user's subclass, as Lightning's docstring suggests (its name lacks "WeightAveraging")."""


class _Checkpoint(ModelCheckpoint):
    """A user's subclass that changes nothing of the state: not named (h160)."""


class _Counter(Callback):
    def __init__(self) -> None:
        self.n = 0

    def on_train_batch_end(self, *args) -> None:
        self.n += 1

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


@pytest.mark.parametrize("averaging,counter", [(EMAWeightAveraging, False), (EMA, True)])
def test_a_replay_under_a_weight_averaging_callback_says_the_average_missed_its_steps(tmp_path, averaging, counter):
    """EMAWeightAveraging updates its average in on_train_batch_end, which a replay does not run: the
    resumed average stayed at the checkpoint's, silently (found by an independent check); a subclass named
    otherwise, and a user's callback counting batches (a warm-up's LR then off), were silent until h156."""

    def fit(stop=None, ckpt_path=None):
        callbacks = [averaging(), *([_Counter()] if counter else []), _Checkpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=7,
                                                            save_last=True)]
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_epochs=2, default_root_dir=str(tmp_path), plugins=[CheckrunCheckpointIO(step_log=True)],
                          callbacks=callbacks + ([_Stop(stop)] if stop else []))
        try:
            trainer.fit(Net(), _data(), ckpt_path=ckpt_path)
        except _Stopped:
            pass

    fit(stop=12)  # last.ckpt at 7, steps 8-12 logged
    with pytest.warns(RuntimeWarning) as caught:
        fit(ckpt_path="last")
    said = [str(w.message) for w in caught if str(w.message).startswith("checkrun:")]
    assert any(f"{averaging.__name__} did not see the 5 replayed step(s)" in m for m in said), said
    assert any("the state of _Counter is the checkpoint's" in m for m in said) == counter, said
    assert not any("_Checkpoint" in m or "Net.on_save_checkpoint" in m for m in said), said


@pytest.mark.parametrize("every,stop,pruned", [(12, 15, True), (7, 9, False)])
def test_a_replay_under_model_pruning_says_the_pruned_weights_moved(tmp_path, every, stop, pruned):
    """ModelPruning saves its weights pruned without the masks (make_pruning_permanent): the replayed steps
    moved the pruned weights off zero, so the resumed model was not the step's, silently (h164). Before its
    first pruning (an epoch end) nothing is zero: no warning (the first version warned: h168)."""
    from lightning.pytorch.callbacks import ModelPruning

    def fit(stop=None, ckpt_path=None):
        callbacks = [ModelPruning("l1_unstructured", amount=0.5, verbose=0),
                     ModelCheckpoint(dirpath=str(tmp_path / "c"), every_n_train_steps=every, save_last=True)]
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_epochs=3, default_root_dir=str(tmp_path), plugins=[CheckrunCheckpointIO(step_log=True)],
                          callbacks=callbacks + ([_Stop(stop)] if stop else []))
        model = Net()
        try:
            trainer.fit(model, _data(), ckpt_path=ckpt_path)
        except _Stopped:
            pass
        return model

    fit(stop=stop)  # pruned at the end of epoch 0 (step 10); last.ckpt at 12 (weights zeroed); steps 13-15 logged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ckpt_path="last")
    said = [str(w.message) for w in caught if str(w.message).startswith("checkrun:")]
    assert any(f"ModelPruning's masks are not in the checkpoint, so the {stop - every} replayed step(s)" in m
               for m in said) == pruned, said


class _Dropout(Net):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))


def test_a_replay_to_an_epoch_end_goes_on_with_the_uninterrupted_runs_random_numbers(tmp_path):
    """A shuffled DataLoader and dropout: after a replay that ends at an epoch's end, the next epoch
    differed from the uninterrupted run's. Lightning makes the epoch's dataloader iterator (a RandomSampler
    draws its seed, the DataLoader its base seed) before on_train_start, where the replay then set the RNG
    states to those after the last replayed step: every later draw was one off (found by an independent
    check). The iterator is made again after such a replay."""
    from lightning.pytorch import seed_everything

    def fit(max_steps, plugins=(), callbacks=(), ckpt_path=None):
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          max_steps=max_steps, default_root_dir=str(tmp_path), plugins=list(plugins),
                          callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        model = _Dropout()
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(80, 4, generator=g), torch.randn(80, 1, generator=g))
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        return model

    seed_everything(0)
    reference = fit(20)  # two epochs of 10 batches, uninterrupted
    seed_everything(0)
    directory = str(tmp_path / "ckpts")
    fit(10, [CheckrunCheckpointIO(step_log=True)],
        [ModelCheckpoint(dirpath=directory, every_n_train_steps=7, save_last=True)])  # epoch 0; saved at 7
    resumed = fit(20, [CheckrunCheckpointIO(step_log=True)],
                  [ModelCheckpoint(dirpath=directory, every_n_train_steps=7, save_last=True)], ckpt_path="last")
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("max_steps", [10, 7, 4])
def test_a_resume_with_a_smaller_max_steps_than_the_logged_run_stops_there(tmp_path, max_steps):
    """A run logged to step 13 (checkpoint at step 7) resumed by a fit with ``max_steps`` 10 (inside the
    log), 7 (the checkpoint's own step) or 4 (before it): the fit ends at step 10, 7 and 7 (Lightning's own
    resume of the checkpoint does not train below its step), holding the uninterrupted run's state there
    (h111: the replay went on to step 13, past the fit's budget)."""
    kwargs = {"max_epochs": 3, "default_root_dir": str(tmp_path)}
    stock, stock_model = _fit([_Stop(max(7, max_steps))], [], {}, False, **kwargs)
    directory = str(tmp_path / "ckpts")
    _fit([ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=7), _Stop(13)],
         [CheckrunCheckpointIO(step_log=True)], {}, False, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="checkrun", category=RuntimeWarning)
        resumed, model = _fit([ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=7)],
                              [CheckrunCheckpointIO(step_log=True)], {}, False, ckpt_path="last",
                              max_steps=max_steps, **kwargs)
    assert resumed.global_step == stock.global_step == max(7, max_steps)
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ours, theirs = resumed.optimizers[0].state_dict()["state"], stock.optimizers[0].state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for i, state in theirs.items():
        assert all(torch.equal(ours[i][k], v) for k, v in state.items()), i


@pytest.mark.parametrize("how", ["accumulation_scheduler", "accumulation_changed_at_the_resume"])
def test_a_resume_counts_the_replayed_batches_of_the_logged_runs_accumulation(tmp_path, how):
    """Steps 8-11 logged with 3 batches per step, resumed by a Trainer whose ``accumulate_grad_batches``
    is 1 when the replay runs: a ``GradientAccumulationScheduler({0: 3})`` (it sets 3 only at the epoch's
    start), or a resume with another accumulation (fewer devices). The loops stand as in Lightning's own
    resume of a checkpoint at step 11 (h111: the replayed steps were counted as one batch each, 6 batches
    behind, and the rest of the run trained on other batches)."""
    kwargs = {"max_epochs": 4, "default_root_dir": str(tmp_path)}
    first = {"accumulate_grad_batches": 3} if how.endswith("resume") else {}
    extra = (lambda: [GradientAccumulationScheduler({0: 3})]) if not first else list
    stock_dir = str(tmp_path / "stock")
    _fit([ModelCheckpoint(dirpath=stock_dir, filename="k", every_n_train_steps=11, save_top_k=-1), _Stop(11),
          *extra()], [], {}, False, **first, **kwargs)
    stock_start = _AtStart()
    stock, stock_model = _fit([stock_start, *extra()], [], {}, False, ckpt_path=f"{stock_dir}/k.ckpt", **kwargs)
    directory = str(tmp_path / "ckpts")
    _fit([ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=7), _Stop(11), *extra()],
         [CheckrunCheckpointIO(step_log=True)], {}, False, **first, **kwargs)
    start = _AtStart()
    resumed, model = _fit([start, ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=7),
                           *extra()], [CheckrunCheckpointIO(step_log=True)], {}, False, ckpt_path="last", **kwargs)
    assert start.loops["global_step"] == 11
    assert start.loops == stock_start.loops
    assert resumed.global_step == stock.global_step
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


class _Overflows(Net):
    """A loss of inf at batches ``at`` (of the fit): a GradScaler skips those optimizer steps."""

    at = (9, 10)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.fit_loop.epoch_loop.batch_progress.total.ready in self.at else loss


class _OverflowsLast(_Overflows):
    at = (11,)


def test_a_replay_whose_last_logged_step_a_grad_scaler_skipped_resumes_after_its_batch(tmp_path):
    """The step after the last replayed one was skipped (inf loss at batch 11), then the run stopped: the
    resumed fit counted one batch less than Lightning's own resume at step 11 and trained batch 11 again,
    one optimizer step too many (h116): the log holds the global_step of the last step applied, too."""
    from lightning.pytorch.plugins import MixedPrecision

    def fit(callbacks, plugins, **kwargs):
        amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        return _fit(callbacks, [amp, *plugins], {}, False, net=_OverflowsLast, max_epochs=3,
                    default_root_dir=str(tmp_path), **kwargs)

    stock_dir, directory = str(tmp_path / "stock"), str(tmp_path / "ckpts")
    fit([ModelCheckpoint(dirpath=stock_dir, filename="k", every_n_train_steps=11, save_top_k=-1), _Stop(11)], [])
    stock_start = _AtStart()
    stock, stock_model = fit([stock_start], [], ckpt_path=f"{stock_dir}/k.ckpt")
    fit([ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=4), _Stop(11)],
        [CheckrunCheckpointIO(step_log=True)])
    start = _AtStart()
    resumed, model = fit([start, ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=4)],
                         [CheckrunCheckpointIO(step_log=True)], ckpt_path="last")
    assert start.loops["global_step"] == 11
    assert start.loops == stock_start.loops
    assert resumed.global_step == stock.global_step == 30
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_resume_with_a_smaller_max_steps_counts_the_steps_a_grad_scaler_skipped(tmp_path):
    """Lightning's global_step counts the steps a GradScaler skipped; the log holds no step for them. A
    resume with max_steps 10 of a run logged to step 11 (checkpoint at 6, steps 9 and 10 skipped)
    replayed 3 steps (7, 8 and 11) and ended at global_step 11 (h113): the limit is the logged global_step."""
    from lightning.pytorch.plugins import MixedPrecision

    def fit(plugins, callbacks, ckpt_path=None, **kwargs):
        amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        return _fit(callbacks, [amp, *plugins], {}, False, ckpt_path=ckpt_path, net=_Overflows, max_epochs=3,
                    default_root_dir=str(tmp_path), **kwargs)

    stock, stock_model = fit([], [_Stop(10)])
    directory = str(tmp_path / "ckpts")
    fit([CheckrunCheckpointIO(step_log=True)], [ModelCheckpoint(dirpath=directory, save_last=True,
                                                                every_n_train_steps=6), _Stop(11)])
    resumed, model = fit([CheckrunCheckpointIO(step_log=True)], [ModelCheckpoint(dirpath=directory, save_last=True,
                                                                                 every_n_train_steps=6)],
                         ckpt_path="last", max_steps=10)
    assert resumed.global_step == stock.global_step == 10
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_replay_ending_at_an_epoch_end_counts_that_epochs_steps_with_its_own_accumulation(tmp_path):
    """GradientAccumulationScheduler({0: 2, 3: 4}), 10 batches per epoch (5 steps): a run stopped after
    the next epoch started, with 4 batches per step, flushed the log there; the replay to step 15 (epoch
    2's end) counted epoch 2's steps with 4 (3 steps where Lightning has 5; h113): the accumulation is
    logged with each step's batch."""
    kwargs = {"max_epochs": 5, "default_root_dir": str(tmp_path)}
    stock_dir = str(tmp_path / "stock")
    _fit([ModelCheckpoint(dirpath=stock_dir, filename="k", every_n_train_steps=15, save_top_k=-1), _Stop(15),
          GradientAccumulationScheduler({0: 2, 3: 4})], [], {}, False, **kwargs)
    stock_start = _AtStart()
    stock, stock_model = _fit([stock_start, GradientAccumulationScheduler({0: 2, 3: 4})], [], {}, False,
                              ckpt_path=f"{stock_dir}/k.ckpt", **kwargs)
    directory = str(tmp_path / "ckpts")
    _fit([ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=8), _Stop(15),
          GradientAccumulationScheduler({0: 2, 3: 4})], [CheckrunCheckpointIO(step_log=True)], {}, False, **kwargs)
    start = _AtStart()
    resumed, model = _fit([start, ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=8),
                           GradientAccumulationScheduler({0: 2, 3: 4})], [CheckrunCheckpointIO(step_log=True)], {},
                          False, ckpt_path="last", **kwargs)
    assert start.loops["global_step"] == 15
    assert start.loops == stock_start.loops
    assert resumed.global_step == stock.global_step
    for key, value in stock_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
