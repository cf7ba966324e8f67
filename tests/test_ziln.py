"""EasyRec's ZILN_LOSS (``odl/models/ziln.py``): a value that is often 0 learned as a
positive-or-not probability and a lognormal; trained, reported and served as two outputs."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest
import torch

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_error import ConfigError
from odl.config.config_redaction import config_to_text
from odl.config.loss_settings import num_classes, real_valued_labels, regression_outputs
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.models.ziln import ziln_loss, ziln_predictions
from odl.protos import pipeline_pb2
from odl.train.progressive_metrics import ProgressiveMetrics
from odl.train.train_module import TrainModule
from serving_plugin.serving_model import ServingModel
from tests.harness import load_config_text

_CONFIG = """
model_dir: "{model_dir}"
kafka_train_input {{ server: "localhost:9092" topic: "ltv" group: "odl_test" }}
data_config {{
  batch_size: 256
  input_fields {{ input_name: "sample_id" input_type: STRING }}
  input_fields {{ input_name: "ltv" input_type: DOUBLE }}
  input_fields {{ input_name: "user" input_type: STRING }}
  input_fields {{ input_name: "item" input_type: STRING }}
  input_fields {{ input_name: "price" input_type: DOUBLE }}
  label_fields: "ltv"
  sample_id_field: "sample_id"
}}
feature_configs {{ input_names: "user" feature_type: IdFeature embedding_dim: 8
                   hash_bucket_size: 5000 }}
feature_configs {{ input_names: "item" feature_type: IdFeature embedding_dim: 8
                   hash_bucket_size: 5000 }}
feature_configs {{ input_names: "price" feature_type: RawFeature }}
model_config {{
  model_class: "RankModel"
  feature_groups {{ group_name: "all" feature_names: "user" feature_names: "item"
                    feature_names: "price" wide_deep: DEEP }}
  backbone {{
    blocks {{ name: "deep" inputs {{ feature_group_name: "all" }}
      keras_layer {{ class_name: "MLP" mlp {{ hidden_units: [32, 16] }} }} }}
  }}
  num_class: 3
  losses {{ loss_type: ZILN_LOSS loss_name: "LTV" {ziln} }}
}}
train_config {{
  optimizer_config {{ adagrad_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: 0.1 }} }} }} }}
  optimizer_config {{ adam_optimizer {{
    learning_rate {{ constant_learning_rate {{ learning_rate: 0.01 }} }} }} }}
}}
"""


def _config(tmp_path, ziln: str = "", edit: tuple[str, str] = ("", "")):
    text = _CONFIG.format(model_dir=tmp_path / "m", ziln=ziln)
    assert edit[0] in text
    return load_config_text(text.replace(edit[0], edit[1], 1))


class _LtvStream:
    """Records whose value is 0 with a user's odds and lognormal around an item's mean."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.user_logit = rng.normal(0.0, 1.5, 200)
        self.item_mu = rng.uniform(0.0, 3.0, 100)
        self.rng = np.random.default_rng(seed + 1)
        self.count = 0

    def batch(self, n: int) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """``n`` CSV records, each one's expected value and its probability of a value."""
        rng = self.rng
        users = rng.integers(200, size=n)
        items = rng.integers(100, size=n)
        p = 1 / (1 + np.exp(-self.user_logit[users]))
        positive = rng.random(n) < p
        value = np.where(positive, np.exp(rng.normal(self.item_mu[items], 0.4)), 0.0)
        expected = p * np.exp(self.item_mu[items] + 0.08)
        records = [f"s{self.count + k},{value[k]:.5f},u{users[k]},i{items[k]},"
                   f"{rng.random():.3f}".encode() for k in range(n)]
        self.count += n
        return records, expected, p


def _numpy_ziln(logits: np.ndarray, y: np.ndarray, mu_reg=0.01, sigma_reg=0.01,
                max_sigma=5.0, class_weight=1.0, reg_weight=1.0):
    """EasyRec's zero_inflated_lognormal_loss and _pred written out in float64 numpy."""
    p, mu, s = logits[:, 0], logits[:, 1], logits[:, 2]
    pos = (y > 0).astype(np.float64)
    bce = np.mean(np.maximum(p, 0) - p * pos + np.log1p(np.exp(-np.abs(p))))
    sigma = np.clip(np.log1p(np.exp(s)), math.sqrt(1e-7), max_sigma)
    safe = np.where(y > 0, y, 1.0)
    density = np.exp(-(np.log(safe) - mu) ** 2 / (2 * sigma**2)) / (
        safe * sigma * math.sqrt(2 * math.pi))
    reg = -np.sum(pos * np.log(density)) / (pos.sum() + 1e-8)
    loss = (class_weight * bce + reg_weight * reg + mu_reg * np.mean(mu**2)
            + sigma_reg * np.mean(s**2))
    log_pred = -np.log1p(np.exp(-p)) + mu + 0.5 * sigma**2
    return loss, 1 / (1 + np.exp(-p)), log_pred


@pytest.mark.parametrize("fields", [{}, {"max_sigma": 0.7, "mu_regularization": 0.1,
                                          "sigma_regularization": 0.0,
                                          "classification_weight": 0.5,
                                          "regression_weight": 2.0}])
def test_loss_and_predictions_follow_easyrecs_formulas(fields) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, (64, 3))
    y = np.where(rng.random(64) < 0.4, np.exp(rng.normal(1.0, 1.0, 64)), 0.0)
    y[:3] = [-2.0, 0.0, 1e-3]  # a negative value counts as no value
    settings = pipeline_pb2.ZILNLoss(**fields)
    want, probs, log_pred = _numpy_ziln(
        logits, y, settings.mu_regularization, settings.sigma_regularization,
        settings.max_sigma, settings.classification_weight, settings.regression_weight)
    got = ziln_loss(torch.tensor(logits), torch.tensor(y), settings)
    assert abs(float(got) - want) <= 1e-9 * max(1.0, abs(want))
    pred = ziln_predictions(torch.tensor(logits), settings).numpy()
    assert np.allclose(pred[:, 0], probs, rtol=1e-12)
    assert np.allclose(pred[:, 1], np.exp(np.clip(log_pred, -100, 20)), rtol=1e-12)
    settings.return_log_pred_value = True
    settings.max_log_clip_value = -1.0  # the log is not clipped
    assert np.allclose(ziln_predictions(torch.tensor(logits), settings).numpy()[:, 1],
                       log_pred, rtol=1e-12)


def test_a_batch_without_a_positive_value_trains_the_probability_only() -> None:
    logits = torch.zeros(8, 3, requires_grad=True)
    loss = ziln_loss(logits, torch.zeros(8), pipeline_pb2.ZILNLoss(mu_regularization=0,
                                                                   sigma_regularization=0))
    loss.backward()
    assert math.isclose(float(loss), math.log(2), rel_tol=1e-6)
    assert logits.grad is not None and float(logits.grad[:, 1:].abs().sum()) == 0.0


@pytest.mark.parametrize("edit, field, words", [
    (("num_class: 3", "num_class: 1"), "model_config.num_class", "needs num_class: 3"),
    (("num_class: 3", "num_class: 4"), "model_config.num_class", "needs num_class: 3"),
    (('loss_name: "LTV"', 'loss_name: "LTV" } losses { loss_type: L2_LOSS'),
     "model_config.losses[0].loss_type", "only loss term"),
    (('loss_name: "LTV"', 'loss_name: "LTV" ziln_loss { max_sigma: 0 }'),
     "model_config.losses[0].ziln_loss.max_sigma", "> 0"),
    (('loss_name: "LTV"', 'loss_name: "LTV" ziln_loss { regression_weight: -1 }'),
     "model_config.losses[0].ziln_loss.regression_weight", ">= 0"),
])
def test_ziln_settings_are_refused_by_field(tmp_path, edit, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(tmp_path, edit=edit), online=True)
    assert info.value.field == field and words in str(info.value)


def test_a_task_towers_ziln_loss_is_refused_by_field(tmp_path) -> None:
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.harness.model_configs import as_model_config_text

    text = as_model_config_text(deepfm_config_text(str(tmp_path / "m")), "MMoE")
    text = text.replace('tower_name: "cvr" label_name: "buy"',
                        'tower_name: "cvr" label_name: "buy" losses { loss_type: ZILN_LOSS }')
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(load_config_text(text), online=True)
    assert info.value.field.endswith("losses[0].loss_type"), info.value.field
    assert "single-task" in str(info.value)


def test_a_ziln_model_learns_the_value_and_serves_both_outputs(tmp_path) -> None:
    """Trained online (150 steps of 256), the probability ranks positive values within 0.02
    of the true probability's AUC and the value ranks records by their expected value; the
    step scores the probability against value > 0 and the value by squared error; an export
    serves both, equal to the trainer."""
    from odl.auc import roc_auc

    config = _config(tmp_path)
    check_pipeline_config(config, online=True)
    assert num_classes(config) == 1 and regression_outputs(config) == [False, True]
    assert real_valued_labels(config) == {"ltv"}
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    assert module.model.output_names == ("ltv", "ltv_value")
    stream = _LtvStream()
    first = ProgressiveMetrics(20000)
    value = ProgressiveMetrics(20000, regression=True)
    mse_first = None
    for step in range(150):
        records, _expected, _p = stream.batch(256)
        built = fb.build(records)
        assert not built.rejected
        labels = built.batch.labels.numpy()
        out = module.train_step(built.batch)
        assert out.probs.shape == (256, 2)
        first.update(out.probs[:, 0], labels)
        value.update(out.probs[:, 1], labels)
        if step == 9:
            mse_first = value.window_mse()
    summary = first.summary()
    assert 0.3 < summary["positive_rate"] < 0.7, summary
    assert value.window_mse() < 0.8 * mse_first  # squared error of the values falls
    records, expected, p = stream.batch(4000)
    batch = fb.build(records).batch
    got = module.predict(batch)
    positive = batch.labels.numpy() > 0
    oracle = roc_auc(positive, p)
    assert roc_auc(positive, got[:, 0]) > oracle - 0.02
    ranks = [np.argsort(np.argsort(v)) for v in (got[:, 1], expected)]
    assert np.corrcoef(*ranks)[0, 1] > 0.9  # the value follows the expected value
    path = CheckpointManager(config.model_dir).save(
        module.global_step, module.state_dict_for_checkpoint(), {0: stream.count},
        {"source": "kafka", "topic": "ltv"}, config_to_text(config), generation="gen0")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    with open(os.path.join(export, "serving_model.json"), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["outputs"] == ["ltv", "ltv_value"]
    assert meta["output_kinds"] == ["probability", "value"]
    served = ServingModel.load(os.path.dirname(export))
    values, _, _ = stream.batch(300)
    want = module.predict(fb.build(values).batch)
    answered, rejected = served.predict_values(values)
    assert rejected == [] and np.asarray(answered).shape == (300, 2)
    assert np.abs(np.asarray(answered) - want).max() <= 1e-6


def test_the_trainer_reports_both_outputs_from_the_broker(tmp_path, kafka_bootstrap,
                                                        kafka_topic_factory) -> None:
    """``odl-train --online``'s trainer on a topic of values: every record trained once,
    /status reports the probability's AUC against value > 0 and the value's squared error."""
    from odl.harness.topic_records import produce
    from tests.harness import run_in_process

    topic = kafka_topic_factory()
    stream = _LtvStream(seed=4)
    records = [r for _ in range(24) for r in stream.batch(256)[0]]
    produce(kafka_bootstrap, topic, records)
    text = _CONFIG.format(model_dir=tmp_path / "m", ziln="").replace(
        'server: "localhost:9092" topic: "ltv"', f'server: "{kafka_bootstrap}" topic: "{topic}"')
    path = tmp_path / "ltv.config"
    path.write_text(text)
    trainer = run_in_process(str(path), {0: len(records)})
    status = trainer.status()
    assert status["samples_trained"] == len(records), status["samples_trained"]
    progressive = status["progressive"]
    assert progressive["auc"] > 0.6 and 0.3 < progressive["positive_rate"] < 0.7, progressive
    value = status["tasks"]["ltv_value"]
    assert value["mse"] is not None and value["auc"] is None, value


def test_serving_replays_both_outputs_to_the_trainers(kafka_bootstrap, kafka_topic_factory,
                                                      tmp_path) -> None:
    """A ZILN RankModel trained from Kafka with publishing: an early export plus the replayed
    deltas answer /predict with both outputs equal to the trainer's (<= 1e-6), also for
    requests without the label column."""
    from tests.test_online_parity import (
        _check_serving_parity,
        _incr_save,
        _train_with_publishing,
    )

    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model="RankModel",
        edits=(('model_class: "RankModel"',
                'model_class: "RankModel"\n  num_class: 3\n  losses { loss_type: ZILN_LOSS }'),))
    assert trainer.module.model.output_names == ("label", "label_value")
    status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert status["versions_applied"] >= 2 and diff <= 1e-6
