"""The C quantization kernels (ckpt_core._cquant) against the numpy code they replace (issue 24).

Plain uniform quantization must give the same bytes either way; the greedy search must find the
same ranges but for float32 near-ties (the kernels add squared errors in another order), so it is
held to the numpy search's error row by row. Edge shapes: one row, one column, row counts that are
not a multiple of the kernels' 16-row block, rows longer than their 1024-element float32 sums.
"""
from __future__ import annotations

import platform
import shutil
import threading

import numpy as np
import pytest
import torch

import ckpt_core.codecs.rowwise as rowwise
from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.codecs import UniformCodec

BITS = [2, 3, 4, 8]
SHAPES = [(1, 1), (1, 64), (5, 1), (17, 3), (33, 64), (40, 128), (3, 1500)]
needs_native = pytest.mark.skipif(not rowwise.native_available(), reason="ckpt_core._cquant was not built")


def sample(kind: str, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.02
    if kind == "trained":  # each row its own scale and offset, heavy tails
        t = torch.randn(shape, generator=g) / (torch.rand(shape, generator=g) + 0.05).sqrt()
        x = t * torch.exp(torch.randn(shape[0], 1, generator=g)) * 0.01 + torch.randn(shape[0], 1, generator=g)
    elif kind == "constant":
        x = torch.full(shape, 0.1)
    elif kind == "mixed":  # constant rows, signed zeros, a huge offset and a tiny scale among normal rows
        x[::3] = 0.25
        x[1::5, ::2] = -0.0
        x[2::7] = 1000.0 + x[2::7] * 1e-3
        x[4::11] *= 1e-3  # steps below fp16's normal range (values ~1e-8 are refused: test_lossy_refusal)
    return x.contiguous()


def encode_both(codec: UniformCodec, x: torch.Tensor, monkeypatch) -> tuple[bytes, bytes]:
    """(bytes from the C kernels, bytes from numpy) of one encoding."""
    native = bytes(codec.encode(x)[0])
    with monkeypatch.context() as m:
        m.setattr(rowwise, "_NATIVE", None)
        plain_numpy = bytes(codec.encode(x)[0])
    return native, plain_numpy


@needs_native
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "trained", "constant", "mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_plain_codes_are_byte_identical(shape, kind, bits, scale_dtype, monkeypatch):
    x = sample(kind, shape)
    if kind == "mixed":  # numpy's min of +0 and -0 may be either zero: only values must agree
        x[1::5, ::2] = 0.0
    native, numpy_bytes = encode_both(UniformCodec(bits, None, scale_dtype, False), x, monkeypatch)
    assert native == numpy_bytes


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [None, 7, 64])
def test_plain_block_mode_and_statistics_match(bits, block, monkeypatch):
    x = sample("trained", (37, 301), seed=1)
    codec = UniformCodec(bits, block, "fp16", False)
    native, stats = codec.encode(x)
    monkeypatch.setattr(rowwise, "_NATIVE", None)
    expected, want = codec.encode(x)
    assert bytes(native) == bytes(expected)
    assert stats.max_abs_error == want.max_abs_error
    assert stats.sq_error_sum == pytest.approx(want.sq_error_sum, rel=1e-5)
    assert stats.sq_ref_sum == pytest.approx(want.sq_ref_sum, rel=1e-5)


def _row_sq_errors(codec: UniformCodec, data: bytes, x: torch.Tensor) -> np.ndarray:
    y = codec.decode(data, tuple(x.shape), torch.float32)
    return ((y.double() - x.double()) ** 2).sum(1).numpy()


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kind", ["normal", "trained", "constant", "mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_greedy_search_matches_numpy_row_by_row(shape, kind, bits, monkeypatch):
    x = sample(kind, shape, seed=2)
    codec = UniformCodec(bits, None, "fp32", True)
    native, numpy_bytes = encode_both(codec, x, monkeypatch)
    got, want = _row_sq_errors(codec, native, x), _row_sq_errors(codec, numpy_bytes, x)
    # Same search: a range can differ only where two candidates tie to float32 rounding.
    assert np.all(got <= want * (1 + 1e-5) + 1e-30)
    assert got.sum() <= want.sum() * (1 + 1e-6) + 1e-30


@needs_native
@pytest.mark.parametrize("bits", BITS)
def test_greedy_ranges_agree_with_the_numpy_search(bits, monkeypatch):
    """The raw search outputs (before the stored-parameter check) are the same ranges: on many
    short rows numpy sums each row's squared errors in element order in float32, as the kernel does."""
    xc = sample("trained", (1000, 64), seed=3).numpy()
    lo, hi = xc.min(1), xc.max(1)
    native = rowwise.greedy_range(xc, lo, hi, bits)
    monkeypatch.setattr(rowwise, "_NATIVE", None)
    expected = rowwise.greedy_range(xc, lo, hi, bits)
    assert np.array_equal(native[0], expected[0]) and np.array_equal(native[1], expected[1])


@needs_native
@pytest.mark.parametrize("bits", BITS)
def test_greedy_never_worse_than_plain_per_row(bits, monkeypatch):
    x = sample("trained", (333, 64), seed=4)
    greedy = UniformCodec(bits, None, "fp16", True)
    native, numpy_bytes = encode_both(greedy, x, monkeypatch)
    plain = _row_sq_errors(greedy, bytes(UniformCodec(bits, None, "fp16", False).encode(x)[0]), x)
    got = _row_sq_errors(greedy, native, x)
    assert np.all(got <= plain)
    assert got.sum() <= _row_sq_errors(greedy, numpy_bytes, x).sum() * (1 + 1e-6)
    if bits <= 4:  # the search pays on these rows
        assert got.sum() < 0.95 * plain.sum()


@needs_native
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("col", [0, 15, 16, 62])  # in the vector part and in the tail of a 63-wide row
def test_inf_and_nan_are_refused_by_the_kernels(bad, col):
    x = sample("normal", (20, 63))
    x[17, col] = bad
    for greedy in (False, True):
        with pytest.raises(ValueError, match="inf or nan"):
            UniformCodec(4, None, "fp16", greedy).encode(x)


@needs_native
def test_strided_rows_are_read_correctly(monkeypatch):
    base = sample("normal", (50, 200), seed=5).numpy()
    view = base[:, 10:74]  # rows 200 apart: the kernels take the row stride
    lo, hi = rowwise._native_minmax(view)
    assert np.array_equal(lo, view.min(1)) and np.array_equal(hi, view.max(1))
    native = rowwise.quantize_rows(view, torch.float32, 4, np.dtype(np.float16), True)
    monkeypatch.setattr(rowwise, "_NATIVE", None)
    expected = rowwise.quantize_rows(view, torch.float32, 4, np.dtype(np.float16), True)
    assert all(np.array_equal(a, b) for a, b in zip(native[:3], expected[:3]))


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None,
                    reason="the C kernels are built for x86-64 with a C compiler")
def test_c_quantization_kernels_were_built():
    # pip install builds ckpt_core._cquant where a compiler exists; losing it silently would make
    # greedy quantization about 5x slower.
    assert rowwise.native_available()


def test_quantization_runs_off_the_training_thread(tmp_path, monkeypatch):
    """Every encode of a quantized tensor runs on a background worker, never on the thread that
    calls save (issue 24: quantization must not stall training)."""
    threads: list[int] = []
    original = UniformCodec.encode

    def spy(self, array):
        threads.append(threading.get_ident())
        return original(self, array)
    monkeypatch.setattr(UniformCodec, "encode", spy)
    cfg = EngineConfig.from_dict({
        "quantization": [{"pattern": "emb", "method": "uniform", "bits": 4, "greedy": True, "min_numel": 1}],
        "compression": {"chunk_bytes": 8192},
        "saving": {"background": "thread", "sigterm_grace_seconds": None},
        "storage": {"fsync": False},
    })
    state = {"emb": sample("trained", (512, 64), seed=6), "dense": torch.randn(100)}
    with CheckpointEngine(cfg) as engine:
        engine.save(state, tmp_path / "step=1.ckpt").result()
        restored = engine.load(tmp_path / "step=1.ckpt")
    assert len(threads) >= 2  # several chunks of the table
    assert threading.get_ident() not in threads
    assert torch.allclose(restored["emb"], state["emb"], atol=float(state["emb"].abs().max()) / 8)
