"""Delta publisher: touched-row tracking, snapshots, back-pressure, end-to-end with a trainer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from confluent_kafka import Consumer, TopicPartition
from google.protobuf import text_format

import publisher.delta_sender as delta_sender
import publisher.publisher_factory as publisher_factory
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.topic_records import make_records, produce
from odl.kafka.client_settings import delta_consumer_config
from odl.kafka.topic_admin import end_offsets
from odl.protos import pipeline_pb2
from odl.train.table_shards import EBC_PREFIX
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.delta_sink import SentOffsets
from publisher.delta_tracker import DeltaTracker
from publisher.fs_sink import FsSink, list_versions, read_chunks
from publisher.id_maps import build_id_maps, read_id_maps
from publisher.incremental_publisher import IncrementalPublisher
from publisher.publisher_factory import dense_variable_shapes, published_table_dims
from publisher.version_assembler import VersionAssembler
from tests.harness import run_in_process, write_config

CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  input_fields { input_name: "c3" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "c1" hash_bucket_size: 5000 embedding_dim: 8 }
  features { input_names: "c2" hash_bucket_size: 5000 embedding_dim: 8 }
  features { input_names: "c3" hash_bucket_size: 5000 embedding_dim: 8 embedding_name: "c1" }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["c1", "c3"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "c2", "c3", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [32, 16] } wide_output_dim: 3 }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.005 } }
  seed: 7
}
"""


def _records(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 3000, size=(n, 3))
    return [f"{i % 2},{rng.normal():.3f},a{a},b{b},c{c}".encode()
            for i, (a, b, c) in enumerate(ids)]


@pytest.fixture(scope="module")
def setup():
    cfg = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    batches = [fb.build(_records(256, s)).batch for s in range(8)]
    return tm, batches


def _expected_rows(tm: TrainModule, kjts) -> dict[str, set[int]]:
    ft = tm.feature_tables()
    out: dict[str, set[int]] = {}
    for kjt in kjts:
        for f, jt in kjt.to_dict().items():
            for t in ft.get(f, []):
                out.setdefault(t, set()).update(jt.values().tolist())
    return out


def _tracker(tm: TrainModule) -> DeltaTracker:
    rows = {n: int(w.shape[0]) for n, w in tm.embedding_tables().items()}
    return DeltaTracker(tm.feature_tables(), rows)


def test_tracker_records_exactly_the_touched_rows(setup):
    tm, batches = setup
    tracker = _tracker(tm)
    tm.set_touched_rows_hook(tracker.record)
    try:
        for b in batches[:3]:
            tm.train_step(b)
        got = tracker.take()
    finally:
        tm.set_touched_rows_hook(None)
    want = _expected_rows(tm, [b.sparse for b in batches[:3]])
    assert {"c1", "c1_wide", "c2"} <= set(want)  # shared table c1, wide table, deep-only c2
    assert "c2_wide" not in want
    assert set(got) == set(want)
    for t, ids in got.items():
        assert ids.tolist() == sorted(want[t])
    assert tracker.take() == {}


def test_tracker_overhead_per_step(setup):
    tm, batches = setup
    tracker = _tracker(tm)
    for b in batches[:2]:  # warm up
        tm.train_step(b)
        tracker.record(b.sparse)
    n = 3
    t0 = time.perf_counter()
    for _ in range(n):
        for b in batches:
            tm.train_step(b)
    step = (time.perf_counter() - t0) / (n * len(batches))
    t0 = time.perf_counter()
    for _ in range(20):
        for b in batches:
            tracker.record(b.sparse)
    rec = (time.perf_counter() - t0) / (20 * len(batches))
    t0 = time.perf_counter()
    taken = tracker.take()
    take = time.perf_counter() - t0
    print(f"\ntracker: {rec * 1e6:.0f} us/step record ({100 * rec / step:.2f}% of a "
          f"{step * 1e3:.1f} ms step, {sum(b.sparse.values().numel() for b in batches) // 8} "
          f"ids/step), take {take * 1e6:.0f} us for {sum(v.numel() for v in taken.values())} "
          f"rows")
    assert rec < 0.1 * step


class _FakeSink:
    """The ``DeltaSink`` members of a sink without a topic or a broker."""

    description = "fake"
    topic = None
    servers = ""
    broker_error = None

    def claim(self, timeout=30.0):
        pass

    def status(self):
        return {}

    def close(self, timeout=5.0):
        pass


class _BlockingSink(_FakeSink):
    description = "test"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent: list[list[bytes]] = []

    def send(self, version, generation, chunks, timeout=30.0):
        self.gate.wait(10)
        self.sent.append(list(chunks))
        return SentOffsets(len(self.sent) - 1, len(self.sent) - 1)


def test_publisher_snapshots_current_rows_and_merges_when_behind(setup):
    tm, batches = setup
    tracker = _tracker(tm)
    maps = build_id_maps(dense_variable_shapes(tm), published_table_dims(tm))
    assert maps.tables["c1_wide"].dim == 3
    sink = _BlockingSink()
    pub = IncrementalPublisher(tm, maps, tracker, sink, "gen", "m", sparse_save_steps=1,
                               dense_save_steps=2, start_step=tm.global_step)
    pub.start()
    tm.set_touched_rows_hook(tracker.record)
    expected_rows: dict[str, set[int]] = {}
    try:
        for b in batches[:4]:
            tm.train_step(b)
            for t, ids in _expected_rows(tm, [b.sparse]).items():
                expected_rows.setdefault(t, set()).update(ids)
            assert pub.maybe_publish(tm.global_step, {0: tm.global_step * 10},
                                     (1000, 2000 + tm.global_step), None)
            deadline = time.time() + 10
            while pub.status()["sending"] is None and time.time() < deadline:
                time.sleep(0.01)  # the first version is in flight before the next is due
        st = pub.status()
        # The first version is in flight, the other three merged into one waiting version.
        assert st["backlog_versions"] == 1 and st["versions_merged"] == 2
        tables = {n: w.clone() for n, w in tm.embedding_tables().items()}
        dense = {n: p.detach().clone() for n, p in tm.dense_parameters().items()}
        sink.gate.set()
        assert pub.flush(timeout=10)
    finally:
        tm.set_touched_rows_hook(None)
    assert len(sink.sent) == 2
    asm = VersionAssembler()
    versions = [asm.add(decode_chunk(c)) for chunks in sink.sent for c in chunks]
    last = versions[-1]
    assert last.version == tm.global_step and last.kind == "both"
    assert last.positions == [("", 0, tm.global_step * 10)]
    assert last.min_event_time_ms == 1000 and last.max_event_time_ms == 2000 + tm.global_step
    names = maps.table_names()
    first_rows = {names[t]: set(ids.tolist()) for t, (ids, _) in versions[0].sparse.items()}
    union: dict[str, set[int]] = {}
    for v in versions:
        for t, (ids, _) in v.sparse.items():
            union.setdefault(names[t], set()).update(ids.tolist())
    assert union == expected_rows
    assert first_rows != union
    for t, (ids, vals) in last.sparse.items():  # merged rows carry the newest values
        name = names[t]
        want = tables[name][torch.from_numpy(ids)][:, : maps.tables[name].dim].numpy()
        np.testing.assert_array_equal(vals, want)
    dnames = maps.dense_names()
    for vid, arr in last.dense.items():
        np.testing.assert_array_equal(arr, dense[dnames[vid]].numpy())


class _TeeSink(_FakeSink):
    def __init__(self, *sinks) -> None:
        self.sinks = sinks
        self.description = " + ".join(s.description for s in sinks)

    def claim(self, timeout=30.0):
        for s in self.sinks:
            s.claim(timeout)

    def send(self, version, generation, chunks, timeout=30.0):
        return [s.send(version, generation, chunks, timeout) for s in self.sinks][0]

    def close(self, timeout=5.0):
        for s in self.sinks:
            s.close(timeout)


def _read_topic(bootstrap: str, topic: str) -> list[bytes]:
    """Every message of the delta topic (transaction markers take offsets, not messages)."""
    consumer = Consumer(delta_consumer_config(bootstrap, "odl-test-delta-reader"))
    end = end_offsets(bootstrap, topic)[0]
    tp = TopicPartition(topic, 0)
    consumer.assign([TopicPartition(topic, 0, 0)])
    out = []
    deadline = time.time() + 30
    position = 0
    while position < end and time.time() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            out.append(msg.value())
        position = consumer.position([tp])[0].offset
    consumer.close()
    assert position == end, (position, end)
    return out


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")),
])
def test_trainer_publishes_versions_equal_to_checkpoints(kafka_bootstrap, kafka_topic_factory,
                                                         tmp_path, monkeypatch, device):
    """Every published version equals the checkpoint of its step (tracker on the GPU too)."""
    topic = kafka_topic_factory(partitions=2)
    delta_topic = kafka_topic_factory(prefix="delta", create=False)
    _, values = make_records(1500, seed=3)
    produce(kafka_bootstrap, topic, values, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    fs_dir = str(tmp_path / "fs_versions")
    real_kafka_sink = publisher_factory.KafkaSink

    def tee(*args, **kwargs):
        return _TeeSink(real_kafka_sink(*args, **kwargs), FsSink(fs_dir))

    monkeypatch.setattr(publisher_factory, "KafkaSink", tee)
    incr = (f'incr_save_config {{ sparse_save_steps: 5 dense_save_steps: 5 '
            f'kafka {{ server: "{kafka_bootstrap}" topic: "{delta_topic}" }} '
            f'max_chunk_bytes: 20000 }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, extra_train=incr,
                       save_checkpoints_steps=5)
    trainer = run_in_process(cfg, ends, edits={"train_config.keep_checkpoint_max": 0},
                             device=device)
    assert trainer.module.device.type == device
    st = trainer.status()["publisher"]
    assert st["last_version"] == trainer.module.global_step and st["failures"] == 0
    maps = read_id_maps(trainer.model_dir)

    asm = VersionAssembler()
    kafka_versions = [v for v in (asm.add(decode_chunk(m))
                                  for m in _read_topic(kafka_bootstrap, delta_topic)) if v]
    assert asm.pending_versions == 0
    # each version is one transaction: its chunks, then a commit marker taking one offset
    assert st["last_offset"] == sum(v.chunk_count + 1 for v in kafka_versions) - 2
    fs_versions = []
    for path in list_versions(fs_dir):
        asm = VersionAssembler()
        fs_versions += [v for v in (asm.add(decode_chunk(c)) for c in read_chunks(path)) if v]
    assert [v.version for v in kafka_versions] == [v.version for v in fs_versions]
    for kv, fv in zip(kafka_versions, fs_versions, strict=True):
        assert kv.header == fv.header
        for t in kv.sparse:
            np.testing.assert_array_equal(kv.sparse[t][0], fv.sparse[t][0])
            np.testing.assert_array_equal(kv.sparse[t][1], fv.sparse[t][1])

    ckpts = {read_checkpoint(p).global_step: p for p in list_checkpoints(trainer.model_dir)}
    steps = [v.version for v in kafka_versions]
    assert steps[:-1] == list(range(5, 5 * len(steps), 5))
    assert steps[-1] == trainer.module.global_step
    assert max(v.chunk_count for v in kafka_versions) > 1
    tnames, dnames = maps.table_names(), maps.dense_names()
    prev_model = None
    total_bytes = total_floor = 0
    for v in kafka_versions:
        assert v.kind == "both" and v.model_name == "model_dir"
        assert v.min_event_time_ms > 0 and v.max_produce_time_ms >= v.min_produce_time_ms > 0
        model = read_checkpoint(ckpts[v.version]).state["model"]
        published: dict[str, set[int]] = {}
        for t, (ids, vals) in v.sparse.items():
            name = tnames[t]
            published[name] = set(ids.tolist())
            want = model[f"{EBC_PREFIX}{name}.weight"][torch.from_numpy(ids)][:, : vals.shape[1]]
            np.testing.assert_array_equal(vals, want.numpy())
            total_floor += len(ids) * (8 + 4 * vals.shape[1])
        total_bytes += v.nbytes
        assert set(v.dense) == set(dnames)
        for vid, arr in v.dense.items():
            np.testing.assert_array_equal(arr, model[dnames[vid]].numpy())
            total_floor += arr.size * 4
        if prev_model is not None:  # every row that changed since the last version is in it
            for name in maps.tables:
                key = f"{EBC_PREFIX}{name}.weight"
                changed = torch.nonzero((model[key] != prev_model[key]).any(dim=1)).reshape(-1)
                assert set(changed.tolist()) <= published.get(name, set()), name
        prev_model = model
    print(f"\n{len(kafka_versions)} versions, {total_bytes} bytes, floor {total_floor}, "
          f"ratio {total_bytes / total_floor:.4f}")
    assert total_bytes <= 1.1 * total_floor


def _validated(tmp_path, incr: str):
    from odl.config.pipeline_config import load_pipeline_config
    from odl.models.model_registry import check_pipeline_config

    cfg = write_config(tmp_path, "127.0.0.1:1", "t", extra_train=incr)
    config = load_pipeline_config(cfg)
    check_pipeline_config(config, online=True)
    return config


@pytest.mark.parametrize("incr, field", [
    ('incr_save_config { kafka { server: "a:1" topic: "d" } }',
     "train_config.incr_save_config.sparse_save_steps"),
    ("incr_save_config { sparse_save_steps: 5 }", "train_config.incr_save_config.kafka"),
    ('incr_save_config { sparse_save_steps: 5 kafka { topic: "d" } }',
     "train_config.incr_save_config.kafka.server"),
    ('incr_save_config { sparse_save_steps: 5 kafka { server: "a:1" } max_chunk_bytes: 10 }',
     "train_config.incr_save_config.kafka.topic"),
    ('incr_save_config { sparse_save_steps: 5 fs { } max_chunk_bytes: 10 }',
     "train_config.incr_save_config.max_chunk_bytes"),
    ("incr_save_config { datahub { } }", "train_config.incr_save_config.datahub"),
])
def test_incr_save_config_validation(tmp_path, incr, field):
    from odl.config.config_error import ConfigError

    with pytest.raises(ConfigError) as info:
        _validated(tmp_path, incr)
    assert info.value.field == field


def test_incr_save_config_accepted(tmp_path):
    config = _validated(tmp_path, 'incr_save_config { dense_save_secs: 10 sparse_save_steps: 5 '
                                  'fs { incr_save_dir: "incr" } value_type: FP16 }')
    isc = config.train_config.incr_save_config
    assert isc.WhichOneof("incr_update") == "fs" and isc.value_type == isc.FP16


class _FlakySink(_FakeSink):
    description = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[int] = []

    def send(self, version, generation, chunks, timeout=30.0):
        from publisher.delta_sink import DeltaSinkError

        if self.failures:
            self.failures -= 1
            raise DeltaSinkError("broker down")
        self.sent.append(version)
        return SentOffsets(len(self.sent), len(self.sent))


def test_failed_send_is_retried_with_newer_state(setup, monkeypatch):
    monkeypatch.setattr(delta_sender, "_RETRY_SECS", 0.05)
    tm, batches = setup
    tracker = _tracker(tm)
    maps = build_id_maps(dense_variable_shapes(tm), published_table_dims(tm))
    sink = _FlakySink(failures=2)
    pub = IncrementalPublisher(tm, maps, tracker, sink, "gen", "m", sparse_save_steps=1,
                               start_step=tm.global_step)
    pub.start()
    tm.set_touched_rows_hook(tracker.record)
    try:
        for b in batches[:2]:
            tm.train_step(b)
            pub.maybe_publish(tm.global_step, {}, None, None)
        assert pub.flush(timeout=10)
    finally:
        tm.set_touched_rows_hook(None)
    st = pub.status()
    assert st["failures"] == 2 and st["last_error"] is None
    assert sink.sent[-1] == tm.global_step and st["backlog_versions"] == 0


def test_an_idle_input_publishes_the_last_steps_once_the_last_version_is_old_enough(
        setup, tmp_path, monkeypatch):
    """A trainer idle between every two batches publishes at most every IDLE_PUBLISH_MIN_SECS,
    and never holds the last steps of a burst back longer than that."""
    import publisher.incremental_publisher as incremental

    tm, batches = setup
    clock = [1000.0]
    monkeypatch.setattr(incremental.time, "monotonic", lambda: clock[0])
    tracker = _tracker(tm)
    maps = build_id_maps(dense_variable_shapes(tm), published_table_dims(tm))
    sink = FsSink(str(tmp_path / "deltas"))
    pub = IncrementalPublisher(tm, maps, tracker, sink, "gen", "m", sparse_save_steps=100,
                               dense_save_steps=100, start_step=tm.global_step)
    pub.start()
    tm.set_touched_rows_hook(tracker.record)
    published = []
    try:
        for b in batches[:3]:
            tm.train_step(b)
            clock[0] += 0.05  # a step 50 ms after the last, then the input is idle
            if pub.publish_if_behind(tm.global_step, {0: tm.global_step}):
                published.append(tm.global_step)
        assert published == []  # 0.15 s since the last version (the start): not yet
        clock[0] += incremental.IDLE_PUBLISH_MIN_SECS
        assert pub.publish_if_behind(tm.global_step, {0: tm.global_step})
        assert not pub.publish_if_behind(tm.global_step, {0: tm.global_step})  # nothing new
        assert pub.flush(timeout=10)
    finally:
        tm.set_touched_rows_hook(None)
    assert len(list(list_versions(str(tmp_path / "deltas")))) == 1  # flush: nothing new
