"""Replays the delta topic onto a ``ServingModel``: decode, assemble, apply in topic order.

A background thread owns one ``confluent_kafka.Consumer`` (settings from
``odl.kafka.client_settings``) with partition 0 of the delta topic assigned explicitly at the
export's ``kafka.txt`` offset; nothing is committed (every start replays from the export's
offset, which is harmless because a version carries full values). Each message goes through
``handle``:

1. ``decode_chunk``: a corrupt, unknown-format or checksum-failing chunk raises
   ``DeltaFormatError`` and is counted in ``rejected[<reason>]``; it never reaches the model;
2. ``GenerationFence.admit``: the newest trainer generation on the topic owns it; a chunk
   of a generation superseded by a newer one (a second trainer publishing the same model, a
   zombie) is counted in ``rejected["fenced_generation"]`` and ignored
   (``publisher.generation_fence``; crash recovery applies the same rule);
3. ``VersionAssembler.add``: returns a version once all its chunks arrived (versions are
   keyed by ``(generation, version)``, so a trainer restart's new generation simply
   continues: later versions in topic order win);
4. ``ServingModel.apply_version``: checks the whole version, then copies it in under the
   model lock (all-or-nothing); a version that does not fit the model is counted in
   ``rejected[<reason>]`` and the previous state keeps serving.

``handle`` is usable without Kafka (tests feed it bytes directly).

The topic is read with ``isolation.level`` ``read_uncommitted`` (``delta_consumer_config``):
the publisher's transactions (``publisher.kafka_sink``) fence older producers, while the
assembler and the generation rule decide what is applied, exactly as crash recovery does.
A commit marker takes an offset but is never delivered: ``next_offset`` follows the
consumer's position past it.

Fetch pacing (``fetch_interval_ms``, default 10; 0 = librdkafka's own): as in the trainer's
``odl.inputs.kafka_source``, the delta partition is refetched only once its local queue is
empty or every interval while messages are queued, the thread takes what is queued and
waits one interval when that was less than a full read, and one fetch may carry 16 MiB.
Versions arrive in bursts (one every few train steps), so the replayer is mostly caught up:
then it *parks*: it unassigns the partition (nothing fetched is pending, so nothing is
dropped) and asks for the log end (one ListOffsets request) every interval, assigning it again
at ``next_offset`` when the end moves away from it (above: new versions; below: the broker
lost messages, which the fetch reports as out of range). A parked consumer sends no fetches,
where one at the log end of a broker without fetch long-polling (the embedded test broker)
sends tens of thousands a second. Unassign/assign, not pause/resume: librdkafka drops
prefetched messages on pause and starts fetching only about a second after a resume,
against milliseconds after an assign. Adds about one to two intervals to a version's apply
time.

Outages: librdkafka reconnects by itself and the consumer resumes at ``next_offset``.
``broker_error`` (rules in ``odl.kafka.broker_health``) is set by the consumers' ``error_cb``
and by failing watermark queries, and cleared only by a successful watermark query (every
``_WATERMARK_REFRESH_SECS``); serving's ``/status`` shows it and ``/healthz`` answers 503
while it is set (the model keeps serving the last applied version).

Watermark queries (ListOffsets) go through a second, never-assigned consumer, so over a
connection of their own. On the fetching consumer's connection they would wait behind the
fetch in flight, and a replayer far behind the log end fetches a large backlog: up to
``max.partition.fetch.bytes`` from a real Kafka, the whole backlog in one response from the
embedded broker, which ignores fetch size limits. A query timing out there would not only
report a healthy broker as unreachable: librdkafka closes a connection on which a request
timed out (``socket.max.fails`` 1), dropping the fetch, which then starts over: a backlog
that takes longer than the query's timeout to arrive would never be read.

When the topic no longer has ``next_offset`` (``auto.offset.reset`` is ``error`` so librdkafka
never jumps on its own): above the log end, the broker lost acknowledged messages (the
embedded broker's restart, an unclean leader election); replay continues at the new end,
where the publisher writes next (it republishes every row once it notices), never from the
beginning, which would roll serving back to old versions. Below the log start, retention
deleted versions; replay continues at the log start. Both are logged and counted in
``offset_resets``.

A replay that never saw the shortened log (it was parked, stopped or disconnected until the
publisher had refilled the log past its position) reads on from its position and skips the
publisher's full republish. Every version published after it names it (``RepublishMark``
in ``protos/delta.proto``): a version naming a full republish this replay neither applied
nor has in its base export is not applied; replay goes back to the full version's first
chunk and applies everything from there in topic order (``publisher.delta_stream``; logged,
counted in ``republish_rewinds``). Each full version is sought once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter as _Counter
from collections.abc import Mapping
from typing import Optional

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from odl.kafka.broker_health import (
    OUT_OF_RANGE_CODES,
    BrokerHealth,
    ReportsBrokerHealth,
    error_text,
    out_of_range_target,
)
from odl.kafka.client_settings import delta_consumer_config
from publisher.delta_format import DeltaFormatError
from publisher.delta_stream import DeltaStreamReader
from publisher.full_republish import FullRepublishes
from publisher.generation_fence import GenerationFence
from publisher.version_assembler import VersionAssembler
from serving_plugin.export_reader import KafkaReplaySource
from serving_plugin.serving_metrics import ServingMetrics
from serving_plugin.serving_model import DeltaApplyError, ServingModel

logger = logging.getLogger(__name__)

_WATERMARK_REFRESH_SECS = 1.0
_REJECT_LOG_INTERVAL_SECS = 10.0
_BATCH_MESSAGES = 500
_PACED_PARTITION_FETCH_BYTES = 16 << 20  # a paced fetch carries up to this per interval


class DeltaReplayer(ReportsBrokerHealth):
    """Applies delta versions from a topic (or from bytes handed to ``handle``).

    Args:
        model: the serving model to update.
        source: the delta topic and start offset (the export's ``kafka.txt``).
        metrics: metrics to update (optional).
        kafka_extra: extra librdkafka settings (SASL/SSL), passed through.
        max_message_bytes: largest delta message accepted by the decoder.

    Attributes:
        next_offset: offset of the next message to read.
        end_offset: the topic's high watermark last seen (-1 = unknown).
        messages: messages handled.
        rejected: reason -> rejected messages / versions.
        broker_error: why the broker is unreachable, or None.
        offset_resets: jumps to the log end or start (position out of range).
        republish_rewinds: rewinds to a skipped full republish.
        rewind_to: the offset replay goes back to next, or None.
    """

    def __init__(
        self,
        model: ServingModel,
        source: KafkaReplaySource,
        metrics: Optional[ServingMetrics] = None,
        kafka_extra: Optional[Mapping[str, str]] = None,
        max_message_bytes: int = 64 << 20,
        fetch_interval_ms: int = 10,
    ) -> None:
        self.model = model
        self.source = source
        self.metrics = metrics
        self._kafka_extra = dict(kafka_extra or {})
        self._fetch_interval = fetch_interval_ms / 1000.0
        self._republishes = FullRepublishes(model.state.generation, int(model.state.version))
        # the base export's generation owns the topic until a newer one publishes
        self.reader = DeltaStreamReader(model.state.generation or None, self._republishes,
                                        max_message_bytes, what="delta replay")
        self.next_offset = int(source.offset)
        self.end_offset = -1
        self.messages = 0
        self.rejected: _Counter[str] = _Counter()
        self.health = BrokerHealth(f"delta broker of {source.topic}")
        self.offset_resets = 0
        self.last_error: Optional[str] = None
        self._last_reject_log = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._consumer: Optional[Consumer] = None
        self._watermarks: Optional[Consumer] = None  # ListOffsets only, see the module doc
        self._last_watermark = 0.0
        self._cv = threading.Condition()

    # -- message handling -------------------------------------------------------------------

    def handle(self, data: bytes, offset: Optional[int] = None) -> Optional[int]:
        """Handles one delta message.

        Args:
            data: the message value.
            offset: its topic offset (advances ``next_offset``).

        Returns:
            The version applied by this message, or None (incomplete, rejected).
        """
        self.messages += 1
        if self.metrics:
            self.metrics.messages.inc()
        applied = None
        try:
            version = self.reader.read(data, offset)
            if version is not None:
                rows = self.model.apply_version(version)
                self._republishes.applied(version.header)
                applied = int(version.header.version)
                if self.metrics:
                    self.metrics.versions.inc()
                    self.metrics.rows.inc(rows)
                    self.metrics.version.set(applied)
                    self.metrics.deletes.inc(version.num_deletes)
                    for table, st in self.model.dynamic_status().items():
                        self.metrics.dynamic_rows.labels(table=table).set(st["live_rows"])
                logger.debug("applied version %d (generation %s, %d rows, %d chunks)",
                             applied, version.header.generation, rows, version.chunk_count)
        except (DeltaFormatError, DeltaApplyError) as exc:
            self._reject(exc.reason, str(exc), offset)
        with self._cv:
            if offset is not None:
                self.next_offset = max(self.next_offset, int(offset) + 1)
            self._cv.notify_all()
        return applied

    @property
    def fence(self) -> GenerationFence:
        """The generation fence (``owner``, ``superseded``)."""
        return self.reader.fence

    @property
    def assembler(self) -> VersionAssembler:
        """The version assembler (``pending_versions``)."""
        return self.reader.assembler

    @property
    def rewind_to(self) -> Optional[int]:
        """The offset replay goes back to next (a skipped full republish), or None.

        ``handle`` only sets it; the replay thread acts on it (``_rewind``).
        """
        return self.reader.rewind_to

    @rewind_to.setter
    def rewind_to(self, offset: Optional[int]) -> None:
        self.reader.rewind_to = offset

    @property
    def republish_rewinds(self) -> int:
        """Rewinds to a skipped full republish so far."""
        return self.reader.rewinds

    def _reject(self, reason: str, detail: str, offset: Optional[int]) -> None:
        self.rejected[reason] += 1
        self.last_error = f"offset {offset}: {detail}"
        if self.metrics:
            self.metrics.rejected.labels(reason).inc()
        now = time.monotonic()
        if now - self._last_reject_log >= _REJECT_LOG_INTERVAL_SECS:
            self._last_reject_log = now
            logger.warning("rejected delta message at offset %s: %s (%d rejected so far; the "
                           "previous version keeps serving)", offset, detail,
                           sum(self.rejected.values()))

    @property
    def rejected_total(self) -> int:
        """Messages and versions rejected so far."""
        return sum(self.rejected.values())

    @property
    def lag(self) -> Optional[int]:
        """Messages between ``next_offset`` and the topic end (None = unknown)."""
        if self.end_offset < 0:
            return None
        return max(0, self.end_offset - self.next_offset)

    # -- thread -----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts replaying in a daemon thread (again after ``stop``: at ``next_offset``)."""
        self._stop.clear()
        conf = delta_consumer_config(self.source.server, f"odl-serving-{uuid.uuid4().hex[:8]}",
                                     self._kafka_extra)
        conf["error_cb"] = self._on_kafka_error
        conf["auto.offset.reset"] = "error"  # handled in _reset_offset
        if self._fetch_interval:  # fetch pacing, see the module docstring
            for key, value in (("queued.min.messages", 1),
                               ("fetch.queue.backoff.ms", int(self._fetch_interval * 1000)),
                               ("max.partition.fetch.bytes", _PACED_PARTITION_FETCH_BYTES)):
                if key not in self._kafka_extra:
                    conf[key] = value
        self._consumer = Consumer(conf)
        self._consumer.assign([TopicPartition(self.source.topic, 0, self.next_offset)])
        self._watermarks = Consumer(dict(conf))
        logger.info("replaying delta topic %s from offset %d", self.source.topic,
                    self.next_offset)
        self._thread = threading.Thread(target=self._run, name="delta-replayer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread and closes the consumer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for client in (self._consumer, self._watermarks):
            if client is not None:
                try:
                    client.close()
                except (KafkaException, RuntimeError):
                    pass
        self._consumer = self._watermarks = None

    def _on_kafka_error(self, err: KafkaError) -> None:
        if self.health.on_client_error(err) and self.metrics:
            self.metrics.broker_up.set(0)

    def _run(self) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        tp = TopicPartition(self.source.topic, 0)
        parked = False  # paced and caught up: partition unassigned, watching the log end
        rewound = False  # rewound, nothing read since
        while not self._stop.is_set():
            if parked:
                if self._stop.wait(self._fetch_interval):
                    break
                high = self._refresh_watermark(tp, force=True)
                if high is None or high == self.next_offset:
                    continue
                # a new message (or a log end below the position: fetching reports it)
                consumer.assign([TopicPartition(self.source.topic, 0, self.next_offset)])
                parked = False
                continue
            try:
                if self._fetch_interval:
                    msgs = consumer.consume(num_messages=_BATCH_MESSAGES, timeout=0)
                else:
                    msgs = consumer.consume(num_messages=_BATCH_MESSAGES, timeout=0.1)
            except KafkaException as exc:
                logger.error("delta consumer failed: %s", exc)
                self._stop.wait(1.0)
                continue
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    if err.code() in OUT_OF_RANGE_CODES:
                        self._reset_offset(consumer, tp)
                    else:
                        logger.warning("delta consumer error: %s", err.str())
                    continue
                self.handle(msg.value() or b"", msg.offset())
                if self.rewind_to is not None:
                    break
            if self.rewind_to is not None:  # the rest of this read comes again
                self._rewind(consumer)
                rewound = True
                continue
            if msgs:
                rewound = False
            if not rewound:  # (right after an assign the position may still be the old one)
                self._follow_position(consumer, tp)
            if not self._fetch_interval:
                self._refresh_watermark(tp)
                continue
            if msgs:
                self._refresh_watermark(tp)
                if len(msgs) < _BATCH_MESSAGES:
                    self._stop.wait(self._fetch_interval)
                continue
            # nothing queued: park when caught up (nothing fetched is pending, none is lost)
            high = self._refresh_watermark(tp, force=True)
            if high is not None and high == self.next_offset:
                consumer.unassign()
                parked = True
            else:
                self._stop.wait(self._fetch_interval)

    def _follow_position(self, consumer: Consumer, tp: TopicPartition) -> None:
        """Moves ``next_offset`` past what the consumer skipped (transaction markers)."""
        try:
            pos = int(consumer.position([tp])[0].offset)
        except (KafkaException, IndexError):
            return
        if pos > self.next_offset:
            with self._cv:
                self.next_offset = pos
                self._cv.notify_all()

    def _rewind(self, consumer: Consumer) -> None:
        """Replays from ``rewind_to`` (a skipped full republish, ``publisher.delta_stream``)."""
        assert self.rewind_to is not None
        target, self.rewind_to = self.rewind_to, None
        with self._cv:
            self.next_offset = target
            self._cv.notify_all()
        self.reader.restart_assembly()  # chunks read past the target come again
        consumer.assign([TopicPartition(self.source.topic, 0, target)])

    def _reset_offset(self, consumer: Consumer, tp: TopicPartition) -> None:
        """Continues at the log end (truncated log) or start (retention); see the module doc."""
        try:
            assert self._watermarks is not None
            low, high = self._watermarks.get_watermark_offsets(tp, timeout=5.0, cached=False)
        except KafkaException as exc:
            logger.warning("delta topic offset %d out of range and watermarks unavailable "
                           "(%s); retrying", self.next_offset, exc)
            self._stop.wait(1.0)
            consumer.assign([TopicPartition(self.source.topic, 0, self.next_offset)])
            return
        target = out_of_range_target(self.next_offset, low, high).offset
        if self.next_offset > high:
            logger.error("delta topic %s ends at offset %d, before the replay position %d: the "
                         "broker lost acknowledged versions; continuing at its end (the "
                         "publisher republishes every row once it notices)", self.source.topic,
                         high, self.next_offset)
        else:
            logger.error("delta topic %s starts at offset %d, after the replay position %d "
                         "(retention deleted versions): serving may miss rows; continuing at "
                         "the log start, re-export a newer base", self.source.topic, low,
                         self.next_offset)
        self.offset_resets += 1
        with self._cv:
            self.next_offset = int(target)
            self.end_offset = int(high)
            self._cv.notify_all()
        self.reader.restart_assembly()  # chunks of a cut version never complete
        consumer.assign([TopicPartition(self.source.topic, 0, int(target))])

    def _refresh_watermark(self, tp: TopicPartition, force: bool = False) -> Optional[int]:
        """Queries the log end (at most every ``_WATERMARK_REFRESH_SECS`` unless ``force``).

        Returns:
            The high watermark, or None when not queried now or the query failed.
        """
        now = time.monotonic()
        if not force and now - self._last_watermark < _WATERMARK_REFRESH_SECS:
            return None
        self._last_watermark = now
        try:
            assert self._watermarks is not None
            _low, high = self._watermarks.get_watermark_offsets(tp, timeout=1.0, cached=False)
        except KafkaException as exc:
            self.health.unreachable(f"watermark query failed: {error_text(exc)}")
            if self.metrics:
                self.metrics.broker_up.set(0)
            return None
        self.health.reachable()
        with self._cv:
            self.end_offset = int(high)
            self._cv.notify_all()
        if self.metrics:
            self.metrics.broker_up.set(1)
            if self.lag is not None:
                self.metrics.lag.set(self.lag)
        return int(high)

    # -- waiting (tests, readiness) ---------------------------------------------------------

    def wait_for_offset(self, offset: int, timeout: float = 30.0) -> bool:
        """Waits until every message before ``offset`` was handled; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.next_offset < offset:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.2))
        return True
