"""Requests a save, a read and garbage collection make on S3 (moto's server, counted from s3fs's log).

Each request to an object store costs a round trip (and money): a manifest was read with HEAD, HEAD,
GET (s3fs asked for the size once more), a listing read each manifest head first (HEAD + GET) then whole,
and the collection after every save read every manifest of the directory again, so a save's requests grew
with the number of checkpoints kept (Lightning's ``save_last`` with ``save_top_k=-1``: N GETs per save
after N saves). A manifest whose listing shows the same size and ETag as one already parsed is not read.
"""
from __future__ import annotations

import collections
import logging
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.retain import keycache

pytestmark = pytest.mark.s3


class _Calls(logging.Handler):
    """s3fs logs ``CALL: <operation> - ... {'Bucket': ..., 'Key': ...}`` for every request it makes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.calls: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("CALL: "):
            op = message.split()[1]
            key = message.split("'Key': '", 1)[1].split("'", 1)[0] if "'Key': '" in message else ""
            self.calls.append((op, key))

    def count(self, op: str | None = None, suffix: str = "") -> int:
        return sum(1 for o, k in self.calls if (op is None or o == op) and k.endswith(suffix))


@contextmanager
def _counted() -> Iterator[_Calls]:
    logger, handler = logging.getLogger("s3fs"), _Calls()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _engine() -> CheckpointEngine:
    return CheckpointEngine({"saving": {"asynchronous": False}, "incremental": {"enabled": False}})


def test_a_manifest_is_read_with_one_head_and_one_get(s3_root, s3_storage_options):
    with _engine() as engine:
        engine.save({"w": torch.ones(64)}, f"{s3_root}/a.ckpt", storage_options=s3_storage_options)
        with _counted() as calls:
            engine.read_manifest(f"{s3_root}/a.ckpt", storage_options=s3_storage_options)
    assert calls.count("head_object", "a.ckpt") == 1 and calls.count("get_object", "a.ckpt") == 1, calls.calls


def test_gc_does_not_read_again_a_manifest_listed_unchanged(s3_root, s3_storage_options):
    keycache.clear()
    with _engine() as engine:
        for i in range(5):
            engine.save({"w": torch.full((64,), float(i))}, f"{s3_root}/c{i}.ckpt", storage_options=s3_storage_options)
        with _counted() as first:
            engine.gc(s3_root, storage_options=s3_storage_options)
        engine.save({"w": torch.full((64,), 9.0)}, f"{s3_root}/c4.ckpt", storage_options=s3_storage_options)
        with _counted() as second:
            report = engine.gc(s3_root, storage_options=s3_storage_options)
    assert not report.problems
    assert first.count("get_object", ".ckpt") == 5 and first.count("head_object", ".ckpt") == 0, first.calls
    assert second.count("get_object", ".ckpt") == 1 and second.count(suffix="c4.ckpt") == 1, second.calls


def test_requests_per_save_do_not_grow_with_the_checkpoints_kept(s3_root, s3_storage_options):
    """``save_last`` with every checkpoint kept: the save of the 8th costs what the 4th did."""
    keycache.clear()
    per_save: dict[int, collections.Counter] = {}
    with _engine() as engine:
        for i in range(8):
            state = {"w": torch.full((256,), float(i))}
            with _counted() as calls:
                engine.save(state, f"{s3_root}/step{i}.ckpt", storage_options=s3_storage_options)
                engine.save(state, f"{s3_root}/last.ckpt", storage_options=s3_storage_options)
            per_save[i] = collections.Counter(op for op, _ in calls.calls)
    assert per_save[7] == per_save[3], per_save  # (the 3rd: the first collection, which reads every manifest)
    assert per_save[7]["get_object"] <= 4, per_save
