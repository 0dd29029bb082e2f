"""The step log in the Lightning plugin (issue 23): ``CheckrunCheckpointIO(step_log=True)``; a real
``Trainer`` SIGKILLed at a random step resumes with ``fit(ckpt_path="last")`` at the newest logged
step: model, optimizer and scheduler state bit for bit, ``global_step`` and the fit loop's counters as
in a checkpoint Lightning itself saved at that step of an uninterrupted run; no step whose
``flush()`` had returned is lost. Synchronised through the child's stdout (a line per step)."""
from __future__ import annotations

import os
from pathlib import Path
import random
import signal
import subprocess
import sys

import pytest
import torch

from lightning_ckpt import CheckrunCheckpointIO
from lightning_ckpt.steplog import StepLogSetupError, targets
from tests.core.steplog_train import assert_bit_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = [sys.executable, "-m", "tests.integration.steplog_lightning_child"]


def _env(devices: int, accumulate: int = 1) -> dict:
    return {**os.environ, "STEPLOG_DEVICES": str(devices), "STEPLOG_ACCUMULATE": str(accumulate),
            "OMP_NUM_THREADS": "1"}


def _train_until_killed(directory: str, kind: str, kill_after: int, devices: int,
                        accumulate: int = 1) -> tuple[int, int]:
    """Returns (the last flushed step, the last step the child reported)."""
    child = subprocess.Popen([*CHILD, "train", directory, kind], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(devices, accumulate), start_new_session=True)
    flushed, last, committed = 0, 0, False
    try:
        for line in child.stdout:
            what, _, value = line.strip().partition(" ")
            # ckpt_path="last" resumes from last.ckpt: its save (after the top-k file's) must have committed
            committed = committed or (what == "committed" and value.endswith("last.ckpt"))
            if what in ("step", "flushed"):
                last = int(value)
            if what == "flushed":
                flushed = int(value)
                if flushed >= kill_after and committed:  # a checkpoint to resume from exists
                    break
        os.killpg(child.pid, signal.SIGKILL)  # every rank; it trains on meanwhile: the kill lands anywhere
        for line in child.stdout:  # what it printed before the kill landed
            what, _, value = line.strip().partition(" ")
            if what in ("step", "flushed"):
                last = int(value)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read()[-3000:]
    return flushed, last


def _run(devices: int, *args: str, accumulate: int = 1) -> None:
    done = subprocess.run([*CHILD, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=_env(devices, accumulate))
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("devices,kind,accumulate", [(1, "adam", 1), (1, "sgd", 1), (2, "adam", 1), (1, "adam", 3),
                                                     (1, "manual", 1), (1, "bn", 1)])
def test_trainer_sigkilled_at_a_random_step_resumes_from_last_bit_exact_with_counters(tmp_path, devices, kind,
                                                                                       accumulate):
    """``accumulate`` > 1: ``accumulate_grad_batches`` (the kill may land between two optimizer steps;
    the batch counters move ``accumulate`` per logged step). "manual": manual optimization stepping every
    2nd batch with a step-interval scheduler it steps itself (the batch counters move by the batches up
    to the last logged step, the scheduler progress, which Lightning leaves to the module, not at all).
    "bn": a BatchNorm layer, whose running statistics must equal the uninterrupted run's too."""
    seed = random.randrange(1 << 30)
    kill_after = random.Random(seed).randrange(8, 40)
    directory = str(tmp_path / "ckpts")
    flushed, last = _train_until_killed(directory, kind, kill_after, devices, accumulate)
    assert flushed >= kill_after, f"seed {seed}: the child ended before step {kill_after}"
    out = str(tmp_path / "resumed.pt")
    _run(devices, "resume", directory, kind, out, accumulate=accumulate)
    states = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(devices)]
    resumed = states[0]["global_step"]
    where = f"seed {seed}, kill after {kill_after}, resumed at {resumed}"
    assert flushed <= resumed <= last + 1, where
    _run(devices, "reference", kind, str(resumed), str(tmp_path / "reference.pt"), accumulate=accumulate)
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    for rank, state in enumerate(states):
        assert_bit_equal(state, reference, f"{where}, rank {rank}")


def test_manual_optimization_resumed_from_segments_closed_at_step_hooks_has_exact_counters(tmp_path):
    """Manual optimization, stepping every 2nd batch, killed at step 28 without any flush: the segments
    the resume replays were closed at the next step's pre-hook, whose state record carried the batch
    counter of that next step (one step ahead: batch 50 at step 24; found by an independent check).
    The counter is that of the last completed step now."""
    directory = str(tmp_path / "ckpts")
    child = subprocess.run([*CHILD, "train", directory, "manual"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={**_env(1), "STEPLOG_KILL_AT": "28"})
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    out = str(tmp_path / "resumed.pt")
    _run(1, "resume", directory, "manual", out)
    state = torch.load(f"{out}.rank0", weights_only=False)
    resumed = state["global_step"]
    assert 21 <= resumed <= 28, resumed  # the checkpoint at 21, then what the log committed
    _run(1, "reference", "manual", str(resumed), str(tmp_path / "reference.pt"))
    assert_bit_equal(state, torch.load(tmp_path / "reference.pt", weights_only=False), f"resumed at {resumed}")


@pytest.mark.parametrize("save_last", [True, "link"])
def test_a_second_model_checkpoint_in_another_directory_leaves_the_log_with_last(tmp_path, save_last):
    """Two ModelCheckpoints: A (every 6 steps, save_last) and B (every 5 steps, top-k only, another
    directory). B's save at step 20 took the log to B, so a resume from A's last.ckpt (step 18) replayed
    only up to step 20 and lost the steps after it (found by an independent check, killed runs resumed
    34 steps back). The log stays with last.ckpt; saves elsewhere are not marked. ``save_last="link"``:
    last.ckpt is a link made after A's top-k save, never saved itself: A's saves keep the log."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integration.steplog_lightning_child import Lit, _trainer

    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    class StartedAt(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.step = trainer.global_step

    def fit(ckpt_path=None) -> int:
        started = StartedAt()
        callbacks = [started, ModelCheckpoint(dirpath=a, every_n_train_steps=6, save_last=save_last),
                     ModelCheckpoint(dirpath=b, every_n_train_steps=5, save_top_k=-1)]
        trainer = _trainer(plugins=[CheckrunCheckpointIO(step_log=True)], callbacks=callbacks, max_steps=22)
        trainer.fit(Lit("adam"), ckpt_path=ckpt_path)
        return started.step

    fit()  # a: 6, 12, 18 (+ last.ckpt); b: 5, 10, 15, 20; the log is closed (flushed) at the end, step 22
    assert fit(ckpt_path="last") == 22  # last.ckpt (18) + the 4 logged steps


@pytest.mark.parametrize("kill_at", [10, 20])
def test_a_replay_that_ends_on_an_epochs_last_batch_goes_on_with_the_next_epoch(tmp_path, kill_at):
    """last.ckpt at step 7, steps 8-10 logged, killed after step 10, the last batch of epoch 0: the
    resumed fit ran epoch 0 again (40 steps in a 30-step fit, silently), because Lightning decides
    whether the epoch is finished before the replay (found by an independent check). Now it goes on
    with epoch 1, as from a checkpoint Lightning saves at that batch (20: last.ckpt at 14, epoch 1's end)."""
    child = [sys.executable, "-m", "tests.integration.steplog_epoch_child"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    directory, out, ref = str(tmp_path / "ckpts"), str(tmp_path / "resumed.pt"), str(tmp_path / "ref.pt")
    killed = subprocess.run([*child, "train", directory, str(kill_at)], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    for args in (["resume", directory, out], ["reference", ref]):
        done = subprocess.run([*child, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    resumed, reference = torch.load(out, weights_only=False), torch.load(ref, weights_only=False)
    assert resumed["started"] == (kill_at, kill_at // 10)
    assert resumed["global_step"] == reference["global_step"] == 30
    assert_bit_equal({k: resumed[k] for k in ("model", "opt")}, {k: reference[k] for k in ("model", "opt")})


def test_step_log_argument_sets_the_config_key() -> None:
    assert CheckrunCheckpointIO(step_log=True).config.step_log.enabled
    assert not CheckrunCheckpointIO().config.step_log.enabled
    assert CheckrunCheckpointIO(config={"step_log": {"enabled": True}}).config.step_log.enabled
    assert not CheckrunCheckpointIO(config={"step_log": {"enabled": True}}, step_log=False).config.step_log.enabled
    assert CheckrunCheckpointIO().step_log is None


def test_two_optimizers_and_lbfgs_are_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(2))

    class _T:
        def __init__(self, optimizers):
            self.optimizers, self.lr_scheduler_configs = optimizers, []

    with pytest.raises(StepLogSetupError, match="2 optimizer"):
        targets(_T([torch.optim.SGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1)]))
    with pytest.raises(StepLogSetupError, match="LBFGS"):
        targets(_T([torch.optim.LBFGS([p])]))


# -- in-process: the chain across two resumes, and a checkpoint saved at an epoch end ----------------
class _Crash(Exception):
    pass


def _fit(directory: str, max_steps: int, ckpt_path=None, crash_at=None, trainer_kwargs=None, extra=(), **mc_kwargs):
    """A fit with the step log; ``crash_at``: flush the log at that step, then raise (no save at the
    end, as after a kill). Returns the trainer and the module."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integration.steplog_lightning_child import Lit, _trainer, plugin

    io = plugin()

    class Crash(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == crash_at:
                io.step_log.flush()
                raise _Crash

    module = Lit("adam")
    mc = ModelCheckpoint(dirpath=directory, **{"save_last": True, **mc_kwargs})
    trainer = _trainer(plugins=[io], callbacks=[Crash(), mc, *extra], max_steps=max_steps, **(trainer_kwargs or {}))
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except _Crash:
        pass
    return trainer, module


def _live(trainer, module) -> dict:
    import copy

    return copy.deepcopy({"model": module.state_dict(), "opt": trainer.optimizers[0].state_dict(),
                          "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                          "global_step": trainer.global_step})


def test_a_second_resume_replays_through_the_steps_logged_after_the_first(tmp_path):
    directory = str(tmp_path / "ckpts")
    _fit(directory, 100, crash_at=10, every_n_train_steps=8)  # last.ckpt at 8; 9, 10 logged
    second, module = _fit(directory, 100, ckpt_path="last", crash_at=14, every_n_train_steps=8)
    at_14 = _live(second, module)  # resumed at 10 (replayed), trained 11..14: no checkpoint after 8
    third, module = _fit(directory, 14, ckpt_path="last", every_n_train_steps=8)
    assert third.global_step == 14  # 8 + 2 (the first run's log) + 4 (the second run's, chained)
    assert_bit_equal(_live(third, module), at_14)


class _AtStart:
    """Keeps the loops' and the objects' state as the resumed fit starts, then ends the fit."""

    def __init__(self) -> None:
        from lightning.pytorch import Callback

        outer = self

        class Keep(Callback):
            def on_train_start(self, trainer, pl_module):
                import copy

                outer.state = {**_live(trainer, pl_module), "loops": copy.deepcopy(trainer.fit_loop.state_dict())}
                raise _Crash

        self.callback = Keep()


def test_a_resume_from_a_checkpoint_saved_inside_an_accumulation_window_has_exact_counters(tmp_path, monkeypatch):
    """``accumulate_grad_batches=3``: a resumed fit saves again at the end of its first batch
    (``every_n_train_steps`` fires again at the same global step), one batch into an accumulation window.
    A resume from there replayed the logged steps but moved the batch counters 3 per step, as from a
    window's start: one batch ahead (and one zero_grad), so every later window was one batch off and
    training drifted (found by an independent check). They stand now as Lightning's own restore of a
    checkpoint saved at the step the replay ends on."""
    from tests.integration import steplog_lightning_child

    monkeypatch.setattr(steplog_lightning_child, "ACCUMULATE", 3)
    from lightning.pytorch.callbacks import ModelCheckpoint

    directory, at_10 = str(tmp_path / "ckpts"), str(tmp_path / "at-10")
    _fit(directory, 8, every_n_train_steps=4)
    # resumed from step 8: saves step 8 again one batch in; steps 9 and 10 logged after it; a second
    # ModelCheckpoint saves step 10 elsewhere (what Lightning's own restore at step 10 is compared with)
    _fit(directory, 10, ckpt_path="last", every_n_train_steps=4,
         extra=[ModelCheckpoint(dirpath=at_10, every_n_train_steps=10)])
    resumed, restored = _AtStart(), _AtStart()
    _fit(directory, 12, ckpt_path="last", every_n_train_steps=4, extra=[resumed.callback])
    _fit(at_10, 12, ckpt_path=str(next(Path(at_10).glob("*step=10.ckpt"))), every_n_train_steps=10,
         extra=[restored.callback])
    assert resumed.state["global_step"] == 10
    assert_bit_equal(resumed.state, restored.state)


@pytest.mark.parametrize("spelling", ["symlink", "trailing-slash"])
def test_a_resume_in_place_continues_the_chain_whatever_the_spelling_of_its_directory(tmp_path, spelling):
    """The log goes on after a resume only in a directory the trainer's ModelCheckpoints save into: Lightning
    resolves their ``dirpath`` (symlinks), URLs keep a trailing ``/``, and the comparison missed both: the
    run after the resume logged nothing, and a second crash resumed 4 steps back (found by an independent
    check)."""
    if spelling == "symlink":  # ckpt_path given through the symlink, as the dirpath
        (tmp_path / "real").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "real")
        directory = str(tmp_path / "link" / "ckpts")
    else:
        directory = f"memory://{tmp_path.name}-chain/ckpts/"
    last = directory.rstrip("/") + "/last.ckpt"
    _fit(directory, 100, crash_at=10, every_n_train_steps=8)  # last.ckpt at 8; 9, 10 logged
    second, module = _fit(directory, 100, ckpt_path=last, crash_at=14, every_n_train_steps=8)
    at_14 = _live(second, module)
    third, module = _fit(directory, 14, ckpt_path=last, every_n_train_steps=8)
    assert third.global_step == 14
    assert_bit_equal(_live(third, module), at_14)


def test_a_fine_tune_from_another_runs_last_checkpoint_leaves_that_runs_log_alone(tmp_path):
    """A run logs into ``base``; a fine-tune resumes from base/last.ckpt into ``tune`` and trains on. It went
    on logging in ``base``'s log, so a later resume of the base run replayed the fine-tune's steps: another
    run's weights, silently (found by an independent check). It logs in its own directory from its first save."""
    base, tune = str(tmp_path / "base"), str(tmp_path / "tune")
    first, module = _fit(base, 100, crash_at=10, every_n_train_steps=8)  # last.ckpt at 8; 9, 10 logged
    at_10 = _live(first, module)
    logged = sorted(os.listdir(os.path.join(base, ".checkrun", "steplog")))
    tuned, _ = _fit(tune, 100, ckpt_path=os.path.join(base, "last.ckpt"), crash_at=16, every_n_train_steps=14)
    assert tuned.global_step == 16
    assert sorted(os.listdir(os.path.join(base, ".checkrun", "steplog"))) == logged
    assert os.listdir(os.path.join(tune, ".checkrun", "steplog"))  # its log starts at its save at step 14
    resumed, module = _fit(base, 10, ckpt_path="last", every_n_train_steps=8)
    assert_bit_equal(_live(resumed, module), at_10)


def test_a_last_checkpoint_that_links_to_the_newest_one_replays_too(tmp_path):
    directory = str(tmp_path / "ckpts")
    first, module = _fit(directory, 100, crash_at=10, every_n_train_steps=4, save_last="link")
    at_10 = _live(first, module)
    assert os.path.islink(os.path.join(directory, "last.ckpt"))
    resumed, module = _fit(directory, 10, ckpt_path="last", every_n_train_steps=4, save_last="link")
    assert_bit_equal(_live(resumed, module), at_10)  # epoch=0-step=8.ckpt + 2 replayed steps


def test_resume_from_a_checkpoint_saved_at_an_epoch_end(tmp_path):
    """8 batches per epoch, ModelCheckpoint at each epoch end: the replayed steps are in epoch 1."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integration.steplog_lightning_child import Lit, _saved, _trainer

    directory, epoch = str(tmp_path / "ckpts"), {"limit_train_batches": 8}
    _fit(directory, 100, crash_at=11, trainer_kwargs=epoch)  # last.ckpt at 8 (epoch 0's end); 9..11 logged
    resumed, module = _fit(directory, 11, ckpt_path="last", trainer_kwargs=epoch)  # at max_steps at once
    ref_dir = str(tmp_path / "ref")
    _trainer(callbacks=[ModelCheckpoint(dirpath=ref_dir, filename="ref", every_n_train_steps=11)], max_steps=11,
             **epoch).fit(Lit("adam"))
    ref, got = _saved(f"{ref_dir}/ref.ckpt"), _live(resumed, module)
    assert got["global_step"] == 11  # (the epoch counter moves on when the loop runs on, as Lightning does)
    assert_bit_equal({k: got[k] for k in ("model", "opt", "sched")}, {k: ref[k] for k in ("model", "opt", "sched")})
    loop = resumed.fit_loop.epoch_loop
    assert loop.batch_progress.total.ready == ref["fit_loop"]["epoch_loop.batch_progress"]["total"]["ready"] == 11


@pytest.mark.parametrize("limit", ["max_steps", "max_epochs"])
def test_a_replay_from_an_epoch_end_saved_by_a_resumed_fit_counts_its_epochs(tmp_path, limit):
    """5 batches an epoch, a checkpoint every 5 steps: the second fit resumes from step 10 (epoch 1's
    end), so its step-20 checkpoint (epoch 3's end) has no epoch started after it and its counters stand
    an epoch behind. The replay of 21, 22 went on in epoch 3, not 4: every later checkpoint was named one
    epoch low and max_epochs ran an epoch more (found by independent checks: h155 with max_steps, h160
    with max_epochs, where Lightning's restore does not count the epoch over at all)."""
    directory = str(tmp_path / "ckpts")

    def fit(ckpt_path=None, crash_at=None, steps=-1, epochs=None):
        kwargs = {"limit_train_batches": 5, **({"max_epochs": epochs} if limit == "max_epochs" else {})}
        return _fit(directory, steps if limit == "max_steps" else -1, ckpt_path=ckpt_path, crash_at=crash_at,
                    every_n_train_steps=5, trainer_kwargs=kwargs)

    fit(steps=10, epochs=2)
    fit(ckpt_path="last", crash_at=22, steps=100, epochs=9)
    resumed, _ = fit(ckpt_path="last", steps=25, epochs=5)
    assert resumed.global_step == 25  # max_epochs=5: 5 epochs of 5 steps, not 6
    assert "epoch=4-step=25.ckpt" in os.listdir(directory)  # as saved by a fit that never stopped


def test_a_checkpoint_saved_without_the_log_resumes_at_itself_with_a_warning(tmp_path):
    """The engine's NoMarkerError (the log has no marker for last.ckpt) is a warning, not a failure."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.integration.steplog_lightning_child import Lit, _trainer

    directory = str(tmp_path / "ckpts")
    mc = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=4)
    _trainer(plugins=[CheckrunCheckpointIO()], callbacks=[mc], max_steps=4).fit(Lit("adam"))
    with pytest.warns(RuntimeWarning, match="no step log after .*last.ckpt"):
        resumed, _ = _fit(directory, 6, ckpt_path="last", every_n_train_steps=4)
    assert resumed.global_step == 6 and resumed.strategy.checkpoint_io._steplog.replayed_steps == 0



def test_callbacks_of_a_resuming_trainer_can_be_copied_and_pickled(tmp_path):
    """Callbacks may deep-copy ``trainer.callbacks`` at fit start (Lightning's own tests do): the
    replay callback the plugin inserts for a resume must copy and pickle (a copy is not armed), and
    the resume still replays."""
    import copy
    import pickle

    from lightning.pytorch import Callback

    class CopyCallbacks(Callback):
        def on_fit_start(self, trainer, pl_module):
            copy.deepcopy(trainer.callbacks)
            pickle.dumps(ours(trainer))  # the test's own callbacks are local classes

    def ours(trainer) -> list:
        return [c for c in trainer.callbacks if type(c).__module__.startswith("lightning_ckpt")]

    directory = str(tmp_path / "ckpts")
    first, module = _fit(directory, 100, crash_at=10, every_n_train_steps=8)  # last.ckpt at 8; 9, 10 logged
    at_10 = _live(first, module)
    second, module = _fit(directory, 10, ckpt_path="last", every_n_train_steps=8, extra=[CopyCallbacks()])
    assert second.global_step == 10
    assert_bit_equal(_live(second, module), at_10)
    assert ours(second) and pickle.loads(pickle.dumps(ours(second)))


def test_a_scheduler_made_after_the_log_started_works(tmp_path):
    """StochasticWeightAveraging swaps in its SWALR scheduler at its first epoch, after the log wrapped
    ``optimizer.step``; torch's schedulers wrap ``step.__func__``, and the log's plain function made that
    fit fail (AttributeError: 'function' object has no attribute '__func__'; found by running Lightning's
    own SWA tests with the step log). The wrapper is a bound method."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2)
    trainer, _ = _fit(str(tmp_path / "ckpts"), 16, every_n_train_steps=4, extra=[swa],
                      trainer_kwargs={"limit_train_batches": 4})
    assert trainer.global_step == 16 and trainer.current_epoch == 4
    assert type(trainer.lr_scheduler_configs[0].scheduler).__name__ == "SWALR"


def test_the_log_keeps_torchs_scheduler_marker_on_optimizer_step(tmp_path):
    """The log wraps ``optimizer.step`` (the closure runs before the step's hooks) after the scheduler wrapped
    it; torch warned 'Seems like `optimizer.step()` has been overridden after learning rate scheduler
    initialization' at the first ``scheduler.step()``, which stock Lightning does not (found by running
    Lightning's own tests with the step log)."""
    import warnings

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]  # stepped at each epoch's end

    trainer = Trainer(default_root_dir=tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=0,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[CheckrunCheckpointIO(step_log=True)],
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model())
    assert trainer.global_step == 6
    assert not [w for w in caught if "overridden after learning rate" in str(w.message)]
