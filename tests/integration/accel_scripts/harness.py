"""Helpers for the accelerate integration tests: real ``accelerate launch`` runs and exact comparisons."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TRAIN = HERE / "train.py"
BIN = Path(sys.executable).parent
LAUNCH_TIMEOUT = 600  # hang protection only; nothing asserts on time


def free_port() -> int:
    """A free TCP port on loopback for torch.distributed's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(tmp: Path, extra: dict | None = None) -> dict:
    """Environment for a launch: no developer accelerate config, one thread per process."""
    env = dict(os.environ)
    env.pop("CHECKRUN_CONFIG", None)
    env.update({"HF_HOME": str(tmp / "hf_home"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def accelerate_args(num_processes: int) -> list[str]:
    """Flags for a config-less ``accelerate launch`` with 1 process or 2 CPU (gloo) processes."""
    common = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_processes == 1:
        return ["--num_processes", "1", *common]
    return ["--multi_gpu", "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
            *common]


def run(cmd: Sequence[str], env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a launch; on failure show its output in the assertion message."""
    proc = subprocess.run(list(map(str, cmd)), env=env, cwd=str(cwd or REPO), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({proc.returncode})\n"
                                  f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def accelerate_launch(launch_args: Sequence[str], script: Path, script_args: Sequence[str], env: dict,
                      via: str = "accelerate") -> subprocess.CompletedProcess:
    """``accelerate launch`` (``via="accelerate"``) or ``accelerate-ckpt launch`` of ``script``."""
    return run([BIN / via, "launch", *launch_args, script, *script_args], env)


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bit-for-bit equality of nested state (tensors: dtype, shape and bytes; floats: exact)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), \
            f"{where}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a).__name__}[{len(a)}] vs {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def load_dump(directory: Path, rank: int) -> dict:
    """A ``final_rank{r}.pt`` written by train.py."""
    return torch.load(directory / f"final_rank{rank}.pt", weights_only=False)
