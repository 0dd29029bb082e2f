"""Large plain Python values in a state (a resumable sampler's permutation, a long string) save and
load. Inline in the manifest, a 4.1M-item list made a manifest with more JSON elements than a load
accepts (``load.max_manifest_elements``) and a 70 MB bytes value one beyond the 64 MiB manifest cap:
the save succeeded, every load failed. Such values now go to blobs, and a manifest a load would refuse
is never committed: the save fails, naming the file."""
from __future__ import annotations

import os

import pytest
import torch

import ckpt_core
from ckpt_core import BackgroundSaveError, CheckpointEngine
from ckpt_core.errors import FormatError
from ckpt_core.format import tree


def test_large_plain_values_round_trip_and_the_manifest_stays_small(tmp_path) -> None:
    shared = torch.arange(6.0)
    state = {
        "perm": list(range(4_100_000)),  # more JSON elements than a load accepts, inline
        "payload": bytes(range(256)) * (280_000),  # 71.7 MB: beyond the manifest cap, inline
        "text": "é" * (tree.SPILL_CHARS + 1),
        "index": {i: (i, str(i)) for i in range(tree.SPILL_ITEMS + 1)},
        "nested": [[i, float(i)] for i in range(tree.SPILL_ITEMS + 1)],
        "with_tensors": [shared] * (tree.SPILL_ITEMS + 1),  # stays inline: tensors remain tensor leaves
        "small": [1, 2, 3],
    }
    path = tmp_path / "big.ckpt"
    with CheckpointEngine() as engine:
        engine.save(state, path).result()
        assert os.path.getsize(path) < (1 << 20)
        manifest = engine.read_manifest(path)
        assert len(manifest.tensors) == 1  # ``shared``, once
        out = engine.load(path)
    assert {k: v for k, v in out.items() if k != "with_tensors"} == {k: v for k, v in state.items() if k != "with_tensors"}
    assert type(out["index"][5]) is tuple and len(out["with_tensors"]) == tree.SPILL_ITEMS + 1
    assert all(t is out["with_tensors"][0] for t in out["with_tensors"]) and torch.equal(out["with_tensors"][0], shared)


def test_a_manifest_a_load_would_refuse_is_not_committed(tmp_path) -> None:
    config = {"load": {"max_manifest_elements": 20_000}}
    path = tmp_path / "last.ckpt"
    with CheckpointEngine(config) as engine:
        engine.save({"step": 1}, path).result()
        with pytest.raises(BackgroundSaveError, match="its manifest would not load") as info:
            engine.save({"step": 2, "rows": {f"k{i}": i for i in range(15_000)}}, path).result()
        assert isinstance(info.value.__cause__, FormatError) and "last.ckpt" in str(info.value.__cause__)
        assert engine.load(path) == {"step": 1}  # what was committed stays
        # more containers than a load accepts: refused by save() itself (since 2026-12-07), before any write
        with pytest.raises(FormatError, match="take more than 5000 JSON lists and objects"):
            engine.save({"step": 2, "rows": [[i, i] for i in range(10_000)]}, path)
        assert engine.load(path) == {"step": 1}
    assert ckpt_core.load(path) == {"step": 1}
