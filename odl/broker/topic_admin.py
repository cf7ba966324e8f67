"""Topic helpers that work against any Kafka-compatible broker (real Kafka or the embedded one).

Every client is built from ``odl.kafka_client`` so the settings odl relies on apply here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from odl.kafka_client import admin_config, consumer_config

logger = logging.getLogger(__name__)


class TopicAdminError(RuntimeError):
    """A topic could not be created, found or inspected."""


def _partition_count(admin: AdminClient, topic: str, timeout: float) -> int | None:
    """Partitions of ``topic`` once every one has a leader; ``None`` while it is not ready.

    Asks for all topics: a metadata request naming a missing topic makes brokers with
    ``auto.create.topics.enable`` create it with default settings.
    """
    md = admin.list_topics(timeout=timeout)
    tmd = md.topics.get(topic)
    if tmd is None or tmd.error is not None or not tmd.partitions:
        return None
    if any(p.leader < 0 or p.error is not None for p in tmd.partitions.values()):
        return None
    return len(tmd.partitions)


def create_topic(
    bootstrap: str,
    topic: str,
    partitions: int,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    replication_factor: int = 1,
    extra: Mapping[str, str] | None = None,
) -> int:
    """Creates ``topic`` if it does not exist and waits until metadata shows it.

    Idempotent: an existing topic is left as it is (a different partition count is logged,
    not changed).

    Args:
        bootstrap: comma separated ``host:port`` list.
        topic: topic name.
        partitions: partition count for a new topic.
        config: topic configs for a new topic (e.g. ``{"retention.ms": "3600000"}``).
        timeout: seconds to wait for creation and for the metadata to show the topic.
        replication_factor: replication factor for a new topic.
        extra: librdkafka settings (SASL/SSL) passed to the admin client.

    Returns:
        The topic's partition count as the broker reports it.

    Raises:
        TopicAdminError: creation failed or the topic did not appear within ``timeout``.
    """
    admin = AdminClient(admin_config(bootstrap, extra))
    deadline = time.monotonic() + timeout
    try:
        existing = _partition_count(admin, topic, timeout)
    except KafkaException as exc:
        raise TopicAdminError(f"cannot reach {bootstrap} to create {topic!r}: {exc}") from exc
    if existing is None:
        new = NewTopic(
            topic,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config=dict(config or {}),
        )
        future = admin.create_topics([new], operation_timeout=timeout, request_timeout=timeout)[
            topic
        ]
        try:
            future.result(timeout=max(deadline - time.monotonic(), 1.0))
            logger.info("created topic %s with %d partitions", topic, partitions)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                raise TopicAdminError(f"creating topic {topic!r} failed: {exc}") from exc
    while True:
        count = _partition_count(admin, topic, max(deadline - time.monotonic(), 0.5))
        if count is not None:
            break
        if time.monotonic() >= deadline:
            raise TopicAdminError(f"topic {topic!r} not visible in metadata after {timeout:.0f}s")
        time.sleep(0.05)
    if count != partitions:
        logger.warning(
            "topic %s exists with %d partitions (asked for %d); left unchanged",
            topic,
            count,
            partitions,
        )
    return count


def list_topics(
    bootstrap: str, timeout: float = 10.0, extra: Mapping[str, str] | None = None
) -> dict[str, int]:
    """Returns ``{topic: partition count}`` for every topic the broker reports.

    Args:
        bootstrap: comma separated ``host:port`` list.
        timeout: seconds to wait for metadata.
        extra: librdkafka settings passed to the admin client.

    Raises:
        TopicAdminError: the broker did not answer.
    """
    admin = AdminClient(admin_config(bootstrap, extra))
    try:
        md = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicAdminError(f"no metadata from {bootstrap}: {exc}") from exc
    return {name: len(t.partitions) for name, t in md.topics.items()}


def end_offsets_many(
    bootstrap: str,
    topics: Iterable[str],
    timeout: float = 10.0,
    extra: Mapping[str, str] | None = None,
) -> dict[str, dict[int, int]]:
    """High watermarks per partition for several topics, with one consumer.

    Args:
        bootstrap: comma separated ``host:port`` list.
        topics: topic names.
        timeout: seconds per metadata / watermark request.
        extra: librdkafka settings passed to the consumer.

    Returns:
        ``{topic: {partition: high watermark}}``.

    Raises:
        TopicAdminError: a topic is missing or the broker did not answer.
    """
    consumer = Consumer(consumer_config(bootstrap, "odl-topic-admin", extra))
    try:
        result: dict[str, dict[int, int]] = {}
        for topic in topics:
            md = consumer.list_topics(topic=topic, timeout=timeout)
            tmd = md.topics.get(topic)
            if tmd is None or tmd.error is not None:
                err = tmd.error if tmd is not None else "unknown topic"
                raise TopicAdminError(f"topic {topic!r} not available: {err}")
            offsets: dict[int, int] = {}
            for pid in sorted(tmd.partitions):
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, pid), timeout=timeout, cached=False
                )
                offsets[pid] = int(high)
            result[topic] = offsets
        return result
    except KafkaException as exc:
        raise TopicAdminError(f"reading end offsets from {bootstrap} failed: {exc}") from exc
    finally:
        consumer.close()


def end_offsets(
    bootstrap: str,
    topic: str,
    timeout: float = 10.0,
    extra: Mapping[str, str] | None = None,
) -> dict[int, int]:
    """High watermark (the next offset to be written) of every partition of ``topic``.

    Args:
        bootstrap: comma separated ``host:port`` list.
        topic: topic name.
        timeout: seconds per metadata / watermark request.
        extra: librdkafka settings passed to the consumer.

    Returns:
        ``{partition: high watermark}``.

    Raises:
        TopicAdminError: the topic is missing or the broker did not answer.
    """
    return end_offsets_many(bootstrap, [topic], timeout, extra)[topic]
