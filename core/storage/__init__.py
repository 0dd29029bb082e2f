"""Step 4's medium: one checkpoint directory on any fsspec filesystem (``store``), retries of
transient errors (``retry``) and the identity of the writing process (``owner``).

Every ``if`` on the kind of storage (local rename vs single PUT) lives in this package.
"""
