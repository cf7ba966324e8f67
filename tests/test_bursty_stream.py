"""The bursty user-item stream (``odl-datagen --bursty``): deterministic, time-ordered,
bursty sessions, new ids, a known answer, readable by its sample config."""

from __future__ import annotations

import json
import os

import numpy as np

from odl.auc import roc_auc
from odl.datagen.bursty_stream import BURSTY_COLUMNS, BurstyStream
from odl.features.feature_builder import FeatureBuilder
from tests.harness import REPO, load_config_text


def _records(seed: int, chunks: list[int]):
    stream = BurstyStream(seed=seed)
    batches = [stream.next_batch(n) for n in chunks]
    return stream, batches


def test_the_stream_is_the_same_whatever_the_chunk_sizes():
    _s1, a = _records(5, [3000, 3000])
    _s2, b = _records(5, [1, 999, 4000, 1000])
    enc_a = [v for x in a for v in x.encode()]
    enc_b = [v for x in b for v in x.encode()]
    assert enc_a == enc_b
    _s3, c = _records(6, [6000])
    assert c[0].encode() != enc_a


def test_events_are_time_ordered_bursty_and_bring_new_ids():
    stream, batches = _records(1, [20000, 20000])
    t = np.concatenate([b.event_times for b in batches])
    assert np.all(np.diff(t) >= 0)
    users = np.concatenate([b.users for b in batches])
    items = np.concatenate([b.items for b in batches])
    # bursts: a user's next event usually follows within seconds
    gaps = []
    last: dict[int, float] = {}
    for u, ti in zip(users.tolist(), t.tolist(), strict=True):
        if u in last:
            gaps.append(ti - last[u])
        last[u] = ti
    assert np.median(gaps) < 5.0
    # new users and items keep appearing in the second half
    first_users, first_items = set(users[:20000].tolist()), set(items[:20000].tolist())
    assert len(set(users[20000:].tolist()) - first_users) > 100
    assert len(set(items[20000:].tolist()) - first_items) > 50
    # the labels follow the hidden probabilities: the oracle AUC is well above chance
    labels = np.concatenate([b.labels for b in batches])
    probs = np.concatenate([b.probabilities for b in batches])
    assert abs(roc_auc(labels, probs) - stream.oracle_auc()) < 1e-3
    assert 0.75 < stream.oracle_auc() < 0.95 and 0.05 < stream.positive_rate() < 0.3


def test_the_sample_config_reads_the_records_as_csv_and_json():
    config = load_config_text(open(os.path.join(REPO, "samples", "bursty_online.config"),
                                   encoding="utf-8").read())
    assert [f.input_name for f in config.data_config.input_fields] == list(BURSTY_COLUMNS)
    fb = FeatureBuilder(config)
    _s, (batch,) = _records(2, [500])
    for fmt in ("csv", "json"):
        built = fb.build(batch.encode(fmt))
        assert not built.rejected and built.batch.size == 500
        assert built.batch.labels.tolist() == batch.labels.astype(float).tolist()
    rec = json.loads(batch.encode("json")[0])
    assert set(rec) == set(BURSTY_COLUMNS) and rec["user_id"].startswith("u")


def test_datagen_cli_produces_the_bursty_stream(kafka_bootstrap, kafka_topic_factory):
    """``odl-datagen --bursty``: the stream's records, in order, keyed by sample id."""
    from odl.cli.datagen_cli import main
    from odl.harness.topic_records import read_messages

    topic = kafka_topic_factory(create=False)
    assert main(["--bootstrap", kafka_bootstrap, "--topic", topic, "--partitions", "1",
                 "--count", "1500", "--rate", "0", "--seed", "3", "--bursty", "-q"]) == 0
    _s, (want,) = _records(3, [1500])
    assert [v for v, _h in read_messages(kafka_bootstrap, topic, 1500)] == want.encode()
    assert main(["--split-dir", "/tmp/unused", "--count", "5", "--bursty"]) == 2
