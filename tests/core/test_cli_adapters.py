"""``checkrun ls/inspect/verify/export/diff`` see through adapter layouts (issue 19, point 8).

An Accelerate checkpoint is an index (``checkpoint_N/checkrun.ckpt``, plain data, no tensor) naming one
part per rank. Every command must show and check the parts' real content, given the folder, the index
or the checkpoints directory, and an earlier release's layout (``ROOT/checkpoint_N.ckpt`` + ``ROOT/parts``)
too; a part that is gone or corrupt is a problem, never ``OK``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckpt_core
from ckpt_core.format import composite
from ckpt_core.cli import main

accelerate = pytest.importorskip("accelerate")


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main([*map(str, argv), "--no-progress"])
    return code, capsys.readouterr().out


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code, out = run(capsys, *argv, "--json")
    return code, json.loads(out)


class _Run(tuple):
    """(root, [folders], [weights at each save]); ``history``: the checkpointer's metrics per save."""

    history: list[dict]


@pytest.fixture
def accel_run(tmp_path: Path):
    """Two checkpoints of a real Accelerator (synchronous saves): (root, [folders], [weights at each save])."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from accelerate_ckpt import attach

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(str(tmp_path / "proj"),
                                                                    automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ckpt = attach(acc, {"saving": {"asynchronous": False}})
    folders, weights = [], []
    for _ in range(2):
        acc.backward(model(torch.randn(3, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        folders.append(str(acc.save_state()))
    ckpt.close()
    run_ = _Run((tmp_path / "proj" / "checkpoints", folders, weights))
    run_.history = list(ckpt.history)
    yield run_
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _part_tensors(index_url: str) -> int:
    with ckpt_core.CheckpointEngine() as engine:
        index = engine.load(index_url)
        return sum(len(engine.read_manifest(p).tensors) for p in composite.part_urls(index_url, index))


def test_inspect_and_ls_show_the_parts_content(capsys, accel_run) -> None:
    root, folders, _ = accel_run
    index = f"{folders[1]}/{composite.INDEX_NAME}"
    expected = _part_tensors(index)
    assert expected > 0
    for arg in (folders[1], index, root):  # the folder, its index, the directory (its newest)
        code, data = run_json(capsys, "inspect", arg)
        assert code == 0 and data["tensors"] == expected and data["tensor_bytes"] > 0, arg
        assert len(data["parts"]) == 1 and data["meta"]["iteration"] == 2
        assert "parts.0.replicated.models.0.0.weight" in {n["path"] for n in data["tree"]}
    code, text = run(capsys, "inspect", folders[1])
    assert code == 0 and f"tensors     {expected}:" in text and "parts.0" in text
    code, data = run_json(capsys, "ls", root)
    assert code == 0 and [r["name"] for r in data["checkpoints"]] == ["checkpoint_0/", "checkpoint_1/"]
    assert all(r["tensors"] == expected and r["status"] == "committed" and len(r["parts"]) == 1
               for r in data["checkpoints"])
    assert data["totals"]["logical_bytes"] > 0 and data["totals"]["unreferenced_bytes"] == 0
    # WROTE of a composite: what its save wrote over all parts, index included (the adapter's figure)
    history = accel_run.history
    assert [r["written_bytes"] for r in data["checkpoints"]] == [m["checkrun/written_bytes"] for m in history]
    assert [r["referenced_bytes"] for r in data["checkpoints"]] == [m["checkrun/stored_bytes"] for m in history]
    code, data = run_json(capsys, "ls", folders[0])
    assert code == 0 and len(data["checkpoints"]) == 1 and data["checkpoints"][0]["tensors"] == expected
    code, text = run(capsys, "ls", root, "--verify")
    assert code == 0 and "2 checkpoint(s), 0 corrupt" in text


def test_verify_checks_every_part_and_never_says_ok_for_nothing(capsys, accel_run, tmp_path: Path) -> None:
    root, folders, _ = accel_run
    code, data = run_json(capsys, "verify", root)
    assert code == 0 and data["ok"] and len(data["checkpoints"]) == 2
    assert all(c["blobs_checked"] > 0 and len(c["parts"]) == 1 for c in data["checkpoints"])
    code, text = run(capsys, "verify", folders[1])
    assert code == 0 and "1 part(s)" in text and "1 intact, 0 corrupt" in text
    # a blob of the parts corrupted: both checkpoints that need it are CORRUPT
    blobs = sorted((root / composite.PARTS_DIR / ".checkrun" / "blobs").rglob("*"))
    victim = next(b for b in blobs if b.is_file())
    data_bytes = bytearray(victim.read_bytes())
    data_bytes[-1] ^= 0xFF
    victim.write_bytes(bytes(data_bytes))
    code, text = run(capsys, "verify", root)
    assert code == 1 and "CORRUPT" in text and "0 corrupt" not in text
    # a part that is gone: the index alone is not a checkpoint
    index = f"{folders[0]}/{composite.INDEX_NAME}"
    with ckpt_core.CheckpointEngine() as engine:
        (part,) = composite.part_urls(index, engine.load(index))
    os.remove(part)
    code, text = run(capsys, "verify", index)
    assert code == 1 and "CORRUPT" in text and "OK " not in text
    assert run(capsys, "export", folders[0], tmp_path / "x.pt")[0] == 1 and not (tmp_path / "x.pt").exists()
    assert run(capsys, "inspect", folders[0])[0] == 1
    # nothing to check at all: not OK either (an empty directory, a folder a crashed save left)
    (tmp_path / "empty").mkdir()
    (root / "checkpoint_7").mkdir()
    for path in (tmp_path / "empty", root / "checkpoint_7"):
        code, text = run(capsys, "verify", path)
        assert code == 1 and "OK" not in text


def test_export_and_diff_use_the_parts(capsys, accel_run, tmp_path: Path) -> None:
    root, folders, weights = accel_run
    out = tmp_path / "ckpt1.pt"
    code, text = run(capsys, "export", folders[1], out)
    assert code == 0 and "0 tensors" not in text
    state = torch.load(out, weights_only=True)
    assert state["checkpoint"]["iteration"] == 2 and len(state["parts"]) == 1
    saved = state["parts"][0]["replicated"]["models"][0]
    assert set(saved) == set(weights[1]) and all(torch.equal(saved[k], weights[1][k]) for k in saved)
    code, _ = run(capsys, "export", folders[1], tmp_path / "ckpt1.safetensors")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "ckpt1.safetensors")["parts.0.replicated.models.0.0.weight"],
                       weights[1]["0.weight"])
    code, data = run_json(capsys, "diff", folders[0], folders[1])
    assert code == 0 and not data["identical"] and data["counts"]["changed"] > 0
    changed = {t["key"] for t in data["tensors"] if t["status"] == "changed"}
    assert "parts.0.replicated.models.0.0.weight" in changed
    assert {"key": "checkpoint.iteration", "status": "changed", "a": 1, "b": 2} in data["values"]


def test_earlier_release_index_is_read_through(capsys, tmp_path: Path) -> None:
    """``ROOT/checkpoint_0.ckpt`` (index format 1) naming ``ROOT/parts/...``: before, 0 tensors and OK."""
    root = tmp_path / "ckpts"
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with ckpt_core.CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        engine.save({"rank": {"rank": 0, "rng": {"torch": torch.get_rng_state()}},
                     "replicated": {"models": [{"w": weight}], "step": 3}}, str(root / "parts" / "c0.x-0.rank0.ckpt"))
        engine.save({"accelerate_ckpt": 1, "name": "checkpoint_0", "parts": ["parts/c0.x-0.rank0.ckpt"],
                     "world_size": 1, "step": 3, "iteration": 1}, str(root / "checkpoint_0.ckpt"))
    index = root / "checkpoint_0.ckpt"
    code, data = run_json(capsys, "inspect", index)
    assert code == 0 and data["tensors"] == 2 and data["parts"] == [str(root / "parts" / "c0.x-0.rank0.ckpt")]
    code, data = run_json(capsys, "verify", index)
    assert code == 0 and data["checkpoints"][0]["blobs_checked"] >= 2
    code, data = run_json(capsys, "ls", root)
    assert [(r["name"], r["tensors"], r["step"]) for r in data["checkpoints"]] == [("checkpoint_0.ckpt", 2, 3)]
    code, _ = run(capsys, "export", index, tmp_path / "old.pt")
    assert code == 0
    assert torch.equal(torch.load(tmp_path / "old.pt")["parts"][0]["replicated"]["models"][0]["w"], weight)
    os.remove(root / "parts" / "c0.x-0.rank0.ckpt")
    code, data = run_json(capsys, "verify", root)
    assert code == 1 and not data["ok"]


def test_gc_of_checkpoint_folders_removes_the_parts_of_a_folder_deleted_by_hand(capsys, accel_run) -> None:
    """``rm -rf checkpoints/checkpoint_0`` (how accelerate users prune by hand) left that checkpoint's
    part in ``.checkrun/parts``, referencing its blobs: ``checkrun gc checkpoints`` freed nothing, ever.
    Now gc removes the parts no index lists once an hour old (a younger one may belong to a save in
    flight on another rank), then collects the parts' blobs; the other checkpoint still loads."""
    import shutil
    import time

    root, folders, weights = accel_run
    shutil.rmtree(folders[0])
    parts = root / ".checkrun" / "parts"
    orphan = [p for p in parts.iterdir() if p.name.startswith("checkpoint_0.")]
    assert len(orphan) == 1
    code, out = run_json(capsys, "gc", root)  # young: kept
    assert code == 0 and out["orphaned_parts"] == [] and orphan[0].exists()
    old = time.time() - 7200
    os.utime(orphan[0], (old, old))
    code, dry = run_json(capsys, "gc", root, "--dry-run")
    assert code == 0 and dry["orphaned_parts"] == [orphan[0].name] and orphan[0].exists()
    code, out = run_json(capsys, "gc", root)
    assert code == 0 and out["orphaned_parts"] == [orphan[0].name] and not orphan[0].exists()
    assert out["deleted_blobs"] > 0 and out["freed_bytes"] > 0
    # the dry run reported the parts' blobs too (h132: 0 blobs, then the real run deleted some)
    assert (dry["deleted_blobs"], dry["freed_bytes"]) == (out["deleted_blobs"], out["freed_bytes"])
    code, out = run_json(capsys, "verify", root)
    assert code == 0 and len(out["checkpoints"]) == 1 and out["checkpoints"][0]["ok"]


def test_a_directory_of_checkpoint_folders_resolves_to_its_newest_intact_one(capsys, accel_run, tmp_path: Path) -> None:
    """``checkrun export checkpoints out.pt`` with a rotted blob in the newest checkpoint failed on its
    checksum, where a plain directory falls back to the next older intact checkpoint (cli.md: "its
    newest intact checkpoint is used"). Now folders are verified as ``latest()`` verifies files."""
    root, folders, weights = accel_run
    with ckpt_core.CheckpointEngine() as engine:
        def blobs(folder: str) -> set[str]:
            index_url = str(Path(folder) / composite.INDEX_NAME)
            index = engine.load(index_url)
            return {b.key for p in composite.part_urls(index_url, index) for b in engine.read_manifest(p).blobs()}
        only_newest = sorted(blobs(folders[1]) - blobs(folders[0]))
    assert only_newest
    path = root / ".checkrun" / "parts" / ".checkrun" / "blobs" / only_newest[0][:2] / only_newest[0][2:]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    out = tmp_path / "newest_intact.pt"
    code, _ = run(capsys, "export", root, out)
    assert code == 0
    state = torch.load(out, weights_only=True)
    saved = state["parts"][0]["replicated"]["models"][0]
    assert state["checkpoint"]["iteration"] == 1 and all(torch.equal(saved[k], weights[0][k]) for k in saved)


def test_ls_dates_a_folder_with_a_damaged_index_by_its_file(capsys, accel_run) -> None:
    """A truncated ``checkrun.ckpt`` made its folder's row say 1970-01-01 and come first; it is dated
    by its index file now, as a damaged plain manifest is."""
    root, folders, _ = accel_run
    index = Path(folders[1]) / composite.INDEX_NAME
    index.write_bytes(index.read_bytes()[:40])
    code, data = run_json(capsys, "ls", root)
    assert code == 1
    rows = {r["name"]: r for r in data["checkpoints"]}
    bad, good = rows["checkpoint_1/"], rows["checkpoint_0/"]
    assert bad["mtime"] == bad["created"] == os.stat(index).st_mtime and bad["manifest_bytes"] == 40
    assert [r["name"] for r in data["checkpoints"]] == ["checkpoint_0/", "checkpoint_1/"] and good["created"] > 0


@pytest.mark.parametrize("cwd, arg", [("checkpoints", "checkpoint_0/checkrun.ckpt"), ("checkpoints", "checkpoint_0"),
                                      ("checkpoint_0", "checkrun.ckpt"), ("checkpoint_0", ".")])
def test_a_relative_path_of_one_or_two_components_finds_the_parts(capsys, accel_run, monkeypatch, cwd, arg) -> None:
    """From inside the checkpoints folder (or a checkpoint folder), a short relative path: the parts
    were looked for at ``/.checkrun/parts`` (the parent of ``checkpoint_0`` was ``""``)."""
    root, folders, _ = accel_run
    monkeypatch.chdir(root if cwd == "checkpoints" else folders[0])
    code, text = run(capsys, "verify", arg)
    assert code == 0 and "1 intact, 0 corrupt" in text, text
    code, text = run(capsys, "inspect", arg)
    assert code == 0 and "parts       1: " in text and "tensors     " in text, text


def test_parent_of_relative_and_remote_paths() -> None:
    assert [composite.parent(p) for p in ("ckpt", ".", "..", "a/b/", "/a", "/", "s3://b", "s3://b/k/x")] == \
        [".", "..", "../..", "a", "/", "/", "s3://b", "s3://b/k"]
