"""Fetch pacing of the sample reader (``data_config.fetch_interval_ms``) on a real broker.

A steady stream is read once by an unpaced and once by a paced ``KafkaSource``: both must
read every record exactly once, in partition order, and have read the last one soon after it
was produced (pacing delays records by about two intervals, never more). What pacing saves
(fetch requests, consumer and broker CPU) is measured in ``bench/fetch_pacing.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer

from odl.inputs.kafka_source import KafkaSource
from odl.inputs.start_positions import StartPositions
from odl.kafka.client_settings import producer_config

PARTITIONS = 2
RECORDS = 8000  # per run
RATE = 4000.0  # records/s: a steady stream; an unpaced reader fetches a record or two at a time


def _read_all(source: KafkaSource, stop: threading.Event, out: list[tuple[int, int]]) -> None:
    while not stop.is_set():
        raw = source.read_batch(stop)
        if raw is None:
            continue
        out.extend(zip(raw.partitions.tolist(), raw.offsets.tolist(), strict=True))


def _produce_steadily(bootstrap: str, topic: str, first: int) -> None:
    producer = Producer(producer_config(bootstrap))
    start = time.monotonic()
    for i in range(first, first + RECORDS):
        producer.produce(topic, value=b"%d" % i, partition=i % PARTITIONS)
        if i % 40 == 39:
            producer.poll(0)
            ahead = (i + 1 - first) / RATE - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)
    assert producer.flush(30) == 0


def _stream_through(bootstrap: str, topic: str, first: int, interval_ms: int):
    """Reads a steady stream with one source; returns (records read, seconds from the end of
    the stream until the last record was read)."""
    source = KafkaSource(
        bootstrap, topic, f"odl-test-pacing-{interval_ms}", StartPositions(
            offsets={p: first // PARTITIONS for p in range(PARTITIONS)}),
        batch_size=256, batch_timeout_ms=100, fetch_interval_ms=interval_ms,
    )
    source.open()
    got: list[tuple[int, int]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read_all, args=(source, stop, got), daemon=True)
    reader.start()
    try:
        time.sleep(0.5)  # assigned and fetching
        _produce_steadily(bootstrap, topic, first)
        ended = time.monotonic()
        deadline = ended + 60
        while len(got) < RECORDS and time.monotonic() < deadline:
            time.sleep(0.01)
        tail = time.monotonic() - ended
    finally:
        stop.set()
        reader.join(10)
        source.close()
    return got, tail


@pytest.mark.slow
def test_paced_and_unpaced_readers_read_everything_once_promptly(kafka_bootstrap,
                                                                    kafka_topic_factory):
    topic = kafka_topic_factory(partitions=PARTITIONS)
    for run, (name, interval) in enumerate((("unpaced", 0), ("paced", 20))):
        first = run * RECORDS
        got, tail = _stream_through(kafka_bootstrap, topic, first, interval)
        expected = {(i % PARTITIONS, i // PARTITIONS) for i in range(first, first + RECORDS)}
        assert len(got) == RECORDS, f"{name}: read {len(got)} of {RECORDS}"
        assert set(got) == expected, f"{name}: not every record exactly once"
        for p in range(PARTITIONS):
            offsets = [o for q, o in got if q == p]
            assert offsets == sorted(offsets), f"{name}: partition {p} out of order"
        # batch_timeout 0.1 s + two 20 ms intervals, with room for a loaded CI machine
        assert tail < 3.0, f"{name}: the last record was read {tail:.2f}s after it was produced"


def test_idle_reader_parks_and_resumes_at_its_positions(kafka_bootstrap, kafka_topic_factory):
    """An idle paced reader unassigns its partitions; records produced later are all read
    once, from where it stopped, promptly."""
    topic = kafka_topic_factory(partitions=PARTITIONS)
    source = KafkaSource(kafka_bootstrap, topic, "odl-test-parking", StartPositions(),
                         batch_size=256, batch_timeout_ms=100, fetch_interval_ms=10)
    source.open()
    got: list[tuple[int, int]] = []
    stop = threading.Event()
    reader = threading.Thread(target=_read_all, args=(source, stop, got), daemon=True)
    reader.start()
    producer = Producer(producer_config(kafka_bootstrap))
    try:
        sent = 0
        for burst in (300, 200, 1):
            deadline = time.monotonic() + 10
            while not source.parked and time.monotonic() < deadline:
                time.sleep(0.02)
            assert source.parked, "an idle reader at the log end should park"
            time.sleep(0.3)  # parked for a while
            for i in range(sent, sent + burst):
                producer.produce(topic, value=b"%d" % i, partition=i % PARTITIONS)
            assert producer.flush(30) == 0
            acked = time.monotonic()
            sent += burst
            while len(got) < sent and time.monotonic() < acked + 10:
                time.sleep(0.005)
            waited = time.monotonic() - acked
            assert len(got) == sent, f"read {len(got)} of {sent}"
            # 50 ms log-end polls + the batch timeout (a partial batch) + fetch; a reader
            # that stayed asleep after waking would take a second or more
            assert waited < 0.9, f"burst of {burst} read {waited:.2f}s after its ack"
    finally:
        stop.set()
        reader.join(10)
        source.close()
    expected = {(i % PARTITIONS, i // PARTITIONS) for i in range(sent)}
    assert len(got) == len(expected) and set(got) == expected
