"""Property-based fuzzing of the record path: every record is trained once xor dead-lettered once.

Hypothesis drives random and mutated records (``odl.datagen.hostile_records``: invalid UTF-8,
lone surrogates, extreme and non-finite numbers, huge fields, wrong field counts, empty and bad
labels, absurd event times, JSON of the wrong shape, raw bytes) through

* the feature builder (many examples): it never raises, it accounts for every record exactly
  once (accepted or rejected with a known reason), and what it accepts is safe downstream
  (labels 0/1, finite float32 features, ids inside their tables, event times in the window
  and encodable in a delta version's header);
* a train step on whatever was accepted: parameters stay finite;
* and, in one seeded run, the whole online loop: the real input process, trainer, Kafka
  delta publisher and dead-letter topic on the broker. The trainer must not stop, and the
  sample ledger plus the dead letters must cover every produced record exactly once, with
  the checkpoint's positions at the topic's end. ``bench/record_fuzz.py`` runs the same loop
  with 100k+ records.
"""

from __future__ import annotations

import json
import math
import random
import struct
import time

import numpy as np
import torch
from confluent_kafka import Consumer, TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.hostile_records import HOSTILE_KINDS, hostile_record, hostile_stream
from odl.datagen.synthetic_ctr import ALL_COLUMNS, SyntheticCtrStream, encode
from odl.features.feature_builder import (
    EVENT_TIME_MAX_AHEAD_SECS,
    EVENT_TIME_MIN_SECS,
    FeatureBuilder,
)
from odl.features.record_parser import REJECT_REASONS
from odl.harness.topic_records import produce
from odl.inputs.dead_letter import REASON_HEADER, SOURCE_HEADER
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import end_offsets
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_format import VersionHeader
from tests.harness import run_in_process, write_config

_CONFIG = parse_pipeline_config_text(deepfm_config_text("/nonexistent/odl-fuzz"))
_FB = FeatureBuilder(_CONFIG)
_GOOD = SyntheticCtrStream(seed=77).next_records(64)
_F32_MAX = float(np.finfo(np.float32).max)
_SMALL_HUGE = (8 << 10, 40 << 10)  # huge fields, kept small for a fast suite
_module: list[TrainModule] = []


def _check_partition(values: list[bytes], res) -> None:
    """The builder's result accounts for every record once and is safe downstream."""
    n = len(values)
    accepted = res.accepted.tolist()
    rejected = [i for i, _ in res.rejected]
    assert accepted == sorted(set(accepted)) and len(rejected) == len(set(rejected))
    assert sorted(accepted + rejected) == list(range(n))
    assert {r for _, r in res.rejected} <= set(REJECT_REASONS)
    if res.arrays is None:
        assert not accepted
        return
    a = res.arrays
    b = len(accepted)
    assert a.labels.shape == (b,) and set(np.unique(a.labels).tolist()) <= {0.0, 1.0}
    assert a.dense.shape[0] == b and np.isfinite(a.dense).all()
    assert (np.abs(a.dense) <= _F32_MAX).all()
    assert (a.event_times >= EVENT_TIME_MIN_SECS).all()
    assert (a.event_times <= time.time() + EVENT_TIME_MAX_AHEAD_SECS).all()
    assert len(a.sample_ids) == b
    lengths = a.lengths.reshape(len(_FB.sparse_feature_names), b)
    assert (lengths >= 0).all() and int(lengths.sum()) == a.values.shape[0]
    rows = {t.name: t.num_rows for t in _FB.table_specs}
    tables = _FB.feature_to_table
    pos = 0
    for k, feature in enumerate(_FB.sparse_feature_names):
        ids = a.values[pos: pos + int(lengths[k].sum())]
        pos += ids.shape[0]
        assert ((ids >= 0) & (ids < rows[tables[feature]])).all(), feature
    # what the trainer hands the publisher for this batch fits a version header
    t = a.event_times
    header = VersionHeader(model_name="m", version=1, generation="g",
                           min_event_time_ms=int(t.min() * 1000),
                           max_event_time_ms=int(t.max() * 1000))
    (chunk,) = encode_version(header, {}, {})
    assert decode_chunk(chunk).header.max_event_time_ms == int(t.max() * 1000)


_kinds = st.sampled_from(("good",) + HOSTILE_KINDS)
# The mutations take a seeded random.Random (use_true_random): hypothesis's own draws floats
# that it refuses to draw while the process flushes subnormals (TrainModule sets that).


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_kinds, st.randoms(use_true_random=True), st.sampled_from(_GOOD)),
                min_size=1, max_size=24))
def test_builder_accounts_for_every_mutated_record(draws):
    now = time.time()
    values = [encode(rec, "csv") if kind == "good"
              else hostile_record(rec, kind, rng, now, _SMALL_HUGE)
              for kind, rng, rec in draws]
    res = _FB.build_arrays(values)
    _check_partition(values, res)
    for i, (kind, _, _) in enumerate(draws):
        if kind == "good":
            assert i in res.accepted


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    # subnormal doubles from their bit patterns: hypothesis refuses to draw them while the
    # process flushes subnormals to zero (as TrainModule sets it, odl.models.subnormal_floats)
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False),
    st.integers(min_value=1, max_value=(1 << 52) - 1).map(
        lambda bits: struct.unpack("<d", struct.pack("<Q", bits))[0]),
    st.text(st.characters(codec=None, categories=["L", "N", "P", "Cs", "Cc"]), max_size=20),
)
_json_value = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=3), kids, max_size=3),
                           max_leaves=8)


@st.composite
def _json_records(draw) -> bytes:
    doc: dict = dict(draw(st.sampled_from(_GOOD)))
    for key in draw(st.lists(st.sampled_from(ALL_COLUMNS + ("extra",)), max_size=4)):
        if draw(st.booleans()):
            doc.pop(key, None)
        else:
            doc[key] = draw(_json_value)
    return json.dumps(doc, allow_nan=True).encode()


@st.composite
def _csv_records(draw) -> bytes:
    cols = encode(draw(st.sampled_from(_GOOD)), "csv").split(b",")
    for _ in range(draw(st.integers(0, 3))):
        cols[draw(st.integers(0, len(cols) - 1))] = draw(st.binary(max_size=12) | st.text(
            max_size=12).map(str.encode))
    return b",".join(cols)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(_json_records() | _csv_records() | st.binary(max_size=200), min_size=1,
                max_size=20))
def test_builder_accounts_for_random_csv_json_and_bytes(values):
    _check_partition(values, _FB.build_arrays(values))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_kinds, st.randoms(use_true_random=True), st.sampled_from(_GOOD)),
                min_size=4, max_size=32))
def test_training_on_whatever_is_accepted_keeps_parameters_finite(draws):
    if not _module:
        _module.append(TrainModule(_CONFIG, _FB, device="cpu"))
    tm = _module[0]
    now = time.time()
    values = [encode(rec, "csv") if kind == "good"
              else hostile_record(rec, kind, rng, now, _SMALL_HUGE)
              for kind, rng, rec in draws]
    res = _FB.build(values)
    if res.batch is None:
        return
    out = tm.train_step(res.batch)
    assert out.trained + len(out.dropped) == res.batch.size
    assert np.isfinite(out.probs).all()
    assert all(torch.isfinite(t).all() for t in tm.dense_parameters().values())
    assert all(torch.isfinite(t).all() for t in tm.embedding_tables().values())


# --------------------------------------------------------------------------- the whole loop

def _read_dead_letters(bootstrap: str, topic: str, n: int) -> list[dict]:
    consumer = Consumer(consumer_config(bootstrap, "odl-test-fuzz-dlq"))
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[dict] = []
    deadline = time.time() + 60
    while len(out) < n and time.time() < deadline:
        for msg in consumer.consume(500, timeout=0.5):
            if msg.error() is None:
                out.append({k: v for k, v in msg.headers() or []})
    consumer.close()
    return out


def test_hostile_stream_through_the_online_loop_trains_or_dead_letters_each_record_once(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    parts = 3
    seed = random.Random(20261123).randrange(1 << 30)
    records = list(hostile_stream(3000, seed, hostile_fraction=0.4, huge_field_bytes=_SMALL_HUGE))
    topic = kafka_topic_factory(partitions=parts, config={"max.message.bytes": str(4 << 20)})
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    dlq = kafka_topic_factory(prefix="dlq", create=False)
    where = produce(kafka_bootstrap, topic, [v for _, _, v in records], parts)
    ends = end_offsets(kafka_bootstrap, topic)
    incr = (f'incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 kafka {{ server: '
            f'"{kafka_bootstrap}" topic: "{delta_topic}" }} }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=100, extra_train=incr)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger, timeout=300,
                             edits={"data_config.dead_letter_topic": dlq,
                                    "data_config.num_workers": 1})
    # the loop never stopped, published to the end and checkpointed exactly the topic's end
    pub = trainer.publisher.status()
    assert pub["fatal_error"] is None and pub["failures"] == 0, pub
    assert pub["last_version"] == trainer.module.global_step
    assert read_checkpoint(list_checkpoints(trainer.model_dir)[-1]).positions == ends
    # trained (ledger, by sample id) xor dead-lettered (by source position), each once
    index_of = {sid: i for i, (sid, _, _) in enumerate(records)}
    trained = [index_of[sid] for _, _, sid in read_ledger(ledger)]
    assert len(trained) == len(set(trained))
    n_rejected = sum(trainer.records_rejected.values())
    assert trainer.status()["dead_letter"]["dropped"] == 0
    letters = _read_dead_letters(kafka_bootstrap, dlq, n_rejected)
    by_source = {f"{topic}/{p}/{o}": i for i, (p, o) in enumerate(where)}
    lettered = [by_source[h[SOURCE_HEADER].decode()] for h in letters]
    assert len(lettered) == len(set(lettered)) == n_rejected
    assert not set(trained) & set(lettered)
    assert sorted(trained + lettered) == list(range(len(records)))
    # every good record trained; each reason is a known one
    assert {i for i, (_, kind, _) in enumerate(records) if kind == "good"} <= set(trained)
    assert {h[REASON_HEADER].decode() for h in letters} <= set(REJECT_REASONS)
    assert math.isfinite(trainer.last_loss)
