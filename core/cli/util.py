"""Shared plumbing of the ``checkrun`` command line: options, engine, storage, output, progress.

Everything here runs on the CLI's main thread. Exit codes are centralised in :class:`CliError`
(raised by commands for problems that are not ckpt_core errors) and in ``cli.main``.
"""
from __future__ import annotations

import datetime as _dt
import errno
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .. import units as _units
from ..storage.paths import bucket_of, is_local_fs
from ..storage.retry import call_with_retry

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

log = logging.getLogger("ckpt_core.cli")


def dangling(path: str) -> str:
    """What is wrong with a symbolic link that points at nothing, or at no regular file (the message
    names its target)."""
    target = os.readlink(path)
    if os.path.exists(path):  # a device, a directory, a pipe (h106: /dev/zero was said not to exist)
        return f"a symbolic link to {target}, which is not a regular file (not a checkpoint)"
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # h134: a loop was said not to exist
            return f"a symbolic link to {target}, a loop of links (no file at its end)"
    return f"a symbolic link to {target}, which does not exist (its checkpoint is gone)"


def points_beside(directory: str, target: str) -> bool:
    """Whether a link in the local ``directory`` whose target is ``target`` points at a file in it."""
    real = os.path.realpath  # h137: the directory given through a link of its own counted a checkpoint twice;
    here = real(directory)  # h138: only the link's own hop (a link to a link beside it points beside)
    return real(os.path.dirname(os.path.join(here, target))) == here


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

        from ..storage.options import open_options

        try:
            return url_to_fs(os.fspath(url), **open_options(os.fspath(url), self.storage_options))
        except ImportError as exc:  # e.g. s3fs not installed
            raise CliError(f"{url}: cannot open this location: {exc}") from None
        except (ValueError, TypeError) as exc:  # unknown protocol, options the filesystem rejects
            raise CliError(f"{url}: cannot open this location: {exc}", EXIT_USAGE) from None

    def kind(self, url: str) -> str:
        """"file", "dir" or "missing" for a path or URL (object stores: a prefix is a dir)."""
        fs, path = self.fs(url)
        try:
            fs.invalidate_cache(path)
            info = call_with_retry(lambda: fs.info(path), config=self.engine.config.storage.retry,
                                   what=f"look at {url}")
        except FileNotFoundError:
            if is_local_fs(fs) and os.path.islink(path):  # save_last="link" left pointing at nothing
                raise CliError(f"{url}: {dangling(path)}") from None
            located = bucket_of(fs, path)  # h147: a mistyped bucket read "no such directory", as a missing prefix
            if located is not None and not located[0].exists(located[1]):
                raise CliError(f"{url}: the bucket {located[1]!r} does not exist") from None
            return "missing"
        except OSError as exc:
            raise CliError(f"{url}: {exc}") from None
        if info.get("type") == "directory" or info.get("mimetype") == "text/html":
            return "dir"  # http: a directory is an index page (h142: "is a file"; h145: an empty one too)
        return "file"

    def links(self, directory: str) -> list[dict]:
        """The symbolic links to files in a local ``directory`` (Lightning's ``save_last="link"``
        makes ``last.ckpt`` one), by name: ``{"name", "target", "ok"}``, ``ok`` False when the link
        points at nothing. Other storage has no links: empty."""
        fs, path = self.fs(directory)
        if not is_local_fs(fs):
            return []
        out = []
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError:
            return []
        for e in entries:
            if e.is_symlink() and not e.name.startswith(".") and not os.path.isdir(e.path):
                item = {"name": e.name, "target": os.readlink(e.path), "ok": os.path.isfile(e.path)}
                if not points_beside(path, item["target"]) and not e.name.endswith((".ckpt", ".dcp")):  # h132,
                    continue  # h134: a user's train.csv -> /mnt/dataset/..., passwd -> /etc/passwd: no checkpoint link
                if not item["ok"]:  # at nothing, or at a device, a pipe (h107: said not to exist)
                    item["problem"] = ("not a regular file" if os.path.exists(e.path) else
                                       "a loop of links" if "loop" in dangling(e.path) else "it does not exist")
                out.append(item)
        return out

    def checkpoint(self, url: str) -> str:
        """Resolve CKPT arguments: a checkpoint file, a checkpoint folder's index, or a directory's
        newest intact checkpoint (see ``cli_composite.resolve_checkpoint``)."""
        from .composite import resolve_checkpoint

        return resolve_checkpoint(self, url)

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


# A manifest whose checksum holds may still carry odd values (forged or from a future release): a
# date out of range, a 400-digit integer, a string where a number belongs. Displaying them never
# raises: they are shown as they are, or as "?" where they cannot be (a date, a size).
_ODD = (ArithmeticError, ValueError, TypeError, OSError)


human_size = _units.fmt_bytes  # the CLI's name for ckpt_core.units.fmt_bytes (binary units)


def ratio(num: float | None, den: float | None) -> float | None:
    """``ckpt_core.units.ratio``; None also when the quotient cannot be a float."""
    try:
        return _units.ratio(num, den)
    except _ODD:
        return None


def fmt_ratio(r: float | None) -> str:
    """``ckpt_core.units.fmt_ratio``, or "?"."""
    try:
        return _units.fmt_ratio(r)
    except _ODD:
        return "?"


def fmt_percent(part: float | None, whole: float | None) -> str:
    """``ckpt_core.units.fmt_percent`` ("3.4%"), or "?"."""
    try:
        return _units.fmt_percent(part, whole)
    except _ODD:
        return "?"


def fmt_less(tensor_bytes: float | None, figure: float | None) -> str:
    """``ckpt_core.units.fmt_less`` ("6.95x less"), or "?"."""
    try:
        return _units.fmt_less(tensor_bytes, figure)
    except _ODD:
        return "?"


def human_time(epoch: float | None) -> str:
    """Local date and time of a timestamp; "?" when it is no date (out of range, not a number)."""
    if epoch is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")
    except _ODD:
        return "?"


def iso_time(epoch: float | None) -> str | None:
    """ISO 8601 (UTC) of a timestamp; None when it is no date."""
    if epoch is None:
        return None
    try:
        return _dt.datetime.fromtimestamp(epoch, _dt.timezone.utc).isoformat()
    except _ODD:
        return None


def fmt_float(x: float | None) -> str:
    """``x`` in 3 significant digits; anything that is not a number is shown as text."""
    if x is None:
        return "-"
    try:
        return f"{x:.3g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else text(x)
    except _ODD:
        return text(x)


# What a terminal would act on: C0 controls, DEL, C1 controls, line/paragraph separators and the
# bidirectional overrides and isolates (they reorder what follows them on the line).
_CONTROLS = ([*range(0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, 0x2028, 0x2029,
              *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
_NAMED = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
_ESCAPES = {c: _NAMED.get(c, f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _CONTROLS}


def safe(value: Any) -> str:
    """``str(value)`` fit for a terminal: control characters escaped as ``\\x1b``, ``\\n``, ``\\u202e``
    (keys and file names come from checkpoints and directories that anyone may have written);
    other characters, ordinary unicode included, stay as they are."""
    return text(value).translate(_ESCAPES)


def text(value: Any) -> str:
    """``str(value)``, never raising (an int beyond Python's digit limit is shown in hex)."""
    try:
        return str(value)
    except ValueError:
        return hex(value) if isinstance(value, int) else f"<{type(value).__name__}>"


def safe_repr(value: Any) -> str:
    """``repr(value)`` (control characters escaped), never raising."""
    try:
        return safe(repr(value))
    except ValueError:  # an int beyond the digit limit, inside a container or not
        return hex(value) if isinstance(value, int) else f"<{type(value).__name__}>"


ELLIPSIS = "\u2026"
TABLE_WIDTH = 120
"""Width tables that may be shortened fit (``inspect`` without ``--wide``), or the terminal's if wider."""


def output_width() -> int:
    """``TABLE_WIDTH``, or the width of the terminal on stdout when it is wider."""
    if _isatty(sys.stdout):
        try:
            return max(TABLE_WIDTH, os.get_terminal_size(sys.stdout.fileno()).columns)
        except (OSError, ValueError):
            pass
    return TABLE_WIDTH


def shorten_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by "\u2026" (leading spaces, the
    indentation of a tree, are kept while there is room; the end keeps a little more than the start)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:max(width, 0)]
    body = text.lstrip(" ")
    indent = len(text) - len(body)
    indent = min(indent, max(width - 8, 0))
    room = width - indent - 1
    head = room * 2 // 5  # the end of a key (the parameter's name, a file name) tells more than its start
    return " " * indent + body[:head] + ELLIPSIS + body[len(body) - (room - head):]


def shorten_end(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut at the end with "\u2026"."""
    if len(text) <= width:
        return text
    return text[:max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


def _fit(widths: list[int], width: int, stages: Sequence[dict[int, int]]) -> list[int]:
    """Narrow shrinkable columns until a line fits: stage by stage (each maps a column to the width it
    may go down to in that stage), within a stage the column furthest above its minimum first."""
    widths = list(widths)
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    for low in stages:
        while excess > 0:
            room = [i for i in low if widths[i] > low[i]]
            if not room:
                break
            i = max(room, key=lambda j: (widths[j] - low[j], widths[j]))
            widths[i] -= 1
            excess -= 1
    return widths


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = (),
          width: int | None = None, shrink: dict[int, int] | Sequence[dict[int, int]] = (),
          shorten: dict[int, Callable[[str, int], str]] | None = None) -> str:
    """Plain aligned columns; ``right`` holds the indices of right-aligned (numeric) columns.

    A row with only two cells is a *spanning* row: its second cell starts at the second column
    and does not widen the columns (long values in a tree of tensors).

    With ``width``, lines are made to fit it: the columns of ``shrink`` (index -> minimum width, or a
    list of such stages applied in order) are narrowed as needed, their cells shortened in the
    middle with "\u2026" (or by ``shorten[i](text, width)`` for column ``i``), and spanning rows are cut
    at the end. Without it, nothing is shortened."""
    headers = [safe(h) for h in headers]
    rows = [[("-" if c is None else safe(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        cells = r if len(r) == len(headers) else r[:1]
        for i, c in enumerate(cells):
            widths[i] = max(widths[i], len(c))
    stages = [shrink] if isinstance(shrink, dict) else list(shrink)
    stages = [{i: max(low, len(headers[i])) for i, low in stage.items()} for stage in stages] if width else []
    natural = list(widths)
    if stages:
        widths = _fit(widths, width, stages)
    shrink = {i for stage in stages for i in stage}
    right = set(right)
    how = shorten or {}

    def cell(i: int, c: str) -> str:
        if i not in shrink or len(c) <= widths[i]:
            return c
        return how.get(i, shorten_middle)(c, widths[i])

    if shrink:  # a shortener may leave a column narrower than allowed: give that room to the others
        full = [r for r in rows if len(r) == len(headers)]
        first = [r[:1] for r in rows if len(r) != len(headers)]
        slack = 0
        for i in shrink:
            used = max([len(headers[i])] + [len(cell(i, r[i])) for r in full] +
                       ([len(cell(0, r[0])) for r in first] if i == 0 else []))
            slack += widths[i] - used
            widths[i] = used
        for i in sorted(shrink):
            grow = min(slack, natural[i] - widths[i])
            widths[i] += grow
            slack -= grow

    def line(cells):
        if len(cells) != len(headers):
            rest = " ".join(cells[1:])
            if width:
                rest = shorten_end(rest, max(width - widths[0] - 2, 12))
            return f"{cell(0, cells[0]).ljust(widths[0])}  {rest}".rstrip()
        out = [cell(i, c).rjust(widths[i]) if i in right else cell(i, c).ljust(widths[i])
               for i, c in enumerate(cells)]
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
    if isinstance(value, int):  # json.dumps cannot write an int beyond Python's digit limit
        return value if value.bit_length() <= 14000 else hex(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k if isinstance(k, str) else repr(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # numpy scalars and arrays: as numbers
        return jsonable(value.tolist())
    return repr(value)


def emit_json(data: Any) -> None:
    print(json.dumps(jsonable(data), indent=2, allow_nan=False))


# Parameters that describe the implementation rather than the format, hidden in text output.
_HIDDEN_PARAMS = frozenset({"name", "version", "threads", "itemsize", "greedy", "scale_dtype"})


def codecs_text(codecs: Sequence[dict]) -> str:
    """``[{"name": "raw"}, {"name": "zstd", "level": 1, ...}] -> "raw > zstd(level=1)"`` (JSON has all)."""
    parts = []
    for c in codecs:
        params = [f"{safe(k)}={safe(v)}" for k, v in c.items() if k not in _HIDDEN_PARAMS and v is not None]
        name = safe(c.get("name", "?"))
        parts.append(f"{name}({','.join(params)})" if params else name)
    return " > ".join(parts) or "-"
