"""``load.reference``: the copy a load keeps of the tensors the next row-delta save compares
against, made during the load (``inline``) or rebuilt after it returned (``background``; ``auto``
picks it on local disks). Either way the next save is the same row delta and restores bit for bit;
a rebuild that fails costs that save its deltas, never its correctness."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from ckpt_core import CheckpointEngine, ConfigError, EngineConfig

ROWS, DIM = 4096, 16


def _cfg(reference: str, **over) -> EngineConfig:
    base = {"incremental": {"row_delta_min_rows": 64}, "load": {"reference": reference}}
    for key, value in over.items():
        base.setdefault(key, {}).update(value)
    return EngineConfig.from_dict(base)


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(ROWS, DIM, generator=g), "mom": torch.randn(ROWS, DIM, generator=g),
            "bias": torch.randn(DIM, generator=g)}


def _train(state: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for key in ("emb", "mom"):
        state[key][torch.randperm(ROWS, generator=g)[:40]] += 1.0
    state["bias"] += 1.0


def _zeros() -> dict:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rebuild_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "checkrun-reference"]


@pytest.mark.parametrize("mode", ["thread", "process"])
@pytest.mark.parametrize("reference", ["inline", "background", "auto"])
def test_the_save_after_a_load_is_the_same_row_delta_whichever_reference(tmp_path, reference, mode):
    state = _state()
    with CheckpointEngine(_cfg("inline")) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
    live = _zeros()
    with CheckpointEngine(_cfg(reference, saving={"background": mode})) as engine:
        engine.load(tmp_path / "0.ckpt", into=live)
        assert _equal(live, state)
        pending = sum(len(d.rebuilds) for d in engine._dirs.values())
        assert pending == (0 if reference == "inline" else 1)  # auto: a local disk rebuilds after the load
        _train(live, 1)
        info = engine.save(live, tmp_path / "1.ckpt").result()
        manifest = engine.read_manifest(tmp_path / "1.ckpt")
    assert info.chain_depth == 1
    deltas = {r.key: sum(d.n for d in r.deltas) for r in manifest.tensors}
    assert deltas["emb"] == 40 and deltas["mom"] == 40  # exactly the rows training changed
    with CheckpointEngine() as engine:
        assert _equal(engine.load(tmp_path / "1.ckpt"), live)


def test_auto_copies_during_the_load_on_an_object_store():
    state = _state()
    url = "memory://checkrun-load-reference/run"
    with CheckpointEngine(_cfg("auto")) as engine:
        engine.save(state, f"{url}/0.ckpt").result()
        loaded = engine.load(f"{url}/0.ckpt")
        (dirstate,) = engine._dirs.values()
        assert dirstate.rebuilds == [] and set(dirstate.streams) == {"emb", "mom"}
        _train(loaded, 2)
        assert engine.save(loaded, f"{url}/1.ckpt").result().chain_depth == 1


def test_a_load_returns_before_the_references_exist_and_the_next_save_adopts_them(tmp_path):
    state = _state()
    with CheckpointEngine(_cfg("background")) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
    with CheckpointEngine(_cfg("background")) as engine:
        loaded = engine.load(tmp_path / "0.ckpt")
        (dirstate,) = engine._dirs.values()
        assert dirstate.streams == {} and len(dirstate.rebuilds) == 1
        _train(loaded, 3)  # training writes the live tensors while the rebuild reads the blobs
        engine.save(loaded, tmp_path / "1.ckpt").result()
        assert dirstate.rebuilds == [] and set(dirstate.streams) == {"emb", "mom"}
        refs = {k: s.buffer.view(ROWS, DIM) for k, s in dirstate.streams.items()}
        assert torch.equal(refs["emb"], loaded["emb"]) and refs["emb"].data_ptr() != loaded["emb"].data_ptr()


def test_a_blob_rotted_before_the_rebuild_reads_it_is_named_and_the_next_save_writes_whole(
        tmp_path, caplog, monkeypatch):
    from ckpt_core.loading import references

    small = {"compression": {"chunk_bytes": 16 * 1024}}  # emb in 16 chunks
    state = _state()
    with CheckpointEngine(_cfg("inline", **small)) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
        emb = {r.key: r for r in engine.read_manifest(tmp_path / "0.ckpt").tensors}["emb"]
    assert len(emb.base) > 4
    blob = tmp_path / ".checkrun" / "blobs" / emb.base[0].blob.key[:2] / emb.base[0].blob.key[2:]
    rotted = threading.Event()
    real = references.load_references

    def after_the_rot(*args, **kwargs):  # the rebuild thread reads once the blob has rotted
        assert rotted.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(references, "load_references", after_the_rot)
    live = _zeros()
    with CheckpointEngine(_cfg("background", **small)) as engine:
        engine.load(tmp_path / "0.ckpt", into=live)
        assert _equal(live, state)  # the load itself read the intact blob
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        rotted.set()
        live["emb"][ROWS - 8:] += 1.0  # training leaves the rotted chunk's rows as they were
        with caplog.at_level(logging.WARNING, logger="ckpt_core"):
            info = engine.save(live, tmp_path / "1.ckpt").result()
        manifest = engine.read_manifest(tmp_path / "1.ckpt")
    warned = [r.getMessage() for r in caplog.records if "could not be rebuilt" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "0.ckpt") in warned[0] and "checksum mismatch" in warned[0]
    assert "writes them whole" in warned[0]
    assert all(not r.deltas for r in manifest.tensors) and info.chain_depth == 0
    with CheckpointEngine() as engine:  # the chunk of the same content was written again, not reused rotted
        assert _equal(engine.load(tmp_path / "1.ckpt"), live)
        assert engine.verify(tmp_path / "1.ckpt").ok


def test_the_references_count_against_max_total_bytes_at_the_load(tmp_path):
    from ckpt_core.errors import ResourceLimitError

    with CheckpointEngine(_cfg("inline")) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
    # The live tensors need no memory of the load's own; the two references need 2 x 256 KiB.
    with CheckpointEngine(_cfg("background", load={"max_total_bytes": 300_000})) as engine:
        with pytest.raises(ResourceLimitError, match="load.max_total_bytes"):
            engine.load(tmp_path / "0.ckpt", into=_zeros())
        assert all(not d.rebuilds for d in engine._dirs.values())


def test_closing_right_after_a_load_ends_the_rebuild(tmp_path):
    with CheckpointEngine(_cfg("background")) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
    engine = CheckpointEngine(_cfg("background", saving={"background": "process"}))
    engine.load(tmp_path / "0.ckpt")
    engine.close()
    assert _rebuild_threads() == []


def test_two_loads_before_a_save_keep_the_newest_reference(tmp_path):
    a, b = _state(0), _state(1)
    for name, state in (("a", a), ("b", b)):  # two engines: two full saves (none marked dense)
        with CheckpointEngine(_cfg("inline")) as engine:
            engine.save(state, tmp_path / f"{name}.ckpt").result()
    with CheckpointEngine(_cfg("background")) as engine:
        engine.load(tmp_path / "a.ckpt")
        loaded = engine.load(tmp_path / "b.ckpt")
        _train(loaded, 5)
        info = engine.save(loaded, tmp_path / "c.ckpt").result()
        manifest = engine.read_manifest(tmp_path / "c.ckpt")
    assert info.chain_depth == 1 and {r.key: sum(d.n for d in r.deltas) for r in manifest.tensors}["emb"] == 40
    with CheckpointEngine() as engine:
        assert _equal(engine.load(tmp_path / "c.ckpt"), loaded)


def test_an_unknown_reference_mode_is_refused():
    with pytest.raises(ConfigError, match="reference"):
        EngineConfig.from_dict({"load": {"reference": "lazy"}})


def test_wait_after_a_load_leaves_no_thread_and_the_next_save_is_still_a_delta(tmp_path):
    with CheckpointEngine(_cfg("background")) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
    with CheckpointEngine(_cfg("background")) as engine:
        loaded = engine.load(tmp_path / "0.ckpt")
        engine.wait()  # an idle engine holds no thread: the rebuild and its io threads have ended
        assert [t.name for t in threading.enumerate() if t.name.startswith("checkrun")] == []
        _train(loaded, 6)
        assert engine.save(loaded, tmp_path / "1.ckpt").result().chain_depth == 1


def test_closing_during_a_rebuild_stops_it_before_it_reads_on(tmp_path, monkeypatch):
    """A script that exits right after a load does not wait for a rebuild nobody will use."""
    from ckpt_core.loading import decode, references

    with CheckpointEngine(_cfg("background")) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
    fetched = []
    real_fetch, real_rebuild = decode.fetch_blob, references.load_references
    monkeypatch.setattr(decode, "fetch_blob", lambda *a, **k: fetched.append(a[1].key) or real_fetch(*a, **k))

    def held_until_stopped(*args):  # the rebuild starts only once close() told it to stop
        assert args[6].wait(60)
        return real_rebuild(*args)

    monkeypatch.setattr(references, "load_references", held_until_stopped)
    engine = CheckpointEngine(_cfg("background"))
    live = engine.load(tmp_path / "0.ckpt")
    assert fetched and _equal(live, _state())  # the load read every blob
    fetched.clear()
    engine.close()
    assert fetched == [] and _rebuild_threads() == []  # stopped before reading anything


def test_a_fork_waits_for_the_rebuild(tmp_path):
    """DataLoader workers fork right after a resume; CPython 3.11 can deadlock a child forked while
    a thread ends, so the rebuild (which starts and ends io threads) is joined before any fork."""
    import os

    from ckpt_core.saving import lifecycle

    with CheckpointEngine(_cfg("background")) as engine:
        engine.save(_state(), tmp_path / "0.ckpt").result()
    with CheckpointEngine(_cfg("background")) as engine:
        engine.load(tmp_path / "0.ckpt")
        (build,) = next(iter(engine._dirs.values())).rebuilds
        assert build._thread in set(lifecycle._retiring)
        pid = os.fork()
        if pid == 0:  # the child: only the forking thread, and nothing of the parent's to finish
            os._exit(0 if not any(t.name == "checkrun-reference" for t in threading.enumerate()) else 1)
        assert not build._thread.is_alive()  # joined before the fork
        assert os.waitpid(pid, 0)[1] == 0
