"""Writes tests/golden/v1: checkpoints in manifest format version 1, kept forever so that every
later checkrun must still load them (test_golden.py). Run only when adding a new format version."""
from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import torch

import ckpt_core


def golden_state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2048, 8, generator=g)
    emb[: step * 3] += 1.0
    return {
        "model": OrderedDict(emb=emb, w=torch.arange(12, dtype=torch.float16).reshape(3, 4),
                             b=torch.tensor([True, False])),
        "opt": {"state": {0: {"step": torch.tensor(float(step)), "sum": emb.abs()}}, "param_groups": [{"lr": 0.1}]},
        "extra": (1, 2.5, float("inf"), None, b"x", torch.bfloat16),
        "step": step,
    }


def main(out: str) -> None:
    cfg = {"incremental": {"row_delta_min_rows": 1024, "policy": "consecutive"},
           "quantization": [{"pattern": "opt.state.0.sum", "method": "uniform", "bits": 4}]}
    with ckpt_core.CheckpointEngine(cfg) as engine:
        for step in (1, 2, 3):
            engine.save(golden_state(step), f"{out}/step={step}.ckpt").result()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "v1"))
