"""Drop-in: unchanged Accelerate scripts keep their habits with checkrun attached (issue 19, points 2, 6,
7, 9). The folder naming is checked against accelerate's own ``save_state`` in real ``accelerate
launch`` runs (1 process, and 2 CPU processes); the rest runs in-process with real Accelerators.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration
from torch import nn

import ckpt_core
from accelerate_ckpt import attach
from ckpt_core.format import composite
from ckpt_core.saving import inflight
from ckpt_core.testing.faults import FaultFS as FaultyFS
from tests.integration.accel_scripts.harness import BIN, HERE, REPO, accelerate_args, accelerate_launch, launch_env

DROPIN = HERE / "dropin.py"
WAIT_LIMIT = 300  # hang protection only; nothing asserts on time


# -- real accelerate launch: folder naming, load_state(folder), load_state(), total_limit -------------
def _launch(tmp: Path, name: str, processes: int, *extra: str) -> list[dict]:
    out = tmp / f"out-{name}"
    out.mkdir()
    accelerate_launch(accelerate_args(processes), DROPIN,
                      ["--project-dir", tmp / f"proj-{name}", "--out", out, *extra], launch_env(tmp))
    return [json.loads((out / f"report_rank{r}.json").read_text()) for r in range(processes)]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_unchanged_script_names_loads_and_prunes_like_accelerate(tmp_path: Path, processes: int) -> None:
    native = _launch(tmp_path, "native", processes, "--native")
    ours = _launch(tmp_path, "checkrun", processes)
    for rank, (n, c) in enumerate(zip(native, ours)):
        assert c["world"] == processes and c["rank"] == rank
        # the paths save_state returns are the folders accelerate itself names, there right after the call
        expected = [str(tmp_path / "proj-checkrun" / "checkpoints" / f"checkpoint_{i}") for i in range(4)]
        assert c["saved"] == expected
        assert [p.replace("proj-native", "proj-checkrun") for p in n["saved"]] == expected
        assert c["existed"] == n["existed"] == [True] * 4 and c["types"] == n["types"]
        # load_state(absolute folder) straight after save_state, load_state(relative), load_state()
        assert n["loads"] == c["loads"] == {"absolute": True, "relative": True, "newest": True}
        # total_limit=2: the same folders are left; the only extra entry is checkrun's hidden .checkrun/
        assert n["listing"] == ["checkpoint_2", "checkpoint_3"]
        assert c["listing"] == [".checkrun", "checkpoint_2", "checkpoint_3"]
        assert c["final_weights"] == n["final_weights"]


@pytest.mark.slow
@pytest.mark.parametrize("stop, how", [(3, ""), (11, ""), (8, ""), (8, "--finish-epoch"), (8, "--skip-zero")],
                         ids=["first-epoch", "second-epoch", "last-batch-then-next-epoch", "last-batch-skipped-again",
                              "last-batch-then-skip-0"])
def test_a_resume_in_the_middle_of_an_epoch_trains_on_the_interrupted_runs_batches(tmp_path: Path, stop: int,
                                                                                   how: str) -> None:
    """2 processes, a shuffled DataLoader (accelerate's synchronized generator), save_state() after batch
    ``stop``, a fresh launch: load_state() + skip_first_batches continue with the batches and weights of
    the uninterrupted run. Before, the generator was saved after the epoch had drawn its order: the
    resumed epoch drew the next epoch's (samples repeated and skipped; accelerate itself is exact in the
    first epoch). It is now saved as of the epoch's start (accelerate: wrong from the second epoch on).
    Saved on an epoch's last batch (8), the three resumes are right: starting the next epoch, skipping the
    whole finished epoch first, or the next epoch through ``skip_first_batches(loader, 0)`` as accelerate's
    examples do (before 2026-12-07 the second drew every later epoch's order one epoch ahead, the third
    one epoch behind: found by independent checks)."""
    script = HERE / "mid_epoch.py"

    def launch(phase: str, project: str) -> list[dict]:
        out = tmp_path / f"out-{phase}-{project}"
        out.mkdir()
        accelerate_launch(accelerate_args(2), script, [phase, "--project-dir", tmp_path / project, "--out", out,
                                                        "--stop", str(stop)] + ([how] if how else []),
                          launch_env(tmp_path))
        return [json.loads((out / f"seen_rank{r}.json").read_text()) for r in range(2)] if phase != "first" else []

    full = launch("full", "full")
    launch("first", "run")
    resumed = launch("resume", "run")
    assert resumed == full


@pytest.mark.slow
def test_fresh_process_resumes_with_load_state_and_no_argument(tmp_path: Path) -> None:
    first = _launch(tmp_path, "run", 1, "--saves", "3")
    out = tmp_path / "out-resume"
    out.mkdir()
    accelerate_launch(accelerate_args(1), DROPIN, ["--project-dir", tmp_path / "proj-run", "--out", out, "--resume"],
                      launch_env(tmp_path))
    again = json.loads((out / "report_rank0.json").read_text())
    assert again["resumed_weights"] == first[0]["final_weights"]  # the newest: checkpoint_2, loaded last
    assert again["listing"] == [".checkrun", "checkpoint_1", "checkpoint_2"]


@pytest.mark.slow
def test_a_rerun_into_the_same_project_is_refused_on_every_rank_like_accelerate(tmp_path: Path) -> None:
    """Rerunning the script without load_state(): accelerate raises ValueError at the first
    save_state (checkpoint_0 exists); checkrun raised nothing and replaced the earlier run's
    checkpoints. Now every rank raises before any writes, and the earlier checkpoints stay."""
    first = _launch(tmp_path, "run", 2, "--saves", "2")
    listing = sorted(os.listdir(tmp_path / "proj-run" / "checkpoints"))
    before = {p: p.read_bytes() for p in (tmp_path / "proj-run" / "checkpoints").rglob("*") if p.is_file()}
    out = tmp_path / "out-rerun"
    out.mkdir()
    with pytest.raises(AssertionError) as failed:  # the launch fails (not hangs): both ranks raised
        accelerate_launch(accelerate_args(2), DROPIN, ["--project-dir", tmp_path / "proj-run", "--out", out,
                                                       "--saves", "2"], launch_env(tmp_path))
    message = str(failed.value)
    assert "still ran after" not in message
    assert message.count("CheckpointExistsError") >= 2 and "checkpoint_0 or a later checkpoint_N already exists" in message
    assert sorted(os.listdir(tmp_path / "proj-run" / "checkpoints")) == listing
    after = {p: p.read_bytes() for p in (tmp_path / "proj-run" / "checkpoints").rglob("*") if p.is_file()}
    assert after == before
    assert first[0]["final_weights"] == first[1]["final_weights"]


@pytest.mark.slow
def test_save_state_on_the_main_process_only_commits_and_resumes(tmp_path: Path) -> None:
    """diffusers' scripts call save_state() under `if accelerator.is_main_process`. Rank 0 waited
    for rank 1's part in a collective forever, and its next save_state blocked the DDP step that
    rank 1 waited in: both hung. Now rank 0 commits its part alone once rank 1 has not started
    saving within participation_timeout_seconds, and a 2-process load_state resumes it."""
    out = tmp_path / "out"
    out.mkdir()
    script = HERE / "main_only.py"
    accelerate_launch(accelerate_args(2), script, ["save", "--out", out], launch_env(tmp_path))
    saved = torch.load(out / "report.pt")
    assert sorted(saved) == ["step1", "step3", "step5"]
    for name in saved:
        index = ckpt_core.load(str(out / name / "checkrun.ckpt"))
        assert len(index["parts"]) == 1 and index["world_size"] == 1  # rank 0's part: rank 1 never saved
    accelerate_launch(accelerate_args(2), script, ["resume", "--out", out], launch_env(tmp_path))
    for rank in range(2):
        resumed = torch.load(out / f"resumed_rank{rank}.pt")
        assert list(resumed) == list(saved["step5"])
        assert all(torch.equal(resumed[k], saved["step5"][k]) for k in resumed), f"rank {rank}"


@pytest.mark.slow
def test_a_rank_whose_save_state_raises_fails_the_checkpoint_on_every_rank(tmp_path: Path) -> None:
    """A save hook raises inside save_state() on one rank. Rank 1's: rank 0 must not commit that
    checkpoint without rank 1's part once participation_timeout_seconds (10 s) have passed; it fails on
    rank 0 too. Rank 0's: rank 1's helper must not wait for a verdict until collective_timeout_seconds
    (30 s here, it then says "no verdict"); it gets rank 0's failure."""
    out = tmp_path / "out"
    out.mkdir()
    accelerate_launch(accelerate_args(2), HERE / "main_only.py", ["hookfail", "--out", out], launch_env(tmp_path))
    r0, r1 = (json.loads((out / f"hookfail_rank{r}.json").read_text()) for r in range(2))
    assert r0["raised"] == ["bad0: hook failed on rank 0"] and r1["raised"] == ["bad1: hook failed on rank 1"]
    (w0,), (w1,) = r0["wait"], r1["wait"]
    assert w0.startswith("bad1: ") and "rank 1 did not save its part: RuntimeError: hook failed on rank 1" in w0
    assert w1.startswith("bad0: ") and "rank 0 did not save its part: RuntimeError: hook failed on rank 0" in w1
    assert not (out / "bad1" / "checkrun.ckpt").exists() and not (out / "bad0" / "checkrun.ckpt").exists()
    assert len(ckpt_core.load(str(out / "good" / "checkrun.ckpt"))["parts"]) == 2


@pytest.mark.slow
def test_ranks_saving_into_folders_of_their_own_get_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    """Each rank passes its own folder to save_state(), then loads it (accelerate's own
    test_stateful_dataloader_save_state does: a TemporaryDirectory per rank). Rank 0 commits its folder
    with its part alone (a rank that did not start the same save within the participation window is left
    out, as for main-process-only saves); before, rank 1 then waited collective_timeout_seconds (30 min by
    default) for a verdict on its folder while rank 0 waited for it in the load (found by running
    Accelerate's own tests with checkrun attached). Now rank 0's load first fails rank 1's stray save."""
    out = tmp_path / "out"
    out.mkdir()
    accelerate_launch(accelerate_args(2), HERE / "main_only.py", ["perrank", "--out", out], launch_env(tmp_path))
    error = json.loads((out / "perrank_rank1.json").read_text())["load"]
    assert error.startswith("BackgroundSaveError: ") and "rank 0 did not save it (it loads" in error, error
    assert "every rank must pass the same folder to save_state()" in error
    assert (out / "rank0" / "checkrun.ckpt").exists() and not (out / "rank1" / "checkrun.ckpt").exists()


@pytest.mark.slow
def test_an_all_rank_save_after_a_main_process_only_one_names_every_rank_s_part(tmp_path: Path) -> None:
    """Rank 0 saves alone (``if is_main_process: save_state()``), then every rank saves and loads. The part
    names held a per-rank save counter, which rank 0's lone save moved on: rank 0's index named a rank-1
    part nobody wrote, the checkpoint committed without an error and did not load on rank 1 (found by an
    independent check). The index now names each part as its rank wrote it."""
    out = tmp_path / "out"
    out.mkdir()
    accelerate_launch(accelerate_args(2), HERE / "main_only.py", ["mainthenall", "--out", out], launch_env(tmp_path))
    assert [json.loads((out / f"mainthenall_rank{r}.json").read_text())["error"] for r in range(2)] == [None, None]
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.verify(out / "s2" / "checkrun.ckpt").ok
    assert len(ckpt_core.load(str(out / "s2" / "checkrun.ckpt"))["parts"]) == 2


def test_a_rerun_refuses_a_folder_accelerate_itself_wrote_and_resuming_continues(tmp_path: Path) -> None:
    from accelerate_ckpt import CheckpointExistsError

    acc, model, opt = _accelerator(tmp_path / "proj")
    native = acc.save_state()  # accelerate's own: checkpoint_0
    acc.end_training()
    written = {p.name: p.read_bytes() for p in Path(native).iterdir()}
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, opt = _accelerator(tmp_path / "proj", seed=1)
    with attach(acc) as ckpt:
        with pytest.raises(CheckpointExistsError, match="checkpoint_0 or a later checkpoint_N already exists") as err:
            acc.save_state()
        assert isinstance(err.value, ValueError)  # what code written for accelerate catches
        assert {p.name: p.read_bytes() for p in Path(native).iterdir()} == written  # untouched
        acc.project_configuration.iteration = 1  # accelerate's documented way out
        _train(acc, model, opt)
        saved = _weights(acc, model)
        assert Path(acc.save_state()).name == "checkpoint_1"
        _train(acc, model, opt)
        assert Path(acc.save_state()).name == "checkpoint_2"
        acc.load_state(str(tmp_path / "proj" / "checkpoints" / "checkpoint_1"))
        assert _same(_weights(acc, model), saved)
        assert Path(acc.save_state()).name == "checkpoint_3"  # the iteration never goes back, as accelerate's
        ckpt.wait()


def test_a_rerun_with_total_limit_is_refused_before_it_prunes_the_earlier_run(tmp_path: Path) -> None:
    """With ``total_limit=2`` the earlier run left ``checkpoint_1`` and ``checkpoint_2``. The rerun's
    first save (``checkpoint_0``, gone) passed the check of its own folder, and retention then pruned
    the earlier run's folders as the oldest: no error, nothing of the earlier run left (accelerate
    raises at its third save, after pruning ``checkpoint_1``). Now the first save raises: a folder
    numbered at or above the one about to be written is an earlier run's."""
    from accelerate_ckpt import CheckpointExistsError

    def project(seed: int) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True, total_limit=2))
        torch.manual_seed(seed)
        model = nn.Linear(4, 2)
        return acc, *acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

    acc, model, opt = project(0)
    with attach(acc):
        for _ in range(3):
            _train(acc, model, opt)
            acc.save_state()
        earlier = _weights(acc, model)
    checkpoints = tmp_path / "proj" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == [".checkrun", "checkpoint_1", "checkpoint_2"]
    acc, model, opt = project(1)
    with attach(acc) as ckpt:
        with pytest.raises(CheckpointExistsError, match="checkpoint_0 or a later checkpoint_N already exists"):
            acc.save_state()
        assert sorted(os.listdir(checkpoints)) == [".checkrun", "checkpoint_1", "checkpoint_2"]
        acc.load_state()  # the documented way on: resume, then the numbering continues
        assert _same(_weights(acc, model), earlier)
        assert Path(acc.save_state()).name == "checkpoint_3"
        ckpt.wait()


def test_checkpoints_accelerate_wrote_before_attaching_still_load(tmp_path: Path) -> None:
    """The one attach() line added to a project whose checkpoints accelerate itself wrote: load_state()
    (and latest()) find the newest of them and accelerate's own loader restores it; naming continues
    after it, and checkrun's later checkpoints win. ``fallback_to_accelerate: false`` refuses."""
    from accelerate_ckpt import CheckpointExistsError

    acc, model, opt = _accelerator(tmp_path / "proj")
    natives = []
    for _ in range(2):
        _train(acc, model, opt)
        natives.append((str(acc.save_state()), _weights(acc, model)))  # accelerate's own save_state
    acc.end_training()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, opt = _accelerator(tmp_path / "proj", seed=1)
    with attach(acc) as ckpt:
        assert ckpt.latest() == natives[1][0]
        assert acc.load_state(natives[0][0]) == natives[0][0]
        assert _same(_weights(acc, model), natives[0][1])
        with pytest.raises(CheckpointExistsError, match="checkpoint_1 holds a checkpoint accelerate's own save_state"):
            acc.save_state()  # never over a folder accelerate wrote (accelerate raises there too)
        assert acc.load_state() == natives[1][0]
        assert _same(_weights(acc, model), natives[1][1])
        _train(acc, model, opt)
        mine = _weights(acc, model)
        assert Path(acc.save_state()).name == "checkpoint_2"  # naming continues after the one loaded
        _train(acc, model, opt)
        assert acc.load_state() == str(tmp_path / "proj" / "checkpoints" / "checkpoint_2")  # checkrun's, newest
        assert _same(_weights(acc, model), mine)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, opt = _accelerator(tmp_path / "proj2")
    acc.save_state()
    with attach(acc, {"accelerate": {"fallback_to_accelerate": False}}) as ckpt:
        assert ckpt.latest() is None
        with pytest.raises(ckpt_core.CheckpointNotFoundError):
            acc.load_state()


def test_a_folder_of_the_users_own_does_not_stop_saving_after_loading_accelerates_checkpoint(tmp_path: Path) -> None:
    """checkpoints/checkpoint_9 holds only the user's notes: after load_state() of accelerate's own
    checkpoint_1 the next save_state() was refused ("resume with load_state() first", which the user had
    just done), where accelerate saves checkpoint_2 (found by an independent check)."""
    acc, model, opt = _accelerator(tmp_path / "proj")
    for _ in range(2):
        acc.save_state()  # accelerate's own: checkpoint_0, checkpoint_1
    acc.end_training()
    notes = tmp_path / "proj" / "checkpoints" / "checkpoint_9" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, opt = _accelerator(tmp_path / "proj")
    with attach(acc):
        assert Path(acc.load_state()).name == "checkpoint_1"
        assert Path(acc.save_state()).name == "checkpoint_2"
    assert notes.read_text() == "mine"


def test_save_state_into_a_folder_accelerate_wrote_replaces_its_files(tmp_path: Path) -> None:
    """``save_state(output_dir)`` into a folder accelerate's own save_state wrote (a script re-saving
    ``step_8``): accelerate overwrites its files there; checkrun's commit removes them, so the folder
    holds one checkpoint (before: checkrun's beside accelerate's older one, which plain accelerate
    then loaded)."""
    folder = tmp_path / "step_8"
    acc, model, opt = _accelerator()
    _train(acc, model, opt)
    acc.save_state(str(folder))  # accelerate's own
    assert any(p.name.endswith(".safetensors") for p in folder.iterdir())
    with attach(acc) as ckpt:
        _train(acc, model, opt)
        mine = _weights(acc, model)
        acc.save_state(str(folder))
        ckpt.wait()
        assert sorted(p.name for p in folder.iterdir()) == [".checkrun", composite.INDEX_NAME]
        _train(acc, model, opt)
        acc.load_state(str(folder))
        assert _same(_weights(acc, model), mine)


@pytest.mark.parametrize("first", ["checkrun", "accelerate"])
def test_files_a_save_hook_rewrites_in_a_reused_folder_are_kept(tmp_path: Path, first: str) -> None:
    """The transformers/diffusers habit: a save hook writes the model itself with ``save_pretrained``
    (``model.safetensors``, ``config.json``) and pops it from ``weights``, and the script saves to one
    fixed ``output_dir`` every time. The second save found the first one's ``model.safetensors``,
    took it for accelerate's own (replaced by checkrun's commit) and removed it at the commit, after
    the hook had rewritten it: the model was gone. Now a folder checkrun saved into has no leftovers
    of accelerate's, and in a folder accelerate's own save_state wrote (``first="accelerate"``), only
    files unchanged since the save began are (a file written during the save is the hook's)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "output"
    acc, model, opt = _accelerator()

    def save_pretrained(models, weights, output_dir):
        save_file({k: v.contiguous() for k, v in acc.unwrap_model(models[0]).state_dict().items()},
                  os.path.join(output_dir, "model.safetensors"))
        Path(output_dir, "config.json").write_text("{}")
        weights.pop()

    acc.register_save_state_pre_hook(save_pretrained)
    _train(acc, model, opt)
    if first == "accelerate":
        acc.save_state(str(folder))
        assert "optimizer.bin" in os.listdir(folder)
    with attach(acc) as ckpt:
        for _ in range(1 if first == "accelerate" else 2):
            _train(acc, model, opt)
            acc.save_state(str(folder))
            ckpt.wait()
        mine = _weights(acc, model)
        assert sorted(p.name for p in folder.iterdir()) == [".checkrun", composite.INDEX_NAME, "config.json",
                                                            "model.safetensors"]
        saved = load_file(folder / "model.safetensors")
        assert sorted(saved) == sorted(mine) and all(torch.equal(saved[k], mine[k]) for k in mine)


def test_user_files_in_the_output_dir_are_kept_and_hooks_get_the_path_as_passed(tmp_path: Path) -> None:
    """``save_state(Path)`` into a folder holding the user's own files: only the names accelerate's
    own save_state writes (and overwrites) count as its leftovers; ``model_best.pt``, ``optimizer.pt``
    or a sharded ``model-00001-of-00002.safetensors`` were removed at the commit (they matched
    accelerate's prefixes and suffixes). The save hooks get the folder as passed: a ``pathlib.Path``
    (a hook doing ``output_dir / "ema"`` failed on the ``str`` it got)."""
    folder = tmp_path / "output"
    folder.mkdir()
    mine = ["model_best.pt", "optimizer.pt", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
            "README.md"]
    for name in mine:
        (folder / name).write_text("the user's")
    acc, model, opt = _accelerator()
    seen = []
    acc.register_save_state_pre_hook(lambda models, weights, output_dir: seen.append(output_dir))
    with attach(acc) as ckpt:
        acc.save_state(folder)
        ckpt.wait()
    assert seen == [folder] and isinstance(seen[0], Path)
    assert sorted(p.name for p in folder.iterdir()) == sorted([".checkrun", composite.INDEX_NAME, *mine])


def test_save_model_then_save_state_into_one_folder_keeps_the_model_file(tmp_path: Path) -> None:
    """``accelerator.save_model(model, out)`` (the weights for inference) then ``save_state(out)``:
    accelerate overwrites ``model.safetensors`` with the same weights; checkrun took it for a
    leftover of accelerate's own save_state and removed it at the commit. A folder counts as
    accelerate's checkpoint only with the RNG states every save_state writes."""
    from safetensors.torch import load_file

    out = tmp_path / "out"
    acc, model, opt = _accelerator()
    _train(acc, model, opt)
    with attach(acc) as ckpt:
        acc.save_model(model, out)
        acc.save_state(out)
        ckpt.wait()
    assert sorted(p.name for p in out.iterdir()) == [".checkrun", composite.INDEX_NAME, "model.safetensors"]
    saved, mine = load_file(out / "model.safetensors"), _weights(acc, model)
    assert sorted(saved) == sorted(mine) and all(torch.equal(saved[k], mine[k]) for k in mine)


def test_load_state_of_a_missing_folder_raises_what_accelerate_raises(tmp_path: Path) -> None:
    """accelerate's ``load_state`` raises ``ValueError`` for a folder that does not exist; a script
    that catches it (to start fresh) must still catch checkrun's error, which stays a
    ``FileNotFoundError`` (``CheckpointNotFoundError``) as before."""
    from accelerate_ckpt import NoCheckpointError

    acc, model, opt = _accelerator()
    with attach(acc):
        for missing in (tmp_path / "missing", str(tmp_path / "empty")):
            Path(tmp_path / "empty").mkdir(exist_ok=True)
            with pytest.raises(ValueError) as info:
                acc.load_state(missing)
            assert isinstance(info.value, NoCheckpointError) and isinstance(info.value, FileNotFoundError)


def test_an_iteration_the_user_set_is_kept_by_load_state(tmp_path: Path) -> None:
    """``ProjectConfiguration(iteration=3)`` then ``load_state(checkpoint_1)``: the next save is
    checkpoint_3, as with accelerate (which never changes the iteration); checkpoint_2 stays."""
    acc, model, opt = _accelerator(tmp_path / "proj")
    with attach(acc):
        for _ in range(3):
            _train(acc, model, opt)
            acc.save_state()
        kept = _weights(acc, model)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, model, opt = _accelerator(tmp_path / "proj", seed=1)
    acc.project_configuration.iteration = 3
    with attach(acc):
        acc.load_state(str(tmp_path / "proj" / "checkpoints" / "checkpoint_1"))
        _train(acc, model, opt)
        assert Path(acc.save_state()).name == "checkpoint_3"
        assert acc.load_state(str(tmp_path / "proj" / "checkpoints" / "checkpoint_2"))
        assert _same(_weights(acc, model), kept)


def test_total_limit_has_removed_the_older_folders_when_the_next_save_state_returns(tmp_path: Path) -> None:
    """accelerate's own test_checkpoint_deletion: 11 save_state() calls with total_limit=2, then
    checkpoint_0 must be gone. The commits (and with them the removals) lagged the training by any
    number of checkpoints; now by at most saving.max_pending (1): the folders left are the two
    committed ones and the one being written."""
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    model = acc.prepare(nn.Linear(3, 2))
    with attach(acc):
        for _ in range(11):
            _ = model.weight.data.add_(1.0)
            acc.save_state()
        listing = sorted(os.listdir(tmp_path / "checkpoints"))
        assert listing == [".checkrun", "checkpoint_10", "checkpoint_8", "checkpoint_9"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [".checkrun", "checkpoint_10", "checkpoint_9"]


def test_a_temporary_project_directory_removed_right_after_saving_is_removed_cleanly() -> None:
    """accelerate's own test_checkpoint_deletion / test_with_save_limit run in a TemporaryDirectory
    that is removed right after the last save_state(): the background writer created files in the
    tree being deleted and its cleanup failed with "Directory not empty" (11 of 20 runs). The
    deletion now waits for the saves in flight under it (``shutil.rmtree``); the last checkpoint
    committed before it was removed."""
    with tempfile.TemporaryDirectory() as tmp:
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=tmp, automatic_checkpoint_naming=True, total_limit=2))
        model = acc.prepare(nn.Linear(3, 2))
        checkpointer = attach(acc)
        for _ in range(11):
            _ = model.weight.data.add_(1.0)
            acc.save_state()
    assert not os.path.exists(tmp)
    checkpointer.wait()  # nothing left to surface: every save committed before the deletion
    checkpointer.close()


# -- in-process helpers ------------------------------------------------------------------------------
def _accelerator(project_dir: Path | None = None, seed: int = 0) -> tuple[Accelerator, nn.Module, torch.optim.Optimizer]:
    pc = ProjectConfiguration(project_dir=str(project_dir), automatic_checkpoint_naming=True) \
        if project_dir is not None else None
    acc = Accelerator(cpu=True, project_config=pc)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _train(acc: Accelerator, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    acc.backward(model(torch.randn(3, 4)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _weights(acc: Accelerator, model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    FaultyFS.reset()
    yield
    if FaultyFS.gate is not None:
        FaultyFS.gate.set()  # never leave a writer blocked
    FaultyFS.reset()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class _Watched(threading.Condition):
    """The in-flight registry's condition, telling the test when a given thread starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.waiting = threading.Event()

    def wait(self, timeout=None):  # noqa: ANN001 - threading.Condition's signature
        if threading.current_thread() is self.thread:
            self.waiting.set()
        return super().wait(timeout)


def _load_in_thread(cond: _Watched, load) -> dict:
    """Run ``load()`` on a thread; return once it waits on the registry or has finished."""
    result: dict = {}

    def run():
        try:
            result["value"] = load()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            result["error"] = exc
        finally:
            cond.waiting.set()

    thread = threading.Thread(target=run, name="other-accelerator-load")
    cond.thread, result["thread"] = thread, thread
    thread.start()
    assert cond.waiting.wait(WAIT_LIMIT)
    return result


# -- point 2: save_state, then load_state on another Accelerator of the same process --------------------
def test_another_accelerator_loads_a_checkpoint_still_being_written(tmp_path: Path, monkeypatch) -> None:
    cond = _Watched()
    monkeypatch.setattr(inflight, "_cond", cond)
    root = f"gatefile://{tmp_path}/ckpts"
    acc1, model1, opt1 = _accelerator(seed=0)
    ckpt1 = attach(acc1, directory=root)
    acc2, model2, opt2 = _accelerator(seed=1)  # another Accelerator, other weights, same process
    ckpt2 = attach(acc2, directory=root)
    for expected_name in ("checkpoint_0", "checkpoint_1"):
        _train(acc1, model1, opt1)
        expected = _weights(acc1, model1)
        FaultyFS.gate = threading.Event()  # storage stalls: the save stays in flight
        folder = acc1.save_state()
        assert folder == f"{root}/{expected_name}"
        assert ckpt_core.save_in_flight(f"{folder}/{composite.INDEX_NAME}")
        cond.waiting.clear()
        # by its folder the first time, then load_state() with no argument (the newest)
        args = (folder,) if expected_name == "checkpoint_0" else ()
        result = _load_in_thread(cond, lambda: acc2.load_state(*args))
        assert "error" not in result, f"the load did not wait for the save in flight: {result.get('error')!r}"
        FaultyFS.gate.set()
        result["thread"].join(WAIT_LIMIT)
        assert result.get("value") == folder and "error" not in result
        assert _same(_weights(acc2, model2), expected)
    ckpt1.close()
    ckpt2.close()


# -- point 6 in-process: folders, old layout, no automatic naming ---------------------------------------
def test_hooks_get_the_folder_and_save_state_output_dir_is_the_folder(tmp_path: Path) -> None:
    acc, model, opt = _accelerator()
    seen = []
    acc.register_save_state_pre_hook(lambda models, weights, d: seen.append(("save", d, os.path.isdir(d))))
    acc.register_load_state_pre_hook(lambda models, d: seen.append(("load", d, os.path.isdir(d))))
    ckpt = attach(acc)
    out = str(tmp_path / "my_checkpoint")
    for _ in range(2):  # saving to the same folder again replaces the checkpoint, as accelerate overwrites
        _train(acc, model, opt)
        expected = _weights(acc, model)
        assert acc.save_state(out) == Path(out)  # a Path, as accelerate's own save_state returns
    _train(acc, model, opt)
    assert acc.load_state(out) == out and _same(_weights(acc, model), expected)
    ckpt.wait()
    assert sorted(os.listdir(out)) == [".checkrun", composite.INDEX_NAME]
    parts = [p for p in os.listdir(Path(out) / composite.PARTS_DIR) if p.endswith(".ckpt")]
    assert len(parts) == 1  # the replaced checkpoint's part is gone
    assert seen == [("save", out, True), ("save", out, True), ("load", out, True)]
    ckpt.close()


def test_earlier_releases_layout_still_loads(tmp_path: Path) -> None:
    """``ROOT/checkpoint_0.ckpt`` (index format 1) + ``ROOT/parts/``, as written before the folders."""
    acc, model, opt = _accelerator(tmp_path / "proj")
    ckpt = attach(acc, {"saving": {"asynchronous": False}})
    _train(acc, model, opt)
    expected = _weights(acc, model)
    folder = str(acc.save_state())
    root = tmp_path / "proj" / "checkpoints"
    with ckpt_core.CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        index = engine.load(f"{folder}/{composite.INDEX_NAME}")
        (part,) = composite.part_urls(f"{folder}/{composite.INDEX_NAME}", index)
        engine.save(engine.load(part), str(root / "parts" / "checkpoint_0.old-0.rank0.ckpt"))
        engine.save({**index, "accelerate_ckpt": 1, "parts": ["parts/checkpoint_0.old-0.rank0.ckpt"]},
                    str(root / "checkpoint_0.ckpt"))
    shutil.rmtree(folder)
    shutil.rmtree(root / ".checkrun")
    _train(acc, model, opt)
    assert acc.load_state(str(root / "checkpoint_0.ckpt")) == str(root / "checkpoint_0.ckpt")
    assert _same(_weights(acc, model), expected)
    _train(acc, model, opt)
    acc.load_state()  # the newest of the directory: the old index
    assert _same(_weights(acc, model), expected)
    ckpt.close()


# -- point 7: saving.asynchronous false means committed when save_state returns -------------------------
@pytest.mark.parametrize("processes", [1, 2])
def test_a_script_that_ends_right_after_save_state_leaves_the_checkpoint_committed(tmp_path: Path,
                                                                                  processes: int) -> None:
    """The script ends while its part is still being written: the interpreter's exit finishes the
    checkpoint (every rank's part, then rank 0's index) before the engines are flushed. Before, the
    exit flush could close the engine that commits the index first: the checkpoint was lost
    ("pending checkpoint failed at interpreter exit ... this CheckpointEngine is closed") and the
    process still exited 0."""
    folder = tmp_path / "checkpoint"
    accelerate_launch(accelerate_args(processes), HERE / "exit_after_save.py", [folder, tmp_path],
                      launch_env(tmp_path))
    with ckpt_core.CheckpointEngine() as fresh:
        index = fresh.load(str(folder / composite.INDEX_NAME))
        parts = composite.part_urls(str(folder / composite.INDEX_NAME), index)
        assert len(parts) == processes
        saved = fresh.load(parts[0])["replicated"]["models"][0]
    assert _same(dict(saved), torch.load(tmp_path / "weights.pt"))


def test_exit_closes_what_drives_engines_before_the_engines(tmp_path: Path, monkeypatch) -> None:
    """``lifecycle.register_owner``: at exit an adapter's checkpointer (which commits through an
    engine of its own) is closed while every engine is still open; engines are flushed after."""
    import weakref

    from ckpt_core.saving import lifecycle
    monkeypatch.setattr(lifecycle, "_owners", [])  # only this test's, not other tests' live objects
    monkeypatch.setattr(lifecycle, "_engines", weakref.WeakSet())

    class Owner:
        def __init__(self, engine) -> None:
            self.engine, self.saw_open = engine, None
            lifecycle.register_owner(self._close_at_exit)

        def _close_at_exit(self) -> None:
            self.saw_open = not self.engine._closed
            self.engine.save({"x": torch.ones(2)}, str(tmp_path / "owner.ckpt")).result()

    engine = ckpt_core.CheckpointEngine()
    owner = Owner(engine)
    lifecycle._flush_all()
    assert owner.saw_open is True and engine._closed
    assert ckpt_core.load(str(tmp_path / "owner.ckpt"))["x"].tolist() == [1.0, 1.0]


def test_synchronous_save_state_returns_after_the_commit(tmp_path: Path) -> None:
    acc, model, opt = _accelerator(tmp_path / "proj")
    ckpt = attach(acc, {"saving": {"asynchronous": False}})
    for i in range(3):
        _train(acc, model, opt)
        expected = _weights(acc, model)
        folder = str(acc.save_state())
        # no commit thread: nothing of this save is left to run
        assert not [t.name for t in threading.enumerate() if t.name.startswith("accelerate-ckpt")]
        with ckpt_core.CheckpointEngine() as fresh:  # another engine, nothing shared with the adapter's
            index = fresh.load(os.path.join(folder, composite.INDEX_NAME))
            assert index["iteration"] == i + 1
            (part,) = composite.part_urls(os.path.join(folder, composite.INDEX_NAME), index)
            saved = fresh.load(part)["replicated"]["models"][0]
            assert _same(dict(saved), expected)
    ckpt.close()


def test_synchronous_save_state_raises_its_own_failure(tmp_path: Path) -> None:
    acc, model, opt = _accelerator()
    ckpt = attach(acc, {"saving": {"asynchronous": False}, "storage": {"retry": {"max_attempts": 1}}},
                  directory=f"gatefile://{tmp_path}/ckpts")
    FaultyFS.fail_writes, FaultyFS.fail_match = PermissionError("injected: disk refuses blobs"), "/blobs/"
    with pytest.raises(ckpt_core.BackgroundSaveError, match="not committed.*injected"):
        acc.save_state()  # the failure of this very save, raised by this call
    folder = f"gatefile://{tmp_path}/ckpts/checkpoint_0"
    assert not ckpt_core.save_in_flight(f"{folder}/{composite.INDEX_NAME}")
    assert not (tmp_path / "ckpts" / "checkpoint_0" / composite.INDEX_NAME).exists()
    FaultyFS.fail_writes = None
    _train(acc, model, opt)
    assert acc.save_state() == f"gatefile://{tmp_path}/ckpts/checkpoint_1"
    assert (tmp_path / "ckpts" / "checkpoint_1" / composite.INDEX_NAME).is_file()
    ckpt.close()


# -- point 9: accelerate-ckpt launch with a broken config: one line, no traceback ------------------------
@pytest.mark.parametrize("content, problem", [
    ({"distributed_type": "NO", "checkpointing": {"saving": {"max_pendin": 2}}}, "saving.max_pendin"),
    ({"distributed_type": "NO", "checkpointing": ["not", "a", "mapping"]}, "expected a mapping"),
    ({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no",
      "use_cpu": True, "num_procs": 2, "checkpointing": {}}, "unknown keys"),
])
def test_launch_config_error_is_one_line(tmp_path: Path, content, problem: str) -> None:
    cfg = tmp_path / "accelerate_checkrun.yaml"
    cfg.write_text(yaml.safe_dump(content))
    proc = subprocess.run([str(BIN / "accelerate-ckpt"), "launch", "--config_file", str(cfg), str(DROPIN)],
                          env=launch_env(tmp_path), cwd=str(REPO), capture_output=True, text=True,
                          timeout=WAIT_LIMIT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"accelerate-ckpt: error: {cfg}: ") and problem in lines[0]
