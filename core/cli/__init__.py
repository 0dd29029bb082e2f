"""``checkrun``: see and manage checkpoints without writing Python.

    checkrun ls DIR                 one row per checkpoint: sizes (tensors, wrote, referenced), dedup totals
    checkrun inspect CKPT           the state tree: tensors (codecs, sizes, error) and plain values
    checkrun verify CKPT|DIR        checksums of every blob and manifest; exit 1 if anything is corrupt
    checkrun export CKPT OUT        a self-contained .pt/.ckpt (torch.save) or .safetensors file
                                    (--step N: the state replayed from the step log to step N)
    checkrun import FILE CKPT       a torch/safetensors file -> a checkrun checkpoint
    checkrun diff A B               changed tensors/rows/values between two checkpoints
    checkrun gc DIR                 delete blobs no checkpoint references and no save in flight holds

Every path may be an fsspec URL (``s3://bucket/run``); ``--storage-option key=value`` (repeatable,
JSON values, dotted keys nest) and ``--endpoint-url`` reach the storage. Exit codes: 0 ok, 1 a
problem was found (corrupt data, missing file, error of the engine), 2 usage errors, 130 interrupted,
141 when the reader of stdout went away (``checkrun inspect --json CKPT | head``; quietly, no message).

``main(argv)`` runs on the calling thread and returns the exit code (the console script exits with
it); it installs a log handler on the ``ckpt_core`` logger for its duration only.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import sys
from typing import Sequence

from .util import (
    EXIT_PROBLEM, EXIT_USAGE, CliError, Context, log, one_line, parse_storage_options, safe)

_EXIT_INTERRUPTED = 130
_EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


def _stdout_gone() -> bool:
    """True if stdout's reader went away (``checkrun ... | head``); stdout then goes to /dev/null
    so that nothing (not the interpreter's last flush either) reports the broken pipe."""
    stream = sys.stdout
    try:
        stream.flush()
        fd = stream.fileno()
        if not hasattr(select, "poll"):  # Windows: only a failing flush tells
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(ev & select.POLLERR for _, ev in poller.poll(0))  # a pipe without reader: POLLERR
    except BrokenPipeError:
        gone = True
        fd = _fileno(stream)
    except (AttributeError, ValueError, OSError):  # no real file (a test's capture), closed
        return False
    if gone and fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return None


def _common(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("storage and output")
    g.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be; "
                        "dotted keys nest, e.g. client_kwargs.region_name=eu-west-1")
    g.add_argument("--endpoint-url", metavar="URL",
                   help="S3-compatible endpoint (shortcut for -o client_kwargs.endpoint_url=URL)")
    g.add_argument("--config", metavar="FILE", help="EngineConfig YAML file (storage options, limits, "
                                                    "quantization rules for import, gc grace)")
    g.add_argument("--config-section", metavar="NAME", help="read only this top-level section of --config")
    g.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("-v", "--verbose", action="count", default=0, help="more log messages (-vv: debug)")
    g.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="checkrun", description="See and manage checkrun checkpoints (local paths or fsspec URLs).",
        epilog="exit codes: 0 ok, 1 problem found or error, 2 usage error, 130 interrupted")
    parser.add_argument("--version", action="version", version=f"checkrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        return p

    p = add("ls", "list the checkpoints of a directory with sizes and dedup totals")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--verify", action="store_true",
                   help="also check every blob's presence and checksum (reads all blobs)")
    _common(p)

    p = add("inspect", "show a checkpoint's state tree: tensors and plain values (reads no tensor data)")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint file, or a directory (its latest)")
    p.add_argument("--wide", action="store_true",
                   help="do not shorten long keys and values to fit 120 columns (--json has everything)")
    _common(p)

    p = add("verify", "check the manifest and every blob of a checkpoint or of all checkpoints in a directory")
    p.add_argument("path", metavar="CKPT|DIR")
    p.add_argument("--no-decode", action="store_true", help="checksums only, do not decode the tensors")
    _common(p)

    p = add("export", "write a checkpoint as one self-contained .pt/.ckpt (torch.save) or .safetensors file")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint file, or a directory (its latest)")
    p.add_argument("out", metavar="OUT", help="output file or fsspec URL; .safetensors selects safetensors")
    p.add_argument("--format", choices=("torch", "safetensors"), help="override the format chosen by OUT's suffix")
    p.add_argument("--unsafe", action="store_true", help="allow pickled values in the checkpoint (trusted only)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    p.add_argument("--step", type=int, metavar="N",
                   help="the state at logged step N: the checkpoint marked newest at or before N, then the "
                        "step log replayed to N (CKPT: a directory, or the checkpoint to start from)")
    p.add_argument("--optimizer", metavar="NAME",
                   help="with --step: the torch.optim class that trained (e.g. Adam); default: the class the "
                        "step log records, if it is one of torch.optim's (logs before format version 2 record none)")
    _common(p)

    p = add("import", "turn a torch.save or safetensors file into a checkrun checkpoint")
    p.add_argument("file", metavar="FILE", help="a .pt/.ckpt/.pth/.bin or .safetensors file, or fsspec URL")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint path to create (DIR/NAME.ckpt)")
    p.add_argument("--format", choices=("torch", "safetensors"), help="override the detected format")
    p.add_argument("--unsafe", action="store_true",
                   help="torch.load with weights_only=False (runs pickle: trusted files only)")
    p.add_argument("--force", action="store_true", help="overwrite CKPT")
    _common(p)

    p = add("diff", "compare two checkpoints: changed tensors and rows, max abs difference, changed values")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--all", action="store_true", help="also list identical tensors")
    p.add_argument("--unsafe", action="store_true", help="allow pickled values when loading (trusted only)")
    p.add_argument("--exit-code", action="store_true", help="exit 1 when the checkpoints differ")
    _common(p)

    p = add("gc", "delete blobs that no checkpoint in the directory references")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    p.add_argument("--grace", type=float, metavar="SECONDS",
                   help="also keep unreferenced blobs younger than this (default: retention.gc_grace_seconds, 0; "
                        "the blobs of saves in flight are kept by their leases, not by age)")
    _common(p)
    return parser


def _commands() -> dict:
    from .diff import cmd_diff
    from .files import cmd_export, cmd_import
    from .inspect import cmd_inspect
    from .ls import cmd_ls
    from .maint import cmd_gc, cmd_verify

    return {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export,
            "import": cmd_import, "diff": cmd_diff, "gc": cmd_gc}


class _SafeFormatter(logging.Formatter):
    """Log messages with control characters escaped (they name keys and files); a traceback (-vv)
    keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return safe(super().formatMessage(record))


def _logging(args: argparse.Namespace) -> tuple[logging.Logger, logging.Handler, int]:
    logger = logging.getLogger("ckpt_core")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_SafeFormatter("%(message)s"))
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    old = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    return logger, handler, old


def _context(args: argparse.Namespace) -> Context:
    from ..config import EngineConfig
    from ..engine import CheckpointEngine

    cli_opts = parse_storage_options(args.storage_option, args.endpoint_url)
    if args.config_section and not args.config:
        raise CliError("--config-section needs --config FILE", EXIT_USAGE)
    config = (EngineConfig.from_yaml(args.config, section=args.config_section) if args.config
              else EngineConfig())
    from ..storage.options import merge_options

    opts = merge_options(config.storage.storage_options, cli_opts)
    return Context(args=args, engine=CheckpointEngine(config), storage_options=opts, json=args.json,
                   progress=not args.no_progress)


def _error_code(exc: BaseException) -> int:
    from ..errors import ConfigError

    return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_PROBLEM


def _message(exc: BaseException) -> str:
    """One line: ckpt_core's messages name the file; others get their type (botocore, fsspec ...)."""
    from ..errors import CheckrunError, UnsafeLoadError

    text = one_line(exc)
    if not isinstance(exc, (CheckrunError, OSError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if isinstance(exc, UnsafeLoadError) and "--unsafe" not in sys.argv:  # with it: torch's switch forced the refusal
        text += " [checkrun: pass --unsafe to allow pickled values of a trusted checkpoint]"
    return text


def run(args: argparse.Namespace) -> int:
    """Run one parsed command; errors become one line on stderr and an exit code."""
    ctx = None
    try:
        ctx = _context(args)
        return _commands()[args.command](ctx)
    except CliError as exc:
        print(f"checkrun: error: {safe(one_line(exc))}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("checkrun: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - CheckrunError, OSError, and storage clients' own errors
        if isinstance(exc, BrokenPipeError) and _stdout_gone():
            return _EXIT_BROKEN_PIPE  # the reader of our output left: nothing to report
        log.debug("checkrun: traceback", exc_info=True)
        print(f"checkrun: error: {safe(_message(exc))}", file=sys.stderr)
        return _error_code(exc)
    finally:
        if ctx is not None:
            try:
                ctx.engine.close()
            except Exception as exc:  # noqa: BLE001 - already reporting; never mask the result
                print(f"checkrun: error while closing: {safe(one_line(exc))}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``checkrun`` console script; returns the exit code (never raises SystemExit)."""
    try:
        code = _main(argv)
    except BrokenPipeError:  # argparse printing --help or --version into a closed pipe
        if not _stdout_gone():
            raise
        return _EXIT_BROKEN_PIPE
    try:
        sys.stdout.flush()  # now, not at exit: the pipe's reader may be gone (`checkrun ... | head`)
    except BrokenPipeError:
        _stdout_gone()
        return _EXIT_BROKEN_PIPE
    except (AttributeError, ValueError):  # stdout replaced or closed by the caller: nothing to flush
        pass
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, --version, usage errors: argparse printed the message
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logger, handler, old_level = _logging(args)
    try:
        return run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


if __name__ == "__main__":  # python -m ckpt_core.cli
    sys.exit(main())
