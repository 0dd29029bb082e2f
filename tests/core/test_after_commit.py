"""One retention-after-commit for every save path (issue 22): ``retain.after_commit``.

* ordinary manifests: ``keep_last`` removes the oldest, never the one just committed, and what they
  alone referenced is collected at once;
* a directory's ``GcMemory`` carries candidates to the next commit (a blob a collection left, or one
  of a checkpoint ``remove`` deleted, goes at the next commit without listing the store);
* composite checkpoints (index + parts + folder, what accelerate_ckpt writes) are retained as a whole:
  the oldest beyond ``keep_last`` go with their parts, folders and blobs; protected ones stay.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.format import composite
from ckpt_core.retain import Memory, after_commit
from ckpt_core.retain.composites import Composites
from ckpt_core.saving.handles import SaveHandle, WriteStats
from ckpt_core.storage.store import Store


def config(**retention) -> EngineConfig:
    return EngineConfig.from_dict({"compression": {"chunk_bytes": 4096}, "retention": retention,
                                   "saving": {"asynchronous": False, "sigterm_grace_seconds": None},
                                   "storage": {"fsync": False}})


def state(seed: int) -> dict:
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)), "step": seed}


def blobs(store: Store) -> set[str]:
    return {b.key for b in store.list_blobs()}


def referenced(engine: CheckpointEngine, urls: list[str]) -> set[str]:
    return set().union(*(engine.read_manifest(u).blob_keys() for u in urls))


def test_keep_last_removes_the_oldest_and_collects_what_only_they_referenced(tmp_path: Path) -> None:
    cfg = config(keep_last=2)
    with CheckpointEngine(config()) as engine:  # no retention of its own: after_commit runs it below
        for i in range(4):
            engine.save(state(i), tmp_path / f"s{i}.ckpt")
    store = Store.for_directory(str(tmp_path), None, cfg.storage)
    after_commit(store, "s1.ckpt", cfg)  # as if s1 were just committed: it stays, whatever its age
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["s1.ckpt", "s2.ckpt", "s3.ckpt"]
    with CheckpointEngine(cfg) as engine:
        assert blobs(store) == referenced(engine, [str(tmp_path / f"s{i}.ckpt") for i in (1, 2, 3)])


def test_a_memory_carries_candidates_to_the_next_commit(tmp_path: Path) -> None:
    cfg = config()
    with CheckpointEngine(cfg) as engine:
        engine.save(state(0), tmp_path / "old.ckpt")
        old = engine.read_manifest(tmp_path / "old.ckpt")
        engine.save(state(1), tmp_path / "new.ckpt")
    store = Store.for_directory(str(tmp_path), None, cfg.storage)
    (tmp_path / "old.ckpt").unlink()  # removed behind the engine's back: only the memory knows its blobs
    memory = Memory(pending={b.key: b.size for b in old.blobs()})
    forgotten: list[str] = []
    after_commit(store, "new.ckpt", cfg, memory=memory, forget=forgotten.extend)
    with CheckpointEngine(cfg) as engine:
        assert blobs(store) == referenced(engine, [str(tmp_path / "new.ckpt")])
    gone = old.blob_keys() - blobs(store)
    assert gone and set(forgotten) == gone and memory.pending == {}


def _composite(engine: CheckpointEngine, root: Path, n: int) -> None:
    rel = f"{composite.PARTS_DIR}/checkpoint_{n}.run-{n}.rank0.ckpt"
    engine.save(state(n), root / rel)
    (root / f"checkpoint_{n}").mkdir()
    (root / f"checkpoint_{n}" / "hook.txt").write_text("written by a save hook")
    index = composite.make_index(f"checkpoint_{n}", [f"../{rel}"], {"step": n})
    engine.save(index, root / f"checkpoint_{n}" / composite.INDEX_NAME)


def test_composites_are_retained_whole_with_their_parts_and_blobs(tmp_path: Path) -> None:
    cfg = config()
    with CheckpointEngine(cfg) as engine:
        for n in range(5):
            _composite(engine, tmp_path, n)
    with Composites(str(tmp_path), cfg, keep_last=2, protect=frozenset({"checkpoint_1"})) as retained:
        store, name = retained.index_store("checkpoint_4")
        after_commit(store, name, cfg, memory=Memory(), retained=retained)
        parts_store = retained.store
        left = blobs(parts_store)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkrun", "checkpoint_1", "checkpoint_3", "checkpoint_4"]
    parts = sorted(p.name for p in (tmp_path / composite.PARTS_DIR).glob("*.ckpt"))
    assert parts == [f"checkpoint_{n}.run-{n}.rank0.ckpt" for n in (1, 3, 4)]
    with CheckpointEngine(cfg) as engine:
        assert left == referenced(engine, [str(tmp_path / composite.PARTS_DIR / p) for p in parts])
        assert engine.load(tmp_path / "checkpoint_1" / composite.INDEX_NAME)["step"] == 1


def test_a_handle_finishes_through_its_public_method() -> None:
    handle = SaveHandle("memory://x/a.ckpt")
    assert not handle.done()
    handle.finish(None, RuntimeError("disk gone"))
    assert handle.done() and isinstance(handle.take_error(), RuntimeError)


def test_write_stats_are_typed_from_the_manifest(tmp_path: Path) -> None:
    with CheckpointEngine(config()) as engine:
        info = engine.save(state(0), tmp_path / "a.ckpt").result()
        stats = WriteStats.from_manifest(engine.read_manifest(tmp_path / "a.ckpt").stats)
    assert stats.tensor_bytes == info.tensor_bytes == 64 * 64 * 4
    assert stats.stored_bytes == info.stored_bytes and stats.chain_depth == info.chain_depth == 0
