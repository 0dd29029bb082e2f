"""Step 4's medium: one checkpoint directory on any fsspec filesystem.

``store`` (the ``Store`` facade: blob and manifest I/O), ``commit`` (how a file appears atomically,
as named strategies: ``RenameCommit`` on local disks, ``SinglePutCommit`` on object stores),
``atomic`` (the one temp-file + fsync + rename write), ``pool`` (the I/O threads), ``paths``
(layout, URLs and the kind of filesystem), ``options`` (the one storage-options merge), ``retry``
(transient errors) and ``owner`` (the identity of the writing process).

Every ``if`` on the kind of storage (local rename vs single PUT, ``memory://``) lives in this package.
"""
