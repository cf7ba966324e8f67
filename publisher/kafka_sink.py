"""Sends delta versions to a Kafka topic.

Topic layout: ONE partition (total order of versions), created when missing with
``max.message.bytes`` = 16 MiB. Each message is one serialized ``DeltaChunk``
(``publisher.delta_codec``), no key, no headers; the chunks of a version are consecutive
messages in chunk order. A version counts as published only when every one of its chunks
has been acknowledged (idempotent producer, acks=all). ``send`` returns the topic offset of
the version's last chunk, so ``offset + 1`` is where a consumer continues after that version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from confluent_kafka import KafkaException, Producer

from odl.broker.topic_admin import create_topic
from odl.kafka_client import producer_config

logger = logging.getLogger(__name__)

DELTA_TOPIC_MAX_MESSAGE_BYTES = 16 << 20


class DeltaSinkError(RuntimeError):
    """A version could not be published (it may be partially written)."""


class KafkaSink:
    """Producer of delta chunks to one topic.

    Args:
        servers: comma separated ``host:port`` list.
        topic: the delta topic (created with one partition when missing).
        kafka_config: extra librdkafka settings (SASL/SSL, timeouts).
        max_chunk_bytes: largest chunk that will be sent (sets the producer's limit).
        create: create the topic when missing.
    """

    def __init__(
        self,
        servers: str,
        topic: str,
        kafka_config: Mapping[str, str] | None = None,
        max_chunk_bytes: int = 900_000,
        create: bool = True,
    ) -> None:
        self.servers = servers
        self.topic = topic
        self._extra = dict(kafka_config or {})
        self._created = not create
        limit = max(1_000_000, int(max_chunk_bytes) + (64 << 10))
        extra = {"message.max.bytes": str(limit)}
        extra.update(self._extra)
        self._producer: Producer | None = Producer(
            producer_config(servers, extra, idempotent=True))
        self.description = f"kafka {topic} @ {servers}"

    def _ensure_topic(self) -> None:
        if self._created:
            return
        create_topic(self.servers, self.topic, 1,
                     config={"max.message.bytes": str(DELTA_TOPIC_MAX_MESSAGE_BYTES)},
                     extra=self._extra)
        self._created = True

    def send(self, version: int, generation: str, chunks: Sequence[bytes],
             timeout: float = 30.0) -> int:
        """Sends one version's chunks and waits until all are acknowledged.

        Args:
            version: the version (for messages only).
            generation: the generation (for messages only).
            chunks: serialized chunks in order.
            timeout: seconds to wait for the acknowledgements.

        Returns:
            The topic offset of the last chunk.

        Raises:
            DeltaSinkError: a chunk was rejected or not acknowledged in time.
        """
        if self._producer is None:
            raise DeltaSinkError("sink closed")
        producer = self._producer
        try:
            self._ensure_topic()
        except Exception as exc:  # noqa: BLE001 - any admin failure means "not published"
            raise DeltaSinkError(f"delta topic {self.topic} unavailable: {exc}") from exc
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
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeltaSinkError(f"version {version} ({generation}): "
                                     f"{len(chunks) - len(results)} chunks not acknowledged "
                                     f"within {timeout:.0f}s")
            producer.flush(min(left, 1.0))
        errors = [err for err, _ in results if err is not None]
        if errors:
            raise DeltaSinkError(f"version {version} ({generation}): delivery failed: "
                                 f"{errors[0]}")
        return max(off for _, off in results)

    def close(self, timeout: float = 5.0) -> None:
        """Flushes and drops the producer (``send`` fails afterwards)."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.flush(timeout)
        except Exception as exc:  # noqa: BLE001 - closing must not raise
            logger.warning("delta producer flush on close failed: %s", exc)
