"""Bounds a load and a save keep before they allocate or write.

* Pickled values (object blobs: torch.save zips unpickled under ``weights_only``) count against
  ``load.max_total_bytes`` with the tensors: their blobs and what their zip directories declare, read
  before anything is unpickled; a record torch.save never writes (deflated: a 0.25 MB blob that
  inflated to a 256 MiB tensor) is refused.
* ``load(into=...)``: a live tensor whose elements share memory (an expanded view) is not written in
  place; it loads as a new tensor, as any other leaf that does not fit, before any leaf is written.
* A state with more tensors than a manifest a load accepts (``load.max_manifest_elements``) fails in
  ``save()``, before any blob is written, and the message says tensors, not plain values.
"""
from __future__ import annotations

import collections
import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import xxhash

import ckpt_core
from ckpt_core import BackgroundSaveError, CheckpointEngine, EngineConfig
from ckpt_core.errors import CorruptCheckpointError, FormatError, ResourceLimitError
from ckpt_core.format.limits import json_shape
from ckpt_core.format.manifest import _body_checksum
from ckpt_core.format.objects import ZIP_ENTRY_COST, object_load_bytes, serialize_object
from ckpt_core.saving.capture import MIN_OBJECT_ELEMENTS, MIN_TENSOR_ELEMENTS

MiB = 1 << 20


def _config(max_total_bytes: int | None = None, **load) -> dict:
    return {"saving": {"sigterm_grace_seconds": None}, "storage": {"fsync": False},
            "load": {"max_total_bytes": max_total_bytes, **load}}


def _holding(nbytes: int) -> collections.Counter:
    """A value pickled into an object blob (torch allows it under weights_only), with a tensor of
    ``nbytes`` inside."""
    return collections.Counter({"t": torch.ones(nbytes // 4)})


def _blob_files(root: Path) -> list[Path]:
    blobs = root / ".checkrun" / "blobs"
    return [p for p in blobs.rglob("*") if p.is_file()] if blobs.exists() else []


# ------------------------------------------------------------------- pickled values vs max_total_bytes
def test_an_object_blob_counts_its_records_against_max_total_bytes(tmp_path):
    path = tmp_path / "x.ckpt"
    ckpt_core.save({"o": _holding(3 * MiB), "w": torch.ones(4)}, path, config=_config())
    # its 3 MiB blob and the 3 MiB storage unpickling it allocates: 6 MiB and a little
    with pytest.raises(ResourceLimitError, match=r"load\.max_total_bytes") as info:
        ckpt_core.load(path, config=_config(5 * MiB))
    assert "x.ckpt" in str(info.value) and "'o'" in str(info.value) and ".checkrun/blobs/" in str(info.value)
    out = ckpt_core.load(path, config=_config(7 * MiB))
    assert torch.equal(out["o"]["t"], torch.ones(3 * MiB // 4))


def test_many_medium_objects_add_up(tmp_path):
    path = tmp_path / "x.ckpt"
    ckpt_core.save({f"o{i}": _holding(MiB) for i in range(6)}, path, config=_config())
    with pytest.raises(ResourceLimitError, match=r"load\.max_total_bytes"):
        ckpt_core.load(path, config=_config(8 * MiB))  # each fits alone; 6 x (1 + 1) MiB do not
    assert len(ckpt_core.load(path, config=_config(13 * MiB))) == 6


def test_object_blobs_are_refused_before_any_tensor_is_written(tmp_path):
    path = tmp_path / "x.ckpt"
    ckpt_core.save({"w": torch.full((MiB,), 2.0), "o": _holding(2 * MiB)}, path, config=_config())
    live = {"w": torch.zeros(MiB)}
    # the tensor decodes into ``live`` (0 bytes), the blob alone fits (2 MiB), blob + records do not
    with pytest.raises(ResourceLimitError, match="unpickling it may allocate"):
        ckpt_core.load(path, config=_config(3 * MiB), into=live)
    assert not live["w"].any()
    # the tensors leave no room for the blobs: refused before they are read
    with pytest.raises(ResourceLimitError, match="for the blobs of its pickled values"):
        ckpt_core.load(path, config=_config(5 * MiB))


def test_the_zip_directory_is_read_before_anything_is_unpickled():
    ok = serialize_object({"t": torch.zeros(1000)})
    need = object_load_bytes(ok, key="k", type_name="dict", max_bytes=1 << 30)
    infos = zipfile.ZipFile(io.BytesIO(ok)).infolist()
    assert need == sum(i.file_size for i in infos) + ZIP_ENTRY_COST * len(infos)
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)  # what torch.save writes
    with pytest.raises(ResourceLimitError, match="more than the 5000 left"):
        object_load_bytes(ok, key="k", type_name="dict", max_bytes=5000)
    with pytest.raises(FormatError, match="is compressed"):
        object_load_bytes(_deflated(ok), key="k", type_name="dict", max_bytes=1 << 30)
    with pytest.raises(CorruptCheckpointError, match="not a torch.save archive"):  # raw and legacy pickles
        object_load_bytes(b"\x80\x02}q\x00.", key="k", type_name="dict", max_bytes=1 << 30)
    with pytest.raises(CorruptCheckpointError, match="not a valid torch.save blob"):
        object_load_bytes(ok[:-30], key="k", type_name="dict", max_bytes=1 << 30)


def test_zip_entries_are_bounded_before_zipfile_builds_them():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i in range(20_000):
            z.writestr(zipfile.ZipInfo(f"{i:x}"), b"")
    with pytest.raises(ResourceLimitError, match="unpickling it may allocate 20480000 bytes"):
        object_load_bytes(buf.getvalue(), key="k", type_name="dict", max_bytes=16 * MiB)


def _deflated(data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    return out.getvalue()


_MAKE_BOMB = textwrap.dedent("""
    import shutil, sys, torch, zipfile
    src, dst = sys.argv[1], sys.argv[2]
    torch.save([torch.zeros(64 << 20)], src)  # 256 MiB, stored
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            with zin.open(info) as r, zout.open(info.filename, "w") as w:
                shutil.copyfileobj(r, w, 1 << 20)
""")

_LOAD = textwrap.dedent("""
    import json, os, sys, torch, ckpt_core
    from ckpt_core.errors import CheckrunError
    path = sys.argv[1]
    cfg = {"load": {"max_total_bytes": 64 << 20}}
    ckpt_core.load(sys.argv[2], config=cfg)  # warm up what a load touches
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        out = {"loaded": type(ckpt_core.load(path, config=cfg)["big"]).__name__}
    except CheckrunError as exc:
        out = {"refused": type(exc).__name__, "message": str(exc)}
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]  # not ru_maxrss: survives exec
    out["grew_mb"] = (int(hwm.split()[1]) * 1024 - rss) / 2**20
    print(json.dumps(out))
""")


def test_a_deflated_object_bomb_is_refused_in_bounded_memory(tmp_path):
    """A 0.25 MB object blob whose deflated record inflates to a 256 MiB tensor, forged into a manifest
    with its checksums recomputed (the attacker of docs/reliability.md), max_total_bytes 64 MiB."""
    root = tmp_path / "run"
    ckpt_core.save({"w": torch.ones(4), "big": list(range(70_000))}, root / "x.ckpt")  # the list: an object blob
    ckpt_core.save({"w": torch.ones(4)}, root / "small.ckpt")
    subprocess.run([sys.executable, "-c", _MAKE_BOMB, str(tmp_path / "s.pt"), str(tmp_path / "bomb.zip")],
                   check=True, timeout=300)
    bomb = (tmp_path / "bomb.zip").read_bytes()
    assert len(bomb) < MiB
    key = xxhash.xxh3_128_hexdigest(bomb)
    (root / ".checkrun" / "blobs" / key[:2]).mkdir(parents=True, exist_ok=True)
    (root / ".checkrun" / "blobs" / key[:2] / key[2:]).write_bytes(bomb)
    body = json.loads((root / "x.ckpt").read_bytes())
    body["objects"][0]["blob"] = {"key": key, "size": len(bomb), "csum": xxhash.xxh3_64_hexdigest(bomb)}
    body.pop("checksum")
    body["checksum"] = _body_checksum(body)
    (root / "x.ckpt").write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(root / "x.ckpt"), str(root / "small.ckpt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.get("refused") == "FormatError", out
    assert "x.ckpt" in out["message"] and "is compressed" in out["message"], out
    assert out["grew_mb"] < 64, out  # before: +512 MiB and more, the tensor loaded


# ------------------------------------------------------------------------------ into= and overlap
@pytest.mark.parametrize("make", [lambda: torch.zeros(1, 5).expand(100, 5),
                                  lambda: torch.zeros(600).as_strided((100, 5), (5, 2))],
                         ids=["expanded", "as_strided-overlap"])
def test_into_a_tensor_whose_elements_share_memory_loads_a_new_tensor(tmp_path, make):
    path = tmp_path / "x.ckpt"
    pos = torch.arange(500.0).reshape(100, 5)
    ckpt_core.save({"a": torch.ones(3), "pos": pos}, path)
    live = {"a": torch.zeros(3), "pos": make()}
    out = ckpt_core.load(path, into=live)
    assert torch.equal(out["pos"], pos) and out["pos"] is not live["pos"]
    assert out["a"] is live["a"] and torch.equal(live["a"], torch.ones(3))
    assert not live["pos"].any()  # left alone, not half-written


def test_into_a_strided_view_is_still_filled_in_place(tmp_path):
    path = tmp_path / "x.ckpt"
    ckpt_core.save({"w": torch.arange(12.0).reshape(4, 3), "t": torch.arange(6.0).reshape(3, 2)}, path)
    buf, other = torch.zeros(4, 6), torch.zeros(2, 3)
    live = {"w": buf[:, ::2], "t": other.t()}
    out = ckpt_core.load(path, into=live)
    assert out["w"] is live["w"] and torch.equal(buf[:, ::2], torch.arange(12.0).reshape(4, 3))
    assert out["t"] is live["t"] and torch.equal(other.t(), torch.arange(6.0).reshape(3, 2))


# --------------------------------------------------------------------- manifests with many tensors
def test_too_many_tensors_fail_in_save_before_any_blob_is_written(tmp_path):
    root = tmp_path / "run"
    state = {f"layer{i}.w": torch.full((3,), float(i)) for i in range(1000)}
    with CheckpointEngine(_config(max_manifest_elements=20_000)) as engine:
        with pytest.raises(FormatError) as info:
            engine.save(state, root / "x.ckpt")
    message = str(info.value)
    assert "1000 tensors" in message and "load.max_manifest_elements" in message, message
    assert "group small tensors" in message and "plain values (nested" not in message, message
    assert not (root / "x.ckpt").exists() and not _blob_files(root)


def test_100k_small_tensors_fail_at_once_with_the_default_config(tmp_path):
    """The default (4M elements) stays: 100k tensors need ~6M, and a limit that admits them lets a
    60 MB manifest of short strings be parsed (+531 MB) that is refused before parsing today."""
    root = tmp_path / "run"
    state = {f"layer{i}.w": torch.full((3,), float(i)) for i in range(100_000)}
    with pytest.raises(FormatError, match="100000 tensors and 0 pickled values") as info:
        ckpt_core.save(state, root / "x.ckpt")
    assert "load.max_manifest_elements to about 7000000" in str(info.value)
    assert not _blob_files(root)


def test_tensors_past_what_any_manifest_holds_are_told_to_group_not_to_raise_the_limit(tmp_path):
    """The early refusal suggested raising load.max_manifest_elements for 200k tensors, whose manifest
    (~79 MB) no setting admits: following it cost ~108 s of writes before the same refusal (found by an
    independent check). It says to group the tensors instead."""
    root = tmp_path / "run"
    state = {f"t{i}": torch.zeros(1) for i in range(280_000)}
    for config in (None, _config(max_manifest_elements=20_000_000)):  # also where the element limit was raised
        with pytest.raises(FormatError, match=r"280000 tensors need a manifest of at least \d+ MiB") as info:
            ckpt_core.save(state, root / "x.ckpt", config=config)
        assert "group small tensors" in str(info.value) and "to about" not in str(info.value)
        assert not _blob_files(root)


def test_the_early_manifest_check_refuses_only_states_sure_to_exceed():
    """190k one-element tensors save and load with compression off (a 58.5 MB manifest: ~300 bytes a
    tensor), yet the early check, assuming a typical 370 bytes, refused them (found by an independent
    check). It now counts the fewest bytes a tensor takes and its key, once (counted twice, 75k tensors
    under a 400-character prefix were refused: a 58 MB manifest; found by the next check)."""
    from ckpt_core.config import coerce_config
    from ckpt_core.saving.capture import check_manifest_room

    config = coerce_config({**_config(max_manifest_elements=50_000_000), "compression": {"compress": False}})
    check_manifest_room(190_000, 0, config, key_chars=190_000 * 6)
    check_manifest_room(260_000, 0, config, key_chars=260_000 * 2)
    check_manifest_room(75_000, 0, config, key_chars=75_000 * 405)  # a long shared prefix: 58 MB, it fits
    with pytest.raises(FormatError, match="190000 tensors need a manifest of at least 65 MiB"):
        check_manifest_room(190_000, 0, config, key_chars=190_000 * 110)


def test_an_expanded_tensor_is_refused_before_its_values_take_memory(tmp_path):
    """``torch.zeros(1).expand(2**31)`` (4 bytes of memory) was staged at its 8 GiB of values: a bare
    allocator error naming no key, or on a larger machine a 1 GiB stored tensor for 4 bytes (found by an
    independent check). A small one is stored as its values, as before; the last checkpoint is kept."""
    path = tmp_path / "x.ckpt"
    with CheckpointEngine(_config()) as engine:
        engine.save({"small": torch.arange(4.0).reshape(1, 4).expand(3, 4)}, path).result()
        with pytest.raises(FormatError, match=r"big: cannot save an expanded tensor .* 8589934592 bytes"):
            engine.save({"big": torch.zeros(1).expand(2**31)}, path)
        assert torch.equal(engine.load(path)["small"], torch.arange(4.0).repeat(3, 1))
        table = torch.zeros(10240, 1024)  # 42 MB behind the view: its storage is more than half its 84 MB
        with pytest.raises(FormatError, match=r"row: cannot save an expanded tensor .* share 4096 bytes"):
            engine.save({"row": table[0].expand(20480, 1024)}, path)


def test_a_value_that_cannot_be_pickled_names_its_key(tmp_path):
    """torch.save's own error (its type kept) with a note naming the value's place in the state."""
    import threading

    with pytest.raises(TypeError, match="cannot pickle") as info:
        ckpt_core.save({"w": torch.ones(2), "sub": {"lock": threading.Lock()}}, tmp_path / "x.ckpt")
    assert any("'sub.lock'" in note for note in info.value.__notes__), info.value.__notes__


def test_the_exact_check_after_the_blobs_names_tensors(tmp_path):
    """Between the early lower bound (44 a tensor) and the real count (~60 a tensor by default)."""
    path = tmp_path / "x.ckpt"
    state = {f"layer{i}.w": torch.full((3,), float(i)) for i in range(1000)}
    with CheckpointEngine(_config(max_manifest_elements=50_000)) as engine:
        with pytest.raises(BackgroundSaveError) as info:
            engine.save(state, path).result()
    cause = info.value.__cause__
    assert isinstance(cause, FormatError), repr(info.value)
    message = str(cause)
    assert "its manifest would not load" in message and "1000 tensors and 0 pickled values" in message, message
    assert "raise load.max_manifest_elements where you save and where you load" in message, message
    assert "plain values (nested" not in message and not path.exists()


def test_the_early_bound_never_exceeds_a_real_manifest(tmp_path):
    """``MIN_TENSOR_ELEMENTS`` / ``MIN_OBJECT_ELEMENTS`` are lower bounds: the smallest records there are
    (a list, no compression, no packs, one-element int8 tensors, one pickled value each)."""
    n = 300
    for compression in ({"compress": False, "pack_bytes": 0}, {}):
        path = tmp_path / f"x{len(compression)}.ckpt"
        state = [torch.full((1,), i % 100, dtype=torch.int8) for i in range(n)]
        ckpt_core.save(state, path, config={"compression": compression})
        elements = json_shape(path.read_bytes())[1]
        assert elements >= MIN_TENSOR_ELEMENTS * n, (compression, elements / n)
    path = tmp_path / "objects.ckpt"
    ckpt_core.save([collections.Counter({i: i}) for i in range(n)], path)
    assert len(json.loads(path.read_bytes())["objects"]) == n
    assert json_shape(path.read_bytes())[1] >= MIN_OBJECT_ELEMENTS * n


def test_a_limit_below_the_tensors_names_the_tensors(tmp_path):
    """load.max_total_bytes below the tensors' bytes, with a pickled value in the checkpoint: the refusal
    blamed "0 bytes for the blobs of its pickled values" and never said what the tensors need."""
    path = tmp_path / "x.ckpt"
    ckpt_core.save({"w": torch.randn(1024, 1024), "step": 1, "note": {1, 2}}, path)
    with CheckpointEngine({"load": {"max_total_bytes": 1 << 20}}) as engine:
        with pytest.raises(ResourceLimitError, match=r"loading needs 4194304 bytes for its tensors and the copies it "
                                                     r"keeps .*, more than the limit of 1048576"):
            engine.load(path, weights_only=False)


def test_the_early_byte_bound_never_exceeds_a_real_manifest(tmp_path):
    """``MIN_TENSOR_BYTES`` (compression or packs off) and ``MIN_TENSOR_BYTES_PACKED`` (the default) are
    lower bounds of a tensor's manifest bytes besides its key and the skeleton: the smallest records
    (one-element int8 tensors in a list, keys of 1-3 characters)."""
    from ckpt_core.saving.capture import MIN_TENSOR_BYTES, MIN_TENSOR_BYTES_PACKED

    n = 300
    state = [torch.full((1,), i % 100, dtype=torch.int8) for i in range(n)]
    keys = sum(len(str(i)) for i in range(n))
    for compression, floor in (({"compress": False}, MIN_TENSOR_BYTES), ({"pack_bytes": 0}, MIN_TENSOR_BYTES),
                               ({}, MIN_TENSOR_BYTES_PACKED)):
        path = tmp_path / f"x{len(compression)}.ckpt"
        ckpt_core.save(state, path, config={"compression": compression, "saving": {"asynchronous": False}})
        skeleton = len(json.dumps(json.loads(path.read_bytes())["skeleton"], separators=(",", ":")))
        assert path.stat().st_size - keys - skeleton >= floor * n, (compression, path.stat().st_size / n)


def test_a_state_no_manifest_holds_is_not_told_to_raise_the_element_limit(tmp_path):
    """200,000 tensors with 12-character keys by default: a 78.8 MB manifest. Before, ``save()`` said to raise
    load.max_manifest_elements, and a save that did failed at commit after writing every blob (found by an
    independent check)."""
    state = {f"layer{i:06d}.w": torch.zeros(1) for i in range(200_000)}
    for limit in (4_000_000, 20_000_000):  # the default, and as the element check used to advise
        with pytest.raises(FormatError, match=r"200000 tensors need a manifest of at least \d+ MiB, more than a "
                                              r"manifest may hold \(64 MiB, whatever load.max_manifest_elements"):
            ckpt_core.save(state, tmp_path / "x.ckpt", config={"load": {"max_manifest_elements": limit}})
        assert not _blob_files(tmp_path)
