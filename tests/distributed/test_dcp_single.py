"""ckpt_core.dcp in one process (DCP without a process group): format, safety, codecs, planning."""
from __future__ import annotations

import json
import os
import time
import warnings
from fractions import Fraction

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items

import ckpt_core
from ckpt_core import dcp as cdcp
from ckpt_core.dcp import CheckrunStorageReader, CheckrunStorageWriter
from ckpt_core.errors import (CorruptCheckpointError, FormatError, NotACheckpointError, StorageError,
                              UnsafeLoadError)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(33, 7, generator=g), "b16": torch.randn(5, 3, generator=g).bfloat16(),
                      "ids": torch.arange(10), "mask": torch.tensor([True, False, True]),
                      "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4),
                      "f64": torch.randn(4, dtype=torch.float64)},
            "step": 12, "meta": {"name": "x", "betas": (0.9, 0.99), "nan": float("nan")}}


def _same(a: dict, b: dict) -> None:
    for k, v in a["model"].items():
        assert b["model"][k].dtype == v.dtype and torch.equal(b["model"][k], v), k
    assert b["step"] == a["step"] and b["meta"]["betas"] == (0.9, 0.99) and b["meta"]["name"] == "x"


def test_round_trip_on_every_backend(any_root) -> None:
    url, opts = any_root
    path = f"{url}/step=12.dcp"
    state = _state()
    info = cdcp.save(state, path, storage_options=opts)
    assert info is not None and info.written_bytes > 0 and info.rank_written_bytes == [info.written_bytes]
    _same(state, cdcp.load_state_dict(path, storage_options=opts))
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0,
              "meta": {"name": None, "betas": None, "nan": None}}
    cdcp.load(target, path, storage_options=opts)
    _same(state, target)
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(url, storage_options=opts) == path
        assert engine.verify(path, storage_options=opts).ok
    again = cdcp.save(state, f"{url}/step=13.dcp", storage_options=opts)
    assert again.written_bytes == 0 and again.stored_bytes == info.stored_bytes  # all content reused


def test_manifest_is_checksummed_json_and_tampering_is_refused(tmp_path) -> None:
    path = str(tmp_path / "x.dcp")
    cdcp.save(_state(), path)
    raw = open(path, "rb").read()
    body = json.loads(raw)  # plain JSON, DCP's Metadata included: nothing is pickled
    assert body["meta"]["dcp"]["state"][0]["fqn"] == "model.w" and "checksum" in body
    tampered = raw.replace(b'"size":[33,7]', b'"size":[34,7]')
    assert tampered != raw
    open(path, "wb").write(tampered)
    with pytest.raises(FormatError, match="checksum"):
        cdcp.load_state_dict(path)
    with pytest.raises(FormatError, match="checksum"):
        CheckrunStorageReader(path).read_metadata()


def test_corrupt_blob_is_reported_with_its_path(tmp_path) -> None:
    path = str(tmp_path / "x.dcp")
    cdcp.save(_state(), path)
    manifest = ckpt_core.CheckpointEngine().read_manifest(path)
    key = next(t for t in manifest.tensors if t.key == "model.w").base[0].blob.key
    blob = tmp_path / ".checkrun" / "blobs" / key[:2] / key[2:]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=key[2:]):
        cdcp.load_state_dict(path)
    assert not ckpt_core.CheckpointEngine().verify(path).ok


def test_quantization_rules_and_compression_apply(tmp_path) -> None:
    path = str(tmp_path / "q.dcp")
    emb = torch.randn(512, 64)
    state = {"model": {"emb.weight": emb, "zeros": torch.zeros(256, 256)}}
    info = cdcp.save(state, path, config={"quantization": [{"pattern": "model.emb.*", "bits": 8}]})
    rec = {t.key: t for t in ckpt_core.CheckpointEngine().read_manifest(path).tensors}
    assert rec["model.emb.weight"].quant["bits"] == 8 and rec["model.zeros"].quant is None
    assert info.stored_bytes < 0.3 * info.tensor_bytes  # 8-bit table + zstd'd zeros
    loaded = cdcp.load_state_dict(path)["model"]
    assert (loaded["emb.weight"] - emb).abs().max() <= rec["model.emb.weight"].quant["max_abs_error"] + 1e-6
    assert torch.equal(loaded["zeros"], state["model"]["zeros"])


def test_engine_checkpoint_is_not_a_dcp_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "plain.ckpt")
    ckpt_core.save({"w": torch.ones(2)}, path)
    assert not cdcp.is_dcp_checkpoint(path) and not cdcp.is_dcp_checkpoint(str(tmp_path / "missing.dcp"))
    with pytest.raises(NotACheckpointError, match="ckpt_core.load"):
        cdcp.load_state_dict(path)


def test_values_load_with_restricted_unpickling(tmp_path) -> None:
    path = str(tmp_path / "v.dcp")
    cdcp.save({"w": torch.ones(3), "ratio": Fraction(1, 3)}, path)
    with pytest.raises(UnsafeLoadError, match="ratio"):
        cdcp.load_state_dict(path)
    assert cdcp.load_state_dict(path, weights_only=False)["ratio"] == Fraction(1, 3)
    assert cdcp.load_state_dict(path, config={"load": {"allowed_globals": ["fractions.Fraction"]}})["ratio"] \
        == Fraction(1, 3)


def test_plain_dcp_api_with_checkpoint_id(tmp_path) -> None:
    path = str(tmp_path / "run" / "a.dcp")
    state = {"w": torch.randn(4, 4), "n": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, storage_writer=CheckrunStorageWriter())
        target = {"w": torch.zeros(4, 4), "n": 0}
        dcp.load(target, checkpoint_id=path, storage_reader=CheckrunStorageReader())
    assert torch.equal(target["w"], state["w"]) and target["n"] == 3
    assert sorted(os.listdir(tmp_path / "run")) == [".checkrun", "a.dcp"]


def test_a_directory_as_the_checkpoint_path_fails_before_any_write(tmp_path) -> None:
    """DCP's own tests (and FileSystemWriter's users) pass a folder, e.g. one ``mkdtemp`` made (h101: the
    blobs went into its parent, then the commit failed with a bare IsADirectoryError)."""
    folder = tmp_path / "run" / "step_100"
    folder.mkdir(parents=True)
    state = {"w": torch.randn(4, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BaseException, match="is a directory: a checkrun DCP checkpoint is one file"):
            dcp.save(state, checkpoint_id=str(folder), storage_writer=CheckrunStorageWriter())
        assert sorted(os.listdir(tmp_path / "run")) == ["step_100"] and not os.listdir(folder)
        dcp.save(state, checkpoint_id=str(folder))  # DCP's own FileSystemWriter checkpoint: a folder
    with pytest.raises(NotACheckpointError, match="is a directory, not a checkrun DCP checkpoint.*FileSystemWriter"):
        cdcp.load_state_dict(str(folder))
    with pytest.raises(StorageError, match="is a directory: a checkpoint is one file"):
        ckpt_core.save({"w": torch.ones(2)}, str(folder))  # the engine: before any write too
    assert sorted(os.listdir(tmp_path / "run")) == ["step_100"]


def test_overwrite_false_refuses_an_existing_checkpoint_before_any_write(tmp_path) -> None:
    """``FileSystemWriter(overwrite=False)``'s counterpart (torch's own ``test_overwrite``, h101)."""
    path = str(tmp_path / "a.dcp")
    first, second = {"w": torch.ones(4)}, {"w": torch.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(first, checkpoint_id=path, storage_writer=CheckrunStorageWriter(overwrite=False))
        blobs = sorted(p.name for p in (tmp_path / ".checkrun" / "blobs").rglob("*"))
        with pytest.raises(BaseException, match="a file exists there .a checkpoint or another. and overwrite=False"):
            dcp.save(second, checkpoint_id=path, storage_writer=CheckrunStorageWriter(overwrite=False))
        assert sorted(p.name for p in (tmp_path / ".checkrun" / "blobs").rglob("*")) == blobs
        assert torch.equal(cdcp.load_state_dict(path)["w"], first["w"])
        dcp.save(second, checkpoint_id=path, storage_writer=CheckrunStorageWriter())  # the default replaces it
    assert torch.equal(cdcp.load_state_dict(path)["w"], second["w"])


def _plans(world: int, replicated: dict, unique: dict[int, dict]) -> list[SavePlan]:
    plans = []
    for rank in range(world):
        items = [i for fqn, t in replicated.items() for i in _create_write_items(fqn, t)]
        items += [i for fqn, t in unique.get(rank, {}).items() for i in _create_write_items(fqn, t)]
        plans.append(SavePlan(items))
    return plans


def test_spread_plans_cut_replicated_tensors_and_balance_ranks() -> None:
    replicated = {"big": torch.zeros(1000, 10), "mid": torch.zeros(100, 10), "one": torch.zeros(1)}
    plans = cdcp.spread_save_plans(_plans(3, replicated, {2: {"own": torch.zeros(50, 10)}}), min_piece_bytes=4000)
    items = [(rank, i) for rank, p in enumerate(plans) for i in p.items]
    assert len({i.index for _, i in items}) == len(items)  # every item exactly once
    big = sorted((i.tensor_data.chunk.offsets[0], i.tensor_data.chunk.sizes[0], r) for r, i in items
                 if i.index.fqn == "big")
    assert [(o, n) for o, n, _ in big] == [(0, 334), (334, 333), (667, 333)]  # rows tile the tensor
    assert {r for _, _, r in big} == {0, 1, 2} and all(i.type == WriteItemType.SHARD for r, i in items
                                                       if i.index.fqn == "big")
    assert [r for r, i in items if i.index.fqn == "own"] == [2]  # unique items stay where they are
    loads = [sum(i.tensor_data.chunk.sizes.numel() * 4 for i in p.items) for p in plans]
    assert max(loads) - min(loads) <= 4000 + 2000  # within one piece of each other


def test_reader_applies_load_max_total_bytes_and_save_info_speaks_savinfo_words(tmp_path) -> None:
    from ckpt_core.errors import ResourceLimitError

    path = str(tmp_path / "x.dcp")
    state = _state()
    info = cdcp.save(state, path)
    assert info.referenced_bytes == info.stored_bytes > 0 and info.compression_ratio > 0
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0,
              "meta": {"name": None, "betas": None, "nan": None}}
    with pytest.raises(ResourceLimitError, match=r"x\.dcp.*load\.max_total_bytes"):
        cdcp.load(target, path, config={"load": {"max_total_bytes": 64}})
    cdcp.load(target, path, config={"load": {"max_total_bytes": 1 << 20}})
    _same(state, target)


def test_dtypes_and_views_stock_dcp_saves(tmp_path) -> None:
    """float8_e8m0fnu (MX scales), complex32 and float4_e2m1fn_x2 failed the commit with a bare
    KeyError, conjugate and negative views the write (found by an independent check against stock
    DCP): they round-trip bit for bit now (the engine stores those dtypes as chunks too)."""
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 255, (16, 4), dtype=torch.uint8, generator=g)
    c = torch.randn(8, 3, dtype=torch.complex64, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "ComplexHalf support is experimental"
        state = {"e8m0": raw.view(torch.float8_e8m0fnu), "fp4": raw.view(torch.float4_e2m1fn_x2),
                 "c32": c.to(torch.complex32), "conj": c.conj(), "neg": torch._neg_view(c.real.contiguous())}
        cdcp.save(state, str(tmp_path / "x.dcp"), min_piece_bytes=64)  # spread: fingerprints views too
        back = cdcp.load_state_dict(str(tmp_path / "x.dcp"))
        for k, v in state.items():
            got, want = back[k], v.resolve_conj().resolve_neg()
            assert got.dtype == want.dtype and not got.is_conj() and not got.is_neg(), k
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.element_size() == 1 else \
                torch.equal(torch.view_as_real(got) if got.is_complex() else got,
                            torch.view_as_real(want) if want.is_complex() else want), k
        with ckpt_core.CheckpointEngine() as engine:
            assert engine.verify(str(tmp_path / "x.dcp")).ok


def _forge(path: str, edit) -> None:
    from ckpt_core.format.manifest import _body_checksum

    body = json.loads(open(path, "rb").read())
    edit(body)
    body = {k: v for k, v in body.items() if k != "checksum"}
    body["checksum"] = _body_checksum(body)
    open(path, "wb").write(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def test_load_raises_checkrun_errors_for_metadata_and_values_naming_the_files(tmp_path, caplog) -> None:
    """From an independent fuzzer: a missing or truncated manifest reached cdcp.load's caller as
    DCP's CheckpointException (an AssertionError holding the text only: not an Exception); a forged
    planner_data path a bare TypeError; a damaged value blob named neither checkpoint nor blob;
    DCP logged its fallback's tracebacks first;
    verify did not check the DCP metadata that loads read."""
    from ckpt_core.errors import CheckpointNotFoundError

    state = {"model": {"w": torch.randn(16, 4)}, "extra": {"step": 5}}
    target = {"model": {"w": torch.zeros(16, 4)}, "extra": {"step": 0}}
    with pytest.raises(CheckpointNotFoundError, match="nope.dcp"):
        cdcp.load(target, str(tmp_path / "nope.dcp"))
    path = str(tmp_path / "t.dcp")
    cdcp.save(state, path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:100])
    with pytest.raises(FormatError, match="t.dcp.*truncated"):
        cdcp.load(target, path)
    assert "metadata is not found" not in caplog.text  # DCP's fallback warnings: the error says it all

    path = str(tmp_path / "p.dcp")
    cdcp.save(state, path)
    _forge(path, lambda b: b["meta"]["dcp"]["planner_data"]["$d"].__setitem__(1, 2 ** 63))
    with pytest.raises(FormatError, match="p.dcp.*planner_data"):
        cdcp.load_state_dict(path)

    path = str(tmp_path / "c.dcp")
    cdcp.save(state, path)
    _forge(path, lambda b: b["meta"]["dcp"]["state"][0]["chunks"][0].append([16, 4]))
    with ckpt_core.CheckpointEngine() as engine:
        report = engine.verify(path)
    assert not report.ok and "DCP metadata" in report.problems[0]

    import xxhash

    path = str(tmp_path / "v.dcp")
    cdcp.save(state, path)
    blob = {}

    def damage(body: dict) -> None:
        ref = body["objects"][0]["blob"]
        junk = b"\x00" * 64
        blob["path"] = tmp_path / ".checkrun" / "blobs" / ref["key"][:2] / ref["key"][2:]
        blob["path"].write_bytes(junk)
        ref.update(size=len(junk), csum=xxhash.xxh3_64_hexdigest(junk))

    _forge(path, damage)
    with pytest.raises(CorruptCheckpointError) as info:
        cdcp.load_state_dict(path)
    assert "v.dcp" in str(info.value) and str(blob["path"]) in str(info.value)


@pytest.mark.parametrize("case", ["too_large", "holes", "overlap"])
def test_metadata_whose_chunks_do_not_tile_the_tensor_is_refused(tmp_path, case) -> None:
    """A DCP index is trusted for the tensor sizes load_state_dict allocates (found by a check of hostile
    inputs): a size of 2**40 x 2**40 raised a bare RuntimeError ("numel: integer multiplication
    overflow") and verify said intact; a size larger than the saved chunks (a 16 x 8 chunk in a
    4096 x 8 tensor) loaded, the uncovered rows holding uninitialised memory. The chunks must now cover
    the tensor exactly once, as for checkrun's own manifests."""
    path = str(tmp_path / "x.dcp")
    state = {"model": {"w": torch.randn(16, 8)}}
    cdcp.save(state, path)

    def edit(body: dict) -> None:
        entry = body["meta"]["dcp"]["state"][0]
        if case == "too_large":
            entry["size"] = [2 ** 40, 2 ** 40]
        elif case == "holes":
            entry["size"] = [4096, 8]
        else:  # two chunks of as many elements as the tensor, rows 4-7 in both, rows 12-15 in none
            entry["chunks"] = [[[0, 0], [8, 8]], [[4, 0], [8, 8]]]

    _forge(path, edit)
    with pytest.raises(FormatError, match=r"x\.dcp.*DCP metadata.*(too large|exactly once)"):
        cdcp.load_state_dict(path)
    with ckpt_core.CheckpointEngine() as engine:
        report = engine.verify(path)
    assert not report.ok and "DCP metadata" in report.problems[0]


def test_load_state_dict_checks_the_sizes_against_load_max_total_bytes_first(tmp_path) -> None:
    """load_state_dict allocated every tensor the index declares before anything checked
    load.max_total_bytes (found by a check of hostile inputs: 16 GiB declared, 1 MiB allowed); the
    reader checks each batch of values it decodes (up to 256 MB at once), after that. The sum of the
    tensors is now checked first (this small case also failed before, in the reader's check: a guard
    against a regression of the message)."""
    from ckpt_core.errors import ResourceLimitError

    path = str(tmp_path / "x.dcp")
    cdcp.save({"model": {"a": torch.randn(256, 512), "b": torch.randn(256, 512)}}, path)
    with pytest.raises(ResourceLimitError, match=r"x\.dcp.*1048576 bytes.*load\.max_total_bytes"):
        cdcp.load_state_dict(path, config={"load": {"max_total_bytes": 3 << 18}})
    assert cdcp.load_state_dict(path, config={"load": {"max_total_bytes": 1 << 21}})["model"]["b"].shape == (256, 512)


def test_a_commit_paused_past_its_lease_whose_blob_was_collected_is_not_reported_done(tmp_path, monkeypatch) -> None:
    """h127: the coordinator passed its lease check, then paused (SIGSTOP) past the lease before writing the
    manifest while another job's collection deleted its blobs; ``dcp.save`` returned as saved and the
    checkpoint did not load ("missing blob"). Stood in for here: the lease reads as lapsed after the
    check, and a blob is deleted then. Now the manifest is removed and the save raises, as the engine's."""
    from ckpt_core.saving import lease as lease_mod

    lapsed: dict = {}
    real_check, real_intact = CheckrunStorageWriter._check_leases, lease_mod.SaveLease.intact

    def check(self, store, manifest):
        real_check(self, store, manifest)
        if lapsed.get("on"):
            os.remove(store.blob_path(sorted(manifest.blob_keys())[0]))
            lapsed["intact"] = False

    monkeypatch.setattr(CheckrunStorageWriter, "_check_leases", check)
    monkeypatch.setattr(lease_mod.SaveLease, "intact", lambda self: lapsed.get("intact", True) and real_intact(self))
    state = _state()
    cdcp.save(state, tmp_path / "step1.dcp")
    lapsed["on"] = True
    with pytest.raises(BaseException, match="paused past its lease"):  # DCP raises CheckpointException
        cdcp.save({"other": torch.full((500,), 7.0)}, tmp_path / "step2.dcp")  # no blob shared with step1
    lapsed.clear()
    assert not (tmp_path / "step2.dcp").exists()
    _same(state, cdcp.load_state_dict(tmp_path / "step1.dcp"))


def test_a_save_committed_late_is_older_than_one_asked_for_after_it(tmp_path, monkeypatch) -> None:
    """h127: a DCP manifest was dated when its coordinator committed it: a job paused before its commit while
    a restarted one saved on committed the newest checkpoint, and ``latest()`` (and retention) took it over
    the restarted job's. A DCP checkpoint is dated (and stamped) when its save began, as the engine's."""
    real_finish, nested = CheckrunStorageWriter.finish, []

    def finish(self, metadata, results):
        if not nested:  # a.dcp's coordinator, paused before its commit while b.dcp is saved
            nested.append(1)
            cdcp.save({"step": 2, "w": torch.full((4,), 2.0)}, tmp_path / "b.dcp")
        real_finish(self, metadata, results)

    monkeypatch.setattr(CheckrunStorageWriter, "finish", finish)
    cdcp.save({"step": 1, "w": torch.full((4,), 1.0)}, tmp_path / "a.dcp")
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("b.dcp")


def test_a_rank_waiting_for_the_commit_longer_than_its_lease_keeps_its_blobs(tmp_path, monkeypatch) -> None:
    """h130: a rank renewed its lease only while it wrote; one that finished and waited in DCP's gather for a
    slower rank longer than ``retention.lease_seconds`` let it lapse, and a collection meanwhile (another
    job's, ``checkrun gc``) deleted its new blobs: the coordinator refused the commit (the save was lost).
    After writing, a rank holds its lease for ``WAIT_HOLD`` lease periods. Stood in for here: a collection
    whose clock reads 1.5 lease periods after the write runs just before the commit."""
    from types import SimpleNamespace

    from ckpt_core.retain import leases as leases_mod

    lease_seconds, real_finish = 20.0, CheckrunStorageWriter.finish
    later = SimpleNamespace(time=lambda: time.time() + 1.5 * lease_seconds, monotonic=time.monotonic)

    def finish(self, metadata, results):
        with monkeypatch.context() as m:
            m.setattr(leases_mod, "time", later)
            with ckpt_core.CheckpointEngine() as engine:
                engine.gc(tmp_path, grace_seconds=0)
        real_finish(self, metadata, results)

    monkeypatch.setattr(CheckrunStorageWriter, "finish", finish)
    state = _state()
    cdcp.save(state, tmp_path / "a.dcp", config={"retention": {"lease_seconds": lease_seconds}})
    _same(state, cdcp.load_state_dict(tmp_path / "a.dcp"))


def test_a_save_after_loading_a_checkpoint_stamped_ahead_is_newer_than_it(tmp_path, monkeypatch) -> None:
    """h134: a run whose clock ran 20 s ahead saved a.dcp; a run on a host with the right clock loaded it with
    ``ckpt_core.dcp`` and saved b.dcp, dated before a.dcp: ``latest()`` went back to a.dcp and ``keep_last``
    deleted b.dcp. Loading a DCP checkpoint now moves this process's stamps past it (``fence.observe``), as
    ``CheckpointEngine.load`` does."""
    import itertools

    from ckpt_core.saving import fence

    monkeypatch.setattr(fence._Clock, "last_ns", time.time_ns() + 20 * 10 ** 9)  # the first run's clock
    cdcp.save({"w": torch.ones(3)}, tmp_path / "a.dcp")
    monkeypatch.setattr(fence._Clock, "writer", "b" * 16)  # the resumed run: another process, the right clock
    monkeypatch.setattr(fence._Clock, "seq", itertools.count(1))
    monkeypatch.setattr(fence._Clock, "last_ns", 0)
    assert torch.equal(cdcp.load_state_dict(tmp_path / "a.dcp")["w"], torch.ones(3))
    cdcp.save({"w": torch.full((3,), 2.0)}, tmp_path / "b.dcp")
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("b.dcp")


def test_a_late_save_does_not_replace_a_newer_checkpoint_of_the_same_name(tmp_path, monkeypatch) -> None:
    """h134: a trainer paused inside its save to last.dcp while a restarted one saved newer states to that
    name; resumed, the late save replaced the newest checkpoint (the DCP commit had no fence). Now it is
    refused (``SupersededError`` inside DCP's exception) and last.dcp keeps the newer state, as the engine's."""
    real_finish, nested = CheckrunStorageWriter.finish, []

    def finish(self, metadata, results):
        if not nested:  # the late save's coordinator, paused before its commit while a newer one is saved
            nested.append(1)
            cdcp.save({"step": 2, "w": torch.full((4,), 2.0)}, tmp_path / "last.dcp")
        real_finish(self, metadata, results)

    monkeypatch.setattr(CheckrunStorageWriter, "finish", finish)
    with pytest.raises(BaseException, match="newer checkpoint of that name"):
        cdcp.save({"step": 1, "w": torch.full((4,), 1.0)}, tmp_path / "last.dcp")
    assert cdcp.load_state_dict(tmp_path / "last.dcp")["step"] == 2


def test_an_async_save_is_older_than_a_save_made_right_after_it(tmp_path, monkeypatch) -> None:
    """h138: a DCP checkpoint of ``async_save`` was stamped when DCP's thread (or process) began the save, not
    when ``async_save`` was called: a save made right after it sorted older, keep_last deleted it and latest()
    answered the older state. Stamped in ``stage`` now (the training thread). Stood in for: the async save's
    thread starts only after the second save is done (DCP's own ``dcp.save``: ``cdcp.save`` waits for the
    async_save first)."""
    import threading

    gate, real = threading.Event(), CheckrunStorageWriter.set_up_storage_writer

    def set_up(self, *args, **kwargs):
        if self.path.endswith("a.dcp"):
            assert gate.wait(120)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CheckrunStorageWriter, "set_up_storage_writer", set_up)
    future = cdcp.async_save({"step": 1, "w": torch.full((4,), 1.0)}, tmp_path / "a.dcp")
    dcp.save({"step": 2, "w": torch.full((4,), 2.0)}, storage_writer=CheckrunStorageWriter(tmp_path / "b.dcp"))
    gate.set()
    future.result()
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("b.dcp")


@pytest.mark.parametrize("how", ["helper", "dcp", "stager"])
def test_an_async_save_not_waited_for_is_committed_when_the_script_ends(tmp_path, how) -> None:
    """h145: a script ending right after ``async_save`` (its future never waited for) lost the checkpoint, with
    no message: at interpreter exit the save's thread pools could not start ("cannot schedule new futures after
    interpreter shutdown", in a future nobody looked at). DCP's own FileSystemWriter wrote it."""
    import subprocess
    import sys
    import textwrap

    call = {"helper": "cdcp.async_save(state, path)",
            "dcp": "dcp.async_save(state, storage_writer=CheckrunStorageWriter(path))",
            "stager": "dcp.async_save(state, storage_writer=CheckrunStorageWriter(path), "  # h147: stage() not called
                      "async_stager=DefaultStager(StagingOptions(False, False, False, False)))"}[how]
    script = textwrap.dedent(f"""
        import warnings, torch
        import torch.distributed.checkpoint as dcp
        from ckpt_core import dcp as cdcp
        from ckpt_core.dcp import CheckrunStorageWriter
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        warnings.simplefilter("ignore")
        state, path = {{"w": torch.arange(10.0), "step": 7}}, {str(tmp_path / "a.dcp")!r}
        {call}
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = cdcp.load_state_dict(tmp_path / "a.dcp")
    assert torch.equal(loaded["w"], torch.arange(10.0)) and loaded["step"] == 7


def test_waiting_for_an_earlier_async_save_lets_an_interrupt_through(tmp_path) -> None:
    """h145: ``save`` waiting for an earlier ``async_save`` swallowed a KeyboardInterrupt (Ctrl-C, or a signal
    handler's exception) and went on while the earlier save ran. Its failure is still left to its future."""
    import threading
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException

    class Interrupted(Future):
        def result(self, timeout=None):
            raise KeyboardInterrupt

    failed = Future()
    failed.set_exception(CheckpointException("write", {0: (RuntimeError("disk full"), None)}))
    done = threading.Event()
    done.set()
    cdcp._PENDING[failed] = done
    try:
        cdcp.save({"w": torch.ones(2)}, tmp_path / "a.dcp")  # the earlier failure is its future's to report
        cdcp._PENDING[Interrupted()] = threading.Event()
        with pytest.raises(KeyboardInterrupt):
            cdcp.save({"w": torch.ones(2)}, tmp_path / "b.dcp")
    finally:
        cdcp._PENDING.clear()
    assert (tmp_path / "a.dcp").exists() and not (tmp_path / "b.dcp").exists()


def test_a_failed_async_staging_leaves_no_stamp_for_the_next_save_of_its_writer(tmp_path) -> None:
    """h139: ``stage`` took the async save's stamp before staging, and a staging that raised left it on the
    writer: its next (sync) save was dated at the failed call, older than saves made in between."""
    writer = CheckrunStorageWriter(tmp_path / "a.dcp")
    with pytest.raises(BaseException):
        cdcp.async_save({"w": torch.empty(4, device="meta")}, tmp_path / "a.dcp", writer=writer).result()
    cdcp.save({"step": 2, "w": torch.ones(4)}, tmp_path / "b.dcp")
    cdcp.save({"step": 3, "w": torch.ones(4)}, tmp_path / "c.dcp", writer=writer)
    with ckpt_core.CheckpointEngine() as engine:
        assert engine.latest(tmp_path).endswith("c.dcp")
