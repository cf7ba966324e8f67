"""The messages between the trainer and its Kafka input process, one dataclass per kind.

Wire layout: one socketpair with ``odl.inputs.child_process`` framing (a 4-byte big-endian
length, then a pickle of one of the dataclasses below). Both ends are this package on one
machine: a pickle names its class by module path, so both must run the same code.

Trainer -> child (``ToChild``):

* ``InputProcessInit``, exactly once, first: what the child needs to open the source.
* ``CreditGrant(batches)``: room for ``batches`` more batches.
* ``CommitRequest(positions)``: commit ``{partition: next_offset}`` to the consumer group
  on the next read (monitoring only; the trainer's checkpoints hold the positions).
* ``CloseRequest(final_positions)``: stop reading, commit ``final_positions``
  synchronously (None: commit nothing), close the consumer, answer ``InputClosed``, exit 0.

Child -> trainer (``ToTrainer``):

* ``InputOpened(starts, partitions)``, once, when the partitions are assigned.
* ``InputBatch``: one built batch, sent only against a credit.
* ``InputStatus``: the consumer's state (positions, watermarks, broker error, retention
  risk), every ``STATUS_INTERVAL_SECS`` (and inside every ``InputBatch``, without the
  retention risk).
* ``InputFailure(kind, text)``: ``kind`` ``"timeout"`` (the topic did not appear in time)
  or ``"failed"`` (``text`` is a traceback); the child's last message, then it exits 1.
* ``InputClosed``: the last message after a ``CloseRequest``, or, unasked, when a finite
  input (``file_stream_input`` past its ``end_day``) handed out its last batch.

Flow control is by credit: the trainer grants its initial credit in ``InputProcessInit``
and one more batch for each batch it takes, and the child sends a batch only against a
credit, so the batches in flight never exceed the credit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import numpy as np

from odl.inputs.start_positions import StartPositions

# How often the child reports the consumer's state (watermarks, broker error, counters).
STATUS_INTERVAL_SECS = 0.25

TIMEOUT = "timeout"
FAILED = "failed"
FailureKind = Literal["timeout", "failed"]


# ---------------------------------------------------------------------------- trainer -> child
@dataclass
class InputProcessInit:
    """What the child needs to open the source (sent once, first).

    Attributes:
        config: the serialized pipeline config (for the feature builder).
        source_args: ``KafkaSource`` keyword arguments except ``start``.
        start: the start position rules.
        num_workers: feature build worker processes the child starts (0: build in its reader).
        max_queued: batches the child's prefetcher builds ahead.
        credit: batches the trainer can take at once (its initial credit).
        log_level: the trainer's logging level.
    """

    config: bytes
    source_args: dict[str, Any] = field(repr=False)  # holds kafka_config (may hold secrets)
    start: StartPositions
    num_workers: int = 0
    max_queued: int = 2
    credit: int = 3
    log_level: int = logging.INFO


@dataclass
class CreditGrant:
    """Room for more batches.

    Attributes:
        batches: how many more batches the child may send.
    """

    batches: int


@dataclass
class CommitRequest:
    """Commit positions to the consumer group on the next read (monitoring only).

    Attributes:
        positions: next offset per partition.
    """

    positions: dict[int, int]


@dataclass
class CloseRequest:
    """Stop reading, commit, close the consumer and exit.

    Attributes:
        final_positions: next offset per partition to commit synchronously, or None.
    """

    final_positions: Optional[dict[int, int]]


ToChild = Union[InputProcessInit, CreditGrant, CommitRequest, CloseRequest]


# ---------------------------------------------------------------------------- child -> trainer
@dataclass
class InputOpened:
    """The source is open and its partitions assigned.

    Attributes:
        starts: the start position (next offset) per assigned partition.
        partitions: the assigned partitions.
    """

    starts: dict[int, int]
    partitions: list[int]


@dataclass
class InputStatus:
    """The consumer's live state, as the child last saw it.

    Attributes:
        partition_state: per partition ``(position, high_watermark, low_watermark)``.
        broker_error: why the broker is unreachable, or None.
        records_consumed: records read from Kafka so far.
        source: the source's own report (a file stream's splits; empty for Kafka).
        retention: the Kafka source's retention risk report
            (``odl.inputs.retention_risk.RetentionReport.as_dict``); None for other sources,
            before the first one and in a batch's status.
    """

    partition_state: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    broker_error: Optional[str] = None
    records_consumed: int = 0
    source: dict = field(default_factory=dict)
    retention: Optional[dict] = None


@dataclass
class InputBatch:
    """One built batch.

    Attributes:
        arrays: the feature builder's ``BatchArrays``, None when every record was rejected.
        accepted: indices of the raw records in ``arrays``.
        rejected: (index, reason) per malformed record.
        rejected_values: the raw value of each rejected record, by index (dead letters).
        positions: next offset per partition after this batch.
        partitions: partition of each raw record.
        offsets: offset of each raw record.
        timestamps_ms: Kafka timestamp of each raw record.
        read_time: when the batch left the source (time.time()).
        status: the consumer's state when the batch was sent.
    """

    arrays: Any
    accepted: np.ndarray
    rejected: list[tuple[int, str]]
    rejected_values: dict[int, bytes]
    positions: dict[int, int]
    partitions: np.ndarray
    offsets: np.ndarray
    timestamps_ms: np.ndarray
    read_time: float
    status: InputStatus


@dataclass
class InputFailure:
    """The child failed (its last message).

    Attributes:
        kind: ``"timeout"`` (the topic did not appear in time) or ``"failed"``.
        text: what happened (a traceback for ``"failed"``).
    """

    kind: FailureKind
    text: str


@dataclass
class InputClosed:
    """The child committed, closed its consumer and is exiting (after a ``CloseRequest``)."""


ToTrainer = Union[InputOpened, InputBatch, InputStatus, InputFailure, InputClosed]
