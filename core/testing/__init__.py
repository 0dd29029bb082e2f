"""Testing helpers for users who write their own storage backends (and for checkrun's own tests).

- ``ckpt_core.testing.conformance``: the storage conformance suite (``run_conformance(url,
  storage_options)``, or ``run_check(name, ...)`` per name in ``CHECK_NAMES``): what checkrun
  needs from a filesystem - blob I/O, atomic manifest commits, listings, temp-file cleanup.
- ``ckpt_core.testing.faults``: the fault-injecting filesystem ``FaultFS`` (``faultfile://`` and
  ``gatefile://`` URLs over the real local disk) with its policies;
- ``ckpt_core.testing.s3faults``: ``S3Faults``, real HTTP error responses injected into the s3fs client.

Importing this package registers the two URL schemes with fsspec. It imports no pytest.
"""
from __future__ import annotations

from .conformance import CHECK_NAMES, ConformanceError, run_check, run_conformance
from .faults import BlockAll, DiskFull, FaultFS, Gate, Permanent, Policy, Transient, transient_error
from .s3faults import S3Faults, s3_fault_options

__all__ = ["CHECK_NAMES", "ConformanceError", "run_check", "run_conformance", "BlockAll", "DiskFull",
           "FaultFS", "Gate", "Permanent", "Policy", "S3Faults", "Transient", "s3_fault_options",
           "transient_error"]
