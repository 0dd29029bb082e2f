"""Every code block in README.md and docs/*.md is executed, so the docs cannot rot.

One test per fenced block, named ``FILE:LINE`` (the line of the opening fence). By the fence's language:

* ``python`` / ``py``: written to a file and run with this interpreter in a fresh temporary directory
  (``cwd``; its page's directory for a page run in order, see ``continue``), in a subprocess with a
  timeout; it must exit 0. Relative paths such as ``runs/a`` land in that directory.
* ``yaml`` / ``yml``: a checkrun configuration, validated by the loader that reads it in real use:
  a mapping with a ``class_path: lightning_ckpt.CheckrunCheckpointIO`` (LightningCLI) or
  ``_target_: lightning_ckpt.CheckrunCheckpointIO`` (Hydra) entry builds that plugin from its arguments;
  a mapping with a top-level ``checkpointing:`` or ``accelerate:`` key goes through accelerate_ckpt's
  loader; anything else is an ``EngineConfig`` (``EngineConfig.from_yaml``).
* ``bash`` / ``sh`` / ``shell`` / ``console``: run command by command in a fresh temporary directory
  (``console``: the lines starting with ``$ ``, continuation lines ending in ``\\`` joined).
  ``checkrun ...`` runs in this process (``ckpt_core.cli.main``), ``python ...`` in a subprocess.
  A command must exit with the status the block shows after it as ``[exit N]``, else 0.
  ``export NAME=VALUE ...`` sets environment variables for the commands after it (and, in a page run
  in order, for the blocks after it). ``moto_server -p PORT &`` starts moto's S3 server in the
  background, as a reader would, on a free port instead of PORT (the blocks' local endpoints are
  replaced by its endpoint, see ``setup=s3``); it is stopped when the block's test ends, or with the
  page. Any other command (``pip``, ``torchrun``, ``accelerate launch``...) makes the block fail: such
  a block needs a skip marker.
* Blocks with another or no language (directory layouts, JSON, text) are not code and are not run.

Markers: an HTML comment on the line right before the opening fence (invisible when rendered):

* ``<!-- snippet: skip (reason) -->``: the block is not run. The reason is required; keep skips rare
  (shell commands that install packages or need several machines, API signature listings,
  benchmark reproductions that take minutes); prefer a self-contained example (a tiny model,
  relative paths, ``memory://``).
* ``<!-- snippet: setup=NAME[,NAME...] -->``: the temporary directory is prepared by the named
  fixtures of ``SETUPS`` (tests/docs/snippet_setups.py) first, in order (checkpoints the block inspects, an S3 server).
* ``<!-- snippet: continue -->``: the block works on what earlier blocks of its page made (checkpoints,
  a server they started, variables they exported), as a reader following the page does. A page with
  such a block is run in page order, up to its last ``continue`` block, in one directory and one
  environment: each block's test first runs the blocks before it that have not run yet (a failure
  there fails the later blocks of the chain too, naming the first failure). Skipped blocks are not run;
  blocks after the page's last ``continue`` block get a fresh directory as usual.
  ``test_page_order_is_tested`` requires it: a shell block that runs ``checkrun`` on a directory an
  earlier ``python`` block of its page writes to (its path appears in that block) must be ``continue``,
  so a wrong file name in the page fails.

Nothing else is accepted in a ``snippet:`` comment (``test_markers_are_valid``).
"""
from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import select
import shlex
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest
import yaml

from tests.docs.snippet_setups import SETUPS, prepare

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON_TIMEOUT = 120
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*\S.*)\)$")
_SETUP = re.compile(r"^setup=(?P<names>[\w-]+(?:,[\w-]+)*)$")
CONTINUE = "continue"
_LOCAL_ENDPOINT = re.compile(r"http://(?:127\.0\.0\.1|localhost):\d+")
LANGS = {"python": "python", "py": "python", "yaml": "yaml", "yml": "yaml", "bash": "shell",
         "sh": "shell", "shell": "shell", "console": "console"}


@dataclass(frozen=True)
class Block:
    file: str            # relative to the repository root
    line: int            # line of the opening fence (1-based)
    lang: str            # "python", "yaml", "shell", "console" or "" (not run)
    code: str
    marker: str | None   # the body of the snippet: comment right before the fence

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def extract_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a markdown file (fences may be indented, e.g. inside lists)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        info = m["info"].strip().split()
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and not lines[i].strip().strip(fence[0])):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        prev = _MARKER.match(lines[start - 1]) if start > 0 else None
        lang = LANGS.get(info[0].lower(), "") if info else ""
        blocks.append(Block(str(path.relative_to(ROOT)), start + 1, lang, "\n".join(body) + "\n",
                            prev["body"] if prev else None))
    return blocks


BLOCKS = [b for f in DOC_FILES for b in extract_blocks(f)]
RUNNABLE = [b for b in BLOCKS if b.lang]


def _parse_marker(block: Block) -> tuple[str | None, list[str]]:
    """(skip reason or None, setup names); raises ValueError for anything else."""
    if block.marker is None or block.marker == CONTINUE:
        return None, []
    skip, setup = _SKIP.match(block.marker), _SETUP.match(block.marker)
    if skip:
        return skip["reason"].strip(), []
    if setup:
        names = setup["names"].split(",")
        unknown = [n for n in names if n not in SETUPS]
        if unknown:
            raise ValueError(f"{block.id}: unknown setup {unknown} (known: {sorted(SETUPS)})")
        return None, names
    raise ValueError(f"{block.id}: invalid marker {block.marker!r}: use 'skip (reason)', 'setup=NAME' or "
                     f"'{CONTINUE}'")


# -- runners -----------------------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the venv's installed packages, as a user has them
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _localize(text: str, ctx: dict) -> str:
    return _LOCAL_ENDPOINT.sub(ctx["endpoint"], text) if "endpoint" in ctx else text


_RUNNER = """\
import atexit, os, runpy, sys
os.environ.clear(); os.environ.update({env!r})
os.chdir({cwd!r})
_log = os.open({log!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(_log, 1); os.dup2(_log, 2)
sys.stdout = open(1, "w", closefd=False); sys.stderr = open(2, "w", closefd=False)
sys.argv = {argv!r}
# what `python SCRIPT` (or `python -c`) has: the script's folder, the interpreter's and the venv's
# paths; not the repository folders pytest put on sys.path (a user's snippet does not have them)
sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv[0] != "-c" else ""] + [
    p for p in sys.path if os.path.isabs(p)
    and (not (p.rstrip(os.sep) + os.sep).startswith({repo!r}) or p.startswith(sys.prefix + os.sep))]
try:
    runpy.run_path({script!r}, run_name="__main__")
finally:
    atexit._run_exitfuncs()
    sys.stdout.flush(); sys.stderr.flush()
"""
_PRELOAD = ["torch", "torch._dynamo", "numpy", "fsspec", "s3fs", "yaml", "safetensors.torch", "ckpt_core",
            "lightning.pytorch", "lightning.pytorch.demos.boring_classes", "lightning_ckpt", "accelerate",
            "accelerate_ckpt"]
_forkserver = None


def run_program(script: pathlib.Path, argv: list[str], tmp: pathlib.Path) -> tuple[int, str]:
    """Run a Python file like ``python SCRIPT ARGS`` with ``cwd=tmp``; (exit status, its output).

    It runs in a child of a multiprocessing fork server that imported torch, Lightning and
    accelerate once (importing them costs 5-15 s per process on two busy cores): a fresh process
    per program, with its own cwd, environment, ``sys.argv`` and ``atexit`` handlers, as with
    ``python SCRIPT``, without paying those imports each time. The fork server imports modules
    only (no tensors, single-threaded OpenMP), so forking it is safe.
    """
    import multiprocessing
    import runpy

    global _forkserver
    if _forkserver is None:
        from multiprocessing import forkserver

        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(_PRELOAD)
        # One intra-op thread, fixed when the server starts: OpenMP reads it once per process, and
        # its children inherit the server's pool settings (2 threads on 2 busy cores ran 5x slower).
        with pytest.MonkeyPatch.context() as mp:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                mp.setenv(var, "1")
            forkserver.ensure_running()
    log, runner = tmp / ".snippet.log", tmp / ".snippet_runner.py"
    runner.write_text(_RUNNER.format(env=_env(), cwd=str(tmp), log=str(log), argv=argv, script=str(script),
                                     repo=str(ROOT) + os.sep), encoding="utf-8")
    proc = _forkserver.Process(target=runpy.run_path, args=(str(runner),))
    proc.start()
    proc.join(PYTHON_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return -9, f"timed out after {PYTHON_TIMEOUT} s\n" + (log.read_text(errors="replace") if log.exists() else "")
    return proc.exitcode, log.read_text(errors="replace") if log.exists() else ""


def run_python(block: Block, tmp: pathlib.Path, ctx: dict) -> None:
    script = tmp / "snippet.py"
    script.write_text(_localize(block.code, ctx), encoding="utf-8")
    status, output = run_program(script, [str(script)], tmp)
    assert status == 0, f"{block.id} exited {status}:\n{output[-6000:]}"


def _plugin_nodes(node) -> list[dict]:
    """Mappings that build a CheckrunCheckpointIO (LightningCLI class_path or Hydra _target_)."""
    found = []
    if isinstance(node, dict):
        target = node.get("class_path") or node.get("_target_")
        if target in ("lightning_ckpt.CheckrunCheckpointIO", "lightning_ckpt.io.CheckrunCheckpointIO"):
            found.append(node)
        for v in node.values():
            found += _plugin_nodes(v)
    elif isinstance(node, list):
        for v in node:
            found += _plugin_nodes(v)
    return found


def run_yaml(block: Block, tmp: pathlib.Path, ctx: dict) -> None:
    data = yaml.safe_load(block.code)
    assert isinstance(data, dict), f"{block.id}: not a mapping"
    plugins = _plugin_nodes(data)
    if plugins:
        from lightning_ckpt import CheckrunCheckpointIO

        for node in plugins:
            if "class_path" in node:
                args = node.get("init_args") or {}
            else:
                args = {k: v for k, v in node.items() if k != "_target_"}
            CheckrunCheckpointIO(**args).engine  # noqa: B018 - builds the engine config
        return
    path = tmp / "config.yaml"
    path.write_text(block.code, encoding="utf-8")
    if "checkpointing" in data or "accelerate" in data:
        from accelerate_ckpt.config import from_mapping, read_yaml

        from_mapping(read_yaml(path), str(path))
    else:
        from ckpt_core import EngineConfig

        EngineConfig.from_yaml(path)


def shell_commands(block: Block) -> list[tuple[str, int]]:
    """(command, expected exit status) pairs of a bash or console block."""
    lines = block.code.splitlines()
    commands: list[list] = []
    for line in lines:
        stripped = line.strip()
        if block.lang == "console":
            if stripped.startswith("$ "):
                commands.append([stripped[2:], 0, stripped.endswith("\\")])
            elif commands and commands[-1][2]:
                commands[-1][0] = commands[-1][0][:-1] + " " + stripped
                commands[-1][2] = stripped.endswith("\\")
            elif commands and (m := re.fullmatch(r"\[exit (\d+)\]", stripped)):
                commands[-1][1] = int(m[1])
        elif stripped and not stripped.startswith("#"):
            if commands and commands[-1][2]:
                commands[-1][0] = commands[-1][0][:-1] + " " + stripped
                commands[-1][2] = stripped.endswith("\\")
            else:
                commands.append([stripped, 0, stripped.endswith("\\")])
    return [(c, status) for c, status, _ in commands]


_ASSIGNMENT = re.compile(r"^(?P<name>[A-Za-z_]\w*)=(?P<value>.*)$", re.S)
_RUNNING_ON = re.compile(rb"Running on (http://[\w.]+:\d+)")
SERVER_TIMEOUT = 60


def export(argv: list[str], ctx: dict) -> None:
    """``export NAME=VALUE ...``: set for the commands (and, in a page run in order, blocks) after it."""
    pairs = [_ASSIGNMENT.match(a) for a in argv[1:]]
    if not pairs or not all(pairs):
        pytest.fail(f"cannot run {shlex.join(argv)!r}: `export` takes NAME=VALUE arguments")
    for m in pairs:
        ctx.setdefault("env", {})[m["name"]] = m["value"]
        ctx["setenv"](m["name"], m["value"])


def start_moto_server(argv: list[str], ctx: dict) -> None:
    """``moto_server [-p PORT] [options] &`` in the background, on a free port instead of PORT.

    Its endpoint is read from its own ``Running on http://HOST:PORT`` line (printed once it accepts
    connections) and replaces the block's local endpoints from then on (``_localize``).
    """
    args, i = [], 1
    while i < len(argv):
        if argv[i] in ("-p", "--port"):
            i += 2
            continue
        if argv[i].startswith("--port="):
            i += 1
            continue
        args.append(argv[i])
        i += 1
    exe = shutil.which("moto_server", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                            os.environ.get("PATH", "")]))
    if exe is None:
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    proc = subprocess.Popen([exe, *args, "-p", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=_env())
    ctx.setdefault("procs", []).append(proc)
    out, deadline = b"", SERVER_TIMEOUT
    while not (m := _RUNNING_ON.search(out)):
        ready, _, _ = select.select([proc.stdout], [], [], deadline)
        chunk = os.read(proc.stdout.fileno(), 65536) if ready else b""
        if not chunk:
            pytest.fail(f"`{shlex.join(argv)}` did not start: {out.decode(errors='replace')}")
        out += chunk
    # keep reading its request log, so that a full pipe never blocks the server
    threading.Thread(target=lambda: [None for _ in iter(lambda: proc.stdout.read(65536), b"")],
                     daemon=True).start()
    ctx["endpoint"] = m[1].decode()


def stop_servers(ctx: dict) -> None:
    for proc in ctx.pop("procs", []):
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_shell(block: Block, tmp: pathlib.Path, ctx: dict) -> None:
    from ckpt_core.cli import main

    commands = shell_commands(block)
    assert commands, f"{block.id}: no command in the block"
    for command, expected in commands:
        argv = shlex.split(_localize(command, ctx), comments=True)
        background = argv[-1] == "&"
        if background:
            argv.pop()
            if argv[0] != "moto_server":
                pytest.fail(f"{block.id}: cannot run {command!r} in the background; only `moto_server ... &`")
            start_moto_server(argv, ctx)
            continue
        if argv[0] == "export":
            export(argv, ctx)
            continue
        if argv[0] == "checkrun":
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(argv[1:] + ([] if "--no-progress" in argv else ["--no-progress"]))
            detail = out.getvalue()[-2000:] + err.getvalue()[-2000:]
        elif argv[0] == "python" and len(argv) > 2 and argv[1] == "-c":
            script = tmp / ".snippet_c.py"
            script.write_text(argv[2], encoding="utf-8")
            status, detail = run_program(script, ["-c", *argv[3:]], tmp)
        elif argv[0] == "python" and len(argv) > 1 and not argv[1].startswith("-"):
            status, detail = run_program(tmp / argv[1], argv[1:], tmp)
        else:
            pytest.fail(f"{block.id}: cannot run {command!r}; mark the block "
                        "<!-- snippet: skip (reason) --> or use checkrun/python commands")
        assert status == expected, f"{block.id}: `{command}` exited {status}, the doc shows {expected}:\n{detail}"


RUNNERS = {"python": run_python, "yaml": run_yaml, "shell": run_shell, "console": run_shell}


# -- tests -------------------------------------------------------------------------------------
def test_markers_are_valid():
    errors = []
    for block in BLOCKS:
        try:
            _parse_marker(block)
        except ValueError as exc:
            errors.append(str(exc))
    stray = [f"{f.relative_to(ROOT)}:{n}" for f in DOC_FILES
             for n, (line, nxt) in enumerate(zip(f.read_text().splitlines(), f.read_text().splitlines()[1:] + [""]), 1)
             if _MARKER.match(line) and not _FENCE.match(nxt)]
    assert not errors and not stray, (errors, f"markers not right before a fence: {stray}")


def test_blocks_are_found():
    assert len(RUNNABLE) > 30
    assert {b.file for b in RUNNABLE} >= {"README.md", "docs/getting-started.md", "docs/cli.md"}


@pytest.fixture(scope="module")
def setup_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("snippet-setups")


def _page_chains() -> dict[str, list[Block]]:
    """Per page with a ``continue`` block: its runnable blocks up to the last such block, in page order."""
    chains = {}
    for file in dict.fromkeys(b.file for b in RUNNABLE):
        blocks = [b for b in RUNNABLE if b.file == file]
        last = max((i for i, b in enumerate(blocks) if b.marker == CONTINUE), default=None)
        if last is not None:
            chains[file] = blocks[: last + 1]
    return chains


CHAINS = _page_chains()


@dataclass
class Page:
    """A page run in order: one directory, one context (endpoint, exported variables, servers) and
    each block's outcome, ``(status, message)`` with status "passed", "failed" or "skipped"."""

    dir: pathlib.Path
    ctx: dict = field(default_factory=dict)
    outcome: dict = field(default_factory=dict)


@pytest.fixture(scope="session")
def pages():
    found: dict[str, Page] = {}
    yield found
    for page in found.values():
        stop_servers(page.ctx)


def run_block(block: Block, directory: pathlib.Path, ctx: dict, request: pytest.FixtureRequest,
              setup_cache: pathlib.Path) -> None:
    """Prepare the block's setups in ``directory`` and run it there, with ``ctx``'s exported variables."""
    _, setups = _parse_marker(block)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(directory)
        for name, value in ctx.get("env", {}).items():
            mp.setenv(name, value)
        ctx.update(request=request, setenv=mp.setenv)
        try:
            prepare(setups, directory, ctx, setup_cache)
            RUNNERS[block.lang](block, directory, ctx)
        finally:
            del ctx["request"], ctx["setenv"]


def _outcome(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, pytest.skip.Exception):
        return "skipped", exc.msg
    if isinstance(exc, pytest.fail.Exception):
        return "failed", exc.msg
    return "failed", f"{type(exc).__name__}: {exc}"


def run_in_page_order(block: Block, request: pytest.FixtureRequest, setup_cache: pathlib.Path,
                      pages: dict[str, Page]) -> None:
    """Run the blocks of ``block``'s page chain up to ``block`` that have not run, then report ``block``."""
    chain = CHAINS[block.file]
    page = pages.get(block.file)
    if page is None:
        tmp = request.getfixturevalue("tmp_path_factory").mktemp("page-" + re.sub(r"\W+", "-", block.file))
        page = pages[block.file] = Page(tmp)
    for earlier in chain[: chain.index(block) + 1]:
        if earlier.id in page.outcome or _parse_marker(earlier)[0] is not None:
            continue
        broken = next((b for b, (status, _) in page.outcome.items() if status != "passed"), None)
        if broken is not None:
            page.outcome[earlier.id] = (page.outcome[broken][0], f"not run: {broken}, earlier in the page, "
                                        f"{page.outcome[broken][0]}: {page.outcome[broken][1]}")
            continue
        try:
            run_block(earlier, page.dir, page.ctx, request, setup_cache)
        except (Exception, pytest.fail.Exception, pytest.skip.Exception) as exc:
            page.outcome[earlier.id] = _outcome(exc)
            if earlier is block:
                raise
        else:
            page.outcome[earlier.id] = ("passed", "")
            if earlier is block:
                return
    status, message = page.outcome[block.id]  # it ran earlier, for a later block's test
    if status == "failed":
        pytest.fail(message, pytrace=False)
    if status == "skipped":
        pytest.skip(message)


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_snippet(block: Block, tmp_path: pathlib.Path, request: pytest.FixtureRequest,
                 setup_cache: pathlib.Path, pages: dict[str, Page]):
    reason, _ = _parse_marker(block)
    if reason is not None:
        pytest.skip(f"marked in the doc: {reason}")
    if block in CHAINS.get(block.file, ()):
        run_in_page_order(block, request, setup_cache, pages)
        return
    ctx: dict = {}
    try:
        run_block(block, tmp_path, ctx, request, setup_cache)
    finally:
        stop_servers(ctx)


def test_the_runners_report_failures(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """A block that fails must fail its test: an exception, an exit status, a wrong ``[exit N]``."""
    monkeypatch.chdir(tmp_path)
    run_python(Block("x.md", 1, "python", "import os\nassert os.getcwd() == %r\nopen('f', 'w')\n" % str(tmp_path),
                     None), tmp_path, {})
    assert (tmp_path / "f").exists()  # ran in the block's directory
    for code in ("raise ValueError('boom')\n", "import sys\nsys.exit(3)\n"):
        with pytest.raises(AssertionError, match="x.md:1 exited"):
            run_python(Block("x.md", 1, "python", code, None), tmp_path, {})
    with pytest.raises(AssertionError, match="exited 1, the doc shows 0"):
        run_shell(Block("x.md", 1, "console", "$ checkrun ls missing-dir\n", None), tmp_path, {})
    run_shell(Block("x.md", 1, "console", "$ checkrun ls missing-dir\n[exit 1]\n", None), tmp_path, {})
    with pytest.raises(pytest.fail.Exception, match="cannot run 'pip install x'"):
        run_shell(Block("x.md", 1, "bash", "pip install x\n", None), tmp_path, {})
    with pytest.raises(ValueError, match="invalid marker"):
        _parse_marker(Block("x.md", 1, "python", "", "skip"))  # a skip needs its reason
    with pytest.raises(pytest.fail.Exception, match="only `moto_server"):
        run_shell(Block("x.md", 1, "bash", "python -m http.server &\n", None), tmp_path, {})


def test_export_and_page_order(tmp_path: pathlib.Path, request: pytest.FixtureRequest,
                               monkeypatch: pytest.MonkeyPatch):
    """``export`` reaches the later commands; a ``continue`` block sees what the page's earlier blocks
    made (files, exported variables), and a failure earlier in the page fails it, naming that block."""
    check_env = "$ python -c \"import os, sys; sys.exit(os.environ.get('SNIPPET_X') != '1')\"\n"
    run_block(Block("x.md", 1, "console", "$ export SNIPPET_X=1\n" + check_env, None), tmp_path, {}, request,
              tmp_path)
    assert "SNIPPET_X" not in os.environ  # only for the block (or its page)
    make = Block("x.md", 1, "python", "import os\nos.makedirs('runs/x')\nopen('runs/x/f', 'w')\n", None)
    export_it = Block("x.md", 5, "shell", "export SNIPPET_X=1\n", None)
    use = Block("x.md", 9, "console", "$ python -c \"open('runs/x/f')\"\n" + check_env, CONTINUE)
    broken = Block("y.md", 1, "python", "raise SystemExit(2)\n", None)
    after_broken = Block("y.md", 5, "console", "$ python -c \"pass\"\n", CONTINUE)
    monkeypatch.setitem(CHAINS, "x.md", [make, export_it, use])
    monkeypatch.setitem(CHAINS, "y.md", [broken, after_broken])
    pages: dict[str, Page] = {}
    run_in_page_order(use, request, tmp_path, pages)  # runs make and export_it first
    assert pages["x.md"].outcome == {b.id: ("passed", "") for b in (make, export_it, use)}
    run_in_page_order(make, request, tmp_path, pages)  # already ran: reported, not run again
    with pytest.raises(pytest.fail.Exception, match=r"not run: y.md:1, earlier in the page, failed"):
        run_in_page_order(after_broken, request, tmp_path, pages)
    with pytest.raises(pytest.fail.Exception, match="y.md:1 exited 2"):
        run_in_page_order(broken, request, tmp_path, pages)


# -- the docs test what they show -------------------------------------------------------------------
_VALUE_OPTIONS = {"-o", "--storage-option", "--endpoint-url", "--config", "--config-section", "--grace"}


def checkrun_directories(block: Block) -> list[str]:
    """The checkpoint directories the ``checkrun`` commands of a shell block name (the directory of a
    file argument such as ``runs/exp1/step=300.ckpt``; arguments without a ``/`` are not counted)."""
    found = []
    for command, _ in shell_commands(block):
        argv = shlex.split(command, comments=True)
        if not argv or argv[0] != "checkrun":
            continue
        for prev, arg in zip(argv[1:], argv[2:]):
            if prev in _VALUE_OPTIONS or arg.startswith("-") or "/" not in arg.split("://")[-1]:
                continue
            arg = arg.rstrip("/")
            last = arg.rsplit("/", 1)[-1]
            found.append(arg.rsplit("/", 1)[0] if "." in last else arg)
    return found


def unchained_checkrun_blocks(blocks: list[Block]) -> list[str]:
    """Shell blocks that run ``checkrun`` on a directory an earlier python block of the same page
    writes to (the directory appears in it), but are not ``continue`` blocks: they would not see
    what that block made, so a wrong file name would go unnoticed."""
    bad = []
    for i, block in enumerate(blocks):
        if block.lang not in ("shell", "console") or block.marker == CONTINUE:
            continue
        earlier = [b.code for b in blocks[:i] if b.file == block.file and b.lang == "python"]
        for directory in checkrun_directories(block):
            pattern = re.compile(r"(?<![\w/.=-])" + re.escape(directory) + r"(?![\w.=-])")
            if any(pattern.search(code) for code in earlier):
                bad.append(f"{block.id} (`{directory}`)")
                break
    return bad


def test_page_order_is_tested():
    """Every shell block in docs/ that runs ``checkrun`` on checkpoints an earlier block of its page
    made runs after that block, on what it made (``continue``): not skipped, not on a setup's copy."""
    docs = [b for b in BLOCKS if b.file.startswith("docs/")]
    assert not unchained_checkrun_blocks(docs), "mark these <!-- snippet: continue -->"
    made = Block("p.md", 1, "python", 'engine.save(state, f"runs/exp1/step={step}.ckpt")\n', None)
    look = Block("p.md", 9, "console", "$ checkrun inspect runs/exp1/step=300.ckpt\n"
                 "$ checkrun ls s3://b/r --endpoint-url http://127.0.0.1:9000\n", "setup=exp1")
    other = Block("p.md", 9, "console", "$ checkrun ls runs/exp10 -o a=b/c\n", None)
    assert checkrun_directories(look) == ["runs/exp1", "s3://b/r"]
    assert unchained_checkrun_blocks([made, look, other]) == ["p.md:9 (`runs/exp1`)"]
    assert unchained_checkrun_blocks([made, Block("p.md", 9, "console", look.code, CONTINUE)]) == []
