"""Shared plumbing of the ``checkrun`` command line: options, engine, storage, output, progress.

Everything here runs on the CLI's main thread. Exit codes are centralised in :class:`CliError`
(raised by commands for problems that are not ckpt_core errors) and in ``cli.main``.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

log = logging.getLogger("ckpt_core.cli")


class CliError(Exception):
    """A problem the CLI reports as one line on stderr with ``code`` as the exit status."""

    def __init__(self, message: str, code: int = EXIT_PROBLEM) -> None:
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- storage options


def parse_value(text: str) -> Any:
    """A ``--storage-option`` value: JSON when it parses (``true``, ``3``, ``{"a": 1}``), else text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def set_dotted(target: dict, dotted: str, value: Any) -> None:
    """``set_dotted(d, "client_kwargs.endpoint_url", v)`` -> ``d["client_kwargs"]["endpoint_url"] = v``."""
    parts = dotted.split(".")
    if not all(parts):
        raise CliError(f"invalid storage option key {dotted!r}", EXIT_USAGE)
    node = target
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CliError(f"storage option {'.'.join(parts[:i + 1])!r} is both a value and a "
                           f"group (in {dotted!r})", EXIT_USAGE)
        node = child
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
        raise CliError(f"storage option {dotted!r} is both a value and a group", EXIT_USAGE)
    node[parts[-1]] = value


def parse_storage_options(items: Sequence[str], endpoint_url: str | None) -> dict:
    """Build fsspec storage options from repeated ``key=value`` items and ``--endpoint-url``."""
    opts: dict = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--storage-option expects KEY=VALUE, got {item!r}", EXIT_USAGE)
        set_dotted(opts, key.strip(), parse_value(value))
    if endpoint_url:
        set_dotted(opts, "client_kwargs.endpoint_url", endpoint_url)
    return opts


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` wins key by key, nested dicts are merged (config options + command line)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- context


@dataclass
class Context:
    """What every command gets: the parsed arguments, one engine, the merged storage options."""

    args: Any
    engine: Any
    storage_options: dict
    json: bool = False
    progress: bool = True

    def fs(self, url: str):
        """(filesystem, path) of ``url`` with this run's storage options."""
        from fsspec.core import url_to_fs

        try:
            return url_to_fs(os.fspath(url), **self.storage_options)
        except ImportError as exc:  # e.g. s3fs not installed
            raise CliError(f"{url}: cannot open this location: {exc}") from None
        except (ValueError, TypeError) as exc:  # unknown protocol, options the filesystem rejects
            raise CliError(f"{url}: cannot open this location: {exc}", EXIT_USAGE) from None

    def kind(self, url: str) -> str:
        """"file", "dir" or "missing" for a path or URL (object stores: a prefix is a dir)."""
        fs, path = self.fs(url)
        try:
            fs.invalidate_cache(path)
            info = fs.info(path)
        except FileNotFoundError:
            return "missing"
        except OSError as exc:
            raise CliError(f"{url}: {exc}") from None
        return "dir" if info.get("type") == "directory" else "file"

    def checkpoint(self, url: str) -> str:
        """Resolve CKPT arguments: a checkpoint file, or a directory's newest intact checkpoint."""
        kind = self.kind(url)
        if kind == "file":
            return url
        if kind == "dir":
            latest = self.engine.latest(url, storage_options=self.storage_options)
            if latest is None:
                raise CliError(f"{url}: directory holds no intact checkrun checkpoint")
            log.info("checkrun: using the latest checkpoint %s", latest)
            return latest
        raise CliError(f"{url}: no such checkpoint")

    def bar(self, total: float | None, desc: str, unit: str = "B"):
        """A tqdm progress bar on stderr; disabled under --json, --no-progress or without a TTY."""
        from tqdm import tqdm

        disable = not self.progress or self.json or not _isatty(sys.stderr)
        scale = unit == "B"
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
                    file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ----------------------------------------------------------------------------- formatting


def human_size(n: float | None) -> str:
    """``1536 -> "1.5 KiB"``; ``None -> "-"``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover - unreachable


def human_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return _dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def iso_time(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).isoformat()


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_float(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = ()) -> str:
    """Plain aligned columns; ``right`` holds the indices of right-aligned (numeric) columns.

    A row with only two cells is a *spanning* row: its second cell starts at the second column
    and does not widen the columns (long values in a tree of tensors)."""
    rows = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        cells = r if len(r) == len(headers) else r[:1]
        for i, c in enumerate(cells):
            widths[i] = max(widths[i], len(c))
    right = set(right)

    def line(cells):
        if len(cells) != len(headers):
            return f"{cells[0].ljust(widths[0])}  {' '.join(cells[1:])}".rstrip()
        out = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def one_line(text: Any) -> str:
    """Whitespace collapsed; ``"P: P: msg"`` (a path the engine put in twice) becomes ``"P: msg"``."""
    text = " ".join(str(text).split())
    parts = text.split(": ", 2)
    if len(parts) == 3 and parts[0] == parts[1]:
        return f"{parts[0]}: {parts[2]}"
    return text


def jsonable(value: Any) -> Any:
    """Strict-JSON form of plain data: non-finite floats and other scalars become strings."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


def emit_json(data: Any) -> None:
    print(json.dumps(jsonable(data), indent=2, allow_nan=False))


# Parameters that describe the implementation rather than the format, hidden in text output.
_HIDDEN_PARAMS = frozenset({"name", "version", "threads", "itemsize", "greedy", "scale_dtype"})


def codecs_text(codecs: Sequence[dict]) -> str:
    """``[{"name": "raw"}, {"name": "zstd", "level": 1, ...}] -> "raw > zstd(level=1)"`` (JSON has all)."""
    parts = []
    for c in codecs:
        params = [f"{k}={v}" for k, v in c.items() if k not in _HIDDEN_PARAMS and v is not None]
        name = str(c.get("name", "?"))
        parts.append(f"{name}({','.join(params)})" if params else name)
    return " > ".join(parts) or "-"
