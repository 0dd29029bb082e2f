"""The step log against storage that fails or lies (issue 23): a full disk while a segment is written, a
segment commit whose response is lost, a transient error; the resume never applies a step that was not
committed, and never skips one.

The log writes its segments through ``faultfile://`` (the real local disk under ``FaultFS``): a
segment is a "manifest" kind of write (``.checkrun/steplog/``), committed by temp file + rename.
"""
from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest

from ckpt_core import CheckpointEngine
from ckpt_core.steplog import StepLogError
from ckpt_core.errors import StorageError
from ckpt_core.testing.faults import DiskFull, FaultFS, Gate, Policy, Transient, transient_error
from tests.core.steplog_train import assert_bit_equal, load_into, make, state, train_step

KIND = "adam"


def _reference(steps: int) -> dict:
    net, opt, sched = make(KIND)
    for step in range(1, steps + 1):
        train_step(net, opt, sched, step)
    return state(net, opt, sched)


def _resume(directory: str) -> tuple[int, dict]:
    net, opt, sched = make(KIND)
    with CheckpointEngine() as engine:
        path = engine.latest(directory)
        load_into(engine.load(path), net, opt, sched)
        n = engine.replay(directory, opt, sched, after=path)
    return n, state(net, opt, sched)


def _train(engine, directory: str, model: tuple, steps, save_at: int | None = None) -> None:
    """``train_step`` for each of ``steps``; after step ``save_at``, checkpoint ``step<N>.ckpt`` (committed)."""
    for step in steps:
        train_step(*model, step)
        if step == save_at:
            engine.save(state(*model), f"{directory}/step{step}.ckpt").result()


class _SegmentsOnly(Policy):
    """Hands the segment writes (``.checkrun/steplog/``) to ``inner``; everything else passes."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def on(self, op, kind, path):
        return self.inner.on(op, kind, path) if "/steplog/" in str(path) else None

    def data(self, kind, path, buf, write):
        if "/steplog/" in str(path):
            return self.inner.data(kind, path, buf, write)
        return write(buf)


def test_disk_full_during_a_segment_fails_loudly_and_the_resume_stops_before_the_lost_steps(tmp_path):
    """Steps 6-8 committed; the disk fills up while steps 9-10 are written (a torn temp file, ENOSPC):
    the error surfaces at the next flush, naming the cause. Space is freed and training goes on
    (steps 11-12 are logged after a gap); the error says a step-log segment, not a manifest, failed. The resume replays 6-8 and stops at the gap: the state is
    step 8's, bit for bit, never 8 + 11 + 12."""
    directory = f"faultfile://{tmp_path}/run"
    model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 100}}) as engine:
        slog = engine.step_log(directory, *model[1:])
        _train(engine, directory, model, range(1, 9), save_at=5)
        slog.flush()
        full = DiskFull(free=64)
        FaultFS.policy = _SegmentsOnly(full)
        _train(engine, directory, model, range(9, 11))
        with pytest.raises(StepLogError, match="No space left on device") as failed:
            slog.flush()
        assert "write step-log segment" in str(failed.value), "the error names what was written"
        assert full.failures >= 1
        FaultFS.policy = None  # space freed; the training goes on
        _train(engine, directory, model, range(11, 13))
        slog.close()
    assert not [p for p in (tmp_path / "run" / ".checkrun" / "steplog").rglob("*") if ".tmp-" in p.name], \
        "a torn temp file of the failed segment was left behind"
    with pytest.warns(UserWarning, match="damaged or missing .*replay stopped after step 8"):
        n, resumed = _resume(directory)
    assert n == 3
    assert_bit_equal(resumed, _reference(8), "resumed after a full disk")


def test_transient_segment_write_errors_are_retried_and_nothing_is_lost(tmp_path, sleeps):
    """Every segment write fails once (a timeout on open): retried, every step is logged."""
    directory = f"faultfile://{tmp_path}/run"
    model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        slog = engine.step_log(directory, *model[1:])
        _train(engine, directory, model, range(1, 4), save_at=3)
        faults = Transient(1.0, ops=("open",), max_per_path=1)
        FaultFS.policy = _SegmentsOnly(faults)
        _train(engine, directory, model, range(4, 12))
        slog.close()
        FaultFS.policy = None
    assert sum(faults.injected.values()) >= 3 and sleeps
    n, resumed = _resume(directory)
    assert n == 8
    assert_bit_equal(resumed, _reference(11), "resumed after retried segment writes")


def test_a_segment_commit_whose_response_is_lost_is_resolved_by_reading_it_back(tmp_path, monkeypatch):
    """The first segment's rename happens but reports an error (its response lost): the log reads the
    segment back, finds exactly its bytes and counts it committed (no error, no duplicate); every
    step replays."""
    directory = f"faultfile://{tmp_path}/run"
    real, lost = os.replace, []

    def replace_then_lose(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if "/steplog/" in str(dst) and not lost:
            lost.append(dst)
            raise OSError(errno.EIO, "response lost after the rename (injected)", dst)

    monkeypatch.setattr(os, "replace", replace_then_lose)
    model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, *model[1:])
        _train(engine, directory, model, range(1, 11), save_at=3)
        slog.close()
    assert lost
    n, resumed = _resume(directory)
    assert n == 7
    assert_bit_equal(resumed, _reference(10), "resumed after a lost commit response")


def _reference_with(steps: list[int]) -> dict:
    """An uninterrupted run through the given batches (train_step's step numbers), in order."""
    net, opt, sched = make(KIND)
    for step in steps:
        train_step(net, opt, sched, step)
    return state(net, opt, sched)


def test_a_writer_paused_while_its_trainer_restarts_never_mixes_the_two_runs(tmp_path):
    """Run A logs steps 6-8 (committed), then its writer is paused while committing steps 9-10. The
    trainer "restarts" meanwhile: run B resumes from A's checkpoint at step 5 (replays 6-8), trains on
    other batches and checkpoints. A's writer then commits its late segment. A resume from B's
    checkpoint is B's state; a resume from step 5 follows the newest run (B) from its branch point, never
    A's late steps 9-10."""
    directory = f"faultfile://{tmp_path}/run"
    cfg = {"step_log": {"flush_every_steps": 100}}
    run_a = make(KIND)
    engine_a = CheckpointEngine(cfg)
    log_a = engine_a.step_log(directory, *run_a[1:])
    _train(engine_a, directory, run_a, range(1, 9), save_at=5)
    log_a.flush()
    gate = Gate("close", "manifest", match="/steplog/.seg-")  # the temp file, before its rename
    FaultFS.policy = gate
    _train(engine_a, directory, run_a, range(9, 11))
    paused = threading.Thread(target=log_a.flush, daemon=True)
    paused.start()
    assert gate.entered.wait(60), "run A's segment write never reached the gate"

    b_batches = [*range(1, 9), *range(109, 113)]  # after the resume at 8: other batches
    net_b, opt_b, sched_b = run_b = make(KIND)
    with CheckpointEngine(cfg) as engine_b:
        load_into(engine_b.load(f"{directory}/step5.ckpt"), *run_b)
        assert engine_b.replay(directory, opt_b, sched_b, after=f"{directory}/step5.ckpt") == 3
        log_b = engine_b.step_log(directory, opt_b, sched_b)
        _train(engine_b, directory, run_b, b_batches[8:10], save_at=b_batches[9])  # B's step 10
        _train(engine_b, directory, run_b, b_batches[10:])
        log_b.close()

    gate.release()  # run A's writer wakes up and commits its late segment
    paused.join(60)
    log_a.close()
    engine_a.close()
    FaultFS.policy = None

    n, resumed = _resume(directory)  # the newest checkpoint: B's at its step 10
    assert n == 2
    assert_bit_equal(resumed, _reference_with(b_batches), "resumed from run B's checkpoint")
    net, opt, sched = make(KIND)
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/step5.ckpt"), net, opt, sched)
        n = engine.replay(directory, opt, sched, after=f"{directory}/step5.ckpt")
    # where two runs continue the same step, replay follows the newest one (B) from its branch point
    assert n == 7, f"replayed {n} steps after step 5: not run B's 3 + 4"
    assert_bit_equal(state(net, opt, sched), _reference_with(b_batches), "replayed after step 5")


class _SegmentReadsFail(Policy):
    """Every read of a segment fails with a transient error (an outage longer than the retries)."""

    def __init__(self) -> None:
        self.raised = 0

    def on(self, op, kind, path):
        if op == "read" and "/seg-" in str(path):
            self.raised += 1
            raise transient_error(self.raised)


def _logged_with_checkpoint(directory: str, steps: int = 12) -> None:
    model = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, *model[1:])
        _train(engine, directory, model, range(1, steps + 1), save_at=3)
        slog.close()


def test_an_outage_while_replaying_raises_instead_of_stopping_early(tmp_path, sleeps):
    """Segment reads that fail through every retry are an outage, not damage: replay raised nothing
    and stopped at the last step before it with a "damaged or missing" warning, and the log opened
    after the resume branched there, so the committed steps after it were lost for good (found by an
    independent check with 500s from S3). It raises StorageError; once storage is back, all replay."""
    directory = f"faultfile://{tmp_path}/run"
    _logged_with_checkpoint(directory)
    FaultFS.policy = outage = _SegmentReadsFail()
    try:
        with pytest.raises(StorageError, match="seg-"):
            _resume(directory)
    finally:
        FaultFS.policy = None
    assert outage.raised > 1 and sleeps, "retried before giving up"
    n, resumed = _resume(directory)
    assert n == 9
    assert_bit_equal(resumed, _reference(12), "resumed after the outage")


def test_a_segment_damaged_in_transit_is_read_again(tmp_path, monkeypatch, caplog):
    """A segment whose bytes arrive with a flipped byte once (a store without response checksums)
    ended the replay there; it is read once more, as blobs are, and counts only if it fails again."""
    directory = f"faultfile://{tmp_path}/run"
    _logged_with_checkpoint(directory)
    real, flipped = FaultFS.cat_file, []

    def flip_once(self, path, start=None, end=None, **kwargs):
        data = real(self, path, start=start, end=end, **kwargs)
        if "/seg-" in str(path) and start is None and not flipped:
            flipped.append(path)
            data = bytearray(data)
            data[-3] ^= 0x10
            data = bytes(data)
        return data

    monkeypatch.setattr(FaultFS, "cat_file", flip_once)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "damaged or missing" warning
        n, resumed = _resume(directory)
    assert flipped and n == 9
    assert_bit_equal(resumed, _reference(12), "resumed through a segment damaged in transit")
    assert "failed its check once" in caplog.text


def test_a_marker_whose_write_failed_is_written_again_so_the_later_steps_stay_reachable(tmp_path):
    """The marker write failed at its save (an outage beyond the retries) while the checkpoint committed:
    before, the steps logged after that checkpoint could never be replayed from it (NoMarkerError; the
    adapters then resumed at the checkpoint: committed steps lost; found by a fault program on S3)."""
    directory = f"faultfile://{tmp_path}/run"
    model = make(KIND)
    FaultFS.reset()
    try:
        with CheckpointEngine({"step_log": {"flush_every_steps": 2}, "storage": {"retry": {"max_attempts": 1}}}) as engine:
            slog = engine.step_log(directory, model[1], model[2])
            _train(engine, directory, model, range(1, 3))
            FaultFS.fail_writes, FaultFS.fail_match = OSError(errno.EIO, "injected"), "mark-"
            engine.save(state(*model), f"{directory}/step2.ckpt").result()  # committed, its marker not
            FaultFS.reset()
            with pytest.raises(StepLogError, match="marker"):  # surfaces at the next step, once it is taken...
                train_step(*model, 3)
            model[2].step()  # ... and the loop finishes it
            _train(engine, directory, model, range(4, 6))
            slog.close()
    finally:
        FaultFS.reset()
    n, resumed = _resume(directory)
    assert n == 3
    assert_bit_equal(resumed, _reference(5))


@pytest.mark.parametrize("fail_at", [6, 8])
def test_a_step_whose_encoding_fails_leaves_a_gap_the_resume_stops_at(tmp_path, monkeypatch, fail_at):
    """Encoding one step fails in the log's encoder thread (out of memory, a codec error): the training
    sees a StepLogError from a later ``optimizer.step()``, raised once that step is applied and logged
    (the loop finishes the step: its scheduler step), and goes on logging; it ends bit-equal to a run
    without the failure. The steps before the failed one are written; the events after it keep their
    numbers, so the resume stops right before the lost step, exactly, and says it was never written. Step 6 is
    the first event of a segment (the one after the checkpoint): the next segment started where the last
    written one ended, no gap showed, and every later step was replayed one place off, silently
    (replay claimed step 24 with the state of neither step 24 nor 25; found by an independent check)."""
    from ckpt_core.steplog import encode

    real = encode.StepEncoder.encode

    def failing(self, rec, *a, **k):
        if rec.step == fail_at:
            raise MemoryError(f"injected while encoding step {fail_at}")
        return real(self, rec, *a, **k)

    monkeypatch.setattr(encode.StepEncoder, "encode", failing)
    directory = str(tmp_path / "run")
    net, opt, sched = make(KIND)
    with CheckpointEngine({"step_log": {"flush_every_steps": 4}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        _train(engine, directory, (net, opt, sched), range(1, 6), save_at=5)
        errors = []
        for step in range(6, 26):
            try:
                train_step(net, opt, sched, step)
            except StepLogError as exc:
                errors.append(str(exc))
                sched.step()  # the rest of the step whose optimizer.step() raised after it applied
        slog.close()
    assert len(errors) == 1 and f"injected while encoding step {fail_at}" in errors[0]
    assert_bit_equal(state(net, opt, sched), _reference(25), "the training, through the error")
    with pytest.warns(UserWarning, match=f"were never written .*replay stopped after step {fail_at - 1}"):
        n, resumed = _resume(directory)
    assert n == fail_at - 1 - 5
    assert_bit_equal(resumed, _reference(fail_at - 1), "resumed before the step whose logging failed")
