"""Storage options: the one merge (``ckpt_core.storage.options``), its users, and per-call options
reaching the writer process (issue 22: its store cache was keyed by path only, so a second save with
other ``storage_options`` - rotated credentials, another endpoint - went where the first one went).

The writer-process cases use real filesystems: fsspec's ``dir://`` over the local disk (its
``path`` option decides where files land) and two moto S3 servers holding a bucket of the same
name (the URL is identical, only ``client_kwargs.endpoint_url`` tells them apart).
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from ckpt_core import CheckpointEngine, EngineConfig
from ckpt_core.config import StorageConfig
from ckpt_core.storage.options import merge_options, options_key
from ckpt_core.storage.store import Store

PROCESS = {"saving": {"background": "process"}}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(512, 16, generator=g), "w": torch.randn(64, 32, generator=g), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ------------------------------------------------------------------------------------ the merge
def test_merge_is_key_by_key_and_recursive_for_nested_mappings() -> None:
    base = {"key": "old", "anon": False, "client_kwargs": {"endpoint_url": "http://a", "region_name": "x"}}
    over = {"key": "new", "client_kwargs": {"region_name": "y"}, "config_kwargs": {"retries": 3}}
    merged = merge_options(base, over)
    assert merged == {"key": "new", "anon": False, "config_kwargs": {"retries": 3},
                      "client_kwargs": {"endpoint_url": "http://a", "region_name": "y"}}
    # neither side changed, and the result shares no nested dict with them
    assert base["client_kwargs"] == {"endpoint_url": "http://a", "region_name": "x"} and base["key"] == "old"
    merged["client_kwargs"]["endpoint_url"] = "http://changed"
    merged["config_kwargs"]["retries"] = 9
    assert base["client_kwargs"]["endpoint_url"] == "http://a" and over["config_kwargs"] == {"retries": 3}


def test_merge_lets_a_plain_value_replace_a_mapping_and_treats_none_as_empty() -> None:
    assert merge_options({"client_kwargs": {"a": 1}}, {"client_kwargs": None}) == {"client_kwargs": None}
    assert merge_options({"a": 1}, {"a": {"b": 2}}) == {"a": {"b": 2}}
    assert merge_options(None, {"a": 1}) == {"a": 1} and merge_options({"a": 1}, None) == {"a": 1}
    assert merge_options(None, None) == {}


def test_options_key_is_canonical() -> None:
    a = {"key": "k", "client_kwargs": {"endpoint_url": "http://a", "region_name": "x"}}
    b = {"client_kwargs": {"region_name": "x", "endpoint_url": "http://a"}, "key": "k"}
    assert options_key(a) == options_key(b)
    assert options_key(a) != options_key({**a, "client_kwargs": {"endpoint_url": "http://b", "region_name": "x"}})
    assert options_key(None) == options_key({})
    assert isinstance(options_key({"session": object()}), str)  # not JSON: counted by repr, no error


def test_store_merges_call_options_over_the_config_recursively(tmp_path) -> None:
    # dir:// over memory:// (over the local disk it is opened as the local disk itself, h142)
    config = StorageConfig(storage_options={"target_protocol": "memory",
                                            "target_options": {"auto_mkdir": True, "x": 1}})
    store = Store.for_directory("dir://run", {"path": f"/{tmp_path.name}", "target_options": {"x": 2}}, config)
    assert store.fs.storage_options == {"path": f"/{tmp_path.name}", "target_protocol": "memory",
                                        "target_options": {"auto_mkdir": True, "x": 2}}
    other = Store.for_directory("dir://run", {"path": f"/{tmp_path.name}/b"}, config)
    assert store.url("") == other.url("") and store.cache_key != other.cache_key
    config = StorageConfig(storage_options={"target_protocol": "file", "target_options": {"auto_mkdir": True, "x": 1}})
    local = Store.for_directory("dir://run", {"path": str(tmp_path), "target_options": {"x": 2}}, config)
    assert local.is_local and local.root == str(tmp_path / "run") and local.fs.storage_options == {"auto_mkdir": True,
                                                                                                   "x": 2}


def test_lightning_adapters_use_the_same_merge() -> None:
    pytest.importorskip("lightning")
    from lightning_ckpt.config import build_config
    from lightning_ckpt.dcp import _CheckrunDCP

    base = {"storage": {"storage_options": {"key": "k", "client_kwargs": {"endpoint_url": "http://a"}}}}
    call = {"client_kwargs": {"region_name": "eu"}}
    expected = {"key": "k", "client_kwargs": {"endpoint_url": "http://a", "region_name": "eu"}}
    assert build_config(base, storage_options=call).storage.storage_options == expected
    strategy = object.__new__(_CheckrunDCP)
    strategy.checkrun_storage_options = base["storage"]["storage_options"]
    assert strategy._options(call) == expected
    assert strategy._options() is base["storage"]["storage_options"]


# ------------------------------------------------------------------ writer process: dir:// on disk
def _dir_options(where) -> dict:
    return {"path": str(where), "target_protocol": "file", "target_options": {"auto_mkdir": True}}


@pytest.mark.parametrize("background", ["process", "thread"])
def test_second_save_with_other_options_reaches_the_new_location(tmp_path, background) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first, second = _state(1), _state(2)
    with CheckpointEngine({"saving": {"background": background}}) as engine:
        engine.save(first, "dir://run/0.ckpt", storage_options=_dir_options(a)).result()
        engine.save(second, "dir://run/1.ckpt", storage_options=_dir_options(b)).result()
        assert _same(engine.load("dir://run/1.ckpt", storage_options=_dir_options(b)), second)
    assert sorted(os.listdir(a / "run")) == [".checkrun", "0.ckpt"]
    assert sorted(os.listdir(b / "run")) == [".checkrun", "1.ckpt"]


def test_writer_process_store_cache_is_bounded_and_closes_what_it_drops(tmp_path) -> None:
    from ckpt_core.saving import process
    from ckpt_core.saving.streams import DirState

    stores: dict = {}
    dirs: dict = {}
    made = []

    def open_store(i: int) -> Store:
        store = Store.for_directory("dir://run", _dir_options(tmp_path / str(i)), StorageConfig(io_threads=2))
        dirs.setdefault(store.cache_key, DirState())
        store.map(lambda x: x, [1, 2])  # starts its pool: a dropped store must stop it
        made.append(store)
        return process.store_for(stores, dirs, store.cache_key, lambda: store)

    first = open_store(0)
    for i in range(1, process.MAX_STORES):
        open_store(i)
    assert process.store_for(stores, dirs, first.cache_key, lambda: None) is first  # used again: kept
    open_store(process.MAX_STORES)  # one too many: the least recently used (store 1) goes
    assert len(stores) == len(dirs) == process.MAX_STORES
    assert first.cache_key in stores and made[1].cache_key not in stores and made[1].cache_key not in dirs
    assert made[1]._pool is None and first._pool is not None
    for store in stores.values():
        store.close()


# ---------------------------------------------------------------------- writer process: two S3s
_SERVER_SCRIPT = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()  # until the test closes our stdin
server.stop()
"""


@pytest.fixture(scope="module")
def second_s3_server(s3_server: str):
    """Another moto S3 server (endpoint B) in a process of its own: moto servers in one process
    share their buckets, so only there can the first endpoint's options not reach B's objects."""
    pytest.importorskip("moto.server")
    proc = subprocess.Popen([sys.executable, "-c", _SERVER_SCRIPT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("http://"), f"moto server B did not start (exit {proc.poll()})"
        yield endpoint
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def _s3_options(endpoint: str) -> dict:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}


@pytest.mark.s3
def test_s3_writer_process_second_save_reaches_endpoint_b(s3_server, second_s3_server) -> None:
    import fsspec

    bucket = f"test-{uuid.uuid4().hex[:16]}"
    admins = {}
    for endpoint in (s3_server, second_s3_server):
        admins[endpoint] = fsspec.filesystem("s3", skip_instance_cache=True, **_s3_options(endpoint))
        admins[endpoint].mkdir(bucket)  # the same bucket name on both: identical URLs
    first, second = _state(4), _state(5)
    url = f"s3://{bucket}/run"
    with CheckpointEngine(EngineConfig.from_dict(PROCESS)) as engine:
        engine.save(first, f"{url}/0.ckpt", storage_options=_s3_options(s3_server)).result()
        engine.save(second, f"{url}/1.ckpt", storage_options=_s3_options(second_s3_server)).result()
        loaded = engine.load(f"{url}/1.ckpt", storage_options=_s3_options(second_s3_server))
    assert _same(loaded, second)
    for endpoint, name in ((s3_server, "0.ckpt"), (second_s3_server, "1.ckpt")):
        admins[endpoint].invalidate_cache()
        files = {p.rsplit("/", 1)[1] for p in admins[endpoint].ls(f"{bucket}/run", detail=False)}
        assert files == {".checkrun", name}, endpoint


@pytest.mark.s3
@pytest.mark.parametrize("retries", [None, {"max_attempts": 2}], ids=["default", "botocore-retries"])
def test_s3_saves_stay_incremental_when_botocore_rewrites_the_options(s3_root, s3_storage_options, retries) -> None:
    """botocore adds ``mode`` to the ``config_kwargs.retries`` dict it is given when s3fs connects, so
    the filesystem's ``storage_options`` change after the first request. The engine's memory of a
    directory (row streams, verified blobs) is keyed by the options as given: the second save of a
    table with 3 changed rows is a row delta, not a full save (it was full with any retries setting,
    checkrun's default included: the first connection changed the key)."""
    state = {"emb": torch.randn(4096, 16, generator=torch.Generator().manual_seed(6)), "step": 0}
    with CheckpointEngine({"saving": {"asynchronous": False}}) as engine:
        for i in range(3):
            opts = dict(s3_storage_options)  # fresh dicts on every call, as a config file gives them
            if retries is not None:
                opts["config_kwargs"] = {"retries": dict(retries)}
            state["emb"][i * 3:i * 3 + 3] += 1.0
            info = engine.save(state, f"{s3_root}/{i}.ckpt", storage_options=opts).result()
            assert info.chain_depth == min(i, 1), i
        assert _same(engine.load(f"{s3_root}/2.ckpt", storage_options=opts), state)


@pytest.mark.parametrize("cache", ["simplecache", "filecache", "blockcache", "cached", "dir::simplecache"])
def test_caching_filesystems_are_refused_by_name(tmp_path, cache) -> None:
    """Through simplecache:: a reader kept loading the last.ckpt it had read first, silently, while
    another engine replaced it; saves through the caches failed (found by an independent check)."""
    from ckpt_core.errors import ConfigError

    url = f"{cache}::file://{tmp_path}/run/last.ckpt"  # dir::simplecache::: a cache below another layer
    with CheckpointEngine() as engine:
        engine.save({"w": torch.ones(3)}, tmp_path / "run" / "last.ckpt").result()
        for call in (lambda: engine.load(url), lambda: engine.save({"w": torch.ones(3)}, url).result(),
                     lambda: engine.latest(url.rsplit("/", 1)[0])):
            with pytest.raises(ConfigError, match="caching filesystems .* are not supported"):
                call()
