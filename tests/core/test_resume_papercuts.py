"""Resume papercuts (issue 19.9, core part): loading a directory or None says what is wrong."""
from __future__ import annotations

import threading

import pytest
import torch

import ckpt_core
from ckpt_core import CheckpointNotFoundError
from ckpt_core.saving import inflight
from ckpt_core.testing.faults import FaultFS as FaultyFS


def test_load_of_a_directory_names_its_newest_checkpoint(tmp_path) -> None:
    with ckpt_core.CheckpointEngine() as engine:
        for step in (1, 2):
            engine.save({"w": torch.full((3,), float(step))}, tmp_path / f"step={step}.ckpt")
        engine.wait()
        with pytest.raises(CheckpointNotFoundError) as info:
            engine.load(tmp_path)
    message = str(info.value)
    assert "directory of 2 checkpoint(s)" in message and f"{tmp_path}/step=2.ckpt" in message


def test_load_of_an_empty_directory_says_so(tmp_path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="directory that holds no committed checkpoint"):
        ckpt_core.load(tmp_path)


def test_load_of_latest_in_an_empty_directory_is_not_a_type_error(tmp_path) -> None:
    with ckpt_core.CheckpointEngine() as engine:
        latest = engine.latest(tmp_path)
        assert latest is None
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint path given"):
            engine.load(latest)
    with pytest.raises(CheckpointNotFoundError):
        ckpt_core.load(None)


def test_save_then_load_by_another_engine_waits_for_the_commit(tmp_path) -> None:
    """A load of a path with a save in flight in another engine of this process gets that save."""
    FaultyFS.reset()
    FaultyFS.gate = threading.Event()
    path = f"gatefile://{tmp_path}/a.ckpt"
    try:
        writer = ckpt_core.CheckpointEngine()
        handle = writer.save({"w": torch.arange(10.0)}, path)
        FaultyFS.entered.acquire()  # the save is inside a storage write
        assert ckpt_core.save_in_flight(path)
        opener = threading.Thread(target=_open_when_waited_for, args=(FaultyFS.gate,))
        opener.start()
        state = ckpt_core.load(path)  # another engine: blocks until the save commits
        opener.join()
        assert state["w"].equal(torch.arange(10.0))
        assert not ckpt_core.save_in_flight(path)
        writer.close()
    finally:
        FaultyFS.gate.set()
        FaultyFS.reset()


def _open_when_waited_for(gate: threading.Event) -> None:
    """Open the storage gate once a thread waits in the in-flight registry (polls its state; bounded)."""
    for _ in range(1_000_000):
        with inflight._cond:
            if inflight._cond._waiters:
                break
        threading.Event().wait(0.0005)
    gate.set()


@pytest.mark.parametrize("spelling", ["dot", "dotdot", "symlink", "double slash"])
def test_a_save_in_flight_is_seen_under_every_spelling_of_its_path(tmp_path, spelling) -> None:
    """``run/./a.ckpt``, ``run/sub/../a.ckpt``, a symlinked directory: one file, one save in flight
    (before, a load under another spelling did not wait and found no checkpoint)."""
    import os

    (tmp_path / "run" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "run", tmp_path / "link")
    saved = str(tmp_path / "run" / "a.ckpt")
    other = {"dot": f"{tmp_path}/run/./a.ckpt", "dotdot": f"{tmp_path}/run/sub/../a.ckpt",
             "symlink": f"{tmp_path}/link/a.ckpt", "double slash": f"{tmp_path}/run//a.ckpt"}[spelling]
    inflight.begin(saved)
    try:
        assert inflight.pending(other) and not inflight.wait(other, timeout=0)
        assert not inflight.wait_under(os.path.dirname(other) + "/", timeout=0)
        assert ckpt_core.save_in_flight(other)
    finally:
        inflight.end(saved)
    assert not inflight.pending(other) and inflight.wait(other, timeout=0)


def test_a_save_to_a_symlink_that_moves_meanwhile_ends_where_it_began(tmp_path) -> None:
    """Lightning's ``save_last="link"``: ``last.ckpt`` is a symlink that is replaced while saves run.
    A save registered under ``last.ckpt`` ends under the same key (before the fix that resolved the
    file itself, the registry kept a save in flight forever and a step log's close hung)."""
    import os

    (tmp_path / "a.ckpt").write_text("a")
    (tmp_path / "b.ckpt").write_text("b")
    last = tmp_path / "last.ckpt"
    os.symlink(tmp_path / "a.ckpt", last)
    inflight.begin(str(last))
    assert inflight.pending(str(last)) and not inflight.pending(str(tmp_path / "a.ckpt"))
    last.unlink()
    os.symlink(tmp_path / "b.ckpt", last)
    inflight.end(str(last))
    assert not inflight.pending(str(last))
    assert inflight.wait_under(f"{tmp_path}/", timeout=0)
