"""A rotted blob is never silently reused by a DCP save (issue 20, point 1, the DCP path).

A DCP save skips writing a chunk whose content-addressed blob already exists. When the stored
bytes of such a blob rotted (a flipped byte, a truncation), the save must check it first and write
it again: the new checkpoint verifies, loads the saved values and is what ``latest()`` returns.
Covered: the same process saving again (its blob index knows the blob), a fresh process (index
seeded from the newest manifest, or empty: the blob is only found on storage), object blobs,
lossy chunks, the read-once-per-process cost, and two gloo ranks. Blobs are damaged in place.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ckpt_core
from ckpt_core import EngineConfig
from ckpt_core.dcp import blobs as dcp_blobs, reader as dcp_reader, writer as dcp_writer
from ckpt_core import dcp as cdcp
from ckpt_core.storage.store import Store
from tests.distributed import workers
from tests.distributed.harness import run_ranks
from tests.reliability.test_rot_reuse import _Reads, age_blobs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CONFIG = {"compression": {"chunk_bytes": 4096}, "quantization": [{"pattern": "model.q", "bits": 8}],
          "storage": {"fsync": False}}


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(64, 48, generator=g),  # 12 KiB: three chunks
                      "q": torch.randn(32, 32, generator=g),  # 8-bit: lossy chunks
                      "b": torch.randn(16, generator=g)},
            "step": 12, "meta": {"name": "x"}}


def _same(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
    assert got["step"] == want["step"] and got["meta"] == want["meta"]


def _store(root: str) -> Store:
    return Store.for_directory(root, None, EngineConfig().storage)


def damage(store: Store, key: str, how: str) -> None:
    path = store.blob_path(key)
    data = store.fs.cat_file(path)
    if how == "truncate":
        data = data[: len(data) // 2]
    else:  # flip one byte in the middle
        buf = bytearray(data)
        buf[len(buf) // 2] ^= 0x5A
        data = bytes(buf)
    store.fs.pipe_file(path, data)


def blobs_of(path: str) -> dict[str, list[str]]:
    """Record key (tensor or object) -> its blob keys, of the checkpoint at ``path``."""
    m = ckpt_core.CheckpointEngine().read_manifest(path)
    out = {t.key: [c.blob.key for c in t.base] for t in m.tensors}
    out.update({o.key: [o.blob.key] for o in m.objects})
    return out


WHAT = {"chunks": (("model.w", 1), ("model.q", 0)), "object": (("step", 0),)}


def damage_some(root: str, name: str, how: str, what: tuple = WHAT["chunks"] + WHAT["object"]) -> None:
    """(default) One chunk of ``w``, one lossy chunk of ``q`` and the object blob of ``step``."""
    keys = blobs_of(f"{root}/{name}")
    store = _store(root)
    for record, i in what:
        damage(store, keys[record][i], how)


def assert_good(root: str, name: str, want: dict) -> None:
    """``name`` verifies, loads ``want`` bit for bit and is the newest valid checkpoint."""
    path = f"{root}/{name}"
    with ckpt_core.CheckpointEngine() as engine:
        report = engine.verify(path)
        assert report.ok, report.problems
        assert engine.latest(root) == path
    _same(cdcp.load_state_dict(path), want)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://dcp-rot-{tmp_path.name}"


@pytest.fixture
def fresh_process(monkeypatch):
    """Calling it makes the DCP path forget what this process knows, as in a new process."""
    def forget() -> None:
        index = dcp_blobs.BlobIndex()
        for module in (dcp_blobs, dcp_writer, dcp_reader):
            monkeypatch.setattr(module, "KNOWN", index)
    forget()
    return forget


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_same_process_rewrites_a_rotted_blob_it_would_reuse(root, how, fresh_process):
    state = _state()
    first = cdcp.save(state, f"{root}/c1.dcp", config=CONFIG)
    damage_some(root, "c1.dcp", how)  # before anything read it back (a load checks what it reads)
    info = cdcp.save(state, f"{root}/c2.dcp", config=CONFIG)
    assert 0 < info.written_bytes < first.written_bytes  # the damaged blobs were written again
    # Encodings are deterministic: the rewrite also repaired the older checkpoint.
    assert ckpt_core.CheckpointEngine().verify(f"{root}/c1.dcp").ok
    restored_q = cdcp.load_state_dict(f"{root}/c1.dcp")["model"]["q"]  # 8-bit: q as restored
    assert_good(root, "c2.dcp", {**state, "model": {**state["model"], "q": restored_q}})


def test_same_process_rewrites_a_blob_that_rotted_after_its_check(root, fresh_process):
    """The process read every blob back at its first reuse (c2); one rots after that."""
    state = _state()
    for name in ("c1", "c2", "c3"):
        cdcp.save(state, f"{root}/{name}.dcp", config=CONFIG)
    want = cdcp.load_state_dict(f"{root}/c1.dcp")
    damage_some(root, "c3.dcp", "flip")
    info = cdcp.save(state, f"{root}/c4.dcp", config=CONFIG)
    assert info.written_bytes > 0
    assert_good(root, "c4.dcp", want)


@pytest.mark.parametrize("what", list(WHAT))
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_new_process_rewrites_a_rotted_blob_it_would_reuse(root, how, seeded, what, fresh_process):
    """A new process seeds its blob index from the newest manifest; without one it finds the blob
    on storage only, and must not adopt the rotted bytes as they are (a checkpoint that verifies
    and loads wrong values)."""
    state = _state()
    cdcp.save(state, f"{root}/c1.dcp", config=CONFIG)
    want = cdcp.load_state_dict(f"{root}/c1.dcp")
    damage_some(root, "c1.dcp", how, WHAT[what])
    if not seeded:
        _store(root).delete_manifest("c1.dcp")
    fresh_process()
    cdcp.save(state, f"{root}/c2.dcp", config=CONFIG)
    assert_good(root, "c2.dcp", want)


def test_written_by_dcp_load_still_checked_once_not_again(tmp_path, monkeypatch, fresh_process):
    """Each reused blob is read once per process: blobs a save wrote count as unchecked until the
    first save that reuses them reads them back; blobs a load read and verified count as checked."""
    root, state = str(tmp_path / "run"), _state()
    reads = _Reads(monkeypatch)
    assert reads.during(lambda: cdcp.save(state, f"{root}/c1.dcp", config=CONFIG)) == 0
    unique = len({k for keys in blobs_of(f"{root}/c1.dcp").values() for k in keys})
    assert reads.during(lambda: cdcp.save(state, f"{root}/c2.dcp", config=CONFIG)) == unique
    assert reads.during(lambda: cdcp.save(state, f"{root}/c3.dcp", config=CONFIG)) == 0
    age_blobs(root)
    from ckpt_core.saving import blobcheck

    monkeypatch.setattr(blobcheck, "CLOCK_MARGIN", -60.0)  # utime moved the ctime to now (test_rot_reuse)
    fresh_process()
    cdcp.load_state_dict(f"{root}/c3.dcp")  # checks every blob it reads
    assert reads.during(lambda: cdcp.save(state, f"{root}/c4.dcp", config=CONFIG)) == 0
    assert_good(str(root), "c4.dcp", cdcp.load_state_dict(f"{root}/c1.dcp"))




# -- two gloo ranks --------------------------------------------------------------------------------
def rot_between_saves(rank: int, world: int, root: str) -> dict:
    """(every rank) Save a sharded state, let rank 0 flip a byte in every blob of it, save it again
    from the same processes (their blob indexes know every blob), load it back resharded."""
    mesh = init_device_mesh("cpu", (world,))
    full = workers.full_tensors()
    state = workers.dtensor_state(full, mesh)
    cdcp.save(state, f"{root}/c1.dcp")
    dist.barrier()
    if rank == 0:
        store = _store(root)
        for key in {k for keys in blobs_of(f"{root}/c1.dcp").values() for k in keys}:
            damage(store, key, "flip")
    dist.barrier()
    info = cdcp.save(state, f"{root}/c2.dcp")
    target = workers.empty_like_state(workers.dtensor_state(full, mesh, emb=workers.Shard(1),
                                                            w=workers.Shard(0)))
    cdcp.load(target, f"{root}/c2.dcp")
    workers.check_state(target, full)
    return {"ranks": None if info is None else info.rank_written_bytes}


def test_two_ranks_rewrite_rotted_blobs_of_their_shards(tmp_path):
    root = str(tmp_path / "run")
    r0, _ = run_ranks(rot_between_saves, 2, root)
    assert all(w > 0 for w in r0["ranks"]), r0  # each rank rewrote the blobs of its own shards
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.verify(f"{root}/c2.dcp").ok and engine.verify(f"{root}/c1.dcp").ok
        assert engine.latest(root) == f"{root}/c2.dcp"
    workers.check_state(cdcp.load_state_dict(f"{root}/c2.dcp"), workers.full_tensors())
