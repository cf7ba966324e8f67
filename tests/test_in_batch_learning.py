"""In-batch learning and the wide tables' rate (``odl.train.in_batch.in_batch_learning``).

The contract: with ``in_batch_learning`` each record's prediction is the one the model would
make after one table-optimizer step on the batch's earlier records (exactly for the wide
lookups, to first order for the embeddings), and the step trains on those predictions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.datagen.bursty_stream import BurstyStream
from odl.datagen.datagen_config import bursty_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.train.train_module import TrainModule
from tests.harness import assert_edit_refused, load_config_text

ADAGRAD = "adagrad_optimizer"


def _config(tmp_path, extra: str = "", optimizer: str = ADAGRAD, sparse_lr: float = 0.1,
            dense_lr: float = 0.001, batch: int = 64):
    """The bursty DeepFM with ``extra`` train fields. With in-batch learning the wide rate is
    held at the written multiplier (1 unless ``extra`` writes one) and per-record Adagrad is
    off unless written, so that the shifts compare with plain steps; those defaults are
    tested in ``test_wide_rate.py`` and ``test_per_record_adagrad.py``. Without it the module
    is plain (``in_batch_learning: false``; unwritten, the stream decides:
    ``test_in_batch_choice.py``)."""
    if "in_batch_learning" not in extra:
        extra += " in_batch_learning: false"
    if "in_batch_learning: true" in extra:
        if "wide_rate_adaptation" not in extra:
            extra += " wide_rate_adaptation: false"
        if "wide_learning_rate_multiplier" not in extra:
            extra += " wide_learning_rate_multiplier: 1"
        if "per_record_adagrad" not in extra:
            extra += " per_record_adagrad: false"
    text = bursty_config_text(str(tmp_path / "m"), batch_size=batch, sparse_lr=sparse_lr,
                              dense_lr=dense_lr, buckets=4096, extra_train=extra)
    return load_config_text(text.replace(ADAGRAD, optimizer, 1))


def _records(n: int, seed: int = 3) -> list[bytes]:
    """Bursty records: users emit several events within a batch, rows repeat."""
    stream = BurstyStream(seed=seed)
    return stream.next_batch(n).encode("csv")


def _module(config) -> tuple[TrainModule, FeatureBuilder]:
    fb = FeatureBuilder(config)
    return TrainModule(config, fb, device="cpu"), fb


def _logit(p: np.ndarray) -> np.ndarray:
    return np.log(p) - np.log1p(-p)


def _warm(tm: TrainModule, fb: FeatureBuilder, records: list[bytes], batch: int) -> None:
    for k in range(0, len(records), batch):
        tm.train_step(fb.build(records[k:k + batch]).batch)


def _fillers(fb: FeatureBuilder, batch_records: list[bytes], n: int) -> list[bytes]:
    """``n`` records that read no table row the batch's records read."""
    taken = {name: set(jt.values().tolist())
             for name, jt in fb.build(batch_records).batch.sparse.to_dict().items()}
    out: list[bytes] = []
    k = 0
    while len(out) < n:
        rec = f"x{k},1767225600,0,xu{k},xi{k},xc{k},xd{k},xh{k}".encode()
        ids = fb.build([rec]).batch.sparse.to_dict()
        if all(not (set(jt.values().tolist()) & taken[name]) for name, jt in ids.items()):
            out.append(rec)
        k += 1
    return out


@pytest.mark.parametrize("optimizer", ["sgd_optimizer", ADAGRAD])
def test_each_prediction_is_the_model_after_a_step_on_the_earlier_records(tmp_path, optimizer):
    """Record i's shifted prediction equals the prediction (eval mode) of the same state after
    one step on records [0, i) of its batch, to first order (the dense rate is 1e-12: frozen).
    The reference step's batch is those records and b - i records that read no row of the
    batch, so each earlier record's share of the loss is 1/b as in the real step."""
    lr = 0.05 if optimizer == ADAGRAD else 0.5
    b = 24
    records = _records(400)
    warm, batch_records = records[:376], records[376:]
    on = _config(tmp_path, "in_batch_learning: true in_batch_sequential: false", optimizer,
                 sparse_lr=lr, dense_lr=1e-12)
    off = _config(tmp_path, "", optimizer, sparse_lr=lr, dense_lr=1e-12)
    tm, fb = _module(on)
    _warm(tm, fb, warm, b)
    start = tm.state_dict_for_checkpoint()
    batch = fb.build(batch_records).batch
    shifted = _logit(tm.train_step(batch).probs)
    ref, fb_off = _module(off)
    ref.load_checkpoint_state(start)
    plain = _logit(ref.predict(batch))
    fillers = _fillers(fb_off, batch_records, b)
    expected = plain.copy()
    for i in range(1, b):
        ref.load_checkpoint_state(start)
        ref.train_step(fb_off.build(batch_records[:i] + fillers[:b - i]).batch)
        expected[i] = _logit(ref.predict(batch))[i]
    moved = np.abs(expected - plain)
    assert moved[1:].max() > 0.05, moved  # the earlier records do move the later ones
    assert shifted[0] == pytest.approx(plain[0], abs=1e-5)  # nothing before the first
    err = np.abs(shifted - expected)
    assert err.max() < 0.1 * moved.max() + 1e-4, (err, moved)
    assert np.mean(err) < 0.05 * np.mean(moved) + 1e-5, (err, moved)


def test_no_shared_rows_no_shift(tmp_path):
    """Records that share no table row with an earlier record of their batch are predicted
    and trained exactly as without in-batch learning."""
    text_on = _config(tmp_path, "in_batch_learning: true")
    text_off = _config(tmp_path)
    rows = [f"s{k},{1767225600 + k},{k % 2},u{k},i{k},c{k},d{k},h{k:02d}".encode()
            for k in range(16)]
    a, fa = _module(text_on)
    b, fb = _module(text_off)
    # the precondition: no two records share a row (device, hour hash into 1024 rows)
    built = fa.build(rows).batch
    for name in ("device", "hour", "category", "user_id", "item_id"):
        ids = built.sparse[name].values().tolist()
        assert len(set(ids)) == len(ids), f"hash collision in {name}: pick other ids"
    pa = a.train_step(built).probs
    pb = b.train_step(fb.build(rows).batch).probs
    np.testing.assert_array_equal(pa, pb)
    for name, t in a.embedding_tables().items():
        torch.testing.assert_close(t, b.embedding_tables()[name], rtol=0, atol=0)


def test_in_batch_learning_learns_bursts_faster(tmp_path):
    """On the bursty stream, progressive logloss of the same model and records is lower with
    in-batch learning (what the bench measures at scale)."""
    records = _records(12_000, seed=5)
    losses = {}
    for flag in (False, True):
        config = _config(tmp_path, f"in_batch_learning: {str(flag).lower()}", batch=256)
        tm, fb = _module(config)
        probs = []
        for k in range(0, len(records), 256):
            probs.append(tm.train_step(fb.build(records[k:k + 256]).batch).probs)
        p = np.clip(np.concatenate(probs), 1e-7, 1 - 1e-7)
        y = np.array([int(r.split(b",")[2]) for r in records])
        losses[flag] = float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
    assert losses[True] < losses[False] - 1e-3, losses


def test_wide_tables_learn_at_their_multiplier(tmp_path):
    """SGD: a wide row moves ``wide_learning_rate_multiplier`` times as far, embeddings as far
    as without it; the multiplier follows the rate schedule and survives a restore."""
    records = _records(64)
    moved = {}
    for m in (1.0, 3.0):
        config = _config(tmp_path, f"wide_learning_rate_multiplier: {m}", "sgd_optimizer",
                         sparse_lr=0.5)
        tm, fb = _module(config)
        before = {k: v.clone() for k, v in tm.embedding_tables().items()}
        tm.train_step(fb.build(records).batch)
        moved[m] = {k: (v - before[k]) for k, v in tm.embedding_tables().items()}
        if m == 3.0:  # restore into a fresh module: the rates of both groups come back
            state = tm.state_dict_for_checkpoint()
            again, _ = _module(config)
            again.load_checkpoint_state(state)
            groups = again.rates.fused_groups(again.fused_optimizer)
            assert sorted(round(g["lr"] / 0.5, 4) for g, _ in groups) == [1.0, 3.0]
            again.train_step(fb.build(records).batch)
            for g, wide in again.rates.fused_groups(again.fused_optimizer):
                assert g["lr"] == pytest.approx(0.5 * (3.0 if wide else 1.0))
    for name, d1 in moved[1.0].items():
        d3 = moved[3.0][name]
        assert float(d1.abs().max()) > 0, name
        factor = 3.0 if name.endswith("_wide") else 1.0
        torch.testing.assert_close(d3, d1 * factor, rtol=1e-4, atol=1e-7)


def test_settings_refused_where_they_cannot_apply(tmp_path):
    text = bursty_config_text(str(tmp_path / "m"), extra_train="in_batch_learning: true")
    assert_edit_refused(text, ("in_batch_learning: true",
                               "in_batch_learning: true wide_learning_rate_multiplier: 0"),
                        "train_config.wide_learning_rate_multiplier", "must be > 0")
    three = text.replace("wide_output_dim: 1", "wide_output_dim: 3")
    assert_edit_refused(three, ("model_class: \"DeepFM\"", "model_class: \"DeepFM\"\n"
                                "  num_class: 3"),
                        "train_config.in_batch_learning", "one output")
    assert_edit_refused(text, (ADAGRAD, "adam_optimizer"), "train_config.in_batch_learning",
                        "Adagrad")


def test_the_shifts_gain_is_the_loss_it_takes_off_the_step(tmp_path):
    """``in_batch_gain``: the step's loss at the shifted logits against the unshifted ones',
    the latter a plain module's step from the same state; measured when the next step runs."""
    records = _records(2 * 64)
    a, fa = _module(_config(tmp_path, "in_batch_learning: true"))
    b, fb = _module(_config(tmp_path))
    assert b.in_batch_gain is None
    shifted = a.train_step(fa.build(records[:64]).batch).loss
    plain = b.train_step(fb.build(records[:64]).batch).loss
    assert a.in_batch_gain.value is None and a.in_batch_gain.steps == 0
    a.train_step(fa.build(records[64:]).batch)
    assert a.in_batch_gain.steps == 1
    assert a.in_batch_gain.value == pytest.approx((plain - shifted) / plain, rel=1e-4)
    assert a.in_batch_gain.value > 1e-3  # the burst's earlier records teach its later ones
