"""The trainer's dashboard: what its page (``GET /``) shows and the figures of its history.

``history_point(status)`` turns one ``/status`` document into the flat figures the history
keeps (``odl.http.metric_history``), sampled every ``HISTORY_INTERVAL_S`` seconds by the
status server:

==============================  ===========================================================
``auc``, ``logloss``            progressive metrics over the window
``auc_total``, ``logloss_total`` since the start; ``gauc``, ``mse``, ``mse_total`` when kept
``auc.task.<t>``                per task of a multi-task model (``logloss.task.<t>`` too)
``auc.pass``, ``logloss.pass``  the last closed pass of a file stream
``auc.eval``, ``logloss.eval``  the last evaluation on the eval stream
``samples_per_sec``, ``loss``   training rate (the job's) and the last step's loss
``samples_per_sec.rank.<r>``    each rank's rate (several ranks)
``global_step``
``lag.<p>``, ``lag_total``      records behind the high watermark, per partition / shard
``published_version``           the last delta version acknowledged
``published_age_s``             seconds since it was
``publish_failures``             the publisher's failures so far
``checkpoint_step``             the last checkpoint's step
``checkpoint_age_s``            seconds since it was written
``checkpoint_error``            1 while the last checkpoint attempt failed, else 0
``rejects.<reason>``            records rejected so far, by reason
``rows.<table>``                live rows of a dynamic table
==============================  ===========================================================
"""

from __future__ import annotations

import time
from typing import Any, Optional

from odl.http.dashboard_page import Chart, DashboardLayout

HISTORY_INTERVAL_S = 2.0

TRAINER_LAYOUT = DashboardLayout(
    title="odl-train",
    header=(("state", "state"), ("stop reason", "stop_reason"), ("generation", "generation"),
            ("global step", "global_step"), ("samples trained", "samples_trained"),
            ("samples/s", "samples_per_sec"), ("ranks", "world_size"), ("device", "device"),
            ("last checkpoint", "last_checkpoint.step"),
            ("published version", "publisher.last_version"), ("topic", "input.topic")),
    charts=(
        Chart("Progressive AUC", ("auc", "auc_total", "gauc", "auc.task.*", "auc.pass",
                                  "auc.eval")),
        Chart("Progressive logloss", ("logloss", "logloss_total", "logloss.task.*",
                                      "logloss.pass", "logloss.eval", "mse")),
        Chart("Training rate", ("samples_per_sec", "samples_per_sec.rank.*"), "samples/s"),
        Chart("Lag", ("lag_total", "lag.*"), "records"),
        Chart("Published version", ("published_version", "checkpoint_step"), "step"),
        Chart("Age of the last version and checkpoint", ("published_age_s", "checkpoint_age_s"),
              "s"),
        Chart("Failures", ("publish_failures", "checkpoint_error"), "count"),
        Chart("Rejected records", ("rejects.*",), "records"),
        Chart("Dynamic table rows", ("rows.*",), "rows"),
    ),
    alert_paths=("failure", "job_warning", "last_checkpoint.error", "input.broker_error",
                 "input.retention.warning", "publisher.last_error"),
)


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def history_point(status: dict[str, Any],
                  now: Optional[float] = None) -> dict[str, Optional[float]]:
    """The history figures of one status document (module docstring).

    Args:
        status: ``TrainerStatus.document()``.
        now: unix time of the sample (default: now).

    Returns:
        Figure name -> number (None: not known now).
    """
    now = time.time() if now is None else now
    out: dict[str, Optional[float]] = {}
    prog = status.get("progressive") or {}
    for key in ("auc", "logloss", "auc_total", "logloss_total", "gauc", "mse", "mse_total"):
        if key in prog:
            out[key] = _num(prog[key])
    for task, summary in (status.get("tasks") or {}).items():
        out[f"auc.task.{task}"] = _num(summary.get("auc"))
        out[f"logloss.task.{task}"] = _num(summary.get("logloss"))
    closed = ((status.get("passes") or {}).get("passes") or [])
    if closed:
        out["auc.pass"] = _num(closed[-1].get("auc"))
        out["logloss.pass"] = _num(closed[-1].get("logloss"))
    evaluation = status.get("evaluation") or {}
    if evaluation:
        out["auc.eval"] = _num(evaluation.get("auc"))
        out["logloss.eval"] = _num(evaluation.get("logloss"))
    out["samples_per_sec"] = _num(status.get("samples_per_sec"))
    ranks = status.get("ranks") or []
    if len(ranks) > 1:
        for r in ranks:
            out[f"samples_per_sec.rank.{r['rank']}"] = _num(r.get("samples_per_sec"))
    out["loss"] = _num(status.get("loss"))
    out["global_step"] = _num(status.get("global_step"))
    lags = {p: _num(st.get("lag"))
            for p, st in ((status.get("input") or {}).get("partitions") or {}).items()}
    for p, lag in lags.items():
        out[f"lag.{p}"] = lag
    known = [v for v in lags.values() if v is not None]
    out["lag_total"] = float(sum(known)) if known else None
    pub = status.get("publisher") or {}
    if pub:
        out["published_version"] = _num(pub.get("last_version"))
        when = _num(pub.get("last_publish_time"))
        out["published_age_s"] = now - when if when is not None else None
        out["publish_failures"] = _num(pub.get("failures"))
    ckpt = status.get("last_checkpoint") or {}
    out["checkpoint_step"] = _num(ckpt.get("step"))
    when = _num(ckpt.get("time"))
    out["checkpoint_age_s"] = now - when if when is not None else None
    out["checkpoint_error"] = 1.0 if ckpt.get("error") else 0.0
    for reason, n in (status.get("records_rejected") or {}).items():
        out[f"rejects.{reason}"] = _num(n)
    for table, st in (status.get("dynamic_tables") or {}).items():
        out[f"rows.{table}"] = _num(st.get("live_rows"))
    return out
