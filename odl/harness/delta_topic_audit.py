"""What serving makes of a whole delta topic: complete, half-sent and corrupt versions.

The audit reads the topic from its first offset to its end with serving's decoder and
assembler and reports, per trainer generation, the last version that completed. The
exactly-once audit (``odl.harness.exactly_once_audit``) starts from it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from odl.kafka.client_settings import delta_consumer_config
from publisher.delta_decoder import decode_chunk
from publisher.delta_format import DeltaFormatError
from publisher.version_assembler import VersionAssembler

logger = logging.getLogger(__name__)


@dataclass
class DeltaTopicAudit:
    """What serving's assembler makes of a whole delta topic.

    Attributes:
        last_complete: generation -> highest complete version.
        complete_versions: complete versions in topic order as ``(generation, version)``.
        incomplete: versions that never completed (half-sent), as ``(generation, version)``.
        rejected: corrupt messages.
        end_offset: the topic's end when read.
        sparse_tables: ids of the tables some chunk carries rows of.
    """

    last_complete: dict[str, int] = field(default_factory=dict)
    complete_versions: list[tuple[str, int]] = field(default_factory=list)
    incomplete: list[tuple[str, int]] = field(default_factory=list)
    rejected: int = 0
    end_offset: int = 0
    sparse_tables: set[int] = field(default_factory=set)


def audit_delta_topic(bootstrap: str, topic: str, timeout: float = 60.0) -> DeltaTopicAudit:
    """Reads the whole delta topic with serving's decoder and assembler.

    Args:
        bootstrap: the broker's bootstrap servers.
        topic: the delta topic (one partition).
        timeout: seconds to read it in.

    Returns:
        The audit.

    Raises:
        TimeoutError: the topic was not read to its end in time.
    """
    audit = DeltaTopicAudit()
    consumer = Consumer(delta_consumer_config(bootstrap, f"odl-audit-{uuid.uuid4().hex[:8]}"))
    try:
        tp = TopicPartition(topic, 0)
        low, high = consumer.get_watermark_offsets(tp, timeout=10, cached=False)
        audit.end_offset = int(high)
        consumer.assign([TopicPartition(topic, 0, int(low))])
        assembler = VersionAssembler(max_pending_versions=1 << 20, max_pending_bytes=1 << 62)
        seen: set[tuple[str, int]] = set()
        nxt, deadline = int(low), time.monotonic() + timeout
        while nxt < high and time.monotonic() < deadline:
            # transaction markers take offsets without being delivered: follow the position
            nxt = max(nxt, consumer.position([TopicPartition(topic, 0)])[0].offset)
            for msg in consumer.consume(500, timeout=0.5):
                if msg.error() is not None:
                    continue
                nxt = max(nxt, msg.offset() + 1)
                try:
                    chunk = decode_chunk(msg.value() or b"")
                except DeltaFormatError:
                    audit.rejected += 1
                    continue
                seen.add((chunk.header.generation, chunk.header.version))
                audit.sparse_tables.update(chunk.sparse)
                version = assembler.add(chunk)
                if version is not None:
                    key = (version.header.generation, int(version.header.version))
                    audit.complete_versions.append(key)
                    audit.last_complete[key[0]] = max(audit.last_complete.get(key[0], -1), key[1])
        if nxt < high:
            raise TimeoutError(f"delta topic {topic} not read to its end ({nxt} < {high})")
        done = set(audit.complete_versions)
        audit.incomplete = sorted(k for k in seen if k not in done)
    finally:
        consumer.close()
    logger.debug("delta topic %s: %d complete, %d incomplete versions", topic,
                 len(audit.complete_versions), len(audit.incomplete))
    return audit


def published_versions(bootstrap: str, topic: str) -> dict[str, int]:
    """Generation -> its last complete version in the delta topic.

    Args:
        bootstrap: the broker's bootstrap servers.
        topic: the delta topic.

    Returns:
        ``DeltaTopicAudit.last_complete`` of the whole topic.
    """
    return audit_delta_topic(bootstrap, topic).last_complete
