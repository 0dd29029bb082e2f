"""The segment being filled by the log's encoder thread (``log.StepLog._loop``): its events and encoded bytes."""
from __future__ import annotations

import queue
import time
from typing import Any

import xxhash

from ..config import EngineConfig
from . import rng
from .capture import Staging, StepRecord
from .encode import StepEncoder


class _Batch:
    """The segment being filled by the encoder thread: events (lo, hi] and their encoded bytes.

    The newest step is *held* (encoded, not yet in ``events``) until the next event arrives or the
    training thread flushes: the scheduler's step after it is logged only at the next ``step()``,
    ``flush`` or save, so a segment cut by ``flush_seconds`` alone must not end with a step whose
    scheduler state is not logged yet (replay would resume the scheduler one step behind). A step's
    byte ranges and pack references are relative to its own bytes and chunks until it is appended."""

    def __init__(self, run: str, lo: int, pays: StepEncoder) -> None:
        self.run, self.lo, self.hi, self.pays = run, lo, lo, pays
        self.events: list[dict] = []
        self.payload: list[bytes] = []
        self.packs: dict[str, list[dict]] = {}
        """Per dtype name, the segment's pack chunks in order (``{"numel", "data": range}``)."""
        self._pack_numel: dict[str, int] = {}
        self.size = 0
        self.csum = xxhash.xxh3_64()
        """Of ``payload`` so far (``extend``): each part hashed as it comes, while it is in cache."""
        self.started = time.monotonic()
        self.held: tuple[dict, list[bytes], list[list], dict, Any] | None = None
        self.rng: tuple[int, int | None, rng.RngState] | None = None
        """``(event, step, states)``: the RNG states after the last step appended (``step`` its number), or
        after event ``event`` of a flush point (``step`` None), if they were captured."""

    @property
    def empty(self) -> bool:
        return not self.events and self.held is None

    def add(self, kind: str, item: Any, config: EngineConfig, staging: Staging) -> None:
        if self.empty:
            self.started = time.monotonic()
        self.release()
        if kind == "state":
            self._append({"kind": "state", **item}, [], [], {})
            return
        rec: StepRecord = item
        parts: list[bytes] = []
        ranges: list[list] = []
        try:
            grads, chunks = self.pays.encode(rec, parts, ranges)
        finally:
            if rec.slot is not None:
                staging.give(rec.slot)
        event = {"kind": "step", "step": rec.step, "grads": grads}
        if rec.bufs:
            event["bufs"] = self.pays.buffers(rec)
        self.held = (event, parts, ranges, chunks, rec.rng)

    def release(self) -> None:
        """Move the held step into the segment (its scheduler state is logged, or the training
        thread flushes)."""
        if self.held is not None:
            held, self.held = self.held, None
            self._append(*held)

    def rest(self) -> "_Batch":
        """The next segment, starting with the held step if there is one."""
        nxt = _Batch(self.run, self.hi, self.pays)
        nxt.held, self.held = self.held, None
        return nxt

    def extend(self, parts: list[bytes]) -> None:
        """Append ``parts`` to the payload."""
        for part in parts:
            self.payload.append(part)
            self.csum.update(part)
            self.size += memoryview(part).nbytes

    def _append(self, event: dict, parts: list[bytes], ranges: list[list], chunks: dict, states: Any = None) -> None:
        for r in ranges:  # offsets were relative to the event's own bytes
            r[0] += self.size
        for g in [*event.get("grads", ()), *event.get("bufs", ())]:  # offsets were relative to the step's chunks
            for ref in g.values():  # every reference into a pack (data, idx, runs), whatever its key
                if isinstance(ref, dict) and "pack" in ref:
                    ref["at"] += self._pack_numel.get(ref["pack"], 0)
        for name, (numel, r) in chunks.items():
            self.packs.setdefault(name, []).append({"numel": numel, "data": r})
            self._pack_numel[name] = self._pack_numel.get(name, 0) + numel
        self.events.append(event)
        self.extend(parts)
        self.hi += 1
        if event["kind"] == "step":
            self.rng = None if states is None else (self.hi, event["step"], states)


class _Inbox(queue.Queue):
    """The encoder thread's queue. Each wake-up of the encoder takes the GIL back from the training
    thread, which then waits for it (measured: ~7 waits per DLRM step): ``put_quiet`` queues an item
    that another item wakes the encoder for (a step's scheduler state, whose step follows)."""

    def put_quiet(self, item: Any) -> None:
        with self.mutex:
            self._put(item)
            self.unfinished_tasks += 1
