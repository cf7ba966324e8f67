"""The delta format's vocabulary: constants, limits, decoded data and the format error.

Shared by the encoder (``publisher.delta_encoder``, which writes the wire layout and
documents it), the decoder (``publisher.delta_decoder``) and the version assembler
(``publisher.version_assembler``). The field numbers live in ``protos/delta.proto``.

Decoded data: a ``DecodedChunk`` is one validated message; a ``DeltaVersion`` is all chunks
of one ``(generation, version)`` merged. Both carry the ``VersionHeader`` that every chunk of
the version repeats, and both expose the header's fields directly (``chunk.version``). Values
are float32 whatever the wire value type; ids are int64.

Depends on numpy and the generated ``odl.protos.delta_pb2`` only (no torch, no trainer code),
so serving and offline tools can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from odl.protos import delta_pb2

FORMAT_VERSION = 1

KINDS = {"dense": delta_pb2.DENSE, "sparse": delta_pb2.SPARSE, "both": delta_pb2.BOTH}
KIND_NAMES = {v: k for k, v in KINDS.items()}
VALUE_TYPES = {"fp32": delta_pb2.FP32, "fp16": delta_pb2.FP16}
VALUE_TYPE_NAMES = {v: k for k, v in VALUE_TYPES.items()}
WIRE_DTYPES = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}
ID_DTYPE = np.dtype("<i8")

# Sanity limits: the encoder refuses to write beyond them, the decoder checks them before
# anything is allocated.
MAX_DIM = 1 << 16
MAX_DENSE_ELEMENTS = 1 << 30
MAX_SHAPE_RANK = 8


class DeltaFormatError(ValueError):
    """A delta message is malformed, corrupted or hostile.

    ``reason`` names the check that failed; serving and crash recovery count rejected
    messages per reason. The decoder (``decode_chunk``) uses ``oversize``, ``unparsable``,
    ``truncated``, ``format_version``, ``chunk_index``, ``kind``, ``value_type``,
    ``crc_mismatch``, ``shape``, ``values_length``, ``duplicate``, ``dim``, ``ids_length``,
    ``ids`` and ``version_rows``; the assembler (``VersionAssembler``) ``dense_slices`` and
    ``dim``; readers of a topic (``publisher.delta_stream``) ``empty`` (a message without a
    value), ``other_model`` (another model's generation) and ``fenced_generation``.

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
        full_republish: the version carries every row its generation ever published and
            every dense variable (published after the delta topic lost versions).
        last_full_version: the generation's newest full republish acknowledged before this
            version was encoded (0 = none).
        last_full_offset: delta topic offset of that full version's first chunk (-1 = none).
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
    full_republish: bool = False
    last_full_version: int = 0
    last_full_offset: int = -1

    @property
    def has_republish_mark(self) -> bool:
        """Whether the version carries a ``RepublishMark`` on the wire."""
        return self.full_republish or self.last_full_version > 0


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
        deletes: table id -> raw ids deleted from a dynamic table (before the rows apply).
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
    deletes: dict[int, np.ndarray] = field(default_factory=dict)


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
        deletes: table id -> raw ids deleted from a dynamic table (unique; applied before
            ``sparse``).
    """

    header: VersionHeader
    value_type: str
    dense: dict[int, np.ndarray]
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    chunk_count: int
    nbytes: int
    deletes: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def num_deletes(self) -> int:
        """Deleted ids carried."""
        return sum(len(ids) for ids in self.deletes.values())
