"""Delta wire format: round trips, chunking, assembly, hostile input, id maps."""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest

from odl.protos import delta_pb2
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_format import DeltaFormatError, VersionHeader
from publisher.id_maps import read_id_maps, write_id_maps
from publisher.version_assembler import VersionAssembler


def _header(version: int = 7, generation: str = "gen1") -> VersionHeader:
    return VersionHeader(
        model_name="m", version=version, generation=generation, kind="both",
        min_event_time_ms=1, max_event_time_ms=2, min_produce_time_ms=3, max_produce_time_ms=4,
        positions=[("topic", 0, 10), ("topic", 1, 12)], publish_time_ms=99)


def _data(seed: int = 0, rows: int = 500, dim: int = 8):
    rng = np.random.default_rng(seed)
    dense = {0: rng.standard_normal((17, 5)).astype(np.float32),
             3: rng.standard_normal(4).astype(np.float32),
             5: np.float32(1.5) * np.ones((), np.float32)}
    sparse = {
        0: (np.sort(rng.choice(100_000, rows, replace=False)).astype(np.int64),
            rng.standard_normal((rows, dim)).astype(np.float32)),
        2: (np.array([3, 1, 9], np.int64), rng.standard_normal((3, 1)).astype(np.float32)),
    }
    return dense, sparse


def _assemble(chunks: list[bytes]):
    asm = VersionAssembler()
    out = [asm.add(decode_chunk(c)) for c in chunks]
    assert all(v is None for v in out[:-1])
    assert out[-1] is not None
    return out[-1]


def _check_equal(version, dense, sparse, atol=0.0):
    assert set(version.dense) == set(dense)
    for k, v in dense.items():
        assert version.dense[k].shape == np.shape(v)
        np.testing.assert_allclose(version.dense[k], v, rtol=0, atol=atol)
    assert set(version.sparse) == set(sparse)
    for k, (ids, vals) in sparse.items():
        got_ids, got_vals = version.sparse[k]
        np.testing.assert_array_equal(got_ids, ids)
        assert got_vals.dtype == np.float32
        np.testing.assert_allclose(got_vals, vals, rtol=0, atol=atol)


def test_round_trip_fp32_exact_and_header():
    dense, sparse = _data()
    chunks = encode_version(_header(), dense, sparse)
    assert len(chunks) == 1
    v = _assemble(chunks)
    _check_equal(v, dense, sparse)
    assert (v.version, v.generation, v.model_name, v.kind) == (7, "gen1", "m", "both")
    assert v.positions == [("topic", 0, 10), ("topic", 1, 12)]
    assert (v.min_event_time_ms, v.max_event_time_ms) == (1, 2)
    assert (v.min_produce_time_ms, v.max_produce_time_ms, v.publish_time_ms) == (3, 4, 99)
    assert v.num_rows == 503


def test_round_trip_fp16_within_tolerance_and_half_size():
    dense, sparse = _data(rows=5000)
    c32 = encode_version(_header(), {}, sparse)
    c16 = encode_version(_header(), {}, sparse, value_type="fp16")
    v = _assemble(c16)
    assert v.value_type == "fp16"
    _check_equal(v, {}, sparse, atol=5e-3)
    values32 = sum(vals.size * 4 for _, vals in sparse.values())
    saved = sum(map(len, c32)) - sum(map(len, c16))
    assert saved == pytest.approx(values32 / 2, rel=0.01)


def test_size_close_to_floor():
    _, sparse = _data(rows=20000, dim=16)
    sparse = {0: sparse[0]}
    chunks = encode_version(_header(), {}, sparse)
    floor = 20000 * (8 + 4 * 16)
    total = sum(map(len, chunks))
    print(f"fp32: {total} bytes for 20000 rows x dim 16, floor {floor}, ratio {total / floor:.4f}")
    assert total <= 1.1 * floor


def test_chunking_all_or_nothing_and_any_corruption_rejected():
    dense, sparse = _data(rows=3000)
    dense[9] = np.arange(5000, dtype=np.float32).reshape(50, 100)  # 20 KB: split across chunks
    chunks = encode_version(_header(), dense, sparse, max_chunk_bytes=4096)
    assert len(chunks) > 10
    assert all(len(c) <= 4096 for c in chunks)
    # Out of order and with duplicates: completes exactly on the last missing chunk.
    asm = VersionAssembler()
    order = list(range(len(chunks)))[::-1]
    results = []
    for i in order[:-1]:
        results.append(asm.add(decode_chunk(chunks[i])))
        results.append(asm.add(decode_chunk(chunks[i])))  # duplicate: ignored
    assert all(r is None for r in results)
    assert asm.pending_versions == 1
    v = asm.add(decode_chunk(chunks[order[-1]]))
    assert v is not None and v.chunk_count == len(chunks)
    _check_equal(v, dense, sparse)
    assert asm.pending_versions == 0
    # Every chunk: truncation and a flipped byte anywhere are rejected.
    rng = np.random.default_rng(1)
    for c in chunks:
        for cut in [*range(1, 40), len(c) // 2, len(c) - 1]:
            with pytest.raises(DeltaFormatError):
                decode_chunk(c[: len(c) - cut])
        payload = delta_pb2.DeltaChunk.FromString(c).payload
        start = c.index(payload)
        pos = start + int(rng.integers(0, len(payload)))
        bad = bytearray(c)
        bad[pos] ^= 0xFF
        with pytest.raises(DeltaFormatError):
            decode_chunk(bytes(bad))


@pytest.mark.parametrize("mark", [dict(full_republish=True),
                                  dict(last_full_version=5, last_full_offset=(1 << 63) - 1),
                                  dict(full_republish=True, last_full_version=7,
                                       last_full_offset=0)])
def test_republish_mark_round_trips_in_every_chunk_within_the_limit(mark):
    dense, sparse = _data(rows=3000)
    header = _header()
    for name, value in mark.items():
        setattr(header, name, value)
    chunks = encode_version(header, dense, sparse, max_chunk_bytes=4096)
    assert len(chunks) > 10 and all(len(c) <= 4096 for c in chunks)
    for c in chunks:  # each chunk alone says it (a replay may start inside a version)
        h = decode_chunk(c).header
        assert (h.full_republish, h.last_full_version, h.last_full_offset) == (
            header.full_republish, header.last_full_version, header.last_full_offset)
    v = _assemble(chunks)
    _check_equal(v, dense, sparse)
    assert (v.header.full_republish, v.header.last_full_version) == (
        header.full_republish, header.last_full_version)
    # a version without a mark carries none: defaults, and no bytes for it
    plain = decode_chunk(encode_version(_header(), {}, {})[0]).header
    assert (plain.full_republish, plain.last_full_version, plain.last_full_offset) == (
        False, 0, -1)
    assert not delta_pb2.DeltaPayload.FromString(
        delta_pb2.DeltaChunk.FromString(encode_version(_header(), {}, {})[0]).payload
    ).HasField("republish")


@pytest.mark.parametrize("version,offset", [(8, 3), (5, -2)])
def test_republish_mark_naming_a_later_version_or_a_bad_offset_is_rejected(version, offset):
    header = _header(version=7)
    header.last_full_version, header.last_full_offset = version, offset
    with pytest.raises(DeltaFormatError) as err:
        decode_chunk(encode_version(header, {}, {})[0])
    assert err.value.reason == "republish"


def test_newer_complete_version_drops_older_incomplete():
    dense, sparse = _data(rows=2000)
    old = encode_version(_header(version=5), dense, sparse, max_chunk_bytes=4096)
    new = encode_version(_header(version=10), dense, sparse, max_chunk_bytes=4096)
    asm = VersionAssembler()
    for c in old[:-1]:
        assert asm.add(decode_chunk(c)) is None
    done = [asm.add(decode_chunk(c)) for c in new]
    assert done[-1] is not None and done[-1].version == 10
    assert asm.pending_versions == 0 and asm.dropped_versions == 1


def test_assembler_memory_bounded():
    dense, sparse = _data(rows=2000)
    asm = VersionAssembler(max_pending_versions=2)
    for ver in range(5):
        chunks = encode_version(_header(version=ver), dense, sparse, max_chunk_bytes=4096)
        asm.add(decode_chunk(chunks[0]))
    assert asm.pending_versions == 2 and asm.dropped_versions == 3


def _raw_chunk(payload: delta_pb2.DeltaPayload, **kw) -> bytes:
    data = payload.SerializeToString()
    msg = delta_pb2.DeltaChunk(format_version=1, version=1, generation="g", chunk_index=0,
                               chunk_count=1, payload=data, payload_crc32=zlib.crc32(data),
                               version_rows=1 << 40, version_variables=1)
    for k, v in kw.items():
        setattr(msg, k, v)
    return msg.SerializeToString()


@pytest.mark.parametrize("case", [
    "wrong_dim", "huge_dim", "ids_not_multiple", "huge_shape", "dense_values_short",
    "offset_beyond", "format_version", "chunk_index", "crc", "garbage", "oversize",
    "negative_id",
])
def test_hostile_messages_rejected_without_big_allocations(case):
    p = delta_pb2.DeltaPayload()
    kw = {}
    if case == "wrong_dim":
        p.sparse.add(table_id=0, dim=3, ids=np.arange(4, dtype="<i8").tobytes(),
                     values=np.zeros(4 * 4, "<f4").tobytes())
    elif case == "huge_dim":
        p.sparse.add(table_id=0, dim=0xFFFFFFFF, ids=np.arange(4, dtype="<i8").tobytes(),
                     values=b"")
    elif case == "ids_not_multiple":
        p.sparse.add(table_id=0, dim=1, ids=b"\x00" * 12, values=b"\x00" * 4)
    elif case == "huge_shape":
        p.dense.add(id=0, shape=[0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF], values=b"\x00" * 16)
    elif case == "dense_values_short":
        p.dense.add(id=0, shape=[1000, 1000], values=b"\x00" * 6)
    elif case == "offset_beyond":
        p.dense.add(id=0, shape=[10], values=b"\x00" * 16, offset=(1 << 63))
    elif case == "negative_id":
        p.sparse.add(table_id=0, dim=1, ids=np.array([-5], "<i8").tobytes(),
                     values=b"\x00" * 4)
    elif case == "format_version":
        kw["format_version"] = 2
    elif case == "chunk_index":
        kw["chunk_index"] = 3
        kw["chunk_count"] = 3
    data = _raw_chunk(p, **kw)
    if case == "crc":
        msg = delta_pb2.DeltaChunk.FromString(_raw_chunk(delta_pb2.DeltaPayload()))
        msg.payload_crc32 ^= 1
        data = msg.SerializeToString()
    elif case == "garbage":
        data = b"\xff" * 100
    elif case == "oversize":
        data = b"\x00" * 2000
    tracemalloc.start()
    try:
        with pytest.raises(DeltaFormatError):
            decode_chunk(data, max_bytes=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_unsplittable_row_too_big_for_chunk_is_an_error():
    with pytest.raises(ValueError):
        encode_version(_header(), {}, {0: (np.arange(2), np.zeros((2, 4096), np.float32))},
                       max_chunk_bytes=4096)


def test_empty_version_is_one_chunk():
    chunks = encode_version(_header(), {}, {})
    v = _assemble(chunks)
    assert v.num_rows == 0 and v.dense == {}


def test_id_maps_round_trip(tmp_path):
    maps = write_id_maps(str(tmp_path), {"dense.b": (3,), "dense.a": (2, 4)},
                         {"c1_wide": (100, 1), "c1": (100, 8), "a": (5, 8)})
    assert maps.dense["dense.a"].id == 0 and maps.dense["dense.b"].id == 1
    assert [maps.tables[n].id for n in ("a", "c1", "c1_wide")] == [0, 1, 2]
    back = read_id_maps(str(tmp_path))
    assert back == maps
    text = (tmp_path / "embed_name_to_ids.txt").read_text()
    assert text.splitlines()[0] == "a\t0\t5\t8"
    assert back.table_names()[2] == "c1_wide"
