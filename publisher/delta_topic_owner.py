"""Which model owns a delta topic, read from the topic itself.

A delta topic carries one model's versions. Every version names its trainer's generation,
which names the model (``publisher.model_identity``). The topic's owner is the model of its
newest chunk.

A trainer checks the owner before it claims the topic's producer (``publisher.kafka_sink``,
which fences whoever published last):

* the newest chunk is this model's (a restart, a re-deployment): it takes over at once;
* the topic is empty, missing, or its newest chunk predates model ids: it takes the topic;
* the newest chunk is another model's (a second trainer configured with the same topic by
  mistake): it refuses to start (``DeltaTopicOwnedError``, exit code 2) and names the owner,
  unless told to take the topic over (``odl-train --take_over_delta_topic``).

Serving and crash recovery apply only versions of their base's model
(``publisher.delta_stream``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Optional

from confluent_kafka import Consumer, KafkaException, TopicPartition

from odl.config.config_error import ConfigError
from odl.kafka.client_settings import consumer_config
from odl.protos import delta_pb2
from publisher.model_identity import model_id, model_of_generation

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class TopicOwner:
    """The newest chunk of a delta topic.

    Attributes:
        model_id: the model id of its generation (``""``: none).
        model_name: its ``model_name``.
        generation: its generation.
        version: its version.
        publish_time_ms: when it was published (unix ms).
    """

    model_id: str
    model_name: str
    generation: str
    version: int
    publish_time_ms: int


class DeltaTopicOwnedError(ConfigError):
    """The delta topic's newest version is another model's."""


def newest_chunk_owner(server: str, topic: str,
                       kafka_config: Optional[Mapping[str, str]] = None,
                       timeout: float = 10.0) -> Optional[TopicOwner]:
    """The owner of a delta topic's newest chunk; None when the topic is missing or empty.

    Reads the last messages of partition 0 (the delta topic has one), newest first, skipping
    what is not a chunk (transaction markers take offsets but are never delivered).

    Raises:
        KafkaException: the broker cannot be reached within ``timeout``.
    """
    consumer = Consumer({**consumer_config(server, "odl-delta-owner", dict(kafka_config or {})),
                         "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
        info = meta.topics.get(topic)
        if info is None or info.error is not None or not info.partitions:
            return None
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout)
        start = max(low, high - 8)  # a few back: the last offsets may be commit markers
        if high <= low:
            return None
        tp = TopicPartition(topic, 0, start)
        consumer.assign([tp])
        newest: Optional[TopicOwner] = None
        deadline = time.monotonic() + timeout
        # until the position passes the end: a transaction's commit marker takes the last
        # offset and is never delivered, so waiting for a message there would wait it out
        while time.monotonic() < deadline:
            msg = consumer.poll(0.1)
            if msg is None:
                pos = consumer.position([tp])[0].offset
                if pos >= high:
                    break
                continue
            if msg.error() is not None:
                continue
            chunk = delta_pb2.DeltaChunk()
            try:
                chunk.ParseFromString(msg.value() or b"")
            except Exception:  # noqa: BLE001 (not a chunk: hostile or foreign bytes)
                continue
            newest = TopicOwner(model_of_generation(chunk.generation), chunk.model_name,
                                chunk.generation, int(chunk.version),
                                int(chunk.publish_time_ms))
        return newest
    finally:
        consumer.close()


def check_delta_topic_owner(server: str, topic: str, model_dir: str, take_over: bool,
                            kafka_config: Optional[Mapping[str, str]] = None) -> None:
    """Refuses a delta topic whose newest version is another model's (module docstring).

    Args:
        server: the delta topic's bootstrap servers.
        topic: the delta topic.
        model_dir: this trainer's ``model_dir``.
        take_over: ``--take_over_delta_topic``: take the topic even from another model.
        kafka_config: extra librdkafka settings (SASL/SSL).

    Raises:
        DeltaTopicOwnedError: naming ``train_config.incr_save_config.kafka.topic`` and the
            owner.
    """
    try:
        owner = newest_chunk_owner(server, topic, kafka_config)
    except KafkaException as exc:  # the publisher's own retries report an unreachable broker
        logger.warning("could not read the owner of delta topic %s: %s", topic, exc)
        return
    mine = model_id(model_dir)
    if owner is None or not owner.model_id or owner.model_id == mine:
        return
    if take_over:
        logger.warning("taking delta topic %s over from model %s (model_name %r, version %d); "
                       "serving of that model stops following it", topic, owner.model_id,
                       owner.model_name, owner.version)
        return
    raise DeltaTopicOwnedError(
        "train_config.incr_save_config.kafka.topic",
        f"delta topic {topic!r} belongs to another model: its newest version ({owner.version}, "
        f"model_name {owner.model_name!r}) is model {owner.model_id}'s, and this model_dir is "
        f"model {mine}; give this model a topic of its own, or pass --take_over_delta_topic "
        "to make the topic this model's (serving of the other model then stops following it)")
