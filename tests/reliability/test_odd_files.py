"""Odd files where a checkpoint directory holds regular files: a blob replaced by a FIFO (or a link
to one), a blob shard directory that cannot be listed. Each is named in a clear error; none hangs a
load or makes a resume go back to an older checkpoint silently."""
from __future__ import annotations

import errno
import os
import re
import shutil
import threading

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.errors import CorruptCheckpointError, StorageError

WATCHDOG = 120  # seconds; only bounds a wait that would otherwise hang on a bug


def _blob_files(directory) -> list[str]:
    blobs = os.path.join(directory, ".checkrun", "blobs")
    return sorted(os.path.join(root, f) for root, _, files in os.walk(blobs) for f in files)


def _in_thread(fn):
    """fn's result or exception, from a daemon thread (a hang fails the test instead of CI)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WATCHDOG)
    assert not t.is_alive(), "hung"
    return out


@pytest.mark.parametrize("how", ["fifo", "link_to_fifo"])
def test_a_blob_replaced_by_a_fifo_is_named_not_waited_on(tmp_path, how):
    """The local read opened a FIFO in the blob's place and waited for a writer for ever (found by an
    independent check); verify and latest already called it missing."""
    directory = tmp_path / "run"
    with CheckpointEngine() as engine:
        engine.save({"w": torch.arange(1000.0), "step": 1}, directory / "s1.ckpt").result()
        blob = _blob_files(directory)[0]
        os.remove(blob)
        if how == "fifo":
            os.mkfifo(blob)
        else:
            os.mkfifo(tmp_path / "pipe")
            os.symlink(tmp_path / "pipe", blob)
        out = _in_thread(lambda: engine.load(directory / "s1.ckpt"))
    assert isinstance(out.get("error"), CorruptCheckpointError), out
    assert os.path.basename(blob) in str(out["error"])


def test_a_blob_shard_that_cannot_be_listed_is_an_error_not_an_older_checkpoint(tmp_path, monkeypatch):
    """A shard directory whose listing fails (EACCES: searchable, not readable; or EIO): fsspec's
    find skipped it silently, so latest(verify=False) called the newest checkpoint's blob missing and
    answered the older one (found by an independent check). It raises now; the blob is there."""
    directory = tmp_path / "run"
    with CheckpointEngine({"incremental": {"enabled": False}}) as engine:
        engine.save({"w": torch.full((1000,), 1.0)}, directory / "s1.ckpt").result()
        engine.save({"w": torch.full((1000,), 2.0)}, directory / "s2.ckpt").result()
        key = next(iter(engine.read_manifest(directory / "s2.ckpt").blobs())).key
        shard = os.path.join(directory, ".checkrun", "blobs", key[:2])
        real = os.scandir

        def scandir(path="."):
            if os.fspath(path).rstrip("/") == shard:
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
            return real(path)

        monkeypatch.setattr(os, "scandir", scandir)
        with pytest.raises(StorageError, match="Permission denied"):
            engine.latest(directory, verify=False)
        with pytest.raises(StorageError, match="Permission denied"):
            engine.gc(directory)
        monkeypatch.setattr(os, "scandir", real)
        assert engine.latest(directory, verify=False).endswith("s2.ckpt")


@pytest.mark.parametrize("linked", [".checkrun", ".checkrun/blobs", ".checkrun/leases"])
def test_gc_beside_a_linked_blob_folder_deletes_nothing(tmp_path, capsys, linked):
    """Two directories sharing one blob folder through a symbolic link: a gc in one saw only its own
    checkpoints and deleted blobs the other's committed checkpoints needed (found by a check of
    hostile layouts). A collection beside a linked ``.checkrun`` (or blobs folder) now deletes
    nothing and says why, by hand or after a save with retention."""
    a, b = tmp_path / "A", tmp_path / "B"
    with CheckpointEngine() as engine:
        engine.save({"w": torch.arange(1000.0)}, a / "a.ckpt").result()
    target = a / linked
    (b / linked).parent.mkdir(parents=True)
    os.symlink(os.path.relpath(target, (b / linked).parent), b / linked)
    config = {"retention": {"keep_last": 1}}
    with CheckpointEngine(config) as engine:
        for step in range(3):  # each save removes the one before it and collects after it
            engine.save({"w": torch.full((1000,), float(step))}, b / f"b{step}.ckpt").result()
        engine.wait()
        report = engine.gc(b)
        assert report.problems and "symbolic link" in report.problems[0] and not report.deleted
        assert engine.verify(a / "a.ckpt").ok and engine.verify(b / "b2.ckpt").ok
    assert sorted(p.name for p in b.glob("*.ckpt")) == ["b2.ckpt"]
    from ckpt_core.cli import main

    capsys.readouterr()
    assert main(["ls", str(b)]) == 0
    out = capsys.readouterr().out  # the unreferenced total is unknown, and ls says why
    assert re.search(r"unreferenced unknown \(\S+ is a symbolic link", out), out


def test_gc_beside_a_linked_step_log_folder_deletes_none_of_it(tmp_path):
    """A ``.checkrun/steplog`` that links to another directory's: ``gc`` of the directory holding the
    link deleted the other directory's whole step log (segments, marker, run object), so its checkpoint
    could no longer be replayed (found by a check of hostile layouts). It now deletes nothing there and
    says why, as beside a linked blob folder."""
    a, b = tmp_path / "A", tmp_path / "B"
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        log = engine.step_log(a, opt)
        for step in range(1, 7):
            opt.zero_grad()
            model(torch.full((3, 4), float(step))).sum().backward()
            opt.step()
            if step == 2:
                engine.save({"m": model.state_dict(), "opt": opt.state_dict()}, a / "s2.ckpt").result()
        log.close()
    with CheckpointEngine() as engine:
        engine.save({"x": torch.zeros(3)}, b / "b.ckpt").result()
    before = sorted(os.listdir(a / ".checkrun" / "steplog"))
    assert before
    os.symlink(a / ".checkrun" / "steplog", b / ".checkrun" / "steplog")
    from ckpt_core.cli import main

    assert main(["gc", str(b), "--grace", "0"]) != 0  # a problem, reported
    assert sorted(os.listdir(a / ".checkrun" / "steplog")) == before
    fresh = torch.nn.Linear(4, 1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with CheckpointEngine() as engine:
        state = engine.load(a / "s2.ckpt")
        fresh.load_state_dict(state["m"])
        fresh_opt.load_state_dict(state["opt"])
        assert engine.replay(a, fresh_opt, after=a / "s2.ckpt") == 4
    assert torch.equal(fresh.weight, model.weight)


def test_verify_says_when_the_blob_folder_is_a_file(tmp_path):
    """A ``.checkrun`` that is a plain file: verify said "there is no .checkrun/blobs folder beside the
    manifest" (a manifest copied alone), which misled (found by a check of odd layouts)."""
    with CheckpointEngine() as engine:
        engine.save({"w": torch.ones(3)}, tmp_path / "a.ckpt").result()
        shutil.rmtree(tmp_path / ".checkrun")
        (tmp_path / ".checkrun").write_bytes(b"")
        report = engine.verify(tmp_path / "a.ckpt")
    assert not report.ok and any(p.endswith(".checkrun is a file, not the folder of the blobs") for p in report.problems)
    assert not any("beside the manifest" in p for p in report.problems), report.problems


def test_gc_keeps_a_users_files_whose_names_only_resemble_temp_files(tmp_path):
    """h132: ``checkrun gc`` deleted a user's day-old ``.last.ckpt.tmp-1`` (a hand-made backup) and
    ``.notes.tmp-2026-12-01`` as temp files of interrupted writes: any ``.X.tmp-`` followed by hex digits,
    ``p``, ``s`` and ``-`` counted. Only the names checkrun's writes give their temp files do now."""
    import pathlib
    import time

    from ckpt_core.storage.atomic import temp_path

    run = tmp_path / "run"
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"w": torch.ones(4)}, run / "last.ckpt")
    mine = [run / ".last.ckpt.tmp-1", run / ".notes.tmp-2026-12-01",
            run / ".last.ckpt.tmp-1796643266410434809", run / ".notes.tmp-0123456789abcdef"]  # h134: time_ns, token_hex(8)
    ours = pathlib.Path(temp_path(str(run / "x.ckpt")))  # an interrupted write's, of this process
    for p in mine + [ours]:
        p.write_bytes(b"kept")
        os.utime(p, (time.time() - 86400, time.time() - 86400))
    with CheckpointEngine() as engine:
        report = engine.gc(run)
    assert all(p.read_bytes() == b"kept" for p in mine) and not ours.exists(), report


def test_gc_of_a_folder_without_checkrun_data_writes_nothing(tmp_path):
    """h132: ``checkrun gc mydata`` on a user's own folder (or accelerate's checkpoint_0, or an empty one)
    left a ``mydata/.checkrun/leases/`` behind: its collection wrote its lease object first."""
    (tmp_path / "notes.txt").write_text("mine")
    with CheckpointEngine() as engine:
        report = engine.gc(tmp_path)
    assert not report.problems and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_gc_deletes_a_killed_saves_temp_file_beside_a_checkpoint_without_blobs(tmp_path):
    """h134: a checkpoint of no tensor (``{"step": 1}``) makes no ``.checkrun`` folder, and gc (which since h132
    writes nothing into a folder without one) no longer collected a killed save's temp file there. It does
    again (and still writes nothing, and keeps a user's look-alike)."""
    import pathlib
    import time

    from ckpt_core.storage.atomic import temp_path

    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"step": 1, "lr": 0.1}, tmp_path / "a.ckpt")
    assert not (tmp_path / ".checkrun").exists()
    torn, mine = pathlib.Path(temp_path(str(tmp_path / "b.ckpt"))), tmp_path / ".b.ckpt.tmp-1"
    for p in (torn, mine):
        p.write_bytes(b"half")
        os.utime(p, (time.time() - 86400, time.time() - 86400))
    with CheckpointEngine() as engine:
        dry = engine.gc(tmp_path, dry_run=True)
        assert dry.temp_files == [torn.name] and torn.exists()
        report = engine.gc(tmp_path)
    assert report.temp_files == [torn.name] and not torn.exists() and mine.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["a.ckpt", mine.name])
