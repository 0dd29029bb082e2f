"""Storage faults, injected by wrapping the real storage (local disk via ``faultfile://``, and the
real s3fs client talking to moto's S3 server via a botocore ``before-send`` handler):

* transient errors on a fraction of requests: saves commit through the engine's retries with
  backoff (``storage.retry``), and every retry is logged;
* permanent errors and a full disk: the save fails with an error surfaced as the async contract
  says, no manifest is written, earlier checkpoints still load, staging memory is released;
* slow storage: backpressure holds the training thread inside ``save()`` while the staging
  budget is used up, instead of letting memory grow.
"""
from __future__ import annotations

import dataclasses

import errno
import logging
import os
import pickle
import random
import threading
import time

import fsspec
import numpy as np
import pytest
import torch

from ckpt_core import BackgroundSaveError, CheckpointEngine, EngineConfig
from ckpt_core.errors import CheckpointNotFoundError, StorageError
from ckpt_core.saving.staging import MemoryBudget
from ckpt_core.format import composite
from ckpt_core.retain import composites
from ckpt_core.storage.options import NO_BOTOCORE_RETRIES, open_options
from ckpt_core.storage.store import Store

from ckpt_core.testing import (BlockAll, DiskFull, FaultFS, Gate, Permanent, Policy, S3Faults, Transient,
                               s3_fault_options)

WATCHDOG = 120  # seconds; only bounds a wait that would otherwise hang on a bug


def make_state(i: int) -> dict:
    """Row-delta embedding (a few rows change per version), a dense matrix, plain values."""
    emb = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0))
    emb[i * 7 % 2048: i * 7 % 2048 + 5] += i
    w = torch.randn(96, 96, generator=torch.Generator().manual_seed(i))
    return {"emb": emb, "w": w, "step": i, "hist": (i, float(i) / 3)}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k
        else:
            assert a[k] == b[k] and type(a[k]) is type(b[k]), k


def config(**over) -> EngineConfig:
    base = {"compression": {"chunk_bytes": 16384}, "saving": {"sigterm_grace_seconds": None},
            "storage": {"fsync": False, "retry": {"max_attempts": 5, "initial_backoff_seconds": 0.05,
                                                  "max_backoff_seconds": 0.4}}}
    cfg = EngineConfig.from_dict(base)
    return cfg.replace(**over) if over else cfg


def retry_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ckpt_core.storage.store" and "transient error" in r.getMessage()]


# ------------------------------------------------------------------------------ transient errors
def test_transient_errors_on_local_storage_commit_through_retries(tmp_path, sleeps, caplog):
    root = f"faultfile://{tmp_path}/run"
    faults = Transient(0.3, seed=7)
    FaultFS.policy = faults
    states = [make_state(i) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
        with CheckpointEngine(config()) as engine:
            for i, st in enumerate(states):
                engine.save(st, f"{root}/c{i}.ckpt")
            engine.wait()
            for i, st in enumerate(states):  # reads are faulted as well
                assert_same(engine.load(f"{root}/c{i}.ckpt"), st)
                assert engine.verify(f"{root}/c{i}.ckpt").ok
    injected = sum(faults.injected.values())
    assert injected >= 20 and set(faults.injected) >= {"open", "close", "info", "read"}
    # Every injected fault was retried once, after a backoff, and logged with what and where.
    assert len(sleeps) == injected
    assert all(0.025 <= s <= 0.4 for s in sleeps)
    warnings = retry_warnings(caplog)
    assert len(warnings) == injected
    assert any("SlowDown" in w for w in warnings) and any("TimeoutError" in w for w in warnings)
    assert all(str(tmp_path) in w and "attempt" in w for w in warnings)


def test_retry_policy_is_configurable(tmp_path, sleeps, caplog):
    root = f"faultfile://{tmp_path}/run"
    cfg = config(**{"storage.retry": {"max_attempts": 2, "initial_backoff_seconds": 0.2,
                                      "max_backoff_seconds": 0.2}})
    with CheckpointEngine(cfg) as engine:
        engine.save(make_state(0), f"{root}/good.ckpt").result()
        # every manifest write fails 3 times: more than the 2 attempts allowed
        FaultFS.policy = Transient(1.0, ops=("open",), max_per_path=3)
        with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
            h = engine.save(make_state(1), f"{root}/bad.ckpt")
            with pytest.raises(BackgroundSaveError, match="failed after 2 attempts") as info:
                h.result()
        assert isinstance(info.value.__cause__, StorageError)
        assert len(sleeps) >= 1 and all(0.1 <= s <= 0.2 for s in sleeps)
        assert all("attempt 1/2" in w for w in retry_warnings(caplog))
        FaultFS.policy = None
        assert not (tmp_path / "run" / "bad.ckpt").exists()
        assert_same(engine.load(f"{root}/good.ckpt"), make_state(0))
        assert engine._budget.in_use == 0


def test_the_default_retry_budget_rides_out_a_few_seconds_of_outage(tmp_path, sleeps):
    """The defaults gave up after 5 attempts, 0.75-1.5 s of backoff: a 5 s S3 outage during a save failed it,
    and the next save stopped the fit, where stock Lightning (botocore's and s3fs's retries) went on (found
    by an independent check). Now 8 attempts, at least ~8 s of backoff (at most ~16 s)."""
    root = f"faultfile://{tmp_path}/run"
    defaults = EngineConfig().storage.retry
    cfg = config(**{"storage.retry": {f.name: getattr(defaults, f.name) for f in dataclasses.fields(defaults)}})
    with CheckpointEngine(cfg) as engine:
        FaultFS.policy = Transient(1.0, ops=("open",), max_per_path=7)  # every write fails 7 times, then lands
        engine.save(make_state(1), f"{root}/ok.ckpt").result()
        FaultFS.policy = None
        assert_same(engine.load(f"{root}/ok.ckpt"), make_state(1))
    assert max(sleeps) >= 2.5  # a write's 7th retry happened, after the backoff the policy gives it
    least = sum(min(defaults.max_backoff_seconds, defaults.initial_backoff_seconds * 2 ** k) / 2 for k in range(7))
    assert least >= 5.0  # seven failed attempts of one write are retried over at least this long


@pytest.mark.s3
@pytest.mark.parametrize("status", [503, 500], ids=["503-SlowDown", "500-InternalError"])
def test_transient_s3_errors_commit_through_retries(s3_root, s3_storage_options, sleeps, caplog, status):
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    assert Store.for_directory(s3_root, opts, config().storage).fs is fs  # the engine's client
    faults = S3Faults(fs, 0.4, operations=("PutObject", "GetObject"), status=status, seed=3)
    states = [make_state(i) for i in range(3)]
    try:
        with caplog.at_level(logging.WARNING, logger="ckpt_core.storage.store"):
            with CheckpointEngine(config(**{"storage.storage_options": opts})) as engine:
                for i, st in enumerate(states):
                    engine.save(st, f"{s3_root}/c{i}.ckpt")
                engine.wait()
                for i, st in enumerate(states):
                    assert_same(engine.load(f"{s3_root}/c{i}.ckpt"), st)
    finally:
        faults.remove()
    injected = sum(faults.injected.values())
    assert faults.injected["PutObject"] >= 3 and faults.injected["GetObject"] >= 1
    assert len(sleeps) == injected
    # s3fs turns the ClientError into an OSError carrying the server's message (the error code
    # is its __cause__): the log names the operation, the object and that message.
    text = "reduce your request rate" if status == 503 else "internal error"
    warnings = retry_warnings(caplog)
    assert len(warnings) == injected and all(text in w and "s3://" in w for w in warnings)


def _global_streams() -> tuple:
    """Python's, numpy's and torch's global random states (what accelerate checkpoints)."""
    return random.getstate(), pickle.dumps(np.random.get_state()), torch.get_rng_state()


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_retries_leave_the_training_random_streams_alone(where, tmp_path, sleeps, request):
    """A retried write in the background draws nothing from the global generators: the training
    thread's random stream (seeded and checkpointed by the script) stays the one it would be."""
    if where == "local":
        root, opts, faults = f"faultfile://{tmp_path}/run", {}, Transient(0.4, seed=5)
        FaultFS.policy = faults
    else:  # botocore's default retries: checkrun opens S3 with them off (options.open_options)
        root, opts = request.getfixturevalue("s3_root"), request.getfixturevalue("s3_storage_options")
        faults = S3Faults(fsspec.filesystem("s3", **open_options(root, opts)), 0.5, status=503, seed=5)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    before = _global_streams()
    try:
        with CheckpointEngine(config(**{"storage.storage_options": opts})) as engine:
            for i in range(3):
                engine.save(make_state(i), f"{root}/c{i}.ckpt")
            engine.wait()
            assert_same(engine.load(f"{root}/c2.ckpt"), make_state(2))
    finally:
        if where == "s3":
            faults.remove()
    assert sum(faults.injected.values()) >= 2 and len(sleeps) >= 2  # retried, each with a jittered backoff
    after = _global_streams()
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])


@pytest.mark.s3
def test_folder_calls_of_the_adapters_retry_transient_s3_errors(s3_root, s3_storage_options, sleeps):
    """The folder calls outside ``Store`` (accelerate's look for an existing checkpoint folder, its
    removal, the listing of checkpoint folders) go through ``storage.retry`` as well: botocore's own
    retries are off on the S3 filesystems checkrun opens."""
    cfg = EngineConfig.from_dict({"storage": {"storage_options": s3_storage_options}})
    with CheckpointEngine(cfg) as engine:
        engine.save(make_state(0), f"{s3_root}/checkpoint_0/c.ckpt").result()
    faults = S3Faults(fsspec.filesystem("s3", **open_options(s3_root, s3_storage_options)), 1.0, status=500,
                      operations=("ListObjectsV2", "HeadObject", "DeleteObjects"), max_per_key=1)
    try:
        assert composite.folder_exists(f"{s3_root}/checkpoint_0", None, cfg)
        assert not composite.folder_exists(f"{s3_root}/checkpoint_1", None, cfg)
        assert composites._subfolders(Store.for_directory(s3_root, s3_storage_options, cfg.storage)) == [
            "checkpoint_0"]
        composite.remove_folder(f"{s3_root}/checkpoint_0", None, cfg)
    finally:
        faults.remove()
    assert not composite.folder_exists(f"{s3_root}/checkpoint_0", None, cfg)
    assert sum(faults.injected.values()) >= 3 and len(sleeps) == sum(faults.injected.values())


def test_s3_options_turn_botocore_retries_off_unless_given():
    endpoint = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert open_options("s3://b/run", endpoint) == {**endpoint, **NO_BOTOCORE_RETRIES}
    assert open_options("s3a://b/run", None) == NO_BOTOCORE_RETRIES
    own = {"config_kwargs": {"retries": {"max_attempts": 3}, "connect_timeout": 5}}
    assert open_options("s3://b/run", own) == own
    assert open_options("s3://b/run", {"config_kwargs": {"connect_timeout": 5}}) == {
        "config_kwargs": {"connect_timeout": 5, "retries": {"total_max_attempts": 1}}}
    assert open_options("/tmp/run", endpoint) == endpoint and open_options("memory://run", None) == {}
    assert open_options("s3://b/run", {"config_kwargs": "x"}) == {"config_kwargs": "x"}  # s3fs's to reject


def test_s3_default_keeps_the_config_kwargs_of_fsspecs_configuration(monkeypatch):
    """fsspec applies its configuration (``~/.config/fsspec``, ``FSSPEC_S3_*``) with a shallow update:
    the default must carry a configured ``config_kwargs`` (e.g. path-style addressing for MinIO)."""
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"s3": {"addressing_style": "path"}}})
    assert open_options("s3://b/run", None) == {
        "config_kwargs": {"s3": {"addressing_style": "path"}, "retries": {"total_max_attempts": 1}}}
    assert open_options("s3://b/run", {"config_kwargs": {"connect_timeout": 5}}) == {"config_kwargs": {
        "s3": {"addressing_style": "path"}, "connect_timeout": 5, "retries": {"total_max_attempts": 1}}}
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 3}}})
    assert open_options("s3://b/run", None) == {}  # configured retries: fsspec applies them as usual


# ------------------------------------------------------------------------- permanent, disk full
def _assert_failed_cleanly(engine, root_dir, handle, good_state, message: str) -> None:
    with pytest.raises(BackgroundSaveError, match=message) as info:
        handle.result()
    assert isinstance(info.value.__cause__, StorageError)
    assert str(root_dir) in str(info.value) or "s3://" in str(info.value)
    assert engine._budget.in_use == 0  # staging memory released
    assert engine.pending == 0
    FaultFS.policy = None
    with pytest.raises(CheckpointNotFoundError):
        engine.load(handle.path)
    assert_same(engine.load(handle.path.replace("bad.ckpt", "good.ckpt")), good_state)


@pytest.mark.parametrize("kind", ["blob", "manifest"])
def test_permanent_error_fails_the_save_without_a_manifest(tmp_path, sleeps, kind):
    root = f"faultfile://{tmp_path}/run"
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(0), f"{root}/good.ckpt").result()
        FaultFS.policy = Permanent(PermissionError(errno.EACCES, "Permission denied"), kind=kind)
        h = engine.save(make_state(1), f"{root}/bad.ckpt")
        _assert_failed_cleanly(engine, tmp_path / "run", h, make_state(0), "Permission denied")
        assert sleeps == []  # permanent: not retried
        engine.wait()  # surfaced once, through result(): not raised again
        engine.save(make_state(2), f"{root}/after.ckpt").result()  # the engine recovers
        assert_same(engine.load(f"{root}/after.ckpt"), make_state(2))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".checkrun", "after.ckpt", "good.ckpt"]


def test_error_not_observed_surfaces_at_next_save_exactly_once(tmp_path, sleeps):
    root = f"faultfile://{tmp_path}/run"
    engine = CheckpointEngine(config())
    engine.save(make_state(0), f"{root}/good.ckpt").result()
    FaultFS.policy = Permanent(PermissionError(errno.EACCES, "Permission denied"), kind="blob")
    engine.save(make_state(1), f"{root}/bad.ckpt").wait()
    FaultFS.policy = None
    with pytest.raises(BackgroundSaveError, match="bad.ckpt"):
        engine.save(make_state(2), f"{root}/next.ckpt")
    engine.save(make_state(2), f"{root}/next.ckpt")
    engine.close()  # nothing left to raise
    assert engine._budget.in_use == 0


@pytest.mark.parametrize("where", ["blobs", "manifest"])
def test_disk_full_fails_cleanly_and_recovers(tmp_path, sleeps, where):
    root = f"faultfile://{tmp_path}/run"
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(0), f"{root}/good.ckpt").result()
        disk = DiskFull(free=20000) if where == "blobs" else DiskFull(free=0, kind="manifest")
        FaultFS.policy = disk
        big = {**make_state(1), "w": torch.randn(512, 512)}  # new data: far more than 20 kB
        h = engine.save(big, f"{root}/bad.ckpt")
        _assert_failed_cleanly(engine, tmp_path / "run", h, make_state(0), "No space left on device")
        assert disk.failures >= 1 and sleeps == []  # ENOSPC is not retried
        temp = [p for p in (tmp_path / "run").rglob("*") if ".tmp-" in p.name]
        assert temp == []  # partial temp files are removed
        engine.save(big, f"{root}/after.ckpt").result()  # space is back: the next save is whole
        assert_same(engine.load(f"{root}/after.ckpt"), big)
        assert engine.verify(f"{root}/after.ckpt").ok


@pytest.mark.s3
def test_s3_access_denied_fails_without_manifest(s3_root, s3_storage_options, sleeps):
    opts = s3_fault_options(s3_storage_options)
    fs = fsspec.filesystem("s3", **opts)
    with CheckpointEngine(config(**{"storage.storage_options": opts})) as engine:
        engine.save(make_state(0), f"{s3_root}/good.ckpt").result()
        faults = S3Faults(fs, 1.0, operations=("PutObject",), status=403, max_per_key=1000)
        try:
            h = engine.save(make_state(1), f"{s3_root}/bad.ckpt")
            with pytest.raises(BackgroundSaveError, match="AccessDenied|Access Denied|Forbidden") as info:
                h.result()
        finally:
            faults.remove()
        assert isinstance(info.value.__cause__, StorageError) and sleeps == []
        assert faults.injected["PutObject"] >= 1
        assert engine._budget.in_use == 0
        with pytest.raises(CheckpointNotFoundError):
            engine.load(f"{s3_root}/bad.ckpt")
        assert_same(engine.load(f"{s3_root}/good.ckpt"), make_state(0))
        assert [e.name for e in engine.list(s3_root)] == ["good.ckpt"]


# ---------------------------------------------------------------------------------- slow storage
class ProbeBudget(MemoryBudget):
    """The engine's staging budget, which also says when a caller has to wait for memory."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.blocked = threading.Event()
        self.waiting = 0

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            if not (self.in_use == 0 or self.in_use + nbytes <= self.limit):
                self.waiting += 1
                self.blocked.set()
        super().acquire(nbytes)


def test_slow_storage_blocks_training_within_the_staging_budget(tmp_path):
    root = f"faultfile://{tmp_path}/run"
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    nbytes = sum(p.nbytes for p in model.state_dict().values())
    limit = int(2.5 * nbytes)  # two snapshots fit, the third must wait
    cfg = config(**{"saving.max_pending": 8, "saving.staging_budget_bytes": limit, "incremental.enabled": False})
    engine = CheckpointEngine(cfg)
    engine._budget = probe = ProbeBudget(limit)
    gate = BlockAll("open", "blob")  # storage accepts nothing until released
    FaultFS.policy = gate
    expected, returned = [], []

    def train() -> None:
        for i in range(6):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # in place, right after the previous save returned
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            engine.save(model.state_dict(), f"{root}/s{i}.ckpt")
            returned.append(i)

    trainer = threading.Thread(target=train)
    trainer.start()
    assert probe.blocked.wait(WATCHDOG)
    # The training thread is held inside save() #3: memory did not grow past the budget.
    assert trainer.is_alive() and returned == [0, 1]
    assert probe.in_use == 2 * nbytes <= limit
    assert engine.pending == 2
    allocated = engine.staging.allocations
    assert allocated == 2 * len(model.state_dict())
    gate.release()
    trainer.join(WATCHDOG)
    assert not trainer.is_alive()
    engine.wait()
    assert probe.peak <= limit and probe.in_use == 0
    assert engine.staging.allocations <= allocated + len(model.state_dict())  # buffers are reused
    for i, exp in enumerate(expected):  # each snapshot is the state at its save, not later
        assert_same(engine.load(f"{root}/s{i}.ckpt"), exp)
    engine.close()


def test_gc_deletes_temp_files_of_interrupted_writes_after_the_grace(tmp_path):
    root = tmp_path / "run"
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(0), root / "good.ckpt").result()
        shard = next((root / ".checkrun" / "blobs").iterdir())
        steplog = root / ".checkrun" / "steplog"  # a step-log writer killed mid-write (found by a fault program)
        steplog.mkdir()
        uid = "0123456789abcdef" * 2  # earlier releases: .<name>.tmp-<uuid4 hex>, no owner tag
        old = [shard / f".tmp-{uid}", root / f".good.ckpt.tmp-{uid}",
               steplog / f".seg-0123456789abcdef-00000001-000000000000-000000000003.bin.tmp-{uid}"]
        young = shard / ".tmp-fedcba9876543210fedcba9876543210"  # a write in progress (another process)
        theirs = root / ".notes.tmp-old"  # a user's file: not of checkrun's temp file pattern
        for p in old + [young, theirs]:
            p.write_bytes(b"torn")
        then = time.time() - 7200
        for p in old + [theirs]:
            os.utime(p, (then, then))
        dry = engine.gc(root, grace_seconds=3600, dry_run=True)
        assert sorted(dry.temp_files) == sorted(str(p.relative_to(root)) for p in old)
        assert all(p.exists() for p in old)
        report = engine.gc(root, grace_seconds=3600)
        assert len(report.temp_files) == 3 and not any(p.exists() for p in old) and young.exists()
        assert theirs.exists()
        assert report.deleted == []  # no blob of the intact checkpoint
        assert_same(engine.load(root / "good.ckpt"), make_state(0))


class _OneChunkFailsWhileAnotherIsHeld(Policy):
    """Chunk ``held``'s existence check waits at a gate (after its content address was computed
    and, raw, its bytes handed over as a view of the staging buffer); once it waits, the check of
    chunk ``fails`` raises EACCES, so the save fails while a worker still uses its snapshot."""

    def __init__(self, held: str, fails: str) -> None:
        self.gate = Gate("info", "blob", 1, match=f"{held[:2]}/{held[2:]}")
        self.fails = f"{fails[:2]}/{fails[2:]}"
        self.failed = threading.Event()

    def on(self, op: str, kind: str, path: str) -> None:
        self.gate.on(op, kind, path)
        if op == "info" and self.fails in path and not self.failed.is_set():
            assert self.gate.entered.wait(WATCHDOG)
            self.failed.set()
            raise PermissionError(errno.EACCES, "Permission denied (injected)")

    def release(self) -> None:
        self.gate.release()


def test_a_failed_save_keeps_its_staging_until_its_workers_are_done(tmp_path):
    """A save that fails while a worker still encodes one of its chunks must not hand the staging
    buffer to the next save: that worker would store the next save's bytes under the failed
    save's content address, and a later save of the old values would reuse them silently."""
    root = tmp_path / "run"
    # Uncompressed: the raw codec hands the staging buffer itself to the write (zero copy).
    cfg = config(**{"saving.max_pending": 2, "saving.workers": 2, "incremental.enabled": False,
                    "compression.chunk_bytes": 4096, "compression.compress": False})
    a = {"w": torch.arange(2048, dtype=torch.float32)}  # two chunks
    b = {"w": -torch.arange(2048, dtype=torch.float32)}
    with CheckpointEngine(cfg) as scratch:  # learn the chunks' content addresses
        scratch.save(a, tmp_path / "scratch" / "a.ckpt").result()
        chunks = scratch.read_manifest(tmp_path / "scratch" / "a.ckpt").tensors[0].base
    policy = _OneChunkFailsWhileAnotherIsHeld(held=chunks[1].blob.key, fails=chunks[0].blob.key)
    FaultFS.policy = policy
    engine = CheckpointEngine(cfg)
    h = engine.save(a, f"faultfile://{root}/a.ckpt")
    assert policy.gate.entered.wait(WATCHDOG) and policy.failed.wait(WATCHDOG)
    try:  # b's snapshot is taken now, while a's worker is held
        engine.save(b, f"faultfile://{root}/b.ckpt")
    except BackgroundSaveError:  # a's failure may already be known: surfaced once, then save again
        engine.save(b, f"faultfile://{root}/b.ckpt")
    # a's buffer is still a's (its worker holds a view of it): b had to get a buffer of its own.
    assert engine.staging.allocations == 2 and engine._budget.in_use == 2 * a["w"].nbytes
    policy.release()
    with pytest.raises(BackgroundSaveError):
        h.result()
    engine.close()  # waits for every worker
    FaultFS.policy = None
    with CheckpointEngine(cfg) as fresh:
        fresh.save(a, root / "again.ckpt").result()
        assert_same(fresh.load(root / "again.ckpt"), a)
        assert_same(fresh.load(root / "b.ckpt"), b)


class _TempFileTaken(Policy):
    """The first temp file of ``kind`` is deleted after it is written, before its rename: what a collection
    in another process does to the temp file of a writer stopped (SIGSTOP) past ``retention.lease_seconds``."""

    def __init__(self, kind: str) -> None:
        self.kind, self.taken = kind, []

    def on(self, op, kind, path):
        if op == "close" and kind == self.kind and not self.taken:
            self.taken.append(path)
            os.remove(path)


@pytest.mark.parametrize("kind", ["blob", "manifest"])
def test_a_temp_file_taken_before_its_rename_is_written_again(tmp_path, kind, caplog):
    """Before, the save failed with a bare "[Errno 2] No such file or directory: '.../.tmp-...' -> '...'"
    (found by a fault program: gc from another process while the writer was paused); the data is still
    in memory, so the file is written again, and the save commits."""
    policy = _TempFileTaken(kind)
    root = f"faultfile://{tmp_path}/run"
    with CheckpointEngine(config()) as engine:
        FaultFS.policy = policy
        try:
            engine.save(make_state(1), f"{root}/a.ckpt").result()
        finally:
            FaultFS.policy = None
        assert len(policy.taken) == 1 and ".tmp-" in policy.taken[0]
        assert_same(engine.load(f"{root}/a.ckpt"), make_state(1))
        assert engine.verify(f"{root}/a.ckpt").ok
    assert any("its temp file was deleted before the rename" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["blob", "manifest"])
def test_latest_raises_when_the_storage_fails_rather_than_resume_an_older_checkpoint(tmp_path, sleeps, kind):
    """Reads that fail after every retry (an outage, S3 503s) made ``latest`` skip the newest
    checkpoint as corrupt: a resume went back to an older one, or started fresh (None), and its
    saves overwrote the newer ones (found by a fault program on S3). Corrupt ones are still skipped."""
    from ckpt_core.testing.faults import transient_error

    root = f"faultfile://{tmp_path}/run"
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(0), f"{root}/a.ckpt").result()
        engine.save(make_state(1), f"{root}/b.ckpt").result()
        FaultFS.policy = Permanent(transient_error(0), ops=("read",), kind=kind)
        try:
            with pytest.raises(StorageError, match="cannot read it .*not skipping it for an older checkpoint"):
                engine.latest(root)
        finally:
            FaultFS.policy = None
        assert engine.latest(root) == f"{root}/b.ckpt"
        (tmp_path / "run" / "b.ckpt").write_bytes(b"CKRN" + b"\0" * 60)  # corrupt: skipped, as ever
        assert engine.latest(root) == f"{root}/a.ckpt"


def test_latest_stops_at_a_checkpoint_it_is_not_allowed_to_read(tmp_path, sleeps):
    """An outage (transient errors through every retry) stops ``latest``, and so does a refusal to read the
    newest checkpoint (h146: a teammate's checkpoint made with umask 077 was skipped as corrupt, the resume
    went back to an older one, or started over, and its saves could replace the newer one)."""
    root = f"faultfile://{tmp_path}/run"
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(0), f"{root}/a.ckpt").result()
        engine.save(make_state(1), f"{root}/b.ckpt").result()

        class Denied(Policy):
            def on(self, op, kind, path):
                if op == "read" and path.endswith("b.ckpt"):
                    raise PermissionError(13, "injected: permission denied", path)

        FaultFS.policy = Denied()
        try:
            with pytest.raises(StorageError, match=r"b.ckpt: cannot read it .*permission denied.*not skipping it "
                                                   r"for an older checkpoint.*fix its permissions"):
                engine.latest(root)
        finally:
            FaultFS.policy = None
        assert engine.latest(root) == f"{root}/b.ckpt"


def test_a_blob_damaged_in_transit_is_read_again(tmp_path, monkeypatch, caplog):
    """One read of a blob returned flipped bytes (an S3 GET without a response checksum, through a
    fault proxy): load and verify said "checksum mismatch (corrupted blob)" for a blob intact in
    storage. A mismatch is read once more; a blob damaged at rest still fails."""
    root = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(make_state(3), f"{root}/a.ckpt").result()
    flips = []
    real = Store.get_blob

    def flaky(self, key, max_bytes):
        data = real(self, key, max_bytes)
        if len(flips) < 1:
            flips.append(key)
            data = bytes([data[0] ^ 1]) + bytes(data[1:])
        return data

    monkeypatch.setattr(Store, "get_blob", flaky)
    with CheckpointEngine(config()) as engine, \
            caplog.at_level(logging.WARNING, logger="ckpt_core"):
        assert engine.verify(f"{root}/a.ckpt").ok and flips
        assert any("checksum mismatch on the first read, the second matched" in r.getMessage()
                   for r in caplog.records)
    monkeypatch.undo()
    blob = next(p for p in (tmp_path / "run" / ".checkrun" / "blobs").rglob("*") if p.is_file())
    blob.write_bytes(bytes([blob.read_bytes()[0] ^ 1]) + blob.read_bytes()[1:])
    with CheckpointEngine(config()) as engine:
        report = engine.verify(f"{root}/a.ckpt")
    assert not report.ok and "checksum mismatch (corrupted blob)" in report.problems[0]


def test_reads_cut_short_in_transit_are_read_again_not_taken_for_damage(tmp_path, monkeypatch, caplog):
    """A response body cut off in transit with no response checksum (a proxy, a store without
    x-amz-checksum): the manifest's head, the whole manifest and a blob read fewer bytes than the
    storage reported. Each counted as damage: latest() went back to an older checkpoint (with three
    such reads, to none) and load/verify called an intact checkpoint corrupt (found by a fault proxy in
    front of S3). Now a short read is retried like any transient error."""
    from fsspec.implementations.local import LocalFileSystem

    from ckpt_core.loading.decode import fetch_blob

    with CheckpointEngine({"storage": {"fsync": False}}) as engine:
        for k in range(3):
            engine.save({"w": torch.full((64,), float(k)), "k": k}, tmp_path / f"s{k}.ckpt")
        engine.wait()
    ref = next(iter(CheckpointEngine().read_manifest(tmp_path / "s2.ckpt").blobs()))
    blob = Store.for_directory(str(tmp_path), None, EngineConfig().storage).blob_path(ref.key)
    cuts = {str(tmp_path / "s2.ckpt"): 3, blob: 1}  # the head read, two whole reads; one blob read
    real = LocalFileSystem.cat_file

    def cut(self, path, start=None, end=None, **kwargs):
        data = real(self, path, start=start, end=end, **kwargs)
        left = cuts.get(self._strip_protocol(path), 0)
        if left and len(data) > 8:
            cuts[self._strip_protocol(path)] = left - 1
            return data[: len(data) // 2]
        return data

    monkeypatch.setattr(LocalFileSystem, "cat_file", cut)
    caplog.set_level(logging.WARNING, logger="ckpt_core")
    with CheckpointEngine({"storage": {"retry": {"initial_backoff_seconds": 0.001}}}) as engine:
        assert engine.latest(tmp_path).endswith("s2.ckpt")
        store = Store.for_directory(str(tmp_path), None, engine.config.storage)
        assert bytes(fetch_blob(store, ref))  # no buffer: read whole through the store, as DCP and S3 loads do
        assert engine.load(tmp_path / "s2.ckpt")["k"] == 2
    assert not any(cuts.values()) and "IncompleteRead" in caplog.text
