"""``python -m ckpt_core.cli``: the ``checkrun`` command line (docs/cli.md)."""
import sys

from . import main

sys.exit(main())
