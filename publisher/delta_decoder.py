"""Decodes one delta chunk, validating it against hostile input.

The reader of the wire layout written by ``publisher.delta_encoder``. Contract: every length
and size is checked against the header's claims and the limits of ``publisher.delta_format``
before an array is built, so a hostile message cannot make the decoder allocate more than
about its own size; a message that fails any check raises ``DeltaFormatError`` (its
``reason`` names the check) and nothing of it is returned. Checks, in order: size,
parsability, presence of ``payload`` / ``payload_crc32`` (any strict prefix of a chunk lacks
one), ``format_version``, chunk index, kind, value type, checksum, payload parsability,
then per dense variable rank, element count and value bytes, per table dim, id and value
bytes and non-negative ids, at most one whole copy of a variable per chunk, one dim per
table, rows not beyond the header's ``version_rows``, and per deleted-id list its length and
non-negative ids (their bytes are bounded by the message size).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
from google.protobuf.message import DecodeError

from odl.protos import delta_pb2
from publisher.delta_format import (
    FORMAT_VERSION,
    ID_DTYPE,
    KIND_NAMES,
    MAX_DENSE_ELEMENTS,
    MAX_DIM,
    MAX_SHAPE_RANK,
    VALUE_TYPE_NAMES,
    WIRE_DTYPES,
    DecodedChunk,
    DeltaFormatError,
    DenseSlice,
    VersionHeader,
)


def decode_chunk(data: bytes, max_bytes: int = 64 << 20) -> DecodedChunk:
    """Parses and validates one chunk.

    Every length is checked against the header's claims before arrays are built, so a
    hostile message cannot make the decoder allocate more than about ``len(data)`` bytes.

    Args:
        data: one serialized ``DeltaChunk``.
        max_bytes: largest accepted message.

    Returns:
        The decoded chunk (values converted to float32, arrays are fresh writable copies).

    Raises:
        DeltaFormatError: oversize, unparsable, truncated (no payload / payload_crc32:
            any strict prefix of a chunk), unknown format_version, bad chunk index,
            checksum mismatch, inconsistent lengths or shapes, out-of-range sizes, a
            republish mark naming a later version or an offset below -1 (``republish``).
    """
    if len(data) > max_bytes:
        raise DeltaFormatError("oversize", f"{len(data)} bytes > {max_bytes}")
    msg = delta_pb2.DeltaChunk()
    try:
        msg.ParseFromString(bytes(data))
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise DeltaFormatError("unparsable", str(exc)) from None
    if not msg.HasField("payload") or not msg.HasField("payload_crc32"):
        # The encoder always writes both, and payload is the last field: a cut-off message
        # (or an empty / all-default one) lacks it or fails to parse.
        raise DeltaFormatError("truncated", "no payload / payload_crc32 (truncated message?)")
    if msg.format_version != FORMAT_VERSION:
        raise DeltaFormatError("format_version", f"unknown format_version {msg.format_version}")
    if msg.chunk_count == 0 or msg.chunk_index >= msg.chunk_count:
        raise DeltaFormatError("chunk_index",
                               f"chunk_index {msg.chunk_index} / chunk_count {msg.chunk_count}")
    if msg.kind not in KIND_NAMES:
        raise DeltaFormatError("kind", f"unknown kind {msg.kind}")
    if msg.value_type not in VALUE_TYPE_NAMES:
        raise DeltaFormatError("value_type", f"unknown value_type {msg.value_type}")
    if zlib.crc32(msg.payload) != msg.payload_crc32:
        raise DeltaFormatError("crc_mismatch", f"version {msg.version} chunk {msg.chunk_index}")
    payload = delta_pb2.DeltaPayload()
    try:
        payload.ParseFromString(msg.payload)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise DeltaFormatError("unparsable", f"payload: {exc}") from None
    value_type = VALUE_TYPE_NAMES[msg.value_type]
    wire = WIRE_DTYPES[value_type]
    bpv = wire.itemsize

    dense: dict[int, np.ndarray] = {}
    slices: list[DenseSlice] = []
    for var in payload.dense:
        shape = tuple(int(d) for d in var.shape)
        if len(shape) > MAX_SHAPE_RANK:
            raise DeltaFormatError("shape", f"dense {var.id}: rank {len(shape)}")
        total = math.prod(shape)
        if total > MAX_DENSE_ELEMENTS:
            raise DeltaFormatError("shape", f"dense {var.id}: {total} elements claimed")
        if len(var.values) % bpv:
            raise DeltaFormatError("values_length", f"dense {var.id}: {len(var.values)} bytes")
        n = len(var.values) // bpv
        if var.offset + n > total:
            raise DeltaFormatError("values_length",
                                   f"dense {var.id}: {n} values at offset {var.offset} exceed "
                                   f"shape {shape}")
        values = np.frombuffer(var.values, dtype=wire).astype(np.float32)
        if var.offset == 0 and n == total:
            if var.id in dense:
                raise DeltaFormatError("duplicate", f"dense {var.id} twice in one chunk")
            dense[var.id] = values.reshape(shape)
        else:
            slices.append(DenseSlice(var.id, shape, int(var.offset), values))
    sparse: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for rows in payload.sparse:
        if not 0 < rows.dim <= MAX_DIM:
            raise DeltaFormatError("dim", f"table {rows.table_id}: dim {rows.dim}")
        if len(rows.ids) % 8:
            raise DeltaFormatError("ids_length", f"table {rows.table_id}: {len(rows.ids)} bytes")
        n = len(rows.ids) // 8
        if len(rows.values) != n * rows.dim * bpv:
            raise DeltaFormatError(
                "values_length", f"table {rows.table_id}: {len(rows.values)} value bytes for "
                                 f"{n} ids x dim {rows.dim}")
        ids = np.frombuffer(rows.ids, dtype=ID_DTYPE).astype(np.int64)
        if n and ids.min() < 0:
            raise DeltaFormatError("ids", f"table {rows.table_id}: negative row id")
        values = np.frombuffer(rows.values, dtype=wire).astype(np.float32).reshape(n, rows.dim)
        if rows.table_id in sparse:
            old_ids, old_values = sparse[rows.table_id]
            if old_values.shape[1] != rows.dim:
                raise DeltaFormatError("dim", f"table {rows.table_id}: two dims in one chunk")
            ids = np.concatenate([old_ids, ids])
            values = np.concatenate([old_values, values])
        sparse[rows.table_id] = (ids, values)
    deletes: dict[int, np.ndarray] = {}
    for gone in payload.deleted:
        if len(gone.ids) % 8:
            raise DeltaFormatError("ids_length", f"deleted of table {gone.table_id}: "
                                                 f"{len(gone.ids)} bytes")
        ids = np.frombuffer(gone.ids, dtype=ID_DTYPE).astype(np.int64)
        if ids.size and ids.min() < 0:
            raise DeltaFormatError("ids", f"deleted of table {gone.table_id}: negative id")
        if gone.table_id in deletes:
            ids = np.concatenate([deletes[gone.table_id], ids])
        deletes[gone.table_id] = ids
    header = VersionHeader(
        model_name=msg.model_name,
        version=int(msg.version),
        generation=msg.generation,
        kind=KIND_NAMES[msg.kind],
        min_event_time_ms=int(msg.min_event_time_ms),
        max_event_time_ms=int(msg.max_event_time_ms),
        min_produce_time_ms=int(msg.min_produce_time_ms),
        max_produce_time_ms=int(msg.max_produce_time_ms),
        positions=[(p.topic, int(p.partition), int(p.next_offset)) for p in msg.positions],
        publish_time_ms=int(msg.publish_time_ms),
    )
    if payload.HasField("republish"):
        mark = payload.republish
        if mark.last_full_offset < -1 or mark.last_full_version > msg.version:
            raise DeltaFormatError(
                "republish", f"version {msg.version}: republish mark names version "
                             f"{mark.last_full_version} at offset {mark.last_full_offset}")
        header.full_republish = bool(mark.full)
        header.last_full_version = int(mark.last_full_version)
        header.last_full_offset = int(mark.last_full_offset)
    chunk = DecodedChunk(header, int(msg.chunk_index), int(msg.chunk_count), value_type,
                         int(msg.version_rows), int(msg.version_variables), dense, slices,
                         sparse, len(data), deletes)
    if chunk.num_rows > chunk.version_rows:
        raise DeltaFormatError("version_rows", f"chunk has {chunk.num_rows} rows, version "
                                               f"claims {chunk.version_rows}")
    return chunk
