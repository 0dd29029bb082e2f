"""Two engines in two processes writing to one directory, both with retention and gc after every
save: neither may delete a blob that the other's in-flight or committed checkpoint needs.

Engine A runs in a child process and is driven command by command; engine B runs here. Gates in
the storage of either process hold a save or a garbage collection at the exact point of a race
while the other engine acts, never sleeping. Leases protect saves in flight (no grace period):
blobs are aged (``os.utime``) where earlier versions relied on their age, to show it no longer
matters. ``lease_seconds`` is short so that a save that meets a collection in progress waits
briefly (twice its deletion window, ``leases.Collection``).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig

from . import crash_child, harness
from ckpt_core.testing.faults import FaultFS, Gate, Permanent

GRACE = 600.0
WATCHDOG = 120


def shared_config() -> EngineConfig:
    return EngineConfig.from_dict({
        "compression": {"chunk_bytes": 16384},
        "retention": {"keep_last": 1, "gc_grace_seconds": GRACE, "gc_after_save": True, "lease_seconds": 8.0},
        "saving": {"sigterm_grace_seconds": None},
        "storage": {"fsync": False},  # durability against power loss is not what is tested here
    })


class RemoteEngine:
    """Engine A: a CheckpointEngine in another process (``crash_child.engine_server``)."""

    def __init__(self, root: str, log: Path) -> None:
        ctx = harness.context()
        self.conn, child = ctx.Pipe()
        self.events, events_child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=crash_child.engine_server,
                                args=(child, events_child, root, shared_config().to_dict(), str(log)),
                                daemon=True)
        self.proc.start()
        child.close()
        events_child.close()

    def call(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(WATCHDOG), f"engine A did not answer {cmd}"
        status, value = self.conn.recv()
        if status == "err":
            raise AssertionError(f"engine A: {cmd[0]} failed: {value}")
        return value

    def entered(self) -> str:
        assert self.events.poll(WATCHDOG), "engine A never reached its gate"
        return self.events.recv()[1]

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("release")
            except AssertionError:
                pass
            self.call("close")
        self.proc.join(WATCHDOG)


@pytest.fixture
def shared(tmp_path):
    root = tmp_path / "run"
    a = RemoteEngine(f"faultfile://{root}", tmp_path / "engine-a.log")
    b = CheckpointEngine(shared_config())
    yield root, a, b
    FaultFS.policy = None
    a.close()
    b.close()


def age_blobs(root: Path, seconds: float) -> int:
    """Make every blob now in the store look ``seconds`` old (time passing, without waiting)."""
    then = time.time() - seconds
    n = 0
    for path in (root / ".checkrun" / "blobs").rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))
            n += 1
    return n


def assert_all_intact(root: Path) -> list[str]:
    with CheckpointEngine(shared_config()) as engine:
        names = [e.name for e in engine.list(root)]
        for name in names:
            report = engine.verify(root / name)
            assert report.ok, report.problems
    return names


def assert_state(root: Path, name: str, version: int, frozen_seed: int = 0) -> None:
    with CheckpointEngine(shared_config()) as engine:
        got = engine.load(root / name)
    want = crash_child.versioned_state(version, frozen_seed)
    assert got["version"] == version
    assert torch.equal(got["frozen"], want["frozen"]) and torch.equal(got["w"], want["w"])


def test_inflight_blobs_survive_the_other_engines_retention_and_gc(shared):
    root, a, b = shared
    a.call("save", "a1.ckpt", 1, True, 0)
    a.call("arm", "open", "manifest", 1)  # a2: every blob written, the commit held
    a.call("save", "a2.ckpt", 2, False, 0)
    a.entered()
    for v in (3, 4):  # B's retention removes a1 (and b3); its gc sees a2's uncommitted blobs
        b.save(crash_child.versioned_state(v, frozen_seed=1), f"{root}/b{v}.ckpt").result()
    report = b.gc(root)
    assert report.kept_leased >= 1 and report.leases == 1  # a2's fresh blobs: unreferenced, leased
    a.call("release")
    a.call("result", "a2.ckpt")
    assert_state(root, "a2.ckpt", 2)
    assert "a2.ckpt" in assert_all_intact(root)


def test_reused_blob_collected_before_the_writers_check_is_written_again(shared):
    root, a, b = shared
    a.call("save", "a1.ckpt", 1, True, 0)
    assert age_blobs(root, 2 * GRACE) > 0  # a1's blobs are now old enough to collect
    a.call("arm", "open", "blob", 1)  # a2 reuses a1's frozen blobs; held at its first new blob
    a.call("save", "a2.ckpt", 2, False, 0)
    a.entered()
    b.save(crash_child.versioned_state(3, frozen_seed=1), f"{root}/b3.ckpt").result()
    assert not (root / "a1.ckpt").exists()  # B's retention removed a1, B's gc its old blobs
    a.call("release")
    a.call("result", "a2.ckpt")  # A's pre-commit check found the frozen blobs gone: rewrote them
    assert_state(root, "a2.ckpt", 2)
    assert_all_intact(root)


def test_reused_blob_collected_between_the_writers_check_and_its_commit(shared):
    root, a, b = shared
    a.call("save", "a1.ckpt", 1, True, 0)
    age_blobs(root, 2 * GRACE)
    a.call("arm", "open", "manifest", 1)  # a2: checked its reused blobs, the commit held
    a.call("save", "a2.ckpt", 2, False, 0)
    a.entered()
    b.save(crash_child.versioned_state(3, frozen_seed=1), f"{root}/b3.ckpt").result()
    a.call("release")
    a.call("result", "a2.ckpt")
    assert_state(root, "a2.ckpt", 2)
    assert_all_intact(root)


def _b_saves_in_background(b, url: str, errors: list) -> threading.Thread:
    def run() -> None:
        try:
            b.save(crash_child.versioned_state(3, frozen_seed=1), f"{url}/b3.ckpt").result()
        except Exception as exc:  # noqa: BLE001 - asserted by the caller
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_commit_during_the_other_engines_gc_listing_keeps_its_reused_blobs(shared):
    root, a, b = shared
    a.call("save", "a1.ckpt", 1, True, 0)
    age_blobs(root, 2 * GRACE)
    # B's save b3 -> retention removes a1 (reading b3: reads 1-2) -> the collection of a1's blobs has
    # read the leases and listed the manifests (a2 is not among them) and is held reading b3 (read 3).
    gate = Gate("read", "manifest", 3, match="b3.ckpt")
    FaultFS.policy = gate
    errors: list = []
    t = _b_saves_in_background(b, f"faultfile://{root}", errors)
    assert gate.entered.wait(WATCHDOG)
    a.call("save", "a2.ckpt", 2, True, 0)  # a2 reuses a1's old frozen blobs and commits
    gate.release()
    t.join(WATCHDOG)
    assert errors == []
    assert_state(root, "a2.ckpt", 2)
    assert_all_intact(root)


def test_a_collection_deletes_nothing_it_chose_before_a_save_took_its_lease(shared):
    """B's full gc has read leases and manifests (a1 removed: its frozen blob is unreferenced) and is
    held before listing the blobs; A's save a2 then reuses that blob and commits. A's lease came
    after B's reads, so A waited out B's deletion window before checking the blob; B, released, finds
    its window over and reads leases and manifests again: a2 references the blob, it stays."""
    root, a, b = shared
    a.call("save", "a1.ckpt", 1, True, 0)
    with CheckpointEngine(shared_config()) as engine:
        frozen = next(t for t in engine.read_manifest(root / "a1.ckpt").tensors if t.key == "frozen")
        engine.remove(root / "a1.ckpt")
    key = frozen.base[0].blob.key
    gate = Gate("list", "blob", 1)
    FaultFS.policy = gate
    reports: list = []
    t = threading.Thread(target=lambda: reports.append(b.gc(f"faultfile://{root}")))
    t.start()
    assert gate.entered.wait(WATCHDOG)
    a.call("save", "a2.ckpt", 2, True, 0)  # reuses the frozen blobs and commits
    gate.release()
    t.join(WATCHDOG)
    assert key not in reports[0].deleted
    assert_state(root, "a2.ckpt", 2)
    assert_all_intact(root)


def test_gc_collects_nothing_while_a_manifest_cannot_be_read(tmp_path, sleeps):
    root = tmp_path / "run"
    with CheckpointEngine(shared_config().replace(**{"retention.keep_last": None})) as engine:
        engine.save(crash_child.versioned_state(1), root / "a1.ckpt").result()
        engine.save(crash_child.versioned_state(2, frozen_seed=1), root / "a2.ckpt").result()
        age_blobs(root, 2 * GRACE)
        before = sorted(p.name for p in (root / ".checkrun" / "blobs").rglob("*") if p.is_file())
        engine.remove(root / "a2.ckpt")  # a2's blobs are garbage now; a1's are not
        # a1 cannot be read (permission, outage): its references are unknown
        FaultFS.policy = Permanent(PermissionError(13, "Permission denied"), ops=("read",), kind="manifest")
        report = engine.gc(f"faultfile://{root}")
        FaultFS.policy = None
        assert report.deleted == [] and report.problems
        after = sorted(p.name for p in (root / ".checkrun" / "blobs").rglob("*") if p.is_file())
        assert after == before
        assert_state(root, "a1.ckpt", 1)
