"""Checkpoints written by format version 1 (tests/golden/v1) load forever, bit for bit."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckpt_core

from .make_golden import golden_state

V1 = Path(__file__).parent / "v1"


@pytest.mark.parametrize("step", [1, 2, 3])
def test_v1_checkpoints_load(step, tmp_path):
    d = tmp_path / "v1"
    shutil.copytree(V1, d)  # never write into the golden files
    with ckpt_core.CheckpointEngine() as engine:
        manifest = engine.read_manifest(d / f"step={step}.ckpt")
        assert manifest.format_version == 1
        loaded = engine.load(d / f"step={step}.ckpt")
        assert engine.verify(d / f"step={step}.ckpt").ok
    ref = golden_state(step)
    for k, v in ref["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["extra"] == ref["extra"] and loaded["step"] == step
    q = loaded["opt"]["state"][0]["sum"]
    assert q.shape == ref["opt"]["state"][0]["sum"].shape
    assert (q - ref["opt"]["state"][0]["sum"]).abs().max() < 0.5  # 4-bit quantized by the golden config
    if step > 1:
        assert any(t.deltas for t in manifest.tensors)
