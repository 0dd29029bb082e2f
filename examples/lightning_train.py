"""Train a small Lightning model with checkrun checkpoints, resume from ``last``, print the savings.

Run: ``python examples/lightning_train.py [--dir DIR_OR_URL] [--steps 40] [--every 10] [--quantize]``

1. ``fit`` for ``--steps`` steps; ``ModelCheckpoint`` saves every ``--every`` steps (plus ``last.ckpt``)
   through ``CheckrunCheckpointIO``: asynchronous (the loop pauses only for an in-memory copy) and
   incremental (only the embedding rows and chunks that changed are written).
2. A second ``Trainer`` resumes with ``fit(ckpt_path="last")`` and trains to twice as many steps.
3. Per save it prints the bytes it wrote, the tensor bytes of the state, the bytes of the blobs the
   checkpoint references and the time the training loop was blocked (``SaveInfo.summary()`` of the
   ``CheckpointMetrics`` history), then the totals, where the checkpoints are and the command that
   lists them: ``checkrun ls DIR`` shows the same figures (WROTE, TENSORS, REFERENCED), in the same
   units (binary: KiB, MiB, GiB).

For S3 give ``--dir s3://bucket/run`` and the endpoint with ``FSSPEC_S3_ENDPOINT_URL`` (read by both
Lightning's and checkrun's fsspec calls), see docs/lightning.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile

from lightning.pytorch import Trainer, seed_everything

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_demo import DemoDataModule, DemoModel  # noqa: E402

from ckpt_core.units import fmt_bytes, fmt_less, fmt_percent  # noqa: E402
from lightning_ckpt import CheckpointMetrics, CheckrunCheckpointIO, CheckrunModelCheckpoint  # noqa: E402


def make_trainer(directory: str, steps: int, every: int, quantize: bool) -> tuple[Trainer, CheckpointMetrics]:
    """A CPU Trainer whose checkpoints go through checkrun; returns it with its metrics callback."""
    rules = [{"pattern": "state_dict.emb.weight", "method": "uniform", "bits": 8}] if quantize else None
    plugin = CheckrunCheckpointIO(quantization=rules, max_pending=2)  # top-k and last.ckpt come in pairs
    metrics = CheckpointMetrics()
    checkpoint = CheckrunModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_top_k=2,
                                         monitor="step", mode="max", save_last=True)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, plugins=[plugin],
                      callbacks=[checkpoint, metrics], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=directory)
    return trainer, metrics


def report(title: str, metrics: CheckpointMetrics) -> tuple[int, int, int]:
    """Print one line per save (``SaveInfo.summary()``); return (saves, tensor bytes, written bytes)."""
    print(title)
    tensor = written = 0
    for info in metrics.history:
        name = info.path.rsplit("/", 1)[-1]
        print(f"  {name:>28}: {info.summary()}")
        tensor += info.tensor_bytes
        written += info.written_bytes
    return len(metrics.history), tensor, written


def totals(saves: int, tensor: int, written: int) -> str:
    """The run's total in the words and units of ``checkrun ls``."""
    return (f"total: {saves} saves wrote {fmt_bytes(written)} for {fmt_bytes(tensor)} of tensors "
            f"({fmt_percent(written, tensor)}, {fmt_less(tensor, written)} than full saves)")


def where(directory: str, temporary: bool) -> str:
    """Where the checkpoints are and the command that lists them (and, for a temp dir, removes them)."""
    quoted, last = shlex.quote(directory), shlex.quote(f"{directory}/last.ckpt")
    lines = [f"checkpoints: {directory}", f"look at them: checkrun ls {quoted}   (one: checkrun inspect {last})"]
    if temporary:
        lines.append(f"a temporary directory: remove it with rm -r {quoted}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="checkpoint directory or fsspec URL (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the first fit (the resume doubles them)")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--quantize", action="store_true", help="store the embedding table with 8-bit quantization")
    args = parser.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    directory = args.dir or tempfile.mkdtemp(prefix="checkrun-lightning-")

    seed_everything(0, verbose=False)
    trainer, metrics = make_trainer(directory, args.steps, args.every, args.quantize)
    trainer.fit(DemoModel(), datamodule=DemoDataModule())
    sums = [report(f"first fit: {trainer.global_step} steps, checkpoints in {directory}", metrics)]

    trainer, metrics = make_trainer(directory, 2 * args.steps, args.every, args.quantize)
    model = DemoModel()
    trainer.fit(model, datamodule=DemoDataModule(), ckpt_path="last")
    print(f"resumed from {trainer.ckpt_path} and trained to step {trainer.global_step}")
    sums.append(report("second fit (resumed):", metrics))

    print(totals(*(sum(column) for column in zip(*sums))))
    print(where(directory, temporary=args.dir is None))


if __name__ == "__main__":
    main()
