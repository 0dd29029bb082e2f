"""The references of the next row-delta save, rebuilt after a load returns (``load.reference``).

A row-delta save compares every row of a tensor with the values of the checkpoint before it, so a
load keeps a second copy of each tensor that will be saved that way (its *reference*;
``saving.streams.wants_stream``). Made during the load (``inline``), that copy is part of the
restore the training job waits for: a copy of those tensors into fresh memory (in
``saving.background: process``, fresh shared memory, slower still). ``background`` leaves it out of
the load: the load returns once the live tensors hold the state, and a thread of its own reads the
same blobs again (from the page cache, on a local disk), verifies and decodes them into the
references. The next save to the directory waits for that thread first (``CheckpointEngine.save``);
if it failed (a blob deleted or rotted meanwhile), that save writes those tensors whole, and
reuses none of the blobs the rebuild read without reading it back first (``saving.blobcheck``).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from ..format.manifest import Manifest
from ..saving import lifecycle
from ..storage.store import Store
from .reader import LoadedTensor, load_references

log = logging.getLogger("ckpt_core")


class ReferenceBuild:
    """One load's references, decoded on a thread of its own (started here)."""

    def __init__(self, store: Store, manifest: Manifest, where: str, indices: list[int],
                 alloc: Callable[[int, torch.dtype], torch.Tensor], max_total_bytes: int | None) -> None:
        self.where = where
        self.keys = [manifest.tensors[i].key for i in indices]
        # what a failure puts in doubt: the blobs it read (``verified`` by the load before)
        self.blob_keys = {ref.key for i in indices for ref in manifest.tensors[i].blobs()}
        self.buffers: list[torch.Tensor] = []  # every buffer allocated, for ``free`` after a failure
        self._loaded: list[LoadedTensor] | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()

        def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
            buf = alloc(numel, dtype)
            self.buffers.append(buf)
            return buf

        self._thread = threading.Thread(target=self._run, name="checkrun-reference", daemon=True,
                                        args=(store, manifest, indices, allocate, max_total_bytes))
        self._thread.stop = self.join  # type: ignore[attr-defined]  # it ends by itself (see the coordinator's)
        self._thread.cancel = self.cancel  # type: ignore[attr-defined]  # at exit (lifecycle._flush_all)
        self._thread.start()
        # It starts and ends io threads; CPython 3.11 can deadlock a child forked while a thread ends
        # (DataLoader workers fork right after a resume): a fork waits for this thread first.
        lifecycle.retiring(self._thread)

    def _run(self, store: Store, manifest: Manifest, indices: list[int], alloc, limit: int | None) -> None:
        try:
            self._loaded = load_references(store, manifest, self.where, indices, alloc, limit, self._stop)
        except BaseException as exc:  # reported by ``result``, on the thread that waits
            self._error = exc
        finally:
            store.release_idle()  # an idle engine holds no thread (a save's map keeps its pool)

    def join(self) -> None:
        """Wait for the thread to end (``result`` gives what it built)."""
        self._thread.join()

    def cancel(self) -> None:
        """Nobody will use the result (the engine closes): stop reading blobs; ``result`` is then None."""
        self._stop.set()

    def result(self, quiet: bool = False) -> list[LoadedTensor] | None:
        """Wait for the thread; the rebuilt tensors (``copy`` set), or None if it failed (a warning
        names the checkpoint and the cause unless ``quiet``)."""
        self._thread.join()
        if self._error is not None:
            if not quiet:
                log.warning("checkrun: %s: the copy of the loaded tensors that the next incremental save "
                            "compares against could not be rebuilt (%s); that save writes them whole",
                            self.where, self._error)
            return None
        return self._loaded


def supersede(builds: list[ReferenceBuild], keys: list[str],
              free: Callable[[torch.Tensor], None]) -> list[ReferenceBuild]:
    """``builds`` less those a newer load of ``keys`` replaces (an earlier build of no other key): each
    is stopped and its buffers freed. Before, every load into one engine added a copy of the state
    that stayed until the next save or ``close()`` (five loads of 256 MiB held 1.4 GiB)."""
    wanted, kept = set(keys), []
    for build in builds:
        if not set(build.keys) <= wanted:
            kept.append(build)
            continue
        build.cancel()
        build.result(quiet=True)
        for buf in build.buffers:
            free(buf)
    return kept
