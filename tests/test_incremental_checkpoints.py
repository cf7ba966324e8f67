"""Incremental checkpoints (``odl.checkpoint.checkpoint_chain``): a chain reads as a full one.

* A model with fixed and dynamic tables (evictions and expiry included) checkpointed every
  few steps as a full checkpoint and its increments: the chain's newest checkpoint reads,
  restores and exports bitwise as a full checkpoint of the same state does.
* Damaged chains: a missing, damaged or replaced link makes its increments unusable (the
  error names the link) and a restore falls back to the newest checkpoint whose chain is
  whole; retention keeps the links a kept checkpoint needs; on OSS the same.
* kill -9 (a real SIGKILL) while an increment's rows are being written leaves the chain up
  to its parent usable.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.checkpoint import checkpoint_chain
from odl.checkpoint.checkpoint_manager import (
    MANIFEST_FILE,
    CheckpointError,
    CheckpointManager,
    list_checkpoints,
    read_checkpoint,
    resolve_checkpoint_path,
    write_full_copy,
)
from odl.checkpoint.table_parts import TableBlocks
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.models.dynamic.disk_rows import CHANGES_FORMAT as DISK_CHANGES_FORMAT
from odl.models.dynamic.state_changes import CHANGES_FORMAT
from odl.storage import file_store
from odl.train.checkpoint_rows import CheckpointRows
from odl.train.module_state import changed_rows_part
from odl.train.train_module import TrainModule
from tests.harness import assert_same, make_half_dynamic, write_config

# small capacity and a short life: rows are evicted for admission and expire untouched
DYNAMIC = "ev_params { filter_freq: 1 max_capacity: 120 steps_to_live: 6 }"
# PaddleRec's form: show / click scores that decay (all rows at once) and a shrink by score
SCORED = ("ctr_accessor_param { embedx_threshold: 0 delete_threshold: 0.05 capacity: 400 "
          "shrink_interval_steps: 4 show_click_decay_rate: 0.5 base_threshold: 0 "
          "delta_threshold: 0 }")
TABLE = "ebc.embedding_bags.t.weight"


# TorchEasyRec's partial row-wise LAMB: row-sparse tables with a state of one column per row
ROW_WISE_STATE_TABLES = (
    "sparse_optimizer { partial_rowwise_lamb_optimizer { lr: 0.05 } constant_learning_rate {} } "
    "dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }")


def _module(tmp_path, dynamic: str = DYNAMIC, optimizer: str = "", partitions: int = 1,
            ram_rows: int = 0):
    cfg = write_config(tmp_path, "127.0.0.1:1", "t", buckets=400,
                       sparse_fields=tuple(f"C{i}" for i in range(1, 7)))
    assert make_half_dynamic(cfg, dynamic)
    config = load_pipeline_config(cfg)
    if optimizer:
        config.train_config.ClearField("optimizer_config")
        text_format.Merge(optimizer, config.train_config)
    config.train_config.dynamic_index_partitions = partitions
    if ram_rows:  # a disk tier (its files under the test's directory)
        config.train_config.disk_tier.dir = str(tmp_path / f"tier-{os.getpid()}-{id(cfg)}")
        config.train_config.disk_tier.ram_rows = ram_rows
    fb = FeatureBuilder(config)
    return config, fb, TrainModule(config, fb, device="cpu")


def _checkpoint(manager: CheckpointManager, rows: CheckpointRows, tm: TrainModule) -> str:
    """What ``TrainerCheckpoints.take`` does for one process, without a trainer."""
    changed = rows.take()
    step = tm.global_step
    if manager.increment_allowed():
        return manager.save(step, tm.state_without_tables(dynamic_state=rows.dynamic_changes),
                            {0: step}, {}, "cfg", rows=changed_rows_part(tm, changed))
    return manager.save(step, tm.state_dict_for_checkpoint(), {0: step}, {}, "cfg")


@pytest.mark.parametrize("dynamic, optimizer, partitions, ram_rows", [
    (DYNAMIC, "", 1, 0), (SCORED, "", 1, 0), (DYNAMIC, ROW_WISE_STATE_TABLES, 1, 0),
    (SCORED, "", 2, 0), (DYNAMIC, "", 1, 24)],
    ids=["ev_params", "ctr_accessor", "row_sparse_row_wise_state", "split_by_id", "disk_tier"])
def test_chain_reads_restores_and_exports_as_the_full_checkpoint(
        tmp_path, dynamic, optimizer, partitions, ram_rows) -> None:
    config, fb, tm = _module(tmp_path, dynamic, optimizer, partitions, ram_rows)
    assert (tm.row_sparse is not None) == bool(optimizer)
    chain_dir, full_dir = str(tmp_path / "chain"), str(tmp_path / "full")
    manager = CheckpointManager(chain_dir, keep_max=2, full_every=4)
    rows = CheckpointRows(tm)
    stream = SyntheticCtrStream(seed=5)
    for i in range(22):  # 6 hours of stream time a step: PaddleRec's scores decay
        records = stream.next_batch(64, now=1.79e9 + i * 21600.0).encode("csv")
        tm.train_step(fb.build(records).batch)
        if i % 2 == 1:
            _checkpoint(manager, rows, tm)
        elif i in (8, 14):  # a checkpoint that failed: its rows are put back
            rows.put_back(rows.take())
    tm.train_step(fb.build(stream.next_batch(64, now=1.79e9 + 22 * 21600.0).encode("csv")).batch)
    rows.put_back(rows.take())  # failed: the newest increment holds what it took
    newest = _checkpoint(manager, rows, tm)
    # the increments hold the dynamic tables' changed rows, not their whole state
    changes = torch.load(os.path.join(newest, "model.pt"), weights_only=True)["dynamic_tables"]
    assert changes["format"] == CHANGES_FORMAT
    by_part = changes["parts"].values() if partitions > 1 else [changes]
    assert len(by_part) == partitions
    assert all(t["rows"].shape[0] < t["last_step"].shape[0] or t["rows"].shape[0] < 120
               for part in by_part for t in part["tables"].values())
    state = tm.dynamic.state_dict()
    evicted = sum(s["counters"].get("evicted", 0) + s["counters"].get("expired", 0)
                  + s["counters"].get("to_disk", 0)
                  for part in (state["parts"].values() if partitions > 1 else [state])
                  for s in part["tables"].values())
    assert evicted > 0  # rows were reset without a lookup (or moved to disk)
    full = CheckpointManager(full_dir, full_every=1).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: tm.global_step}, {}, "cfg")

    chain = read_checkpoint(resolve_checkpoint_path(chain_dir))
    assert chain.path == newest and len(chain.chain) >= 3  # a full one and increments
    assert chain.manifest["increment"]["base"] == os.path.basename(chain.chain[0])
    # retention: 2 kept, plus the links they read from
    assert set(chain.chain) <= set(list_checkpoints(chain_dir))
    whole = read_checkpoint(full)
    assert_same(chain.state, whole.state)
    mapped = read_checkpoint(newest, whole_tables=False)
    blocks, reference = TableBlocks(mapped.state), TableBlocks(read_checkpoint(full).state)
    for name in whole.state["model"]:
        if name.startswith("ebc."):
            assert torch.equal(blocks.blocks(name)[0][1], reference.blocks(name)[0][1]), name

    if ram_rows:  # the increments hold the tier's changed slots, not all its rows
        tiers = [t["tier"]["disk"] for t in changes["tables"].values()]
        assert all(d["format"] == DISK_CHANGES_FORMAT for d in tiers)
        on_disk = [len(s["tier"]["disk"]["ids"]) for s in state["tables"].values()]
        assert sum(len(d["ids"]) + len(d["freed"]) for d in tiers) < sum(on_disk)
        config.train_config.disk_tier.dir += "-restored"
    restored = TrainModule(config, fb, device="cpu")
    restored.load_checkpoint_state(read_checkpoint(newest).state)
    assert_same(restored.state_dict_for_checkpoint(), tm.state_dict_for_checkpoint())

    a = export_checkpoint(config, newest, str(tmp_path / "export_chain"),
                          warn_without_topic=False)
    b = export_checkpoint(config, full, str(tmp_path / "export_full"),
                          warn_without_topic=False)
    files = sorted(os.path.relpath(p, a.path) for p in glob.glob(f"{a.path}/embeddings/*/*"))
    assert files
    for rel in files:
        assert np.array_equal(np.load(os.path.join(a.path, rel)),
                              np.load(os.path.join(b.path, rel))), rel


def _tables(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(50, 4, generator=g), torch.rand(50, generator=g)


def _save_chain(manager: CheckpointManager, steps: range) -> dict[int, tuple]:
    """Saves steps of a table whose rows 2*step, 2*step+1 change per step; returns each
    step's expected (weights, accumulators)."""
    w, acc = _tables(0)
    expected = {}
    for step in steps:
        ids = torch.tensor([2 * step, 2 * step + 1])
        w[ids], acc[ids] = float(step), float(step)
        dense = {"dense.b": torch.full((2,), float(step))}
        if manager.increment_allowed():
            pieces = {("model", TABLE, ""): ((50, 4), ids, w[ids].clone()),
                      ("sparse", TABLE, "m"): ((50,), ids, acc[ids].clone())}
            manager.save(step, {"global_step": step, "model": dense, "sparse_optimizer": {}},
                         {0: step}, {}, "cfg",
                         rows=checkpoint_chain.rows_document(pieces, 0, 1))
        else:
            manager.save(step, {"global_step": step, "model": {TABLE: w.clone(), **dense},
                                "sparse_optimizer": {TABLE: {"m": acc.clone()}}},
                         {0: step}, {}, "cfg")
        expected[step] = (w.clone(), acc.clone())
    return expected


def _assert_step(path: str, step: int, expected: dict[int, tuple]) -> None:
    ckpt = read_checkpoint(path)
    assert ckpt.global_step == step
    assert torch.equal(ckpt.state["model"][TABLE], expected[step][0])
    assert torch.equal(ckpt.state["sparse_optimizer"][TABLE]["m"], expected[step][1])
    assert torch.equal(ckpt.state["model"]["dense.b"], torch.full((2,), float(step)))


def test_a_broken_chain_is_refused_by_link_and_restore_falls_back(tmp_path) -> None:
    model_dir = str(tmp_path / "m")
    manager = CheckpointManager(model_dir, keep_max=0, full_every=4)
    expected = _save_chain(manager, range(1, 8))  # full 1, increments 2-4, full 5, 6-7
    path = {s: os.path.join(model_dir, f"model.ckpt-{s}") for s in expected}
    manifest = checkpoint_chain.manifest_of(path[4])[0]
    assert manifest["format"] == 2 and manifest["increment"]["depth"] == 3
    assert checkpoint_chain.manifest_of(path[5])[0]["format"] == 1
    for s in expected:
        _assert_step(path[s], s, expected)
    # a self-contained copy of an increment (a file stream's pass copy) is written full
    copy = write_full_copy(path[4], str(tmp_path / "day" / "1"))
    assert checkpoint_chain.manifest_of(copy)[0]["format"] == 1
    assert read_checkpoint(copy).chain == (copy,)
    _assert_step(copy, 4, expected)

    shutil.rmtree(path[6])  # a lost link: 7 is unusable, 5 is the newest whole chain
    with pytest.raises(CheckpointError, match="model.ckpt-6"):
        resolve_checkpoint_path(path[7])
    assert manager.latest() == path[5] == resolve_checkpoint_path(model_dir)

    rows = glob.glob(os.path.join(path[3], "rows.rank-*"))[0]
    with open(rows, "r+b") as f:  # a damaged link
        f.truncate(50)
    with pytest.raises(CheckpointError, match="model.ckpt-3"):
        resolve_checkpoint_path(path[4])

    # a parent replaced by another checkpoint of its step: refused by manifest digest
    CheckpointManager(model_dir, keep_max=0).save(
        1, {"global_step": 1, "model": {TABLE: torch.zeros(50, 4), "dense.b": torch.ones(2)},
            "sparse_optimizer": {TABLE: {"m": torch.zeros(50)}}}, {0: 1}, {}, "cfg",
        overwrite=True)
    with pytest.raises(CheckpointError, match="another one"):
        resolve_checkpoint_path(path[2])


def test_retention_keeps_the_links_a_kept_checkpoint_needs(tmp_path) -> None:
    model_dir = str(tmp_path / "m")
    expected = _save_chain(CheckpointManager(model_dir, keep_max=2, full_every=5),
                           range(1, 10))
    steps = [int(p.rsplit("-", 1)[1]) for p in list_checkpoints(model_dir)]
    assert steps == [6, 7, 8, 9]  # 8 and 9 kept, with their base 6 and the link 7
    _assert_step(resolve_checkpoint_path(model_dir), 9, expected)


def test_chain_on_oss(oss) -> None:
    model_dir = "oss://bkt/odl/inc"
    expected = _save_chain(CheckpointManager(model_dir, keep_max=1, full_every=3),
                           range(1, 6))
    assert [p.rsplit("-", 1)[1] for p in list_checkpoints(model_dir)] == ["4", "5"]
    newest = resolve_checkpoint_path(model_dir)
    assert newest == f"{model_dir}/model.ckpt-5"
    _assert_step(newest, 5, expected)
    file_store.remove(f"{model_dir}/model.ckpt-4/DONE")
    with pytest.raises(CheckpointError, match="model.ckpt-4"):
        resolve_checkpoint_path(newest)


_WRITER = """
import sys, torch
from odl.checkpoint import checkpoint_chain
from odl.checkpoint.checkpoint_manager import CheckpointManager
rows = 1 << 20
m = CheckpointManager(sys.argv[1], keep_max=0, full_every=1000)
w = torch.zeros(rows, 16)
m.save(0, {"global_step": 0, "model": {"t": w}, "sparse_optimizer": {}}, {}, {}, "cfg")
for step in range(1, 1000):
    ids = torch.arange(step % 2, rows, 2)
    w[ids] = float(step)
    m.save(step, {"global_step": step, "model": {}, "sparse_optimizer": {}}, {}, {}, "cfg",
           rows=checkpoint_chain.rows_document({("model", "t", ""): ((rows, 16), ids, w[ids])},
                                               0, 1))
"""


def test_sigkill_during_an_increment_write_leaves_the_chain_usable(tmp_path) -> None:
    model_dir = str(tmp_path / "m")
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, model_dir])
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # kill inside the second increment's row file write
            if glob.glob(os.path.join(model_dir, ".model.ckpt-2.tmp-*", "rows.rank-*")):
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert glob.glob(os.path.join(model_dir, ".model.ckpt-2.tmp-*")), "not killed mid-write"
    manager = CheckpointManager(model_dir, keep_max=0, full_every=1000)  # removes the rest
    assert not glob.glob(os.path.join(model_dir, ".model.ckpt-*"))
    newest = manager.latest()
    assert newest is not None and newest.endswith("model.ckpt-1")
    table = read_checkpoint(newest).state["model"]["t"]
    assert float(table[1::2].min()) == float(table[1::2].max()) == 1.0
    assert float(table[0::2].abs().max()) == 0.0
    assert os.path.exists(os.path.join(newest, MANIFEST_FILE))


def test_a_dynamic_tables_changes_rebuild_its_state_when_its_free_rows_sink_and_rise() -> None:
    """``state_changes``: the parent's full state plus an increment's changes is the table's
    state, when between them the free-row stack sank below the parent's (admissions took
    rows the parent had free) and rose again (evictions gave rows back), so only its bottom
    part is the parent's."""
    from odl.config.dynamic_table_config import DynamicTableSpec
    from odl.models.dynamic.dynamic_table import DynamicTable, state_tensors
    from odl.models.dynamic.state_changes import (
        apply_table_changes,
        kept_free_rows,
        table_changes,
    )

    table = DynamicTable("t", DynamicTableSpec(form="zch", capacity=64, policy="lru"), seed=1)
    table.admit(np.arange(20, dtype=np.int64), np.zeros(20), step=1, now=1.0)
    parent = state_tensors(table.state_dict())
    parent_free = table.index.free_stack().copy()
    parent_ids = table.index.row_ids.copy()
    parent_last = table.last_step.copy()
    table.admit(np.arange(100, 130, dtype=np.int64), np.zeros(30), step=2, now=2.0)  # sinks
    table.forget(np.arange(5, 15, dtype=np.int64))  # rises: 10 rows back on top
    table.admit(np.arange(200, 203, dtype=np.int64), np.zeros(3), step=3, now=3.0)
    free_now = table.index.free_stack()
    kept = kept_free_rows(parent_free, free_now)
    assert kept < parent_free.shape[0] and kept < free_now.shape[0]  # the stack moved
    changed = np.flatnonzero((table.index.row_ids != parent_ids) | (table.last_step != parent_last))
    got = apply_table_changes(parent, table_changes(table, changed, kept, scores_whole=False))
    assert_same(got, state_tensors(table.state_dict()))
    # keeping more of the parent's stack than it shares is wrong, and shows
    wrong = apply_table_changes(parent, table_changes(table, changed, kept + 1, False))
    assert not torch.equal(wrong["index"]["free"], torch.from_numpy(free_now.copy()))
