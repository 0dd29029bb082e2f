"""Storage URLs of kinds users point checkrun at besides local paths, s3:// and memory:// (found by h142):
a checkpoint directory served read-only over HTTP (published checkpoints), and fsspec's ``dir://``
(a path prefix over another filesystem). A real ``http.server`` on 127.0.0.1 serves the files."""
from __future__ import annotations

import functools
import http.server
import threading

import fsspec
import pytest
import torch

import ckpt_core
from ckpt_core.cli import main


@pytest.fixture
def served(tmp_path):
    """(directory, its http:// URL): a real HTTP server on 127.0.0.1 serving ``directory``."""
    root = tmp_path / "www"
    root.mkdir()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_directory_served_over_http_is_listed_and_its_latest_loads(served, capsys) -> None:
    """h142: every URL checkrun gave back for an http:// directory read ``http://http://...``: latest()
    answered one that load() could not open; ``checkrun ls`` took the directory for a file."""
    root, url = served
    with ckpt_core.CheckpointEngine() as engine:
        for step in (1, 2):
            engine.save({"step": step, "w": torch.full((8,), float(step))}, root / "run" / f"step={step}.ckpt")
        engine.wait()
        latest = engine.latest(f"{url}/run")
        assert latest.startswith(f"{url}/run/step") and "http://http" not in latest
        assert engine.latest(f"{url}/run", verify=False) == latest  # h147: index pages list no sizes
        assert engine.load(latest)["step"] == 2
        assert engine.verify(f"{url}/run/step=1.ckpt").path == f"{url}/run/step=1.ckpt"
        with pytest.raises(ckpt_core.CheckpointNotFoundError) as err:
            engine.load(f"{url}/run/step=9.ckpt")
        assert "http://http" not in str(err.value) and f"{url}/run/step=9.ckpt" in str(err.value)
    capsys.readouterr()
    assert main(["ls", f"{url}/run"]) == 0
    assert "2 checkpoint(s), 0 corrupt" in capsys.readouterr().out
    assert main(["verify", f"{url}/run"]) == 0
    assert "2 intact, 0 corrupt" in capsys.readouterr().out
    # h145: gc reported "deleted 0 ... kept 0 referenced"; an empty served folder was "a file"
    with ckpt_core.CheckpointEngine() as engine:
        with pytest.raises(ckpt_core.StorageError, match=r"http:// storage is read-only: nothing can be collected"):
            engine.gc(f"{url}/run")
    assert main(["gc", f"{url}/run"]) != 0
    assert "read-only" in capsys.readouterr().err
    assert main(["gc", "--dry-run", "--grace", "0", f"{url}/run"]) == 0
    assert "kept 2 referenced" in capsys.readouterr().out
    (root / "empty").mkdir()
    assert main(["ls", f"{url}/empty"]) == 0
    assert "no checkrun checkpoints" in capsys.readouterr().out


def test_dir_urls_over_the_local_disk_save_and_a_missing_one_is_a_first_run(tmp_path, monkeypatch) -> None:
    """h142: ``dir://run`` (fsspec's DirFileSystem over a local folder) failed every save (it got the
    object-store commit, which makes no folders), and latest() of a folder not made yet raised "the bucket
    'run' does not exist" instead of answering None (a first run)."""
    monkeypatch.setitem(fsspec.config.conf, "dir", {"path": str(tmp_path / "base"), "target_protocol": "file"})
    (tmp_path / "base").mkdir()
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest("dir://fresh-run") is None
        engine.save({"step": 1, "w": torch.arange(4.0)}, "dir://run/step=1.ckpt").result()
        engine.save({"step": 2, "w": torch.arange(4.0) + 1}, "dir://run/step=2.ckpt").result()
        latest = engine.latest("dir://run")
        assert engine.load(latest)["step"] == 2
    assert (tmp_path / "base" / "run" / "step=2.ckpt").is_file()
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.load(str(tmp_path / "base" / "run" / "step=1.ckpt"))["step"] == 1


@pytest.mark.s3
def test_a_mistyped_bucket_under_dir_urls_is_an_error_not_a_first_run(s3_storage_options, s3_bucket, capsys) -> None:
    """h145: ``dir://run`` over ``s3://<mistyped bucket>/team``: latest() answered None (a first run) and only the
    first save failed; with ``s3://`` URLs it says at once that the bucket does not exist."""
    def options(bucket: str) -> dict:
        return {"path": f"{bucket}/team", "target_protocol": "s3", "target_options": s3_storage_options}

    with ckpt_core.CheckpointEngine({"storage": {"storage_options": options(s3_bucket)}}) as engine:
        assert engine.latest("dir://run") is None  # the bucket is there: a first run
        engine.save({"w": torch.ones(3)}, "dir://run/step=1.ckpt").result()
        assert engine.latest("dir://run").endswith("step=1.ckpt")
    with ckpt_core.CheckpointEngine({"storage": {"storage_options": options(s3_bucket + "-typo")}}) as engine:
        with pytest.raises(ckpt_core.CheckpointNotFoundError, match=f"the bucket '{s3_bucket}-typo' does not exist"):
            engine.latest("dir://run")
    # the CLI said "no such directory", as for a missing prefix of a bucket that exists (h147)
    endpoint = s3_storage_options["client_kwargs"]["endpoint_url"]
    assert main(["ls", f"s3://{s3_bucket}-typo/run", "--endpoint-url", endpoint]) != 0
    assert f"the bucket '{s3_bucket}-typo' does not exist" in capsys.readouterr().err
    assert main(["ls", f"s3://{s3_bucket}/no-such-prefix", "--endpoint-url", endpoint]) != 0
    assert "no such directory" in capsys.readouterr().err

