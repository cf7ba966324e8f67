"""Per-record Adagrad accumulators (``odl.train.in_batch.per_record_adagrad``).

The contract: a table row that several records of a step read accumulates each record's
squared gradient (at least ``S**2 / c**2``) and moves by ``-lr * S / (sqrt(G + Q) + eps)``;
a row that one record reads is updated exactly as without the setting.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.in_batch_settings import per_record_adagrad_on
from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.datagen_config import bursty_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.train.optimizer_builder import TABLE_EPS
from odl.train.train_module import TrainModule
from tests.harness import assert_edit_refused, load_config_text

SPARSE_LR = 0.07
WIDE_MULT = 3.0
EASYREC_ADAGRAD = ("optimizer_config { adagrad_optimizer {\n"
                   "    learning_rate { constant_learning_rate { learning_rate: 0.07 } } } }\n"
                   "  optimizer_config { adam_optimizer {\n"
                   "    learning_rate { constant_learning_rate { learning_rate: 0.001 } } } }")
ROWWISE = ("sparse_optimizer { rowwise_adagrad_optimizer { lr: 0.07 } }\n"
           "  dense_optimizer { adam_optimizer { lr: 0.001 } }")


def _config(tmp_path, per_record: bool, optimizer: str = "adagrad", gain: float = 3.0,
            batch: int = 128):
    # the batched shift (not sequential) leaves the forward and the shift independent of the
    # accumulator rule, so both modules of a test predict alike
    extra = (f"in_batch_learning: true in_batch_sequential: false "
             f"wide_learning_rate_multiplier: {WIDE_MULT} wide_rate_adaptation: false "
             f"per_record_adagrad: {str(per_record).lower()} "
             f"per_record_adagrad_max_gain: {gain}")
    text = bursty_config_text(str(tmp_path / f"m{int(per_record)}"), batch_size=batch,
                              sparse_lr=SPARSE_LR, dense_lr=0.001, buckets=4096,
                              extra_train=extra)
    if optimizer == "rowwise":
        assert EASYREC_ADAGRAD in text
        text = text.replace(EASYREC_ADAGRAD, ROWWISE)
    return load_config_text(text)


def _records(n: int, seed: int = 3) -> list[bytes]:
    return BurstyStream(seed=seed).next_batch(n).encode("csv")


def _module(config) -> tuple[TrainModule, FeatureBuilder]:
    fb = FeatureBuilder(config)
    return TrainModule(config, fb, device="cpu"), fb


def _accumulators(tm: TrainModule) -> dict[str, torch.Tensor]:
    _, states = tm.row_state_views()
    return {name[len("ebc.embedding_bags."):-len(".weight")]: v[0].clone()
            for name, v in states.items()}


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise"])
def test_wide_rows_accumulate_each_records_squared_gradient(tmp_path, optimizer):
    """After a warm-up, one step: every wide row read by several records has the accumulator
    and weight of the contract, computed here from the step's own predictions (a wide row's
    gradient from record j is (p_j - y_j) / B, p_j the shifted prediction the step trains
    on); every row read by one record, and every dense parameter, equal the batched step's."""
    gain = 2.0
    records = _records(1200)
    warm, step = records[:1024], records[1024:1152]
    a, fa = _module(_config(tmp_path, True, optimizer, gain))
    b, fb = _module(_config(tmp_path, False, optimizer, gain))
    for k in range(0, len(warm), 128):
        a.train_step(fa.build(warm[k:k + 128]).batch)
    state = a.state_dict_for_checkpoint()
    b.load_checkpoint_state(state)
    w0 = {k: v.clone() for k, v in a.embedding_tables().items()}
    g0 = _accumulators(a)
    batch = fa.build(step).batch
    probs = a.train_step(batch).probs
    probs_b = b.train_step(fb.build(step).batch).probs
    np.testing.assert_array_equal(probs, probs_b)  # the same forward and shift
    y = batch.labels.numpy().astype(np.float64).reshape(-1)
    err = (probs - y) / len(y)
    # the multiplier is stated in the logit's space: a width-1 wide part added to the logit
    # moves it by the multiplier under Adagrad; row-wise Adagrad's step on its row (stored
    # 4 wide, one column read) is twice that, so its kernel runs at half the multiplier
    step_multiplier = WIDE_MULT / (2.0 if optimizer == "rowwise" else 1.0)
    assert a.rates.wide_multiplier == pytest.approx(step_multiplier)
    lr = SPARSE_LR * step_multiplier
    checked = 0
    for feature in ("user_id", "item_id", "category", "device", "hour"):
        table = f"{feature}_wide"
        ids = batch.sparse[feature].values().numpy()
        stored = w0[table].shape[1]
        w, acc = a.embedding_tables()[table], _accumulators(a)[table]
        w_b = b.embedding_tables()[table]
        for row in np.unique(ids):
            readers = err[ids == row]
            if len(readers) == 1:
                assert float(w[row, 0]) == float(w_b[row, 0])
                continue
            s, q = readers.sum(), (readers ** 2).sum()
            q = max(q, s * s / gain ** 2)
            if optimizer == "rowwise":
                g_before = float(g0[table][row])
                g_after = g_before + q / stored
                assert float(acc[row]) == pytest.approx(g_after, rel=1e-4, abs=1e-12)
            else:
                g_before = float(g0[table].view(-1, stored)[row, 0])
                g_after = g_before + q
                assert float(acc.view(-1, stored)[row, 0]) == pytest.approx(
                    g_after, rel=1e-4, abs=1e-12)
            expected = float(w0[table][row, 0]) - lr * s / (np.sqrt(g_after) + TABLE_EPS)
            assert float(w[row, 0]) == pytest.approx(expected, rel=1e-4, abs=1e-6)
            checked += 1
    assert checked > 20, checked  # the bursty batch has rows read by several records
    dense_a = dict(a._dense_module().named_parameters())
    for name, p in b._dense_module().named_parameters():
        torch.testing.assert_close(dense_a[name], p, rtol=0, atol=0)


def test_no_shared_rows_nothing_changes(tmp_path):
    """Records that share no table row are trained exactly as without the setting."""
    rows = [f"s{k},{1767225600 + k},{k % 2},u{k},i{k},c{k},d{k},h{k:02d}".encode()
            for k in range(16)]
    a, fa = _module(_config(tmp_path, True))
    b, fb = _module(_config(tmp_path, False))
    built = fa.build(rows).batch
    for name in ("device", "hour", "category", "user_id", "item_id"):
        ids = built.sparse[name].values().tolist()
        assert len(set(ids)) == len(ids), f"hash collision in {name}: pick other ids"
    np.testing.assert_array_equal(a.train_step(built).probs,
                                  b.train_step(fb.build(rows).batch).probs)
    for name, t in a.embedding_tables().items():
        torch.testing.assert_close(t, b.embedding_tables()[name], rtol=0, atol=0)
    for name, t in _accumulators(a).items():
        torch.testing.assert_close(t, _accumulators(b)[name], rtol=0, atol=0)


def test_settings_refused_where_they_cannot_apply(tmp_path):
    text = bursty_config_text(str(tmp_path / "m"), extra_train=(
        "in_batch_learning: true per_record_adagrad: true"))
    assert_edit_refused(text, ("in_batch_learning: true ", "in_batch_learning: false "),
                        "train_config.per_record_adagrad", "in-batch learning")
    assert_edit_refused(text, ("adagrad_optimizer", "sgd_optimizer"),
                        "train_config.per_record_adagrad", "Adagrad")
    assert_edit_refused(text, ("per_record_adagrad: true",
                               "per_record_adagrad: true per_record_adagrad_max_gain: 0.5"),
                        "train_config.per_record_adagrad_max_gain", "at least 1")


@pytest.mark.parametrize("extra,optimizer,on", [
    ("in_batch_learning: true", "adagrad_optimizer", True),
    ("in_batch_learning: true", "sgd_optimizer", False),  # (no accumulators to count in)
    ("in_batch_learning: true per_record_adagrad: false", "adagrad_optimizer", False),
    ("in_batch_learning: false", "adagrad_optimizer", False),
    ("", "adagrad_optimizer", True),  # (in-batch learning decided by the stream)
    ("", "sgd_optimizer", False),
])
def test_unwritten_it_runs_with_in_batch_learning_and_adagrad_tables(tmp_path, extra,
                                                                      optimizer, on):
    """``per_record_adagrad`` unwritten: on where in-batch learning (written or decided by
    the stream) trains (row-wise) Adagrad tables, else off; written, as written."""
    text = bursty_config_text(str(tmp_path / "m"), buckets=4096, extra_train=extra)
    config = load_config_text(text.replace("adagrad_optimizer", optimizer, 1))
    assert per_record_adagrad_on(config) is on
    tm, _ = _module(config)
    learning = tm.row_pair_learning
    assert (learning is not None and learning.per_record is not None) is on
