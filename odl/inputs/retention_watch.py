"""The thread that keeps a Kafka input's retention risk report current.

Every ``_WATCH_SECS`` it asks its source to refresh the watermarks (which feeds the
estimator, ``odl.inputs.retention_risk``) and rebuilds the report; every
``_CONFIGS_SECS`` it reads the topic's ``retention.bytes`` / ``retention.ms`` /
``segment.bytes`` (DescribeConfigs). A failed read keeps the last values, says so in the
report's ``configs_error`` and is logged once per streak of failures; any other failure is
logged and retried a minute later, never ending the input. A partition turning ``behind``
or ``losing`` is logged as a warning, at most once a minute while it stays so
(``RetentionWarnings``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Optional

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from odl.inputs.retention_risk import RetentionEstimator, RetentionLimits, RetentionWarnings
from odl.kafka.broker_health import error_text
from odl.kafka.client_settings import admin_config
from odl.kafka.topic_admin import TopicAdminError, topic_configs

logger = logging.getLogger(__name__)

__all__ = ["RetentionWatch"]

_WATCH_SECS = 1.0  # how often the report is brought up to date
_CONFIGS_SECS = 60.0  # how often the topic's retention configs are read


class RetentionWatch:
    """Reads a topic's retention configs and keeps its retention risk report.

    Args:
        servers: bootstrap servers.
        topic: the topic read.
        kafka_config: the source's extra librdkafka settings (security settings apply to the
            admin client too).
    """

    def __init__(self, servers: str, topic: str,
                 kafka_config: Optional[Mapping[str, str]] = None) -> None:
        self.servers, self.topic = servers, topic
        self._kafka_config = dict(kafka_config or {})
        self.estimator = RetentionEstimator()
        self.report: Optional[dict] = None
        self._warnings = RetentionWarnings(topic)
        self._admin: Optional[AdminClient] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, refresh_watermarks: Callable[[], None]) -> None:
        """Starts the watch thread; it calls ``refresh_watermarks`` every second."""
        self._thread = threading.Thread(target=self._run, args=(refresh_watermarks,),
                                        name="retention-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Asks the thread to end (see ``join``)."""
        self._stop.set()

    def join(self) -> None:
        """Waits (at most 5 s) for the thread, and lets the admin client go."""
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._admin = None  # its connections close with it

    def read_limits(self) -> None:
        """Reads the topic's retention configs; a failure keeps the last ones (logged)."""
        try:
            if self._admin is None:
                self._admin = AdminClient(admin_config(self.servers, self._kafka_config))
            found = topic_configs(self.servers, [self.topic], admin=self._admin)
        except (TopicAdminError, KafkaException) as exc:
            error = error_text(exc)
            if self.estimator.configs_error is None:  # once per streak of failures
                logger.warning("could not read the retention configs of topic %s (%s); %s",
                               self.topic, error,
                               "estimating from the log start only until they can be read"
                               if self.estimator.limits is None else "keeping the last ones")
            self.estimator.set_limits(None, error)
            return
        configs = found.get(self.topic)
        if configs is None:
            self.estimator.set_limits(None, f"topic {self.topic} not found")
            return
        limits = RetentionLimits.from_configs({k: v for k, (v, _own) in configs.items()})
        if limits != self.estimator.limits:
            logger.info("topic %s retention: %s, segments of %s bytes", self.topic,
                        limits.describe(), limits.segment_bytes or "?")
        self.estimator.set_limits(limits)

    def update_report(self) -> None:
        """Rebuilds the report from the estimator and logs a state change."""
        now = time.monotonic()
        report = self.estimator.report(now).as_dict()
        self.report = report
        self._warnings.log(report, now)

    def _run(self, refresh_watermarks: Callable[[], None]) -> None:
        next_configs = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_configs:
                    self.read_limits()
                    next_configs = time.monotonic() + _CONFIGS_SECS
                refresh_watermarks()
                self.update_report()
            except Exception:  # never let the watch end the input; say why once a minute
                logger.exception("retention watch of topic %s failed; retrying", self.topic)
                self._stop.wait(_CONFIGS_SECS)
            self._stop.wait(_WATCH_SECS)
