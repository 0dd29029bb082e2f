"""The accelerator path (issue 26), as far as a CPU can show it.

No test here runs a CUDA tensor: GPU behaviour is checked by ``benchmarks/gpu_check.py`` on a GPU.
What is forged here stands in for a device: a manifest whose tensors claim ``cuda:0``, a pickled
value whose tensor claims ``cuda:0``, RNG states of two GPUs, a meta-device embedding table (a copy
of it to the CPU fails, as a device sync would be an error under ``set_sync_debug_mode``).
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_core import CheckpointEngine, CheckrunError
from ckpt_core import save as ckpt_core_save
from ckpt_core.format.manifest import parse_manifest
from ckpt_core.saving.staging import BufferPool, Copier, MemoryBudget
from ckpt_core.saving.tracking import EmbeddingTracker

SYNC = {"saving": {"asynchronous": False}}
Pair = collections.namedtuple("Pair", "a b")


class Box(dict):
    """A dict subclass: pickled, not flattened."""


class Tagged(torch.Tensor):
    """A tensor subclass: pickled with its class."""


class ExplodingStep(torch.Tensor):
    """A "step" whose value cannot be read: an error in the blocking part after the budget was charged."""

    def __int__(self):
        raise RuntimeError("exploding step")


def _forge_devices(path: Path, device: str) -> None:
    """Rewrite a committed manifest as if every tensor had been saved from ``device``."""
    m = parse_manifest(path.read_bytes(), str(path))
    tensors = tuple(dataclasses.replace(t, device=device) for t in m.tensors)
    path.write_bytes(dataclasses.replace(m, tensors=tensors).to_bytes())


# -- 1: no host reference copies for tensors saved from a device --------------------------------
def _streams(engine: CheckpointEngine) -> int:
    for d in engine._dirs.values():  # references a load rebuilds in the background (load.reference)
        engine._adopt_rebuilds(d)
    return sum(len(d.streams) for d in engine._dirs.values())


def test_no_reference_copy_after_loading_tensors_saved_from_a_device(tmp_path):
    state = {"emb": torch.randn(2048, 8), "small": torch.randn(3)}
    with CheckpointEngine(SYNC) as engine:
        engine.save(state, tmp_path / "cpu.ckpt")
        engine.save(state, tmp_path / "gpu.ckpt")
    _forge_devices(tmp_path / "gpu.ckpt", "cuda:0")
    with CheckpointEngine(SYNC) as engine:  # control: saved from the CPU, a row stream is kept
        engine.load(tmp_path / "cpu.ckpt", map_location="cpu")
        assert _streams(engine) == 1
    with CheckpointEngine(SYNC) as engine:
        out = engine.load(tmp_path / "gpu.ckpt", map_location="cpu")
        assert out["emb"].device.type == "cpu" and torch.equal(out["emb"], state["emb"])
        assert _streams(engine) == 0  # no private host copy of a tensor that lives on a GPU


# -- 2: map_location reaches tensors inside pickled values --------------------------------------
def _save_with_cuda_tags(path: Path, state: dict, monkeypatch) -> None:
    """Save ``state`` while torch.save tags every storage ``cuda:0`` (what a GPU run writes)."""
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        with CheckpointEngine(SYNC) as engine:
            engine.save(state, path)


def _pickled_state():
    t = torch.arange(6.0).reshape(2, 3)
    dd = collections.defaultdict(list)
    dd["x"].append(t)
    return {"dd": dd, "pair": Pair(t + 1, {"k": t * 2}), "box": Box(w=t - 1), "plain": torch.ones(2)}


def test_map_location_applies_to_tensors_inside_pickled_values(tmp_path, monkeypatch):
    state = _pickled_state()
    _save_with_cuda_tags(tmp_path / "c.ckpt", state, monkeypatch)
    with CheckpointEngine() as engine:
        out = engine.load(tmp_path / "c.ckpt", map_location="cpu", weights_only=False)
    assert type(out["dd"]) is collections.defaultdict and type(out["pair"]) is Pair and type(out["box"]) is Box
    assert torch.equal(out["dd"]["x"][0], state["dd"]["x"][0]) and out["dd"]["x"][0].device.type == "cpu"
    assert torch.equal(out["pair"].b["k"], state["pair"].b["k"])
    assert torch.equal(out["box"]["w"], state["box"]["w"])


def test_map_location_none_puts_pickled_tensors_on_the_cpu_without_their_backend(tmp_path, monkeypatch):
    """Like the engine's own tensors: a CUDA checkpoint read on a CPU-only machine lands on the CPU."""
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA restores to the GPU")
    state = _pickled_state()
    _save_with_cuda_tags(tmp_path / "c.ckpt", state, monkeypatch)
    with CheckpointEngine() as engine:
        out = engine.load(tmp_path / "c.ckpt", weights_only=False)
        dict_form = engine.load(tmp_path / "c.ckpt", map_location={"cuda:0": "cpu"}, weights_only=False)
    assert torch.equal(out["dd"]["x"][0], state["dd"]["x"][0])
    assert torch.equal(dict_form["box"]["w"], state["box"]["w"])


def test_map_location_applies_to_tensor_subclasses_inside_pickled_values(tmp_path, monkeypatch):
    t = torch.arange(4.0).as_subclass(Tagged)
    _save_with_cuda_tags(tmp_path / "s.ckpt", {"v": [t], "d": collections.defaultdict(int, a=1)}, monkeypatch)
    with CheckpointEngine() as engine:
        out = engine.load(tmp_path / "s.ckpt", map_location="cpu", weights_only=False)
    assert type(out["v"][0]) is Tagged and torch.equal(out["v"][0], t)


# -- 3: the Accelerate adapter loads onto the CPU ------------------------------------------------
def test_accelerate_load_state_loads_parts_onto_the_cpu(tmp_path, monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from accelerate_ckpt import AcceleratorCheckpointer

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True))
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        seen = []
        real = CheckpointEngine.load

        def spy(self, path, map_location=None, *args, **kwargs):
            seen.append(map_location)
            return real(self, path, map_location, *args, **kwargs)

        monkeypatch.setattr(CheckpointEngine, "load", spy)
        with AcceleratorCheckpointer(acc, SYNC) as ckpt:
            acc.save_state()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            acc.load_state(map_location="on_device")
            assert seen and all(str(m) == "cpu" for m in seen), seen
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            del ckpt
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# -- 5: no device syncs; errors in the blocking part give everything back ------------------------
def test_tracker_hook_keeps_indices_on_the_tables_device():
    """A meta-device table stands in for a GPU one: copying its indices to the CPU fails."""
    emb = nn.Embedding(100, 4, device="meta")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    tracker = EmbeddingTracker(emb, opt)
    try:
        emb(torch.tensor([1, 5, 7], device="meta"))
        tracker.captured()  # ticks the clock without reading the device
    finally:
        tracker.close()


def test_tracker_still_tracks_cpu_tables():
    emb = nn.Embedding(50, 4)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    tracker = EmbeddingTracker(emb, opt)
    try:
        emb(torch.tensor([[3, 9], [9, 4]]))
        assert tracker.rows_for(emb.weight, 0).tolist() == [3, 4, 9]
        tracker.captured()
        assert tracker.rows_for(emb.weight, 1).tolist() == [3, 4, 9]  # looked up, not yet stepped
        opt.step()
        tracker.captured()
        assert tracker.rows_for(emb.weight, 2).tolist() == []
    finally:
        tracker.close()


def test_error_in_the_blocking_part_refunds_the_budget(tmp_path):
    with CheckpointEngine(SYNC) as engine:
        with pytest.raises(RuntimeError, match="exploding"):
            engine.save({"w": torch.randn(64, 4), "step": torch.tensor(3).as_subclass(ExplodingStep)},
                        tmp_path / "x.ckpt")
        assert engine._budget.in_use == 0
        engine.save({"w": torch.randn(64, 4)}, tmp_path / "y.ckpt")
        assert engine._budget.in_use == 0


def test_error_in_the_blocking_part_gives_the_staging_buffers_back(tmp_path):
    bad = collections.defaultdict(lambda: 0)  # torch.save cannot pickle the lambda
    with CheckpointEngine(SYNC) as engine:
        with pytest.raises(Exception):
            engine.save({"w": torch.randn(64, 4), "bad": bad}, tmp_path / "x.ckpt")
        assert engine._budget.in_use == 0
        engine.save({"w": torch.randn(64, 4)}, tmp_path / "y.ckpt")
        assert engine.staging.allocations == 1  # the first save's buffer came back and was reused


def test_failed_capture_does_not_lose_row_changes(tmp_path):
    """Row streams captured by a save that then fails no longer match what is committed."""
    emb = torch.zeros(2048, 8)
    with CheckpointEngine(SYNC) as engine:
        engine.save({"emb": emb}, tmp_path / "a.ckpt")
        emb[5] = 1.0
        with pytest.raises(Exception):
            engine.save({"emb": emb, "bad": collections.defaultdict(lambda: 0)}, tmp_path / "b.ckpt")
        emb[7] = 2.0
        engine.save({"emb": emb}, tmp_path / "c.ckpt")
        assert torch.equal(engine.load(tmp_path / "c.ckpt")["emb"], emb)


def test_step_tensor_meta_still_recorded_for_cpu(tmp_path):
    with CheckpointEngine(SYNC) as engine:
        engine.save({"step": torch.tensor(12), "epoch": 2, "w": torch.ones(2)}, tmp_path / "m.ckpt")
        meta = engine.read_manifest(tmp_path / "m.ckpt").meta
    assert meta["step"] == 12 and meta["epoch"] == 2


@pytest.mark.parametrize("background", ["thread", "process"])
def test_objects_holding_device_tensors_are_serialised_after_the_copy(tmp_path, monkeypatch, background):
    """The deferred path (what a CUDA storage inside a pickled value takes), forced for CPU
    storages: the value is snapshotted in save() and pickled by the background part."""
    from ckpt_core.saving import capture
    from ckpt_core.format import objects

    monkeypatch.setattr(objects, "_staged_device", lambda device: True)
    monkeypatch.setattr(capture, "_devices_in_use", lambda sources: True)
    calls = []
    real = objects.serialize_object
    monkeypatch.setattr(capture, "serialize_object", lambda obj: calls.append(obj) or real(obj))
    t = torch.arange(8.0)
    dd = collections.defaultdict(list, x=[t, t[2:5]])
    with CheckpointEngine({"saving": {"background": background}}) as engine:
        handle = engine.save({"dd": dd, "pair": Pair(t, 3)}, tmp_path / "o.ckpt")
        t.add_(100)  # after save(): must not reach the checkpoint
        handle.result()
        assert not calls  # not pickled by torch.save inside save()
        assert engine._budget.in_use == 0
        out = engine.load(tmp_path / "o.ckpt", weights_only=False)
    assert torch.equal(out["dd"]["x"][0], torch.arange(8.0))
    assert torch.equal(out["dd"]["x"][1], torch.arange(2.0, 5.0))
    assert out["dd"]["x"][1].untyped_storage().data_ptr() == out["dd"]["x"][0].untyped_storage().data_ptr()
    assert torch.equal(out["pair"].a, torch.arange(8.0)) and out["pair"].b == 3


# -- 7: meta tensors refused, device copies never split across threads --------------------------
def test_meta_tensors_are_refused_with_a_checkrun_error(tmp_path):
    with CheckpointEngine(SYNC) as engine:
        with pytest.raises(CheckrunError, match="meta"):
            engine.save({"w": torch.empty(4, 4, device="meta")}, tmp_path / "m.ckpt")
        assert engine._budget.in_use == 0


def test_non_cpu_copies_are_never_split_across_threads():
    """Any non-CPU source is a device tensor: copied on the calling thread (or a side stream), never
    half of it by the helper thread (two threads using MPS at once crash the process)."""
    copier = Copier()
    src = torch.empty(1024, 1024, device="meta")  # 4 MiB: a CPU tensor this size would be split
    dst = torch.empty(src.numel())
    with pytest.raises((NotImplementedError, RuntimeError)):
        copier.copy(src, dst)
    assert copier._helper is None and not copier._halves
    copier.close()


# -- 8: one pinned arena per snapshot ------------------------------------------------------------
def test_device_staging_is_one_arena_per_snapshot_within_the_budget(monkeypatch):
    from ckpt_core.saving import pinned

    # Stand-in for pinned memory on a CPU-only machine: exact-size host memory.
    monkeypatch.setattr(pinned, "alloc_pinned", lambda nbytes, device: torch.empty(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(pinned, "can_pin", lambda device: True)
    budget = MemoryBudget(None)
    pool = BufferPool(budget=budget)
    specs = [(torch.float32, 1000), (torch.float16, 3), (torch.int64, 0), (torch.uint8, 77)]
    staged = sum(n * dt.itemsize for dt, n in specs)
    charged = pinned.arena_layout(specs)[1]  # what a snapshot charges: the arena, alignment included
    assert staged <= charged <= staged + 64 * len(specs)
    budget.acquire(charged)
    views = pool.take_arena(specs, torch.device("cuda", 0))
    assert pool.allocations == 1
    assert [(v.dtype, v.numel()) for v in views] == specs
    assert pool.allocated_bytes == charged
    ptrs = sorted((v.data_ptr(), v.nbytes) for v in views if v.numel())
    assert all(a + n <= b for (a, n), (b, _) in zip(ptrs, ptrs[1:]))  # disjoint
    for v in views:
        pool.give(v)
    again = pool.take_arena(specs, torch.device("cuda", 0))
    assert pool.allocations == 1 and [v.data_ptr() for v in again] == [v.data_ptr() for v in views]
    other = pool.take_arena(specs, torch.device("cuda", 0))  # a second save in flight: its own arena
    assert pool.allocations == 2 and not {v.data_ptr() for v in other if v.numel()} & {
        v.data_ptr() for v in again if v.numel()}
    for v in again + other:
        pool.give(v)
    budget.release(charged)


def test_give_never_asks_whether_a_buffer_is_pinned(monkeypatch):
    """``is_pinned()`` can create a CUDA context in a CPU-only job."""
    pool = BufferPool(budget=MemoryBudget(1 << 20))
    buf = pool.take(torch.float32, 16, for_cuda=False)

    def boom(self, *a, **k):
        raise AssertionError("is_pinned called")

    monkeypatch.setattr(torch.Tensor, "is_pinned", boom)
    pool.give(buf)
    assert pool.take(torch.float32, 16, for_cuda=False) is buf


# -- 9: a callable map_location's result is the tensor's storage ---------------------------------
def test_callable_map_location_is_called_once_per_tensor_and_its_result_used(tmp_path):
    state = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.tensor(2.5)}
    with CheckpointEngine(SYNC) as engine:
        engine.save(state, tmp_path / "c.ckpt")
        results = []

        def place(storage, location):
            assert location == "cpu"
            out = storage.clone()
            results.append(out)
            return out

        out = engine.load(tmp_path / "c.ckpt", map_location=place)
    assert len(results) == 3
    got = sorted(t.untyped_storage().data_ptr() for t in out.values())
    assert got == sorted(r.data_ptr() for r in results)  # used as is, not copied again
    for k, v in state.items():
        assert torch.equal(out[k], v)


def test_callable_map_location_sees_each_tensors_values_once(tmp_path):
    """A row-delta candidate is probed first (before its values are decoded) with an empty storage:
    nothing of it is copied for the probe."""
    emb = torch.randn(2048, 8)
    with CheckpointEngine(SYNC) as engine:
        engine.save({"emb": emb}, tmp_path / "c.ckpt")
    sizes = []

    def place(storage, location):
        sizes.append(storage.nbytes())
        return storage.clone()

    with CheckpointEngine(SYNC) as engine:
        out = engine.load(tmp_path / "c.ckpt", map_location=place)
    assert sorted(sizes, reverse=True)[0] == emb.nbytes and all(n == 0 for n in sorted(sizes, reverse=True)[1:])
    assert torch.equal(out["emb"], emb)


def test_callable_map_location_returning_none_keeps_the_default(tmp_path):
    with CheckpointEngine(SYNC) as engine:
        engine.save({"a": torch.randn(3)}, tmp_path / "c.ckpt")
        out = engine.load(tmp_path / "c.ckpt", map_location=lambda s, loc: None)
    assert out["a"].device.type == "cpu"


# -- 10: RNG states of more GPUs than are visible ------------------------------------------------
def _fake_cuda_rng(monkeypatch, visible: int) -> list:
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((device, state)))
    return calls


def test_accelerate_rng_restore_with_fewer_visible_gpus(monkeypatch):
    from accelerate_ckpt import state as acc_state

    calls = _fake_cuda_rng(monkeypatch, 1)
    monkeypatch.setattr(acc_state, "_device_rng", lambda: ("cuda", torch.cuda))
    tree = {"python": __import__("random").getstate(),
            "numpy": {"name": "MT19937", "key": torch.zeros(624, dtype=torch.int64), "pos": 624,
                      "has_gauss": 0, "gauss": 0.0},
            "torch": torch.get_rng_state(),
            "device": {"type": "cuda", "states": [torch.full((16,), 1, dtype=torch.uint8),
                                                  torch.full((16,), 2, dtype=torch.uint8)]}}
    with pytest.warns(RuntimeWarning, match="2 cuda device"):
        acc_state._set_rng_state(tree)
    assert [d for d, _ in calls] == [0] and int(calls[0][1][0]) == 1


def test_accelerate_dcp_rng_restore_with_fewer_visible_gpus(monkeypatch):
    pytest.importorskip("torch.distributed.checkpoint")
    from accelerate_ckpt import dcp as acc_dcp

    calls = _fake_cuda_rng(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rng = {"python": __import__("random").getstate(), "torch": torch.get_rng_state(),
           "numpy": ("MT19937", torch.zeros(624, dtype=torch.int64), 624, 0, 0.0),
           "cuda": [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]}
    with pytest.warns(RuntimeWarning, match="2 cuda device"):
        acc_dcp._set_rng_state(rng)
    assert [d for d, _ in calls] == [0]


def test_rng_restore_with_as_many_gpus_warns_nothing(monkeypatch):
    from accelerate_ckpt import state as acc_state

    calls = _fake_cuda_rng(monkeypatch, 2)
    monkeypatch.setattr(acc_state, "_device_rng", lambda: ("cuda", torch.cuda))
    tree = {"python": __import__("random").getstate(),
            "numpy": {"name": "MT19937", "key": torch.zeros(624, dtype=torch.int64), "pos": 624,
                      "has_gauss": 0, "gauss": 0.0},
            "torch": torch.get_rng_state(),
            "device": {"type": "cuda", "states": [torch.zeros(16, dtype=torch.uint8)] * 2}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc_state._set_rng_state(tree)
    assert [d for d, _ in calls] == [0, 1]


# -- the GPU check ------------------------------------------------------------------------------
def test_gpu_check_skips_cleanly_without_cuda():
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the check itself")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py")], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: no CUDA" in proc.stdout


@pytest.mark.parametrize("where, count, message", [
    ("cuda", 0, "map_location 'cuda': this machine has no cuda device (load with map_location='cpu')"),
    (torch.device("cuda", 3), 2, "map_location 'cuda:3': this machine has 2 cuda device(s)"),
    ("mps", 0, "map_location 'mps': this machine has no mps device"),
])
def test_map_location_naming_a_device_this_machine_lacks_is_a_clear_error(tmp_path, monkeypatch, where, count,
                                                                          message):
    """Before, torch failed inside the copy ("Torch not compiled with CUDA enabled"), naming no file.
    The device counts are the machine's as the loader sees them (``placement._BACKENDS``)."""
    import ckpt_core.loading.placement as placement

    path = tmp_path / "a.ckpt"
    ckpt_core_save({"w": torch.ones(3), "o": {"nested": [torch.zeros(2)]}}, path)
    monkeypatch.setitem(placement._BACKENDS, torch.device(where).type, lambda: count)
    with CheckpointEngine() as engine:
        with pytest.raises(CheckrunError) as info:
            engine.load(path, map_location=where)
    assert str(info.value).startswith(f"{path}: {message}")
