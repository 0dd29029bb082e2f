"""The plain-PyTorch quickstart example runs end to end and its resume is exact."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_and_resumes_exactly(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert "resume exact vs an uninterrupted run: True" in out
    assert (tmp_path / "step=40.ckpt").exists()
