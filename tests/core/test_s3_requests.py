"""Requests a save, a read and garbage collection make on S3 (moto's server, counted from s3fs's log).

Each request to an object store costs a round trip (and money): a manifest was read with HEAD, HEAD,
GET (s3fs asked for the size once more), and a listing read each manifest head first (HEAD + GET), then
whole (HEAD, HEAD, GET): five requests per manifest in every collection, one now.
"""
from __future__ import annotations

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


def test_a_collection_reads_each_manifest_with_one_get(s3_root, s3_storage_options):
    """Every manifest of the directory, each time (a listing's size and ETag are not trusted to stand for its
    content: h129, a stale listing made a collection use an older version's blobs and delete a newer one's)."""
    keycache.clear()
    with _engine() as engine:
        for i in range(5):
            engine.save({"w": torch.full((64,), float(i))}, f"{s3_root}/c{i}.ckpt", storage_options=s3_storage_options)
        for _ in range(2):
            with _counted() as calls:
                report = engine.gc(s3_root, storage_options=s3_storage_options)
            assert not report.problems
            assert calls.count("get_object", ".ckpt") == 5 and calls.count("head_object", ".ckpt") == 0, calls.calls
