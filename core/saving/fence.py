"""Commit fencing: a save never replaces a newer manifest of the same name, and a writer process
whose training process died commits nothing (it never commits: see below).

Every snapshot gets a ``CommitStamp`` when it is captured (on the training thread): the wall clock
in nanoseconds, the random id of the capturing process and a sequence number counting that
process's snapshots. The stamp is written into the manifest (field ``commit``; canonical JSON sorts
it right after the checksum, so it lies in the first ~150 bytes). Right before the commit - after
the temp file is written and fsynced and before the rename; before the PUT - ``commit_guard`` reads
the head of the manifest about to be replaced and refuses with ``SupersededError`` if that one is
newer:

* same writer id (one process): the higher sequence number is newer - capture order, which a wall
  clock stepping back cannot reorder;
* different writers (another process, a restarted trainer, another host): the later wall-clock
  time is newer, the writer id breaking a tie.

A stamp claiming to be newer is believed only if that manifest's checksum matches its bytes: a
damaged manifest never blocks a save. A file without a stamp (a manifest of an older checkrun, a DCP
manifest, not a checkrun file at all) is replaced as before.

Superseded is an error: the save did not do what was asked (its state is not at that path), so it
surfaces like any failed save (``BackgroundSaveError`` whose cause is ``SupersededError``). Its
message names the file and both stamps. In practice it means two writers save to one name (two jobs
on one directory, or a restarted trainer whose old writer is still finishing); across hosts it can
also mean a clock running behind the one that wrote the newer manifest.

The check and the rename/PUT are two steps. On S3 the PUT is a compare-and-swap: conditional on the
ETag of the object as it was before the check (``storage.commit.SinglePutCommit``), so a newer
manifest committed in between (or while the writer was paused there) fails the PUT and the check runs
again. Remaining race: locally, a newer manifest committed between the check and our rename (a few
microseconds: one small read, one comparison) is overwritten (a rename cannot be conditional).

The writer process (``saving.background: process``) never commits itself: it writes the blobs and
the manifest's bytes, then hands them to the training process, whose coordinator thread runs the
fence and the rename/PUT (``process.WriterProcess.commit``). A training process that died commits
nothing, wherever its writer was paused; only a live one can commit, as in thread mode.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, SupersededError
from ..format.manifest import FUTURE_SLACK_SECONDS, checksum_matches
from ..storage.store import WHOLE_READ_BYTES

if TYPE_CHECKING:
    from ..storage.store import Store

log = logging.getLogger("ckpt_core")

#: Bytes read from the head of a manifest to find its stamp (it ends before byte ~170).
HEAD_BYTES = 512
_STAMP_RE = re.compile(rb'\{"_checkrun":"manifest","checksum":"[0-9a-f]{32}",'
                       rb'"commit":\{"ns":(\d{1,20}),"seq":(\d{1,20}),"writer":"([0-9a-f]{1,32})"\}')


@dataclass(frozen=True)
class CommitStamp:
    """When and by whom a snapshot was captured; orders commits of one name (``newer_than``)."""

    ns: int
    """``time.time_ns()`` at capture, never less than the previous stamp of this process."""
    writer: str
    """Random hex id of the capturing process (new in a forked child)."""
    seq: int
    """1, 2, ... in capture order within the process."""

    def newer_than(self, other: "CommitStamp") -> bool:
        """Whether this stamp's snapshot is newer than ``other``'s (equal stamps: same snapshot)."""
        if self.writer == other.writer:
            return self.seq > other.seq
        return (self.ns, self.writer) > (other.ns, other.writer)

    def to_json(self) -> dict:
        """The manifest's ``commit`` field."""
        return {"ns": self.ns, "seq": self.seq, "writer": self.writer}


class _Clock:
    lock = threading.Lock()
    writer = uuid.uuid4().hex[:16]
    seq = itertools.count(1)
    last_ns = 0


def _forked() -> None:
    # A forked child that saves is another writer: it must not continue the parent's sequence.
    _Clock.lock = threading.Lock()
    _Clock.writer = uuid.uuid4().hex[:16]
    _Clock.seq = itertools.count(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def new_stamp() -> CommitStamp:
    """The stamp of a snapshot captured now (any thread; stamps of one process strictly increase)."""
    with _Clock.lock:
        ns = _Clock.last_ns = max(time.time_ns(), _Clock.last_ns + 1)
        return CommitStamp(ns, _Clock.writer, next(_Clock.seq))


def observe(commit: Optional[dict]) -> None:
    """A checkpoint with this commit stamp (``Manifest.commit``) was loaded: this process's later stamps are
    newer than it, unless it lies more than ``FUTURE_SLACK_SECONDS`` ahead of this host's clock (h127: a host
    whose clock ran 10-30 s behind the one that wrote it saved checkpoints older than the one it resumed
    from, and its retention deleted them). Stamps order checkpoints (``created`` is the stamp's time)."""
    ns = commit.get("ns") if isinstance(commit, dict) else None
    if isinstance(ns, int) and ns <= time.time_ns() + int(FUTURE_SLACK_SECONDS * 1e9):
        with _Clock.lock:  # 1 us past it: ``created`` (a float, ~240 ns apart at this epoch) orders them too (h129)
            _Clock.last_ns = max(_Clock.last_ns, ns + 1000)


def clock_ns() -> int:
    """This process's stamp clock (``time_ns`` of its latest stamp, or past a loaded checkpoint's)."""
    return _Clock.last_ns


def follow(ns: int) -> None:
    """Later stamps of this process are past ``ns``: another process's ``clock_ns`` (h137: DCP's saving process
    stamped a save after a load of the training process as older than the loaded checkpoint)."""
    with _Clock.lock:
        _Clock.last_ns = max(_Clock.last_ns, int(ns))


def read_stamp(head: bytes) -> Optional[CommitStamp]:
    """The stamp in the first bytes of a manifest, or None (no stamp, or not a manifest)."""
    m = _STAMP_RE.match(head)
    return CommitStamp(int(m.group(1)), m.group(3).decode(), int(m.group(2))) if m else None


class ReplacedManifest:
    """What the fence found at the name it let a commit replace: the bytes of the intact stamped manifest it
    read there (None: none, or not read), whose blobs the collection after the commit looks at."""

    data: Optional[bytes] = None


def commit_guard(store: "Store", name: str, stamp: CommitStamp,
                 replaced: Optional[ReplacedManifest] = None) -> Callable[[], None]:
    """The check ``Store.write_manifest`` runs right before the rename/PUT of ``name``: raises
    ``SupersededError`` when the manifest in place is newer than ``stamp``; records in ``replaced`` the
    manifest it read there."""

    def check() -> None:
        existing, data = _existing_stamp(store, name)
        if replaced is not None:
            replaced.data = data
        if existing is not None and existing.newer_than(stamp):
            mine = existing.writer == stamp.writer
            error = SupersededError(
                f"{store.url(name)} not committed: a newer checkpoint of that name was committed by "
                f"{'a later save of this process' if mine else 'another writer'} meanwhile (its stamp "
                f"{existing.to_json()}, this save's {stamp.to_json()}); it is kept. "
                + ("" if mine else "Two writers save to one name, or this host's clock is behind theirs"))
            error.same_process = mine
            raise error

    return check


def _existing_stamp(store: "Store", name: str) -> tuple[Optional[CommitStamp], Optional[bytes]]:
    """The stamp of the manifest now at ``name`` if it has one and is intact, else None; with its bytes."""
    try:
        head = store.read_head(name, WHOLE_READ_BYTES)  # a manifest under it is read whole, in one GET
        if len(head) < HEAD_BYTES and read_stamp(head) is None:  # too short for a stamp: a HEAD that said fewer
            head = store.read_manifest(name)  # bytes cut the read? (h131: 0-130 bytes let an older save replace it)
        stamp = read_stamp(head[:HEAD_BYTES])
        if stamp is None:
            return None, None
        # claims to be newer: believe it only if it is intact (read once more before it counts as damaged: a
        # HEAD that said fewer bytes cut the first read, and an older save replaced the newer one, h129)
        data = head if len(head) < WHOLE_READ_BYTES and checksum_matches(head) else store.read_manifest(name)
    except CheckpointNotFoundError:
        return None, None
    except CorruptCheckpointError as exc:  # read_manifest: larger than any manifest may be
        log.warning("checkrun: replacing %s: %s", store.url(name), exc)
        return None, None
    stamp = read_stamp(data[:HEAD_BYTES])
    if stamp is None or not checksum_matches(data):
        log.warning("checkrun: replacing %s: its checksum does not match (damaged)", store.url(name))
        return None, None
    ahead = stamp.ns / 1e9 - time.time()
    if ahead > FUTURE_SLACK_SECONDS:
        log.warning("checkrun: replacing %s: its commit stamp lies %.0f s ahead of this host's clock (a clock "
                    "running ahead, or forged)", store.url(name), ahead)
        return None, data
    return stamp, data
