"""Hostile delta messages: truncated, huge claimed sizes, floods of pending versions.

Complements ``test_delta_codec.py`` (per-field corruption) and ``test_serving.py`` (unknown
ids, shapes, checksums through a real topic): every strict prefix of a real chunk is
rejected, and messages that claim gigabytes or billions of chunks cost about their own size.
"""

from __future__ import annotations

import tracemalloc
import zlib

import numpy as np
import pytest

from odl.protos import delta_pb2
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_format import DeltaFormatError, VersionHeader
from publisher.version_assembler import VersionAssembler


def _chunks(rows: int = 300, dim: int = 8, max_chunk_bytes: int = 900_000) -> list[bytes]:
    rng = np.random.default_rng(0)
    header = VersionHeader(model_name="m", version=5, generation="g", kind="both",
                           positions=[("t", 0, 1)])
    dense = {0: rng.standard_normal((4, 3)).astype(np.float32)}
    sparse = {1: (np.arange(rows, dtype=np.int64),
                  rng.standard_normal((rows, dim)).astype(np.float32))}
    return encode_version(header, dense, sparse, max_chunk_bytes=max_chunk_bytes)


@pytest.mark.parametrize("empty", [False, True])
def test_every_truncation_is_rejected(empty):
    if empty:
        data = encode_version(VersionHeader(model_name="m", version=1, generation="g",
                                            kind="both"), {}, {})[0]
    else:
        data = _chunks()[0]
    decode_chunk(data)  # the whole message is fine
    cuts = range(len(data)) if len(data) < 600 else sorted(
        set(range(0, 300)) | set(range(len(data) - 300, len(data)))
        | set(np.random.default_rng(1).integers(0, len(data), 300).tolist()))
    accepted = []
    for cut in cuts:
        try:
            decode_chunk(data[:cut])
        except DeltaFormatError:
            continue
        accepted.append(cut)
    assert accepted == [], f"prefixes of {len(data)} bytes decoded: {accepted[:10]}"


def _claiming(version: int, **claims: int) -> bytes:
    payload = delta_pb2.DeltaPayload().SerializeToString()
    msg = delta_pb2.DeltaChunk(format_version=1, version=version, generation="evil",
                               chunk_index=0, chunk_count=claims.get("chunk_count", 1),
                               version_rows=claims.get("version_rows", 0),
                               version_variables=claims.get("version_variables", 0),
                               payload=payload, payload_crc32=zlib.crc32(payload))
    return msg.SerializeToString()


def test_huge_claims_cost_only_their_own_size():
    """Versions claiming 2**32-1 chunks and 2**60 rows: pending state stays small."""
    asm = VersionAssembler(max_pending_versions=4, max_pending_bytes=1 << 20)
    tracemalloc.start()
    try:
        for v in range(2000):
            chunk = decode_chunk(_claiming(v, chunk_count=0xFFFFFFFF, version_rows=1 << 60,
                                           version_variables=1 << 60))
            assert asm.add(chunk) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert asm.pending_versions <= 4
    assert peak < 4 << 20, peak


def test_dense_shape_claiming_gigabytes_is_rejected_before_allocating():
    """A slice claiming a 4 GiB variable: refused at decode or assembly, never allocated."""
    p = delta_pb2.DeltaPayload()
    p.dense.add(id=0, shape=[1 << 15, 1 << 15], values=b"\x00" * 64, offset=0)  # 2**30 floats
    data = p.SerializeToString()
    msg = delta_pb2.DeltaChunk(format_version=1, version=1, generation="g", chunk_index=0,
                               chunk_count=1, payload=data, payload_crc32=zlib.crc32(data),
                               version_variables=1)
    tracemalloc.start()
    try:
        with pytest.raises(DeltaFormatError):
            VersionAssembler().add(decode_chunk(msg.SerializeToString()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_flood_of_big_incomplete_versions_is_bounded():
    """Many first chunks of never-completed multi-chunk versions: bytes held stay bounded."""
    asm = VersionAssembler(max_pending_versions=8, max_pending_bytes=2 << 20)
    for v in range(40):
        rng = np.random.default_rng(v)
        header = VersionHeader(model_name="m", version=v, generation="g", kind="both")
        sparse = {0: (np.arange(20_000, dtype=np.int64),
                      rng.standard_normal((20_000, 8)).astype(np.float32))}
        chunks = encode_version(header, {}, sparse, max_chunk_bytes=400_000)
        assert len(chunks) > 1
        asm.add(decode_chunk(chunks[0]))
        assert asm.pending_bytes <= 2 << 20
    assert asm.dropped_versions >= 30
