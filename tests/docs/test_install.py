"""One install story: every ``pip install`` of torch in README.md and docs/ is the one CI runs.

CI installs torch in ``.ci/setup`` (``pip install -c constraints.txt "torch==X"``: the CPU build; an
unpinned ``torch`` pulls a multi-GB CUDA build). Every ``pip install`` command in README.md and docs/
(in a code block or inline code) that names torch must give the same requirement and the same
constraints file; a page that only mentions installing links to README.md's Install section instead.
"""
from __future__ import annotations

import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_PIP_INSTALL = re.compile(r"pip3? install\b(?P<args>[^`\n]*)")
_TORCH = re.compile(r"^torch(?:\[[^\]]*\])?(?:\s*[<>=!~;].*)?$")
_VALUE_OPTIONS = {"-c": "-c", "--constraint": "-c", "-r": "-r", "--requirement": "-r",
                  "-i": "--index-url", "--index-url": "--index-url", "--extra-index-url": "--extra-index-url",
                  "-f": "--find-links", "--find-links": "--find-links"}
_IGNORED = {"-q", "--quiet", "-U", "--upgrade"}  # how verbose, not what is installed


def normalize(args: str) -> frozenset[str]:
    """The requirements and options of ``pip install ARGS`` as a set of words (``-c FILE`` is one)."""
    words = shlex.split(args, comments=True)
    found, i = set(), 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if word.startswith("-") and name in _VALUE_OPTIONS:
            if not eq:
                i += 1
                value = words[i] if i < len(words) else ""
            found.add(f"{_VALUE_OPTIONS[name]} {value}")
        elif word not in _IGNORED:
            found.add(word)
        i += 1
    return frozenset(found)


def installs_torch(args: str) -> bool:
    try:
        words = shlex.split(args, comments=True)
    except ValueError:  # an unbalanced quote in prose
        words = args.split()
    return any(_TORCH.match(w) for w in words)


def ci_torch_install() -> frozenset[str]:
    """``.ci/setup``'s command that installs torch, normalized."""
    commands = [m["args"] for line in (ROOT / ".ci" / "setup").read_text().splitlines()
                if not line.lstrip().startswith("#") and (m := _PIP_INSTALL.search(line)) and installs_torch(m["args"])]
    assert len(commands) == 1, f".ci/setup: expected one command installing torch, found {commands}"
    return normalize(commands[0])


def doc_torch_installs() -> list[tuple[str, str]]:
    """(FILE:LINE, arguments) of every ``pip install`` naming torch in README.md and docs/."""
    found = []
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in _PIP_INSTALL.finditer(line):
                if installs_torch(m["args"]):
                    found.append((f"{path.relative_to(ROOT)}:{number}", m["args"]))
    return found


def test_ci_pins_the_cpu_build_of_constraints_txt():
    ci = ci_torch_install()
    pinned = [line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line.strip().startswith("torch==")]
    assert "-c constraints.txt" in ci and len(pinned) == 1 and pinned[0] in ci, (ci, pinned)


def test_every_torch_install_in_the_docs_is_ci_s():
    ci = ci_torch_install()
    installs = doc_torch_installs()
    assert any(where.startswith("README.md:") for where, _ in installs), "README.md: no install command"
    wrong = [f"{where}: pip install{args}" for where, args in installs if normalize(args) != ci]
    assert not wrong, (f"install torch as CI does (`pip install {' '.join(sorted(ci))}`), or link to "
                       f"README.md#install instead: {wrong}")


def test_install_sections_link_to_the_readme():
    """A page of docs/ with an install section repeats CI's commands (above) and links to the one in
    README.md, which says what to do elsewhere."""
    for path in sorted((ROOT / "docs").rglob("*.md")):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"^#+ +Install(?:ation|ing)?\b.*$(?P<body>(?:\n(?!#).*)*)", text, re.M):
            assert "README.md#install" in m["body"], f"{path.relative_to(ROOT)}: {m[0].splitlines()[0]!r}"


def test_the_check_sees_a_wrong_install():
    ci = ci_torch_install()
    assert normalize('-q -c constraints.txt "torch==2.13.0"') == normalize("--constraint=constraints.txt torch==2.13.0")
    for args in (" torch", " torch==2.13.0", " 'torch>=2.4'", " -c constraints.txt torch"):
        assert installs_torch(args) and normalize(args) != ci, args
    assert not installs_torch(' -e ".[s3,lightning]"') and not installs_torch(" torchvision")
