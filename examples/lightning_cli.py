"""LightningCLI with checkrun configured in YAML (``trainer.plugins`` with ``class_path``/``init_args``).

Run::

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml \
        --trainer.default_root_dir /tmp/checkrun-cli

then resume from the newest ``last.ckpt`` with ``--ckpt_path last`` added. Every argument of
``CheckrunCheckpointIO`` can be set in the YAML or on the command line, e.g.
``--trainer.plugins.init_args.keep_last 3`` (LightningCLI parses them from the type hints).
"""
from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_demo import DemoDataModule, DemoModel  # noqa: E402


def main(args: list[str] | None = None) -> LightningCLI:
    """Build the CLI (and run its subcommand unless ``args`` says otherwise)."""
    return LightningCLI(DemoModel, DemoDataModule, args=args, save_config_callback=None)


if __name__ == "__main__":
    main()
