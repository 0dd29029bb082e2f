"""Staging memory stays bounded: the buffer pool keeps within the staging budget whatever sizes it
has seen (least recently used free buffers are freed, in shared memory too, where the writer
process unmaps them), and staging directories of dead processes are removed at the next start.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig

BUDGET = 4 << 20
SAVES = 30


def config(background: str, budget: int | None) -> EngineConfig:
    return EngineConfig.from_dict({
        "saving": {"background": background, "staging_budget_bytes": budget, "sigterm_grace_seconds": None},
        "incremental": {"enabled": False},  # no row streams: every tensor is staged in the pool
        "storage": {"fsync": False},
    })


def changing_state(i: int) -> dict:
    """Two tensors whose sizes change at every save (multiples of a page), 0.5-3.5 MiB in all."""
    a = 1024 * (16 + (i * 37) % 96)   # float32: 64 KiB .. 448 KiB steps
    b = 1024 * (48 + (i * 53) % 320)  # float32: 192 KiB .. 1.5 MiB
    return {"a": torch.full((a,), float(i)), "b": torch.arange(b, dtype=torch.float32), "step": i}


def _shm_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n.endswith(".buf"))


def _mapped_bytes(pid: int, directory: str) -> int:
    """Bytes of staging files the writer process has mapped (deleted files included)."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if directory in line:
                start, end = line.split()[0].split("-")
                total += int(end, 16) - int(start, 16)
    return total


def _settled_mapped_bytes(pid: int, directory: str, ok) -> int:
    """``_mapped_bytes`` once ``ok`` holds for it. The writer process unmaps a buffer when the engine's
    notice reaches it, which the engine sends when its pool frees the buffer (after a save's commit)
    without waiting for it: so it is looked at until it holds; the watchdog only bounds a bug."""
    deadline = time.monotonic() + 60
    while True:
        got = _mapped_bytes(pid, directory)
        if ok(got) or time.monotonic() > deadline:
            return got
        os.sched_yield()


@pytest.mark.parametrize("background", ["thread", "process"])
def test_pool_stays_within_the_staging_budget(tmp_path, background):
    with CheckpointEngine(config(background, BUDGET)) as engine:
        for i in range(SAVES):
            engine.save(changing_state(i), tmp_path / f"c{i}.ckpt").result()
            pool = engine.staging
            assert pool.allocated_bytes <= BUDGET, f"save {i}: the pool holds {pool.allocated_bytes}"
            if background == "process":
                shared = engine._process.shared.directory
                assert _shm_bytes(shared) <= BUDGET, f"save {i}"
                assert _settled_mapped_bytes(engine._process._proc.pid, shared, lambda n: n <= BUDGET) <= BUDGET, \
                    f"save {i}"
        assert engine.staging.peak_bytes <= BUDGET
        assert engine.staging.allocations > 2  # sizes changed: buffers were freed and made
        state = engine.load(tmp_path / f"c{SAVES - 1}.ckpt")
        assert all(torch.equal(state[k], changing_state(SAVES - 1)[k]) for k in ("a", "b"))


def test_pool_without_a_budget_keeps_at_most_the_largest_snapshot(tmp_path):
    with CheckpointEngine(config("thread", None)) as engine:
        for i in range(SAVES):
            engine.save(changing_state(i), tmp_path / f"c{i}.ckpt").result()
            largest = engine._budget.peak  # max_pending 1: the largest snapshot staged so far
            assert engine.staging.allocated_bytes <= largest, f"save {i}"
        assert engine.staging.peak_bytes <= engine._budget.peak


def test_row_stream_buffers_of_changed_sizes_are_released_in_shared_memory(tmp_path):
    """A row stream (a large 2-D tensor, saved incrementally) owns a buffer outside the pool; when
    its tensor changes size the old one goes, in ``/dev/shm`` and in the writer process."""
    cfg = config("process", BUDGET).replace(**{"incremental.enabled": True})
    with CheckpointEngine(cfg) as engine:
        for i in range(10):
            emb = torch.randn(1024 + 256 * (i % 5), 64)
            engine.save({"emb": emb}, tmp_path / f"c{i}.ckpt").result()
            shared = engine._process.shared.directory
            assert _shm_bytes(shared) == emb.nbytes, f"save {i}"
            mapped = _settled_mapped_bytes(engine._process._proc.pid, shared, lambda n: n == emb.nbytes)
            assert mapped == emb.nbytes, f"save {i}"
        assert torch.equal(engine.load(tmp_path / "c9.ckpt")["emb"], emb)


def test_pool_reuses_buffers_of_unchanged_sizes(tmp_path):
    state = changing_state(0)
    with CheckpointEngine(config("thread", BUDGET)) as engine:
        for i in range(5):
            engine.save(state, tmp_path / f"c{i}.ckpt").result()
        assert engine.staging.allocations == 2


# ------------------------------------------------------------------------- stale /dev/shm dirs
_OWNER = """
import sys, torch
from ckpt_core.saving.shm_staging import SharedBuffers
s = SharedBuffers()
s.allocate(1024, torch.float32)
for pid in sys.argv[1:]:
    s.add_owner(int(pid))
print(s.directory, flush=True)
sys.stdin.read()
s.close()
"""


def _owner(*extra_owners: int) -> tuple[subprocess.Popen, str]:
    """A process with a staging directory (and more owner pids); it lives until its stdin closes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, *map(str, extra_owners)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    directory = proc.stdout.readline().strip()
    assert os.path.isdir(directory), directory
    return proc, directory


def _killed(proc: subprocess.Popen) -> None:
    proc.kill()  # SIGKILL: nothing of it runs any more, its directory stays behind
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/shm and pids: Linux")
def test_stale_staging_directories_of_dead_owners_are_removed_at_the_next_start(tmp_path):
    dead, dead_dir = _owner()
    _killed(dead)
    live, live_dir = _owner()
    helper, _ = _owner()  # a live writer process of a dead trainer: both are owners
    orphaned, orphaned_dir = _owner(helper.pid)
    _killed(orphaned)
    try:
        with CheckpointEngine(config("process", None)):
            assert not os.path.exists(dead_dir)
            assert os.path.isdir(live_dir) and os.path.isdir(orphaned_dir)
        _killed(helper)
        with CheckpointEngine(config("process", None)):
            assert not os.path.exists(orphaned_dir) and os.path.isdir(live_dir)
    finally:
        for proc in (live, helper):
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait()
                proc.stdout.close()
    assert not os.path.exists(live_dir)  # it closed normally: it removed its own directory
