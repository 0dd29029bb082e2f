"""``checkrun`` on hostile or odd inputs: keys that collide once flattened, control characters in keys
and file names, special files as export targets, manifests with odd (forged) field values, deeply
nested safetensors metadata and tensors safetensors cannot hold.

Real files in ``tmp_path``; the commands run in-process through ``main(argv)`` as in test_cli.py.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save as st_save

import ckpt_core
from ckpt_core.cli import util as cli_util

from ..reliability.test_hostile import forge
from .test_cli import run, run_json

# What a terminal acts on: C0 (but the newlines that end lines), DEL, C1, U+2028/9, bidi controls.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


# ----------------------------------------------------------------------------- diff: real paths


def test_diff_pairs_leaves_by_their_real_path_not_their_dotted_name(capsys, tmp_path):
    def x():
        return torch.ones(3)

    def y():
        return torch.zeros(3)

    ckpt_core.save({"a.b": x(), "a": {"b": y()}, 2: x(), "2": y(), "v.w": 1, "v": {"w": 2}}, tmp_path / "A.ckpt")
    ckpt_core.save({"a": {"b": x()}, "a.b": y(), "2": x(), 2: y(), "v": {"w": 1}, "v.w": 2}, tmp_path / "B.ckpt")
    a, b = str(tmp_path / "A.ckpt"), str(tmp_path / "B.ckpt")
    code, out, _ = run(capsys, "diff", a, b, "--exit-code")
    assert code == 1, out
    for name in ("['a.b']", "['a']['b']", "[2]", "['2']"):
        assert re.search(rf"^{re.escape(name)}\s+changed\s+3/3", out, re.M), (name, out)
    assert "4 changed" in out and "0 identical" in out and "2 value(s) differ" in out
    code, data = run_json(capsys, "diff", a, b)
    assert {t["key"] for t in data["tensors"]} == {"['a.b']", "['a']['b']", "[2]", "['2']"}
    assert {v["key"] for v in data["values"]} == {"['v.w']", "['v']['w']"}
    assert not data["identical"]
    # The same state on both sides: identical, and plain dotted names where nothing collides.
    ckpt_core.save({"m": {"w": x()}, "step": 1}, tmp_path / "C.ckpt")
    code, out, _ = run(capsys, "diff", str(tmp_path / "C.ckpt"), str(tmp_path / "C.ckpt"), "--all", "--exit-code")
    assert code == 0 and re.search(r"^m\.w\s+same", out, re.M), out


def test_diff_compares_pickled_values_by_their_blob(capsys, tmp_path):
    """Pickled values (a Counter, a set; every non-tensor of a DCP checkpoint) were left out of diff:
    ``--exit-code`` said identical when they changed or went (found by a check of the CLI)."""
    from collections import Counter

    ckpt_core.save({"w": torch.ones(3), "c": Counter(a=1), "s": {1, 2}, "k": Counter(b=1)}, tmp_path / "A.ckpt")
    ckpt_core.save({"w": torch.ones(3), "c": Counter(a=2), "k": Counter(b=1)}, tmp_path / "B.ckpt")
    code, out, _ = run(capsys, "diff", str(tmp_path / "A.ckpt"), str(tmp_path / "B.ckpt"), "--exit-code")
    assert code == 1, out
    assert re.search(r"^c\s+changed\s+<pickled collections.Counter", out, re.M), out
    assert re.search(r"^s\s+removed\s+<pickled builtins.set", out, re.M) and not re.search(r"^k\s", out, re.M), out
    code, data = run_json(capsys, "diff", str(tmp_path / "A.ckpt"), str(tmp_path / "B.ckpt"))
    assert {v["key"]: v["status"] for v in data["values"]} == {"c": "changed", "s": "removed"}


def test_numpy_values_in_diff_inspect_and_export(capsys, tmp_path, caplog):
    """numpy scalars and small arrays are plain data (since 2026-12-06): diff compared them with ``==``
    (a numpy nan differed from itself; an array raised), the JSON of inspect showed their repr, and an
    export to .pt pickles them where torch.load(weights_only=True) refuses them: it says so (found by
    an independent check)."""
    import numpy as np

    state = {"w": torch.ones(3), "nan": np.float32("nan"), "cnan": np.complex64(complex("nan")),
             "arr": np.arange(3), "n": np.int64(3), "flag": np.bool_(True)}
    ckpt_core.save(state, tmp_path / "A.ckpt")
    ckpt_core.save(state, tmp_path / "B.ckpt")
    ckpt_core.save({**state, "arr": np.arange(1, 4)}, tmp_path / "C.ckpt")
    assert run(capsys, "diff", str(tmp_path / "A.ckpt"), str(tmp_path / "B.ckpt"), "--exit-code")[0] == 0
    code, data = run_json(capsys, "diff", str(tmp_path / "A.ckpt"), str(tmp_path / "C.ckpt"))
    assert {v["key"]: v["status"] for v in data["values"]} == {"arr": "changed"}
    code, doc = run_json(capsys, "inspect", str(tmp_path / "A.ckpt"))
    assert code == 0 and "np." not in json.dumps(doc), doc
    assert run(capsys, "export", str(tmp_path / "A.ckpt"), str(tmp_path / "a.pt"))[0] == 0
    assert "5 numpy value(s) (arr, cnan, flag, n, nan) are pickled in a torch file" in caplog.text


def test_config_section_typo_and_nan_grace_are_usage_errors(capsys, tmp_path):
    """A misspelt ``--config-section`` silently used the defaults (a gc grace of 3600 s became 0);
    ``--grace nan`` passed (found by a check of the CLI)."""
    ckpt_core.save({"w": torch.ones(3)}, tmp_path / "run" / "a.ckpt")
    (tmp_path / "c.yaml").write_text("checkpointing:\n  retention:\n    gc_grace_seconds: 3600\n")
    root = str(tmp_path / "run")
    code, _, err = run(capsys, "gc", root, "--dry-run", "--config", str(tmp_path / "c.yaml"),
                       "--config-section", "checkpointng")
    assert code == 2 and "no top-level section 'checkpointng'" in err and "checkpointing" in err, err
    code, _, err = run(capsys, "gc", root, "--dry-run", "--config-section", "checkpointing")
    assert code == 2 and "--config-section needs --config" in err, err
    code, _, err = run(capsys, "gc", root, "--dry-run", "--grace", "nan")
    assert code == 2 and "--grace must be >= 0" in err, err
    code, out, _ = run(capsys, "gc", root, "--dry-run", "--config", str(tmp_path / "c.yaml"),
                       "--config-section", "checkpointing")
    assert code == 0, out


# ----------------------------------------------------------------------------- control characters


def test_control_characters_in_keys_and_file_names_are_escaped(capsys, tmp_path):
    evil = "w\x1b[2J\x1b]0;owned\x07\nOK       /fake/step=999.ckpt\u202e\x9b"
    run_dir = tmp_path / "run\x1b[31m"
    ckpt_core.save({"model": {evil: torch.ones(2), "caf\u00e9": torch.ones(1)}, "step": evil}, run_dir / "a\n.ckpt")
    ckpt_core.save({"model": {evil: torch.zeros(2)}}, run_dir / "b.ckpt")
    a, b = str(run_dir / "a\n.ckpt"), str(run_dir / "b.ckpt")
    for argv in (["inspect", a, "--wide"], ["inspect", a], ["ls", str(run_dir)], ["verify", str(run_dir)],
                 ["diff", a, b], ["export", a, str(tmp_path / "out.pt")], ["inspect", str(tmp_path / "no\x1b")]):
        code, out, err = run(capsys, *argv)
        assert not _CONTROL.search(out + err), (argv, out, err)
        assert not any(line.startswith("OK       /fake/") for line in (out + err).splitlines()), (argv, out)
    code, out, _ = run(capsys, "inspect", a, "--wide")
    assert code == 0 and "w\\x1b[2J\\x1b]0;owned\\x07\\nOK" in out and "\\u202e" in out and "\\x9b" in out
    assert "caf\u00e9" in out  # ordinary unicode stays as it is
    assert cli_util.safe("a\tb\r\x7f\u2029") == "a\\tb\\r\\x7f\\u2029"


# ----------------------------------------------------------------------------- export targets


def _kind(path) -> str:
    mode = os.lstat(path).st_mode
    return ("link" if stat.S_ISLNK(mode) else "fifo" if stat.S_ISFIFO(mode) else
            "chr" if stat.S_ISCHR(mode) else "file" if stat.S_ISREG(mode) else "?")


def test_export_refuses_an_out_that_is_not_a_regular_file_even_with_force(capsys, tmp_path):
    ckpt_core.save({"w": torch.ones(4)}, tmp_path / "run" / "x.ckpt")
    src = str(tmp_path / "run" / "x.ckpt")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target").write_text("keep\n")
    os.symlink("target", tmp_path / "link")
    os.symlink("missing", tmp_path / "dangling")
    targets = {"fifo": "FIFO (named pipe)", "link": "symbolic link", "dangling": "symbolic link"}
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets["null"] = "character device"
    except (PermissionError, OSError):
        pass  # not root: the FIFO and the links show the rule
    for name, what in targets.items():
        before = _kind(tmp_path / name)
        code, out, err = run(capsys, "export", src, str(tmp_path / name), "--force")
        assert code == 2, (name, out, err)
        assert f"{tmp_path / name}: is a {what}, not a regular file" in err, err
        assert _kind(tmp_path / name) == before
    assert (tmp_path / "target").read_text() == "keep\n"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code, out, err = run(capsys, "export", src, "-")
    finally:
        os.chdir(cwd)
    assert code == 2 and "'-': writing to stdout is not supported" in err and not (tmp_path / "-").exists()
    # A regular file is still replaced with --force.
    (tmp_path / "old.pt").write_text("old")
    assert run(capsys, "export", src, str(tmp_path / "old.pt"), "--force")[0] == 0
    assert torch.equal(torch.load(tmp_path / "old.pt")["w"], torch.ones(4))


# ----------------------------------------------------------------------------- odd field values


def _forged(tmp_path, edit) -> tuple[str, str]:
    d = tmp_path / "odd"
    ckpt_core.save({"w": torch.ones(4), "step": 1}, d / "good.ckpt")
    ckpt_core.save({"w": torch.ones(4), "step": 2}, d / "x.ckpt")
    body = json.loads((d / "x.ckpt").read_bytes())
    edit(body)
    (d / "x.ckpt").write_bytes(forge(body))
    # its file time (a created far ahead is ordered by it) after good.ckpt's: the kernel's coarse file clock can
    # precede good's stamp, and so does now after a test in this process loaded a checkpoint stamped ahead
    later = max(time.time(), json.loads((d / "good.ckpt").read_bytes())["created"]) + 1
    os.utime(d / "x.ckpt", (later, later))
    return str(d), str(d / "x.ckpt")


@pytest.mark.parametrize("edit", [
    lambda b: b.__setitem__("created", 1e20),
    lambda b: b["stats"].__setitem__("tensor_bytes", 10 ** 400),
    lambda b: b["stats"].__setitem__("written_bytes", "lots"),
    lambda b: b["tensors"][0].__setitem__("quant", {"method": "x", "bits": "y", "max_abs_error": "z",
                                                    "rel_l2_error": None}),
], ids=["created-1e20", "huge-tensor-bytes", "text-written-bytes", "text-quant-errors"])
def test_odd_manifest_fields_never_crash_ls_or_inspect(capsys, tmp_path, edit):
    directory, x = _forged(tmp_path, edit)
    code, out, err = run(capsys, "ls", directory)
    assert re.search(r"^good\.ckpt\s.*committed$", out, re.M), (out, err)
    assert "x.ckpt" in out and "Error" not in err, (out, err)  # listed, or marked corrupt with its name
    code, data = run_json(capsys, "ls", directory)
    assert [c["name"] for c in data["checkpoints"]] == ["good.ckpt", "x.ckpt"]
    assert all(c.get("tensor_bytes", 16) == 16 for c in data["checkpoints"])  # a forged figure is not believed
    for argv in (["inspect", x], ["inspect", x, "--json"]):
        code, out, err = run(capsys, *argv)
        assert code == 0 or x in err, (argv, out, err)
        assert "Error" not in err, err


def test_odd_values_format_as_question_marks_or_as_they_are(capsys, tmp_path):
    assert cli_util.human_time(1e20) == "?" and cli_util.iso_time(1e20) is None
    assert cli_util.ratio(10 ** 400, 3) is None
    assert cli_util.fmt_less(10 ** 400, 3) == "?" and cli_util.fmt_float("z") == "z"
    # Ints beyond Python's digit limit as a key and a value of the state (the skeleton holds them).
    big = 10 ** 5000
    ckpt_core.save({"w": torch.ones(1), big: 1, "v": big, "step": 1}, tmp_path / "big.ckpt")
    for argv in (["inspect", str(tmp_path / "big.ckpt")], ["inspect", str(tmp_path / "big.ckpt"), "--json"],
                 ["diff", str(tmp_path / "big.ckpt"), str(tmp_path / "big.ckpt")]):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
    assert hex(big)[:20] in run(capsys, "inspect", str(tmp_path / "big.ckpt"))[1]


# ----------------------------------------------------------------------------- safetensors


def test_import_of_deeply_nested_skeleton_is_a_clear_error(capsys, tmp_path):
    path = tmp_path / "deep.safetensors"
    path.write_bytes(st_save({"w": torch.ones(2)}, metadata={
        "checkrun.skeleton": "[" * 100000 + "]" * 100000, "checkrun.tensors": "[]"}))
    code, out, err = run(capsys, "import", str(path), str(tmp_path / "imp" / "x.ckpt"))
    assert code == 1
    assert err.strip() == (f"checkrun: error: {path}: invalid checkrun metadata in safetensors file: "
                           "checkrun.skeleton is nested too deeply")


def test_export_drops_tensors_safetensors_cannot_hold_with_a_note(capsys, tmp_path):
    w = torch.nn.Parameter(torch.randn(3))
    state = {"a": torch.randn(2), "c": torch.randn(3, dtype=torch.complex128), "z": torch.arange(4),
             "p": w, "tied": w, "step": 7}
    ckpt_core.save(state, tmp_path / "run" / "c.ckpt")
    out_st = tmp_path / "c.safetensors"
    code, out, err = run(capsys, "export", str(tmp_path / "run" / "c.ckpt"), str(out_st))
    assert code == 0, err
    assert "1 value(s) dropped" in out and out.rstrip().endswith(": c"), out
    code, out, err = run(capsys, "import", str(out_st), str(tmp_path / "imp" / "c.ckpt"))
    assert code == 0, err
    back = ckpt_core.load(tmp_path / "imp" / "c.ckpt")
    assert back["c"] is None and back["step"] == 7
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["z"], state["z"])
    assert torch.equal(back["p"], w.detach()) and back["tied"] is back["p"]


# ----------------------------------------------------------------------------- memory: deep and long states


def test_inspect_diff_and_export_of_a_deep_state_stay_within_its_size(capsys, tmp_path):
    """Every pending item of the tree walk (and of export's numpy scan) held its whole dotted path as
    text, and diff held every plain list item as a value of its own with the reprs of all its keys:
    a 62 KB manifest (20,000 list items under 240 dicts with 80-character keys) took 665 MB to
    inspect, 1.1 GB to export and 3.8 GB to diff; 15 lists of 65,536 ints 2.3 GB to diff. A plain list
    is now one value to diff (compared item by item, shown from the first item that differs)."""
    import tracemalloc

    def deep(tail: int) -> dict:
        state: dict = {"w": torch.ones(3), "ids": list(range(5000)), "small": [1, 2, tail]}
        for _ in range(200):
            state = {"k" * 80: state}
        return state

    ckpt_core.save(deep(3), tmp_path / "a.ckpt")
    ckpt_core.save(deep(4), tmp_path / "b.ckpt")
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    peaks = {}
    for name, argv in (("inspect", ("inspect", a)), ("diff", ("diff", a, b, "--json")),
                       ("export", ("export", a, str(tmp_path / "a.pt")))):
        tracemalloc.start()
        try:
            code, out, _ = run(capsys, *argv)
            peaks[name] = tracemalloc.get_traced_memory()[1] >> 20
        finally:
            tracemalloc.stop()
        assert code in (0, 1), out
        if name == "diff":
            [value] = json.loads(out)["values"]
            assert value["key"].endswith(".small") and value["index"] == 2 and value["b"] == [1, 2, 4]
    assert all(peak < 24 for peak in peaks.values()), peaks  # MiB; before: 100-700 MiB
    ckpt_core.save({"ids": list(range(100)), "long": list(range(300)), "same": [float("nan")] * 300},
                   tmp_path / "c.ckpt")
    ckpt_core.save({"ids": list(range(300)), "long": list(range(299)) + [7], "same": [float("nan")] * 300},
                   tmp_path / "d.ckpt")
    code, out, _ = run(capsys, "diff", str(tmp_path / "c.ckpt"), str(tmp_path / "d.ckpt"))
    rows = {line.split()[0]: line.split(None, 2)[2] for line in out.splitlines() if " changed " in line}
    assert set(rows) == {"ids", "long"} and "1 value(s) differ" not in out, out  # a list that grew: one row
    assert rows["ids"].split() == "[100] (ends) of 100 items [100] 100 of 300 items".split()
    assert rows["long"].split() == "[299] 299 of 300 items [299] 7 of 300 items".split()


def _forty_checkpoints(tmp_path) -> int:
    """Saves 40 checkpoints of 100 tensors into ``tmp_path``; returns the peak bytes of listing them."""
    import tracemalloc

    state = {f"t{i}": torch.randn(2000) for i in range(100)}
    with ckpt_core.CheckpointEngine() as engine:
        for step in range(40):
            state[f"t{step % 100}"] += 1
            engine.save({"model": state, "step": step}, tmp_path / f"step={step:03d}.ckpt").result()
        tracemalloc.start()
        try:
            engine.list(tmp_path)
            listing = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    return listing


def test_ls_holds_the_directory_parsed_once(capsys, tmp_path):
    """``checkrun ls`` kept every parsed manifest while its gc dry run (the unreferenced total) parsed
    them all again: twice a listing's memory (2,000 checkpoints: 1.29 GB, now 0.79 GB)."""
    import tracemalloc

    listing = _forty_checkpoints(tmp_path)
    tracemalloc.start()
    try:
        code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0 and len(json.loads(out)["checkpoints"]) == 40
    assert peak < 1.6 * listing, (peak, listing)  # before: 2.1x


@pytest.mark.parametrize("command", ["gc", "verify"])
def test_gc_and_verify_hold_no_directory_of_parsed_manifests(capsys, tmp_path, command):
    """A collection (``checkrun gc``, the after-save one, ``ls``'s unreferenced total) held every parsed
    manifest of the directory while it looked for referenced blobs, and ``checkrun verify DIR`` while it
    verified them one by one: a listing's memory (1,000 checkpoints of 300 tensors: ``checkrun gc
    --dry-run`` 648 MB, now 253 MB; ``verify --no-decode`` 648 MB, now 249 MB). A collection parses each
    manifest and keeps its blob keys; verify lists the manifests by their heads and parses each in turn."""
    import tracemalloc

    listing = _forty_checkpoints(tmp_path)
    argv = ("gc", str(tmp_path), "--dry-run", "--json") if command == "gc" else (
        "verify", str(tmp_path), "--no-decode", "--json")
    tracemalloc.start()
    try:
        code, out, _ = run(capsys, *argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    got = json.loads(out)
    assert code == 0 and (got["referenced"] >= 40 if command == "gc" else len(got["checkpoints"]) == 40)
    assert peak < 0.7 * listing, (peak, listing)  # before: 1.1x; now 0.5x


@pytest.mark.skipif(not shutil.which("bash"), reason="needs bash (ulimit -f)")
@pytest.mark.parametrize("out", ["x.pt", "x.safetensors"])
def test_export_onto_a_full_disk_names_the_file_and_the_cause(tmp_path, out):
    """A write that fails (here: past the file size limit of ``ulimit -f``, as a full disk fails it;
    Python ignores SIGXFSZ, so the write gets EFBIG) failed a ``.pt`` export with torch's zip writer's
    "unexpected pos 704 vs 598", naming neither the file nor the cause, and a ``.safetensors`` one with a
    bare errno (h106, on a real full tmpfs)."""
    ckpt_core.save({"w": torch.randn(300_000)}, tmp_path / "run" / "x.ckpt")
    target = tmp_path / "out" / out
    command = f"ulimit -f 64 && exec {shlex.quote(sys.executable)} -m ckpt_core.cli export " \
              f"{shlex.quote(str(tmp_path / 'run' / 'x.ckpt'))} {shlex.quote(str(target))}"
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{target}: writing failed: File too large (nothing was written there)" in proc.stderr, proc.stderr
    assert not target.exists() and not list((tmp_path / "out").iterdir())  # no temporary file left


def test_verify_says_a_link_to_something_other_than_a_file_is_not_a_checkpoint(capsys, tmp_path):
    """A link to /dev/null was said to point at something that "does not exist" (h106, h107)."""
    ckpt_core.save({"w": torch.ones(3)}, tmp_path / "run" / "a.ckpt")
    os.symlink("/dev/null", tmp_path / "run" / "z.ckpt")
    code, out, _ = run(capsys, "verify", str(tmp_path / "run"))
    assert code == 1 and "z.ckpt: a symbolic link to /dev/null, which is not a regular file" in out, out
    code, out, _ = run(capsys, "ls", str(tmp_path / "run"))  # h107: "(dangling: it does not exist)"
    assert code == 1 and "z.ckpt -> /dev/null  (not a regular file: not a checkpoint)" in out, out
