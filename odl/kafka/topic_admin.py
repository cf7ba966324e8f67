"""Topic helpers that work against any Kafka-compatible broker (real Kafka or the embedded one).

Every client is built from ``odl.kafka.client_settings`` so the settings odl relies on
apply here too.

Retention: :class:`Retention` turns a size per partition and an age into the standard topic
configs ``retention.bytes``, ``retention.ms`` and ``segment.bytes``, which ``create_topic``
sets on a new topic and ``set_topic_configs`` on an existing one. A broker deletes whole
segments, oldest first: a partition keeps between ``retention.bytes`` and one segment more,
so the segment is an eighth of the size limit (at least 1 MiB). Records older than
``retention.ms`` go too. ``odl-kafka`` gives every topic on the broker it runs these settings
unless the topic sets them itself (``odl.broker.retention_keeper``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

from odl.kafka.client_settings import admin_config, consumer_config

logger = logging.getLogger(__name__)

# The development broker's default (odl-kafka up): it keeps everything in RAM and rewrites
# it all after every write, so on a small machine its CPU, RSS and the stalls that its saves
# cause grow with what it keeps (bench/soak.py, docs/benchmarks.md#soak).
DEFAULT_RETENTION_MB = 32.0
DEFAULT_RETENTION_HOURS = 24.0
RETENTION_KEYS = ("retention.bytes", "retention.ms", "segment.bytes")
_MIN_SEGMENT_BYTES = 1 << 20
_MAX_SEGMENT_BYTES = 1 << 30


class TopicAdminError(RuntimeError):
    """A topic could not be created, found or inspected."""


@dataclass(frozen=True)
class Retention:
    """How much of each partition a broker keeps: by size and by age.

    Attributes:
        retention_bytes: size limit per partition in bytes; -1 = no size limit.
        retention_ms: age limit in milliseconds; -1 = no age limit.
    """

    retention_bytes: int
    retention_ms: int

    @classmethod
    def from_flags(cls, retention_mb: float, retention_hours: float) -> Retention:
        """Builds a retention from CLI units (MiB per partition, hours); 0 = no limit.

        Raises:
            ValueError: a negative value.
        """
        if retention_mb < 0 or retention_hours < 0:
            raise ValueError("retention sizes and ages must be >= 0 (0 = no limit)")
        size = int(retention_mb * (1 << 20)) if retention_mb > 0 else -1
        age = int(retention_hours * 3_600_000) if retention_hours > 0 else -1
        return cls(size, age)

    @property
    def segment_bytes(self) -> int | None:
        """Segment size that keeps a partition within 1/8 of its size limit (None: no limit)."""
        if self.retention_bytes <= 0:
            return None
        return min(max(self.retention_bytes // 8, _MIN_SEGMENT_BYTES), _MAX_SEGMENT_BYTES)

    def topic_config(self) -> dict[str, str]:
        """The topic configs: ``retention.bytes``, ``retention.ms`` and ``segment.bytes``.

        Without a size limit ``segment.bytes`` is left out (the broker's default applies).
        """
        conf = {"retention.bytes": str(self.retention_bytes),
                "retention.ms": str(self.retention_ms)}
        if self.segment_bytes is not None:
            conf["segment.bytes"] = str(self.segment_bytes)
        return conf

    def describe(self) -> str:
        """A short human-readable form, e.g. ``128 MiB per partition, 24 h``."""
        return describe_retention(self.topic_config())

    def as_dict(self) -> dict[str, int]:
        """JSON-friendly form (``retention_bytes``, ``retention_ms``)."""
        return {"retention_bytes": self.retention_bytes, "retention_ms": self.retention_ms}


def describe_retention(configs: Mapping[str, str]) -> str:
    """``retention.bytes`` / ``retention.ms`` of a topic as text (``unlimited`` for -1)."""

    def num(key: str) -> int | None:
        try:
            return int(configs[key])
        except (KeyError, ValueError):
            return None

    size, age = num("retention.bytes"), num("retention.ms")
    size_text = ("size ?" if size is None else "no size limit" if size < 0
                 else f"{size / (1 << 20):g} MiB per partition")
    age_text = ("age ?" if age is None else "no age limit" if age < 0
                else f"{age / 3_600_000:g} h")
    return f"{size_text}, {age_text}"


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
    retention: Retention | None = None,
) -> int:
    """Creates ``topic`` if it does not exist and waits until metadata shows it.

    Idempotent: an existing topic is left as it is (a different partition count is logged,
    not changed; so are its configs).

    Args:
        bootstrap: comma separated ``host:port`` list.
        topic: topic name.
        partitions: partition count for a new topic.
        config: topic configs for a new topic (e.g. ``{"retention.ms": "3600000"}``).
        timeout: seconds to wait for creation and for the metadata to show the topic.
        replication_factor: replication factor for a new topic.
        extra: librdkafka settings (SASL/SSL) passed to the admin client.
        retention: size and age limits for a new topic; keys also in ``config`` keep
            ``config``'s value. None: the broker's defaults (on a broker run by
            ``odl-kafka``, the ones it was started with).

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
        topic_config = retention.topic_config() if retention is not None else {}
        topic_config.update(config or {})
        new = NewTopic(
            topic,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config=topic_config,
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


def topic_configs(
    bootstrap: str,
    topics: Iterable[str],
    keys: Iterable[str] = RETENTION_KEYS,
    timeout: float = 10.0,
    extra: Mapping[str, str] | None = None,
    admin: AdminClient | None = None,
) -> dict[str, dict[str, tuple[str, bool]]]:
    """Selected configs of several topics, and whether each topic sets them itself.

    Args:
        bootstrap: comma separated ``host:port`` list.
        topics: topic names.
        keys: config names to return.
        timeout: seconds to wait for the answer.
        extra: librdkafka settings passed to the admin client.
        admin: an admin client to ask (one kept by a caller that asks repeatedly); None: a
            new one from ``bootstrap`` and ``extra``.

    Returns:
        ``{topic: {key: (value, set_on_topic)}}``; ``set_on_topic`` is False where the value
        is the broker's default. Topics that vanished meanwhile are left out.

    Raises:
        TopicAdminError: the broker refused or did not answer in time.
    """
    names = list(topics)
    if not names:
        return {}
    if admin is None:
        admin = AdminClient(admin_config(bootstrap, extra))
    wanted = set(keys)
    futures = admin.describe_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, t) for t in names], request_timeout=timeout)
    result: dict[str, dict[str, tuple[str, bool]]] = {}
    for resource, future in futures.items():
        try:
            entries = future.result(timeout=timeout)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue
            raise TopicAdminError(f"describing topic {resource.name!r} failed: {exc}") from exc
        except FutureTimeoutError as exc:
            raise TopicAdminError(f"describing topic {resource.name!r}: no answer within "
                                  f"{timeout:g}s") from exc
        result[resource.name] = {
            k: (str(e.value), e.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value)
            for k, e in entries.items() if k in wanted
        }
    return result


def set_topic_configs(
    bootstrap: str,
    topic: str,
    configs: Mapping[str, str],
    timeout: float = 10.0,
    extra: Mapping[str, str] | None = None,
) -> None:
    """Sets configs of an existing topic (IncrementalAlterConfigs; other configs stay).

    Args:
        bootstrap: comma separated ``host:port`` list.
        topic: topic name.
        configs: config name -> value.
        timeout: seconds to wait for the answer.
        extra: librdkafka settings passed to the admin client.

    Raises:
        TopicAdminError: the broker refused or did not answer.
    """
    admin = AdminClient(admin_config(bootstrap, extra))
    resource = ConfigResource(
        ConfigResource.Type.TOPIC, topic,
        incremental_configs=[ConfigEntry(k, str(v), incremental_operation=AlterConfigOpType.SET)
                             for k, v in configs.items()])
    try:
        for future in admin.incremental_alter_configs([resource],
                                                      request_timeout=timeout).values():
            future.result(timeout=timeout)
    except KafkaException as exc:
        raise TopicAdminError(f"setting {dict(configs)} on topic {topic!r} failed: {exc}") from exc


def watermarks_many(
    bootstrap: str,
    topics: Iterable[str],
    timeout: float = 10.0,
    extra: Mapping[str, str] | None = None,
) -> dict[str, dict[int, tuple[int, int]]]:
    """Low and high watermarks per partition for several topics, with one consumer.

    Args:
        bootstrap: comma separated ``host:port`` list.
        topics: topic names.
        timeout: seconds per metadata / watermark request.
        extra: librdkafka settings passed to the consumer.

    Returns:
        ``{topic: {partition: (low, high)}}``: the first offset still kept and the next one
        to be written.

    Raises:
        TopicAdminError: a topic is missing or the broker did not answer.
    """
    consumer = Consumer(consumer_config(bootstrap, "odl-topic-admin", extra))
    try:
        result: dict[str, dict[int, tuple[int, int]]] = {}
        for topic in topics:
            md = consumer.list_topics(topic=topic, timeout=timeout)
            tmd = md.topics.get(topic)
            if tmd is None or tmd.error is not None:
                err = tmd.error if tmd is not None else "unknown topic"
                raise TopicAdminError(f"topic {topic!r} not available: {err}")
            marks: dict[int, tuple[int, int]] = {}
            for pid in sorted(tmd.partitions):
                low, high = consumer.get_watermark_offsets(
                    TopicPartition(topic, pid), timeout=timeout, cached=False
                )
                marks[pid] = (int(low), int(high))
            result[topic] = marks
        return result
    except KafkaException as exc:
        raise TopicAdminError(f"reading watermarks from {bootstrap} failed: {exc}") from exc
    finally:
        consumer.close()


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
    marks = watermarks_many(bootstrap, topics, timeout, extra)
    return {topic: {p: high for p, (_low, high) in parts.items()} for topic, parts in marks.items()}


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
