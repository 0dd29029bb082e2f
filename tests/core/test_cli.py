"""The ``checkrun`` command line on real engine-produced directories: local disk and S3 (moto).

Commands run in-process through ``main(argv)`` (exit code returned, output captured) and, for the
console script itself, as real subprocesses. Corruption is real: a flipped byte in a blob file and
a truncated manifest file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import torch
from fsspec.core import url_to_fs

from ckpt_core import CheckpointEngine
from ckpt_core.cli import util as cli_util
from ckpt_core.cli import main
from ckpt_core.cli.util import CliError, parse_storage_options

CHANGED_ROWS = [3, 17, 100]
QUANT = {"quantization": [{"pattern": "model.emb.weight", "method": "uniform", "bits": 8}]}


class Tiny(pl.LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(3, hidden)


def _state(step: int, emb: torch.Tensor, lin: torch.nn.Linear) -> dict:
    return {"model": {"emb.weight": emb, "lin": lin.state_dict()},
            "hyper": {"lr": 0.01, "betas": (0.9, 0.999), "name": "tiny", 3: float("inf")},
            "step": step, "epoch": 0}


def make_run(root: str, opts: dict) -> dict:
    """step=1 (full), step=2 (row delta on 3 rows of the embedding), quant.ckpt (8-bit embedding)."""
    torch.manual_seed(0)
    emb, lin = torch.randn(2048, 8), torch.nn.Linear(8, 4)
    with CheckpointEngine({"saving": {"asynchronous": False}}) as eng:
        eng.save(_state(1, emb, lin), f"{root}/step=1.ckpt", storage_options=opts).result()
        emb[CHANGED_ROWS] += 1.0
        eng.save(_state(2, emb, lin), f"{root}/step=2.ckpt", storage_options=opts).result()
    with CheckpointEngine(QUANT) as eng:
        eng.save(_state(3, emb, lin), f"{root}/quant.ckpt", storage_options=opts).result()
    return {"emb": emb.clone(), "lin": {k: v.clone() for k, v in lin.state_dict().items()}}


def cli_opts(opts: dict) -> list[str]:
    """Storage options as command line flags (the S3 ones through --endpoint-url and -o)."""
    out = []
    for key, value in opts.items():
        if key == "client_kwargs":
            out += ["--endpoint-url", value["endpoint_url"]]
        else:
            out += ["-o", f"{key}={value}"]
    return out


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def unique_blob(root: str, opts: dict, name: str, other: str) -> str:
    """Path (fsspec) of a blob referenced by ``name`` but not by ``other``."""
    with CheckpointEngine() as eng:
        mine = eng.read_manifest(f"{root}/{name}", storage_options=opts).blob_keys()
        theirs = eng.read_manifest(f"{root}/{other}", storage_options=opts).blob_keys()
    key = sorted(mine - theirs)[0]
    fs, base = url_to_fs(root, **opts)
    return f"{base}/.checkrun/blobs/{key[:2]}/{key[2:]}"


def corrupt(root: str, opts: dict) -> str:
    """Flip a byte of a blob only step=2.ckpt uses; add broken.ckpt, a truncated manifest copy."""
    fs, base = url_to_fs(root, **opts)
    blob = unique_blob(root, opts, "step=2.ckpt", "step=1.ckpt")
    data = bytearray(fs.cat_file(blob))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(blob, bytes(data))
    manifest = fs.cat_file(f"{base}/step=1.ckpt")
    fs.pipe_file(f"{base}/broken.ckpt", manifest[: len(manifest) // 2])
    fs.invalidate_cache()
    return blob.rsplit("/", 2)[-2] + "/" + blob.rsplit("/", 1)[-1]


@pytest.fixture
def local_run(tmp_path) -> tuple[str, dict]:
    root = str(tmp_path / "run")
    return root, make_run(root, {})


@pytest.fixture
def s3_run(s3_root, s3_storage_options) -> tuple[str, dict, list[str]]:
    return s3_root, make_run(s3_root, s3_storage_options), cli_opts(s3_storage_options)


# ----------------------------------------------------------------------------- options


def test_storage_options_parsing():
    opts = parse_storage_options(["anon=false", "client_kwargs.region_name=eu-west-1", "config_kwargs="
                                  '{"retries": {"max_attempts": 2}}', "key=abc"], "http://127.0.0.1:9")
    assert opts == {"anon": False, "key": "abc", "config_kwargs": {"retries": {"max_attempts": 2}},
                    "client_kwargs": {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(CliError) as err:
        parse_storage_options(["a=1", "a.b=2"], None)
    assert err.value.code == 2


def test_usage_errors_exit_2(capsys, local_run, tmp_path):
    root, _ = local_run
    assert run(capsys, "ls", root, "-o", "noequals")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys, "gc", root, "--grace", "soon")[0] == 2
    code, _, err = run(capsys, "ls", f"{root}/step=1.ckpt")
    assert code == 2 and "is a file" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("retention: {keep_lastt: 2}\n")
    code, _, err = run(capsys, "ls", root, "--config", str(bad))
    assert code == 2 and "keep_lastt" in err and err.count("\n") == 1
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope.ckpt"))
    assert code == 1 and err.startswith("checkrun: error:") and "nope.ckpt" in err
    code, _, err = run(capsys, "ls", str(tmp_path / "nodir"))
    assert code == 1 and "no such directory" in err
    assert run(capsys, "--version")[0] == 0


# ----------------------------------------------------------------------------- ls / inspect


def test_ls_local(capsys, local_run):
    root, _ = local_run
    code, data = run_json(capsys, "ls", root)
    assert code == 0
    rows = {r["name"]: r for r in data["checkpoints"]}
    assert list(rows) == ["step=1.ckpt", "step=2.ckpt", "quant.ckpt"]
    s1, s2, q = rows["step=1.ckpt"], rows["step=2.ckpt"], rows["quant.ckpt"]
    assert (s1["step"], s2["step"], s1["epoch"]) == (1, 2, 0)
    assert s1["status"] == s2["status"] == q["status"] == "committed"
    assert s1["tensor_bytes"] == s2["tensor_bytes"] == (2048 * 8 + 4 * 8 + 4) * 4
    assert s2["chain_depth"] == 1 and s1["chain_depth"] == 0
    assert q["quantized"] and not s1["quantized"]
    # step=2 references step=1's base plus its own delta (3 rows + indices): step=1 owns nothing alone
    assert s1["new_bytes"] == 0 and 0 < s2["new_bytes"] < 1024 and q["new_bytes"] > 2048 * 8
    t = data["totals"]
    assert t["logical_bytes"] == s1["tensor_bytes"] * 3
    assert t["used_bytes"] == t["blob_bytes"] + t["manifest_bytes"] + t["unreferenced_bytes"]
    assert t["used_bytes"] < t["logical_bytes"] and t["unreferenced_bytes"] == 0
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "step=2.ckpt" in out and "quantized" in out and "tensor bytes" in out
    assert "KiB" in out and "WROTE" in out.splitlines()[0]
    assert s2["written_bytes"] < s2["referenced_bytes"] == s2["stored_bytes"]


def test_inspect_reads_no_blobs(capsys, local_run):
    root, _ = local_run
    shutil.rmtree(Path(root) / ".checkrun")  # inspect must not need any tensor data
    code, data = run_json(capsys, "inspect", f"{root}/quant.ckpt")
    assert code == 0
    tensors = {n["path"]: n for n in data["tree"] if n["kind"] == "tensor"}
    emb = tensors["model.emb.weight"]
    assert emb["shape"] == [2048, 8] and emb["dtype"] == "float32" and emb["quant"]["bits"] == 8
    assert emb["quant"]["max_abs_error"] > 0 and emb["ratio"] > 2 and emb["codecs"]
    assert tensors["model.lin.bias"]["lossless"]
    assert data["values"]["hyper.lr"] == 0.01 and data["values"]["hyper.betas.1"] == 0.999
    assert data["values"]["hyper.3"] == "inf" and data["values"]["step"] == 3
    code, out, _ = run(capsys, "inspect", f"{root}/step=2.ckpt")
    assert code == 0
    for text in ("model", "emb.weight", "float32 [2048x8]", "'betas': (0.9, 0.999)", "'tiny'", "3: inf",
                 "step", "= 2"):
        assert text in out, text


# ----------------------------------------------------------------------------- verify


def test_verify_local_intact_then_corrupt(capsys, local_run):
    root, _ = local_run
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and out.count("OK ") == 3
    assert run(capsys, "verify", f"{root}/step=1.ckpt")[0] == 0
    blob = corrupt(root, {})
    code, out, _ = run(capsys, "verify", f"{root}/step=2.ckpt")
    assert code == 1 and "CORRUPT" in out and blob in out and "checksum" in out
    code, data = run_json(capsys, "verify", root)
    assert code == 1 and not data["ok"]
    res = {Path(r["path"]).name: r for r in data["checkpoints"]}
    assert res["step=1.ckpt"]["ok"] and res["quant.ckpt"]["ok"]
    assert not res["step=2.ckpt"]["ok"] and blob in res["step=2.ckpt"]["problems"][0]
    assert not res["broken.ckpt"]["ok"] and "broken.ckpt" in res["broken.ckpt"]["problems"][0]
    code, data = run_json(capsys, "ls", root)
    assert code == 1 and {r["name"]: r["status"] for r in data["checkpoints"]}["broken.ckpt"] == "corrupt"
    code, data = run_json(capsys, "ls", root, "--verify")
    status = {r["name"]: r["status"] for r in data["checkpoints"]}
    assert status == {"step=1.ckpt": "committed", "step=2.ckpt": "corrupt", "quant.ckpt": "committed",
                      "broken.ckpt": "corrupt"}
    code, _, err = run(capsys, "export", f"{root}/step=2.ckpt", f"{root}/../x.pt")
    assert code == 1 and blob in err and err.count("\n") == 1
    code, _, err = run(capsys, "inspect", f"{root}/broken.ckpt")
    assert code == 1 and "broken.ckpt" in err and "truncated" in err and err.count("\n") == 1


def test_verify_of_a_torch_save_file_says_foreign_not_corrupt(capsys, tmp_path):
    """A project that switched to checkrun keeps torch.save files beside: verify called one CORRUPT
    (found by an independent check)."""
    from safetensors.torch import save_file

    path = tmp_path / "epoch=2-step=15.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")  # accelerate's own (h160: was CORRUPT)
    (tmp_path / "text.ckpt").write_text("PK but no zip")
    for name, foreign in (("epoch=2-step=15.ckpt", True), ("model.safetensors", True), ("text.ckpt", False)):
        code = main(["verify", str(tmp_path / name)])
        out = capsys.readouterr().out
        assert code == 1 and ("FOREIGN" in out) == foreign and ("CORRUPT" in out) != foreign, out
        assert ("0 corrupt, 1 not a checkrun checkpoint" in out) == foreign, out


def test_ls_and_verify_show_links_and_report_one_that_points_at_nothing(capsys, local_run):
    """Lightning's save_last="link" makes last.ckpt a symbolic link: ls did not show it, and a link left
    pointing at a removed checkpoint (ckpt_path="last" then fails) passed verify unseen."""
    root, _ = local_run
    os.symlink("step=2.ckpt", f"{root}/last.ckpt")
    code, data = run_json(capsys, "ls", root)
    assert code == 0 and data["links"] == [{"name": "last.ckpt", "target": "step=2.ckpt", "ok": True}]
    assert "last.ckpt -> step=2.ckpt" in run(capsys, "ls", root)[1]
    assert run(capsys, "verify", root)[1].count("OK ") == 3  # the link's target is checked once
    os.symlink("gone.ckpt", f"{root}/last-v1.ckpt")
    code, out, _ = run(capsys, "ls", root)
    assert code == 1 and "last-v1.ckpt -> gone.ckpt  (dangling" in out and "1 dangling link(s)" in out
    code, data = run_json(capsys, "verify", root)
    bad = [r for r in data["checkpoints"] if not r["ok"]]
    assert code == 1 and [Path(r["path"]).name for r in bad] == ["last-v1.ckpt"]
    assert "symbolic link to gone.ckpt, which does not exist" in bad[0]["problems"][0]
    for cmd in ("verify", "inspect", "ls"):
        code, _, err = run(capsys, cmd, f"{root}/last-v1.ckpt")
        assert code == 1 and "last-v1.ckpt: a symbolic link to gone.ckpt, which does not exist" in err
    # a user's link out of the directory (a dataset not mounted here) is not a checkpoint link (h132: verify
    # said CORRUPT and ls exited 1)
    os.remove(f"{root}/last-v1.ckpt")
    os.symlink("/nonexistent-mount/dataset/train.csv", f"{root}/train.csv")
    assert run(capsys, "verify", root)[0] == 0 and run(capsys, "ls", root)[0] == 0


def test_verify_of_a_directory_checks_each_shared_blob_and_tensor_once(capsys, tmp_path, monkeypatch):
    """Incremental checkpoints share most blobs: ``verify DIR`` read each shared blob once per
    checkpoint (an independent check: 40,000 blob reads for 399 distinct blobs) and decoded each
    shared tensor again. Intact ones are now checked once per command; a damaged shared blob is
    still reported for every checkpoint that needs it."""
    from ckpt_core.loading import decode, reader

    state = {f"t{i}": torch.randn(100_000) for i in range(6)}  # a blob each (not packed)
    with CheckpointEngine() as engine:
        for step in range(5):
            state[f"t{step}"] += 1
            engine.save({"model": state, "step": step}, tmp_path / f"step={step}.ckpt").result()
        distinct = {b.key for step in range(5) for b in engine.read_manifest(tmp_path / f"step={step}.ckpt").blobs()}
    fetched, decoded = [], []
    real_fetch, real_decode = reader.fetch_blob, decode.Pass.add
    monkeypatch.setattr(reader, "fetch_blob", lambda store, ref, *a: fetched.append(ref.key) or real_fetch(store, ref, *a))
    monkeypatch.setattr(decode.Pass, "add", lambda self, loaded, *a: decoded.append(loaded.record.key)
                        or real_decode(self, loaded, *a))
    code, data = run_json(capsys, "verify", str(tmp_path))
    assert code == 0 and data["ok"] and len(data["checkpoints"]) == 5
    assert sorted(fetched) == sorted(distinct)  # once each (5 x 6 + 5 without the cache)
    assert len(decoded) == len(distinct) == 6 + 4  # each version of a tensor decoded once
    with CheckpointEngine() as engine:
        records = {r.key: r for r in engine.read_manifest(tmp_path / "step=4.ckpt").tensors}
    shared = records["model.t1"].base[0].blob  # t1 last changed at step 1: steps 1-4 need it
    (tmp_path / ".checkrun" / "blobs" / shared.key[:2] / shared.key[2:]).write_bytes(b"x" * shared.size)
    code, data = run_json(capsys, "verify", str(tmp_path), "--no-decode")
    bad = [Path(r["path"]).name for r in data["checkpoints"] if not r["ok"]]
    assert code == 1 and sorted(bad) == [f"step={s}.ckpt" for s in range(1, 5)]


def test_a_verify_cache_holds_what_each_store_has(tmp_path):
    """The same blob (key, size, checksum) in another store is another copy: found intact in one
    directory, it was skipped in another whose copy was gone (a check of this cache: a composite's
    parts store, a manifest linked from another directory), and verify said intact."""
    import ckpt_core

    state = {"w": torch.arange(1000.0)}
    with CheckpointEngine() as engine:
        engine.save(state, tmp_path / "a" / "x.ckpt").result()
        engine.save(state, tmp_path / "b" / "y.ckpt").result()
        shutil.rmtree(tmp_path / "b" / ".checkrun" / "blobs")
        os.symlink(tmp_path / "b" / "y.ckpt", tmp_path / "a" / "best.ckpt")
        cache = ckpt_core.VerifyCache()
        assert engine.verify(tmp_path / "a" / "x.ckpt", cache=cache).ok
        report = engine.verify(tmp_path / "a" / "best.ckpt", cache=cache)
    assert not report.ok and "missing blob" in report.problems[0], report.problems


def test_verify_decodes_a_checkpoint_larger_than_the_memory_limit_in_groups(tmp_path, monkeypatch):
    """``verify`` decoded every tensor of a checkpoint at once: one larger than the machine's memory
    (``load.max_total_bytes``) could not be verified. It decodes them in groups now."""
    from ckpt_core.errors import ResourceLimitError
    from ckpt_core.loading import reader

    monkeypatch.setattr(reader, "VERIFY_GROUP_BYTES", 64 << 10)
    config = {"load": {"max_total_bytes": 200 << 10}}
    with CheckpointEngine(config) as engine:
        engine.save({f"t{i}": torch.randn(8192) for i in range(10)}, tmp_path / "big.ckpt").result()  # 320 KiB
        with pytest.raises(ResourceLimitError, match="max_total_bytes"):
            engine.load(tmp_path / "big.ckpt")
        report = engine.verify(tmp_path / "big.ckpt")
    assert report.ok and report.problems == []


def test_a_tensor_larger_than_the_memory_limit_is_not_verified_rather_than_corrupt(capsys, tmp_path):
    """One tensor over ``load.max_total_bytes`` cannot be decoded in any group: verify said CORRUPT of an
    intact checkpoint (a script may delete it; found by an independent check). It says UNVERIFIED."""
    (tmp_path / "small.yaml").write_text("load:\n  max_total_bytes: 200000\n")
    with CheckpointEngine() as engine:
        engine.save({"big": torch.randn(100_000), "small": torch.ones(4)}, tmp_path / "c" / "a.ckpt").result()
    with CheckpointEngine({"load": {"max_total_bytes": 200_000}}) as engine:
        report = engine.verify(tmp_path / "c" / "a.ckpt")
    assert not report.ok and report.unverified and "not verified" in report.problems[0]
    code, out, _ = run(capsys, "verify", "--config", str(tmp_path / "small.yaml"), str(tmp_path / "c"))
    assert code == 1 and out.startswith("UNVERIFIED") and "0 corrupt, 1 not verified" in out
    (tmp_path / "c" / "a.ckpt").write_bytes(b"garbage")  # a real problem is still CORRUPT
    code, out, _ = run(capsys, "verify", "--config", str(tmp_path / "small.yaml"), str(tmp_path / "c" / "a.ckpt"))
    assert code == 1 and out.startswith("CORRUPT")


def test_progress_bar_only_on_a_tty(capsys, local_run, monkeypatch):
    root, _ = local_run
    assert "verifying" not in run(capsys, "verify", root)[2]
    monkeypatch.setattr(cli_util, "_isatty", lambda stream: True)
    assert "verifying" in run(capsys, "verify", root)[2]
    assert "verifying" not in run(capsys, "verify", root, "--no-progress")[2]


# ----------------------------------------------------------------------------- export / import


def test_export_lightning_ckpt(capsys, tmp_path):
    model = Tiny(hidden=5, lr=0.3)
    state = {"epoch": 2, "global_step": 40, "pytorch-lightning_version": lightning.__version__,
             "state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams),
             "loops": {}, "callbacks": {}, "optimizer_states": [], "lr_schedulers": []}
    with CheckpointEngine({"saving": {"asynchronous": False}}) as eng:
        eng.save(state, str(tmp_path / "run" / "epoch=2-step=40.ckpt")).result()
    out = tmp_path / "export" / "model.ckpt"
    code, out_text, _ = run(capsys, "export", str(tmp_path / "run"), str(out))  # a DIR means its latest
    assert code == 0 and "exported" in out_text
    plain = torch.load(out)  # torch's default weights_only=True
    assert plain["global_step"] == 40 and plain["hyper_parameters"] == {"hidden": 5, "lr": 0.3}
    restored = Tiny.load_from_checkpoint(out)
    assert restored.hparams.hidden == 5
    for k, v in model.state_dict().items():
        assert torch.equal(restored.state_dict()[k], v)
    assert run(capsys, "export", str(tmp_path / "run"), str(out))[0] == 2  # exists, no --force
    assert run(capsys, "export", str(tmp_path / "run"), str(out), "--force")[0] == 0


def test_export_safetensors_and_import_round_trip(capsys, local_run, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    root, ref = local_run
    st = tmp_path / "m.safetensors"
    code, data = run_json(capsys, "export", f"{root}/step=2.ckpt", str(st))
    assert code == 0 and data["tensors"] == 3
    tensors = load_file(st)
    assert set(tensors) == {"model.emb.weight", "model.lin.weight", "model.lin.bias"}
    assert torch.equal(tensors["model.emb.weight"], ref["emb"])
    with safe_open(st, "pt") as f:
        values = json.loads(f.metadata()["checkrun.values"])
    assert values["hyper.lr"] == 0.01 and values["step"] == 2
    code, _, _ = run(capsys, "import", str(st), f"{root}/imported.ckpt")
    assert code == 0
    with CheckpointEngine() as eng:
        back = eng.load(f"{root}/imported.ckpt")
        orig = eng.load(f"{root}/step=2.ckpt")
    assert back["hyper"] == orig["hyper"] and back["step"] == 2
    assert torch.equal(back["model"]["emb.weight"], orig["model"]["emb.weight"])
    assert torch.equal(back["model"]["lin"]["bias"], orig["model"]["lin"]["bias"])
    # torch file round trip, and weights_only safety for pickled values
    pt = tmp_path / "m.pt"
    assert run(capsys, "export", f"{root}/step=1.ckpt", str(pt))[0] == 0
    assert run(capsys, "import", str(pt), f"{root}/from_pt.ckpt")[0] == 0
    assert run(capsys, "diff", f"{root}/step=1.ckpt", f"{root}/from_pt.ckpt", "--exit-code")[0] == 0
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1)}, unsafe)
    code, _, err = run(capsys, "import", str(unsafe), f"{root}/u.ckpt")
    assert code == 1 and "--unsafe" in err and err.count("\n") == 1
    assert run(capsys, "import", str(unsafe), f"{root}/u.ckpt", "--unsafe")[0] == 0
    code, _, err = run(capsys, "import", f"{root}/step=1.ckpt", f"{root}/again.ckpt")
    assert code == 1 and "already a checkrun checkpoint" in err
    junk = tmp_path / "junk.pt"  # not a torch file: one line naming it (was "KeyError: 174812789")
    junk.write_bytes(b"junk\n")
    code, _, err = run(capsys, "import", str(junk), f"{root}/junk.ckpt")
    assert code == 1 and str(junk) in err and "not a PyTorch file" in err and err.count("\n") == 1
    code, data = run_json(capsys, "export", f"{root}/u.ckpt", str(tmp_path / "u.safetensors"), "--unsafe")
    assert code == 0 and data["dropped"] == ["args"] and set(load_file(tmp_path / "u.safetensors")) == {"w"}
    assert run(capsys, "export", f"{root}/u.ckpt", str(tmp_path / "u2.pt"))[0] == 1  # needs --unsafe
    foreign = tmp_path / "foreign.safetensors"
    save_file({"enc.layer.0.weight": torch.ones(2, 2), "head": torch.zeros(3)}, foreign)
    assert run(capsys, "import", str(foreign), f"{root}/foreign.ckpt")[0] == 0
    with CheckpointEngine() as eng:
        back = eng.load(f"{root}/foreign.ckpt")
    assert set(back) == {"enc.layer.0.weight", "head"} and torch.equal(back["head"], torch.zeros(3))


def test_exotic_state_round_trips(capsys, tmp_path):
    """Every dtype, tied tensors, parameters and non-JSON plain values survive export + import."""
    from collections import OrderedDict

    shared = torch.randn(3, 3)
    state = {"t": {"f16": torch.randn(5, 7).half(), "bf16": torch.randn(33).bfloat16(), "i64": torch.arange(10),
                   "bool": torch.tensor([True, False]), "c64": torch.randn(4, dtype=torch.complex64),
                   "zero_d": torch.tensor(3.5), "empty": torch.empty(0, 3),
                   "f8": torch.randn(4).to(torch.float8_e4m3fn)},
             "tied_a": shared, "tied_b": shared, "param": torch.nn.Parameter(torch.ones(3)),
             "plain": {1: "int key", (2, 3): [None, float("nan")], "b": b"\x00", "dtype": torch.float16},
             "od": OrderedDict(b=1, a=2), "step": 7}
    root = tmp_path / "run"
    with CheckpointEngine() as eng:
        eng.save(state, str(root / "a.ckpt")).result()
    for i, suffix in enumerate((".safetensors", ".pt")):
        out = str(tmp_path / f"a{suffix}")
        assert run(capsys, "export", str(root / "a.ckpt"), out)[0] == 0
        assert run(capsys, "import", out, str(root / f"b{i}.ckpt"))[0] == 0
        assert run(capsys, "diff", str(root / "a.ckpt"), str(root / f"b{i}.ckpt"), "--exit-code")[0] == 0
    with CheckpointEngine() as eng:
        back = eng.load(str(root / "b0.ckpt"))
    assert back["tied_a"] is back["tied_b"] and isinstance(back["param"], torch.nn.Parameter)
    assert list(back["od"]) == ["b", "a"] and back["plain"][1] == "int key"
    state["t"]["bf16"][5] += 1
    with CheckpointEngine() as eng:
        eng.save(state, str(root / "c.ckpt")).result()
    code, data = run_json(capsys, "diff", str(root / "a.ckpt"), str(root / "c.ckpt"))
    changed = [d for d in data["tensors"] if d["status"] == "changed"]
    assert [(d["key"], d["changed_rows"]) for d in changed] == [("t.bf16", 1)]


# ----------------------------------------------------------------------------- diff / gc


def test_diff(capsys, local_run):
    root, ref = local_run
    code, data = run_json(capsys, "diff", f"{root}/step=1.ckpt", f"{root}/step=2.ckpt")
    assert code == 0 and not data["identical"]
    t = {d["key"]: d for d in data["tensors"]}
    emb = t["model.emb.weight"]
    assert emb["status"] == "changed" and emb["changed_rows"] == len(CHANGED_ROWS) and emb["rows"] == 2048
    assert emb["changed_elements"] == 8 * len(CHANGED_ROWS) and emb["max_abs_diff"] == pytest.approx(1.0)
    assert t["model.lin.weight"] == {"key": "model.lin.weight", "status": "same", "how": "blobs",
                                     "dtype": "float32", "shape": [4, 8]}
    assert data["values"] == [{"key": "step", "status": "changed", "a": 1, "b": 2}]
    code, out, _ = run(capsys, "diff", f"{root}/step=1.ckpt", f"{root}/step=2.ckpt", "--exit-code")
    assert code == 1 and "3/2048" in out and "1 changed" in out
    code, data = run_json(capsys, "diff", f"{root}/step=2.ckpt", f"{root}/quant.ckpt")
    emb = {d["key"]: d for d in data["tensors"]}["model.emb.weight"]
    assert 0 < emb["max_abs_diff"] < 0.1  # 8-bit quantization error only
    assert run(capsys, "diff", f"{root}/step=2.ckpt", f"{root}/step=2.ckpt", "--exit-code")[0] == 0
    other = {"model": {"emb.weight": ref["emb"][:10], "extra": torch.ones(2)}, "step": 2, "new": "x"}
    with CheckpointEngine() as eng:
        eng.save(other, f"{root}/other.ckpt").result()
    code, data = run_json(capsys, "diff", f"{root}/step=2.ckpt", f"{root}/other.ckpt")
    status = {d["key"]: d["status"] for d in data["tensors"]}
    assert status == {"model.emb.weight": "retyped", "model.lin.weight": "removed",
                      "model.lin.bias": "removed", "model.extra": "added"}
    assert {v["key"]: v["status"] for v in data["values"]} == {
        "hyper.lr": "removed", "hyper.betas": "removed", "hyper.name": "removed",
        "hyper.3": "removed", "epoch": "removed", "new": "added"}


def test_gc(capsys, local_run):
    root, _ = local_run
    with CheckpointEngine() as eng:
        eng.remove(f"{root}/step=2.ckpt")
    code, data = run_json(capsys, "gc", root, "--dry-run")
    assert code == 0 and data["deleted_blobs"] > 0 and data["kept_young"] == 0  # leases, no grace (default 0)
    code, data = run_json(capsys, "gc", root, "--dry-run", "--grace", "3600")
    assert code == 0 and data["deleted_blobs"] == 0 and data["kept_young"] > 0  # an explicit grace still holds
    code, data = run_json(capsys, "gc", root, "--dry-run", "--grace", "0")
    freed = data["freed_bytes"]
    assert code == 0 and data["dry_run"] and data["deleted_blobs"] > 0 and freed > 0
    code, out, _ = run(capsys, "gc", root, "--grace", "0")
    assert code == 0 and "deleted" in out
    assert run_json(capsys, "gc", root, "--grace", "0")[1]["deleted_blobs"] == 0
    assert run(capsys, "verify", root)[0] == 0
    Path(root, "broken.ckpt").write_bytes(Path(root, "step=1.ckpt").read_bytes()[:50])
    code, out, _ = run(capsys, "gc", root, "--grace", "0")
    assert code == 1 and "broken.ckpt" in out


def test_ls_and_gc_say_when_their_bytes_are_temp_files_of_a_killed_writer(capsys, local_run):
    """A writer killed mid-save leaves its half-written blob as a temp file. ``ls`` counted its bytes as
    "unreferenced 12.7 MiB in 0 blob(s)" and ``gc`` "deleted 0 unreferenced blob(s), freed 12.7 MiB",
    never saying what they were; both now name the temp files."""
    root, _ = local_run
    shard = Path(root, ".checkrun", "blobs", "ab")
    shard.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import sys; from ckpt_core.storage.atomic import temp_path; "
                    "open(temp_path(sys.argv[1]), 'wb').write(bytes(5000))", str(shard / ("ab" * 15))],
                   check=True)  # that writer has ended: its temp file is garbage
    code, out, _ = run(capsys, "ls", root)
    assert code == 0 and "and 1 temp file(s) of interrupted writes" in out
    code, data = run_json(capsys, "gc", root, "--dry-run")
    assert code == 0 and len(data["temp_files"]) == 1 and data["freed_bytes"] >= 5000
    code, out, _ = run(capsys, "gc", root)
    assert code == 0 and "and 1 temp file(s) of interrupted writes, freed" in out
    assert not list(shard.iterdir())


def test_verify_of_a_manifest_copied_alone_says_why_its_blobs_are_missing(capsys, local_run, tmp_path):
    """``cp step=1.ckpt elsewhere/``: verify listed only "missing blob ..." (a load says why)."""
    root, _ = local_run
    alone = tmp_path / "elsewhere"
    alone.mkdir()
    shutil.copy(Path(root, "step=1.ckpt"), alone)
    code, out, _ = run(capsys, "verify", str(alone / "step=1.ckpt"))
    assert code == 1 and "missing blob" in out and "no .checkrun/blobs folder beside the manifest" in out


# ----------------------------------------------------------------------------- S3 and the real script


@pytest.mark.s3
def test_every_command_on_s3(capsys, s3_run, tmp_path):
    root, ref, flags = s3_run
    code, data = run_json(capsys, "ls", root, *flags)
    assert code == 0 and [r["name"] for r in data["checkpoints"]] == ["step=1.ckpt", "step=2.ckpt", "quant.ckpt"]
    cfg = tmp_path / "checkrun.yaml"  # storage options from --config, merged key by key with -o
    cfg.write_text(f"checkpointing:\n  storage:\n    storage_options:\n      key: testing\n"
                   f"      client_kwargs: {{endpoint_url: '{flags[1]}'}}\n")
    code, data = run_json(capsys, "ls", root, "--config", str(cfg), "--config-section", "checkpointing",
                          "-o", "secret=testing", "-o", "client_kwargs.region_name=us-east-1")
    assert code == 0 and data["totals"]["checkpoints"] == 3
    code, data = run_json(capsys, "inspect", f"{root}/step=2.ckpt", *flags)
    assert code == 0 and data["values"]["step"] == 2 and data["chain_depth"] == 1
    code, data = run_json(capsys, "diff", f"{root}/step=1.ckpt", f"{root}/step=2.ckpt", *flags)
    assert {d["key"]: d for d in data["tensors"]}["model.emb.weight"]["changed_rows"] == 3
    code, _, _ = run(capsys, "export", f"{root}/step=2.ckpt", f"{root}-export/model.pt", *flags)
    assert code == 0
    code, _, _ = run(capsys, "import", f"{root}-export/model.pt", f"{root}/imported.ckpt", *flags)
    assert code == 0
    local_copy = tmp_path / "model.safetensors"
    assert run(capsys, "export", f"{root}/imported.ckpt", str(local_copy), *flags)[0] == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(local_copy)["model.emb.weight"], ref["emb"])
    opts = {"client_kwargs": {"endpoint_url": flags[1]}, "key": "testing", "secret": "testing"}
    blob = corrupt(root, opts)
    code, data = run_json(capsys, "verify", root, *flags)
    bad = {Path(r["path"]).name: r for r in data["checkpoints"] if not r["ok"]}
    assert code == 1 and set(bad) == {"step=2.ckpt", "broken.ckpt"} and blob in bad["step=2.ckpt"]["problems"][0]
    code, _, _ = run(capsys, "gc", root, "--grace", "0", *flags)
    assert code == 1  # refused: a manifest is unreadable, its blobs may be needed
    fs, base = url_to_fs(root, **opts)
    fs.rm_file(f"{base}/broken.ckpt")
    with CheckpointEngine() as eng:
        eng.remove(f"{root}/quant.ckpt", storage_options=opts)
    code, data = run_json(capsys, "gc", root, "--grace", "0", *flags)
    assert code == 0 and data["deleted_blobs"] > 0 and data["freed_bytes"] > 0


def _script() -> str:
    exe = Path(sys.executable).with_name("checkrun")
    return str(exe) if exe.exists() else (shutil.which("checkrun") or pytest.skip("checkrun script not installed"))


def test_console_script_local(local_run):
    root, _ = local_run
    blob = corrupt(root, {})
    proc = subprocess.run([_script(), "verify", root, "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert [Path(r["path"]).name for r in data["checkpoints"] if not r["ok"]] == ["step=2.ckpt", "broken.ckpt"]
    assert blob in data["checkpoints"][1]["problems"][0]


def test_python_m_ckpt_core_cli_runs_the_command_line(local_run):
    """docs/cli.md promises ``python -m ckpt_core.cli``; the package had no ``__main__`` (found by an
    independent check)."""
    root, _ = local_run
    proc = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "verify", root, "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(r["ok"] for r in json.loads(proc.stdout)["checkpoints"])


@pytest.mark.s3
def test_console_script_s3(s3_run):
    root, _, flags = s3_run
    corrupt(root, {"client_kwargs": {"endpoint_url": flags[1]}, "key": "testing", "secret": "testing"})
    proc = subprocess.run([_script(), "verify", root, "--json", *flags], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "AWS_ACCESS_KEY_ID": "testing",
                                            "AWS_SECRET_ACCESS_KEY": "testing"})
    assert proc.returncode == 1, proc.stderr
    assert not json.loads(proc.stdout)["ok"]


def test_import_and_export_to_a_name_ending_in_a_slash_refuse_instead_of_making_a_file(capsys, local_run, tmp_path):
    """h132: `checkrun import m.pt newdir/` (the `cp f dir/` habit) with newdir missing made a checkpoint FILE
    named newdir; export the same. A target ending in '/' names a directory: refused, nothing written."""
    root, _ = local_run
    pt = tmp_path / "m.pt"
    assert run(capsys, "export", f"{root}/step=1.ckpt", str(pt))[0] == 0
    code, _, err = run(capsys, "import", str(pt), f"{tmp_path}/newdir/")
    assert code == 2 and "newdir/: is a directory name (ends with /); give a file name" in err
    code, _, err = run(capsys, "export", f"{root}/step=1.ckpt", f"{tmp_path}/out/")
    assert code == 2 and "out/: is a directory name" in err
    assert not (tmp_path / "newdir").exists() and not (tmp_path / "out").exists()


def test_verify_of_a_directory_checks_a_link_to_a_checkpoint_elsewhere(capsys, local_run, tmp_path):
    """h134: ``last.ckpt -> ../other/o.ckpt`` with a rotted blob in ``other``: ``checkrun verify DIR`` said
    everything intact (exit 0; the docs say a link is checked as its target), ``verify DIR/last.ckpt`` CORRUPT.
    Also: a user's ``passwd -> /etc/passwd`` was listed as a checkpoint link, a link loop "does not exist"."""
    root, _ = local_run
    other = tmp_path / "other"
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"w": torch.randn(64)}, other / "o.ckpt")
    blob = next(p for p in (other / ".checkrun" / "blobs").rglob("*") if p.is_file())
    blob.write_bytes(b"x" + blob.read_bytes()[1:])
    os.symlink(os.path.relpath(other / "o.ckpt", root), f"{root}/last.ckpt")
    code, data = run_json(capsys, "verify", root)
    bad = [Path(r["path"]).name for r in data["checkpoints"] if not r["ok"]]
    assert code == 1 and bad == ["last.ckpt"]
    os.remove(f"{root}/last.ckpt")
    os.symlink("/etc/passwd", f"{root}/passwd")
    os.symlink("loop.ckpt", f"{root}/loop.ckpt")
    code, data = run_json(capsys, "ls", root)
    assert [k["name"] for k in data["links"]] == ["loop.ckpt"] and data["links"][0]["problem"] == "a loop of links"
    code, data = run_json(capsys, "verify", root)
    assert code == 1 and "a loop of links" in [r for r in data["checkpoints"] if not r["ok"]][0]["problems"][0]
    os.remove(f"{root}/loop.ckpt")  # h137: the directory through a link of its own, last.ckpt -> its real path
    os.symlink(os.path.realpath(f"{root}/step=2.ckpt"), f"{root}/last.ckpt")
    os.symlink(root, tmp_path / "alias")
    code, data = run_json(capsys, "verify", str(tmp_path / "alias"))
    assert code == 0 and len(data["checkpoints"]) == len(run_json(capsys, "verify", root)[1]["checkpoints"])
    os.remove(f"{root}/last.ckpt")  # h138: a link to a link beside it, which points elsewhere: checked once
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"w": torch.randn(8)}, other / "x.ckpt")
    os.symlink(os.path.relpath(other / "x.ckpt", root), f"{root}/elsewhere.ckpt")
    os.symlink("elsewhere.ckpt", f"{root}/last.ckpt")
    code, data = run_json(capsys, "verify", root)
    assert [Path(r["path"]).name for r in data["checkpoints"]].count("last.ckpt") == 0
