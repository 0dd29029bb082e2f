"""Helpers for the accelerate integration tests: real ``accelerate launch`` runs and exact comparisons."""
from __future__ import annotations

import os
import signal
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
LAUNCH_TIMEOUT = 300  # hang protection only; nothing asserts on time (a launch takes seconds)


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
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
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
    """Run a launch; on failure show its output in the assertion message. A launch still running
    after ``LAUNCH_TIMEOUT`` fails with every descendant's Python stacks (``PYTHONFAULTHANDLER``:
    SIGABRT makes each process print all its threads) in the message."""
    args = list(map(str, cmd))
    with subprocess.Popen(args, env=env, cwd=str(cwd or REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            stdout, stderr = _dump_stacks_and_kill(proc)
            raise AssertionError(f"{' '.join(args)} still ran after {LAUNCH_TIMEOUT} s (a hang); stacks of "
                                 f"every process:\n--- stdout\n{stdout[-6000:]}\n--- stderr\n{stderr[-30000:]}")
    out = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, (f"{' '.join(args)} failed ({out.returncode})\n"
                                 f"--- stdout\n{stdout[-6000:]}\n--- stderr\n{stderr[-8000:]}")
    return out


def _dump_stacks_and_kill(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to every descendant of a hung launch, one at a time, deepest first (each prints its
    stacks), then SIGKILL to the whole session. The output collected; then each process's dump,
    after a line naming the process (read before the next signal, so that dumps do not interleave)."""
    import psutil  # an accelerate dependency

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    fds = [proc.stdout.fileno(), proc.stderr.fileno()]
    for fd in fds:
        os.set_blocking(fd, False)
    dumps: list[bytes] = []

    def drain() -> None:
        for fd in fds:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                dumps.append(chunk)
    for child in reversed(family):
        try:
            label = f"{child.pid} (parent {child.ppid()}): {' '.join(child.cmdline())[-160:]}"
            drain()
            dumps.append(f"\n=== stacks of process {label}\n".encode())
            child.send_signal(signal.SIGABRT)
            psutil.wait_procs([child], timeout=10)
        except psutil.NoSuchProcess:
            pass
    drain()
    for fd in fds:
        os.set_blocking(fd, True)
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    return stdout, stderr + "\n--- output while the stacks were taken\n" + b"".join(dumps).decode(errors="replace")


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
