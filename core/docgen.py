"""Generate the configuration reference (docs/configuration.md) from the EngineConfig dataclasses.

``python -m ckpt_core.docgen > docs/configuration.md``; a test checks the file is current, so the
reference cannot drift from the code. Field descriptions are the string literals under each field.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing


from .config import EngineConfig, QuantRule

_HEADER = """# Configuration reference

Generated from `ckpt_core.config` by `python -m ckpt_core.docgen > docs/configuration.md`
(a test fails when this file is out of date). Every setting lives in one `EngineConfig` tree; build it
with `EngineConfig.from_dict({...})`, `EngineConfig.from_yaml(path)` or keyword-free defaults
`EngineConfig()`. Unknown keys and wrong types raise `ConfigError` naming the dotted key.

Example YAML:

```yaml
saving: {max_pending: 1, workers: 2}
incremental: {policy: intermittent, max_chain: 8}
retention: {keep_last: 3}
quantization:
  - {pattern: "*embedding*", method: uniform, bits: 4}
storage:
  storage_options: {client_kwargs: {endpoint_url: "http://127.0.0.1:9000"}}
```
"""


def _field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _type_name(tp) -> str:
    text = str(tp).replace("typing.", "").replace("NoneType", "None")
    return getattr(tp, "__name__", text) if not typing.get_args(tp) else text


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return json.dumps(f.default) if not isinstance(f.default, tuple) else json.dumps(list(f.default))
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "see below" if dataclasses.is_dataclass(value) else json.dumps(value)
    return "required"


def _section(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    lines = [f"## `{prefix or 'EngineConfig'}`", "", (inspect.getdoc(cls) or "").split("\n")[0], "",
             "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(tp):
            nested.append((tp, key))
            lines.append(f"| `{key}` | section | | see `{key}` below |")
            continue
        lines.append(f"| `{key}` | `{_type_name(tp)}` | `{_default(f)}` | {docs.get(f.name, '')} |")
    lines.append("")
    for tp, key in nested:
        lines.extend(_section(tp, key))
    return lines


def render() -> str:
    """The whole configuration reference as Markdown."""
    lines = [_HEADER]
    lines.extend(_section(EngineConfig, ""))
    lines.extend(_section(QuantRule, "quantization[]"))
    return "\n".join(lines).rstrip() + "\n"




if __name__ == "__main__":
    print(render(), end="")
