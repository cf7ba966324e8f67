"""Dynamic tables split by id (``train_config.dynamic_index_partitions``).

The contract (``odl.models.dynamic.partitions``): an id lives in the partition its hash
names, its row in that partition's block of the table (the block TorchRec's row-wise
sharding gives the rank of the same number); two ranks, each holding one partition of the
index, train as one process holding both (predictions, tables, rows of every id), and their
checkpoints move between the two; a checkpoint of another number of partitions is re-split
(``odl.models.dynamic.resplit``): each id keeps its row's values in its new partition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.checkpoint.checkpoint_manager import CheckpointManager, list_checkpoints, read_checkpoint
from odl.config.config_error import ConfigError
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.models.dynamic.partitions import partition_of, partition_spans
from odl.train.checkpoint_rows import CheckpointRows
from odl.train.rank_checkpoint import save_across_ranks
from odl.train.table_shards import EBC_PREFIX
from odl.train.train_module import TrainModule
from serving_plugin.serving_model import ServingModel
from tests.harness import assert_same, assert_tables_close
from tests.test_distributed_dynamic import GLOBAL, ROW_WISE_MIN_ROWS, _steps
from tests.test_dynamic_tables import _config, _records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _split_config(model_dir: str, batch: int, partitions: int = 2):
    config = _config(model_dir)
    config.data_config.batch_size = batch
    config.train_config.dynamic_index_partitions = partitions
    return config


def _ids(tm: TrainModule, fb: FeatureBuilder, records: list[bytes]) -> dict[str, np.ndarray]:
    """Each dynamic table's raw ids in the records (unique)."""
    sparse = fb.build(records).batch.sparse.to_dict()
    return {name: np.unique(np.concatenate([sparse[f].values().numpy()
                                            for f in tm.dynamic._table_features[name]]))
            for name in tm.dynamic.tables}


def _rows(tm: TrainModule, ids: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """The row each id holds in ``tm``'s index (-1: none, or a partition held elsewhere)."""
    return {name: tm.dynamic.tables[name].lookup(v).tolist() for name, v in ids.items()}


def _one_process(tmp_path, records: list[bytes], partitions: int = 2) -> tuple:
    config = _split_config(str(tmp_path / "one"), GLOBAL, partitions)
    fb = FeatureBuilder(config)
    return config, fb, TrainModule(config, fb, device="cpu")


def _rank_main(rank: int, world: int, model_dir: str, schedule: list, start: str,
               records: list[bytes], partitions: int) -> tuple:
    config = _split_config(model_dir, GLOBAL // world, partitions)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    tm.load_checkpoint_state(torch.load(start, weights_only=False))
    probs = [tm.train_step(fb.build(step[rank]).batch if step[rank] else tm.empty_batch()).probs
             for step in schedule]
    ids = _ids(tm, fb, records)
    predicted = tm.predict(fb.build(records[:GLOBAL]).batch if rank == 0 else tm.empty_batch())
    state = tm.state_dict_for_checkpoint()  # gathered on rank 0
    tables = {k: v.numpy() for k, v in state.get("model", {}).items()
              if k.startswith(EBC_PREFIX)}
    save_across_ranks(CheckpointManager(model_dir), tm, {rank: len(schedule)}, {}, "", "gen0")
    live = {n: t.live_rows() for n, t in tm.dynamic.tables.items()}
    return (np.concatenate(probs), predicted, tables, _rows(tm, ids), live,
            tm.dynamic_status())


@pytest.mark.parametrize("partitions", [2, 4])
def test_two_ranks_holding_their_partitions_train_as_one_process_holding_all(ranks, tmp_path,
                                                                            partitions):
    """One process with 2 (or 4) partitions trains the first steps and saves; two ranks
    restore that state, each holding its half of the partitions, and train on. Against the
    one process going on: the same predictions, tables and rows of every id (each rank knows
    exactly the ids of its own partitions, their rows in its own block of the table); its
    share of the index and counters is about half; the ranks' checkpoint restores into one
    process with the same partitions, equal to the process that never stopped, and an
    export of it predicts as that process in ``odl-serve``'s model."""
    records = _records(24 * GLOBAL, seed=4)
    first, rest = records[:8 * GLOBAL], records[8 * GLOBAL:]
    config, fb, one = _one_process(tmp_path, records, partitions)
    for k in range(0, len(first), GLOBAL):
        one.train_step(fb.build(first[k:k + GLOBAL]).batch)
    start = str(tmp_path / "start.pt")
    torch.save(one.state_dict_for_checkpoint(), start)
    evicted_before = {n: t.counters.evicted for n, t in one.dynamic.tables.items()}
    probs = np.concatenate([one.train_step(fb.build(rest[k:k + GLOBAL]).batch).probs
                            for k in range(0, len(rest), GLOBAL)])
    assert all(t.counters.evicted > evicted_before[n]  # both tables evict on
               for n, t in one.dynamic.tables.items())
    two_dir = str(tmp_path / "two")
    got = ranks.run(_rank_main, 2, two_dir, _steps(rest, 2), start, records, partitions)
    share = GLOBAL // 2
    merged = np.concatenate([np.concatenate([got[r][0][b * share:(b + 1) * share]
                                             for r in range(2)])
                             for b in range(len(rest) // GLOBAL)])
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    np.testing.assert_allclose(got[0][1], one.predict(fb.build(records[:GLOBAL]).batch),
                               atol=5e-5, rtol=0)
    ids = _ids(one, fb, records)
    want = _rows(one, ids)
    one_status = one.dynamic_status()
    share = partitions // 2
    for name, table_ids in ids.items():
        owner = partition_of(table_ids, partitions) // share  # the rank holding each id
        spans = partition_spans(one.dynamic.tables[name].spec.capacity, partitions)
        for r in range(2):
            rows = np.asarray(got[r][3][name])
            expect = np.where(owner == r, want[name], -1)
            assert rows.tolist() == expect.tolist(), (name, r)
            lo, hi = spans[r * share][0], spans[(r + 1) * share - 1][1]
            live = got[r][4][name]
            assert len(live) and live.min() >= lo and live.max() < hi  # its own block
            assert got[r][5][name]["map_bytes"] < 0.6 * one_status[name]["map_bytes"]
    assert_tables_close(got[0][2], one.state_dict_for_checkpoint(), atol=5e-5)
    # the ranks' checkpoint (each partition in its rank's part) into one process, and into
    # serving through an export: the predictions of the process that never stopped
    ckpt = read_checkpoint(list_checkpoints(two_dir)[-1])
    restored = TrainModule(_split_config(str(tmp_path / "r"), GLOBAL, partitions), fb,
                           device="cpu")
    restored.load_checkpoint_state(ckpt.state)
    assert _rows(restored, ids) == want
    probe = fb.build(records[:4 * GLOBAL]).batch
    expected = one.predict(probe)
    np.testing.assert_allclose(restored.predict(probe), expected, atol=5e-5, rtol=0)
    exported = export_checkpoint(config, ckpt.path, str(tmp_path / "export"))
    with open(os.path.join(exported.embeddings_dir, "MANIFEST.json")) as f:
        manifest = json.load(f)["tables"]
    assert len(manifest["user"]["parts"]) == 2  # one per rank's block, written one by one
    serving = ServingModel.load(str(tmp_path / "export"))
    np.testing.assert_allclose(serving.predict_batch(probe), expected, atol=5e-5, rtol=0)
    more = records[:2 * GLOBAL]
    for k in range(0, len(more), GLOBAL):
        np.testing.assert_allclose(restored.train_step(fb.build(more[k:k + GLOBAL]).batch).probs,
                                   one.train_step(fb.build(more[k:k + GLOBAL]).batch).probs,
                                   atol=5e-5, rtol=0)


def _saved_last_steps(saved: dict, name: str) -> dict[int, int]:
    """Id -> last step trained, from a checkpoint's dynamic-table state."""
    p = int(saved.get("partitions", 1))
    parts = {0: saved} if p == 1 else saved["parts"]
    out = {}
    for part in parts.values():
        st = part["tables"][name]
        ids = st["index"]["row_ids"].numpy()
        live = ids >= 0
        out.update(zip(ids[live].tolist(), st["last_step"].numpy()[live].tolist(),
                       strict=True))
    return out


def _dynamic_params(tm: TrainModule, name: str) -> list[str]:
    """The parameter names of a dynamic table's torch tables (deep and wide)."""
    return [f"{EBC_PREFIX}{t}.weight" for t in tm.dynamic_torch_tables[name]]


@pytest.mark.parametrize("old,new", [(2, 1), (1, 4), (2, 4)])
def test_a_checkpoint_re_splits_into_another_number_of_partitions(tmp_path, old, new):
    """A checkpoint of one number of partitions restores into a model of another: every id
    lives in its new partition's block with its row's weights and optimizer state; an id
    its new partition has no room for is one of that partition's least recently used and
    becomes a delete for the publisher; free rows are fresh; the lifetime counts add up.
    Into one partition nothing is dropped and the model predicts as before."""
    records = _records(12 * GLOBAL, seed=2)
    _c, fb, a = _one_process(tmp_path, records, old)
    for k in range(0, 8 * GLOBAL, GLOBAL):
        a.train_step(fb.build(records[k:k + GLOBAL]).batch)
    state = a.state_dict_for_checkpoint()
    _c, _f, b = _one_process(tmp_path / "b", records, new)
    b.dynamic.add_delete_consumer("publisher")
    b.load_checkpoint_state(state)
    got = b.state_dict_for_checkpoint()
    deleted = b.dynamic.take_deleted("publisher")
    dropped_any = False
    for name, t in a.dynamic.tables.items():
        cap = t.spec.capacity
        old_rows = t.live_rows()
        ids = t.raw_ids(old_rows)
        new_rows = b.dynamic.tables[name].lookup(ids)
        kept = new_rows >= 0
        spans = partition_spans(cap, new)
        for q, (lo, hi) in enumerate(spans):  # each id in its new partition's block
            mine = kept & (partition_of(ids, new) == q)
            assert ((new_rows[mine] >= lo) & (new_rows[mine] < hi)).all()
        for pname in _dynamic_params(a, name):
            np.testing.assert_array_equal(got["model"][pname][new_rows[kept]].numpy(),
                                          state["model"][pname][old_rows[kept]].numpy())
            for key, v in state["sparse_optimizer"][pname].items():
                np.testing.assert_array_equal(
                    got["sparse_optimizer"][pname][key][new_rows[kept]].numpy(),
                    v[old_rows[kept]].numpy())
                free = np.setdiff1d(np.arange(cap), new_rows[kept])
                assert float(got["sparse_optimizer"][pname][key][free].abs().sum()) == 0.0
        dropped = np.sort(ids[~kept])
        assert deleted.get(name, np.empty(0)).tolist() == dropped.tolist()
        dropped_any |= bool(dropped.shape[0])
        last = _saved_last_steps(state["dynamic_tables"], name)
        for q in range(new):  # the least recently used of its partition were dropped
            of_q = partition_of(ids, new) == q
            if (of_q & ~kept).any():
                assert (max(last[i] for i in ids[of_q & ~kept])
                        <= min(last[i] for i in ids[of_q & kept]))
                assert (of_q & kept).sum() == spans[q][1] - spans[q][0]  # it was full
        before, after = t.counters, b.dynamic.tables[name].counters
        assert (after.admitted, after.rejected) == (before.admitted, before.rejected)
        assert after.evicted == before.evicted + dropped.shape[0]
    assert dropped_any == (new > 1)  # the full tables do not split evenly into 4
    probe = fb.build(records[:4 * GLOBAL]).batch
    if new == 1:
        np.testing.assert_allclose(b.predict(probe), a.predict(probe), atol=1e-6, rtol=0)
    for k in range(8 * GLOBAL, 12 * GLOBAL, GLOBAL):  # and it trains on
        assert np.isfinite(b.train_step(fb.build(records[k:k + GLOBAL]).batch).probs).all()


def test_admission_counts_survive_a_re_split(tmp_path):
    """An item id seen once (``filter_freq: 2``) before the checkpoint is admitted at its
    next sighting after a re-split into two partitions, as without the re-split; a model
    that never saw it does not admit it."""
    records = _records(GLOBAL, seed=9)
    first = records[:16]
    _c, fb, a = _one_process(tmp_path, records, 1)
    a.train_step(fb.build(first).batch)
    items = fb.build(first).batch.sparse.to_dict()["item"].values().numpy()
    seen, counts = np.unique(items, return_counts=True)
    once = seen[(counts == 1) & (a.dynamic.tables["item"].lookup(seen) < 0)]
    assert once.shape[0] >= 3
    state = a.state_dict_for_checkpoint()
    _c, _f, b = _one_process(tmp_path / "b", records, 2)
    b.load_checkpoint_state(state)
    _c, _f, fresh = _one_process(tmp_path / "c", records, 2)
    for m in (a, b, fresh):
        m.train_step(fb.build(first).batch)
    assert (a.dynamic.tables["item"].lookup(once) >= 0).all()
    assert (b.dynamic.tables["item"].lookup(once) >= 0).all()
    assert (fresh.dynamic.tables["item"].lookup(once) < 0).all()


@pytest.mark.parametrize("old,new", [(2, 1), (2, 2)])
def test_a_warm_start_moves_each_id_with_its_row(tmp_path, old, new):
    """``fine_tune_checkpoint``'s parameters with its dynamic tables split by id into 2
    partitions warm-start a model of 1 or 2: every id keeps its row's weights (the model
    predicts as the source), no optimizer state comes along."""
    records = _records(8 * GLOBAL, seed=5)
    _c, fb, a = _one_process(tmp_path, records, old)
    for k in range(0, len(records), GLOBAL):
        a.train_step(fb.build(records[k:k + GLOBAL]).batch)
    state = a.state_dict_for_checkpoint()
    _c, _f, b = _one_process(tmp_path / "b", records, new)
    report = b.load_parameters(state["model"], None, state["dynamic_tables"],
                               state["global_step"])
    assert not report.missing and not report.unused
    probe = fb.build(records[:4 * GLOBAL]).batch
    np.testing.assert_allclose(b.predict(probe), a.predict(probe), atol=1e-6, rtol=0)
    for name, t in a.dynamic.tables.items():
        ids = t.raw_ids(t.live_rows())
        assert (b.dynamic.tables[name].lookup(ids) >= 0).all()
    assert b.global_step == 0
    sparse = b.state_dict_for_checkpoint()["sparse_optimizer"]
    assert all(float(v.abs().sum()) == 0.0 for st in sparse.values() for v in st.values())


def _resplit_rank(rank: int, world: int, model_dir: str, schedule: list, start: str,
                  probe: list[bytes]) -> tuple:
    """Restores a one-partition state into 2 partitions over the ranks, trains, saves; then
    restores that checkpoint (its parts mapped) into 4 partitions."""
    config = _split_config(model_dir, GLOBAL // world, 2)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    tm.load_checkpoint_state(torch.load(start, weights_only=False))
    probs = [tm.train_step(fb.build(step[rank]).batch).probs for step in schedule]
    save_across_ranks(CheckpointManager(model_dir), tm, {rank: len(schedule)}, {}, "", "gen0")
    config4 = _split_config(model_dir, GLOBAL // world, 4)
    four = TrainModule(config4, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    four.load_checkpoint_state(
        read_checkpoint(list_checkpoints(model_dir)[-1], whole_tables=False).state)
    predicted = four.predict(fb.build(probe).batch if rank == 0 else four.empty_batch())
    tables = {k: v.numpy() for k, v in four.state_dict_for_checkpoint().get("model", {}).items()
              if k.startswith(EBC_PREFIX)}
    return np.concatenate(probs), predicted, tables


def test_ranks_re_split_a_checkpoint_as_one_process_does(ranks, tmp_path):
    """Two ranks restoring a one-partition checkpoint into two partitions (one each) train
    as one process re-splitting it alike; their checkpoint, read a block at a time, re-splits
    into four partitions over the ranks as one process re-splits it whole."""
    records = _records(12 * GLOBAL, seed=7)
    first, rest = records[:8 * GLOBAL], records[8 * GLOBAL:]
    _c, fb, a = _one_process(tmp_path, records, 1)
    for k in range(0, len(first), GLOBAL):
        a.train_step(fb.build(first[k:k + GLOBAL]).batch)
    start = str(tmp_path / "start.pt")
    torch.save(a.state_dict_for_checkpoint(), start)
    _c, _f, one = _one_process(tmp_path / "one", records, 2)
    one.load_checkpoint_state(torch.load(start, weights_only=False))
    probs = np.concatenate([one.train_step(fb.build(rest[k:k + GLOBAL]).batch).probs
                            for k in range(0, len(rest), GLOBAL)])
    two_dir = str(tmp_path / "two")
    probe = records[:GLOBAL]
    got = ranks.run(_resplit_rank, 2, two_dir, _steps(rest, 2), start, probe)
    share = GLOBAL // 2
    merged = np.concatenate([np.concatenate([got[r][0][b * share:(b + 1) * share]
                                             for r in range(2)])
                             for b in range(len(rest) // GLOBAL)])
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    _c, _f, four = _one_process(tmp_path / "four", records, 4)
    four.load_checkpoint_state(read_checkpoint(list_checkpoints(two_dir)[-1]).state)
    np.testing.assert_allclose(got[0][1], four.predict(fb.build(probe).batch), atol=5e-5,
                               rtol=0)
    for name, t in four.state_dict_for_checkpoint()["model"].items():
        if name.startswith(EBC_PREFIX):
            np.testing.assert_allclose(got[0][2][name], t.numpy(), atol=5e-5, rtol=0,
                                       err_msg=name)


def test_partitions_that_do_not_fit_the_ranks_or_the_tables_are_refused(tmp_path):
    """More partitions than a table has rows: a config error on the field."""
    config = _split_config(str(tmp_path), GLOBAL, partitions=1000)
    with pytest.raises(ConfigError, match="dynamic_index_partitions"):
        TrainModule(config, FeatureBuilder(config), device="cpu")


@pytest.mark.slow
def test_torchrun_two_ranks_split_by_id_train_files_as_one_process_split_alike(tmp_path):
    """``odl-train --nproc 2`` (``torchrun`` with two ranks) on offline files with the index
    split by id over the ranks ends, exit 0, with the checkpoint of one process holding both
    partitions with a batch twice as large: the same tables and the same row of every id."""
    records = _records(20 * GLOBAL, seed=12)
    data = tmp_path / "data.csv"
    data.write_bytes(b"\n".join(records) + b"\n")
    runs = {}
    for name, batch, launch in (("one", GLOBAL, ()), ("two", GLOBAL // 2, ("--nproc", "2"))):
        config = _split_config(str(tmp_path / name), batch)
        config.train_config.save_checkpoints_steps = 8
        if not launch:  # one process: odl-train's Trainer in this process
            from odl.train.trainer import Trainer, TrainerOptions

            config.train_input_path = str(data)  # odl-train's --train_input_path
            assert Trainer(config, TrainerOptions(online=False, device="cpu",
                                                  status_port=-1)).run() == 0
        else:
            path = tmp_path / f"{name}.config"
            path.write_text(text_format.MessageToString(config))
            done = subprocess.run(
                [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path",
                 str(path), "--train_input_path", str(data), "--device", "cpu",
                 "--status_port", "-1", "--log_level", "WARNING", *launch], cwd=REPO,
                capture_output=True, timeout=300)
            assert done.returncode == 0, done.stderr.decode()[-3000:]
        runs[name] = read_checkpoint(list_checkpoints(str(tmp_path / name))[-1])
    one, two = runs["one"], runs["two"]
    assert one.global_step == two.global_step == 20
    fb = FeatureBuilder(_split_config("", GLOBAL))
    modules = {}
    for name, ckpt in runs.items():
        modules[name] = TrainModule(_split_config(str(tmp_path / f"{name}-r"), GLOBAL), fb,
                                    device="cpu")
        modules[name].load_checkpoint_state(ckpt.state)
    ids = _ids(modules["one"], fb, records)
    assert _rows(modules["two"], ids) == _rows(modules["one"], ids)
    for name, t in one.state["model"].items():
        if name.startswith(EBC_PREFIX):
            np.testing.assert_allclose(two.state["model"][name].numpy(), t.numpy(), atol=3e-5,
                                       rtol=0, err_msg=name)


def _refusing_rank(rank: int, world: int, model_dir: str) -> list[str]:
    """The config errors of partitions that do not fit two ranks."""
    errors = []
    for partitions, capacity in ((3, 60), (4, 62)):
        config = _split_config(model_dir, GLOBAL // world, partitions)
        text = text_format.MessageToString(config).replace("zch_size: 60",
                                                           f"zch_size: {capacity}")
        config = text_format.Parse(text, type(config)())
        try:
            TrainModule(config, FeatureBuilder(config), device="cpu",
                        row_wise_min_rows=ROW_WISE_MIN_ROWS)
        except ConfigError as exc:
            errors.append(str(exc))
    return errors


def test_partitions_that_do_not_divide_among_the_ranks_are_refused(ranks, tmp_path):
    """With two ranks: 3 partitions (not a multiple of 2), and 4 partitions of a table of 62
    rows (two partitions' blocks would not make a rank's block of the table), refused by
    field with what to set."""
    got = ranks.run(_refusing_rank, 2, str(tmp_path))
    for errors in got.values():
        assert len(errors) == 2
        assert "dynamic_index_partitions" in errors[0] and "multiple of 2" in errors[0]
        assert "capacity 62 must then be a multiple of 4" in errors[1]


def test_a_process_holding_some_partitions_answers_no_row_for_the_others():
    """The held partitions admit their own ids into their own blocks; ids and rows of the
    other partitions get no row, no raw id, and are named as held elsewhere."""
    from odl.config.dynamic_table_config import DynamicTableSpec
    from odl.models.dynamic.model_tables import DynamicTables

    spec = DynamicTableSpec(form="zch", capacity=40)
    tables = DynamicTables({"t": spec}, {"t": ["f"]}, partitions=4, held=(1, 2))
    table = tables.tables["t"]
    ids = np.arange(1000, 1100, dtype=np.int64)
    owner = partition_of(ids, 4)
    rows, _evicted = table.upsert(ids, step=1, now=0.0)
    spans = partition_spans(40, 4)
    mine = np.isin(owner, (1, 2))
    assert (rows[~mine] == -1).all()
    for p in (1, 2):  # each held partition fills its own block of 10 rows, nothing more
        got = rows[(owner == p) & (rows >= 0)]
        assert len(got) == 10 and got.min() >= spans[p][0] and got.max() < spans[p][1]
    assert (table.lookup(ids) == rows).all()
    assert (table.raw_ids(rows[rows >= 0]) == ids[rows >= 0]).all()
    assert table.unheld_rows().tolist() == list(range(0, 10)) + list(range(30, 40))
    assert table.holds(np.arange(40)).tolist() == [10 <= r < 30 for r in range(40)]
    assert table.live == 20 and sorted(table.live_rows().tolist()) == list(range(10, 30))


def _chain_rank(rank: int, world: int, model_dir: str, schedule: list) -> tuple:
    config = _split_config(model_dir, GLOBAL // world, 2)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    changed = CheckpointRows(tm)
    manager = CheckpointManager(model_dir, keep_max=0, full_every=3)
    for i, step in enumerate(schedule):
        tm.train_step(fb.build(step[rank]).batch if step[rank] else tm.empty_batch())
        if i % 2:
            save_across_ranks(manager, tm, {rank: i}, {}, "", "gen0", changed=changed.take())
    final = tm.state_dict_for_checkpoint()  # gathered on rank 0
    again = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    again.load_checkpoint_state(
        read_checkpoint(list_checkpoints(model_dir)[-1], whole_tables=False).state)
    return final, again.state_dict_for_checkpoint()


def test_ranks_write_increments_that_restore_into_any_number_of_ranks(ranks, tmp_path):
    """Two ranks (tables split by rows, dynamic tables by id) write a full checkpoint and
    increments of the rows any rank changed in their shards: the chain restores bitwise
    into the two ranks (each reading its blocks and rows), reads as their gathered state in
    one process, and re-splits into one partition as that state does."""
    records = _records(10 * GLOBAL, seed=9)
    model_dir = str(tmp_path / "two")
    final, again = ranks.run(_chain_rank, 2, model_dir, _steps(records, 2))[0]
    chains = [read_checkpoint(p).chain for p in list_checkpoints(model_dir)]
    assert [len(c) for c in chains] == [1, 2, 3, 1, 2]  # full every third
    assert_same(again, final)
    assert_same(read_checkpoint(list_checkpoints(model_dir)[-1]).state, final)
    _c, _f, chained = _one_process(tmp_path / "a", records, 1)
    chained.load_checkpoint_state(read_checkpoint(list_checkpoints(model_dir)[-1]).state)
    _c, _f, whole = _one_process(tmp_path / "b", records, 1)
    whole.load_checkpoint_state(final)
    assert_same(chained.state_dict_for_checkpoint(), whole.state_dict_for_checkpoint())
