"""Setups for tests/docs/test_snippets.py: what ``<!-- snippet: setup=NAME -->`` prepares.

Each setup writes into the block's temporary directory (``tmp``); ``ctx`` carries the pytest request
and, after ``s3``, the moto endpoint that replaces local endpoints in the block.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Callable


def _exp1(tmp: pathlib.Path, ctx: dict) -> None:
    """runs/exp1/step=100|200|300.ckpt (a 2048x16 embedding + linear + Adagrad, row deltas) and
    step=300-int8.ckpt (the embedding quantized to 8 bits), as in docs/cli.md."""
    import torch
    from torch import nn

    import ckpt_core

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2048, 16), nn.Linear(16, 16))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.01)
    hparams = {"lr": 0.01, "emb_dim": 16, "betas": (0.9, 0.999), "name": "dlrm-tiny"}
    state = {}
    with ckpt_core.CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        for step in (100, 200, 300):
            loss = model(torch.randint(0, 2048, (32,))).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "hyper_parameters": hparams, "global_step": step, "epoch": step // 200}
            engine.save(state, tmp / f"runs/exp1/step={step}.ckpt")
    rule = {"pattern": "model.0.weight", "method": "uniform", "bits": 8}
    ckpt_core.save(state, tmp / "runs/exp1/step=300-int8.ckpt", config={"quantization": [rule]})


def _corrupt(tmp: pathlib.Path, ctx: dict) -> None:
    """After exp1: one byte of a blob of runs/exp1/step=300.ckpt flipped, and a truncated manifest
    runs/exp1/step=400.ckpt."""
    import ckpt_core

    run = tmp / "runs/exp1"
    manifest = ckpt_core.CheckpointEngine().read_manifest(run / "step=300.ckpt")
    rec = next(t for t in manifest.tensors if t.key == "model.1.weight")
    key = next(iter(rec.blobs())).key
    blob = run / ".checkrun" / "blobs" / key[:2] / key[2:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    text = (run / "step=300.ckpt").read_bytes()
    (run / "step=400.ckpt").write_bytes(text[: len(text) // 2])


def _exported(tmp: pathlib.Path, ctx: dict) -> None:
    """After exp1: out/model.ckpt (torch.save) and out/model.safetensors exported from step=300."""
    from ckpt_core.cli import main

    for out in ("out/model.ckpt", "out/model.safetensors"):
        assert main(["export", str(tmp / "runs/exp1/step=300.ckpt"), str(tmp / out), "--no-progress"]) == 0


def _run_a(tmp: pathlib.Path, ctx: dict) -> None:
    """runs/a/epoch=0-step=500.ckpt and runs/a/last.ckpt, Lightning-shaped."""
    import torch

    import ckpt_core

    torch.manual_seed(0)
    state = {"state_dict": {"layer.weight": torch.randn(2, 32), "layer.bias": torch.zeros(2)},
             "epoch": 0, "global_step": 500, "hyper_parameters": {}}
    with ckpt_core.CheckpointEngine() as engine:
        engine.save(state, tmp / "runs/a/epoch=0-step=500.ckpt")
        engine.save(state, tmp / "runs/a/last.ckpt")


def _examples(tmp: pathlib.Path, ctx: dict) -> None:
    """examples/: a copy of the checkout's examples folder (its scripts and YAML files), for blocks that
    run ``python examples/...`` from the root of a checkout."""
    shutil.copytree(pathlib.Path(__file__).resolve().parents[2] / "examples", tmp / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun", "lightning_logs"))


def _s3(tmp: pathlib.Path, ctx: dict) -> None:
    """A moto S3 server: every http://127.0.0.1:PORT (or localhost) in the block is replaced by its
    endpoint; buckets ``bucket`` and ``ckpts`` are emptied and hold s3://ckpts/run1/step=10|20.ckpt
    and s3://bucket/run/step=1.ckpt. Credentials are fake (AWS_* variables)."""
    import fsspec
    import torch

    import ckpt_core

    endpoint = ctx["request"].getfixturevalue("s3_server")
    ctx["endpoint"] = endpoint
    opts = {"client_kwargs": {"endpoint_url": endpoint}}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    for bucket in ("bucket", "ckpts"):
        if fs.exists(bucket):
            fs.rm(bucket, recursive=True)
        fs.mkdir(bucket)
    emb = torch.zeros(4096, 32)
    with ckpt_core.CheckpointEngine({"storage": {"storage_options": opts}}) as engine:
        engine.save({"emb": emb, "step": 10}, "s3://ckpts/run1/step=10.ckpt")
        emb[:16] += 0.1
        engine.save({"emb": emb, "step": 20}, "s3://ckpts/run1/step=20.ckpt")
        engine.save({"w": torch.ones(8), "step": 1}, "s3://bucket/run/step=1.ckpt")


SETUPS: dict[str, Callable[[pathlib.Path, dict], None]] = {
    "exp1": _exp1, "corrupt": _corrupt, "exported": _exported, "run-a": _run_a, "examples": _examples, "s3": _s3,
}
_LOCAL_SETUPS = {"exp1", "corrupt", "exported", "run-a", "examples"}  # only create files under the directory


def prepare(names: list[str], tmp: pathlib.Path, ctx: dict, cache: pathlib.Path) -> None:
    """Run the named setups in ``tmp``. Local ones are built once per session (per sequence of names)
    and copied, since many blocks inspect the same checkpoints."""
    local = [n for n in names if n in _LOCAL_SETUPS]
    if local:
        built = cache / "-".join(local)
        if not built.exists():
            work = cache / (built.name + ".tmp")
            work.mkdir(parents=True)
            for name in local:
                SETUPS[name](work, ctx)
            work.rename(built)
        shutil.copytree(built, tmp, dirs_exist_ok=True)
    for name in names:
        if name not in _LOCAL_SETUPS:
            SETUPS[name](tmp, ctx)
