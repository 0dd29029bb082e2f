"""Lightning ``Trainer.fit`` with checkpoints every k steps: checkrun's plugin vs Lightning's own.

A small GPT-like LightningModule (``--state-mb`` MB of fp32 weights + Adam moments) is trained on CPU
on random tokens; ``ModelCheckpoint(every_n_train_steps=k)`` saves to local disk through each
CheckpointIO:

* none: no checkpointing at all (the baseline of ``--mode paired``);
* torch: Lightning's default ``TorchCheckpointIO`` (synchronous ``torch.save``);
* async: ``AsyncCheckpointIO(TorchCheckpointIO())`` (clone on the training thread, save in a thread);
* checkrun: ``CheckrunCheckpointIO()`` with the engine defaults (asynchronous, incremental, lossless,
  byte-shuffle + zstd-1, background threads);
* checkrun-process: the same with ``overrides={"saving.background": "process"}`` (the background
  part of each save in a writer process fed through shared memory);
* checkrun-raw: ``overrides={"compression.compress": False}`` (chunks stored raw);
* checkrun-nofsync: ``overrides={"storage.fsync": False}`` (no fsync, like ``torch.save``);
* noop: a CheckpointIO that writes nothing: what Lightning itself spends around each save
  (``dump_checkpoint``, ModelCheckpoint's bookkeeping), a floor no CheckpointIO can go below.

``--mode interleaved`` (the default): one fit in which the CheckpointIO rotates among the
configurations save by save. A save's interval runs from the start of the step that saves to the
start of the step k steps later (the save, its blocking, and what its background work costs the
following steps); overhead per save = mean interval after a configuration's saves - mean interval
after noop's, with one standard error. Every configuration is measured within seconds of the
others, so the machine's drifts (which moved whole fits by seconds on the development VM) cancel.
``still running`` counts saves whose background work was not done when the next save began (then
part of its cost falls into another configuration's interval: choose k so that it stays 0).

``--mode paired``: one fit per configuration (``--steps`` steps), each paired with the baseline fits
run just before and after it: overhead = its fit time minus their mean; ``--repeats`` rounds (the
order rotates), medians. Also reports fit seconds, process CPU seconds and bytes on disk.

The target is checkrun's overhead <= 1/3 of the default's (TorchCheckpointIO).

Run: ``python -m benchmarks.bench_lightning [--mode interleaved|paired] [--state-mb 32] [--every 10]
[--saves 30] [--steps 240] [--repeats 5] [--threads N] [--configs a,b,...] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import statistics
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
from benchmarks.common import (GPT, dir_bytes, machine_header, machine_info, med, overheads, table,  # noqa: E402
                               verdict, workdir, write_json)
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

from lightning_ckpt import CheckrunCheckpointIO  # noqa: E402

CONFIGS = ("none", "torch", "async", "checkrun", "checkrun-raw", "checkrun-nofsync", "checkrun-process", "noop")


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
          "checkrun-process": lambda: TimedCheckrun(overrides={"saving.background": "process"}),
          "noop": lambda: TimedNoop()}[name]
    if io is None:
        return None
    plugin = io()
    plugin.blocked = []
    return plugin


_FIT_NUMBERS = itertools.count()
WARMUP_ROUNDS = 3
"""Interleaved: rounds of saves not measured (thread pools and the writer process start, ~3 s)."""


class Rotating(CheckpointIO):
    """Save k goes to configuration k mod n; a removal to the configuration that saved the path."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.ios = {name: make_io(name) for name in names}
        self.names, self.order, self.owner = names, [], {}
        self.spilled = {name: 0 for name in names}

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Optional[Any] = None) -> None:
        for other, io in self.ios.items():  # a background save still running: its cost spills over
            engine = getattr(io, "_engine", None)
            if engine is not None and engine.pending and len(self.order) >= WARMUP_ROUNDS * len(self.names):
                self.spilled[other] += 1
        name = self.names[len(self.order) % len(self.names)]
        self.order.append(name)
        self.owner[str(path)] = name
        self.ios[name].save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Any = None) -> dict:
        raise FileNotFoundError(path)

    def remove_checkpoint(self, path: Any) -> None:
        self.ios[self.owner.pop(str(path))].remove_checkpoint(path)

    def teardown(self) -> None:
        for io in self.ios.values():
            io.teardown()


class StepClock(Callback):
    """``perf_counter`` at the start of every training batch and at the end of training."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())


def fit_interleaved(names: list[str], args: argparse.Namespace, root: Path) -> dict:
    """One fit in which the CheckpointIO rotates among ``names`` save by save (``--mode interleaved``).

    The interval of a save runs from the start of the step that saves to the start of the step
    ``every`` steps later: the save, its blocking and whatever its background work costs the
    following steps. Each configuration gets ``--saves`` measured intervals after
    ``WARMUP_ROUNDS`` rounds with one-off start-up costs; all share the machine's drifts within seconds."""
    steps = args.every * (len(names) * (args.saves + WARMUP_ROUNDS) + 1)
    vocab, layers = shape_for(args.state_mb, args.d_model)
    tokens = torch.randint(vocab, (steps * args.batch, args.ctx + 1), generator=torch.Generator().manual_seed(0))
    plugin, clock = Rotating(names), StepClock()
    directory = root / f"interleaved-{next(_FIT_NUMBERS)}"
    checkpoint = ModelCheckpoint(dirpath=str(directory), every_n_train_steps=args.every,
                                 save_top_k=2 * len(names), monitor="step", mode="max")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, checkpoint],
                      plugins=[plugin], default_root_dir=str(directory))
    t0 = time.perf_counter()
    trainer.fit(LitGPT(vocab, args.d_model, layers),
                train_dataloaders=DataLoader(TensorDataset(tokens), batch_size=args.batch))
    seconds = time.perf_counter() - t0
    stamps = clock.stamps
    intervals: dict = {name: [] for name in names}
    for k, name in enumerate(plugin.order):
        start = args.every * (k + 1) - 1  # the batch whose end triggers save k
        if k >= WARMUP_ROUNDS * len(names) and start + args.every < len(stamps):
            intervals[name].append(stamps[start + args.every] - stamps[start])
    return {"fit": seconds, "steps": steps, "intervals": intervals, "spilled": plugin.spilled,
            "blocked": {name: list(io.blocked[1:]) for name, io in plugin.ios.items()}}


def interleaved_report(res: dict, args: argparse.Namespace, state_mb: float) -> str:
    """Per-save overhead = mean interval after that configuration's saves - mean after noop's."""
    iv = res["intervals"]
    stats = overheads(iv, "noop")
    over = {n: o for n, (o, _) in stats.items()}
    rows = []
    for name, v in iv.items():
        se = stats[name][1]
        ratio = over[name] / over["torch"] if over.get("torch", 0) > 0 else float("nan")
        blocked = res["blocked"][name]
        rows.append([name, len(v), statistics.mean(v), over[name] * 1e3, se * 1e3,
                     med(blocked) * 1e3 if blocked else float("nan"), res["spilled"][name], ratio])
    ok = over.get("torch", 0) > 0 and over.get("checkrun", float("inf")) <= over["torch"] / 3
    best = min((n for n in over if n.startswith("checkrun")), key=lambda n: over[n], default=None)
    head = ["CheckpointIO", "saves", f"interval s ({args.every} steps)", "overhead per save ms", "+- ms (1 s.e.)",
            "blocked per save ms", "still running at the next save", "overhead / torch's"]
    return (f"{machine_header('Lightning fit, CheckpointIO rotating save by save (interleaved)')}\n"
            f"state {state_mb:.0f} MB (weights + Adam, fp32), one fit of {res['steps']} steps ({res['fit']:.0f} s), "
            f"a save every {args.every} steps going to each configuration in turn; overhead per save = mean interval "
            f"after its saves - mean after a CheckpointIO that writes nothing (noop)\n\n{table(head, rows)}\n\n"
            f"checkrun (defaults) overhead <= 1/3 of the default's: {verdict(ok)} ({over.get('checkrun', float('nan')) * 1e3:.1f} ms vs "
            f"{over.get('torch', float('nan')) * 1e3:.1f} ms per save)"
            + (f"; lowest checkrun setting: {best} {over[best] * 1e3:.1f} ms ({over[best] / over['torch']:.2f}x)"
               if best and over.get("torch", 0) > 0 else "") + "\n")


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
    parser.add_argument("--state-mb", type=float, default=32.0)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--steps", type=int, default=240, help="paired: steps per fit")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--mode", choices=("interleaved", "paired"), default="interleaved",
                        help="interleaved: one fit, the CheckpointIO rotating save by save (drift-free per-save "
                             "overheads); paired: one fit per configuration, each paired with baseline fits")
    parser.add_argument("--saves", type=int, default=30, help="interleaved: measured saves per configuration")
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
    if args.mode == "interleaved":
        names = ["noop"] + [c for c in args.configs.split(",") if c in CONFIGS and c not in ("none", "noop")]
        results = fit_interleaved(names, args, root)
        write_json(args.json, "lightning", args, {"state_mb": state_mb, "interleaved": results}, started)
        print(interleaved_report(results, args, state_mb))
    else:
        results = run_rounds(args, data, root)
        write_json(args.json, "lightning", args, {"state_mb": state_mb, "configs": results}, started)
        print(report(results, args, state_mb))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
