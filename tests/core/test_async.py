"""Asynchronous saving: snapshot consistency, backpressure, error surfacing, ordering, flush, kill."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from ckpt_core import BackgroundSaveError, CheckpointEngine, EngineConfig
from ckpt_core.errors import CheckpointNotFoundError

from ckpt_core.testing.faults import FaultFS as FaultyFS


@pytest.fixture(autouse=True)
def _reset_faults():
    FaultyFS.reset()
    yield
    if FaultyFS.gate is not None:
        FaultyFS.gate.set()
    FaultyFS.reset()


def _gated(tmp_path):
    FaultyFS.gate = threading.Event()
    return f"gatefile://{tmp_path}"


def test_snapshot_is_consistent_under_inplace_optimizer_steps(tmp_path):
    root = _gated(tmp_path)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state_dict()["state"][0]["exp_avg"].clone()
    with CheckpointEngine() as engine:
        handle = engine.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{root}/a.ckpt")
        for _ in range(3):  # mutate in place while the write is held at the gate
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
        model.weight.data.zero_()
        assert not handle.done()
        FaultyFS.gate.set()
        handle.result()
        loaded = engine.load(f"{root}/a.ckpt")
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v)
    assert torch.equal(loaded["opt"]["state"][0]["exp_avg"], exp_avg)


def test_backpressure_keeps_at_most_max_pending_snapshots(tmp_path):
    root = _gated(tmp_path)
    cfg = EngineConfig.from_dict({"saving": {"max_pending": 1}, "incremental": {"enabled": False}})
    engine = CheckpointEngine(cfg)
    state = {"w": torch.randn(256, 256)}
    engine.save(state, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()  # the first save is inside storage, held by the gate
    second_returned = threading.Event()

    def second():
        state["w"].add_(1.0)  # new values: the same ones would repeat the save in flight (no wait)
        engine.save(state, f"{root}/b.ckpt")
        second_returned.set()

    t = threading.Thread(target=second)
    t.start()
    assert not second_returned.wait(0.2)  # blocked by backpressure, not queued
    assert engine.staging.allocations == 1
    FaultyFS.gate.set()
    t.join()
    engine.wait()
    for i in range(3):
        engine.save(state, f"{root}/c{i}.ckpt").result()
    assert engine.staging.allocations == 1  # the staging buffer is reused once warm
    engine.close()


def test_staging_budget_blocks_second_save(tmp_path):
    root = _gated(tmp_path)
    state = {"w": torch.randn(128, 128)}
    cfg = EngineConfig.from_dict({"saving": {"max_pending": 4, "staging_budget_bytes": state["w"].nbytes}})
    engine = CheckpointEngine(cfg)
    engine.save(state, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()
    done = threading.Event()
    changed = {"w": state["w"] + 1}  # the same values would repeat the save in flight (no staging)
    t = threading.Thread(target=lambda: (engine.save(changed, f"{root}/b.ckpt"), done.set()))
    t.start()
    assert not done.wait(0.2)
    assert engine._budget.in_use == state["w"].nbytes
    FaultyFS.gate.set()
    t.join()
    engine.close()
    assert engine._budget.peak == state["w"].nbytes


def test_background_error_surfaces_once_with_cause(tmp_path):
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    FaultyFS.fail_match = ".checkrun"
    engine = CheckpointEngine()
    h = engine.save({"w": torch.randn(10, 10)}, f"{root}/a.ckpt")
    h.wait()
    with pytest.raises(BackgroundSaveError) as info:
        engine.save({"w": torch.randn(10, 10)}, f"{root}/b.ckpt")
    assert isinstance(info.value.__cause__, Exception)
    assert "No space left" in str(info.value)
    FaultyFS.fail_writes = None
    engine.save({"w": torch.ones(2)}, f"{root}/c.ckpt")
    engine.wait()  # the first error is not raised again
    assert not (tmp_path / "a.ckpt").exists()
    with pytest.raises(CheckpointNotFoundError):
        engine.load(f"{root}/a.ckpt")
    engine.close()


def test_a_save_that_fails_while_the_next_waits_for_its_slot_is_raised_by_that_next_save(tmp_path):
    """The error check ran before the wait for a slot: a save that failed during that wait was raised one
    save later (a Fabric user's second save returned as if all was well; found by an independent check)."""
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    FaultyFS.gate = threading.Event()
    engine = CheckpointEngine()  # saving.max_pending 1: the second save waits for the first
    engine.save({"w": torch.randn(10, 10)}, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()  # the first save's write waits at the gate: no error yet
    acquire = engine._coord.acquire_slot

    def acquire_after_the_gate_opens():
        FaultyFS.gate.set()  # the first save fails while the second waits for its slot
        acquire()

    engine._coord.acquire_slot = acquire_after_the_gate_opens
    with pytest.raises(BackgroundSaveError, match="No space left"):
        engine.save({"w": torch.randn(10, 10)}, f"{root}/b.ckpt")
    FaultyFS.fail_writes = None
    engine.save({"w": torch.ones(2)}, f"{root}/c.ckpt")
    engine.close()
    assert torch.equal(ckpt_core_load(tmp_path / "c.ckpt")["w"], torch.ones(2))


def test_a_save_that_fails_while_the_next_waits_for_it_to_finish_is_raised_by_that_next_save(tmp_path):
    """With ``saving.max_pending`` 2 and a row-stream tensor, the second save to a directory waits for the
    first to finish (not for a slot), after the error check: the first one's failure meanwhile came a
    call later (found by an independent check)."""
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    FaultyFS.gate = threading.Event()
    engine = CheckpointEngine({"saving": {"max_pending": 2}})
    state = {"emb": torch.randn(4096, 16)}  # rows: a row stream, whose buffer the next save must wait for
    engine.save(state, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()  # the first save's write waits at the gate: no error yet
    dirstate = engine._dirstate(engine._dir_store(root, None))
    wait = dirstate.last.wait

    def wait_after_the_gate_opens(*args, **kwargs):
        FaultyFS.gate.set()  # the first save fails while the second waits for it
        return wait(*args, **kwargs)

    dirstate.last.wait = wait_after_the_gate_opens
    state["emb"][0] += 1
    with pytest.raises(BackgroundSaveError, match="a.ckpt failed: .*No space left"):
        engine.save(state, f"{root}/b.ckpt")
    FaultyFS.fail_writes = None
    engine.save({"w": torch.ones(2)}, f"{root}/c.ckpt")
    engine.close()
    assert torch.equal(ckpt_core_load(tmp_path / "c.ckpt")["w"], torch.ones(2))


def test_every_failed_save_is_raised_by_the_next_call(tmp_path):
    """With ``saving.max_pending`` 3, three saves failed: the next call raised the first one's error and the
    other two were dropped (logged only; found by an independent check). One error names them all (raised one
    per call, a loop that catches and goes on lost a save per queued error: found by the next check)."""
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    FaultyFS.gate = threading.Event()  # all three are submitted before any fails
    engine = CheckpointEngine({"saving": {"max_pending": 3}})
    handles = [engine.save({"w": torch.randn(10)}, f"{root}/s{i}.ckpt") for i in range(3)]
    FaultyFS.gate.set()
    for h in handles:
        h.wait()
    FaultyFS.fail_writes = None
    with pytest.raises(BackgroundSaveError, match="s0.ckpt failed.*s1.ckpt failed too.*s2.ckpt failed too"):
        engine.save({"w": torch.ones(2)}, f"{root}/ok.ckpt")
    engine.save({"w": torch.ones(2)}, f"{root}/ok.ckpt")  # the next save goes through
    engine.close()
    assert torch.equal(ckpt_core_load(tmp_path / "ok.ckpt")["w"], torch.ones(2))


def test_error_at_wait_and_close_not_masking_user_exception(tmp_path):
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.EIO, "injected I/O error")
    engine = CheckpointEngine()
    engine.save({"w": torch.randn(3)}, f"{root}/a.ckpt")
    with pytest.raises(BackgroundSaveError):
        engine.wait()
    engine.wait()  # surfaced exactly once
    engine.save({"w": torch.randn(3)}, f"{root}/b.ckpt")
    with pytest.raises(KeyError):
        with engine:
            raise KeyError("user error")  # the background error is logged, not raised over this


def test_a_background_error_is_raised_inside_an_except_block_too(tmp_path):
    """Retry code (``except OSError: train_again()``): the next wait/save inside the handler logged a
    failed save and dropped it for good (found by an independent check). It is raised, chained to the
    exception being handled."""
    root = f"gatefile://{tmp_path}"
    FaultyFS.fail_writes = OSError(errno.EIO, "injected I/O error")
    engine = CheckpointEngine()
    try:
        raise KeyError("an earlier attempt failed")
    except KeyError as handled:
        engine.save({"w": torch.randn(3)}, f"{root}/a.ckpt")
        with pytest.raises(BackgroundSaveError, match="injected I/O error") as info:
            engine.wait()
        assert info.value.__context__ is handled
    FaultyFS.fail_writes = None
    engine.close()


def test_load_and_remove_wait_for_pending_save_to_path(tmp_path):
    root = _gated(tmp_path)
    engine = CheckpointEngine({"saving": {"max_pending": 3}})
    engine.save({"w": torch.full((4,), 1.0)}, f"{root}/a.ckpt")
    FaultyFS.entered.acquire()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("w", engine.load(f"{root}/a.ckpt")["w"]))
    t.start()
    assert not result
    FaultyFS.gate.set()
    t.join()
    assert torch.equal(result["w"], torch.ones(4))
    FaultyFS.gate = threading.Event()
    engine.save({"w": torch.full((4,), 2.0)}, f"{root}/a.ckpt")
    engine.save({"w": torch.full((4,), 3.0)}, f"{root}/a.ckpt")
    FaultyFS.gate.set()
    assert torch.equal(engine.load(f"{root}/a.ckpt")["w"], torch.full((4,), 3.0))  # in order
    engine.remove(f"{root}/a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    engine.close()


def _run_script(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_atexit_flushes_forgotten_engine(tmp_path):
    p = _run_script("""
        import sys, torch, ckpt_core
        e = ckpt_core.CheckpointEngine()
        e.save({"w": torch.arange(1000)}, sys.argv[1] + "/x.ckpt")
        # no wait(), no close(): the atexit hook must commit it
    """, str(tmp_path))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert torch.equal(ckpt_core_load(tmp_path / "x.ckpt")["w"], torch.arange(1000))


@pytest.mark.parametrize("background", ["thread", "process"])
def test_atexit_flushes_an_engine_only_a_returned_function_held(tmp_path, background):
    """The engine was a local of a function that returned with its saves in flight (``def train(): ...``
    without ``close()``): it was collected, the exit hook found no engine, and every save was lost,
    silently (found by a check of process models). A queued save now keeps its engine alive."""
    p = _run_script("""
        import sys, torch, ckpt_core
        def train(root, background):
            engine = ckpt_core.CheckpointEngine({"saving": {"background": background, "max_pending": 3}})
            for step in range(3):
                engine.save({"w": torch.full((4_000_000,), float(step))}, f"{root}/step={step}.ckpt")
        train(sys.argv[1], sys.argv[2])
    """, str(tmp_path), background)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    for step in range(3):
        assert torch.equal(ckpt_core_load(tmp_path / f"step={step}.ckpt")["w"], torch.full((4_000_000,), float(step)))


def ckpt_core_load(path):
    import ckpt_core

    return ckpt_core.load(path)


def test_sigkill_during_slow_save_leaves_no_partial_checkpoint(tmp_path):
    code = """
        import sys, threading, torch, ckpt_core
        sys.path.insert(0, sys.argv[2])
        from ckpt_core.testing.faults import FaultFS as FaultyFS
        root = "gatefile://" + sys.argv[1]
        e = ckpt_core.CheckpointEngine()
        e.save({"w": torch.ones(100)}, root + "/good.ckpt").result()
        FaultyFS.gate = threading.Event()   # never opened: the save hangs inside storage
        e.save({"w": torch.zeros(1000, 1000)}, root + "/torn.ckpt")
        FaultyFS.entered.acquire()
        print("inside", flush=True)
        threading.Event().wait()
    """
    p = _run_script(code, str(tmp_path), os.getcwd())
    assert p.stdout.readline().strip() == "inside"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    with CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("good.ckpt")
        assert [e.name for e in engine.list(tmp_path)] == ["good.ckpt"]
        assert not (tmp_path / "torn.ckpt").exists()


def test_sigterm_grace_commits_pending_save(tmp_path):
    code = """
        import os, signal, sys, threading, torch, ckpt_core
        sys.path.insert(0, sys.argv[2])
        from ckpt_core.testing.faults import FaultFS as FaultyFS
        root = "gatefile://" + sys.argv[1]
        e = ckpt_core.CheckpointEngine({"saving": {"sigterm_grace_seconds": 60}})
        FaultyFS.gate = threading.Event()
        e.save({"w": torch.arange(10)}, root + "/t.ckpt")
        FaultyFS.entered.acquire()
        threading.Timer(0, FaultyFS.gate.set).start()
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached", flush=True)
    """
    p = _run_script(code, str(tmp_path), os.getcwd())
    out, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err
    assert "not reached" not in out
    assert torch.equal(ckpt_core_load(tmp_path / "t.ckpt")["w"], torch.arange(10))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_background_threads_are_nicer_than_the_training_thread(tmp_path):
    def nice(native_id: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, native_id)

    base = nice(threading.get_native_id())
    ours: list = []
    with CheckpointEngine({"saving": {"thread_nice": 5, "workers": 2}}) as engine:
        # Observed from a save callback: the coordinator and its workers end once the engine is idle.
        engine.add_callback(lambda info: ours.extend(
            (t.name, nice(t.native_id)) for t in threading.enumerate()
            if t.name.startswith(("checkrun-worker", "checkrun-coordinator")) and t.native_id))
        engine.save({"w": torch.randn(256, 1024)}, tmp_path / "a.ckpt",).result()
        assert {name.split("_")[0].split(" (")[0] for name, _ in ours} == {"checkrun-worker", "checkrun-coordinator"}
        assert all(value == min(19, base + 5) for _, value in ours)
    assert nice(threading.get_native_id()) == base  # the caller's thread is untouched
