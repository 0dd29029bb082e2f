"""The step log in the Accelerate adapter (issue 23): ``step_log.enabled: true`` logs the prepared
optimizer's steps; ``load_state()`` loads the checkpoint, then replays the steps logged after it.

In-process with a real Accelerator, and a real ``accelerate launch`` (1 process, and 2 CPU ranks)
SIGKILLed at a random step: the resumed state equals an uninterrupted run's at the resumed step, bit
for bit, on every rank, and no step whose ``flush()`` had returned is lost. The launch is
synchronised through the lines the script prints (and appends to its progress file) after each step.
"""
from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration

from accelerate_ckpt import AcceleratorCheckpointer
from accelerate_ckpt.steplog import StepLogSetupError
from tests.core.steplog_train import assert_bit_equal, batch, make
from tests.integration.accel_scripts.harness import BIN, REPO, accelerate_args, launch_env, run

CHILD = Path(__file__).resolve().parent / "steplog_accel_child.py"
CONFIG = {"step_log": {"enabled": True, "flush_every_steps": 3}, "saving": {"sigterm_grace_seconds": None}}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# -- in-process -----------------------------------------------------------------------------------
def _setup(project: Path, kind: str = "adam", config: dict | None = None) -> tuple:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True))
    net, opt, sched = acc.prepare(*make(kind))
    return acc, net, opt, sched, AcceleratorCheckpointer(acc, config or CONFIG).attach()


def _step(acc: Accelerator, net, opt, sched, step: int) -> None:
    ids, y = batch(step)
    opt.zero_grad()
    acc.backward(torch.nn.functional.mse_loss(net(ids), y))
    acc.clip_grad_norm_(net.parameters(), 0.5)
    opt.step()
    sched.step()


def _state(net, opt, sched) -> dict:
    """A copy: the optimizer's state_dict holds its live tensors, which later steps change in place."""
    return copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})


def _reference(kind: str, steps: int) -> dict:
    """An uninterrupted run, without checkrun, through a second Accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    net, opt, sched = acc.prepare(*make(kind))
    for step in range(1, steps + 1):
        _step(acc, net, opt, sched, step)
    return _state(net, opt, sched)


@pytest.mark.parametrize("kind", ["adam", "sgd", "adam_bn"])
def test_load_state_replays_to_the_last_step_and_a_second_resume_follows_the_chain(tmp_path: Path, kind: str) -> None:
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj", kind)
    for step in range(1, 11):
        _step(acc, net, opt, sched, step)
        if step == 4:
            acc.save_state()
    at_10 = _state(net, opt, sched)
    assert ckpt.optimizer_steps == 10 and ckpt.step_log is not None
    acc.load_state()  # checkpoint_0 (step 4) + steps 5..10 from the log
    assert (ckpt.replayed_steps, ckpt.optimizer_steps) == (6, 10)
    assert_bit_equal(_state(net, opt, sched), at_10, "after the first replay")
    for step in range(11, 14):  # logged by the log that continues the replayed chain
        _step(acc, net, opt, sched, step)
    at_13 = _state(net, opt, sched)
    acc.load_state()  # still checkpoint_0: steps 5..10 (first run), 11..13 (the continuation)
    assert (ckpt.replayed_steps, ckpt.optimizer_steps) == (9, 13)
    assert_bit_equal(_state(net, opt, sched), at_13, "after the second replay")
    ckpt.close()
    assert_bit_equal(at_13, _reference(kind, 13), "against an uninterrupted run")


def test_a_second_accelerator_of_the_process_replays_the_first_ones_unflushed_steps(tmp_path: Path) -> None:
    """The first Accelerator's log still held steps not written (no end_training(), the object kept) when a
    second one of the same process called load_state(): it replayed the committed steps only, silently,
    and its own log went on from there, so those steps were lost for good (found by an independent
    check). The replay now flushes the other open logs of the directory first."""
    config = {**CONFIG, "step_log": {"enabled": True, "flush_every_steps": 100}}
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj", config=config)
    for step in range(1, 11):
        _step(acc, net, opt, sched, step)
        if step == 4:
            acc.save_state()
    at_10 = _state(net, opt, sched)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, net2, opt2, sched2, ckpt2 = _setup(tmp_path / "proj", config=config)
    acc2.load_state()
    assert (ckpt2.replayed_steps, ckpt2.optimizer_steps) == (6, 10)
    assert_bit_equal(_state(net2, opt2, sched2), at_10, "the second Accelerator after load_state()")
    ckpt2.close()
    ckpt.close()


def test_another_project_loading_a_checkpoint_leaves_its_log_alone(tmp_path: Path) -> None:
    """Project B loads project A's newest checkpoint and trains 3 steps. B's log went on in A's directory,
    so A's next load_state() replayed B's 3 steps: another run's state, silently (found by an independent
    check). B logs from its own first save on; A resumes exactly where it was."""
    acc, net, opt, sched, ckpt = _setup(tmp_path / "a")
    for step in range(1, 6):
        _step(acc, net, opt, sched, step)
    acc.save_state()
    at_5 = _state(net, opt, sched)
    ckpt.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc_b, net_b, opt_b, sched_b, ckpt_b = _setup(tmp_path / "b")
    acc_b.load_state(str(tmp_path / "a" / "checkpoints" / "checkpoint_0"))
    for step in range(6, 9):
        _step(acc_b, net_b, opt_b, sched_b, step)
    ckpt_b.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc_a, net_a, opt_a, sched_a, ckpt_a = _setup(tmp_path / "a")
    acc_a.load_state()
    assert (ckpt_a.replayed_steps, ckpt_a.optimizer_steps) == (0, 5)
    assert_bit_equal(_state(net_a, opt_a, sched_a), at_5, "project A resumed")
    ckpt_a.close()


def test_folders_in_temporary_directories_are_deleted_with_the_log_open_and_the_next_one_logs(tmp_path: Path) -> None:
    """accelerate's own tests save into a ``TemporaryDirectory``: with the log on, its cleanup failed with
    "Directory not empty: 'steplog'" (the log's writer went on creating segments there; found by an
    independent check). rmtree closes the log; the next save_state() into another folder opens one there."""
    import tempfile

    acc = Accelerator(cpu=True)
    net, opt, sched = acc.prepare(*make("adam"))
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    for trial in range(2):
        with tempfile.TemporaryDirectory(dir=tmp_path) as d:
            acc.save_state(f"{d}/state")
            for step in range(1, 5):
                _step(acc, net, opt, sched, 10 * trial + step)
            live = _state(net, opt, sched)
            acc.load_state(f"{d}/state")
            assert ckpt.replayed_steps == 4, trial
            assert_bit_equal(_state(net, opt, sched), live, f"trial {trial}")
        assert not os.path.exists(d)
    ckpt.close()


def test_an_older_checkpoint_loaded_by_name_is_a_rewind_and_the_newest_still_resumes(tmp_path: Path) -> None:
    """load_state(folder) of a checkpoint older than the newest replayed the steps logged after it on through
    the newer checkpoints, to the newest logged step: a rewind (accelerate: that folder's state) did not
    go back (an independent check found it undocumented). It now loads the older checkpoint as saved, as
    the Lightning plugin does for any checkpoint but last*.ckpt; load_state() and the newest folder by
    name still resume to the newest logged step, also after such a rewind."""
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")
    saved = {}
    for step in range(1, 13):
        _step(acc, net, opt, sched, step)
        if step in (4, 8):
            acc.save_state()
            saved[step] = _state(net, opt, sched)
    at_12 = _state(net, opt, sched)
    checkpoints = tmp_path / "proj" / "checkpoints"
    acc.load_state(str(checkpoints / "checkpoint_0"))
    assert ckpt.replayed_steps == 0
    assert_bit_equal(_state(net, opt, sched), saved[4], "the older checkpoint, as saved")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state()
    late = [str(w.message) for w in caught if "committed the checkpoint late" in str(w.message)]
    assert not late, late  # no branch at a rewind: a false "late commit" warning (h169)
    assert ckpt.replayed_steps == 4
    assert_bit_equal(_state(net, opt, sched), at_12, "load_state() after the rewind")
    acc.load_state(str(checkpoints / "checkpoint_1"))  # the newest, by name
    assert ckpt.replayed_steps == 4
    assert_bit_equal(_state(net, opt, sched), at_12, "the newest checkpoint by name")
    acc.load_state(f"file://{checkpoints}/checkpoint_1")  # another spelling of it (taken for a rewind: h66)
    assert ckpt.replayed_steps == 4
    ckpt.close()


def test_replay_false_loads_the_newest_checkpoint_as_saved(tmp_path: Path) -> None:
    """With the step log on, load_state() of the newest checkpoint always replayed the steps logged after it:
    no way was left to roll back to it (accelerate's own test_state_checkpointing saves, trains, then loads
    the checkpoint back: 10 of its 18 tests failed with the log on; h166). ``replay=False`` loads it as
    saved, through ``load_state`` and ``ckpt.load``; the steps logged after the rollback are the branch a
    later load_state() resumes, not the abandoned ones (the first version replayed those: h168)."""
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")
    for step in range(1, 11):
        _step(acc, net, opt, sched, step)
        if step == 4:
            acc.save_state()
            at_4 = _state(net, opt, sched)
    acc.load_state(replay=False)
    assert ckpt.replayed_steps == 0
    assert_bit_equal(_state(net, opt, sched), at_4, "the newest checkpoint, as saved")
    for step in range(105, 108):  # another branch after the rollback (other batches)
        _step(acc, net, opt, sched, step)
    branch_b = _state(net, opt, sched)
    acc.load_state()
    assert ckpt.replayed_steps == 3
    assert_bit_equal(_state(net, opt, sched), branch_b, "load_state() after a rollback and a new branch")
    ckpt.load(str(tmp_path / "proj" / "checkpoints" / "checkpoint_0"), replay=False)
    assert ckpt.replayed_steps == 0
    assert_bit_equal(_state(net, opt, sched), at_4, "ckpt.load(replay=False)")
    ckpt.close()


def test_load_state_ends_with_the_rng_states_of_the_last_replayed_step(tmp_path: Path) -> None:
    """accelerate's ``save_state`` keeps the RNG states; a resume through the log ends with those of the
    last replayed step, as a ``save_state()`` there would have them (before 2026-12-06: the checkpoint's)."""
    import numpy as np

    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")
    for step in range(1, 11):
        torch.rand(3), random.random(), np.random.rand()  # a forward pass's draws (dropout, augmentation)
        _step(acc, net, opt, sched, step)
        if step == 4:
            acc.save_state()
    at_10 = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    acc.load_state()  # the checkpoint's states (step 4), then the replay's (step 10)
    assert ckpt.replayed_steps == 6
    assert torch.equal(torch.get_rng_state(), at_10[0]) and random.getstate() == at_10[1]
    assert np.array_equal(np.random.get_state()[1], at_10[2])
    ckpt.close()


@pytest.mark.parametrize("built_on", ["torch optimizer", "prepared optimizer"])
def test_a_scheduler_registered_instead_of_prepared_is_replayed_too(tmp_path: Path, built_on: str) -> None:
    """An LR scheduler registered with register_for_checkpointing (not prepared) is saved and loaded
    with the checkpoint, but the log did not step it: after load_state() it stayed at the checkpoint's
    step while the optimizer was at the replayed one, silently (found by independent checks; built
    on the prepared optimizer, after prepare, it was missed too)."""
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "proj"),
                                                                    automatic_checkpoint_naming=True))
    net, opt, sched = make("adam")
    net, opt = acc.prepare(net, opt)
    if built_on == "prepared optimizer":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)  # as make() builds it
    acc.register_for_checkpointing(sched)
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    for step in range(1, 11):
        _step(acc, net, opt, sched, step)
        if step == 4:
            acc.save_state()
    at_10 = _state(net, opt, sched)
    acc.load_state()
    assert ckpt.replayed_steps == 6 and sched.last_epoch == 10
    assert_bit_equal(_state(net, opt, sched), at_10, "after the replay")
    ckpt.close()


def test_a_prepared_and_a_registered_scheduler_are_refused(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "proj"),
                                                                    automatic_checkpoint_naming=True))
    net, opt, sched = make("adam")
    extra = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    net, opt, sched = acc.prepare(net, opt, sched)
    acc.register_for_checkpointing(extra)
    with pytest.raises(StepLogSetupError, match="a prepared scheduler and a registered one"):
        AcceleratorCheckpointer(acc, CONFIG).attach()


def test_without_the_log_nothing_is_replayed_and_a_checkpoint_without_markers_warns(tmp_path: Path) -> None:
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj", config={"saving": {"sigterm_grace_seconds": None}})
    for step in range(1, 4):
        _step(acc, net, opt, sched, step)
    acc.save_state()
    at_3 = _state(net, opt, sched)
    _step(acc, net, opt, sched, 4)
    acc.load_state()
    assert ckpt.step_log is None and ckpt.optimizer_steps is None and ckpt.replayed_steps == 0
    assert_bit_equal(_state(net, opt, sched), at_3)
    ckpt.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")  # now with the log: the checkpoint has no marker
    with pytest.warns(RuntimeWarning, match="no step log after .*rank0.ckpt"):
        acc.load_state()
    assert ckpt.replayed_steps == 0 and ckpt.optimizer_steps == 0
    assert_bit_equal(_state(net, opt, sched), at_3)
    ckpt.close()


def test_a_registered_module_that_missed_the_replayed_steps_is_named(tmp_path: Path) -> None:
    """An EMA (AveragedModel) registered for checkpointing is updated by the user's loop, which a replay
    does not run: its average stayed the checkpoint's with no word (found by an independent check). A
    registered plain object (a progress record, as the docs' resume loop keeps) is not warned about."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")
    ema = AveragedModel(acc.unwrap_model(net), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    acc.register_for_checkpointing(ema)
    for step in range(1, 6):
        _step(acc, net, opt, sched, step)
        ema.update_parameters(acc.unwrap_model(net))
        if step == 2:
            acc.save_state()
    with pytest.warns(RuntimeWarning, match=r"AveragedModel \(registered for checkpointing\) did not see the 3 "):
        acc.load_state()
    assert int(ema.n_averaged) == 2 and ckpt.replayed_steps == 3
    ckpt.close()


def test_retention_truncates_the_log_and_the_newest_checkpoint_still_replays(tmp_path: Path) -> None:
    pc = ProjectConfiguration(str(tmp_path / "proj"), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=pc)
    net, opt, sched = acc.prepare(*make("adam"))
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    for step in range(1, 24):
        _step(acc, net, opt, sched, step)
        if step % 4 == 0:
            acc.save_state()  # checkpoint_0..4 at steps 4..20; total_limit keeps checkpoint_3 and 4
    ckpt.wait()
    at_23 = _state(net, opt, sched)
    logdir = tmp_path / "proj" / "checkpoints" / ".checkrun" / "parts" / ".checkrun" / "steplog"
    markers = sorted(p.name for p in logdir.glob("mark-*.json"))
    assert len(markers) == 2, markers  # those of the retained checkpoints' rank 0 parts
    acc.load_state()  # checkpoint_4 (step 20) + 21..23
    assert (ckpt.replayed_steps, ckpt.optimizer_steps) == (3, 23)
    assert_bit_equal(_state(net, opt, sched), at_23)
    ckpt.close()


def test_two_optimizers_are_refused_naming_the_setting(tmp_path: Path) -> None:
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    acc.prepare(a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1))
    ckpt = AcceleratorCheckpointer(acc, CONFIG)
    with pytest.raises(StepLogSetupError, match="step_log.enabled.*2 prepared optimizer"):
        ckpt.attach()
    ckpt.close()


def test_an_accelerator_without_an_optimizer_saves_and_loads_with_the_log_on(tmp_path: Path) -> None:
    """An evaluation script sharing the training run's config (step_log.enabled): save_state() raised
    StepLogSetupError ("0 prepared optimizer(s)", found by an independent check). It now saves and loads
    as without the log, with a warning that nothing is logged."""
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    model = acc.prepare(torch.nn.Linear(2, 2))
    ckpt = AcceleratorCheckpointer(acc, CONFIG).attach()
    with pytest.warns(RuntimeWarning, match="no prepared optimizer"):
        acc.save_state()
    weights = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state()
    assert ckpt.replayed_steps == 0 and torch.equal(model.weight, weights["weight"])
    ckpt.close()


# -- real accelerate launch, SIGKILL ------------------------------------------------------------------
def _env(tmp: Path) -> dict:
    return launch_env(tmp, {"PYTHONPATH": str(REPO)})  # the script imports tests.core.steplog_train


def _train_until_killed(tmp: Path, processes: int, kind: str, kill_after: int) -> tuple[int, list[str]]:
    """Launch the training, SIGKILL the whole launch once step >= kill_after was flushed after a
    committed checkpoint; returns (last flushed step, the progress file's lines)."""
    progress = tmp / "progress.txt"
    cmd = [BIN / "accelerate", "launch", *accelerate_args(processes), CHILD, "train", "--project", tmp / "proj",
           "--progress", progress, "--kind", kind]
    with open(tmp / "train.stderr", "w") as err:
        child = subprocess.Popen(list(map(str, cmd)), cwd=str(REPO), env=_env(tmp), stdout=subprocess.PIPE,
                                 stderr=err, text=True, start_new_session=True)
        flushed, committed = 0, False
        try:
            for line in child.stdout:
                what, _, value = line.strip().partition(" ")
                if what not in ("step", "committed", "flushed"):
                    continue
                committed = committed or what == "committed"
                if what == "flushed":
                    flushed = int(value)
                    if flushed >= kill_after and committed:
                        break
            os.killpg(child.pid, signal.SIGKILL)  # the launcher and every rank; training went on meanwhile
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == -signal.SIGKILL, (tmp / "train.stderr").read_text()[-4000:]
    return flushed, progress.read_text().split("\n")


@pytest.mark.slow
@pytest.mark.parametrize("processes,kind", [(1, "adam"), (1, "sgd"), (2, "adamw")])
def test_accelerate_launch_sigkilled_at_a_random_step_resumes_bit_exact(tmp_path: Path, processes: int,
                                                                       kind: str) -> None:
    seed = random.randrange(1 << 30)
    kill_after = random.Random(seed).randrange(8, 40)
    flushed, lines = _train_until_killed(tmp_path, processes, kind, kill_after)
    assert flushed >= kill_after, f"seed {seed}: the training ended before step {kill_after}"
    last = max(int(line.split()[1]) for line in lines if line.strip())
    out = tmp_path / "out"
    out.mkdir()
    run([BIN / "accelerate", "launch", *accelerate_args(processes), CHILD, "resume", "--project", tmp_path / "proj",
         "--out", out, "--kind", kind], _env(tmp_path))
    for rank in range(processes):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        where = f"seed {seed}, rank {rank}, resumed at step {got['steps']} ({got['replayed']} replayed)"
        assert got["world"] == processes
        # nothing flushed is lost; nothing after the step the kill interrupted can be in the log
        assert flushed <= got["steps"] <= last + 1, where
        assert (got["steps"] - got["replayed"]) % 7 == 0, where  # a checkpoint's step (one every 7) + the log
        assert_bit_equal(got["resumed"], got["reference"], where)


class _Progress:
    """The loop's own position, registered for checkpointing (as accelerate's examples keep theirs)."""

    def __init__(self) -> None:
        self.epoch = self.batch = self.steps = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch, self.steps = state["epoch"], state["batch"], state["steps"]


def _accumulating(project: Path, shuffle: bool) -> tuple:
    torch.manual_seed(0)
    from accelerate.utils import DataLoaderConfiguration

    acc = Accelerator(cpu=True, gradient_accumulation_steps=3,  # shuffled: an order that a resume can redo
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=shuffle),
                      project_config=ProjectConfiguration(str(project), automatic_checkpoint_naming=True))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(25, 4, generator=g), torch.randn(25, 1, generator=g))
    net = torch.nn.Linear(4, 1)
    net, opt, dl = acc.prepare(net, torch.optim.Adam(net.parameters(), lr=0.01),
                               torch.utils.data.DataLoader(data, batch_size=1, shuffle=shuffle))
    progress = _Progress()
    acc.register_for_checkpointing(progress)
    return acc, net, opt, dl, progress, AcceleratorCheckpointer(acc, CONFIG).attach()


def _train(acc, net, opt, dl, progress, until: int, save_at: int | None = None, skip: int = 0) -> None:
    """Steps until optimizer step ``until``, skipping ``skip`` batches first, carried over epochs."""
    while progress.steps < until:
        progress.batch = min(skip, len(dl))
        skip -= progress.batch
        dl.set_epoch(progress.epoch)  # the seedable sampler's order of this epoch
        for x, y in acc.skip_first_batches(dl, progress.batch) if progress.batch else dl:
            with acc.accumulate(net):
                acc.backward(torch.nn.functional.mse_loss(net(x), y))
                opt.step()
                opt.zero_grad()
            progress.batch += 1
            if acc.sync_gradients:
                progress.steps += 1
                if progress.steps == save_at:
                    acc.save_state()
                if progress.steps == until:
                    return
        progress.epoch, progress.batch = progress.epoch + 1, 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_documented_resume_skips_the_batches_the_replayed_steps_took(tmp_path: Path, shuffle: bool) -> None:
    """25 batches per epoch, 3 per step: a checkpoint at step 7 (batch 21), steps 8-11 logged (batches
    21-23, 24 alone at the epoch's end, then 6 of the next epoch). The documented recipe, skipping
    ``start_batch + ckpt.replayed_batches(len(dl), start_batch)`` batches carried over epochs, goes on
    as the uninterrupted run (h110: ``replayed_steps * gradient_accumulation_steps`` skipped 12)."""
    acc, net, opt, dl, progress, ckpt = _accumulating(tmp_path / "a", shuffle)
    _train(acc, net, opt, dl, progress, until=20)
    want = copy.deepcopy(net.state_dict())
    ckpt.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, net, opt, dl, progress, ckpt = _accumulating(tmp_path / "b", shuffle)
    _train(acc, net, opt, dl, progress, until=11, save_at=7)
    ckpt.step_log.flush()
    ckpt.close()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, net, opt, dl, progress, ckpt = _accumulating(tmp_path / "b", shuffle)
    acc.load_state()
    assert (progress.epoch, progress.batch, progress.steps, ckpt.replayed_steps) == (0, 21, 7, 4)
    skip = progress.batch + ckpt.replayed_batches(len(dl), progress.batch)
    assert skip == 31
    progress.steps += ckpt.replayed_steps
    _train(acc, net, opt, dl, progress, until=20, skip=skip)
    for key, value in want.items():
        assert torch.equal(net.state_dict()[key], value), key
    ckpt.close()


def _linear_run(tmp_path: Path, make_opt: Any, **accelerator: Any) -> tuple:
    """A fresh Accelerator (``accelerator``: its arguments) with a Linear(4, 1), the optimizer ``make_opt``
    builds and a StepLR, prepared, checkrun attached with the step log."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "p"), automatic_checkpoint_naming=True),
                      **accelerator)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = make_opt(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    net, opt, sched = acc.prepare(net, opt, sched)
    return acc, net, opt, sched, AcceleratorCheckpointer(acc, CONFIG).attach()


def test_a_scheduler_stepped_per_micro_batch_resumes_where_the_last_window_ended(tmp_path: Path) -> None:
    """``step_scheduler_with_optimizer=False`` with accumulation: the scheduler steps at every micro-batch. 17
    micro-batches are 5 optimizer steps and 2 micro-batches of the 6th; a resume runs those 2 again, so the
    resumed scheduler must be where step 5's window ended (found by an independent check: it was 2 steps
    ahead, and the learning rate then differed from the uninterrupted run's)."""

    def setup() -> tuple:
        return _linear_run(tmp_path, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                           gradient_accumulation_steps=3, step_scheduler_with_optimizer=False)

    acc, net, opt, sched, ckpt = setup()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 4, generator=g) for _ in range(17)]
    for i, x in enumerate(batches, 1):
        with acc.accumulate(net):
            acc.backward(net(x).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        if i == 6:
            acc.save_state()
        if i == 15:
            at_step_5 = _state(net, opt, sched)
    ckpt.step_log.flush()
    ckpt.close()
    acc, net, opt, sched, ckpt = setup()
    acc.load_state()
    assert ckpt.replayed_steps == 3
    assert sched.state_dict() == at_step_5["sched"]
    assert_bit_equal(_state(net, opt, sched), at_step_5)
    ckpt.close()


def test_hyperparameters_set_after_the_scheduler_step_are_resumed(tmp_path: Path) -> None:
    """The default ``step_scheduler_with_optimizer=True``: a loop that sets a hyperparameter after
    ``scheduler.step()`` resumes with the value of its last step (the first fix of the per-micro-batch
    scheduler logged the state right after the scheduler's step for every prepared scheduler: found by
    the next independent check)."""

    def setup() -> tuple:
        return _linear_run(tmp_path, lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.0))

    acc, net, opt, sched, ckpt = setup()
    g = torch.Generator().manual_seed(0)
    for i in range(1, 8):
        acc.backward(net(torch.randn(2, 4, generator=g)).square().mean())
        opt.step()
        sched.step()
        opt.zero_grad()
        for group in opt.param_groups:
            group["weight_decay"] = 0.01 * i
        if i == 2:
            acc.save_state()
    want = _state(net, opt, sched)
    ckpt.close()
    acc, net, opt, sched, ckpt = setup()
    acc.load_state()
    assert ckpt.replayed_steps == 5 and opt.param_groups[0]["weight_decay"] == 0.07
    assert_bit_equal(_state(net, opt, sched), want)
    ckpt.close()


def test_checkrun_ls_and_verify_of_the_checkpoint_folders_include_the_step_log(tmp_path: Path, capsys) -> None:
    """h125: the log of Accelerate checkpoints is in the parts directory (``checkpoints/.checkrun/parts``);
    ``ls``/``verify`` of the checkpoints directory did not look there (no step-log line; "2 intact"
    without reading a segment), only of ``.checkrun/parts`` itself."""
    from ckpt_core.cli import main as cli

    acc, net, opt, sched, ckpt = _setup(tmp_path / "proj")
    for step in range(1, 7):
        _step(acc, net, opt, sched, step)
        if step == 2:
            acc.save_state()
    ckpt.close()
    directory = str(tmp_path / "proj" / "checkpoints")
    assert cli(["verify", directory]) == 0
    assert "step log intact" in capsys.readouterr().out
    assert cli(["ls", directory]) == 0
    assert ".checkrun/parts/.checkrun/steplog:" in capsys.readouterr().out
