"""EasyRec's RankModel (``odl/models/rank_model.py``): a backbone built from a config learns,
serves what it trains and restarts exactly once; the config checks name fields."""

from __future__ import annotations

import pytest
import torch

from odl.config.config_error import ConfigError
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.models.model_registry import check_pipeline_config, registered_model_classes
from odl.train.train_module import TrainModule
from tests.harness import load_config_text
from tests.model_checks import restart_inside_a_pass, serving_replay_diff, stream_auc


def _config(edit: tuple[str, str] = ("", "")):
    text = as_model_config_text(deepfm_config_text("/tmp/unused"), "RankModel")
    assert edit[0] in text
    return load_config_text(text.replace(edit[0], edit[1], 1))


def test_rank_model_is_registered_by_its_module() -> None:
    assert registered_model_classes()["RankModel"].build.__module__ == "odl.models.rank_model"


def test_each_feature_is_looked_up_once_and_wide_groups_read_wide_tables() -> None:
    """C1..C26 sit in the wide and the deep group: one deep and one wide lookup each, in one
    pooled group (deep first); the logit is the wide weights' sum plus the deep tower's."""
    config = _config()
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    model = tm.model
    (group,) = model.pooled_layout
    features = [f for f, _t in group.lookups]
    tables = [t for _f, t in group.lookups]
    assert features == [f"C{i}" for i in range(1, 27)] * 2
    assert all(not t.endswith("_wide") for t in tables[:26])
    assert all(t.endswith("_wide") for t in tables[26:])
    assert group.dims[26:] == (1,) * 26


@pytest.mark.parametrize("edit, field", [
    (("l2_regularization: 1e-5", "l2_regularization: -1"),
     "model_config.model_params.l2_regularization"),
    (('input_fn: "lambda x: tf.add_n(x)"', 'input_fn: "lambda x: eval(x)"'),
     "model_config.backbone.blocks[3].inputs[0].input_fn"),
    (('class_name: "Add"', 'class_name: "Attention"'),
     "model_config.backbone.blocks[3].keras_layer.class_name"),
    (("wide_output_dim: 1", "wide_output_dim: 2"), "model_config.backbone.blocks[3].keras_layer"),
])
def test_rank_model_settings_are_refused_by_field(edit, field) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(edit), online=True)
    assert info.value.field.startswith(field), info.value.field


def test_rank_model_learns_the_synthetic_stream() -> None:
    """Trained online on the Criteo-like stream (80 steps of 256), the backbone ranks the
    next records above chance."""
    assert stream_auc("RankModel", 80) > 0.6


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts (max abs diff <= 1e-6)."""
    status, diff = serving_replay_diff("RankModel", "BackboneDense", tmp_path, kafka_bootstrap,
                                       kafka_topic_factory)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once
    (the sample ledger), and serving from the first day's base + the pass deltas predicts
    what the restarted trainer predicts."""
    assert restart_inside_a_pass("RankModel", tmp_path) <= 1e-6


def test_the_dense_part_scripts_to_the_same_logits() -> None:
    config = _config()
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    dense.eval()
    pooled = torch.randn(7, tm.model.pooled_layout[0].width)
    raw = torch.randn(7, len(fb.dense_feature_names))
    torch.testing.assert_close(torch.jit.script(dense)(pooled, raw), dense(pooled, raw))


@pytest.mark.parametrize("edit, added", [
    (("", ""), False),  # the logit is the Add block's output: nothing goes around it
    (('    concat_blocks: "logit"\n', '    concat_blocks: "logit"\n    top_mlp { '
      "hidden_units: [4] use_bn: false use_final_bn: false }\n"), True),
    (("l2_regularization: 1e-5 }", "l2_regularization: 1e-5 wide_to_logit: false }"), False),
])
def test_wide_to_logit_adds_the_wide_weights_where_layers_stand_before_the_logit(
        edit, added) -> None:
    """With a top_mlp the 26 wide lookups (after the 26 deep ones) join the logit; without
    one, or with wide_to_logit: false, they do not."""
    config = _config(edit)
    model = TrainModule(config, FeatureBuilder(config), device="cpu").model
    deep = sum(model.layout.deep_dims)
    assert len(model.layout.wide_keys) == 26 and model.pooled_layout[0].width == deep + 26
    assert model.dense.wide_start == (deep if added else -1)
