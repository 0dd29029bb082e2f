"""The manifest's JSON form of its records is written out by hand (for speed): it must stay what
``dataclasses.asdict`` gives, field for field, as fields are added."""
from __future__ import annotations

import dataclasses
import json

from ckpt_core.format.manifest import (
    BlobRef, ChunkRef, DeltaRef, Manifest, ObjectRecord, TensorRecord, parse_manifest)


def _asdict_form(t: TensorRecord) -> dict:
    d = dataclasses.asdict(t)
    d["shape"] = list(t.shape)
    for c in list(d["base"]) + [c for delta in d["deltas"] for c in delta["chunks"]]:
        if c["part"] is None:  # written only for parts of a pack
            del c["part"]
    return json.loads(json.dumps(d))  # tuples -> lists, as in the file


def test_record_json_equals_asdict():
    blob = BlobRef("a" * 32, 10, "b" * 16)
    chunk = ChunkRef(0, 2, 3, blob)
    rec = TensorRecord("model.w", "float32", (2, 3), ({"name": "raw", "version": 1},), (chunk,),
                       deltas=(DeltaRef(1, blob, (ChunkRef(0, 1, 3, blob),)),), written=10,
                       quant={"method": "uniform", "bits": 4, "max_abs_error": 0.5, "rel_l2_error": 0.1},
                       device="cuda:0")
    plain = TensorRecord("opt.step", "float32", (), ({"name": "raw", "version": 1},), (ChunkRef(0, 1, 1, blob, (0, 4)),))
    obj = ObjectRecord("cfg", "builtins.object", blob)
    m = Manifest(created=1.5, skeleton={"$t": 0}, tensors=(rec, plain), objects=(obj,))
    body = json.loads(m.to_bytes())
    assert body["tensors"] == [_asdict_form(rec), _asdict_form(plain)]
    assert body["objects"] == [json.loads(json.dumps(dataclasses.asdict(obj)))]
    assert set(body["tensors"][0]) == {f.name for f in dataclasses.fields(TensorRecord)}
    again = parse_manifest(m.to_bytes(), "m", max_blob_bytes=1 << 30)
    assert again.tensors == m.tensors and again.objects == m.objects


def test_checksum_field_is_spliced_into_the_canonical_bytes():
    # to_bytes and parse_manifest splice "checksum" in and out of the canonical JSON instead of
    # serializing twice: the result must be what serializing the whole body gives.
    from ckpt_core.format.manifest import _body_checksum

    blob = BlobRef("c" * 32, 4, "d" * 16)
    rec = TensorRecord("w", "float32", (1,), ({"name": "raw", "version": 1},), (ChunkRef(0, 1, 1, blob),))
    m = Manifest(created=2.0, skeleton={"$t": 0}, tensors=(rec,), stats={"a": 1}, meta={"z": [1.5, None]})
    data = m.to_bytes()
    body = json.loads(data)
    assert body["checksum"] == _body_checksum(body)
    assert data == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    parse_manifest(data, "m", max_blob_bytes=1 << 30)


def test_records_with_one_pipeline_share_its_codecs_across_manifests():
    """Each record kept its own codec dicts: a quarter of a parsed manifest's memory, and a listing of
    a directory holds every manifest parsed (2,000 manifests: `checkrun ls` 1.74 GB, now 1.29 GB)."""
    blob = BlobRef("a" * 32, 10, "b" * 16)
    pipe = ({"name": "raw", "version": 1}, {"name": "zstd", "version": 1, "level": 3, "threads": 0})
    recs = tuple(TensorRecord(f"w{i}", "float32", (3,), pipe, (ChunkRef(0, 1, 3, blob),)) for i in range(3))
    other = TensorRecord("x", "float32", (3,), pipe[:1], (ChunkRef(0, 1, 3, blob),))
    data = Manifest(created=1.5, skeleton=None, tensors=recs + (other,)).to_bytes()
    first, second = (parse_manifest(data, "m", max_blob_bytes=1 << 30) for _ in range(2))
    codecs = {id(r.codecs) for m in (first, second) for r in m.tensors[:3]}
    assert len(codecs) == 1 and first.tensors[0].codecs == pipe
    assert first.tensors[3].codecs == pipe[:1] and first.tensors[3].codecs is not first.tensors[0].codecs
