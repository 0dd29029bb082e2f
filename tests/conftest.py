"""Shared fixtures: a real S3 endpoint (moto's HTTP server) and roots over every backend.

``any_root`` parametrizes a test over ``memory``, ``local`` and ``s3`` and gives
``(root_url, storage_options)``; the S3 server starts only when an ``s3`` case runs.
"""
from __future__ import annotations

import os
import uuid
from typing import Iterator, NamedTuple

import pytest

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Never read the developer's real AWS config or talk to a proxy for the loopback server.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


@pytest.fixture(autouse=True)
def _stamp_clock_left_as_found() -> Iterator[None]:
    """A test that loads a checkpoint stamped by a clock ahead (``fence.observe``) left this process's commit-stamp
    clock ahead: the next tests' checkpoints were stamped in the future, which changes how readers order them
    (test_vanishing's head-first case failed after test_fencing's resume on a host behind, in one worker). A stamp
    clock left ahead of the real one goes back to where the test found it."""
    import time

    from ckpt_core.saving import fence

    before = fence._Clock.last_ns
    yield
    with fence._Clock.lock:
        if fence._Clock.last_ns > time.time_ns() + 10**9:
            fence._Clock.last_ns = before


class Root(NamedTuple):
    """A checkpoint directory URL and the storage options that reach it."""

    url: str
    storage_options: dict

    @property
    def backend(self) -> str:
        """"memory", "local" or "s3"."""
        return self.url.split("://", 1)[0] if "://" in self.url else "local"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Start moto's S3 server on a free loopback port; yield its endpoint URL."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _FAKE_AWS_ENV.items():
            mp.setenv(key, value)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def _s3_admin(s3_server: str):
    """A private s3fs client for creating buckets (one per session: a client takes ~0.5 s)."""
    import fsspec

    # skip_instance_cache: the bucket listings it caches must not leak into the tests' client.
    return fsspec.filesystem("s3", skip_instance_cache=True, **_s3_options(s3_server))


@pytest.fixture
def s3_bucket(_s3_admin) -> str:
    """A fresh, empty bucket on the moto server (unique per test)."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    _s3_admin.mkdir(name)
    return name


def _s3_options(endpoint: str) -> dict:
    return {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}


@pytest.fixture
def s3_storage_options(s3_server: str, s3_bucket: str) -> dict:  # noqa: ARG001 (creates it)
    """fsspec storage options for the moto endpoint (the bucket of ``s3_bucket`` exists)."""
    return _s3_options(s3_server)


@pytest.fixture
def s3_root(s3_bucket: str) -> str:
    """``s3://<fresh bucket>/run``."""
    return f"s3://{s3_bucket}/run"


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A ``memory://`` directory unique to this test, removed afterwards (memory is global)."""
    import fsspec

    url = f"memory://test-{uuid.uuid4().hex}/run"
    yield url
    fs = fsspec.filesystem("memory")
    try:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)
    except FileNotFoundError:
        pass


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def any_root(request: pytest.FixtureRequest, tmp_path) -> Root:
    """``(url, storage_options)`` of an empty checkpoint directory on each backend."""
    backend = request.param
    if backend == "memory":
        return Root(request.getfixturevalue("memory_root"), {})
    if backend == "local":
        return Root(str(tmp_path / "run"), {})
    return Root(request.getfixturevalue("s3_root"),
                request.getfixturevalue("s3_storage_options"))


@pytest.fixture
def gate():
    """Hold every storage write of ``gatefile://`` paths (``ckpt_core.testing.faults``) until the
    returned event is set; always opened and reset at the end."""
    import threading

    from ckpt_core.testing.faults import FaultFS

    FaultFS.reset()
    FaultFS.gate = threading.Event()
    yield FaultFS.gate
    FaultFS.gate.set()
    FaultFS.reset()
