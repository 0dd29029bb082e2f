"""Lease objects: what protects the blobs of saves in flight from garbage collection, in any process.

Objects under ``<dir>/.checkrun/leases/`` (small JSON, each written in one atomic step like a blob):

* ``<writer>-<n>.json``, kind ``save``: one save in flight (``save_lease.SaveLease``): its process
  (writer id, pid, start time, host key: ``owner``), when it was written and when it expires (the
  writer's clock), and the keys of every blob the save writes or reuses.
* ``gc-<writer>-<n>.json``, kind ``gc``: a collection in progress (``Collection``) and its *window*:
  after writing a version of it, the collection issues deletions for at most ``window`` seconds.

A lease is *live* until its expiry, unless its process is certainly gone (same host key, see
``owner``); a collection deletes no blob a live lease names. Expiry compares the expiry the writer
wrote (writer's clock) with the collector's clock, and also the lease's lifetime with the age of its
object on the storage's clock (its mtime): a lease is live while either says so. A collection measures
the storage's clock against its own host's (``storage_now``, from the mtime of the object it wrote) and
dates temp files and blobs by it too, so a host whose clock is off (a writer behind, a collector ahead:
h165 lost committed checkpoints at 10 minutes) neither loses leases nor has files taken for old; an
offset over ``SKEW_WARN_SECONDS`` is logged. Every object
read is validated before use (size, JSON shape, types, keys as hex digests): anything else is a
``FormatError`` naming the file, and a collection that meets one deletes nothing. Names are matched
against a fixed pattern and joined to the lease directory, never taken as paths.

The ordering argument (why a blob a save writes or reuses is never deleted) is in
docs/operations.md, "Leases"; ``retention`` runs collections, ``save_lease`` the saves' side.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

from ..storage import owner
from ..errors import CheckpointNotFoundError, CheckrunError, CorruptCheckpointError, FormatError
from ..format.dtypes import is_blob_key
from ..format.limits import json_shape
from ..storage.paths import FileInfo
from ..storage.store import LEASE_DIR, Store

log = logging.getLogger("ckpt_core")

#: A lease lists ~35 bytes per key: 16 MiB is ~480k blobs (7 TiB in 16 MiB chunks).
MAX_LEASE_BYTES = 16 << 20
_MAGIC = "lease"
_VERSION = 1
_NAME_RE = re.compile(r"(gc-)?[0-9a-f]{16}-[0-9]{1,12}\.json")
_WRITER_RE = re.compile(r"[0-9a-f]{1,32}")
_SEQ = itertools.count(1)


def new_name(kind: str = "save") -> str:
    """A fresh lease object name for this process (``gc-`` in front for a collection)."""
    return f"{'gc-' if kind == 'gc' else ''}{owner.writer_id()}-{next(_SEQ)}.json"


@dataclass(frozen=True)
class LeaseRecord:
    """One lease object as read (or about to be written)."""

    name: str
    kind: str
    writer: str
    pid: int
    start: int
    host: str
    written: float
    expires: float
    window: float = 0.0
    keys: frozenset = frozenset()

    def gone(self) -> bool:
        """Its process has certainly ended (only decidable on the same host: ``owner.is_gone``)."""
        return owner.is_gone(self.host, self.pid, self.start)

    def live(self, now: float, stored: float | None = None, storage_now: float | None = None) -> bool:
        """Whether it still protects (``now``: the reader's ``time.time()``; ``stored``: the object's mtime and
        ``storage_now``, both on the storage's clock: live while younger than its lifetime there too)."""
        if self.gone():
            return False
        lifetime = min(self.expires - self.written, MAX_LIFETIME)  # a forged or damaged object: bounded (h167)
        aged = stored is not None and storage_now is not None and storage_now <= stored + lifetime
        # by its expiry only if written less than a day ahead of this clock: a writer years ahead kept it (h169)
        return (now <= self.expires and self.written <= now + MAX_LIFETIME) or aged

    def to_bytes(self) -> bytes:
        body = {"_checkrun": _MAGIC, "version": _VERSION, "kind": self.kind, "writer": self.writer,
                "pid": self.pid, "start": self.start, "host": self.host, "written": self.written,
                "expires": self.expires, "window": self.window, "keys": sorted(self.keys)}
        return json.dumps(body, separators=(",", ":")).encode()


def record(name: str, kind: str, seconds: float, keys: frozenset = frozenset(), window: float = 0.0,
           expired: bool = False) -> LeaseRecord:
    """A record of this process written now, expiring in ``seconds`` (at once if ``expired``)."""
    ident = owner.identity()
    now = time.time()
    return LeaseRecord(name, kind, ident["writer"], ident["pid"], ident["start"], ident["host"], now,
                       0.0 if expired else now + seconds, window, frozenset(keys))


def parse(data: bytes, where: str) -> LeaseRecord:
    """Validate and decode a lease object; ``FormatError`` naming ``where`` for anything else."""
    if len(data) > MAX_LEASE_BYTES:
        raise FormatError(f"lease {where}: {len(data)} bytes, more than the limit of {MAX_LEASE_BYTES}")
    if data.count(b"[") + data.count(b"{") > 64 and json_shape(data)[2] > 8:  # json.loads recurses (C stack)
        raise FormatError(f"lease {where}: JSON nested deeper than a lease object")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"lease {where}: not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(body, dict) or body.get("_checkrun") != _MAGIC:
        raise FormatError(f"lease {where}: not a checkrun lease object")
    if body.get("version") != _VERSION:
        raise FormatError(f"lease {where}: unknown lease version {str(body.get('version'))[:20]!r}")
    kind = _field(body, "kind", str, where)
    if kind not in ("save", "gc"):
        raise FormatError(f"lease {where}: unknown kind {kind[:20]!r}")
    writer = _field(body, "writer", str, where)
    host = _field(body, "host", str, where)
    if not _WRITER_RE.fullmatch(writer) or len(host) > 512:
        raise FormatError(f"lease {where}: invalid writer or host field")
    pid, start = _field(body, "pid", int, where), _field(body, "start", int, where)
    if not (0 <= pid < 2**32 and 0 <= start < 2**64):
        raise FormatError(f"lease {where}: pid or start out of range")
    written, expires, window = (_number(body, k, where) for k in ("written", "expires", "window"))
    keys = _field(body, "keys", list, where)
    if not all(is_blob_key(k) for k in keys):
        raise FormatError(f"lease {where}: 'keys' must be blob keys (32-64 lowercase hex digits)")
    name = where.rstrip("/").rpartition("/")[2]
    return LeaseRecord(name, kind, writer, pid, start, host, written, expires, window, frozenset(keys))


def _field(body: dict, name: str, typ: type, where: str):
    value = body.get(name)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise FormatError(f"lease {where}: field {name!r} missing or not {typ.__name__}")
    return value


def _number(body: dict, name: str, where: str) -> float:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FormatError(f"lease {where}: field {name!r} must be a finite number >= 0")
    return float(value)


class LeaseDir:
    """The lease objects of one store (any thread). Lease writes are not fsynced: a lease matters
    only while its writer runs, and a power loss ends the writer too."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.path = f"{store.root.rstrip('/')}/{LEASE_DIR}"
        config = dataclasses.replace(store.config, fsync=False)
        self._raw = Store(store.fs, self.path, config, store.url_prefix)  # the lease directory

    def url(self, name: str) -> str:
        return self.store.url(f"{LEASE_DIR}/{name}")

    @staticmethod
    def _checked(name: str) -> str:
        if not _NAME_RE.fullmatch(name):
            raise CheckrunError(f"invalid lease name {name[:80]!r}")  # never from outside: our own names
        return name

    def write(self, rec: LeaseRecord) -> None:
        """Write (or replace) a lease object in one atomic step."""
        self._raw.put_file(self._checked(rec.name), rec.to_bytes())

    def delete(self, name: str) -> None:
        """Delete a lease object; a missing one is not an error."""
        self._raw.delete_manifest(self._checked(name))

    def listing(self) -> set[str]:
        """Names of the files in the lease directory (lease objects, temp files)."""
        return set(self.infos())

    def infos(self) -> dict[str, FileInfo]:
        """The files in the lease directory by name, with their mtimes (the storage's clock)."""
        return {f.name: f for f in self._raw.list_files(include_temp=True)}

    def names(self, prefix: str = "", listing: set[str] | None = None) -> list[str]:
        """Names of the lease objects (other files are ignored), sorted."""
        listing = self.listing() if listing is None else listing
        return sorted(n for n in listing if _NAME_RE.fullmatch(n) and n.startswith(prefix))

    def read(self, name: str) -> Optional[LeaseRecord]:
        """A lease object, validated; None if it is gone (released meanwhile)."""
        try:
            data = self._raw.read_manifest(self._checked(name), MAX_LEASE_BYTES, what="lease")
        except CheckpointNotFoundError:
            return None
        except CorruptCheckpointError as exc:  # larger than the limit
            raise FormatError(str(exc)) from None
        rec = parse(data, self.url(name))
        if rec.kind != ("gc" if name.startswith("gc-") else "save"):
            raise FormatError(f"lease {self.url(name)}: kind {rec.kind!r} does not match its name")
        return rec

    def read_all(self, prefix: str = "", listing: set[str] | None = None) -> list[LeaseRecord]:
        """Every lease object (whose name starts with ``prefix``) that still exists, validated."""
        recs = self.store.map(self.read, self.names(prefix, listing))
        return [r for r in recs if r is not None]


@dataclass
class Protection:
    """What the lease objects of a directory protect, as one collection round read them."""

    live: set = dataclasses.field(default_factory=set)
    """Keys named by live save leases."""
    dead: list = dataclasses.field(default_factory=list)
    """Save leases and collection objects whose writer died or that expired (removed by the collector;
    the keys of save leases among them are candidates: their saves never committed, or did)."""
    leases: int = 0
    """Live save leases."""
    dead_temp: bool = False
    """A lease write of a process that ended left its temp file (it died before its first lease)."""

    @property
    def writer_died(self) -> bool:
        """Whether a writer died here (or a save failed): its leftovers need a full collection."""
        return bool(self.dead) or self.dead_temp


#: The longest a lease lives by the age of its object: a day (``lease_seconds`` is minutes; a save's ``hold``
#: rewrites it); a forged or damaged lifetime (``written: 0``) would otherwise protect its blobs for decades.
MAX_LIFETIME = 86400.0
#: Storage clock minus this host's, per directory, as its latest collection measured it (``storage_now``).
_OFFSETS: dict[str, float] = {}
_WARNED: set[tuple[str, str]] = set()
#: A difference below this is timestamp granularity and request latency, not a clock that is off.
SKEW_IGNORE_SECONDS = 2.0
#: A clock this far off the storage's is logged (once per directory and host): retention's order and the
#: commit stamps use the hosts' clocks too.
SKEW_WARN_SECONDS = 30.0


def storage_now(store: Store) -> float:
    """``time.time()`` on the storage's clock of ``store``'s directory, as its latest collection measured it."""
    return time.time() + _OFFSETS.get(store.url(""), 0.0)


def _skew(ldir: LeaseDir, who: str, seconds: float) -> None:
    key = (ldir.store.url(""), who)
    if abs(seconds) >= SKEW_WARN_SECONDS and key not in _WARNED and len(_WARNED) < 1024:
        _WARNED.add(key)
        log.warning("checkrun: the clock of %s is %.0f s %s the storage's (%s): leases and file ages are judged on "
                    "the storage's clock; synchronise the clocks (NTP): the order of checkpoints uses them too", who,
                    abs(seconds), "behind" if seconds > 0 else "ahead of", ldir.store.url(""))


def clock_offset(ldir: LeaseDir, infos: dict[str, FileInfo], written: dict[str, float]) -> float:
    """The storage's clock minus this host's, from the mtime of the objects this process wrote (``written``: name
    -> its ``written``, this host's clock) in the listing ``infos``; 0 if none is listed or it is within
    ``SKEW_IGNORE_SECONDS``. Also kept for ``storage_now``."""
    mine = [(w, infos[n].mtime - w) for n, w in written.items() if n in infos and infos[n].dated]
    if not mine:
        return _OFFSETS.get(ldir.store.url(""), 0.0)
    offset = max(mine)[1]  # the latest write
    offset = _OFFSETS[ldir.store.url("")] = offset if abs(offset) >= SKEW_IGNORE_SECONDS else 0.0
    _skew(ldir, "this host", offset)
    return offset


def read_protection(ldir: LeaseDir, exclude: str = "", written: float | None = None) -> Protection:
    """The live keys and the dead objects of ``ldir`` (``exclude``: the reader's own collection object, which
    it wrote at ``written`` by its clock: the storage's clock is measured against it)."""
    prot = Protection()
    now, infos = time.time(), ldir.infos()
    storage = now + clock_offset(ldir, infos, {exclude: written} if written is not None else {})
    listing = set(infos) - {exclude}
    prot.dead_temp = any(".tmp-" in n and owner.temp_writer_gone(n) for n in listing)
    savers = set()
    for rec in ldir.read_all(listing=listing):
        stored = infos[rec.name].mtime if rec.name in infos and infos[rec.name].dated else None  # else: expiry
        if stored is not None:  # once per host (its processes share its clock: h167)
            _skew(ldir, f"host {rec.host[:200]}", stored - rec.written)
        if not rec.live(now, stored, storage):
            prot.dead.append(rec)
        elif rec.kind == "save":
            prot.live |= rec.keys
            savers.add((rec.host, rec.pid, rec.start, rec.writer))
    prot.leases = len(savers)  # per process: a save of many blobs holds several lease objects (h153)
    return prot


class WindowClosed(CheckrunError):
    """A collection's deletion window ended (raised by ``Collection.guard``; the deletion waits for
    the next round)."""


class Collection:
    """A collection in progress, as ``gc-<writer>-<n>.json`` (the thread running the collection).

    Each round starts with ``begin_round`` (the object written again: saves that write their lease
    after this see it and wait); deletions pass ``guard`` only within ``window`` seconds of the start
    of that write, measured on this process's monotonic clock. ``end`` removes the object."""

    def __init__(self, store: Store, lease_seconds: float) -> None:
        self.dir = LeaseDir(store)
        self.name = new_name("gc")
        self.lease_seconds = lease_seconds
        self.window = lease_seconds / 20
        self._deadline = 0.0
        self._written = False
        self.written: float | None = None
        """When this host's clock said it last wrote its object (None before)."""

    def begin_round(self) -> None:
        """Write this collection's object again; deletions may run for ``window`` seconds from now."""
        t0 = time.monotonic()
        rec = record(self.name, "gc", self.lease_seconds, window=self.window)
        self.dir.write(rec)
        self._written, self.written = True, rec.written
        self._deadline = t0 + self.window

    def widen(self) -> None:
        """A round ran out of time before deleting anything (slow listings): longer rounds."""
        self.window = min(2 * self.window, self.lease_seconds / 4)

    def guard(self) -> None:
        """Refuse a deletion after the round's window (``Store.delete_blob``'s guard)."""
        if time.monotonic() >= self._deadline:
            raise WindowClosed("the collection round's deletion window ended")

    def end(self) -> None:
        """Remove the object (after the last deletion returned); an error only expires it later."""
        if not self._written:
            return
        try:
            self.dir.delete(self.name)
        except CheckrunError as exc:
            log.warning("checkrun: could not remove %s (it expires by itself): %s", self.dir.url(self.name), exc)


def linked_blobs(store: Store) -> str | None:
    """Why nothing may be collected from a local directory: its ``.checkrun`` (or the blobs, step-log
    or lease folder in it) is a symbolic link, so what it holds may belong to another directory's
    checkpoints, which this collection does not see (a gc there deleted blobs another directory's
    committed checkpoints needed, and through a linked ``steplog`` folder another directory's whole step
    log: found by checks of hostile layouts)."""
    if not store.is_local:
        return None
    for sub in (".checkrun", ".checkrun/blobs", ".checkrun/steplog", ".checkrun/leases"):
        path = os.path.join(store.root, sub)
        if os.path.islink(path):
            return (f"{store.url(sub)} is a symbolic link (to {os.path.realpath(path)}): what it holds may belong "
                    "to checkpoints of other directories, which a collection here cannot see; nothing is deleted. "
                    "A blob, step-log or lease folder shared through links is not supported: a gc where it lies "
                    "deletes what only this directory's checkpoints need (move them into one directory)")
    return None
