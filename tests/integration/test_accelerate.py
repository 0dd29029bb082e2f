"""accelerate_ckpt with a real ``accelerate launch``: save, continue, resume in a new process.

Each test runs tests/integration/accel_scripts/train.py twice: run 1 saves after epochs 1 and 2 and
trains on to epoch 4 (the uninterrupted reference); run 2 resumes from the newest committed
checkpoint and trains to epoch 4. Weights, optimizer, scheduler, custom object, RNG streams (python,
numpy, torch, the dataloader's generator), ``accelerator.step`` and the save iteration must equal
the reference bit for bit, on every rank. Config reaches the script both ways: (a) a
``checkpointing:`` section in the accelerate config file through ``accelerate-ckpt launch``, and
(b) ``$CHECKRUN_CONFIG`` with plain ``accelerate launch``. One process on local disk, two
processes on S3 (moto).
"""
from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import yaml

import ckpt_core
from ckpt_core.format import composite
from tests.integration.accel_scripts.harness import (TRAIN, accelerate_args, accelerate_launch, assert_same,
                                                     free_port, launch_env, load_dump)

pytestmark = pytest.mark.slow


def _two_runs(tmp: Path, launch_args, script_extra, env, via="accelerate"):
    """Run 1 (save at epochs 1, 2; continue to 4) then run 2 (resume); return both out dirs."""
    out1, out2 = tmp / "out1", tmp / "out2"
    out1.mkdir(), out2.mkdir()
    common = ["--project-dir", tmp / "project", "--epochs", "4", *script_extra]
    for out, args in ((out1, ["--save-epochs", "1,2"]), (out2, ["--resume"])):
        done = accelerate_launch(launch_args, TRAIN, [*common, "--out", out, *args], env, via)
        (out / "launch.log").write_text(f"{done.stdout}\n--- stderr\n{done.stderr}")
    return out1, out2


def _assert_resumed_exactly(out1: Path, out2: Path, ranks: int) -> tuple[dict, dict]:
    r1 = json.loads((out1 / "report.json").read_text())
    r2 = json.loads((out2 / "report.json").read_text())
    assert r1["num_processes"] == ranks and r2["loaded"] == r1["saved"][-1]
    for rank in range(ranks):
        ref, resumed = load_dump(out1, rank), load_dump(out2, rank)
        assert ref["progress"]["epoch"] == 4 and ref["step"] > 0 and ref["iteration"] == 2
        try:
            assert_same(ref, resumed, f"rank{rank}")
        except AssertionError as exc:  # what both runs logged (retries, warnings) says why
            logs = "\n".join(f"--- {o.name}\n{(o / 'launch.log').read_text()[-6000:]}" for o in (out1, out2))
            raise AssertionError(f"{exc}\n{logs}") from None
    return r1, r2


def _checkpoint_files(fs, root: str) -> tuple[list[str], list[str]]:
    """(checkpoint folders in root holding an index, part file names in root/.checkrun/parts)."""
    fs.invalidate_cache()
    names = lambda d, ok: sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(d, detail=False) if ok(p))  # noqa: E731
    folders = names(root, lambda p: fs.isfile(f"{p}/{composite.INDEX_NAME}"))
    return folders, names(f"{root}/{composite.PARTS_DIR}", fs.isfile)


def test_one_process_env_config_resume_is_exact(tmp_path: Path) -> None:
    """(b) plain accelerate launch + $CHECKRUN_CONFIG; keep_last=1; one process."""
    cfg = tmp_path / "checkrun.yaml"
    cfg.write_text(yaml.safe_dump({"retention": {"keep_last": 1}, "compression": {"zstd_level": 3}}))
    env = launch_env(tmp_path, {"CHECKRUN_CONFIG": str(cfg)})
    out1, out2 = _two_runs(tmp_path, accelerate_args(1), [], env)
    r1, _ = _assert_resumed_exactly(out1, out2, 1)
    root = tmp_path / "project" / "checkpoints"
    assert r1["saved"] == [str(root / "checkpoint_0"), str(root / "checkpoint_1")]
    assert r1["config_source"] == f"$CHECKRUN_CONFIG={cfg}"
    assert r1["config"]["retention"]["keep_last"] == 1 and r1["config"]["compression"]["zstd_level"] == 3
    # keep_last=1: only the newest whole checkpoint (index + its part) is left
    indexes, parts = _checkpoint_files(fsspec.filesystem("file"), str(root))
    assert indexes == ["checkpoint_1"] and sorted(p.name for p in root.iterdir()) == [".checkrun", "checkpoint_1"]
    assert len(parts) == 1 and parts[0].startswith("checkpoint_1.") and parts[0].endswith(".rank0.ckpt")
    # metrics of both saves reached the training thread (blocking time, bytes, ratio)
    hist = r1["history"]
    assert len(hist) == 2 and all(h["checkrun/written_bytes"] > 0 and h["checkrun/blocking_seconds"] >= 0
                                  and h["checkrun/compression_ratio"] > 0 for h in hist)
    with ckpt_core.CheckpointEngine() as engine:
        index = engine.load(str(root / "checkpoint_1" / composite.INDEX_NAME))
        assert index["iteration"] == 2 and index["world_size"] == 1
        assert index["parts"] == [f"../{composite.PARTS_DIR}/{parts[0]}"]
        assert engine.verify(str(root / composite.PARTS_DIR / parts[0])).ok


def _combined_config(tmp: Path, num_processes: int, checkpointing: dict) -> Path:
    path = tmp / "accelerate_checkrun.yaml"
    accel = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
             "num_processes": num_processes, "machine_rank": 0, "main_process_port": free_port(),
             "mixed_precision": "no", "dynamo_config": {}, "rdzv_backend": "static", "same_network": True,
             "use_cpu": False, "gpu_ids": "all", "main_training_function": "main"}
    path.write_text(yaml.safe_dump({**accel, "checkpointing": checkpointing}))
    return path


@pytest.mark.s3
def test_two_processes_on_s3_combined_config_resume_is_exact(tmp_path: Path, s3_root: str,
                                                             s3_storage_options: dict) -> None:
    """(a) accelerate-ckpt launch --config_file with a checkpointing: section naming an s3:// directory;
    two gloo processes; the moto endpoint reaches the script as an argument."""
    cfg = _combined_config(tmp_path, 2, {"retention": {"keep_last": 5}, "saving": {"max_pending": 2},
                                         "accelerate": {"directory": s3_root}})
    extra = ["--storage-options", json.dumps(s3_storage_options)]
    out1, out2 = _two_runs(tmp_path, ["--config_file", cfg], extra, launch_env(tmp_path), via="accelerate-ckpt")
    r1, _ = _assert_resumed_exactly(out1, out2, 2)
    assert r1["distributed_type"].endswith("MULTI_CPU")  # Accelerator(cpu=True) under --multi_gpu: gloo DDP
    assert r1["config_source"].startswith("$CHECKRUN_CONFIG=") and r1["config"]["saving"]["max_pending"] == 2
    assert r1["saved"] == [f"{s3_root}/checkpoint_0", f"{s3_root}/checkpoint_1"]
    assert not (tmp_path / "project" / "checkpoints").exists()  # nothing went to the local project dir
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **s3_storage_options)
    indexes, parts = _checkpoint_files(fs, s3_root)
    assert indexes == ["checkpoint_0", "checkpoint_1"]
    # replicated state written once (rank 0's part), per-rank state kept per rank
    assert sorted(p.rsplit(".", 2)[1] for p in parts) == ["rank0", "rank0", "rank1", "rank1"]
    with ckpt_core.CheckpointEngine({"storage": {"storage_options": s3_storage_options}}) as engine:
        index_url = f"{s3_root}/checkpoint_1/{composite.INDEX_NAME}"
        index = engine.load(index_url)
        assert index["world_size"] == 2 and index["iteration"] == 2
        rank0, rank1 = (engine.load(p) for p in composite.part_urls(index_url, index))
        assert set(rank0) == {"rank", "replicated"} and set(rank1) == {"rank"}
        assert rank0["rank"]["rank"] == 0 and rank1["rank"]["rank"] == 1
        assert len(rank0["replicated"]["models"]) == 2 and len(rank0["replicated"]["custom"]) == 1
