"""The step log's cheap path (issue 23, cost): reused staging and packs on the training thread,
one chunk per dtype pack and step on the encoder thread, and the bytes and replay that must not change for it."""
from __future__ import annotations

import copy

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.codecs import lossless_pipeline
from ckpt_core.config import CompressionConfig
from ckpt_core.steplog import capture
from ckpt_core.steplog.capture import PACK_MAX_BYTES, Staging, StepRecord, capture_step
from ckpt_core.steplog.encode import StepEncoder

from .steplog_train import assert_bit_equal


def _opt_with_grads(grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return torch.optim.SGD(params, lr=0.1)


def _sparse_grad(rows: int, dim: int, ids: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.int64)
    return torch.sparse_coo_tensor(idx, torch.randn(len(ids), dim, generator=gen), (rows, dim))


def _grads(seed: int, n_ids: int = 40) -> list[torch.Tensor]:
    """Sparse rows (repeated ids, uncoalesced), dense fp32/bf16/fp16 of awkward sizes, an empty
    gradient, and a bf16 one whose byte planes are large enough for shuffle_zstd's probe."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n_ids,), generator=gen).tolist()
    bumpy = torch.randn(300 << 10, generator=gen).to(torch.bfloat16)  # 600 KiB: planes of 300 KiB
    return [_sparse_grad(50, 7, ids, seed), torch.randn(13, 5, generator=gen),
            torch.randn(33, generator=gen).to(torch.bfloat16), torch.randn(3, 3, generator=gen).half(),
            torch.zeros(0, 4), bumpy, torch.full((64, 64), 0.5)]


def _capture(opt, staging: Staging, step: int, slot: int = 0) -> StepRecord:
    return capture_step(opt, step, staging, slot, 0.5)


def _own_bytes(t: torch.Tensor, pipeline) -> bytes:
    flat = t.reshape(1, -1) if t.numel() else t.reshape(0, 1)
    return bytes(pipeline.encode(flat.contiguous())[0])


def test_a_steps_packs_are_one_chunk_per_dtype_and_entries_point_into_them():
    """A step's small tensors are encoded as one chunk per dtype (its pack, through the dtype's
    lossless pipeline: the chunk decodes to the pack bit for bit) and every entry names its span."""
    grads = _grads(1)
    opt = _opt_with_grads(grads)
    rec = _capture(opt, Staging(1), 1)
    assert all(g.data is None for g in rec.grads), "every tensor here is below PACK_MAX_BYTES"
    parts, ranges = [], []
    entries, chunks = StepEncoder(CompressionConfig()).encode(rec, parts, ranges)
    payload = b"".join(parts)
    assert set(chunks) == {"float32", "bfloat16", "float16", "int64"} and len(parts) == 4
    decoded = {}
    for name, (numel, (off, size, codecs)) in chunks.items():
        dtype = getattr(torch, name)
        pipe = lossless_pipeline(dtype, CompressionConfig())
        assert codecs == pipe.to_list() and numel == rec.packs[dtype].numel()
        decoded[name] = pipe.decode(payload[off:off + size], (1, numel), dtype, 1 << 30).view(-1)
        assert torch.equal(decoded[name].view(torch.uint8), rec.packs[dtype].view(torch.uint8))
    assert [e["k"] for e in entries] == ["sparse"] + ["dense"] * (len(grads) - 1)
    for e, g in zip(entries, grads):
        t = g._values() if g.is_sparse else g
        at = e["data"]["at"]
        span = decoded[e["data"]["pack"]][at:at + t.numel()]
        assert torch.equal(span.view(torch.uint8), t.reshape(-1).view(torch.uint8))
    at = entries[0]["idx"]["at"]
    assert torch.equal(decoded["int64"][at:at + 40], grads[0]._indices().view(-1))


def test_pack_references_count_along_the_segments_chunks():
    """In a segment, ``at`` counts along the chunks of its dtype: a held step carried into the next
    segment starts again at 0 there."""
    from ckpt_core.steplog.log import _Batch

    grads = _grads(2)
    opt = _opt_with_grads(grads)
    staging = Staging(3)
    enc = StepEncoder(CompressionConfig())
    batch = _Batch("0" * 16, 0, enc)
    recs = [_capture(opt, staging, step, slot=step - 1) for step in (1, 2, 3)]
    n32 = recs[0].packs[torch.float32].numel()
    batch.add("step", recs[0], None, staging)
    batch.add("step", recs[1], None, staging)  # step 1 is appended, step 2 is held
    assert [e["step"] for e in batch.events] == [1] and batch.held is not None
    batch.release()
    assert [c["numel"] for c in batch.packs["float32"]] == [n32, n32]
    assert batch.events[1]["grads"][1]["data"]["at"] == n32 + recs[1].grads[1].data_at[0]
    batch.add("step", recs[2], None, staging)  # step 3 held: cut here, it goes to the next segment
    nxt = batch.rest()
    nxt.release()
    assert len(batch.packs["float32"]) == 2 and [c["numel"] for c in nxt.packs["float32"]] == [n32]
    assert nxt.events[0]["grads"][1]["data"]["at"] == recs[2].grads[1].data_at[0]
    assert nxt.packs["float32"][0]["data"][0] == 0  # byte offsets restart with the segment too


def test_staging_is_reused_and_grows_only_when_a_step_is_larger():
    grads = _grads(2)
    opt = _opt_with_grads(grads)
    staging = Staging(2)
    first = _capture(opt, staging, 1)
    ptrs = {d: t.data_ptr() for d, t in first.packs.items()}
    for step, seed in ((2, 3), (3, 4)):  # new values, same sizes: the same memory
        for p, g in zip(opt.param_groups[0]["params"], _grads(seed)):
            p.grad = g
        rec = _capture(opt, staging, step)
        assert {d: t.data_ptr() for d, t in rec.packs.items()} == ptrs
    opt.param_groups[0]["params"][0].grad = _sparse_grad(50, 7, list(range(50)) * 2, 5)  # more rows
    grown = _capture(opt, staging, 4)
    assert grown.packs[torch.float32].data_ptr() != ptrs[torch.float32]
    assert grown.grads[0].n == 100
    again = _capture(opt, staging, 5)
    assert again.packs[torch.float32].data_ptr() == grown.packs[torch.float32].data_ptr()
    other = _capture(opt, staging, 6, slot=1)  # each slot has its own buffers
    assert other.packs[torch.float32].data_ptr() != again.packs[torch.float32].data_ptr()


def test_capture_is_a_copy_of_what_step_consumes():
    grads = _grads(6)
    opt = _opt_with_grads(grads)
    rec = _capture(opt, Staging(1), 1)
    before = {d: t.clone() for d, t in rec.packs.items()}
    dense = grads[1].clone()
    for g in grads:  # training goes on: the next backward writes into the gradients
        (g._values() if g.is_sparse else g).add_(1)
    for d, t in rec.packs.items():
        assert torch.equal(t.view(torch.uint8), before[d].view(torch.uint8))
    start, n = rec.grads[1].data_at
    assert torch.equal(rec.packs[torch.float32][start:start + n], dense.reshape(-1))


def test_large_gradients_get_buffers_of_their_own():
    rows = PACK_MAX_BYTES // (4 * 16) + 10  # values just over PACK_MAX_BYTES
    sparse = _sparse_grad(rows + 5, 16, list(range(rows)), 7)
    dense = torch.randn(PACK_MAX_BYTES // 4 + 1)
    opt = _opt_with_grads([sparse, dense, torch.randn(4)])
    staging = Staging(1)
    rec = _capture(opt, staging, 1)
    big_sparse, big_dense, small = rec.grads
    assert big_sparse.data is not None and big_sparse.idx is not None and big_sparse.data_at is None
    assert torch.equal(big_sparse.data, sparse._values()) and torch.equal(big_sparse.idx, sparse._indices()[0])
    assert big_dense.data is not None and torch.equal(big_dense.data, dense)
    assert small.data is None and small.data_at == (0, 4)
    ptr = big_sparse.data.data_ptr()
    assert _capture(opt, staging, 2).grads[0].data.data_ptr() == ptr


class _Table(torch.nn.Module):
    """A sparse table whose rows of one step are more than PACK_MAX_BYTES, and small layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6000, 64, sparse=True)
        self.head = torch.nn.Linear(64, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1))


def _train(net, opt, sched, step: int, n_ids: int) -> None:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 6000, (n_ids // 8, 8), generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(ids), torch.randn(n_ids // 8, 3, generator=gen)).backward()
    opt.step()
    sched.step()


def _make():
    torch.manual_seed(7)
    net = _Table()
    opt = torch.optim.Adagrad(net.parameters(), lr=0.05)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _state(net, opt, sched) -> dict:
    return {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


@pytest.mark.parametrize("n_ids", [4400, 64])  # sparse rows of their own (1.1 MB), and packed
def test_replay_is_bit_exact_through_both_paths(tmp_path, n_ids, step_log=None):
    directory = str(tmp_path / "run")
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 2, **(step_log or {})}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, 6):
            _train(net, opt, sched, step, n_ids)
            if step == 1:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
        expected = copy.deepcopy(_state(net, opt, sched))
        net2, opt2, sched2 = _make()
        st = engine.load(f"{directory}/ck.ckpt")
        net2.load_state_dict(st["model"])
        opt2.load_state_dict(st["opt"])
        sched2.load_state_dict(st["sched"])
        assert engine.replay(directory, opt2, sched2) == 4
    assert_bit_equal(_state(net2, opt2, sched2), expected)


def test_replay_keeps_one_decoded_chunk_per_dtype():
    """``Payload`` decodes a chunk when a reference needs it and keeps only the last one per dtype:
    a header whose references jump between chunks costs decodes, not memory."""
    from ckpt_core.steplog.replay import Payload

    chunks, parts, size = [], [], 0
    pipe = lossless_pipeline(torch.float32, CompressionConfig())
    for k in range(3):
        blob = _own_bytes(torch.full((100,), float(k)), pipe)
        chunks.append({"numel": 100, "data": [size, len(blob), pipe.to_list()]})
        parts.append(blob)
        size += len(blob)
    payload = Payload({"packs": {"float32": chunks}}, memoryview(b"".join(parts)), 1 << 20)
    for at in (5, 150, 250, 10):
        got = payload.tensor({"pack": "float32", "at": at}, 3, torch.float32, "seg")
        assert torch.equal(got, torch.full((3,), float(at // 100)))
        assert list(payload._decoded) == ["float32"] and payload._decoded["float32"][0] == at // 100


def _pooled_grad(bags: list[list[int]], dim: int, seed: int) -> torch.Tensor:
    """The sparse gradient ``emb(ids).sum(1)`` gives: every id of a bag gets the bag's row."""
    gen = torch.Generator().manual_seed(seed)
    per_bag = torch.randn(len(bags), dim, generator=gen)
    idx = torch.tensor([[i for bag in bags for i in bag]])
    vals = torch.cat([per_bag[b].expand(len(bag), dim) for b, bag in enumerate(bags)])
    return torch.sparse_coo_tensor(idx, vals, (100, dim))


@pytest.mark.skipif(capture._FOLD is None, reason="the C kernel ckpt_core._crows was not built")
def test_a_pooled_sparse_gradient_is_folded_to_one_row_per_run():
    """Equal adjacent rows (bytewise: -0.0 and 0.0 differ) are stored once with their run length,
    in the packs or in buffers of their own; rows that do not repeat enough are stored as they are."""
    pooled = _pooled_grad([[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11], [12] * 9], 5, 0)
    signed = torch.sparse_coo_tensor(torch.arange(20).view(1, -1), torch.tensor([[0.0], [-0.0]] * 10), (100, 1))
    big = _pooled_grad([list(range(b * 8, b * 8 + 8)) for b in range(PACK_MAX_BYTES // (4 * 64 * 8) + 2)], 64, 1)
    big = torch.sparse_coo_tensor(big._indices() % 100, big._values(), (100, 64))
    rec = _capture(_opt_with_grads([pooled, signed, big]), Staging(1), 1)
    folded, unfolded, own = rec.grads
    assert (folded.n, folded.u) == (20, 4) and folded.runs_at is not None
    start, u = folded.runs_at
    assert rec.packs[torch.int32][start:start + u].tolist() == [4, 2, 5, 9]
    start, numel = folded.data_at
    assert torch.equal(rec.packs[torch.float32][start:start + numel].view(4, 5), pooled._values()[[0, 4, 6, 11]])
    assert unfolded.u == 0 and unfolded.runs is None and unfolded.runs_at is None and unfolded.data_at[1] == 20
    assert own.data is not None and own.u == own.n // 8
    assert torch.equal(own.runs, torch.full((own.u,), 8, dtype=torch.int32))
    assert torch.equal(own.data.view(-1, 64), big._values()[::8])


@pytest.mark.parametrize("fold", [True, False])
def test_folded_and_unfolded_logs_replay_the_same_bits(tmp_path, monkeypatch, fold):
    """The bit-exact replay of ``_Table`` (bags of 8 ids: folded where the C kernel exists) holds
    with folding off too, and the folded segments are what the kernel made."""
    if not fold:
        monkeypatch.setattr(capture, "_FOLD", None)
    elif capture._FOLD is None:
        pytest.skip("the C kernel ckpt_core._crows was not built")
    test_replay_is_bit_exact_through_both_paths(tmp_path, 4400, {"rng": False})
    from ckpt_core.steplog.format import SEG_RE, split_segment
    segs = [p for p in (tmp_path / "run" / ".checkrun" / "steplog").iterdir() if SEG_RE.fullmatch(p.name)]
    header, _ = split_segment(segs[0].read_bytes(), "seg")
    grads = [g for ev in header["events"] if ev["kind"] == "step" for g in ev["grads"] if g["k"] == "sparse"]
    assert grads and all(("runs" in g) == fold for g in grads)
    assert not fold or all(g["u"] * 8 == g["n"] for g in grads)
    # what format 4 did not change is written as version 3: a checkrun reading up to 3 replays it
    # (with step_log.rng off: the RNG states need version 7)
    assert header["format_version"] == (4 if fold else 3)


def _folded(h: dict) -> dict:
    return next(g for ev in h["events"] if ev["kind"] == "step" for g in ev["grads"] if "runs" in g)


@pytest.mark.skipif(capture._FOLD is None, reason="the C kernel ckpt_core._crows was not built")
@pytest.mark.parametrize("mutate, message", [
    (lambda g: g.__setitem__("u", g["n"] + 1), "stores"),
    (lambda g: g.__setitem__("u", 0), "stores"),
    (lambda g: g.__setitem__("u", g["u"] - 1), "sum to"),
    (lambda g: g["runs"].__setitem__("pack", "int64"), "its dtype is int32"),
    (lambda g: g["runs"].__setitem__("at", 10**12), "past the end of its chunk"),
    (lambda g: g.pop("u"), "malformed gradient entry"),
    (lambda g: g.__setitem__("k", "rows"), "malformed gradient entry"),
])
def test_hostile_folded_gradients_are_refused(tmp_path, mutate, message):
    """A folded entry's run lengths and stored rows are checked like every other field (checksums
    intact: a hostile writer) before replay allocates the unfolded rows."""
    from ckpt_core.steplog.checks import StepLogFormatError
    from ckpt_core.steplog.format import SEG_RE, pack_segment, split_segment

    test_replay_is_bit_exact_through_both_paths(tmp_path, 64)
    segdir = tmp_path / "run" / ".checkrun" / "steplog"
    for path in sorted(p for p in segdir.iterdir() if SEG_RE.fullmatch(p.name)):
        header, payload = split_segment(path.read_bytes(), path.name)
        mutate(_folded(header))
        for k in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
            header.pop(k)
        path.write_bytes(pack_segment(header, [bytes(payload)]))
    net, opt, sched = _make()
    with CheckpointEngine() as engine:
        st = engine.load(f"{tmp_path}/run/ck.ckpt")
        opt.load_state_dict(st["opt"])
        with pytest.raises(StepLogFormatError, match="seg-") as exc:
            engine.replay(str(tmp_path / "run"), opt, sched)
    assert message in str(exc.value)


@pytest.mark.parametrize("weighted", [False, True])
def test_folded_runs_that_change_from_step_to_step_replay_bit_exact(tmp_path, weighted):
    """Bags whose boundaries (or per-sample weights) change every step: each step has its own run
    lengths in the segment's int32 pack. The segment's pack offsets of ``runs`` were not shifted,
    so every step of a segment replayed with its first step's runs: wrong weights, silently, or a
    refusal when the row counts differed (found by a check of today's changes)."""
    directory = str(tmp_path / "run")

    def make():
        torch.manual_seed(0)
        bag = torch.nn.EmbeddingBag(1000, 16, mode="sum", sparse=True)
        return bag, torch.optim.SGD(bag.parameters(), lr=0.1)

    def step(bag, opt, s):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 1000, (32,), generator=g)
        offsets = torch.cat([torch.tensor([0]), torch.randperm(31, generator=g)[:3].add(1).sort().values])
        weights = torch.rand(32, generator=g) if weighted and s % 2 else None
        opt.zero_grad()
        out = bag(ids, offsets, per_sample_weights=weights)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        opt.step()

    bag, opt = make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 8}}) as engine:
        slog = engine.step_log(directory, opt)
        for s in range(1, 17):
            step(bag, opt, s)
            if s == 4:
                engine.save({"bag": bag.state_dict(), "opt": opt.state_dict()}, f"{directory}/s4.ckpt").result()
        slog.close()
    bag2, opt2 = make()
    with CheckpointEngine() as engine:
        st = engine.load(f"{directory}/s4.ckpt")
        bag2.load_state_dict(st["bag"])
        opt2.load_state_dict(st["opt"])
        assert engine.replay(directory, opt2) == 12
    assert torch.equal(bag.weight, bag2.weight)
