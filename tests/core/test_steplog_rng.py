"""RNG states in the step log: after a replay, training draws the random numbers the uninterrupted run drew
(dropout masks, augmentations), and a logged state that is malformed is refused naming its segment."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from ckpt_core import CheckpointEngine
from ckpt_core.steplog import StepLogFormatError
from ckpt_core.steplog.format import pack_segment, split_segment

from .steplog_train import assert_bit_equal

STEPS, CKPT_AT, RESUME_AT = 20, 6, 15


def _make():
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    return net, opt, sched


def _step(net, opt, sched, step: int) -> None:
    """Dropout draws from torch's RNG; the batch's noise from python's and numpy's."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=g) + random.random() + float(np.random.rand())
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), torch.randn(16, 1, generator=g)).backward()
    opt.step()
    sched.step()


def _state(net, opt, sched) -> dict:
    return copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})


def _seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def _reference() -> dict:
    _seed(1)
    net, opt, sched = _make()
    _seed(1)
    for step in range(1, STEPS + 1):
        _step(net, opt, sched, step)
    return _state(net, opt, sched)


def _crashed_run(directory: str, **step_log) -> None:
    """Logs steps 1..RESUME_AT (checkpoint after CKPT_AT), then stops as if killed (log flushed)."""
    _seed(1)
    net, opt, sched = _make()
    _seed(1)
    with CheckpointEngine({"step_log": {"flush_every_steps": 4, **step_log}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, RESUME_AT + 1):
            _step(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/step{step}.ckpt")
        slog.close()


def _resume(directory: str, **replay) -> tuple:
    _seed(999)  # a new process seeds as it likes: the replay sets the states of step RESUME_AT
    net, opt, sched = _make()
    with CheckpointEngine() as engine:
        state = engine.load(engine.latest(directory))
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        n = engine.replay(directory, opt, sched, **replay)
    return n, (net, opt, sched)


def test_training_after_a_replay_draws_what_the_uninterrupted_run_drew(tmp_path):
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    n, (net, opt, sched) = _resume(directory)
    assert n == RESUME_AT - CKPT_AT
    for step in range(RESUME_AT + 1, STEPS + 1):  # dropout, python and numpy noise as uninterrupted
        _step(net, opt, sched, step)
    assert_bit_equal(_state(net, opt, sched), _reference())


def test_replay_with_rng_false_leaves_the_generators_alone(tmp_path):
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    _seed(999)
    expected = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    _seed(999)
    net, opt, sched = _make()
    _seed(999)
    with CheckpointEngine() as engine:
        state = engine.load(engine.latest(directory))
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        assert engine.replay(directory, opt, sched, rng=False) == RESUME_AT - CKPT_AT
    assert random.getstate() == expected[0]
    assert np.array_equal(np.random.get_state()[1], expected[1])
    assert torch.equal(torch.get_rng_state(), expected[2])


@pytest.mark.parametrize("how", ["step_log.rng off", "a log of the previous format"])
def test_without_logged_states_the_replay_leaves_the_generators_alone(tmp_path, how):
    """``step_log.rng: false``: nothing logged (segments of the lowest version); a log written before the
    states were logged (no ``rng``, version 3/5) replays all the same."""
    directory = str(tmp_path / "run")
    _crashed_run(directory, **({"rng": False} if how == "step_log.rng off" else {}))
    for seg in sorted((tmp_path / "run/.checkrun/steplog").glob("seg-*.bin")):
        if how != "step_log.rng off":
            _tamper(seg, lambda h: h.pop("rng", None))
        header, _ = split_segment(seg.read_bytes(), str(seg))
        assert "rng" not in header and header["format_version"] == 3
    n, _ = _resume(directory)
    after = (random.getstate(), torch.get_rng_state())
    assert n == RESUME_AT - CKPT_AT
    _seed(999)
    _make()  # what _resume does before its replay, which leaves the generators as they are
    assert after[0] == random.getstate() and torch.equal(after[1], torch.get_rng_state())


def test_each_segment_logs_the_states_after_its_last_step_or_flush_point(tmp_path):
    """Segments closed at a step's pre-hook (every 4 steps) or by ``close`` hold the states of their last
    step; one closed by a save or ``flush`` the states captured there (``step`` null), after its last
    event."""
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    kinds = []
    for seg in sorted((tmp_path / "run/.checkrun/steplog").glob("seg-*.bin")):
        header, _ = split_segment(seg.read_bytes(), str(seg))
        logged = [(header["lo"] + i + 1, ev["step"]) for i, ev in enumerate(header["events"]) if ev["kind"] == "step"]
        if logged:
            entry = header["rng"]
            assert header["format_version"] == 7 and entry["rank"] == 0
            assert (entry["event"], entry["step"]) in (logged[-1], (header["hi"], None))
            kinds.append("step" if entry["step"] is not None else "point")
    assert "point" in kinds and kinds[-1] == "step"  # the save's segment; close() captures none (it may be late)


def _tamper(seg: Path, change) -> None:
    """Rewrite ``seg``'s header with ``change`` applied and its checksums made right (a forged segment)."""
    data = seg.read_bytes()
    header, payload = split_segment(data, str(seg))
    for key in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
        header.pop(key)
    change(header)
    seg.write_bytes(pack_segment(header, [bytes(payload)]))


def _last_segment(tmp_path) -> Path:
    return sorted((tmp_path / "run/.checkrun/steplog").glob("seg-*.bin"))[-1]


@pytest.mark.parametrize("change, message", [
    (lambda h: h["rng"].update(rank="0"), "field 'rank'"),
    (lambda h: h["rng"].pop("numpy"), "must hold event, step, rank"),
    (lambda h: h["rng"]["python"].update(version=2), "'python' must be"),
    (lambda h: h["rng"]["python"].update(gauss="x"), "'python' must be"),
    (lambda h: h["rng"]["python"].update(gauss=10**400), "'python' must be"),  # was a bare OverflowError
    (lambda h: h["rng"]["numpy"].update(gauss=10**400), "'numpy' must be"),
    (lambda h: h["rng"].update(event=h["lo"]), "event .* is not one of the segment's"),
    (lambda h: h["rng"].update(step="3"), "field 'step'"),
    (lambda h: h["rng"]["numpy"].update(pos=625), "'numpy' must be"),
    (lambda h: h["rng"]["numpy"].update(has_gauss=2), "'numpy' must be"),
    (lambda h: h["rng"]["numpy"]["mt"].__setitem__(1, 100), "'numpy.mt' holds 100 bytes"),
    (lambda h: h["rng"]["torch"].__setitem__(1, 0), "'torch' holds 0 bytes"),
    (lambda h: h["rng"]["torch"].__setitem__(0, 10**9), "reaches byte"),
    (lambda h: h["rng"].update(cuda=[[0, 16, []]] * 1025), "'cuda' must list"),
])
def test_a_malformed_rng_entry_is_refused_naming_the_segment(tmp_path, change, message):
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    seg = _last_segment(tmp_path)
    _tamper(seg, change)
    with pytest.raises(StepLogFormatError, match=message) as info:
        _resume(directory)
    assert seg.name in str(info.value)


def test_a_state_that_torch_refuses_is_refused_before_any_generator_is_set(tmp_path):
    """Checksums hold, shapes hold, torch's generator refuses the bytes (a forged state)."""
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    seg = _last_segment(tmp_path)
    header, payload = split_segment(seg.read_bytes(), str(seg))
    off, size, _ = header["rng"]["torch"]
    forged = bytearray(payload)
    forged[off:off + size] = b"\xff" * size  # every field of torch's state out of range

    header = {k: v for k, v in header.items() if k not in ("_checkrun", "format_version", "payload_bytes",
                                                           "payload_csum")}
    seg.write_bytes(pack_segment(header, [bytes(forged)]))
    _seed(5)
    before = (random.getstate(), torch.get_rng_state())
    net, opt, sched = _make()
    _seed(5)
    with CheckpointEngine() as engine:
        state = engine.load(engine.latest(directory))
        opt.load_state_dict(state["opt"])
        with pytest.raises(StepLogFormatError, match="RNG state after event \\d+ is refused") as info:
            engine.replay(directory, opt, sched)
    assert seg.name in str(info.value)
    assert random.getstate() == before[0] and torch.equal(torch.get_rng_state(), before[1])


def test_a_version_7_run_object_is_refused(tmp_path):
    """Version 7 is a segment format: a run or marker object claiming it is refused by its version."""
    directory = str(tmp_path / "run")
    _crashed_run(directory)
    run = next((tmp_path / "run/.checkrun/steplog").glob("run-*.json"))
    body = json.loads(run.read_bytes())
    body["format_version"] = 7
    rest = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = xxhash.xxh3_64_hexdigest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
    run.write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(StepLogFormatError, match="unsupported steplog-run format_version 7"):
        _resume(directory)


def test_inspect_of_a_segment_names_its_rng_states_and_running_statistics(tmp_path, capsys):
    """``checkrun inspect SEGMENT`` shows the states' step and generators, and the running statistics
    line, each on a line of its own (both printed a literal backslash-n before 2026-12-06)."""
    from ckpt_core.cli import main

    from .test_steplog_buffers import _logged, _segment

    directory = str(tmp_path / "run")
    _logged(directory)
    seg = _segment(directory)
    assert main(["inspect", str(seg), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "\\n" not in out
    header, _ = split_segment(seg.read_bytes(), str(seg))
    at = f"step {header['rng']['step']}'s" if header["rng"]["step"] is not None else "a flush point's"
    assert f"\nRNG states after event {header['rng']['event']} ({at}, rank 0): python, numpy, torch\n" in out
    assert "\nrunning statistics of 3 buffer(s) with each step" in out
    assert main(["inspect", str(seg), "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)["rng"]
    assert got == {"event": header["rng"]["event"], "step": header["rng"]["step"], "rank": 0,
                   "generators": ["python", "numpy", "torch"]}


def _scaled(skip: int):
    """Model with dropout, SGD and a CPU GradScaler; ``step`` skips the optimizer step of batch ``skip``
    (an infinite loss: the scaler backs off) and counts batches in ``batches``."""
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Dropout(0.4), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    batches = {"batch": 0}

    def step(s: int) -> None:
        g = torch.Generator().manual_seed(s)
        loss = torch.nn.functional.mse_loss(net(torch.randn(8, 4, generator=g) + random.random()),
                                            torch.randn(8, 1, generator=g))
        opt.zero_grad()
        scaler.scale(loss * (float("inf") if s == skip else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        batches["batch"] = s

    return net, opt, scaler, batches, step


def _scaled_state(net, opt, scaler) -> dict:
    return copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})


@pytest.mark.parametrize("end", ["flush after the skipped batch", "segment closed at the next step"])
def test_a_resume_right_after_a_skipped_step_is_exact_or_warned(tmp_path, end):
    """Batch 12's step is skipped by the GradScaler: no step pre-hook ran, so the states last captured
    at a step (11) are one batch old where the log ends. A flush after batch 12 captures them there:
    the resumed run continues bit-equal. A segment closed at step 13's pre-hook ends with batch 12's
    state record, whose states nobody captured: the replay sets none and warns. Before, it set step 11's,
    and the run went on with other dropout masks, silently (found by an independent check)."""
    directory = str(tmp_path / "run")
    _seed(1)
    net, opt, scaler, batches, step = _scaled(skip=12)
    _seed(1)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2 if end.startswith("segment") else 100}}) as engine:
        slog = engine.step_log(directory, opt, scaler=scaler, counters=lambda: dict(batches))
        for s in range(1, 14 if end.startswith("segment") else 13):
            step(s)
            if s == 5:
                engine.save({**_scaled_state(net, opt, scaler), "batch": s}, f"{directory}/c.ckpt").result()
        if end.startswith("flush"):
            slog.flush()  # then killed, say: close() captures no states (the process may have drawn since)
        slog.close()
    if end.startswith("segment"):  # the log ends with the segment closed at step 13's pre-hook
        segs = sorted((tmp_path / "run/.checkrun/steplog").glob("seg-*.bin"))
        ending = [split_segment(p.read_bytes(), str(p))[0] for p in segs]
        keep = next(i for i, h in enumerate(ending) if h["events"][-1]["kind"] == "state"
                    and h["events"][-1].get("counters", {}).get("batch") == 12)
        for p in segs[keep + 1:]:
            p.unlink()
    _seed(1)
    ref_net, ref_opt, ref_scaler, _, ref_step = _scaled(skip=12)
    _seed(1)
    for s in range(1, 21):
        ref_step(s)
    _seed(999)
    net, opt, scaler, batches, step = _scaled(skip=12)
    _seed(4)
    before = torch.get_rng_state()
    with CheckpointEngine() as engine:
        state = engine.load(f"{directory}/c.ckpt")
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        scaler.load_state_dict(state["scaler"])
        counters: dict = {}
        if end.startswith("flush"):
            assert engine.replay(directory, opt, scaler=scaler, counters=counters) == 6
        else:
            with pytest.warns(RuntimeWarning, match="RNG states are not set after replaying to step 11 .*GradScaler "
                                                    "skipped followed step 11"):
                assert engine.replay(directory, opt, scaler=scaler, counters=counters) == 6
            assert torch.equal(torch.get_rng_state(), before)  # left alone, not set to step 11's
            return
    assert counters == {"batch": 12}
    for s in range(13, 21):
        step(s)
    assert_bit_equal(_scaled_state(net, opt, scaler), _scaled_state(ref_net, ref_opt, ref_scaler))
