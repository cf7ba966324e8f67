"""Dynamic tables with several ranks (``TrainModule._remap_ranks``).

The contract: every rank holds the whole id index and decides admissions, evictions and
expiry from the step's records of all ranks in rank order, so two ranks train (predictions,
tables, index) as one process does on the concatenated batches; evicted rows are reset in
the shards that hold them; a checkpoint of one process restores into the ranks; the ranks
publish and recover the versions one process publishes and recovers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.features.feature_builder import FeatureBuilder
from odl.models.dynamic.partitions import partition_of
from odl.train.distributed import agree, check_several_ranks
from odl.train.rank_publishing import RankPublishing
from odl.train.table_shards import EBC_PREFIX
from odl.train.train_module import TrainModule
from publisher.delta_recovery import apply_recovered_state
from publisher.id_maps import build_id_maps
from publisher.publisher_factory import (
    build_delta_sink,
    build_publisher,
    dense_variable_shapes,
    published_table_dims,
)
from tests.harness import assert_tables_close
from tests.test_distributed_publishing import _versions
from tests.test_dynamic_tables import _config, _records, recovered_run

GLOBAL = 64  # records per step, all ranks together
ROW_WISE_MIN_ROWS = 16  # the 60- and 40-row dynamic tables split by rows over the ranks


def _steps(records: list[bytes], world: int) -> list[list[list[bytes]]]:
    share = GLOBAL // world
    return [[records[k + r * share:k + (r + 1) * share] for r in range(world)]
            for k in range(0, len(records), GLOBAL)]


def _index(tm: TrainModule, fb: FeatureBuilder, records: list[bytes]) -> dict[str, list]:
    """Each dynamic table's row of every id the records carry (-1: none)."""
    sparse = fb.build(records).batch.sparse.to_dict()
    return {name: table.lookup(np.concatenate([
        sparse[f].values().numpy() for f in tm.dynamic._table_features[name]])).tolist()
        for name, table in tm.dynamic.tables.items()}


def _partition_index(tm: TrainModule, fb: FeatureBuilder, records: list[bytes],
                     partition: int, partitions: int) -> dict[str, list]:
    """``_index`` as a rank holding only ``partition`` of ``tm``'s index knows it (-1 for
    the ids of the other partitions)."""
    sparse = fb.build(records).batch.sparse.to_dict()
    out = {}
    for name, table in tm.dynamic.tables.items():
        ids = np.concatenate([sparse[f].values().numpy() for f in tm.dynamic._table_features[name]])
        rows = table.lookup(ids)
        rows[partition_of(ids, partitions) != partition] = -1
        out[name] = rows.tolist()
    return out


def _rank_main(rank: int, world: int, model_dir: str, schedule: list, start: str,
               records: list[bytes]) -> tuple:
    config = _config(model_dir)
    config.data_config.batch_size = GLOBAL // world
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    tm.load_checkpoint_state(torch.load(start, weights_only=False))
    probs = [tm.train_step(fb.build(step[rank]).batch if step[rank] else tm.empty_batch()).probs
             for step in schedule]
    state = tm.state_dict_for_checkpoint()  # gathered on rank 0
    tables = {k: v.numpy() for k, v in state.get("model", {}).items()
              if k.startswith(EBC_PREFIX)}
    return np.concatenate(probs), tables, _index(tm, fb, records)


def test_two_ranks_admit_and_evict_as_one_process(ranks, tmp_path):
    """One process trains the first steps and saves; two ranks restore that state and train
    on, against the one process going on: the same admissions and evictions (each rank's
    index equals the process's), predictions and tables."""
    records = _records(24 * GLOBAL, seed=4)
    first, rest = records[:8 * GLOBAL], records[8 * GLOBAL:]
    config = _config(str(tmp_path / "one"))
    config.data_config.batch_size = GLOBAL
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    for k in range(0, len(first), GLOBAL):
        one.train_step(fb.build(first[k:k + GLOBAL]).batch)
    start = str(tmp_path / "start.pt")
    torch.save(one.state_dict_for_checkpoint(), start)
    evicted_before = {n: t.counters.evicted + t.counters.expired
                      for n, t in one.dynamic.tables.items()}
    probs = np.concatenate([one.train_step(fb.build(rest[k:k + GLOBAL]).batch).probs
                            for k in range(0, len(rest), GLOBAL)])
    assert any(t.counters.evicted + t.counters.expired > evicted_before[n]  # rows do go
               for n, t in one.dynamic.tables.items())
    got = ranks.run(_rank_main, 2, str(tmp_path / "m"), _steps(rest, 2), start, records)
    share = GLOBAL // 2
    merged = np.concatenate([np.concatenate([got[r][0][b * share:(b + 1) * share]
                                             for r in range(2)])
                             for b in range(len(rest) // GLOBAL)])
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    want = _index(one, fb, records)
    assert got[0][2] == want and got[1][2] == want
    assert_tables_close(got[0][1], one.state_dict_for_checkpoint(), atol=5e-5)


INCR = 'incr_save_config { sparse_save_steps: 2 dense_save_steps: 3 fs { incr_save_dir: "v" } }'


def _publishing_config(model_dir: str, batch: int, partitions: int = 1):
    config = _config(model_dir)
    config.data_config.batch_size = batch
    config.train_config.dynamic_index_partitions = partitions
    text_format.Merge(INCR, config.train_config)
    return config


def _publishing_rank(rank: int, world: int, model_dir: str, steps: list,
                     partitions: int) -> int:
    """One rank training its share of each step and publishing through rank 0."""
    config = _publishing_config(model_dir, GLOBAL // world, partitions)
    check_several_ranks(config, world_size=world)  # publishing them: allowed
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    publishing = RankPublishing.build(config, tm, "gen0", rank, None,
                                      build_delta_sink(config) if rank == 0 else None)
    positions: dict[int, int] = {}
    for k, records in enumerate(steps):
        flags = agree([publishing.turn_flags(tm.global_step)])[0][0]  # rank 0's
        publishing.after_turn(tm.global_step, flags, True, positions)
        tm.train_step(fb.build(records[rank::world]).batch)
        positions = {rank: k + 1}
        if publishing.publisher is not None:  # each version sent alone, never merged
            assert publishing.publisher.wait_sent(30.0)
    publishing.flush(tm.global_step, positions, timeout=30.0)
    return tm.global_step


@pytest.mark.parametrize("partitions", [1, 2])
def test_two_ranks_publish_dynamic_tables_as_one_process(ranks, tmp_path, partitions):
    """Delta versions of a model with dynamic tables from two ranks: the same versions as one
    process's on the same records, rows under the raw ids they hold (the union of both
    ranks' touched rows, named by rank 0's whole index, or, split by id, by the rank whose
    partition holds each row, whoever trained it) and the evicted ids as deletes (split by
    id: every partition's)."""
    records = _records(16 * GLOBAL, seed=6)
    steps = [records[k:k + GLOBAL] for k in range(0, len(records), GLOBAL)]
    two_dir, one_dir = str(tmp_path / "two"), str(tmp_path / "one")
    ranks.run(_publishing_rank, 2, two_dir, steps, partitions)
    config = _publishing_config(one_dir, GLOBAL, partitions)
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    pub = build_publisher(config, one, "gen0", sink=build_delta_sink(config))
    for k, recs in enumerate(steps):
        one.train_step(fb.build(recs[0::2] + recs[1::2]).batch)
        pub.maybe_publish(one.global_step, {r: k + 1 for r in range(2)})
        assert pub.wait_sent(30.0)
    pub.flush(timeout=30.0, step=one.global_step, positions={0: 16, 1: 16})
    two, ref = _versions(two_dir), _versions(one_dir)
    assert [v.header.version for v in two] == [v.header.version for v in ref]
    assert any(v.deletes for v in ref)  # the steps evict: deletes are published
    for a, b in zip(two, ref, strict=True):
        assert {t: sorted(ids.tolist()) for t, ids in a.deletes.items()} == {
            t: sorted(ids.tolist()) for t, ids in b.deletes.items()}
        assert set(a.sparse) == set(b.sparse)
        for tid, (ids, values) in b.sparse.items():
            order_a, order_b = np.argsort(a.sparse[tid][0]), np.argsort(ids)
            np.testing.assert_array_equal(a.sparse[tid][0][order_a], ids[order_b])
            np.testing.assert_allclose(a.sparse[tid][1][order_a], values[order_b],
                                       atol=1e-4, rtol=0)


def _recovering_rank(rank: int, world: int, model_dir: str, base: str, recovered: str,
                     records: list[bytes], partitions: int) -> tuple:
    """One rank restoring the base state, then applying the recovered versions."""
    config = _config(model_dir)
    config.train_config.dynamic_index_partitions = partitions
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    tm.load_checkpoint_state(torch.load(base, weights_only=False))
    maps = build_id_maps(dense_variable_shapes(tm), published_table_dims(tm))
    apply_recovered_state(tm.table_rows(), tm.dense_parameters(), maps,
                          torch.load(recovered, weights_only=False), tm)
    state = tm.state_dict_for_checkpoint()  # gathered on rank 0
    tables = {k: v.numpy() for k, v in state.get("model", {}).items()
              if k.startswith(EBC_PREFIX)}
    return tables, _index(tm, fb, records)


@pytest.mark.parametrize("partitions", [1, 2])
def test_two_ranks_recover_published_rows_and_deletes_as_one_process(ranks, tmp_path, partitions):
    """Crash recovery's step with ranks: a base state restored into two ranks, then the
    delta versions published after it (rows under raw ids, deletes): every rank's index
    (split by id: the ids of its partition) and the shards' rows equal one process
    recovering the same."""
    run, base_state, state = recovered_run(tmp_path, partitions)
    one = TrainModule(run.cfg, run.fb, device="cpu")
    one.load_checkpoint_state(base_state)
    apply_recovered_state(one.embedding_tables(), one.dense_parameters(), run.maps, state, one)
    base, recovered = str(tmp_path / "base.pt"), str(tmp_path / "recovered.pt")
    torch.save(base_state, base)
    torch.save(state, recovered)
    records = _records(400, seed=5)
    got = ranks.run(_recovering_rank, 2, str(tmp_path / "m"), base, recovered, records,
                    partitions)
    want = _index(one, run.fb, records)
    for r in range(2):
        assert got[r][1] == (want if partitions == 1 else
                             _partition_index(one, run.fb, records, r, partitions))
    for name, t in one.state_dict_for_checkpoint()["model"].items():
        if name.startswith(EBC_PREFIX):
            np.testing.assert_allclose(got[0][0][name], t.numpy(), atol=1e-6, rtol=0,
                                       err_msg=name)


def _increment_rank(rank: int, world: int, model_dir: str, steps: list,
                    partitions: int = 1) -> dict:
    """Three checkpoints of the ranks through ``save_across_ranks``, as the trainer takes
    them: a full one after the first third of the steps, then two increments (the dynamic
    tables' changes from every rank's rows); each rank returns the paths and its dynamic
    tables' state at the end (split by id: its own partition's)."""
    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.models.dynamic.dynamic_table import state_arrays
    from odl.train.checkpoint_rows import CheckpointRows
    from odl.train.rank_checkpoint import save_across_ranks

    config = _config(model_dir)
    config.data_config.batch_size = GLOBAL // world
    config.train_config.dynamic_index_partitions = partitions
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    rows = CheckpointRows(tm)
    manager = CheckpointManager(model_dir, keep_max=0, full_every=5)
    paths = []
    third = len(steps) // 3
    for part in (steps[:third], steps[third:2 * third], steps[2 * third:]):
        for step in part:
            tm.train_step(fb.build(step[rank]).batch)
        paths.append(save_across_ranks(manager, tm, {rank: tm.global_step}, {"source": "t"},
                                       "cfg", "gen", changed=rows.take(),
                                       dynamic_changes=rows.dynamic_changes_of))
    return {"paths": paths, "dynamic": state_arrays(tm.dynamic.state_dict())}


@pytest.mark.parametrize("partitions", [1, 2])
def test_two_ranks_write_the_dynamic_tables_changes_into_an_increment(ranks, tmp_path,
                                                                       partitions):
    """An increment of two ranks holds the dynamic tables as the rows changed (not their
    whole state): rank 0 writes the changes of the whole index every rank holds, or, split
    by id, each rank the changes of its own partition beside its rows; the chain (a full
    checkpoint, two increments) reads back the ranks' index and counters bitwise."""
    import glob

    from odl.checkpoint.checkpoint_chain import read_rows
    from odl.checkpoint.checkpoint_manager import read_checkpoint
    from odl.models.dynamic.dynamic_table import state_arrays
    from odl.models.dynamic.state_changes import CHANGES_FORMAT
    from tests.harness import assert_same

    records = _records(18 * GLOBAL, seed=7)  # 18 steps of two ranks
    got = ranks.run(_increment_rank, 2, str(tmp_path / "m"), _steps(records, 2), partitions)
    full, first, newest = got[0]["paths"]
    assert read_checkpoint(newest).chain == (full, first, newest)
    saved = read_checkpoint(newest).state["dynamic_tables"]
    if partitions == 1:
        assert torch.load(f"{newest}/model.pt",
                          weights_only=True)["dynamic_tables"]["format"] == CHANGES_FORMAT
        assert_same(got[0]["dynamic"], state_arrays(saved))
        return
    for inc in (first, newest):
        parts = {}
        for path in sorted(glob.glob(f"{inc}/rows*")):
            parts.update(read_rows(path)["dynamic_parts"])
        assert sorted(parts) == [0, 1]
        assert all(part["format"] == CHANGES_FORMAT for part in parts.values())
    want = {p: part for r in range(2) for p, part in got[r]["dynamic"]["parts"].items()}
    assert sorted(saved["parts"]) == [0, 1]
    for p in (0, 1):
        assert_same(want[p], state_arrays(saved["parts"][p]))
