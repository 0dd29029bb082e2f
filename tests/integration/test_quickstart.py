"""The plain-PyTorch quickstart example runs end to end, its resume is exact, and it leaves no
temporary folder behind (neither its default checkpoint folder nor the reference run's)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmpdir: Path) -> str:
    tmpdir.mkdir()
    # tempfile puts the example's own folders in TMPDIR; torch's cache (torchinductor_USER, made by any
    # torch program that runs backward, kept for the next run) goes elsewhere
    env = {**os.environ, "TMPDIR": str(tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(tmpdir.parent / "torch-cache")}
    return subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600, check=True).stdout


def test_quickstart_runs_and_resumes_exactly(tmp_path):
    out = _run(["--dir", str(tmp_path / "ckpts")], tmp_path / "tmp")
    assert "resume exact vs an uninterrupted run: True" in out
    assert (tmp_path / "ckpts" / "step=40.ckpt").exists()
    assert not list((tmp_path / "tmp").iterdir())


def test_quickstart_without_dir_removes_its_folders(tmp_path):
    out = _run(["--steps", "4", "--every", "2"], tmp_path / "tmp")
    assert "resume exact vs an uninterrupted run: True" in out and "checkpoints in " in out
    assert not list((tmp_path / "tmp").iterdir())
