"""A fork never races checkrun's threads starting or ending (core/forksafe.py).

CPython 3.11 can deadlock a child forked while another thread starts or ends; DataLoader workers
fork every epoch while saves run in the background (a 2-rank ``accelerate launch`` hung in CI).
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt_core
from ckpt_core import forksafe
from ckpt_core.storage.pool import IOPool

pytestmark = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.fork")


def test_started_executor_has_every_thread_running_so_a_later_submit_starts_none() -> None:
    pool = forksafe.started_executor(3, "checkrun-test")
    try:
        assert len(pool._threads) == 3 and all(t.is_alive() for t in pool._threads)
        before = set(threading.enumerate())
        gate = threading.Barrier(4)
        futures = [pool.submit(gate.wait) for _ in range(3)]  # all three busy at once
        gate.wait()
        assert [f.result() for f in futures] is not None
        assert set(threading.enumerate()) == before
    finally:
        forksafe.stop_executor(pool)
    assert not any(t.is_alive() for t in pool._threads)


def test_a_thread_that_cannot_start_stops_the_started_ones_at_once(monkeypatch) -> None:
    """h144: under a process limit (``ulimit -u``) the second thread of a pool failed to start; the first
    waited at the start barrier for FORK_WAIT_SECONDS (30 s) and the process as long at exit."""
    from concurrent.futures import ThreadPoolExecutor

    real, calls = ThreadPoolExecutor._adjust_thread_count, []

    def adjust(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(ThreadPoolExecutor, "_adjust_thread_count", adjust)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        forksafe.started_executor(3, "checkrun-nproc-test")
    assert not [t for t in threading.enumerate() if t.name.startswith("checkrun-nproc-test")]


def test_io_pool_threads_all_start_with_its_first_map() -> None:
    pool = IOPool(4)
    try:
        assert pool.map(lambda x: x * 2, range(8)) == list(range(0, 16, 2))
        assert len(pool.executor._threads) == 4
    finally:
        pool.close()


def _fork_and_report(seen: dict) -> int:
    """Fork; the child exits with 1 if it saw ``seen["released"]`` set, else 0. Returns that code."""
    pid = os.fork()
    if pid == 0:
        os._exit(1 if seen["released"] else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_waits_until_a_thread_ends_its_churn_section() -> None:
    seen = {"released": False}
    holding, release, fork_started = threading.Event(), threading.Event(), threading.Event()

    def background() -> None:
        with forksafe.churn():
            holding.set()
            release.wait()
            seen["released"] = True  # still inside the section: a fork that waited sees it

    def mark() -> None:
        fork_started.set()

    t = threading.Thread(target=background)
    t.start()
    holding.wait()
    # registered after forksafe's hook, so it runs before it (os.fork runs "before" hooks in reverse)
    os.register_at_fork(before=lambda: mark() if threading.current_thread().name == "forker" else None)
    result: list[int] = []
    forker = threading.Thread(target=lambda: result.append(_fork_and_report(seen)), name="forker")
    forker.start()
    fork_started.wait()  # the fork has begun: its wait for the section holds it there
    release.set()
    forker.join()
    t.join()
    assert result == [1], "the child was forked while the background thread was still in its churn section"


def test_a_fork_inside_a_churn_section_does_not_wait_for_itself() -> None:
    with forksafe.churn():
        assert _fork_and_report({"released": True}) == 1


def test_a_synchronous_engine_saving_from_a_background_thread_leaves_no_thread_behind(tmp_path) -> None:
    """The Accelerate index committer's pattern: a synchronous engine used from a helper thread
    starts its workers inside a section and ends them inside one; afterwards none is left."""
    engine = ckpt_core.CheckpointEngine(ckpt_core.EngineConfig().replace(**{"saving.asynchronous": False}))
    before = {t.name for t in threading.enumerate()}
    errors: list[BaseException] = []

    def save() -> None:
        try:
            for i in range(3):
                engine.save({"x": torch.arange(1000.0) + i}, str(tmp_path / f"c{i}.ckpt")).result()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=save)
    t.start()
    t.join()
    engine.close()
    assert not errors
    left = {t.name for t in threading.enumerate()} - before
    assert not any(name.startswith("checkrun") for name in left), left
    assert torch.equal(ckpt_core.load(str(tmp_path / "c2.ckpt"))["x"], torch.arange(1000.0) + 2)


@pytest.mark.parametrize("which", ["workers", "coordinator"])
def test_a_save_whose_threads_cannot_start_fails_and_the_engine_goes_on(tmp_path, which) -> None:
    """h146: a save whose threads could not start (a process limit) raised, but kept its slot and its place in
    flight: the next save, ``close()`` and the interpreter's exit waited for ever, even once the limit was
    lifted; a coordinator thread that failed to start left its workers and was taken as started."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import threading, torch, ckpt_core
        from concurrent.futures import ThreadPoolExecutor
        real_adjust, real_start = ThreadPoolExecutor._adjust_thread_count, threading.Thread.start
        def adjust(self):
            if "checkrun-worker" in self._thread_name_prefix:
                raise RuntimeError("can't start new thread")
            return real_adjust(self)
        def start(self):
            if self.name == "checkrun-coordinator":
                raise RuntimeError("can't start new thread")
            return real_start(self)
        if {which!r} == "workers":
            ThreadPoolExecutor._adjust_thread_count = adjust
        else:
            threading.Thread.start = start
        engine = ckpt_core.CheckpointEngine()
        try:
            engine.save({{"w": torch.ones(100)}}, {str(tmp_path / "a.ckpt")!r})
        except RuntimeError as exc:
            print("first:", exc)
        ThreadPoolExecutor._adjust_thread_count, threading.Thread.start = real_adjust, real_start
        assert not [t for t in threading.enumerate() if t.name.startswith("checkrun-worker")]
        engine.save({{"w": torch.full((100,), 2.0)}}, {str(tmp_path / "b.ckpt")!r}).result()
        print("latest:", engine.latest({str(tmp_path)!r}).rsplit("/", 1)[1])
        engine.save({{"w": torch.full((100,), 3.0)}}, {str(tmp_path / "c.ckpt")!r})
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:2] == ["first: can't start new thread", "latest: b.ckpt"], run.stdout
    assert not (tmp_path / "a.ckpt").exists() and (tmp_path / "c.ckpt").exists()
