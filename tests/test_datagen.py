from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, TopicPartition

from odl.auc import HistogramAuc, roc_auc
from odl.datagen.synthetic_ctr import (
    ALL_COLUMNS,
    ALL_FIELDS,
    DENSE_FIELDS,
    SPARSE_FIELDS,
    SyntheticCtrStream,
    decode,
    encode,
)
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import end_offsets

REPO = Path(__file__).resolve().parents[1]


def _datagen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "odl.cli.datagen_cli", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _consume(bootstrap: str, topic: str, partitions: int, n: int) -> list:
    consumer = Consumer(consumer_config(bootstrap, "odl-test-datagen"))
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    msgs = []
    deadline = time.monotonic() + 15
    try:
        while len(msgs) < n and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.5):
                if not msg.error():
                    msgs.append(msg)
        # Anything beyond n would be a duplicate: give it a moment to show up.
        msgs.extend(m for m in consumer.consume(1000, 0.3) if not m.error())
    finally:
        consumer.close()
    return msgs


def test_columns() -> None:
    assert len(ALL_COLUMNS) == 42
    assert ALL_COLUMNS[:3] == ("sample_id", "event_time", "label")
    assert ALL_FIELDS == DENSE_FIELDS + SPARSE_FIELDS
    assert DENSE_FIELDS[0] == "I1" and DENSE_FIELDS[-1] == "I13"
    assert SPARSE_FIELDS[0] == "C1" and SPARSE_FIELDS[-1] == "C26"


def test_cli_produces_exact_count_csv(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = kafka_topic_factory(create=False)
    n = 3000
    before = time.time()
    res = subprocess.run(
        _datagen_cmd(
            "--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "3",
            "--count", str(n), "--rate", "0", "--seed", "7",
        ),
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    after = time.time()
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["topic"] == topic
    assert summary["produced"] == n
    assert summary["delivery_errors"] == 0
    assert 0.6 < summary["oracle_auc"] < 0.95
    assert 0.1 < summary["positive_rate"] < 0.4
    assert sum(end_offsets(kafka_bootstrap, topic).values()) == n

    msgs = _consume(kafka_bootstrap, topic, 3, n)
    assert len(msgs) == n
    ids = set()
    for msg in msgs:
        cols = msg.value().decode().split(",")
        assert len(cols) == 42
        sample_id = cols[0]
        assert msg.key().decode() == sample_id
        ids.add(sample_id)
        number = int(sample_id.rsplit("-", 1)[1])
        assert msg.partition() == number % 3
        ts_type, ts_ms = msg.timestamp()
        assert ts_type == TIMESTAMP_CREATE_TIME
        assert before - 1 <= ts_ms / 1000 <= after + 1
        assert before - 1 <= float(cols[1]) <= after + 1
        assert cols[2] in ("0", "1")
        assert all(0.0 <= float(v) <= 4.0 for v in cols[3:16])
        assert all(len(c) == 8 and int(c, 16) >= 0 and c == c.lower() for c in cols[16:])
    assert len(ids) == n
    assert summary["first_event_time"] <= summary["last_event_time"]


def test_cli_json_rate_limited(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = kafka_topic_factory(2)
    start = time.monotonic()
    res = subprocess.run(
        _datagen_cmd(
            "--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "2",
            "--count", "1000", "--rate", "2000", "--format", "json",
        ),
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["produced"] == 1000
    assert summary["seconds"] >= 0.4  # 1000 samples at 2000/s take ~0.5 s
    assert time.monotonic() - start < 30
    msgs = _consume(kafka_bootstrap, topic, 2, 1000)
    assert len(msgs) == 1000
    for msg in msgs[:50]:
        rec = json.loads(msg.value())
        assert list(rec) == list(ALL_COLUMNS)
        assert isinstance(rec["label"], int)
        assert isinstance(rec["event_time"], float)
        assert all(isinstance(rec[f], (int, float)) for f in DENSE_FIELDS)
        assert all(isinstance(rec[f], str) and len(rec[f]) == 8 for f in SPARSE_FIELDS)
        assert rec["sample_id"] == msg.key().decode()


def test_cli_sigterm_flushes_and_prints_summary(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = kafka_topic_factory(1)
    proc = subprocess.Popen(
        _datagen_cmd("--bootstrap", kafka_bootstrap, "--topic", topic, "--rate", "2000", "-q"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and sum(end_offsets(kafka_bootstrap, topic).values()) == 0:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["produced"] > 0
    assert summary["produced"] == sum(end_offsets(kafka_bootstrap, topic).values())


def test_cli_bad_broker_exits_2() -> None:
    res = subprocess.run(
        _datagen_cmd("--bootstrap", "127.0.0.1:1", "--topic", "x", "--count", "1", "-q",
                      "--timeout", "2"),
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert res.returncode == 2
    assert "odl-datagen: error:" in res.stderr


def test_determinism_same_seed() -> None:
    a = SyntheticCtrStream(seed=3, start_time=1_700_000_000.0, events_per_second=1000)
    b = SyntheticCtrStream(seed=3, start_time=1_700_000_000.0, events_per_second=1000)
    ra = a.next_records(2000)
    rb = b.next_records(700) + b.next_records(1300)  # chunking does not matter
    assert ra == rb
    # Wall-clock streams started at other times: same ids, (nearly) same labels.
    c = SyntheticCtrStream(seed=3).next_batch(2000)
    d = SyntheticCtrStream(seed=3, start_time=time.time() + 5).next_batch(2000)
    assert (c.ids == np.array([[r[f] for f in SPARSE_FIELDS] for r in ra])).all()
    assert (c.ids == d.ids).all() and (c.dense == d.dense).all()
    assert np.mean(c.labels == d.labels) > 0.98
    assert c.sample_ids[0] != d.sample_ids[0]  # run_id differs
    e = SyntheticCtrStream(seed=4, start_time=1_700_000_000.0).next_batch(2000)
    assert np.mean(e.ids == c.ids) < 0.5


def test_encode_decode_roundtrip() -> None:
    stream = SyntheticCtrStream(seed=1)
    batch = stream.next_batch(200)
    records = batch.to_records()
    for fmt in ("csv", "json"):
        values = batch.encode(fmt)
        for value, rec in zip(values, records, strict=True):
            assert encode(rec, fmt) == value
            assert decode(value, fmt) == rec
    assert len(batch.encode("csv")[0].decode().split(",")) == 42
    with pytest.raises(ValueError):
        encode(records[0], "avro")


def test_vocabulary_grows_and_ids_are_zipf() -> None:
    stream = SyntheticCtrStream(seed=0, vocab_doubling=10_000)
    v0 = stream.vocab_sizes()
    batch = stream.next_batch(20_000)
    v1 = stream.vocab_sizes()
    assert (v1 >= v0).all() and (v1 > v0).sum() >= 10
    assert v0.min() <= 10 and v0.max() >= 10_000
    # Later records reach ranks beyond the initial vocabulary.
    assert (batch.ranks[10_000:] >= v0).any()
    counts = np.bincount(batch.ranks[:, 2])
    assert counts[0] > counts[10] > 0  # most frequent rank first


def test_roc_auc_exact_and_tie_aware() -> None:
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert roc_auc(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.5, 0.5])) == 0.5
    assert np.isnan(roc_auc(np.array([1, 1]), np.array([0.1, 0.2])))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = np.round(rng.random(300), 1)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    brute = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        pos.size * neg.size
    )
    assert roc_auc(y, s) == pytest.approx(brute, abs=1e-12)
    hist = HistogramAuc(bins=1000)
    hist.add(y[:100], s[:100])
    hist.add(y[100:], s[100:])
    assert hist.auc() == pytest.approx(brute, abs=1e-12)


def test_oracle_auc_in_expected_range() -> None:
    stream = SyntheticCtrStream(seed=0, start_time=1_700_000_000.0, events_per_second=10_000)
    batches = [stream.next_batch(10_000) for _ in range(5)]
    probs = np.concatenate([b.probabilities for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    oracle = stream.oracle_auc()
    assert 0.75 <= oracle <= 0.81
    assert oracle == pytest.approx(roc_auc(labels, probs), abs=1e-4)
    assert 0.2 <= stream.positive_rate() <= 0.3
    assert stream.produced == 50_000


def _progressive_logreg_auc(stream: SyntheticCtrStream, n: int, batch: int = 256) -> float:
    """Predict-then-train logistic regression (Adagrad) on hashed ids + dense features."""
    size = 1 << 21
    w, g2 = np.zeros(size), np.full(size, 1e-6)
    wd, gd2 = np.zeros(len(DENSE_FIELDS) + 1), np.full(len(DENSE_FIELDS) + 1, 1e-6)
    preds, labels = [], []
    lr = 0.05
    data = stream.next_batch(n)
    keys = (data.id_values.astype(np.int64) * 31 + np.arange(26)) % size
    dense = np.hstack([data.dense, np.ones((n, 1))])
    for s in range(0, n, batch):
        k, x, y = keys[s : s + batch], dense[s : s + batch], data.labels[s : s + batch]
        p = 1.0 / (1.0 + np.exp(-(w[k].sum(axis=1) + x @ wd)))
        preds.append(p)
        labels.append(y)
        g = p - y
        flat = k.ravel()
        uniq, inv = np.unique(flat, return_inverse=True)
        grad = np.bincount(inv, weights=np.repeat(g, k.shape[1]))
        g2[uniq] += grad**2
        w[uniq] -= lr * grad / np.sqrt(g2[uniq])
        gd = x.T @ g
        gd2 += gd**2
        wd -= lr * gd / np.sqrt(gd2)
    return roc_auc(np.concatenate(labels), np.concatenate(preds))


def test_signal_is_learnable_by_a_simple_model() -> None:
    stream = SyntheticCtrStream(seed=0, start_time=1_700_000_000.0, events_per_second=10_000)
    learner = _progressive_logreg_auc(stream, 100_000)
    oracle = stream.oracle_auc()
    assert learner >= 0.9 * oracle, (learner, oracle)
