"""The blocking part of an incremental save (issue 24): the C row kernel and its numpy fallback find
the same rows bitwise, the comparison is shared with the copier's helper thread, and what the
engine saves stays exact on both paths."""
from __future__ import annotations

import platform
import shutil
import threading

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.saving import streams
from ckpt_core.saving.copier import SPLIT_COPY_BYTES, Copier

needs_native = pytest.mark.skipif(not streams.native_available(), reason="ckpt_core._crows was not built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t).view(torch.uint8) if t.is_complex() else t.view(torch.uint8)


def _random(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(rows, cols, generator=g) > 0.5
    if dtype == torch.complex64:
        return torch.randn(rows, cols, 2, generator=g).contiguous().view(torch.complex64).view(rows, cols)
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (rows, cols), generator=g).to(dtype)
    return torch.randn(rows, cols, generator=g).to(dtype)


def _changed_pair(rows: int, cols: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, live): ``live`` differs from ``reference`` by single flipped bits in random rows,
    the first and last rows and the rows around the middle."""
    g = torch.Generator().manual_seed(seed)
    ref = _random(rows, cols, dtype, g)
    live = ref.clone()
    picked = torch.randperm(rows, generator=g)[: max(1, rows // 50)].tolist()
    for r in set(picked + [0, rows - 1, max(0, rows // 2 - 1), rows // 2]):
        row = _bits(live[r]).view(-1)
        row[int(torch.randint(row.numel(), (1,), generator=g))] ^= 1 << int(torch.randint(8, (1,), generator=g))
    return ref, live


def _run(live: torch.Tensor, ref: torch.Tensor, native: bool, share=None) -> tuple[list[int], torch.Tensor]:
    dst = ref.clone()
    saved = streams._NATIVE
    if not native:
        streams._NATIVE = None
    try:
        out = streams.copy_changed_rows(live, dst, share)
    finally:
        streams._NATIVE = saved
    assert out.dtype == torch.int64
    return out.tolist(), dst


def _expected(live: torch.Tensor, ref: torch.Tensor) -> list[int]:
    a, b = _bits(live).reshape(live.shape[0], -1), _bits(ref).reshape(ref.shape[0], -1)
    return torch.ne(a, b).any(dim=1).nonzero().squeeze(1).tolist()


@needs_native
@pytest.mark.parametrize("dtype,cols", [(torch.float32, 64), (torch.float32, 3), (torch.float16, 3),
                                        (torch.bfloat16, 8), (torch.float64, 1), (torch.int8, 5),
                                        (torch.bool, 9), (torch.complex64, 2), (torch.int64, 2)])
@pytest.mark.parametrize("rows", [1, 2, 1031, 9000])
def test_native_and_numpy_find_the_same_rows(dtype, cols, rows):
    ref, live = _changed_pair(rows, cols, dtype, seed=rows * 31 + cols)
    want = _expected(live, ref)
    copier = Copier()
    try:
        results = [_run(live, ref, native=False), _run(live, ref, native=True),
                   _run(live, ref, native=True, share=copier.share)]
    finally:
        copier.close()
    for found, dst in results:
        assert found == want
        assert torch.equal(_bits(dst), _bits(live))


@needs_native
@pytest.mark.parametrize("native", [True, False])
def test_signed_zeros_and_nan_payloads_count_as_changes(native):
    ref = torch.zeros(4096, 16)
    ref[10, 3] = float("nan")
    live = ref.clone()
    live[1, 0] = -0.0  # == 0.0, but other bits
    _bits(live[2])[4 * 5:4 * 6] = torch.tensor([1, 0, 192, 127], dtype=torch.uint8)  # NaN, payload 1
    live[4095, 15] = 1e-45  # the smallest subnormal, last element of the last row
    copier = Copier()
    try:
        found, dst = _run(live, ref, native, share=copier.share)
    finally:
        copier.close()
    assert found == [1, 2, 4095]  # row 10: the same NaN bits on both sides, unchanged
    assert torch.equal(_bits(dst), _bits(live))


@needs_native
def test_no_change_and_every_row_changed():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(SPLIT_COPY_BYTES // 64 + 3, 16, generator=g)  # shared with the helper
    copier = Copier()
    try:
        for native in (True, False):
            assert _run(ref.clone(), ref, native, copier.share)[0] == []
            live = ref + 1
            found, dst = _run(live, ref, native, copier.share)
            assert found == list(range(ref.shape[0])) and torch.equal(dst, live)
    finally:
        copier.close()


class _Spy:
    """Stands in for the loaded C library: records the rows of each call, then makes it."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, []

    def checkrun_copy_changed_rows(self, *args):
        self.calls.append((args[4], args[2]))  # (first row, rows)
        return self.lib.checkrun_copy_changed_rows(*args)


@needs_native
def test_a_large_table_is_compared_in_parts_shared_with_the_helper(monkeypatch, tmp_path):
    spy = _Spy(streams._NATIVE)
    monkeypatch.setattr(streams, "_NATIVE", spy)
    emb = torch.randn(3 * streams._PART_BYTES // 256, 64)  # 3 parts of 4 MiB
    changed = [5, emb.shape[0] // 3, emb.shape[0] // 3 + 1, emb.shape[0] - 1]
    cfg = EngineConfig.from_dict({"incremental": {"row_delta_min_rows": 64}})
    with CheckpointEngine(cfg) as engine:
        engine.save({"emb": emb}, tmp_path / "0.ckpt").result()
        emb[changed] += 1
        info = engine.save({"emb": emb}, tmp_path / "1.ckpt").result()
        assert torch.equal(engine.load(tmp_path / "1.ckpt")["emb"], emb)
    assert info.chain_depth == 1
    step = emb.shape[0] // 3
    assert sorted(spy.calls) == [(0, step), (step, step), (2 * step, step)]


def test_share_runs_the_parts_the_helper_has_not_started_on_this_thread():
    copier = Copier()
    release, threads = threading.Event(), {}

    def part(i: int) -> int:
        threads[i] = threading.get_ident()
        if i == 0:
            release.wait()  # holds the helper: parts 1 and 2 cannot start there
        if i == 1:
            release.set()
        return i * 10
    try:
        join = copier.share([lambda i=i: part(i) for i in range(3)])
        assert join() == [0, 10, 20]
        assert threads[1] == threads[2] == threading.get_ident()
        assert copier.finish() is None  # parts run by join count as done
    finally:
        copier.close()


def test_settle_waits_for_started_parts_when_a_part_fails():
    copier = Copier()
    release, done = threading.Event(), []

    def slow() -> int:
        release.wait()
        done.append(True)
        return 0

    def failing() -> int:
        release.set()
        raise RuntimeError("part failed")
    try:
        join = copier.share([slow, failing])
        with pytest.raises(RuntimeError, match="part failed"):
            join()
        copier.settle()
        assert done == [True]  # what the helper writes is over before buffers go back
    finally:
        copier.close()


@pytest.mark.parametrize("native", [True, False])
def test_dense_changes_become_full_bases_on_both_paths(monkeypatch, tmp_path, native):
    """Without sampling (the C path) a table whose rows all changed is found by the comparison:
    a full base, then whole copies for the next saves, like the numpy path's sampled guess."""
    if native and not streams.native_available():
        pytest.skip("ckpt_core._crows was not built")
    if not native:
        monkeypatch.setattr(streams, "_NATIVE", None)
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(8192, 64, generator=g)  # 2 MiB: sampled on the numpy path
    small = torch.randn(2048, 20, generator=g)  # 160 KiB: never sampled
    state = {"emb": emb, "small": small}
    cfg = EngineConfig.from_dict({"incremental": {"row_delta_min_rows": 64, "max_chain": 3}})
    depths = []
    with CheckpointEngine(cfg) as engine:
        engine.save(state, tmp_path / "0.ckpt").result()
        emb.add_(1.0)
        small.add_(1.0)
        depths.append(engine.save(state, tmp_path / "1.ckpt").result().chain_depth)
        after_dense = {k: v.clone() for k, v in state.items()}
        emb[7] += 1
        small[9] += 1
        depths.append(engine.save(state, tmp_path / "2.ckpt").result().chain_depth)
        for name, want in (("1.ckpt", after_dense), ("2.ckpt", state)):
            loaded = engine.load(tmp_path / name)
            assert all(torch.equal(_bits(loaded[k]), _bits(v)) for k, v in want.items())
    assert depths == [0, 0]  # dense: a base, and whole copies while the tensor is believed dense


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None,
                    reason="the C kernels are built for x86-64 with a C compiler")
def test_c_row_kernel_was_built():
    # pip install builds ckpt_core._crows where a compiler exists; losing it silently would put a
    # numpy comparison of every row table on the training thread (2-3x the copy floor).
    assert streams.native_available()


@pytest.mark.parametrize("view", ["transposed", "row_slice"])
def test_a_large_view_is_split_only_along_its_outermost_dimension(monkeypatch, view):
    """Halves of a transposed view lose torch's fast transpose copy (h150: a 1 GiB ``.t()`` blocked the
    training thread 9-17x the copy floor); a slice of rows is still copied in two halves."""
    base = torch.randn(SPLIT_COPY_BYTES // 4 * 2)
    src = base.view(-1, 256).t() if view == "transposed" else base.view(-1, 256)[:, :200]
    copier = Copier()
    submitted = []
    real = copier._submit
    monkeypatch.setattr(copier, "_submit", lambda fn, *args: (submitted.append(fn), real(fn, *args))[1])
    dst = torch.empty(src.numel())
    try:
        copier.copy(src, dst)
        assert copier.finish() is None
    finally:
        copier.close()
    assert torch.equal(dst.view_as(src), src)
    assert len(submitted) == (0 if view == "transposed" else 1)
