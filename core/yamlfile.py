"""Reading a YAML config file: every problem is a ``ConfigError`` naming the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; ``ConfigError`` naming the file for an unreadable, non-UTF-8 or invalid one, and for a
    key given twice (h136: a second ``retention:`` block silently replaced the first)."""
    import yaml

    class _Unique(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            keys = [self.construct_object(k, deep=True) for k, _ in node.value
                    if k.tag != "tag:yaml.org,2002:merge"]  # `<<: *defaults` (h137): its keys may be given again
            twice = next((i for i, k in enumerate(keys) if _hashable(k) and k in keys[:i]), None)
            if twice is not None:
                raise ConfigError(f"{path}: key {keys[twice]!r} appears twice in one mapping (the mapping at line "
                                  f"{node.start_mark.line + 1}; the last would silently win)")
            return super().construct_mapping(node, deep)

    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")  # ~ as in checkpoint paths (h136)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}): a config is YAML text") from None
    try:
        return yaml.load(text, Loader=_Unique)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).replace('<unicode string>', str(path))}") from exc


def _hashable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None)))
