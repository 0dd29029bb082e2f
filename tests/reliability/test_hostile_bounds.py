"""Hostile manifests within bounded memory (issue 20, point 6): device strings, declared sizes,
JSON size and nesting, delta chains. Each is refused with a ``CheckrunError`` naming the file and the
limit, before anything is allocated; the memory cost of parsing is measured in a child process
(its own peak RSS (VmHWM) against its RSS right before the parse).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import zstandard

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.format import limits as manifest_limits
from ckpt_core.codecs import Pipeline
from ckpt_core.errors import CheckrunError, FormatError, ResourceLimitError
from ckpt_core.format.manifest import parse_manifest
from ckpt_core.codecs import index_pipeline

from .test_hostile import Env, config, env, forge, refused  # noqa: F401 - env is a fixture


def cfg(**load) -> EngineConfig:
    """test_hostile's config (it allows the Marker object of ``Env``'s state) with ``load`` settings."""
    data = config().to_dict()
    data["load"].update(load)
    return EngineConfig.from_dict(data)

# ------------------------------------------------------------------------------------ devices
# Not devices checkrun writes: no data (meta), out-of-tree backends, malformed names.
BAD_DEVICES = ["xla", "xla:0", "hpu", "lazy", "meta", "ipu", "privateuseone", "mtia", "cuda:-1", "cuda:0:1",
               "CPU", " cpu", "cpu\x00", "cuda:1000", "", 3, None]


@pytest.mark.parametrize("device", BAD_DEVICES, ids=repr)
def test_devices_checkrun_does_not_write_are_refused_when_parsing(env, device):
    body = env.body()
    body["tensors"][1]["device"] = device
    err = refused(env, forge(body), FormatError, match="field 'device'")
    assert "evil.ckpt" in str(err)


def _on(device: str) -> list[str]:
    """Marks for a saved device this machine has (then map_location=None does not mean the CPU)."""
    kind = device.split(":")[0]
    present = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(),
               "xpu": hasattr(torch, "xpu") and torch.xpu.is_available()}[kind]
    return [pytest.mark.skipif(present, reason=f"this machine has {kind}")]


@pytest.mark.parametrize("device", [pytest.param(d, marks=_on(d)) for d in ("cuda:3", "mps", "mps:0", "xpu:1")])
def test_a_device_this_machine_lacks_loads_on_the_cpu(env, device):
    """What the writer records for a GPU/MPS/XPU tensor loads on the CPU where that backend is absent,
    as a CUDA checkpoint always did on a CPU-only machine."""
    body = env.body()
    for rec in body["tensors"]:
        rec["device"] = device
    (env.root / "dev.ckpt").write_bytes(forge(body))
    with CheckpointEngine(cfg()) as engine:
        state = engine.load(env.root / "dev.ckpt")
        good = engine.load(env.root / "good.ckpt")
        assert engine.verify(env.root / "dev.ckpt").ok
    assert state["w"].device.type == "cpu" and torch.equal(state["w"], good["w"])


def test_saving_a_tensor_on_a_device_checkrun_cannot_restore_is_refused(tmp_path):
    with CheckpointEngine({"saving": {"sigterm_grace_seconds": None}}) as engine:
        with pytest.raises(FormatError, match="cannot save a tensor on meta"):
            engine.save({"w": torch.empty(4, device="meta")}, tmp_path / "m.ckpt")


# ----------------------------------------------------------------------------- declared bytes
def _zeros_manifest(env: Env, numel: int) -> bytes:
    """Tensor ``w`` declared as ``numel`` float32 zeros, stored as one small, valid zstd frame."""
    body = env.body()
    rec = body["tensors"][1]
    frame = zstandard.ZstdCompressor(level=3).compress(bytes(numel * 4))
    rec.update(shape=[numel], quant=None, codecs=[{"name": "raw", "version": 1},
                                                  {"name": "zstd", "version": 1, "level": 1, "threads": 0}])
    rec["base"] = [{"off": 0, "rows": 1, "cols": numel, "blob": env.put_blob(frame)}]
    return forge(body)


def test_declared_bytes_beyond_max_total_bytes_are_refused_before_allocating(env):
    (env.root / "big.ckpt").write_bytes(_zeros_manifest(env, 16 << 20))  # 64 MiB of float32
    with CheckpointEngine(cfg(max_total_bytes=32 << 20, max_blob_bytes=1 << 30)) as engine:
        with pytest.raises(ResourceLimitError, match="load.max_total_bytes") as info:
            engine.load(env.root / "big.ckpt")
        report = engine.verify(env.root / "big.ckpt")
        assert engine.verify(env.root / "big.ckpt", decode=False).ok  # intact: only too big for the limit
    assert "big.ckpt" in str(info.value) and str(32 << 20) in str(info.value)
    assert not report.ok and "load.max_total_bytes" in report.problems[0]
    with CheckpointEngine(cfg(max_blob_bytes=1 << 30)) as engine:  # default: physical memory
        assert torch.count_nonzero(engine.load(env.root / "big.ckpt")["w"]) == 0


def test_the_copy_kept_for_row_deltas_counts_against_max_total_bytes(env):
    """emb (2048x16 float32, 128 KiB) becomes a row stream on load: a second copy of it is needed."""
    with CheckpointEngine(cfg(max_total_bytes=200 << 10)) as engine:
        assert engine.verify(env.root / "good.ckpt").ok  # 128 + 16 KiB of tensors
        with pytest.raises(ResourceLimitError, match="load.max_total_bytes"):
            engine.load(env.root / "good.ckpt")


def test_an_allocation_that_fails_is_a_checkrun_error(env, monkeypatch):
    """The decoding buffers are sized by the manifest too: their failure is not a bare RuntimeError."""
    from ckpt_core.loading import reader

    real = reader.empty_host

    def failing(numel, dtype):
        if dtype == torch.uint8:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(numel, dtype)

    monkeypatch.setattr(reader, "empty_host", failing)
    with CheckpointEngine(cfg()) as engine:
        with pytest.raises(ResourceLimitError, match="cannot be allocated") as info:
            engine.load(env.root / "good.ckpt")
        report = engine.verify(env.root / "good.ckpt")
    assert "good.ckpt" in str(info.value)
    assert not report.ok and "cannot be allocated" in report.problems[0]


# ------------------------------------------------------------------------------------- deltas
def _deltas_manifest(env: Env, count: int) -> bytes:
    """``count`` deltas replacing every row of emb, all with the same (valid) blobs."""
    body = env.body()
    rec = body["tensors"][0]
    rows, cols = rec["shape"]
    idx, _ = index_pipeline().encode(torch.arange(rows, dtype=torch.int64).view(1, rows))
    vals, _ = Pipeline.from_list(rec["codecs"]).encode(torch.randn(rows, cols))
    delta = {"n": rows, "idx": env.put_blob(bytes(idx)),
             "chunks": [{"off": 0, "rows": rows, "cols": cols, "blob": env.put_blob(bytes(vals))}]}
    rec["deltas"] = [delta] * count
    return forge(body)


def test_a_long_delta_chain_is_refused_before_it_is_decoded(env):
    """5,000 deltas of a 2048-row tensor took +0.5 GB here (5.3 GB reported for a larger tensor)."""
    limit = manifest_limits.deltas_limit(EngineConfig().incremental.max_chain)
    err = refused(env, _deltas_manifest(env, 5000), FormatError, match=f"more than the limit of {limit}")
    assert "5000 deltas" in str(err) and "incremental.max_chain" in str(err)


def test_the_delta_limit_follows_max_chain(env):
    def deltas(count: int, config: EngineConfig) -> int:
        data = _deltas_manifest(env, count)
        return len(parse_manifest(data, "m.ckpt", limits=manifest_limits.limits_for(config)).tensors[0].deltas)

    assert deltas(64, EngineConfig()) == 64
    with pytest.raises(FormatError, match="65 deltas"):
        deltas(65, EngineConfig())
    assert deltas(80, EngineConfig.from_dict({"incremental": {"max_chain": 20}})) == 80


# ------------------------------------------------------------------------- JSON size, nesting
HEAD = b'{"_checkrun":"manifest","checksum":"0","format_version":2,"skeleton":['
# Each ~60 MB (under the store's 64 MiB cap): what stdlib json would build from them.
SHAPES = {
    "empty-lists": (b"[]", 20_000_000),        # 1.6 GB of RSS to parse before the fix
    "empty-objects": (b'{"a":{}}', 7_000_000),
    "short-strings": (b'"abcdefgh"', 5_000_000),
    "numbers": (b"1.5", 15_000_000),
    "nesting": None,                           # 2 MB of "[" then "]": deeper than any manifest
}

_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from ckpt_core import CheckpointEngine
    from ckpt_core.errors import CheckrunError
    path = sys.argv[1]
    with CheckpointEngine({"saving": {"sigterm_grace_seconds": None}}) as engine:
        engine.verify(path + ".small")  # warm up everything a load touches
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out = {}
        for op in ("load", "verify"):
            try:
                if op == "load":
                    engine.load(path)
                    out[op] = None
                else:
                    report = engine.verify(path)
                    out[op] = ["ok" if report.ok else "CheckrunError", report.problems[:1]]
            except CheckrunError as exc:
                out[op] = [type(exc).__name__, str(exc)]
    # VmHWM, not ru_maxrss: the latter survives exec, so it would include the forking pytest process
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
    peak = int(hwm.split()[1]) * 1024
    out["grew_mb"] = (peak - rss) / 2**20
    print(json.dumps(out))
""")


def _write_shape(path, shape: str) -> None:
    with open(path, "wb") as f:  # written piecewise: the test process itself stays small
        if SHAPES[shape] is None:
            f.write(b'{"_checkrun":"manifest","checksum":"0","format_version":2,"skeleton":')
            f.write(b"[" * (1 << 20) + b"]" * (1 << 20) + b"}")
            return
        unit, count = SHAPES[shape]
        f.write(HEAD)
        block = (unit + b",") * 100_000
        for _ in range(count // 100_000 - 1):
            f.write(block)
        f.write((unit + b",") * 99_999 + unit + b"]}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_huge_json_manifest_is_refused_in_bounded_memory(env, shape):
    path = env.root / "evil.ckpt"
    _write_shape(path, shape)
    (env.root / "evil.ckpt.small").write_bytes((env.root / "good.ckpt").read_bytes())
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kind, message = out["load"]
    assert kind == "FormatError", out
    assert "evil.ckpt" in message and "limit" in message, message
    assert out["verify"][0] == "CheckrunError" and "limit" in out["verify"][1][0], out
    assert out["grew_mb"] < 500, f"parsing grew the RSS by {out['grew_mb']:.0f} MB"


def test_the_element_limit_is_configurable(env):
    with CheckpointEngine(cfg(max_manifest_elements=40)) as engine:
        with pytest.raises(FormatError, match="load.max_manifest_elements") as info:
            engine.load(env.root / "good.ckpt")
    assert "good.ckpt" in str(info.value)


def test_a_large_legitimate_manifest_is_within_the_limits(tmp_path):
    """5,000 tensors: a 2 MB manifest, scanned (it is longer than the container limit) and accepted."""
    state = {"model": {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(5000)}, "step": 7}
    with CheckpointEngine({"saving": {"sigterm_grace_seconds": None}, "storage": {"fsync": False}}) as engine:
        engine.save(state, tmp_path / "big.ckpt").result()
        data = (tmp_path / "big.ckpt").read_bytes()
        assert len(data) > manifest_limits.ManifestLimits().max_containers
        back = engine.load(tmp_path / "big.ckpt")
    assert torch.equal(back["model"]["layer4999.weight"], state["model"]["layer4999.weight"])


# --------------------------------------------------------------------------- the pre-scan itself
def _reference_shape(data: bytes) -> tuple[int, int, int]:
    """(containers, elements, depth) by a plain byte-by-byte JSON scanner."""
    containers = elements = depth = deepest = 0
    in_string = escaped = False
    for ch in data:
        if in_string:
            if escaped:
                escaped = False
            elif ch == 0x5C:
                escaped = True
            elif ch == 0x22:
                in_string = False
        elif ch == 0x22:
            in_string = True
        elif ch in b"[{":
            containers, elements, depth = containers + 1, elements + 1, depth + 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
        elif ch in b",:":
            elements += 1
    return containers, elements, deepest


def _random_json(rnd: random.Random, depth: int = 0):
    text = lambda: "".join(rnd.choice('[]{},:"\\ab') for _ in range(rnd.randint(0, 8)))  # noqa: E731
    r = rnd.random()
    if depth > 6 or r < 0.3:
        return rnd.choice([text(), 1, 2.5, None, True])
    if r < 0.65:
        return [_random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    return {text(): _random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}


@pytest.mark.parametrize("window", [1, 2, 7, 1 << 20])
def test_the_pre_scan_counts_exactly_outside_strings(monkeypatch, window):
    """Strings full of brackets, quotes and backslashes, split across scan windows anywhere."""
    monkeypatch.setattr(manifest_limits, "_WINDOW", window)
    rnd = random.Random(window)
    for _ in range(300):
        data = json.dumps(_random_json(rnd), separators=(",", ":")).encode()
        assert manifest_limits.json_shape(data) == _reference_shape(data), data


@pytest.mark.parametrize("what", ["manifest", "lease"])
def test_deep_json_under_a_megabyte_is_refused_with_a_raised_recursion_limit(tmp_path, what):
    """A program that raised its recursion limit (deep models do) let ``json.loads`` recurse into a small
    but deeply nested manifest or lease until the C stack overflowed: the process crashed (SIGSEGV) at a
    load, or at the gc after a save (found by an independent check). Refused before parsing."""
    code = textwrap.dedent("""
        import os, sys, torch, ckpt_core
        sys.setrecursionlimit(100_000)
        d, what = sys.argv[1], sys.argv[2]
        deep = b"[" * 200_000 + b"]" * 200_000
        ckpt_core.save({"w": torch.ones(2)}, f"{d}/a.ckpt")
        if what == "manifest":
            open(f"{d}/b.ckpt", "wb").write(b'{"_checkrun":"manifest","x":' + deep + b"}")
            try:
                ckpt_core.load(f"{d}/b.ckpt")
            except ckpt_core.errors.FormatError as exc:
                print("refused:", exc)
        else:
            open(f"{d}/.checkrun/leases/ffffffffffffffff-1.json", "wb").write(deep)
            print("refused:", ckpt_core.CheckpointEngine().gc(d).problems)
    """)
    (tmp_path / ".checkrun" / "leases").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), what], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "nest" in done.stdout, done.stdout


@pytest.mark.parametrize("parts,world", [(["parts/a.ckpt"] * 3, 1), (["parts/a.ckpt"] * 3, 3),
                                         (["parts/a.ckpt", "parts/b.ckpt"], 10 ** 9)],
                         ids=["repeated", "repeated-world", "world-size-lie"])
def test_an_accelerate_index_must_list_one_part_per_rank(parts, world):
    """h128: an index listing its one part 20,000 times (1.1 MB, checksum recomputed) made ``checkrun
    inspect``/``verify`` read and hold every listed part: 87 s and 1.2 GB, more with more. An index lists
    as many different parts as its world size."""
    from ckpt_core.format import composite

    index = {composite.INDEX_KEY: composite.FORMAT, "name": "checkpoint_0", "parts": parts, "world_size": world}
    with pytest.raises(FormatError, match="one part per rank"):
        composite.check_index(index, "checkrun.ckpt")
    composite.check_index({**index, "parts": sorted(set(parts)), "world_size": len(set(parts))}, "checkrun.ckpt")


def _zstd_zeros(total: int) -> bytes:
    """A zstd frame declaring ``total`` bytes, made of RLE blocks of zeros: ~4 bytes per 128 KiB."""
    import struct

    frame = bytearray(struct.pack("<I", 0xFD2FB528)) + bytes([0xC0, 7 << 3]) + struct.pack("<Q", total)
    left = total
    while left:
        n = min(128 << 10, left)
        left -= n
        frame += ((1 if not left else 0) | 2 | n << 3).to_bytes(3, "little") + b"\0"
    return bytes(frame)


def test_a_pack_declared_larger_than_its_parts_is_refused_before_decoding(tmp_path):
    """h128: a 32-element tensor declared its chunk a part of a 4 GiB pack whose blob (128 KB) decodes to
    4 GiB: the load decoded it whole (4.3 GB peak) with ``load.max_total_bytes`` at 10 MB. A pack is
    exactly the tensors that are parts of it; one declared larger is refused, naming the file."""
    import os

    import xxhash

    with CheckpointEngine() as engine:
        engine.save({"w": torch.randn(32, 64), "b": torch.randn(32)}, tmp_path / "a.ckpt").result()
    body = json.loads((tmp_path / "a.ckpt").read_bytes())
    total, bomb = 256 << 20, _zstd_zeros(256 << 20)
    key = xxhash.xxh3_128_hexdigest(bomb)
    os.makedirs(tmp_path / ".checkrun" / "blobs" / key[:2], exist_ok=True)
    (tmp_path / ".checkrun" / "blobs" / key[:2] / key[2:]).write_bytes(bomb)
    w = next(t for t in body["tensors"] if t["key"] == "w")
    w["base"][0]["part"][1] = 32 * 64 * 4  # the pack it shared with "b": now w's alone
    t = next(t for t in body["tensors"] if t["key"] == "b")
    t["codecs"] = [{"name": "raw", "version": 1}, {"name": "zstd", "version": 1, "level": 1, "threads": 0}]
    t["base"] = [{"off": 0, "rows": 1, "cols": 32, "part": [0, total],
                  "blob": {"key": key, "size": len(bomb), "csum": xxhash.xxh3_64_hexdigest(bomb)}}]
    (tmp_path / "a.ckpt").write_bytes(forge(body))
    with CheckpointEngine({"load": {"max_total_bytes": 10_000_000}}) as engine:
        with pytest.raises(FormatError, match="declares 268435456 bytes, its parts cover 128") as exc:
            engine.load(tmp_path / "a.ckpt")
    assert "a.ckpt" in str(exc.value)
