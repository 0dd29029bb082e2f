"""The step log when storage fails under it (found by an independent fault program, h99): a run
object or marker write that fails, a segment write that fails at the end, a damaged marker of a
deleted checkpoint, a directory reached through a symlink. Every later resume is exact up to where
it says it stops, and says so when it stops early."""
from __future__ import annotations

import errno
import threading
import os
import warnings

import pytest

from ckpt_core import CheckpointEngine
from ckpt_core.errors import StorageError
from ckpt_core.steplog import StepLogError, StepLogFormatError
from ckpt_core.testing import FaultFS, Policy

from .steplog_train import assert_bit_equal, load_into, make, state, train_step

ONE_TRY = {"step_log": {"flush_every_steps": 3}, "storage": {"retry": {"max_attempts": 1}}}


@pytest.fixture(autouse=True)
def _faults():
    FaultFS.reset()
    yield
    FaultFS.reset()


class FailWrites(Policy):
    """EIO for writes of step-log objects whose name starts with ``prefix`` (``.run-``, ``.mark-``,
    ``.seg-``: their temp files), after ``skip`` of them, while ``on``."""

    def __init__(self, prefix: str, skip: int = 0, on: bool = True) -> None:
        self.prefix, self.skip, self.on_ = prefix, skip, on

    def on(self, op: str, kind: str, path: str) -> None:
        if self.on_ and op == "open" and f"/steplog/{self.prefix}" in str(path):
            if self.skip:
                self.skip -= 1
                return
            raise OSError(errno.EIO, "injected EIO", str(path))


def _reference(kind: str, steps: int) -> dict:
    net, opt, sched = make(kind)
    for s in range(1, steps + 1):
        train_step(net, opt, sched, s)
    return state(net, opt, sched)


def _resume(directory: str, after: str, kind: str = "adam") -> tuple[int, dict, list[str]]:
    """Load ``after`` into a fresh model and replay: (steps replayed, the state, the warnings)."""
    net, opt, sched = make(kind)
    with warnings.catch_warnings(record=True) as caught, CheckpointEngine() as engine:
        warnings.simplefilter("always")
        load_into(engine.load(f"{directory}/{after}"), net, opt, sched)
        n = engine.replay(directory, opt, sched, after=f"{directory}/{after}")
    return n, state(net, opt, sched), [str(w.message) for w in caught]


def _first_run(url: str, steps: int = 20, save_at: int = 10) -> None:
    net, opt, sched = make("adam")
    with CheckpointEngine(ONE_TRY) as engine:
        slog = engine.step_log(url, opt, sched)
        for s in range(1, steps + 1):
            train_step(net, opt, sched, s)
            if s == save_at:
                engine.save(state(net, opt, sched), f"{url}/s{s}.ckpt").result()
        slog.close()


def test_a_replay_whose_run_object_write_fails_leaves_the_open_log_numbered_as_its_encoder(tmp_path):
    """The log was opened before the replay; continuing the chain rewrites its run object, which
    failed. The counters had moved first: training thread and encoder numbered events differently,
    and a later resume replayed wrong steps (and ``ls`` claimed steps never logged)."""
    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    _first_run(url)
    net, opt, sched = make("adam")
    with CheckpointEngine(ONE_TRY) as engine:
        load_into(engine.load(f"{url}/s10.ckpt"), net, opt, sched)
        slog = engine.step_log(url, opt, sched)
        FaultFS.policy = FailWrites(".run-")
        with pytest.raises(StorageError, match="run record"):
            engine.replay(url, opt, sched, after=f"{url}/s10.ckpt")
        FaultFS.policy = None
        for s in range(21, 41):  # the replay applied its 10 steps; the user goes on
            train_step(net, opt, sched, s)
            if s == 25:
                engine.save(state(net, opt, sched), f"{url}/s25.ckpt").result()
        slog.close()
    n, st, msgs = _resume(d, "s25.ckpt")
    assert n == 15 and not msgs
    assert_bit_equal(st, _reference("adam", 40))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_close_with_a_pending_error_logs_the_scheduler_step_after_the_last_step(tmp_path, kind):
    """Marker writes fail from the second save on; the loop catches each ``StepLogError`` and finishes
    its iteration (as docs allow); ``close`` raised before it logged the last step's scheduler step,
    and a resume there was one scheduler step behind, silently."""
    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    policy = FaultFS.policy = FailWrites(".mark-", on=False)
    net, opt, sched = make(kind)
    engine = CheckpointEngine({**ONE_TRY, "step_log": {"flush_every_steps": 4}})
    slog = engine.step_log(url, opt, sched)
    raised = []
    for s in range(1, 14):
        try:
            train_step(net, opt, sched, s)
        except StepLogError:  # raised in the post-hook, after the step: the scheduler step is ours
            raised.append(s)
            sched.step()
        if s == 5:
            engine.save(state(net, opt, sched), f"{url}/s5.ckpt").result()
        if s == 10:
            policy.on_ = True
            engine.save(state(net, opt, sched), f"{url}/s10.ckpt").result()
    with pytest.raises(StepLogError, match="marker"):
        slog.close()
    engine.close()
    FaultFS.policy = None
    assert raised
    n, st, _ = _resume(d, "s5.ckpt", kind)
    assert n == 8
    assert_bit_equal(st, _reference(kind, 13))


def _lose_the_tail(url: str) -> tuple:
    """Steps 1-20 logged (s5.ckpt saved at 5), the segments of steps 16-20 fail to write, ``close`` raises;
    the engine and the model, optimizer and scheduler at step 20."""
    policy = FaultFS.policy = FailWrites(".seg-", on=False)
    net, opt, sched = make("adam")
    engine = CheckpointEngine(ONE_TRY)
    slog = engine.step_log(url, opt, sched)
    for s in range(1, 21):
        if s == 16:
            slog.flush()
            policy.on_ = True
        try:
            train_step(net, opt, sched, s)
        except StepLogError:
            sched.step()
        if s == 5:
            engine.save(state(net, opt, sched), f"{url}/s5.ckpt").result()
    with pytest.raises(StepLogError, match="segment"):
        slog.close()
    FaultFS.policy = None
    return engine, net, opt, sched


def test_a_lost_tail_after_a_failed_close_is_reported(tmp_path):
    """The last segments' writes fail; ``close`` raises. It skipped the run object's ``end`` then, so a
    resume stopped early without a warning and ``verify`` called the log intact."""
    d = str(tmp_path / "run")
    engine, *_ = _lose_the_tail(f"faultfile://{d}")
    engine.close()
    n, st, msgs = _resume(d, "s5.ckpt")
    assert n == 10 and any("replay stopped after step 15" in m and "before it was closed" in m for m in msgs), msgs
    assert_bit_equal(st, _reference("adam", 15))


def test_a_retried_step_log_after_a_failed_open_continues_the_chain(tmp_path):
    """``step_log`` after a replay failed once (its run object's write); the retry started a chain of
    its own, so a crash before the next checkpoint resumed 10 steps short, silently."""
    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    _first_run(url)
    net, opt, sched = make("adam")
    engine = CheckpointEngine(ONE_TRY)
    load_into(engine.load(f"{url}/s10.ckpt"), net, opt, sched)
    assert engine.replay(url, opt, sched, after=f"{url}/s10.ckpt") == 10
    FaultFS.policy = FailWrites(".run-")
    with pytest.raises(StorageError):
        engine.step_log(url, opt, sched)
    FaultFS.policy = None
    slog = engine.step_log(url, opt, sched)
    for s in range(21, 31):
        train_step(net, opt, sched, s)
    slog.flush()  # then the process dies (its log is not closed)
    n, st, _ = _resume(d, "s10.ckpt")
    assert n == 20
    assert_bit_equal(st, _reference("adam", 30))
    slog.close()
    engine.close()


def test_a_log_that_logged_before_a_replay_warns_that_it_does_not_continue_the_chain(tmp_path):
    d = str(tmp_path / "run")
    _first_run(d)
    net, opt, sched = make("adam")
    with CheckpointEngine(ONE_TRY) as engine:
        load_into(engine.load(f"{d}/s10.ckpt"), net, opt, sched)
        slog = engine.step_log(d, opt, sched)
        slog.flush()
        with pytest.warns(RuntimeWarning, match="does not continue the replayed chain"):
            engine.replay(d, opt, sched, after=f"{d}/s10.ckpt")
        slog.close()


def test_a_damaged_marker_of_a_deleted_checkpoint_blocks_neither_replay_nor_gc(tmp_path):
    """One flipped byte in the marker of a checkpoint retention deleted made every replay of the
    directory raise and its step-log gc refuse for ever (h99). gc keeps it (h100: a marker damaged in
    transit is intact at rest; one read twice damaged may still be a retained checkpoint's)."""
    d = str(tmp_path / "run")
    logdir = os.path.join(d, ".checkrun", "steplog")
    net, opt, sched = make("adam")
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(d, opt, sched)
        for s in range(1, 7):
            train_step(net, opt, sched, s)
            if s in (3, 6):
                engine.save(state(net, opt, sched), f"{d}/s{s}.ckpt").result()
        slog.close()
    mark = sorted(n for n in os.listdir(logdir) if n.startswith("mark-"))[0]  # s3.ckpt's
    with open(os.path.join(logdir, mark), "r+b") as f:
        f.seek(30)
        byte = f.read(1)
        f.seek(30)
        f.write(bytes([byte[0] ^ 1]))
    os.remove(os.path.join(d, "s3.ckpt"))
    n, st, msgs = _resume(d, "s6.ckpt")
    assert n == 0 and any(mark in m and "do not parse" in m for m in msgs), msgs
    with CheckpointEngine({"retention": {"keep_last": 1}}) as engine:
        net, opt, sched = make("adam")
        load_into(engine.load(f"{d}/s6.ckpt"), net, opt, sched)
        slog = engine.step_log(d, opt, sched)
        for s in range(7, 13):
            train_step(net, opt, sched, s)
            if s in (9, 12):
                engine.save(state(net, opt, sched), f"{d}/s{s}.ckpt").result()
        slog.close()
    assert mark in os.listdir(logdir)  # gc went on, and kept it (which checkpoint it marks is unknown)
    assert "s9.ckpt" not in os.listdir(d) and "s6.ckpt" not in os.listdir(d)  # retention ran
    n, st, msgs = _resume(d, "s12.ckpt")
    assert n == 0 and any(mark in m for m in msgs)


def test_a_damaged_marker_of_the_resumed_checkpoint_is_named(tmp_path):
    d = str(tmp_path / "run")
    _first_run(d)
    logdir = os.path.join(d, ".checkrun", "steplog")
    mark = next(n for n in os.listdir(logdir) if n.startswith("mark-"))
    with open(os.path.join(logdir, mark), "r+b") as f:
        f.seek(20)
        f.write(b"#")
    net, opt, sched = make("adam")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{d}/s10.ckpt"), net, opt, sched)
        with pytest.raises(StepLogFormatError, match=f"no intact marker.*{mark}"):
            engine.replay(d, opt, sched, after=f"{d}/s10.ckpt")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="symlinks")
@pytest.mark.parametrize("how", ["log through the link", "reopened through the link"])
def test_a_directory_reached_through_a_symlink_is_one_directory(tmp_path, how):
    """A log opened through a symlink gave a save through the real path no marker (the resume blamed
    another engine), and a log reopened through the symlink started a chain of its own."""
    d = str(tmp_path / "run")
    os.makedirs(d)
    link = str(tmp_path / "link")
    os.symlink(d, link)
    net, opt, sched = make("adam")
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(link if how == "log through the link" else d, opt, sched)
        for s in range(1, 21):
            train_step(net, opt, sched, s)
            if s == 5:
                engine.save(state(net, opt, sched), f"{d}/s5.ckpt").result()
            if s == 10 and how == "reopened through the link":
                slog.close()
                slog = engine.step_log(link, opt, sched)
        slog.close()
    n, st, msgs = _resume(d, "s5.ckpt")
    assert n == 15 and not msgs
    assert_bit_equal(st, _reference("adam", 20))


def test_a_replay_waits_for_another_logs_close_under_way_on_another_thread(tmp_path, monkeypatch):
    """An Accelerator dropped closes its checkpointer (and step log) on a thread of its own; a second
    Accelerator's ``load_state`` right after replayed without the steps that close was committing
    (``commit_for`` saw a flush under way and gave up: found by an independent check)."""
    from ckpt_core.steplog.log import StepLog
    from ckpt_core.testing import Gate

    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    net, opt, sched = make("adam")
    engine = CheckpointEngine({"step_log": {"flush_every_steps": 100}})
    slog = engine.step_log(url, opt, sched)
    for s in range(1, 13):
        train_step(net, opt, sched, s)
        if s == 5:
            engine.save(state(net, opt, sched), f"{url}/s5.ckpt").result()
    gate = FaultFS.policy = Gate("open", match="/steplog/.seg-")  # the close's segment write waits
    closer = threading.Thread(target=slog.close)
    closer.start()
    assert gate.entered.wait(60), "the close never wrote its segment"
    real = StepLog.commit_for

    def commit_for(self, seconds):  # the close goes on as the replay asks the log to commit
        gate.release()
        return real(self, seconds)

    monkeypatch.setattr(StepLog, "commit_for", commit_for)
    net2, opt2, sched2 = make("adam")  # another optimizer (a second Accelerator), same directory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "did not commit the steps it holds" would fail here
        with CheckpointEngine() as engine2:
            load_into(engine2.load(f"{url}/s5.ckpt"), net2, opt2, sched2)
            assert engine2.replay(url, opt2, sched2) == 7
    closer.join(60)
    engine.close()
    assert_bit_equal(state(net2, opt2, sched2), _reference("adam", 12))


class _FailMarkersAndBlobs(Policy):
    """Marker writes fail while ``on``; blob writes too while ``blobs`` (the save then fails)."""

    on_, blobs = False, False

    def on(self, op: str, kind: str, path: str) -> None:
        if op == "open" and ((self.on_ and "/steplog/.mark-" in str(path)) or (self.blobs and kind == "blob")):
            raise OSError(errno.ENOSPC, "injected ENOSPC", str(path))


def test_the_marker_of_a_save_that_failed_is_not_tried_again(tmp_path):
    """A full disk failed a save and its marker; the marker was written again (and failed, raising a
    ``StepLogError``) at every later step, although no checkpoint could ever need it (h99)."""
    from ckpt_core.errors import BackgroundSaveError

    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    policy = FaultFS.policy = _FailMarkersAndBlobs()
    net, opt, sched = make("adam")
    engine = CheckpointEngine(ONE_TRY)
    slog = engine.step_log(url, opt, sched)
    raised = []
    for s in range(1, 16):
        try:
            train_step(net, opt, sched, s)
        except StepLogError:
            raised.append(s)
            sched.step()
        if s == 5:
            policy.on_ = policy.blobs = True
            with pytest.raises(BackgroundSaveError):
                engine.save(state(net, opt, sched), f"{url}/s5.ckpt").result()
            policy.blobs = False  # the markers still fail
    assert raised == [6]  # once, for the failed write; not at every step after
    policy.on_ = False
    slog.close()
    engine.close()


def test_a_replay_from_before_a_lost_tail_that_a_later_log_continues_warns(tmp_path):
    """The last segments were lost (close raised), the same optimizer's next log continued the chain after
    them: a resume from before the loss stopped there without a warning, and verify called the log intact
    (h100)."""
    from ckpt_core.cli import main as cli

    d = str(tmp_path / "run")
    url = f"faultfile://{d}"
    engine, net, opt, sched = _lose_the_tail(url)
    slog = engine.step_log(url, opt, sched)  # continues after step 20
    for s in range(21, 26):
        train_step(net, opt, sched, s)
    slog.close()
    engine.close()
    n, st, msgs = _resume(d, "s5.ckpt")
    assert n == 10 and any("replay stopped after step 15" in m and "continues it" in m for m in msgs), msgs
    assert_bit_equal(st, _reference("adam", 15))
    assert cli(["verify", d]) == 1


def test_replay_without_after_refuses_when_the_newest_checkpoints_marker_may_be_the_damaged_one(tmp_path):
    """``replay`` without ``after=`` went on from an older checkpoint's marker, onto the state of the newest
    that the caller loaded: wrong values (h100)."""
    d = str(tmp_path / "run")
    _first_run(d, steps=12, save_at=5)
    net, opt, sched = make("adam")
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:  # a second checkpoint, at 12
        load_into(engine.load(f"{d}/s5.ckpt"), net, opt, sched)
        engine.replay(d, opt, sched, after=f"{d}/s5.ckpt")
        slog = engine.step_log(d, opt, sched)
        engine.save(state(net, opt, sched), f"{d}/s12.ckpt").result()
        slog.close()
    logdir = os.path.join(d, ".checkrun", "steplog")
    newest = sorted((n for n in os.listdir(logdir) if n.startswith("mark-")),
                    key=lambda n: os.path.getmtime(os.path.join(logdir, n)))[-1]
    with open(os.path.join(logdir, newest), "r+b") as f:
        f.seek(20)
        f.write(b"#")
    net, opt, sched = make("adam")
    with CheckpointEngine() as engine:
        load_into(engine.load(engine.latest(d)), net, opt, sched)
        with pytest.raises(StepLogFormatError, match="s12.ckpt \\(its newest\\)"):
            engine.replay(d, opt, sched)


def test_a_marker_damaged_in_transit_once_is_read_again_and_kept(tmp_path, monkeypatch):
    """A marker read that returned a flipped byte once made gc delete the intact marker of a kept
    checkpoint for good (h100): a marker is read twice before it counts as damaged, as segments are."""
    from ckpt_core.storage.store import Store

    d = str(tmp_path / "run")
    _first_run(d)
    real, flipped = Store.read_manifest, []

    def read_manifest(self, name, *args, **kwargs):
        data = real(self, name, *args, **kwargs)
        if name.startswith("mark-") and not flipped:
            flipped.append(name)
            data = data[:20] + bytes([data[20] ^ 1]) + data[21:]
        return data

    monkeypatch.setattr(Store, "read_manifest", read_manifest)
    from ckpt_core.steplog import collect_segments

    with CheckpointEngine() as engine:
        removed = collect_segments(engine._dir_store(d, None), lambda: engine.list(d))
    assert flipped and flipped[0] not in removed
    monkeypatch.undo()
    n, st, msgs = _resume(d, "s10.ckpt")
    assert n == 10 and not msgs
