"""Sequential in-batch learning (``odl.train.in_batch.in_batch_scan``).

The contract: each record's prediction is the one the model would make after the batch's
earlier records were learned one at a time, in order, each from its own error at that point
(to first order for the embeddings; exactly for the wide lookups under SGD), and the step
trains on those predictions.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from odl.datagen.datagen_config import bursty_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.train.in_batch import in_batch_scan, native_kernels
from odl.train.in_batch.in_batch_scan import (
    KINDS,
    InBatchScan,
    fit_errors,
    python_pass,
    scan_pairs,
)
from odl.train.train_module import TrainModule
from tests.harness import assert_edit_refused, load_config_text
from tests.test_in_batch_learning import _config, _fillers, _logit, _module, _records, _warm


def test_each_prediction_follows_the_earlier_records_learned_one_at_a_time(tmp_path):
    """SGD tables, frozen dense part: record i's shifted logit equals (to first order) its
    logit after records 0..i-1 were each trained alone, in order, with the loss share 1/b of
    the real step (each reference step is that record and b - 1 records that read no row of
    the batch). The batched shift (every earlier record at its error at the batch's start)
    is measurably further from that reference on this bursty batch."""
    b, lr = 24, 2.0
    records = _records(400)
    warm, batch_records = records[:376], records[376:]
    seq = _config(tmp_path, "in_batch_learning: true", "sgd_optimizer", sparse_lr=lr,
                  dense_lr=1e-12)
    batched = _config(tmp_path, "in_batch_learning: true in_batch_sequential: false",
                      "sgd_optimizer", sparse_lr=lr, dense_lr=1e-12)
    off = _config(tmp_path, "", "sgd_optimizer", sparse_lr=lr, dense_lr=1e-12)
    tm, fb = _module(seq)
    _warm(tm, fb, warm, b)
    start = tm.state_dict_for_checkpoint()
    batch = fb.build(batch_records).batch
    shifted = _logit(tm.train_step(batch).probs)
    one_step, fb_one = _module(batched)
    one_step.load_checkpoint_state(start)
    shifted_batched = _logit(one_step.train_step(fb_one.build(batch_records).batch).probs)
    ref, fb_off = _module(off)
    ref.load_checkpoint_state(start)
    plain = _logit(ref.predict(batch))
    fillers = _fillers(fb_off, batch_records, b - 1)
    expected = np.empty(b)
    for i in range(b):  # record i predicted, then learned alone
        expected[i] = _logit(ref.predict(batch))[i]
        ref.train_step(fb_off.build([batch_records[i]] + fillers).batch)
    moved = np.abs(expected - plain)
    assert moved[1:].max() > 0.2, moved  # the earlier records do move the later ones
    assert shifted[0] == pytest.approx(plain[0], abs=1e-5)
    err = np.abs(shifted - expected)
    err_batched = np.abs(shifted_batched - expected)
    assert err.max() < 0.1 * moved.max() + 1e-4, (err, moved)
    assert np.mean(err) < 0.05 * np.mean(moved) + 1e-5, (err, moved)
    assert np.mean(err) < 0.5 * np.mean(err_batched), (err, err_batched)


def _random_pairs(kind: str, seed: int):
    """A random step's pairs: 40 records reading rows of 3 tables (bursts of repeats), some
    twice, with weights, table rates and accumulators."""
    g = torch.Generator().manual_seed(seed)
    b, width, p = 40, 4, 300
    sample = torch.randint(0, b, (p,), generator=g)
    table = torch.randint(0, 3, (p,), generator=g)
    row = torch.randint(0, 6, (p,), generator=g)  # few rows: many shared reads
    key = table * 100 + row
    order = torch.argsort(key * (b + 1) + sample)
    key, sample, table = key[order], sample[order], table[order]
    new_row = torch.ones(p, dtype=torch.bool)
    new_row[1:] = key[1:] != key[:-1]
    jrow = torch.randn(p, width, generator=g)
    weight = torch.rand(p, generator=g) + 0.5
    slot = torch.cumsum(new_row.long(), 0) - 1
    heads = new_row.nonzero().flatten()  # each row's first pair: its table, its state
    rate = torch.tensor([0.1, 0.3, 0.05])[table[heads]]
    acc = None
    if kind == "adagrad":
        acc = torch.rand(len(heads), width, generator=g)
    elif kind == "rowwise_adagrad":
        acc = torch.rand(len(heads), 1, generator=g)
    stored = torch.full((len(heads),), float(width))
    logits = torch.randn(b, generator=g)
    labels = (torch.rand(b, generator=g) < 0.4).float()
    return scan_pairs(sample, slot, jrow, weight, rate, acc, stored), logits, labels


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("per_record", [False, True])
def test_compiled_pass_equals_the_python_pass(kind, per_record):
    """The C pass and its Python twin (used without a compiler) give the same shifts."""
    if not in_batch_scan.native_pass_available():
        pytest.skip("no C compiler here")
    pairs, logits, labels = _random_pairs(kind, seed=len(kind) + per_record)
    at = logits.numpy()
    slope = (torch.sigmoid(logits) - labels).numpy() / len(at)
    curve = (torch.sigmoid(logits) * (1 - torch.sigmoid(logits))).numpy() / len(at)
    errors = fit_errors(slope, curve, at, logistic=True)
    args = (pairs, KINDS[kind], per_record, 3.0, 1e-8, at.astype(np.float32), errors)
    native = in_batch_scan._native_pass(*args)
    python = python_pass(*args)
    assert np.abs(python).max() > 1e-3  # the shifts are not all zero
    np.testing.assert_allclose(native, python, rtol=1e-4, atol=1e-6)


def test_without_a_compiler_the_python_pass_runs(tmp_path, monkeypatch, caplog):
    """A machine without a working C compiler logs why and trains with the Python pass."""
    monkeypatch.setenv("ODL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native_kernels.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native_kernels, "_library", None)
    caplog.set_level(logging.WARNING, logger=native_kernels.logger.name)
    assert not in_batch_scan.native_pass_available()
    assert "could not compile" in caplog.text
    pairs, logits, labels = _random_pairs("adagrad", seed=7)

    def loss_at(x):
        return torch.nn.functional.binary_cross_entropy_with_logits(x, labels)

    shift = InBatchScan("adagrad", False, 3.0, 1e-8, exact=True).shift(pairs, logits, loss_at)
    assert float(shift.abs().max()) > 1e-3


def test_losses_the_model_does_not_fit_exactly_reach_the_fixed_point():
    """Binary focal loss: the error model is only a fit, so the pass repeats from the logits
    it reached until the errors it assumed are the loss's own there."""
    pairs, logits, labels = _random_pairs("adagrad", seed=3)

    def focal(x):
        p = torch.sigmoid(x)
        ce = torch.nn.functional.binary_cross_entropy_with_logits(x, labels, reduction="none")
        pt = torch.where(labels > 0, p, 1 - p)
        return ((1 - pt) ** 2 * ce).mean()

    scan = InBatchScan("adagrad", True, 3.0, 1e-8, exact=False)
    shift = scan.shift(pairs, logits, focal)
    assert scan.passes > 1
    at = (logits + shift).numpy()
    slope, curve = in_batch_scan.loss_slopes(focal, torch.from_numpy(at))
    again = python_pass(pairs, KINDS["adagrad"], True, 3.0, 1e-8, logits.numpy(),
                        fit_errors(slope, curve, at, logistic=True))
    np.testing.assert_allclose(again, shift.numpy(), atol=2e-3 * float(shift.abs().max()))


def test_sequential_learns_bursts_better_at_large_batches(tmp_path):
    """Bursty stream, batch 1024, per-record Adagrad (the pairing the bench recommends):
    progressive logloss is lower with sequential in-batch learning than with the batched
    shift, whose earlier records all step with their errors at the batch's start."""
    records = _records(8192, seed=5)
    y = np.array([int(r.split(b",")[2]) for r in records])
    losses = {}
    for flag in (False, True):
        config = _config(tmp_path, "in_batch_learning: true per_record_adagrad: true "
                                   "wide_learning_rate_multiplier: 3 in_batch_sequential: "
                                   f"{str(flag).lower()}", sparse_lr=0.07, batch=1024)
        tm, fb = _module(config)
        probs = np.concatenate([tm.train_step(fb.build(records[k:k + 1024]).batch).probs
                                for k in range(0, len(records), 1024)])
        p = np.clip(probs, 1e-7, 1 - 1e-7)
        losses[flag] = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    assert losses[True] < losses[False] - 3e-3, losses


def _config_text(tmp_path) -> str:
    return bursty_config_text(str(tmp_path / "m"), extra_train="in_batch_learning: true")


def test_coupled_losses_refused(tmp_path):
    text = _config_text(tmp_path)
    pairwise = ("model_class: \"DeepFM\"", "model_class: \"DeepFM\"\n  loss_type: PAIR_WISE_LOSS")
    assert_edit_refused(text, pairwise, "train_config.in_batch_sequential", "PAIR_WISE_LOSS")
    # without in-batch learning the setting does nothing and is not checked
    plain = text.replace("in_batch_learning: true", "in_batch_learning: false")
    assert load_config_text(plain.replace(*pairwise)).train_config.in_batch_sequential


def test_regression_model_steps_with_one_exact_pass(tmp_path):
    """An L2 regression output: the error model is the tangent line, exact: one pass."""
    text = _config_text(tmp_path).replace("model_class: \"DeepFM\"",
                                          "model_class: \"DeepFM\"\n  loss_type: L2_LOSS")
    config = load_config_text(text)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    scan = tm.row_pair_learning.in_batch.sequential
    assert scan is not None and scan.exact and not scan.logistic
    records = _records(256)
    tm.train_step(fb.build(records[:128]).batch)
    tm.train_step(fb.build(records[128:]).batch)
    assert scan.passes == 1
