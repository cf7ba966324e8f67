"""Dynamic tables that grow (ev_params without a written capacity): they start small, double
at a step's end as ids are admitted, keep every row, its optimizer state and its index across
a growth, restore at the rows a checkpoint holds, export and serve as fixed ones do, and the
memory check counts their start rows and reports the rows they can reach.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import odl.config.dynamic_table_config as dynamic_table_config
from odl.checkpoint.checkpoint_manager import (
    CheckpointManager,
    read_checkpoint,
    resolve_checkpoint_path,
)
from odl.config.config_redaction import config_to_text
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.models.dynamic.partitions import partition_of
from odl.models.embedding_tables import initial_rows
from odl.protos import pipeline_pb2
from odl.train import table_growth
from odl.train.checkpoint_rows import CheckpointRows
from odl.train.host_memory import AvailableMemory
from odl.train.memory_estimate import check_memory, estimate_memory, growth_limit, growth_notes
from odl.train.module_state import changed_rows_part
from odl.train.table_growth import grow_tables
from odl.train.table_shards import EBC_PREFIX
from odl.train.train_module import TrainModule
from publisher.delta_decoder import decode_chunk
from publisher.delta_encoder import encode_version
from publisher.delta_tracker import DeltaTracker
from publisher.id_maps import write_id_maps
from publisher.publisher_factory import dense_variable_shapes, published_table_dims
from publisher.version_assembler import VersionAssembler
from publisher.version_snapshot import ParameterSnapshotter
from serving_plugin.serving_model import ServingModel

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
  features { input_names: "item" num_buckets: 1 embedding_dim: 8
             ev_params { filter_freq: 2 init_capacity: 16 } }
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
  seed: 5
}
"""
# the rows a growing table may reach here (EasyRec's 16,777,216 would not fit a test)
CAP = 128


@pytest.fixture(autouse=True)
def _small_cap(monkeypatch):
    monkeypatch.setattr(dynamic_table_config, "EV_DEFAULT_MAX_CAPACITY", CAP)


def _config(sparse: str = "adagrad_optimizer { lr: 0.1 }",
            model_dir: str = "", partitions: int = 1) -> pipeline_pb2.EasyRecConfig:
    cfg = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    cfg.train_config.sparse_optimizer.Clear()
    text_format.Merge(sparse, cfg.train_config.sparse_optimizer)
    cfg.model_dir = model_dir
    cfg.train_config.dynamic_index_partitions = partitions
    return cfg


# the index whole, and split by id into two partitions (each growing block by block)
PARTITIONS = pytest.mark.parametrize("partitions", [1, 2], ids=["whole", "split_by_id"])


def _records(n: int, seed: int, items: int = 40) -> list[bytes]:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 80, n)
    it = rng.integers(0, items, n)
    lab = (rng.random(n) < 0.3).astype(int)
    return [f"{y},{rng.normal():.3f},u{a},{i}".encode() for y, a, i in zip(lab, u, it,
                                                                          strict=True)]


def _train(tm: TrainModule, fb: FeatureBuilder, seeds, items: int = 40) -> None:
    for s in seeds:
        tm.train_step(fb.build(_records(32, s, items)).batch)


def _rows(tm: TrainModule) -> int:
    return tm.dynamic.tables["item"].spec.capacity


def test_config_forms_that_grow():
    cfg = _config()
    spec = {s.name: s.dynamic for s in FeatureBuilder(cfg).table_specs}["item"]
    assert (spec.capacity, spec.grows_to, spec.grows) == (16, CAP, True)
    item = cfg.feature_config.features[2]
    item.ev_params.ClearField("init_capacity")
    spec = {s.name: s.dynamic for s in FeatureBuilder(cfg).table_specs}["item"]
    assert spec.capacity == CAP and not spec.grows  # the default start is above this cap
    item.ev_params.max_capacity = 50  # a written capacity: a fixed table
    spec = {s.name: s.dynamic for s in FeatureBuilder(cfg).table_specs}["item"]
    assert (spec.capacity, spec.grows) == (50, False)


@pytest.mark.parametrize("sparse", ["adagrad_optimizer { lr: 0.1 }",
                                    "adam_optimizer { lr: 0.01 }"])
def test_growth_keeps_rows_optimizer_state_index_and_predictions(sparse):
    """A growth changes nothing but the rows (fused Adagrad; row-sparse Adam on CPU)."""
    cfg = _config(sparse)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    _train(tm, fb, range(3), items=12)
    assert _rows(tm) == 16 and tm.dynamic.tables["item"].live <= 12
    before = tm.state_dict_for_checkpoint()
    batch = fb.build(_records(64, 99)).batch
    probs = tm.predict(batch)
    status, seen = tm.dynamic_status(), []
    tm.add_table_growth_hook(  # called mid-growth: /status reads the status from before
        lambda _shapes: seen.append((tm.dynamic_status(), tm.global_step)))
    event = grow_tables(tm, {"item": 32})
    assert seen == [(status, before["global_step"])]
    assert tm.dynamic_status()["item"]["capacity"] == 32
    assert event.rows == {"item": (16, 32)} and _rows(tm) == 32
    after = tm.state_dict_for_checkpoint()
    for key, t in before["model"].items():
        assert torch.equal(after["model"][key][: t.shape[0]], t), key
    assert after["model"][f"{EBC_PREFIX}item.weight"].shape[0] == 32
    for t in ("item", "item_wide"):  # the rows added hold their initial values
        w = after["model"][f"{EBC_PREFIX}{t}.weight"]
        first, values = next(initial_rows(t, cfg.train_config.seed, tuple(w.shape), 16, 32))
        assert torch.equal(w[16:], values[16 - first:32 - first]), t
    for pname, states in before["sparse_optimizer"].items():
        for k, v in states.items():
            got = after["sparse_optimizer"][pname][k]
            assert torch.equal(got[: v.shape[0]] if v.dim() else got, v), (pname, k)
    old, new = before["dynamic_tables"]["tables"]["item"], after["dynamic_tables"]["tables"]["item"]
    assert torch.equal(new["index"]["row_ids"][:16], old["index"]["row_ids"])
    assert bool((new["index"]["row_ids"][16:] == -1).all())
    assert np.array_equal(tm.predict(batch), probs)
    assert tm.global_step == before["global_step"]


@PARTITIONS
def test_tables_grow_through_admissions_and_restore_continues_bit_for_bit(partitions):
    cfg = _config(partitions=partitions)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    seen = []
    for s in range(30):
        _train(tm, fb, [s], items=200)
        seen.append(_rows(tm))
        assert tm.dynamic.tables["item"].live <= _rows(tm)
    assert seen[-1] == CAP  # doubled up to the cap
    assert sorted(set(seen)) == [16, 32, 64, CAP][[16, 32, 64, CAP].index(seen[0]):]
    assert [e.rows["item"] for e in tm.growth.events] == [
        (r, 2 * r) for r in (16, 32, 64) if r >= seen[0]]
    assert tm.dynamic.status()["item"]["evicted"] > 0  # full at the cap: it evicts
    assert (tm.dynamic_status()["item"]["capacity"], tm.dynamic_status()["item"]["grows_to"]) \
        == (CAP, CAP)
    # a module built at the start rows restores the grown checkpoint and continues exactly
    other = TrainModule(cfg, fb, device="cpu")
    assert _rows(other) == 16
    other.load_checkpoint_state(tm.state_dict_for_checkpoint())
    assert _rows(other) == CAP
    for s in range(30, 36):
        b = fb.build(_records(32, s, 200)).batch
        a, c = tm.train_step(b), other.train_step(b)
        assert np.array_equal(a.probs, c.probs) and a.loss == c.loss
    assert tm.dynamic.status() == other.dynamic.status()


@PARTITIONS
def test_growth_in_training_equals_a_restore_at_the_grown_rows(partitions):
    """Training on from a growth equals training on from a checkpoint of the grown state
    (split by id: each partition's rows moved to their place in the grown table)."""
    cfg = _config(partitions=partitions)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    step = 0
    while _rows(tm) == 16:
        _train(tm, fb, [step], items=60)
        step += 1
    restored = TrainModule(cfg, fb, device="cpu")
    restored.load_checkpoint_state(tm.state_dict_for_checkpoint())
    for s in range(step, step + 5):
        b = fb.build(_records(32, s, 60)).batch
        assert np.array_equal(tm.train_step(b).probs, restored.train_step(b).probs)
    for name, w in tm.embedding_tables().items():
        assert torch.equal(w, restored.embedding_tables()[name]), name


@PARTITIONS
def test_serving_parity_through_growth(tmp_path, partitions):
    """An export of a grown table, then versions of it growing to the cap and evicting:
    serving grows its own table as the versions' new ids need and predicts as the trainer
    (split by id: the rows touched before a growth are published at their new places)."""
    cfg = _config(model_dir=str(tmp_path / "model_dir"), partitions=partitions)
    cfg.train_config.incr_save_config.SetInParent()  # evictions kept as deletes
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    os.makedirs(cfg.model_dir)
    maps = write_id_maps(cfg.model_dir, dense_variable_shapes(tm), published_table_dims(tm))
    assert maps.tables["item"].num_rows == CAP  # the id maps name the most rows
    tracker = DeltaTracker(tm.feature_tables(), {n: r for n, (r, _) in tm.table_shapes().items()})
    tm.set_touched_rows_hook(tracker.record)
    tm.add_table_growth_hook(lambda shapes: tracker.grow(
        {n: r for n, (r, _) in shapes.items()}, tm.growth.moves))
    snaps = ParameterSnapshotter(tm, maps, tracker)
    _train(tm, fb, range(4), items=200)  # grown once or more before the export
    assert _rows(tm) > 16
    snaps.take(tm.global_step, {}, dense=True, sparse=True)
    ckpt = CheckpointManager(cfg.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 0},
        {"source": "kafka", "topic": "s"}, config_to_text(cfg), generation="g")
    export_checkpoint(cfg, ckpt, str(tmp_path / "export"))
    serving = ServingModel.load(str(tmp_path / "export"))
    assembler = VersionAssembler()
    grown_at = _rows(tm)
    # serving starts at the rows the checkpoint holds and may grow to the cap
    assert serving.dynamic_status()["item"] == {
        "capacity": grown_at, "live_rows": tm.dynamic.tables["item"].live, "max_rows": CAP}
    for k in range(8):  # grows to the cap, then evicts (deletes)
        _train(tm, fb, range(100 + 2 * k, 102 + 2 * k), items=200)
        snap = snaps.take(tm.global_step, {}, dense=True, sparse=True)
        for c in encode_version(snap.header("m", "g"), snap.dense, snap.sparse,
                                max_chunk_bytes=4096, deletes=snap.deletes):
            version = assembler.add(decode_chunk(c))
        serving.apply_version(version)
        b = fb.build(_records(100, 500 + k, 200)).batch
        got = serving.predict_batch(fb.build(_records(100, 500 + k, 200)).batch)
        assert float(np.abs(tm.predict(b) - got).max()) <= 1e-6, f"version {k}"
    assert _rows(tm) == CAP > grown_at
    for name in ("item", "item_wide"):  # serving grew with the ids it was sent
        index = serving.dynamic[name]
        assert grown_at < index.capacity <= CAP
        table = tm.dynamic.tables["item"]
        assert np.array_equal(np.sort(index.row_ids[index.row_ids >= 0]),
                              np.sort(table.raw_ids(table.live_rows())))


def test_memory_check_counts_the_start_rows_and_reports_the_cap():
    cfg = _config()
    est = estimate_memory(cfg, "cpu")
    item = {t.name: t for t in est.tables}["item"]
    assert (item.rows, item.grows_to) == (16, CAP)
    assert growth_limit(est, est.host_bytes * 10) == {"item": CAP, "item_wide": CAP}
    checked = check_memory(cfg, "cpu", 0.8, host_available=AvailableMemory(1 << 40, "host"))
    assert growth_notes(checked) == [
        f"dynamic table item grows: counted at its start, 16 rows; it may reach {CAP} rows "
        f"(grows_to {CAP})"]
    assert growth_limit(est, est.host_bytes) == {"item": 16, "item_wide": 16}  # no room left
    cfg.train_config.dynamic_index_partitions = 3  # split by id: grows in whole blocks
    item = {t.name: t for t in estimate_memory(cfg, "cpu").tables}["item"]
    assert (item.rows, item.grows_to) == (18, CAP)


def test_growth_stops_where_the_memory_is_not_free(monkeypatch):
    cfg = _config()
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    monkeypatch.setattr(table_growth, "available_host_memory",
                        lambda: AvailableMemory(1000, "host"))
    _train(tm, fb, range(6), items=200)
    assert _rows(tm) == 16 and tm.growth.stopped == {"item": 16}
    assert tm.dynamic.status()["item"]["evicted"] > 0


def test_split_by_id_grows_in_whole_blocks():
    """Split by id a growing table's rows are a multiple of P from the start, and a growth
    keeps each partition's ids in its block, each in its row within the block."""
    cfg = _config(partitions=3)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    assert _rows(tm) == 18  # the 16 start rows in 3 blocks of 6
    _train(tm, fb, range(2), items=12)
    table = tm.dynamic.tables["item"]
    rows = _rows(tm)
    assert rows % 3 == 0 and [e.rows["item"] for e in tm.growth.events] == [(18, 36)]
    before = {p: part.raw_ids(np.arange(rows // 3)) for p, (_lo, part) in table.held.items()}
    ids = table.raw_ids(table.live_rows())
    assert ids.shape[0] > 6

    def by_id() -> dict:  # each id's weights and optimizer state, wherever its row is
        rows = torch.from_numpy(tm.dynamic.tables["item"].lookup(ids))
        state = tm.state_dict_for_checkpoint()
        key = f"{EBC_PREFIX}item.weight"
        return {"w": state["model"][key][rows],
                **{k: v[rows] for k, v in state["sparse_optimizer"][key].items() if v.dim()}}

    want = by_id()
    grow_tables(tm, {"item": 2 * rows})
    for p, (lo, part) in tm.dynamic.tables["item"].held.items():
        assert lo == 2 * rows // 3 * p and part.spec.capacity == 2 * rows // 3
        assert np.array_equal(part.raw_ids(np.arange(rows // 3)), before[p])
    got = by_id()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@PARTITIONS
def test_crash_recovery_grows_the_table_to_hold_the_replayed_ids(partitions):
    cfg = _config(partitions=partitions)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    assert table_growth.grow_to_hold(tm, {"item": np.arange(1000, 1040)}) is not None
    if partitions == 1:
        assert _rows(tm) == 64  # 40 ids fit under GROW_AT of 64 rows
    for _lo, part in tm.dynamic.tables["item"].held.values() if partitions > 1 else []:
        ids = np.arange(1000, 1040)  # each partition's share fits under GROW_AT of its block
        share = int((partition_of(ids, partitions) == part_index(tm, part)).sum())
        assert share <= 0.75 * part.spec.capacity
    assert table_growth.grow_to_hold(tm, {"item": np.arange(1000, 1040)}) is None


def part_index(tm: TrainModule, part) -> int:  # noqa: ANN001 - a DynamicTable
    """The partition a held DynamicTable is."""
    return next(p for p, (_lo, t) in tm.dynamic.tables["item"].held.items() if t is part)


def test_incremental_checkpoints_through_growth(tmp_path):
    """After a growth the next checkpoint is full (TrainerCheckpoints' hook); the chain's
    newest restores into a module built at the start rows exactly."""
    cfg = _config()
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_max=3, full_every=4)
    rows = CheckpointRows(tm)
    tm.add_table_growth_hook(lambda _shapes: setattr(manager, "chain", None))
    fulls = 0
    for s in range(12):
        _train(tm, fb, [s], items=120)
        changed = rows.take()
        if manager.increment_allowed():
            manager.save(tm.global_step, tm.state_without_tables(), {0: s}, {}, "cfg",
                         rows=changed_rows_part(tm, changed))
        else:
            fulls += 1
            manager.save(tm.global_step, tm.state_dict_for_checkpoint(), {0: s}, {}, "cfg")
    assert len(tm.growth.events) >= 2 and fulls >= 3  # the first, and one per growth
    restored = TrainModule(cfg, fb, device="cpu")
    restored.load_checkpoint_state(read_checkpoint(resolve_checkpoint_path(
        str(tmp_path / "ckpt"))).state)
    want, got = tm.state_dict_for_checkpoint(), restored.state_dict_for_checkpoint()
    for key, t in want["model"].items():
        assert torch.equal(got["model"][key], t), key
    assert tm.dynamic.status() == restored.dynamic.status()


def test_warm_start_from_a_grown_checkpoint():
    cfg = _config()
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    _train(tm, fb, range(4), items=200)
    assert _rows(tm) > 16
    state = tm.state_dict_for_checkpoint()
    warm = TrainModule(cfg, fb, device="cpu")
    warm.load_parameters(state["model"], dynamic_state=state["dynamic_tables"],
                         source_step=state["global_step"])
    assert _rows(warm) == _rows(tm)
    batch = fb.build(_records(64, 77, 200)).batch
    assert np.array_equal(warm.predict(batch), tm.predict(batch))


@contextlib.contextmanager
def _rank_cap() -> Iterator[None]:
    """``CAP`` as the growing tables' cap in a rank process (not monkeypatched there), put
    back when the rank's task ends: a ``RankPool`` rank runs other tasks after it."""
    before = dynamic_table_config.EV_DEFAULT_MAX_CAPACITY
    dynamic_table_config.EV_DEFAULT_MAX_CAPACITY = CAP
    try:
        yield
    finally:
        dynamic_table_config.EV_DEFAULT_MAX_CAPACITY = before


def _growing_rank(rank: int, world: int, steps: list, sparse: str, start: str = "",
                  partitions: int = 1) -> dict:
    """One of ``world`` ranks training ``steps`` (each rank its share of every step) on the
    growing config with its tables split by rows, from the state saved at ``start`` when
    given; rank 0 returns the gathered state."""
    with _rank_cap():
        return _grow_steps(rank, world, steps, sparse, start, partitions)


def _grow_steps(rank: int, world: int, steps: list, sparse: str, start: str,
                partitions: int) -> dict:
    cfg = _config(sparse, partitions=partitions)
    cfg.data_config.batch_size = 32 // world
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu", row_wise_min_rows=8)
    if world > 1:  # the growing table's rows are split between the ranks
        shards = tm.dmp.state_dict()[f"{EBC_PREFIX}item.weight"].local_shards()
        assert [tuple(sh.tensor.shape) for sh in shards] == [(16 // world, 8)]
    if start:  # built at the start rows, then at the rows the state holds
        tm.load_checkpoint_state(torch.load(start, weights_only=False))
    probs, rows = [], []
    for step in steps:
        share = len(step) // world
        probs.append(tm.train_step(fb.build(step[rank * share:(rank + 1) * share]).batch).probs)
        rows.append(_rows(tm))
    state = tm.state_dict_for_checkpoint()  # gathered on rank 0
    return {"probs": np.concatenate(probs), "rows": rows,
            "events": [e.rows for e in tm.growth.events],
            "tables": {k: v.numpy() for k, v in state.get("model", {}).items()
                       if k.startswith(EBC_PREFIX)},
            "sparse": {f"{p}/{k}": v.numpy() for p, st in state.get("sparse_optimizer",
                                                                     {}).items()
                       for k, v in st.items()},
            "status": tm.dynamic.status()}


@pytest.mark.parametrize("sparse, partitions", [
    ("adagrad_optimizer { lr: 0.1 }", 1), ("adam_optimizer { lr: 0.01 }", 1),
    ("adagrad_optimizer { lr: 0.1 }", 2)], ids=["fused", "row_sparse", "split_by_id"])
def test_two_ranks_grow_as_one_process(ranks, sparse, partitions):
    """Two ranks, the growing table split by rows between them: they double at the steps one
    process does, each rank's rows move to the rank that holds them after the growth, and
    predictions, tables, optimizer state and index equal one process's on the same records.
    Split by id each rank holds one partition (its index and its block of rows): the ranks
    agree on each growth and every partition's rows move within its rank."""
    steps = [_records(32, s, 200) for s in range(12)]
    one = _growing_rank(0, 1, steps, sparse, "", partitions)
    assert one["events"] == [{"item": (16, 32)}, {"item": (32, 64)}, {"item": (64, CAP)}]
    got = ranks.run(_growing_rank, 2, steps, sparse, "", partitions)
    assert got[0]["events"] == got[1]["events"] == one["events"]
    assert got[0]["rows"] == one["rows"]
    if partitions == 1:
        assert got[0]["status"] == one["status"]
    else:  # split by id: each rank's status is its partition's
        for name, st in one["status"].items():
            for key in ("capacity", "live_rows", "admitted", "evicted"):
                assert got[0]["status"][name][key] + got[1]["status"][name][key] == st[key]
    ranks_probs = np.concatenate([np.concatenate([got[r]["probs"][k * 16:(k + 1) * 16]
                                                  for r in range(2)]) for k in range(12)])
    np.testing.assert_allclose(ranks_probs, one["probs"], atol=1e-5, rtol=0)
    assert set(got[0]["tables"]) == set(one["tables"])
    for name, t in one["tables"].items():
        np.testing.assert_allclose(got[0]["tables"][name], t, atol=1e-5, rtol=0, err_msg=name)
    for name, t in one["sparse"].items():
        np.testing.assert_allclose(got[0]["sparse"][name], t, atol=1e-5, rtol=0, err_msg=name)


def test_a_grown_checkpoint_restores_into_two_ranks(ranks, tmp_path):
    """A checkpoint of a table grown in one process restores into two ranks (they build it
    at its rows) and they continue as one process does."""
    cfg = _config()
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    _train(tm, fb, range(6), items=200)
    assert _rows(tm) > 16
    start = str(tmp_path / "grown.pt")
    torch.save(tm.state_dict_for_checkpoint(), start)
    steps = [_records(32, s, 200) for s in range(6, 10)]
    one = _growing_rank(0, 1, steps, "adagrad_optimizer { lr: 0.1 }", start)
    got = ranks.run(_growing_rank, 2, steps, "adagrad_optimizer { lr: 0.1 }", start)
    assert got[0]["rows"] == one["rows"] and got[0]["status"] == one["status"]
    for name, t in one["tables"].items():
        np.testing.assert_allclose(got[0]["tables"][name], t, atol=1e-5, rtol=0, err_msg=name)


def test_a_table_grown_split_by_id_restores_into_another_partition_count():
    """A checkpoint of a table grown in 2 partitions restores (re-split) into one partition,
    predicting as before, and into 4, at the rows it holds; 3 do not divide its rows."""
    cfg = _config(partitions=2)
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu")
    _train(tm, fb, range(4), items=40)
    assert _rows(tm) > 16 and tm.dynamic.tables["item"].live < 0.75 * _rows(tm)
    state = tm.state_dict_for_checkpoint()
    batch = fb.build(_records(64, 88, 40)).batch
    for partitions in (1, 4):
        other_cfg = _config(partitions=partitions)
        other = TrainModule(other_cfg, FeatureBuilder(other_cfg), device="cpu")
        other.load_checkpoint_state(state)
        assert _rows(other) == _rows(tm)  # every id kept, each with its row's values
        assert other.dynamic.tables["item"].live == tm.dynamic.tables["item"].live
        if partitions == 1:  # (4 partitions of the fixed 60-row table drop a few ids)
            np.testing.assert_allclose(other.predict(batch), tm.predict(batch), atol=1e-6)
    three = _config(partitions=3)
    with pytest.raises(ValueError, match="cannot split"):
        TrainModule(three, FeatureBuilder(three), device="cpu").load_checkpoint_state(state)


def _recovering_rank(rank: int, world: int, partitions: int) -> dict:
    """One of ``world`` ranks training two steps, then growing to hold 40 replayed ids
    (crash recovery's ``grow_to_hold``); rank 0 returns the gathered state."""
    with _rank_cap():
        return _recover_steps(rank, world, partitions)


def _recover_steps(rank: int, world: int, partitions: int) -> dict:
    cfg = _config(partitions=partitions)
    cfg.data_config.batch_size = 32 // world
    fb = FeatureBuilder(cfg)
    tm = TrainModule(cfg, fb, device="cpu", row_wise_min_rows=8)
    for s in range(2):
        step = _records(32, s, 40)
        share = len(step) // world
        tm.train_step(fb.build(step[rank * share:(rank + 1) * share]).batch)
    event = table_growth.grow_to_hold(tm, {"item": np.arange(1000, 1040)})
    state = tm.state_dict_for_checkpoint()  # gathered on rank 0
    return {"grown": event.rows if event is not None else None, "rows": _rows(tm),
            "tables": {k: v.numpy() for k, v in state.get("model", {}).items()
                       if k.startswith(EBC_PREFIX)}}


@PARTITIONS
def test_two_ranks_grow_to_hold_replayed_ids_as_one_process(ranks, partitions):
    """Crash recovery's growth with two ranks (the ids agreed, the rows moved across or
    within the ranks) ends at one process's rows and tables."""
    one = _recovering_rank(0, 1, partitions)
    assert one["grown"] is not None and one["rows"] > 16
    got = ranks.run(_recovering_rank, 2, partitions)
    assert got[0]["grown"] == got[1]["grown"] == one["grown"]
    assert got[0]["rows"] == one["rows"]
    for name, t in one["tables"].items():
        np.testing.assert_allclose(got[0]["tables"][name], t, atol=1e-5, rtol=0, err_msg=name)
