"""Several ranks train one model as one process does (``odl.train.distributed``).

Two CPU ranks (gloo, started here as ``torchrun`` would: RANK / WORLD_SIZE / MASTER_* in the
environment) each train on their half of every batch, with the id tables split by rows and
the small tables placed whole; their predictions, tables (gathered) and dense parameters
must equal one process's on the whole batches.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint
from odl.config.config_error import ConfigError
from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.datagen_config import bursty_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.inputs.partition_assignment import rank_partitions
from odl.train.distributed import check_several_ranks, table_placement
from odl.train.in_batch import in_batch_choice
from odl.train.torch_runtime import rank_device
from odl.train.train_module import TrainModule
from tests.harness import RankPool, assert_tables_close, load_config_text

BATCH = 256
ROW_WISE_MIN_ROWS = 2048  # the 4096-row id tables split by rows, device / hour (1024) whole


def _config(model_dir: str, extra_train: str = ""):
    """The bursty DeepFM; without in-batch learning unless ``extra_train`` writes it (those
    tests are of the plain step's ranks; in-batch learning's have their own below)."""
    if "in_batch_learning" not in extra_train:
        extra_train += " in_batch_learning: false"
    return load_config_text(bursty_config_text(model_dir, batch_size=BATCH, buckets=4096,
                                               extra_train=extra_train))


def _tables(state: dict) -> dict[str, np.ndarray]:
    """The embedding tables of a checkpoint state ({} for a rank other than 0's)."""
    return {k: v.numpy() for k, v in state.get("model", {}).items()
            if k.startswith("ebc.embedding_bags.")}


def _even(records: list[bytes], world: int) -> list[list[list[bytes]]]:
    """Per step, per rank: each rank its equal share of each batch of ``BATCH`` records."""
    share = BATCH // world
    return [[records[k + r * share:k + (r + 1) * share] for r in range(world)]
            for k in range(0, len(records), BATCH)]


def _load(path: str) -> dict:
    """A saved state: a ``torch.save`` file, or a checkpoint directory read as a restart of
    several ranks reads it (``whole_tables=False``: a one-process checkpoint's state file
    mapped, each rank copying its own rows out of it)."""
    if os.path.isdir(path):
        return read_checkpoint(path, whole_tables=False).state
    return torch.load(path, weights_only=False)


def _rank_main(rank: int, world: int, model_dir: str, schedule: list[list[list[bytes]]],
               load_path: str = "", save_path: str = "", warm: bool = False,
               extra_train: str = "") -> tuple:
    """One rank's training: ``(predictions, gathered tables (rank 0), dense parameters)``."""
    config = _config(model_dir, extra_train)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    if load_path and warm:  # parameters only, as fine_tune_checkpoint does
        tm.load_parameters(_load(load_path)["model"])
    elif load_path:  # a checkpoint state of any number of ranks
        tm.load_checkpoint_state(_load(load_path))
    probs = []
    for step in schedule:  # a rank without records at a step still takes part
        mine = step[rank]
        probs.append(tm.train_step(fb.build(mine).batch if mine else tm.empty_batch()).probs)
    assert tm.global_step == sum(1 for step in schedule if any(step)) + (
        0 if not load_path or warm else int(_load(load_path)["global_step"]))
    if save_path:
        state = tm.state_dict_for_checkpoint()  # every rank takes part; rank 0 gets it
        assert bool(state) == (rank == 0)
        if state:
            torch.save(state, save_path)
    tables = _tables(tm.state_dict_for_checkpoint())  # gathered on rank 0
    dense = {k: v.detach().cpu().numpy() for k, v in tm.dense_parameters().items()}
    return np.concatenate(probs), tables, dense


def _run_ranks(ranks: RankPool, world: int, model_dir: str,
               schedule: list[list[list[bytes]]], load_path: str = "", save_path: str = "",
               warm: bool = False, extra_train: str = "") -> dict[int, tuple]:
    """Runs ``_rank_main`` on the ``world`` ranks; rank -> (probs, tables, dense)."""
    assert world == ranks.world
    return ranks.run(_rank_main, world, model_dir, schedule, load_path, save_path, warm,
                     extra_train)


def _trained_on(tmp_path, records: list[bytes]):
    """One process trained on ``records`` and its state saved: ``(config, feature builder,
    module, path of the saved state)``."""
    config = _config(str(tmp_path / "one"))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    for k in range(0, len(records), BATCH):
        one.train_step(fb.build(records[k:k + BATCH]).batch)
    start = str(tmp_path / "start.pt")
    torch.save(one.state_dict_for_checkpoint(), start)
    return config, fb, one, start


def _merged_probs(got: dict[int, tuple], world: int, n: int) -> np.ndarray:
    """The ranks' predictions in record order (rank r predicted its share of each batch)."""
    share = BATCH // world
    return np.concatenate([
        np.concatenate([got[r][0][b * share:(b + 1) * share] for r in range(world)])
        for b in range(n // BATCH)])


def test_two_ranks_train_the_model_one_process_trains(ranks, tmp_path):
    world = 2
    records = BurstyStream(seed=4).next_batch(6 * BATCH).encode("csv")
    got = _run_ranks(ranks, world, str(tmp_path / "m"), _even(records, world))

    config = _config(str(tmp_path / "one"))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    probs = np.concatenate([one.train_step(fb.build(records[k:k + BATCH]).batch).probs
                            for k in range(0, len(records), BATCH)])
    np.testing.assert_allclose(_merged_probs(got, world, len(records)), probs, atol=2e-5,
                               rtol=0)
    tables = _tables(one.state_dict_for_checkpoint())
    assert set(got[0][1]) == set(tables) and got[1][1] == {}
    for name, t in tables.items():
        np.testing.assert_allclose(got[0][1][name], t, atol=2e-5, rtol=0,
                                   err_msg=name)
    for name, v in one.dense_parameters().items():
        for r in range(world):  # DDP kept every rank's dense part equal to one process's
            np.testing.assert_allclose(got[r][2][name], v.detach().numpy(), atol=2e-5,
                                       rtol=0, err_msg=f"rank {r} {name}")


# the in-batch choice's windows where the stream decides (per_record None): one step each,
# on from the second window, so that two ranks pass from measuring to on within the run
SMALL_WINDOWS = {"WINDOW_RECORDS": 1, "WINDOW_MIN_STEPS": 1, "ON_ABOVE": -1.0,
                 "OFF_BELOW": -2.0}


@pytest.mark.parametrize("optimizer,per_record", [("adagrad_optimizer", False),
                                                   ("sgd_optimizer", False),
                                                   ("adagrad_optimizer", True),
                                                   ("adagrad_optimizer", None)])
def test_two_ranks_learn_in_batch_as_one_process(ranks, tmp_path, monkeypatch, optimizer,
                                                 per_record):
    """Sequential in-batch learning with two ranks: each record is shifted by the step's
    earlier records of both ranks (rank 0's first), the accumulators of rows held by the
    other rank included, so the predictions and the tables are one process's on the
    concatenated batches; with per-record Adagrad each shared row is corrected by the rank
    holding it, from both ranks' records. Decided by the stream (``per_record`` None), every
    rank takes one process's decisions at its steps."""
    world = 2
    records = BurstyStream(seed=8).next_batch(6 * BATCH).encode("csv")
    extra = _in_batch_settings(per_record) if per_record is not None else ""
    windows = SMALL_WINDOWS if per_record is None else {}
    for name, value in windows.items():
        monkeypatch.setattr(in_batch_choice, name, value)
    text = bursty_config_text(str(tmp_path / "one"), batch_size=BATCH, buckets=4096,
                              extra_train=extra)
    config = load_config_text(text.replace("adagrad_optimizer", optimizer, 1))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    probs = np.concatenate([one.train_step(fb.build(records[k:k + BATCH]).batch).probs
                            for k in range(0, len(records), BATCH)])
    got = ranks.run(_in_batch_rank_main, world, str(tmp_path / "m"),
                    _even(records, world), optimizer, extra, "", windows)
    merged = np.concatenate([
        np.concatenate([got[r][0][b * (BATCH // world):(b + 1) * (BATCH // world)]
                        for r in range(world)]) for b in range(len(records) // BATCH)])
    plain = _config(str(tmp_path / "plain"))
    ref = TrainModule(plain, FeatureBuilder(plain), device="cpu")
    ref_probs = np.concatenate([ref.train_step(fb.build(records[k:k + BATCH]).batch).probs
                                for k in range(0, len(records), BATCH)])
    assert np.abs(probs - ref_probs).max() > 1e-2  # in-batch learning does shift them
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    assert_tables_close(got[0][1], one.state_dict_for_checkpoint(), atol=5e-5)
    # the wide rate's probes judged every rank's records: one level, one process's
    assert one.wide_rate.probes >= 1
    for r in range(world):
        assert got[r][3]["level"] == one.wide_rate.level
        assert got[r][3]["sensitivity"] == pytest.approx(one.wide_rate.sensitivity, rel=1e-5)
        # the shift's gain, measured on the step's loss over both ranks' records
        assert got[r][4] == pytest.approx(one.in_batch_gain.value, rel=1e-4)
        choice = one.row_pair_learning.choice.state_dict()
        assert {**got[r][5], "sum": 0.0, "window_gain": 0.0} == {
            **choice, "sum": 0.0, "window_gain": 0.0}
        assert got[r][5]["sum"] == pytest.approx(choice["sum"], rel=1e-4)
    if per_record is None:
        assert one.row_pair_learning.choice.phase == "on" and choice["switches"] == 1


def _in_batch_settings(per_record: bool) -> str:
    return ("in_batch_learning: true wide_learning_rate_multiplier: 3"
            + f" per_record_adagrad: {str(per_record).lower()}")


def _in_batch_rank_main(rank: int, world: int, model_dir: str,
                        schedule: list[list[list[bytes]]], optimizer: str, extra: str,
                        loss: str = "", windows: dict | None = None) -> tuple:
    """One rank of ``test_two_ranks_learn_in_batch_as_one_process`` (and the focal loss's);
    ``windows``: the in-batch choice's constants to set in this process for the call (the
    pool's process keeps running other tests' calls: they are restored)."""
    saved = {name: getattr(in_batch_choice, name) for name in (windows or {})}
    for name, value in (windows or {}).items():
        setattr(in_batch_choice, name, value)
    try:
        text = _with_loss(bursty_config_text(model_dir, batch_size=BATCH, buckets=4096,
                                             extra_train=extra), loss)
        config = load_config_text(text.replace("adagrad_optimizer", optimizer, 1))
        fb = FeatureBuilder(config)
        tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
        probs = [tm.train_step(fb.build(step[rank]).batch if step[rank]
                               else tm.empty_batch()).probs for step in schedule]
    finally:
        for name, value in saved.items():
            setattr(in_batch_choice, name, value)
    passes = tm.row_pair_learning.in_batch.sequential.passes
    return (np.concatenate(probs), _tables(tm.state_dict_for_checkpoint()), passes,
            tm.wide_rate.state_dict(), tm.in_batch_gain.value,
            tm.row_pair_learning.choice.state_dict())


FOCAL = "losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { gamma: 0.5 } }"


def _with_loss(text: str, loss: str) -> str:
    """The config with ``loss`` (a ``losses`` entry) in its model config, if given."""
    model_class = 'model_class: "DeepFM"'
    assert model_class in text
    return text.replace(model_class, f"{model_class}\n  {loss}", 1) if loss else text


def test_two_ranks_refine_the_pass_for_a_loss_it_fits_as_one_process(ranks, tmp_path):
    """Binary focal loss, whose errors the sequential pass only fits: it repeats from the
    logits it reached, and with two ranks every pass runs over both ranks' records (the
    ranks giving their records' slopes between passes) as one process's passes run over
    the concatenated batch: the same number of passes, predictions and tables."""
    world = 2
    records = BurstyStream(seed=8).next_batch(4 * BATCH).encode("csv")
    extra = _in_batch_settings(True)
    config = load_config_text(_with_loss(bursty_config_text(
        str(tmp_path / "one"), batch_size=BATCH, buckets=4096, extra_train=extra), FOCAL))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    probs = np.concatenate([one.train_step(fb.build(records[k:k + BATCH]).batch).probs
                            for k in range(0, len(records), BATCH)])
    scan = one.row_pair_learning.in_batch.sequential
    assert not scan.exact and scan.passes > 1  # the last step's pass repeated
    got = ranks.run(_in_batch_rank_main, world, str(tmp_path / "m"), _even(records, world),
                    "adagrad_optimizer", extra, FOCAL)
    assert [got[r][2] for r in range(world)] == [scan.passes] * world
    merged = np.concatenate([
        np.concatenate([got[r][0][b * (BATCH // world):(b + 1) * (BATCH // world)]
                        for r in range(world)]) for b in range(len(records) // BATCH)])
    np.testing.assert_allclose(merged, probs, atol=5e-5, rtol=0)
    assert_tables_close(got[0][1], one.state_dict_for_checkpoint(), atol=5e-5)


@pytest.mark.parametrize("written", ["state", "checkpoint"])
def test_checkpoints_move_between_one_process_and_two_ranks(ranks, tmp_path, written):
    """One process's checkpoint state restores into two ranks (their tables split and
    placed as the plan says) and theirs, written by rank 0, into one process: the training
    that continues from it is the same on either side, and so are the states. The state
    is given as saved, or as a checkpoint directory read as a restart of several ranks
    reads it (the state file mapped, each rank copying its own rows)."""
    records = BurstyStream(seed=6).next_batch(6 * BATCH).encode("csv")
    rest = records[3 * BATCH:]
    config, fb, one, start = _trained_on(tmp_path, records[:3 * BATCH])
    if written == "checkpoint":
        start = CheckpointManager(str(tmp_path / "one_ckpt")).save(
            one.global_step, torch.load(start, weights_only=False), {0: 3 * BATCH},
            {"source": "kafka"}, "cfg")
    probs = np.concatenate([one.train_step(fb.build(rest[k:k + BATCH]).batch).probs
                            for k in range(0, len(rest), BATCH)])
    end_one = one.state_dict_for_checkpoint()

    end_two = str(tmp_path / "two.pt")
    got = _run_ranks(ranks, 2, str(tmp_path / "m"), _even(rest, 2), load_path=start,
                     save_path=end_two)
    np.testing.assert_allclose(_merged_probs(got, 2, len(rest)), probs, atol=2e-5, rtol=0)
    state = torch.load(end_two, weights_only=False)
    assert state["global_step"] == end_one["global_step"] == 6
    assert set(state["model"]) == set(end_one["model"])
    for name, t in end_one["model"].items():
        np.testing.assert_allclose(state["model"][name].numpy(), t.numpy(), atol=2e-5,
                                   rtol=0, err_msg=name)
    assert set(state["sparse_optimizer"]) == set(end_one["sparse_optimizer"])
    for pname, states in end_one["sparse_optimizer"].items():
        for k, t in states.items():
            np.testing.assert_allclose(state["sparse_optimizer"][pname][k].numpy(),
                                       t.numpy(), atol=2e-5, rtol=0, err_msg=k)
    # and back into one process, strictly (every name, every shape)
    again = TrainModule(config, fb, device="cpu")
    again.load_checkpoint_state(state)
    batch = fb.build(records[:BATCH]).batch
    np.testing.assert_allclose(again.predict(batch), one.predict(batch), atol=2e-5, rtol=0)


def test_two_ranks_warm_start_from_one_processs_parameters(ranks, tmp_path):
    """fine_tune_checkpoint's warm start (parameters only) into two ranks: each copies its
    own rows; training on from there is one process's warm-started training."""
    records = BurstyStream(seed=9).next_batch(5 * BATCH).encode("csv")
    rest = records[2 * BATCH:]
    config, fb, source, start = _trained_on(tmp_path, records[:2 * BATCH])
    warm = TrainModule(config, fb, device="cpu")
    warm.load_parameters(source.state_dict_for_checkpoint()["model"])
    probs = np.concatenate([warm.train_step(fb.build(rest[k:k + BATCH]).batch).probs
                            for k in range(0, len(rest), BATCH)])
    got = _run_ranks(ranks, 2, str(tmp_path / "m"), _even(rest, 2), load_path=start, warm=True)
    np.testing.assert_allclose(_merged_probs(got, 2, len(rest)), probs, atol=2e-5, rtol=0)


def test_uneven_and_empty_shares_train_as_one_process_on_the_step_records(ranks, tmp_path):
    """Ranks step in lock-step whatever they hold: uneven shares, a rank with none (it passes
    an empty batch), a step with none anywhere (skipped by all). Each step's update is one
    process's on the step's records together."""
    records = BurstyStream(seed=7).next_batch(900).encode("csv")
    sizes = [(200, 56), (0, 256), (256, 0), (0, 0), (10, 100), (1, 1), (0, 20)]
    schedule, k = [], 0
    for a, b in sizes:
        schedule.append([records[k:k + a], records[k + a:k + a + b]])
        k += a + b
    got = _run_ranks(ranks, 2, str(tmp_path / "m"), schedule)

    config = _config(str(tmp_path / "one"))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    probs = [one.train_step(fb.build(a + b).batch).probs for a, b in schedule if a or b]
    ranks_probs, at = [], [0, 0]
    for a, b in schedule:
        for r, part in enumerate((a, b)):
            ranks_probs.append(got[r][0][at[r]:at[r] + len(part)])
            at[r] += len(part)
    np.testing.assert_allclose(np.concatenate(ranks_probs), np.concatenate(probs),
                               atol=2e-5, rtol=0)
    for name, t in _tables(one.state_dict_for_checkpoint()).items():
        np.testing.assert_allclose(got[0][1][name], t, atol=2e-5, rtol=0,
                                   err_msg=name)


def _save_parts_main(rank: int, world: int, model_dir: str, schedule, fail_rank: int) -> dict:
    """Trains, then two checkpoints through ``save_across_ranks``: the first written by
    every rank, the second with ``fail_rank``'s part failing. Rank 0 returns the gathered
    state of the first (``state_dict_for_checkpoint``) and what each save said."""
    from odl.checkpoint.checkpoint_manager import CheckpointError, CheckpointManager
    from odl.train.rank_checkpoint import save_across_ranks

    config = _config(model_dir)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    manager = CheckpointManager(model_dir, keep_max=5)
    for step in schedule[:2]:
        tm.train_step(fb.build(step[rank]).batch)
    saved = save_across_ranks(manager, tm, {rank: 100 + rank}, {"source": "kafka"},
                              "config", "gen-1")
    gathered = tm.state_dict_for_checkpoint()
    tm.train_step(fb.build(schedule[2][rank]).batch)
    if rank == fail_rank:
        def fail(*_a, **_k):
            raise CheckpointError(f"rank {rank}: disk full")
        manager.write_table_part = fail
    try:
        save_across_ranks(manager, tm, {rank: 200 + rank}, {"source": "kafka"}, "config",
                          "gen-1")
        second = "saved"
    except CheckpointError as exc:
        second = str(exc)
    gathered = {"model": {k: v.numpy() for k, v in gathered.get("model", {}).items()},
                "sparse_optimizer": {p: {k: v.numpy() for k, v in st.items()} for p, st in
                                     gathered.get("sparse_optimizer", {}).items()}}
    return {"saved": saved, "gathered": gathered, "second": second,
            "last_saved_step": manager.last_saved_step}


def _restore_parts_main(rank: int, world: int, model_dir: str, path: str,
                        row_wise_min_rows: int) -> dict:
    """Restores ``path`` from its table parts (each rank reading only its own rows' blocks);
    the state gathered on rank 0."""
    from odl.checkpoint.checkpoint_manager import read_checkpoint

    config = _config(model_dir)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu",
                     row_wise_min_rows=row_wise_min_rows)
    state = read_checkpoint(path, whole_tables=False).state
    assert state["table_parts"] and not [k for k in state["model"] if k.startswith("ebc.")]
    tm.load_checkpoint_state(state)
    gathered = tm.state_dict_for_checkpoint()
    return {"model": {k: v.numpy() for k, v in gathered.get("model", {}).items()},
            "sparse_optimizer": {p: {k: v.numpy() for k, v in st.items()} for p, st in
                                 gathered.get("sparse_optimizer", {}).items()},
            "global_step": gathered.get("global_step")}


@pytest.mark.slow
def test_each_rank_writes_its_own_rows_and_the_checkpoint_reads_whole(ranks, tmp_path):
    """With two ranks the checkpoint holds one table part per rank and model.pt no table;
    read back it is the state gathered on rank 0 (so it restores into any number of ranks),
    with both ranks' positions. A rank whose part fails leaves no checkpoint of that step,
    and every rank hears of it."""
    from odl.checkpoint.checkpoint_manager import (
        list_checkpoints,
        read_checkpoint,
        verify_checkpoint,
    )

    records = BurstyStream(seed=11).next_batch(3 * BATCH).encode("csv")
    model_dir = str(tmp_path / "m")
    got = ranks.run(_save_parts_main, 2, model_dir, _even(records, 2), 1)
    path = got[0]["saved"]
    assert got[1]["saved"] == path and path.endswith("model.ckpt-2")
    files = sorted(p.name for p in (tmp_path / "m" / "model.ckpt-2").iterdir())
    assert "tables.rank-0-of-2.pt" in files and "tables.rank-1-of-2.pt" in files
    raw = torch.load(f"{path}/model.pt", weights_only=True)
    assert raw["table_parts"] == ["tables.rank-0-of-2.pt", "tables.rank-1-of-2.pt"]
    assert not [k for k in raw["model"] if k.startswith("ebc.")] and not raw["sparse_optimizer"]
    assert verify_checkpoint(path) is None
    loaded = read_checkpoint(path)
    assert loaded.positions == {0: 100, 1: 101}
    want = got[0]["gathered"]
    assert set(loaded.state["model"]) == set(want["model"])
    for name, t in want["model"].items():
        np.testing.assert_array_equal(loaded.state["model"][name].numpy(), t, err_msg=name)
    assert set(loaded.state["sparse_optimizer"]) == set(want["sparse_optimizer"])
    for pname, states in want["sparse_optimizer"].items():
        for k, t in states.items():
            np.testing.assert_array_equal(loaded.state["sparse_optimizer"][pname][k].numpy(),
                                          t, err_msg=k)
    # one process restores it strictly, every name and shape
    one = TrainModule(_config(str(tmp_path / "one")), FeatureBuilder(_config("x")), device="cpu")
    one.load_checkpoint_state(loaded.state)
    # the failed second save: the same error on both ranks, nothing of step 3 left behind
    assert "rank 1: disk full" in got[0]["second"] and got[0]["second"] == got[1]["second"]
    assert [c.rsplit("/", 1)[-1] for c in list_checkpoints(model_dir)] == ["model.ckpt-2"]
    assert not [n for n in (tmp_path / "m").iterdir() if n.name.startswith(".model.ckpt")]
    assert got[0]["last_saved_step"] == got[1]["last_saved_step"] == 2
    # two ranks restore from the parts, each reading its own rows' blocks, the tables now
    # placed whole on one rank each (another sharding than the writers'): the same state
    back = ranks.run(_restore_parts_main, 2, str(tmp_path / "r"), path, 1 << 20)[0]
    assert back["global_step"] == 2
    for name, t in want["model"].items():
        np.testing.assert_array_equal(back["model"][name], t, err_msg=name)
    for pname, states in want["sparse_optimizer"].items():
        for k, t in states.items():
            np.testing.assert_array_equal(back["sparse_optimizer"][pname][k], t, err_msg=k)
    # a part lost afterwards: the checkpoint is not trusted
    (tmp_path / "m" / "model.ckpt-2" / "tables.rank-1-of-2.pt").unlink()
    assert "tables.rank-1-of-2.pt is missing" in verify_checkpoint(path)


def test_recovered_rows_go_to_the_shards_that_hold_them():
    """Crash recovery's rows written through ``ShardRows``: each shard takes the rows (and
    columns) it holds, as a whole table would."""
    from odl.train.table_shards import ShardRows

    whole = torch.zeros(6, 4)
    top, bottom = torch.zeros(3, 4), torch.zeros(3, 4)  # rows 0-2 and 3-5 of one table
    rows = ShardRows([((0, 0), top), ((3, 0), bottom)], (6, 4))
    assert rows.shape == (6, 4) and rows[:, :2].shape == (6, 2)
    ids, values = torch.tensor([1, 4, 5]), torch.arange(12.0).view(3, 4)
    rows[ids] = values
    whole[ids] = values
    ids2, values2 = torch.tensor([0, 3]), -torch.ones(2, 2)
    rows[:, :2][ids2] = values2
    whole[:, :2][ids2] = values2
    assert torch.equal(torch.cat([top, bottom]), whole)
    only_bottom = torch.zeros(3, 4)  # a rank holding the bottom rows only
    ShardRows([((3, 0), only_bottom)], (6, 4))[ids] = values
    assert torch.equal(only_bottom, whole[3:] * (whole[3:] > 0))


def test_table_placement_splits_large_tables_and_balances_the_rest():
    tables = {"big": (1 << 20, 16), "a": (1000, 16), "b": (900, 16), "c": (800, 4),
              "d": (100, 16)}
    plan = table_placement(tables, 2, row_wise_min_rows=1 << 20)
    assert plan["big"].row_wise and all(not plan[t].row_wise for t in "abcd")
    assert plan["a"].rank != plan["b"].rank  # the two largest whole tables apart
    assert table_placement(tables, 2, 1 << 20) == plan  # deterministic
    one = table_placement(tables, 1)
    assert all(not p.row_wise and p.rank == 0 for p in one.values())


def test_partitions_split_across_ranks():
    parts = [3, 0, 2, 1, 4]
    split = [rank_partitions(parts, r, 2) for r in range(2)]
    assert split == [[0, 2, 4], [1, 3]]
    assert sorted(sum(split, [])) == sorted(parts)
    assert rank_partitions([5, 9], 1, 2) == [9]  # by position, whatever the numbers
    with pytest.raises(ValueError, match="3 ranks but only 2 partitions"):
        rank_partitions([0, 1], 0, 3)


def test_several_ranks_refuse_what_they_cannot_do_by_field(tmp_path):
    """Publishing, an eval stream, offline files, a file stream with its day and pass
    saves, sequential in-batch learning and per-record Adagrad are things several ranks do;
    the batched shift is refused at start, naming the field."""
    base = bursty_config_text(str(tmp_path / "m"), batch_size=BATCH, buckets=4096,
                              extra_train='incr_save_config { sparse_save_steps: 5 '
                                          'fs { incr_save_dir: "v" } }')
    evaluated = base + '\nkafka_eval_input { server: "127.0.0.1:9092" topic: "eval" }\n'
    check_several_ranks(load_config_text(evaluated), world_size=2)
    check_several_ranks(load_config_text(base), world_size=2)
    kafka = re.search(r"kafka_train_input \{[^}]*\}", base)
    assert kafka is not None
    check_several_ranks(load_config_text(base.replace(kafka.group(0), (
        f'file_stream_input {{ train_data_dir: "{tmp_path / "days"}" start_day: "20260101" '
        f'model_save_path: "{tmp_path}/s" }}'))), world_size=2)

    def in_batch(extra: str):
        return load_config_text(bursty_config_text(
            str(tmp_path / "m"), batch_size=BATCH, buckets=4096,
            extra_train=f"in_batch_learning: true {extra}"))

    check_several_ranks(in_batch("per_record_adagrad: true"), world_size=2)
    with pytest.raises(ConfigError) as err:
        check_several_ranks(in_batch("in_batch_sequential: false"), world_size=2)
    assert err.value.field == "train_config.in_batch_sequential", err.value


def _predict_main(rank: int, model_dir: str, records: list[bytes]) -> np.ndarray:
    """Rank 0 predicts ``records``, rank 1 joins with an empty batch (an evaluation)."""
    config = _config(model_dir)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ROW_WISE_MIN_ROWS)
    return tm.predict(fb.build(records).batch if rank == 0 else tm.empty_batch())


def test_rank_0_predicts_with_the_others_joining_empty(ranks, tmp_path):
    """Evaluation beside training with several ranks: rank 0's predictions through the
    sharded tables equal one process's; the joining rank gets none."""
    records = BurstyStream(seed=10).next_batch(300).encode("csv")
    got = ranks.run(_predict_main, str(tmp_path / "m"), records)
    config = _config(str(tmp_path / "one"))
    fb = FeatureBuilder(config)
    one = TrainModule(config, fb, device="cpu")
    np.testing.assert_allclose(got[0], one.predict(fb.build(records).batch), atol=2e-6, rtol=0)
    assert len(got[1]) == 0


def test_each_rank_of_a_host_takes_its_own_gpu():
    """``--device cuda`` (or auto on a GPU host) under torchrun: rank with LOCAL_RANK i uses
    cuda:i; an explicit index and the CPU stay as given."""
    assert rank_device(torch.device("cuda"), "1") == torch.device("cuda", 1)
    assert rank_device(torch.device("cuda", 0), "1") == torch.device("cuda", 0)
    assert rank_device(torch.device("cpu"), "1") == torch.device("cpu")
    assert rank_device(torch.device("cuda"), None) == torch.device("cuda")
