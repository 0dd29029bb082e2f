"""Steps 1-5 of a save, in data-flow order: capture (training thread) -> plan -> write -> commit.

Modules: ``capture``/``copier``/``staging``/``shm_staging``/``pinned`` (step 1, the snapshot),
``tracking``/``streams`` (what changed), ``quant_rules``/``plan`` (which tensors are lossy; the frozen
plan of a save), ``write``/``blobwrite`` (execute plans: encode, store), ``commit``/``fence``/``lease``
(step 5), ``process`` (the writer process),
``handles``/``inflight``/``lifecycle`` (what a save returns and how saves end).
"""
