"""Prometheus metrics of this process's OSS use (read from ``oss_store.oss_health`` on scrape).

``odl_oss_up`` (1 while the last OSS operation succeeded), ``odl_oss_requests_total``,
``odl_oss_retries_total``, ``odl_oss_failures_total`` (operations that failed after their
retries), ``odl_oss_bytes_uploaded_total``, ``odl_oss_bytes_downloaded_total``. Nothing is
exported while the process has not used OSS.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from odl.storage.oss_store import oss_health

_COUNTERS = (
    ("requests", "odl_oss_requests", "OSS requests sent"),
    ("retries", "odl_oss_retries", "OSS requests retried after a transient error"),
    ("failures", "odl_oss_failures", "OSS operations that failed after their retries"),
    ("bytes_uploaded", "odl_oss_bytes_uploaded", "Bytes written to OSS"),
    ("bytes_downloaded", "odl_oss_bytes_downloaded", "Bytes read from OSS"),
)


class OssCollector(Collector):
    """Collects the OSS counters at scrape time."""

    def collect(self) -> Iterator:
        """Yields the metric families (none before OSS is used)."""
        health = oss_health()
        if health is None:
            return
        up = GaugeMetricFamily("odl_oss_up", "1 while the last OSS operation succeeded")
        up.add_metric([], 1.0 if health["healthy"] else 0.0)
        yield up
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(health[key]))
            yield c


def register_oss_metrics(registry: CollectorRegistry) -> None:
    """Adds the OSS metrics to a registry."""
    registry.register(OssCollector())
