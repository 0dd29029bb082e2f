"""One manifest sniffing test (``format.manifest.is_manifest_head``) for every caller: it tells real
manifests from torch.save files, and no other module re-implements it."""
from __future__ import annotations

import pathlib

import torch

import ckpt_core
from ckpt_core.format.manifest import HEAD_BYTES, is_manifest_head

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_saved_manifest_is_sniffed_and_a_torch_file_is_not(tmp_path):
    ckpt_core.save({"w": torch.arange(6.0)}, str(tmp_path / "a.ckpt"), config={"saving": {"asynchronous": False}})
    head = (tmp_path / "a.ckpt").read_bytes()[:HEAD_BYTES]
    assert is_manifest_head(head) and is_manifest_head(b" \n\t" + head)
    torch.save({"w": torch.arange(6.0)}, tmp_path / "b.pt")
    assert not is_manifest_head((tmp_path / "b.pt").read_bytes()[:HEAD_BYTES])
    assert not is_manifest_head(b"") and not is_manifest_head(b'{"checkrun": 1}')


def test_no_module_sniffs_manifests_on_its_own():
    offenders = [str(p.relative_to(ROOT)) for pkg in ("core", "lightning_ckpt", "accelerate_ckpt")
                 for p in (ROOT / pkg).rglob("*.py")
                 if "MAGIC_PREFIX" in p.read_text() and p != ROOT / "core" / "format" / "manifest.py"]
    assert offenders == []
