"""Leases: the blobs of saves in flight are protected by the lease of their save, not by their age.

* a blob of a save in flight survives a concurrent gc (the save held at a gate or inside a blob
  write; local disk, memory:// and S3), and the save then commits intact;
* the lease of a dead writer does not protect: expired (forged with a past expiry), or of a
  process of this host that has ended (SIGKILLed mid-save, another engine collecting right after);
* hostile lease objects are refused with an error naming the file, and nothing is collected;
* collection is prompt: after every commit with ``keep_last=3`` no unreferenced blob is left;
* a lease that lapsed (renewals failing) makes the save check every blob again before it commits;
* two writers (two processes) saving, retaining and collecting in one directory in a random
  order lose no blob, on local disk and on S3.

No sleeps: gates and held writes are threading.Events; a save that meets a collection in progress
waits twice that collection's deletion window (``lease_seconds / 20``, short here).
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.retain.leases import LeaseDir, LeaseRecord, record
from ckpt_core.storage.store import Store

from . import crash_child, harness
from ckpt_core.testing.faults import FaultFS, Gate

WATCHDOG = 120
LEASE = 8.0  # renewal every 2 s, deletion windows of 0.4 s


def config(root_opts: dict | None = None, **retention) -> EngineConfig:
    ret = {"lease_seconds": LEASE, **retention}
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 16384},
        "retention": ret,
        "saving": {"sigterm_grace_seconds": None},
        "storage": {"fsync": False, "storage_options": root_opts or {}},
    })


def state(version: int, frozen_seed: int = 0) -> dict:
    return crash_child.versioned_state(version, frozen_seed)


def store_of(url: str, opts: dict | None = None) -> Store:
    return Store.for_directory(url, opts, config(opts).storage)


def stored(url: str, opts: dict | None = None) -> dict[str, int]:
    return {b.key: b.size for b in store_of(url, opts).list_blobs()}


def referenced(engine: CheckpointEngine, url: str, opts: dict | None = None) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in engine.list(url, storage_options=opts):
        out.update((b.key, b.size) for b in e.manifest.blobs())
    return out


def verify_all(url: str, opts: dict | None = None) -> list[str]:
    """Every checkpoint of ``url`` verifies (sizes, checksums, decoding): no blob was lost."""
    with CheckpointEngine(config(opts)) as engine:
        names = [e.name for e in engine.list(url, storage_options=opts)]
        for name in names:
            report = engine.verify(f"{url}/{name}", storage_options=opts)
            assert report.ok, (name, report.problems)
    return names


# --------------------------------------------------------------------------- in-flight protection
def test_blobs_of_a_save_held_at_its_commit_survive_a_concurrent_gc(tmp_path):
    root = tmp_path / "run"
    url = f"faultfile://{root}"
    with CheckpointEngine(config()) as a, CheckpointEngine(config(keep_last=1)) as b:
        a.save(state(1), f"{url}/a1.ckpt").result()
        gate = Gate("open", "manifest", 1)  # a2: every blob written and checked, its commit held
        FaultFS.policy = gate
        handle = a.save(state(2, frozen_seed=5), f"{url}/a2.ckpt")
        assert gate.entered.wait(WATCHDOG)
        fresh = set(stored(str(root))) - set(referenced(b, str(root)))
        assert fresh  # a2's new blobs: in the store, referenced by no manifest yet
        b.remove(root / "a1.ckpt")
        report = b.gc(root)  # a full collection: a1's blobs go, a2's stay (leased)
        assert report.leases == 1 and report.kept_leased >= len(fresh)
        assert fresh <= set(stored(str(root))) and not fresh & set(report.deleted)
        gate.release()
        handle.result()
    FaultFS.policy = None
    assert verify_all(str(root)) == ["a2.ckpt"]
    assert not list((root / ".checkrun" / "leases").iterdir())  # released at the commit


def test_a_forward_step_of_the_clock_during_a_save_never_commits_collected_blobs(tmp_path, monkeypatch):
    """One host: a save is held at its commit (blobs and lease written); the host's clock steps forward
    past the lease (a VM resumed, an NTP step); a collection then reads the lease as expired and deletes
    the save's new blobs. The save's lease ran on time.monotonic only, which a step of the clock does
    not move: it committed a checkpoint whose blobs were gone (found by an independent check). Now the
    wall clock lapses the lease too: the save fails, nothing of it is committed, the rest verifies."""
    from ckpt_core.errors import BackgroundSaveError

    root = tmp_path / "run"
    url = f"faultfile://{root}"
    with CheckpointEngine(config()) as a, CheckpointEngine(config()) as b:
        a.save(state(1), f"{url}/a1.ckpt").result()
        gate = Gate("open", "manifest", 1)
        FaultFS.policy = gate
        handle = a.save(state(2, frozen_seed=5), f"{url}/a2.ckpt")
        assert gate.entered.wait(WATCHDOG)
        fresh = set(stored(str(root))) - set(referenced(b, str(root)))
        assert fresh
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 10 * LEASE)  # the step: every clock reader sees it
        for lease in (root / ".checkrun" / "leases").iterdir():  # and the files written before it are older
            st = lease.stat()  # by as much on the clock that dates the files written after it (leases, h165)
            os.utime(lease, (st.st_atime - 10 * LEASE, st.st_mtime - 10 * LEASE))
        try:
            report = b.gc(root)
            assert report.leases == 0 and fresh <= set(report.deleted)  # the lease reads as expired now
        finally:
            gate.release()
        with pytest.raises(BackgroundSaveError, match="collected while its lease had lapsed"):
            handle.result()
    FaultFS.policy = None
    assert verify_all(str(root)) == ["a1.ckpt"]


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_blob_written_before_a_held_write_survives_gc(backend, tmp_path, request):
    """A (another process) is inside a save: its first blobs written, the next write held. B's
    collections (its save's, then a full gc) keep A's blobs; A, released, commits intact."""
    url, opts = _root(backend, tmp_path, request)
    cfg = config(opts, keep_last=1)
    a = _RemoteEngine(url, cfg, tmp_path / "a.log")
    try:
        a.call("save", "a1.ckpt", 1, True, 0)
        a.call("hold_put", 2)
        a.call("save", "a2.ckpt", 2, False, 7)  # a new frozen part: new blobs
        a.entered()
        with CheckpointEngine(cfg) as b:
            b.save(state(3, frozen_seed=1), f"{url}/b3.ckpt", storage_options=opts).result()  # removes a1
            in_flight = set(stored(url, opts)) - set(referenced(b, url, opts))
            assert in_flight  # a2's first blob: in the store, referenced by no manifest
            report = b.gc(url, storage_options=opts)
            assert report.leases == 1 and report.kept_leased >= len(in_flight) and not report.problems
            assert in_flight <= set(stored(url, opts))
            a.call("release_put")
            a.call("result", "a2.ckpt")
        assert verify_all(url, opts) == ["a2.ckpt", "b3.ckpt"]  # a2 was captured before b3: it is older
    finally:
        a.kill()


def _root(backend: str, tmp_path: Path, request) -> tuple[str, dict]:
    if backend == "s3":
        return request.getfixturevalue("s3_root"), request.getfixturevalue("s3_storage_options")
    return str(tmp_path / "run"), {}


# --------------------------------------------------------------------------------- dead writers
def _orphans(url: str, opts: dict | None = None, n: int = 3) -> list[str]:
    """Blobs no manifest references (as a killed save leaves them)."""
    store = store_of(url, opts)
    keys = [f"{i:02x}" + "ab" * 15 for i in range(n)]
    for k in keys:
        store.put_blob(k, b"orphan " + k.encode())
    return keys


def _forge(url: str, keys: list[str], expires_in: float, host: str = "another-host/boot/1",
           pid: int = 4242, start: int = 1) -> LeaseRecord:
    """A lease as another writer would have written it 60 s ago (its file dated so: collections also judge a
    lease by the age of its file, h165)."""
    ldir = LeaseDir(store_of(url))
    now = time.time()
    rec = LeaseRecord(f"{'0f' * 8}-{pid}.json", "save", "0f" * 8, pid, start, host, now - 60,
                      now + expires_in, 0.0, frozenset(keys))
    ldir.write(rec)
    os.utime(Path(url) / ".checkrun" / "leases" / rec.name, (now - 60, now - 60))
    return rec


def test_an_expired_lease_of_a_dead_writer_does_not_protect(tmp_path):
    url = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        live = _orphans(url, n=2)
        _forge(url, live, expires_in=LEASE)  # another host's save in flight
        report = engine.gc(url)
        assert report.deleted == [] and report.kept_leased == 2 and report.leases == 1
        dead = _forge(url, live, expires_in=-1.0)  # the same writer, which died: its lease ran out
        report = engine.gc(url)
        assert sorted(report.deleted) == sorted(live) and report.leases == 0
        assert not (Path(url) / ".checkrun" / "leases" / dead.name).exists()  # removed with its blobs
    assert verify_all(url) == ["a1.ckpt"]


def _lease_of_another_host(url: str, keys: list[str], written: float, pid: int = 4242,
                           expires: float | None = None) -> None:
    LeaseDir(store_of(url)).write(LeaseRecord(f"{'0f' * 8}-{pid}.json", "save", "0f" * 8, pid, 1, "another-host/boot/1",
                                              written, written + LEASE if expires is None else expires, 0.0,
                                              frozenset(keys)))


def test_a_lease_of_a_writer_whose_clock_is_behind_protects_while_its_file_is_young(tmp_path, caplog):
    """h165: a trainer whose clock ran 10 minutes behind wrote leases already expired by the collector's clock:
    gc deleted the blobs of its saves in flight, which committed without them (kept checkpoints lost blobs,
    nothing said). A lease also lives while its file is younger than its lifetime, on the storage's clock."""
    url = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        live = _orphans(url, n=2)
        _lease_of_another_host(url, live[:1], time.time() - 600)  # just written, by its clock
        _lease_of_another_host(url, live[1:], time.time() - 600, pid=4343)  # another process of that host
        with caplog.at_level(logging.WARNING, logger="ckpt_core"):
            report = engine.gc(url)
    assert report.deleted == [] and report.kept_leased == 2 and report.leases == 2, report
    said = [r.getMessage() for r in caplog.records if "behind the storage's" in r.getMessage()]
    assert len(said) == 1 and "host another-host/boot/1 is 600 s behind the storage's" in said[0], said  # per host


def test_a_dead_writer_years_ahead_does_not_keep_its_lease_for_years(tmp_path):
    """A writer whose clock ran 10 years ahead died: its lease expires in 10 years by its clock. Its expiry
    counts only if it was written less than a day ahead of the collector's clock; by its file's age (2 days)
    it is dead (h169: its blobs were kept for years)."""
    url = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        dead = _orphans(url, n=2)
        _lease_of_another_host(url, dead, time.time() + 10 * 365 * 86400)
        for lease in (Path(url) / ".checkrun" / "leases").iterdir():
            os.utime(lease, (time.time() - 2 * 86400, time.time() - 2 * 86400))
        report = engine.gc(url)
    assert sorted(report.deleted) == sorted(dead) and report.leases == 0, report


def test_a_forged_lifetime_does_not_keep_a_lease_for_decades(tmp_path):
    """A lease object written at 0 that expired 10 s ago, dated now: by its file's age it would live ~56 years
    (h167). Its age-based lifetime is bounded by a day; by its expiry it is dead: collected."""
    url = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        dead = _orphans(url, n=2)
        _lease_of_another_host(url, dead, 0.0, expires=time.time() - 10)
        for lease in (Path(url) / ".checkrun" / "leases").iterdir():  # its file dated two days ago
            os.utime(lease, (time.time() - 2 * 86400, time.time() - 2 * 86400))
        report = engine.gc(url)
    assert sorted(report.deleted) == sorted(dead) and report.leases == 0, report


def test_a_collector_whose_clock_is_ahead_keeps_live_leases_and_young_temp_files(tmp_path, monkeypatch, caplog):
    """h165: a gc on a host 10 minutes ahead took every lease for expired and every temp file for a dead
    writer's: it deleted blobs and manifests being written (saves failed with a raw rename error, kept
    checkpoints lost blobs). It dates leases, temp files and blobs on the storage's clock, measured by the
    date the storage gives the object it writes."""
    url = str(tmp_path / "run")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        live = _orphans(url, n=2)
        _lease_of_another_host(url, live, time.time())
        temp = Path(url) / f".a2.ckpt.tmp-{'ab' * 16}"  # its manifest being written
        temp.write_bytes(b"partial")
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 600)
        with caplog.at_level(logging.WARNING, logger="ckpt_core"):
            report = engine.gc(url)
    assert report.deleted == [] and report.kept_leased == 2 and report.temp_files == [] and temp.exists(), report
    assert any("the clock of this host is 600 s ahead of the storage's" in r.getMessage() for r in caplog.records)


def test_an_expired_lease_on_a_storage_that_gives_no_file_times_is_collected(tmp_path, monkeypatch):
    """Where a listing gives no modification time (its date falls back to the listing's time), a lease is judged
    by its expiry alone: dated "now" at every listing, a dead writer's lease would protect its blobs for ever."""
    url = str(tmp_path / "run")
    real = FaultFS.ls

    def ls(self, path, detail=False, **kwargs):
        out = real(self, path, detail=detail, **kwargs)
        return [{k: v for k, v in e.items() if k not in ("mtime", "created")} for e in out] if detail else out
    monkeypatch.setattr(FaultFS, "ls", ls)
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        dead = _orphans(url, n=2)
        _forge(url, dead, expires_in=-1.0)
        report = engine.gc(f"faultfile://{url}")
    assert sorted(report.deleted) == sorted(dead) and report.leases == 0, report


def test_the_lease_of_an_ended_process_of_this_host_does_not_protect(tmp_path):
    url = str(tmp_path / "run")
    ctx = harness.context()
    proc = ctx.Process(target=os.getpid)
    proc.start()
    proc.join()
    keys = _orphans(url, n=2)
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), f"{url}/a1.ckpt").result()
        me = record("x", "save", LEASE)  # this host's key and a pid that ended (start time known)
        _forge(url, keys, expires_in=LEASE, host=me.host, pid=proc.pid, start=max(me.start, 1))
        report = engine.gc(url)
    if not me.host:
        pytest.skip("no /proc here: processes cannot be looked up, only expiry decides")
    assert sorted(report.deleted) == sorted(keys)


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_writer_killed_mid_save_and_another_collecting_right_after(backend, tmp_path, request):
    """A in another process: a1 committed, a2 SIGKILLed inside a blob write (lease held, some
    blobs written). B, right after: its save's retention and collection, then a full gc. Nothing
    committed is lost; A's orphans, lease and temp files go (same host: its process is gone)."""
    url, opts = _root(backend, tmp_path, request)
    cfg = config(opts, keep_last=2)
    a = _RemoteEngine(url, cfg, tmp_path / "a.log")
    try:
        a.call("save", "a1.ckpt", 1, True, 0)
        a.call("hold_put", 3)
        a.call("save", "a2.ckpt", 2, False, 7)  # new frozen part: several new blobs
        a.entered()
        a.kill()
        with CheckpointEngine(cfg) as b:
            b.save(state(3, frozen_seed=1), f"{url}/b3.ckpt", storage_options=opts).result()
            report = b.gc(url, storage_options=opts)
            assert report.leases == 0 and not report.problems
            assert set(stored(url, opts)) == set(referenced(b, url, opts))  # nothing left over
        assert sorted(verify_all(url, opts)) == ["a1.ckpt", "b3.ckpt"]
        assert LeaseDir(store_of(url, opts)).listing() == set()
    finally:
        a.kill()


class _RemoteEngine:
    """An engine in another process (``crash_child.engine_server``) that can be SIGKILLed."""

    def __init__(self, root: str, cfg: EngineConfig, log: Path) -> None:
        ctx = harness.context()
        self.conn, child = ctx.Pipe()
        self.events, events_child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=crash_child.engine_server,
                                args=(child, events_child, root, cfg.to_dict(), str(log)), daemon=True)
        self.proc.start()
        child.close()
        events_child.close()

    def call(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(WATCHDOG), f"engine A did not answer {cmd}"
        status, value = self.conn.recv()
        assert status == "ok", f"engine A: {cmd[0]} failed: {value}"
        return value

    def entered(self) -> str:
        assert self.events.poll(WATCHDOG), "engine A never reached its hold"
        return self.events.recv()[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(WATCHDOG)


# ------------------------------------------------------------------------------- hostile leases
_KEY = "ab" * 16
_GOOD = {"_checkrun": "lease", "version": 1, "kind": "save", "writer": "0f" * 8, "pid": 1, "start": 1,
         "host": "h", "written": 1.0, "expires": 9e12, "window": 0.0, "keys": [_KEY]}
HOSTILE = {
    "not-json": b"{nope",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "not-a-lease": json.dumps({**_GOOD, "_checkrun": "manifest"}).encode(),
    "version": json.dumps({**_GOOD, "version": 99}).encode(),
    "path-key": json.dumps({**_GOOD, "keys": ["../../../outside"]}).encode(),
    "upper-key": json.dumps({**_GOOD, "keys": [_KEY.upper()]}).encode(),
    "keys-not-list": json.dumps({**_GOOD, "keys": {"a": 1}}).encode(),
    "nan-expiry": json.dumps({**_GOOD, "expires": float("nan")}).encode(),
    "bool-pid": json.dumps({**_GOOD, "pid": True}).encode(),
    "kind-mismatch": json.dumps({**_GOOD, "kind": "gc"}).encode(),
    "huge": None,  # a sparse file over the size limit: refused by its size, unread
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_lease_objects_are_refused_naming_the_file(tmp_path, case):
    root = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), root / "a1.ckpt").result()
        garbage = _orphans(str(root), n=1)
        path = root / ".checkrun" / "leases" / f"{'0e' * 8}-1.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if HOSTILE[case] is None:
            with open(path, "wb") as f:
                f.truncate(17 << 20)
        else:
            path.write_bytes(HOSTILE[case])
        report = engine.gc(root)
        assert report.deleted == [] and report.problems  # what it protects is unknown: nothing goes
        assert path.name in report.problems[0] and "lease" in report.problems[0]
        if case == "huge":  # named as what it is (it was called a manifest: h94)
            assert f"is {17 << 20} bytes" in report.problems[0] and "manifest" not in report.problems[0], report.problems[0]
        assert set(garbage) <= set(stored(str(root)))
        path.unlink()
        assert engine.gc(root).deleted == garbage
    assert outside.read_bytes() == b"keep me"
    assert verify_all(str(root)) == ["a1.ckpt"]


def test_a_hostile_collection_object_fails_a_save_naming_it(tmp_path):
    root = tmp_path / "run"
    path = root / ".checkrun" / "leases" / f"gc-{'0e' * 8}-1.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"_checkrun":"lease"')
    with CheckpointEngine(config()) as engine:
        with pytest.raises(Exception, match=path.name):
            engine.save(state(1), root / "a1.ckpt").result()
        path.unlink()
        engine.save(state(1), root / "a1.ckpt").result()
    assert verify_all(str(root)) == ["a1.ckpt"]


def test_a_collection_object_declaring_an_endless_window_holds_saves_back_once_and_bounded(tmp_path, caplog):
    """A forged (or damaged) gc lease declaring a deletion window of 1e9 s made every save wait 2e9 s
    (found by an independent fuzzer). A collection widens its window to a quarter of its own lease
    (``expires - written``) at most: a save waits twice that at most, warns naming the object, and
    later saves do not wait again. (An object declaring a lease of 1e9 s too is bounded by
    MAX_COLLECTION_WINDOW, one hour: not waited for here.)"""
    root = tmp_path / "run"
    path = root / ".checkrun" / "leases" / f"gc-{'0e' * 8}-1.json"
    path.parent.mkdir(parents=True)
    now = time.time()
    path.write_bytes(LeaseRecord(path.name, "gc", "0e" * 8, 4242, 1, "another-host/boot/1", now, now + LEASE, 1e9,
                                 frozenset()).to_bytes())
    with CheckpointEngine(config()) as engine:
        for step in (1, 2):
            engine.save(state(step), root / f"a{step}.ckpt").result(timeout=120)
    warned = [r.getMessage() for r in caplog.records if "deletion window" in r.getMessage()]
    assert len(warned) == 1 and path.name in warned[0], warned
    assert verify_all(str(root)) == ["a1.ckpt", "a2.ckpt"]


def test_a_save_waits_out_the_window_of_a_collection_with_a_longer_lease_than_its_own(tmp_path, monkeypatch):
    """``checkrun gc`` with the default lease (300 s: windows of 15 s) beside a trainer configured with
    a short one: the save must wait for the collector's window, not a quarter of its own lease (the cap
    of the commit before read it so; found by an independent check)."""
    from ckpt_core.saving import lease as lease_mod

    root = tmp_path / "run"
    path = root / ".checkrun" / "leases" / f"gc-{'0e' * 8}-1.json"
    path.parent.mkdir(parents=True)
    now = time.time()
    path.write_bytes(LeaseRecord(path.name, "gc", "0e" * 8, 4242, 1, "another-host/boot/1", now, now + 40.0, 2.0,
                                 frozenset()).to_bytes())
    clock = [0.0]  # a monotonic clock that only sleeping advances
    monkeypatch.setattr(lease_mod, "_now", lambda: clock[0])
    monkeypatch.setattr(lease_mod.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    lease_mod.SaveLease(store_of(str(root)), config(lease_seconds=2.0))._wait_for_collections()
    assert clock[0] >= 2 * 2.0  # the collector's window (2 s) twice, not twice a quarter of its own 2 s


# ------------------------------------------------------------------------------ prompt collection
def test_nothing_unreferenced_is_left_after_each_commit_with_keep_last_3(any_root):
    url, opts = any_root
    with CheckpointEngine(config(opts, keep_last=3)) as engine:
        for step in range(10):
            st = {"emb": torch.randn(64, 256), "frozen": state(0)["frozen"], "step": step}
            engine.save(st, f"{url}/step={step}.ckpt").result()  # returns after the background step
            have, live = stored(url, opts), referenced(engine, url, opts)
            assert set(have) == set(live), f"after step {step}: {len(set(have) - set(live))} unreferenced"
        assert len(engine.list(url)) == 3
    assert LeaseDir(store_of(url, opts)).listing() == set()


# --------------------------------------------------------------------------------- lapsed leases
def test_a_lapsed_lease_makes_the_save_check_every_blob_again(tmp_path, monkeypatch):
    """Renewals failed for longer than the lease's validity while the save ran: a collection may
    have taken any of its blobs meanwhile (here: one it wrote). The save takes its lease again,
    finds the blob gone and writes it again before it commits."""
    from ckpt_core.saving import lease as save_lease

    root = tmp_path / "run"
    lapses: list = []
    real = save_lease.SaveLease.intact

    def intact(self):
        if not lapses:
            written = [p for p in (root / ".checkrun" / "blobs").rglob("*") if p.is_file()]
            lapses.append(written[0].parent.name + written[0].name)
            written[0].unlink()  # what a collection would have done while the lease was out
            return False
        return real(self)

    monkeypatch.setattr(save_lease.SaveLease, "intact", intact)
    with CheckpointEngine(config()) as engine:
        info = engine.save(state(1), root / "a1.ckpt").result()
    assert lapses and (root / ".checkrun" / "blobs" / lapses[0][:2] / lapses[0][2:]).exists()
    assert info.written_bytes > 0
    assert verify_all(str(root)) == ["a1.ckpt"]


# ------------------------------------------------------------------------- two writers, at random
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_two_writers_at_random_lose_no_blob(backend, tmp_path, request):
    """A (another process) and B (here) save, retain (``keep_last=1``: each removes the other's
    checkpoints) and collect in one directory, in a random order, saves overlapping; the states
    share a frozen part chosen at random, so the writers reuse each other's blobs. After every
    step every checkpoint of the directory verifies."""
    url, opts = _root(backend, tmp_path, request)
    cfg = config(opts, keep_last=1)
    rng = random.Random(21)
    a = _RemoteEngine(url, cfg, tmp_path / "a.log")
    pending: list[str] = []
    try:
        with CheckpointEngine(cfg) as b:
            for i in range(14 if backend == "s3" else 24):
                what = rng.choice(["a-save", "a-save", "b-save", "b-save", "a-gc", "b-gc", "a-wait"])
                seed = rng.randint(0, 2)
                if what == "a-save":
                    a.call("save", f"a{i}.ckpt", i, False, seed)
                    pending.append(f"a{i}.ckpt")
                elif what == "b-save":
                    b.save(state(i, seed), f"{url}/b{i}.ckpt", storage_options=opts)
                elif what == "a-gc":
                    a.call("gc", None)
                elif what == "b-gc":
                    b.gc(url, storage_options=opts)
                else:
                    for name in pending:
                        a.call("result", name)
                    pending.clear()
                    b.wait()
                    verify_all(url, opts)
            for name in pending:
                a.call("result", name)
            b.wait()
        a.call("wait")
        names = verify_all(url, opts)
        assert names  # keep_last=1 per writer's retention: the newest survive
    finally:
        a.kill()


# ------------------------------------------------------------------------------------ DCP ranks
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saves_release_their_lease_and_retention_collects_at_once(tmp_path):
    """``ckpt_core.dcp.save`` (one process, no process group): the rank's lease is held while it
    writes and released on return; the coordinator's retention collects the removed checkpoints'
    blobs right after its commit."""
    from ckpt_core import dcp as cdcp

    url = str(tmp_path / "run")
    cfg = config(keep_last=1)
    writer = cdcp.CheckrunStorageWriter(None, cfg)
    for step in range(3):
        cdcp.save({"w": torch.randn(64, 64), "frozen": state(0)["frozen"]}, f"{url}/s{step}.dcp", config=cfg,
                  writer=writer)
        assert LeaseDir(store_of(url)).listing() == set()
    with CheckpointEngine(cfg) as engine:
        assert set(stored(url)) == set(referenced(engine, url))  # nothing unreferenced left
    assert verify_all(url) == ["s2.dcp"]


def test_a_save_renews_its_lease_as_it_works(tmp_path, monkeypatch):
    """No renewal thread: the save's threads rewrite the lease (new expiry) once a quarter of
    ``lease_seconds`` has passed; a lease not renewed for 3/4 of it is no longer intact."""
    from ckpt_core.saving import lease as save_lease

    store = store_of(str(tmp_path / "run"))
    clock = [1000.0]
    monkeypatch.setattr(save_lease, "_now", lambda: clock[0])
    lease = save_lease.SaveLease(store, config())
    lease.cover([_KEY])
    first = LeaseDir(store).read(lease.name)
    clock[0] += LEASE / 8
    lease.renew_if_due()  # not due yet
    assert LeaseDir(store).read(lease.name) == first
    clock[0] += LEASE / 8 + 0.1
    lease.renew_if_due()
    second = LeaseDir(store).read(lease.name)
    assert second.written > first.written and second.expires > first.expires and second.keys == first.keys
    assert lease.intact()
    clock[0] += 0.8 * LEASE  # nothing renewed it for longer than its validity
    assert not lease.intact()
    lease.refresh()
    assert lease.intact()
    lease.release()
    assert LeaseDir(store).listing() == set()


def test_a_commit_paused_past_its_lease_whose_blob_was_collected_is_not_reported_done(tmp_path, monkeypatch):
    """The save passes its guard (lease intact, blobs there), then pauses past its lease before the
    rename while a collection deletes a blob it wrote (stood in for here: the lease reads as lapsed after
    the guard, and the blob is deleted then). Before: the manifest was renamed and the save reported
    done, a checkpoint that cannot load (found by an independent fault program with SIGSTOP and a real
    gc). Now the save fails, the manifest is removed, and the directory's checkpoints all verify."""
    from ckpt_core.errors import BackgroundSaveError
    from ckpt_core.saving import commit, lease as lease_mod

    lapsed = {"on": False}
    real_guard, real_intact = commit._guard, lease_mod.SaveLease.intact

    def guard(store, lease, manifest):
        real_guard(store, lease, manifest)
        if lapsed["on"]:  # paused here past the lease; a collection took one of the new blobs
            key = sorted(manifest.blob_keys())[0]
            os.remove(store.blob_path(key).removeprefix("file://"))
            lapsed["intact"] = False

    monkeypatch.setattr(commit, "_guard", guard)
    monkeypatch.setattr(lease_mod.SaveLease, "intact",
                        lambda self: lapsed.get("intact", True) and real_intact(self))
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"a": torch.arange(100.0)}, tmp_path / "step1.ckpt").result()
        lapsed["on"] = True
        with pytest.raises(BackgroundSaveError, match="paused past its lease"):
            engine.save({"a": torch.arange(100.0), "b": torch.full((500,), 7.0)}, tmp_path / "step2.ckpt").result()
        lapsed.clear()
        assert not (tmp_path / "step2.ckpt").exists()
        assert engine.verify(tmp_path / "step1.ckpt").ok and engine.latest(tmp_path).endswith("step1.ckpt")


def test_a_collection_whose_rounds_never_fit_the_window_stops_and_leaves_the_blobs(tmp_path, monkeypatch):
    """Reading a directory's manifests took longer than the widest deletion window (1 s per S3 GET,
    160 manifests): every round deleted nothing and read the state again, for ever, and the
    collection after a commit held the coordinator so training's next save waited (found by a fault
    proxy). Now it stops once the widest window deleted nothing; the blobs are reported pending."""
    import threading

    from ckpt_core.retain.leases import Collection, WindowClosed

    rounds = []

    def closed(self):
        rounds.append(self.window)
        raise WindowClosed("the collection round's deletion window ended")

    root = str(tmp_path / "run")
    with CheckpointEngine({"retention": {"lease_seconds": 60}}) as engine:
        engine.save({"w": torch.ones(64, 64)}, f"{root}/a.ckpt").result()
        engine.save({"w": torch.zeros(64, 64)}, f"{root}/b.ckpt").result()
        os.remove(f"{root}/a.ckpt")  # by hand: its blob is unreferenced
        monkeypatch.setattr(Collection, "guard", closed)
        out = []
        worker = threading.Thread(target=lambda: out.append(engine.gc(root)), daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "gc looped for ever"
        report = out[0]
        assert report.deleted == [] and len(report.pending) == 1
        assert rounds == [3.0, 6.0, 12.0, 15.0]  # each window doubled up to lease_seconds / 4; stopped after it
    monkeypatch.undo()
    with CheckpointEngine() as engine:
        assert len(engine.gc(root).deleted) == 1


def test_a_collection_paused_before_a_deletion_deletes_nothing_once_its_window_ended(tmp_path):
    """A collector paused between its window check and the deletion (SIGSTOP, a suspended job) deleted,
    once it woke, a blob that another writer's checkpoint committed meanwhile reused: that save had waited
    out the window and found the blob there (found by an independent fault program). A local blob is now
    moved aside, the window checked again, and a move that came too late is undone."""
    root = tmp_path / "run"
    url = f"faultfile://{root}"
    x = state(1)
    with CheckpointEngine(config()) as a:
        a.save(x, f"{url}/old.ckpt").result()
        a.remove(f"{url}/old.ckpt")  # its blobs are garbage now
        gate = Gate("move", "blob")  # the collector stops right after its window check
        FaultFS.policy = gate
        reports = []
        collector = threading.Thread(target=lambda: reports.append(a.gc(url, grace_seconds=0)))
        collector.start()
        assert gate.entered.wait(WATCHDOG)
        with CheckpointEngine(config()) as b:  # the restarted trainer: waits out a's window, reuses the blobs
            assert b.save(x, f"{url}/new.ckpt").result().reused_blobs > 0
        gate.release()
        collector.join(WATCHDOG)
    FaultFS.policy = None
    held = Path(gate.held_path)  # moved aside when the collector woke, after its window: put back
    key = held.parent.name + held.name
    assert reports and held.exists() and key in referenced(CheckpointEngine(config()), str(root))
    assert verify_all(str(root)) == ["new.ckpt"]
    assert not [p for p in root.rglob("*") if ".gc.tmp-" in p.name]


def test_a_blob_moved_aside_by_a_killed_collection_is_put_back_by_the_next(tmp_path):
    """Killed between moving a blob aside and checking its window again, a collection leaves the blob
    under a temp name; the next collection gives it its name back when it is missing (a checkpoint may
    need it), and deletes the temp file otherwise."""
    from ckpt_core.storage.atomic import temp_path, temp_prefix

    root = tmp_path / "run"
    with CheckpointEngine(config()) as engine:
        engine.save(state(1), root / "c.ckpt").result()
        blobs = sorted(p for p in (root / ".checkrun" / "blobs").rglob("*") if p.is_file())
        asides = []
        for blob, keep in zip(blobs[:2], (False, True)):
            aside = Path(temp_path(str(blob), temp_prefix(blob.name) + ".gc"))
            (os.link if keep else os.rename)(blob, aside)  # keep: a save wrote the blob again since
            old = time.time() - 2 * LEASE  # its writer gone as far as age tells
            os.utime(aside, (old, old))
            asides.append(aside)
        assert not engine.verify(root / "c.ckpt").ok
        engine.gc(root)
        assert engine.verify(root / "c.ckpt").ok
    assert not any(a.exists() for a in asides) and all(b.exists() for b in blobs[:2])


def test_a_save_of_many_blobs_spreads_its_keys_over_lease_objects(tmp_path, monkeypatch):
    """Publishing a key rewrites at most PART_KEYS keys, not every key so far (h150: a save of 10,000 small
    blobs rewrote one growing lease per blob, quadratic); a collector reads every object, so all keys stay
    protected; renewal, expiry on abandon and release cover every object."""
    from ckpt_core.retain.leases import read_protection
    from ckpt_core.saving import lease as save_lease

    monkeypatch.setattr(save_lease, "PART_KEYS", 100)
    store = store_of(str(tmp_path / "run"))
    ldir = LeaseDir(store)
    written: list[int] = []
    real_write = LeaseDir.write
    monkeypatch.setattr(LeaseDir, "write", lambda self, rec: (written.append(len(rec.keys)), real_write(self, rec)))
    clock = [1000.0]
    monkeypatch.setattr(save_lease, "_now", lambda: clock[0])
    lease = save_lease.SaveLease(store, config())
    keys = [f"{i:032x}" for i in range(1, 351)]
    for key in keys:
        lease.cover([key])
    assert len(written) == 350 and max(written) <= 100  # before: the i-th write named i keys
    assert read_protection(ldir).live == set(keys) and len(ldir.listing()) == 4
    assert read_protection(ldir).leases == 1  # one save in flight, not one per lease object (h153)
    written.clear()
    clock[0] += LEASE / 4 + 0.1
    lease.renew_if_due()
    assert sorted(written) == [50, 100, 100, 100] and lease.intact()
    clock[0] += 0.8 * LEASE  # one object stale is enough for the lease to have lapsed
    lease.cover([f"{0:032x}"])
    assert not lease.intact()
    lease.abandon()
    assert read_protection(ldir).live == set() and len(read_protection(ldir).dead) == 4
    lease = save_lease.SaveLease(store, config())
    for key in keys[:150]:
        lease.cover([key])
    assert len(ldir.listing()) == 6
    lease.release()
    assert len(ldir.listing()) == 4  # the abandoned lease's objects, left for the next collection
