"""The retention risk estimator on synthetic observations (no broker).

Each scenario feeds :class:`odl.inputs.retention_risk.RetentionEstimator` one observation a
second (position, watermarks, the age of the record at the position) and checks the state,
``seconds_to_loss``, ``headroom_records`` and which signal limited them; then the summary, the
warning texts and their rate limit, and the trainer's gauges.
"""

from __future__ import annotations

import logging
import math

import pytest
from prometheus_client import generate_latest

from odl.inputs.retention_risk import (
    BEHIND,
    LOSING,
    OK,
    RetentionEstimator,
    RetentionLimits,
    RetentionWarnings,
    input_warning,
)
from odl.inputs.source_factory import source_retention
from odl.train.trainer_metrics import TrainerMetrics

# 1 MB per partition in 100 kB segments; records of 84 value bytes + 16 overhead = 100 bytes,
# so a partition surely keeps (1_000_000 - 100_000) / 100 = 9,000 records
SIZE = RetentionLimits(retention_bytes=1_000_000, retention_ms=None, segment_bytes=100_000)


def _estimator(limits: RetentionLimits | None = SIZE, value_bytes: int = 84,
               **kw) -> RetentionEstimator:
    est = RetentionEstimator(**kw)
    if limits is not None:
        est.set_limits(limits)
    if value_bytes:
        est.note_records(1000, 1000 * value_bytes)
    return est


def _feed(est: RetentionEstimator, seconds: int, position, low, high, age=None,
          partition: int = 0) -> None:
    """One observation per second for ``seconds`` s; each argument a function of t."""
    for t in range(seconds):
        est.observe(partition, float(t), position(t), low(t), high(t),
                    None if age is None else age(t))


def test_limits_from_topic_configs():
    limits = RetentionLimits.from_configs({"retention.bytes": "2097152", "retention.ms": "-1",
                                           "segment.bytes": "1048576"})
    assert limits == RetentionLimits(2 * 1048576, None, 1048576)
    assert limits.kept_bytes == 1048576  # the limit less one segment
    assert limits.describe() == "2 MiB per partition, no age limit"
    # a segment as large as the limit: half the limit is still kept
    assert RetentionLimits(1000, None, 5000).kept_bytes == 500
    assert RetentionLimits.from_configs({"retention.bytes": "x"}) == RetentionLimits()
    assert RetentionLimits().kept_bytes is None


def test_growing_lag_under_a_size_limit_is_behind_with_the_time_to_loss():
    est = _estimator()
    # the log grows 200 records/s, the trainer reads 100/s: the lag grows 100/s to 1,000+
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 1000 + 200 * t)
    risk = est.partition_risk(0, now=29.0)
    lag = 1000 + 100 * 29
    assert risk.lag == lag and risk.lag_growth_per_s == pytest.approx(100.0)
    assert risk.headroom_records == 9000 - lag
    assert risk.seconds_to_loss == pytest.approx((9000 - lag) / 100.0)
    assert risk.state == BEHIND and risk.limited_by == "size"


def test_slowly_growing_lag_far_from_the_limit_is_ok_with_a_finite_time():
    est = _estimator()
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 1000 + 101 * t)
    risk = est.partition_risk(0, now=29.0)
    assert risk.seconds_to_loss == pytest.approx((9000 - 1029) / 1.0, rel=1e-6)
    assert risk.seconds_to_loss > est.warn_seconds and risk.state == OK


def test_threshold_is_a_constructor_parameter():
    est = _estimator(warn_seconds=10_000)
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 1000 + 101 * t)
    assert est.partition_risk(0, now=29.0).state == BEHIND


def test_steady_lag_has_no_time_to_loss_unless_headroom_is_small():
    est = _estimator()
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 50 + 100 * t)
    risk = est.partition_risk(0, now=29.0)
    assert (risk.state, risk.seconds_to_loss, risk.headroom_records) == (OK, None, 8950)
    assert risk.lag_growth_per_s == pytest.approx(0.0, abs=1e-9)
    # 8,000 behind and steady: 1,000 records of headroom, under a fifth of the 9,000 kept
    est = _estimator()
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 8000 + 100 * t)
    risk = est.partition_risk(0, now=29.0)
    assert (risk.state, risk.seconds_to_loss, risk.headroom_records) == (BEHIND, None, 1000)
    assert risk.limited_by == "size"


def test_caught_up_is_ok_without_figures_of_loss():
    est = _estimator()
    _feed(est, 10, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 100 * t)
    risk = est.partition_risk(0, now=9.0)
    assert (risk.state, risk.seconds_to_loss, risk.lag) == (OK, None, 0)


def test_log_start_passing_the_position_is_losing():
    est = _estimator()
    _feed(est, 5, position=lambda t: 500, low=lambda t: 400 + 100 * t, high=lambda t: 9000)
    risk = est.partition_risk(0, now=4.0)
    assert risk.state == LOSING and risk.seconds_to_loss == 0.0
    assert risk.records_lost == 300 and risk.low_watermark == 800 and risk.read_position == 500


def test_a_reset_past_deleted_records_stays_losing_for_the_hold_time():
    est = _estimator(loss_hold_s=60.0)
    est.observe(0, 0.0, 800, 800, 9000)
    est.note_loss(0, 300, t=0.0)
    est.observe(0, 1.0, 810, 800, 9000)
    assert est.partition_risk(0, now=1.0).state == LOSING
    assert est.partition_risk(0, now=1.0).records_lost == 300
    est.observe(0, 61.0, 9000, 800, 9000)
    risk = est.partition_risk(0, now=61.0)
    assert risk.state == OK and risk.records_lost == 300


def test_log_start_signal_without_any_config():
    """No limits known: a log start moving towards the position gives the time left."""
    est = _estimator(limits=None)
    # the broker deletes 100 records/s (at its limit), the trainer reads 50/s
    _feed(est, 20, position=lambda t: 5000 + 50 * t, low=lambda t: 3000 + 100 * t,
          high=lambda t: 20000 + 100 * t)
    risk = est.partition_risk(0, now=19.0)
    distance = (5000 + 50 * 19) - (3000 + 100 * 19)
    assert risk.headroom_records == distance
    assert risk.seconds_to_loss == pytest.approx(distance / 50.0)
    assert risk.state == BEHIND and risk.limited_by == "log_start"


def test_log_start_corrects_a_size_estimate_that_is_too_generous():
    """Records larger at the broker than their values (compression off, big keys): the log
    start shows the partition full long before the size model thinks it is."""
    est = _estimator(value_bytes=20)  # 36 bytes a record by the model: 25,000 records kept
    _feed(est, 20, position=lambda t: 5000 + 50 * t, low=lambda t: 3000 + 100 * t,
          high=lambda t: 12000 + 100 * t)
    risk = est.partition_risk(0, now=19.0)
    assert risk.headroom_records == (5000 + 950) - (3000 + 1900)
    assert risk.limited_by == "log_start" and risk.state == BEHIND


def test_time_retention_of_a_stalled_reader():
    est = _estimator(limits=RetentionLimits(None, 3_600_000, None))
    # stalled: the position does not move, its record ages 1 s a second, 3,400 s old at t=0
    _feed(est, 20, position=lambda t: 100, low=lambda t: 0, high=lambda t: 200 + 10 * t,
          age=lambda t: 3400.0 + t)
    risk = est.partition_risk(0, now=19.0)
    assert risk.seconds_to_loss == pytest.approx(3600 - 3419, rel=1e-6)
    assert risk.state == BEHIND and risk.limited_by == "time"
    assert risk.headroom_records is None  # no size limit


def test_time_retention_of_a_reader_keeping_pace():
    est = _estimator(limits=RetentionLimits(None, 3_600_000, None))
    _feed(est, 20, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 500 + 100 * t,
          age=lambda t: 600.0)
    assert est.partition_risk(0, now=19.0).state == OK
    # as far behind in time, but past 80 % of retention.ms: behind, not growing
    est = _estimator(limits=RetentionLimits(None, 3_600_000, None))
    _feed(est, 20, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 500 + 100 * t,
          age=lambda t: 3000.0)
    risk = est.partition_risk(0, now=19.0)
    assert (risk.state, risk.seconds_to_loss, risk.limited_by) == (BEHIND, None, "time")


def test_rates_need_a_span_and_follow_the_window():
    est = _estimator(window_s=10.0)
    est.observe(0, 0.0, 0, 0, 100)
    risk = est.partition_risk(0, now=0.0)
    assert risk.lag_growth_per_s is None and risk.seconds_to_loss is None
    # a burst long ago falls out of the window: only the last 10 s count
    _feed(est, 40, position=lambda t: 100 * t,
          low=lambda t: 0, high=lambda t: 100 * t + (1000 if t >= 5 else 100 + 180 * t))
    risk = est.partition_risk(0, now=39.0)
    assert risk.lag_growth_per_s == pytest.approx(0.0, abs=1e-9) and risk.state == OK


def test_unknown_watermarks_and_unobserved_partitions():
    est = _estimator()
    est.observe(0, 0.0, 0, -1, -1)  # watermarks not known yet: ignored
    assert est.report(0.0).partitions == {}
    risk = est.partition_risk(3, now=0.0)
    assert (risk.state, risk.seconds_to_loss, risk.headroom_records) == (OK, None, None)


def _two_partitions() -> RetentionEstimator:
    """Partition 0 keeps up; partition 1's lag grows by 100 records a second."""
    est = _estimator()
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 50 + 100 * t,
          partition=0)
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 1000 + 200 * t,
          partition=1)
    return est


def test_report_summary_names_the_worst_partition():
    est = _two_partitions()
    doc = est.report(now=29.0).as_dict()
    assert doc["state"] == BEHIND and doc["partition"] == 1
    assert doc["seconds_to_loss"] == pytest.approx((9000 - 3900) / 100.0, abs=0.1)
    assert doc["headroom_records"] == 9000 - 3900
    assert doc["retention_bytes"] == 1_000_000 and doc["segment_bytes"] == 100_000
    assert doc["bytes_per_record"] == 100.0 and doc["records_lost"] == 0
    assert set(doc["partitions"]) == {"0", "1"}
    assert doc["partitions"]["0"]["state"] == OK
    text = input_warning(doc)
    assert text.startswith("behind: partition 1 will lose data in ~51 s (lag 3900, headroom "
                           "5100 records, limited by size; retention ")
    assert input_warning({**doc, "state": OK}) is None and input_warning(None) is None


def test_configs_that_cannot_be_read_keep_the_last_limits():
    est = _estimator()
    est.set_limits(None, "broker unreachable")
    assert est.limits == SIZE
    doc = est.report(0.0).as_dict()
    assert doc["configs_error"] == "broker unreachable" and doc["retention_bytes"] == 1_000_000
    est.set_limits(RetentionLimits(None, None, None))
    assert est.report(0.0).as_dict()["configs_error"] is None


def test_warnings_are_logged_on_change_and_at_most_once_a_minute(caplog):
    est = _estimator()
    warnings = RetentionWarnings("samples", interval_s=60.0)
    caplog.set_level(logging.INFO, logger="odl.inputs.retention_risk")
    _feed(est, 30, position=lambda t: 100 * t, low=lambda t: 0, high=lambda t: 1000 + 200 * t)
    behind = est.report(29.0).as_dict()
    assert warnings.log(behind, now=100.0) == 1
    assert warnings.log(behind, now=130.0) == 0  # same state within the minute
    assert warnings.log(behind, now=161.0) == 1
    lines = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2
    assert lines[0].getMessage().startswith("behind: partition 0 of topic samples will lose "
                                            "data in ~")
    # a change of state is logged at once; so is the way back
    losing = {**behind, "partitions": {"0": {**behind["partitions"]["0"], "state": LOSING,
                                             "records_lost": 7}}}
    assert warnings.log(losing, now=162.0) == 1
    assert "losing: partition 0 of topic samples: 7 records deleted" in caplog.records[-1].message
    ok = {**behind, "partitions": {"0": {**behind["partitions"]["0"], "state": OK}}}
    assert warnings.log(ok, now=163.0) == 1 and warnings.log(ok, now=164.0) == 0
    assert caplog.records[-1].levelno == logging.INFO


def test_sources_without_retention_report_none():
    class DatahubLike:  # no retention_report
        pass

    assert source_retention(DatahubLike()) is None


def test_trainer_gauges_from_a_report():
    est = _two_partitions()
    metrics = TrainerMetrics()
    metrics.set_retention(None)  # files, DataHub: nothing
    assert "odl_input_retention_state{" not in generate_latest(metrics.registry).decode()
    metrics.set_retention(est.report(29.0).as_dict())
    text = generate_latest(metrics.registry).decode()
    assert 'odl_input_seconds_to_retention_loss{partition="0"} +Inf' in text
    assert 'odl_input_retention_state{partition="0"} 0.0' in text
    assert 'odl_input_retention_state{partition="1"} 1.0' in text
    assert 'odl_input_retention_headroom_records{partition="1"} 5100.0' in text
    assert 'odl_input_retention_lost_records{partition="1"} 0.0' in text
    seconds = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('odl_input_seconds_to_retention_loss{partition="1"}')]
    assert seconds and math.isclose(seconds[0], 51.0, abs_tol=0.1)


def test_time_retention_ignores_one_record_of_a_sparse_stream():
    """A record arriving after a long pause is read at once: one observation of its age (its
    predecessor's, 50 min) is no sign of falling behind a 1 h retention."""
    est = _estimator(limits=RetentionLimits(None, 3_600_000, None))
    _feed(est, 10, position=lambda t: 100, low=lambda t: 0, high=lambda t: 100)
    est.observe(0, 10.0, 100, 0, 101, 3000.0)
    assert est.partition_risk(0, now=10.0).state == OK
    est.observe(0, 11.0, 100, 0, 101, 3001.0)  # still unread a second later: behind
    assert est.partition_risk(0, now=11.0).state == BEHIND


def test_log_start_bounds_the_capacity_when_records_are_larger_than_their_values():
    """Keys ten times the values: the size model thinks 9,000 records fit, the partition
    keeps 900. Caught up but for a few records, the trainer is not behind."""
    est = _estimator()
    _feed(est, 20, position=lambda t: 1000 + 100 * t - 5, low=lambda t: 100 + 100 * t,
          high=lambda t: 1000 + 100 * t)
    risk = est.partition_risk(0, now=19.0)
    assert risk.headroom_records == 895 and risk.state == OK
    # 750 of the 900 behind: a sixth left, under the fifth that warns
    est = _estimator()
    _feed(est, 20, position=lambda t: 250 + 100 * t, low=lambda t: 100 + 100 * t,
          high=lambda t: 1000 + 100 * t)
    risk = est.partition_risk(0, now=19.0)
    assert (risk.state, risk.headroom_records, risk.limited_by) == (BEHIND, 150, "log_start")
