"""librdkafka client settings shared by every odl Kafka client.

One place decides the settings that odl relies on for correctness, so the trainer's
consumer, the datagen producer, the admin client and (later) the delta publisher and
the serving replayer all behave the same against any broker:

* ``receive.message.max.bytes`` is raised to its maximum: some Kafka-compatible brokers
  (the embedded ``noida-db``) ignore fetch size limits and answer with responses larger
  than librdkafka's default cap, which would otherwise fail every fetch.
* ``enable.auto.commit`` is off and ``enable.auto.offset.store`` is off for consumers: the
  checkpoint is the source of truth for positions; committing to the group is only done
  explicitly, for monitoring tools.
* Extra settings from the pipeline config (SASL/SSL, timeouts) are passed through
  untouched and win over the defaults, except the keys odl must own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

# Settings odl needs for correctness; user-supplied extras may not override them.
_CONSUMER_OWNED = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
}

_COMMON_DEFAULTS = {
    "receive.message.max.bytes": 2147483647,
    "socket.keepalive.enable": True,
}

# Setting names whose values are secrets: never logged or echoed.
SECRET_SETTING_MARKERS = (
    "password", "secret", "sasl.oauthbearer.config", "key.pem", "token",
)


def _merge(
    servers: str, defaults: Mapping[str, object], extra: Optional[Mapping[str, str]]
) -> dict:
    conf: dict = {"bootstrap.servers": servers}
    conf.update(_COMMON_DEFAULTS)
    conf.update(defaults)
    if extra:
        conf.update(dict(extra))
    return conf


def consumer_config(
    servers: str,
    group: str,
    extra: Optional[Mapping[str, str]] = None,
) -> dict:
    """Settings for a consumer that is assigned partitions explicitly.

    Args:
        servers: comma separated ``host:port`` list.
        group: consumer group id (used for committing positions for monitoring).
        extra: librdkafka settings from the config, passed through untouched.

    Returns:
        A dict for ``confluent_kafka.Consumer``.
    """
    conf = _merge(
        servers,
        {
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "fetch.wait.max.ms": 50,
            "isolation.level": "read_committed",
        },
        extra,
    )
    conf.update(_CONSUMER_OWNED)
    return conf


def delta_consumer_config(
    servers: str,
    group: str,
    extra: Optional[Mapping[str, str]] = None,
) -> dict:
    """Settings for a reader of a delta topic (serving's replayer, crash recovery).

    Like ``consumer_config`` but with ``isolation.level`` ``read_uncommitted``: a delta
    topic's versions are assembled all-or-nothing from their chunks and owned by the newest
    generation (``publisher.generation_fence``), so serving and crash recovery see the same
    versions whether or not the publisher's transaction committed, and a transaction left
    open by a killed trainer never holds them back.

    Args:
        servers: comma separated ``host:port`` list.
        group: consumer group id (nothing is committed).
        extra: librdkafka settings from the config, passed through untouched.

    Returns:
        A dict for ``confluent_kafka.Consumer``.
    """
    conf = consumer_config(servers, group, extra)
    if not extra or "isolation.level" not in extra:
        conf["isolation.level"] = "read_uncommitted"
    return conf


def producer_config(
    servers: str, extra: Optional[Mapping[str, str]] = None, idempotent: bool = True
) -> dict:
    """Settings for a producer.

    Args:
        servers: comma separated ``host:port`` list.
        extra: librdkafka settings passed through untouched.
        idempotent: enable the idempotent producer (acks=all, ordered retries).

    Returns:
        A dict for ``confluent_kafka.Producer``.
    """
    defaults: dict = {"linger.ms": 5, "compression.type": "none"}
    if idempotent:
        defaults["enable.idempotence"] = True
    return _merge(servers, defaults, extra)


def admin_config(servers: str, extra: Optional[Mapping[str, str]] = None) -> dict:
    """Settings for an ``AdminClient``.

    Args:
        servers: comma separated ``host:port`` list.
        extra: librdkafka settings passed through untouched.

    Returns:
        A dict for ``confluent_kafka.admin.AdminClient``.
    """
    return _merge(servers, {}, extra)


def redact_settings(conf: Mapping[str, object]) -> dict:
    """Returns a copy of ``conf`` safe to log: secret values replaced by ``***``.

    Args:
        conf: librdkafka settings.

    Returns:
        The settings with every secret-looking value masked.
    """
    out = {}
    for key, value in conf.items():
        lowered = key.lower()
        out[key] = "***" if any(m in lowered for m in SECRET_SETTING_MARKERS) else value
    return out
