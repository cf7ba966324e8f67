"""Serving's dashboard: what its page (``GET /``) shows and the figures of its history.

``history_point(status, requests)`` turns one ``/status`` document and the ``/predict``
requests since the previous point (``odl.http.latency_window``) into the flat figures the
history keeps (``odl.http.metric_history``), sampled every ``HISTORY_INTERVAL_S`` seconds:

==============================  ===========================================================
``version``                     the version applied last
``freshness_s``                 now minus the newest sample event time it holds
``publish_age_s``               now minus the publish time of the version applied last
``lag_messages``                delta messages behind the topic's end
``predict_rate``                ``/predict`` requests answered per second
``predict_p50_ms``, ``p99``     their latency percentiles (``predict_p99_ms``)
``rejected.<reason>``           delta messages / versions rejected so far, by reason
``rows.<table>``                live rows of a dynamic table
==============================  ===========================================================
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

from odl.http.dashboard_page import Chart, DashboardLayout

HISTORY_INTERVAL_S = 2.0

SERVING_LAYOUT = DashboardLayout(
    title="odl-serve",
    header=(("state", "state"), ("version", "version"), ("generation", "generation"),
            ("base export", "base_export"), ("delta topic", "delta_topic"),
            ("versions applied", "versions_applied"), ("lag", "lag_messages")),
    charts=(
        Chart("Version", ("version",), "step"),
        Chart("Freshness", ("freshness_s", "publish_age_s"), "s"),
        Chart("Replay lag", ("lag_messages",), "messages"),
        Chart("/predict rate", ("predict_rate",), "requests/s"),
        Chart("/predict latency", ("predict_p50_ms", "predict_p99_ms"), "ms"),
        Chart("Rejected versions", ("rejected.*",), "messages"),
        Chart("Dynamic table rows", ("rows.*",), "rows"),
    ),
    alert_paths=("broker_error", "last_reject"),
)


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def history_point(status: Mapping[str, Any], requests: Mapping[str, Optional[float]],
                  now: Optional[float] = None) -> dict[str, Optional[float]]:
    """The history figures of one status document (module docstring).

    Args:
        status: ``ServingService.status()``.
        requests: ``LatencyWindow.take()`` of the ``/predict`` requests since the last point.
        now: unix time of the sample (default: now).

    Returns:
        Figure name -> number (None: not known now).
    """
    now = time.time() if now is None else now
    published = _num(status.get("last_version_publish_time"))
    out: dict[str, Optional[float]] = {
        "version": _num(status.get("version")),
        "freshness_s": _num(status.get("freshness_seconds")),
        "publish_age_s": now - published if published is not None else None,
        "lag_messages": _num(status.get("lag_messages")),
        "predict_rate": requests.get("rate"),
        "predict_p50_ms": requests.get("p50_ms"),
        "predict_p99_ms": requests.get("p99_ms"),
    }
    for reason, n in (status.get("rejected_by_reason") or {}).items():
        out[f"rejected.{reason}"] = _num(n)
    for table, st in (status.get("dynamic_tables") or {}).items():
        out[f"rows.{table}"] = _num(st.get("live_rows"))
    return out
