"""``checkrun export`` and ``checkrun import``: self-contained torch/safetensors files <-> checkpoints.

Exported ``.pt``/``.ckpt`` files are plain ``torch.save`` output of the loaded state (so a
Lightning-shaped state loads with ``LightningModule.load_from_checkpoint``). ``.safetensors``
files hold every tensor under its flattened dotted key; the state's structure and plain values
travel in the metadata (``checkrun.skeleton`` / ``checkrun.tensors`` / ``checkrun.values``) so
that ``checkrun import`` rebuilds the same tree. Pickled values cannot go into safetensors and
are dropped with a note. A composite (accelerate_ckpt's ``checkpoint_N`` folder or its index) is
exported whole: ``{"checkpoint": <the index>, "parts": [<part 0>, <part 1>, ...]}``.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import stat
import struct
from functools import lru_cache
from typing import Any, Callable

import numpy as np
import torch

from .composite import open_view
from .util import (
    EXIT_OK, EXIT_USAGE, Context, CliError, emit_json, fmt_less, human_size, jsonable, log, one_line, safe)
from ..errors import CheckrunError
from ..format.manifest import is_manifest_head
from ..format.skeleton import unflatten
from ..format.tree import flatten
from ..storage.atomic import write_atomic
from ..storage.paths import is_local_fs

_BLOCK = 8 << 20
_TORCH_MAGIC = b"PK\x03\x04"   # torch.save's zip container


def _format(path: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    return "safetensors" if str(path).lower().endswith(".safetensors") else "torch"


_SPECIAL = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO (named pipe)"),
            (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def _special_file(ctx: Context, url: str) -> str | None:
    """What a local ``url`` is when it exists and is not a regular file or directory (a symlink,
    FIFO, device, socket), else None. Such a target is never replaced: the temporary file renamed
    over it would turn ``/dev/null`` or a pipe into a regular file."""
    fs, path = ctx.fs(url)
    if not is_local_fs(fs):
        return None
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return next((what for test, what in _SPECIAL if test(mode)), None)


def _check_target(ctx: Context, url: str, force: bool) -> None:
    if url == "-":
        raise CliError("'-': writing to stdout is not supported; give a file name", EXIT_USAGE)
    special = _special_file(ctx, url)
    if special is not None:
        raise CliError(f"{url}: is a {special}, not a regular file; checkrun writes only regular files "
                       f"(even with --force): give another name", EXIT_USAGE)
    kind = ctx.kind(url)
    if kind == "dir" or url.endswith("/"):  # `cp f dir/` habit: a missing dir/ became a file named dir
        raise CliError(f"{url}: is a directory{'' if kind == 'dir' else ' name (ends with /)'}; give a file name",
                       EXIT_USAGE)
    if kind == "file" and not force:
        raise CliError(f"{url}: already exists (use --force to overwrite)", EXIT_USAGE)


class _ProgressWriter:
    """A write-only file object that counts bytes into a tqdm bar (torch.save writes through it)."""

    def __init__(self, f: Any, bar: Any) -> None:
        self.f, self.bar, self.written = f, bar, 0
        self.error: OSError | None = None  # the first failed write (torch.save's own error does not say it)

    def write(self, data: bytes) -> int:
        try:
            n = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        size = memoryview(data).nbytes
        self.written += size
        self.bar.update(size)
        return size if n is None else n

    def flush(self) -> None:
        self.f.flush()


def write_file(ctx: Context, url: str, produce: Callable[[Any], None], desc: str) -> int:
    """Write ``url`` through ``produce(fileobj)``: local files via temp + rename, remote ones
    discarded (multipart aborted) when ``produce`` fails, so no partial file is left behind."""
    fs, path = ctx.fs(url)
    writer = _ProgressWriter(None, None)
    try:
        return _write_file(fs, path, produce, ctx, desc, writer)
    except Exception as exc:  # a full disk: torch.save's zip writer reported only a bad position (h106)
        err = writer.error or exc
        if isinstance(exc, CheckrunError) or not isinstance(err, OSError):
            raise
        raise CliError(f"{url}: writing failed: {err.strerror or err} (nothing was written there)") from exc


def _write_file(fs: Any, path: str, produce: Callable[[Any], None], ctx: Context, desc: str,
                writer: _ProgressWriter) -> int:
    with ctx.bar(None, desc) as bar:
        writer.bar = bar
        if is_local_fs(fs):
            path = os.path.abspath(path)
            os.makedirs(os.path.dirname(path), exist_ok=True)

            def fill(f: Any) -> None:
                writer.f = f
                produce(writer)

            write_atomic(path, fill)
        else:
            f = writer.f = fs.open(path, "wb")
            try:
                produce(writer)
            except BaseException:
                discard = getattr(f, "discard", None)
                if callable(discard):
                    discard()
                raise
            f.close()
            fs.invalidate_cache(path)
        return writer.written


def read_file(ctx: Context, url: str) -> bytes:
    fs, path = ctx.fs(url)
    try:
        fs.invalidate_cache(path)
        size = fs.size(path)
        buf = io.BytesIO()
        with ctx.bar(size, "reading") as bar, fs.open(path, "rb") as f:
            while True:
                block = f.read(_BLOCK)
                if not block:
                    break
                buf.write(block)
                bar.update(len(block))
    except FileNotFoundError:
        raise CliError(f"{url}: no such file") from None
    except IsADirectoryError:
        raise CliError(f"{url}: is a directory", EXIT_USAGE) from None
    return buf.getvalue()


# ----------------------------------------------------------------------------- export


def _drop_objects(skeleton: Any, kept: dict[int, int]) -> Any:
    """Copy of a skeleton with every pickled-object ref ({"$o": i}) replaced by null, and every tensor
    ref ({"$t": i}, {"$p": [i, grad]}) renumbered by ``kept`` (old index -> new), or null if not there."""
    root = [skeleton]
    stack: list[tuple[Any, Any]] = [(root, 0)]
    while stack:
        parent, slot = stack.pop()
        node = parent[slot]
        if isinstance(node, dict):
            if len(node) == 1 and "$o" in node:
                parent[slot] = None
                continue
            if len(node) == 1 and ("$t" in node or "$p" in node):
                parent[slot] = _renumbered(node, kept)
                continue
            node = parent[slot] = dict(node)
            stack.extend((node, k) for k in node)
        elif isinstance(node, list):
            node = parent[slot] = list(node)
            stack.extend((node, i) for i in range(len(node)))
    return root[0]


@lru_cache(maxsize=None)
def storable(dtype: torch.dtype) -> bool:
    """Whether safetensors can hold tensors of ``dtype`` (it has no complex128, for one) and read them
    back from bytes as ``checkrun import`` does (0.8 writes float8_e8m0fnu and float4 it cannot)."""
    from safetensors.torch import load as st_load, save as st_save

    try:
        st_load(st_save({"x": torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype)}))  # no complex32 warning
    except Exception:  # noqa: BLE001 - KeyError today; whatever a safetensors release raises
        return False
    return True


def _renumbered(ref: dict, kept: dict[int, int]) -> dict | None:
    (tag, arg), = ref.items()
    index = arg[0] if isinstance(arg, list) else arg
    if index not in kept:
        return None
    return {tag: [kept[index], *arg[1:]] if isinstance(arg, list) else kept[index]}


def safetensors_payload(state: Any, values: dict) -> tuple[dict, dict, list[str]]:
    """(tensors by dotted key, metadata, keys of dropped values) for ``state``: values that need
    pickle and tensors of a dtype safetensors cannot hold are dropped (null in the skeleton)."""
    flat = flatten(state)
    tensors, kept = {}, {}
    dropped = []
    for i, leaf in enumerate(flat.tensors):
        if storable(leaf.tensor.dtype):
            kept[i] = len(tensors)
            tensors[leaf.key or "_"] = leaf.tensor.detach().contiguous()
        else:
            dropped.append(leaf.key or "_")
    dropped += [o.key or "_" for o in flat.objects]
    meta = {"format": "pt",
            "checkrun.skeleton": json.dumps(_drop_objects(flat.skeleton, kept), separators=(",", ":")),
            "checkrun.tensors": json.dumps(list(tensors), separators=(",", ":")),
            "checkrun.values": json.dumps(jsonable(values), separators=(",", ":"), allow_nan=False)}
    if dropped:
        meta["checkrun.dropped"] = json.dumps(dropped)
    return tensors, meta, dropped


def numpy_values(state: Any, limit: int = 100) -> list[str]:
    """Dotted keys of the numpy scalars and arrays in ``state`` (dicts, lists, tuples; at most ``limit``)."""
    out: list[str] = []
    todo: list[tuple] = [(state, None, None)]  # (value, its parent's key, its own key): keys made when reached
    while todo and len(out) < limit:
        value, parent, k = todo.pop()
        key = "" if parent is None else f"{parent}.{k}" if parent else str(k)
        if isinstance(value, (np.generic, np.ndarray)):
            out.append(key or "_")
        elif isinstance(value, dict):
            todo.extend((v, key, k) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            todo.extend((v, key, i) for i, v in enumerate(value))
    return sorted(out)


def cmd_export(ctx: Context) -> int:
    args = ctx.args
    fmt = _format(args.out, args.format)
    replay = None
    if getattr(args, "step", None) is not None:  # the state replayed to a logged step (docs/steplog.md)
        from .stepexport import plain_values, replayed_state

        if args.step < 0:
            raise CliError("--step must be >= 0", EXIT_USAGE)
        _check_target(ctx, args.out, args.force)
        src, state, replay = replayed_state(ctx, args.checkpoint, args.step, args.optimizer, not args.unsafe)
        values = plain_values(state)
    else:
        src = ctx.checkpoint(args.checkpoint)
        _check_target(ctx, args.out, args.force)
        view = open_view(ctx, src)
        with ctx.bar(1, "loading", unit="ckpt") as bar:
            state = view.load(ctx, weights_only=not args.unsafe)
            bar.update(1)
        values = view.values() if fmt == "safetensors" else {}  # only safetensors' metadata holds them
    dropped: list[str] = []
    if fmt == "safetensors":
        from safetensors.torch import save as st_save

        tensors, meta, dropped = safetensors_payload(state, values)
        data = st_save(tensors, metadata=meta)
        n_tensors = len(tensors)

        def produce(f):
            for i in range(0, len(data), _BLOCK):
                f.write(data[i:i + _BLOCK])
    else:
        n_tensors = len(flatten(state).tensors)
        pickled = numpy_values(state)  # plain data in a checkpoint, pickled objects in a torch file

        def produce(f):
            torch.save(state, f)
    written = write_file(ctx, args.out, produce, "writing")
    if fmt != "safetensors" and pickled:
        log.warning("checkrun: %s: %d numpy value(s) (%s) are pickled in a torch file: torch.load(weights_only=True) "
                    "refuses them (weights_only=False, or torch.serialization.add_safe_globals for numpy's types; "
                    "checkrun import --unsafe)", args.out, len(pickled), ", ".join(pickled[:5]))
    for key in dropped:
        log.warning("checkrun: %s: value %r needs pickle or has a dtype safetensors cannot hold; dropped",
                    args.out, key)
    result = {"source": src, "out": args.out, "format": fmt, "tensors": n_tensors, "bytes": written,
              "dropped": dropped}
    if replay is not None:
        result["replay"] = replay
    if ctx.json:
        emit_json(result)
    else:
        shown = safe(src)
        if replay is not None:
            print(f"replayed {replay['replayed_steps']} logged step(s) after {safe(src)} (step {replay['from_step']}) "
                  f"with {replay['optimizer']}")
            shown = f"{safe(src)} + step log to step {replay['step']}"
        print(f"exported {shown} -> {safe(args.out)} ({fmt}, {n_tensors} tensors, {human_size(written)})")
        if dropped:
            print(safe(f"note: {len(dropped)} value(s) dropped (safetensors holds tensors of its dtypes and "
                       f"plain data only; pickled values and e.g. complex128 tensors cannot go in): "
                       f"{', '.join(dropped)}"))
    return EXIT_OK


# ----------------------------------------------------------------------------- import


def safetensors_metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors file held in memory (header: u64 length + JSON)."""
    if len(data) < 8:
        return {}
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def state_from_safetensors(data: bytes, where: str) -> Any:
    from safetensors.torch import load as st_load

    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError and others
        raise CliError(f"{where}: not a valid safetensors file: {one_line(exc)}") from None
    meta = safetensors_metadata(data)
    if "checkrun.skeleton" not in meta:
        return dict(tensors)
    try:
        skeleton = json.loads(meta["checkrun.skeleton"])
        keys = json.loads(meta["checkrun.tensors"])
        return unflatten(skeleton, [tensors[k] for k in keys], [])
    except RecursionError:
        raise CliError(f"{where}: invalid checkrun metadata in safetensors file: checkrun.skeleton is nested "
                       f"too deeply") from None
    except (ValueError, KeyError, TypeError, CheckrunError) as exc:
        raise CliError(f"{where}: invalid checkrun metadata in safetensors file: {one_line(exc)}") from None


def state_from_torch(data: bytes, where: str, unsafe: bool) -> Any:
    if data[:4] != _TORCH_MAGIC and data[:1] != b"\x80":  # neither torch.save's zip nor a pickle
        raise CliError(f"{where}: not a PyTorch file (neither a torch.save zip archive nor a pickle; "
                       f"{len(data)} bytes); a safetensors file needs --format safetensors")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not unsafe)
    except pickle.UnpicklingError as exc:
        if unsafe:
            raise CliError(f"{where}: cannot unpickle: {one_line(exc)}") from None
        first = one_line(str(exc).split("\n")[0] if "\n" in str(exc) else exc)[:300]
        raise CliError(f"{where}: loading it needs pickle beyond plain tensors and values ({first}); "
                       f"rerun with --unsafe only if you trust this file") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file raises anything from the unpickler
        raise CliError(f"{where}: not a loadable PyTorch file: {type(exc).__name__}: {one_line(exc)[:300]}") from None


def cmd_import(ctx: Context) -> int:
    args = ctx.args
    _check_target(ctx, args.checkpoint, args.force)
    data = read_file(ctx, args.file)
    if is_manifest_head(data):
        raise CliError(f"{args.file}: is already a checkrun checkpoint (use `checkrun export` to turn it "
                       f"into a torch file)")
    fmt = args.format or ("torch" if data[:4] == _TORCH_MAGIC else _format(args.file, None))
    if fmt == "safetensors":
        state = state_from_safetensors(data, args.file)
    else:
        state = state_from_torch(data, args.file, args.unsafe)
    del data
    with ctx.bar(1, "saving", unit="ckpt") as bar:
        info = ctx.engine.save(state, args.checkpoint, storage_options=ctx.storage_options).result()
        bar.update(1)
    result = {"source": args.file, "checkpoint": info.path, "format": fmt, "tensor_bytes": info.tensor_bytes,
              "written_bytes": info.written_bytes, "stored_bytes": info.stored_bytes,
              "ratio": info.compression_ratio, "quantized_tensors": info.quantized_tensors}
    if ctx.json:
        emit_json(result)
    else:
        print(f"imported {safe(args.file)} -> {safe(args.checkpoint)}: {human_size(info.tensor_bytes)} of tensors, wrote "
              f"{human_size(info.written_bytes)}, references {human_size(info.referenced_bytes)} "
              f"({fmt_less(info.tensor_bytes, info.referenced_bytes)} than the tensor bytes)")
    return EXIT_OK
