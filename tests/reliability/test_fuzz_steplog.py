"""Fuzzing the step log's hostile-input boundary with hypothesis: a real segment (format 3: pack
chunks, sparse, row and dense gradients, a gradient with a range of its own, state records with
counters) whose header fields are replaced by arbitrary JSON and repacked with valid checksums, then
decoded and applied to a fresh optimizer as replay does. Whatever the input, the outcome is a
replayed step or a ``CheckrunError`` (``StepLogFormatError``, ``StepLogError``), or the internal
``SegmentDamaged``: never another exception. Examples: ``CHECKRUN_FUZZ_EXAMPLES`` (see test_fuzz.py).
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, strategies as st

from ckpt_core import CheckpointEngine
from ckpt_core.errors import CheckrunError
from ckpt_core.steplog import capture
from ckpt_core.steplog.capture import PACK_MAX_BYTES
from ckpt_core.steplog.format import SEG_RE, SegmentDamaged, pack_segment, split_segment
from ckpt_core.steplog.replay import Payload, apply_event

from .test_fuzz import JSON, fuzz, replace_fields

LIMIT = 1 << 24
KEYS = ["kind", "step", "grads", "groups", "sched", "scaler", "counters", "p", "k", "dtype", "shape", "data",
        "idx", "n", "coalesced", "pack", "at", "numel", "packs", "events", "lo", "hi", "run", "seq", "float32",
        "int64", "lr", "x"]
VALUE = JSON | st.recursive(st.integers(-1, 2**41) | st.sampled_from(["float32", "int64", "pack", "dense", "rows"]),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner,
                                                                                         max_size=4),
                            max_leaves=12)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 4, sparse=True)  # sparse: values + indices in the packs
        self.rows = torch.nn.Parameter(torch.zeros(128, 64))  # few rows touched: a "rows" gradient
        self.big = torch.nn.Parameter(torch.zeros(PACK_MAX_BYTES // 4 + 8))  # a range of its own
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1)) + self.rows[ids[:, 0]].sum() + self.big[:3].sum()


def _make():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adagrad(net.parameters(), lr=0.1)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _step(net, opt, sched, i: int) -> None:
    ids = torch.randint(0, 64, (8, 4), generator=torch.Generator().manual_seed(i))  # bags: folded rows
    opt.zero_grad()
    net(ids).square().mean().backward()
    opt.step()
    sched.step()


@pytest.fixture(scope="module")
def segment(tmp_path_factory):
    """The bytes of a real segment of 3 steps."""
    directory = tmp_path_factory.mktemp("fuzz-steplog") / "run"
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(str(directory), opt, sched, counters=lambda: {"batches": 7})
        for i in range(1, 5):
            _step(net, opt, sched, i)
        slog.close()
    segs = sorted(p for p in (directory / ".checkrun" / "steplog").iterdir() if SEG_RE.fullmatch(p.name))
    data = segs[0].read_bytes()
    header, _ = split_segment(data, "seg")
    kinds = {g["k"] for ev in header["events"] if ev["kind"] == "step" for g in ev["grads"]}
    assert {"sparse", "rows", "dense"} <= kinds and header["packs"] and "counters" in header["events"][0]
    assert any(isinstance(g["data"], list) for ev in header["events"] if ev["kind"] == "step" for g in ev["grads"])
    assert capture._FOLD is None or any("runs" in g for ev in header["events"] if ev["kind"] == "step"
                                        for g in ev["grads"])
    return data


def replay_segment(data: bytes) -> None:
    header, payload = split_segment(data, "seg")
    net, opt, sched = _make()
    view = Payload(header, payload, LIMIT)
    for ev in header["events"]:
        apply_event(ev, view, opt, sched, "seg", LIMIT)


def test_the_real_segment_replays(segment):
    replay_segment(segment)


@fuzz
@given(st.data())
def test_forged_segment_headers_replay_or_fail_with_checkrun_errors(segment, data):
    header, payload = split_segment(segment, "seg")
    header = json.loads(json.dumps(header))
    for k in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
        header.pop(k)
    replace_fields(data, header, VALUE)
    try:
        forged = pack_segment(header, [bytes(payload)])
    except (ValueError, TypeError, RecursionError):  # not JSON (e.g. a huge float): no such segment exists
        return
    try:
        replay_segment(forged)
    except (CheckrunError, SegmentDamaged) as exc:
        assert "seg" in str(exc)
