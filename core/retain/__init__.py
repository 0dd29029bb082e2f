"""Step 6 of a save: listing, retention (``keep_last``) and garbage collection (``retention``), the
leases that protect the blobs of saves in flight (``leases``), what runs right after each commit on
every save path (``after``: ``after_commit``), and retention of composite checkpoints (``composites``).
"""
from .after import Garbage, Manifests, Memory, after_commit, collect, note_removed

__all__ = ["Garbage", "Manifests", "Memory", "after_commit", "collect", "note_removed"]
