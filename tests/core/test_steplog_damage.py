"""Damaged and hostile step logs: replay stops at the last good step with a warning naming the
segment; hostile metadata (checksums intact) is refused with an error naming the object."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.codecs import index_pipeline, lossless_pipeline
from ckpt_core.config import CompressionConfig
from ckpt_core.steplog import StepLogFormatError
from ckpt_core.steplog.format import pack_segment, split_segment

from .steplog_train import assert_bit_equal, forged, load_into, make, state, train_step
from .test_steplog import _reference

STEPS, CKPT_AT, EVERY = 12, 3, 3


@pytest.fixture
def logged(tmp_path):
    """A file:// directory with a checkpoint after step 3 and 9 more logged steps, 3 per segment."""
    directory = str(tmp_path / "run")
    net, opt, sched = make("adamw")
    with CheckpointEngine({"step_log": {"flush_every_steps": EVERY}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, STEPS + 1):
            train_step(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(state(net, opt, sched), f"{directory}/ck.ckpt")
        slog.close()
    return directory


def _segments(directory: str) -> list[str]:
    segdir = os.path.join(directory, ".checkrun", "steplog")
    return sorted(os.path.join(segdir, f) for f in os.listdir(segdir) if f.startswith("seg-"))


def _after_checkpoint(directory: str) -> list[str]:
    """Segments holding the steps after the checkpoint, in order."""
    mark = next(f for f in os.listdir(os.path.join(directory, ".checkrun", "steplog")) if f.startswith("mark-"))
    event = int(mark.split("-")[2])
    return [s for s in _segments(directory) if int(os.path.basename(s).split("-")[4].split(".")[0]) > event]


def _resume(directory: str) -> tuple[int, tuple]:
    net, opt, sched = make("adamw")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{directory}/ck.ckpt"), net, opt, sched)
        n = engine.replay(directory, opt, sched)
    return n, (net, opt, sched)


def _rewrite(path: str, fn) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(fn(data))


def _repack(path: str, mutate) -> None:
    """Change a segment's header and write it back with valid checksums (a hostile writer)."""
    header, payload = split_segment(open(path, "rb").read(), path)
    mutate(header)
    for k in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
        header.pop(k)
    _rewrite(path, lambda _: pack_segment(header, [bytes(payload)]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_segment_stops_at_last_good_step(logged, damage):
    segs = _after_checkpoint(logged)
    assert len(segs) == 3
    bad = segs[1]
    if damage == "flip":
        _rewrite(bad, lambda d: d[:-10] + bytes([d[-10] ^ 0x40]) + d[-9:])
    elif damage == "truncate":
        _rewrite(bad, lambda d: d[: len(d) // 2])
    else:
        os.remove(bad)
    named = os.path.basename(bad) if damage != "delete" else os.path.basename(bad)[:29]  # seg-<run>-<seq>
    with pytest.warns(UserWarning, match=named) as rec:
        n, resumed = _resume(logged)
    assert n == EVERY, n
    assert f"replay stopped after step 6 (event 13) of the log's run, counted from its start: {EVERY} step(s) replayed" \
        in str(rec[0].message)
    assert_bit_equal(state(*resumed), _reference("adamw", CKPT_AT + EVERY))


def _step(h: dict) -> dict:
    return next(e for e in h["events"] if e["kind"] == "step")


def _dense(h: dict) -> dict:
    return next(g for g in _step(h)["grads"] if g["k"] == "dense")


@pytest.mark.parametrize("mutate, message", [
    (lambda h: _dense(h).__setitem__("shape", [1] * 9), "field 'shape'"),
    (lambda h: _dense(h).__setitem__("data", [0, 10**9, []]), "reaches byte"),
    (lambda h: h["packs"]["float32"][0]["data"].__setitem__(2, [{"name": "pickle", "version": 1}]), "pickle"),
    (lambda h: h["packs"]["float32"][0]["data"].__setitem__(2, [{"name": "uniform", "version": 1, "bits": 4}]),
     "codec"),
    (lambda h: h["packs"]["float32"][0].__setitem__("numel", 2**41), "numel in"),
    (lambda h: h["packs"]["float32"][0].__setitem__("numel", 1), "past the end of its chunk"),
    (lambda h: h["packs"].__setitem__("object", h["packs"]["float32"]), "pack 'object'"),
    (lambda h: h["packs"].__setitem__("float32", {}), "list of chunks"),
    (lambda h: h["packs"]["float32"][0].__setitem__("data", [0, 10**9, []]), "reaches byte"),
    (lambda h: _dense(h)["data"].__setitem__("at", 10**12), "past the end of its chunk"),
    (lambda h: _dense(h)["data"].__setitem__("pack", "int64"), "its dtype is float32"),
    (lambda h: _dense(h)["data"].__setitem__("at", -1), "field 'data'"),
    (lambda h: h["packs"].pop("float32"), "the segment has none"),
    (lambda h: _dense(h).__setitem__("p", "../../etc/passwd"), "field 'p'"),
    (lambda h: _dense(h).__setitem__("dtype", "object"), "unknown dtype"),
    (lambda h: _dense(h).__setitem__("dtype", []), "unknown dtype"),  # found by test_fuzz_steplog: a TypeError
    (lambda h: _dense(h).__setitem__("k", []), "malformed gradient entry"),
    (lambda h: next(e for e in h["events"] if e["kind"] == "state")["groups"][0].__setitem__("lr", None),
     "logged hyperparameter 'lr' is None"),  # found by test_fuzz_steplog: Adam's step() raised a TypeError
    (lambda h: _step(h).__setitem__("extra", 1), "exactly step, grads"),
    (lambda h: h["events"].append({"kind": "exec", "code": "rm -rf /"}), "hi - lo"),
    (lambda h: h["events"][1].__setitem__("sched", [1, 2]), "'sched'"),
    # found by an independent fuzzer: load_state_dict set these as attributes, and the next
    # scheduler.step() failed with a bare AttributeError naming no file
    (lambda h: next(e for e in h["events"] if e["kind"] == "state")["sched"].__setitem__("optimizer", 5),
     "scheduler state 'optimizer'"),
    (lambda h: next(e for e in h["events"] if e["kind"] == "state")["sched"].__setitem__("last_epoch", "x"),
     "scheduler state 'last_epoch'"),
    (lambda h: h.__setitem__("hi", h["hi"] + 1), "hi - lo"),
    (lambda h: h.__setitem__("run", "../x"), "field 'run'"),
    # named as what it is, not as a manifest with a setting that does not apply (h94)
    (lambda h: h.__setitem__("pad", [0] * 2_000_001),
     "step-log segment header has more JSON elements than the limit of 2000000 (the step-log format's own limit)"),
])
def test_hostile_segment_header_is_refused(logged, mutate, message):
    bad = _after_checkpoint(logged)[0]
    _repack(bad, mutate)
    with pytest.raises(StepLogFormatError, match=os.path.basename(bad)) as exc:
        _resume(logged)
    assert message in str(exc.value)


def test_unknown_format_version_is_refused(logged, monkeypatch):
    from ckpt_core.steplog import format as fmt

    bad = _after_checkpoint(logged)[0]
    header, payload = split_segment(open(bad, "rb").read(), bad)
    for k in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
        header.pop(k)
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 99)
    monkeypatch.setattr(fmt, "PLAIN_VERSION", 99)
    data = pack_segment(header, [bytes(payload)])
    monkeypatch.undo()
    _rewrite(bad, lambda _: data)
    with pytest.raises(StepLogFormatError, match="unsupported step-log format_version '99'"):
        _resume(logged)


def test_hostile_row_indices_are_refused(logged):
    """Checksums intact, the table's gradient claims row 10**6 of a 512-row table."""
    bad = _after_checkpoint(logged)[0]
    header, payload = split_segment(open(bad, "rb").read(), bad)
    step = next(e for e in header["events"] if e["kind"] == "step")
    g = next(g for g in step["grads"] if g["k"] == "rows")
    idx, _ = index_pipeline().encode(torch.tensor([[10**6]], dtype=torch.int64))
    rows_pipe = lossless_pipeline(torch.float32, CompressionConfig())
    rows, _ = rows_pipe.encode(torch.ones(1, g["shape"][1]))
    idx, rows = bytes(idx), bytes(rows)
    g["n"] = 1
    g["idx"] = [len(payload), len(idx), index_pipeline().to_list()]
    g["data"] = [len(payload) + len(idx), len(rows), rows_pipe.to_list()]
    for k in ("_checkrun", "format_version", "payload_bytes", "payload_csum"):
        header.pop(k)
    _rewrite(bad, lambda _: pack_segment(header, [bytes(payload), idx, rows]))
    with pytest.raises(StepLogFormatError, match="row index outside") as exc:
        _resume(logged)
    assert os.path.basename(bad) in str(exc.value)


def test_a_logged_params_list_is_refused_and_the_optimizer_kept(logged):
    """h128: a state event whose group held ``"params": [0, 1, ...]`` (as many ints as the group has
    parameters, checksums recomputed) was applied: the optimizer's parameters became ints, then torch
    raised AttributeError. Only the kinds the writer logs (numbers, flags, lists of them) replace values."""
    bad = _after_checkpoint(logged)[0]
    net, opt, sched = make("adamw")
    value = list(range(len(opt.param_groups[0]["params"])))
    _repack(bad, lambda h: next(e for e in h["events"] if e["kind"] == "state")["groups"][0].__setitem__("params",
                                                                                                         value))
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{logged}/ck.ckpt"), net, opt, sched)
        with pytest.raises(StepLogFormatError, match="logged hyperparameter 'params'") as exc:
            engine.replay(logged, opt, sched)
    assert os.path.basename(bad) in str(exc.value)
    assert all(isinstance(p, torch.nn.Parameter) for p in opt.param_groups[0]["params"])


def test_huge_header_length_is_refused_before_reading_it(logged):
    bad = _after_checkpoint(logged)[0]
    _rewrite(bad, lambda d: d[:8] + struct.pack("<I", 2**31) + d[12:])
    with pytest.raises(StepLogFormatError, match="header of 2147483648 bytes"):
        _resume(logged)


def test_hostile_marker_is_refused(logged):
    segdir = os.path.join(logged, ".checkrun", "steplog")
    mark = os.path.join(segdir, next(f for f in os.listdir(segdir) if f.startswith("mark-")))
    body = json.loads(open(mark).read())
    body["checkpoint"] = "../../other.ckpt"
    _rewrite(mark, lambda _: forged(body))  # a forger recomputes the checksum
    with pytest.raises(StepLogFormatError, match=os.path.basename(mark)):
        _resume(logged)


def test_a_cycle_of_step_log_runs_is_refused_before_anything_is_applied(logged, capsys):
    """A run object whose parent is itself (or closes a longer cycle) made replay, `checkrun export
    --step` and Lightning's resume loop for ever (found by an independent fuzzer)."""
    from ckpt_core.cli import main

    segdir = os.path.join(logged, ".checkrun", "steplog")
    run = os.path.join(segdir, next(f for f in os.listdir(segdir) if f.startswith("run-")))
    body = json.loads(open(run).read())
    body["parent"] = {"run": body["run"], "event": STEPS}
    _rewrite(run, lambda _: forged(body))  # a forger recomputes the checksum
    with pytest.raises(StepLogFormatError, match=os.path.basename(run)):
        _resume(logged)
    capsys.readouterr()
    assert main(["verify", logged]) == 1
    assert "closes a cycle of runs" in capsys.readouterr().out


class _DropOnce(torch.optim.lr_scheduler.LRScheduler):
    """A user's scheduler: ``pending_drop`` a number until the drop, then None; ``warm_done_at`` set
    only on the first step after warm-up (absent from a state saved before)."""

    def __init__(self, opt, at):
        self.pending_drop = at
        super().__init__(opt)

    def get_lr(self):
        if self.last_epoch >= 4 and not hasattr(self, "warm_done_at"):
            self.warm_done_at = self.last_epoch
        if self.pending_drop is not None and self.last_epoch >= self.pending_drop:
            self.pending_drop = None
            return [g["lr"] * 0.1 for g in self.optimizer.param_groups]
        return [g["lr"] for g in self.optimizer.param_groups]


def test_a_users_scheduler_whose_state_grows_or_goes_none_replays_exactly(tmp_path):
    """The refusal of forged scheduler keys must not refuse a legitimate scheduler's later state (a
    key it sets lazily, a number that becomes None): found by an independent check of that refusal."""
    directory = str(tmp_path / "run")

    def make_all():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return net, opt, _DropOnce(opt, at=7)

    def step(net, opt, sched, i):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(torch.randn(8, 4, generator=g)), torch.randn(8, 2, generator=g)).backward()
        opt.step()
        sched.step()

    net, opt, sched = make_all()
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        log = engine.step_log(directory, opt, sched)
        for i in range(1, 11):
            step(net, opt, sched, i)
            if i == 2:
                engine.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                            f"{directory}/c.ckpt")
        log.close()
    net2, opt2, sched2 = make_all()
    with CheckpointEngine() as engine:
        saved = engine.load(f"{directory}/c.ckpt")
        net2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        sched2.load_state_dict(saved["sched"])
        assert "warm_done_at" not in saved["sched"] and engine.replay(directory, opt2, sched2) == 8
    assert sched2.state_dict() == sched.state_dict() and sched2.pending_drop is None
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), net2.state_dict().values()))


@pytest.mark.parametrize("kind", ["run-", "mark-"])
def test_every_bit_flip_of_a_run_object_or_marker_is_refused_naming_it(logged, kind):
    """Before: run and marker objects had no checksum, and a flipped bit could read as another valid
    object (a parent event 41 read as 51: replay stopped early without a warning; 41 as 40: it stopped
    at a state that was not its step's). Every single-bit flip now fails with the file named, or reads
    as the very same object (the last digit of a 17-digit float that rounds to the same number)."""
    from ckpt_core.steplog.format import parse_marker, parse_run

    segdir = os.path.join(logged, ".checkrun", "steplog")
    name = next(f for f in sorted(os.listdir(segdir)) if f.startswith(kind))
    data = open(os.path.join(segdir, name), "rb").read()
    parse = (lambda d: parse_run(d, name, name[4:-5])) if kind == "run-" else (lambda d: parse_marker(d, name, name))
    intact = parse(data)
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            assert parse(bytes(flipped)) == intact, f"bit {bit} flipped reads as another object"
        except StepLogFormatError as exc:
            assert name in str(exc)


def test_a_lost_last_segment_of_a_closed_log_is_seen(logged, capsys):
    """A closed log's run object says where it ended (``end``, version 8): losing its last segment stops
    the replay with a warning naming it, and ``checkrun verify`` reports it. Before, the replay ended
    one segment early in silence and verify said the log was intact (found by an independent fault
    program). A log that was not closed (a crash) cannot tell: its unflushed steps are the loss bound."""
    from ckpt_core.cli import main

    last = _after_checkpoint(logged)[-1]
    os.remove(last)
    with pytest.warns(UserWarning, match=os.path.basename(last)[:29] + r".*missing: events .* says were logged") as rec:
        n, resumed = _resume(logged)
    assert n == 2 * EVERY and len(rec) == 1
    assert_bit_equal(state(*resumed), _reference("adamw", CKPT_AT + 2 * EVERY))
    assert main(["verify", logged, "--no-progress"]) == 1
    assert "are missing (its object says they were logged before it was closed)" in capsys.readouterr().out


def test_segments_whose_run_object_is_lost_are_named_and_kept(logged, capsys):
    """A run that resumed and logged on, whose run object was then lost: a replay ended at the older run's
    end in silence, ``checkrun verify`` said the log was intact and gc deleted the run's segments (found by
    an independent fault program). The replay warns naming them, verify reports them, gc keeps them."""
    from ckpt_core.cli import main

    steplog = os.path.join(logged, ".checkrun", "steplog")
    n, (net, opt, sched) = _resume(logged)
    with CheckpointEngine({"step_log": {"flush_every_steps": EVERY}}) as engine:
        slog = engine.step_log(logged, opt, sched)  # continues the chain the replay ended on
        for step in range(STEPS + 1, STEPS + 4):
            train_step(net, opt, sched, step)
        slog.close()
    run = f"run-{slog.run}.json"
    os.remove(os.path.join(steplog, run))
    with pytest.warns(UserWarning, match=f"run {slog.run}: 1 segment.s., events .* not replayed"):
        n, resumed = _resume(logged)
    assert n == STEPS - CKPT_AT
    assert main(["verify", logged, "--no-progress"]) == 1
    assert f"run {slog.run}: 1 segment(s)" in capsys.readouterr().out
    kept = sorted(f for f in os.listdir(steplog) if f.startswith(f"seg-{slog.run}"))
    assert kept and main(["gc", logged, "--no-progress"]) == 0
    assert sorted(f for f in os.listdir(steplog) if f.startswith(f"seg-{slog.run}")) == kept


def test_a_run_a_concurrent_gc_deletes_while_the_log_is_listed_is_no_orphan(logged, monkeypatch):
    """gc deletes a run's segments, then its object: a listing straddling that (segments listed, the object
    gone when runs are read) named the run's segments as orphaned (found by an independent check)."""
    from ckpt_core.steplog.index import read_index
    from ckpt_core.storage.store import Store

    steplog = os.path.join(logged, ".checkrun", "steplog")
    listing, calls = Store.list_files, []

    def list_files(self):
        out = listing(self)
        if not calls:  # "another process" collects the run between the reader's listings
            for name in os.listdir(steplog):
                if name.startswith(("seg-", "run-")):
                    os.remove(os.path.join(steplog, name))
        calls.append(1)
        return out

    with CheckpointEngine() as engine:
        store = engine._dir_store(logged, None)
    monkeypatch.setattr(Store, "list_files", list_files)
    from ckpt_core.steplog.log import log_store
    index = read_index(log_store(store))
    assert index.orphans() == {} and index.orphan_note("x") is None


@pytest.mark.parametrize("end, message", [({"event": 1}, "field 'end' must be"), ({"event": 3, "seq": True}, "end.seq"),
                                          ({"event": "9", "seq": 1}, "end.event"), (None, "must be")])
def test_hostile_end_of_a_run_object_is_refused(logged, end, message):
    from ckpt_core.steplog.format import parse_run, run_to_bytes

    segdir = os.path.join(logged, ".checkrun", "steplog")
    name = next(f for f in os.listdir(segdir) if f.startswith("run-"))
    info = parse_run(open(os.path.join(segdir, name), "rb").read(), name, name[4:-5])
    assert info.closed and info.end is not None and info.end[0] > info.start
    body = json.loads(run_to_bytes(info))
    body.pop("checksum")
    if end is None:  # an end in a run object that does not say closed
        body["closed"] = False
    else:
        body["end"] = end
    data = forged(body)
    with pytest.raises(StepLogFormatError, match=message):
        parse_run(data, name, name[4:-5])


def test_gc_keeps_the_steps_after_a_damaged_marker(logged):
    """A marker with a flipped byte: gc keeps it, and the segments after its event, which a resume from
    its checkpoint needs (h112: the segments were deleted, only marker and run object stayed)."""
    from ckpt_core.cli import main

    segdir = os.path.join(logged, ".checkrun", "steplog")
    mark = os.path.join(segdir, next(f for f in os.listdir(segdir) if f.startswith("mark-")))
    _rewrite(mark, lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:])
    needed = _after_checkpoint(logged)
    assert needed and main(["gc", logged, "--grace", "0", "--no-progress"]) == 0
    with CheckpointEngine() as engine:
        engine.gc(logged)
    assert all(os.path.exists(s) for s in needed) and os.path.exists(mark)


def test_a_resume_from_a_run_whose_object_is_lost_replays_it_and_says_so(logged):
    """The run object of the run the checkpoint's marker names is lost: its segments are still replayed
    (the marker names the run), and the warning says so (h112: it said their steps were not replayed)."""
    segdir = os.path.join(logged, ".checkrun", "steplog")
    os.remove(os.path.join(segdir, next(f for f in os.listdir(segdir) if f.startswith("run-"))))
    with pytest.warns(UserWarning, match="which a checkpoint.s marker names, has no run object .* after that checkpoint are "
                                         "replayed, but a lost last segment"):
        n, resumed = _resume(logged)
    assert n == STEPS - CKPT_AT
    assert_bit_equal(state(*resumed), _reference("adamw", STEPS))


def test_a_segment_copied_over_another_is_refused_by_replay_and_verify(logged, capsys):
    """Its checksums hold, its header names another segment: replay raised, but ``checkrun verify`` said
    the log was intact (h112; export: test_cli_steplog.py)."""
    from ckpt_core.cli import main

    first, second = _after_checkpoint(logged)[:2]
    _rewrite(first, lambda _: open(second, "rb").read())
    name = os.path.basename(first)
    with pytest.raises(StepLogFormatError, match=f"{name}: header says .* its name says otherwise"):
        _resume(logged)
    assert main(["verify", logged, "--no-progress"]) == 1
    assert f"{name}: header says" in capsys.readouterr().out


def test_load_max_total_bytes_bounds_what_a_segment_decodes(logged, tmp_path, capsys):
    """A forged pack chunk of zeros (checksums resealed) declaring 2**29 elements made replay and
    ``checkrun verify`` allocate 4 GiB whatever ``load.max_total_bytes`` said (h112): it bounds each
    segment, tensor and pack chunk now, as a checkpoint's tensors (here: a limit below a segment's size,
    which ends the replay before it with a warning, as ``load.max_blob_bytes`` does)."""
    from ckpt_core.cli import main

    net, opt, sched = make("adamw")
    with CheckpointEngine() as engine:
        load_into(engine.load(f"{logged}/ck.ckpt"), net, opt, sched)
    with CheckpointEngine({"load": {"max_total_bytes": 64}}) as engine:
        with pytest.warns(UserWarning, match="more than the allowed 64.*0 step.s. replayed"):
            assert engine.replay(logged, opt, sched) == 0
    config = tmp_path / "small.yaml"
    config.write_text("load:\n  max_total_bytes: 64\n")
    assert main(["verify", logged, "--no-progress", "--config", str(config)]) == 1
    assert "more than the allowed 64" in capsys.readouterr().out
