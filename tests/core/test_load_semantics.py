"""Loading follows torch.load's contract where users rely on it (found by an independent check, h151):
``weights_only=None`` and torch's TORCH_FORCE_*_WEIGHTS_ONLY_LOAD switches, values whose class changed since
the save (not corruption), a dict ``map_location`` naming a missing device, builtins in the allow-list,
``map_location`` as the second positional argument."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

import ckpt_core
from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.errors import ConfigError, CorruptCheckpointError, ObjectLoadError, UnsafeLoadError


class _RunsCode:
    """Unpickling it touches a file (os.system would be blocked as well; this one needs no allow-list miss)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def no_switches(monkeypatch):
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)


def test_weights_only_none_means_true(tmp_path, no_switches):
    marker = tmp_path / "ran"
    ckpt_core.save({"w": torch.ones(2), "x": _RunsCode(str(marker))}, tmp_path / "a.ckpt")
    for load in (lambda: ckpt_core.load(tmp_path / "a.ckpt", weights_only=None),
                 lambda: CheckpointEngine().load(tmp_path / "a.ckpt", weights_only=None),
                 lambda: ckpt_core.load(tmp_path / "a.ckpt")):
        with pytest.raises(UnsafeLoadError):
            load()
    assert not marker.exists()


def test_lightning_plugin_passes_weights_only_none_as_torch_does(tmp_path, no_switches):
    pytest.importorskip("lightning")
    from lightning_ckpt import CheckrunCheckpointIO

    marker = tmp_path / "ran"
    ckpt_core.save({"state_dict": {}, "x": _RunsCode(str(marker))}, tmp_path / "l.ckpt")
    with pytest.raises(UnsafeLoadError):
        CheckrunCheckpointIO().load_checkpoint(tmp_path / "l.ckpt", weights_only=None)
    assert not marker.exists()


def test_torch_switches_apply_as_in_torch_load(tmp_path, monkeypatch, no_switches):
    ns = {"args": __import__("argparse").Namespace(lr=0.1), "w": torch.ones(1)}
    ckpt_core.save(ns, tmp_path / "a.ckpt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"):
        assert ckpt_core.load(tmp_path / "a.ckpt")["args"].lr == 0.1  # not given: unrestricted, as torch.load
    with pytest.raises(UnsafeLoadError):  # given explicitly: the switch does not override it
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=True)
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "true")
    with pytest.raises(UnsafeLoadError, match="unset TORCH_FORCE_WEIGHTS_ONLY_LOAD"):  # was CorruptCheckpointError
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ConfigError, match="set only one"):
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)


def _module(tmp_path, monkeypatch, body: str):
    (tmp_path / "cfgmod_h151.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("cfgmod_h151", None)
    importlib.invalidate_caches()
    return importlib.import_module("cfgmod_h151")


def test_a_class_changed_since_the_save_is_not_reported_as_corruption(tmp_path, monkeypatch):
    mod = _module(tmp_path, monkeypatch, "class Config:\n    def __init__(self):\n        self.v = 1\n")
    ckpt_core.save({"cfg": mod.Config(), "w": torch.ones(1)}, tmp_path / "a.ckpt")
    os.utime(tmp_path / "cfgmod_h151.py", (0, 0))
    _module(tmp_path, monkeypatch, "class Renamed:\n    pass\n")  # the class was renamed
    with pytest.raises(ObjectLoadError, match=r"'cfg' \(cfgmod_h151.Config\) could not be rebuilt.*not damaged") as info:
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)
    causes, exc = [], info.value
    while exc is not None:
        causes, exc = causes + [exc], exc.__cause__
    assert isinstance(causes[-1], AttributeError) and not isinstance(info.value, CorruptCheckpointError)
    _module(tmp_path, monkeypatch, "class Config:\n    def __setstate__(self, s):\n"
                                   "        raise ValueError('Config v1 is no longer supported')\n")
    with pytest.raises(ObjectLoadError, match="ValueError: Config v1 is no longer supported"):
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)
    sys.modules.pop("cfgmod_h151", None)
    (tmp_path / "cfgmod_h151.py").unlink()
    importlib.invalidate_caches()
    with pytest.raises(ObjectLoadError, match="ModuleNotFoundError"):  # was a raw ModuleNotFoundError
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)
    assert ckpt_core.CheckpointEngine().verify(tmp_path / "a.ckpt").ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_dict_map_location_to_a_missing_device_is_refused(tmp_path):
    ckpt_core.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(ckpt_core.CheckrunError, match="map_location 'cuda:0': this machine has no cuda device"):
        ckpt_core.load(tmp_path / "a.ckpt", map_location={"cpu": "cuda:0"})  # was: CPU tensors, no error
    assert ckpt_core.load(tmp_path / "a.ckpt", map_location={"cuda:0": "cpu"})["w"].device.type == "cpu"
    ckpt_core.save({"ns": __import__("argparse").Namespace(t=torch.ones(1))}, tmp_path / "b.ckpt")
    with pytest.raises(ObjectLoadError, match="Attempting to deserialize object on a CUDA device"):
        ckpt_core.load(tmp_path / "b.ckpt", map_location={"cpu": "cuda:0"}, weights_only=False)


def test_the_allow_list_name_in_the_refusal_works_for_builtins(tmp_path):
    ckpt_core.save({"s": frozenset({1, 2})}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeLoadError, match="add 'builtins.frozenset' to the config's load.allowed_globals"):
        ckpt_core.load(tmp_path / "a.ckpt")
    for name in ("builtins.frozenset", "frozenset"):
        cfg = EngineConfig.from_dict({"load": {"allowed_globals": [name]}})
        assert ckpt_core.load(tmp_path / "a.ckpt", config=cfg)["s"] == frozenset({1, 2})


def test_map_location_is_the_second_positional_argument_as_in_torch_load(tmp_path):
    ckpt_core.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert ckpt_core.load(tmp_path / "a.ckpt", "cpu")["w"].device.type == "cpu"


@pytest.mark.parametrize("before, after", [
    ("import enum\nclass V(enum.Enum):\n    old = 1\n    new = 2\nVALUE = V.old\n",
     "import enum\nclass V(enum.Enum):\n    new = 2\n"),  # a member removed: ValueError inside enum.py
    ("import typing\nclass V(typing.NamedTuple):\n    x: int\nVALUE = V(1)\n",
     "import typing\nclass V(typing.NamedTuple):\n    x: int\n    y: int\n"),  # a field added: TypeError at the call
    ("class V:\n    def __init__(self, a):\n        self.a = a\n    def __reduce__(self):\n        return (V, (self.a,))\n"
     "VALUE = V(1)\n", "class V:\n    def __init__(self, a, b):\n        pass\n"),  # __init__ gained an argument
    ("class V:\n    pass\nVALUE = V()\nVALUE.a = 1\n",
     "class V:\n    def __setstate__(self, s):\n        assert False, 'v1 is no longer supported'\n"),  # an assert
])
def test_changes_of_a_class_since_the_save_are_not_corruption(tmp_path, monkeypatch, before, after):
    """h152: these still said "not a valid torch.save blob" (or raised a bare AssertionError)."""
    mod = _module(tmp_path, monkeypatch, before)
    ckpt_core.save({"v": mod.VALUE}, tmp_path / "a.ckpt")
    _module(tmp_path, monkeypatch, after)
    with pytest.raises(ObjectLoadError, match=r"'v' \(cfgmod_h151.V\) could not be rebuilt"):
        ckpt_core.load(tmp_path / "a.ckpt", weights_only=False)


def test_a_malformed_pickle_is_still_corruption(tmp_path, monkeypatch):
    """A blob whose pickle is not a valid opcode stream (its checksum recomputed by whoever damaged it)."""
    import io
    import zipfile

    from ckpt_core.format import objects

    good = objects.serialize_object(__import__("argparse").Namespace(a=1))
    src, out = zipfile.ZipFile(io.BytesIO(good)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            dst.writestr(info, data[:len(data) // 2] if info.filename.endswith("data.pkl") else data)
    with pytest.raises(CorruptCheckpointError) as info:
        objects.deserialize_object(out.getvalue(), key="v", type_name="argparse.Namespace", weights_only=False)
    assert not isinstance(info.value, ObjectLoadError)


def test_a_dict_map_location_naming_no_device_is_a_clear_error(tmp_path):
    ckpt_core.save({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    with pytest.raises(ckpt_core.CheckrunError, match="map_location 'bogus' names no device"):
        ckpt_core.load(tmp_path / "a.ckpt", map_location={"cpu": "bogus"})


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_storage_record_is_corruption_not_a_rebuild_failure(damage):
    """h154: a storage record cut short or missing (the checksum recomputed by whoever damaged it) was reported
    as ObjectLoadError, "most likely not damaged"."""
    import io
    import zipfile

    from ckpt_core.format import objects

    good = objects.serialize_object({"x": torch.arange(8)})
    src, out = zipfile.ZipFile(io.BytesIO(good)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data/0"):
                if damage == "missing":
                    continue
                data = data[:len(data) // 2]
            dst.writestr(info, data)
    for weights_only in (True, False):
        with pytest.raises(CorruptCheckpointError) as info:
            objects.deserialize_object(out.getvalue(), key="v", type_name="builtins.dict", weights_only=weights_only)
        assert not isinstance(info.value, ObjectLoadError)
