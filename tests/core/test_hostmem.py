"""Host buffers on transparent huge pages (ckpt_core.saving.staging.empty_host / advise_huge_pages)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from ckpt_core.saving.staging import advise_huge_pages, empty_host

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
madvise_mode = sys.platform.startswith("linux") and THP.exists() and "[madvise]" in THP.read_text()


def _flags(t: torch.Tensor) -> str:
    """The VmFlags of the mapping that holds the middle of ``t`` (Linux /proc/self/smaps)."""
    addr = t.data_ptr() + t.nbytes // 2
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            return next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
    raise AssertionError("mapping not found")


def test_empty_host_is_a_plain_writable_tensor():
    for numel, dtype in [(0, torch.float32), (3, torch.bfloat16), (5 << 20, torch.float32)]:
        t = empty_host(numel, dtype)
        assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        t.fill_(1)
        assert int(t.sum()) == numel


def test_small_tensors_are_not_advised():
    assert advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8)) is False


@pytest.mark.skipif(not madvise_mode, reason="transparent huge pages are not in madvise mode here")
def test_large_buffers_are_advised_for_huge_pages():
    t = empty_host(16 << 20, torch.uint8)
    assert "hg" in _flags(t).split()  # VM_HUGEPAGE: the kernel took the advice
    assert advise_huge_pages(t) is True


@pytest.mark.skipif(not madvise_mode, reason="transparent huge pages are not in madvise mode here")
def test_loaded_tensors_are_on_huge_page_memory(tmp_path):
    import ckpt_core

    w = torch.randn(2048, 2048)
    ckpt_core.save({"w": w}, tmp_path / "a.ckpt")
    out = ckpt_core.load(tmp_path / "a.ckpt")
    assert torch.equal(out["w"], w)
    assert "hg" in _flags(out["w"]).split()
