"""Loading: read a manifest, fetch and verify blobs, decode, apply deltas (``reader``), and place
the tensors (``placement``: ``map_location``).
"""
