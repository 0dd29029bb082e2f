"""State tree <-> skeleton round trips, leaf identity, object blobs and hostile skeletons."""
from __future__ import annotations

import collections
import enum
import gc
import json
import math
import pathlib
import pickle
import struct
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_core.errors import CorruptCheckpointError, FormatError, UnsafeLoadError
from ckpt_core.format.objects import deserialize_object, serialize_object
from ckpt_core.format.skeleton import unflatten, validate_skeleton
from ckpt_core.format.tree import ObjectLeaf, TensorLeaf, flatten


class Color(enum.Enum):
    RED = 1


class Point:
    """A user class; module level so that pickle and allowed_globals can name it."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and other.x == self.x


Pair = collections.namedtuple("Pair", "a b")


def _bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: types (bool vs int, tuple vs list, OrderedDict vs dict), float bits, key order."""
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.nn.Parameter):
        assert a.dtype == b.dtype and a.requires_grad == b.requires_grad and torch.equal(a, b), path
    elif isinstance(a, torch.Tensor):
        assert a is b, f"{path}: tensor not passed through"
    elif type(a) is float:
        assert _bits(a) == _bits(b), f"{path}: {a!r} vs {b!r}"
    elif type(a) is complex:
        assert _bits(a.real) == _bits(b.real) and _bits(a.imag) == _bits(b.imag), path
    elif type(a) in (list, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif type(a) in (dict, OrderedDict):
        assert len(a) == len(b), path
        for j, ((ka, va), (kb, vb)) in enumerate(zip(a.items(), b.items())):
            assert_same(ka, kb, f"{path}[key {j}]")
            assert_same(va, vb, f"{path}[value {j}]")
        assert hasattr(a, "_metadata") == hasattr(b, "_metadata"), path
        if hasattr(a, "_metadata"):
            assert_same(a._metadata, b._metadata, f"{path}._metadata")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def roundtrip(state: Any) -> tuple[Any, Any]:
    """flatten -> JSON text (as the manifest writes it) -> validate -> unflatten."""
    flat = flatten(state)
    text = json.dumps(flat.skeleton, allow_nan=False, sort_keys=True, separators=(",", ":"))
    skeleton = json.loads(text)
    validate_skeleton(skeleton, len(flat.tensors), len(flat.objects))
    out = unflatten(skeleton, [leaf.tensor for leaf in flat.tensors], [leaf.obj for leaf in flat.objects])
    return flat, out


# ----------------------------------------------------------------------------- strategies

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]
SHAPES = [(), (0,), (1,), (3,), (2, 3), (2, 1, 2)]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
    t = (torch.arange(math.prod(shape)) % 3).reshape(shape).to(dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
    return t


tricky_text = st.one_of(st.text(max_size=8),
                        st.sampled_from(["$t", "$d", "$od", "$meta", "$", "", "a.b", "1"]))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([2**53, -(2**53) - 1, 2**64 - 1, -(2**200)]),
    st.floats(), st.sampled_from([-0.0, math.inf, -math.inf, -math.nan]), tricky_text, st.binary(max_size=8),
    st.complex_numbers(), st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")]),
)
keys = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), tricky_text,
              st.binary(max_size=4)),
    lambda inner: st.lists(inner, max_size=2).map(tuple), max_leaves=4)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    dicts = st.dictionaries(keys, children, max_size=4)
    return st.one_of(st.lists(children, max_size=4), st.lists(children, max_size=4).map(tuple), dicts,
                     dicts.map(OrderedDict))


trees = st.recursive(st.one_of(scalars, tensors()), _containers, max_leaves=25)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_roundtrip_random_trees(state: Any) -> None:
    flat, out = roundtrip(state)
    assert_same(state, out)
    assert len({leaf.key for leaf in flat.tensors}) == len(flat.tensors)
    assert json.dumps(flatten(state).skeleton) == json.dumps(flat.skeleton)  # deterministic


# ----------------------------------------------------------------------------- plain values


def test_keys_of_equal_value_but_different_type_stay_distinct() -> None:
    for state in ({1: "a"}, {True: "a"}, {1.0: "a"}, {"1": "a"}, {None: 1, (1, (2, "x")): 2, b"k": 3}):
        _, out = roundtrip(state)
        assert_same(state, out)
    assert not flatten({"a": 1, 2: [1.5, "x", None]}).tensors


def test_dollar_keys_and_tag_lookalikes_round_trip() -> None:
    state = {"$t": 0, "$d": {"$o": 1}, "$od": ["$meta"], "x": {"$t": {"$p": [0, True]}}}
    _, out = roundtrip(state)
    assert_same(state, out)


def test_special_floats_and_big_ints() -> None:
    weird_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
    state = [math.nan, -math.nan, weird_nan, math.inf, -math.inf, -0.0, 5e-324, 2**53 + 1, 1 + 2j,
             -(2**20000), {2**20000: torch.zeros(1)}]  # beyond the int<->str digit limit
    _, out = roundtrip(state)
    assert_same(state, out)


def test_skeleton_format_is_stable() -> None:
    """Golden encoding: manifests on disk depend on it, so a change here needs a format version bump."""
    od = OrderedDict([("w", torch.zeros(1))])
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"sd": od, 3: (2**53 + 1, math.inf, b"\x00"), "p": torch.nn.Parameter(torch.ones(1)),
             "x": [None, True, -0.0, 1 + 0j, torch.bfloat16, torch.Size([2]), torch.device("cuda", 0)],
             "o": pathlib.Path("a")}
    assert json.dumps(flatten(state).skeleton, separators=(",", ":")) == (
        '{"$d":["sd",{"$od":["w",{"$t":0}],"$meta":{"$d":["",{"$d":["version",1]}]}},'
        '3,{"$tuple":[{"$i":"0x20000000000001"},{"$f":"inf"},{"$b":"AA=="}]},"p",{"$p":[1,true]},'
        '"x",[null,true,-0.0,{"$c":[1.0,0.0]},{"$dtype":"bfloat16"},{"$size":[2]},{"$device":"cuda:0"}],'
        '"o",{"$o":0}]}')


def test_compact_for_large_flat_state_dict() -> None:
    sd = OrderedDict((f"model.layers.{i}.attn.q_proj.weight", torch.zeros(1)) for i in range(5000))
    text = json.dumps(flatten(sd).skeleton, separators=(",", ":"))
    assert len(text) < sum(len(k) + 16 for k in sd)  # key + quotes + {"$t":NNNN} + commas


# ----------------------------------------------------------------------------- tensors


def test_lightning_style_state_dict_keeps_metadata() -> None:
    sd = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).state_dict()
    flat, out = roundtrip({"state_dict": sd, "epoch": 3})
    assert type(out["state_dict"]) is OrderedDict
    assert out["state_dict"]._metadata == sd._metadata and list(out["state_dict"]) == list(sd)
    assert [leaf.key for leaf in flat.tensors][:2] == ["state_dict.0.weight", "state_dict.0.bias"]


def test_parameters_rebuilt_and_tied_weights_stay_tied() -> None:
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    emb = torch.nn.Embedding(4, 2)
    shared = torch.arange(3.0)
    state = {"emb": emb.weight, "head": emb.weight, "frozen": frozen, "a": shared, "b": [shared]}
    flat, out = roundtrip(state)
    assert len(flat.tensors) == 3 and isinstance(flat.tensors[0], TensorLeaf)
    assert [leaf.key for leaf in flat.tensors] == ["emb", "frozen", "a"]
    assert out["emb"] is out["head"] and type(out["emb"]) is torch.nn.Parameter and out["emb"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert out["a"] is out["b"][0] is shared


def test_plain_tensors_keep_requires_grad_like_torch_load() -> None:
    """A learnable tensor that is not a Parameter (SAC's log_alpha in a Fabric state): torch.save
    keeps its requires_grad, and so must checkrun; refs to it stay one object."""
    log_alpha = torch.zeros(1, requires_grad=True)
    state = {"log_alpha": log_alpha, "again": [log_alpha], "derived": log_alpha * 2, "plain": torch.ones(2)}
    flat, out = roundtrip(state)
    assert flat.skeleton["$d"][1] == {"$t": [0, True]} and flat.skeleton["$d"][7] == {"$t": 2}
    assert out["log_alpha"].requires_grad and out["log_alpha"].is_leaf and out["again"][0] is out["log_alpha"]
    assert out["derived"].requires_grad and out["derived"].is_leaf  # as torch.load rebuilds a non-leaf
    assert not out["plain"].requires_grad
    with pytest.raises(FormatError, match="require grad"):
        unflatten({"$t": [0, True]}, [torch.zeros(2, dtype=torch.int64)], [])


def test_optimizer_state_keys_and_collisions() -> None:
    # Shaped like Adam's state_dict (a real step() costs seconds of first-use setup).
    adam = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                      for i in range(2)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None,
                              "params": [0, 1]}]}
    state = {"optimizer_states": [adam], 1: torch.zeros(1), "1": torch.zeros(1), "1#2": torch.zeros(1),
             "a": {"b": torch.zeros(1)}, "a.b": torch.zeros(1)}
    flat, out = roundtrip(state)
    names = [leaf.key for leaf in flat.tensors]
    assert "optimizer_states.0.state.1.exp_avg" in names
    assert names[-5:] == ["1", "1#2", "1#2#2", "a.b", "a.b#2"]
    assert list(out["optimizer_states"][0]["state"]) == [0, 1]
    assert out["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_reference_cycle_is_refused() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(FormatError, match="cycle"):
        flatten({"x": loop})


# ----------------------------------------------------------------------------- objects


class MyTensor(torch.Tensor):
    pass


def test_non_plain_values_become_objects() -> None:
    state = {"color": Color.RED, "path": pathlib.Path("/tmp/x"), "np": np.longdouble(1.5), "arr": np.array(["a"]),
             "point": Point(1), "set": {1, 2}, "pair": Pair(1, 2), "dd": collections.defaultdict(int),
             "enum_keys": {Color.RED: torch.ones(1)}, "sub": torch.ones(1).as_subclass(MyTensor)}
    flat, out = roundtrip(state)
    assert all(isinstance(o, ObjectLeaf) for o in flat.objects) and not flat.tensors
    assert {o.key: o.type_name for o in flat.objects}["point"] == f"{__name__}.Point"
    assert [o.key for o in flat.objects] == list(state)
    assert all(out[k] is state[k] for k in state)


def test_objects_deserialize_under_torch_rules() -> None:
    blob = serialize_object(Point(7))
    kw = {"key": "state.extra", "type_name": f"{__name__}.Point"}
    with pytest.raises(UnsafeLoadError, match=r"state\.extra.*Point.*weights_only=False.*allowed_globals") as info:
        deserialize_object(blob, weights_only=True, **kw)
    assert isinstance(info.value, pickle.UnpicklingError)  # what torch raises there, and code catches
    assert deserialize_object(blob, weights_only=False, **kw) == Point(7)
    name = f"{Point.__module__}.{Point.__qualname__}"
    assert deserialize_object(blob, weights_only=True, allowed_globals=[name], **kw) == Point(7)
    assert Point not in torch.serialization.get_safe_globals()  # allowed for that call only
    with pytest.warns(RuntimeWarning, match="not_imported_mod"), pytest.raises(UnsafeLoadError):
        deserialize_object(blob, weights_only=True, allowed_globals=["not_imported_mod.X"], **kw)


def test_enum_and_numpy_refused_but_plain_pickle_safe_values_load() -> None:
    for value, type_name in ((Color.RED, f"{__name__}.Color"), (np.float32(2.0), "numpy.float32")):
        with pytest.raises(UnsafeLoadError, match=type_name):
            deserialize_object(serialize_object(value), key="k", type_name=type_name, weights_only=True)
    blob = serialize_object({1, 2})
    assert deserialize_object(blob, key="k", type_name="builtins.set", weights_only=True) == {1, 2}


def test_numpy_scalars_are_plain_data_bit_for_bit() -> None:
    """np.float64(...) from a metric, np.int64 counters: plain data in the skeleton (dtype and raw
    bytes), so they load under weights_only=True; before 2026-12-06 they were pickled and refused
    (stock accelerate loads registered objects with weights_only=False)."""
    values = [np.float64(0.25), np.float32("nan"), np.float32(-0.0), np.float16(3.5), np.int64(-(2**63)),
              np.uint64(2**64 - 1), np.int8(-3), np.bool_(True), np.complex128(1 - 2j),
              np.frombuffer(bytes.fromhex("0100c07f"), np.float32)[0]]  # a nan with a payload
    state = {"m": values, np.int32(3): "numpy key", "ld": np.longdouble(1.5)}
    flat = flatten(state)
    assert [o.type_name for o in flat.objects] == ["numpy.longdouble"]  # not exact as data: pickled
    back = unflatten(json.loads(json.dumps(flat.skeleton)), [], [o.obj for o in flat.objects])
    for a, b in zip(values, back["m"]):
        assert type(a) is type(b) and a.tobytes() == b.tobytes(), (a, b)
    assert back[np.int32(3)] == "numpy key" and type(next(k for k in back if k != "m" and k != "ld")) is np.int32


def test_small_numpy_arrays_are_plain_data() -> None:
    """Numeric numpy arrays up to 64 KiB (a metric history, np.random.get_state()'s key) are plain
    data: loaded under weights_only=True, equal, writable; larger ones and other dtypes are pickled."""
    state = {"hist": np.arange(6, dtype=np.float32).reshape(2, 3), "empty": np.zeros((0, 4)), "zero_d": np.array(7),
             "strided": np.arange(10)[::-3], "fortran": np.asfortranarray(np.eye(3)), "rng": np.random.get_state(),
             "big": np.zeros(1 << 14), "text": np.array(["a"])}
    flat = flatten(state)
    assert sorted(o.key for o in flat.objects) == ["big", "text"]  # 128 KiB, and a str dtype
    back = unflatten(json.loads(json.dumps(flat.skeleton)), [], [o.obj for o in flat.objects])
    for k in ("hist", "empty", "zero_d", "strided", "fortran"):
        assert back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k]) and back[k].flags.writeable, k
    assert back["rng"][0] == "MT19937" and np.array_equal(back["rng"][1], state["rng"][1])


def test_user_safe_globals_survive_and_corrupt_blob_is_reported() -> None:
    blob = serialize_object(Point(1))
    name = f"{__name__}.Point"
    with torch.serialization.safe_globals([Point]):
        deserialize_object(blob, key="k", type_name=name, weights_only=True, allowed_globals=[name])
        assert Point in torch.serialization.get_safe_globals()
    with pytest.raises(CorruptCheckpointError, match="'k'"):
        deserialize_object(b"not a zip", key="k", type_name=name, weights_only=True)
    with pytest.raises(CorruptCheckpointError):
        deserialize_object(blob[: len(blob) // 2], key="k", type_name=name, weights_only=False)


# ----------------------------------------------------------------------------- hostile skeletons

HOSTILE = [
    # unknown or malformed tags, refs out of range or of the wrong type
    {"$x": 1}, {"a": 1}, {}, {"$meta": 1}, {"$t": 0, "$o": 0}, {"$od": [], "$meta": 1, "x": 2},
    {"$t": 5}, {"$t": -1}, {"$t": True}, {"$t": 1.0}, {"$t": "0"}, {"$o": 0}, [1, [2, {"$t": 0.5}]],
    {"$p": [0]}, {"$p": [0, 1]}, {"$p": [9, True]}, {"$t": [0]}, {"$t": [0, 1]}, {"$t": [9, True]},
    {"$t": [0, True, 1]}, {"$t": [True, True]},
    # dicts: odd lists, unhashable / non-plain / duplicate keys
    {"$d": [1]}, {"$d": "ab"}, {"$d": [[1], 2]}, {"$d": [{"$t": 0}, 1]}, {"$d": [{"$d": []}, 1]},
    {"$d": ["a", 1, "a", 2]}, {"$d": [1, 1, True, 2]}, {"$d": [{"$size": "x"}, 1]}, {"$od": {"a": 1}},
    {"$tuple": 3}, {"$tuple": {"a": 1}},
    # scalar tags
    {"$dtype": "float33"}, {"$dtype": "Tensor"}, {"$dtype": "float"}, {"$dtype": 1},
    {"$device": "nodevice:0"}, {"$device": 5}, {"$device": "cpu" * 30},
    {"$f": "1.5"}, {"$f": "nan:7ff0000000000000"}, {"$f": None},
    {"$i": "12"}, {"$i": "0x1_0"}, {"$i": " 0x10"}, {"$d": [{"$i": "0x" + "f" * 5000}, {"$t": 7}]},
    {"$b": "!!"}, {"$c": [1]}, {"$c": ["1", 2]}, {"$size": [1.5]}, {"$size": [True]}, {"$size": [2**70]},
    {"$np": "float64"}, {"$np": ["float64", "00"]}, {"$np": ["float64", "zz" * 8]}, {"$np": ["float64", 5]},
    {"$np": ["object", "00" * 8]}, {"$np": ["longdouble", "00" * 16]}, {"$np": [["int8"], "00"]},
    {"$np": ["int8", "00", 1]}, {"$np": ["U1", "00" * 4]},
    {"$nd": ["int8", [4], "AAA="]}, {"$nd": ["int8", [3], "AAA="]}, {"$nd": ["object", [1], "AA=="]},
    {"$nd": ["int8", [-1], ""]}, {"$nd": ["int8", [1.0], "AA=="]}, {"$nd": ["int8", 1, "AA=="]},
    {"$nd": ["int8", [2**40, 2**40], ""]}, {"$nd": ["int8", [65536] * 33, ""]}, {"$nd": ["int8", [1], "!!"]},
    {"$nd": ["float64", [1 << 17], "A" * (4 * (1 << 17))]}, {"$nd": ["int8", [1]]},
    {"$np": ["int8", "  "]}, {"$d": [{"$nd": ["int8", [1], "AA=="]}, 1]},
    # Python objects that JSON never yields
    {1: 2}, b"bytes", {1, 2}, (1, 2), float, pickle,
]


@pytest.mark.parametrize("skeleton", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_skeleton_is_refused(skeleton: Any) -> None:
    with pytest.raises(FormatError):
        validate_skeleton(skeleton, 1, 0)
    with pytest.raises(FormatError):
        unflatten(skeleton, [torch.zeros(1)], [])


TAGS = ["$d", "$od", "$meta", "$tuple", "$t", "$p", "$o", "$f", "$i", "$b", "$c", "$dtype", "$size",
        "$device", "$np", "$nd"]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=3),
              st.sampled_from(["nan", "-inf", "0x10", "float32", "cpu", "AA==", "nan:fff8000000000000"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(TAGS) | st.text(max_size=2), inner, max_size=2)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_loads_or_raises_format_error_only(skeleton: Any) -> None:
    try:
        validate_skeleton(skeleton, 2, 1)
    except FormatError:
        with pytest.raises(FormatError):
            unflatten(skeleton, [torch.zeros(1), torch.ones(1)], [Point(1)])
        return
    unflatten(skeleton, [torch.zeros(1), torch.ones(1)], [Point(1)])


def test_errors_name_the_key_path() -> None:
    skeleton = {"$d": ["model", {"$od": ["layer.weight", {"$t": 9}]}]}
    with pytest.raises(FormatError, match=r"model\.layer\.weight: tensor ref 9 out of range"):
        validate_skeleton(skeleton, 2, 0)
    with pytest.raises(FormatError, match=r"opt\.0\.lr: bad \$dtype value \'evil\'"):
        unflatten({"$d": ["opt", [{"$d": ["lr", {"$dtype": "evil"}]}]]}, [], [])


def test_parameter_flag_on_integer_tensor_is_refused() -> None:
    with pytest.raises(FormatError, match="Parameter"):
        unflatten({"$p": [0, True]}, [torch.zeros(2, dtype=torch.int64)], [])


def _nest(depth: int, wrap: Any) -> Any:
    gc.disable()  # the cyclic GC would rescan the growing chain over and over
    try:
        node: Any = 0
        for _ in range(depth):
            node = wrap(node)
        return node
    finally:
        gc.enable()


@pytest.mark.parametrize("wrap", [lambda n: [n], lambda n: {"$d": ["k", n]}, lambda n: {"$tuple": [n]},
                                  lambda n: {"$od": [], "$meta": n}])
def test_deep_hostile_nesting_is_refused_without_recursion_error(wrap: Any) -> None:
    with pytest.raises(FormatError, match="max_depth"):
        validate_skeleton(_nest(100_000, wrap), 0, 0)
    deep_key = {"$d": [_nest(100_000, lambda n: {"$tuple": [n]}), 1]}
    with pytest.raises(FormatError, match="max_depth"):
        unflatten(deep_key, [], [])


def test_depth_limit_is_the_same_for_save_and_load() -> None:
    for limit in (8, 512):
        ok, too_deep = _nest(limit, lambda n: [n]), _nest(limit + 1, lambda n: [n])
        skeleton = flatten(ok, max_depth=limit).skeleton
        validate_skeleton(json.loads(json.dumps(skeleton)), 0, 0, max_depth=limit)
        with pytest.raises(FormatError, match="max_depth"):
            flatten(too_deep, max_depth=limit)
        with pytest.raises(FormatError, match="max_depth"):
            validate_skeleton(too_deep, 0, 0, max_depth=limit)
    with pytest.raises(FormatError, match="max_depth"):
        flatten(_nest(100_000, lambda n: {"k": (n,)}))


@settings(max_examples=60, deadline=None)
@given(trees, st.integers(4, 12))
def test_flatten_output_always_validates_at_the_same_depth(state: Any, limit: int) -> None:
    try:
        flat = flatten(state, max_depth=limit)
    except FormatError:
        return
    validate_skeleton(flat.skeleton, len(flat.tensors), len(flat.objects), max_depth=limit)


def _deep(items: int, depth: int, leaf: Any = 0) -> dict:
    """A skeleton of ``depth`` dicts, each with one 80-character key, over a list of ``items``."""
    skel: Any = [leaf] * items
    for _ in range(depth):
        skel = {"$d": ["k" * 80, skel]}
    return skel


def test_a_deep_skeleton_with_many_items_decodes_in_memory_its_size_bounds() -> None:
    """Each pending item of the decoder held its whole dotted key path as text: 100,000 list items
    under 240 dicts with 80-character keys (a 218 KB manifest) took 2 GB to load. Paths are now made
    into text only for an error, which still names where (its last 200 characters)."""
    import tracemalloc

    skel = _deep(5000, 200)
    tracemalloc.start()
    try:
        validate_skeleton(skel, 0, 0)
        state = unflatten(skel, [], [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 2**20:.0f} MiB"  # the paths as text: 81 MB
    for _ in range(200):
        state = state["k" * 80]
    assert state == [0] * 5000
    with pytest.raises(FormatError, match=r"^skeleton at \.\.\.[k.]+\.0: tensor ref 7 out of range") as info:
        validate_skeleton(_deep(5000, 200, {"$t": 7}), 1, 0)
    assert len(str(info.value)) < 300
    with pytest.raises(FormatError, match=r"^skeleton at <root>: "):
        validate_skeleton({"$t": 7}, 1, 0)
    with pytest.raises(FormatError, match=r"^skeleton at a\.0\.b: "):
        validate_skeleton({"$d": ["a", [{"$d": ["b", {"$t": 7}]}]]}, 1, 0)


def test_flattening_a_deep_state_makes_text_keys_only_for_its_leaves() -> None:
    """The encoder (every save) held each pending item's dotted path as text too: 78 MB for a list of
    5,000 ints under 200 dicts with 80-character keys. A tensor's key is still its whole path."""
    import tracemalloc

    state: Any = {"w": torch.ones(2), 3: {"x": torch.zeros(1)}, "ids": list(range(5000))}
    for _ in range(200):
        state = {"k" * 80: state}
    tracemalloc.start()
    try:
        flat = flatten(state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"peak {peak / 2**20:.0f} MiB"
    prefix = ".".join(["k" * 80] * 200)
    assert [t.key for t in flat.tensors] == [f"{prefix}.w", f"{prefix}.3.x"]
