"""Step logs of one directory opened one after another in the same process: each continues the chain
its predecessor ended, so a replay from any earlier checkpoint reaches the last logged step, bit for
bit; a log whose optimizer changed since starts a chain of its own; a replay first commits what
another open log of the process holds for that directory."""
from __future__ import annotations

import copy

import pytest
import torch

from ckpt_core import CheckpointEngine

from .steplog_train import assert_bit_equal, load_into, make, state, train_step

KIND = "adam"


def _reference(steps: int) -> dict:
    net, opt, sched = make(KIND)
    for step in range(1, steps + 1):
        train_step(net, opt, sched, step)
    return copy.deepcopy(state(net, opt, sched))


def _log(engine: CheckpointEngine, d: str, model: tuple, steps, save_at: int | None = None) -> None:
    """Open a log, train ``steps`` (saving ``step{save_at}.ckpt`` after that step), close the log."""
    net, opt, sched = model
    log = engine.step_log(d, opt, sched)
    for step in steps:
        train_step(net, opt, sched, step)
        if step == save_at:
            engine.save(state(net, opt, sched), f"{d}/step{step}.ckpt").result()
    log.close()


def _replayed(directory: str, after: str) -> tuple[int, dict]:
    net, opt, sched = make(KIND)
    with CheckpointEngine() as engine:
        load_into(engine.load(after), net, opt, sched)
        n = engine.replay(directory, opt, sched, after=after)
    return n, state(net, opt, sched)


def test_a_log_closed_and_opened_again_continues_the_chain(tmp_path):
    """Found by an independent check: a log closed (end of a phase) and opened again on the same engine
    and optimizer started a chain of its own: a replay from the checkpoint of the first phase ended
    at that phase's end without a warning (5 of 15 steps), and gc deleted the second log as garbage.
    Also with the second log on another engine."""
    d = str(tmp_path / "run")
    model = make(KIND)
    cfg = {"step_log": {"flush_every_steps": 4}}
    with CheckpointEngine(cfg) as engine, CheckpointEngine(cfg) as other:
        _log(engine, d, model, range(1, 11), save_at=5)
        _log(engine, d, model, range(11, 16))
        _log(other, d, model, range(16, 21))
        engine.gc(d)  # keeps what a replay from step5.ckpt needs: all three logs
    n, got = _replayed(d, f"{d}/step5.ckpt")
    assert n == 15
    assert_bit_equal(got, _reference(20))


def test_a_log_after_a_replay_and_a_closed_log_does_not_fork_the_chain(tmp_path):
    """A replay's end was kept for every log opened afterwards on that engine: the first log continued it,
    and a second, opened after the first closed, too, forking the chain where the replay ended. A later
    replay from the first checkpoint followed the newer branch: it skipped the first log's steps and
    ended in a state no run ever held (4 steps replayed instead of 6, found while fixing the test above)."""
    d = str(tmp_path / "run")
    cfg = {"step_log": {"flush_every_steps": 1}}
    with CheckpointEngine(cfg) as engine:
        _log(engine, d, make(KIND), range(1, 5), save_at=2)
    net, opt, sched = model = make(KIND)
    with CheckpointEngine(cfg) as engine:
        load_into(engine.load(f"{d}/step2.ckpt"), net, opt, sched)
        assert engine.replay(d, opt, sched) == 2
        _log(engine, d, model, (5, 6))
        _log(engine, d, model, (7, 8))
    n, got = _replayed(d, f"{d}/step2.ckpt")
    assert n == 6
    assert_bit_equal(got, _reference(8))


def test_a_log_of_an_optimizer_changed_since_starts_its_own_chain(tmp_path):
    """The parameters changed between the logs (an older checkpoint loaded, steps taken without a log):
    the new log must not continue the closed one's chain, or a replay through it would apply its steps
    to a state they were not taken from. Replays from the first checkpoint end at the first log's end;
    a checkpoint saved in the second log replays its own steps."""
    d = str(tmp_path / "run")
    net, opt, sched = model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        _log(engine, d, model, range(1, 7), save_at=3)
        train_step(net, opt, sched, 7)  # no log open: this step is in no log
        _log(engine, d, model, range(8, 12), save_at=9)
    n, got = _replayed(d, f"{d}/step3.ckpt")
    assert n == 3
    assert_bit_equal(got, _reference(6))
    n, got = _replayed(d, f"{d}/step9.ckpt")
    assert n == 2
    assert_bit_equal(got, _reference(11))


def test_a_replay_commits_what_another_open_log_of_the_process_holds_first(tmp_path):
    """A second engine (a second Accelerator of the process, found by an independent check) replaying
    the directory while the first one's log still held unflushed steps replayed only the committed
    ones, silently, and its own log then went on from there: the newest steps were lost for good."""
    d = str(tmp_path / "run")
    net, opt, sched = make(KIND)
    first = CheckpointEngine({"step_log": {"flush_every_steps": 100}})
    try:
        first.step_log(d, opt, sched)
        for step in range(1, 11):
            train_step(net, opt, sched, step)
            if step == 4:
                first.save(state(net, opt, sched), f"{d}/step4.ckpt").result()
        n, got = _replayed(d, f"{d}/step4.ckpt")
        assert n == 6
        assert_bit_equal(got, _reference(10))
    finally:
        first.close()


@pytest.mark.parametrize("change", ["data_copy", "vector_to_parameters", "half_then_float", "state_data",
                                    "permute"])
def test_writes_that_move_no_version_counter_still_start_a_chain_of_their_own(tmp_path, change):
    """The optimizer's fingerprint compared version counters only: writes through ``.data``,
    ``vector_to_parameters`` (``set_data``) or ``model.half().float()`` (which rounds) move none, so the
    reopened log continued the chain and a replay through it reached a state no run held (found by an
    independent check). The values' float64 sums were compared then; they missed the optimizer state's
    tensors written through ``.data`` and permutations (found by the next check): digests of the
    parameters' and the state's bytes are compared now."""
    d = str(tmp_path / "run")
    net, opt, sched = model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        _log(engine, d, model, range(1, 7), save_at=3)
        with torch.no_grad():
            if change == "data_copy":
                for p in net.parameters():
                    p.data.copy_(p.data * 1.5)
            elif change == "vector_to_parameters":
                vec = torch.nn.utils.parameters_to_vector(net.parameters())
                torch.nn.utils.vector_to_parameters(vec * 1.5, net.parameters())
            elif change == "half_then_float":
                net.half()
                net.float()
            elif change == "state_data":  # "reset the moments": the state's tensors, not the parameters
                for st in opt.state.values():
                    st["exp_avg"].data.zero_()
            else:  # a permutation keeps every sum
                for p in net.parameters():
                    p.data.copy_(p.data.flip(0))
        _log(engine, d, model, range(7, 10))
    n, got = _replayed(d, f"{d}/step3.ckpt")
    assert n == 3
    assert_bit_equal(got, _reference(6))


def test_a_replay_into_another_optimizer_does_not_continue_this_ones_log(tmp_path):
    """A replay's end was kept per engine and directory and taken by the next log opened there, of any
    optimizer: a replay into a scratch optimizer handed its end to the live one's next log, after steps
    taken with no log open (found by an independent check): a later replay matched no step of the run."""
    d = str(tmp_path / "run")
    net, opt, sched = model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        _log(engine, d, model, range(1, 7), save_at=3)
        scratch = make(KIND)
        load_into(engine.load(f"{d}/step3.ckpt"), *scratch)
        assert engine.replay(d, scratch[1], scratch[2]) == 3
        for step in range(7, 9):  # no log open
            train_step(net, opt, sched, step)
        _log(engine, d, model, range(9, 11))
    n, got = _replayed(d, f"{d}/step3.ckpt")
    assert n == 3
    assert_bit_equal(got, _reference(6))


def test_a_replay_leaves_the_other_logs_write_error_to_its_owner(tmp_path):
    """The replay's commit of another open log took that log's write error (cleared it): the replay only
    warned, and the log's own close() returned cleanly although its steps were never written (found by an
    independent check). The owner's close() raises it."""
    from ckpt_core.steplog import StepLogError

    d = str(tmp_path / "run")
    net, opt, sched = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 100}}) as engine:
        log = engine.step_log(d, opt, sched)
        engine.save(state(net, opt, sched), f"{d}/step0.ckpt").result()

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        log._segs.write_manifest = full
        for step in range(1, 4):
            train_step(net, opt, sched, step)
        with pytest.warns(RuntimeWarning, match="another step log"):
            _replayed(d, f"{d}/step0.ckpt")
        with pytest.raises(StepLogError, match="No space left"):
            log.close()


def test_closing_a_log_of_lazy_parameters_not_initialized_yet(tmp_path):
    """close() computed the fingerprint from ``data_ptr()``, which an uninitialized lazy parameter refuses:
    a script that stopped before its first forward pass failed in close() (found by an independent check)."""
    net = torch.nn.LazyLinear(3)
    opt = torch.optim.Adam(net.parameters())
    with CheckpointEngine() as engine:
        log = engine.step_log(str(tmp_path / "run"), opt)
        log.close()
        net(torch.randn(2, 4))  # initialized now: a new log starts a chain of its own
        engine.step_log(str(tmp_path / "run"), opt).close()


def test_rmtree_of_a_directory_whose_log_failed_deletes_it_and_leaves_the_error_to_the_owner(tmp_path):
    """``shutil.rmtree`` closes the logs open under the deleted directory: a log with a write error raised
    it from rmtree, which deleted nothing (a TemporaryDirectory's cleanup failed), and its owner's close()
    then returned cleanly (found by an independent check)."""
    import shutil

    from ckpt_core.steplog import StepLogError

    d = tmp_path / "run"
    net, opt, sched = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        log = engine.step_log(str(d), opt, sched)
        for step in range(1, 6):
            train_step(net, opt, sched, step)

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        log._segs.write_manifest = full  # the last segment: written when rmtree closes the log
        shutil.rmtree(d)
        assert not d.exists() and log.closed
        with pytest.raises(StepLogError, match="No space left"):
            log.close()


def test_engine_close_closes_every_log_and_raises_every_error_after_one_log_failed(tmp_path):
    """``engine.close()`` closed its logs one by one with nothing between them: the first log's error (kept
    by the rmtree above for its owner) ended close() there, so the second log was never closed (a new
    engine could not log its optimizer) and a failed save's error was never raised (found by an
    independent check). Every log is closed now, then every error raised: the failed saves', noting the log's."""
    import shutil

    from ckpt_core import BackgroundSaveError

    net1, opt1, sched1 = make(KIND)
    net2, opt2, sched2 = make("sgd")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    engine = CheckpointEngine({"step_log": {"flush_every_steps": 1000}, "storage": {"retry": {"max_attempts": 1}}})
    log1 = engine.step_log(str(tmp_path / "run1"), opt1, sched1)
    log2 = engine.step_log(str(tmp_path / "run2"), opt2, sched2)
    for step in range(1, 4):
        train_step(net1, opt1, sched1, step)
        train_step(net2, opt2, sched2, step)
    log1._segs.write_manifest = full
    shutil.rmtree(tmp_path / "run1")  # log1 closed, its error kept for engine.close()
    (tmp_path / "blocked").write_text("a file where the save needs a directory")
    handle = engine.save(state(net2, opt2, sched2), str(tmp_path / "blocked" / "x.ckpt"))
    handle.wait()
    assert handle.failed()
    with pytest.raises(BackgroundSaveError, match="x.ckpt failed") as info:
        engine.close()
    assert any("No space left" in note for note in getattr(info.value, "__notes__", ()))
    assert log2.closed
    with CheckpointEngine() as again:  # the optimizer's log was closed: a new one opens
        again.step_log(str(tmp_path / "run2"), opt2, sched2).close()


def test_the_device_digest_sees_a_permutation():
    """On a device the fingerprint digests a tensor by sums computed there; plain sums of its words missed
    a permutation (a flip, two rows swapped), so a log reopened on a permuted GPU model continued the old
    chain (found by an independent check). The sums are weighted by position now, per block of words."""
    from ckpt_core.codecs._common import position_sums

    t = torch.randn(64, 33)
    swapped = t.clone()
    swapped[[3, 40]] = t[[40, 3]]
    assert position_sums(t, step=256) == position_sums(t.clone(), step=256)
    for other in (t.flip(0), swapped, t.flip(1)):
        assert position_sums(other.contiguous(), step=256) != position_sums(t, step=256)
    assert position_sums(torch.arange(7, dtype=torch.uint8)) != position_sums(torch.arange(7, dtype=torch.uint8).flip(0))
    # linear weights missed a rotation and changes of zero sum and first moment (found by the next check)
    assert position_sums(torch.tensor([2, 1, 3], dtype=torch.int32)) != position_sums(torch.tensor([1, 3, 2], dtype=torch.int32))
    assert position_sums(torch.tensor([5, 5, 5], dtype=torch.int32)) != position_sums(torch.tensor([6, 3, 6], dtype=torch.int32))
