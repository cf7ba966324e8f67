"""Dynamic tables with several ranks (``TrainModule._remap_ranks``).

The contract: every rank holds the whole id index and decides admissions, evictions and
expiry from the step's records of all ranks in rank order, so two ranks train (predictions,
tables, index) as one process does on the concatenated batches; evicted rows are reset in
the shards that hold them; a checkpoint of one process restores into the ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.harness.spawned_ranks import run_ranks
from odl.train.distributed import check_several_ranks
from odl.train.train_module import EBC_PREFIX, TrainModule
from tests.test_dynamic_tables import _config, _records

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


def test_two_ranks_admit_and_evict_as_one_process(tmp_path):
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
    got = run_ranks(_rank_main, 2, 2, str(tmp_path / "m"), _steps(rest, 2), start, records)
    share = GLOBAL // 2
    merged = np.concatenate([np.concatenate([got[r][0][b * share:(b + 1) * share]
                                             for r in range(2)])
                             for b in range(len(rest) // GLOBAL)])
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    want = _index(one, fb, records)
    assert got[0][2] == want and got[1][2] == want
    for name, t in one.state_dict_for_checkpoint()["model"].items():
        if name.startswith(EBC_PREFIX):
            np.testing.assert_allclose(got[0][1][name], t.numpy(), atol=5e-5, rtol=0,
                                       err_msg=name)


def test_publishing_dynamic_tables_with_ranks_is_refused_by_field(tmp_path):
    config = _config(str(tmp_path / "m"))
    config.kafka_train_input.server, config.kafka_train_input.topic = "127.0.0.1:9", "t"
    check_several_ranks(config, online=True, world_size=2)  # training them: done
    config.train_config.incr_save_config.fs.incr_save_dir = "v"
    with pytest.raises(ConfigError) as err:
        check_several_ranks(config, online=True, world_size=2)
    assert err.value.field == "train_config.incr_save_config" and "2 ranks" in str(err.value)
