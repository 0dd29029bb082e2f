"""``accelerate-ckpt launch``: ``accelerate launch`` for config files with a ``checkpointing:`` section.

Accelerate's config loader rejects unknown top-level keys, so this command

1. parses its arguments with accelerate's own ``launch`` parser (every option works as there),
2. reads the config file (``--config_file``, else accelerate's default config file if it exists),
3. writes the file without its ``checkpointing:`` section to a temporary accelerate config, and the
   section to a temporary YAML whose path it exports as ``$CHECKRUN_CONFIG`` for the script,
4. runs accelerate's ``launch`` with the temporary config, then removes the temporary files.

A config file without a ``checkpointing:`` section is passed on unchanged. Usage::

    accelerate-ckpt launch --config_file accelerate_checkrun.yaml train.py --my-arg 1
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Sequence

import yaml

from ckpt_core import CheckrunError, ConfigError

from .config import CONFIG_ENV, SECTION, from_mapping, read_yaml, split_sections

log = logging.getLogger("accelerate_ckpt")
USAGE = ("usage: accelerate-ckpt launch [accelerate launch options] --config_file FILE script.py [script args]\n"
         f"  Strips the '{SECTION}:' section of FILE into ${CONFIG_ENV} and runs 'accelerate launch'.")


def prepare_config(config_file: str, workdir: str) -> tuple[str, str | None]:
    """Split ``config_file``: ``(accelerate config path, checkrun section path or None)``.

    The section is validated first, so a typo fails here rather than in every process."""
    data = read_yaml(config_file)
    try:
        rest, section = split_sections(data)
    except CheckrunError as exc:
        raise type(exc)(f"{config_file}: {exc}") from None
    if section is None:
        check_accelerate_config(config_file, config_file)
        return config_file, None
    from_mapping(section, f"{config_file}: {SECTION}")
    accel_path = os.path.join(workdir, "accelerate_config.yaml")
    section_path = os.path.join(workdir, "checkpointing.yaml")
    with open(accel_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(rest, f, sort_keys=False)
    with open(section_path, "w", encoding="utf-8") as f:
        yaml.safe_dump({SECTION: section}, f, sort_keys=False)
    check_accelerate_config(accel_path, config_file)
    return accel_path, section_path


def check_accelerate_config(path: str, shown: str) -> None:
    """Load ``path`` with accelerate's own config loader; its error becomes a ConfigError naming
    ``shown`` (the user's file) instead of a traceback from inside ``accelerate launch``."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(path)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        text = " ".join(str(exc).replace(path, shown).split()) or type(exc).__name__
        raise ConfigError(f"{shown}: not a valid accelerate config: {text}") from None


def _default_config_file() -> str | None:
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


def _has_section(path: str) -> bool:
    """Whether the YAML file ``path`` has a ``checkpointing:`` section (False when it cannot be read: a file
    accelerate ignores is not checked, h137)."""
    try:
        return SECTION in read_yaml(path)
    except ConfigError:
        return False


def launch(argv: Sequence[str]) -> None:
    """Run ``accelerate launch argv...`` with the ``checkpointing:`` section split off."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(list(argv))
    config_file = args.config_file or (None if args.cpu else _default_config_file())
    skipped = None if args.config_file or not args.cpu else _default_config_file()
    if skipped is not None and _has_section(skipped):  # h136: dropped without a word
        log.warning("accelerate-ckpt: with --cpu, accelerate ignores its default config %s, and so its %s: section "
                    "is not used either: pass --config_file %s (or set $%s)", skipped, SECTION, skipped, CONFIG_ENV)
    if config_file is None:
        launch_command(args)
        return
    workdir = tempfile.mkdtemp(prefix="accelerate-ckpt-")
    previous = os.environ.get(CONFIG_ENV)
    try:
        accel_path, section_path = prepare_config(config_file, workdir)
        if section_path is not None:
            args.config_file = accel_path
            if previous:  # the file's section wins (it is what this launch names); say so
                log.warning("accelerate-ckpt: the %s section of %s replaces $%s=%s for this launch", SECTION,
                            config_file, CONFIG_ENV, previous)
            os.environ[CONFIG_ENV] = section_path
            log.info("accelerate-ckpt: %s section of %s -> $%s=%s", SECTION, config_file, CONFIG_ENV, section_path)
        launch_command(args)
    finally:
        if previous is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = previous
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``accelerate-ckpt``; a config error is one line on stderr and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "launch":
        print(f"accelerate-ckpt: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    if not log.handlers:  # say what was split, without turning on INFO logs of every library
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        launch(argv[1:])
    except CheckrunError as exc:  # names the file and the problem; a traceback would only bury it
        print(f"accelerate-ckpt: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
