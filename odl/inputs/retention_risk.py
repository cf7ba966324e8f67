"""Retention risk: will the broker delete records of a partition before the trainer reads them?

A Kafka topic with size or time retention deletes whole segments, oldest first. A trainer
that falls behind far enough loses the records it has not read yet; the source notices only
afterwards (its position is below the log start, ``offset_resets``). The
:class:`RetentionEstimator` says so ahead of time, per partition and for the whole input,
from what the source sees anyway:

* observations of the read position (the next offset to read), the low and high watermarks
  and the age of the record at the position (its Kafka timestamp; the source uses the last
  record it read, at most as old), every refresh of the watermarks;
* the size of the records it reads (``bytes_per_record``: values plus
  ``record_overhead_bytes`` for Kafka's framing and a small key);
* the topic's ``retention.bytes``, ``retention.ms`` and ``segment.bytes``
  (:class:`RetentionLimits`, read with DescribeConfigs by the source about once a minute).

Three signals, each giving the seconds left before the segment holding the position is
deleted; the smallest wins (``limited_by`` names it):

* **size**: a partition is sure to keep ``retention.bytes`` less one segment (Kafka deletes
  the oldest segment while the rest still holds ``retention.bytes``; the segment boundary
  relative to the position is unknown). That is the capacity in records at the average
  record size; the headroom is the capacity less the lag, the time left the headroom over the lag's
  growth rate (records/s, the least-squares slope of the lag over ``window_s``);
* **time**: the record at the position is deleted once it is older than ``retention.ms`` (its
  segment may live a little longer); the time left is what remains of ``retention.ms`` over
  the growth rate of its age (1 s/s for a stalled reader, about 0 for one keeping pace). It
  needs two ages at least a second apart: the first record of a sparse stream after a pause
  is read at once, and its predecessor's age says nothing about it;
* **log start** (config-free): while the log start moves (the partition is at its limit),
  the distance position − low watermark is the headroom, and its shrinking rate gives the
  time left. It also corrects a wrong size estimate (compression, larger keys).

States:

* ``"losing"``: records were deleted before they were read: the position is below the log
  start, or the source reset a position for that reason (:meth:`RetentionEstimator.note_loss`)
  within the last ``loss_hold_s``;
* ``"behind"``: records wait to be read (lag > 0) and either ``seconds_to_loss`` is at most
  ``warn_seconds`` (default 600 s: time for an operator to raise the retention or scale the
  trainer), or the headroom is at most ``warn_headroom_fraction`` (default 0.2) of the
  capacity (by size, or by age: with the default, the record at the position is older than
  80 % of ``retention.ms``), growing or not;
* ``"ok"`` otherwise. ``seconds_to_loss`` is None when no signal foresees a loss (lag not
  growing, no limit known), ``headroom_records`` None without a size limit (and before the
  log start moves).

Everything here is pure bookkeeping: times are passed in (monotonic seconds for
observations, ages in seconds), so tests drive it with synthetic observations.
:class:`RetentionWarnings` turns reports into rate-limited log lines.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from odl.kafka.topic_admin import describe_retention

logger = logging.getLogger(__name__)

OK = "ok"
BEHIND = "behind"
LOSING = "losing"
STATE_LEVELS = {OK: 0, BEHIND: 1, LOSING: 2}

DEFAULT_WARN_SECONDS = 600.0
DEFAULT_WARN_HEADROOM_FRACTION = 0.2
DEFAULT_WINDOW_SECONDS = 60.0
DEFAULT_LOSS_HOLD_SECONDS = 300.0
# Kafka's per-record framing (length, attributes, timestamp and offset deltas, key and value
# lengths, header count) plus a small key; batch headers spread over a batch's records
RECORD_OVERHEAD_BYTES = 16
# a rate needs observations at least this far apart
_MIN_SPAN_SECONDS = 1.0
# observations closer than this to the previous one are not kept (a parked source asks for
# the watermarks every 50 ms)
_MIN_OBSERVATION_GAP_SECONDS = 0.5
# records over which the average record size follows a change (exponential weighting)
_RECORD_SIZE_MEMORY = 10_000


@dataclass(frozen=True)
class RetentionLimits:
    """A topic's retention settings (None: no such limit, or not known).

    Attributes:
        retention_bytes: size limit per partition in bytes.
        retention_ms: age limit in milliseconds.
        segment_bytes: segment size in bytes.
    """

    retention_bytes: Optional[int] = None
    retention_ms: Optional[int] = None
    segment_bytes: Optional[int] = None

    @classmethod
    def from_configs(cls, configs: Mapping[str, str]) -> RetentionLimits:
        """Reads ``retention.bytes``, ``retention.ms`` and ``segment.bytes``.

        -1, 0, a missing or an unreadable value: no such limit.

        Args:
            configs: topic config name -> value, as DescribeConfigs returns them.

        Returns:
            The limits.
        """

        def positive(key: str) -> Optional[int]:
            try:
                value = int(configs[key])
            except (KeyError, TypeError, ValueError):
                return None
            return value if value > 0 else None

        return cls(positive("retention.bytes"), positive("retention.ms"),
                   positive("segment.bytes"))

    @property
    def kept_bytes(self) -> Optional[int]:
        """Bytes a partition is sure to keep: ``retention.bytes`` less one segment.

        At least half of ``retention.bytes`` (a segment as large as the limit). None without
        a size limit.
        """
        if self.retention_bytes is None:
            return None
        segment = self.segment_bytes or 0
        return self.retention_bytes - min(segment, self.retention_bytes // 2)

    def describe(self) -> str:
        """The limits as text, e.g. ``2 MiB per partition, 24 h``."""
        return describe_retention({
            "retention.bytes": str(self.retention_bytes or -1),
            "retention.ms": str(self.retention_ms or -1),
        })

    def as_dict(self) -> dict[str, Optional[int]]:
        """JSON-friendly form."""
        return {"retention_bytes": self.retention_bytes, "retention_ms": self.retention_ms,
                "segment_bytes": self.segment_bytes}


@dataclass(frozen=True)
class PartitionRisk:
    """One partition's retention risk.

    Attributes:
        partition: the partition.
        state: ``"ok"``, ``"behind"`` or ``"losing"`` (see the module docstring).
        seconds_to_loss: seconds until unread records are deleted; None when no loss is
            foreseen (0: now).
        headroom_records: how many more records the lag can grow by before the segment
            holding the position is deleted; None without a known size limit.
        lag: records between the read position and the log end.
        lag_growth_per_s: the lag's growth rate over the window (records/s), None before two
            observations.
        limited_by: the signal that gave ``seconds_to_loss`` (or the headroom):
            ``"size"``, ``"time"``, ``"log_start"``, or None.
        records_lost: records deleted before they were read, since the start.
        read_position: the next offset to read (the trainer's position is at most the
            batches in flight behind it).
        low_watermark: the log start.
    """

    partition: int
    state: str = OK
    seconds_to_loss: Optional[float] = None
    headroom_records: Optional[int] = None
    lag: Optional[int] = None
    lag_growth_per_s: Optional[float] = None
    limited_by: Optional[str] = None
    records_lost: int = 0
    read_position: Optional[int] = None
    low_watermark: Optional[int] = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (without ``partition``: the key says it)."""
        return {
            "state": self.state,
            "seconds_to_loss": (None if self.seconds_to_loss is None
                                else round(self.seconds_to_loss, 1)),
            "headroom_records": self.headroom_records,
            "lag": self.lag,
            "lag_growth_per_s": (None if self.lag_growth_per_s is None
                                 else round(self.lag_growth_per_s, 2)),
            "limited_by": self.limited_by,
            "records_lost": self.records_lost,
            "read_position": self.read_position,
            "low_watermark": self.low_watermark,
        }


@dataclass(frozen=True)
class RetentionReport:
    """The retention risk of every partition and of the whole input.

    Attributes:
        partitions: per partition risk.
        limits: the topic's limits (None: not read yet).
        bytes_per_record: the average record size used (None: no record read yet).
        configs_error: why the limits could not be read last time, or None.
        warn_seconds: the ``seconds_to_loss`` below which a partition is behind.
    """

    partitions: dict[int, PartitionRisk] = field(default_factory=dict)
    limits: Optional[RetentionLimits] = None
    bytes_per_record: Optional[float] = None
    configs_error: Optional[str] = None
    warn_seconds: float = DEFAULT_WARN_SECONDS

    @property
    def worst(self) -> Optional[PartitionRisk]:
        """The partition closest to losing records (highest state, then fewest seconds)."""
        if not self.partitions:
            return None
        return min(self.partitions.values(), key=lambda r: (
            -STATE_LEVELS[r.state],
            math.inf if r.seconds_to_loss is None else r.seconds_to_loss,
            math.inf if r.headroom_records is None else r.headroom_records,
            r.partition))

    def as_dict(self) -> dict[str, Any]:
        """The input's summary plus ``partitions`` (``str(partition)`` -> its dict).

        Summary: ``state`` (the worst partition's), ``partition`` (which one),
        ``seconds_to_loss`` and ``headroom_records`` (the smallest of any partition),
        ``records_lost`` (all partitions), ``retention`` (the limits as text), the limits,
        ``bytes_per_record``, ``configs_error`` and ``warn_seconds``.
        """
        worst = self.worst
        seconds = [r.seconds_to_loss for r in self.partitions.values()
                   if r.seconds_to_loss is not None]
        headroom = [r.headroom_records for r in self.partitions.values()
                    if r.headroom_records is not None]
        limits = self.limits or RetentionLimits()
        return {
            "state": worst.state if worst is not None else OK,
            "partition": worst.partition if worst is not None else None,
            "seconds_to_loss": round(min(seconds), 1) if seconds else None,
            "headroom_records": min(headroom) if headroom else None,
            "records_lost": sum(r.records_lost for r in self.partitions.values()),
            "retention": limits.describe() if self.limits is not None else None,
            **limits.as_dict(),
            "bytes_per_record": (None if self.bytes_per_record is None
                                 else round(self.bytes_per_record, 1)),
            "configs_error": self.configs_error,
            "warn_seconds": self.warn_seconds,
            "partitions": {str(p): r.as_dict() for p, r in sorted(self.partitions.items())},
        }


@dataclass
class _Observation:
    t: float
    lag: int
    distance: int  # position - low watermark
    low: int
    age_s: Optional[float]


@dataclass
class _Track:
    """One partition's recent observations."""

    points: deque = field(default_factory=deque)
    position: int = 0
    low: int = -1
    high: int = -1
    age_s: Optional[float] = None
    records_lost: int = 0
    last_loss_t: Optional[float] = None


def _slope(points: Sequence[tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of ``(t, y)`` points; None for fewer than two or a short span."""
    if len(points) < 2 or points[-1][0] - points[0][0] < _MIN_SPAN_SECONDS:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var


class RetentionEstimator:
    """Per-partition retention risk from observations (see the module docstring).

    Thread-safe: the source's reading thread and its watch thread both feed it.

    Args:
        warn_seconds: a partition whose ``seconds_to_loss`` is at most this is ``"behind"``.
        warn_headroom_fraction: a partition whose headroom is at most this fraction of what
            retention keeps (records, or ``retention.ms`` by age) is ``"behind"``.
        window_s: rates are the slopes of the observations of the last ``window_s`` seconds.
        loss_hold_s: a partition stays ``"losing"`` this long after records were deleted
            before they were read.
        record_overhead_bytes: bytes a record takes at the broker beyond its value.
    """

    def __init__(self, warn_seconds: float = DEFAULT_WARN_SECONDS,
                 warn_headroom_fraction: float = DEFAULT_WARN_HEADROOM_FRACTION,
                 window_s: float = DEFAULT_WINDOW_SECONDS,
                 loss_hold_s: float = DEFAULT_LOSS_HOLD_SECONDS,
                 record_overhead_bytes: int = RECORD_OVERHEAD_BYTES) -> None:
        self.warn_seconds = float(warn_seconds)
        self.warn_headroom_fraction = float(warn_headroom_fraction)
        self.window_s = float(window_s)
        self.loss_hold_s = float(loss_hold_s)
        self.record_overhead_bytes = int(record_overhead_bytes)
        self._lock = threading.Lock()
        self._tracks: dict[int, _Track] = {}
        self._limits: Optional[RetentionLimits] = None
        self._configs_error: Optional[str] = None
        self._value_bytes: Optional[float] = None  # average value size

    # ------------------------------------------------------------------ inputs
    def set_limits(self, limits: Optional[RetentionLimits], error: Optional[str] = None) -> None:
        """Sets the topic's limits.

        None with ``error``: reading them failed; the previous limits stay in use.

        Args:
            limits: the limits read, or None.
            error: why they could not be read, or None.
        """
        with self._lock:
            if limits is not None:
                self._limits = limits
            self._configs_error = error

    @property
    def limits(self) -> Optional[RetentionLimits]:
        """The topic's limits in use (None: never read)."""
        return self._limits

    @property
    def configs_error(self) -> Optional[str]:
        """Why the limits could not be read the last time, or None."""
        return self._configs_error

    def note_records(self, count: int, value_bytes: int) -> None:
        """Records read: ``count`` of them, ``value_bytes`` of values in all.

        Args:
            count: records.
            value_bytes: the sum of their values' lengths.
        """
        if count <= 0:
            return
        mean = value_bytes / count
        with self._lock:
            if self._value_bytes is None:
                self._value_bytes = mean
            else:
                weight = 1.0 - math.exp(-count / _RECORD_SIZE_MEMORY)
                self._value_bytes += (mean - self._value_bytes) * max(weight, 1e-3)

    @property
    def bytes_per_record(self) -> Optional[float]:
        """Average bytes a record takes at the broker (None: no record read yet)."""
        value = self._value_bytes
        return None if value is None else value + self.record_overhead_bytes

    def observe(self, partition: int, t: float, position: int, low: int, high: int,
                position_age_s: Optional[float] = None) -> None:
        """One observation of a partition.

        Args:
            partition: the partition.
            t: when the watermarks were read (monotonic seconds).
            position: the next offset to read.
            low: the low watermark (log start); < 0: unknown (the observation is ignored).
            high: the high watermark (log end).
            position_age_s: the age of the record at the position (seconds), None when
                unknown.
        """
        if low < 0 or high < 0:
            return
        with self._lock:
            track = self._tracks.setdefault(partition, _Track())
            track.position, track.low, track.high = int(position), int(low), int(high)
            track.age_s = position_age_s
            points = track.points
            if not points or t - points[-1].t >= _MIN_OBSERVATION_GAP_SECONDS:
                points.append(_Observation(t, max(0, high - position), position - low, low,
                                           position_age_s))
            while points and points[0].t < t - self.window_s:
                points.popleft()

    def note_loss(self, partition: int, records: int, t: float) -> None:
        """The source moved a partition's position past records retention deleted.

        Args:
            partition: the partition.
            records: how many records were skipped.
            t: when (monotonic seconds).
        """
        with self._lock:
            track = self._tracks.setdefault(partition, _Track())
            track.records_lost += max(0, int(records))
            track.last_loss_t = t

    # ------------------------------------------------------------------ outputs
    def partition_risk(self, partition: int, now: float) -> PartitionRisk:
        """One partition's risk now.

        Args:
            partition: the partition.
            now: monotonic seconds (the clock of the observations).

        Returns:
            The risk (state ``"ok"`` and no figures before the first observation).
        """
        with self._lock:
            track = self._tracks.get(partition)
            if track is None or not track.points:
                return PartitionRisk(partition, records_lost=track.records_lost if track else 0)
            return self._risk(partition, track, now)

    def report(self, now: float) -> RetentionReport:
        """Every observed partition's risk and the limits in use.

        Args:
            now: monotonic seconds (the clock of the observations).

        Returns:
            The report.
        """
        with self._lock:
            parts = {p: (self._risk(p, tr, now) if tr.points
                         else PartitionRisk(p, records_lost=tr.records_lost))
                     for p, tr in self._tracks.items()}
            configs_error = self._configs_error
            limits = self._limits
        return RetentionReport(parts, limits, self.bytes_per_record, configs_error,
                               self.warn_seconds)

    def _risk(self, partition: int, track: _Track, now: float) -> PartitionRisk:
        points = list(track.points)
        lag = max(0, track.high - track.position)
        distance = track.position - track.low
        pending_loss = max(0, -distance)  # below the log start, not reset yet
        growth = _slope([(o.t, o.lag) for o in points])
        base = {"lag": lag, "lag_growth_per_s": growth,
                "records_lost": track.records_lost + pending_loss,
                "read_position": track.position, "low_watermark": track.low}
        if pending_loss or (track.last_loss_t is not None
                            and now - track.last_loss_t < self.loss_hold_s):
            return PartitionRisk(partition, LOSING, 0.0 if pending_loss else None,
                                 0 if pending_loss else None, limited_by="log_start", **base)
        seconds: list[tuple[float, str]] = []  # (seconds to loss, signal)
        headroom: Optional[float] = None
        headroom_kind: Optional[str] = None
        capacity: Optional[float] = None
        tight_kind: Optional[str] = None  # a headroom under its warning fraction
        limits = self._limits or RetentionLimits()
        bpr = self.bytes_per_record
        kept = limits.kept_bytes
        if kept is not None and bpr:  # size
            capacity = kept / bpr
            headroom, headroom_kind = capacity - lag, "size"
            if lag > 0 and growth is not None and growth > 0:
                seconds.append((max(headroom, 0.0) / growth, "size"))
        if points[0].low < track.low and distance >= 0:  # log start: it moves, at the limit
            if headroom is None or distance < headroom:
                headroom, headroom_kind = float(distance), "log_start"
            kept_records = float(max(0, track.high - track.low))  # what it does keep
            if capacity is None or kept_records < capacity:
                capacity = kept_records
            shrink = _slope([(o.t, o.distance) for o in points])
            if lag > 0 and shrink is not None and shrink < 0:
                seconds.append((distance / -shrink, "log_start"))
        if headroom is not None and capacity and lag > 0:
            if headroom <= self.warn_headroom_fraction * capacity:
                tight_kind = headroom_kind
        if limits.retention_ms is not None and lag > 0 and track.age_s is not None:  # time
            keep_s = limits.retention_ms / 1000.0
            remaining = keep_s - track.age_s
            # two ages at least a second apart: behind for a while, not a record of a sparse
            # stream that has just arrived (its predecessor's age says little about it)
            aging = _slope([(o.t, o.age_s) for o in points if o.age_s is not None])
            if aging is not None and aging > 0:
                seconds.append((max(remaining, 0.0) / aging, "time"))
            if (aging is not None and tight_kind is None
                    and remaining <= self.warn_headroom_fraction * keep_s):
                tight_kind = "time"
        soonest = min(seconds) if seconds else None
        behind = tight_kind is not None or (soonest is not None
                                            and soonest[0] <= self.warn_seconds)
        limited_by = soonest[1] if soonest is not None else tight_kind or headroom_kind
        return PartitionRisk(
            partition, BEHIND if behind else OK,
            None if soonest is None else soonest[0],
            None if headroom is None else max(0, int(headroom)),
            limited_by=limited_by, **base)


def partition_warning(partition: str | int, risk: Mapping[str, Any],
                      retention: Optional[str] = None, topic: Optional[str] = None
                      ) -> Optional[str]:
    """The warning for one partition's risk dict (``PartitionRisk.as_dict``); None when ok.

    Args:
        partition: the partition.
        risk: its risk as a dict.
        retention: the topic's limits as text, or None.
        topic: the topic, or None.

    Returns:
        ``"behind: partition P will lose data in ~N s (lag L, headroom H records; retention
        R)"``, a ``"losing: ..."`` line, or None.
    """
    state = risk.get("state")
    where = f"partition {partition}" + (f" of topic {topic}" if topic else "")
    limits = f"; retention {retention}" if retention else ""
    if state == LOSING:
        return (f"losing: {where}: {risk.get('records_lost', 0)} records deleted by retention "
                f"before they were read (read position {risk.get('read_position')}, log start "
                f"{risk.get('low_watermark')}{limits})")
    if state != BEHIND:
        return None
    seconds = risk.get("seconds_to_loss")
    headroom = risk.get("headroom_records")
    headroom_text = "?" if headroom is None else str(headroom)
    when = (f"in ~{seconds:.0f} s" if seconds is not None
            else "if it falls further behind (lag not growing now)")
    return (f"behind: {where} will lose data {when} (lag {risk.get('lag')}, headroom "
            f"{headroom_text} records, limited by {risk.get('limited_by')}{limits})")


def input_warning(summary: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The warning for an input's report (``RetentionReport.as_dict``); None when ok.

    Args:
        summary: the report as a dict (its ``partitions`` included), or None.

    Returns:
        The worst partition's warning, or None.
    """
    if not summary or summary.get("state", OK) == OK:
        return None
    partition = summary.get("partition")
    risk = (summary.get("partitions") or {}).get(str(partition))
    if risk is None:
        return f"{summary['state']}: partition {partition}"
    return partition_warning(partition, risk, summary.get("retention"))


class RetentionWarnings:
    """Rate-limited log lines for retention reports.

    A partition turning ``"behind"`` or ``"losing"`` is logged at once (WARNING), then again
    at most every ``interval_s`` while it stays so; turning ``"ok"`` again is logged once
    (INFO).

    Args:
        topic: the topic, named in the lines.
        interval_s: least seconds between two lines of one partition in one state.
    """

    def __init__(self, topic: str, interval_s: float = 60.0) -> None:
        self.topic = topic
        self.interval_s = float(interval_s)
        self._last: dict[str, tuple[str, float]] = {}  # partition -> (state, logged at)

    def log(self, report: Mapping[str, Any], now: float) -> int:
        """Logs what changed in ``report`` (``RetentionReport.as_dict``).

        Args:
            report: the report as a dict.
            now: monotonic seconds.

        Returns:
            How many lines were logged.
        """
        lines = 0
        for p, risk in (report.get("partitions") or {}).items():
            state = risk.get("state", OK)
            before = self._last.get(p)
            if state == OK:
                if before is not None and before[0] != OK:
                    logger.info("partition %s of topic %s is no longer at risk of losing "
                                "records to retention (lag %s)", p, self.topic, risk.get("lag"))
                    self._last[p] = (OK, now)
                    lines += 1
                continue
            if before is not None and before[0] == state and now - before[1] < self.interval_s:
                continue
            text = partition_warning(p, risk, report.get("retention"), self.topic)
            logger.warning("%s", text)
            self._last[p] = (state, now)
            lines += 1
        return lines
