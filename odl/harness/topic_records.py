"""Records on real broker topics: synthetic samples, the one producer helper, a reader, cleanup.

``produce`` writes values round robin over a topic's partitions and returns where each one
landed; tests and benchmarks use it for sample topics and for hand-made delta topics alike.
``read_messages`` reads a one-partition topic (a dead-letter topic) from its start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Optional

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from odl.datagen.synthetic_ctr import SyntheticCtrStream, encode
from odl.harness.model_configs import records_for_model
from odl.kafka.client_settings import admin_config, consumer_config, producer_config

logger = logging.getLogger(__name__)

_POLL_EVERY = 1000


class RecordPosition(NamedTuple):
    """Where a produced record landed.

    Attributes:
        partition: the partition.
        offset: its offset in that partition.
    """

    partition: int
    offset: int


def produce(
    bootstrap: str,
    topic: str,
    values: Sequence[bytes],
    partitions: int = 1,
    keys: Optional[Sequence[str | bytes]] = None,
    timestamps_ms: Optional[Sequence[int]] = None,
    config: Optional[Mapping[str, str]] = None,
    flush_timeout: float = 120.0,
) -> list[RecordPosition]:
    """Produces ``values`` in order, value ``i`` to partition ``i % partitions``.

    The producer is idempotent, so the values of one partition keep their order.

    Args:
        bootstrap: the broker's bootstrap servers.
        topic: the topic (it must exist).
        values: the record values.
        partitions: partitions to spread the values over (1: everything to partition 0).
        keys: a key per value.
        timestamps_ms: a message timestamp per value (ms since the epoch).
        config: extra librdkafka producer settings (e.g. ``message.max.bytes``).
        flush_timeout: seconds to wait for every acknowledgement.

    Returns:
        ``(partition, offset)`` per value, in the order of ``values``.

    Raises:
        RuntimeError: a record was not acknowledged.
    """
    producer = Producer(producer_config(bootstrap, config))
    where: list[Optional[RecordPosition]] = [None] * len(values)
    errors: list[str] = []

    def delivered(i: int) -> Callable[[Optional[KafkaError], Message], None]:
        def report(err: Optional[KafkaError], msg: Message) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                where[i] = RecordPosition(int(msg.partition()), int(msg.offset()))

        return report

    for i, value in enumerate(values):
        extra: dict = {}
        if keys is not None:
            extra["key"] = keys[i]
        if timestamps_ms is not None:
            extra["timestamp"] = int(timestamps_ms[i])
        while True:
            try:
                producer.produce(topic, value=value, partition=i % partitions,
                                 on_delivery=delivered(i), **extra)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        if i % _POLL_EVERY == _POLL_EVERY - 1:
            producer.poll(0)
    left = producer.flush(flush_timeout)
    if left or errors:
        raise RuntimeError(f"{left} record(s) to {topic} unacknowledged after "
                           f"{flush_timeout:.0f}s; errors: {errors[:3]}")
    positions = [w for w in where if w is not None]
    if len(positions) != len(values):
        raise RuntimeError(f"{len(values) - len(positions)} record(s) to {topic} unreported")
    logger.debug("produced %d records to %s", len(values), topic)
    return positions


def make_records(n: int, seed: int = 0, fmt: str = "csv",
                 model: str = "DeepFM") -> tuple[list[str], list[bytes]]:
    """``n`` synthetic CTR records of the datagen schema.

    Args:
        n: records.
        seed: the stream's seed (same seed, same records).
        fmt: ``"csv"`` or ``"json"``.
        model: with the columns the ``as_model_config_text`` config of this model class
            reads (``odl.harness.model_configs.records_for_model``).

    Returns:
        ``(sample_ids, encoded values)``.
    """
    if model != "DeepFM":
        stream = SyntheticCtrStream(seed=seed)
        batch = stream.next_batch(n)
        return list(batch.sample_ids), records_for_model(model, stream, batch, fmt)
    records = SyntheticCtrStream(seed=seed).next_records(n)
    return [r["sample_id"] for r in records], [encode(r, fmt) for r in records]


def read_messages(bootstrap: str, topic: str, n: int,
                  timeout: float = 30.0) -> list[tuple[bytes, dict[str, bytes]]]:
    """Reads up to ``n`` messages of partition 0 of ``topic`` from offset 0.

    Args:
        bootstrap: bootstrap servers.
        topic: the topic.
        n: messages wanted.
        timeout: seconds to wait for them.

    Returns:
        ``(value, headers)`` per message, in order (fewer than ``n`` on timeout).
    """
    consumer = Consumer(consumer_config(bootstrap, "odl-test-reader"))
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[tuple[bytes, dict[str, bytes]]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                out.append((msg.value() or b"", dict(msg.headers() or [])))
    finally:
        consumer.close()
    return out


def delete_topics(bootstrap: str, topics: Sequence[str], timeout: float = 15.0) -> None:
    """Deletes topics a test made, best effort (a name never created is skipped).

    The embedded broker rewrites everything it holds after each write
    (``odl.broker.embedded_broker``), so topics left behind make every later write cost more.
    """
    if not topics:
        return
    admin = AdminClient(admin_config(bootstrap))
    for future in admin.delete_topics(list(topics), operation_timeout=10).values():
        try:
            future.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - cleanup: unknown topics and a gone broker alike
            pass
