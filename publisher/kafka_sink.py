"""Sends delta versions to a Kafka topic.

Topic layout: ONE partition (total order of versions), created when missing with
``max.message.bytes`` = 16 MiB. Each message is one serialized ``DeltaChunk``
(``publisher.delta_encoder``), no key, no headers; the chunks of a version are consecutive
messages in chunk order. A version counts as published only when every one of its chunks
has been acknowledged (idempotent producer, acks=all). ``send`` returns the topic offset of
the version's last chunk, so ``offset + 1`` is where a consumer continues after that version.

Outages: librdkafka keeps reconnecting by itself; ``broker_error`` (set by the rules of
``odl.kafka.broker_health`` from the producer's ``error_cb`` and failed deliveries, cleared
by the next acknowledged version) says why the broker is unreachable.
A send that fails or times out drops the producer (its queue is purged, so a stale copy can
never be delivered after a newer version) and the next send starts a fresh one. The same
happens after a fatal producer error, e.g. ``OUT_OF_ORDER_SEQUENCE_NUMBER`` when a restarted
broker forgot the idempotent producer's sequence numbers. The caller (the publisher) retries
with the newest state, so nothing is lost and the topic order stays the version order.

Ownership (``fence=True``, the default): the producer is transactional, with
``transactional.id`` = ``odl-delta.<topic>`` (a ``transactional.id`` in ``kafka_config``
wins), and each version is one transaction. ``claim`` (``init_transactions``) registers this
trainer as the topic's producer: the broker aborts a transaction the previous producer left
open and fences that producer, whose next send fails with ``DeltaSinkFenced``, so at most one
trainer publishes to a delta topic at a time, the newest. Consumers read the topic with
either isolation level: the chunks of an aborted transaction never form a version that a
newer generation's versions do not supersede (serving's generation rule,
``publisher.generation_fence``). A commit marker takes one offset after a version's last
chunk; consumers skip it. ``fence=False`` (``fence_producers: false``, for brokers without
transactions) keeps a plain idempotent producer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Optional

from confluent_kafka import KafkaError, KafkaException, Producer

from odl.kafka.broker_health import BrokerHealth, ReportsBrokerHealth
from odl.kafka.client_settings import producer_config
from odl.kafka.topic_admin import create_topic
from publisher.delta_sink import (
    DeltaSinkError,
    DeltaSinkFenced,
    DeltaSinkUnsupported,
    SentOffsets,
)

logger = logging.getLogger(__name__)

DELTA_TOPIC_MAX_MESSAGE_BYTES = 16 << 20
# A newer producer with the same transactional.id took over.
_FENCED_CODES = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                 KafkaError.INVALID_PRODUCER_EPOCH)
# The broker does not offer (or this principal may not use) transactions.
_NO_TRANSACTIONS_CODES = (
    KafkaError._UNSUPPORTED_FEATURE, KafkaError._NOT_IMPLEMENTED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.INVALID_TRANSACTION_TIMEOUT,
)


def delta_transactional_id(topic: str) -> str:
    """The ``transactional.id`` of a delta topic's producer (one owner per topic)."""
    return f"odl-delta.{topic}"


class KafkaSink(ReportsBrokerHealth):
    """Producer of delta chunks to one topic.

    Args:
        servers: comma separated ``host:port`` list.
        topic: the delta topic (created with one partition when missing).
        kafka_config: extra librdkafka settings (SASL/SSL, timeouts).
        max_chunk_bytes: largest chunk that will be sent (sets the producer's limit).
        create: create the topic when missing.
        fence: publish through a transactional producer that fences older producers of
            the topic (see the module docstring).
    """

    def __init__(
        self,
        servers: str,
        topic: str,
        kafka_config: Mapping[str, str] | None = None,
        max_chunk_bytes: int = 900_000,
        create: bool = True,
        fence: bool = True,
    ) -> None:
        self.servers = servers
        self.topic = topic
        self._extra = dict(kafka_config or {})
        self._created = not create
        limit = max(1_000_000, int(max_chunk_bytes) + (64 << 10))
        extra = {"message.max.bytes": str(limit)}
        if fence:
            extra["transactional.id"] = delta_transactional_id(topic)
        extra.update(self._extra)
        self.fence = bool(fence and extra.get("transactional.id"))
        self.transactional_id = str(extra["transactional.id"]) if self.fence else None
        if not self.fence:
            extra.pop("transactional.id", None)
        self._conf = producer_config(servers, extra, idempotent=True)
        self._conf["error_cb"] = self._on_error
        self._lock = threading.Lock()
        self._closed = False
        self._fatal: Optional[str] = None
        self._fatal_code: Optional[int] = None
        self.health = BrokerHealth(f"delta broker of {topic}")
        self.producer_restarts = 0
        self.fenced: Optional[str] = None
        # a transactional producer is created (and claims the topic) by claim() / send()
        self._producer: Producer | None = None if self.fence else Producer(self._conf)
        self._claimed = False
        self.description = f"kafka {topic} @ {servers}"

    def _on_error(self, err: KafkaError) -> None:
        """Records errors from librdkafka's ``error_cb`` (runs inside poll/flush when sending)."""
        if err.fatal():
            self._fatal = err.str()
            self._fatal_code = err.code()
        self.health.on_client_error(err)

    def _drop_producer(self, why: str) -> None:
        """Discards the producer and everything it still holds; the next send makes a new one."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.purge()  # queued and in-flight: never delivered after a newer version
            producer.flush(0)
        except (KafkaException, RuntimeError) as exc:
            logger.debug("purging the delta producer failed: %s", exc)
        self.producer_restarts += 1
        logger.warning("delta producer restarted (%s)", why)

    def _get_producer(self, timeout: float = 30.0) -> Producer:
        with self._lock:
            if self.fenced is not None:
                raise DeltaSinkFenced(self.fenced)
            if self._closed:
                raise DeltaSinkError("sink closed")
            if self._producer is None:
                self._fatal = self._fatal_code = None
                self._producer = Producer(self._conf)
                self._claimed = False
            producer = self._producer
        if self.fence and not self._claimed:
            self._init_transactions(producer, timeout)
        return producer

    def claim(self, timeout: float = 30.0) -> None:
        """Registers this trainer as the topic's only producer (``fence``; else a no-op).

        Aborts a transaction an earlier producer of the topic left open and fences that
        producer. Call it before reading the topic for crash recovery, so nothing is written
        after the read by anyone else.

        Args:
            timeout: seconds to wait for the broker.

        Raises:
            DeltaSinkUnsupported: the broker refuses transactions.
            DeltaSinkError: the broker is unreachable (retry later).
        """
        if self.fence:
            self._get_producer(timeout)

    def _init_transactions(self, producer: Producer, timeout: float) -> None:
        try:
            producer.init_transactions(timeout)
        except KafkaException as exc:
            err = exc.args[0]
            if err.code() in _NO_TRANSACTIONS_CODES:
                raise DeltaSinkUnsupported(
                    f"the broker refuses the transactional producer of delta topic "
                    f"{self.topic} ({err.str()}): set incr_save_config.kafka.fence_producers: "
                    "false to publish without broker-side fencing") from exc
            if err.fatal():
                self._drop_producer(f"init_transactions: {err.str()}")
            raise DeltaSinkError(f"delta topic {self.topic}: claiming the transactional "
                                 f"producer failed: {err.str()}") from exc
        self._claimed = True
        logger.info("delta topic %s: transactional producer %s registered (older producers "
                    "of the topic are fenced)", self.topic, self.transactional_id)

    def _ensure_topic(self) -> None:
        if self._created:
            return
        create_topic(self.servers, self.topic, 1,
                     config={"max.message.bytes": str(DELTA_TOPIC_MAX_MESSAGE_BYTES)},
                     extra=self._extra)
        self._created = True

    def send(self, version: int, generation: str, chunks: Sequence[bytes],
             timeout: float = 30.0) -> SentOffsets:
        """Sends one version's chunks and waits until all are acknowledged.

        Args:
            version: the version (for messages only).
            generation: the generation (for messages only).
            chunks: serialized chunks in order.
            timeout: seconds to wait for the acknowledgements.

        Returns:
            The topic offsets of the first and last chunk.

        Raises:
            DeltaSinkError: a chunk was rejected or not acknowledged in time.
        """
        try:
            self._ensure_topic()
        except Exception as exc:  # noqa: BLE001 - any admin failure means "not published"
            self.health.unreachable(f"delta topic {self.topic} unavailable: {exc}")
            raise DeltaSinkError(f"delta topic {self.topic} unavailable: {exc}") from exc
        producer = self._get_producer(timeout)
        try:
            if self.fence:
                producer.begin_transaction()
            sent = self._send(producer, version, generation, chunks, timeout)
            if self.fence:
                self._commit(producer, version, generation, timeout)
        except DeltaSinkError as exc:
            self._failed(exc, None)
        except Exception as exc:  # noqa: BLE001 - KafkaException, or the SystemError that
            # confluent-kafka raises from flush() when a fatal error meets a delivery callback
            self._failed(DeltaSinkError(f"version {version} ({generation}): {exc}"), exc)
        self.health.reachable()
        return sent

    def _failed(self, error: DeltaSinkError, cause: Optional[BaseException]) -> None:
        """Turns a failed send into ``DeltaSinkFenced`` or drops the producer; raises."""
        code = None
        link = cause
        while link is not None and code is None:  # the KafkaError, possibly chained
            if isinstance(link, KafkaException) and link.args:
                code = link.args[0].code()
            link = link.__cause__ or link.__context__
        if code in _FENCED_CODES or self._fatal_code in _FENCED_CODES:
            self.fenced = (f"delta topic {self.topic} was taken over by a newer producer with "
                           f"transactional.id {self.transactional_id} (another trainer "
                           "publishes to it): this trainer stops publishing")
            self._drop_producer("fenced")
            raise DeltaSinkFenced(self.fenced) from cause or error
        self._drop_producer(str(error))
        raise error from cause

    def _commit(self, producer: Producer, version: int, generation: str,
                timeout: float) -> None:
        """Commits the version's transaction, retrying what librdkafka calls retriable."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                producer.commit_transaction(max(0.1, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    continue
                if err.txn_requires_abort():
                    try:
                        producer.abort_transaction(max(0.1, deadline - time.monotonic()))
                    except KafkaException as abort_exc:
                        logger.debug("aborting the delta transaction failed: %s", abort_exc)
                raise

    def _send(self, producer: Producer, version: int, generation: str,
              chunks: Sequence[bytes], timeout: float) -> SentOffsets:
        results: list[tuple[KafkaException | None, int]] = []

        def on_delivery(err, msg) -> None:  # noqa: ANN001 - librdkafka callback
            results.append((err, msg.offset() if err is None else -1))

        deadline = time.monotonic() + timeout
        for chunk in chunks:
            while True:
                try:
                    producer.produce(self.topic, value=chunk, partition=0,
                                           on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
                    if time.monotonic() > deadline:
                        raise DeltaSinkError("producer queue full") from None
                except KafkaException as exc:
                    raise DeltaSinkError(f"produce failed: {exc}") from exc
            producer.poll(0)
        while len(results) < len(chunks):
            if self._fatal is not None:
                raise DeltaSinkError(f"version {version} ({generation}): producer fatal error: "
                                     f"{self._fatal}")
            left = deadline - time.monotonic()
            if left <= 0:
                why = f" (broker: {self.broker_error})" if self.broker_error else ""
                raise DeltaSinkError(f"version {version} ({generation}): "
                                     f"{len(chunks) - len(results)} chunks not acknowledged "
                                     f"within {timeout:.0f}s{why}")
            producer.flush(min(left, 1.0))
        errors = [err for err, _ in results if err is not None]
        if errors:
            if isinstance(errors[0], KafkaError):
                self.health.on_request_error(errors[0])
            raise DeltaSinkError(f"version {version} ({generation}): delivery failed: "
                                 f"{errors[0]}")
        return SentOffsets(min(off for _, off in results), max(off for _, off in results))

    def status(self) -> dict:
        """Connection and ownership state for the publisher's status."""
        return {"broker_error": self.broker_error,
                "broker_error_since": self.broker_error_since,
                "producer_restarts": self.producer_restarts,
                "fencing": "transactional" if self.fence else "generation_only",
                "transactional_id": self.transactional_id,
                "fenced": self.fenced}

    def close(self, timeout: float = 5.0) -> None:
        """Flushes and drops the producer (``send`` fails afterwards)."""
        with self._lock:
            self._closed = True
            producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.flush(timeout)
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            logger.warning("delta producer flush on close failed: %s", exc)
