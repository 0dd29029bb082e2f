"""GPU check of the accelerator path (issue 26): what no CPU test can show, on one CUDA device.

Run on a machine with a GPU, from the repository root (under 2 minutes on one GPU)::

    python benchmarks/gpu_check.py

One line per check (``ok`` or ``FAIL`` with the reason); the exit status is non-zero if any check
failed, and 0 with ``skipped: no CUDA`` on a machine without CUDA. Checks:

- round trips of every dtype and layout (non-contiguous, offset views, 0-d, empty, channels_last,
  expanded, tied), saved from cuda:0 and loaded back onto it and onto the CPU;
- a kernel queued before ``save()`` is captured, one queued after it is not;
- ``save()`` returns while seconds of GPU work are still queued, and issues no device sync
  (``torch.cuda.set_sync_debug_mode("error")`` around it), with a CUDA "step" counter and a
  pickled value holding CUDA tensors in the state;
- a source freed right after ``save()`` and reused by the allocator does not tear the snapshot;
- two saves in flight keep distinct buffers;
- staging is pinned, reused from save to save, and within 1.1x of the staged bytes;
- every ``map_location`` form (None, "cpu", "cuda", "cuda:0", a device, a dict, callables), for
  tensors and for tensors inside pickled values; a callable's result used as is, and a load to
  the GPU holding the state once (peak memory);
- the EmbeddingTracker's forward hook issues no device sync;
- RNG states of more GPUs than are visible restore with a warning;
- process mode (``saving.background: process``) orders its copies right;
- DCP async save with cached staging keeps pinned buffers from save to save.

Until this script has run on a GPU, the GPU path is untested on hardware (``docs/gpu.md``).
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
Pair = collections.namedtuple("Pair", "a b")


def _import_engine() -> Any:
    """``ckpt_core`` as installed, else this checkout's ``core/`` under that name (a link in a
    temporary directory put on ``sys.path``, which the writer process inherits)."""
    sys.path.insert(0, str(ROOT))  # accelerate_ckpt from this checkout when not installed
    if importlib.util.find_spec("ckpt_core") is None:
        links = Path(tempfile.mkdtemp(prefix="checkrun-gpu-path-"))
        (links / "ckpt_core").symlink_to(ROOT / "core", target_is_directory=True)
        sys.path.insert(0, str(links))
    import ckpt_core

    return ckpt_core


# -- helpers ------------------------------------------------------------------------------------
_CYCLES_PER_SECOND: list[float] = []


def gpu_sleep(seconds: float) -> None:
    """Queue ``seconds`` of GPU work on the current stream (returns at once)."""
    import torch

    if not _CYCLES_PER_SECOND:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_SECOND.append(50_000_000 / (start.elapsed_time(end) / 1000))
    torch.cuda._sleep(int(seconds * _CYCLES_PER_SECOND[0]))


@contextlib.contextmanager
def no_device_sync():
    """Any device synchronisation inside raises (``set_sync_debug_mode("error")``)."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        # bitwise (NaNs, -0.0, dtypes without comparison kernels): the bytes in logical order
        return torch.equal(a.cpu().reshape(-1).contiguous().view(torch.uint8),
                           b.cpu().reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def devices(tree: Any) -> set[str]:
    import torch

    if isinstance(tree, torch.Tensor):
        return {str(tree.device)}
    if isinstance(tree, dict):
        return set().union(*(devices(v) for v in tree.values())) if tree else set()
    if isinstance(tree, (list, tuple)):
        return set().union(*(devices(v) for v in tree)) if tree else set()
    return set()


# -- the checks (each returns a detail line or raises) --------------------------------------------
def check_round_trip(ck: Any, tmp: Path) -> str:
    import torch

    from ckpt_core.format.manifest import DTYPES

    dev = torch.device("cuda", 0)
    state: dict = {}
    for name, dtype in DTYPES.items():
        try:
            base = torch.randn(37, 11, device=dev)
            t = (base * 100).to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
        except (RuntimeError, TypeError):  # no CUDA kernel for this dtype here
            continue
        state[f"{name}/contig"] = t
        state[f"{name}/transposed"] = t.t()
        state[f"{name}/offset"] = t[3:9, 2:7]
    x = torch.randn(4, 3, 8, 8, device=dev)
    state.update({"zero_d": torch.tensor(2.5, device=dev), "empty": torch.empty(0, 5, device=dev),
                  "channels_last": x.to(memory_format=torch.channels_last),
                  "expanded": torch.randn(1, 6, device=dev).expand(5, 6),
                  "tied_a": x, "tied_b": x, "int_step": torch.tensor(9, device=dev)})
    with ck.CheckpointEngine() as engine:
        engine.save(state, tmp / "rt.ckpt").result()
        on_gpu = engine.load(tmp / "rt.ckpt")
        on_cpu = engine.load(tmp / "rt.ckpt", map_location="cpu")
    assert same(on_gpu, state), "restored values differ (map_location=None)"
    assert devices(on_gpu) == {"cuda:0"}, devices(on_gpu)
    assert same(on_cpu, {k: v.cpu() for k, v in state.items()}) and devices(on_cpu) == {"cpu"}
    return f"{len(state)} tensors, {len(DTYPES)} dtypes known to the format"


def check_ordering(ck: Any, tmp: Path, config: dict | None = None) -> str:
    import torch

    x = torch.zeros(1 << 22, device="cuda")
    with ck.CheckpointEngine(config) as engine:
        gpu_sleep(0.3)
        x.add_(1)  # queued before save(): captured
        handle = engine.save({"x": x}, tmp / "order.ckpt")
        x.add_(1)  # queued after save(): not captured
        handle.result()
        got = engine.load(tmp / "order.ckpt", map_location="cpu")["x"]
    assert torch.all(got == 1), f"snapshot holds {got.unique().tolist()}, expected only 1.0"
    return "before captured, after not"


def check_no_sync(ck: Any, tmp: Path) -> str:
    import torch

    dev = torch.device("cuda", 0)
    w = torch.randn(4096, 4096, device=dev)
    dd = collections.defaultdict(list)
    dd["m"].append(torch.full((1000,), 3.0, device=dev))

    def state() -> dict:
        return {"w": w, "step": torch.tensor(41, device=dev), "extra": dd, "pair": Pair(w[:2], 1)}

    with ck.CheckpointEngine() as engine:
        engine.save(state(), tmp / "warm.ckpt").result()  # first save: buffers are made, not reused
        expected = w.clone()
        current = state()  # made before the window: torch.tensor(41, device=...) itself syncs
        gpu_sleep(2.0)
        w.mul_(1)
        with no_device_sync():
            t0 = time.perf_counter()
            handle = engine.save(current, tmp / "nosync.ckpt")
            blocked = time.perf_counter() - t0
        still_busy = not torch.cuda.current_stream().query()
        handle.result()
        meta = engine.read_manifest(tmp / "nosync.ckpt").meta
        got = engine.load(tmp / "nosync.ckpt", weights_only=False)
    assert still_busy, "the GPU queue was drained by save()"
    assert blocked < 1.0, f"save() blocked {blocked:.2f} s with 2 s of GPU work queued"
    assert same(got["w"], expected) and got["step"].item() == 41 and meta.get("step") == 41, meta
    assert same(got["extra"]["m"][0], dd["m"][0]) and got["extra"]["m"][0].device == dev
    assert same(got["pair"].a, expected[:2])
    return f"save() blocked {blocked * 1000:.1f} ms with 2 s of GPU work queued; meta step={meta['step']}"


def check_freed_source(ck: Any, tmp: Path) -> str:
    import torch

    n = 1 << 24
    side = torch.cuda.Stream()
    with ck.CheckpointEngine() as engine:
        for attempt in range(3):
            with torch.cuda.stream(side):
                src = torch.full((n,), 7.0, device="cuda")
            torch.cuda.current_stream().wait_stream(side)
            gpu_sleep(0.3)  # the copy waits behind this on the training stream
            handle = engine.save({"x": src}, tmp / f"freed{attempt}.ckpt")
            del src  # freed on `side`, which does not wait for the copy
            with torch.cuda.stream(side):
                junk = torch.full((n,), -1.0, device="cuda")  # same size: the freed block, if allowed
            handle.result()
            got = engine.load(tmp / f"freed{attempt}.ckpt", map_location="cpu")["x"]
            del junk
            assert torch.all(got == 7), f"torn snapshot: {got.unique().tolist()}"
    return "3 saves of a source freed and reallocated on another stream at once"


def check_two_in_flight(ck: Any, tmp: Path) -> str:
    import torch

    x = torch.full((1 << 22,), 1.0, device="cuda")
    with ck.CheckpointEngine({"saving": {"max_pending": 2}}) as engine:
        gpu_sleep(0.3)
        h1 = engine.save({"x": x}, tmp / "a.ckpt")
        x.fill_(2.0)
        h2 = engine.save({"x": x}, tmp / "b.ckpt")
        h1.result(), h2.result()
        a = engine.load(tmp / "a.ckpt", map_location="cpu")["x"]
        b = engine.load(tmp / "b.ckpt", map_location="cpu")["x"]
        arenas = engine.staging.allocations
    assert torch.all(a == 1) and torch.all(b == 2), (a.unique().tolist(), b.unique().tolist())
    assert arenas == 2, f"{arenas} staging allocations for two snapshots in flight"
    return "two snapshots, two arenas, each its own values"


def check_staging_memory(ck: Any, tmp: Path) -> str:
    import torch

    sizes = [3_000_001, 1_048_576, 777, 12_345_678, 5, 2_000_000] * 3
    state = {f"t{i}": torch.randn(n, device="cuda") for i, n in enumerate(sizes)}
    staged = sum(t.nbytes for t in state.values())
    with ck.CheckpointEngine() as engine:
        for i in range(3):
            engine.save(state, tmp / f"mem{i}.ckpt").result()
        pool = engine.staging
        held = pool.allocated_bytes
        arenas = [b for q in pool._free.values() for b in q]
        pinned = all(b.is_pinned() for b in arenas)
        allocations = pool.allocations
    assert allocations == 1, f"{allocations} allocations for 3 saves of the same state"
    assert pinned and arenas, "staging buffers are not pinned"
    assert held <= 1.1 * staged, f"pool holds {held} bytes for {staged} staged"
    stats = getattr(torch.cuda, "host_memory_stats", None)
    extra = ""
    if stats is not None:
        with contextlib.suppress(Exception):
            extra = f"; torch's pinned cache holds {stats().get('reserved_bytes.current', '?')} bytes"
    return f"one pinned arena of {held} bytes for {staged} staged ({held / staged:.3f}x), reused{extra}"


def check_map_location(ck: Any, tmp: Path) -> str:
    import torch

    dev = torch.device("cuda", 0)
    w = torch.randn(2048, 1024, device=dev)
    state = {"w": w, "b": torch.arange(10, device=dev), "obj": Pair(torch.ones(3, device=dev), "x")}
    forms: list[tuple[str, Any, str]] = [
        ("None", None, "cuda:0"), ('"cpu"', "cpu", "cpu"), ('"cuda"', "cuda", "cuda:0"),
        ('"cuda:0"', "cuda:0", "cuda:0"), ("device", torch.device("cuda", 0), "cuda:0"),
        ("dict", {"cuda:0": "cpu"}, "cpu"), ("callable->None", lambda s, loc: None, "cuda:0"),
        ("callable->cpu", lambda s, loc: s.cpu(), "cpu"),
    ]
    with ck.CheckpointEngine() as engine:
        engine.save(state, tmp / "ml.ckpt").result()
        for name, ml, want in forms:
            got = engine.load(tmp / "ml.ckpt", map_location=ml, weights_only=False)
            assert same({k: got[k] for k in ("w", "b")}, {"w": w, "b": state["b"]}), name
            found = devices({"w": got["w"], "b": got["b"], "o": got["obj"].a})
            assert found == {want}, f"map_location {name}: tensors on {found}, expected {want}"
        results = []
        got = engine.load(tmp / "ml.ckpt", weights_only=False,
                          map_location=lambda s, loc: results.append(s.cuda()) or results[-1])
        ptrs = {r.data_ptr() for r in results}
        assert got["w"].untyped_storage().data_ptr() in ptrs, "a callable's result was copied again"
        del got, results
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        got = engine.load(tmp / "ml.ckpt", weights_only=False)
        peak = torch.cuda.max_memory_allocated() - base
    need = sum(t.nbytes for t in (w, state["b"], state["obj"].a))
    assert peak <= 1.1 * need + (4 << 20), f"load to the GPU peaked at {peak} bytes for {need}"
    return f"{len(forms) + 1} forms; load onto the GPU peaked at {peak / need:.2f}x the state"


def check_tracker(ck: Any, tmp: Path) -> str:
    import torch
    from torch import nn

    from ckpt_core.saving.tracking import EmbeddingTracker

    emb = nn.Embedding(100_000, 64, sparse=True).cuda()
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    tracker = EmbeddingTracker(emb, opt)
    idx = torch.randint(0, 100_000, (4096,), device="cuda")
    try:
        for _ in range(10):
            with no_device_sync():  # the forward pass, where the hook runs
                out = emb(idx)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        with no_device_sync():
            tracker.captured()
    finally:
        tracker.close()
    return "10 forward passes with the hook and a capture, no sync"


def check_rng(ck: Any, tmp: Path) -> str:
    import torch

    try:
        from accelerate_ckpt.state import restore_device_states
    except ImportError as exc:
        return f"not run: {exc}"
    count = torch.cuda.device_count()
    states = [torch.cuda.get_rng_state(i) for i in range(count)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restore_device_states(torch.cuda, "cuda", states + [states[0]])
    assert any("RNG states of" in str(w.message) for w in caught), "no warning for the missing GPU"
    return f"{count + 1} saved states, {count} visible: restored with a warning"


def check_process_mode(ck: Any, tmp: Path) -> str:
    import torch

    order = check_ordering(ck, tmp, {"saving": {"background": "process"}})
    w = torch.randn(4096, 4096, device="cuda")
    with ck.CheckpointEngine({"saving": {"background": "process"}}) as engine:
        engine.save({"w": w}, tmp / "pwarm.ckpt").result()  # shared buffers made (and registered)
        expected = w.clone()
        gpu_sleep(2.0)
        w.mul_(1)
        t0 = time.perf_counter()
        handle = engine.save({"w": w}, tmp / "pbusy.ckpt")
        blocked = time.perf_counter() - t0
        still_busy = not torch.cuda.current_stream().query()
        handle.result()
        pinned = all(b.is_pinned() for free in engine.staging._free.values() for b in free)
        got = engine.load(tmp / "pbusy.ckpt", map_location="cpu")["w"]
    assert same(got, expected.cpu()), "process-mode snapshot differs"
    assert pinned, "the writer process's shared staging buffers are not pinned"
    assert still_busy and blocked < 1.0, f"save() blocked {blocked:.2f} s: the shared staging is not pinned"
    return f"{order}; shared staging pinned, save() blocked {blocked * 1000:.1f} ms with 2 s of GPU work queued"


def check_dcp(ck: Any, tmp: Path) -> str:
    import torch
    import torch.distributed as dist

    from ckpt_core import dcp as cdcp
    from ckpt_core.dcp.writer import CheckrunStorageWriter

    started = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        started = True
    try:
        state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
        writer = CheckrunStorageWriter(tmp / "d0.dcp", cache_staged_state_dict=True)
        cdcp.async_save(state, tmp / "d0.dcp", writer=writer).result()
        cache = writer.state_dict_cache
        ptrs = {k: v.data_ptr() for k, v in cache.items()}
        pinned = all(v.is_pinned() for v in cache.values())
        state["w"].add_(1)
        cdcp.async_save(state, tmp / "d1.dcp", writer=writer).result()  # DCP resets its path
        reused = {k: v.data_ptr() for k, v in writer.state_dict_cache.items()} == ptrs
        back = {"w": torch.empty(1024, 1024, device="cuda"), "b": torch.empty(7, device="cuda")}
        cdcp.load(back, tmp / "d1.dcp")
    finally:
        if started:
            dist.destroy_process_group()
    assert pinned, "DCP's cached staging is not pinned"
    assert reused, "DCP's cached staging was not reused"
    assert same(back, state), "DCP round trip differs"
    return "cached pinned staging reused across two async saves"


CHECKS: list[tuple[str, Callable[[Any, Path], str]]] = [
    ("round trip of every dtype and layout", check_round_trip),
    ("kernel before save() captured, after not", check_ordering),
    ("save() returns with GPU work queued, no device sync", check_no_sync),
    ("freed sources reused by the allocator do not tear", check_freed_source),
    ("two saves in flight keep distinct buffers", check_two_in_flight),
    ("staging pinned, reused, within 1.1x", check_staging_memory),
    ("every map_location form", check_map_location),
    ("tracker hook does not sync", check_tracker),
    ("RNG restore with fewer visible GPUs", check_rng),
    ("process mode ordering", check_process_mode),
    ("DCP async save with cached pinned staging", check_dcp),
]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    ck = _import_engine()
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
    failed = 0
    started = time.perf_counter()
    for name, check in CHECKS:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="checkrun-gpu-") as tmp:
            try:
                detail = check(ck, Path(tmp))
                print(f"ok   {name}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
            except Exception as exc:  # noqa: BLE001 - one line per check, then the next one
                failed += 1
                torch.cuda.set_sync_debug_mode(0)
                last = traceback.extract_tb(exc.__traceback__)[-1]
                print(f"FAIL {name}: {type(exc).__name__}: {exc} [{Path(last.filename).name}:{last.lineno}]",
                      flush=True)
        torch.cuda.synchronize()
    print(f"gpu_check: {len(CHECKS) - failed}/{len(CHECKS)} ok in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
