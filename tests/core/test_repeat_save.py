"""A save of the same values as the save still in flight to its directory (``saving/repeat.py``), as
Lightning's ``ModelCheckpoint(save_last=True)`` makes at every checkpoint: it neither waits for that
save nor copies, and its checkpoint holds exactly the values it was given, whatever happened to the
tensors in between (changes through ``.data`` bump no version counter) or to the save it repeats.

The save in flight is held at its manifest commit by a storage gate (``faultfile://``), or, in
writer-process mode, by stopping the writer process (SIGSTOP)."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from ckpt_core import BackgroundSaveError, CheckpointEngine, EngineConfig
from ckpt_core.saving.repeat import same_bytes
from ckpt_core.testing import FaultFS, Gate, Policy

from .steplog_train import assert_bit_equal

WATCHDOG = 120  # seconds; only bounds a wait that would otherwise hang on a bug


@pytest.fixture(autouse=True)
def _faults():
    FaultFS.reset()
    yield
    FaultFS.reset()


class Net(torch.nn.Module):
    """An embedding table (row deltas) and a dense layer (whole tensors), trained with Adam."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(4096, 32)
        self.out = torch.nn.Linear(32, 8)
        self.opt = torch.optim.Adam(self.parameters(), lr=1e-2)

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 4096, (64,), generator=g)
        self.out(self.emb(ids)).square().mean().backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self, **extra) -> dict:
        return {"model": self.state_dict(), "optimizer": self.opt.state_dict(), **extra}


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone(v) for v in state]
    return state


def engine_config(**over) -> EngineConfig:
    return EngineConfig.from_dict({"saving": {"max_pending": 1}, "incremental": {"row_delta_min_rows": 1024},
                                   **over})


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def held_first(engine: CheckpointEngine, root: str, net: Net, policy=None, **extra):
    """Save s0 (committed: the row streams exist), train a step, then save s1 held at its manifest
    commit by ``policy`` (default: a gate); returns (s1's handle, its state as saved, the policy)."""
    net.step(0)
    engine.save(net.state(), f"{root}/s0.ckpt").result()
    net.step(1)
    expected = clone(net.state(**extra))
    policy = policy or Gate("close", "manifest", match="s1.ckpt")
    FaultFS.policy = policy
    first = engine.save(net.state(**extra), f"{root}/s1.ckpt")
    assert policy.entered.wait(WATCHDOG)  # s1 is in flight: held at its manifest commit
    return first, expected, policy


def save_after_release(engine: CheckpointEngine, net: Net, path: str, gate: Gate, first) -> None:
    """Save ``net``'s state to ``path`` from a thread (it may wait for ``first``), open ``gate``, and
    wait for both saves."""
    saver = in_thread(lambda: engine.save(net.state(), path))
    gate.release()
    saver.join(WATCHDOG)
    assert not saver.is_alive()
    first.result()
    engine.wait()


def test_a_repeat_of_the_save_in_flight_returns_before_it_and_holds_its_values(tmp_path):
    root = f"faultfile://{tmp_path}/run"
    net = Net()
    with CheckpointEngine(engine_config()) as engine:
        first, expected, gate = held_first(engine, root, net, step=1, cb="top-k")
        handles = []
        saver = in_thread(lambda: handles.append(engine.save(net.state(step=1, cb="last"), f"{root}/last.ckpt")))
        saver.join(WATCHDOG)
        # With one slot (max_pending 1) and s1 writing from the row streams' buffers, any save that
        # waited for s1 would still be inside save() here.
        assert not saver.is_alive() and not first.done()
        gate.release()
        info = handles[0].result()
        assert first.result().path.endswith("s1.ckpt")
        assert info.written_bytes < 0.05 * info.tensor_bytes  # a manifest: every blob is s1's
        net.step(2)
        after = clone(net.state(step=2))
        engine.save(net.state(step=2), f"{root}/s2.ckpt").result()  # a row delta on top of the repeat
        assert_bit_equal(engine.load(f"{root}/s1.ckpt"), expected)
        assert_bit_equal(engine.load(f"{root}/last.ckpt"), {**expected, "cb": "last"})
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), after)
        for name in ("s1", "last", "s2"):
            assert engine.verify(f"{root}/{name}.ckpt").ok


def test_a_repeat_reuses_the_records_of_the_save_it_repeats_instead_of_encoding_again(tmp_path, monkeypatch):
    """Lightning's last.ckpt went through the whole pipeline again after the top-k file it repeats (every
    chunk encoded and hashed to find the blobs that save had written): it committed seconds later on a
    large state, and a kill in between left ``ckpt_path="last"`` an older checkpoint. Its tensors now take
    the committed save's records; only its row-stream tensors (no changed row) are planned."""
    from ckpt_core.saving import write

    planned = []
    plan = write.Planner.snapshot
    monkeypatch.setattr(write.Planner, "snapshot", lambda self, tensors: planned.append([st.key for st in tensors])
                        or plan(self, tensors))
    root = f"faultfile://{tmp_path}/run"
    net = Net()
    with CheckpointEngine(engine_config()) as engine:
        first, expected, gate = held_first(engine, root, net)
        last = engine.save(net.state(), f"{root}/last.ckpt")
        gate.release()
        first.result()
        assert last.result().written_bytes < 0.05 * last.result().tensor_bytes
        shapes = {k: tuple(t.shape) for k, t in _flat(net.state()).items()}
        assert any(shapes[k][:1] != (4096,) for k in planned[-2])  # the top-k save planned the dense tensors
        assert planned[-1] and all(shapes[k][:1] == (4096,) for k in planned[-1])  # the repeat only the row streams
        assert_bit_equal(engine.load(f"{root}/last.ckpt"), expected)
        assert engine.verify(f"{root}/last.ckpt").ok
        net.step(2)
        engine.save(net.state(), f"{root}/s2.ckpt").result()  # after a repeat, the next save is as ever
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), clone(net.state()))


def test_a_repeat_reads_back_the_blobs_of_the_save_it_repeats(tmp_path):
    """A blob the repeated save wrote is damaged between its commit and the repeat's: the repeat, reusing
    its records, must still read it back (as any reused blob, once per engine) and write it again; a repeat
    that trusted that save's blobs committed a checkpoint that failed to load (found by an independent check)."""
    import glob

    base = tmp_path / "run"
    root = f"faultfile://{base}"
    state = {"w": torch.randn(256, 256), "b": torch.randn(1000)}
    with CheckpointEngine(engine_config()) as engine:
        engine.save({"w": torch.zeros(4)}, f"{root}/s0.ckpt").result()
        before = set(glob.glob(f"{base}/.checkrun/blobs/**/*", recursive=True))
        rotted = []

        def rot(info):
            if info.path.endswith("s1.ckpt"):
                for path in sorted(set(glob.glob(f"{base}/.checkrun/blobs/**/*", recursive=True)) - before):
                    if os.path.isfile(path):
                        with open(path, "r+b") as f:
                            f.seek(os.path.getsize(path) // 2)
                            byte = f.read(1)
                            f.seek(-1, 1)
                            f.write(bytes([byte[0] ^ 0xFF]))
                        rotted.append(path)

        engine.add_callback(rot)
        gate = Gate("close", "manifest", match="s1.ckpt")
        FaultFS.policy = gate
        first = engine.save(state, f"{root}/s1.ckpt")
        assert gate.entered.wait(WATCHDOG)
        last = engine.save(state, f"{root}/last.ckpt")
        gate.release()
        first.result()
        last.result()
        FaultFS.reset()
        assert rotted
        assert_bit_equal(engine.load(f"{base}/last.ckpt"), state)
        assert engine.verify(f"{base}/last.ckpt").ok and engine.verify(f"{base}/s1.ckpt").ok  # repaired too


def _flat(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}" if prefix else str(key)).items()}
    return {}


@pytest.mark.parametrize("change", ["data", "negative_zero", "one_row"])
def test_a_change_the_version_counter_misses_is_saved(tmp_path, change):
    """Not a repeat: the second save has the new values (the comparison is of the bytes)."""
    root = f"faultfile://{tmp_path}/run"
    net = Net()
    with CheckpointEngine(engine_config()) as engine:
        first, expected_first, gate = held_first(engine, root, net)
        version = net.out.weight._version
        if change == "data":
            net.out.weight.data.mul_(0.5)  # what EMA and clipping code does: no version bump
        elif change == "negative_zero":
            net.out.bias.data[3] = 0.0
            net.out.bias.data[3] = -0.0  # equal as values, not as bytes
        else:
            net.emb.weight.data[4000] += 1.0  # one row of the row-delta table
        assert net.out.weight._version == version
        expected = clone(net.state())
        save_after_release(engine, net, f"{root}/s2.ckpt", gate, first)
        assert_bit_equal(engine.load(f"{root}/s1.ckpt"), expected_first)
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), expected)


class FailHeld(Policy):
    """Hold the commit of the manifest matching ``match`` until released, then fail it."""

    def __init__(self, match: str) -> None:
        self.match = match
        self.entered, self.go = threading.Event(), threading.Event()

    def on(self, op: str, kind: str, path: str) -> None:
        if op == "close" and kind == "manifest" and self.match in path:
            self.entered.set()
            self.go.wait()
            raise PermissionError(13, "Permission denied", path)


def test_a_repeat_of_a_save_that_fails_fails_too(tmp_path):
    """Lightning saves the top-k file, then last.ckpt, a repeat of it: a repeat that committed although the
    save it repeats failed left a last.ckpt whose ModelCheckpoint state names a top-k file that does not
    exist (found by an independent check), where stock's failing torch.save stops before last.ckpt. The
    repeat fails, naming that save; the next save is whole and right."""
    root = f"faultfile://{tmp_path}/run"
    net = Net()
    with CheckpointEngine(engine_config()) as engine:
        first, expected, policy = held_first(engine, root, net, FailHeld("s1.ckpt"))
        handles = []
        saver = in_thread(lambda: handles.append(engine.save(net.state(), f"{root}/last.ckpt")))
        saver.join(WATCHDOG)
        assert not saver.is_alive() and not first.done()
        policy.go.set()
        with pytest.raises(BackgroundSaveError, match="s1.ckpt"):
            first.result()
        with pytest.raises(BackgroundSaveError, match=r"last.ckpt: not saved: it repeats the save to .*s1.ckpt"):
            handles[0].result()
        assert not os.path.exists(tmp_path / "run" / "s1.ckpt")
        assert not os.path.exists(tmp_path / "run" / "last.ckpt")
        net.step(2)
        after = clone(net.state())
        engine.save(net.state(), f"{root}/s2.ckpt").result()
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), after)


def test_a_repeat_after_a_load_into_the_directory_is_a_plain_save(tmp_path):
    """A load between the two saves replaced the row streams: the second save stages as usual."""
    root = f"faultfile://{tmp_path}/run"
    net = Net()
    with CheckpointEngine(engine_config()) as engine:
        first, expected, gate = held_first(engine, root, net)
        engine.load(f"{root}/s0.ckpt")  # another path of the same directory: no wait
        save_after_release(engine, net, f"{root}/s2.ckpt", gate, first)
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), expected)


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once /proc says it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WATCHDOG
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        os.sched_yield()


def test_a_repeat_in_writer_process_mode_shares_the_shared_memory_staging(tmp_path):
    root = str(tmp_path / "run")
    net = Net()
    with CheckpointEngine(engine_config(saving={"max_pending": 1, "background": "process"})) as engine:
        net.step(0)
        engine.save(net.state(), f"{root}/s0.ckpt").result()  # starts the writer process
        pid = engine._process._proc.pid
        net.step(1)
        expected = clone(net.state())
        _stop(pid)
        try:
            first = engine.save(net.state(cb="top-k"), f"{root}/s1.ckpt")
            handles = []
            saver = in_thread(lambda: handles.append(engine.save(net.state(cb="last"), f"{root}/last.ckpt")))
            saver.join(WATCHDOG)
            assert not saver.is_alive() and not first.done()
        finally:
            os.kill(pid, signal.SIGCONT)
        first.result()
        handles[0].result()
        net.step(2)
        after = clone(net.state())
        engine.save(net.state(), f"{root}/s2.ckpt").result()
        assert_bit_equal(engine.load(f"{root}/s1.ckpt"), {**expected, "cb": "top-k"})
        assert_bit_equal(engine.load(f"{root}/last.ckpt"), {**expected, "cb": "last"})
        assert_bit_equal(engine.load(f"{root}/s2.ckpt"), after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.complex64,
                                   torch.float64])
def test_same_bytes_compares_bytes_not_values(dtype):
    a = (torch.arange(1001) % 7).to(dtype)  # 1001 elements: not a multiple of 8 bytes for 1-byte types
    assert same_bytes(a, a.clone())
    b = a.clone()
    b.view(torch.uint8)[-1] ^= 1  # the last byte: after the 8 MB blocks and the word view
    assert not same_bytes(a, b)
    assert not same_bytes(a, a[:-1].clone())
    if dtype.is_floating_point:
        z = torch.zeros(16, dtype=dtype)
        assert not same_bytes(z, -z)  # 0.0 == -0.0 as values
        nan = torch.full((16,), float("nan"), dtype=dtype)
        assert same_bytes(nan, nan.clone())  # NaN != NaN as values


@pytest.mark.parametrize("shared", [False, True])
def test_same_bytes_compares_every_block(monkeypatch, shared):
    """Block by block on this thread, or with half the blocks on the copier's helper thread."""
    import ckpt_core.saving.repeat as repeat
    from ckpt_core.saving.copier import Copier

    monkeypatch.setattr(repeat, "BLOCK_BYTES", 64)
    copier = Copier()
    share = copier.share if shared else None
    try:
        a = torch.randn(1000)
        assert same_bytes(a, a.clone(), share)
        for at in (0, 17, 500, 999):  # the first, a middle and the last block
            b = a.clone()
            b[at] = 1e9
            assert not same_bytes(a, b, share), at
    finally:
        copier.settle()
        copier.close()


@pytest.mark.parametrize("mode, seed", [("thread", 1), ("thread", 2), ("thread", 3), ("process", 4)])
def test_random_saves_repeats_changes_and_loads_keep_every_checkpoint_exact(tmp_path, mode, seed):
    """A random mix (fixed seed) of row changes, changes through ``.data`` (a ``-0.0`` among them),
    saves followed or not by a save of the same state to ``last.ckpt`` (a repeat whenever the first
    is still in flight), loads and waits; every checkpoint holds the state given to its last save."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    emb, mom = torch.randn(5000, 16), torch.zeros(5000, 16)
    lin, bias = torch.randn(64, 8), torch.randn(8)
    expected: dict[str, dict] = {}

    def state() -> dict:
        return {"emb": emb, "lin": lin, "bias": bias, "opt": {"mom": mom, "step": 3}}

    cfg = {"saving": {"background": mode, "max_pending": rng.choice([1, 2])},
           "incremental": {"max_chain": rng.choice([2, 4, 8]), "row_delta_min_rows": 1024}}
    with CheckpointEngine(cfg) as engine:
        for i in range(120):
            op = rng.random()
            if op < 0.35:
                rows = torch.randint(0, 5000, (rng.choice([1, 50, 600]),))
                emb[rows] += 0.01
                mom[rows] += 1.0
                if rng.random() < 0.5:
                    lin.data.mul_(1.01)
                if rng.random() < 0.2:
                    bias.data[0] = 0.0 if str(bias[0].item()) == "-0.0" else -0.0
            elif op < 0.8:
                name = rng.choice(["a", "b", "last", f"s{i}"])
                expected[name] = clone(state())
                engine.save(state(), f"{tmp_path}/{name}.ckpt")
                if rng.random() < 0.6:
                    engine.save(state(), f"{tmp_path}/last.ckpt")
                    expected["last"] = expected[name]
            elif op < 0.9 and expected:
                name = rng.choice(sorted(expected))
                assert_bit_equal(engine.load(f"{tmp_path}/{name}.ckpt"), expected[name], f"op {i}: {name}")
            else:
                engine.wait()
        engine.wait()
        for name, want in expected.items():
            assert_bit_equal(engine.load(f"{tmp_path}/{name}.ckpt"), want, name)
            assert engine.verify(f"{tmp_path}/{name}.ckpt").ok


@pytest.mark.parametrize("policy", ["consecutive", "intermittent"])
def test_a_save_with_no_changed_row_adds_no_link_to_the_chain(tmp_path, policy):
    """The second of two saves of one state (``save_last=True``'s pattern, waited for or repeated)
    keeps the first's record: no empty link, no index blob, no step toward ``max_chain``. Before, it
    added an empty link, so with ``save_last=True`` chains grew twice as fast and rebased twice as
    often."""
    net = Net()
    cfg = engine_config(incremental={"row_delta_min_rows": 1024, "policy": policy, "max_chain": 3})
    depths = []
    with CheckpointEngine(cfg) as engine:
        for i in range(4):
            net.step(i)
            expected = clone(net.state())
            first = engine.save(net.state(), tmp_path / f"s{i}.ckpt").result()
            second = engine.save(net.state(), tmp_path / "last.ckpt").result()
            depths.append((first.chain_depth, second.chain_depth))
            assert second.new_blobs == 0  # a manifest over the first's blobs
            assert_bit_equal(engine.load(tmp_path / "last.ckpt"), expected)
    # save 0 is a base; saves 1-3 are deltas (intermittent: one cumulative link), none rebased by the
    # repeated saves in between (max_chain 3)
    assert depths == ([(0, 0), (1, 1), (2, 2), (3, 3)] if policy == "consecutive" else
                      [(0, 0), (1, 1), (1, 1), (1, 1)])
