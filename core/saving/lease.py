"""The saves' side of leases: ``SaveLease``, created by every save in flight (engine threads, the
writer process, each DCP rank) before it writes or reuses any blob.

``cover(keys)`` returns once a version of the lease naming ``keys`` is in the store *and* no
collection that may have missed that version can still delete anything: it lists the collection
objects (``gc-*.json``) right after the write and waits until each live one present then is gone or
its deletion window has passed twice over (``leases.Collection``). From then on, a collection that
starts later reads this lease; one that ran earlier is done. So the save writes a covered blob, or
checks that a covered blob it reuses exists (``writer._repair_missing``), and that stays true until
the lease is released after the commit (the manifest protects the blobs from then on). Concurrent
``cover`` calls of the worker threads share one write (group commit): a save costs a few lease
writes and listings, not one per blob. A save naming more than ``PART_KEYS`` keys spreads them over
several lease objects (each a whole lease that any collector reads, older releases' too), so publishing
a key rewrites at most ``PART_KEYS`` of them, not every key so far (found by an independent check: a
save of 10,000 small blobs rewrote one growing lease 10,000 times, 268 MiB of lease writes for 4,000
blobs, ~10 ms per blob and rising).

Renewal: the save's own threads rewrite the lease as they work (``renew_if_due``, from ``cover`` and
from every chunk they store) once a quarter of ``lease_seconds`` has passed since the last write: no
thread of its own, since starting and ending threads behind the training loop's back races its forks
(DataLoader workers; ``lifecycle.retiring``). The writer counts its lease as valid until
``lease_seconds * 3 / 4`` after the start of its latest write (a quarter of ``lease_seconds`` kept for
clock differences with collectors, which compare the written expiry with their own clock), by
``time.monotonic`` and by the wall clock alike: a step of the host's clock (a VM resumed, an NTP step)
moves only the latter, and collectors on the host read the lease by it. If no renewal happened for
that long (one operation took minutes, the storage was unreachable, the clock stepped forward),
``intact()`` says so and the writer calls ``refresh()`` and checks every blob of the save again before
it commits: a collection may have taken some meanwhile. So a slow save is never cut short, only
checked again. Only a dead writer's lease runs out, after ``lease_seconds``.

``release()`` deletes the lease after the commit; ``abandon()`` (a failed save) rewrites it as
expired, so that the next collection takes its keys as candidates and deletes what no manifest
references.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterable

from ..config import EngineConfig
from ..errors import CheckrunError
from ..retain.leases import LeaseDir, clock_offset, new_name, record
from ..storage.store import Store

log = logging.getLogger("ckpt_core")

_POLL_FIRST, _POLL_MAX = 0.005, 0.5
MAX_COLLECTION_WINDOW = 3600.0
"""No collection's deletion window is longer (it would need ``retention.lease_seconds`` over 4 h)."""
_WAITED_OUT: set[tuple[str, float]] = set()
"""(lease URL, its ``written``) of the collection leases declaring an overlong window that a save of
this process waited out (they hold no later save back)."""
_now = time.monotonic
"""The clock of renewals, validity and waits (module-level so that tests can move it)."""
PART_KEYS = 1024
"""Keys per lease object of a save (see the module docstring)."""


class SaveLease:
    """The lease of one save in flight; see the module docstring for the order of calls."""

    def __init__(self, store: Store, config: EngineConfig) -> None:
        self.dir = LeaseDir(store)
        self.seconds = float(config.retention.lease_seconds)
        self.name = new_name("save")  # its first lease object
        self.waited_seconds = 0.0
        """Time ``cover`` spent waiting for collections in progress."""
        self._parts: list[tuple[str, set[str]]] = [(self.name, set())]  # (object, keys its latest version names)
        self._times: dict[str, tuple[float, float, float]] = {}  # object -> (valid until, wall until, written at)
        self._wrote: dict[str, float] = {}  # object -> its latest ``written`` (this host's clock)
        self._covered: set[str] = set()  # published, and past the wait for collections
        self._pending: set[str] = set()
        self._cond = threading.Condition()
        self._publishing = False
        self._io = threading.Lock()  # one write of the lease object at a time
        self._valid_until: float | None = None  # monotonic
        self._written_at = 0.0  # monotonic start of the latest write
        self._wall_until = 0.0  # the same validity by the wall clock (time.time), which collectors compare
        self._lapsed = False
        self._ended = False

    def cover(self, keys: Iterable[str]) -> None:
        """Return once ``keys`` are protected (see the module docstring). Any thread."""
        self.renew_if_due()
        want = set(keys)
        with self._cond:
            want -= self._covered
            if not want:
                return
            self._pending |= want
            while not want <= self._covered:
                if self._publishing:
                    self._cond.wait()
                    continue
                batch, self._publishing = set(self._pending), True
                self._cond.release()
                try:
                    self._publish(batch)
                finally:
                    self._cond.acquire()
                    self._publishing = False
                    self._cond.notify_all()
                self._covered |= batch
                self._pending -= batch

    def _publish(self, batch: set[str]) -> None:
        with self._io:
            name, keys = self._parts[-1]
            if keys and len(keys) + len(batch) > PART_KEYS:
                name, keys = new_name("save"), set()
                self._parts.append((name, keys))
            keys |= batch
            self._write(only=(name, keys))
        self._wait_for_collections()

    def _write(self, expired: bool = False, seconds: float | None = None, only: tuple | None = None) -> None:
        """Write the lease's objects (``only``: that one), protecting for ``seconds`` (``lease_seconds``)
        (caller holds ``_io``); a write starting after the validity ran out is a lapse. The lease is valid
        while every object is: until the oldest write's start plus ``seconds`` less a quarter of
        ``lease_seconds`` (kept for clock differences with collectors)."""
        seconds = self.seconds if seconds is None else seconds
        for name, keys in (self._parts if only is None else (only,)):
            started, wall = _now(), time.time()
            rec = record(name, "save", seconds, frozenset(keys), expired=expired)
            self.dir.write(rec)
            self._wrote[name] = rec.written
            if self._valid_until is not None and (started > self._valid_until or wall > self._wall_until):
                self._lapsed = True
            margin = seconds - 0.25 * self.seconds
            self._times[name] = (started + margin, wall + margin, started)
            self._valid_until, self._wall_until, self._written_at = (min(t[i] for t in self._times.values())
                                                                     for i in range(3))

    def _wait_for_collections(self) -> None:
        """Wait until no collection that may have missed the version just written can still delete.

        A collection's window is at most a quarter of its own ``lease_seconds`` (it starts shorter and
        only widens to that), which its object declares as ``expires - written``; an object declaring
        a longer window, or one over ``MAX_COLLECTION_WINDOW``, is not one a collection wrote (forged or
        damaged: a window of 1e9 s blocked every save): its window counts as that bound, with a
        warning, and once waited out in this process it holds no later save back."""
        first_seen: dict[str, float] = {}
        delay, t0 = _POLL_FIRST, _now()
        while True:
            now_wall, now, infos = time.time(), _now(), self.dir.infos()
            storage = now_wall + clock_offset(self.dir, infos, dict(self._wrote))  # a host clock off: h165
            busy = []
            for rec in self.dir.read_all(prefix="gc-", listing=set(infos)):
                identity = (self.dir.url(rec.name), rec.written)
                stored = infos[rec.name].mtime if rec.name in infos and infos[rec.name].dated else None
                if not rec.live(now_wall, stored, storage) or identity in _WAITED_OUT:
                    continue
                own = max(self.seconds, rec.expires - rec.written)  # the collector's lease_seconds
                window = min(rec.window, own / 4, MAX_COLLECTION_WINDOW)
                if window < rec.window and rec.name not in first_seen:
                    log.warning("checkrun: %s declares a deletion window of %.0f s, longer than a collection "
                                "uses (a quarter of its lease, at most %.0f s): waiting %.0f s at most",
                                self.dir.url(rec.name), rec.window, MAX_COLLECTION_WINDOW, 2 * window)
                seen = first_seen.setdefault(rec.name, now)
                if now < seen + 2 * window:
                    busy.append(seen + 2 * window - now)
                elif window < rec.window:
                    _WAITED_OUT.add(identity)
            if not busy:
                self.waited_seconds += _now() - t0
                return
            time.sleep(min(delay, max(busy)))
            delay = min(2 * delay, _POLL_MAX)

    def renew_if_due(self) -> None:
        """Rewrite the lease (new expiry) if a quarter of ``lease_seconds`` passed since the last
        write; a failure is logged (the next call tries again; a lapse is caught by ``intact``).
        Any thread; never waits for another thread's write."""
        if self._valid_until is None or self._ended:
            return
        if not self._due() or not self._io.acquire(blocking=False):
            return
        try:
            if not self._ended and self._due():
                self._write()
        except CheckrunError as exc:
            log.warning("checkrun: renewing lease %s failed (retrying): %s", self.dir.url(self.name), exc)
        finally:
            self._io.release()

    def _due(self) -> bool:
        """A quarter of ``lease_seconds`` since the last write, by either clock."""
        return (_now() - self._written_at >= self.seconds / 4
                or time.time() >= self._wall_until - 0.5 * self.seconds)

    def hold(self, seconds: float) -> None:
        """Rewrite the lease to protect its keys for ``seconds`` (at least ``lease_seconds``) with no
        renewal after it: a DCP rank that finished writing and waits in DCP's gather for slower ranks
        and the commit has no chunk left to renew on (found by an independent check: a collection
        deleted such a rank's new blobs and the coordinator refused the commit). A failure is logged."""
        if self._valid_until is None:
            return
        try:
            with self._io:
                self._write(seconds=max(seconds, self.seconds))
        except CheckrunError as exc:
            log.warning("checkrun: extending lease %s failed: %s", self.dir.url(self.name), exc)

    def intact(self) -> bool:
        """Whether the lease has been valid without a gap since its first write (any thread), by the
        monotonic clock and by the wall clock: a step of the host's clock (a VM resumed, an NTP step)
        makes a collection on this host read the lease by the wall clock, which ``time.monotonic``
        does not see (found by an independent check: a collection deleted the blobs of a save in
        flight after a forward step, and the save committed without checking them again)."""
        with self._io:
            return not self._lapsed and (self._valid_until is None
                                         or (_now() <= self._valid_until and time.time() <= self._wall_until))

    def refresh(self) -> None:
        """After a lapse: write the lease again and wait for collections; the caller then checks every
        blob the save references (a collection may have deleted some while the lease was out)."""
        with self._io:
            self._write()
            self._lapsed = False
        self._wait_for_collections()

    def _end(self) -> None:
        with self._io:
            self._ended = True

    def release(self) -> None:
        """After the commit: delete the lease (an error is logged: it expires by itself)."""
        self._end()
        if self._valid_until is None:
            return  # never written
        for name, _ in self._parts:
            try:
                self.dir.delete(name)
            except CheckrunError as exc:
                log.warning("checkrun: could not remove lease %s (it expires by itself): %s", self.dir.url(name), exc)

    def abandon(self) -> None:
        """After a failure: rewrite the lease as expired, so the next collection takes its keys as
        candidates (an error is logged: then it expires by itself)."""
        self._end()
        if self._valid_until is None:
            return
        try:
            with self._io:
                self._write(expired=True)
        except CheckrunError as exc:
            log.warning("checkrun: could not mark lease %s as expired: %s", self.dir.url(self.name), exc)

