"""Fabric DDP with 2 CPU ranks (``fabric.launch()`` runs this script again for rank 1): rank 0 saves a
state with a row-delta tensor, every rank loads it; each rank writes how many reference copies (row
streams, the rows a next incremental save compares against) its plugin's engine keeps and whether the
load was exact. Run by ``test_lightning_ddp.py``."""
from __future__ import annotations

import json
import os
import sys

import torch
from lightning.fabric import Fabric

from lightning_ckpt import CheckrunCheckpointIO


def main(root: str) -> None:
    plugin = CheckrunCheckpointIO({"load": {"reference": "inline"}})  # the copy made during the load: countable
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Embedding(2048, 16)  # 2-D, >= incremental.row_delta_min_rows: a row-delta tensor
    path = os.path.join(root, "ck.ckpt")
    fabric.save(path, {"model": model})
    plugin.wait()
    fabric.barrier()
    with torch.no_grad():
        model.weight.zero_()
    fabric.load(path, {"model": model})
    torch.manual_seed(0)
    exact = torch.equal(model.weight, torch.nn.Embedding(2048, 16).weight)
    streams = sum(len(d.streams) for d in plugin.engine._dirs.values())
    with open(os.path.join(root, f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump({"exact": exact, "streams": streams}, f)
    plugin.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
