"""The states and the peers of ``benchmarks.bench_restore``: how each one saves and restores.

A state is a payload (the tree that is checkpointed, whose tensors ARE the live training tensors) and
a ``change(i)`` that moves it like one checkpoint interval of training. A restore method saves the
payload once and restores it into those same live tensors; a saver takes repeated saves (blocking =
the call, durable = until committed / fsync'd). Everything runs in the calling thread of one process:
DCP runs without a process group (single process, ``no_dist`` inferred by torch).
"""
from __future__ import annotations

import inspect
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import (MB, cached_state, dlrm_interval, dlrm_payload, dlrm_state, floor_copy, fresh,
                               gpt_state, tensors)

# DCP warns on every call that no process group exists: single-process is what is measured here
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

STATES = ("dlrm", "dense", "ft")
STATE_LABELS = {"dlrm": "DLRM", "dense": "dense", "ft": "fine-tune"}
METHODS = ("floor", "torch", "dcp", "threads", "process")
RESTORE_LABELS = {"floor": "copy floor (raw readinto live tensors)",
                  "torch": "torch.save / torch.load + copy_ (Lightning)",
                  "dcp": "DCP dcp.load in place", "threads": "checkrun threads (defaults)",
                  "process": "checkrun, saving.background: process",
                  # not restores: until the next save's references were rebuilt after the load (load.reference)
                  "threads+ready": "(checkrun threads: + references rebuilt in the background)",
                  "process+ready": "(checkrun process: + references rebuilt in the background)"}
SAVE_LABELS = {"floor": "copy floor (reused buffers)", "torch": "torch.save (the call)",
               "dcp": "DCP async_save (reused stager)", "threads": "checkrun threads (incremental)",
               "process": "checkrun process (incremental)"}
CHECKRUN = {"threads": {}, "process": {"saving": {"background": "process"}}}
FT_D = 2048  # frozen 2048x2048 layers, as bench_incremental's fine-tune case
FT_RANK = 16


@dataclass
class BenchState:
    """A payload whose tensors are the live ones, and one training interval (``change(i)``)."""

    name: str
    payload: dict
    change: Callable[[int], None]
    owner: Any = None  # keeps the live modules / optimizers behind the payload alive


def _bump(payload: dict) -> None:
    """Dense training: every floating-point element changes (1e-6 is above fp32's step at 0.02)."""
    with torch.no_grad():
        for t in tensors(payload):
            if t.is_floating_point():
                t.add_(1e-6)


def build_state(name: str, size_mb: float) -> BenchState:
    """State ``name`` (one of ``STATES``) of about ``size_mb`` MB of fp32 in all."""
    if name == "dlrm":  # the tables plus 1/64 of them in row-wise Adagrad state (dim 64)
        st = dlrm_state(size_mb * 64 / 65)
        return BenchState(name, dlrm_payload(st), lambda i: dlrm_interval(st, 0.05, seed=i), st)
    if name == "dense":
        payload = cached_state(f"gpt_{int(size_mb)}mb", lambda: gpt_state(size_mb))
        return BenchState(name, payload, lambda i: _bump(payload))
    if name == "ft":
        from benchmarks.bench_incremental import finetune_payload, finetune_state, finetune_step

        layers = max(1, round(size_mb * MB / (FT_D * FT_D * 4)))
        st = finetune_state(layers=layers, d=FT_D, r=FT_RANK)
        # state_dict()/state_dict() of the optimizer hold the live parameters and moments (no copies)
        return BenchState(name, finetune_payload(st), lambda i: finetune_step(st, i), st)
    raise ValueError(f"unknown state {name!r}; expected one of {', '.join(STATES)}")


def copy_into(live: Any, loaded: Any) -> None:
    """``live.copy_(loaded)`` for every tensor, as ``load_state_dict`` does after a load."""
    dst, src = tensors(live), tensors(loaded)
    assert len(dst) == len(src), f"loaded state has {len(src)} tensors, the live one {len(dst)}"
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


def _flat_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as bytes (contiguous CPU tensors: the live state's)."""
    assert t.is_contiguous() and t.device.type == "cpu", "copy floor needs contiguous CPU tensors"
    return memoryview(t.detach().view(-1).view(torch.uint8).numpy())


class RawFloor:
    """The least any restore can cost: every tensor's bytes in one file, ``readinto`` their memory."""

    def __init__(self, root: Path) -> None:
        self.path = root / "floor.raw"

    def save(self, payload: dict) -> None:
        with open(fresh(self.path), "wb") as f:
            for t in tensors(payload):
                f.write(_flat_bytes(t))
            f.flush()
            os.fsync(f.fileno())

    def restore(self, payload: dict) -> None:
        with open(self.path, "rb", buffering=0) as f:
            for t in tensors(payload):
                view = _flat_bytes(t)
                got = f.readinto(view)
                assert got == len(view), f"{self.path}: short read ({got} of {len(view)} bytes)"


class TorchFile:
    """torch.save then ``torch.load(weights_only=True)`` + ``copy_`` (Lightning's TorchCheckpointIO)."""

    def __init__(self, root: Path) -> None:
        self.path = root / "state.pt"

    def save(self, payload: dict) -> None:
        with open(fresh(self.path), "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())

    def restore(self, payload: dict) -> None:
        copy_into(payload, torch.load(self.path, weights_only=True))


class DcpDir:
    """``dcp.save`` with FileSystemWriter (fsync), ``dcp.load`` in place into the live tensors."""

    def __init__(self, root: Path) -> None:
        self.path = root / "dcp"

    def save(self, payload: dict) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(payload, storage_writer=dcp.FileSystemWriter(str(fresh(self.path)), sync_files=True))

    def restore(self, payload: dict) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(payload, checkpoint_id=str(self.path))


def has_into() -> bool:
    """Whether ``CheckpointEngine.load`` decodes straight into live tensors (``into=``)."""
    import ckpt_core

    return "into" in inspect.signature(ckpt_core.CheckpointEngine.load).parameters


def engine_load_into(engine: Any, path: Path, payload: dict) -> None:
    """``engine.load(path, into=payload)`` where the engine has it, else load + ``copy_``."""
    if has_into():
        engine.load(path, into=payload)
    else:
        copy_into(payload, engine.load(path))


class CheckrunFile:
    """One checkrun save; each restore by a fresh engine (a restarted job), built before the clock."""

    def __init__(self, root: Path, mode: str) -> None:
        self.dir, self.config = root / f"ckr-{mode}", CHECKRUN[mode]
        self.path, self.engine = self.dir / "step=0.ckpt", None

    def history(self, payload: dict) -> None:
        """A save before the restored one, by the same engine (as in training: the checkpoint a job
        restores is rarely its first, and the engine's choices, e.g. which tensors are dense, show in it)."""
        import ckpt_core

        fresh(self.dir)
        self._writer = ckpt_core.CheckpointEngine(self.config)
        self._writer.save(payload, self.dir / "step=-1.ckpt").result()

    def save(self, payload: dict) -> None:
        import ckpt_core

        writer = getattr(self, "_writer", None)
        if writer is None:
            fresh(self.dir)
            writer = ckpt_core.CheckpointEngine(self.config)
        with writer:
            writer.save(payload, self.path).result()
        self._writer = None

    def prepare(self) -> None:
        import ckpt_core

        self.engine = ckpt_core.CheckpointEngine(self.config)

    def restore(self, payload: dict) -> None:
        engine_load_into(self.engine, self.path, payload)

    def references_ready(self) -> None:
        """Wait for the references the load rebuilds in the background (``load.reference``), as the
        next save would."""
        for dirstate in getattr(self.engine, "_dirs", {}).values():
            if hasattr(self.engine, "_adopt_rebuilds"):
                self.engine._adopt_rebuilds(dirstate)

    def finish(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def restorer(method: str, root: Path) -> Any:
    if method in CHECKRUN:
        return CheckrunFile(root, method)
    return {"floor": RawFloor, "torch": TorchFile, "dcp": DcpDir}[method](root)


class Saver:
    """Repeated saves of one method: ``save(payload, i)`` returns when training may go on, ``wait()``
    when the save is durable (floor: nothing to wait for)."""

    def __init__(self, method: str, root: Path) -> None:
        self.method, self.root, self.pending, self.bufs = method, root / f"save-{method}", None, None
        fresh(self.root).mkdir(parents=True)
        self.engine = None
        if method in CHECKRUN:
            import ckpt_core

            self.engine = ckpt_core.CheckpointEngine(CHECKRUN[method])

    def save(self, payload: dict, i: int) -> None:
        m = self.method
        if m == "floor":
            self.bufs = floor_copy(payload, self.bufs)
        elif m == "torch":
            self.pending = open(fresh(self.root / f"t{i % 2}.pt"), "wb")
            torch.save(payload, self.pending)
        elif m == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self.bufs is None:  # one stager for every save: it keeps its staging storages
                self.bufs = DefaultStager(StagingOptions(False, False, False, False))  # CPU only
            path = str(fresh(self.root / f"dcp{i % 2}"))
            self.pending = dcp.async_save(payload, checkpoint_id=path, async_stager=self.bufs,
                                          storage_writer=dcp.FileSystemWriter(path, sync_files=True))
        else:
            self.pending = self.engine.save(payload, self.root / f"step={i}.ckpt")

    def wait(self) -> None:
        if self.method == "torch" and self.pending is not None:
            self.pending.flush()
            os.fsync(self.pending.fileno())
            self.pending.close()
        elif self.pending is not None:
            self.pending.result()
        self.pending = None

    def timed_save(self, payload: dict, i: int) -> tuple[float, float]:
        """(blocking s, durable s) of one save; the save is durable on return."""
        t0 = time.perf_counter()
        self.save(payload, i)
        blocking = time.perf_counter() - t0
        self.wait()
        return blocking, time.perf_counter() - t0

    def close(self) -> None:
        self.wait()
        if self.engine is not None:
            self.engine.close()
        elif self.method == "dcp" and self.bufs is not None:
            self.bufs.close()
        self.bufs = None
