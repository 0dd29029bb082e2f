"""Commits are fenced, and an unanswered commit is resolved by checking what landed.

* An orphan writer commits nothing: a trainer in writer-process mode is SIGKILLed while its save to
  ``last.ckpt`` is in flight in its writer process (held there with SIGSTOP); after SIGCONT the
  writer must not commit, whether or not a restarted trainer committed a newer ``last.ckpt``.
* An older save never replaces a newer manifest of the same name (the fence compares the commit
  stamps of the two manifests right before the rename / PUT), in writer-process and thread mode.
* A manifest PUT that the S3 server applied but whose response was lost (a botocore ``after-call``
  handler raising a read timeout) is a committed save; one that did not land fails, naming the
  file. The local equivalent: a rename that happened although the call reported an error.

Synchronisation is by pipes, gates, /proc state and pidfds: no sleeps.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import time
from pathlib import Path

import fsspec
import pytest

from ckpt_core import BackgroundSaveError, CheckpointEngine
from ckpt_core.errors import CheckpointNotFoundError, CheckrunError, StorageError
from ckpt_core.storage.store import Store

from . import fencing_child, harness
from .crash_child import versioned_state
from ckpt_core.testing import FaultFS, Gate, s3_fault_options

WATCHDOG = 120  # seconds; only bounds a wait that would otherwise hang on a bug


def version_at(path, **kw) -> int:
    with CheckpointEngine(fencing_child.engine_config("thread")) as engine:
        return engine.load(str(path), **kw)["version"]


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (its /proc state says so)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WATCHDOG
    while _proc_state(pid) not in ("T", "t"):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        os.sched_yield()


def resume_until_exit(pid: int) -> None:
    """SIGCONT ``pid`` (not our child) and wait for it to exit, on a pidfd."""
    if not hasattr(os, "pidfd_open"):
        os.kill(pid, signal.SIGCONT)
        pytest.skip("needs os.pidfd_open (Linux 5.3+) to wait for a process that is not a child")
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGCONT)
        ready, _, _ = select.select([fd], [], [], WATCHDOG)
        assert ready, f"writer process {pid} did not exit"
    finally:
        os.close(fd)


def _recv(conn):
    assert conn.poll(WATCHDOG), "the trainer process sent nothing"
    return conn.recv()


# ------------------------------------------------------------------------------- orphan writers
@pytest.mark.parametrize("restart", [True, False], ids=["restarted-trainer-commits-newer", "no-restart"])
def test_orphan_writer_commits_nothing(tmp_path, restart):
    root = tmp_path / "run"
    log = tmp_path / "trainer.log"
    ctx = harness.context()
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=fencing_child.orphan_trainer, args=(child_conn, str(root), str(log)),
                       daemon=True)
    proc.start()
    child_conn.close()
    writer_pid = None
    try:
        kind, writer_pid, staging_dir = _recv(conn)
        assert kind == "writer" and os.path.isdir(staging_dir)
        stop(writer_pid)
        conn.send("go")
        assert _recv(conn) == ("sent",)  # version 2 is in the stopped writer's pipe
        proc.kill()
        proc.join()
        if restart:  # the restarted trainer commits a newer last.ckpt while the old writer sleeps
            with CheckpointEngine(fencing_child.engine_config("thread")) as engine:
                engine.save(versioned_state(3), f"{root}/last.ckpt").result()
        resume_until_exit(writer_pid)
    finally:
        proc.kill()
        proc.join()
        if writer_pid is not None:  # never leave a stopped writer behind a failed test
            with contextlib.suppress(ProcessLookupError):
                os.kill(writer_pid, signal.SIGCONT)
    assert version_at(root / "last.ckpt") == (3 if restart else 1)
    assert [p.name for p in root.iterdir() if p.name.startswith(".") and p.name != ".checkrun"] == []
    assert not os.path.exists(staging_dir)  # the orphan deleted the dead trainer's staging files
    if not restart:
        assert "training process" in log.read_text()  # it said why it committed nothing


def test_older_save_in_a_paused_writer_process_never_replaces_a_newer_manifest(tmp_path):
    from ckpt_core.errors import SupersededError

    path = tmp_path / "run" / "last.ckpt"
    with CheckpointEngine(fencing_child.engine_config("process")) as a, \
            CheckpointEngine(fencing_child.engine_config("thread")) as b:
        a.save(versioned_state(1), path).result()
        writer_pid = a._process._proc.pid
        stop(writer_pid)
        try:
            older = a.save(versioned_state(2), path)  # captured before b's: older
            b.save(versioned_state(3), path).result()
        finally:
            os.kill(writer_pid, signal.SIGCONT)
        with pytest.raises(BackgroundSaveError, match="last.ckpt") as info:
            older.result(WATCHDOG)
        assert isinstance(info.value.__cause__, SupersededError)
        assert version_at(path) == 3
        a.save(versioned_state(4), path).result()  # a's next save is newer than b's: it commits
        assert version_at(path) == 4
        assert a.verify(path).ok


_HOLD_AT_COMMIT = """
import os, sys
hold = os.environ.get("CHECKRUN_TEST_HOLD_COMMIT")
if hold:
    if sys.argv[:1] == ["-c"]:  # the writer process: tell the test its pid
        with open(os.path.join(hold, "writer.pid"), "w") as f:
            f.write(str(os.getpid()))
    replace = os.replace

    def held_replace(src, dst, *args, **kwargs):
        if str(dst).endswith("/last.ckpt"):  # this process is about to commit: say who, then wait
            with open(os.path.join(hold, "ready"), "w") as f:
                f.write(str(os.getpid()))
            with open(os.path.join(hold, "release")) as f:
                f.read()
        return replace(src, dst, *args, **kwargs)

    os.replace = held_replace
"""

_TRAINER = """
import sys, threading, torch, ckpt_core
sys.path.insert(0, {tests!r})
from reliability import fencing_child
from reliability.crash_child import versioned_state
torch.set_num_threads(1)
engine = ckpt_core.CheckpointEngine(fencing_child.engine_config("process"))
engine.save(versioned_state(2), {path!r})
threading.Event().wait()
"""


def test_a_writer_process_paused_at_the_commit_while_its_trainer_restarts_replaces_nothing(tmp_path):
    """The commit's last step (the rename onto ``last.ckpt``) is held in whichever process makes it;
    the trainer is SIGKILLed there, a restarted trainer commits a newer ``last.ckpt``, then the
    hold is released. Before, the writer process renamed, after its checks of the trainer and of
    the fence, so released there it replaced the newer checkpoint with the dead trainer's (a fault
    program's random SIGSTOPs hit that window). Now the training process makes the commit: killed,
    it commits nothing, and the writer process ends. Held by a ``sitecustomize`` on the inherited
    PYTHONPATH (FIFOs: no sleeps)."""
    import subprocess
    import sys
    import textwrap

    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(_HOLD_AT_COMMIT)
    for fifo in ("ready", "release"):
        os.mkfifo(hold / fifo)
    path = tmp_path / "run" / "last.ckpt"
    with CheckpointEngine(fencing_child.engine_config("thread")) as engine:
        engine.save(versioned_state(1), path).result()
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(_TRAINER.format(tests=str(Path(__file__).parents[1]), path=str(path))))
    env = dict(os.environ, CHECKRUN_TEST_HOLD_COMMIT=str(hold),
               PYTHONPATH=os.pathsep.join([str(hold), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with open(tmp_path / "trainer.log", "w") as log:
        trainer = subprocess.Popen([sys.executable, str(script)], env=env, stdout=log, stderr=log)
    writer = None
    try:
        with open(hold / "ready") as f:  # until a process reached the rename of version 2
            f.read()
        writer = os.pidfd_open(int((hold / "writer.pid").read_text()))
        trainer.kill()
        trainer.wait()
        with CheckpointEngine(fencing_child.engine_config("thread")) as engine:  # the restarted trainer
            engine.save(versioned_state(3), path).result()
        try:  # release the holder if it is alive (the writer process, before)
            os.close(os.open(hold / "release", os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno == errno.ENXIO  # nobody holds: the holder was the trainer
        assert select.select([writer], [], [], WATCHDOG)[0], "the writer process did not end"
    finally:
        trainer.kill()
        trainer.wait()
        if writer is not None:
            os.close(writer)
    assert version_at(path) == 3
    assert "training process" in (tmp_path / "trainer.log").read_text()  # the writer said why


def test_a_save_asked_for_before_another_writers_commit_is_older_even_if_it_waited(tmp_path, gate, monkeypatch):
    """A stalled writer (its storage held) asks for another save of a name; that call waits for a
    slot (the previous save is still in flight) while another writer commits the name. The waiting
    save is the older one: stamped when asked for, it must not replace the other writer's checkpoint
    once the storage comes back (before: stamped after its wait, it did, and became ``latest()``)."""
    import threading

    from ckpt_core import engine as engine_module
    from ckpt_core.errors import SupersededError

    asked = threading.Event()
    original = engine_module.new_stamp

    def observed():
        stamp = original()
        if threading.current_thread().name == "asker":
            asked.set()
        return stamp

    monkeypatch.setattr(engine_module, "new_stamp", observed)
    root = tmp_path / "run"
    config = fencing_child.engine_config("thread")
    with CheckpointEngine(config) as a, CheckpointEngine(config) as b:
        first = a.save(versioned_state(1), f"gatefile://{root}/first.ckpt")
        FaultFS.entered.acquire()  # a's storage stalls; its one slot is taken
        handles = []
        asker = threading.Thread(name="asker", target=lambda: handles.append(
            a.save(versioned_state(2), f"gatefile://{root}/last.ckpt")))
        asker.start()
        try:
            assert asked.wait(WATCHDOG)  # a asked (and waits for its slot) before b commits
            b.save(versioned_state(3), root / "last.ckpt").result()
        finally:
            gate.set()
        asker.join(WATCHDOG)
        first.result(WATCHDOG)
        with pytest.raises(BackgroundSaveError, match="last.ckpt") as info:
            handles[0].result(WATCHDOG)
        assert isinstance(info.value.__cause__, SupersededError)
        assert version_at(root / "last.ckpt") == 3
        assert b.latest(root).endswith("last.ckpt")


def test_fence_is_checked_between_the_written_temp_file_and_the_rename(tmp_path):
    from ckpt_core.errors import SupersededError

    root = tmp_path / "run"
    url = f"faultfile://{root}/last.ckpt"
    with CheckpointEngine(fencing_child.engine_config("thread")) as a, \
            CheckpointEngine(fencing_child.engine_config("thread")) as b:
        a.save(versioned_state(1), url).result()
        gate = Gate("close", "manifest")  # a's manifest is written and fsynced, not yet renamed
        FaultFS.policy = gate
        older = a.save(versioned_state(2), url)
        assert gate.entered.wait(WATCHDOG)
        b.save(versioned_state(3), root / "last.ckpt").result()  # plain path: not gated
        gate.release()
        with pytest.raises(BackgroundSaveError, match="last.ckpt") as info:
            older.result(WATCHDOG)
        FaultFS.policy = None
        assert isinstance(info.value.__cause__, SupersededError)
        assert "newer" in str(info.value)
    assert version_at(root / "last.ckpt") == 3
    assert [p.name for p in root.iterdir()] and not [p for p in root.rglob("*") if ".tmp-" in p.name]


# --------------------------------------------------------------------------- ambiguous commits
class LostResponses:
    """botocore hooks on the engine's s3fs client: every PutObject of a key ending in ``suffix``
    reaches the S3 server and is applied there, then the client raises a read timeout instead of
    returning the answer (``after-call``), as if the connection dropped before the response.
    ``tamper(key)``: called after the server applied the PUT, before the error (another writer)."""

    def __init__(self, fs, suffix: str = ".ckpt", tamper=None, before_send: bool = False) -> None:
        fs.connect()
        self.fs, self.suffix, self.tamper = fs, suffix, tamper
        self.client = fs.s3
        self.saved_retries, fs.retries = fs.retries, 1  # s3fs's own retries off: the engine's count
        self.lost: list[str] = []
        self.handlers = [("before-parameter-build.s3.PutObject", self._remember_key),
                         ("before-send.s3.PutObject" if before_send else "after-call.s3.PutObject",
                          self._drop)]
        for event, handler in self.handlers:
            self.client.meta.events.register(event, handler)

    def _remember_key(self, params, context, **kwargs):
        context["checkrun_test_key"] = params.get("Key", "")

    def _drop(self, context=None, request=None, **kwargs):
        from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

        key = (context or getattr(request, "context", None) or {}).get("checkrun_test_key", "")
        if not key.endswith(self.suffix):
            return None
        self.lost.append(key)
        if request is not None:  # before-send: the request never leaves the client
            raise EndpointConnectionError(endpoint_url="injected: the connection failed")
        if self.tamper is not None:
            self.tamper(key)
        raise ReadTimeoutError(endpoint_url="injected: the response was lost")

    def remove(self) -> None:
        for event, handler in self.handlers:
            self.client.meta.events.unregister(event, handler)
        self.fs.retries = self.saved_retries


def _s3_config(opts: dict):
    cfg = fencing_child.engine_config("thread")
    return cfg.replace(**{"storage.storage_options": opts, "storage.retry.max_attempts": 3,
                          "storage.retry.initial_backoff_seconds": 0.01})


@pytest.mark.s3
def test_s3_manifest_put_applied_but_unanswered_is_a_committed_save(s3_root, s3_storage_options,
                                                                    sleeps, caplog):
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    assert Store.for_directory(s3_root, opts, _s3_config(opts).storage).fs is fs  # the engine's client
    with CheckpointEngine(_s3_config(opts)) as engine:
        engine.save(versioned_state(1), f"{s3_root}/last.ckpt").result()
        faults = LostResponses(fs)
        try:
            with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
                engine.save(versioned_state(2), f"{s3_root}/last.ckpt").result()
        finally:
            faults.remove()
        assert faults.lost and all(k.endswith("run/last.ckpt") for k in faults.lost)
        assert engine.load(f"{s3_root}/last.ckpt")["version"] == 2
        assert engine.latest(s3_root) == f"{s3_root}/last.ckpt"
        assert any("landed" in r.getMessage() and "last.ckpt" in r.getMessage() for r in caplog.records)


@pytest.mark.s3
@pytest.mark.parametrize("how", ["not-sent", "replaced-meanwhile"])
def test_s3_manifest_put_that_did_not_land_fails_naming_the_file(s3_root, s3_storage_options, sleeps,
                                                                 how):
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    other = _sync_s3_client(opts)

    def replace_it(key: str) -> None:  # another writer's PUT lands between ours and our check
        other.put_object(Bucket=s3_root[5:].split("/")[0], Key=key, Body=b"another writer's bytes")

    with CheckpointEngine(_s3_config(opts)) as engine:
        engine.save(versioned_state(1), f"{s3_root}/c.ckpt").result()
        faults = LostResponses(fs, tamper=replace_it if how == "replaced-meanwhile" else None,
                               before_send=how == "not-sent")
        try:
            handle = engine.save(versioned_state(2), f"{s3_root}/new.ckpt")
            with pytest.raises(BackgroundSaveError, match="new.ckpt") as info:
                handle.result(WATCHDOG)
        finally:
            faults.remove()
        assert isinstance(info.value.__cause__, CheckrunError) and faults.lost
        if how == "not-sent":
            with pytest.raises(CheckpointNotFoundError):
                engine.load(f"{s3_root}/new.ckpt")
        assert engine.latest(s3_root) == f"{s3_root}/c.ckpt"


@pytest.mark.s3
def test_s3_a_writer_paused_after_its_fence_check_replaces_no_newer_manifest(s3_root, s3_storage_options,
                                                                               monkeypatch):
    """Writer A passes the fence check of ``last.ckpt`` and pauses before its PUT (a stopped process, a
    stalled connection, s3fs retrying the PUT); a restarted trainer B commits a newer ``last.ckpt``; A's
    PUT then replaced it, reported as committed, and ``ckpt_path="last"`` resumed the dead run's older
    state (found by an independent check). The PUT is conditional on the object the check looked at:
    A's fails, its check runs again and finds B's newer stamp."""
    import threading

    from ckpt_core.errors import SupersededError
    from ckpt_core.saving import commit as commit_module

    paused, resume = threading.Event(), threading.Event()
    real_guard = commit_module.commit_guard

    def pausing_guard(store, name, stamp, *rest):
        check = real_guard(store, name, stamp, *rest)

        def guarded():
            check()
            if name == "last.ckpt" and threading.current_thread().name != "MainThread" and not paused.is_set():
                paused.set()  # A: checked, its PUT not sent yet
                assert resume.wait(WATCHDOG)
        return guarded

    monkeypatch.setattr(commit_module, "commit_guard", pausing_guard)
    config = _s3_config(s3_storage_options)
    url = f"{s3_root}/last.ckpt"
    with CheckpointEngine(config) as a, \
            CheckpointEngine(config.replace(**{"saving.asynchronous": False})) as b:
        a.save(versioned_state(1), f"{s3_root}/first.ckpt").result()
        zombie = a.save(versioned_state(2), url)
        assert paused.wait(WATCHDOG)
        b.save(versioned_state(3), url)  # synchronous: on the main thread, not paused
        resume.set()
        with pytest.raises(BackgroundSaveError, match="last.ckpt") as info:
            zombie.result(WATCHDOG)
        assert isinstance(info.value.__cause__, SupersededError)
        assert b.load(url)["version"] == 3


@pytest.mark.s3
def test_s3_a_store_without_conditional_puts_still_commits(s3_root, s3_storage_options, caplog):
    """An S3-compatible store that answers a conditional PUT (``If-Match``/``If-None-Match``) with
    NotImplemented: the manifest is written without the condition, with a warning, not failed."""
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    fs.connect()
    refused = []

    def refuse(params, **kwargs):
        if {"If-Match", "If-None-Match"} & set(params.get("headers", {})):
            refused.append(params.get("url_path", ""))
            http = type("Answer", (), {"status_code": 501, "headers": {}})()
            return http, {"Error": {"Code": "NotImplemented", "Message": "not implemented (test)"},
                          "ResponseMetadata": {"HTTPStatusCode": 501}}
        return None

    fs.s3.meta.events.register("before-call.s3.PutObject", refuse)
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
            with CheckpointEngine(_s3_config(opts)) as engine:
                engine.save(versioned_state(1), f"{s3_root}/last.ckpt").result()
                engine.save(versioned_state(2), f"{s3_root}/last.ckpt").result()
                assert engine.load(f"{s3_root}/last.ckpt")["version"] == 2
    finally:
        fs.s3.meta.events.unregister("before-call.s3.PutObject", refuse)
    assert len(refused) == 1  # then remembered: later commits go without the condition
    assert any("conditional writes" in r.getMessage() for r in caplog.records)


@pytest.mark.s3
@pytest.mark.parametrize("answer", [(409, "ConditionalRequestConflict"), (404, "NoSuchKey")])
def test_s3_a_conditional_put_answered_conflict_or_gone_is_checked_and_tried_again(s3_root, s3_storage_options,
                                                                                    answer):
    """AWS answers a conditional PUT racing another with 409 ConditionalRequestConflict (to be retried), and one
    whose object was deleted after its ETag was read with 404: both failed the save (found by an independent
    check); they mean the object changed, so the fence check runs again and the PUT is retried."""
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    fs.connect()
    status, code = answer
    answered = []

    def conflict_once(params, **kwargs):
        if "If-Match" in params.get("headers", {}) and not answered:
            answered.append(code)
            http = type("Answer", (), {"status_code": status, "headers": {}})()
            return http, {"Error": {"Code": code, "Message": f"{code} (test)"}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return None

    with CheckpointEngine(_s3_config(opts)) as engine:
        engine.save(versioned_state(1), f"{s3_root}/last.ckpt").result()
        fs.s3.meta.events.register("before-call.s3.PutObject", conflict_once)
        try:
            engine.save(versioned_state(2), f"{s3_root}/last.ckpt").result()
        finally:
            fs.s3.meta.events.unregister("before-call.s3.PutObject", conflict_once)
        assert answered == [code] and engine.load(f"{s3_root}/last.ckpt")["version"] == 2


def _sync_s3_client(opts: dict):
    """A plain (synchronous) botocore client of the same endpoint: usable inside a handler that
    runs on s3fs's event loop, where the async client cannot be called."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=opts["client_kwargs"]["endpoint_url"], aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"], region_name="us-east-1")


def test_local_rename_that_happened_but_reported_an_error_is_a_committed_save(tmp_path, monkeypatch,
                                                                               caplog):
    """NFS: a rename whose reply was lost is retried by the client and answered ENOENT, although
    the first one happened. The manifest holds this save's bytes: the save is committed."""
    real_replace = os.replace
    lost: list[str] = []

    def replace(src, dst, **kwargs):
        real_replace(src, dst, **kwargs)
        if str(dst).endswith(".ckpt"):
            lost.append(str(dst))
            raise FileNotFoundError(errno.ENOENT, "injected: the retried rename found no source", src)

    root = tmp_path / "run"
    with CheckpointEngine(fencing_child.engine_config("thread")) as engine:
        monkeypatch.setattr(os, "replace", replace)
        with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
            engine.save(versioned_state(1), root / "a.ckpt").result()
        monkeypatch.setattr(os, "replace", real_replace)
        assert lost == [str(root / "a.ckpt")]
        assert engine.load(root / "a.ckpt")["version"] == 1
    assert any("landed" in r.getMessage() for r in caplog.records)


def test_local_rename_error_without_the_manifest_fails_naming_it(tmp_path, monkeypatch):
    def replace(src, dst, **kwargs):
        raise OSError(errno.EIO, "injected: I/O error", src)

    root = tmp_path / "run"
    with CheckpointEngine(fencing_child.engine_config("thread")) as engine:
        monkeypatch.setattr(os, "replace", replace)
        handle = engine.save(versioned_state(1), root / "a.ckpt")
        with pytest.raises(BackgroundSaveError, match="a.ckpt") as info:
            handle.result(WATCHDOG)
        monkeypatch.undo()
        assert isinstance(info.value.__cause__, StorageError)
    assert sorted(p.name for p in Path(root).iterdir()) == [".checkrun"]


# -- a checkpoint that claims to come from the future ------------------------------------------------
def _forge(path: Path, edit) -> None:
    """Rewrite a manifest's body with a correct checksum (a writer whose clock runs ahead, or an attacker)."""
    import json

    import xxhash

    from ckpt_core.format import manifest as m

    body = json.loads(path.read_bytes())
    edit(body)
    body.pop("checksum")
    text = m._canonical_bytes(body)
    path.write_bytes(m._with_checksum(text, xxhash.xxh3_128_hexdigest(text)))


def test_a_checkpoint_from_the_future_neither_stays_newest_nor_fences_its_name(tmp_path, caplog) -> None:
    """A manifest whose ``created`` and commit stamp lie 3 years ahead: before, ``latest()`` returned it
    for good, ``keep_last`` retention deleted every checkpoint committed after it, and no later save of
    its name could replace it (SupersededError). It is now ordered by its file's time, and its stamp
    does not fence."""
    import torch

    ahead = time.time() + 3 * 365 * 86400
    kept, fenced = tmp_path / "kept", tmp_path / "fenced"
    keep2 = {"retention": {"keep_last": 2}, "saving": {"asynchronous": False}}
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"step": 1, "w": torch.ones(4)}, kept / "step1.ckpt").result()
        engine.save({"step": 1, "w": torch.ones(4)}, fenced / "last.ckpt").result()
    for path in (kept / "step1.ckpt", fenced / "last.ckpt"):
        _forge(path, lambda b: (b.__setitem__("created", ahead), b["commit"].__setitem__("ns", int(ahead * 1e9))))
    with CheckpointEngine(keep2) as engine:  # another writer: the stamps compare by time
        for step in (2, 3, 4):
            engine.save({"step": step, "w": torch.full((4,), float(step))}, kept / f"step{step}.ckpt").result()
        names = sorted(e.name for e in engine.list(kept) if e.manifest is not None)
        assert names == ["step3.ckpt", "step4.ckpt"] and engine.load(engine.latest(kept))["step"] == 4, names
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine, \
            caplog.at_level(logging.WARNING, logger="ckpt_core"):
        engine.save({"step": 4, "w": torch.full((4,), 4.0)}, fenced / "last.ckpt").result()
        assert engine.load(fenced / "last.ckpt")["step"] == 4
    assert "ahead of this host's clock" in caplog.text


@pytest.mark.parametrize("ahead", [3600, 60])
def test_a_clock_stepped_back_keeps_one_processs_checkpoints_in_capture_order(tmp_path, monkeypatch, ahead) -> None:
    """One process saves steps 1-3 with its host's clock ``ahead`` seconds fast (the files' times too:
    the kernel's clock), the clock is then set right and it saves steps 4-6 with ``keep_last=2``.
    Ordered by commit time, steps 1-3 stayed the newest: retention deleted step 4, then 5, and
    ``latest()`` answered step 3 with step 6 committed (found by an independent check; 60 s, under
    the 5-minute future slack, the same). One process's checkpoints keep their capture order now."""
    import torch

    real = time.time
    directory = tmp_path / "run"
    with CheckpointEngine({"retention": {"keep_last": 2}, "saving": {"asynchronous": False}}) as engine:
        monkeypatch.setattr(time, "time", lambda: real() + ahead)
        for step in (1, 2, 3):
            path = directory / f"step{step}.ckpt"
            engine.save({"step": step, "w": torch.full((4,), float(step))}, path).result()
            os.utime(path, (real() + ahead, real() + ahead))
        monkeypatch.setattr(time, "time", real)
        for step in (4, 5, 6):
            engine.save({"step": step, "w": torch.full((4,), float(step))}, directory / f"step{step}.ckpt").result()
        names = sorted(e.name for e in engine.list(directory) if e.manifest is not None)
        assert names == ["step5.ckpt", "step6.ckpt"], names
        assert engine.load(engine.latest(directory))["step"] == 6


_AHEAD_WRITER = """
import sys, time
import torch
t, tn = time.time, time.time_ns
time.time = lambda: t() + 30; time.time_ns = lambda: tn() + 30 * 10**9
from ckpt_core import CheckpointEngine
with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
    for step in (1, 2, 3):
        engine.save({"step": step, "w": torch.full((4,), float(step))}, f"{sys.argv[1]}/step{step}.ckpt")
"""


def test_a_run_resumed_on_a_host_whose_clock_is_behind_keeps_its_own_checkpoints(tmp_path) -> None:
    """A writer whose clock runs 30 s ahead of this host's (well within the lease tolerance) saves steps 1-3;
    this process loads step 3 and saves steps 4-6 with ``keep_last=2``: ordered by their commit times, its
    own checkpoints were older than step 3, so its retention deleted steps 4 and 5 and ``latest()`` answered
    step 3 (h127). A process's checkpoints are now newer than the one it loaded (``fence.observe``)."""
    import subprocess
    import sys

    import torch

    directory = tmp_path / "run"
    subprocess.run([sys.executable, "-c", _AHEAD_WRITER, str(directory)], check=True, timeout=300)
    with CheckpointEngine({"retention": {"keep_last": 2}, "saving": {"asynchronous": False}}) as engine:
        assert engine.load(engine.latest(directory))["step"] == 3
        for step in (4, 5, 6):
            engine.save({"step": step, "w": torch.full((4,), float(step))}, directory / f"step{step}.ckpt")
            # (h129: the first one, stamped 1 ns past step 3, had the same float ``created`` and sorted older)
            assert engine.latest(directory).endswith(f"step{step}.ckpt")
        names = sorted(e.name for e in engine.list(directory) if e.manifest is not None)
        assert names == ["step5.ckpt", "step6.ckpt"], names
        assert engine.load(engine.latest(directory))["step"] == 6


@pytest.mark.parametrize("told_size", [0, 100, 300])
def test_a_head_that_says_fewer_bytes_does_not_make_a_newer_checkpoint_look_damaged(tmp_path, monkeypatch,
                                                                                   told_size) -> None:
    """h129: the fence read a small manifest whole in one request, sized by a HEAD that said fewer bytes than
    the file holds; the cut read failed its checksum, the newer checkpoint counted as damaged and an older save
    replaced it. A read that fails its checksum is read again before it counts as damaged."""
    import torch

    from ckpt_core.saving.fence import new_stamp

    older = new_stamp()  # a save asked for before the one that commits first
    path = tmp_path / "x.ckpt"
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"step": 2, "w": torch.full((4,), 2.0)}, path)
    real, told = FaultFS.info, []

    def info(self, p, **kwargs):
        out = real(self, p, **kwargs)
        if str(p).endswith("x.ckpt") and not told:  # the first HEAD of it (h131: 0-130 bytes, too few for a stamp)
            told.append(p)
            return {**out, "size": told_size}
        return out

    monkeypatch.setattr(FaultFS, "info", info)
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        with pytest.raises(BackgroundSaveError, match="a newer checkpoint of that name was committed"):
            engine.save({"step": 1, "w": torch.full((4,), 1.0)}, f"faultfile://{path}", stamp=older)
        assert told and engine.load(path)["step"] == 2
