"""Delta wire format: encoder, hardened decoder, version assembler and id-map files.

The only module that writes or reads the delta format; the trainer's publisher and the
serving plugin both use it. It depends on numpy and the generated ``odl.protos.delta_pb2``
only (no torch, no trainer code).

Wire layout (see ``protos/delta.proto`` for every field): one Kafka message (or one record
of a ``.delta`` file) is one serialized ``DeltaChunk``::

    DeltaChunk {header fields..., chunk_index, chunk_count, value_type,
                payload = serialized DeltaPayload, payload_crc32 = zlib.crc32(payload),
                version_rows, version_variables}
    DeltaPayload {dense: [DenseVariable {id, shape, values, offset}],
                  sparse: [SparseRows {table_id, dim, ids, values}]}

* ``ids``: little-endian int64, one per row (the row index serving looks up).
* ``values``: little-endian float32 (``value_type`` FP32) or float16 (FP16), row-major;
  ``rows x dim`` for sparse rows; for a dense variable ``prod(shape)`` elements, or a
  contiguous slice starting at flat element ``offset`` when the variable was too large for
  one chunk (the slices of a variable then lie in several chunks of the same version).
* Every chunk of a version repeats the full header; a version is complete when chunks
  ``0 .. chunk_count - 1`` of the same ``(generation, version)`` have arrived.
* Within one version a row id appears at most once per table and a dense variable at most
  once (split slices cover it exactly once).

Id-map files written by the trainer into ``model_dir`` at start (and copied by export):

* ``DENSE_UPDATE_VARIABLES``: JSON ``{"<dense variable name>": {"id": int, "shape": [..]},
  ...}``; names are the checkpoint's parameter / buffer names (``dense.dnn.0.weight``).
  Only floating-point variables are listed and published.
* ``embed_name_to_ids.txt``: one ``<table name><TAB><id><TAB><num_rows><TAB><dim>`` line per
  embedding table, ``dim`` = published width (``wide_output_dim`` for ``<table>_wide``).

Ids are assigned by sorted name, 0, 1, 2, ... separately for dense variables and tables.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from odl.protos import delta_pb2

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DENSE_UPDATE_VARIABLES = "DENSE_UPDATE_VARIABLES"
EMBED_NAME_TO_IDS = "embed_name_to_ids.txt"

KINDS = {"dense": delta_pb2.DENSE, "sparse": delta_pb2.SPARSE, "both": delta_pb2.BOTH}
KIND_NAMES = {v: k for k, v in KINDS.items()}
VALUE_TYPES = {"fp32": delta_pb2.FP32, "fp16": delta_pb2.FP16}
VALUE_TYPE_NAMES = {v: k for k, v in VALUE_TYPES.items()}
_WIRE_DTYPE = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}
_ID_DTYPE = np.dtype("<i8")

# Decoder sanity limits (checked before anything is allocated).
MAX_DIM = 1 << 16
MAX_DENSE_ELEMENTS = 1 << 30
MAX_SHAPE_RANK = 8

# Conservative protobuf framing estimates used to size chunks (tag + length varints).
_CHUNK_FRAMING = 16          # payload tag + length varint + spare
_SPARSE_FRAMING = 40         # SparseRows tag/len + table_id + dim + ids/values tags/lens
_DENSE_FRAMING = 48          # DenseVariable tag/len + id + offset + values tag/len + shape
_MIN_CHUNK_BYTES = 1024


class DeltaFormatError(ValueError):
    """A delta message is malformed, corrupted or hostile.

    Attributes:
        reason: short machine-friendly reason (e.g. ``"crc_mismatch"``).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class VersionHeader:
    """What every chunk of a version says about the version.

    Attributes:
        model_name: model name.
        version: the trainer's global step.
        generation: trainer generation id (new per trainer start).
        kind: ``"dense"``, ``"sparse"`` or ``"both"``.
        min_event_time_ms: min event time of the samples since the previous version (0 = unknown).
        max_event_time_ms: max event time of those samples (0 = unknown).
        min_produce_time_ms: min Kafka produce time of those samples (0 = unknown).
        max_produce_time_ms: max Kafka produce time of those samples (0 = unknown).
        positions: ``(topic, partition, next_offset)`` input positions the version covers.
        publish_time_ms: when the trainer snapshotted the version (unix ms).
    """

    model_name: str
    version: int
    generation: str
    kind: str = "both"
    min_event_time_ms: int = 0
    max_event_time_ms: int = 0
    min_produce_time_ms: int = 0
    max_produce_time_ms: int = 0
    positions: list[tuple[str, int, int]] = field(default_factory=list)
    publish_time_ms: int = 0


@dataclass
class DenseSlice:
    """Part of a dense variable split across chunks.

    Attributes:
        id: variable id.
        shape: full shape of the variable.
        offset: flat index of the first element of ``values``.
        values: float32 flat values.
    """

    id: int
    shape: tuple[int, ...]
    offset: int
    values: np.ndarray


class _HeaderFieldsAndRows:
    """Shared by chunks and versions: header fields readable directly, and a row count."""

    header: VersionHeader
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: expose the header's fields.
        if name == "header":
            raise AttributeError(name)
        return getattr(self.header, name)

    @property
    def num_rows(self) -> int:
        """Embedding rows carried."""
        return sum(len(ids) for ids, _ in self.sparse.values())


@dataclass
class DecodedChunk(_HeaderFieldsAndRows):
    """One validated chunk. Header fields are also readable directly (``chunk.version``).

    Attributes:
        header: the version header.
        chunk_index: index of this chunk in the version.
        chunk_count: number of chunks of the version.
        value_type: ``"fp32"`` or ``"fp16"`` (values here are float32 either way).
        version_rows: embedding rows of the whole version.
        version_variables: dense variables of the whole version.
        dense: variable id -> float32 array of its full shape (variables whole in this chunk).
        dense_slices: slices of variables split across chunks (see ``VersionAssembler``).
        sparse: table id -> ``(ids int64 [n], values float32 [n, dim])``.
        nbytes: serialized size of the chunk.
    """

    header: VersionHeader
    chunk_index: int
    chunk_count: int
    value_type: str
    version_rows: int
    version_variables: int
    dense: dict[int, np.ndarray]
    dense_slices: list[DenseSlice]
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    nbytes: int



@dataclass
class DeltaVersion(_HeaderFieldsAndRows):
    """A complete version (all chunks merged).

    Attributes:
        header: the version header.
        value_type: wire value type (values here are float32).
        dense: variable id -> float32 array of its full shape.
        sparse: table id -> ``(ids int64 [n], values float32 [n, dim])``.
        chunk_count: number of chunks it arrived in.
        nbytes: total serialized bytes of its chunks.
    """

    header: VersionHeader
    value_type: str
    dense: dict[int, np.ndarray]
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    chunk_count: int
    nbytes: int



# ----------------------------------------------------------------------------- encoding


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
) -> list[bytes]:
    """Encodes one version into chunks, each serialized chunk at most ``max_chunk_bytes``.

    Args:
        header: the version header.
        dense: variable id -> array (any shape, converted to float32 / float16).
        sparse: table id -> ``(ids int64 [n], values [n, dim])``; ids unique per table.
        value_type: ``"fp32"`` or ``"fp16"``.
        max_chunk_bytes: size limit of one serialized chunk (>= 1024).

    Returns:
        The serialized chunks in order (at least one, even for an empty version).

    Raises:
        ValueError: bad arguments (shapes, value type, a limit too small for the header).
    """
    if value_type not in VALUE_TYPES:
        raise ValueError(f"value_type must be one of {sorted(VALUE_TYPES)}, got {value_type!r}")
    if max_chunk_bytes < _MIN_CHUNK_BYTES:
        raise ValueError(f"max_chunk_bytes must be >= {_MIN_CHUNK_BYTES}")
    wire = _WIRE_DTYPE[value_type]
    bpv = wire.itemsize
    base = _header_proto(header, value_type)
    probe = delta_pb2.DeltaChunk()
    probe.CopyFrom(base)
    probe.chunk_index = probe.chunk_count = 0xFFFFFFFF
    probe.payload_crc32 = 0xFFFFFFFF
    probe.version_rows = probe.version_variables = (1 << 64) - 1
    budget = max_chunk_bytes - probe.ByteSize() - _CHUNK_FRAMING
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
        ids = np.ascontiguousarray(ids, dtype=_ID_DTYPE).reshape(-1)
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

    out: list[bytes] = []
    count = len(chunks)
    for index, items in enumerate(chunks):
        payload = delta_pb2.DeltaPayload()
        for item in items:
            if item[0] == "dense":
                _, vid, shape, offset, flat = item
                payload.dense.add(id=vid, shape=shape, values=flat.tobytes(), offset=offset)
            else:
                _, tid, dim, ids, vals = item
                payload.sparse.add(table_id=tid, dim=dim, ids=ids.tobytes(),
                                   values=vals.tobytes())
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


# ----------------------------------------------------------------------------- decoding


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
            checksum mismatch, inconsistent lengths or shapes, out-of-range sizes.
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
    wire = _WIRE_DTYPE[value_type]
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
        ids = np.frombuffer(rows.ids, dtype=_ID_DTYPE).astype(np.int64)
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
    chunk = DecodedChunk(header, int(msg.chunk_index), int(msg.chunk_count), value_type,
                         int(msg.version_rows), int(msg.version_variables), dense, slices,
                         sparse, len(data))
    if chunk.num_rows > chunk.version_rows:
        raise DeltaFormatError("version_rows", f"chunk has {chunk.num_rows} rows, version "
                                               f"claims {chunk.version_rows}")
    return chunk


# ----------------------------------------------------------------------------- assembling


@dataclass
class _Pending:
    seq: int
    chunk_count: int
    chunks: dict[int, DecodedChunk]
    nbytes: int = 0


class VersionAssembler:
    """Collects chunks into complete versions (all-or-nothing).

    Feed chunks in topic order with ``add``; it returns a ``DeltaVersion`` when the last
    missing chunk of a ``(generation, version)`` arrives. A duplicate chunk is ignored.
    When a version completes, every pending version that started arriving before it is
    dropped (it can never complete: the topic has one partition and one writer). Memory is
    bounded: beyond ``max_pending_versions`` or ``max_pending_bytes`` the oldest pending
    versions are dropped (counted in ``dropped_versions``).

    Args:
        max_pending_versions: most incomplete versions kept.
        max_pending_bytes: most serialized bytes of incomplete versions kept.
    """

    def __init__(self, max_pending_versions: int = 8, max_pending_bytes: int = 1 << 30) -> None:
        self.max_pending_versions = max_pending_versions
        self.max_pending_bytes = max_pending_bytes
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._seq = 0
        self.dropped_versions = 0
        self.duplicate_chunks = 0

    @property
    def pending_versions(self) -> int:
        """Incomplete versions held."""
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        """Serialized bytes of the incomplete versions held."""
        return sum(p.nbytes for p in self._pending.values())

    def add(self, chunk: DecodedChunk) -> DeltaVersion | None:
        """Adds one chunk; returns the version it completes, else None.

        Args:
            chunk: a decoded chunk.

        Returns:
            The complete version or None.

        Raises:
            DeltaFormatError: the completed version's dense slices do not cover their
                variables exactly (the version is dropped).
        """
        key = (chunk.header.generation, chunk.header.version)
        pending = self._pending.get(key)
        if pending is not None and pending.chunk_count != chunk.chunk_count:
            logger.warning("version %s: chunk_count changed from %d to %d; restarting it",
                           key, pending.chunk_count, chunk.chunk_count)
            del self._pending[key]
            self.dropped_versions += 1
            pending = None
        if pending is None:
            self._seq += 1
            pending = _Pending(self._seq, chunk.chunk_count, {})
            self._pending[key] = pending
        if chunk.chunk_index in pending.chunks:
            self.duplicate_chunks += 1
            return None
        pending.chunks[chunk.chunk_index] = chunk
        pending.nbytes += chunk.nbytes
        if len(pending.chunks) == pending.chunk_count:
            del self._pending[key]
            for other_key in [k for k, p in self._pending.items() if p.seq < pending.seq]:
                logger.warning("dropping incomplete version %s (a later version completed)",
                               other_key)
                del self._pending[other_key]
                self.dropped_versions += 1
            return _merge_chunks([pending.chunks[i] for i in range(pending.chunk_count)])
        self._enforce_bounds(key)
        return None

    def _enforce_bounds(self, current: tuple[str, int]) -> None:
        while self._pending and (len(self._pending) > self.max_pending_versions
                                 or self.pending_bytes > self.max_pending_bytes):
            oldest = min(self._pending, key=lambda k: self._pending[k].seq)
            logger.warning("dropping incomplete version %s: pending limit reached (%d versions, "
                           "%d bytes)", oldest, len(self._pending), self.pending_bytes)
            del self._pending[oldest]
            self.dropped_versions += 1
            if oldest == current:
                break


def _merge_chunks(chunks: Sequence[DecodedChunk]) -> DeltaVersion:
    first = chunks[0]
    dense: dict[int, np.ndarray] = {}
    slices: dict[int, list[DenseSlice]] = {}
    sparse_parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for c in chunks:
        dense.update(c.dense)
        for s in c.dense_slices:
            slices.setdefault(s.id, []).append(s)
        for tid, part in c.sparse.items():
            sparse_parts.setdefault(tid, []).append(part)
    for vid, parts in slices.items():
        parts.sort(key=lambda s: s.offset)
        shape = parts[0].shape
        total = math.prod(shape)
        pos = 0
        for s in parts:
            if s.shape != shape or s.offset != pos:
                raise DeltaFormatError("dense_slices", f"dense {vid}: slices do not tile it")
            pos += s.values.size
        if pos != total:
            raise DeltaFormatError("dense_slices", f"dense {vid}: slices cover {pos} of {total}")
        dense[vid] = np.concatenate([s.values for s in parts]).reshape(shape)
    sparse: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for tid, parts in sparse_parts.items():
        dims = {v.shape[1] for _, v in parts}
        if len(dims) != 1:
            raise DeltaFormatError("dim", f"table {tid}: several dims in one version")
        if len(parts) == 1:
            sparse[tid] = parts[0]
        else:
            sparse[tid] = (np.concatenate([i for i, _ in parts]),
                           np.concatenate([v for _, v in parts]))
    return DeltaVersion(first.header, first.value_type, dense, sparse, len(chunks),
                        sum(c.nbytes for c in chunks))


# ----------------------------------------------------------------------------- id maps


@dataclass(frozen=True)
class DenseVariableInfo:
    """A published dense variable.

    Attributes:
        id: its id on the wire.
        shape: its shape.
    """

    id: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TableInfo:
    """A published embedding table.

    Attributes:
        id: its id on the wire.
        num_rows: rows of the table.
        dim: published width (wide tables: wide_output_dim).
    """

    id: int
    num_rows: int
    dim: int


@dataclass
class IdMaps:
    """Name <-> id maps of dense variables and embedding tables.

    Attributes:
        dense: variable name -> info.
        tables: table name -> info.
    """

    dense: dict[str, DenseVariableInfo]
    tables: dict[str, TableInfo]

    def dense_names(self) -> dict[int, str]:
        """Variable id -> name."""
        return {v.id: k for k, v in self.dense.items()}

    def table_names(self) -> dict[int, str]:
        """Table id -> name."""
        return {v.id: k for k, v in self.tables.items()}


def build_id_maps(
    dense_shapes: Mapping[str, Sequence[int]],
    tables: Mapping[str, tuple[int, int]],
) -> IdMaps:
    """Assigns ids by sorted name.

    Args:
        dense_shapes: dense variable name -> shape.
        tables: table name -> ``(num_rows, published dim)``.

    Returns:
        The maps.
    """
    dense = {name: DenseVariableInfo(i, tuple(int(d) for d in dense_shapes[name]))
             for i, name in enumerate(sorted(dense_shapes))}
    tabs = {name: TableInfo(i, int(tables[name][0]), int(tables[name][1]))
            for i, name in enumerate(sorted(tables))}
    return IdMaps(dense, tabs)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_id_maps(
    model_dir: str,
    dense_shapes: Mapping[str, Sequence[int]],
    tables: Mapping[str, tuple[int, int]],
) -> IdMaps:
    """Assigns ids (``build_id_maps``) and writes both files into ``model_dir`` atomically.

    Args:
        model_dir: directory to write ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt``.
        dense_shapes: dense variable name -> shape.
        tables: table name -> ``(num_rows, published dim)``.

    Returns:
        The maps written.
    """
    maps = build_id_maps(dense_shapes, tables)
    os.makedirs(model_dir, exist_ok=True)
    doc = {name: {"id": info.id, "shape": list(info.shape)} for name, info in maps.dense.items()}
    _atomic_write(os.path.join(model_dir, DENSE_UPDATE_VARIABLES),
                  json.dumps(doc, indent=1, sort_keys=True) + "\n")
    lines = "".join(f"{name}\t{t.id}\t{t.num_rows}\t{t.dim}\n"
                    for name, t in sorted(maps.tables.items(), key=lambda kv: kv[1].id))
    _atomic_write(os.path.join(model_dir, EMBED_NAME_TO_IDS), lines)
    return maps


def read_id_maps(model_dir: str) -> IdMaps:
    """Reads the two id-map files of a model_dir or export dir.

    Args:
        model_dir: directory holding ``DENSE_UPDATE_VARIABLES`` and ``embed_name_to_ids.txt``.

    Returns:
        The maps.

    Raises:
        OSError: a file is missing.
        ValueError: a file is malformed.
    """
    with open(os.path.join(model_dir, DENSE_UPDATE_VARIABLES)) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{DENSE_UPDATE_VARIABLES}: expected a JSON object")
    dense = {}
    for name, info in doc.items():
        try:
            dense[name] = DenseVariableInfo(int(info["id"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{DENSE_UPDATE_VARIABLES}: bad entry {name!r}: {exc}") from None
    tables = {}
    path = os.path.join(model_dir, EMBED_NAME_TO_IDS)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) != 4:
                raise ValueError(f"{path}:{lineno}: expected name<TAB>id<TAB>rows<TAB>dim")
            try:
                tables[parts[0]] = TableInfo(int(parts[1]), int(parts[2]), int(parts[3]))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: bad number in {line!r}") from None
    return IdMaps(dense, tables)
