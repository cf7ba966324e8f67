"""Kafka sample source: explicit partition assignment, start positions, raw record batches.

The source reads every partition of one topic with a ``confluent_kafka.Consumer`` whose
partitions are assigned explicitly, never by group rebalancing, so the trainer knows exactly
which records it owns. The consumer group is only used to commit positions for
monitoring tools; the trainer's checkpoint is the source of truth.

Start positions: :mod:`odl.inputs.start_positions` (a checkpoint's, else the config's).

Records come out as :class:`RawBatch` objects carrying the positions *after* the batch, so a
consumer of batches can checkpoint exactly what it has trained.

Fetch pacing (``fetch_interval_ms`` > 0, the trainer's default 10 ms): the local queue
threshold is one record (``queued.min.messages`` 1) and a partition with records queued
locally is refetched only every ``fetch.queue.backoff.ms`` = ``fetch_interval_ms``; the
reader takes what is queued and, while its batch is not full, waits one interval before
looking again. Each fetch then carries an interval's worth of records, from any broker, at
the price of about two intervals of latency. Unpaced (0: a prefetch of four batches) has a
failure mode: against a broker without fetch long-polling a consumer at the log end refetches
at once, tens of thousands of times a second. Its queue backoff is ``UNPACED_QUEUE_BACKOFF_MS``
(50 ms): with librdkafka's default of 1 s, once one fetch returned more than the prefetch
threshold the partition was not fetched again for a second, and records waited up to a
second. ``bench/fetch_pacing.py`` measures both modes (figures in docs/benchmarks.md).

Parking (paced only): when a whole batch timeout brings nothing and every partition is at its
log end, the source unassigns its partitions (nothing fetched is pending, so nothing is
dropped) and asks for the log ends every 50 ms, assigning them again at its positions once
one moves, or once the broker is unreachable (outages are then handled as usual). ``parked``
says which state it is in. Unassign/assign rather than pause/resume: librdkafka drops
prefetched records on pause and fetches again only about a second after a resume.

Outages: librdkafka reconnects by itself and resumes fetching at the consumer's position, so
nothing is skipped or read twice. ``broker_error`` tells the trainer the broker is down, by the
rules of ``odl.kafka.broker_health`` (``error_cb`` outages, failing requests, metadata or
watermark queries), and is cleared only by a successful watermark query (every
``_WATERMARK_REFRESH_SECS``; records still queued locally prove nothing about the broker).

A position the partition no longer has (``auto.offset.reset`` is ``error``, librdkafka never
jumps by itself): above the log end, the broker lost records it had acknowledged (already
trained): reading continues at the new end, so records produced from now on are all read and
none is read twice; below the log start, retention deleted records: reading continues at the
log start. Both are logged as errors and counted in ``offset_resets``.

Retention risk, ahead of that (``watch_retention``, on by default): a watch thread
(``odl.inputs.retention_watch``) reads the topic's ``retention.bytes`` / ``retention.ms`` /
``segment.bytes`` once a minute, refreshes the watermarks when the reading thread has not for
``_WATERMARK_REFRESH_SECS`` (a trainer held in a long step or checkpoint stops reading, and
the log goes on growing) and keeps :meth:`KafkaSource.retention_report` current every
second: per partition whether records will be deleted before they are read
(``odl.inputs.retention_risk``), fed with every watermark refresh, the size of the values
read and the timestamp of the last record read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from odl.inputs.partition_assignment import rank_partitions
from odl.inputs.retention_watch import RetentionWatch
from odl.inputs.start_positions import StartPositions, resolve_start_offsets
from odl.kafka.broker_health import (
    OUT_OF_RANGE_CODES,
    BrokerHealth,
    ReportsBrokerHealth,
    error_text,
    out_of_range_target,
)
from odl.kafka.client_settings import consumer_config

logger = logging.getLogger(__name__)

# librdkafka's fetch.queue.backoff.ms when fetch pacing is off (fetch_interval_ms 0): how long
# a partition whose local queue passed the prefetch threshold waits before its next fetch
# (librdkafka's default, 1 s, left records waiting a second after every large fetch)
UNPACED_QUEUE_BACKOFF_MS = 50

_WATERMARK_REFRESH_SECS = 2.0
_PARKED_POLL_SECS = 0.05  # how often a parked source asks for the log ends


def _sleep(stop_event: Optional[threading.Event], seconds: float) -> bool:
    """Sleeps ``seconds`` or until ``stop_event`` is set; True when it was set."""
    if stop_event is None:
        time.sleep(seconds)
        return False
    return stop_event.wait(seconds)


@dataclass
class RawBatch:
    """Undecoded records plus where they came from.

    Attributes:
        values: message values in consumption order.
        partitions: partition of each value.
        offsets: offset of each value.
        timestamps_ms: Kafka message timestamp (produce time) of each value, ms.
        positions: next offset to read per partition after this batch (all assigned
            partitions, cumulative).
    """

    values: list[bytes]
    partitions: np.ndarray
    offsets: np.ndarray
    timestamps_ms: np.ndarray
    positions: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class PartitionState:
    """Live per-partition figures for status and lag."""

    position: int = 0
    high_watermark: int = -1
    low_watermark: int = -1

class KafkaSource(ReportsBrokerHealth):
    """Reads raw record batches from one Kafka topic.

    Args:
        servers: bootstrap servers.
        topic: topic to read.
        group: consumer group for monitoring commits.
        start: start position rules.
        batch_size: records per batch.
        batch_timeout_ms: emit a partial batch after this long without filling it.
        fetch_interval_ms: fetch pacing (see the module docstring); 0 = librdkafka's own.
        kafka_config: extra librdkafka settings, passed through.
        topic_wait_secs: how long to wait for the topic to exist (0 = forever).
        rank: this rank of ``world_size``: only its share of the partitions is read
            (``odl.inputs.partition_assignment``).
        world_size: ranks reading the topic together (1: every partition).
        watch_retention: keep a retention risk report (see the module docstring).
    """

    def __init__(
        self,
        servers: str,
        topic: str,
        group: str,
        start: StartPositions,
        batch_size: int,
        batch_timeout_ms: int = 200,
        kafka_config: Optional[Mapping[str, str]] = None,
        fetch_interval_ms: int = 0,
        topic_wait_secs: float = 0.0,
        rank: int = 0,
        world_size: int = 1,
        watch_retention: bool = True,
    ) -> None:
        self.rank, self.world_size = int(rank), int(world_size)
        self.servers = servers
        self.topic = topic
        self.group = group
        self._start = start
        self.batch_size = int(batch_size)
        self.batch_timeout = batch_timeout_ms / 1000.0
        self.fetch_interval = fetch_interval_ms / 1000.0
        self._topic_wait_secs = topic_wait_secs
        conf = consumer_config(servers, group, kafka_config)
        conf["error_cb"] = self._on_kafka_error
        conf["auto.offset.reset"] = "error"  # handled in _reset_offset
        # Prefetch a few batches, not librdkafka's default 100k messages: the trainer never
        # needs more, and against brokers that ignore fetch size limits every refetch returns
        # the whole backlog, which would burn the CPU the train step needs.
        owned: list[tuple[str, object]] = [("queued.max.messages.kbytes", 16384)]
        if fetch_interval_ms:
            # paced: refetch a partition only once its local queue is empty, or every
            # fetch_interval_ms while records are queued (see the module docstring)
            owned += [("queued.min.messages", 1), ("fetch.queue.backoff.ms", fetch_interval_ms)]
        else:
            owned += [("queued.min.messages", max(4 * self.batch_size, 1000)),
                      ("fetch.queue.backoff.ms", UNPACED_QUEUE_BACKOFF_MS)]
        for key, value in owned:
            if not kafka_config or key not in kafka_config:
                conf[key] = value
        self._consumer = Consumer(conf)
        # Log-end queries (ListOffsets) on a connection of their own: on the fetching
        # consumer's they would wait behind a large fetch in flight (a whole backlog from a
        # broker that ignores fetch size limits), time out, and make librdkafka drop the
        # connection and the fetch with it, so a far-behind reader would never catch up.
        self._offsets_consumer = Consumer(dict(conf))
        self._partitions: list[int] = []
        self.partition_state: dict[int, PartitionState] = {}
        self._positions: dict[int, int] = {}
        self._last_watermark_refresh = 0.0
        self._commit_lock = threading.Lock()
        self._pending_commit: Optional[dict[int, int]] = None
        self.health = BrokerHealth(f"kafka input {topic}")
        self.records_consumed = 0
        self.offset_resets = 0
        self.parked = False
        self._closed = False
        # watermark queries of the reading and the watch thread, one at a time
        self._watermark_lock = threading.Lock()
        self._retention = RetentionWatch(servers, topic, kafka_config)
        self.retention_estimator = self._retention.estimator
        self._watch_retention = watch_retention
        self._last_timestamp_ms: dict[int, int] = {}  # of the last record read, per partition

    # ------------------------------------------------------------------ start
    def open(self, stop_event: Optional[threading.Event] = None) -> dict[int, int]:
        """Resolves start positions and assigns the partitions.

        Args:
            stop_event: aborts waiting for the topic when set.

        Returns:
            The start position (next offset) per assigned partition.

        Raises:
            TimeoutError: the topic did not appear within ``topic_wait_secs``.
        """
        partitions = self._wait_for_partitions(stop_event)
        if self.world_size > 1:
            partitions = rank_partitions(partitions, self.rank, self.world_size)
        self._partitions = list(partitions)
        starts = self._resolve_starts()
        self._positions = dict(starts)
        for p, off in starts.items():
            self.partition_state[p] = PartitionState(position=off)
        self._consumer.assign([TopicPartition(self.topic, p, off) for p, off in starts.items()])
        self._refresh_watermarks(force=True)
        if self._watch_retention:
            self._retention.start(self._refresh_watermarks)
        logger.info("reading topic %s partitions %s from %s", self.topic, self._partitions,
                    starts)
        return starts

    def _wait_for_partitions(self, stop_event: Optional[threading.Event]) -> list[int]:
        deadline = time.monotonic() + self._topic_wait_secs if self._topic_wait_secs else None
        while True:
            try:
                md = self._consumer.list_topics(self.topic, timeout=5)
                tmd = md.topics.get(self.topic)
                if tmd is not None and tmd.error is None and tmd.partitions:
                    self.health.reachable()
                    return sorted(tmd.partitions)
                reason = f"topic {self.topic} does not exist yet"
            except KafkaException as exc:
                reason = f"broker unreachable: {error_text(exc)}"
            self.health.unreachable(reason)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"kafka topic {self.topic!r} on {self.servers}: {reason}")
            if stop_event is not None and stop_event.wait(1.0):
                raise InterruptedError("stopped while waiting for the topic")
            if stop_event is None:
                time.sleep(1.0)

    def _resolve_starts(self) -> dict[int, int]:
        lows = {p: self._watermarks(p)[0] for p in self._partitions}

        def deleted(p: int, records: int) -> None:
            self.retention_estimator.note_loss(p, records, time.monotonic())

        def at_times(ts_ms: int) -> list[TopicPartition]:
            return self._consumer.offsets_for_times(
                [TopicPartition(self.topic, p, ts_ms) for p in self._partitions], timeout=10)

        return resolve_start_offsets(self._start, self._partitions, lows, at_times,
                                     lambda p: self._watermarks(p)[1], deleted)

    def _watermarks(self, partition: int) -> tuple[int, int]:
        return self._offsets_consumer.get_watermark_offsets(
            TopicPartition(self.topic, partition), timeout=10, cached=False
        )

    # ------------------------------------------------------------------ read
    def read_batch(self, stop_event: Optional[threading.Event] = None) -> Optional[RawBatch]:
        """Reads up to ``batch_size`` records, waiting at most ``batch_timeout``.

        Args:
            stop_event: returns early (with what was read) when set.

        Returns:
            A batch, or None when nothing arrived in time.
        """
        self._maybe_commit()
        self._refresh_watermarks()
        values: list[bytes] = []
        parts: list[int] = []
        offs: list[int] = []
        tss: list[int] = []
        deadline = time.monotonic() + self.batch_timeout
        if self.parked and not self._wait_while_parked(deadline, stop_event):
            return None
        while len(values) < self.batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (stop_event is not None and stop_event.is_set()):
                break
            if self.fetch_interval:
                # take what is queued; if that does not fill the batch, let records gather
                # (locally and at the broker) for one interval instead of polling each one
                msgs = self._consumer.consume(num_messages=self.batch_size - len(values),
                                              timeout=0)
                if len(values) + len(msgs) < self.batch_size:
                    _sleep(stop_event, min(remaining, self.fetch_interval))
            else:
                msgs = self._consumer.consume(
                    num_messages=self.batch_size - len(values), timeout=min(remaining, 0.1)
                )
            if not msgs:
                continue
            if any([m.error() is not None for m in msgs]):
                # rare: handle each message in order (an error can move a partition)
                for msg in msgs:
                    err = msg.error()
                    if err is not None:
                        self._handle_error(err, msg.partition())
                        continue
                    self._take([msg], values, parts, offs, tss)
            else:
                self._take(msgs, values, parts, offs, tss)
        if not values:
            if self.fetch_interval and not (stop_event is not None and stop_event.is_set()):
                self._park_if_caught_up()
            return None
        self.records_consumed += len(values)
        for p, off in self._positions.items():
            self.partition_state[p].position = off
        return RawBatch(
            values=values,
            partitions=np.asarray(parts, dtype=np.int32),
            offsets=np.asarray(offs, dtype=np.int64),
            timestamps_ms=np.asarray(tss, dtype=np.int64),
            positions=dict(self._positions),
        )

    def _take(self, msgs: list, values: list[bytes], parts: list[int], offs: list[int],
              tss: list[int]) -> None:
        """Appends error-free messages to the batch lists and advances the positions.

        One pass per attribute (C-level iteration) rather than a Python loop per message: the
        reading thread shares the GIL with the train step.
        """
        v_new = [m.value() or b"" for m in msgs]
        values.extend(v_new)
        p_new = [m.partition() for m in msgs]
        o_new = [m.offset() for m in msgs]
        t_new = [m.timestamp()[1] for m in msgs]
        parts.extend(p_new)
        offs.extend(o_new)
        tss.extend(t_new)
        # offsets rise within a partition, so the last one seen per partition wins
        for p, o in dict(zip(p_new, o_new, strict=True)).items():
            self._positions[p] = o + 1
        self._last_timestamp_ms.update(zip(p_new, t_new, strict=True))
        self.retention_estimator.note_records(len(v_new), sum(map(len, v_new)))

    # ------------------------------------------------------------------ parking
    def _caught_up(self) -> bool:
        """Every partition's position equals its log end, queried now (broker reachable)."""
        self._refresh_watermarks(force=True)
        if self.broker_error is not None:
            return False
        return all(self.partition_state[p].high_watermark == self._positions.get(p)
                   for p in self._partitions)

    def _park_if_caught_up(self) -> None:
        """Unassigns the partitions if every one is at its log end.

        Called after a whole batch timeout brought nothing; nothing fetched is pending then,
        so nothing is dropped.
        """
        if self._partitions and self._caught_up():
            self._consumer.unassign()
            self.parked = True
            logger.debug("input idle at %s: parked", self._positions)

    def _wait_while_parked(self, deadline: float,
                           stop_event: Optional[threading.Event]) -> bool:
        """Polls the log ends until one moves or ``deadline`` passes.

        Returns:
            True once the input moved (the partitions are assigned again at their
            positions), False at the deadline or on stop.
        """
        while True:
            if not self._caught_up():  # new records, a shorter log, or the broker is away
                self._consumer.assign([TopicPartition(self.topic, p, self._positions[p])
                                       for p in self._partitions])
                self.parked = False
                logger.debug("input moved: fetching again from %s", self._positions)
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if _sleep(stop_event, min(remaining, _PARKED_POLL_SECS)):
                return False

    def _handle_error(self, err: KafkaError, partition: Optional[int] = None) -> None:
        code = err.code()
        if code == KafkaError._PARTITION_EOF:
            return
        if self.health.on_request_error(err):
            return
        if code in OUT_OF_RANGE_CODES:
            self._reset_offset(partition)
            return
        if err.fatal():
            raise KafkaException(err)
        logger.warning("kafka consumer error: %s", err.str())

    def _reset_offset(self, partition: Optional[int]) -> None:
        """Moves a partition whose position is out of range (see the module docstring)."""
        if partition is None or partition not in self._positions:
            logger.error("kafka: offset out of range on an unknown partition (%s)", partition)
            return
        pos = self._positions[partition]
        try:
            low, high = self._watermarks(partition)
        except KafkaException as exc:
            logger.warning("partition %d: position %d out of range, watermarks unavailable "
                           "(%s); retrying", partition, pos, exc)
            time.sleep(1.0)
            target = pos
        else:
            target = out_of_range_target(pos, low, high).offset
            if pos > high:
                logger.error("partition %d ends at offset %d, before the position %d: the "
                             "broker lost %d acknowledged records (already trained); reading "
                             "on from its end", partition, high, pos, pos - high)
            else:
                logger.error("partition %d: records %d..%d were deleted by retention before "
                             "they were trained; reading on from %d", partition, pos,
                             low - 1, target)
                self.retention_estimator.note_loss(partition, target - pos, time.monotonic())
            self.offset_resets += 1
            self._positions[partition] = target
            self.partition_state[partition].position = target
        self._consumer.assign([TopicPartition(self.topic, p, off)
                               for p, off in sorted(self._positions.items())])

    def _on_kafka_error(self, err: KafkaError) -> None:
        """Handles librdkafka's ``error_cb`` (runs inside ``consume`` on the reading thread)."""
        self.health.on_client_error(err)

    def _refresh_watermarks(self, force: bool = False) -> None:
        """Queries every partition's watermarks if due (or ``force``) and observes them.

        Called by the reading thread and the retention watch; a call that is not forced
        returns at once while the other thread queries.
        """
        now = time.monotonic()
        if not force and now - self._last_watermark_refresh < _WATERMARK_REFRESH_SECS:
            return
        if not self._watermark_lock.acquire(blocking=force):
            return
        try:
            if self._closed:
                return
            self._last_watermark_refresh = now
            for p in self._partitions:
                try:
                    low, high = self._offsets_consumer.get_watermark_offsets(
                        TopicPartition(self.topic, p), timeout=2, cached=False
                    )
                except KafkaException as exc:
                    self.health.unreachable(f"watermark query failed: {error_text(exc)}")
                    # retry sooner than the normal refresh while the broker is away
                    self._last_watermark_refresh = now - _WATERMARK_REFRESH_SECS / 2
                    return
                st = self.partition_state.setdefault(p, PartitionState())
                st.low_watermark, st.high_watermark = low, high
                self._observe(p, time.monotonic(), low, high)
            self.health.reachable()
        finally:
            self._watermark_lock.release()

    # ------------------------------------------------------------------ retention risk
    def _observe(self, partition: int, now: float, low: int, high: int) -> None:
        """Feeds one partition's watermarks, position and position age to the estimator."""
        position = self._positions.get(partition)
        if position is None:
            return
        ts_ms = self._last_timestamp_ms.get(partition)
        # the record at the position is at most as old as the last one read before it
        age = (max(0.0, time.time() - ts_ms / 1000.0)
               if ts_ms is not None and ts_ms > 0 and position < high else None)
        self.retention_estimator.observe(partition, now, position, low, high, age)

    def retention_report(self) -> Optional[dict]:
        """The retention risk report (``RetentionReport.as_dict``), at most a second old.

        Returns:
            The report, or None before the first one (or without ``watch_retention``).
        """
        return self._retention.report

    # ------------------------------------------------------------------ commit
    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Asks the reading thread to commit ``positions`` to the consumer group.

        Commits are for monitoring tools only and happen on the next read.

        Args:
            positions: next offset per partition.
        """
        with self._commit_lock:
            self._pending_commit = dict(positions)

    def _maybe_commit(self) -> None:
        with self._commit_lock:
            pending, self._pending_commit = self._pending_commit, None
        if not pending:
            return
        tps = [TopicPartition(self.topic, p, off) for p, off in pending.items()]
        try:
            self._consumer.commit(offsets=tps, asynchronous=True)
        except KafkaException as exc:  # monitoring only: never fatal
            logger.warning("committing positions to group %s failed: %s", self.group, exc)

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Commits ``positions`` synchronously (used once at shutdown, from the reading thread).

        Args:
            positions: next offset per partition.
        """
        if not positions:
            return
        tps = [TopicPartition(self.topic, p, off) for p, off in positions.items()]
        try:
            # a synchronous commit would wait for an unreachable broker forever
            self._consumer.commit(offsets=tps, asynchronous=self.broker_error is not None)
        except KafkaException as exc:
            logger.warning("committing positions to group %s failed: %s", self.group, exc)

    @property
    def partitions(self) -> list[int]:
        """Assigned partitions."""
        return list(self._partitions)

    def close(self) -> None:
        """Closes the consumer (without leaving uncommitted state behind)."""
        if not self._closed:
            self._retention.stop()
            with self._watermark_lock:  # no watermark query in flight past here
                self._closed = True
            self._retention.join()
            self._consumer.close()
            self._offsets_consumer.close()


__all__ = [
    "KafkaSource",
    "RawBatch",
    "PartitionState",
    "OFFSET_BEGINNING",
]
