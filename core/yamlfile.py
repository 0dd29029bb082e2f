"""Reading a YAML config file: every problem is a ``ConfigError`` naming the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError

_MERGE, _VALUE = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:value"


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; ``ConfigError`` naming the file for an unreadable, non-UTF-8 or invalid one, and for a
    key given twice in one mapping (h136: a second ``retention:`` block silently replaced the first). Keys merged
    in with ``<<: *anchor`` may be given again, as YAML allows."""
    import yaml

    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")  # ~ as in checkpoint paths (h136)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}): a config is YAML text") from None
    try:
        _check_unique(yaml.compose(text, Loader=yaml.SafeLoader), path)  # on the nodes as written (h138: not
        return yaml.safe_load(text)  # after the loader's merges, which change anchored mappings in place)
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError) as exc:  # PyYAML's own, for a bad scalar (`2026-13-45`, `!!bool x`)
        raise ConfigError(f"{path}: invalid YAML: {type(exc).__name__}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).replace('<unicode string>', str(path))}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"{path}: invalid YAML: nested too deeply for a config") from None


def _check_unique(root: Any, path: str | Path) -> None:
    """``ConfigError`` for a key written twice in one mapping node (each node once: aliases share them)."""
    import yaml

    seen, todo, build = set(), [root], yaml.SafeLoader("").construct_object
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set = set()
            for key, value in node.value:
                todo += [key, value]
                if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:
                    continue
                try:  # as the loaded dict has it: 1, 0x1 and 1.0 (true and on) are one key (h139); `=` is a string
                    built = key.value if key.tag == _VALUE else build(key)
                    twice = built in keys
                except (ValueError, KeyError, TypeError, yaml.YAMLError):  # no key the loader builds (h140):
                    continue  # the load says why
                if twice:
                    raise ConfigError(f"{path}: key {key.value!r} appears twice in one mapping (line "
                                      f"{key.start_mark.line + 1}; the last would silently win)")
                keys.add(built)
        elif isinstance(node, yaml.SequenceNode):
            todo += node.value
