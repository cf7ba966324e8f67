"""EasyRec's ``train_config.freeze_gradient`` (``odl.train.frozen_parameters``): a frozen
parameter keeps its values and its optimizer state while everything else trains, on one rank
and on two, and a pattern odl cannot honour exactly is refused by field.

The configs are EasyRec's own sample (``tests/compat_configs/easyrec/
deepfm_freeze_gradient.config``: DeepFM, Adam tables, ``freeze_gradient:
"input_layer_1.*embedding_weights"``, i.e. the ``deep`` group's embeddings, EasyRec reading
its ``wide`` group first) with tables capped and small batches, as the compatibility test
trains it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.train.startup_checks import check_start
from odl.train.train_module import TrainModule
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

_SAMPLE = os.path.join(_HERE, "easyrec", "deepfm_freeze_gradient.config")
_SAMPLE_PATTERN = "input_layer_1.*embedding_weights"
_ADAGRAD = ("adagrad_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.05 "
            "} } initial_accumulator_value: 0.1 }")
_SGD = "sgd_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.05 } } }"
_FTRL = ("ftrl_optimizer { learning_rate { constant_learning_rate { learning_rate: 0.05 } } "
         "l2_reg: 0.001 }")


def _config(model_dir: str, optimizer: str = "", patterns: tuple[str, ...] | None = None):
    """The sample as the compatibility test trains it; ``optimizer``: another table and
    dense optimizer (EasyRec's text); ``patterns``: other freeze_gradient patterns."""
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    config.model_dir = model_dir
    if optimizer:
        oc = config.train_config.optimizer_config[0]
        oc.Clear()
        text_format.Merge(optimizer, oc)
    if patterns is not None:
        del config.train_config.freeze_gradient[:]
        config.train_config.freeze_gradient.extend(patterns)
    return config


def _deep_tables(config) -> set[str]:
    """The tables of the sample's ``deep`` group (the one EasyRec reads second)."""
    (deep,) = [g for g in config.model_config.feature_groups if g.group_name == "deep"]
    return set(deep.feature_names)


def _state(tm: TrainModule) -> dict[str, np.ndarray]:
    """Tables, their optimizer state and the dense parameters, by name (copies)."""
    state = tm.state_dict_for_checkpoint()
    out = {k: v.detach().clone().numpy() for k, v in state["model"].items()}
    for entries in state["sparse_optimizer"].values():
        out.update({k: torch.as_tensor(v).clone().numpy() for k, v in entries.items()
                    if isinstance(v, torch.Tensor)})
    return out


def _moved(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    return {k for k in before if not np.array_equal(before[k], after[k])}


def _assert_tables_moved_but(before: dict[str, np.ndarray], moved: set[str],
                             frozen: set[str]) -> None:
    """Every table moved but the ``frozen`` ones, which kept their rows and state."""
    assert not {k for k in moved if _table(k) in frozen}
    tables = {_table(k) for k in before if k.startswith("ebc.")}
    assert {_table(k) for k in moved if k.startswith("ebc.")} == tables - frozen


def _table(key: str) -> str:
    """``ebc.embedding_bags.<t>.weight`` / ``<t>.<state>`` -> ``<t>``."""
    return key.removeprefix("ebc.embedding_bags.").split(".")[0]


@pytest.mark.parametrize("optimizer", ["", _ADAGRAD, _SGD, _FTRL],
                         ids=["adam_row_sparse", "adagrad_fused", "sgd_fused", "ftrl_row_sparse"])
def test_the_sample_trains_all_but_its_deep_embeddings_from_a_trained_state(tmp_path,
                                                                            optimizer) -> None:
    """A model trained without freezing (so every table has optimizer state) is restored
    into the sample's config: the deep group's tables and their optimizer state (Adam's
    moments, Adagrad's and FTRL's accumulators) stay bit for bit; every wide table, its
    state and the dense part move."""
    unfrozen = _config(str(tmp_path / "a"), optimizer, patterns=())
    fb = FeatureBuilder(unfrozen)
    warm = TrainModule(unfrozen, fb, device="cpu")
    for step in range(3):
        warm.train_step(fb.build(_records(unfrozen, 32, seed=step)).batch)
    config = _config(str(tmp_path / "b"), optimizer)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    deep = _deep_tables(config)
    assert tm.frozen.tables == deep and not tm.frozen.dense
    tm.load_checkpoint_state(warm.state_dict_for_checkpoint())
    before = _state(tm)
    assert optimizer == _SGD or any(_table(k) in deep and "weight" not in k and before[k].any()
                                    for k in before)  # a state to keep (SGD has none)
    for step in range(3, 7):
        tm.train_step(fb.build(_records(config, 32, seed=step)).batch)
    moved = _moved(before, _state(tm))
    _assert_tables_moved_but(before, moved, deep)
    state = {k for k in before if not k.startswith(("ebc.", "dense."))}
    assert {k for k in state if _table(k) not in deep} <= moved  # the wide tables' state
    assert {k for k in before if k.startswith("dense.")} <= moved


def test_dense_parameters_freeze_by_their_odl_names(tmp_path) -> None:
    """``dense\\.dnn\\.`` freezes the DNN's layers and nothing else: they keep their values
    (and take no gradient) while the final DNN and every table train."""
    config = _config(str(tmp_path / "m"), patterns=(r"dense\.dnn\.",))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    assert not tm.frozen.tables
    assert tm.frozen.dense == {k for k in tm.dense_parameters() if k.startswith("dense.dnn.")}
    before = _state(tm)
    for step in range(4):
        tm.train_step(fb.build(_records(config, 32, seed=step)).batch)
    moved = _moved(before, _state(tm))
    assert not {k for k in moved if k.startswith("dense.dnn.")}
    assert {k for k in before if k.startswith("dense.final_dnn.")} <= moved
    assert {_table(k) for k in moved if k.startswith("ebc.")} == {
        _table(k) for k in before if k.startswith("ebc.")}
    assert all(p.grad is None for n, p in tm.model.dense.named_parameters()
               if n.startswith("dnn."))


def _frozen_rank(rank: int, world: int, model_dir: str, start: str, steps: list) -> dict:
    """One rank of two training the sample from a saved state: the gathered tables and
    their optimizer state before and after (rank 0)."""
    config = _config(model_dir, patterns=(_SAMPLE_PATTERN, r"dense\.dnn\.0\."))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    tm.load_checkpoint_state(torch.load(start, weights_only=False))
    before = _state(tm) if rank == 0 else tm.state_dict_for_checkpoint()
    for step in steps:
        tm.train_step(fb.build(step[rank]).batch)
    after = _state(tm) if rank == 0 else tm.state_dict_for_checkpoint()
    return {k: (v, after[k]) for k, v in before.items()} if rank == 0 else {}


def test_two_ranks_keep_the_frozen_tables_wherever_their_shards_live(ranks, tmp_path) -> None:
    """From a state one process trained without freezing (Adam moments everywhere): over
    two ranks the frozen tables (wherever their shards live) and the frozen first DNN layer
    (whose gradient the ranks do not average) keep their values and moments."""
    unfrozen = _config(str(tmp_path / "a"), patterns=())
    fb = FeatureBuilder(unfrozen)
    warm = TrainModule(unfrozen, fb, device="cpu")
    for step in range(3):
        warm.train_step(fb.build(_records(unfrozen, 32, seed=step)).batch)
    start = str(tmp_path / "start.pt")
    torch.save(warm.state_dict_for_checkpoint(), start)
    steps = [[_records(unfrozen, 32, seed=10 * k + r) for r in range(2)] for k in range(3)]
    got = ranks.run(_frozen_rank, 2, str(tmp_path / "m"), start, steps)[0]
    moved = {k for k, (a, b) in got.items() if not np.array_equal(a, b)}
    deep = _deep_tables(unfrozen)
    assert not {k for k in moved if _table(k) in deep}
    tables = {_table(k) for k in got if k.startswith("ebc.")}
    assert {_table(k) for k in moved if k.startswith("ebc.")} == tables - deep
    assert not {k for k in moved if k.startswith("dense.dnn.0.")}
    assert {k for k in got if k.startswith("dense.") and "weight" in k
            and not k.startswith("dense.dnn.0.")} <= moved


# ---- refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize(("patterns", "message"), [
    (("input_layer_1/(",), "is not a regular expression"),
    (("dnn/hiddenlayer_0/kernel",), "matches no parameter"),  # EasyRec's dense names
    (("input_layer_1.*embedding_weights", "no_such"), "matches no parameter"),
])
def test_a_pattern_odl_cannot_honour_is_refused_at_start(tmp_path, patterns, message) -> None:
    config = _config(str(tmp_path / "m"), patterns=patterns)
    check_pipeline_config(config, online=True)
    with pytest.raises(ConfigError, match=message) as err:
        check_start(config, online=True, device="cpu")
    assert err.value.field.startswith("train_config.freeze_gradient")
    if len(patterns) > 1:
        assert err.value.field == "train_config.freeze_gradient[1]"
    if "no parameter" in message:  # the names it is searched in
        assert "ebc.embedding_bags." in str(err.value) and "input_layer" in str(err.value)


def test_a_pattern_over_one_of_two_easyrec_variables_of_a_table_is_refused(tmp_path) -> None:
    """With DeepFM's ``fm`` group EasyRec holds ``hour``'s deep embedding twice (its deep and
    fm input layers, ``input_layer_1`` and ``input_layer_2``); odl holds one table."""
    config = _config(str(tmp_path / "m"))
    config.model_config.feature_groups.add(group_name="fm", feature_names=["hour"])
    check_pipeline_config(config, online=True)
    with pytest.raises(ConfigError, match="input_layer_2/hour_embedding") as err:
        check_start(config, online=True, device="cpu")
    assert err.value.field == "train_config.freeze_gradient"
    config.train_config.freeze_gradient[0] = "input_layer_[12]/.*embedding_weights"
    check_start(config, online=True, device="cpu")  # both: the table freezes


def test_in_batch_learning_refuses_frozen_parameters(tmp_path) -> None:
    config = _config(str(tmp_path / "m"), _ADAGRAD)
    config.train_config.in_batch_learning = True
    with pytest.raises(ConfigError) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == "train_config.freeze_gradient"
    config.train_config.ClearField("in_batch_learning")  # unwritten: decided off
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    assert tm.in_batch_mode == "off"


_TZ_FROZEN = os.path.join(_HERE, "torcheasyrec", "multi_tower_din_mock_frozen.config")


def test_torcheasyrecs_trainable_false_freezes_those_features_tables(tmp_path) -> None:
    """TorchEasyRec's sample ``multi_tower_din_mock_frozen``: ``id_1``, the bucketized
    ``raw_1`` and the sequence's ``click_50_seq__raw_1`` (``trainable: false``) keep their rows
    and optimizer state while every other table and the dense part train; in-batch learning
    refuses it by the feature's field."""
    config = _small_cpu_config(try_load.load_one(_TZ_FROZEN, "torcheasyrec"))
    config.model_dir = str(tmp_path / "m")
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    frozen = {"id_1", "raw_1", "click_50_seq__raw_1"}
    assert tm.frozen.tables == frozen and not tm.frozen.dense
    for step in range(2):  # optimizer state to keep
        tm.train_step(fb.build(_records(config, 32, seed=step)).batch)
    before = _state(tm)
    for step in range(2, 5):
        tm.train_step(fb.build(_records(config, 32, seed=step)).batch)
    _assert_tables_moved_but(before, _moved(before, _state(tm)), frozen)
    config.train_config.in_batch_learning = True
    with pytest.raises(ConfigError, match="frozen tables") as err:
        check_pipeline_config(config, online=True)
    assert err.value.field.endswith(".trainable")


# ---- publishing ---------------------------------------------------------------------------

def test_frozen_tables_are_not_republished_and_serving_equals_the_trainer(
        kafka_bootstrap, kafka_topic_factory, tmp_path) -> None:
    """The Criteo-like DeepFM (groups wide, deep) with EasyRec's sample pattern, trained from
    the broker with publishing: its versions carry rows of the wide tables only (the deep
    tables' rows never change), and an early export plus the replayed versions predict what
    the trainer predicts."""
    import time

    from odl.harness.delta_topic_audit import audit_delta_topic
    from publisher.id_maps import read_id_maps
    from tests.test_online_parity import (
        _check_serving_parity,
        _incr_save,
        _train_with_publishing,
    )

    delta_topic = f"odl-deltas-frozen-{os.getpid()}-{time.time_ns()}"
    freeze = ("save_checkpoints_steps: 4",
              f'save_checkpoints_steps: 4 freeze_gradient: "{_SAMPLE_PATTERN}"')
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), n=800, edits=(freeze,))
    tables = set(trainer.module.table_shapes())
    deep = {t for t in tables if not t.endswith("_wide")}
    assert trainer.module.frozen.tables == deep and deep
    _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    names = read_id_maps(trainer.model_dir).table_names()
    audit = audit_delta_topic(kafka_bootstrap, delta_topic)
    assert not audit.incomplete and not audit.rejected
    assert {names[i] for i in audit.sparse_tables} == tables - deep
