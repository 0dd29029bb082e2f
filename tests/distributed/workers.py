"""Per-rank bodies of the multi-process DCP tests (run by ``harness.run_ranks`` in real processes).

Each function gets ``(rank, world_size, *args)`` inside an initialized gloo process group, asserts what
it can see locally and returns JSON data for the test's cross-rank checks.
"""
from __future__ import annotations

import errno
import time
from datetime import timedelta

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.dcp import CheckrunLoadPlanner, CheckrunStorageReader, CheckrunStorageWriter


class FailingBlobFS(LocalFileSystem):
    """``dcpfail://`` = the local filesystem, except that writing a blob fails with ENOSPC (a full disk)."""

    protocol = ("dcpfail",)
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return super()._strip_protocol(path[len("dcpfail://"):] if path.startswith("dcpfail://") else path)

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode and "/.checkrun/blobs/" in str(path):
            raise OSError(errno.ENOSPC, "injected: no space left on device", str(path))
        return super().open(path, mode, **kwargs)


fsspec.register_implementation("dcpfail", FailingBlobFS, clobber=True)


def full_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The global tensors every test state is cut from (identical in every process)."""
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(64, 8, generator=g), "w": torch.randn(10, 6, generator=g),
            "bias": torch.randn(6, generator=g), "scale": torch.tensor(2.5),
            "ids": torch.arange(12, dtype=torch.int64).view(3, 4), "half": torch.randn(8, 4, generator=g).bfloat16()}


def dtensor_state(full: dict, mesh, emb=Shard(0), w=Shard(1)) -> dict:
    """A sharded state: DTensor shards, a replicated DTensor, plain (replicated) tensors, plain values."""
    return {"model": {"emb": distribute_tensor(full["emb"].clone(), mesh, [emb]),
                      "w": distribute_tensor(full["w"].clone(), mesh, [w]),
                      "bias": distribute_tensor(full["bias"].clone(), mesh, [Replicate()]),
                      "half": distribute_tensor(full["half"].clone(), mesh, [Shard(0)]),
                      "scale": full["scale"].clone(), "ids": full["ids"].clone()},
            "step": 7, "extra": {"name": "run", "lr": [0.1, 0.01]}}


def empty_like_state(state: dict) -> dict:
    """Same structure and sharding, zeros everywhere, placeholders for values."""
    def zero(v):
        if isinstance(v, DTensor):
            return distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh, v.placements)
        return torch.zeros_like(v)
    return {"model": {k: zero(v) for k, v in state["model"].items()}, "step": 0,
            "extra": {"name": None, "lr": None}}


def check_state(loaded: dict, full: dict) -> None:
    for k, v in loaded["model"].items():
        got = v.full_tensor() if isinstance(v, DTensor) else v
        assert torch.equal(got, full[k]), k
    assert loaded["step"] == 7 and loaded["extra"] == {"name": "run", "lr": [0.1, 0.01]}


def _info(writer: CheckrunStorageWriter) -> dict | None:
    s = writer.last_save
    return None if s is None else {"written": s.written_bytes, "ranks": s.rank_written_bytes, "path": s.path,
                                   "tensor_bytes": s.tensor_bytes, "stored": s.stored_bytes}


# -- scenarios -------------------------------------------------------------------------------------
def sharded_save_and_load(rank: int, world: int, path: str) -> dict:
    """Plain DCP API: save a DTensor state, load it back resharded (Shard(0) <-> Shard(1))."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    state = dtensor_state(full, mesh)
    writer = CheckrunStorageWriter(path)
    dcp.save(state, storage_writer=writer)
    target = empty_like_state(dtensor_state(full, mesh, emb=Shard(1), w=Shard(0)))
    dcp.load(target, storage_reader=CheckrunStorageReader(path), planner=CheckrunLoadPlanner())
    check_state(target, full)
    return {"info": _info(writer), "written": writer.last_written_bytes}


def load_resharded(rank: int, world: int, path: str) -> dict:
    """Load a checkpoint saved by another world size into this one's shards (uneven, some empty)."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    target = empty_like_state(dtensor_state(full, mesh, emb=Shard(0), w=Shard(1)))
    cdcp.load(target, path)
    check_state(target, full)
    return {"local_w_cols": target["model"]["w"].to_local().shape[1]}


def incremental_saves(rank: int, world: int, root: str, phase: int) -> dict:
    """Phase 1: save, change two rows of rank 1's shard, save again. Phase 2 (fresh processes): save
    the same content again (the blob index is seeded from the newest manifest)."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(4096, 64, generator=g)
    config = {"compression": {"chunk_bytes": 64 << 10}}
    if phase == 2:
        emb[2048:2050] += 1.0
    state = {"emb": distribute_tensor(emb, mesh, [Shard(0)]), "head": torch.ones(256, 64), "step": 1}
    writer = CheckrunStorageWriter(config=config)
    out = {}
    if phase == 1:
        cdcp.save(state, f"{root}/s1.dcp", writer=writer)
        out["s1"] = (_info(writer), writer.last_written_bytes)
        if rank == 1:
            state["emb"].to_local()[0:2] += 1.0  # global rows 2048, 2049
        cdcp.save(state, f"{root}/s2.dcp", writer=writer)
        out["s2"] = (_info(writer), writer.last_written_bytes)
    else:
        cdcp.save(state, f"{root}/s3.dcp", writer=writer)
        out["s3"] = (_info(writer), writer.last_written_bytes)
    return out


def failing_rank(rank: int, world: int, root: str) -> dict:
    """A good save, then a save whose blob writes fail on rank 1 only (disk full)."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    state = dtensor_state(full, mesh)
    cdcp.save(state, f"{root}/good.dcp")
    state["model"]["emb"].to_local().add_(1.0)  # new content on every rank: rank 0 writes new blobs
    path = (f"dcpfail://{root}/bad.dcp" if rank == 1 else f"{root}/bad.dcp")
    try:
        cdcp.save(state, path, config={"storage": {"retry": {"max_attempts": 1}}})
    except CheckpointException as exc:
        return {"raised": True, "message": str(exc)[-2000:]}
    return {"raised": False, "message": ""}


def replicated_saves(rank: int, world: int, root: str) -> dict:
    """DDP-style replicated state saved twice: spread over ranks, and all by rank 0 (DCP's option)."""
    g = torch.Generator().manual_seed(2)
    state = {"model": {"emb": torch.randn(4096, 32, generator=g), "fc.w": torch.randn(64, 64, generator=g),
                       "fc.b": torch.randn(64, generator=g)},
             "optim": {"emb.exp_avg": torch.randn(4096, 32, generator=g), "lr": 0.01}, "step": 3}
    spread = cdcp.save(state, f"{root}/spread/x.dcp", min_piece_bytes=32 << 10)
    writer = CheckrunStorageWriter(f"{root}/rank0/x.dcp")
    dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "optim": {"emb.exp_avg": torch.zeros(4096, 32), "lr": None}, "step": 0}
    cdcp.load(target, f"{root}/spread/x.dcp")  # every rank reads every piece back (DDP resume)
    for k, v in state["model"].items():
        assert torch.equal(target["model"][k], v), k
    assert torch.equal(target["optim"]["emb.exp_avg"], state["optim"]["emb.exp_avg"])
    assert target["optim"]["lr"] == 0.01 and target["step"] == 3
    return {"spread": None if spread is None else {"ranks": spread.rank_written_bytes},
            "rank0": _info(writer)}


def async_saves(rank: int, world: int, root: str) -> dict:
    """dcp.async_save returns after staging; changing the state afterwards must not reach the checkpoint."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    state = dtensor_state(full, mesh)
    writer = CheckrunStorageWriter(cache_staged_state_dict=True)
    first = cdcp.async_save(state, f"{root}/a1.dcp", writer=writer)
    state["model"]["emb"].to_local().mul_(-1.0)  # training goes on while the save runs
    first.result(timeout=120)
    second = cdcp.async_save(state, f"{root}/a2.dcp", writer=writer)
    second.result(timeout=120)
    target = empty_like_state(state)
    cdcp.load(target, f"{root}/a1.dcp")
    check_state(target, full)
    cdcp.load(target, f"{root}/a2.dcp")
    assert torch.equal(target["model"]["emb"].full_tensor(), -full["emb"])
    return {"ok": True}


def async_save_then_save_at_once(rank: int, world: int, root: str) -> dict:
    """A save and a load right after an async_save, without waiting for its future (s38: both ranks
    waited for ever: DCP's thread and the new save ran collectives on the same group at once)."""
    mesh = init_device_mesh("cpu", (world,))
    full = full_tensors()
    state = dtensor_state(full, mesh)
    first = cdcp.async_save(state, f"{root}/a1.dcp")
    cdcp.save(state, f"{root}/a2.dcp")
    assert first.done()
    target = empty_like_state(state)  # collectives of its own: not while an async_save runs
    second = cdcp.async_save(state, f"{root}/a3.dcp")
    cdcp.load(target, f"{root}/a3.dcp")
    assert second.done()
    check_state(target, full)
    return {"ok": True}


def s3_save(rank: int, world: int, path: str, storage_options: dict) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    state = dtensor_state(full_tensors(), mesh)
    info = cdcp.save(state, path, storage_options=storage_options)
    dist.barrier()
    target = empty_like_state(state)
    cdcp.load(target, path, storage_options=storage_options)
    check_state(target, full_tensors())
    return {"info": None if info is None else info.written_bytes}


def rank0_saves_every_rank_loads(rank: int, world: int, root: str) -> dict:
    """Rank 0 saves asynchronously with its storage held at a gate; after a barrier every rank loads
    the path. Rank 1 posts that it is about to load, and only then does rank 0 open its gate: rank 1's
    load must wait for rank 0's commit (it raised 'not found' before saves were counted job-wide)."""
    import threading

    import ckpt_core
    from ckpt_core.testing.faults import FaultFS

    store = dist.distributed_c10d._get_default_store()
    state = {"w": torch.arange(1000, dtype=torch.float32) + 7, "step": 3}
    path = f"gatefile://{root}/c.ckpt"
    engine = ckpt_core.CheckpointEngine()
    if rank == 0:
        FaultFS.reset()
        FaultFS.gate = threading.Event()
        engine.save(state, path)
    dist.barrier()
    if rank == 0:
        store.wait(["rank1-loads"])
        FaultFS.gate.set()
    else:
        store.set("rank1-loads", b"1")
    got = engine.load(path)
    engine.close()
    if rank == 0:
        FaultFS.reset()
    return {"same": torch.equal(got["w"], state["w"]) and got["step"] == 3}


class _Part:
    """A part handle whose durability the test controls: ``result()`` runs ``before`` first."""

    def __init__(self, path: str, before) -> None:
        self.path, self._before = path, before

    def result(self):
        import types

        self._before()
        return types.SimpleNamespace(written_bytes=1, tensor_bytes=1, stored_bytes=1, background_seconds=0.0)


def late_part_is_waited_for(rank: int, world: int) -> dict:
    """GroupCommitter with participation_seconds=0: rank 1 announces the checkpoint, then holds its
    part back (as a snapshot waiting for staging memory does) until rank 0, its own part durable,
    has looked whether rank 1 takes part. Rank 0 must wait for that part, not commit
    without it (the mark was posted only once the snapshot was taken)."""
    from ckpt_core.saving.group import GroupCommitter, Job, Verdict

    store = dist.distributed_c10d._get_default_store()
    group = GroupCommitter(None, rank, world, participation_seconds=0.0, timeout_seconds=60)
    group.token()
    seen: list = []
    key = group.announce("memory://run/checkpoint_0/index")
    if rank == 0:
        looks = group._await

        def looked(wanted: str, *args, **kwargs) -> bool:  # rank 1 submits only once rank 0 has looked
            found = looks(wanted, *args, **kwargs)
            if wanted.startswith("called/"):
                store.set("test/r0-looked", b"1")
            return found
        group._await = looked

        def finish(outcomes) -> Verdict:
            seen.append([o.path if o is not None else None for o in outcomes])
            return Verdict()
        group.submit(Job(_Part("part0", lambda: store.wait(["test/r1-announced"])), finish, key=key))
    else:
        store.set("test/r1-announced", b"1")
        store.wait(["test/r0-looked"])
        group.submit(Job(_Part("part1", lambda: None), None, key=key))
    group.close()
    return {"parts": seen, "errors": group.take_errors()}


def abandoned_part_fails_the_checkpoint(rank: int, world: int) -> dict:
    """Rank 1 announces a checkpoint, then its save raises (``abandon``): rank 0 does not wait out
    the timeout for a part that will not come; the checkpoint fails with rank 1's error."""
    from ckpt_core.saving.group import GroupCommitter, Job, Verdict

    group = GroupCommitter(None, rank, world, timeout_seconds=60)
    group.token()
    key = group.announce("memory://run/checkpoint_0/index")
    if rank == 0:
        def finish(outcomes) -> Verdict:
            failed = [o.error for o in outcomes if o is not None and o.error]
            return Verdict("; ".join(failed) or None)
        group.submit(Job(_Part("part0", lambda: None), finish, key=key))
        group.wait()
    else:
        group.abandon(key, "part1", OSError("disk full"))
    errors = group.take_errors()
    group.close()
    return {"errors": errors}


class _LostStore:
    """A c10d store whose connection is lost for the keys ``lost`` says (the launcher hosting it died)."""

    def __init__(self, store, lost) -> None:
        self._store, self._lost = store, lost

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            if self._lost(name, args):
                raise RuntimeError("Broken pipe")
            return method(*args, **kwargs)
        return call


def verdict_lost_after_rank0_committed(rank: int, world: int) -> dict:
    """The store goes away after rank 0 committed the checkpoint, before its verdict reached rank 1:
    every rank reported "checkpoint not committed" for a committed checkpoint (h110). Rank 0 keeps its
    verdict; rank 1 says the outcome is unknown."""
    from ckpt_core.saving.group import GroupCommitter, Job, Verdict

    group = GroupCommitter(None, rank, world, timeout_seconds=60)
    group.token()
    key = group.announce("memory://run/checkpoint_0/index")
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        group._store = _LostStore(group._store, lambda name, args: name == "set" and args[0].startswith("verdict/"))
        group.submit(Job(_Part("part0", lambda: None), lambda outcomes: Verdict(), key=key))
        group.wait()
        store.set("test/r0-decided", b"1")
    else:
        def lost(name: str, args: tuple) -> bool:  # waiting for the verdict, once rank 0 has decided
            if name == "check" and args[0][0].startswith("verdict/"):
                store.wait(["test/r0-decided"])
                return True
            return False
        group._store = _LostStore(group._store, lost)
        group.submit(Job(_Part("part1", lambda: None), None, key=key))
        group.wait()
    errors = [str(e) for e in group.take_errors()]
    group.close()
    return {"errors": errors}


def rank0_gone_is_not_waited_for(rank: int, world: int) -> dict:
    """Rank 0's process ends before its verdict while the store lives on (torchrun's agent hosts it): rank 1
    stopped waiting only after ``timeout_seconds``, and a SIGTERM grace waited its full 30 s (h149). Rank 0
    stands in for a dead one by posting the identity of a process that has ended, and holds its verdict."""
    import json
    import subprocess
    import sys

    from ckpt_core.saving.group import GroupCommitter, Job, Verdict
    from ckpt_core.storage import owner

    group = GroupCommitter(None, rank, world, timeout_seconds=600)
    group.token()
    key = group.announce("memory://run/checkpoint_0/index")
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        ident = dict(owner.identity(), pid=child.pid, start=owner.start_time(child.pid))
        child.wait()
        group._store.set("who/0", json.dumps(ident).encode())
        store.wait(["test/r1-done"], timedelta(seconds=120))  # rank 1 must not need rank 0's verdict
        group.submit(Job(_Part("part0", lambda: None), lambda outcomes: Verdict(), key=key))
        group.wait()
        errors = group.take_errors()
    else:
        group.submit(Job(_Part("part1", lambda: None), None, key=key))
        group.wait()
        errors = group.take_errors()
        store.set("test/r1-done", b"1")
    group.close()
    return {"errors": errors}


def inflight_count_follows_its_process_group(rank: int, world: int) -> dict:
    """Rank 0 begins a save under one process group, which is then destroyed and another one
    initialized (a second job in the same processes); the save ends under the new group. Its count
    must be taken back where it was made: taken from the new group's count, it hid that group's
    next save from the other ranks' loads (a count of 0 while a save was in flight)."""
    from tests.distributed.harness import free_port

    from ckpt_core.saving import inflight

    url = "memory://run/c.ckpt"
    old = dist.distributed_c10d._get_default_store()
    if rank == 0:
        inflight.begin(url)
        old.set("test/port", str(free_port()))
    port = int(old.get("test/port"))
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    new = dist.distributed_c10d._get_default_store()
    if rank == 0:
        inflight.end(url)  # the save of the first job ends now
        inflight.begin(url)  # a save of the second job
    dist.barrier()
    during = (int(new.add(f"checkrun-inflight/{url}", 0)), int(new.add("checkrun-inflight-total", 0)))
    dist.barrier()
    if rank == 0:
        inflight.end(url)
    dist.barrier()
    return {"during": list(during), "after": int(new.add(f"checkrun-inflight/{url}", 0))}


def per_rank_buffers(rank: int, world: int, root: str) -> dict:
    """A plain tensor of one name whose content (``buf``) or shape (``odd``) differs per rank (a DDP buffer
    not broadcast, a per-rank statistic): not replicated. Spreading cut ``buf`` into rows from each rank's
    copy (a tensor no rank held) and failed the save on ``odd`` (found by an independent check); DCP
    stores the lowest rank's copy. Then ``AsyncCheckpointerType.PROCESS``: the writer is pickled to DCP's
    saving process (it failed on a lock)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"buf": torch.full((4096, 16), float(rank)), "odd": torch.full((100 - 50 * rank, 4), float(rank)),
             "same": torch.ones(4096, 16)}
    cdcp.save(state, f"{root}/spread.dcp", min_piece_bytes=16 << 10)
    got = cdcp.load_state_dict(f"{root}/spread.dcp")
    assert torch.equal(got["buf"], torch.zeros(4096, 16)) and torch.equal(got["odd"], torch.zeros(100, 4))
    assert torch.equal(got["same"], state["same"])
    from ckpt_core.saving import fence

    ahead = time.time_ns() + 20 * 10 ** 9  # as after loading a checkpoint stamped by a clock 20 s ahead
    fence.follow(ahead)
    future = dcp.async_save({"w": torch.arange(12.0) + rank * 0, "step": 7},
                            storage_writer=CheckrunStorageWriter(f"{root}/process.dcp"),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    future.result()
    back = cdcp.load_state_dict(f"{root}/process.dcp")
    assert torch.equal(back["w"], torch.arange(12.0)) and back["step"] == 7
    with ckpt_core.CheckpointEngine() as engine:  # h137: the saving process stamped it by its own clock, behind
        stamp = engine.read_manifest(f"{root}/process.dcp").commit["ns"]  # the checkpoint loaded before
    assert rank != 0 or stamp > ahead  # (the coordinator's stamp: rank 0's clock)
    return {"ok": True}


def chunk_like_keys(rank: int, world: int, root: str) -> dict:
    """A state key that reads like checkrun's name for another key's chunk ("w@2,0" beside a sharded
    "w"): the save failed in finish() with "two DCP items map to the record key" (stock DCP saves it;
    found by an independent check). Both load back as saved."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).reshape(4, 2)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "w@2,0": torch.full((3,), 7.0)}
    cdcp.save(state, f"{root}/at.dcp")
    target = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "w@2,0": torch.zeros(3)}
    cdcp.load(target, f"{root}/at.dcp")
    whole = cdcp.load_state_dict(f"{root}/at.dcp")
    ok = (torch.equal(target["w"].full_tensor(), full) and torch.equal(target["w@2,0"], torch.full((3,), 7.0))
          and torch.equal(whole["w"], full) and torch.equal(whole["w@2,0"], torch.full((3,), 7.0)))
    return {"ok": ok}


def zero_step_log_replay(rank: int, world: int, root: str) -> dict:
    """A ZeroRedundancyOptimizer (each rank holds the state of its shard) logged by rank 0, checkpointed at step
    3 (consolidated on rank 0), replayed on every rank after a load: its load_state_dict leaves ``state[p] =
    None`` for the other rank's parameters, which the log's fingerprint took for a dict (h162)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    engine = ckpt_core.CheckpointEngine()
    log = engine.step_log(root, opt, model=model) if rank == 0 else None
    for i in range(1, 7):
        ddp(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                engine.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{root}/s3.ckpt").result()
    if log is not None:
        log.close()
    final = {k: v.clone() for k, v in model.state_dict().items()}
    dist.barrier()
    state = engine.load(f"{root}/s3.ckpt")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    replayed = engine.replay(root, opt, after=f"{root}/s3.ckpt", model=model)
    engine.close()
    return {"replayed": replayed, "equal": all(torch.equal(v, final[k]) for k, v in model.state_dict().items())}
