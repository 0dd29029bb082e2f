"""One vocabulary and one unit system for every figure checkrun prints (no torch import).

The CLI (``checkrun ls`` / ``inspect``), ``SaveInfo.summary()``, the Lightning ``CheckpointMetrics``
and the examples all format sizes and ratios with the helpers below, and name the figures with
these words (docs/cli.md, "Sizes: what the numbers mean"):

* **tensor bytes**: the raw size of the state's tensors, what a full uncompressed save would hold
  (``SaveInfo.tensor_bytes``, ``ls`` TENSORS, ``inspect`` SIZE).
* **written by this save**: the bytes one save put into storage, its new blobs plus its manifest
  (``SaveInfo.written_bytes``, ``ls`` WROTE). An incremental save writes little.
* **referenced by this checkpoint**: the bytes of every blob the checkpoint needs, each once, its
  size if it were alone in a directory (``SaveInfo.referenced_bytes`` = ``stored_bytes``,
  ``ls`` REFERENCED, ``inspect`` STORED).
* **stored in the directory**: what the directory really holds: the blobs its checkpoints
  reference (shared ones once), the manifests and unreferenced blobs ``gc`` could delete
  (``checkrun ls`` totals).

Sizes are binary (1 KiB = 1024 bytes, MiB, GiB, TiB); ratios are "tensor bytes / figure"
with two decimals, said in words (``fmt_less``: "7.26x less", or "1.33x more" for a figure above
the tensor bytes). JSON output and metrics keep exact byte counts.
"""
from __future__ import annotations

__all__ = ["KIB", "MIB", "GIB", "fmt_bytes", "fmt_ratio", "fmt_percent", "ratio", "fmt_less"]

KIB, MIB, GIB = 1024, 1024 ** 2, 1024 ** 3
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float | None) -> str:
    """A byte count in binary units: ``1536 -> "1.5 KiB"``, ``5 -> "5 B"``; ``None -> "-"``."""
    if n is None:
        return "-"
    n, i = float(n), 0
    while abs(n) >= 1024 and i < len(_UNITS) - 1:
        n, i = n / 1024, i + 1
    return f"{int(n)} B" if i == 0 else f"{n:.1f} {_UNITS[i]}"


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is missing or ``den`` is 0."""
    if num is None or not den:
        return None
    return num / den


def fmt_ratio(r: float | None) -> str:
    """``6.774 -> "6.77x"``; ``None -> "-"``."""
    return "-" if r is None else f"{r:.2f}x"


def fmt_percent(part: float | None, whole: float | None) -> str:
    """``part`` as a percentage of ``whole``: ``"3.4%"``; ``"-"`` when ``whole`` is 0 or missing."""
    r = ratio(part, whole)
    return "-" if r is None else f"{100 * r:.1f}%"


def fmt_less(tensor_bytes: float | None, figure: float | None) -> str:
    """How ``figure`` compares with ``tensor_bytes``: ``"6.95x less"``, ``"1.33x more"`` (a figure
    above the tensor bytes, e.g. the manifests of tiny checkpoints), ``"-"`` when unknown."""
    r = ratio(tensor_bytes, figure)
    if r is None or r == 0:
        return "-"
    return f"{r:.2f}x less" if r >= 1 else f"{1 / r:.2f}x more"
