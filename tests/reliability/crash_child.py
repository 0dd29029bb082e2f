"""Child processes of the reliability suite (run in processes forked from a forkserver).

``train_main``: a plain PyTorch training loop (embedding + MLP, Adagrad, dropout, RNG state in the
checkpoint) that saves asynchronous, incremental, lossless checkpoints with keep_last retention and
gc after every save, resumes from ``engine.latest()`` when the directory has one, and can be
armed to stop at one *kill point*: when the armed phase is reached for the n-th time the child
tells the parent (``("hit", phase, detail)``) and blocks forever, so the parent's SIGKILL lands
exactly there. Phases:

    step             the training thread, before step k (a save may be in flight in the background)
    capture          inside ``save()``: tensors staged, the non-tensor values being pickled
    blob-write       a blob's temp file was created, nothing written yet
    blob-torn        half of a blob's bytes written to its temp file
    lease-write      a lease object's temp file was created (a save taking or renewing its lease)
    manifest-write   the manifest's temp file was created, nothing written yet
    manifest-rename  the manifest's bytes written and fsynced, the rename not done
    committed        right after the commit (save callback), before retention
    retention        retention is deleting a manifest
    gc               garbage collection is deleting a blob

``engine_server``: a CheckpointEngine in another process, driven command by command from the
parent, whose storage can be held at a gate (two-process races).
"""
from __future__ import annotations

import collections
import hashlib
import os
import struct
import threading
import traceback
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - optimizers import it lazily (seconds); the forkserver preloads it

from ckpt_core import CheckpointEngine, EngineConfig

from ckpt_core.testing import faults as faultfs

SEED = 20240917
ROWS, DIM, BATCH, IDS = 2048, 16, 32, 4
PHASES = ("step", "capture", "lease-write", "blob-write", "blob-torn", "manifest-write", "manifest-rename",
          "committed", "retention", "gc")


def engine_config(**overrides: Any) -> EngineConfig:
    """What the crash trials run with: lossless, async, incremental, keep_last=2 + gc after every save
    (leases protect saves in flight; the grace only applies to directories without leases), small
    chunks (several blobs per tensor)."""
    cfg = EngineConfig.from_dict({
        "compression": {"chunk_bytes": 32768},
        "retention": {"keep_last": 2, "gc_grace_seconds": 0.0, "gc_after_save": True},
        "saving": {"max_pending": 1, "sigterm_grace_seconds": None},
        "storage": {"retry": {"initial_backoff_seconds": 0.001, "max_backoff_seconds": 0.01}},
        "load": {"allowed_globals": [f"{__name__}.Marker"]},
    })
    return cfg.replace(**overrides) if overrides else cfg


# --------------------------------------------------------------------------------- kill points
class _Kill:
    conn = None
    phase: str | None = None
    n = 0
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    send_lock = threading.Lock()


def send(msg: tuple) -> None:
    with _Kill.send_lock:
        _Kill.conn.send(msg)


def fire(phase: str, detail: Any = None) -> None:
    """Count a phase; at the armed occurrence tell the parent and block until SIGKILL."""
    with _Kill.lock:
        _Kill.counts[phase] += 1
        hit = phase == _Kill.phase and _Kill.counts[phase] == _Kill.n
    if hit:
        send(("hit", phase, detail))
        threading.Event().wait()


class CrashPolicy(faultfs.Policy):
    """Maps storage operations to the kill phases above."""

    def on(self, op: str, kind: str, path: str) -> None:
        phase = {("open", "blob"): "blob-write", ("open", "manifest"): "manifest-write",
                 ("open", "lease"): "lease-write",
                 ("close", "manifest"): "manifest-rename", ("delete", "manifest"): "retention",
                 ("delete", "blob"): "gc"}.get((op, kind))
        if phase is not None:
            fire(phase, os.path.basename(path))

    def data(self, kind: str, path: str, buf, write) -> None:
        if kind == "blob" and _Kill.phase == "blob-torn":
            view = memoryview(buf).cast("B")
            with _Kill.lock:
                armed = _Kill.counts["blob-torn"] + 1 == _Kill.n
            if armed and view.nbytes > 1:
                write(view[: view.nbytes // 2])  # flushed to the OS: SIGKILL cannot lose it
            fire("blob-torn", os.path.basename(path))
        write(buf)


class Marker:
    """A non-tensor value of the state (stored as a pickled object blob); pickling it during
    ``save()`` is the ``capture`` kill point."""

    def __init__(self, tag: int) -> None:
        self.tag = tag

    def __reduce__(self):
        fire("capture", self.tag)
        return (Marker, (self.tag,))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Marker) and other.tag == self.tag

    def __repr__(self) -> str:
        return f"Marker({self.tag})"


# ------------------------------------------------------------------------------------ training
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(ROWS, DIM)
        self.fc1 = torch.nn.Linear(DIM, 32)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(self.emb(ids).mean(1)))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1000003 + step)
    ids = torch.randint(0, ROWS, (BATCH, IDS), generator=g)
    return ids, ids.float().mean(1, keepdim=True) / ROWS


def build() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    model = Net()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05)


def train_step(model: Net, opt: torch.optim.Optimizer, step: int) -> float:
    ids, target = batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(ids), target)
    loss.backward()
    opt.step()
    return float(loss.detach())


def state_of(model: Net, opt: torch.optim.Optimizer, step: int, loss: float) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state(), "extra": {"marker": Marker(step), "loss": (step, loss)}}


def digest(obj: Any) -> str:
    """Bit-exact fingerprint of a state tree (tensor bytes, dtypes, shapes, exact floats, types)."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(x, dict):
        h.update(f"D{type(x).__name__}{len(x)}".encode())
        for k in sorted(x, key=repr):
            _feed(h, k)
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"L{type(x).__name__}{len(x)}".encode())
        for v in x:
            _feed(h, v)
    elif isinstance(x, float):
        h.update(b"F" + struct.pack("<d", x))
    else:
        h.update(f"V{type(x).__name__}:{x!r}".encode())


def _redirect_stderr(log: str | None) -> None:
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


def train_main(conn, root: str, spec: dict) -> None:
    """One training process: resume from the latest checkpoint in ``root`` (if any), train to
    ``spec["total_steps"]`` saving every ``spec["save_every"]`` steps, unless killed on the way.

    ``spec["reference"]``: no checkpointing at all; send the digest of the state at every save
    step instead (the uninterrupted run that resumed runs are compared with)."""
    _Kill.conn = conn
    _redirect_stderr(spec.get("log"))
    try:
        torch.set_num_threads(1)
        kill = spec.get("kill")
        _Kill.phase, _Kill.n = (kill[0], int(kill[1])) if kill else (None, 0)
        faultfs.FaultFS.policy = CrashPolicy()
        total, every = int(spec["total_steps"]), int(spec["save_every"])
        model, opt = build()
        if spec.get("reference"):
            for step in range(total):
                loss = train_step(model, opt, step)
                if (step + 1) % every == 0 or step + 1 == total:
                    send(("saved", step + 1, digest(state_of(model, opt, step + 1, loss))))
            send(("done", total, digest(state_of(model, opt, total, loss)), []))
            return
        _train_with_checkpoints(root, spec, model, opt, total, every)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the trial
        send(("error", traceback.format_exc()))
        raise


def _train_with_checkpoints(root: str, spec: dict, model: Net, opt, total: int, every: int) -> None:
    engine = CheckpointEngine(engine_config(**spec.get("overrides", {})))
    committed: list[int] = []

    def on_commit(info) -> None:
        step = int(os.path.basename(info.path).split("-")[1].split(".")[0])
        committed.append(step)
        send(("committed", step))
        fire("committed", step)

    engine.add_callback(on_commit)
    start, loss = 0, float("nan")
    latest = engine.latest(root)
    if latest is not None:
        st = engine.load(latest)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        torch.set_rng_state(st["rng"])
        start, loss = st["step"], st["extra"]["loss"][1]
        send(("resumed", start))
    for step in range(start, total):
        fire("step", step)
        loss = train_step(model, opt, step)
        if (step + 1) % every == 0 or step + 1 == total:
            engine.save(state_of(model, opt, step + 1, loss), f"{root}/step-{step + 1:05d}.ckpt")
    engine.close()
    send(("done", total, digest(state_of(model, opt, total, loss)), committed))


# ------------------------------------------------------------------------------- engine server
def versioned_state(version: int, frozen_seed: int = 0) -> dict:
    """A state whose ``frozen`` part never changes (its blobs are reused by every save) and
    whose ``w`` changes with ``version``."""
    g = torch.Generator().manual_seed(frozen_seed)
    frozen = torch.randn(256, 64, generator=g)
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1000 + version))
    return {"frozen": frozen, "w": w, "version": version}


def engine_server(conn, events, root: str, config: dict, log: str | None = None) -> None:
    """Run commands from ``conn`` on one engine; gate events go out on ``events``.

    Commands: ("save", name, version, wait, frozen_seed) -> the path (committed if ``wait``);
    ("result", name) waits for that save;
    ("arm", op, kind, n) installs a gate, whose ``("entered", path)`` goes to ``events``;
    ("hold_put", n) holds the n-th blob write (``Store.put_blob``, any backend: S3 too) until
    ("release_put",) or SIGKILL, reporting ``("entered", key)``: the lease names the blob, earlier
    blobs are written;
    ("release",); ("wait",); ("gc", grace); ("latest",); ("close",) ends the server."""
    _redirect_stderr(log)
    torch.set_num_threads(1)
    engine = CheckpointEngine(config)
    handles = {}
    gate: faultfs.Gate | None = None
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "save":
                name, version, wait, frozen_seed = args
                h = engine.save(versioned_state(version, frozen_seed), f"{root}/{name}")
                handles[name] = h
                reply = h.result().path if wait else h.path
            elif cmd == "result":
                reply = handles[args[0]].result().path
            elif cmd == "arm":
                gate = faultfs.Gate(*args)
                faultfs.FaultFS.policy = gate
                threading.Thread(target=_report_entry, args=(gate, events), daemon=True).start()
                reply = None
            elif cmd == "release":
                gate.release()
                reply = None
            elif cmd == "hold_put":
                _hold_put(int(args[0]), events)
                reply = None
            elif cmd == "release_put":
                _HELD.set()
                reply = None
            elif cmd == "wait":
                engine.wait()
                reply = None
            elif cmd == "gc":
                reply = engine.gc(root, grace_seconds=args[0]).deleted
            elif cmd == "latest":
                reply = engine.latest(root)
            elif cmd == "close":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except Exception as exc:  # noqa: BLE001 - the parent asserts on it
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


_HELD = threading.Event()


def _hold_put(n: int, events) -> None:
    from ckpt_core.storage.store import Store

    real, calls, lock = Store.put_blob, [0], threading.Lock()

    def put_blob(self, key, data):
        with lock:
            calls[0] += 1
            mine = calls[0] == n
        if mine:
            events.send(("entered", key))
            _HELD.wait()  # until release_put (or SIGKILL)
        return real(self, key, data)

    Store.put_blob = put_blob


def _report_entry(gate: faultfs.Gate, events) -> None:
    gate.entered.wait()
    events.send(("entered", gate.held_path))


__all__ = ["train_main", "engine_server", "engine_config", "digest", "Marker", "PHASES",
           "versioned_state"]
