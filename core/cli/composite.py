"""The CLI's view of a checkpoint: an ordinary manifest, or a composite index read through to its parts.

accelerate_ckpt commits one index per checkpoint (``checkpoint_3/checkrun.ckpt``) naming one part per
rank (``ckpt_core.format.composite``). Shown or checked on its own, an index holds no tensor at all, so
every command reads through it: a :class:`View` is the list of manifests that make up what the user
named, each with the key prefix its tensors and values get (``parts.0.replicated.models.0.weight``).
Exported, a composite is ``{"checkpoint": <the index>, "parts": [<part 0>, <part 1>, ...]}``.
Runs on the CLI's main thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..format import composite
from ..retain.composites import list_in
from .tree import plain_values
from .util import Context, CliError, log, one_line
from ..errors import CheckpointNotFoundError, CheckrunError
from ..format.manifest import BlobRef, Manifest, TensorRecord


@dataclass(frozen=True)
class Piece:
    """One manifest of a view: ``prefix`` goes in front of its keys (empty for an ordinary checkpoint)."""

    prefix: str
    url: str
    manifest: Manifest


@dataclass(frozen=True)
class View:
    """What a CKPT argument names: the manifest at ``url`` and the pieces holding its content."""

    url: str
    manifest: Manifest
    index: dict | None
    pieces: tuple[Piece, ...]

    @property
    def composite(self) -> bool:
        """True for an index read through to its parts."""
        return self.index is not None

    def records(self) -> dict[str, TensorRecord]:
        """Every tensor record by its (prefixed) key."""
        return {p.prefix + r.key: r for p in self.pieces for r in p.manifest.tensors}

    def blobs(self) -> list[BlobRef]:
        """Every blob the pieces need, each once."""
        return list({b.key: b for p in self.pieces for b in p.manifest.blobs()}.values())

    def values(self) -> dict[str, Any]:
        """Plain values by dotted key (a composite's index values under ``checkpoint.``)."""
        out: dict[str, Any] = {}
        if self.index is not None:
            out.update({f"checkpoint.{k}": v for k, v in plain_values(self.manifest, self.url).items()})
        for p in self.pieces:
            out.update({p.prefix + k: v for k, v in plain_values(p.manifest, p.url).items()})
        return out

    def load(self, ctx: Context, weights_only: bool) -> Any:
        """The whole state (tensors on CPU), verified; a DCP checkpoint's shards reassembled, nested as saved
        (h130: ``export`` wrote its per-shard records, ``model.weight@0,0``)."""
        if self.index is None and isinstance(self.manifest.meta.get("dcp"), dict):
            from ..dcp import load_state_dict  # (torch.distributed.checkpoint: imported only for one)

            return load_state_dict(self.url, config=ctx.engine.config, storage_options=ctx.storage_options,
                                   weights_only=weights_only)
        states = [ctx.engine.load(p.url, map_location="cpu", weights_only=weights_only,
                                  storage_options=ctx.storage_options) for p in self.pieces]
        if self.index is None:
            return states[0]
        return {"checkpoint": dict(self.index), "parts": states}


def part_prefix(i: int) -> str:
    """Key prefix of part ``i`` of a composite."""
    return f"parts.{i}."


def open_view(ctx: Context, url: str) -> View:
    """Read the manifest at ``url`` and, for an index, its parts' manifests (no blob is read).

    A missing or unreadable part raises (its error names the file)."""
    m = ctx.engine.read_manifest(url, storage_options=ctx.storage_options)
    index = composite.index_of(m, url)
    if index is None:
        return View(url, m, None, (Piece("", url, m),))
    pieces = tuple(Piece(part_prefix(i), u, ctx.engine.read_manifest(u, storage_options=ctx.storage_options))
                   for i, u in enumerate(composite.part_urls(url, index)))
    return View(url, m, index, pieces)


def folder_index(ctx: Context, directory: str) -> str | None:
    """The index of a checkpoint folder (``DIR/checkrun.ckpt``), or None if ``directory`` is not one."""
    url = composite.join(directory, composite.INDEX_NAME)
    return url if ctx.kind(url) == "file" else None


def folders(ctx: Context, directory: str) -> list[composite.Composite]:
    """Checkpoint folders directly in ``directory`` (format 2 composites), oldest first."""
    return list_in(directory, ctx.storage_options, ctx.engine.config, legacy=False)


def resolve_checkpoint(ctx: Context, url: str) -> str:
    """A CKPT argument -> a manifest: a file; a checkpoint folder's index; else a directory's newest
    intact checkpoint (ordinary manifests in it, or the checkpoint folders in it)."""
    kind = ctx.kind(url)
    if kind == "missing":
        raise CliError(f"{url}: no such checkpoint")
    if kind == "file":
        return url
    index = folder_index(ctx, url)
    if index is not None:
        return index
    candidates = []
    latest = ctx.engine.latest(url, storage_options=ctx.storage_options)
    if latest is not None:
        candidates.append((ctx.engine.read_manifest(latest, storage_options=ctx.storage_options).created, latest))
    for folder in reversed([f for f in folders(ctx, url) if f.manifest is not None]):
        report = verify_view(ctx, folder.url, decode=False)  # every part's blobs, as latest() verifies
        if report["ok"]:
            candidates.append((folder.created, folder.url))
            break
        log.warning("checkrun: skipping checkpoint %s: %s", folder.url, one_line("; ".join(report["problems"])))
    if not candidates:
        raise CliError(f"{url}: directory holds no intact checkrun checkpoint")
    chosen = max(candidates)[1]
    log.info("checkrun: using the latest checkpoint %s", chosen)
    return chosen


def verify_view(ctx: Context, url: str, decode: bool, progress: Any = None, cache: Any = None) -> dict:
    """Verify a checkpoint and, for an index, every part: ``{"path", "ok", "problems", "parts",
    "blobs_checked", "bytes_checked"}``; ``cache``: a ``VerifyCache`` shared with other checkpoints."""
    rep = ctx.engine.verify(url, storage_options=ctx.storage_options, decode=decode, progress=progress, cache=cache)
    out = {"path": url, "ok": rep.ok, "problems": list(rep.problems), "parts": None,
           "blobs_checked": rep.blobs_checked, "bytes_checked": rep.bytes_checked, "unverified": rep.unverified,
           "foreign": rep.foreign}
    if not rep.ok:
        return out
    try:
        index = composite.index_of(ctx.engine.read_manifest(url, storage_options=ctx.storage_options), url)
    except CheckrunError as exc:
        out.update(ok=False, problems=[str(exc)])
        return out
    if index is None:
        return out
    out["parts"], failed = [], []  # per failing part: whether its problems are all unverified checks
    for part in composite.part_urls(url, index):
        try:
            prep = ctx.engine.verify(part, storage_options=ctx.storage_options, decode=decode, progress=progress,
                                     cache=cache)
            problems, blobs, nbytes = list(prep.problems), prep.blobs_checked, prep.bytes_checked
            failed += [] if prep.ok else [prep.unverified]
        except CheckpointNotFoundError as exc:
            problems, blobs, nbytes = [f"missing part: {exc}"], 0, 0
            failed.append(False)
        out["parts"].append(part)
        out["problems"].extend(problems)
        out["blobs_checked"] += blobs
        out["bytes_checked"] += nbytes
    out["ok"], out["unverified"] = not out["problems"], bool(failed) and all(failed)
    return out
