"""The step log's format version 2 (issue 23 leftovers): the optimizer's class and parameter names in
the run header (``checkrun export --step`` without ``--optimizer``), hostile run headers and scaler
states, version-1 logs still read, the ``GradScaler`` state logged and replayed (a forced inf step
included), a segment cut by ``flush_seconds`` keeping the scheduler exact, and gc of run objects."""
from __future__ import annotations

import copy
import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.cli import main
from ckpt_core.codecs import index_pipeline, lossless_pipeline
from ckpt_core.config import CompressionConfig
from ckpt_core.format.dtypes import DTYPES
from ckpt_core.steplog import StepLogError, StepLogFormatError
from ckpt_core.steplog import format as fmt
from ckpt_core.steplog import log as steplog_log
from ckpt_core.steplog.replay import Payload
from ckpt_core.steplog.format import (MARK_RE, RUN_RE, SEG_RE, pack_segment, parse_marker, parse_run,
                                      split_segment)
from ckpt_core.storage import owner

from .steplog_train import assert_bit_equal, batch, forged, load_into, make, state, train_step

CKPT_AT, STEPS = 4, 12


def _logdir(directory: str) -> Path:
    return Path(directory, ".checkrun", "steplog")


def _objects(directory: str, pattern) -> list[Path]:
    return sorted(p for p in _logdir(directory).iterdir() if pattern.fullmatch(p.name))


def _run_json(directory: str) -> dict:
    (path,) = _objects(directory, RUN_RE)
    return json.loads(path.read_bytes())


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--no-progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _train_logged(directory: str, opt_kind: str = "adam", named: bool = False, model_names: bool = False,
                  steps: int = STEPS) -> tuple:
    """Steps 1..steps with the log on and a checkpoint after CKPT_AT; returns the live objects."""
    net, opt, sched = make(opt_kind)
    if named:  # the optimizer records param_names in its groups (torch >= 2.6)
        opt = type(opt)(net.named_parameters(), **opt.defaults)
        sched = type(sched)(opt, step_size=4, gamma=0.7)
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched, model=net if model_names else None)
        for step in range(1, steps + 1):
            train_step(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    return net, opt, sched


# ----------------------------------------------------------------------------- run header metadata


def test_run_header_records_optimizer_class_and_names(tmp_path):
    d1, d2, d3 = (str(tmp_path / n) for n in ("named", "model", "none"))
    _train_logged(d1, named=True)
    _train_logged(d2, model_names=True)
    _train_logged(d3)
    names = [["emb.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]]
    for d, want in ((d1, names), (d2, names), (d3, None)):
        body = _run_json(d)
        assert body["format_version"] == fmt.RUN_END_VERSION and body["optimizer"] == "torch.optim.adam.Adam"
        assert body["end"] == {"event": 2 * STEPS + 1, "seq": STEPS // 3 + 1}  # closed: its last event and segment
        assert body["param_names"] == want and body["closed"] is True
        assert body["owner"]["pid"] == owner.identity()["pid"]


def test_export_step_uses_the_logged_class(tmp_path, capsys):
    directory = str(tmp_path / "run")
    net, opt, sched = _train_logged(directory, model_names=True)  # optimizer without param_names
    out = tmp_path / "s.pt"
    code, text, err = _cli(capsys, "export", directory, str(out), "--step", str(STEPS), "--json")
    assert code == 0, err
    assert json.loads(text)["replay"]["optimizer"] == "torch.optim.Adam"
    got = torch.load(out, weights_only=True)
    assert_bit_equal(got["model"], net.state_dict())
    assert_bit_equal(got["opt"]["state"], opt.state_dict()["state"])
    assert got["sched"] == sched.state_dict()
    code, text, _ = _cli(capsys, "inspect", f"{directory}/.checkrun/steplog", "--json")
    (run,) = json.loads(text)["runs"]
    assert code == 0 and run["optimizer"] == "torch.optim.adam.Adam" and len(run["param_names"][0]) == 5
    # --optimizer still overrides: a class that does not fit the state is refused
    code, _, err = _cli(capsys, "export", directory, str(tmp_path / "x.pt"), "--step", "9", "--optimizer", "SGD")
    assert code == 1 and "does not load into torch.optim.SGD" in err


class MyAdam(torch.optim.Adam):
    """An optimizer class outside torch.optim: export must not import it."""


def test_export_refuses_a_class_outside_torch_optim(tmp_path, capsys):
    directory = str(tmp_path / "run")
    net, _, _ = make("adam")
    opt = MyAdam(net.named_parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, 7):
            train_step(net, opt, sched, step)
            if step == 2:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    assert _run_json(directory)["optimizer"] == f"{__name__}.MyAdam"
    code, _, err = _cli(capsys, "export", directory, str(tmp_path / "x.pt"), "--step", "5")
    assert code == 2 and "MyAdam" in err and "not one of torch.optim's" in err and "--optimizer" in err
    code, _, err = _cli(capsys, "export", directory, str(tmp_path / "y.pt"), "--step", "5", "--optimizer", "Adam")
    assert code == 0, err


# ----------------------------------------------------------------------------- version 1 still read


def _to_v1(directory: str) -> None:
    """Rewrite a log as checkrun before format version 2 wrote it (no metadata, no scaler)."""
    for p in _objects(directory, RUN_RE) + _objects(directory, MARK_RE):
        body = json.loads(p.read_bytes())
        for k in ("optimizer", "param_names", "owner", "closed", "checksum", "end"):
            body.pop(k, None)
        body["format_version"] = 1
        p.write_bytes(json.dumps(body).encode())
    for p in _objects(directory, SEG_RE):
        header, payload = split_segment(p.read_bytes(), p.name)
        for ev in header["events"]:
            ev.pop("scaler", None)
        keep = {k: header[k] for k in ("run", "seq", "lo", "hi", "events")}
        p.write_bytes(_pack(keep, _unpacked(header, payload), version=1))


def _unpacked(header: dict, payload: memoryview) -> list[bytes]:
    """The payload as writers before version 3 laid it out: every pack reference of the header's
    gradients becomes a range of its own (the tensor through its pipeline, appended)."""
    data = Payload(header, payload, 1 << 40)
    parts, size = [bytes(payload)], len(payload)
    for ev in header["events"]:
        for g in ev["grads"] if ev["kind"] == "step" else ():
            for key in ("data", "idx"):
                ref = g.get(key)
                if not isinstance(ref, dict):
                    continue
                dtype = DTYPES[ref["pack"]]
                numel = g["n"] if key == "idx" else g["n"] * g["shape"][1] if "n" in g else math.prod(g["shape"])
                t = data.tensor(ref, numel, dtype, "test")
                pipe = index_pipeline() if key == "idx" else lossless_pipeline(dtype, CompressionConfig())
                blob = bytes(pipe.encode(t.reshape(1, -1) if numel else t.reshape(0, 1))[0])
                g[key] = [size, len(blob), pipe.to_list()]
                parts.append(blob)
                size += len(blob)
    return parts


def _pack(header: dict, payload: list, version: int) -> bytes:
    saved = fmt.FORMAT_VERSION
    fmt.FORMAT_VERSION = version
    try:
        return pack_segment(header, payload)
    finally:
        fmt.FORMAT_VERSION = saved


def test_version_1_log_replays_and_exports_with_optimizer(tmp_path, capsys):
    directory = str(tmp_path / "run")
    net, opt, sched = _train_logged(directory, named=True)
    _to_v1(directory)
    net2, opt2, sched2 = make("adam")
    opt2 = torch.optim.Adam(net2.named_parameters(), **opt2.defaults)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=4, gamma=0.7)
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/ck.ckpt"), net2, opt2, sched2)
        assert engine.replay(directory, opt2, sched2) == STEPS - CKPT_AT
    assert_bit_equal(state(net2, opt2, sched2), state(net, opt, sched))
    code, _, err = _cli(capsys, "export", directory, str(tmp_path / "x.pt"), "--step", "9")
    assert code == 2 and "does not record the optimizer's class" in err and "version 2" in err
    assert _cli(capsys, "export", directory, str(tmp_path / "y.pt"), "--step", "9", "--optimizer", "Adam")[0] == 0


# ----------------------------------------------------------------------------- hostile input

_RUN = "0123456789abcdef"


def _run_bytes(**fields) -> bytes:
    body = {"_checkrun": "steplog-run", "format_version": 2, "run": _RUN, "created": 1.0, "start": 0,
            "start_step": 0, "parent": None, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


@pytest.mark.parametrize("fields, message", [
    ({"optimizer": 7}, "optimizer"),
    ({"optimizer": "os.system; rm"}, "optimizer"),
    ({"optimizer": "a." * 200 + "b"}, "optimizer"),
    ({"param_names": "w"}, "param_names"),
    ({"param_names": [["w", 3]]}, "param_names"),
    ({"param_names": [[""]]}, "param_names"),
    ({"param_names": [["x" * 1025]]}, "param_names"),
    ({"param_names": [["w"] * 100_001]}, "param_names"),
    ({"param_names": [[]] * 10_001}, "param_names"),
    ({"owner": {"writer": "zz", "pid": 1, "start": 1, "host": "h"}}, "owner"),
    ({"owner": {"writer": "ab", "pid": -1, "start": 1, "host": "h"}}, "owner"),
    ({"owner": {"writer": "ab", "pid": 1, "start": 1}}, "owner"),
    ({"closed": "yes"}, "closed"),
    ({"extra": 1}, "keys"),
    ({"format_version": 6}, "format_version"),
    ({"format_version": 1, "optimizer": "torch.optim.adam.Adam"}, "keys"),
])
def test_hostile_run_header_is_rejected(fields, message):
    with pytest.raises(StepLogFormatError, match=message) as info:
        parse_run(_run_bytes(**fields), f"mem://x/run-{_RUN}.json", _RUN)
    assert f"run-{_RUN}.json" in str(info.value)


def test_run_header_too_large_is_rejected_before_parsing():
    data = _run_bytes(param_names=[["n" * 1000] * 9000])
    with pytest.raises(StepLogFormatError, match="limit"):
        parse_run(data, "run", _RUN)


def test_run_header_v1_and_v2_parse():
    v1 = json.loads(_run_bytes())
    v1["format_version"] = 1
    info = parse_run(json.dumps(v1).encode(), "r", _RUN)
    assert info.optimizer is None and info.param_names is None and not info.closed
    info = parse_run(_run_bytes(optimizer="torch.optim.sgd.SGD", param_names=[["a", "b"], ["c"]], closed=True),
                     "r", _RUN)
    assert info.optimizer == "torch.optim.sgd.SGD" and info.param_names == (("a", "b"), ("c",)) and info.closed


def _state_segment(scaler, version: int = 2) -> bytes:
    ev = {"kind": "state", "groups": [{"lr": 0.1}], "sched": None}
    if scaler is not ...:
        ev["scaler"] = scaler
    return _pack({"run": _RUN, "seq": 1, "lo": 0, "hi": 1, "events": [ev]}, [], version)


@pytest.mark.parametrize("scaler", [
    {"scale": 1.0},
    {"scale": "1", "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "_growth_tracker": 0},
    {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1.5, "_growth_tracker": 0},
    {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1, "_growth_tracker": -1},
    [1.0],
])
def test_hostile_scaler_state_is_rejected(scaler):
    with pytest.raises(StepLogFormatError, match="scaler"):
        split_segment(_state_segment(scaler), "seg")


def test_scaler_state_needs_version_2():
    good = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 1}
    assert split_segment(_state_segment(good), "seg")[0]["events"][0]["scaler"] == good
    split_segment(_state_segment(..., version=1), "seg")
    with pytest.raises(StepLogFormatError, match="state"):
        split_segment(_state_segment(good, version=1), "seg")


def _counters_segment(counters, version: int = fmt.FORMAT_VERSION) -> bytes:
    ev = {"kind": "state", "groups": [{"lr": 0.1}], "sched": None, "counters": counters}
    return _pack({"run": _RUN, "seq": 1, "lo": 0, "hi": 1, "events": [ev]}, [], version)


@pytest.mark.parametrize("counters", [[1], {"": 1}, {"x" * 65: 1}, {"s": -1}, {"s": 2**53}, {"s": 1.0},
                                      {"s": True}, {f"c{i}": 1 for i in range(65)}])
def test_hostile_counters_are_rejected(counters):
    with pytest.raises(StepLogFormatError, match="counters"):
        split_segment(_counters_segment(counters), "seg")


def test_counters_need_version_3():
    assert split_segment(_counters_segment({"global_step": 7}), "seg")[0]["events"][0]["counters"] == {"global_step": 7}
    with pytest.raises(StepLogFormatError, match="counters"):
        split_segment(_counters_segment({"global_step": 7}, version=2), "seg")


def test_counters_are_logged_and_handed_back_by_replay(tmp_path):
    """``step_log(counters=)`` logs the caller's counters with each state record; ``replay(counters=)``
    fills the dict with those of the last record it applied (a loop that also counts skipped steps)."""
    directory = str(tmp_path / "run")
    net, opt, sched = make("adam")
    seen = {"batches": 0}
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched, counters=lambda: dict(seen))
        for step in range(1, STEPS + 1):
            train_step(net, opt, sched, step)
            seen["batches"] += 2  # e.g. a loop that also counts batches it did not step on
            if step == CKPT_AT:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
        net2, opt2, sched2 = make("adam")
        load_into(engine.load(f"{directory}/ck.ckpt"), net2, opt2, sched2)
        got = {"stale": 1}
        assert engine.replay(directory, opt2, sched2, counters=got) == STEPS - CKPT_AT
    assert got == {"batches": 2 * STEPS}
    assert_bit_equal(state(net2, opt2, sched2), state(net, opt, sched))


def test_a_counters_callable_returning_nonsense_fails_the_step(tmp_path):
    net, opt, sched = make("adam")
    with CheckpointEngine() as engine:
        slog = engine.step_log(str(tmp_path / "run"), opt, sched, counters=lambda: {"step": "seven"})
        with pytest.raises(StepLogError, match=r"counters=.*integers"):
            train_step(net, opt, sched, 1)
        with pytest.raises(StepLogError, match=r"counters="):  # its flush logs the state too
            slog.close()
        assert not slog._thread.is_alive()  # closed all the same


def test_marker_versions():
    body = {"_checkrun": "steplog-marker", "format_version": 1, "run": _RUN, "event": 3, "step": 2,
            "checkpoint": "a.ckpt", "commit": None}
    name = f"mark-{_RUN}-{3:012d}-{1:08d}.json"
    assert parse_marker(json.dumps(body).encode(), name, name).step == 2
    body["format_version"] = 0
    with pytest.raises(StepLogFormatError, match="format_version"):
        parse_marker(json.dumps(body).encode(), name, name)


# ----------------------------------------------------------------------------- GradScaler

INF_AT = (7, STEPS)  # a skipped step after the checkpoint, and the last step skipped


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)


def _amp_step(net, opt, sched, scaler, step: int) -> None:
    ids, y = batch(step)
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(net(ids), y)).backward()
    if step in INF_AT:  # an overflow: scaler.step skips optimizer.step(), update() backs the scale off
        net.mlp[0].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    sched.step()


def _amp_state(net, opt, sched, scaler) -> dict:
    return {**state(net, opt, sched), "scaler": scaler.state_dict()}


def _amp_logged(directory: str, model: bool = False) -> dict:
    """Steps 1..STEPS with a GradScaler (forced inf steps INF_AT) and the log on, a checkpoint after
    CKPT_AT; the state at the end."""
    net, opt, sched = make("adam")
    scaler = _scaler()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched, scaler=scaler, model=net if model else None)
        for step in range(1, STEPS + 1):
            _amp_step(net, opt, sched, scaler, step)
            if step == CKPT_AT:
                engine.save(_amp_state(net, opt, sched, scaler), f"{directory}/ck.ckpt").result()
        slog.close()
    return copy.deepcopy(_amp_state(net, opt, sched, scaler))


def test_grad_scaler_state_is_logged_and_replayed(tmp_path):
    directory = str(tmp_path / "run")
    want = _amp_logged(directory)
    # reference: an uninterrupted run without the log reaches the same state
    ref = make("adam")
    ref_scaler = _scaler()
    for step in range(1, STEPS + 1):
        _amp_step(*ref, ref_scaler, step)
    assert_bit_equal(_amp_state(*ref, ref_scaler), want)

    net2, opt2, sched2 = make("adam")
    scaler2 = _scaler()
    with CheckpointEngine() as engine:
        st = engine.load(f"{directory}/ck.ckpt")
        load_into(st, net2, opt2, sched2)
        scaler2.load_state_dict(st["scaler"])
        assert st["scaler"] != want["scaler"]  # the scaler moved on after the checkpoint
        replayed = engine.replay(directory, opt2, sched2, scaler=scaler2)
    assert replayed == STEPS - CKPT_AT - len(INF_AT)  # skipped steps are not optimizer steps
    assert_bit_equal(_amp_state(net2, opt2, sched2, scaler2), want)


def test_export_step_writes_the_logged_scaler_state(tmp_path, capsys):
    """``checkrun export --step N`` applies the logged GradScaler states to the checkpoint's scaler
    state, as replay does to a live scaler: the file holds the scale at step N, not the checkpoint's."""
    directory = str(tmp_path / "run")
    want = _amp_logged(directory, model=True)
    last = STEPS - len(INF_AT)  # optimizer steps: the skipped ones are not among them
    out = tmp_path / "s.pt"
    code, _, err = _cli(capsys, "export", directory, str(out), "--step", str(last))
    assert code == 0, err
    got = torch.load(out, weights_only=True)
    assert got["scaler"] == want["scaler"] and got["scaler"]["scale"] != 2.0**12
    assert_bit_equal(got["model"], want["model"])
    assert_bit_equal(got["opt"]["state"], want["opt"]["state"])


def test_replay_without_scaler_leaves_the_log_scaler_alone(tmp_path):
    directory = str(tmp_path / "run")
    net, opt, sched = make("sgd")
    scaler = _scaler()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched, scaler=scaler)
        for step in range(1, 9):
            _amp_step(net, opt, sched, scaler, step)
            if step == 2:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    net2, opt2, sched2 = make("sgd")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/ck.ckpt"), net2, opt2, sched2)
        assert engine.replay(directory, opt2, sched2) == 6 - 1  # step 7 was skipped
    assert_bit_equal(state(net2, opt2, sched2), state(net, opt, sched))


def test_fused_optimizer_with_a_scaler_is_refused(tmp_path):
    net, _, _ = make("adam")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    with CheckpointEngine() as engine, pytest.raises(StepLogError, match="fused=True"):
        engine.step_log(str(tmp_path / "run"), opt, scaler=_scaler())


# ----------------------------------------------------------------------------- segments cut by time


class _Clock:
    """log.py's ``time`` with a monotonic clock that jumps an hour per read: every open segment is past
    ``flush_seconds`` whenever the encoder looks, so it cuts one each time its queue is empty."""

    def __init__(self) -> None:
        # from the real clock: a segment's opening time may come from another module's (real) clock, and a
        # fake one starting at 0 stayed behind it once the machine had been up for a day (24 reads)
        self.now = time.monotonic()

    def monotonic(self) -> float:
        self.now += 3600.0
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_time_cut_segment_keeps_the_scheduler_exact(tmp_path, monkeypatch):
    directory = str(tmp_path / "run")
    monkeypatch.setattr(steplog_log, "time", _Clock())
    written: list[int] = []
    cond = threading.Condition()
    net, opt, sched = make("adamw")  # CosineAnnealingLR: the LR changes at every scheduler step
    with CheckpointEngine({"step_log": {"flush_every_steps": 10_000, "flush_seconds": 30.0}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        write = slog._segs.write_manifest

        def noting(name, data, *args, **kwargs):
            write(name, data, *args, **kwargs)
            m = SEG_RE.fullmatch(name)
            if m:
                with cond:
                    written.append(int(m.group(4)))
                    cond.notify_all()

        slog._segs.write_manifest = noting
        for step in range(1, STEPS + 1):
            train_step(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt").result()
        last = slog.event  # the newest step's event: held back from any cut by time
        with cond:
            assert cond.wait_for(lambda: written and max(written) >= last - 1, timeout=60)
        assert max(written) == last - 1 and len(written) >= 2  # cut by time, the newest step left out
        net2, opt2, sched2 = make("adamw")
        # a resume from what is committed now (a crash here), from a copy: a replay of the directory itself
        # would first commit what the open log holds (the newest step too)
        crashed = shutil.copytree(directory, tmp_path / "crashed")
        with CheckpointEngine() as other:
            load_into(other.load(f"{crashed}/ck.ckpt"), net2, opt2, sched2)
            assert other.replay(crashed, opt2, sched2) == STEPS - 1 - CKPT_AT
        slog.close()
    ref = make("adamw")
    for step in range(1, STEPS):
        train_step(*ref, step)
    assert_bit_equal(state(net2, opt2, sched2), state(*ref))
    assert opt2.param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]
    assert sched2.get_last_lr() == ref[2].get_last_lr()


# ----------------------------------------------------------------------------- gc of runs


def test_gc_removes_finished_runs_and_lists_them_in_dry_run(tmp_path, capsys):
    directory = str(tmp_path / "run")
    _train_logged(directory)  # run A: closed, its checkpoint ck.ckpt
    (run_a,) = _objects(directory, RUN_RE)
    with CheckpointEngine() as engine:
        engine.remove(f"{directory}/ck.ckpt")
    before = {p.name for p in _logdir(directory).iterdir()}
    code, text, _ = _cli(capsys, "gc", directory, "--dry-run", "--json")
    assert code == 0
    listed = set(json.loads(text)["step_log"])
    assert run_a.name in listed and listed == before  # segments, marker and the run object
    assert {p.name for p in _logdir(directory).iterdir()} == before
    code, text, _ = _cli(capsys, "gc", directory, "--dry-run")
    assert f"would delete {len(before)} step-log object(s)" in text and run_a.name in text
    assert _cli(capsys, "gc", directory)[0] == 0
    assert not any(_logdir(directory).iterdir())


def test_open_log_holds_its_run_and_retention_collects_closed_ones(tmp_path):
    directory = str(tmp_path / "run")
    _train_logged(directory)  # run A, closed; ck.ckpt is the only checkpoint
    (run_a,) = _objects(directory, RUN_RE)
    net, opt, sched = make("sgd")
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}, "retention": {"keep_last": 1}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, 6):
            train_step(net, opt, sched, step)
        slog.flush()  # every segment so far landed: none lands after this gc (as garbage the last gc would find)
        engine.gc(directory)  # run B has no marker yet: its segments are garbage, its run object is not
        runs = {p.name for p in _objects(directory, RUN_RE)}
        assert run_a.name in runs and len(runs) == 2  # A's checkpoint is still retained
        engine.save(state(net, opt, sched), f"{directory}/b.ckpt").result()  # keep_last=1: ck.ckpt goes
        engine.gc(directory)
        (run_b,) = _objects(directory, RUN_RE)
        assert run_b.name != run_a.name and not any(m.name.split("-")[1] in run_a.name
                                                    for m in _objects(directory, MARK_RE))
        for step in range(6, 9):
            train_step(net, opt, sched, step)
        slog.close()
    with CheckpointEngine() as engine:
        assert engine.gc(directory).step_log == []  # b.ckpt needs run B's marker, segments and object
    net2, opt2, sched2 = make("sgd")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/b.ckpt"), net2, opt2, sched2)
        assert engine.replay(directory, opt2, sched2) == 3
    assert_bit_equal(state(net2, opt2, sched2), state(net, opt, sched))


def test_gc_takes_runs_of_dead_processes_only(tmp_path):
    directory = str(tmp_path / "run")
    _train_logged(directory)
    with CheckpointEngine() as engine:
        engine.remove(f"{directory}/ck.ckpt")
    (run,) = _objects(directory, RUN_RE)
    body = json.loads(run.read_bytes())
    body["closed"] = False  # as if its process had crashed: only the owner decides now
    del body["end"]
    run.write_bytes(forged(body))
    with CheckpointEngine() as engine:
        deleted = engine.gc(directory).step_log
        assert run.name not in deleted and run.exists()  # alive (this process): kept, markers too
        assert _objects(directory, MARK_RE) and all(n.startswith("seg-") for n in deleted)
        ident = owner.identity()
        body["owner"] = {**ident, "pid": 4_194_303, "start": 1}  # no such process on this host
        run.write_bytes(forged(body))
        gone = engine.gc(directory).step_log
    assert run.name in gone and not any(_logdir(directory).iterdir())
    body.pop("owner"), body.pop("closed"), body.pop("checksum")
    body.pop("optimizer"), body.pop("param_names")
    body["format_version"] = 1
    run.write_bytes(json.dumps(body).encode())  # version 1 records no owner: never collected
    with CheckpointEngine() as engine:
        assert engine.gc(directory).step_log == [] and run.exists()


def test_replay_into_an_optimizer_with_other_flags_keeps_working(tmp_path):
    """A resumed optimizer whose ``foreach`` is True (logged: None, the default) still replays: flags
    may differ in kind (bool/None), numbers must stay numbers (see the damage tests). Replay sets the
    logged value, as for every hyperparameter."""
    directory = str(tmp_path / "run")
    net, opt, sched = _train_logged(directory)
    net2, opt2, sched2 = make("adam")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/ck.ckpt"), net2, opt2, sched2)
        opt2.param_groups[0]["foreach"] = True  # after load_state_dict, which restores the saved flags
        assert engine.replay(directory, opt2, sched2) == STEPS - CKPT_AT
    assert_bit_equal(state(net2, opt2, sched2)["model"], state(net, opt, sched)["model"])


@pytest.mark.parametrize("logged", [
    {"$steplog_tensors": ["0.1"], "dtype": "float32"},
    {"$steplog_tensors": [0.1], "dtype": "os.system"},
    {"$steplog_tensors": [0.1] * 1025, "dtype": "float32"},
    {"$steplog_tensors": [], "dtype": "float32"},
    {"$steplog_tensors": [True], "dtype": "float32"},
    {"$steplog_tensors": [0.1], "dtype": "float32", "extra": 1},
])
def test_a_logged_list_of_tensor_values_is_checked(logged) -> None:
    """A scheduler's ``_last_lr`` of tensors is logged as values with a dtype; what a segment says
    there is checked before any tensor is made."""
    from ckpt_core.errors import FormatError
    from ckpt_core.steplog.replay import _tensor_list

    with pytest.raises(FormatError, match="invalid list of tensor values"):
        _tensor_list(logged)
    assert _tensor_list({"$steplog_tensors": [0.5, 2], "dtype": "bfloat16"})[1].dtype == torch.bfloat16


def test_a_hyperparameter_that_goes_from_none_to_a_number_replays(tmp_path):
    """h129: a custom optimizer's ``clip=None`` set to 2.0 during training (after the checkpoint) made
    replay refuse the log as if forged ("logged hyperparameter 'clip' is 2.0, the optimizer holds a
    NoneType"). None may become a number or a flag."""
    from ckpt_core import CheckpointEngine

    def make():
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1)
        return net, Clipped(net.parameters())

    net, opt = make()
    with CheckpointEngine() as engine:
        log = engine.step_log(tmp_path, opt)
        for step in range(1, 7):
            if step == 5:
                opt.param_groups[0]["clip"] = 2.0
            opt.zero_grad()
            net(torch.full((2, 3), float(step))).sum().backward()
            opt.step()
            if step == 3:
                engine.save({"net": net.state_dict(), "opt": opt.state_dict()}, tmp_path / "s3.ckpt")
        log.close()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    net2, opt2 = make()
    with CheckpointEngine() as engine:
        state = engine.load(tmp_path / "s3.ckpt")
        net2.load_state_dict(state["net"])
        opt2.load_state_dict(state["opt"])
        assert engine.replay(tmp_path, opt2) == 3
    assert opt2.param_groups[0]["clip"] == 2.0
    assert all(torch.equal(want[k], v) for k, v in net2.state_dict().items())


class Clipped(torch.optim.SGD):
    """SGD with a hyperparameter of its own that starts as None."""

    def __init__(self, params, lr=0.1, clip=None):
        super().__init__(params, lr=lr)
        for g in self.param_groups:
            g.setdefault("clip", clip)
