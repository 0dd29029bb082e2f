"""Lossy codecs: bit-packing, error bounds with the stored parameters, statistics, edge values."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_core.codecs import CastCodec, Int8BlockCodec, UniformCodec
from ckpt_core.codecs.packing import SUPPORTED_BITS, pack, packed_nbytes, unpack
from ckpt_core.errors import LossyRefusedError

BITS = [2, 3, 4, 8]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Decoders and the cast codec are many torch calls; on a busy 2-core runner torch's intra-op
    thread team (busy-waiting at each barrier) makes them 10x slower and the timings erratic.
    (The lossy encoders are numpy and do not care: test_encoders_run_no_torch_ops.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sample(kind: str, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "laplace":
        x = torch.sign(x) * torch.log1p(torch.rand(shape, generator=g) * 1e4)
    elif kind == "offset":      # large offset, small range: needs the outward rounding of fp16 params
        x = 1000.0 + x * 1e-2
    elif kind == "tiny":        # steps below fp16's smallest subnormal
        x = x * 1e-7
    elif kind == "rows":        # each row its own magnitude
        x = x * torch.logspace(-3, 3, shape[0])[:, None]
    elif kind == "constant":
        x = torch.full(shape, 0.1)
    return x.contiguous()


def group_view(t: torch.Tensor, block: int | None) -> list[torch.Tensor]:
    """The quantization groups of a 2-D tensor, in stored order, as 1-D tensors."""
    out = []
    for row in t:
        size = block or max(len(row), 1)
        out.extend(row[i:i + size] for i in range(0, len(row), size))
    return out


# ---------------------------------------------------------------- packing

@settings(max_examples=150, deadline=None)
@given(bits=st.sampled_from(SUPPORTED_BITS), data=st.data())
def test_pack_unpack_identity_property(bits, data):
    codes = np.frombuffer(data.draw(st.binary(max_size=300)), np.uint8) & ((1 << bits) - 1)
    n = codes.size
    packed = pack(codes, bits)
    assert packed.size == packed_nbytes(n, bits) == (n * bits + 7) // 8
    assert np.array_equal(unpack(packed, bits, n), codes)
    start = data.draw(st.integers(0, n))
    assert np.array_equal(unpack(packed, bits, n - start, start), codes[start:])
    # Layout: each code's bits LSB-first in one stream (numpy's little bit order).
    stream = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, :bits].reshape(-1)
    assert np.array_equal(packed, np.packbits(stream, bitorder="little"))


def test_pack_masks_stray_high_bits():
    assert np.array_equal(unpack(pack(np.array([0xFF] * 8, np.uint8), 3), 3, 8), [7] * 8)


# ---------------------------------------------------------------- uniform: error bounds

@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "laplace", "offset", "tiny", "rows", "constant"])
@pytest.mark.parametrize("shape,block", [((7, 37), None), ((3, 1), None), ((1, 1001), 256),
                                          ((4, 130), 64), ((1, 5), 8)], ids=str)
def test_uniform_plain_error_is_at_most_half_a_stored_step(shape, block, kind, bits, scale_dtype):
    x = sample(kind, shape)
    codec = UniformCodec(bits, block, scale_dtype, greedy=False)
    try:
        data, stats = codec.encode(x)
    except LossyRefusedError as exc:  # steps fp16 can only round up to 6e-8 (most "tiny" cases): lossless
        assert kind == "tiny" and scale_dtype == "fp16" and "underflow" in str(exc)
        return
    y = codec.decode(data, shape, torch.float32)
    mins, steps = codec.params(bytes(data), shape)
    assert len(bytes(data)) == 2 * mins.numel() * mins.element_size() + packed_nbytes(x.numel(), bits)
    groups_x, groups_y = group_view(x, block), group_view(y, block)
    assert len(groups_x) == steps.numel()
    for gx, gy, step in zip(groups_x, groups_y, steps.double()):
        err = (gy.double() - gx.double()).abs().max()
        assert err <= step / 2 + 1e-6 * gx.abs().max(), (err, step)
    assert stats.max_abs_error == pytest.approx(float((y - x).abs().max()), rel=1e-6, abs=1e-30)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "laplace", "rows", "constant"])
@pytest.mark.parametrize("shape,block", [((16, 64), None), ((4, 1500), None), ((1, 2000), 256),
                                          ((3, 70), 32)], ids=str)
def test_uniform_greedy_never_worse_per_group(shape, block, kind, bits):
    x = sample(kind, shape, seed=1)
    errors = {}
    for greedy in (False, True):
        codec = UniformCodec(bits, block, "fp16", greedy)
        y = codec.decode(codec.encode(x)[0], shape, torch.float32)
        errors[greedy] = [((gy.double() - gx.double()) ** 2).sum() for gx, gy in
                          zip(group_view(x, block), group_view(y, block))]
    assert all(g <= p for g, p in zip(errors[True], errors[False]))
    if kind in ("normal", "laplace") and bits <= 4:  # the search pays on bell-shaped data
        assert sum(errors[True]) < 0.95 * sum(errors[False])


@pytest.mark.parametrize("codec", [UniformCodec(3, None, "fp16", False), UniformCodec(4, None, "fp16", True),
                                   UniformCodec(3, 100, "fp32", False), UniformCodec(2, 7, "fp16", True),
                                   Int8BlockCodec(100)], ids=repr)
@pytest.mark.parametrize("shape", [(37, 301), (1, 5003), (3, 1777)], ids=str)
def test_encoding_does_not_depend_on_the_processing_block(codec, shape, monkeypatch):
    """Chunks are processed in pieces of BLOCK_ELEMS elements; the bytes must not show it."""
    import ckpt_core.codecs.int8_block as int8_module
    import ckpt_core.codecs.uniform as uniform_module

    x = sample("laplace", shape, seed=3)
    expected = bytes(codec.encode(x)[0])
    for size in (700, 4096):
        monkeypatch.setattr(uniform_module, "BLOCK_ELEMS", size)
        monkeypatch.setattr(int8_module, "BLOCK_ELEMS", size)
        data = bytes(codec.encode(x)[0])
        assert data == expected
        assert torch.equal(codec.decode(data, shape, torch.float32),
                           codec.decode(expected, shape, torch.float32))


def test_uniform_long_block_rows():
    flat = sample("normal", (1, 270_001), seed=4)  # more than one processing block
    codec = UniformCodec(3, 256, "fp16", True)
    data = bytes(codec.encode(flat)[0])
    y = codec.decode(data, (1, 270_001), torch.float32)
    steps = codec.params(data, (1, 270_001))[1].float()
    assert steps.numel() == -(-270_001 // 256)
    per_elem = steps.repeat_interleave(256)[:270_001]
    # A greedy range may clip a block's extremes; nothing can be off by more than the clipped
    # 16% of its range (about 2.4 steps at 3 bits) plus half a step.
    assert ((y - flat).abs()[0] <= 3 * per_elem).all()


def test_uniform_is_deterministic():
    x = sample("laplace", (33, 517), seed=5)
    for greedy in (False, True):
        codec = UniformCodec(4, None, "fp16", greedy)
        assert bytes(codec.encode(x)[0]) == bytes(codec.encode(x.clone())[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_uniform_other_float_dtypes(dtype):
    x = sample("normal", (9, 100), seed=6).to(dtype)
    codec = UniformCodec(4, None, "fp32", False)
    data, stats = codec.encode(x)
    y = codec.decode(data, (9, 100), dtype)
    assert y.dtype == dtype and y.shape == x.shape
    steps = codec.params(bytes(data), (9, 100))[1].double()
    ulp = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7, torch.float64: 0.0}[dtype]
    err = (y.double() - x.double()).abs()
    # Half a step, plus half an ulp of the final cast to the tensor's own dtype.
    assert (err <= steps[:, None] / 2 + ulp * x.double().abs().amax(1, keepdim=True) + 1e-12).all()
    assert stats.max_abs_error == pytest.approx(float(err.max()), rel=1e-6)


def test_uniform_exact_cases():
    codec = UniformCodec(2, None, "fp16", True)
    zeros = torch.zeros(3, 9)
    data, stats = codec.encode(zeros)
    assert torch.equal(codec.decode(data, (3, 9), torch.float32), zeros) and stats.sq_error_sum == 0
    levels = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 0.0, 1.0]])  # exactly on a 2-bit grid
    y = UniformCodec(2, None, "fp16", False).decode(UniformCodec(2).encode(levels)[0], (1, 7), torch.float32)
    assert torch.equal(y, levels)


@pytest.mark.parametrize("shape", [(1, 0), (0, 5), (0, 0), (1, 1)], ids=str)
@pytest.mark.parametrize("codec", [UniformCodec(3, None, "fp16", True), UniformCodec(2, 4, "fp32", True),
                                   Int8BlockCodec(4), CastCodec("float16")], ids=repr)
def test_lossy_codecs_handle_empty_and_single_elements(codec, shape):
    x = torch.full(shape, 0.5)
    data, stats = codec.encode(x)
    y = codec.decode(bytes(data), shape, torch.float32)
    assert y.shape == shape and torch.allclose(y, x, rtol=0, atol=1e-6)
    assert stats.max_abs_error <= 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("codec", [UniformCodec(4, None, "fp16", False), UniformCodec(4, None, "fp16", True),
                                   UniformCodec(8, 16, "fp32", False), Int8BlockCodec(16),
                                   CastCodec("bfloat16"), CastCodec("float16")], ids=repr)
def test_non_finite_input_raises_value_error(codec, bad):
    x = torch.randn(4, 50)
    x[2, 17] = bad
    with pytest.raises(ValueError, match="inf or nan"):
        codec.encode(x)


def test_unrepresentable_scales_raise_value_error():
    big = torch.randn(2, 30) * 1e6
    with pytest.raises(ValueError):
        UniformCodec(4, None, "fp16", False).encode(big)
    codec = UniformCodec(4, None, "fp32", False)
    assert codec.decode(codec.encode(big)[0], (2, 30), torch.float32).isfinite().all()
    with pytest.raises(ValueError):
        CastCodec("float16").encode(torch.full((1, 3), 1e5))


def test_lossy_codecs_refuse_non_float_input():
    for codec in (UniformCodec(), Int8BlockCodec(), CastCodec()):
        with pytest.raises(ValueError):
            codec.encode(torch.arange(10).view(2, 5))


# ---------------------------------------------------------------- statistics

@pytest.mark.parametrize("codec", [UniformCodec(3, None, "fp16", True), UniformCodec(4, 64, "fp32", False),
                                   Int8BlockCodec(32), CastCodec("bfloat16"), CastCodec("float16")], ids=repr)
def test_stats_match_a_direct_computation(codec):
    x = sample("laplace", (37, 301), seed=7)
    data, stats = codec.encode(x)
    y = codec.decode(data, tuple(x.shape), torch.float32).double()
    err = y - x.double()
    assert stats.max_abs_error == pytest.approx(float(err.abs().max()), rel=1e-6)
    assert stats.sq_error_sum == pytest.approx(float((err ** 2).sum()), rel=1e-4)
    assert stats.sq_ref_sum == pytest.approx(float((x.double() ** 2).sum()), rel=1e-5)


# ---------------------------------------------------------------- int8_block and cast

@pytest.mark.parametrize("shape,block", [((1, 1000), 256), ((7, 13), 5), ((3, 300), 1), ((2, 2), 256)], ids=str)
def test_int8_block_error_is_at_most_half_a_scale(shape, block):
    x = sample("rows", shape, seed=8)
    x.view(-1)[:block] = 0.0  # an all-zero block is exact
    codec = Int8BlockCodec(block)
    data, _ = codec.encode(x)
    n = x.numel()
    nb = -(-n // block)
    assert len(bytes(data)) == nb * 4 + n
    scales = torch.from_numpy(np.frombuffer(bytes(data)[:nb * 4], np.float32).copy()).double()
    y = codec.decode(data, shape, torch.float32)
    err = (y.double() - x.double()).reshape(-1).abs()
    per_elem = scales.repeat_interleave(block)[:n]
    assert (err <= per_elem / 2 + 1e-7 * x.abs().max()).all()
    assert float(err[:block].max()) == 0.0


@pytest.mark.parametrize("to,rel", [("bfloat16", 2 ** -8), ("float16", 2 ** -11)])
def test_cast_error_is_half_an_ulp(to, rel):
    x = sample("normal", (5, 77), seed=9) * 10
    codec = CastCodec(to)
    data, stats = codec.encode(x)
    assert len(bytes(data)) == x.numel() * 2
    y = codec.decode(data, (5, 77), torch.float32)
    assert ((y - x).abs() <= x.abs() * rel * 1.0001).all()
    assert torch.equal(y, x.to(getattr(torch, to)).float())
    assert codec.decode(data, (5, 77), torch.float64).dtype == torch.float64


# ---------------------------------------------------------------- numpy encoders: format pinned, search

def _reference_plain_bytes(x: torch.Tensor, bits: int, sdt: torch.dtype) -> bytes:
    """The v1 uniform layout (per-row) computed independently with torch: stored min rounded down,
    step rounded up to the scale dtype, codes round-half-even and clamped, packed LSB first."""
    q = (1 << bits) - 1
    x64 = x.double()
    lo, hi = x64.amin(1), x64.amax(1)

    def directed(v: torch.Tensor, up: bool) -> torch.Tensor:
        r = v.to(sdt)
        wrong = r.double() < v if up else r.double() > v
        return torch.where(wrong, torch.nextafter(r, torch.full_like(r, float("inf") if up else -float("inf"))), r)
    m = directed(lo, up=False)
    s = directed((hi - m.double()) / q, up=True)
    inv = torch.where(s.float() > 0, 1.0 / s.float(), torch.zeros_like(s.float()))
    codes = ((x.float() - m.float()[:, None]) * inv[:, None]).round().clamp(0, q).to(torch.uint8)
    return m.numpy().tobytes() + s.numpy().tobytes() + pack(codes.numpy().reshape(-1), bits).tobytes()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
def test_plain_uniform_bytes_match_an_independent_torch_reference(bits, scale_dtype):
    """The numpy encoder writes exactly the bytes of the stored v1 format (bit compatibility)."""
    x = torch.cat([sample("normal", (20, 64), seed=11) * 0.02, sample("laplace", (5, 64), seed=12),
                   sample("offset", (3, 64), seed=13)])
    sdt = {"fp16": torch.float16, "fp32": torch.float32}[scale_dtype]
    assert bytes(UniformCodec(bits, None, scale_dtype, False).encode(x)[0]) == _reference_plain_bytes(x, bits, sdt)


def _reference_greedy_mse(row: np.ndarray, bits: int) -> float:
    """FBGEMM's greedy search for one row, written as plainly as possible (float64), then the
    squared error of quantizing the row with the best range found."""
    q = (1 << bits) - 1
    lo, hi = float(row.min()), float(row.max())
    step = (hi - lo) / 200

    def loss(a: float, b: float) -> float:
        s = (b - a) / q
        codes = np.clip(np.rint((row - a) / s), 0, q) if s > 0 else np.zeros_like(row)
        return float(((codes * s + a - row) ** 2).sum())
    cur_lo, cur_hi, best = lo, hi, (loss(lo, hi), lo, hi)
    for _ in range(32):
        up, down = loss(cur_lo + step, cur_hi), loss(cur_lo, cur_hi - step)
        cur_lo, cur_hi = (cur_lo + step, cur_hi) if up < down else (cur_lo, cur_hi - step)
        best = min(best, (min(up, down), cur_lo, cur_hi))
    return min(best[0], loss(lo, hi))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("kind,shape", [("normal", (40, 64)), ("laplace", (40, 16)), ("normal", (3, 5000))], ids=str)
def test_greedy_search_matches_a_plain_reference(kind, shape, bits):
    """The vectorised search (transposed short rows, sorted long rows) finds ranges as good as
    a per-row reference loop (stored fp32 parameters: only the search differs)."""
    x = sample(kind, shape, seed=14)
    codec = UniformCodec(bits, None, "fp32", True)
    y = codec.decode(codec.encode(x)[0], shape, torch.float32).double()
    got = ((y - x.double()) ** 2).sum(1).numpy()
    want = np.array([_reference_greedy_mse(r, bits) for r in x.double().numpy()])
    assert got.sum() <= want.sum() * (1 + 1e-3)
    assert (got <= want * (1 + 1e-2) + 1e-12).mean() >= 0.95  # float32 search vs float64: rare near-ties


def test_greedy_search_does_not_depend_on_its_row_block(monkeypatch):
    import ckpt_core.codecs.rowwise as rowwise

    x = sample("laplace", (300, 48), seed=15)
    codec = UniformCodec(3, None, "fp16", True)
    expected = bytes(codec.encode(x)[0])
    for elems in (1, 100, 48 * 7, 1 << 20):  # one row at a time (row layout) .. all rows transposed
        monkeypatch.setattr(rowwise, "SEARCH_ELEMS", elems)
        assert bytes(codec.encode(x)[0]) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_encode_statistics_see_the_final_cast_exactly(dtype):
    """Stats describe the decoded tensor in its own dtype (numpy emulates torch's bf16 rounding)."""
    x = sample("laplace", (31, 77), seed=16).to(dtype)
    for codec in (UniformCodec(4, None, "fp32", True), UniformCodec(3, 16, "fp16", False), Int8BlockCodec(50)):
        data, stats = codec.encode(x)
        err = codec.decode(data, (31, 77), dtype).double() - x.double()
        assert stats.max_abs_error == float(err.abs().max())
        assert stats.sq_error_sum == pytest.approx(float((err ** 2).sum()), rel=1e-5)


def test_encoders_run_no_torch_ops(monkeypatch):
    """The encoders must not fan out to torch's intra-op threads (docs/benchmarks.md P4): with
    every torch op that could run a parallel kernel made to fail, encoding still works."""
    x = sample("normal", (600, 64), seed=17)
    expected = [bytes(c.encode(x)[0]) for c in (UniformCodec(4, None, "fp16", True), Int8BlockCodec(64),
                                                UniformCodec(2, 32, "fp32", True))]

    def refuse(*args, **kwargs):
        raise AssertionError("torch op in an encoder")
    ops = ("amin", "amax", "abs", "round", "clamp", "where", "searchsorted", "dot", "add", "sub", "mul")
    for name in ops:
        monkeypatch.setattr(torch, name, refuse)
    for name in ("amin", "amax", "abs", "round", "clamp", "add", "sub", "mul", "to", "round_", "clamp_", "add_",
                 "sub_", "mul_", "__sub__", "__mul__", "__add__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = [bytes(c.encode(x)[0]) for c in (UniformCodec(4, None, "fp16", True), Int8BlockCodec(64),
                                           UniformCodec(2, 32, "fp32", True))]
    assert got == expected
