"""In-batch learning's closed-form log loss (``odl.train.in_batch.log_loss``): the slopes a
model declares are its loss's, the steps train as with autograd's slopes, and a model whose
loss is not the declared one falls back to autograd."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.datagen_config import bursty_config_text, deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_model import ModelOutput
from odl.train.in_batch.in_batch_scan import loss_and_slopes
from odl.train.in_batch.log_loss import LogLoss, record_log_loss
from odl.train.train_module import TrainModule
from tests.harness import as_model, load_config_text

ONE_OUTPUT = ["DeepFM", "WideAndDeep", "FM", "DCN", "DCNV2", "MultiTower", "MaskNet", "DLRM",
              "WuKong"]


def _slopes_both_ways(config_text: str, records: list[bytes],
                      sample_weights: np.ndarray | None = None):
    """A module's step loss slopes at its logits: autograd's and the declared log loss's
    (the batch with ``sample_weights`` as its ``data_config.sample_weight`` values)."""
    config = parse_pipeline_config_text(config_text)
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(records).batch
    tm.train_step(batch)  # a state off the initial one
    if sample_weights is not None:
        batch.sample_weights = sample_weights
    with torch.no_grad():
        output = tm._dmp(batch)  # noqa: SLF001 - the forward the step runs
    logits = output.logits.detach()

    def loss_at(at: torch.Tensor) -> torch.Tensor:
        return tm.step_loss(ModelOutput(at, tuple(p.detach() for p in output.pooled)), batch)

    _, slope, curve = loss_and_slopes(loss_at, logits)
    log_loss = record_log_loss(tm.model.log_loss_weights(batch), batch.labels, 1.0)
    return log_loss, logits.numpy(), slope, curve


@pytest.mark.parametrize("model", ONE_OUTPUT)
def test_every_one_output_model_declares_the_slopes_of_its_loss(model):
    """Regularization written too (it must not count: it does not read the logits)."""
    text = as_model(deepfm_config_text("/tmp/unused"), model).replace(
        "model_config {", "model_config {\n  embedding_regularization: 0.001", 1)
    records = SyntheticCtrStream(seed=2).next_batch(128).encode("csv")
    log_loss, logits, slope, curve = _slopes_both_ways(text, records)
    assert log_loss is not None, model
    mine_slope, mine_curve = log_loss.slopes(logits)
    np.testing.assert_allclose(mine_slope, slope, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(mine_curve, curve, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("losses, form", [
    ("losses { loss_type: CLASSIFICATION weight: 0.7 } "
     "losses { loss_type: CROSS_ENTROPY_LOSS weight: 0.2 }", True),
    ("losses { loss_type: L2_LOSS }", False),
    ("losses { loss_type: BINARY_FOCAL_LOSS binary_focal_loss { gamma: 2 } }", False),
    ("loss_weight_strategy: Uncertainty losses { loss_type: CLASSIFICATION "
     "learn_loss_weight: true }", False),
])
def test_weighted_terms_keep_the_form_and_other_losses_have_none(losses, form):
    text = deepfm_config_text("/tmp/unused").replace("model_config {",
                                                     f"model_config {{\n  {losses}", 1)
    records = SyntheticCtrStream(seed=2).next_batch(96).encode("csv")
    log_loss, logits, slope, curve = _slopes_both_ways(text, records)
    assert (log_loss is not None) == form
    if form:
        np.testing.assert_allclose(log_loss.slopes(logits)[0], slope, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(log_loss.slopes(logits)[1], curve, rtol=1e-4, atol=1e-9)


def test_sample_weights_keep_the_form():
    """``data_config.sample_weight``: each record's cross entropy weighs ``w / count(w != 0)``
    in the loss the model trains on (zero weights included)."""
    records = SyntheticCtrStream(seed=2).next_batch(96).encode("csv")
    w = np.linspace(0.0, 2.0, 96).astype(np.float32)
    log_loss, logits, slope, curve = _slopes_both_ways(deepfm_config_text("/tmp/unused"),
                                                       records, sample_weights=w)
    assert log_loss is not None
    np.testing.assert_allclose(log_loss.slopes(logits)[0], slope, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(log_loss.slopes(logits)[1], curve, rtol=1e-4, atol=1e-9)
    assert slope[0] == 0 and log_loss.slopes(logits)[0][0] == 0  # the zero-weight record


def _bursty_in_batch(tmp_path):
    extra = ("in_batch_learning: true wide_rate_adaptation: true per_record_adagrad: true")
    config = load_config_text(bursty_config_text(str(tmp_path / "m"), batch_size=64,
                                                 buckets=4096, extra_train=extra))
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    return TrainModule(config, fb, device="cpu"), fb


def test_closed_form_trains_as_autograd_and_a_wrong_form_falls_back(tmp_path, caplog):
    """Three modules from one state on one stream: the declared log loss, autograd's slopes,
    and a declared form that is not the loss (twice its weights). The first two predict and
    measure the shift's gain alike; the third warns once and trains as autograd does."""
    records = BurstyStream(seed=3).next_batch(12 * 64).encode("csv")
    closed, fc = _bursty_in_batch(tmp_path / "a")
    plain, fp = _bursty_in_batch(tmp_path / "b")
    wrong, fw = _bursty_in_batch(tmp_path / "c")
    plain.row_pair_learning._log_loss_weights = None  # noqa: SLF001
    declared = wrong.model.log_loss_weights
    wrong.row_pair_learning._log_loss_weights = lambda b: 2 * declared(b)  # noqa: SLF001
    caplog.set_level(logging.WARNING, logger="odl.train.in_batch.log_loss")
    for k in range(0, len(records), 64):
        got = [m.train_step(f.build(records[k:k + 64]).batch).probs
               for m, f in ((closed, fc), (plain, fp), (wrong, fw))]
        np.testing.assert_allclose(got[0], got[1], rtol=2e-4, atol=1e-6)
        np.testing.assert_allclose(got[2], got[1], rtol=2e-4, atol=1e-6)
    warnings = [r for r in caplog.records if "is not the log loss it declares" in r.message]
    assert len(warnings) == 1
    assert closed.in_batch_status()["loss_slopes"] == "closed_form"
    assert plain.in_batch_status()["loss_slopes"] == "autograd"
    assert wrong.in_batch_status()["loss_slopes"] == "autograd"
    assert closed.in_batch_gain.steps == plain.in_batch_gain.steps == 11
    assert closed.in_batch_gain.value == pytest.approx(plain.in_batch_gain.value, rel=1e-3)
    assert closed.in_batch_gain.value > 1e-3


def test_log_loss_value_and_slopes_are_the_cross_entropys():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, 50)
    y = (rng.random(50) < 0.4).astype(np.float64)
    c = rng.random(50)
    loss = LogLoss(y, c)
    t = torch.tensor(z, requires_grad=True)
    value = (torch.tensor(c) * torch.nn.functional.binary_cross_entropy_with_logits(
        t, torch.tensor(y), reduction="none")).sum()
    (g,) = torch.autograd.grad(value, t)
    assert loss.value(z) == pytest.approx(float(value), rel=1e-12)
    np.testing.assert_allclose(loss.slopes(z)[0], g.numpy(), rtol=1e-5, atol=1e-9)
    p = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(loss.slopes(z)[1], c * p * (1 - p), rtol=1e-5, atol=1e-9)
