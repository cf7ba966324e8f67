"""Regression outputs (every loss term ``L2_LOSS``): real-valued labels, the logit itself as
the prediction in training and serving, and squared error as the progressive metric."""

from __future__ import annotations

import os

import numpy as np
import pytest

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.config.loss_settings import real_valued_labels, regression_outputs
from odl.datagen.datagen_config import deepfm_config_text
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.train.progressive_metrics import ProgressiveMetrics, TaskMetrics
from odl.train.train_module import TrainModule
from serving_plugin.serving_model import ServingModel
from tests.harness import load_config_text, synthetic_records


def _with_real_labels(records: list[bytes], seed: int) -> list[bytes]:
    """The records with their label (the third CSV field) replaced by a real number."""
    rng = np.random.default_rng(seed)
    out = []
    for r in records:
        fields = r.split(b",")
        fields[2] = f"{float(fields[2]) * 3.0 + rng.normal(0.5, 0.2):.4f}".encode()
        out.append(b",".join(fields))
    return out


def _config(tmp_path, model: str = "DeepFM") -> str:
    text = as_model_config_text(deepfm_config_text(str(tmp_path / "m"), dim=8, buckets=50,
                                                   hidden_units=(16,)), model)
    if model == "DeepFM":
        return text.replace('model_class: "DeepFM"',
                            'model_class: "DeepFM"\n  losses { loss_type: L2_LOSS }')
    return text.replace('tower_name: "cvr" label_name: "buy"',
                        'tower_name: "cvr" label_name: "buy" loss_type: L2_LOSS')


def test_an_l2_output_reads_real_labels_and_predicts_its_logit(tmp_path) -> None:
    config = load_config_text(_config(tmp_path))
    assert regression_outputs(config) == [True] and real_valued_labels(config) == {"label"}
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    values = _with_real_labels(synthetic_records(300, seed=99), 99)
    batch = fb.build(values).batch
    labels = batch.labels.numpy()
    before = np.mean((module.predict(batch) - labels) ** 2)
    for step in range(30):
        built = fb.build(_with_real_labels(synthetic_records(128, seed=step), step))
        assert not built.rejected
        module.train_step(built.batch)
    got = module.predict(batch)
    assert got.max() > 1.0  # values, not probabilities
    assert np.mean((got - labels) ** 2) < 0.5 * before  # trained toward the labels
    # served: the same values from the export
    path = CheckpointManager(config.model_dir).save(
        module.global_step, module.state_dict_for_checkpoint(), {0: 1},
        {"source": "kafka", "topic": "t"}, config_to_text(config), generation="g")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    served, rejected = ServingModel.load(os.path.dirname(export)).predict_values(values)
    assert rejected == [] and np.abs(served - got).max() <= 1e-6


def test_a_classification_label_stays_zero_or_one(tmp_path) -> None:
    """MMoE with a regression "cvr" task: its label is real, "label" (ctr) still 0/1."""
    config = load_config_text(_config(tmp_path, "MMoE"))
    assert regression_outputs(config) == [False, True]
    assert real_valued_labels(config) == {"buy"}
    fb = FeatureBuilder(config)
    good = b"s1,1767225600.0,1," + b",".join(b"1.0" for _ in range(13)) + b"," + b",".join(
        f"c{i}".encode() for i in range(1, 27)) + b",2.75"
    built = fb.build([good, good.replace(b",1,1.0,", b",2,1.0,", 1)])
    assert built.rejected == [(1, "bad_label")]
    assert built.batch.labels[0].tolist() == [1.0, 2.75]


def test_progressive_squared_error_of_a_regression_output() -> None:
    m = ProgressiveMetrics(window=4, regression=True)
    m.update(np.array([1.0, 2.0, 3.0]), np.array([1.5, 2.0, 1.0]))
    m.update(np.array([0.0, 4.0]), np.array([1.0, 4.0]))
    window = np.array([0.0, 4.0, 1.0, 0.0])  # the last four squared errors
    s = m.summary()
    assert s["mse"] == pytest.approx(window.mean())
    assert s["mse_total"] == pytest.approx((0.25 + 0 + 4 + 1 + 0) / 5)
    assert s["auc"] is None and s["logloss"] is None and s["auc_total"] is None
    first = ProgressiveMetrics(window=10)
    tasks = TaskMetrics([("ctr", 0), ("watch", 1)], first, 10, [False, True])
    probs, labels = np.array([[0.9, 3.0], [0.2, 1.0]]), np.array([[1.0, 2.0], [0.0, 1.0]])
    first.update(probs[:, 0], labels[:, 0])  # the trainer updates the first output's itself
    tasks.update(probs, labels)
    summary = tasks.summary()
    assert summary["watch"]["mse"] == pytest.approx(0.5) and "mse" not in summary["ctr"]
    assert summary["ctr"]["auc"] == 1.0
