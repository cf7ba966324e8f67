"""Bad input never stops the trainer: a seeded fuzz of malformed records on a real broker.

More than 10,000 malformed records of every kind the parser knows (plus random bytes and
random text) are mixed with good ones. The trainer must keep going, count each reason in
``/metrics``, forward every rejected record unchanged to the dead-letter topic with its
reason and source headers, and train every good record exactly once (sample ledger).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

from confluent_kafka import Consumer, TopicPartition
from prometheus_client import generate_latest

from odl.config.pipeline_config import load_pipeline_config, parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.features.record_parser import DEFAULT_MAX_RECORD_BYTES
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.http_client import http_request
from odl.harness.topic_records import make_records, produce
from odl.harness.trainer_process import trainer_url
from odl.inputs.dead_letter import (
    REASON_HEADER,
    SOURCE_HEADER,
    TRUNCATED_HEADER,
    DeadLetterSink,
)
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import end_offsets
from tests.harness import run_in_process, write_config

PARTS = 3
N_GOOD = 2000
N_BAD = 10_400
N_OVERSIZED = 4  # ~1 MiB each: the whole backlog stays near 10 MB
SEED = 20261122
MAX_VALUE = 4096

# Column positions of the datagen schema: sample_id, event_time, label, I1..I13, C1..C26.
LABEL, I1, C1 = 2, 3, 16


def _csv(good: bytes, col: int, value: bytes) -> bytes:
    cols = good.split(b",")
    cols[col] = value
    return b",".join(cols)


def _bad_record(kind: str, good: bytes, good_json: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One malformed record of ``kind`` made from a good one; returns (reason, value)."""
    if kind == "empty":
        return "empty", rng.choice([b"", b"\n", b"\r\n"])
    if kind == "oversized":
        return "oversized", good + b"x" * (DEFAULT_MAX_RECORD_BYTES + rng.randrange(1, 500))
    if kind == "invalid_utf8":
        return "invalid_utf8", _csv(good, C1 + rng.randrange(26), rng.choice(
            [b"\xff\xfe", b"\xc3\x28", b"\xe2\x82", b"ab\x80cd", b"\xed\xa0\x80"]))
    if kind == "random_bytes":  # arbitrary bytes holding at least one byte never valid in UTF-8
        raw = bytearray(rng.randbytes(rng.randrange(1, 300)))
        raw[rng.randrange(len(raw))] = rng.choice([0xFF, 0xFE, 0xC0, 0xC1, 0xF8])
        return "invalid_utf8", bytes(raw)
    if kind == "bad_json":
        cut = rng.randrange(1, len(good_json) - 1)
        return "bad_json", rng.choice([good_json[:cut], b"{" + good_json, b"{'a': 1}",
                                       b"{\"label\": 1,}", b"{" * 5000])
    if kind == "json_type":
        doc = json.loads(good_json)
        which = rng.randrange(5)
        if which == 0:
            doc["I1"] = {"nested": 1}
        elif which == 1:
            doc["I2"] = [1, 2]
        elif which == 2:
            doc["I3"] = True
        elif which == 3:
            del doc["label"]
        else:
            doc["label"] = None
        return "json_type", json.dumps(doc).encode()
    if kind == "field_count":
        cols = good.split(b",")
        if rng.random() < 0.5:
            del cols[rng.randrange(len(cols))]
        else:
            cols.insert(rng.randrange(len(cols)), b"extra")
        return "field_count", b",".join(cols)
    if kind == "random_text":  # printable text without separators: one column of 42
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 .-_") for _ in
                       range(rng.randrange(1, 200)))
        return "field_count", ("z" + text).encode()
    if kind == "bad_number":
        return "bad_number", _csv(good, I1 + rng.randrange(13), rng.choice(
            [b"abc", b"1.2.3", b"--1", b"0x", b"1e", b"\xc3\xa9"]))
    if kind == "non_finite":
        return "non_finite", _csv(good, I1 + rng.randrange(13), rng.choice(
            [b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"1e999", b"-1e39"]))
    if kind == "bad_label":
        return "bad_label", _csv(good, LABEL, rng.choice([b"2", b"-1", b"0.5", b"", b"7"]))
    raise AssertionError(kind)


KINDS = ["empty", "invalid_utf8", "random_bytes", "bad_json", "json_type", "field_count",
         "random_text", "bad_number", "non_finite", "bad_label"]


def _stream(seed: int) -> tuple[list[bytes], list[str | None], list[str]]:
    """Seeded mix: (values, reason per value or None for good, good sample ids in order)."""
    rng = random.Random(seed)
    ids, good = make_records(N_GOOD + N_BAD, seed=seed % 1000)
    _, good_json = make_records(N_BAD, seed=seed % 1000 + 1, fmt="json")
    slots = ["good"] * N_GOOD + ["oversized"] * N_OVERSIZED + [
        KINDS[i % len(KINDS)] for i in range(N_BAD - N_OVERSIZED)]
    rng.shuffle(slots)
    values: list[bytes] = []
    reasons: list[str | None] = []
    good_ids: list[str] = []
    bad_i = 0
    for i, kind in enumerate(slots):
        if kind == "good":
            values.append(good[i])
            reasons.append(None)
            good_ids.append(ids[i])
        else:
            reason, value = _bad_record(kind, good[i], good_json[bad_i], rng)
            bad_i += 1
            values.append(value)
            reasons.append(reason)
    return values, reasons, good_ids


def _consume_all(bootstrap: str, topic: str, expected: int, timeout: float = 60) -> list:
    consumer = Consumer(consumer_config(bootstrap, "dlq-check"))
    consumer.assign([TopicPartition(topic, 0, 0)])
    out = []
    deadline = time.time() + timeout
    try:
        while len(out) < expected and time.time() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if msg.error() is None:
                    out.append((msg.value(), dict(msg.headers() or [])))
    finally:
        consumer.close()
    return out


def test_parser_assigns_the_injected_reasons(tmp_path):
    """The generator's claims hold for the parser (so the broker test checks the trainer)."""
    values, reasons, _ = _stream(SEED + 1)
    fb = FeatureBuilder(parse_pipeline_config_text(deepfm_config_text(str(tmp_path))))
    got: dict[int, str] = {}
    for start in range(0, len(values), 512):
        res = fb.build(values[start:start + 512])
        got.update({start + i: r for i, r in res.rejected})
    want = {i: r for i, r in enumerate(reasons) if r is not None}
    assert got == want


def test_fuzzed_stream_trains_good_records_once_counts_and_dead_letters_the_rest(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory(partitions=PARTS, prefix="fuzz",
                                config={"max.message.bytes": str(4 << 20)})
    dlq = kafka_topic_factory(prefix="dlq", create=False)  # the trainer creates it
    values, reasons, good_ids = _stream(SEED)
    expected = Counter(r for r in reasons if r is not None)
    assert sum(expected.values()) >= 10_000 and len(expected) == 9, expected
    assert sum(len(v) for v in values) < 40 << 20
    where = produce(kafka_bootstrap, topic, values, PARTS,
                    config={"message.max.bytes": str(4 << 20)})
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    ledger = str(tmp_path / "ledger.tsv")
    seen_status: dict = {}
    done = threading.Event()

    def grab_status() -> None:  # /metrics while the trainer runs, the last one seen wins
        model_dir = str(tmp_path / "model_dir")
        while not done.is_set():
            url = trainer_url(model_dir)
            try:
                reply = http_request(url + "/metrics", timeout=5) if url else None
            except OSError:
                reply = None
            if reply is not None and reply.status == 200:
                seen_status["metrics"] = reply.body.decode()
            time.sleep(0.1)

    watcher = threading.Thread(target=grab_status, daemon=True)
    watcher.start()
    try:
        trainer = run_in_process(cfg, ends, ledger, status_port=0, timeout=400,
                                 edits={"data_config.dead_letter_topic": dlq})
    finally:
        done.set()
        watcher.join(10)
    # Every good record trained exactly once; every bad one counted by reason.
    assert sorted(ledger_sample_ids(ledger)) == sorted(good_ids)
    assert trainer.records_rejected == dict(expected)
    assert trainer.state == "stopped"
    # /metrics over HTTP (the last scrape before the server stopped, usually final; else
    # the registry it serves, after checking the endpoint did serve the counter).
    assert "odl_records_rejected_total{" in seen_status.get("metrics", ""), "no /metrics seen"
    final = generate_latest(trainer.metrics.registry).decode()
    for reason, n in expected.items():
        line = f'odl_records_rejected_total{{reason="{reason}"}} {float(n)}'
        assert line in final, reason
    if "odl_records_consumed_total " + str(float(len(values))) in seen_status["metrics"]:
        assert all(f'odl_records_rejected_total{{reason="{r}"}} {float(n)}'
                   in seen_status["metrics"] for r, n in expected.items())
    # Dead-letter topic: one message per rejected record, value unchanged, reason + source.
    dl = trainer.status()["dead_letter"]
    assert dl["delivered"] == sum(expected.values()) and dl["dropped"] == 0, dl
    letters = _consume_all(kafka_bootstrap, dlq, sum(expected.values()))
    assert len(letters) == sum(expected.values())
    by_source = {(topic, p, o): i for i, (p, o) in enumerate(where)}
    got_reasons: Counter = Counter()
    for value, headers in letters:
        src_topic, p, o = headers[SOURCE_HEADER].decode().rsplit("/", 2)
        i = by_source[(src_topic, int(p), int(o))]
        reason = headers[REASON_HEADER].decode()
        assert reason == reasons[i], (i, reason, reasons[i])
        assert value == values[i] or (not values[i] and not value)
        got_reasons[reason] += 1
    assert got_reasons == expected


def test_dead_letter_sink_truncates_huge_values_and_drops_when_full(kafka_bootstrap,
                                                                     kafka_topic_factory):
    topic = kafka_topic_factory(prefix="dlq", create=False)
    sink = DeadLetterSink(kafka_bootstrap, topic, max_queued_records=3,
                          max_queued_bytes=MAX_VALUE + 100, max_value_bytes=MAX_VALUE)
    try:
        huge = b"y" * (MAX_VALUE + 10)
        assert sink.send(huge, "oversized", "in", 1, 5, timestamp_ms=1_700_000_000_000)
        accepted = [sink.send(b"v%d" % i, "empty", "in", 0, i) for i in range(20)]
        assert sink.flush(30)
    finally:
        sink.close()
    assert sink.dropped == accepted.count(False) and sink.dropped > 0
    assert sink.delivered == 1 + accepted.count(True)
    letters = _consume_all(kafka_bootstrap, topic, sink.delivered)
    big = [(v, h) for v, h in letters if h[REASON_HEADER] == b"oversized"]
    assert len(big) == 1
    assert len(big[0][0]) == MAX_VALUE
    assert big[0][1][TRUNCATED_HEADER] == str(len(huge)).encode()
    assert big[0][1][SOURCE_HEADER] == b"in/1/5"


def test_dead_letter_topic_must_differ_from_input(tmp_path):
    from odl.config.config_error import ConfigError
    from odl.models.model_registry import check_pipeline_config

    cfg = load_pipeline_config(write_config(tmp_path, "127.0.0.1:1", "samples"),
                               '{"data_config.dead_letter_topic": "samples"}')
    try:
        check_pipeline_config(cfg, online=True)
    except ConfigError as exc:
        assert "data_config.dead_letter_topic" in str(exc)
    else:
        raise AssertionError("accepted a dead-letter topic equal to the input topic")
