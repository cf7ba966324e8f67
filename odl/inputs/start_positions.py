"""Where a Kafka source starts reading each partition.

Start positions, first match wins:

1. positions restored from a checkpoint (next offset to read per partition; partitions the
   checkpoint does not know start at their beginning),
2. ``offset_info`` ``{"timestamp": s}`` / ``offset_time``: the first offset whose message
   timestamp is >= s (a partition with none starts at its end),
3. ``offset_info`` ``{"<partition>": <offset>}`` / repeated ``offset``: those offsets (unlisted
   partitions start at their beginning),
4. otherwise offset 0 (the partition's beginning).

A restored position below the log start (retention deleted those records before they were
trained) starts at the log start; the loss is logged as an error and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from confluent_kafka import KafkaException, TopicPartition

logger = logging.getLogger(__name__)

__all__ = ["StartPositions", "resolve_start_offsets", "start_positions_from_config"]


@dataclass
class StartPositions:
    """How to position each partition at start."""

    checkpoint: Optional[dict[int, int]] = None
    timestamp_s: Optional[float] = None
    offsets: Optional[dict[int, int]] = None


def start_positions_from_config(
    offset_info: Optional[tuple[str, object]],
    offset_time: int,
    offsets: list[int],
    checkpoint_positions: Optional[dict[int, int]],
) -> StartPositions:
    """Builds :class:`StartPositions` with the documented precedence.

    Args:
        offset_info: parsed ``offset_info`` (``("timestamp", s)`` or ``("offsets", {p: o})``).
        offset_time: ``offset_time`` seconds (0 = unset).
        offsets: EasyRec's repeated ``offset`` field (partition i starts at offsets[i]).
        checkpoint_positions: positions restored from a checkpoint, if any.

    Returns:
        The start rules for :class:`KafkaSource`.
    """
    if checkpoint_positions is not None:
        return StartPositions(checkpoint=dict(checkpoint_positions))
    if offset_info is not None:
        kind, value = offset_info
        if kind == "timestamp":
            return StartPositions(timestamp_s=float(value))  # type: ignore[arg-type]
        return StartPositions(offsets={int(k): int(v) for k, v in dict(value).items()})  # type: ignore[call-overload]
    if offset_time:
        return StartPositions(timestamp_s=float(offset_time))
    if offsets:
        return StartPositions(offsets={i: int(o) for i, o in enumerate(offsets)})
    return StartPositions()


def resolve_start_offsets(
    start: StartPositions,
    partitions: Sequence[int],
    lows: dict[int, int],
    offsets_at: Callable[[int], list[TopicPartition]],
    high_watermark: Callable[[int], int],
    on_deleted: Callable[[int, int], None],
) -> dict[int, int]:
    """The first offset to read per partition, by ``start``'s rules (module docstring).

    Args:
        start: the start rules.
        partitions: the partitions read.
        lows: each partition's log start (-1: unknown).
        offsets_at: ``timestamp ms -> offsets_for_times`` of every partition.
        high_watermark: a partition's log end.
        on_deleted: ``(partition, records)`` for records retention deleted before they were
            trained (a checkpoint's position below the log start).

    Returns:
        Partition -> offset.

    Raises:
        KafkaException: a partition's time lookup failed.
    """
    if start.checkpoint is not None:
        out = {}
        for p in partitions:
            if p in start.checkpoint:
                off = int(start.checkpoint[p])
                if 0 <= lows[p] and off < lows[p]:
                    logger.error(
                        "partition %d: checkpoint offset %d is below the log start %d; "
                        "records %d..%d were deleted by retention and cannot be trained",
                        p, off, lows[p], off, lows[p] - 1)
                    on_deleted(p, lows[p] - off)
                    off = lows[p]
                out[p] = off
            else:
                logger.info("partition %d is not in the checkpoint: starting at its "
                            "beginning", p)
                out[p] = max(lows[p], 0)
        return out
    if start.timestamp_s is not None:
        out = {}
        for tp in offsets_at(int(start.timestamp_s * 1000)):
            if tp.error is not None:
                raise KafkaException(tp.error)
            # no message at or after the timestamp: start at the end
            out[tp.partition] = high_watermark(tp.partition) if tp.offset < 0 else tp.offset
        return out
    if start.offsets is not None:
        unknown = sorted(set(start.offsets) - set(partitions))
        if unknown:
            logger.warning("offset_info names partitions %s that the topic does not have",
                           unknown)
        return {p: int(start.offsets.get(p, max(lows[p], 0))) for p in partitions}
    return {p: max(lows[p], 0) for p in partitions}
