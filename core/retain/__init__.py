"""Step 6 of a save: listing, retention (``keep_last``) and garbage collection (``retention``), and
the leases that protect the blobs of saves in flight (``leases``).
"""
