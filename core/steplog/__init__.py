"""The per-step update log (issue 23, docs/steplog.md): every optimizer step between checkpoints,
logged so that a crashed run resumes at its last logged step, bit for bit.

Stage: after saving (it uses the codecs, the store and the format limits; the engine calls it).
``StepLog`` logs (``log``, ``capture``), ``replay`` applies, ``gc`` truncates, ``format`` is the
on-storage format and its hostile-input checks.
"""
from .api import open_log, replay
from .format import NoMarkerError, StepLogFormatError
from .gc import collect_segments
from .log import StepLog, StepLogError
from .capture import forward_state, warn_forward_state

__all__ = ["StepLog", "StepLogError", "NoMarkerError", "StepLogFormatError", "open_log", "replay", "collect_segments",
           "forward_state", "warn_forward_state"]
