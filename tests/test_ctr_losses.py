"""The prediction losses (``odl.models.ctr_losses``): each term's formula, weighted sums, and
training with every loss through the real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.config.config_validation import validate_pipeline_config
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import as_model_config_text, deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_losses import ctr_loss
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule

S = torch.tensor([2.0, -1.0, 0.5, -0.3, 1.2], dtype=torch.float64)
Y = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)


def _terms(text: str) -> list[pipeline_pb2.Loss]:
    mc = text_format.Parse(text, pipeline_pb2.EasyRecModel())
    return list(mc.losses)


def _sig(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_each_loss_is_its_formula() -> None:
    s, y = S.numpy(), Y.numpy()
    p = _sig(s)
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    got = {name: float(ctr_loss(S, Y, _terms(text))) for name, text in {
        "bce": "losses { loss_type: CLASSIFICATION }",
        "ce": "losses { loss_type: CROSS_ENTROPY_LOSS }",
        "l2": "losses { loss_type: SIGMOID_L2_LOSS }",
        "focal0": "losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { gamma: 0 } }",
        "focal": "losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { alpha: 0.25 } }",
        "pair": "losses { loss_type: PAIR_WISE_LOSS pairwise_loss { margin: 0.5 } }",
        "logistic": "losses { loss_type: PAIRWISE_LOGISTIC_LOSS "
                    "pairwise_logistic_loss { temperature: 2 } }",
        "sum": "losses { loss_type: CLASSIFICATION weight: 0.7 } "
               "losses { loss_type: SIGMOID_L2_LOSS weight: 0.3 }",
    }.items()}
    p_t = np.where(y > 0.5, p, 1 - p)
    pos, neg = s[y > 0.5], s[y <= 0.5]
    diff = (pos[:, None] - neg[None, :]).ravel()
    want = {
        "bce": bce.mean(), "ce": bce.mean(), "l2": ((p - y) ** 2).mean(),
        "focal0": bce.mean(),
        "focal": (np.where(y > 0.5, 0.25, 0.75) * (1 - p_t) ** 2 * bce).mean(),
        "pair": np.log1p(np.exp(-(diff - 0.5))).mean(),
        "logistic": np.log1p(np.exp(-diff / 2)).mean(),
        "sum": 0.7 * bce.mean() + 0.3 * ((p - y) ** 2).mean(),
    }
    for name, value in want.items():  # proto floats are float32: 0.7 is 0.699999988
        assert got[name] == pytest.approx(value, rel=1e-9 if name != "sum" else 1e-7), name
    one_class = torch.ones(3, dtype=torch.float64)  # no pairs: the pairwise term is 0
    assert float(ctr_loss(S[:3], one_class, _terms("losses { loss_type: PAIR_WISE_LOSS }"))) == 0


@pytest.mark.parametrize("model, losses", [
    ("DeepFM", "losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { gamma: 2 } }"),
    ("DeepFM", "losses { loss_type: SIGMOID_L2_LOSS }"),
    ("DCN", "losses { loss_type: CLASSIFICATION weight: 1 } "
            "losses { loss_type: PAIRWISE_LOGISTIC_LOSS weight: 0.5 }"),
])
def test_training_with_each_loss_learns(tmp_path, model: str, losses: str) -> None:
    text = as_model_config_text(deepfm_config_text(str(tmp_path / "m"), batch_size=256), model)
    text = text.replace(f'model_class: "{model}"', f'model_class: "{model}"\n  {losses}')
    config = parse_pipeline_config_text(text)
    validate_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=3)
    held_out = fb.build(stream.next_batch(2000).encode("csv")).batch
    before = tm.predict(held_out)
    for _ in range(40):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    after = tm.predict(held_out)
    labels = held_out.labels.numpy()
    from odl.auc import roc_auc

    assert np.isfinite(after).all()
    assert roc_auc(labels, after) > roc_auc(labels, before) + 0.05


def test_session_pairs_are_refused_by_field(tmp_path) -> None:
    text = deepfm_config_text(str(tmp_path / "m"), batch_size=64).replace(
        'model_class: "DeepFM"', 'model_class: "DeepFM"\n  losses { loss_type: PAIR_WISE_LOSS '
        'pairwise_loss { session_name: "user_id" } }')
    with pytest.raises(ConfigError, match="session") as info:
        validate_pipeline_config(parse_pipeline_config_text(text), online=True)
    assert info.value.field == "model_config.losses[0].pairwise_loss.session_name"
