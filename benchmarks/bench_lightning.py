"""Lightning ``Trainer.fit`` with checkpoints every k steps: checkrun's plugin vs Lightning's own.

A small GPT-like LightningModule (``--state-mb`` MB of fp32 weights + Adam moments) is trained on CPU
for ``--steps`` steps on random tokens; ``ModelCheckpoint(every_n_train_steps=k, save_top_k=2)``
saves to local disk through each CheckpointIO:

* none: no checkpointing at all (the baseline);
* torch: Lightning's default ``TorchCheckpointIO`` (synchronous ``torch.save``);
* async: ``AsyncCheckpointIO(TorchCheckpointIO())`` (clone on the training thread, save in a thread);
* checkrun: ``CheckrunCheckpointIO()`` with the engine defaults (asynchronous, incremental, lossless,
  byte-shuffle + zstd-1);
* checkrun-raw: the same with ``overrides={"compression.compress": False}`` (chunks stored raw: the
  background work is hashing and writing only, which matters on a 2-core machine);
* checkrun-nofsync: the defaults with ``overrides={"storage.fsync": False}`` (no fsync, like
  ``torch.save``: the kernel writes the files back whenever it likes);
* noop: a CheckpointIO that writes nothing: what Lightning itself spends around each save
  (``dump_checkpoint`` collecting the state dicts, ModelCheckpoint's bookkeeping), a floor that
  no CheckpointIO can go below.

Per configuration: ``fit`` seconds (until ``fit`` returns, i.e. including the plugin's teardown that
waits for pending saves), the process CPU seconds of the fit (all threads; less sensitive to other load
on the machine than wall time), the time each ``save_checkpoint`` call blocked the training loop
(median) and the bytes on disk at the end. Other work on a shared machine moves fit times by seconds,
so each fit of a configuration is paired with the baseline fits run just before and after it: its
overhead is its fit time minus their mean; ``--repeats`` rounds (the order of the configurations
rotates), medians reported. The target is checkrun's overhead <= 1/3 of the default's.

Run: ``python -m benchmarks.bench_lightning [--state-mb 40] [--steps 20] [--every 2] [--repeats 5] [--threads N]
[--json PATH]`` (``--json``: every fit's raw measurements).
"""
from __future__ import annotations

import argparse
import itertools
import logging
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # `python benchmarks/bench_lightning.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (GPT, dir_bytes, machine_header, machine_info, med, table, verdict,  # noqa: E402
                               workdir, write_json)
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from lightning_ckpt import CheckrunCheckpointIO  # noqa: E402

CONFIGS = ("none", "torch", "async", "checkrun", "checkrun-raw", "checkrun-nofsync", "noop")


class LitGPT(LightningModule):
    """``benchmarks.common.GPT`` trained with Adam on next-token prediction."""

    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(vocab, d, layers)
        self.vocab = vocab

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx = batch[0]
        logits = self.gpt(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), idx[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def shape_for(state_mb: float, d: int) -> tuple[int, int]:
    """(vocab, layers) so that weights + 2 Adam moments take about ``state_mb`` MB in fp32."""
    params = state_mb * 1e6 / 12
    vocab = max(1024, int(0.28 * params / d))
    layers = max(1, round((params - vocab * d) / (12 * d * d)))
    return vocab, layers


class Timed:
    """Mixin: records how long each ``save_checkpoint`` call kept the caller (the training loop)."""

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]
        self.blocked.append(time.perf_counter() - t0)


class NoopCheckpointIO(CheckpointIO):
    """Writes nothing (the Lightning-side floor of checkpointing)."""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        pass

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Any = None) -> dict:
        raise FileNotFoundError(path)

    def remove_checkpoint(self, path: Any) -> None:
        pass


class TimedNoop(Timed, NoopCheckpointIO):
    blocked: list


class TimedTorch(Timed, TorchCheckpointIO):
    blocked: list


class TimedAsync(Timed, AsyncCheckpointIO):
    blocked: list


class TimedCheckrun(Timed, CheckrunCheckpointIO):
    blocked: list


def make_io(name: str) -> Optional[Any]:
    io = {"none": None, "torch": lambda: TimedTorch(), "async": lambda: TimedAsync(TorchCheckpointIO()),
          "checkrun": lambda: TimedCheckrun(),
          "checkrun-raw": lambda: TimedCheckrun(overrides={"compression.compress": False}),
          "checkrun-nofsync": lambda: TimedCheckrun(overrides={"storage.fsync": False}),
          "noop": lambda: TimedNoop()}[name]
    if io is None:
        return None
    plugin = io()
    plugin.blocked = []
    return plugin


_FIT_NUMBERS = itertools.count()


def fit_once(name: str, args: argparse.Namespace, data: DataLoader, root: Path) -> dict:
    """One ``fit``; returns its seconds and the per-save blocking times."""
    vocab, layers = shape_for(args.state_mb, args.d_model)
    model = LitGPT(vocab, args.d_model, layers)
    plugin = make_io(name)
    # A directory of its own per fit, deleted only at the end of the benchmark: on ext4 without a
    # journal (this project's development VM) creating files is slowed for minutes after many
    # deletions nearby (the allocator skips recently deleted inodes), which would penalize
    # whichever writer creates many files after the previous fit's cleanup.
    directory = root / f"{name}-{next(_FIT_NUMBERS)}"
    callbacks = [] if plugin is None else [ModelCheckpoint(dirpath=str(directory), every_n_train_steps=args.every,
                                                           save_top_k=2, monitor="step", mode="max")]
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.steps, max_epochs=-1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                      enable_checkpointing=plugin is not None, plugins=[plugin] if plugin else None,
                      default_root_dir=str(directory))
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit(model, train_dataloaders=data)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    written = dir_bytes(directory) if directory.exists() else 0  # the 2 kept checkpoints (+ shared blobs)
    return {"fit": seconds, "cpu": cpu, "written": written,
            "blocked": list(plugin.blocked) if plugin is not None else []}


def run_rounds(args: argparse.Namespace, data: DataLoader, root: Path) -> dict:
    """``args.repeats`` rounds of ``none, c1, none, c2, ..., none``; each fit of a configuration is paired
    with the mean of the two baseline fits around it (same load on the machine, within seconds)."""
    configs = ("none",) + tuple(c for c in args.configs.split(",") if c in CONFIGS and c != "none")
    results: dict = {name: [] for name in configs}
    fit_once("none", args, data, root)  # warm-up: first-use costs (allocator, thread pools)
    for round_ in range(args.repeats):
        shift = round_ % (len(configs) - 1)
        order = configs[1:][shift:] + configs[1:][:shift]
        before = fit_once("none", args, data, root)
        results["none"].append(before)
        for name in order:
            run = fit_once(name, args, data, root)
            after = fit_once("none", args, data, root)
            results["none"].append(after)
            run["overhead"] = run["fit"] - (before["fit"] + after["fit"]) / 2
            run["extra_cpu"] = run["cpu"] - (before["cpu"] + after["cpu"]) / 2
            results[name].append(run)
            print(f"round {round_}: {name} fit {run['fit']:.2f} s, overhead {run['overhead']:+.2f} s", file=sys.stderr)
            before = after
    return results


def report(results: dict, args: argparse.Namespace, state_mb: float) -> str:
    rows, overhead = [], {"none": 0.0, "torch": float("nan"), "checkrun": float("nan")}
    for name in results:
        runs = results[name]
        blocked = [b for r in runs for b in r["blocked"]]
        if name != "none":
            overhead[name] = med(r["overhead"] for r in runs)
        ratio = overhead[name] / overhead["torch"] if name not in ("none", "torch") and overhead["torch"] > 0 \
            else (1.0 if name == "torch" else float("nan"))
        rows.append([name, med(r["fit"] for r in runs), overhead[name],
                     med(r.get("extra_cpu", 0.0) for r in runs), med(blocked) if blocked else float("nan"),
                     len(blocked) // max(1, len(runs)), med(r["written"] for r in runs) / 1e6, ratio])
    ok = overhead["torch"] > 0 and overhead["checkrun"] <= overhead["torch"] / 3
    head = ["CheckpointIO", "fit s", "overhead s", "extra CPU s", "blocked per save s", "saves",
            "on disk MB", "overhead / torch's"]
    verdict_text = verdict(ok) if overhead["torch"] > 0 else "INCONCLUSIVE (no overhead measured for torch: noise)"
    return (f"{machine_header('Lightning fit with checkpoints every k steps')}\n"
            f"state {state_mb:.0f} MB (weights + Adam, fp32), {args.steps} steps, save every {args.every} "
            f"(top-2 kept), batch {args.batch}x{args.ctx} tokens, {args.repeats} rounds; medians: fit, "
            f"overhead and extra CPU paired with the baseline fits just before and after, blocked over all saves\n\n"
            f"{table(head, rows)}\n\ncheckrun overhead <= 1/3 of the default's: {verdict_text} "
            f"({overhead['checkrun']:.2f} s vs {overhead['torch']:.2f} s; checkrun-raw "
            f"{overhead.get('checkrun-raw', float('nan')):.2f} s; a CheckpointIO writing nothing "
            f"{overhead.get('noop', float('nan')):.2f} s)\n")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mb", type=float, default=40.0)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated CheckpointIOs to compare (torch and checkrun are needed for the target)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for training (default: torch's, = all cores); 1 leaves a "
                             "core free for background work, as GPU training does")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the raw measurements here")
    args = parser.parse_args(argv)
    started = machine_info()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    root = workdir(args.dir)
    vocab, layers = shape_for(args.state_mb, args.d_model)
    tokens = torch.randint(vocab, (args.steps * args.batch, args.ctx + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=args.batch)
    state_mb = sum(p.numel() for p in LitGPT(vocab, args.d_model, layers).parameters()) * 12 / 1e6
    results = run_rounds(args, data, root)
    write_json(args.json, "lightning", args, {"state_mb": state_mb, "configs": results}, started)
    print(report(results, args, state_mb))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
