"""Dynamic embedding tables: admission, eviction by each policy, reset of evicted rows, exact
restore, deletes published and applied by serving (also from RAM and disk), parity through
evictions, crash recovery.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_error import ConfigError
from odl.config.config_redaction import config_to_text
from odl.config.dynamic_table_config import DynamicTableSpec
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.features.raw_id_index import RawIdIndex
from odl.models.dynamic import disk_rows
from odl.models.dynamic.dynamic_table import DynamicTable
from odl.models.embedding_tables import DEEP_INIT_STD
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.table_shards import EBC_PREFIX
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_recovery import RecoveredState, RecoveryMerger, apply_recovered_state
from publisher.delta_tracker import DeltaTracker
from publisher.id_maps import write_id_maps
from publisher.publisher_factory import dense_variable_shapes, published_table_dims
from publisher.version_assembler import VersionAssembler
from publisher.version_snapshot import ParameterSnapshotter
from serving_plugin import export_reader
from serving_plugin.export_reader import ExportLoadError
from serving_plugin.serving_model import DeltaApplyError, ServingModel
from serving_plugin.serving_tier import DiskTierSettings

CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "user" }
  input_fields { input_name: "item" input_type: INT64 }
  input_fields { input_name: "cat" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "user" embedding_dim: 8 combiner: "mean"
             zch { zch_size: 60 lru {} } }
  features { input_names: "item" num_buckets: 1 embedding_dim: 8
             ev_params { filter_freq: 2 max_capacity: 40 steps_to_live: 30 } }
  features { input_names: "cat" hash_bucket_size: 50 embedding_dim: 8 }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["user", "item"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["user", "item", "cat", "x"]
                   wide_deep: DEEP }
  deepfm { dnn { hidden_units: [16, 8] } wide_output_dim: 1 }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.005 } }
  seed: 11
}
"""


def _config(model_dir: str = "") -> pipeline_pb2.EasyRecConfig:
    cfg = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    if model_dir:
        cfg.model_dir = model_dir
    return cfg


def _records(n: int, seed: int, users: int = 150, items: int = 120) -> list[bytes]:
    """Skewed users (multi-valued, some repeated) and items, so tables fill and evict."""
    rng = np.random.default_rng(seed)
    u1 = rng.zipf(1.4, n) % users
    u2 = rng.integers(0, users, n)
    it = rng.zipf(1.3, n) % items - 3  # a few negative integer ids
    cat = rng.integers(0, 80, n)
    lab = (rng.random(n) < 0.3).astype(int)
    return [f"{y},{rng.normal():.3f},u{a}|u{b},{i},k{c}".encode()
            for y, a, b, i, c in zip(lab, u1, u2, it, cat, strict=True)]


# --------------------------------------------------------------------------- the index


def test_raw_id_index_matches_a_dict_through_inserts_and_removals():
    rng = np.random.default_rng(0)
    index = RawIdIndex(200)
    model: dict[int, int] = {}
    for _ in range(60):
        new = np.setdiff1d(np.unique(rng.integers(0, 1 << 62, rng.integers(0, 30))),
                           np.array(list(model), dtype=np.int64))[: index.free]
        rows = index.insert(new)
        model.update(zip(new.tolist(), rows.tolist(), strict=True))
        if model and rng.random() < 0.6:
            drop = rng.choice(np.array(list(model)), size=min(len(model), 12), replace=False)
            freed = index.remove_ids(drop)
            assert sorted(freed.tolist()) == sorted(model.pop(int(i)) for i in drop)
        probe = np.concatenate([np.array(list(model), dtype=np.int64),
                                rng.integers(0, 1 << 62, 20)])
        want = [model.get(int(i), -1) for i in probe]
        assert index.lookup(probe).tolist() == want
        assert index.live == len(model)
        assert len(set(model.values())) == len(model)  # rows never shared
    again = RawIdIndex(200)
    again.load_state_dict(index.state_dict())
    probe = np.array(list(model), dtype=np.int64)
    assert np.array_equal(again.lookup(probe), index.lookup(probe))
    # the restored free stack allocates exactly as the original
    fresh = np.arange(1 << 61, (1 << 61) + index.free, dtype=np.int64)
    assert np.array_equal(again.insert(fresh), index.insert(fresh))


# --------------------------------------------------------------------------- the engine


def _table(policy: str, capacity: int = 100, **kw) -> DynamicTable:
    table = DynamicTable("t", DynamicTableSpec(form="zch", capacity=capacity, policy=policy,
                                               **kw), seed=1)
    table.record_deletes = True  # as when a publisher takes them
    return table


def test_admission_by_frequency():
    t = _table("lru", admit_freq=3)
    ids = np.array([7, 7, 8], dtype=np.int64)
    rows, _ = t.admit(ids, np.zeros(3), step=1, now=0.0)
    assert rows.tolist() == [-1, -1, -1]  # 7 seen twice, 8 once
    rows, _ = t.admit(np.array([8, 9], dtype=np.int64), np.zeros(2), step=2, now=0.0)
    assert rows.tolist() == [-1, -1]
    rows, _ = t.admit(np.array([7, 9], dtype=np.int64), np.zeros(2), step=3, now=0.0)
    assert rows[0] >= 0 and rows[1] < 0  # 7: 3 sightings; 9: 2
    assert t.counters.admitted == 1 and t.counters.rejected == 5


def test_admission_by_probability_is_seeded_by_id_and_step():
    ids = np.arange(10_000, dtype=np.int64) * 7919
    runs = []
    for _ in range(2):
        t = _table("lru", capacity=20_000, admit_probability=0.3)
        first, _ = t.admit(ids, np.zeros(ids.shape[0]), step=1, now=0.0)
        second, _ = t.admit(ids, np.zeros(ids.shape[0]), step=2, now=0.0)
        runs.append((first >= 0, second >= 0))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    once, twice = runs[0][0].mean(), runs[0][1].mean()
    assert 0.27 < once < 0.33  # one chance
    assert 0.48 < twice < 0.54  # a second chance: 1 - 0.7 ** 2 = 0.51
    assert runs[0][1][runs[0][0]].all()  # admitted ids keep their rows


def _fill(t: DynamicTable) -> None:
    """Ids 0..99 with sightings 100 - id at steps 1..100 (id i last seen at step i + 1)."""
    for i in range(100):
        ids = np.full(100 - i, i, dtype=np.int64)
        t.admit(ids, np.zeros(ids.shape[0]), step=i + 1, now=float(i))
    assert t.index.live == 100 and t.index.free == 0


@pytest.mark.parametrize("policy,victims", [
    ("lru", range(0, 8)),            # seen least recently
    ("lfu", range(92, 100)),         # seen least often
    ("distance_lfu", range(92, 100)),  # (100 - i) sightings / age (101 - i): lowest for i=99
])
def test_eviction_policies_pick_their_victims(policy, victims):
    t = _table(policy)
    _fill(t)
    # one row is needed; a block of 8 x the rows needed goes at once
    rows, evicted = t.admit(np.array([1000], dtype=np.int64), np.zeros(1), step=101, now=0.0)
    assert evicted.shape[0] == 8 and rows[0] in evicted
    assert t.take_deleted().tolist() == list(victims)
    assert (t.index.lookup(np.array(list(victims))) == -1).all()
    assert t.index.live == 93 and t.counters.evicted == 8
    t.record_deletes = False  # no publisher: evicted ids are not kept (memory stays flat)
    t.admit(np.arange(2000, 2008, dtype=np.int64), np.zeros(8), step=102, now=0.0)
    assert t.counters.evicted > 8 and t.take_deleted().shape[0] == 0


def test_large_table_evicts_exactly_the_lowest_rows():
    """Beyond 65,536 rows the victims come from a sampled threshold: still the k lowest."""
    rng = np.random.default_rng(3)
    t = _table("lfu", capacity=100_000)
    ids = np.arange(100_000, dtype=np.int64)
    t.admit(ids, np.zeros(ids.shape[0]), step=1, now=0.0)
    hot = rng.choice(ids, 60_000, replace=False)
    for s in range(3):  # sightings 1..4, many ties
        t.admit(hot[: 20_000 * (s + 1)], np.zeros(20_000 * (s + 1)), step=2 + s, now=0.0)
    before = t.sightings.copy()
    protect_ids = ids[:10]  # in the batch: never evicted
    rows, evicted = t.admit(np.concatenate([protect_ids, [10**12]]), np.zeros(11), step=9,
                            now=0.0)
    assert evicted.shape[0] == 1000  # 1 % of the capacity at once
    assert not np.isin(evicted, rows[:10]).any()
    kept = np.setdiff1d(np.arange(100_000), np.concatenate([evicted, rows[:10]]))
    assert before[evicted].max() <= before[kept].min()


def test_score_policy_and_protected_rows():
    t = _table("score", delete_threshold=None)
    _fill(t)  # ids with more sightings have a higher score (0.1 per unclicked show)
    # id 99 has the lowest score but is in the batch: it is protected, 91..98 go
    ids = np.array([99, 2000], dtype=np.int64)
    rows, evicted = t.admit(ids, np.zeros(2), step=101, now=0.0)
    assert t.index.lookup(np.array([98]))[0] == -1 and rows[0] >= 0 and rows[1] >= 0
    assert t.take_deleted().tolist() == list(range(91, 99))
    # clicks weigh more: a clicked newcomer outranks an id shown 5 times
    t.admit(np.array([2000] * 3, dtype=np.int64), np.ones(3), step=102, now=0.0)
    assert t.score(t.index.lookup(np.array([2000])))[0] > t.score(
        t.index.lookup(np.array([95])))[0]


def test_expiry_by_steps_score_and_unseen_days():
    t = _table("lru", steps_to_live=10)
    t.admit(np.array([1, 2], dtype=np.int64), np.zeros(2), step=1, now=0.0)
    t.admit(np.array([2], dtype=np.int64), np.zeros(1), step=8, now=0.0)
    assert t.maintain(step=12, now=0.0).shape[0] == 1  # 1 unseen for 11 steps
    assert t.take_deleted().tolist() == [1]
    day = 86400.0
    s = _table("score", delete_threshold=0.8, delete_after_unseen_days=2.0,
               decay_rate_per_day=0.5)
    s.admit(np.array([5] * 10 + [6] * 3, dtype=np.int64), np.zeros(13), step=1, now=0.0)
    s.admit(np.array([7], dtype=np.int64), np.ones(1), step=1, now=0.0)
    s.maintain(step=2, now=0.0)  # scores 1.0, 0.3, 1.0: 6 goes
    assert s.take_deleted().tolist() == [6]
    s.maintain(step=3, now=1.0 * day)  # decayed to 0.5: both below 0.8
    assert s.take_deleted().tolist() == [5, 7]
    u = _table("score", delete_threshold=None, delete_after_unseen_days=2.0)
    u.admit(np.array([1], dtype=np.int64), np.zeros(1), step=1, now=0.0)
    u.admit(np.array([2], dtype=np.int64), np.zeros(1), step=2, now=2.5 * day)
    u.maintain(step=3, now=2.5 * day)
    assert u.take_deleted().tolist() == [1]


# --------------------------------------------------------------------------- config forms


def test_config_forms_and_errors():
    fb = FeatureBuilder(_config())
    specs = {s.name: s for s in fb.table_specs}
    assert specs["user"].dynamic.form == "zch" and specs["user"].num_rows == 60
    assert specs["item"].dynamic.admit_freq == 2 and specs["item"].num_rows == 40
    assert specs["cat"].dynamic is None
    acc = _config()
    acc.feature_config.features[3].ctr_accessor_param.embedx_threshold = 0.5
    spec = {s.name: s for s in FeatureBuilder(acc).table_specs}["cat"].dynamic
    assert (spec.policy, spec.capacity, spec.admit_score) == ("score", 50, 0.5)
    glob = _config()
    glob.model_config.ev_params.filter_freq = 4
    spec = {s.name: s for s in FeatureBuilder(glob).table_specs}["cat"].dynamic
    assert (spec.form, spec.capacity, spec.admit_freq) == ("ev_params", 50, 4)
    bad = _config()
    bad.feature_config.features[1].zch.threshold_filtering_func = "lambda x: x"
    assert _refused(bad).field == "feature_config.features[1].zch.threshold_filtering_func"
    never = _config()
    never.feature_config.features[1].zch.admit_probability = 0.0
    assert _refused(never).field == "feature_config.features[1].zch.admit_probability"
    both = _config()
    both.feature_config.features[1].ev_params.filter_freq = 2
    err = _refused(both)
    assert err.field == "feature_config.features[1].zch" and "at most one" in err.message


def _refused(cfg: pipeline_pb2.EasyRecConfig) -> ConfigError:
    """The error of validating ``cfg`` (given a model_dir and an input path), which must fail.

    Feature rules are validation's: the builder takes a validated config.
    """
    cfg.model_dir = cfg.model_dir or "/tmp/odl-dynamic-tables-unused"
    cfg.train_input_path = "/tmp/odl-dynamic-tables-unused.csv"
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(cfg, online=False)
    return info.value


def test_raw_ids_are_hashes_and_integers_as_they_are():
    fb = FeatureBuilder(_config())
    res = fb.build([b"1,0.5,u3,-1,k1", b"0,0.5,u3|u4,12345678901,k2"])
    d = res.batch.sparse.to_dict()
    from odl.features.id_hashing import fnv1a64
    mask = (1 << 63) - 1
    assert d["user"].values().tolist() == [fnv1a64("u3") & mask, fnv1a64("u3") & mask,
                                           fnv1a64("u4") & mask]
    assert d["item"].values().tolist() == [mask, 12345678901]  # -1 keeps its 63 low bits
    assert max(d["cat"].values().tolist()) < 50  # the fixed table still buckets


# --------------------------------------------------------------------------- the trainer


def _train(tm: TrainModule, fb: FeatureBuilder, seeds) -> None:
    for s in seeds:
        tm.train_step(fb.build(_records(64, s)).batch)


def test_restore_is_exact_and_evicted_rows_are_reset():
    cfg = _config()
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    _train(tm, fb, range(20))
    st = tm.dynamic.status()
    assert st["user"]["evicted"] > 0 and st["item"]["rejected"] > 0  # both full and filtering
    state = tm.state_dict_for_checkpoint()
    other = TrainModule(cfg, fb, device="cpu")
    other.load_checkpoint_state(state)
    for s in range(20, 60):  # fewer items from now on: the others expire (steps_to_live)
        b = fb.build(_records(64, s, items=12)).batch
        a, c = tm.train_step(b), other.train_step(b)
        assert np.array_equal(a.probs, c.probs) and a.loss == c.loss
    for name, w in tm.embedding_tables().items():
        assert torch.equal(w, other.embedding_tables()[name]), name
    assert tm.dynamic.status() == other.dynamic.status()
    assert tm.dynamic.status()["item"]["expired"] > 0
    # rows freed by expiry hold fresh values and zero optimizer state until reused
    item = tm.dynamic.tables["item"]
    free = np.flatnonzero(item.index.row_ids < 0)
    assert free.shape[0] > 0
    tables = tm.embedding_tables()
    wide = tables["item_wide"][torch.from_numpy(free)]
    assert torch.count_nonzero(wide) == 0
    deep = tables["item"][torch.from_numpy(free)]
    assert 0.5 * DEEP_INIT_STD < float(deep.std()) < 2 * DEEP_INIT_STD
    opt = tm.fused_optimizer.state_dict()["state"][f"{EBC_PREFIX}item.weight"]
    for v in opt.values():
        v = v.local_shards()[0].tensor if hasattr(v, "local_shards") else v
        assert torch.count_nonzero(v[torch.from_numpy(free)]) == 0


# --------------------------------------------------------------------------- publish + serve


class _Run:
    """A trainer with a tracker and snapshotter, and a serving model replaying its versions."""

    def __init__(self, tmp_path, warm_steps: int = 6, partitions: int = 1,
                 tier: DiskTierSettings | None = None) -> None:
        self.cfg = _config(str(tmp_path / "model_dir"))
        self.cfg.train_config.dynamic_index_partitions = partitions
        self.fb = FeatureBuilder(self.cfg)
        self.tm = TrainModule(self.cfg, self.fb, device="cpu")
        os.makedirs(self.cfg.model_dir, exist_ok=True)
        self.maps = write_id_maps(self.cfg.model_dir, dense_variable_shapes(self.tm),
                                  published_table_dims(self.tm))
        rows = {n: int(w.shape[0]) for n, w in self.tm.embedding_tables().items()}
        self.tracker = DeltaTracker(self.tm.feature_tables(), rows)
        self.tm.set_touched_rows_hook(self.tracker.record)
        self.snaps = ParameterSnapshotter(self.tm, self.maps, self.tracker)
        _train(self.tm, self.fb, range(warm_steps))
        self.snaps.take(self.tm.global_step, {}, dense=True, sparse=True)  # in the base
        ckpt = CheckpointManager(self.cfg.model_dir).save(
            self.tm.global_step, self.tm.state_dict_for_checkpoint(), {0: 0},
            {"source": "kafka", "topic": "s"}, config_to_text(self.cfg), generation="g")
        self.export = export_checkpoint(self.cfg, ckpt, str(tmp_path / "export"))
        self.serving = ServingModel.load(str(tmp_path / "export"))
        # the same export served from RAM and disk, given the same versions
        self.tiered = (ServingModel.load(str(tmp_path / "export"), disk_tier=tier)
                       if tier else None)
        self.assembler = VersionAssembler()
        self.versions = []

    def publish(self) -> None:
        snap = self.snaps.take(self.tm.global_step, {}, dense=True, sparse=True)
        self.versions.append(snap)
        chunks = encode_version(snap.header("m", "g"), snap.dense, snap.sparse,
                                max_chunk_bytes=4096, deletes=snap.deletes)
        for c in chunks:
            version = self.assembler.add(decode_chunk(c))
        self.serving.apply_version(version)
        if self.tiered is not None:
            self.tiered.apply_version(version)
        self.applied = getattr(self, "applied", []) + [version]
        self.chunks = getattr(self, "chunks", []) + chunks

    def max_diff(self, seed: int) -> float:
        batch = self.fb.build(_records(200, seed)).batch
        want = self.tm.predict(batch)
        got = self.serving.predict_batch(self.fb.build(_records(200, seed)).batch)
        return float(np.abs(want - got).max())


def test_export_holds_live_rows_by_raw_id(tmp_path):
    run = _Run(tmp_path)
    emb = os.path.join(run.export.path, "embeddings")
    with open(os.path.join(emb, "MANIFEST.json")) as f:
        manifest = json.load(f)
    for name, base in (("user", "user"), ("user_wide", "user"), ("item", "item")):
        info = manifest["tables"][name]
        table = run.tm.dynamic.tables[base]
        assert info["keys"] == "raw_id" and info["rows"] == table.spec.capacity
        assert info["live"] == table.index.live
        ids = np.load(os.path.join(emb, name, info["parts"][0]["ids_file"]))
        assert sorted(ids.tolist()) == sorted(table.index.row_ids[table.index.row_ids >= 0])
    assert "keys" not in manifest["tables"]["cat"]
    assert run.serving.dynamic_status()["item"]["live_rows"] == run.tm.dynamic.tables[
        "item"].index.live
    assert run.max_diff(500) <= 1e-6


@pytest.mark.parametrize("partitions", [1, 2])
def test_parity_through_evictions_and_deletes(tmp_path, partitions):
    """Serving replaying the versions predicts as the trainer, through evictions published
    as deletes (also with the tables split by id into two partitions in one process)."""
    run = _Run(tmp_path, partitions=partitions)
    deleted = 0
    for k in range(12):
        _train(run.tm, run.fb, range(100 + 3 * k, 103 + 3 * k))
        run.publish()
        deleted += sum(len(v) for v in run.versions[-1].deletes.values())
        assert run.max_diff(700 + k) <= 1e-6, f"version {k}"
        for base in ("user", "item"):  # serving holds exactly the trainer's live ids
            table = run.tm.dynamic.tables[base]
            live = np.sort(table.raw_ids(table.live_rows()))
            index = run.serving.dynamic[base]
            assert np.array_equal(np.sort(index.row_ids[index.row_ids >= 0]), live)
    assert deleted > 0
    assert len(run.chunks) > len(run.versions)  # versions split across chunks


def test_ids_below_filter_freq_are_never_published(tmp_path):
    run = _Run(tmp_path, warm_steps=2)
    rare = 987654321  # seen once per batch below, in one batch only
    batch = _records(63, 3000) + [f"1,0.1,u1,{rare},k1".encode()]
    run.tm.train_step(run.fb.build(batch).batch)
    run.publish()
    item_ids = {run.maps.tables[t].id for t in ("item", "item_wide")}
    published = np.concatenate([run.versions[-1].sparse[t][0] for t in item_ids
                                if t in run.versions[-1].sparse])
    assert rare not in published.tolist()
    assert run.tm.dynamic.tables["item"].lookup(np.array([rare]))[0] == -1
    run.tm.train_step(run.fb.build(batch).batch)  # second sighting: admitted
    run.publish()
    assert run.tm.dynamic.tables["item"].lookup(np.array([rare]))[0] >= 0
    assert rare in run.versions[-1].sparse[run.maps.tables["item"].id][0].tolist()


def recovered_run(tmp_path, partitions: int = 1) -> tuple[_Run, dict, RecoveredState]:
    """A run's state at its base, then 8 published steps read back as crash recovery does:
    ``(run, base state, recovered state)``; the steps evict, so there are deletes."""
    run = _Run(tmp_path, partitions=partitions)
    base_state = run.tm.state_dict_for_checkpoint()
    for k in range(8):
        _train(run.tm, run.fb, range(200 + 2 * k, 202 + 2 * k))
        run.publish()
    merger = RecoveryMerger(RecoveredState(topic="d", start_offset=0, end_offset=0))
    for offset, chunk in enumerate(run.chunks):
        merger.add(chunk, offset)
    state = merger.finish()
    assert state.deletes  # evictions happened after the base
    return run, base_state, state


@pytest.mark.parametrize("partitions", [1, 2])
def test_crash_recovery_applies_rows_and_deletes(tmp_path, partitions):
    run, base_state, state = recovered_run(tmp_path, partitions)
    restarted = TrainModule(run.cfg, run.fb, device="cpu")
    restarted.load_checkpoint_state(base_state)
    apply_recovered_state(restarted.embedding_tables(), restarted.dense_parameters(),
                          run.maps, state, restarted)
    for base in ("user", "item"):
        want = run.serving.dynamic[base]
        got = restarted.dynamic.tables[base]
        assert np.array_equal(np.sort(got.raw_ids(got.live_rows())),
                              np.sort(want.row_ids[want.row_ids >= 0]))
    batch = run.fb.build(_records(200, 999)).batch
    got = restarted.predict(batch)
    want = run.serving.predict_batch(run.fb.build(_records(200, 999)).batch)
    assert np.abs(got - want).max() <= 1e-6


def test_show_and_click_fields_count_like_paddlerec_slots():
    text = CONFIG.replace(
        'input_fields { input_name: "cat" }',
        'input_fields { input_name: "cat" }\n'
        '  input_fields { input_name: "shows" input_type: INT32 }\n'
        '  input_fields { input_name: "clicks" input_type: INT32 }').replace(
        'hash_bucket_size: 50 embedding_dim: 8 }',
        'hash_bucket_size: 50 embedding_dim: 8 ctr_accessor_param { embedx_threshold: 0 '
        'show_field: "shows" click_field: "clicks" } }')
    cfg = text_format.Parse(text, pipeline_pb2.EasyRecConfig())
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    # the label says 0 but the click field counts 2 of 5 shows, twice for k1, once for k2
    batch = fb.build([b"0,0.1,u1,1,k1,5,2", b"1,0.2,u2,2,k1,5,2", b"0,0.3,u3,3,k2,4,0"]).batch
    tm.train_step(batch)
    cat = tm.dynamic.tables["cat"]
    from odl.features.id_hashing import fnv1a64
    rows = cat.lookup(np.array([fnv1a64("k1") & ((1 << 63) - 1), fnv1a64("k2") & ((1 << 63) - 1)]))
    assert cat.show[rows].tolist() == [10.0, 4.0] and cat.click[rows].tolist() == [4.0, 0.0]
    assert np.allclose(cat.score(rows), [4 + 0.1 * 6, 0.1 * 4])
    bad = text.replace('click_field: "clicks"', 'click_field: "cat"')  # a STRING field
    err = _refused(text_format.Parse(bad, pipeline_pb2.EasyRecConfig()))
    assert err.field == "feature_config.features[3].ctr_accessor_param.click_field"
    assert "numeric" in err.message


# --------------------------------------------------------------------------- serving's disk tier


def _held_ids(model: ServingModel, table: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids in RAM, ids on disk) of a table of a serving model (all in RAM: none on disk)."""
    if table in model.tiers:
        tier = model.tiers[table]
        ram = tier.ram.row_ids[tier.ram.row_ids >= 0]
        return np.sort(ram), np.sort(tier.disk.ids())
    index = model.dynamic[table]
    return np.sort(index.row_ids[index.row_ids >= 0]), np.empty(0, dtype=np.int64)


def test_serving_from_ram_and_disk_predicts_bit_for_bit(tmp_path, monkeypatch):
    """Serving with 8 rows a table in RAM and the rest on disk holds the ids the all-RAM
    serving holds, through versions that update, add and delete rows in both tiers, and
    predicts exactly what it predicts; batches with more ids on disk than staging rows grow
    the staging rows."""
    monkeypatch.setattr(export_reader, "STAGING_START_ROWS", 4)
    run = _Run(tmp_path, tier=DiskTierSettings(str(tmp_path / "serve_tier"), ram_rows=8))
    tiered = run.tiered
    assert set(tiered.tiers) == {"user", "user_wide", "item", "item_wide"}  # cat: fixed
    for k in range(12):  # one small step a version: some rows in RAM are not in it
        run.tm.train_step(run.fb.build(_records(12, 100 + k)).batch)
        run.publish()
        batch = _records(200, 700 + k)
        want = run.serving.predict_batch(run.fb.build(batch).batch)
        got = tiered.predict_batch(run.fb.build(batch).batch)
        assert np.array_equal(got, want), k
        assert float(np.abs(run.tm.predict(run.fb.build(batch).batch) - got).max()) <= 1e-6
        for table in tiered.tiers:
            ram, disk = _held_ids(tiered, table)
            assert ram.shape[0] <= 8 and np.intersect1d(ram, disk).shape[0] == 0
            assert np.array_equal(np.sort(np.concatenate([ram, disk])),
                                  _held_ids(run.serving, table)[0]), (k, table)
    status = tiered.dynamic_status()
    deleted = sum(len(v) for snap in run.versions for v in snap.deletes.values())
    assert deleted > 0
    for table in ("user", "item"):
        st = status[table]
        assert st["ram_live"] == 8 and st["disk_rows"] > 0, st
        assert st["to_disk"] > 0 and st["from_disk"] > 0 and st["disk_reads"] > 0, st
        assert st["live_rows"] == run.serving.dynamic_status()[table]["live_rows"]
        assert tiered.tables[table].shape[0] > 8 + 4  # the staging rows grew
    tiered.close()


def test_serving_tier_refuses_what_does_not_fit_and_a_directory_it_does_not_own(tmp_path):
    """A version with more new ids than the two tiers hold is refused whole; an export
    larger than them is refused at load; one odl-serve owns a tier directory, and a
    directory with other files is not emptied."""
    run = _Run(tmp_path)
    export = str(tmp_path / "export")
    live = max(st["live_rows"] for st in run.serving.dynamic_status().values())
    small = DiskTierSettings(str(tmp_path / "small"), ram_rows=4, max_disk_rows=live - 6)
    with pytest.raises(ExportLoadError, match="no room"):
        ServingModel.load(export, disk_tier=small)
    tier = DiskTierSettings(str(tmp_path / "tier"), ram_rows=4, max_disk_rows=live + 2)
    model = ServingModel.load(export, disk_tier=tier)
    with pytest.raises(ExportLoadError, match="in use"):
        ServingModel.load(export, disk_tier=tier)
    _train(run.tm, run.fb, range(40, 43))
    snap = run.snaps.take(run.tm.global_step, {}, dense=True, sparse=True)
    tid = run.maps.tables["item"].id
    ids, vals = snap.sparse[tid]
    room = model.dynamic_status()["item"]["capacity"] - model.dynamic_status()["item"][
        "live_rows"] + len(snap.deletes.get(tid, ()))  # the version's deletes free rows
    fresh = np.arange(room + 1, dtype=np.int64) + (1 << 40)  # ids the table never held
    snap.sparse[tid] = (np.concatenate([ids, fresh]),
                        np.concatenate([vals, np.ones((fresh.shape[0], vals.shape[1]),
                                                      dtype=vals.dtype)]))
    version = None
    for c in encode_version(snap.header("m", "g"), snap.dense, snap.sparse,
                            deletes=snap.deletes):
        version = run.assembler.add(decode_chunk(c))
    batch = _records(100, 5)
    before = model.predict_batch(run.fb.build(batch).batch)
    status = model.dynamic_status()
    with pytest.raises(DeltaApplyError) as err:
        model.apply_version(version)
    assert err.value.reason == "capacity"
    assert model.dynamic_status() == status  # nothing written
    assert np.array_equal(model.predict_batch(run.fb.build(batch).batch), before)
    model.close()
    ServingModel.load(export, disk_tier=tier).close()  # free again once closed
    foreign = tmp_path / "trainer_tier"
    foreign.mkdir()
    (foreign / "rows.f32").write_bytes(b"x")
    with pytest.raises(ExportLoadError, match="did not write"):
        ServingModel.load(export, disk_tier=DiskTierSettings(str(foreign), ram_rows=4))
    assert (foreign / "rows.f32").read_bytes() == b"x"


def test_serving_tier_predictions_during_versions_see_whole_versions(tmp_path, monkeypatch):
    """Predictions made while versions are applied to a tiered model (its disk file growing
    meanwhile) each equal the all-RAM model's prediction at the version they report."""
    monkeypatch.setattr(disk_rows, "_START_SLOTS", 2)  # the tier's file doubles often
    run = _Run(tmp_path)
    requests = [run.fb.build(_records(60, 900 + i)).batch for i in range(3)]
    want = {run.serving.state.version: [run.serving.predict_batch(b) for b in requests]}
    for k in range(10):
        run.tm.train_step(run.fb.build(_records(12, 300 + k)).batch)
        run.publish()
        want[run.serving.state.version] = [run.serving.predict_batch(b) for b in requests]
    tiered = ServingModel.load(run.export.path,
                               disk_tier=DiskTierSettings(str(tmp_path / "tier"), ram_rows=6))
    done = threading.Event()
    seen: list[tuple[int, int, np.ndarray]] = []

    def predict() -> None:
        while not done.is_set():
            for i, b in enumerate(requests):
                probs, version, _ = tiered.predict_versioned(b)
                seen.append((i, version, probs))

    reader = threading.Thread(target=predict)
    reader.start()
    try:
        for version in run.applied:
            tiered.apply_version(version)
    finally:
        done.set()
        reader.join()
    assert tiered.tiers["item"].disk.index.capacity >= 16  # grown while read
    assert len({v for _i, v, _p in seen}) >= 2  # predictions fell between versions
    for i, version, probs in seen:
        assert np.array_equal(probs, want[version][i]), (i, version)
    tiered.close()
