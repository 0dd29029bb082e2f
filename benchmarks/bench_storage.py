"""Storage that stays small: stored bytes / bytes referenced by live checkpoints, after every commit.

A LightningCLI-style fit (the model and data of ``examples/lightning_cli.py``: ``DemoModel`` and
``DemoDataModule`` of ``examples/lightning_demo.py``, a ``Trainer`` with
``lightning_ckpt.CheckrunCheckpointIO`` and ``ModelCheckpoint(every_n_train_steps=2)``) saves every 2
steps. Retention, ``--retention``:

* ``plugin`` (default): ``CheckrunCheckpointIO(keep_last=3)`` and ``save_top_k=-1`` (the engine removes);
* ``topk``: ``ModelCheckpoint(save_top_k=3, monitor="step", mode="max")`` (Lightning removes, through
  ``remove_checkpoint``).

After every commit and its background step (retention, then collection), at the start of the next
step: *stored* = every byte under the directory (blobs, manifests, lease objects, temp files),
*referenced* = the blobs the live checkpoints reference (each once) plus their manifests. Target:
max(stored / referenced) <= 1.2x. Printed beside the same run's bytes *written* per save
(``SaveInfo.written_bytes``: blobs and manifest that save wrote). Local disk, then a shorter run on
S3 (moto's server on loopback: behaviour, not speed).

Run: ``python -m benchmarks.bench_storage [--steps 600] [--every 2] [--keep 3]
[--retention plugin|topk] [--s3-steps 120] [--no-s3] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_storage.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ROOT, machine_header  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
import fsspec  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning_demo import DemoDataModule, DemoModel  # noqa: E402

from ckpt_core import CheckpointEngine  # noqa: E402
from lightning_ckpt import CheckrunCheckpointIO  # noqa: E402

MiB = 2**20


@dataclass
class Run:
    """One fit's figures (bytes)."""

    backend: str
    retention: str
    steps: int
    saves: int = 0
    ratios: list = field(default_factory=list)
    stored: list = field(default_factory=list)
    referenced: list = field(default_factory=list)
    written: list = field(default_factory=list)
    tensor_bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"backend": self.backend, "retention": self.retention, "steps": self.steps,
                "saves": self.saves, "measurements": len(self.ratios),
                "max_ratio": max(self.ratios), "final_ratio": self.ratios[-1],
                "median_ratio": statistics.median(self.ratios),
                "max_stored_MiB": max(self.stored) / MiB, "final_referenced_MiB": self.referenced[-1] / MiB,
                "written_per_save_MiB_median": statistics.median(self.written) / MiB,
                "written_per_save_MiB_max": max(self.written) / MiB,
                "state_MiB": self.tensor_bytes / MiB, "seconds": round(self.seconds, 1),
                "target_met": max(self.ratios) <= 1.2}


def directory_bytes(url: str, opts: dict) -> tuple[int, int]:
    """(stored, referenced) bytes of the checkpoint directory ``url`` right now."""
    fs, path = fsspec.core.url_to_fs(url, **opts)
    fs.invalidate_cache()
    stored = sum(int(i.get("size") or 0) for i in fs.find(path, detail=True).values())
    blobs: dict[str, int] = {}
    manifests = 0
    with CheckpointEngine({"storage": {"storage_options": opts}}) as engine:
        for entry in engine.list(url):
            manifests += entry.size
            blobs.update((b.key, b.size) for b in entry.manifest.blobs())
    return stored, sum(blobs.values()) + manifests


class Measure(Callback):
    """After each save's commit and background step (at the start of the next step): the ratio."""

    def __init__(self, plugin: CheckrunCheckpointIO, url: str, opts: dict, run: Run) -> None:
        self.plugin, self.url, self.opts, self.run = plugin, url, opts, run
        self.unmeasured = 0
        plugin.add_save_callback(self._saved)

    def _saved(self, info) -> None:  # the engine's background thread, after the commit
        self.run.saves += 1
        self.run.written.append(info.written_bytes)
        self.run.tensor_bytes = info.tensor_bytes
        self.unmeasured += 1

    def _measure(self) -> None:
        self.plugin.wait()  # the save's background step (retention, collection) has ended
        if not self.unmeasured:
            return
        self.unmeasured = 0
        stored, referenced = directory_bytes(self.url, self.opts)
        self.run.stored.append(stored)
        self.run.referenced.append(referenced)
        self.run.ratios.append(stored / referenced)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._measure()

    def on_train_end(self, trainer, pl_module) -> None:
        self._measure()


def fit(url: str, opts: dict, steps: int, every: int, keep: int, retention: str, backend: str) -> Run:
    """One fit saving every ``every`` steps to ``url``; the ratio after every commit."""
    run = Run(backend, retention, steps)
    plugin = CheckrunCheckpointIO(keep_last=keep if retention == "plugin" else None, storage_options=opts)
    if retention == "plugin":
        ckpt = ModelCheckpoint(dirpath=url, every_n_train_steps=every, save_top_k=-1)
    else:
        ckpt = ModelCheckpoint(dirpath=url, every_n_train_steps=every, save_top_k=keep, monitor="step", mode="max")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
                      callbacks=[ckpt, Measure(plugin, url, opts, run)], default_root_dir=None)
    t0 = time.perf_counter()
    trainer.fit(DemoModel(), DemoDataModule())
    run.seconds = time.perf_counter() - t0
    return run


def s3_endpoint():
    """moto's S3 server on loopback, and the storage options that reach a fresh bucket."""
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "key": "testing", "secret": "testing"}
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True, **opts).mkdir(bucket)
    # Lightning's ModelCheckpoint reaches the endpoint through fsspec's global config (docs/lightning.md)
    fsspec.config.conf["s3"] = dict(opts)
    return server, opts, f"s3://{bucket}/ckpts"


def print_run(run: Run) -> None:
    s = run.summary()
    print(f"\n### {run.backend}: {run.steps} steps, a save every {args_every} steps, retention {run.retention}, "
          f"keep 3 ({s['seconds']} s)\n")
    print("| saves | state | written per save (median / max) | stored / referenced (max / median / final) "
          "| max stored | referenced at the end | target <= 1.2x |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {run.saves} | {s['state_MiB']:.2f} MiB | {s['written_per_save_MiB_median']:.3f} / "
          f"{s['written_per_save_MiB_max']:.3f} MiB | {s['max_ratio']:.3f}x / {s['median_ratio']:.3f}x / "
          f"{s['final_ratio']:.3f}x | {s['max_stored_MiB']:.2f} MiB | {s['final_referenced_MiB']:.2f} MiB "
          f"| {'met' if s['target_met'] else 'MISSED'} |")


args_every = 2


def main(argv: list[str] | None = None) -> int:
    global args_every
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--retention", choices=("plugin", "topk"), default="plugin")
    ap.add_argument("--s3-steps", type=int, default=120)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    args_every = args.every
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "werkzeug"):  # werkzeug: moto's server logs every request
        logging.getLogger(name).setLevel(logging.ERROR)
    print(machine_header("Storage that stays small: stored / referenced after every commit"))
    runs = []
    work = Path(tempfile.mkdtemp(prefix="checkrun-bench-storage-"))
    try:
        runs.append(fit(str(work / "ckpts"), {}, args.steps, args.every, args.keep, args.retention, "local disk"))
        print_run(runs[-1])
        if not args.no_s3:
            server, opts, url = s3_endpoint()
            try:
                runs.append(fit(url, opts, args.s3_steps, args.every, args.keep, args.retention, "S3 (moto)"))
                print_run(runs[-1])
            finally:
                server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {"command": "python -m benchmarks.bench_storage " + " ".join(sys.argv[1:] if argv is None else argv),
               "runs": [r.summary() for r in runs],
               "per_commit": [{k: v for k, v in asdict(r).items() if k in ("backend", "ratios", "written")}
                              for r in runs]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(r.summary()["target_met"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
