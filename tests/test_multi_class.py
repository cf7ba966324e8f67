"""``num_class`` C > 1: C outputs (the softmax over C logits), class-index labels trained by
softmax cross entropy, served to parity."""

from __future__ import annotations

import os

import numpy as np
import pytest

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.train.memory_estimate import estimate_memory
from odl.train.train_module import TrainModule
from serving_plugin.serving_model import ServingModel
from tests.harness import assert_edit_refused, load_config_text, synthetic_records


def _classes(records: list[bytes]) -> list[bytes]:
    """The records with their label replaced by a class (0, 1, 2) of their I1 and label."""
    out = []
    for r in records:
        f = r.split(b",")
        i1 = float(f[3])
        f[2] = str(int(f[2]) + (1 if i1 >= 1.5 else 0)).encode()
        out.append(b",".join(f))
    return out


def _text(tmp_path, model: str) -> str:
    text = as_model_config_text(deepfm_config_text(str(tmp_path / "m"), dim=8, buckets=100,
                                                   hidden_units=(16,)), model)
    text = text.replace(f'model_class: "{model}"', f'model_class: "{model}"\n  num_class: 3')
    return text.replace("wide_output_dim: 1", "wide_output_dim: 3")


@pytest.mark.parametrize("model", ["DeepFM", "MultiTower"])
def test_a_three_class_model_trains_and_serves_its_softmax(tmp_path, model) -> None:
    config = load_config_text(_text(tmp_path, model))
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    assert module.model.output_names == ("label_0", "label_1", "label_2")
    assert estimate_memory(config, "cpu").dense_parameters == sum(
        p.numel() for p in module.model.dense.parameters())
    held = fb.build(_classes(synthetic_records(600, seed=50))).batch
    y = held.labels.numpy().argmax(axis=1)
    assert held.labels.shape == (600, 3) and set(held.labels.sum(dim=1).tolist()) == {1.0}
    before = module.predict(held)
    for step in range(40):
        out = module.train_step(fb.build(_classes(synthetic_records(128, seed=step))).batch)
        assert out.probs.shape == (128, 3)
    after = module.predict(held)
    assert np.allclose(after.sum(axis=1), 1.0)

    def xent(p):
        return -np.mean(np.log(p[np.arange(len(y)), y]))

    assert xent(after) < xent(before) - 0.05
    path = CheckpointManager(config.model_dir).save(
        module.global_step, module.state_dict_for_checkpoint(), {0: 1},
        {"source": "kafka", "topic": "t"}, config_to_text(config), generation="g")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    values = _classes(synthetic_records(200, seed=77))
    got, rejected = ServingModel.load(os.path.dirname(export)).predict_values(values)
    want = module.predict(fb.build(values).batch)
    assert rejected == [] and got.shape == (200, 3) and np.abs(got - want).max() <= 1e-6


def test_a_class_label_is_an_index_below_num_class(tmp_path) -> None:
    fb = FeatureBuilder(load_config_text(_text(tmp_path, "DeepFM")))
    good = _classes(synthetic_records(1, seed=3))[0]
    fields = good.split(b",")
    bad = [b",".join(fields[:2] + [v] + fields[3:]) for v in (b"3", b"1.5", b"-1")]
    built = fb.build([good, *bad])
    assert built.rejected == [(1, "bad_label"), (2, "bad_label"), (3, "bad_label")]


@pytest.mark.parametrize("model, edit, field, words", [
    ("DeepFM", ("num_class: 3", "num_class: 3\n  loss_type: L2_LOSS"),
     "model_config.loss_type", "softmax cross entropy"),
    ("DeepFM", ("wide_output_dim: 3", "wide_output_dim: 1"),
     "model_config.deepfm.wide_output_dim", "num_class (3)"),
    ("MMoE", ("num_class: 3", "num_class: 3"), "model_config.num_class", "binary"),
    ("DeepFM", ('input_name: "label" input_type: INT32', 'input_name: "label" input_type: STRING'),
     "data_config.label_fields[0]", "numeric field"),
])
def test_num_class_errors_name_the_field(tmp_path, model, edit, field, words) -> None:
    assert_edit_refused(_text(tmp_path, model), edit, field, words)
