"""The prediction losses (``odl.models.ctr_losses``): each term's formula, weighted sums, and
training with every loss through the real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.models.ctr_losses import ctr_loss
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule

S = torch.tensor([2.0, -1.0, 0.5, -0.3, 1.2], dtype=torch.float64)
Y = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)


def _module_and_stream(text: str) -> tuple[FeatureBuilder, TrainModule, SyntheticCtrStream]:
    """The config's feature builder and a fresh train module, and the synthetic stream."""
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    return fb, TrainModule(config, fb, device="cpu"), SyntheticCtrStream(seed=3)


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


def _f1_reference(s: np.ndarray, y: np.ndarray, beta2: float, ls: float) -> float:
    """EasyRec's f1_reweight_sigmoid_cross_entropy, written out in numpy."""
    p = _sig(s)
    n = len(s)
    num_pos = y.sum()
    tp = p.sum()
    neg_w = tp / (beta2 * num_pos + (n - num_pos) - (n - tp) + 1e-8)
    w = np.where(y == 1, 1.0, neg_w)
    t = y * (1 - ls) + 0.5 * ls
    ce = -(t * np.log(p) + (1 - t) * np.log(1 - p))
    return float((w * ce).sum() / (w != 0).sum())


def _pairwise_focal_reference(s: np.ndarray, y: np.ndarray, gamma: float = 2.0,
                              alpha: float | None = None, hinge: float | None = None,
                              temperature: float = 1.0, ohem: float = 1.0) -> float:
    """EasyRec's pairwise_focal_loss (sigmoid_focal_loss_with_logits on pair differences)."""
    losses, weights = [], []
    for i in range(len(s)):
        for j in range(len(s)):
            if not y[i] > y[j]:
                continue
            d = (s[i] - s[j]) / temperature
            if hinge is not None and not d < hinge:
                continue
            q = min(max(_sig(d), 1e-7), 1 - 1e-7)
            w = (1 - q) ** gamma * (alpha if alpha is not None else 1.0)
            weights.append(w)
            losses.append(w * np.log1p(np.exp(-d)))
    losses_a = np.array(losses)
    if ohem == 1.0:
        return float(losses_a.sum() / (np.array(weights) != 0).sum())
    k = int(np.rint(len(losses_a) * ohem))
    top = np.sort(losses_a)[::-1][:k]
    return float(top[top > 0].mean())


def test_easyrec_losses_match_their_references() -> None:
    s, y = S.numpy(), Y.numpy()
    cases = {
        "losses { loss_type: L2_LOSS }": ((s - y) ** 2).mean(),
        "losses { loss_type: F1_REWEIGHTED_LOSS }": _f1_reference(s, y, 1.0, 0.0),
        "losses { loss_type: F1_REWEIGHTED_LOSS f1_reweighted_loss { f1_beta_square: 2.25 } }":
            _f1_reference(s, y, 2.25, 0.0),
        "losses { loss_type: F1_REWEIGHTED_LOSS "
        "f1_reweighted_loss { f1_beta_square: 0.5 label_smoothing: 0.25 } }":
            _f1_reference(s, y, 0.5, 0.25),
        "losses { loss_type: PAIRWISE_FOCAL_LOSS }": _pairwise_focal_reference(s, y),
        "losses { loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { gamma: 1 alpha: 0.25 "
        "temperature: 2 } }": _pairwise_focal_reference(s, y, 1.0, 0.25, temperature=2.0),
        "losses { loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { hinge_margin: 1 } }":
            _pairwise_focal_reference(s, y, hinge=1.0),
        "losses { loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { ohem_ratio: 0.5 } }":
            _pairwise_focal_reference(s, y, ohem=0.5),
    }
    for text, want in cases.items():
        assert float(ctr_loss(S, Y, _terms(text))) == pytest.approx(want, rel=1e-9), text
    # the hinge drops pairs already apart by the margin; OHEM keeps the hardest half
    base = cases["losses { loss_type: PAIRWISE_FOCAL_LOSS }"]
    assert cases["losses { loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { "
                 "hinge_margin: 1 } }"] != pytest.approx(base)
    # F1 reweighting moves only the negatives' weight: a batch of positives is plain BCE
    pos = torch.ones(3, dtype=torch.float64)
    f1 = float(ctr_loss(S[:3], pos, _terms("losses { loss_type: F1_REWEIGHTED_LOSS "
                                            "f1_reweighted_loss { f1_beta_square: 4 } }")))
    assert f1 == pytest.approx(float(-np.log(_sig(s[:3])).mean()), rel=1e-9)
    # no pair: the pairwise focal term is 0 (and keeps a gradient path)
    x = S[:3].clone().requires_grad_(True)
    zero = ctr_loss(x, pos, _terms("losses { loss_type: PAIRWISE_FOCAL_LOSS }"))
    zero.backward()
    assert float(zero) == 0 and x.grad is not None


def test_easyrec_losses_give_gradients_toward_the_labels() -> None:
    for text in ("losses { loss_type: F1_REWEIGHTED_LOSS }",
                 "losses { loss_type: PAIRWISE_FOCAL_LOSS }"):
        x = S.clone().requires_grad_(True)
        ctr_loss(x, Y, _terms(text)).backward()
        g = x.grad.numpy()
        # a descent step raises the positives' logits against the negatives'
        assert g[Y.numpy() > 0.5].mean() < g[Y.numpy() < 0.5].mean(), text
    x = S.clone().requires_grad_(True)  # L2_LOSS regresses the logit itself onto the label
    ctr_loss(x, Y, _terms("losses { loss_type: L2_LOSS }")).backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * (S - Y).numpy() / len(S), rtol=1e-12)


@pytest.mark.parametrize("settings, field", [
    ("loss_type: F1_REWEIGHTED_LOSS f1_reweighted_loss { f1_beta_square: 0 }",
     "f1_reweighted_loss.f1_beta_square"),
    ("loss_type: F1_REWEIGHTED_LOSS f1_reweighted_loss { label_smoothing: 1 }",
     "f1_reweighted_loss.label_smoothing"),
    ("loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { ohem_ratio: 0 }",
     "pairwise_focal_loss.ohem_ratio"),
    ("loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { temperature: 0 }",
     "pairwise_focal_loss.temperature"),
    ("loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { alpha: 1.5 }",
     "pairwise_focal_loss.alpha"),
    ("loss_type: PAIRWISE_FOCAL_LOSS pairwise_focal_loss { session_name: \"user_id\" }",
     "pairwise_focal_loss.session_name"),
])
def test_easyrec_loss_settings_are_checked_by_field(tmp_path, settings: str, field: str) -> None:
    text = deepfm_config_text(str(tmp_path / "m"), batch_size=64).replace(
        'model_class: "DeepFM"', f'model_class: "DeepFM"\n  losses {{ {settings} }}')
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(text), online=True)
    assert info.value.field == f"model_config.losses[0].{field}"


def _jrc_reference(logits: np.ndarray, y: np.ndarray, sessions: np.ndarray, alpha: float,
                   same_label: bool) -> float:
    """EasyRec's jrc_loss (TensorFlow) step by step in numpy, on [B, 2] logits."""
    b = logits.shape[0]

    def log_softmax(x, axis):
        m = x.max(axis=axis, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))

    ce = -np.mean(log_softmax(logits, 1)[np.arange(b), y])
    onehot = np.stack([1 - y, y], axis=1).astype(np.float64)
    mask = (sessions[:, None] == sessions[None, :]).astype(np.float64)
    lg = np.repeat(logits[:, None, :], b, axis=1)  # tile(expand_dims(logits, 1))
    yy = np.repeat(onehot[:, None, :], b, axis=1) * mask[:, :, None]
    lg = lg + (1 - mask[:, :, None]) * -1e9
    y_neg, y_pos, l_neg, l_pos = yy[:, :, 0], yy[:, :, 1], lg[:, :, 0], lg[:, :, 1]
    if same_label:
        loss_pos = -(y_pos * log_softmax(l_pos, 0)).sum(0)
        loss_neg = -(y_neg * log_softmax(l_neg, 0)).sum(0)
        ge = np.mean((loss_pos + loss_neg) / mask.sum(0))
    else:
        diag = np.eye(b)
        l_pos = l_pos + (1 - diag) * y_pos * -1e9
        l_neg = l_neg + (1 - diag) * y_neg * -1e9
        ge = np.mean(-np.diag(y_pos * log_softmax(l_pos, 0))
                     - np.diag(y_neg * log_softmax(l_neg, 0)))
    return alpha * ce + (1 - alpha) * ge


@pytest.mark.parametrize("same_label", [True, False])
def test_jrc_loss_is_easyrecs(same_label) -> None:
    from odl.models.ctr_losses import jrc_loss

    rng = np.random.default_rng(4)
    logits = rng.normal(size=(12, 2))
    y = rng.integers(0, 2, 12)
    sessions = rng.integers(0, 3, 12)
    settings = pipeline_pb2.JRCLoss(session_name="u", alpha=0.3, same_label_loss=same_label)
    onehot = torch.tensor(np.stack([1 - y, y], axis=1), dtype=torch.float64)
    got = jrc_loss(torch.tensor(logits), onehot, torch.tensor(sessions), settings)
    want = _jrc_reference(logits, y, sessions, settings.alpha, same_label)  # alpha: float32
    assert float(got) == pytest.approx(want, rel=1e-9)


def test_a_two_class_model_trains_with_jrc_loss(tmp_path) -> None:
    text = deepfm_config_text(str(tmp_path / "m"), batch_size=64, dim=8, buckets=100,
                              hidden_units=(16,))
    text = text.replace('model_class: "DeepFM"',
                        'model_class: "DeepFM"\n  num_class: 2\n  losses { loss_type: JRC_LOSS '
                        'jrc_loss { session_name: "C1" alpha: 0.5 } }')
    text = text.replace("wide_output_dim: 1", "wide_output_dim: 2")
    fb, tm, stream = _module_and_stream(text)
    held = fb.build(stream.next_batch(1000).encode("csv")).batch
    assert held.session_keys is not None and held.session_keys.shape == (1000,)
    before = tm.predict(held)[:, 1]
    for _ in range(30):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    after = tm.predict(held)[:, 1]
    from odl.auc import roc_auc

    labels = held.labels.numpy()[:, 1]
    assert roc_auc(labels, after) > roc_auc(labels, before) + 0.05
    for edit, words in [
        (("num_class: 2", "num_class: 1"), "num_class: 2"),
        (('session_name: "C1"', 'session_name: "nope"'), "neither an input field"),
        (("alpha: 0.5", 'alpha: 0.5 loss_weight_strategy: "uncertainty"'), "fixed"),
    ]:
        bad = text.replace(*edit)
        if edit[1] == "num_class: 1":
            bad = bad.replace("wide_output_dim: 2", "wide_output_dim: 1")
        with pytest.raises(ConfigError, match=words):
            check_pipeline_config(parse_pipeline_config_text(bad), online=True)


@pytest.mark.parametrize("model, losses", [
    ("DeepFM", "losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { gamma: 2 } }"),
    ("DeepFM", "losses { loss_type: SIGMOID_L2_LOSS }"),
    ("DCN", "losses { loss_type: CLASSIFICATION weight: 1 } "
            "losses { loss_type: PAIRWISE_LOGISTIC_LOSS weight: 0.5 }"),
    ("DeepFM", "losses { loss_type: F1_REWEIGHTED_LOSS f1_reweighted_loss { f1_beta_square: "
               "2.25 } } losses { loss_type: PAIRWISE_FOCAL_LOSS }"),
    ("DeepFM", "losses { loss_type: L2_LOSS }"),
])
def test_training_with_each_loss_learns(tmp_path, model: str, losses: str) -> None:
    text = as_model_config_text(deepfm_config_text(str(tmp_path / "m"), batch_size=256), model)
    text = text.replace(f'model_class: "{model}"', f'model_class: "{model}"\n  {losses}')
    fb, tm, stream = _module_and_stream(text)
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
        check_pipeline_config(parse_pipeline_config_text(text), online=True)
    assert info.value.field == "model_config.losses[0].pairwise_loss.session_name"
