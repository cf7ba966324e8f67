"""A trainer falling behind a topic with small retention says so before records are deleted.

The topic keeps 256 KiB per partition in 64 KiB segments (the standard topic configs,
which the embedded broker enforces as Kafka does: whole segments, oldest first, while the
rest still holds ``retention.bytes``). A real trainer (in this process, with its status API
and its Kafka input process) is held inside its first train step, so it reads no further
than the batches its input buffers. Records are then produced a chunk at a time, each chunk
only once ``/status`` shows it, and the broker's log start is checked after each:

* ``/status`` ``input.retention`` turns ``behind`` with a finite ``seconds_to_loss`` while the
  log start is still at 0 (nothing deleted, so at or below the trainer's position), and
  ``/healthz`` (200, the warning in its reason), ``/metrics`` and the input's log say so too;
* once the log start passes the input's read position, it turns ``losing``.

Released, the trainer reads on from the log start and stops cleanly. A source read in the
trainer's own threads (``input_process: false``) reports the same way: its report is checked
directly on a ``KafkaSource``. Against an external
broker (``ODL_KAFKA_BOOTSTRAP``) the test is skipped: a real Kafka deletes segments only every
``log.retention.check.interval.ms`` (5 minutes) and, from 4.0 on, refuses segments under
1 MiB.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
from confluent_kafka import Consumer, TopicPartition

from odl.config.pipeline_config import load_pipeline_config
from odl.harness.http_client import get_json, http_request
from odl.harness.topic_records import make_records, produce
from odl.harness.trainer_process import trainer_url
from odl.inputs.kafka_source import KafkaSource
from odl.inputs.start_positions import StartPositions
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import create_topic
from odl.models.model_registry import check_pipeline_config
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import run_in_thread, wait_for_value, write_config

EXTERNAL_BOOTSTRAP_ENV = "ODL_KAFKA_BOOTSTRAP"  # as in conftest.py
RETENTION_BYTES = 256 << 10
SEGMENT_BYTES = 64 << 10
FIRST_CHUNK = 400  # more than the input buffers (credit, prefetcher, the batch in hand)
CHUNK = 50
MAX_RECORDS = 3000  # ~1 MB of records, four times the limit: a warning must have come


@pytest.mark.slow
def test_behind_is_reported_before_retention_deletes_unread_records(
        kafka_bootstrap, kafka_topic_factory, tmp_path, capfd, caplog):
    if os.environ.get(EXTERNAL_BOOTSTRAP_ENV):
        pytest.skip("a real Kafka deletes segments every 5 minutes (and needs 1 MiB ones)")
    # the input process logs at the root level it is started with (an earlier test may have
    # raised it): warnings, as odl-train's default INFO lets through
    caplog.set_level(logging.WARNING)
    topic = kafka_topic_factory(create=False)
    create_topic(kafka_bootstrap, topic, 1, config={
        "retention.bytes": str(RETENTION_BYTES), "segment.bytes": str(SEGMENT_BYTES),
        "retention.ms": "3600000"})
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=32)
    config = load_pipeline_config(cfg)
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=0))
    model_dir = str(tmp_path / "model_dir")
    release = threading.Event()
    train_step = trainer.module.train_step

    def held_train_step(*args, **kwargs):  # the first step waits until the test is done
        release.wait()
        return train_step(*args, **kwargs)

    trainer.module.train_step = held_train_step
    thread, outcome = run_in_thread(trainer)
    marks = Consumer(consumer_config(kafka_bootstrap, "odl-test-marks"))

    def log_start() -> int:
        return marks.get_watermark_offsets(TopicPartition(topic, 0), timeout=10,
                                           cached=False)[0]

    try:
        url = wait_for_value(lambda: trainer_url(model_dir), "the status API", 60)

        def status() -> dict:
            return get_json(url + "/status") or {}

        def showing(end: int) -> dict:
            """``/status`` once it shows partition 0's log end at ``end``."""
            return wait_for_value(lambda: (doc := status()) and (doc["input"]["partitions"]
                                                        .get("0", {})
                                                        .get("high_watermark") == end) and doc,
                         f"/status to show the log end {end}")

        first = wait_for_value(lambda: (doc := status()).get("state") == "training"
                      and doc["input"]["retention"] is not None and doc,
                      "the trainer to train, with a retention report", 60)
        assert first["input"]["retention"]["state"] == "ok"
        assert first["input"]["retention"]["warning"] is None
        produced, seed = 0, 0
        behind = None
        while behind is None:
            n = FIRST_CHUNK if produced == 0 else CHUNK
            assert produced + n <= MAX_RECORDS, (
                f"no retention warning after {produced} records; last: {status()['input']}")
            produce(kafka_bootstrap, topic, make_records(n, seed=seed)[1])
            produced, seed = produced + n, seed + 1
            doc = showing(produced)
            low = log_start()
            position = doc["input"]["partitions"]["0"]["position"]
            assert low <= position, (
                f"records {position}..{low - 1} deleted before any warning: {doc['input']}")
            if doc["input"]["retention"]["state"] == "behind":
                behind = doc
        summary = behind["input"]["retention"]
        risk = behind["input"]["partitions"]["0"]["retention"]
        assert summary["partition"] == 0 and summary["seconds_to_loss"] is not None
        assert summary["warning"].startswith("behind: partition 0 will lose data in ~")
        assert 0 <= summary["seconds_to_loss"] <= summary["warn_seconds"]
        assert risk["state"] == "behind" and risk["lag"] > 0 and risk["records_lost"] == 0
        assert summary["retention_bytes"] == RETENTION_BYTES
        assert summary["segment_bytes"] == SEGMENT_BYTES
        assert log_start() == 0  # nothing deleted yet

        health = http_request(url + "/healthz")
        assert health.status == 200, health.body
        reason = health.json()["reason"]
        assert reason.startswith("training; behind: partition 0 will lose data"), reason
        metrics = http_request(url + "/metrics").body.decode()
        assert 'odl_input_retention_state{partition="0"} 1.0' in metrics
        seconds = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith('odl_input_seconds_to_retention_loss{partition="0"}')]
        assert seconds and seconds[0] < float("inf")
        assert "odl_input_retention_headroom_records{partition=\"0\"}" in metrics

        # more records than the partition keeps: the log start passes the read position
        read_position = risk["read_position"]
        produce(kafka_bootstrap, topic, make_records(4 * FIRST_CHUNK, seed=seed)[1])
        produced += 4 * FIRST_CHUNK
        wait_for_value(lambda: log_start() > read_position, "retention to delete unread records")
        losing = wait_for_value(lambda: ((doc := status()).get("input", {}).get("retention") or {})
                       .get("state") == "losing" and doc, "/status to say losing")
        lost = losing["input"]["partitions"]["0"]["retention"]
        assert lost["records_lost"] > 0 and lost["seconds_to_loss"] == 0
        health = http_request(url + "/healthz")
        assert health.status == 200 and "losing: partition 0" in health.json()["reason"]
        assert ('odl_input_retention_state{partition="0"} 2.0'
                in http_request(url + "/metrics").body.decode())
    finally:
        release.set()
        marks.close()
        trainer.request_stop("test: done")
        thread.join(120)
    assert not thread.is_alive() and outcome.get("rc") == 0, outcome
    err = capfd.readouterr().err
    assert f"behind: partition 0 of topic {topic} will lose data in ~" in err
    assert f"losing: partition 0 of topic {topic}" in err


def test_source_reports_the_topic_retention_and_ok_when_it_keeps_up(
        kafka_bootstrap, kafka_topic_factory):
    """The report a ``KafkaSource`` keeps (what the in-process input layout shows): the topic's
    limits, the record size it reads, ``ok`` while it keeps up; none without the watch."""
    topic = kafka_topic_factory(create=False)
    create_topic(kafka_bootstrap, topic, 2, config={
        "retention.bytes": str(RETENTION_BYTES), "segment.bytes": str(SEGMENT_BYTES),
        "retention.ms": "-1"})
    values = make_records(100, seed=1)[1]
    produce(kafka_bootstrap, topic, values, 2)
    source = KafkaSource(kafka_bootstrap, topic, "odl-test-retention", StartPositions(),
                         batch_size=32, fetch_interval_ms=10)
    quiet = KafkaSource(kafka_bootstrap, topic, "odl-test-retention", StartPositions(),
                        batch_size=32, watch_retention=False)
    try:
        source.open()
        quiet.open()
        read = [0]

        def read_all() -> bool:
            batch = source.read_batch()
            read[0] += len(batch) if batch is not None else 0
            return read[0] >= len(values)

        wait_for_value(read_all, "the records to be read")
        report = wait_for_value(lambda: (r := source.retention_report()) and r["bytes_per_record"]
                       and all(p["lag"] == 0 for p in r["partitions"].values()) and r,
                       "a report of the records read")
        assert report["state"] == "ok" and set(report["partitions"]) == {"0", "1"}
        assert (report["retention_bytes"], report["retention_ms"], report["segment_bytes"]) == (
            RETENTION_BYTES, None, SEGMENT_BYTES)
        assert report["retention"] == "0.25 MiB per partition, no age limit"
        mean = sum(map(len, values)) / len(values)
        assert report["bytes_per_record"] == pytest.approx(mean + 16, rel=0.05)
        assert report["configs_error"] is None and report["records_lost"] == 0
        assert quiet.retention_report() is None
    finally:
        source.close()
        quiet.close()
