"""Single records that used to stop training for good are rejected once, with a reason.

* an event time in nanoseconds or milliseconds (sent as seconds) once killed the delta
  publisher thread (the int64 header field overflowed) and stalled every later checkpoint;
* a JSON string with a lone surrogate (``"\\ud800"``) raised out of the parser and killed the
  input process, so the trainer crash-looped at that offset;
* an empty label trained as the label field's ``default_val``;
* a sample whose prediction is not finite would turn the parameters it reaches into NaN.

Each must end dead-lettered exactly once with its reason while every good record trains
exactly once and versions keep being published.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import torch

from odl.config.pipeline_config import load_pipeline_config, parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import EVENT_TIME_MIN_SECS, FeatureBuilder
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.topic_records import make_records, produce, read_messages
from odl.inputs.dead_letter import REASON_HEADER, SOURCE_HEADER
from odl.kafka.topic_admin import end_offsets
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions
from publisher import delta_sender
from tests.harness import run_in_process, write_config

SAMPLE_ID, EVENT_TIME, LABEL, I1 = 0, 1, 2, 3


def _with(record: bytes, col: int, value: bytes) -> bytes:
    cols = record.split(b",")
    cols[col] = value
    return b",".join(cols)


def _poison(good: list[bytes], good_json: bytes) -> list[tuple[bytes, str]]:
    """(value, expected reason) of records that each stopped training before."""
    now = time.time()
    doc = json.loads(good_json)
    doc["sample_id"], doc["C1"] = "poison-surrogate", "\ud800"  # json.dumps keeps \\ud800
    return [
        (_with(good[0], EVENT_TIME, str(int(now * 1e9)).encode()), "bad_event_time"),  # ns
        (_with(good[1], EVENT_TIME, str(int(now * 1e3)).encode()), "bad_event_time"),  # ms
        (_with(good[2], EVENT_TIME, b"0"), "bad_event_time"),
        (_with(good[3], EVENT_TIME, str(now + 7 * 86400).encode()), "bad_event_time"),
        (json.dumps(doc).encode(), "invalid_utf8"),
        (_with(good[4], LABEL, b""), "bad_label"),
    ]


def test_builder_rejects_poison_with_reasons(tmp_path):
    text = deepfm_config_text(str(tmp_path)).replace(
        'input_name: "label" input_type: INT32', 'input_name: "label" input_type: INT32 '
        'default_val: "0"')
    fb = FeatureBuilder(parse_pipeline_config_text(text))
    _, good = make_records(8, seed=2)
    _, good_json = make_records(1, seed=3, fmt="json")
    poison = _poison(good, good_json[0])
    values = [v for v, _ in poison] + good[5:]
    res = fb.build_arrays(values)
    assert res.rejected == [(i, reason) for i, (_, reason) in enumerate(poison)]
    assert res.accepted.tolist() == list(range(len(poison), len(values)))
    assert (res.arrays.event_times >= EVENT_TIME_MIN_SECS).all()


def test_a_record_whose_build_raises_is_rejected_alone(tmp_path, monkeypatch):
    fb = FeatureBuilder(parse_pipeline_config_text(deepfm_config_text(str(tmp_path))))
    ids, good = make_records(6, seed=4)
    bomb = _with(good[2], SAMPLE_ID, b"bomb")
    real_parse = fb.parser.parse

    def parse(values):  # a parser bug that only this record triggers
        if any(b"bomb" in v for v in values):
            raise IndexError("unforeseen input")
        return real_parse(values)

    monkeypatch.setattr(fb.parser, "parse", parse)
    res = fb.build_arrays(good[:2] + [bomb] + good[3:])
    assert res.rejected == [(2, "unprocessable")]
    assert res.accepted.tolist() == [0, 1, 3, 4, 5]
    assert res.arrays.sample_ids == ids[:2] + ids[3:]


def test_poison_records_are_dead_lettered_and_publishing_goes_on(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory(partitions=2)
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    dlq = kafka_topic_factory(prefix="dlq", create=False)
    ids, good = make_records(600, seed=5)
    _, good_json = make_records(1, seed=6, fmt="json")
    poison = _poison(good, good_json[0])
    good_ids = ids[len(poison):]
    values = [v for v, _ in poison] + good[len(poison):]
    where = produce(kafka_bootstrap, topic, values, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ server: '
            f'"{kafka_bootstrap}" topic: "{delta_topic}" }} }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=50, extra_train=incr)
    text = open(cfg).read().replace('input_name: "label" input_type: INT32',
                                    'input_name: "label" input_type: INT32 default_val: "0"')
    open(cfg, "w").write(text)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger, edits={"data_config.dead_letter_topic": dlq})
    assert sorted(ledger_sample_ids(ledger)) == sorted(good_ids)
    want = {}
    for _, reason in poison:
        want[reason] = want.get(reason, 0) + 1
    assert trainer.records_rejected == want
    pub = trainer.publisher.status()
    assert pub["fatal_error"] is None and pub["failures"] == 0, pub
    assert pub["last_version"] == trainer.module.global_step  # published to the end
    assert trainer.checkpoints.last_saved_step == trainer.module.global_step
    letters = read_messages(kafka_bootstrap, dlq, len(poison))
    by_source = {f"{topic}/{p}/{o}": i for i, (p, o) in enumerate(where)}
    got = sorted((by_source[h[SOURCE_HEADER].decode()], h[REASON_HEADER].decode(), v)
                 for v, h in letters)
    assert got == [(i, reason, value) for i, (value, reason) in enumerate(poison)]


def test_non_finite_predictions_are_left_out_and_dead_lettered(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """A sample the network overflows on is never trained on; its neighbours are."""
    topic = kafka_topic_factory(partitions=1)
    dlq = kafka_topic_factory(prefix="dlq", create=False)
    ids, good = make_records(200, seed=7)
    huge = b"3.0e38"
    overflow = good[10]
    for col in range(I1, I1 + 13):
        overflow = _with(overflow, col, huge)
    values = good[:10] + [overflow] + good[11:]
    where = produce(kafka_bootstrap, topic, values, 1)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=50)
    config = load_pipeline_config(cfg, json.dumps({"data_config.dead_letter_topic": dlq}))
    ledger = str(tmp_path / "ledger.tsv")
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1,
                                             sample_ledger=ledger))
    with torch.no_grad():  # weights large enough for 3e38 inputs to overflow float32
        for name, t in trainer.module.dense_parameters().items():
            if name.startswith("dense.dnn.") and name.endswith("weight"):
                t.fill_(1.0)

    def stop_when_caught_up() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            if trainer.state == "training" and dict(trainer.positions) == ends:
                break
            time.sleep(0.05)
        trainer.request_stop("test: caught up")

    threading.Thread(target=stop_when_caught_up, daemon=True).start()
    assert trainer.run() == 0
    assert trainer.stop_reason == "test: caught up"
    assert sorted(ledger_sample_ids(ledger)) == sorted(ids[:10] + ids[11:])
    assert trainer.records_rejected == {"non_finite_output": 1}
    for t in trainer.module.dense_parameters().values():
        assert torch.isfinite(t).all()
    for t in trainer.module.embedding_tables().values():
        assert torch.isfinite(t).all()
    letters = read_messages(kafka_bootstrap, dlq, 1)
    assert [(h[REASON_HEADER], h[SOURCE_HEADER]) for _, h in letters] == [
        (b"non_finite_output", f"{topic}/{where[10][0]}/{where[10][1]}".encode())]


def test_train_step_drops_only_the_samples_with_non_finite_predictions(tmp_path):
    config = parse_pipeline_config_text(deepfm_config_text(str(tmp_path)))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    _, good = make_records(8, seed=8)
    bad = good[3]
    for col in range(I1, I1 + 13):
        bad = _with(bad, col, b"3.0e38")
    batch = fb.build(good[:3] + [bad] + good[4:]).batch
    with torch.no_grad():
        for name, t in tm.dense_parameters().items():
            if name.startswith("dense.dnn.") and name.endswith("weight"):
                t.fill_(1.0)
    before = {n: t.clone() for n, t in tm.dense_parameters().items()}
    out = tm.train_step(batch)
    assert out.dropped.tolist() == [3]
    assert out.trained == 7 and np.isfinite(out.probs).all() and np.isfinite(out.loss)
    assert tm.global_step == 1
    changed = [n for n, t in tm.dense_parameters().items() if not torch.equal(t, before[n])]
    assert changed  # the other seven trained
    assert all(torch.isfinite(t).all() for t in tm.dense_parameters().values())


def test_a_publisher_bug_stops_the_trainer_with_exit_1_not_a_silent_stall(
        kafka_bootstrap, kafka_topic_factory, tmp_path, monkeypatch):
    topic = kafka_topic_factory(partitions=1)
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    _, values = make_records(400, seed=9)
    produce(kafka_bootstrap, topic, values, 1)
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ server: '
            f'"{kafka_bootstrap}" topic: "{delta_topic}" }} }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=50, extra_train=incr)
    calls = {"n": 0}
    real_encode = delta_sender.encode_version

    def encode(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("Value out of range")  # what an int64 overflow raised
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(delta_sender, "encode_version", encode)
    config = load_pipeline_config(cfg)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    seen_health: list[tuple[bool, str]] = []

    def watch_health() -> None:
        deadline = time.time() + 60
        while time.time() < deadline and trainer.state != "stopped":
            if trainer.publisher is not None and trainer.publisher.fatal_error:
                seen_health.append(trainer.health())
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch_health, daemon=True)
    watcher.start()
    guard = threading.Timer(90, trainer.request_stop, args=("test: no failure seen",))
    guard.start()
    try:
        assert trainer.run() == 1, trainer.stop_reason
    finally:
        guard.cancel()
    watcher.join(10)
    assert "ValueError: Value out of range" in trainer.failure
    assert trainer.status()["failure"] == trainer.failure
    assert seen_health and seen_health[0][0] is False
    assert trainer.publisher.status()["failures"] >= 1
