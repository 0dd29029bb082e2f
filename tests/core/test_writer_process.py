"""``saving.background: process``: saves written by a writer process through shared staging buffers."""
from __future__ import annotations

import errno
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from ckpt_core import CheckpointEngine, CheckrunError, ConfigError, EngineConfig, StorageError

PROCESS = {"saving": {"background": "process"}, "incremental": {"row_delta_min_rows": 64},
           "retention": {"gc_grace_seconds": 0}}


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(2048, 16, generator=g), "w": torch.randn(300, 70, generator=g),
            "bias": torch.randn(16, generator=g), "half": torch.randn(40, 3, generator=g).bfloat16(),
            "step": 3, "note": "text", "empty": torch.empty(0, 5)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) if isinstance(a[k], torch.Tensor) and a[k].numel()
        else (a[k].shape == b[k].shape if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a)


def test_round_trip_row_deltas_and_same_blobs_as_threads(tmp_path) -> None:
    state = _state()
    with CheckpointEngine(PROCESS) as engine:
        first = engine.save(state, tmp_path / "p" / "0.ckpt").result()
        state["emb"][[3, 700, 2000]] += 1.0
        state["w"] += 1.0
        second = engine.save(state, tmp_path / "p" / "1.ckpt").result()
        assert _equal(engine.load(tmp_path / "p" / "1.ckpt"), state)
        directory = engine.staging.shared.directory
        assert os.listdir(directory)  # the staging buffers are files there
    assert not os.path.exists(directory)
    assert second.chain_depth == 1 and second.reused_blobs > 0
    assert second.written_bytes < 0.6 * first.written_bytes
    # the writer process stores exactly what the threads would
    with CheckpointEngine({**PROCESS, "saving": {"background": "thread"}}) as engine:
        engine.save(_state(), tmp_path / "t" / "0.ckpt").result()
        blobs = {b.key for b in engine.read_manifest(tmp_path / "t" / "0.ckpt").blobs()}
        assert blobs == {b.key for b in engine.read_manifest(tmp_path / "p" / "0.ckpt").blobs()}


def test_a_loaded_checkpoint_is_reused_by_the_writer_process(tmp_path) -> None:
    state = _state()
    with CheckpointEngine(PROCESS) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
    with CheckpointEngine(PROCESS) as engine:
        loaded = engine.load(tmp_path / "0.ckpt")
        assert engine._process._proc is None  # a load alone starts no writer process
        loaded["emb"][5] += 1.0
        info = engine.save(loaded, tmp_path / "1.ckpt").result()
        assert _equal(engine.load(tmp_path / "1.ckpt"), loaded)
    assert info.chain_depth == 1  # a row delta against the loaded base
    assert info.written_bytes < 5000


def test_a_killed_writer_process_fails_one_save_and_the_next_starts_a_new_one(tmp_path) -> None:
    state = _state()
    with CheckpointEngine(PROCESS) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
        proc = engine._process._proc
        proc.kill()
        proc.wait()
        state["w"] += 1.0
        handle = engine.save(state, tmp_path / "1.ckpt")
        with pytest.raises(CheckrunError, match=r"writer process died \(exit status -9\).*1\.ckpt"):
            handle.result()
        state["w"] += 1.0
        engine.save(state, tmp_path / "2.ckpt").result()
        assert engine._process._proc.pid != proc.pid
        assert _equal(engine.load(tmp_path / "2.ckpt"), state)
        assert sorted(e.name for e in engine.list(tmp_path)) == ["0.ckpt", "2.ckpt"]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.complex32, torch.float32])
def test_zero_size_tensors_of_every_dtype_are_saved(tmp_path, dtype) -> None:
    """A zero-size staging buffer is a plain tensor, pickled to the writer by torch, which cannot unpickle
    uint16/uint32/uint64/float8/complex32 tensors: the writer died, and every later save failed (found by
    an independent check). They are rebuilt in the writer, not pickled."""
    with CheckpointEngine(PROCESS) as engine:
        state = {"w": torch.ones(4), "e": torch.empty(0, 3, dtype=dtype)}
        engine.save(state, tmp_path / "a.ckpt").result()
        loaded = engine.load(tmp_path / "a.ckpt")
        assert loaded["e"].dtype == dtype and loaded["e"].shape == (0, 3)
        engine.save({"w": torch.zeros(4)}, tmp_path / "b.ckpt").result()


def test_a_writer_that_fails_on_an_error_leaves_the_staging_buffers_to_the_next_one(tmp_path, monkeypatch) -> None:
    """The writer's exit on an error of its own deleted the engine's staging directory: every later save
    failed (its next writer could not register, and was killed after 10 s; found by an independent check)."""
    from ckpt_core.saving import process

    with CheckpointEngine(PROCESS) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
        real = process._Pickler.persistent_id
        monkeypatch.setattr(process._Pickler, "persistent_id",  # a buffer the writer cannot map: it fails
                            lambda self, obj: ("missing.buf", torch.float32, 4) if type(obj) is torch.Tensor else None)
        with pytest.raises(CheckrunError, match=r"writer process died \(exit status 1\).*1\.ckpt"):
            engine.save(_state(1), tmp_path / "1.ckpt").result()
        monkeypatch.setattr(process._Pickler, "persistent_id", real)
        state = _state(2)
        engine.save(state, tmp_path / "2.ckpt").result()
        assert _equal(engine.load(tmp_path / "2.ckpt"), state)


def test_blobs_collected_by_gc_are_written_again(tmp_path) -> None:
    a, b = _state(0), _state(1)
    with CheckpointEngine(PROCESS) as engine:
        engine.save(a, tmp_path / "a.ckpt").result()
        engine.save(b, tmp_path / "b.ckpt").result()
        engine.remove(tmp_path / "a.ckpt")
        assert engine.gc(tmp_path, grace_seconds=0).deleted
        engine.save(a, tmp_path / "a2.ckpt").result()
        assert engine.verify(tmp_path / "a2.ckpt").ok
        assert _equal(engine.load(tmp_path / "a2.ckpt"), a)


def test_memory_filesystem_is_refused_on_the_calling_thread() -> None:
    with CheckpointEngine(PROCESS) as engine:
        with pytest.raises(ConfigError, match="memory://.*saving.background 'thread'"):
            engine.save(_state(), "memory://wp/0.ckpt")


def test_full_shared_memory_is_a_clear_error(tmp_path, monkeypatch) -> None:
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # what shm_staging calls
    with CheckpointEngine(PROCESS) as engine:
        with pytest.raises(StorageError, match=r"cannot reserve \d+ bytes of shared memory in .*--shm-size"):
            engine.save(_state(), tmp_path / "0.ckpt")
        assert engine.pending == 0
    assert not (tmp_path / "0.ckpt").exists()
    # h144: without a writable /dev/shm the buffers go to the temp directory, for which --shm-size is no help
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != "/dev/shm" and real_access(path, mode))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with CheckpointEngine(PROCESS) as engine:
        with pytest.raises(StorageError, match=r"in " + re.escape(str(tmp_path)) + r"/checkrun-staging-.*/dev/shm is "
                           r"missing or not writable, so the temp directory is used: free space there or point TMPDIR"):
            engine.save(_state(), tmp_path / "0.ckpt")


def test_writer_process_deletes_the_buffers_when_the_training_process_dies(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import os, torch, ckpt_core
        engine = ckpt_core.CheckpointEngine({{"saving": {{"background": "process"}}}})
        engine.save({{"w": torch.ones(1000)}}, {str(tmp_path / "0.ckpt")!r}).result()
        print(engine.staging.shared.directory, engine._process._proc.pid, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    directory, pid = out.split()
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        fd = None  # already gone
    if fd is not None:
        select.select([fd], [], [], 60)  # readable when the writer process exits
        os.close(fd)
    assert not os.path.exists(directory)
    assert (tmp_path / "0.ckpt").exists()


def test_a_state_of_more_tensors_than_open_files_allowed_saves_and_loads(tmp_path) -> None:
    """h144: each staging buffer kept an open descriptor (Python's mmap) in both processes: with the usual limit
    of 1,024 open files a model of ~1,000 state tensors (200 Linear layers with Adam) failed its first save with
    a bare EMFILE; threads mode and torch.save were fine. Here: 300 tensors under a limit of 128."""
    script = textwrap.dedent(f"""
        import os, resource, torch, ckpt_core
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        state = {{f"p{{i}}": torch.full((16,), float(i)) for i in range(300)}}
        with ckpt_core.CheckpointEngine({{"saving": {{"background": "process"}}}}) as engine:
            for step in range(2):
                engine.save(state, {str(tmp_path)!r} + f"/{{step}}.ckpt").result()
            assert len(os.listdir("/proc/self/fd")) < 64
            loaded = engine.load({str(tmp_path / "1.ckpt")!r})
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_a_writer_whose_trainer_died_while_it_started_commits_nothing(tmp_path) -> None:
    """A trainer killed right after its first save went to its writer process, while that process
    was still starting: the writer was re-parented before it looked, so ``os.getppid()`` at its start
    named the reaper, it took that for its trainer and committed the dead trainer's save (found by a
    fault program: SIGKILL of trainers during saves). The writer now gets its trainer's pid from the
    engine. Deterministic: the writer is held before ``serve()`` by a ``sitecustomize`` (on the
    PYTHONPATH it inherits) that waits on a FIFO the test opens once the trainer is gone."""
    hold = tmp_path / "hold"
    hold.mkdir()
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    (hold / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, sys
        if sys.argv[:1] == ["-c"] and os.environ.get("CHECKRUN_TEST_HOLD_WRITER"):  # the writer process only
            with open(os.environ["CHECKRUN_TEST_HOLD_WRITER"]) as f:  # until the test opens it for writing
                f.read()
    """))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(textwrap.dedent(f"""
        import os, signal, threading, torch, ckpt_core
        from ckpt_core.saving.process import WriterProcess

        send = WriterProcess._send
        def send_then_die(self, message, start=True):
            conn = send(self, message, start)
            if message[0] == "save":  # the save is in the writer's socket: die before it answers
                with open({str(tmp_path / "writer.txt")!r}, "w") as f:
                    f.write(f"{{self._proc.pid}} {{self.shared.directory}}")
                os.kill(os.getpid(), signal.SIGKILL)
            return conn
        WriterProcess._send = send_then_die
        engine = ckpt_core.CheckpointEngine({{"saving": {{"background": "process"}}}})
        engine.save({{"w": torch.ones(1000)}}, {str(tmp_path / "0.ckpt")!r})
        threading.Event().wait()
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hold), *filter(None, [os.environ.get("PYTHONPATH")])]),
               CHECKRUN_TEST_HOLD_WRITER=str(fifo))
    with open(tmp_path / "trainer.log", "w") as log:  # a file: the writer inherits it and outlives the trainer
        rc = subprocess.run([sys.executable, str(trainer)], env=env, stdout=log, stderr=log, timeout=300).returncode
    assert rc == -9, (tmp_path / "trainer.log").read_text()
    pid, directory = (tmp_path / "writer.txt").read_text().split()
    writer = os.pidfd_open(int(pid))  # it cannot have exited: it waits for the FIFO
    try:
        os.close(os.open(fifo, os.O_WRONLY))  # let it go on into serve(), its trainer long dead
        assert select.select([writer], [], [], 300)[0], "the writer process did not end"  # hang protection only
    finally:
        os.close(writer)
    assert not (tmp_path / "0.ckpt").exists()
    assert CheckpointEngine().latest(tmp_path) is None
    assert not os.path.exists(directory)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_trainers_process_group_while_the_writer_starts_does_not_lose_the_save(tmp_path, sig):
    """Ctrl-C in a terminal, or a preemption's SIGTERM, reaches every process of the trainer's process
    group. One that came while the writer process was still starting (importing torch: 2-3 s) killed
    it, before it ignored them, and the first checkpoint was never committed (h110). The writer now
    ignores them from its first line, in a process group of its own. Deterministic: a ``sitecustomize``
    (on the PYTHONPATH the writer inherits) says when the writer has started and holds it until the
    signal was sent."""
    hold = tmp_path / "hold"
    hold.mkdir()
    ready, release = tmp_path / "ready", tmp_path / "release"
    os.mkfifo(ready)
    os.mkfifo(release)
    (hold / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, select, sys
        if sys.argv[:1] == ["-c"] and os.environ.get("CHECKRUN_TEST_READY"):  # the writer process only
            fd = os.open(os.environ["CHECKRUN_TEST_RELEASE"], os.O_RDONLY | os.O_NONBLOCK)
            with open(os.environ["CHECKRUN_TEST_READY"], "w") as f:  # until the test opens it for reading
                f.write("started")
            while not (select.select([fd], [], [])[0] and os.read(fd, 2)):  # until the test writes to it
                pass
            os.close(fd)
    """))
    trainer = tmp_path / "trainer.py"
    trainer.write_text(textwrap.dedent(f"""
        import threading, torch, ckpt_core
        engine = ckpt_core.CheckpointEngine({{"saving": {{"background": "process"}}}})
        engine.save({{"w": torch.arange(1000.0)}}, {str(tmp_path / "0.ckpt")!r})
        threading.Event().wait()  # training goes on until the signal's handler ends the process
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hold), *filter(None, [os.environ.get("PYTHONPATH")])]),
               CHECKRUN_TEST_READY=str(ready), CHECKRUN_TEST_RELEASE=str(release))
    proc = subprocess.Popen([sys.executable, str(trainer)], env=env, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        with open(ready) as f:  # the writer process runs (before the trainer can have been signalled)
            assert f.read() == "started"
        os.killpg(proc.pid, getattr(signal, sig))
        try:
            fd = os.open(release, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # no reader: the writer process is gone
            assert exc.errno == errno.ENXIO
        else:
            os.write(fd, b"go")
            os.close(fd)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "writer process died" not in err, err
    assert torch.equal(CheckpointEngine().load(tmp_path / "0.ckpt")["w"], torch.arange(1000.0)), err


def test_background_is_validated() -> None:
    with pytest.raises(ConfigError, match="saving.background"):
        EngineConfig.from_dict({"saving": {"background": "fork"}})


def test_the_writer_process_starts_while_no_fork_can_happen(tmp_path, monkeypatch):
    """h125: the writer process is started by the first save's background thread; a DataLoader worker
    forked by the training thread meanwhile inherited the write end of ``Popen``'s exec-error pipe, so
    ``Popen`` waited until that worker ended, and the worker waited for the training thread, which waited
    for the save: a resumed 2-rank run with ``num_workers=2`` hung for good. ``Popen`` runs inside
    ``forksafe.churn()`` now: ``os.fork`` waits until it returned."""
    from ckpt_core import forksafe

    held, real = [], subprocess.Popen

    def popen(*args, **kwargs):
        held.append(forksafe._churn.locked())
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    with CheckpointEngine({"saving": {"background": "process"}}) as engine:
        engine.save({"w": torch.ones(4)}, tmp_path / "a.ckpt").result()
    assert held == [True]
