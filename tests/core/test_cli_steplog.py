"""The step log in the ``checkrun`` command line, on real logs written through ``engine.step_log``:
``ls`` (logged steps after each checkpoint), ``inspect SEGMENT``, ``verify DIR`` and
``export --step N``. Damage is real: a flipped payload byte, a truncated segment, and a hostile
segment whose checksums hold."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.cli import main
from ckpt_core.steplog.format import SEG_RE, RunInfo, pack_segment, run_name, run_to_bytes, seg_name

STEPS, CKPT_AT, EVERY = 14, 4, 4


def _make() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(32, 3), torch.nn.Flatten(), torch.nn.Linear(6, 1))
    opt = torch.optim.Adam(net.named_parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return net, opt, sched


def _train(net, opt, sched, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 32, (4, 2), generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    sched.step()


def _state(net, opt, sched) -> dict:
    return {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


@pytest.fixture
def logged(tmp_path) -> str:
    """A directory with a checkpoint after step 4 and steps 5..14 logged after it (4 per segment)."""
    directory = str(tmp_path / "run")
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": EVERY}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, STEPS + 1):
            _train(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    return directory


def _segments(directory: str) -> list[Path]:
    segdir = Path(directory, ".checkrun", "steplog")
    return sorted((p for p in segdir.iterdir() if SEG_RE.fullmatch(p.name)), key=lambda p: p.name)


def _after_marker(directory: str) -> list[Path]:
    """Segments holding events after the checkpoint's marker (a replay from ck.ckpt reads them)."""
    mark = next(p.name for p in Path(directory, ".checkrun", "steplog").iterdir() if p.name.startswith("mark-"))
    event = int(mark.split("-")[2])
    return [p for p in _segments(directory) if int(SEG_RE.fullmatch(p.name).group(4)) > event]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--no-progress"])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = _run(capsys, *argv, "--json")
    return code, json.loads(out)


def _flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- ls


def test_ls_shows_logged_steps_after_the_checkpoint(logged, capsys):
    code, doc = _json(capsys, "ls", logged)
    assert code == 0
    (row,) = doc["checkpoints"]
    assert row["logged_steps_after"] == STEPS - CKPT_AT
    assert (row["logged_from_step"], row["logged_through_step"]) == (CKPT_AT, STEPS)
    assert doc["step_log"]["markers"] == 1 and doc["step_log"]["segments"] == len(_segments(logged))
    code, out, _ = _run(capsys, "ls", logged)
    assert code == 0 and f"ck.ckpt  +{STEPS - CKPT_AT} logged steps (through step {STEPS})" in out


@pytest.mark.parametrize("lie", ["size 0", "flipped byte"])
def test_ls_reads_a_segment_header_damaged_in_transit_again(logged, capsys, monkeypatch, lie):
    """h117 (an S3 proxy): one HEAD answering a size of 0 for a segment, or one GET with a byte flipped, made
    ``ls`` say an intact log "ends early" (+0 logged steps, exit 0); replay and verify read it again. So
    does ``ls`` now (``faultfile://``: the real disk, one answer changed)."""
    from ckpt_core.testing.faults import FaultFS

    target = _after_marker(logged)[0].name
    told: list[str] = []
    real_info, real_cat = FaultFS.info, FaultFS.cat_file

    def info(self, path, **kwargs):
        out = real_info(self, path, **kwargs)
        if lie == "size 0" and str(path).endswith(target) and not told:
            told.append(str(path))
            out = {**out, "size": 0}
        return out

    def cat_file(self, path, start=None, end=None, **kwargs):
        out = real_cat(self, path, start=start, end=end, **kwargs)
        if lie == "flipped byte" and str(path).endswith(target) and not told:
            told.append(str(path))
            out = bytes([out[0] ^ 1]) + out[1:]
        return out
    monkeypatch.setattr(FaultFS, "info", info)
    monkeypatch.setattr(FaultFS, "cat_file", cat_file)
    code, doc = _json(capsys, "ls", f"faultfile://{logged}")
    assert told and code == 0
    (row,) = doc["checkpoints"]
    assert row["logged_steps_after"] == STEPS - CKPT_AT and row.get("step_log_problem") is None, row


def test_ls_without_a_step_log_is_unchanged(tmp_path, capsys):
    with CheckpointEngine() as engine:
        engine.save({"w": torch.ones(3)}, f"{tmp_path}/a.ckpt").result()
    code, doc = _json(capsys, "ls", str(tmp_path))
    assert code == 0 and "step_log" not in doc
    assert not any(k.startswith("logged") for k in doc["checkpoints"][0])
    code, out, _ = _run(capsys, "ls", str(tmp_path))
    assert "step log" not in out and "logged" not in out


def test_ls_names_a_segment_whose_header_is_gone(logged, capsys):
    last = _after_marker(logged)[-1]
    last.write_bytes(last.read_bytes()[:10])
    code, doc = _json(capsys, "ls", logged)
    (row,) = doc["checkpoints"]
    assert row["logged_through_step"] < STEPS and last.name in row["step_log_problem"]
    assert row["step_log_problem"].count(last.name) == 1, row["step_log_problem"]  # was named twice


# ----------------------------------------------------------------------------- inspect


def test_inspect_segment_prints_its_header(logged, capsys):
    seg = _after_marker(logged)[-1]
    code, doc = _json(capsys, "inspect", str(seg))
    assert code == 0 and doc["ok"] and doc["payload_status"] == "ok"
    steps = [r for r in doc["records"] if r["kind"] == "step"]
    assert doc["steps"] == [steps[0]["step"], steps[-1]["step"]] and doc["steps"][1] == STEPS
    grads = {g["param"]: g for g in steps[0]["grads"]}
    assert grads[0]["shape"] == [32, 3] and grads[0]["dtype"] == "float32"
    assert grads[0]["kind"] in ("rows", "dense")  # rows when few are touched: the core decides
    assert grads[0]["kind"] == "dense" or 0 < grads[0]["rows"] <= 8  # 4 x 2 ids touch at most 8 rows
    assert grads[1]["shape"] == [1, 6] and grads[1]["kind"] == "dense" and grads[1]["pack"]["dtype"] == "float32"
    assert "float32" in doc["packs"] and doc["packs"]["float32"]["encoded_bytes"] > 0
    assert sum(p["encoded_bytes"] for p in doc["packs"].values()) <= doc["payload_bytes"]
    code, out, _ = _run(capsys, "inspect", str(seg))
    assert code == 0 and "checksum ok" in out and "float32" in out and f"run       {doc['run']}" in out


def test_inspect_corrupt_segment_shows_header_and_fails(logged, capsys):
    seg = _after_marker(logged)[0]
    _flip(seg)
    code, out, err = _run(capsys, "inspect", str(seg))
    assert code == 1 and "DAMAGED (payload checksum mismatch)" in out
    assert err.count("\n") == 1 and seg.name in err and "Traceback" not in err


@pytest.mark.parametrize("keep", [10, 200])
def test_inspect_truncated_segment_is_one_line_error(logged, capsys, keep):
    seg = _after_marker(logged)[0]
    seg.write_bytes(seg.read_bytes()[:keep])
    code, out, err = _run(capsys, "inspect", str(seg))
    assert code == 1 and out == "" and err.count("\n") == 1 and seg.name in err
    assert "truncated" in err and "Traceback" not in err


def test_inspect_hostile_segment_is_one_line_error(tmp_path, capsys):
    d = tmp_path / ".checkrun" / "steplog"
    d.mkdir(parents=True)
    run = "0123456789abcdef"
    bad = {"run": run, "seq": 1, "lo": 0, "hi": 1,
           "events": [{"kind": "step", "step": 1, "grads": [{"p": 0, "k": "dense", "dtype": "float32",
                                                               "shape": [4], "data": [0, 1 << 40, []]}]}]}
    path = d / seg_name(run, 1, 0, 1)
    path.write_bytes(pack_segment(bad, [b"x" * 16]))
    code, out, err = _run(capsys, "inspect", str(path))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert path.name in err and "'data'" in err and "Traceback" not in err
    code, doc = _json(capsys, "verify", str(tmp_path))
    assert code == 1 and "hostile" in doc["step_log"]["problems"][0]


def test_inspect_log_folder_lists_segments_and_markers(logged, capsys):
    segs = _segments(logged)
    segs[-1].write_bytes(segs[-1].read_bytes()[:10])
    code, doc = _json(capsys, "inspect", f"{logged}/.checkrun/steplog")
    assert code == 0 and [Path(r["segment"]).name for r in doc["segments"]] == [p.name for p in segs]
    assert doc["segments"][0]["steps"][0] == 1 and doc["segments"][-1]["steps"] is None
    assert segs[-1].name in doc["segments"][-1]["error"]
    assert [(m["checkpoint"], m["step"]) for m in doc["markers"]] == [("ck.ckpt", CKPT_AT)]
    code, out, _ = _run(capsys, "inspect", f"{logged}/.checkrun/steplog/")
    assert code == 0 and "unreadable" in out and f"marker: ck.ckpt after step {CKPT_AT}" in out


# ----------------------------------------------------------------------------- verify


def test_verify_intact_log(logged, capsys):
    code, doc = _json(capsys, "verify", logged)
    assert code == 0 and doc["ok"] and doc["step_log"]["ok"]
    assert doc["step_log"]["segments"] == len(_segments(logged)) and doc["step_log"]["problems"] == []
    code, out, _ = _run(capsys, "verify", logged)
    assert code == 0 and "step log intact" in out


def test_verify_corrupt_segment_says_where_replay_stops(logged, capsys):
    first, second = _after_marker(logged)[:2]
    _flip(second)
    code, doc = _json(capsys, "verify", logged)
    assert code == 1 and not doc["ok"] and all(c["ok"] for c in doc["checkpoints"])  # the checkpoint is fine
    (early,) = doc["step_log"]["ends_early"]
    assert early["segment"].endswith(second.name) and early["needed_by"] == ["ck.ckpt"]
    first_steps = [e["step"] for e in json.loads(_header_json(first))["events"] if e["kind"] == "step"]
    assert early["stops_at_step"] == first_steps[-1]
    code, out, _ = _run(capsys, "verify", logged)
    assert code == 1 and f"replay from ck.ckpt stops at step {first_steps[-1]}" in out
    assert "OK       " in out and "step log damaged" in out and "1 intact, 0 corrupt" in out


def test_verify_reports_a_segment_missing_between_two(logged, capsys):
    """A segment gone from the middle of the chain (deleted, or never written: a full disk) ends the
    replay there; verify said "step log intact", exit 0, because each segment left was fine (found by
    an independent check)."""
    first, second = _after_marker(logged)[:2]
    second.unlink()
    code, doc = _json(capsys, "verify", logged)
    assert code == 1 and not doc["step_log"]["ok"]
    (early,) = doc["step_log"]["ends_early"]
    first_steps = [e["step"] for e in json.loads(_header_json(first))["events"] if e["kind"] == "step"]
    assert early["segment"] is None and "missing" in early["error"] and early["needed_by"] == ["ck.ckpt"]
    assert early["stops_at_step"] == first_steps[-1]
    code, out, _ = _run(capsys, "verify", logged)
    assert code == 1 and f"replay from ck.ckpt stops at step {first_steps[-1]}" in out and "are missing" in out


def test_verify_truncated_segment(logged, capsys):
    seg = _after_marker(logged)[0]
    seg.write_bytes(seg.read_bytes()[:-7])
    code, doc = _json(capsys, "verify", logged)
    assert code == 1
    (early,) = doc["step_log"]["ends_early"]
    assert early["segment"].endswith(seg.name) and early["stops_at_step"] == CKPT_AT


def test_verify_decodes_each_gradient(tmp_path, capsys):
    """Checksums hold but a gradient's bytes do not decode to its shape: only decoding finds it."""
    d = tmp_path / ".checkrun" / "steplog"
    d.mkdir(parents=True)
    run = "0123456789abcdef"
    codecs = [{"name": "raw", "version": 1}]
    header = {"run": run, "seq": 1, "lo": 0, "hi": 1,
              "events": [{"kind": "step", "step": 1, "grads": [{"p": 0, "k": "dense", "dtype": "float32",
                                                                  "shape": [100], "data": [0, 16, codecs]}]}]}
    seg = d / seg_name(run, 1, 0, 1)
    seg.write_bytes(pack_segment(header, [bytes(16)]))
    (d / run_name(run)).write_bytes(run_to_bytes(RunInfo(run, 0.0, 0, 0, None)))  # its run object (else: orphaned)
    code, doc = _json(capsys, "verify", str(tmp_path))
    assert code == 1 and seg.name in doc["step_log"]["problems"][0] and "param 0" in doc["step_log"]["problems"][0]
    code, doc = _json(capsys, "verify", str(tmp_path), "--no-decode")
    assert doc["step_log"]["ok"] and doc["step_log"]["segments"] == 1


def test_malformed_marker_is_named_by_verify_and_ls(logged, capsys):
    mark = next(p for p in Path(logged, ".checkrun", "steplog").iterdir() if p.name.startswith("mark-"))
    mark.write_text('{"_checkrun": "steplog-marker", "format_version": 1}')
    code, doc = _json(capsys, "verify", logged)
    assert code == 1 and mark.name in doc["step_log"]["problems"][0] and all(c["ok"] for c in doc["checkpoints"])
    code, out, _ = _run(capsys, "ls", logged)
    assert code == 0 and "step log" in out and "unreadable" in out and mark.name in out
    assert "ck.ckpt" in out and "committed" in out


def _header_json(path: Path) -> bytes:
    data = path.read_bytes()
    n = int.from_bytes(data[8:12], "little")
    return data[12:12 + n]


# ----------------------------------------------------------------------------- export --step


def _reference(step: int) -> dict:
    net, opt, sched = _make()
    for s in range(1, step + 1):
        _train(net, opt, sched, s)
    return _state(net, opt, sched)


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["opt"]["param_groups"] == want["opt"]["param_groups"]
    for i, st in want["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["opt"]["state"][i][k], v), (i, k)
    assert got["sched"] == want["sched"]


@pytest.mark.parametrize("step", [CKPT_AT, 9, STEPS])
def test_export_step_writes_the_replayed_state(logged, tmp_path, capsys, step):
    out = tmp_path / f"s{step}.pt"
    code, doc = _json(capsys, "export", logged, str(out), "--step", str(step), "--optimizer", "Adam")
    assert code == 0, doc
    assert doc["replay"]["replayed_steps"] == step - CKPT_AT and doc["replay"]["from_step"] == CKPT_AT
    _assert_equal(torch.load(out, weights_only=True), _reference(step))


def test_export_step_refuses_a_segment_copied_over_another(logged, tmp_path, capsys):
    """Checksums intact, the header names another segment: export wrote a state no run ever had (h112)."""
    first, second = _after_marker(logged)[:2]
    first.write_bytes(second.read_bytes())
    out = tmp_path / "s.pt"
    code, _, err = _run(capsys, "export", logged, str(out), "--step", str(STEPS), "--optimizer", "Adam")
    assert code != 0 and f"{first.name}: header says" in err
    assert not out.exists()
    code, out_text, _ = _run(capsys, "ls", logged)  # h113: ls and inspect took it too
    assert f"{first.name}: header says" in out_text
    code, _, err = _run(capsys, "inspect", str(first))
    assert code != 0 and f"{first.name}: header says" in err


def test_export_step_safetensors_roundtrip(logged, tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    code, _, _ = _run(capsys, "export", f"{logged}/ck.ckpt", str(out), "--step", "11", "--optimizer", "torch.optim.Adam")
    assert code == 0
    back = tmp_path / "back" / "b.ckpt"
    assert _run(capsys, "import", str(out), str(back))[0] == 0
    with CheckpointEngine() as engine:
        _assert_equal(engine.load(str(back)), _reference(11))


def test_export_step_refuses_what_it_cannot_do(logged, tmp_path, capsys):
    out = str(tmp_path / "x.pt")
    code, _, err = _run(capsys, "export", logged, out, "--step", "9", "--optimizer", "os.system")
    assert code == 2 and "not a torch.optim optimizer class" in err
    code, _, err = _run(capsys, "export", logged, out, "--step", str(STEPS + 1), "--optimizer", "Adam")
    assert code == 1 and f"step {STEPS + 1} is not in the step log" in err and f"{CKPT_AT}..{STEPS}" in err
    code, _, err = _run(capsys, "export", logged, out, "--step", "2", "--optimizer", "Adam")
    assert code == 1 and "no checkpoint with a marker at or before it" in err
    code, _, err = _run(capsys, "export", logged, out, "--step", "9", "--optimizer", "SGD")
    assert code == 1 and "does not load into torch.optim.SGD" in err
    assert not os.path.exists(out)


def test_export_step_stops_at_a_corrupt_segment(logged, tmp_path, capsys):
    segs = _after_marker(logged)
    _flip(segs[1])
    ok = tmp_path / "ok.pt"
    steps = [e["step"] for e in json.loads(_header_json(segs[0]))["events"] if e["kind"] == "step"]
    assert _run(capsys, "export", logged, str(ok), "--step", str(steps[-1]), "--optimizer", "Adam")[0] == 0
    _assert_equal(torch.load(ok, weights_only=True), _reference(steps[-1]))
    code, _, err = _run(capsys, "export", logged, str(tmp_path / "no.pt"), "--step", str(STEPS),
                        "--optimizer", "Adam")
    assert code == 1 and segs[1].name in err and "ends early" in err and "Traceback" not in err


def test_export_step_needs_param_names(tmp_path, capsys):
    directory = str(tmp_path / "run")
    net, _, _ = _make()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # no names: gradients cannot be matched
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        slog = engine.step_log(directory, opt)
        engine.save({"model": net.state_dict(), "opt": opt.state_dict()}, f"{directory}/a.ckpt").result()
        for step in range(1, 3):
            _train(net, opt, type("S", (), {"step": lambda self: None})(), step)
        slog.close()
    code, _, err = _run(capsys, "export", directory, str(tmp_path / "x.pt"), "--step", "2", "--optimizer", "SGD")
    assert code == 1 and "param_names" in err and "named_parameters" in err


def test_export_step_keeps_an_unnamed_optimizer_state_unnamed(tmp_path, capsys):
    """An optimizer built from ``parameters()`` (as Lightning's ``configure_optimizers`` does), its names
    from the log's model: the exported state gained ``param_names`` that the checkpoint never had and that a
    stock load_state_dict then carried into every later checkpoint (found by an independent check)."""
    directory = str(tmp_path / "run")
    net, _, _ = _make()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    with CheckpointEngine({"step_log": {"flush_every_steps": 2}}) as engine:
        slog = engine.step_log(directory, opt, sched, model=net)
        engine.save(_state(net, opt, sched), f"{directory}/a.ckpt").result()
        for step in range(1, 4):
            _train(net, opt, sched, step)
        slog.close()
    out = tmp_path / "x.pt"
    assert _run(capsys, "export", directory, str(out), "--step", "3", "--optimizer", "Adam")[0] == 0
    got = torch.load(out, weights_only=True)
    assert got["opt"]["param_groups"] == opt.state_dict()["param_groups"]
    assert all(torch.equal(got["model"][k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize("cls", ["SparseAdam", "Adafactor"])
def test_export_step_of_an_optimizer_whose_defaults_lack_differentiable(tmp_path, capsys, cls):
    """torch's load_state_dict adds ``differentiable`` to every optimizer's defaults; SparseAdam and Adafactor
    never put it in their groups: export refused their logs ("its parameter groups lack differentiable (saved
    by another optimizer class?)") although replay was exact (h162)."""
    directory = str(tmp_path / "run")
    torch.manual_seed(0)
    emb = torch.nn.Embedding(40, 8, sparse=cls == "SparseAdam")
    opt = getattr(torch.optim, cls)(emb.parameters(), lr=0.01)

    def step(i: int) -> None:
        opt.zero_grad()
        emb(torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(i))).square().mean().backward()
        opt.step()

    with CheckpointEngine() as engine:
        slog = engine.step_log(directory, opt, model=emb)
        for i in range(1, 7):
            step(i)
            if i == 3:
                engine.save({"model": emb.state_dict(), "opt": opt.state_dict()}, f"{directory}/s3.ckpt").result()
        slog.close()
    out = tmp_path / "x.pt"
    code, _, err = _run(capsys, "export", directory, str(out), "--step", "6", "--optimizer", cls)
    assert code == 0, err
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["model"]["weight"], emb.weight.detach())
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for k, v in opt.state_dict()["state"].items()
               for a, b in zip(v.values(), got["opt"]["state"][k].values()))


class _SegmentReadsFail:
    """Every read of a step-log segment fails as an unreachable storage does (after the retries)."""

    def on(self, op, kind, path):
        if op in ("read", "open") and "/steplog/seg-" in str(path) and ".tmp-" not in str(path):
            raise ConnectionResetError(104, "injected: connection reset by peer")

    def data(self, kind, path, buf, write):
        write(buf)


def test_a_storage_outage_is_not_reported_as_a_damaged_step_log(logged, capsys):
    """Before: `verify DIR` called an unreadable segment 'hostile or invalid', and `ls` exited 0 saying the
    log ends early (found by a fault program on S3): an outage is not damage, and fails the command."""
    from ckpt_core.testing.faults import FaultFS

    url = f"faultfile://{logged}"
    config = Path(logged).parent / "retry-once.yaml"
    config.write_text("storage:\n  retry:\n    max_attempts: 1\n")
    FaultFS.reset()
    FaultFS.policy = _SegmentReadsFail()
    try:
        code, out, _ = _run(capsys, "verify", url, "--config", str(config))
        assert code == 1 and "UNREADABLE" in out and "the storage failed, not a damaged segment" in out
        assert "hostile" not in out and "step log unreadable" in out
        code, out, err = _run(capsys, "ls", url, "--config", str(config))
        assert code == 1 and "the log ends early" not in out
    finally:
        FaultFS.reset()


def test_export_step_from_a_quantized_checkpoint_warns(tmp_path, capsys, caplog):
    """As engine.replay warns: the replayed state starts from quantized values (h148: export said nothing)."""
    directory = str(tmp_path / "run")
    net, opt, sched = _make()
    rule = {"pattern": "model.0.weight", "method": "bf16", "min_numel": 0}
    with CheckpointEngine({"step_log": {"flush_every_steps": EVERY}, "quantization": [rule]}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, 7):
            _train(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    code, _, _ = _run(capsys, "export", directory, str(tmp_path / "s6.pt"), "--step", "6", "--optimizer", "Adam")
    assert code == 0
    assert "stores 1 tensor(s) quantized (lossy): the 2 replayed step(s)" in caplog.text
