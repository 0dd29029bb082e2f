"""ckpt_core.testing: the storage conformance suite on memory://, local disk, moto's S3 server and the
fault-injecting filesystem, and proof that it catches broken backends (real memory filesystems with
one deliberate defect each)."""
from __future__ import annotations

import subprocess
import sys
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ckpt_core.errors import CheckrunError
from ckpt_core.testing import CHECK_NAMES, ConformanceError, FaultFS, Permanent, run_check, run_conformance


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_store_conforms(any_root, check):
    run_check(check, any_root.url, any_root.storage_options)


def test_fault_filesystem_conforms_when_no_fault_is_set(tmp_path):
    FaultFS.reset()
    assert run_conformance(f"faultfile://{tmp_path}/f") == list(CHECK_NAMES)
    assert run_conformance(f"gatefile://{tmp_path}/g", only=["manifests"]) == ["manifests"]


class _ForgetfulFS(MemoryFileSystem):
    """Deletes nothing (a backend whose delete call is a no-op)."""

    protocol = ("forgetfulmem",)

    def rm_file(self, path):
        pass


class _StaleListingFS(MemoryFileSystem):
    """Lists a directory as it was the first time it was listed (a cache never invalidated)."""

    protocol = ("stalemem",)
    _seen: dict = {}

    def ls(self, path, detail=True, **kwargs):
        key = (self._strip_protocol(path), detail)
        if key not in self._seen:
            self._seen[key] = super().ls(path, detail=detail, **kwargs)
        return self._seen[key]


@pytest.fixture
def broken_backends():
    fsspec.register_implementation("forgetfulmem", _ForgetfulFS, clobber=True)
    fsspec.register_implementation("stalemem", _StaleListingFS, clobber=True)
    yield
    _StaleListingFS._seen.clear()


def test_a_backend_that_does_not_delete_fails_blobs(broken_backends):
    url = f"forgetfulmem://conf-{uuid.uuid4().hex}/run"
    with pytest.raises(ConformanceError, match=r"'blobs' failed on forgetfulmem://.*deleted blob still exists"):
        run_check("blobs", url)


def test_a_backend_with_stale_listings_fails_manifests(broken_backends):
    url = f"stalemem://conf-{uuid.uuid4().hex}/run"
    with pytest.raises(ConformanceError, match="'manifests' failed on stalemem://.*lists a deleted manifest"):
        run_check("manifests", url)


def test_a_failing_backend_error_propagates_and_conformance_error_is_a_checkrun_error(tmp_path):
    FaultFS.policy = Permanent(PermissionError("injected: read-only bucket"), ops=("open",), kind="manifest")
    try:
        with pytest.raises(CheckrunError, match="read-only bucket"):
            run_check("manifests", f"faultfile://{tmp_path}/ro")
    finally:
        FaultFS.reset()
    assert issubclass(ConformanceError, CheckrunError) and issubclass(ConformanceError, AssertionError)
    with pytest.raises(ConformanceError, match="no storage conformance check 'nope'"):
        run_check("nope", str(tmp_path))


def test_testing_package_imports_no_pytest():
    code = ("import sys, ckpt_core.testing, ckpt_core.testing.faults, ckpt_core.testing.conformance; "
            "print('pytest' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
