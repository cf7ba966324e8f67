"""Forwards rejected (malformed) input records to a dead-letter Kafka topic.

Enabled by ``data_config.dead_letter_topic`` (odl extension). Each rejected record becomes
one message on that topic:

* value: the original record bytes, unchanged (a record larger than
  ``MAX_DEAD_LETTER_VALUE_BYTES`` is cut to that size and gets an ``odl-truncated`` header
  holding its original length); empty for a record rejected after it was built
  (``non_finite_output``: its bytes stay in the input process), whose ``odl-source`` header
  locates it in the input topic;
* headers: ``odl-reject-reason`` (one of ``odl.features.record_parser.REJECT_REASONS``) and
  ``odl-source`` (``<topic>/<partition>/<offset>`` of the record);
* timestamp: the record's original Kafka timestamp.

Forwarding never slows or stops training: :meth:`DeadLetterSink.send` only appends to a
bounded in-memory queue (records beyond ``max_queued_records`` / ``max_queued_bytes`` are
dropped and counted); a background thread creates the topic when missing (one partition,
``max.message.bytes`` = 16 MiB), produces, and retries while the broker is away. Delivery is
at-least-once across restarts: records of batches trained but not yet checkpointed are read,
rejected and forwarded again after a crash.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from confluent_kafka import KafkaException, Producer
from prometheus_client import CollectorRegistry, Counter

from odl.kafka.client_settings import producer_config
from odl.kafka.topic_admin import create_topic

logger = logging.getLogger(__name__)

REASON_HEADER = "odl-reject-reason"
SOURCE_HEADER = "odl-source"
TRUNCATED_HEADER = "odl-truncated"
DEAD_LETTER_TOPIC_MAX_MESSAGE_BYTES = 16 << 20
MAX_DEAD_LETTER_VALUE_BYTES = 8 << 20
_TOPIC_RETRY_SECS = 5.0
_LOG_INTERVAL_SECS = 30.0


@dataclass
class _Letter:
    value: bytes
    reason: str
    source: str
    timestamp_ms: int
    truncated_from: int


class DeadLetterSink:
    """Asynchronous, bounded producer of rejected records.

    Args:
        servers: comma separated ``host:port`` list (``kafka_train_input.server``).
        topic: the dead-letter topic.
        kafka_config: extra librdkafka settings (``kafka_train_input.kafka_config``).
        registry: Prometheus registry for ``odl_dead_letter_records_total{result}``.
        max_queued_records: records held while the producer is behind; more are dropped.
        max_queued_bytes: bytes held while the producer is behind; more are dropped.
        max_value_bytes: longer records are cut to this size (``odl-truncated`` header).
        create: create the topic when it is missing.
    """

    def __init__(
        self,
        servers: str,
        topic: str,
        kafka_config: Optional[Mapping[str, str]] = None,
        registry: Optional[CollectorRegistry] = None,
        max_queued_records: int = 100_000,
        max_queued_bytes: int = 64 << 20,
        max_value_bytes: int = MAX_DEAD_LETTER_VALUE_BYTES,
        create: bool = True,
    ) -> None:
        self.servers = servers
        self.topic = topic
        self._extra = dict(kafka_config or {})
        self._create = create
        self._queue: queue.Queue[_Letter] = queue.Queue(maxsize=max(1, max_queued_records))
        self._max_bytes = int(max_queued_bytes)
        self._max_value = min(int(max_value_bytes), MAX_DEAD_LETTER_VALUE_BYTES)
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._in_flight = 0
        self.queued_total = 0
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: Optional[str] = None
        self._last_log = 0.0
        self._counter: Optional[Counter] = None
        if registry is not None:
            self._counter = Counter(
                "odl_dead_letter_records_total",
                "Rejected records forwarded to the dead-letter topic, by result "
                "(delivered, failed, dropped).",
                ["result"],
                registry=registry,
            )
        extra = {"message.max.bytes": str(MAX_DEAD_LETTER_VALUE_BYTES + (64 << 10)),
                 "queue.buffering.max.kbytes": str(max(1024, self._max_bytes >> 10))}
        extra.update(self._extra)
        self._producer = Producer(producer_config(servers, extra, idempotent=False))
        self._thread = threading.Thread(target=self._run, name="dead-letter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def send(self, value: Optional[bytes], reason: str, source_topic: str, partition: int,
             offset: int, timestamp_ms: int = 0) -> bool:
        """Queues one rejected record; never blocks.

        Args:
            value: the record as read (``None`` is sent as an empty value).
            reason: the reject reason.
            source_topic: the topic the record came from.
            partition: its partition.
            offset: its offset.
            timestamp_ms: its Kafka timestamp (0 = now).

        Returns:
            False when the record was dropped (queue full or sink closed).
        """
        data = bytes(value or b"")
        original = len(data)
        truncated_from = 0
        if original > self._max_value:
            data, truncated_from = data[:self._max_value], original
        letter = _Letter(data, reason, f"{source_topic}/{int(partition)}/{int(offset)}",
                         int(timestamp_ms), truncated_from)
        with self._lock:
            if self._stop.is_set() or self._queued_bytes + len(data) > self._max_bytes:
                self._count_dropped()
                return False
            try:
                self._queue.put_nowait(letter)
            except queue.Full:
                self._count_dropped()
                return False
            self._queued_bytes += len(data)
            self.queued_total += 1
            self._idle.clear()
        return True

    def _count_dropped(self) -> None:
        self.dropped += 1
        if self._counter is not None:
            self._counter.labels(result="dropped").inc()
        self._maybe_log("dead-letter queue full or closed: dropping rejected records "
                        f"({self.dropped} dropped so far)")

    def _maybe_log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_INTERVAL_SECS:
            self._last_log = now
            logger.warning("%s (dead-letter topic %s)", message, self.topic)

    # ------------------------------------------------------------------ background thread
    def _ensure_topic(self) -> bool:
        if not self._create:
            return True
        try:
            create_topic(self.servers, self.topic, 1,
                         config={"max.message.bytes": str(DEAD_LETTER_TOPIC_MAX_MESSAGE_BYTES)},
                         timeout=10.0, extra=self._extra)
        except Exception as exc:  # noqa: BLE001 - any admin failure: retry later
            self.last_error = f"topic {self.topic} unavailable: {exc}"
            self._maybe_log(self.last_error)
            return False
        self._create = False
        return True

    def _run(self) -> None:
        while not self._ensure_topic():
            if self._stop.wait(_TOPIC_RETRY_SECS):
                return
        while True:
            try:
                letter = self._queue.get(timeout=0.02)
            except queue.Empty:
                self._producer.poll(0.05)
                with self._lock:
                    if self._queue.empty() and self._in_flight == 0:
                        self._idle.set()
                if self._stop.is_set():
                    return
                continue
            self._produce(letter)

    def _produce(self, letter: _Letter) -> None:
        headers = [(REASON_HEADER, letter.reason.encode()),
                   (SOURCE_HEADER, letter.source.encode())]
        if letter.truncated_from:
            headers.append((TRUNCATED_HEADER, str(letter.truncated_from).encode()))
        kw = {"timestamp": letter.timestamp_ms} if letter.timestamp_ms > 0 else {}
        with self._lock:
            self._in_flight += 1
            self._queued_bytes -= len(letter.value)
        while True:
            try:
                self._producer.produce(self.topic, value=letter.value, headers=headers,
                                       on_delivery=self._on_delivery, **kw)
                break
            except BufferError:  # librdkafka's own queue is full: let deliveries drain
                if self._stop.is_set():
                    self._on_delivery("stopped with librdkafka's queue full", None)
                    return
                self._producer.poll(0.05)
            except (KafkaException, ValueError, TypeError) as exc:
                self._on_delivery(exc, None)
                return
        self._producer.poll(0)

    def _on_delivery(self, err: object, _msg: object) -> None:
        with self._lock:
            self._in_flight -= 1
            if err is None:
                self.delivered += 1
            else:
                self.failed += 1
                self.last_error = str(err)
        if self._counter is not None:
            self._counter.labels(result="delivered" if err is None else "failed").inc()
        if err is not None:
            self._maybe_log(f"could not forward a rejected record: {err}")

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every queued record is delivered or failed.

        Args:
            timeout: seconds to wait.

        Returns:
            True when nothing is left in flight.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            if self._idle.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
                with self._lock:
                    if self._queue.empty() and self._in_flight == 0:
                        return True
        with self._lock:
            return self._queue.empty() and self._in_flight == 0

    def close(self, timeout: float = 10.0) -> None:
        """Flushes (up to ``timeout``) and stops the background thread."""
        done = self.flush(timeout)
        self._stop.set()
        self._thread.join(5.0)
        self._producer.flush(1.0 if done else 0.0)
        left = self._queue.qsize() + self._in_flight
        if not self._thread.is_alive():
            self._producer = _ClosedProducer()  # lets librdkafka's threads and sockets go
        if left:
            logger.warning("dead-letter topic %s: %d rejected records not forwarded at stop",
                           self.topic, left)

    def status(self) -> dict:
        """Counters for the trainer's ``/status``."""
        return {
            "topic": self.topic,
            "queued": self._queue.qsize(),
            "forwarded": self.queued_total,
            "delivered": self.delivered,
            "failed": self.failed,
            "dropped": self.dropped,
            "last_error": self.last_error,
        }


class _ClosedProducer:
    """Stands in for the producer after :meth:`DeadLetterSink.close`."""

    def produce(self, *_args: object, **_kwargs: object) -> None:
        raise KafkaException("dead-letter sink closed")

    def poll(self, _timeout: float = 0.0) -> int:
        return 0

    def flush(self, _timeout: float = 0.0) -> int:
        return 0
