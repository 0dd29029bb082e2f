"""An idle engine holds no thread (issue 19, point 5): the coordinator and its workers end once the
queue is empty, the snapshot's copy helper after each snapshot, the storage pools when nothing uses
them. ``wait()`` returns once they have ended; the engine stays usable (and incremental)."""
from __future__ import annotations

import subprocess
import sys
import threading

import torch

from ckpt_core import CheckpointEngine, StorageConfig
from ckpt_core.storage.store import Store


def checkrun_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("checkrun"))


def state(step: int) -> dict:
    # > 1 MiB (the copy helper splits it) and several chunks (the storage pool checks reused blobs)
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(512, 1024, generator=g), "small": torch.full((8,), float(step)), "step": step}


def test_async_engine_ends_its_threads_when_idle_and_stays_usable(tmp_path) -> None:
    assert checkrun_threads() == []
    engine = CheckpointEngine({"saving": {"workers": 2}, "compression": {"chunk_bytes": 1 << 18}})
    try:
        for step in range(3):
            engine.save(state(step), tmp_path / f"s{step}.ckpt")
        engine.wait()
        assert checkrun_threads() == []
        info = engine.save(state(3), tmp_path / "s3.ckpt").result()
        assert info.reused_blobs > 0  # the engine kept what it knew: unchanged chunks are not written again
        assert engine.load(tmp_path / "s1.ckpt")["step"] == 1
        engine.wait()
        assert checkrun_threads() == []
    finally:
        engine.close()
    assert checkrun_threads() == []


def test_sync_engine_holds_no_thread_after_a_save_or_a_load(tmp_path) -> None:
    with CheckpointEngine({"saving": {"asynchronous": False}, "compression": {"chunk_bytes": 1 << 18}}) as engine:
        for step in range(3):
            engine.save(state(step), tmp_path / f"s{step}.ckpt")
            assert checkrun_threads() == []
        assert torch.equal(engine.load(tmp_path / "s0.ckpt")["big"], state(0)["big"])
        assert checkrun_threads() == []
        # a collection (Lightning's removal of a .temp.ckpt runs one) left the store's io threads for good
        engine.remove(tmp_path / "s0.ckpt")
        assert engine.gc(tmp_path).deleted and checkrun_threads() == []


def test_release_idle_keeps_a_pool_in_use(tmp_path) -> None:
    store = Store.for_directory(str(tmp_path), None, StorageConfig(io_threads=2))

    def work(i: int) -> int:
        store.release_idle()  # called while this map uses the pool: a no-op
        return i * i

    assert store.map(work, range(6)) == [i * i for i in range(6)]
    assert any(n.startswith("checkrun-io") for n in checkrun_threads())
    store.release_idle()
    assert store._pool is None and checkrun_threads() == []
    assert store.map(work, range(3)) == [0, 1, 4]  # a new pool
    store.close()
    assert checkrun_threads() == []


_DROPPED_AFTER_LOAD = r"""
import sys, threading
def check():  # threading's exit hooks run last-registered first: this one after checkrun's
    alive = [t.name for t in threading.enumerate() if t.name == "checkrun-reference" and t.is_alive()]
    print("ALIVE" if alive else "ENDED", flush=True)
threading._register_atexit(check)
import torch, ckpt_core
from ckpt_core.loading import references
real = references.load_references
def held(store, manifest, where, indices, alloc, limit, stop):
    stop.wait()  # the rebuild is still running when the script ends
    return real(store, manifest, where, indices, alloc, limit, stop)
references.load_references = held
emb = torch.zeros(200_000, 8)
with ckpt_core.CheckpointEngine() as engine:
    for step in range(1, 4):
        emb[step * 10:(step + 1) * 10] += 1  # a few rows change: row-delta saves (references rebuilt after a load)
        engine.save({"emb": emb, "step": step}, f"{sys.argv[1]}/step={step}.ckpt")
print("loaded", ckpt_core.CheckpointEngine().load(f"{sys.argv[1]}/step=3.ckpt")["step"], flush=True)
"""


def test_a_load_through_an_engine_dropped_at_once_ends_its_reference_rebuild_before_exit(tmp_path) -> None:
    """h165: ``CheckpointEngine().load(p)`` in an evaluation script (the engine never kept) left the load's
    reference rebuild (``load.reference: auto``) running into interpreter shutdown: exit status 134,
    "terminate called without an active exception", 6 runs of 6. At exit it is stopped and joined."""
    script = tmp_path / "eval.py"
    script.write_text(_DROPPED_AFTER_LOAD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["loaded", "3", "ENDED"], (out.stdout, out.stderr)


_LOAD_AT_EXIT = r"""
import atexit, sys, torch, ckpt_core
state = {f"t{i}": torch.randn(2_000_000, generator=torch.Generator().manual_seed(i)) for i in range(4)}
ckpt_core.save(state, f"{sys.argv[1]}/a.ckpt")  # blobs of several MB: read on the I/O pool
def final_eval():
    got = ckpt_core.CheckpointEngine().load(f"{sys.argv[1]}/a.ckpt")
    print("loaded", sum(torch.equal(got[k], state[k]) for k in state), flush=True)
atexit.register(final_eval)
"""


def test_a_load_in_the_scripts_own_atexit_handler_reads_its_blobs(tmp_path) -> None:
    """h167: a final evaluation in an ``atexit`` handler loading a checkpoint of several blobs failed with
    "cannot schedule new futures after interpreter shutdown" (the I/O pool, released after each load, could
    not start again), exit status 0. The blobs are read on the calling thread once the exit has begun."""
    script = tmp_path / "final_eval.py"
    script.write_text(_LOAD_AT_EXIT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["loaded", "4"], (out.stdout, out.stderr)
