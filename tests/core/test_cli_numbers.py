"""Numbers that agree (issue 21): one vocabulary and one unit system for the main job, ``SaveInfo``,
``CheckpointMetrics`` and ``checkrun ls/inspect``; ``inspect`` fits 120 columns; a closed pipe ends
the CLI quietly; ``--version`` and ``--help`` answer without importing torch.

*written by this save* = ``SaveInfo.written_bytes`` = ``ls`` WROTE; *referenced by this checkpoint* =
``SaveInfo.stored_bytes`` (alias ``referenced_bytes``) = ``ls`` REFERENCED; *stored in the
directory*: the ``ls`` totals. Sizes are binary (KiB, MiB) everywhere (``ckpt_core.units``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ckpt_core import CheckpointEngine
from ckpt_core.cli import main

ROOT = Path(__file__).resolve().parents[2]
CHECKRUN = Path(sys.executable).with_name("checkrun")
MODEL_CHECKPOINT_KEY = ("ModelCheckpoint{'monitor': 'val/loss_epoch', 'mode': 'min', 'every_n_train_steps': 0, "
                        "'every_n_epochs': 1, 'train_time_interval': None}")
LONG_KEY = "model.transformer_encoder.layers.11.self_attention_block.multi_head_attention.in_projection.weight"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*map(str, argv), "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def ls_text_rows(out: str) -> dict[str, dict[str, str]]:
    """``checkrun ls`` text output: {NAME: {HEADER: cell}} (cells are split on 2+ spaces)."""
    lines = out.splitlines()
    headers = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(headers, cells))
    return rows


def load_main_job():
    """examples/lightning_train.py as a module (its summary functions, without running it)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location("lightning_train_example",
                                                      ROOT / "examples" / "lightning_train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


def _saves(root: Path) -> dict[str, object]:
    """Three saves, the SaveInfo of each: a full one, a row delta, and ``last.ckpt`` written twice."""
    torch.manual_seed(0)
    emb, lin = torch.randn(4096, 16), torch.nn.Linear(16, 16)
    infos = {}
    with CheckpointEngine({"saving": {"asynchronous": False}, "incremental": {"row_delta_min_rows": 1024}}) as eng:
        for step in (1, 2):
            emb[[step, 7 * step, 100 + step]] += 1.0
            state = {"model": {"emb.weight": emb, "lin": lin.state_dict()}, "step": step,
                     "hyper": {"lr": 0.01, "name": "tiny"}}
            infos[f"step={step}.ckpt"] = eng.save(state, str(root / f"step={step}.ckpt")).result()
            infos["last.ckpt"] = eng.save(state, str(root / "last.ckpt")).result()
    return infos


# ----------------------------------------------------------------------------- units and vocabulary


def test_one_unit_system() -> None:
    from ckpt_core import units
    from ckpt_core.cli.util import human_size

    assert human_size is units.fmt_bytes
    assert [units.fmt_bytes(n) for n in (0, 1023, 1536, 5 * 1024 ** 2, 3 * 1024 ** 3, None)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB", "-"]
    assert units.fmt_ratio(units.ratio(20, 3)) == "6.67x" and units.fmt_ratio(units.ratio(1, 0)) == "-"
    assert units.fmt_percent(1, 8) == "12.5%"


def test_saveinfo_ls_main_job_and_metrics_agree(capsys, tmp_path) -> None:
    """The WROTE column of ``checkrun ls`` is ``SaveInfo.written_bytes`` of the save that made each
    checkpoint, REFERENCED is ``stored_bytes``; the main job's lines and the metrics say the same."""
    root = tmp_path / "run"
    infos = _saves(root)
    code, data = run_json(capsys, "ls", root)
    assert code == 0
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert set(rows) == set(infos)
    for name, info in infos.items():
        r = rows[name]
        assert r["written_bytes"] == info.written_bytes, name
        assert r["referenced_bytes"] == r["stored_bytes"] == info.stored_bytes == info.referenced_bytes, name
        assert r["tensor_bytes"] == info.tensor_bytes, name
        assert r["unique_bytes"] == r["new_bytes"]
    # the delta saves wrote far less than they reference: WROTE is not UNIQUE ("NEW") nor REFERENCED
    assert rows["step=2.ckpt"]["written_bytes"] < rows["step=2.ckpt"]["referenced_bytes"] // 10
    assert rows["last.ckpt"]["written_bytes"] < rows["step=2.ckpt"]["written_bytes"]

    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "NEW" not in out.splitlines()[0] and " MB" not in out
    text = ls_text_rows(out)
    job = load_main_job()
    capsys.readouterr()
    job.report("saves:", SimpleNamespace(history=list(infos.values())))
    lines = capsys.readouterr().out.splitlines()[1:]
    for (name, info), line in zip(infos.items(), lines):
        row = text[name]
        assert row["WROTE"] == job.fmt_bytes(info.written_bytes)
        assert row["REFERENCED"] == job.fmt_bytes(info.stored_bytes)
        assert row["TENSORS"] == job.fmt_bytes(info.tensor_bytes)
        # the main job prints SaveInfo.summary(): the same three figures, in the same words
        assert line.endswith(info.summary()) and name in line
        assert f"wrote {row['WROTE']} " in line and f"of {row['TENSORS']} of tensors" in line
        assert f"references {row['REFERENCED']}," in line and " MB" not in line

    from lightning_ckpt import CheckpointMetrics

    metrics = CheckpointMetrics().metrics(infos["step=2.ckpt"])
    assert metrics["checkrun/written_bytes"] == rows["step=2.ckpt"]["written_bytes"]
    assert metrics["checkrun/referenced_bytes"] == rows["step=2.ckpt"]["referenced_bytes"]
    assert metrics["checkrun/tensor_bytes"] == rows["step=2.ckpt"]["tensor_bytes"]


def test_ls_totals_use_the_vocabulary(capsys, tmp_path) -> None:
    root = tmp_path / "run"
    _saves(root)
    code, data = run_json(capsys, "ls", root)
    t = data["totals"]
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    assert f"tensor bytes  {job_fmt(t['logical_bytes'])}" in out
    assert f"stored        {job_fmt(t['used_bytes'])} in the directory ({t['dedup_ratio']:.2f}x less than the tensor " \
           "bytes)" in out
    from ckpt_core.units import fmt_less

    assert (fmt_less(100, 50), fmt_less(100, 200), fmt_less(100, 0)) == ("2.00x less", "2.00x more", "-")
    assert "smaller" not in out and "logical size" not in out
    code, inspect, _ = run(capsys, "inspect", root / "step=2.ckpt")
    code, meta = run_json(capsys, "inspect", root / "step=2.ckpt")
    row = {r["name"]: r for r in data["checkpoints"]}["step=2.ckpt"]
    assert meta["written_bytes"] == row["written_bytes"] and meta["referenced_bytes"] == row["referenced_bytes"]
    assert f"referenced  {job_fmt(row['referenced_bytes'])} of blobs" in inspect
    assert f"its save wrote {job_fmt(row['written_bytes'])}" in inspect


def job_fmt(n: int) -> str:
    from ckpt_core.units import fmt_bytes

    return fmt_bytes(n)


def test_main_job_totals_and_where_its_checkpoints_are() -> None:
    job = load_main_job()
    line = job.totals(8, 40 * 1024 ** 2, 5 * 1024 ** 2)
    assert line == "total: 8 saves wrote 5.0 MiB for 40.0 MiB of tensors (12.5%, 8.00x less than full saves)"
    assert job.totals(1, 1024, 2048).endswith("(200.0%, 2.00x more than full saves)")
    text = job.where("/tmp/my run", temporary=True)
    assert "checkpoints: /tmp/my run" in text and "checkrun ls '/tmp/my run'" in text and "rm -r" in text
    assert "rm -r" not in job.where("s3://bucket/run", temporary=False)


def test_main_job_and_ls_print_the_same_figures(capsys, monkeypatch, tmp_path) -> None:
    """The main job itself (examples/lightning_train.py, a short run): what it prints for the last save
    of each checkpoint ``checkrun ls`` lists is that row's WROTE / TENSORS / REFERENCED, and it ends
    with where the checkpoints are and the command that lists them."""
    import runpy

    directory = str(tmp_path / "ckpts")
    monkeypatch.setattr(sys, "argv", ["lightning_train.py", "--dir", directory, "--steps", "6", "--every", "3"])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    capsys.readouterr()
    runpy.run_path(str(ROOT / "examples" / "lightning_train.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"checkpoints: {directory}\nlook at them: checkrun ls {directory}"
                                 f"   (one: checkrun inspect {directory}/last.ckpt)")
    assert " MB" not in out and "x less than full saves" in out
    printed = {}  # checkpoint name -> the line of its last save
    for line in out.splitlines():
        m = re.match(r"\s+(\S+\.ckpt): (wrote .*)$", line)
        if m:
            printed[m[1]] = m[2]
    code, text, _ = run(capsys, "ls", directory)
    rows = ls_text_rows(text)
    assert code == 0 and "last.ckpt" in rows and set(rows) <= set(printed)
    for name, row in rows.items():
        line = printed[name]
        assert line.startswith(f"wrote {row['WROTE']} (") and f"of {row['TENSORS']} of tensors" in line
        assert f"references {row['REFERENCED']}," in line


# ----------------------------------------------------------------------------- inspect width


def _lightning_like(path: Path, quantize: bool) -> None:
    """A checkpoint shaped like Lightning's: long state_dict keys, a ModelCheckpoint callback state keyed
    by its settings with best_k_models keyed by long paths, loops, optimizer states, hyper-parameters."""
    torch.manual_seed(0)
    best = {f"/very/long/path/to/the/experiment/checkpoints/epoch={e}-step={100 * e}-val_loss=0.1234.ckpt":
            torch.tensor(0.5 + e) for e in range(2)}
    sd = OrderedDict([(LONG_KEY, torch.randn(64, 32)), ("model.embedding.weight", torch.randn(4096, 16)),
                      ("model.head.bias", torch.randn(8))])
    state = {
        "epoch": 1, "global_step": 200, "pytorch-lightning_version": "2.6.6", "state_dict": sd,
        "loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"ready": 200, "completed": 200}}}},
        "callbacks": {MODEL_CHECKPOINT_KEY: {"monitor": "val/loss_epoch", "best_model_score": torch.tensor(0.5),
                                             "best_k_models": best, "dirpath": "/very/long/path/to/the/experiment"}},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(64, 32)}},
                              "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1, 2]}]}],
        "hyper_parameters": {"description": "x" * 300, "layers": list(range(40))},
    }
    rules = [{"pattern": "state_dict.model.embedding.weight", "method": "uniform", "bits": 8}] if quantize else []
    with CheckpointEngine({"saving": {"asynchronous": False}, "quantization": rules}) as eng:
        eng.save(state, str(path)).result()


@pytest.mark.parametrize("quantize", [False, True])
def test_inspect_fits_120_columns(capsys, tmp_path, monkeypatch, quantize) -> None:
    monkeypatch.chdir(tmp_path)
    _lightning_like(tmp_path / "lightning" / "last.ckpt", quantize)
    code, out, _ = run(capsys, "inspect", "lightning/last.ckpt")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 120, "\n".join(line for line in lines if len(line) > 120)
    assert "\u2026" in out and LONG_KEY not in out and MODEL_CHECKPOINT_KEY not in out
    assert ("QUANT ERROR" in lines[lines.index("") + 1]) == quantize  # the column only when something is
    # the shortened key keeps both ends
    assert any(re.match(r"\s+model\.t[\w.]*\u2026[\w.]*\.weight\s", line) for line in lines)

    code, wide, _ = run(capsys, "inspect", "lightning/last.ckpt", "--wide")
    assert code == 0 and LONG_KEY in wide and MODEL_CHECKPOINT_KEY in wide
    assert max(len(line) for line in wide.splitlines()) > 120

    code, data = run_json(capsys, "inspect", "lightning/last.ckpt")
    paths = {n["path"] for n in data["tree"]}
    assert f"state_dict.{LONG_KEY}" in paths and f"callbacks.{MODEL_CHECKPOINT_KEY}" in paths
    assert data["values"]["hyper_parameters.description"] == "x" * 300


# ----------------------------------------------------------------------------- broken pipe, no torch


def _shell(command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{CHECKRUN.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, env=env)


def test_json_into_head_ends_quietly(tmp_path) -> None:
    """``checkrun inspect --json X | head -1`` through a real pipe: no traceback, no error line, and
    an exit status of 0 or 141 (128 + SIGPIPE). The JSON is large, so the pipe does break."""
    state = {"values": {f"hyper_parameter_number_{i}": i for i in range(4000)}, "w": torch.randn(8)}
    ckpt = tmp_path / "big.ckpt"
    with CheckpointEngine({"saving": {"asynchronous": False}}) as eng:
        eng.save(state, str(ckpt)).result()
    for cmd in (f"checkrun inspect --json {ckpt}", f"checkrun inspect {ckpt}", f"checkrun ls --json {tmp_path}"):
        res = _shell(f"{cmd} 2>{tmp_path}/err | (sleep 0.5; head -1); echo \"rc=${{PIPESTATUS[0]}}\"")
        err = (tmp_path / "err").read_text()
        assert res.stdout.splitlines()[0] in ("{", f"checkpoint  {ckpt}"), (cmd, res.stdout)
        assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, (cmd, err)
        assert res.stdout.strip().splitlines()[-1] in ("rc=0", "rc=141"), (cmd, res.stdout)
    # the output was big enough to break the pipe at least for the JSON tree
    res = _shell(f"checkrun inspect --json {ckpt} 2>/dev/null | head -c 1 >/dev/null; echo \"rc=${{PIPESTATUS[0]}}\"")
    assert res.stdout.strip() == "rc=141"


_NO_TORCH = """
import json, sys
from ckpt_core.cli import main
codes = [main(argv) for argv in (["--version"], ["--help"], ["ls", "--help"], ["inspect", "--help"])]
print(json.dumps({"codes": codes, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
"""


def test_version_and_help_do_not_import_torch() -> None:
    res = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"codes": [0, 0, 0, 0], "torch": []}
    assert "checkrun 0.1.0" in res.stdout and "--wide" in res.stdout
    # the console script itself, with the interpreter's import log
    for arg in ("--version", "--help"):
        res = subprocess.run([str(CHECKRUN), arg], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
        assert res.returncode == 0 and res.stdout
        imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
        assert "ckpt_core.cli" in imported and "torch" not in imported, arg


def test_package_names_stay_importable() -> None:
    code = ("import ckpt_core, sys\n"
            "from ckpt_core import *\n"
            "from ckpt_core import CheckpointEngine, SaveInfo, EngineConfig\n"
            "missing = [n for n in ckpt_core.__all__ if n not in globals()]\n"
            "assert not missing, missing\n"
            "assert ckpt_core.format.manifest.Manifest and ckpt_core.CheckpointEngine is CheckpointEngine\n"
            "assert set(ckpt_core.__all__) <= set(dir(ckpt_core))\n"
            "try:\n    ckpt_core.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ls_holds_one_checkpoints_manifests_at_a_time(tmp_path, capsys, monkeypatch):
    """``checkrun ls`` parsed every manifest of the directory and held them all until it printed (400
    checkpoints of 300 tensors: 401 MB peak, 243 MB now, as verify and gc); now each checkpoint's are
    measured and dropped, with the same figures."""
    import gc
    import weakref

    from ckpt_core.format import manifest as manifest_module

    with CheckpointEngine({"storage": {"fsync": False}}) as engine:
        state = {f"t{i}": torch.full((8,), float(i)) for i in range(20)}
        for k in range(12):
            state["t0"] += 1
            engine.save(state, tmp_path / f"c{k:02d}.ckpt")
        engine.wait()
    live: list = []  # weak references (a Manifest is not hashable)
    most = [0]
    parse = manifest_module._manifest_from_json

    def counted(*args, **kwargs):
        m = parse(*args, **kwargs)
        gc.collect()
        live.append(weakref.ref(m))
        most[0] = max(most[0], sum(r() is not None for r in live))
        return m

    monkeypatch.setattr(manifest_module, "_manifest_from_json", counted)
    assert main(["ls", "--json", "--no-progress", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert len(rows) == 12 and all(r["status"] == "committed" and r["new_blobs"] >= 1 for r in rows)
    assert most[0] <= 2, most[0]
    assert list(rows[0]) == [  # the order the keys always had (the first rewrite moved some: found by a check)
        "name", "url", "manifest_bytes", "mtime", "created", "created_iso", "status", "step", "epoch", "global_step",
        "tensors", "tensor_bytes", "written_bytes", "referenced_bytes", "unique_bytes", "stored_bytes", "new_bytes",
        "new_blobs", "blobs", "chain_depth", "quantized"]
