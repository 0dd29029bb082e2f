"""examples/accelerate_train.py runs as documented, with its YAML both ways, and resumes.

Run 1: ``accelerate-ckpt launch --config_file examples/accelerate_config.yaml`` (way a) from scratch.
Run 2: plain ``accelerate launch`` with ``CHECKRUN_CONFIG=examples/accelerate_checkrun.yaml`` (way b):
it finds run 1's newest checkpoint, resumes from it and trains on.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.accel_scripts.harness import REPO, accelerate_args, accelerate_launch, launch_env

EXAMPLE = REPO / "examples" / "accelerate_train.py"
pytestmark = pytest.mark.slow


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def test_example_runs_and_resumes_with_both_config_ways(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    args = ["--project-dir", project, "--save-every", "10"]
    first = accelerate_launch(["--config_file", REPO / "examples" / "accelerate_config.yaml"], EXAMPLE,
                              [*args, "--steps", "20"], launch_env(tmp_path), via="accelerate-ckpt")
    res = _result(first.stdout)
    root = project / "checkpoints"
    assert res["resumed"] is None and res["step"] == 20 and res["keep_last"] == 2
    assert res["saved"] == [str(root / "checkpoint_0"), str(root / "checkpoint_1")]
    assert res["config"].startswith("$CHECKRUN_CONFIG=")
    assert "blocked" in first.stdout and "references" in first.stdout and " MB" not in first.stdout

    env = launch_env(tmp_path, {"CHECKRUN_CONFIG": str(REPO / "examples" / "accelerate_checkrun.yaml")})
    second = accelerate_launch(accelerate_args(1), EXAMPLE, [*args, "--steps", "30"], env)
    res = _result(second.stdout)
    assert res["resumed"] == str(root / "checkpoint_1") and res["step"] == 30
    assert res["saved"] == [str(root / "checkpoint_2")] and res["keep_last"] == 2
    assert sorted(p.name for p in root.iterdir()) == [".checkrun", "checkpoint_1", "checkpoint_2"]
