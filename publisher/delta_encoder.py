"""Encodes delta versions: the writer of the delta wire layout.

Wire layout (see ``protos/delta.proto`` for every field): one Kafka message (or one record
of a ``.delta`` file, ``publisher.fs_sink``) is one serialized ``DeltaChunk``::

    DeltaChunk {header fields..., chunk_index, chunk_count, value_type,
                payload = serialized DeltaPayload, payload_crc32 = zlib.crc32(payload),
                version_rows, version_variables}
    DeltaPayload {dense: [DenseVariable {id, shape, values, offset}],
                  sparse: [SparseRows {table_id, dim, ids, values}],
                  deleted: [DeletedRows {table_id, ids}],
                  republish: RepublishMark {full, last_full_version, last_full_offset}}

* ``format_version`` is ``publisher.delta_format.FORMAT_VERSION``.
* ``ids``: little-endian int64, one per row (the row index serving looks up; a dynamic
  table's raw id).
* ``DeletedRows.ids``: little-endian int64 raw ids a dynamic table evicted; within a version
  they apply before the rows (an id in both keeps the row).
* ``values``: little-endian float32 (``value_type`` FP32) or float16 (FP16), row-major;
  ``rows x dim`` for sparse rows; for a dense variable ``prod(shape)`` elements, or a
  contiguous slice starting at flat element ``offset`` when the variable was too large for
  one chunk (the slices of a variable then lie in several chunks of the same version).
* Every chunk of a version repeats the full header; a version is complete when chunks
  ``0 .. chunk_count - 1`` of the same ``(generation, version)`` have arrived.
* ``version_rows`` / ``version_variables``: embedding rows and dense variables of the whole
  version (every chunk says the same).
* Within one version a row id appears at most once per table and a dense variable at most
  once (split slices cover it exactly once).
* ``payload`` is the last field written, so a cut-off message lacks it.
* ``republish`` is written into every chunk of a version whose header is a full republish
  or names one (after the delta topic lost acknowledged versions,
  ``publisher.delta_sender``), and left out otherwise.

Ids name the dense variables and tables of the id-map files (``publisher.id_maps``). Chunks
are sized to stay below ``max_chunk_bytes`` serialized; a version is never empty of chunks.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np

from odl.protos import delta_pb2
from publisher.delta_format import (
    FORMAT_VERSION,
    ID_DTYPE,
    KINDS,
    MAX_DIM,
    MAX_SHAPE_RANK,
    VALUE_TYPES,
    WIRE_DTYPES,
    VersionHeader,
)

# Conservative protobuf framing estimates used to size chunks (tag + length varints).
_CHUNK_FRAMING = 16          # payload tag + length varint + spare
_SPARSE_FRAMING = 40         # SparseRows tag/len + table_id + dim + ids/values tags/lens
_DENSE_FRAMING = 48          # DenseVariable tag/len + id + offset + values tag/len + shape
_DELETED_FRAMING = 24        # DeletedRows tag/len + table_id + ids tag/len
_REPUBLISH_FRAMING = 32      # RepublishMark tag/len + full + two varints of up to 10 bytes
_MIN_CHUNK_BYTES = 1024


def _header_proto(header: VersionHeader, value_type: str) -> delta_pb2.DeltaChunk:
    if header.kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {header.kind!r}")
    msg = delta_pb2.DeltaChunk(
        format_version=FORMAT_VERSION,
        model_name=header.model_name,
        version=int(header.version),
        generation=header.generation,
        kind=KINDS[header.kind],
        min_event_time_ms=int(header.min_event_time_ms),
        max_event_time_ms=int(header.max_event_time_ms),
        min_produce_time_ms=int(header.min_produce_time_ms),
        max_produce_time_ms=int(header.max_produce_time_ms),
        publish_time_ms=int(header.publish_time_ms),
        value_type=VALUE_TYPES[value_type],
    )
    for topic, partition, next_offset in header.positions:
        msg.positions.add(topic=topic, partition=int(partition), next_offset=int(next_offset))
    return msg


def encode_version(
    header: VersionHeader,
    dense: Mapping[int, np.ndarray],
    sparse: Mapping[int, tuple[np.ndarray, np.ndarray]],
    value_type: str = "fp32",
    max_chunk_bytes: int = 900_000,
    deletes: Mapping[int, np.ndarray] | None = None,
) -> list[bytes]:
    """Encodes one version into chunks, each serialized chunk at most ``max_chunk_bytes``.

    Args:
        header: the version header.
        dense: variable id -> array (any shape, converted to float32 / float16).
        sparse: table id -> ``(ids int64 [n], values [n, dim])``; ids unique per table.
        value_type: ``"fp32"`` or ``"fp16"``.
        max_chunk_bytes: size limit of one serialized chunk (>= 1024).
        deletes: table id -> raw ids deleted from a dynamic table (unique per table).

    Returns:
        The serialized chunks in order (at least one, even for an empty version).

    Raises:
        ValueError: bad arguments (shapes, value type, a limit too small for the header).
    """
    if value_type not in VALUE_TYPES:
        raise ValueError(f"value_type must be one of {sorted(VALUE_TYPES)}, got {value_type!r}")
    if max_chunk_bytes < _MIN_CHUNK_BYTES:
        raise ValueError(f"max_chunk_bytes must be >= {_MIN_CHUNK_BYTES}")
    wire = WIRE_DTYPES[value_type]
    bpv = wire.itemsize
    base = _header_proto(header, value_type)
    probe = delta_pb2.DeltaChunk()
    probe.CopyFrom(base)
    probe.chunk_index = probe.chunk_count = 0xFFFFFFFF
    probe.payload_crc32 = 0xFFFFFFFF
    probe.version_rows = probe.version_variables = (1 << 64) - 1
    budget = max_chunk_bytes - probe.ByteSize() - _CHUNK_FRAMING
    if header.has_republish_mark:
        budget -= _REPUBLISH_FRAMING
    if budget < 256:
        raise ValueError(f"max_chunk_bytes {max_chunk_bytes} leaves no room for data after the "
                         f"{probe.ByteSize()}-byte header")

    # Each chunk: list of ("dense", id, shape, offset, flat wire values) /
    # ("sparse", table_id, dim, ids, wire values).
    chunks: list[list[tuple]] = [[]]
    left = budget

    def new_chunk() -> None:
        nonlocal left
        chunks.append([])
        left = budget

    total_rows = 0
    for vid in sorted(dense):
        arr = np.asarray(dense[vid])
        shape = tuple(int(d) for d in arr.shape)
        if len(shape) > MAX_SHAPE_RANK:
            raise ValueError(f"dense variable {vid}: rank {len(shape)} > {MAX_SHAPE_RANK}")
        flat = np.ascontiguousarray(arr, dtype=wire).reshape(-1)
        framing = _DENSE_FRAMING + 5 * len(shape)
        pos = 0
        while True:
            room = (left - framing) // bpv
            if room <= 0 or (room < flat.size - pos and left < budget // 4):
                new_chunk()
                continue
            take = min(room, flat.size - pos)
            chunks[-1].append(("dense", int(vid), shape, pos, flat[pos : pos + take]))
            left -= framing + take * bpv
            pos += take
            if pos >= flat.size:
                break
    for tid in sorted(sparse):
        ids, values = sparse[tid]
        ids = np.ascontiguousarray(ids, dtype=ID_DTYPE).reshape(-1)
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[0] != ids.size:
            raise ValueError(f"table {tid}: values shape {values.shape} does not match "
                             f"{ids.size} ids")
        dim = int(values.shape[1])
        if not 0 < dim <= MAX_DIM:
            raise ValueError(f"table {tid}: dim {dim} out of range")
        if ids.size == 0:
            continue
        vals = np.ascontiguousarray(values, dtype=wire)
        row_bytes = 8 + dim * bpv
        if row_bytes + _SPARSE_FRAMING > budget:
            raise ValueError(f"table {tid}: one row ({row_bytes} bytes) does not fit in "
                             f"max_chunk_bytes {max_chunk_bytes}")
        total_rows += ids.size
        pos = 0
        while pos < ids.size:
            room = (left - _SPARSE_FRAMING) // row_bytes
            if room <= 0:
                new_chunk()
                continue
            take = min(room, ids.size - pos)
            chunks[-1].append(("sparse", int(tid), dim, ids[pos : pos + take],
                               vals[pos : pos + take]))
            left -= _SPARSE_FRAMING + take * row_bytes
            pos += take

    for tid in sorted(deletes or {}):
        gone = np.ascontiguousarray((deletes or {})[tid], dtype=ID_DTYPE).reshape(-1)
        pos = 0
        while pos < gone.size:
            room = (left - _DELETED_FRAMING) // 8
            if room <= 0:
                new_chunk()
                continue
            take = min(room, gone.size - pos)
            chunks[-1].append(("deleted", int(tid), gone[pos : pos + take]))
            left -= _DELETED_FRAMING + take * 8
            pos += take

    out: list[bytes] = []
    count = len(chunks)
    for index, items in enumerate(chunks):
        payload = delta_pb2.DeltaPayload()
        if header.has_republish_mark:
            payload.republish.full = bool(header.full_republish)
            payload.republish.last_full_version = int(header.last_full_version)
            payload.republish.last_full_offset = int(header.last_full_offset)
        for item in items:
            if item[0] == "dense":
                _, vid, shape, offset, flat = item
                payload.dense.add(id=vid, shape=shape, values=flat.tobytes(), offset=offset)
            elif item[0] == "sparse":
                _, tid, dim, ids, vals = item
                payload.sparse.add(table_id=tid, dim=dim, ids=ids.tobytes(),
                                   values=vals.tobytes())
            else:
                _, tid, gone = item
                payload.deleted.add(table_id=tid, ids=gone.tobytes())
        data = payload.SerializeToString()
        msg = delta_pb2.DeltaChunk()
        msg.CopyFrom(base)
        msg.chunk_index = index
        msg.chunk_count = count
        msg.payload = data
        msg.payload_crc32 = zlib.crc32(data)
        msg.version_rows = total_rows
        msg.version_variables = len(dense)
        blob = msg.SerializeToString()
        if len(blob) > max_chunk_bytes:  # framing estimates are conservative; never expected
            raise AssertionError(f"chunk of {len(blob)} bytes exceeds {max_chunk_bytes}")
        out.append(blob)
    return out
