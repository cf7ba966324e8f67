"""Prometheus metrics of one trainer process (own registry, so tests can run several)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

from odl.inputs.retention_risk import STATE_LEVELS
from odl.storage.oss_metrics import register_oss_metrics


class TrainerMetrics:
    """The trainer's counters and gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_oss_metrics(r)
        self.records_consumed = Counter(
            "odl_records_consumed", "Records read from the input", registry=r
        )
        self.records_rejected = Counter(
            "odl_records_rejected", "Malformed records skipped, by reason", ["reason"], registry=r
        )
        self.samples_trained = Counter("odl_samples_trained", "Samples trained on", registry=r)
        self.steps = Counter("odl_train_steps", "Training steps", registry=r)
        self.global_step = Gauge("odl_global_step", "Current global step", registry=r)
        self.samples_per_sec = Gauge(
            "odl_samples_per_second",
            "Training rate over the last 5 s (since the start, before the first 5 s)", registry=r
        )
        self.loss = Gauge("odl_loss", "Loss of the last step", registry=r)
        self.healthy = Gauge("odl_healthy", "1 while /healthz answers 200, else 0 (set at "
                             "each /healthz and /metrics request)", registry=r)
        self.auc = Gauge("odl_progressive_auc", "Windowed progressive AUC", registry=r)
        self.logloss = Gauge("odl_progressive_logloss", "Windowed progressive logloss", registry=r)
        self.eval_auc = Gauge("odl_eval_auc", "AUC of the last evaluation on kafka_eval_input",
                              registry=r)
        self.eval_logloss = Gauge("odl_eval_logloss", "Logloss of the last evaluation on "
                                  "kafka_eval_input", registry=r)
        self.eval_samples = Gauge("odl_eval_samples", "Records scored by the last evaluation "
                                  "on kafka_eval_input", registry=r)
        self.gauc = Gauge("odl_progressive_gauc", "Windowed progressive GAUC (grouped_auc's "
                          "grouping key)", registry=r)
        self.task_auc = Gauge("odl_task_progressive_auc", "Windowed progressive AUC per task "
                              "(multi-task models)", ["task"], registry=r)
        self.task_logloss = Gauge("odl_task_progressive_logloss", "Windowed progressive logloss "
                                  "per task (multi-task models)", ["task"], registry=r)
        self.mse = Gauge("odl_progressive_mse", "Windowed progressive mean squared error (a "
                         "regression output: every loss term L2_LOSS)", registry=r)
        self.task_mse = Gauge("odl_task_progressive_mse", "Windowed progressive mean squared "
                              "error per regression task (multi-task models)", ["task"],
                              registry=r)
        self.lag = Gauge(
            "odl_partition_lag", "Records behind the partition end", ["partition"], registry=r
        )
        self.position = Gauge(
            "odl_partition_position", "Next offset to train per partition", ["partition"],
            registry=r,
        )
        self.retention_seconds = Gauge(
            "odl_input_seconds_to_retention_loss", "Seconds until retention deletes records of "
            "the partition that were not read yet (+Inf: no loss foreseen; 0: deleting now)",
            ["partition"], registry=r)
        self.retention_headroom = Gauge(
            "odl_input_retention_headroom_records", "How many more records the partition's lag "
            "can grow by before retention deletes unread ones (+Inf: no size limit known)",
            ["partition"], registry=r)
        self.retention_state = Gauge(
            "odl_input_retention_state", "Retention risk of the partition: 0 ok, 1 behind (will "
            "lose records within the warning time), 2 losing (records deleted before they were "
            "read)", ["partition"], registry=r)
        self.retention_lost = Gauge(
            "odl_input_retention_lost_records", "Records of the partition deleted by retention "
            "before they were read, since the input started", ["partition"], registry=r)
        self.checkpoint_step = Gauge(
            "odl_checkpoint_last_step", "Step of the last checkpoint written", registry=r
        )
        self.checkpoint_failures = Counter(
            "odl_checkpoint_failures", "Checkpoints that could not be written", registry=r
        )
        self.wide_rate_level = Gauge(
            "odl_wide_rate_level", "In-batch learning's wide rate in the logit's space, as a "
            "multiple of the table rate (adapted to the stream; docs/training.md)", registry=r)
        self.wide_rate_multiplier = Gauge(
            "odl_wide_rate_multiplier", "The wide tables' learning rate over the table rate "
            "(the level over the logit's sensitivity to the wide part)", registry=r)
        self.in_batch_loss_gain = Gauge(
            "odl_in_batch_loss_gain", "How much in-batch learning's shift lowers the step's "
            "loss, relative, smoothed over steps (docs/training.md)", registry=r)
        self.in_batch_active = Gauge(
            "odl_in_batch_active", "1 while in-batch learning runs at every step, 0 while the "
            "trainer has it off for the stream (docs/training.md#in-batch-learning)", registry=r)
        self.broker_up = Gauge("odl_broker_up", "1 when the input broker is reachable", registry=r)
        self.pass_auc = Gauge("odl_pass_auc", "Progressive AUC of the last closed pass (file "
                              "stream)", registry=r)
        self.pass_logloss = Gauge("odl_pass_logloss", "Progressive logloss of the last closed "
                                  "pass (file stream)", registry=r)
        self.pass_samples = Gauge("odl_pass_samples", "Samples of the last closed pass (file "
                                  "stream)", registry=r)
        self.pass_train_auc = Gauge("odl_pass_train_auc", "AUC of the last closed pass's "
                                    "sampled records scored after training on the pass (file "
                                    "stream)", registry=r)
        self.pass_deltas = Counter("odl_pass_deltas", "Pass delta directories written "
                                   "(file_stream_input.model_save_path)", registry=r)
        self.day_bases = Counter("odl_day_bases", "Day bases written "
                                 "(file_stream_input.model_save_path)", registry=r)
        # several ranks: each rank as rank 0 last saw it (odl.train.job_status)
        self.rank_up = Gauge("odl_rank_up", "1 while a rank reports (its report under "
                             "STALE_AFTER_S old), else 0", ["rank"], registry=r)
        self.rank_samples_trained = Gauge("odl_rank_samples_trained", "Samples a rank trained "
                                          "in this run", ["rank"], registry=r)
        self.rank_samples_per_sec = Gauge("odl_rank_samples_per_second", "A rank's training "
                                          "rate over its last log interval", ["rank"],
                                          registry=r)
        self.rank_global_step = Gauge("odl_rank_global_step", "A rank's global step",
                                      ["rank"], registry=r)
        self.rank_report_age = Gauge("odl_rank_report_age_seconds", "Seconds since rank 0 "
                                     "saw a rank's report change", ["rank"], registry=r)
        self.dynamic = {
            key: Gauge(f"odl_dynamic_table_{key}", text, ["table"], registry=r)
            for key, text in (
                ("live_rows", "Rows of a dynamic table holding an id"),
                ("capacity", "Rows of a dynamic table"),
                ("admitted", "Ids given a row since the table was created"),
                ("rejected", "Candidate ids refused a row (once per step they appeared in)"),
                ("evicted", "Rows evicted (to make room or expired)"),
                ("memory_bytes", "Bytes of a dynamic table: rows, optimizer state, id index"),
            )
        }

    def set_retention(self, report: Optional[Mapping[str, Any]]) -> None:
        """Sets the per-partition retention gauges from the input's retention report.

        Args:
            report: ``odl.inputs.retention_risk.RetentionReport.as_dict()``; None (files,
                DataHub, no report yet) sets nothing.
        """
        if not report:
            return
        for p, risk in (report.get("partitions") or {}).items():
            seconds = risk.get("seconds_to_loss")
            headroom = risk.get("headroom_records")
            self.retention_seconds.labels(partition=p).set(
                math.inf if seconds is None else seconds)
            self.retention_headroom.labels(partition=p).set(
                math.inf if headroom is None else headroom)
            self.retention_state.labels(partition=p).set(
                STATE_LEVELS.get(risk.get("state", "ok"), 0))
            self.retention_lost.labels(partition=p).set(risk.get("records_lost") or 0)

    def set_ranks(self, views: Sequence[Any]) -> None:
        """Sets the per-rank gauges, and lag and position of every rank's partitions.

        Args:
            views: ``odl.train.job_status.RankView`` of every rank (rank 0's own first).
        """
        for view in views:
            rank = str(view.rank)
            self.rank_up.labels(rank=rank).set(1 if view.answering else 0)
            self.rank_report_age.labels(rank=rank).set(view.age_s)
            report = view.report
            if report is None:
                continue
            self.rank_samples_trained.labels(rank=rank).set(report["samples_trained"])
            self.rank_samples_per_sec.labels(rank=rank).set(report["samples_per_sec"])
            self.rank_global_step.labels(rank=rank).set(report["global_step"])
            for p, st in ((report.get("input") or {}).get("partitions") or {}).items():
                self.position.labels(partition=p).set(st["position"])
                self.lag.labels(partition=p).set(-1 if st["lag"] is None else st["lag"])

    def set_dynamic_tables(self, status: dict) -> None:
        """Sets the per-table gauges from ``TrainModule.dynamic_status()``."""
        for table, st in status.items():
            for key, gauge in self.dynamic.items():
                gauge.labels(table=table).set(st[key])
