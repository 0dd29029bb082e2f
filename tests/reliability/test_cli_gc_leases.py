"""``checkrun gc`` while another save is in flight: its blobs are kept by that save's lease, and the
command says so (``kept_leased``/``leases`` in ``--json``, "leased by 1 save(s) in flight" in text)."""
from __future__ import annotations

import json

from ckpt_core import CheckpointEngine
from ckpt_core.cli import main

from ckpt_core.testing.faults import FaultFS, Gate
from .test_leases import WATCHDOG, config, referenced, state, stored, verify_all


def test_gc_command_reports_the_blobs_a_save_in_flight_holds(tmp_path, capsys):
    root = tmp_path / "run"
    url = f"faultfile://{root}"
    with CheckpointEngine(config()) as a:
        a.save(state(1), f"{url}/a1.ckpt").result()
        gate = Gate("open", "manifest", 1)  # a2: every blob written, its commit held
        FaultFS.policy = gate
        try:
            handle = a.save(state(2, frozen_seed=5), f"{url}/a2.ckpt")
            assert gate.entered.wait(WATCHDOG)
            with CheckpointEngine(config()) as b:
                fresh = set(stored(str(root))) - set(referenced(b, str(root)))
            assert fresh  # a2's new blobs: stored, referenced by no manifest yet
            capsys.readouterr()
            assert main(["gc", str(root), "--json"]) == 0
            data = json.loads(capsys.readouterr().out)
            assert data["leases"] == 1 and data["kept_leased"] >= len(fresh) and data["deleted_blobs"] == 0
            assert main(["gc", str(root), "--dry-run"]) == 0
            out = capsys.readouterr().out
            assert f"{data['kept_leased']} leased by 1 save(s) in flight" in out
            assert "0 younger than the grace (0 s)" in out
        finally:
            gate.release()
            FaultFS.policy = None
        handle.result()
    assert verify_all(str(root)) == ["a1.ckpt", "a2.ckpt"]
