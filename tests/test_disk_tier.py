"""The disk tier of dynamic tables (``train_config.disk_tier``): rows that leave RAM move to
disk with their optimizer state and counters and come back unchanged; no id is lost; a
checkpoint holds both tiers and a restore continues bit for bit; export, publishing and
serving see one table.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from google.protobuf import text_format

from odl.checkpoint.checkpoint_manager import (
    CheckpointManager,
    list_checkpoints,
    read_checkpoint,
)
from odl.config.config_error import ConfigError
from odl.config.config_redaction import config_to_text
from odl.config.pipeline_config import load_pipeline_config
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.delta_topic_audit import published_versions
from odl.harness.exactly_once_audit import reflected_exactly_once
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.models.dynamic.disk_rows import DiskRows
from odl.models.dynamic.dynamic_table import DynamicTable
from odl.protos import pipeline_pb2
from odl.train.memory_estimate import DISK_INDEX_BYTES_PER_ROW, estimate_memory
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_tracker import DeltaTracker
from publisher.id_maps import write_id_maps
from publisher.publisher_factory import dense_variable_shapes, published_table_dims
from publisher.version_assembler import VersionAssembler
from publisher.version_snapshot import ParameterSnapshotter
from serving_plugin.serving_model import ServingModel
from tests.harness import make_half_dynamic, run_in_process, write_config

CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "user" }
  input_fields { input_name: "item" input_type: INT64 }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "user" embedding_dim: 8 combiner: "mean"
             zch { zch_size: 60 lru {} } }
  features { input_names: "item" num_buckets: 1 embedding_dim: 8 ev_params { } }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["user", "item"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["user", "item", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [16, 8] } wide_output_dim: 1 }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.005 } }
  disk_tier { ram_rows: 16 }
  seed: 5
}
"""
SPARSE = ["adagrad_optimizer { lr: 0.1 }", "adam_optimizer { lr: 0.01 }"]
# records per batch: fewer distinct ids than the RAM rows, so every id of a batch gets a row
BATCH = 12


def _config(tmp_path, name: str = "tier", sparse: str = SPARSE[0],
            model_dir: str = "") -> pipeline_pb2.EasyRecConfig:
    cfg = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    cfg.train_config.sparse_optimizer.Clear()
    text_format.Merge(sparse, cfg.train_config.sparse_optimizer)
    cfg.train_config.disk_tier.dir = str(tmp_path / name)
    cfg.model_dir = model_dir
    return cfg


def _records(n: int, seed: int, items: int = 120) -> list[bytes]:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 90, n)
    it = rng.integers(0, items, n)
    lab = (rng.random(n) < 0.3).astype(int)
    return [f"{y},{rng.normal():.3f},u{a},{i}".encode()
            for y, a, i in zip(lab, u, it, strict=True)]


def _tiers(tm: TrainModule, base: str) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """(RAM id -> row values, disk id -> slot values), both in the tier's row layout."""
    table = tm.dynamic.tables[base]
    rows = table.live_rows()
    ram = tm.dynamic_rows.disk_row_values(base, rows)
    disk = table.disk.state_dict()
    return ({int(i): v for i, v in zip(table.raw_ids(rows), ram, strict=True)},
            {int(i): v for i, v in zip(disk["ids"], disk["values"], strict=True)})


def test_the_config_sets_the_ram_rows_and_refuses_ranks(tmp_path):
    specs = {s.name: s.dynamic for s in FeatureBuilder(_config(tmp_path)).table_specs}
    assert specs["item"].capacity == specs["user"].capacity == 16
    assert specs["item"].grows_to == 0 and specs["item"].disk_rows == -1
    assert specs["item"].most_ids == (1 << 31) - 1  # the id maps' and serving's bound
    unbounded = estimate_memory(_config(tmp_path), "cpu")
    bounded_cfg = _config(tmp_path)
    bounded_cfg.train_config.disk_tier.max_disk_rows = 1000  # its index counted
    bounded = estimate_memory(bounded_cfg, "cpu")
    # two tables' indexes, each counted twice on the host (with the checkpoint's copy)
    assert bounded.host_bytes - unbounded.host_bytes == 2 * 2 * 1000 * DISK_INDEX_BYTES_PER_ROW
    cfg = _config(tmp_path)
    cfg.train_config.dynamic_index_partitions = 2
    with pytest.raises(ConfigError, match="disk_tier"):
        TrainModule(cfg, FeatureBuilder(cfg), device="cpu")


@pytest.mark.parametrize("sparse", SPARSE)
def test_rows_leave_ram_and_come_back_unchanged(tmp_path, sparse):
    """Fused Adagrad and row-sparse Adam: a row keeps its weights, optimizer state and
    counters across any number of moves, and every id seen is in exactly one tier."""
    cfg = _config(tmp_path, sparse=sparse)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    seen: dict[str, set[int]] = {"item": set(), "user": set()}
    for s in range(30):
        batch = fb.build(_records(BATCH, s)).batch
        before = {base: _tiers(tm, base) for base in seen}
        counters = {base: tm.dynamic.tables[base].state_dict() for base in seen}
        tm.dynamic_rows.remap(batch)  # admission and moves, no update
        for base in seen:
            ram0, disk0 = before[base]
            ram1, disk1 = _tiers(tm, base)
            assert not set(ram1) & set(disk1)
            assert set(ram1) | set(disk1) == set(ram0) | set(disk0) | (set(ram1) - set(ram0)
                                                                       - set(disk0))
            for i, v in ram1.items():  # in RAM: from its RAM row, or back from disk
                if i in ram0 or i in disk0:
                    assert np.array_equal(v, ram0[i] if i in ram0 else disk0[i]), (base, i)
            for i, v in disk1.items():  # on disk: from its slot, or just moved out
                assert np.array_equal(v, disk0[i] if i in disk0 else ram0[i]), (base, i)
            table = tm.dynamic.tables[base]  # a returning id keeps its counters
            back = [i for i in ram1 if i in disk0]
            if back:
                old = counters[base]["tier"]["disk"]
                at = {int(i): k for k, i in enumerate(old["ids"])}
                rows = table.lookup(np.asarray(back))
                looked = batch.sparse.to_dict()[base].values().numpy()  # counted by the remap
                assert np.array_equal(
                    table.sightings[rows],
                    np.asarray([old["counters"][at[i]][0] + (looked == i).sum() for i in back]))
        tm.train_step(batch)
        for base, ids in seen.items():
            ids.update(int(i) for i in tm.dynamic.tables[base].raw_ids(
                tm.dynamic.tables[base].live_rows()))
    for base, ids in seen.items():  # nothing is lost
        ram, disk = _tiers(tm, base)
        assert set(ram) | set(disk) == ids
        status = tm.dynamic_status()[base]
        assert status["to_disk"] > 50 and status["from_disk"] > 20, status
        assert status["evicted"] == 0 and status["rejected"] == 0
        assert status["disk_rows"] == len(disk) == len(ids) - status["live_rows"]


def test_a_checkpoint_holds_both_tiers_and_a_restore_continues_bit_for_bit(tmp_path):
    cfg = _config(tmp_path, model_dir=str(tmp_path / "model_dir"))
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    for s in range(15):
        tm.train_step(fb.build(_records(BATCH, s)).batch)
    path = CheckpointManager(cfg.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 0},
        {"source": "kafka", "topic": "s"}, config_to_text(cfg), generation="g")
    other = _config(tmp_path, name="other_tier")
    restored = TrainModule(other, FeatureBuilder(other), device="cpu")
    restored.load_checkpoint_state(read_checkpoint(path).state)
    assert _tiers(restored, "item")[1].keys() == _tiers(tm, "item")[1].keys()
    for s in range(15, 25):
        b = fb.build(_records(BATCH, s)).batch
        assert np.array_equal(tm.train_step(b).probs, restored.train_step(b).probs), s
    for base in ("item", "user"):
        a, b = _tiers(tm, base), _tiers(restored, base)
        for mine, theirs in zip(a, b, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(np.array_equal(v, theirs[i]) for i, v in mine.items())
    plain = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())  # same rows, no tier
    plain.train_config.ClearField("disk_tier")
    plain.feature_config.features[1].zch.zch_size = 16
    plain.feature_config.features[2].ev_params.max_capacity = 16
    without = TrainModule(plain, FeatureBuilder(plain), device="cpu")
    with pytest.raises(ValueError, match="disk_tier.dir"):
        without.load_checkpoint_state(read_checkpoint(path).state)
    plain.train_config.dynamic_index_partitions = 2  # a re-split would lose them
    split = TrainModule(plain, FeatureBuilder(plain), device="cpu")
    with pytest.raises(ValueError, match="not re-split"):
        split.load_checkpoint_state(read_checkpoint(path).state)


def test_export_publishing_and_serving_see_one_table(tmp_path):
    """Serving holds the rows on disk too (export), gets the last updates of rows that left
    RAM before a version (sent from disk), and predicts as the trainer once the ids are back
    in RAM."""
    cfg = _config(tmp_path, model_dir=str(tmp_path / "model_dir"))
    cfg.train_config.incr_save_config.SetInParent()  # moves kept for the publisher
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    maps = write_id_maps(cfg.model_dir, dense_variable_shapes(tm), published_table_dims(tm))
    tracker = DeltaTracker(tm.feature_tables(), {n: r for n, (r, _) in tm.table_shapes().items()})
    tm.set_touched_rows_hook(tracker.record)
    snaps = ParameterSnapshotter(tm, maps, tracker)
    for s in range(10):
        tm.train_step(fb.build(_records(BATCH, s)).batch)
    snaps.take(tm.global_step, {}, dense=True, sparse=True)
    ckpt = CheckpointManager(cfg.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 0},
        {"source": "kafka", "topic": "s"}, config_to_text(cfg), generation="g")
    export_checkpoint(cfg, ckpt, str(tmp_path / "export"))
    serving = ServingModel.load(str(tmp_path / "export"))
    ram, disk = _tiers(tm, "item")
    assert serving.dynamic_status()["item"]["live_rows"] == len(ram) + len(disk)
    assembler = VersionAssembler()
    moved_by_predictions = 0
    for k in range(6):  # each version: steps that move trained rows out before it is taken
        for s in range(3):
            tm.train_step(fb.build(_records(BATCH, 100 + 3 * k + s)).batch)
        snap = snaps.take(tm.global_step, {}, dense=True, sparse=True)
        assert not snap.deletes  # a move to disk is not a delete
        for c in encode_version(snap.header("m", "g"), snap.dense, snap.sparse,
                                max_chunk_bytes=4096, deletes=snap.deletes):
            version = assembler.add(decode_chunk(c))
        serving.apply_version(version)
        records = _records(BATCH, 100 + 3 * k)  # trained ids, some on disk now
        item = tm.dynamic.tables["item"]
        ids = np.unique(fb.build(records).batch.sparse["item"].values().numpy())
        on_disk = int((item.disk.slots(ids) >= 0).sum())
        back = item.counters.from_disk
        got = tm.predict(fb.build(records).batch)  # its ids on disk come back to RAM first
        assert item.counters.from_disk - back == on_disk, k
        want = serving.predict_batch(fb.build(records).batch)
        assert float(np.abs(got - want).max()) <= 1e-6, k
        moved_by_predictions += on_disk
    assert tm.dynamic_status()["item"]["to_disk"] > 30 and moved_by_predictions > 0
    ram, disk = _tiers(tm, "item")  # a republish (the broker lost versions): both tiers
    republished = snaps.take(tm.global_step, {}, dense=True, sparse=True, republish_all=True)
    sent = republished.sparse[maps.tables["item"].id][0]
    assert sorted(sent.tolist()) == sorted(set(ram) | set(disk)) and len(disk) > 50


def test_the_store_grows_keeps_its_bound_and_restores(tmp_path):
    store = DiskRows(str(tmp_path / "t"), 3, max_rows=40000, columns={"t": 0})
    ids = np.arange(30000, dtype=np.int64) * 7
    counters = np.random.default_rng(0).random((30000, 5))
    slots = store.reserve(ids, counters)
    assert (slots >= 0).all() and store.live == 30000  # grown past its first 16,384 slots
    store.write(slots, np.arange(90000, dtype=np.float32).reshape(30000, 3))
    more = store.reserve(np.arange(30000, 50000, dtype=np.int64) * 7, counters[:20000])
    assert int((more >= 0).sum()) == 10000 and store.live == 40000  # its bound
    state = store.state_dict()
    copy = DiskRows(str(tmp_path / "u"), 3, max_rows=40000)
    copy.load_state_dict(state)
    got = copy.read(copy.slots(ids[:5]))
    assert np.array_equal(got, np.arange(15, dtype=np.float32).reshape(5, 3))
    assert np.array_equal(copy.read_counters(copy.slots(ids[:5])), counters[:5])
    assert copy.release(copy.slots(ids[:2])).tolist() == [0, 7] and copy.live == 39998
    with pytest.raises(ValueError, match="values a row"):
        DiskRows(str(tmp_path / "v"), 4).load_state_dict(state)


@pytest.mark.slow
def test_a_trainer_on_the_broker_moves_rows_restarts_and_serves_exactly_once(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """``odl-train``'s loop with a disk tier smaller than the ids of the stream: rows move
    both ways, a restart continues from the checkpoint's two tiers, every record is
    reflected exactly once in the published versions, and serving an export of the final
    checkpoint predicts as the trainer."""
    topic = kafka_topic_factory(partitions=2)
    delta_topic = kafka_topic_factory(partitions=1, prefix="delta", create=False)
    extra = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 kafka {{ '
             f'server: "{kafka_bootstrap}" topic: "{delta_topic}" }} }} '
             f'disk_tier {{ dir: "{tmp_path / "tier"}" ram_rows: 48 }}')
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=32, extra_train=extra,
                       save_checkpoints_steps=8)
    dynamic = make_half_dynamic(cfg, "ev_params { }")
    ids, values = make_records(1400, seed=3)
    ledger = str(tmp_path / "ledger.tsv")
    produce(kafka_bootstrap, topic, values[:700], 2)
    first = run_in_process(cfg, end_offsets(kafka_bootstrap, topic), ledger)
    moved = first.module.dynamic_status()
    full = [f for f in dynamic if moved[f]["to_disk"]]  # (a feature may have fewer ids)
    assert len(full) >= 5 and all(moved[f]["from_disk"] > 0 for f in full), moved
    # killed after publishing its last versions, before its checkpoint: crash recovery puts
    # the versions' rows on both tiers
    model_dir = str(tmp_path / "model_dir")
    shutil.rmtree(list_checkpoints(model_dir)[-1])
    produce(kafka_bootstrap, topic, values[700:], 2)
    last = run_in_process(cfg, end_offsets(kafka_bootstrap, topic), ledger)
    assert last.recovery["versions"] >= 1
    lost, twice = reflected_exactly_once(
        ids, read_ledger(ledger), published_versions(kafka_bootstrap, delta_topic))
    assert lost == [] and twice == [], (len(lost), len(twice))
    final = list_checkpoints(model_dir)[-1]
    assert read_checkpoint(final).global_step == last.module.global_step
    config = load_pipeline_config(cfg)
    export_checkpoint(config, final, str(tmp_path / "export"))
    serving = ServingModel.load(str(tmp_path / "export"))
    fb = FeatureBuilder(config)
    for at in range(0, 160, 8):  # trained records, a few at a time: their ids fit in RAM
        batch = fb.build(values[at:at + 8]).batch  # (its ids on disk come back to RAM)
        got = serving.predict_batch(fb.build(values[at:at + 8]).batch)
        assert float(np.abs(last.module.predict(batch) - got).max()) <= 1e-6, at


def test_ssd_unseenday_threshold_moves_unseen_rows_to_disk_at_maintenance(tmp_path):
    """PaddleRec's form: with the tier, rows unseen for more than ``ssd_unseenday_threshold``
    days move to disk at the maintenance pass (no delete), those seen stay; expiry still
    deletes."""
    cfg = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    item = cfg.feature_config.features[2]
    item.ClearField("ev_params")
    text_format.Merge("ctr_accessor_param { capacity: 64 embedx_threshold: 0 "
                      "delete_threshold: 0 delete_after_unseen_days: 5 "
                      "ssd_unseenday_threshold: 2 }", item)
    cfg.train_config.disk_tier.dir = str(tmp_path / "tier")
    cfg.train_config.disk_tier.ram_rows = 0  # the table's own capacity
    spec = {s.name: s.dynamic for s in FeatureBuilder(cfg).table_specs}["item"]
    assert (spec.capacity, spec.disk_after_unseen_days) == (64, 2.0)
    table = DynamicTable("item", spec)
    table.record_deletes = True
    table.attach_disk(DiskRows(str(tmp_path / "t"), 3))
    day = 86400.0
    table.admit(np.array([1, 2, 3], dtype=np.int64), np.zeros(3), step=1, now=0.0)
    table.admit(np.array([3], dtype=np.int64), np.zeros(1), step=2, now=1.5 * day)
    moved = table.maintain(step=3, now=2.5 * day)  # 1, 2 unseen 2.5 days; 3 for 1
    assert sorted(table.raw_ids(moved).tolist()) == [-1, -1]  # their rows are free now
    moves = table.take_moves()
    assert sorted(moves.out_ids.tolist()) == [1, 2] and not table.take_deleted().shape[0]
    assert table.live == 1 and table.disk.live == 2
    table.maintain(step=4, now=7.0 * day)  # 3 unseen 5.5 days: expired, a delete
    assert table.take_deleted().tolist() == [3] and table.disk.live == 2
    back, _evicted = table.admit(np.array([2], dtype=np.int64), np.zeros(1), step=5,
                                 now=7.0 * day)
    assert back[0] >= 0 and table.take_moves().in_ids.tolist() == [2]
