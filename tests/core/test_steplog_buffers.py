"""The forward-pass state in the step log: BatchNorm's running statistics change in the forward pass,
not in ``optimizer.step()``, so a log of optimizer steps alone resumed a BatchNorm model with its
checkpoint's statistics (found by an independent check: ``num_batches_tracked`` 17 short after 17
replayed steps). With ``step_log(model=)`` every step also logs them; ``replay(model=)`` sets them,
so the whole state equals the uninterrupted run's, buffers included."""
from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.cli import main
from ckpt_core.steplog import StepLogError, StepLogFormatError, forward_state, warn_forward_state
from ckpt_core.steplog.format import SEG_RE, pack_segment, split_segment

from .steplog_train import assert_bit_equal

STEPS, CKPT_AT = 13, 4


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.frozen_stats = torch.nn.BatchNorm1d(16, track_running_stats=False)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.frozen_stats(self.bn(self.inp(x)))))


def _make():
    torch.manual_seed(7)
    net = BNNet()
    opt = torch.optim.Adam(net.named_parameters(), lr=0.02)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def _train(net, opt, sched, step: int, accumulate: int = 1) -> None:
    opt.zero_grad()
    for micro in range(accumulate):  # several forward passes per step: the statistics of all of them
        g = torch.Generator().manual_seed(100 * step + micro)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    sched.step()


def _state(net, opt, sched) -> dict:
    return {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


def _reference(step: int, accumulate: int = 1) -> dict:
    net, opt, sched = _make()
    for s in range(1, step + 1):
        _train(net, opt, sched, s, accumulate)
    return _state(net, opt, sched)


def _logged(directory: str, model: bool = True, accumulate: int = 1) -> None:
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched, model=net if model else None)
        for step in range(1, STEPS + 1):
            _train(net, opt, sched, step, accumulate)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()


def _load_checkpoint(engine, directory: str, net, opt, sched) -> dict:
    """Load ``ck.ckpt`` into the live objects; its state."""
    st = engine.load(f"{directory}/ck.ckpt")
    net.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    return st


def _resume(directory: str, model: bool = True):
    net, opt, sched = _make()
    with CheckpointEngine() as engine:
        st = _load_checkpoint(engine, directory, net, opt, sched)
        n = engine.replay(directory, opt, sched, model=net if model else None)
    return n, _state(net, opt, sched)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_replay_sets_the_logged_running_statistics(tmp_path, accumulate):
    directory = str(tmp_path / "run")
    _logged(directory, accumulate=accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out: no warning
        n, got = _resume(directory)
    assert n == STEPS - CKPT_AT
    want = _reference(STEPS, accumulate)
    assert int(got["model"]["bn.num_batches_tracked"]) == STEPS * accumulate
    assert_bit_equal(got, want)


def test_replay_without_the_model_says_what_it_left_out(tmp_path):
    directory = str(tmp_path / "run")
    _logged(directory)
    with pytest.warns(RuntimeWarning, match="holds the running statistics .* pass model= to replay"):
        n, got = _resume(directory, model=False)
    assert n == STEPS - CKPT_AT
    assert int(got["model"]["bn.num_batches_tracked"]) == CKPT_AT  # the checkpoint's, as warned


def test_a_log_without_the_model_warns_on_replay(tmp_path):
    directory = str(tmp_path / "run")
    _logged(directory, model=False)
    with pytest.warns(RuntimeWarning, match=r"replayed 9 logged step\(s\) after .*ck.ckpt, the last of them without logged "
                                            r"running statistics .* 3 buffer\(s\) \(bn.running_mean, bn.running_var, "
                                            r"bn.num_batches_tracked\)"):
        n, got = _resume(directory)
    assert n == STEPS - CKPT_AT and int(got["model"]["bn.num_batches_tracked"]) == CKPT_AT
    # parameters and optimizer state are exact all the same
    want = _reference(STEPS)
    assert_bit_equal({k: v for k, v in got["model"].items() if not k.startswith("bn.")},
                     {k: v for k, v in want["model"].items() if not k.startswith("bn.")})
    assert_bit_equal(got["opt"], want["opt"])


def test_a_log_continued_with_the_model_replays_without_a_warning(tmp_path):
    """A chain whose first run was logged without the model (an older checkrun, say) and whose second
    run has it: the last replayed step sets every running statistic, so nothing is left to warn about
    (it warned because some replayed steps had none)."""
    directory = str(tmp_path / "run")
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        slog = engine.step_log(directory, opt, sched)
        for step in range(1, 9):
            _train(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    # resume at step 8 from the log without statistics, then log on with the model
    net, opt, sched = _make()
    with CheckpointEngine({"step_log": {"flush_every_steps": 3}}) as engine:
        st = _load_checkpoint(engine, directory, net, opt, sched)
        with pytest.warns(RuntimeWarning, match="without logged running statistics"):
            assert engine.replay(directory, opt, sched, model=net) == 8 - CKPT_AT
        slog = engine.step_log(directory, opt, sched, model=net)  # continues the replayed chain
        for step in range(9, STEPS + 1):
            _train(net, opt, sched, step)
        slog.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the last replayed step (13) set every statistic
        n, got = _resume(directory)
    assert n == STEPS - CKPT_AT
    assert int(got["model"]["bn.num_batches_tracked"]) == CKPT_AT + (STEPS - 8)  # steps 5-8 were not in it


def test_a_mismatching_model_is_refused_before_the_step_changes_anything(tmp_path):
    """The model's buffers were checked after ``optimizer.step()`` had run: a refused replay had already
    moved the parameters, and the retry the error suggests applied that step twice."""
    directory = str(tmp_path / "run")
    _logged(directory)
    net, opt, sched = _make()
    with CheckpointEngine() as engine:
        st = _load_checkpoint(engine, directory, net, opt, sched)
        wrapped = torch.nn.ModuleDict({"net": net})  # other names than the logged ones
        with pytest.raises(StepLogError, match="'bn.running_mean'.*has no such buffer"):
            engine.replay(directory, opt, sched, model=wrapped)
    assert_bit_equal(_state(net, opt, sched)["model"], st["model"])  # nothing moved


def test_forward_state_names_and_warning():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                torch.nn.BatchNorm1d(4, track_running_stats=False), torch.nn.LayerNorm(4))
    assert forward_state(model) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert forward_state(torch.nn.Linear(2, 2)) == [] and forward_state(None) == []
    with pytest.warns(RuntimeWarning, match=r"replayed 3 logged step\(s\) after ck.ckpt, the last of them"):
        warn_forward_state(model, 3, "ck.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_forward_state(model, 0, "ck.ckpt")
        warn_forward_state(model, 4, "ck.ckpt", restored=True)
        warn_forward_state(torch.nn.Linear(2, 2), 5, "ck.ckpt")


def test_a_model_without_the_logged_buffer_is_refused_by_name(tmp_path):
    directory = str(tmp_path / "run")
    _logged(directory)
    net, opt, sched = _make()
    net.bn = torch.nn.BatchNorm1d(16, dtype=torch.float64)  # same names, another dtype
    with CheckpointEngine() as engine:
        with pytest.raises(StepLogError, match="logged running statistics 'bn.running_mean' .* holds float64"):
            engine.replay(directory, opt, sched, after=f"{directory}/ck.ckpt", model=net)


def _segment(directory: str) -> Path:
    """The log's last segment (after the checkpoint: replay reads it)."""
    segdir = Path(directory, ".checkrun", "steplog")
    return sorted(p for p in segdir.iterdir() if SEG_RE.fullmatch(p.name))[-1]


@pytest.mark.parametrize("forge", ["name", "index", "old_version", "kind", "twice"])
def test_hostile_buffer_entries_are_refused(tmp_path, forge):
    directory = str(tmp_path / "run")
    _logged(directory)
    seg = _segment(directory)
    header, payload = split_segment(seg.read_bytes(), str(seg))
    assert header["format_version"] >= 5 and header["buffers"][0] == "bn.running_mean"
    step = next(ev for ev in header["events"] if ev["kind"] == "step")
    if forge == "name":
        header["buffers"][0] = ""
    elif forge == "index":
        step["bufs"][0]["p"] = len(header["buffers"])
    elif forge == "old_version":
        header["format_version"] = 4
    elif forge == "twice":  # the first buffer twice, the second not at all
        step["bufs"][1] = {**step["bufs"][0]}
    else:
        step["bufs"][0]["k"] = "rows"
    body = {k: v for k, v in header.items() if k not in ("_checkrun", "format_version", "payload_bytes", "payload_csum")}
    data = pack_segment(body, [bytes(payload)])
    if forge == "old_version":  # pack_segment writes the version; forge it after, checksums made to hold
        data = _reversion(data, 4)
    seg.write_bytes(data)
    net, opt, sched = _make()
    with CheckpointEngine() as engine:
        with pytest.raises(StepLogFormatError, match=str(seg.name)):
            engine.replay(directory, opt, sched, after=f"{directory}/ck.ckpt", model=net)


def _reversion(data: bytes, version: int) -> bytes:
    import xxhash

    hlen = struct.unpack_from("<8sI", data, 0)[1]
    header = json.loads(data[12:12 + hlen])
    header["format_version"] = version
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return b"".join([struct.pack("<8sI", data[:8], len(text)), text, struct.pack("<Q", xxhash.xxh3_64_intdigest(text)),
                     data[12 + hlen + 8:]])


def test_export_step_and_verify_include_the_running_statistics(tmp_path, capsys):
    directory = str(tmp_path / "run")
    _logged(directory)
    out = tmp_path / "s11.pt"
    assert main(["export", directory, str(out), "--step", "11"]) == 0
    got = torch.load(out, weights_only=True)
    assert_bit_equal(got["model"], _reference(11)["model"])
    assert main(["verify", directory]) == 0
    capsys.readouterr()
    seg = _segment(directory)
    assert main(["inspect", str(seg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    step = next(r for r in doc["records"] if r["kind"] == "step")
    assert [b["name"] for b in step["buffers"]] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]


def test_export_of_a_log_without_statistics_says_so(tmp_path, caplog):
    directory = str(tmp_path / "run")
    _logged(directory, model=False)
    assert main(["export", directory, str(tmp_path / "s11.pt"), "--step", "11"]) == 0
    assert "holds no running statistics for step 11" in caplog.text


def test_a_replay_after_a_quantized_checkpoint_says_it_is_not_exact(tmp_path):
    """A checkpoint saved with a lossy quantization rule loads with quantized values; the replayed
    steps start from those, so the bit-exact promise does not hold: replay says so (the docs did not)."""
    directory = str(tmp_path / "run")
    net, opt, sched = _make()
    cfg = {"step_log": {"flush_every_steps": 3},
           "quantization": [{"pattern": "model.inp.weight", "bits": 8, "min_numel": 1}]}
    with CheckpointEngine(cfg) as engine:
        slog = engine.step_log(directory, opt, sched, model=net)
        for step in range(1, STEPS + 1):
            _train(net, opt, sched, step)
            if step == CKPT_AT:
                engine.save(_state(net, opt, sched), f"{directory}/ck.ckpt").result()
        slog.close()
    with pytest.warns(RuntimeWarning, match=r"stores 1 tensor\(s\) quantized \(lossy\).*not the uninterrupted run's"):
        n, _ = _resume(directory)
    assert n == STEPS - CKPT_AT
