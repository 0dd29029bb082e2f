"""A collection that leaves a local directory without checkpoints, saves in flight or blobs removes the
empty ``.checkrun`` folders too (Lightning's tuner saves and removes a temporary checkpoint: the
directory must be as before); where anything is left, nothing of ``.checkrun`` goes."""
from __future__ import annotations

import os

import torch

from ckpt_core import CheckpointEngine


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "step": seed}


def test_removing_the_only_checkpoint_leaves_the_directory_empty(tmp_path):
    run = tmp_path / "run"
    with CheckpointEngine() as engine:
        engine.save(_state(0), run / "a.ckpt").result()
        assert (run / ".checkrun").is_dir()
        engine.remove(run / "a.ckpt")
        report = engine.gc(run, full=False)
        assert report.deleted and report.checkpoints == 0
        assert os.listdir(run) == []
        # a later save makes the folders again
        engine.save(_state(1), run / "b.ckpt").result()
        assert torch.equal(engine.load(run / "b.ckpt")["w"], _state(1)["w"])


def test_a_remaining_checkpoint_keeps_its_folders(tmp_path):
    run = tmp_path / "run"
    with CheckpointEngine() as engine:
        engine.save(_state(0), run / "a.ckpt").result()
        engine.save(_state(1), run / "b.ckpt").result()
        engine.remove(run / "a.ckpt")
        report = engine.gc(run)
        assert report.checkpoints == 1
        assert sorted(os.listdir(run)) == [".checkrun", "b.ckpt"]
        assert torch.equal(engine.load(run / "b.ckpt")["w"], _state(1)["w"])


def test_files_in_checkrun_are_never_removed_with_the_folders(tmp_path):
    """No checkpoint left, but a file of someone's in ``.checkrun`` (an open step log's objects, a
    user's note): only the empty folders go."""
    run = tmp_path / "run"
    with CheckpointEngine() as engine:
        engine.save(_state(0), run / "a.ckpt").result()
        keep = run / ".checkrun" / "steplog" / "kept"
        keep.parent.mkdir(parents=True)
        keep.write_bytes(b"x")
        engine.remove(run / "a.ckpt")
        engine.gc(run)
        assert keep.read_bytes() == b"x"
        assert sorted(os.listdir(run / ".checkrun")) == ["steplog"]
