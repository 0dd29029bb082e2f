"""docs/troubleshooting.md covers every error message checkrun raises.

The rule (also stated at the top of docs/troubleshooting.md):

* Every ``raise SomeError(message)`` in ``core/``, ``lightning_ckpt/`` and ``accelerate_ckpt/`` is a
  *raise site*, and so is every construction of a class named ``...Error``/``...Exception`` elsewhere
  (``err = BackgroundSaveError(...)``, raised later). Re-raises such as ``raise``, ``raise exc`` or
  ``raise type(exc)(...)`` are not: they pass on a message raised elsewhere.
* Its message's *fixed parts* are the literal text of the message: the string, or the text between
  the ``{...}`` fields of an f-string. A message built by a helper (``raise X(_message(...))``) or held
  in a variable (``raise X(msg)``) is followed one step: the helper's returned strings or the
  variable's assigned strings in the same module.
* The site's *fragment* is its longest fixed part with surrounding spaces and punctuation stripped,
  cut to its first ``MAX_FRAGMENT`` characters at a word boundary. It must appear in
  docs/troubleshooting.md (whitespace, including line breaks, is compared collapsed).
* A message with no fixed part of at least ``MIN_FRAGMENT`` characters (``f"{path}: {exc}"``) only adds
  a location to another error's message, which is covered where that one is raised.
* Every exception class raised with a message must have a section heading of its own in the doc.
"""
from __future__ import annotations

import ast
import pathlib
import re
import string
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("core", "lightning_ckpt", "accelerate_ckpt")
DOC = ROOT / "docs" / "troubleshooting.md"
MIN_FRAGMENT = 8
MAX_FRAGMENT = 60
_STRIP = string.whitespace + string.punctuation.replace("`", "")  # a leading `name` keeps its quote


@dataclass(frozen=True)
class RaiseSite:
    file: str
    line: int
    exception: str
    fragment: str  # "" when the message has no fixed part long enough (a wrapper)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _class_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None  # type(exc)(...): re-raise of another error's class and message


def _fixed_parts(node: ast.AST | None, module: "_Module", depth: int = 0) -> list[str]:
    if node is None or depth > 2:
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        return _fixed_parts(node.left, module, depth) + _fixed_parts(node.right, module, depth)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in module.functions:
        return [p for ret in module.functions[node.func.id] for p in _fixed_parts(ret, module, depth + 1)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
        return [p for a in node.args for p in _fixed_parts(a, module, depth)]
    if isinstance(node, ast.Name) and node.id in module.assigned:
        return [p for v in module.assigned[node.id] for p in _fixed_parts(v, module, depth + 1)]
    return []


class _Module:
    """The module-level helpers a message may come from: function returns and assigned names."""

    def __init__(self, tree: ast.Module) -> None:
        self.functions: dict[str, list[ast.expr]] = {}
        self.assigned: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = [r.value for r in ast.walk(node)
                                             if isinstance(r, ast.Return) and r.value is not None]
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.assigned.setdefault(node.targets[0].id, []).append(node.value)


def fragment_of(parts: list[str]) -> str:
    """The longest fixed part, stripped, cut to MAX_FRAGMENT characters at a word boundary."""
    best = max((p.strip(_STRIP) for p in parts), key=len, default="")
    best = " ".join(best.split())
    if len(best) < MIN_FRAGMENT:
        return ""
    if len(best) > MAX_FRAGMENT:
        cut = best[:MAX_FRAGMENT + 1]
        best = cut[:cut.rfind(" ")] if " " in cut else best[:MAX_FRAGMENT]
        best = best.rstrip(_STRIP)
    return best


def raise_sites() -> list[RaiseSite]:
    sites = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            module = _Module(tree)
            raised = {id(n.exc) for n in ast.walk(tree) if isinstance(n, ast.Raise)}
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = _class_name(node.func)
                if name is None or not name[:1].isupper():
                    continue
                if id(node) not in raised and not name.endswith(("Error", "Exception")):
                    continue
                parts = [p for arg in node.args for p in _fixed_parts(arg, module)]
                sites.append(RaiseSite(str(path.relative_to(ROOT)), node.lineno, name, fragment_of(parts)))
    return sites


def _collapse(text: str) -> str:
    return " ".join(text.split())


SITES = raise_sites()


def test_the_scan_finds_the_raise_sites():
    # a guard against the scanner silently finding nothing (moved packages, a parser change)
    assert len(SITES) > 150
    assert {"ConfigError", "FormatError", "CorruptCheckpointError", "CliError"} <= {s.exception for s in SITES}
    assert sum(1 for s in SITES if s.fragment) > 0.8 * len(SITES)


@pytest.mark.parametrize("site", [s for s in SITES if s.fragment], ids=lambda s: s.where)
def test_every_error_message_is_in_troubleshooting(site: RaiseSite):
    doc = _collapse(DOC.read_text(encoding="utf-8"))
    assert site.fragment in doc, (
        f"{site.where} raises {site.exception} with a message docs/troubleshooting.md does not cover: "
        f"add the text {site.fragment!r} (cause and fix) under the {site.exception} section")


def test_every_raised_exception_class_has_a_section():
    headings = " ".join(line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith("#"))
    missing = sorted({s.exception for s in SITES} - set(re.findall(r"\w+", headings)))
    assert not missing, f"docs/troubleshooting.md has no section heading naming {missing}"


def test_fragment_rule():
    assert fragment_of([": ", " (", ")"]) == ""
    assert fragment_of(["", ": no such checkpoint"]) == "no such checkpoint"
    long = fragment_of(["a " * 50])
    assert len(long) <= MAX_FRAGMENT and not long.endswith(" ")
