"""Prometheus metrics of one serving process (own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServingMetrics:
    """Serving's counters, gauges and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("odl_serving_predict_requests", "/predict requests by HTTP code",
                                ["code"], registry=r)
        self.records = Counter("odl_serving_predict_records", "Records predicted", registry=r)
        self.refused = Counter(
            "odl_serving_predict_refused",
            "/predict requests refused by a limit (body_too_large, too_many_records, "
            "inflight_requests, inflight_bytes, body_timeout)", ["reason"], registry=r)
        self.client_disconnects = Counter(
            "odl_serving_predict_client_disconnects",
            "/predict clients gone before their body was complete (counted as code 499)",
            registry=r)
        self.inflight_requests = Gauge("odl_serving_predict_inflight_requests",
                                       "/predict requests being read or answered", registry=r)
        self.inflight_bytes = Gauge("odl_serving_predict_inflight_bytes",
                                    "Body bytes held by in-flight /predict requests",
                                    registry=r)
        self.latency = Histogram(
            "odl_serving_predict_seconds", "Time to answer /predict (parse + model)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=r)
        self.messages = Counter("odl_serving_delta_messages", "Delta messages read", registry=r)
        self.rejected = Counter("odl_serving_delta_rejected",
                                "Delta messages / versions rejected, by reason", ["reason"],
                                registry=r)
        self.versions = Counter("odl_serving_versions_applied", "Versions applied", registry=r)
        self.rows = Counter("odl_serving_rows_applied", "Embedding rows applied", registry=r)
        self.version = Gauge("odl_serving_version", "Version applied last", registry=r)
        self.freshness = Gauge("odl_serving_freshness_seconds",
                               "Now minus the newest sample event time of the applied versions",
                               registry=r)
        self.lag = Gauge("odl_serving_delta_lag", "Delta messages behind the topic end",
                         registry=r)
        self.broker_up = Gauge("odl_serving_broker_up", "1 when the delta broker is reachable",
                               registry=r)
        self.healthy = Gauge("odl_serving_healthy", "1 while /healthz answers 200, else 0 (set "
                             "at each /healthz and /metrics request)", registry=r)
        self.dynamic_rows = Gauge("odl_serving_dynamic_table_live_rows",
                                  "Ids with a row in a dynamic table", ["table"], registry=r)
        self.deletes = Counter("odl_serving_ids_deleted",
                               "Ids deleted from dynamic tables by versions", registry=r)
