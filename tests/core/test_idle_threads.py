"""An idle engine holds no thread (issue 19, point 5): the coordinator and its workers end once the
queue is empty, the snapshot's copy helper after each snapshot, the storage pools when nothing uses
them. ``wait()`` returns once they have ended; the engine stays usable (and incremental)."""
from __future__ import annotations

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
