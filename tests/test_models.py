import logging
import math

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.embedding_tables import (
    DEEP_INIT_STD,
    INIT_BLOCK_ROWS,
    WIDE_SUFFIX,
    init_embedding_weights,
    initial_rows,
    wide_storage_dim,
)
from odl.models.model_registry import build_model
from odl.protos import pipeline_pb2
from odl.train.optimizer_builder import optimizer_specs, sparse_optimizer_args
from odl.train.rate_schedules import LrSchedule
from odl.train.train_module import TrainModule

NUM_IDS = 40


def roc_auc(labels, scores):
    """Rank AUC (ties averaged)."""
    labels = np.asarray(labels).astype(bool)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    for v in np.unique(scores):  # average ranks of ties
        m = scores == v
        ranks[m] = ranks[m].mean()
    n_pos = labels.sum()
    n_neg = len(labels) - n_pos
    return (ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)

CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  input_fields { input_name: "c3" }
  label_fields: "label"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { feature_name: "xb" input_names: "x" feature_type: RawFeature
             boundaries: [-1, 0, 1] embedding_dim: 8 }
  features { input_names: "c1" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c2" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c3" hash_bucket_size: 100 embedding_dim: 8 }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["c1", "c2", "c3", "xb"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "c2", "c3", "xb", "x"]
                   wide_deep: DEEP }
  deepfm { dnn { hidden_units: [32, 16] } l2_regularization: 1e-5 }
  embedding_regularization: 1e-6
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.005 } }
  seed: 7
}
"""


def config(**edits):
    c = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    for path, value in edits.items():
        text_format.Merge(value, getattr(c, path))
    return c


# A learnable problem: every id has a hidden weight; label ~ Bernoulli(sigmoid(sum)).
_W = np.random.default_rng(0).normal(0, 1.5, size=(3, NUM_IDS))


def make_records(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, NUM_IDS, size=(n, 3))
    x = rng.normal(size=n)
    logit = _W[0, ids[:, 0]] + _W[1, ids[:, 1]] + _W[2, ids[:, 2]] + x
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
    return [
        f"{labels[i]},{x[i]:.4f},a{ids[i, 0]},b{ids[i, 1]},c{ids[i, 2]}".encode()
        for i in range(n)
    ], labels


def batches(fb, n_batches, size=256, seed=0):
    out = []
    for k in range(n_batches):
        recs, _ = make_records(size, seed * 1000 + k)
        out.append(fb.build(recs).batch)
    return out


@pytest.fixture(scope="module")
def fb():
    return FeatureBuilder(config())


def test_forward_shapes_and_layout(fb):
    tm = TrainModule(config(), fb, device="cpu")
    b = batches(fb, 1, size=64)[0]
    p = tm.predict(b)
    assert p.shape == (64,) and p.dtype == np.float64
    assert np.all((p > 0) & (p < 1))
    tables = tm.embedding_tables()
    assert set(tables) == {"c1", "c2", "c3", "xb", "c1_wide", "c2_wide", "c3_wide", "xb_wide"}
    assert tuple(tables["c1"].shape) == (200, 8)
    assert tuple(tables["xb"].shape) == (4, 8)
    assert tuple(tables["c3_wide"].shape) == (100, 4)
    dense = tm.dense_parameters()
    assert "dense.dnn.0.weight" in dense and "dense.wide_bias" in dense
    # deep input = 4 embeddings * 8 + 1 dense value
    assert tuple(dense["dense.dnn.0.weight"].shape) == (32, 33)
    assert tm.feature_tables()["c1"] == ["c1", "c1_wide"]


def test_final_dnn_variant(fb):
    c = config(model_config="deepfm { final_dnn { hidden_units: [8] } }")
    tm = TrainModule(c, fb, device="cpu")
    b = batches(fb, 1, size=32)[0]
    out = tm.train_step(b)
    assert out.probs.shape == (32,) and math.isfinite(out.loss)
    # final tower input = wide (1) + fm (8) + deep (16)
    assert tuple(tm.dense_parameters()["dense.final_dnn.0.weight"].shape) == (8, 25)


def _final_dnn_module(fb, fields: str = ""):
    """A TrainModule of a DeepFM with a final DNN [8] over a wide part of width 3, plus
    ``fields`` of its deepfm message."""
    text = f"deepfm {{ final_dnn {{ hidden_units: [8] }} wide_output_dim: 3 {fields} }}"
    return TrainModule(config(model_config=text), fb, device="cpu")


def test_wide_to_logit_adds_the_wide_part_around_the_final_dnn(fb):
    """odl's default with a final DNN: the logit is the final DNN's plus the wide part's sum
    (wide_to_logit); false is EasyRec's structure, the wide part through the final DNN only.
    The same parameters either way; the scripted dense part (serving) agrees."""
    on, off = _final_dnn_module(fb), _final_dnn_module(fb, "wide_to_logit: false")
    b, later = batches(fb, 2, size=32)
    on.train_step(later)  # (the wide rows start at 0: one step moves them)
    off.model.load_state_dict(on.model.state_dict())
    got, plain, final_in = _with_and_without(on, off, b)
    wide = final_in[:, :3]  # the final DNN's input starts with the wide part
    torch.testing.assert_close(got, plain + wide.sum(dim=1))
    assert not torch.allclose(got, plain)


def _with_and_without(on, off, b):
    """``(on's logits, off's logits, on's final DNN input)`` on batch ``b``; asserts on's
    scripted dense part (serving's) gives on's logits."""
    dense = on.model.dense
    captured = {}

    def keep_input(_module, inputs, _output):
        captured["final_in"] = inputs[0]

    hook = dense.final_dnn.register_forward_hook(keep_input)
    with torch.no_grad():
        got, plain = on.model(b).logits, off.model(b).logits
    hook.remove()
    out = on.model(b)
    scripted = torch.jit.script(dense)
    torch.testing.assert_close(scripted(*[p for p in out.pooled], b.dense), out.logits)
    return got, plain, captured["final_in"]


def test_fm_to_logit_adds_the_fm_sum_through_a_fast_learned_weight(fb):
    """odl's default with a final DNN: the logit also gets g * sum(fm), g learned from 1 at 30
    times the dense rate (Adam's first step moves it by 30 * lr); false is EasyRec's
    structure (no such parameter); the scripted dense part (serving) agrees."""
    from odl.models.deepfm import FM_LOGIT_RATE

    on, off = _final_dnn_module(fb), _final_dnn_module(fb, "fm_to_logit: false")
    assert "dense.fm_logit_weight" not in off.dense_parameters()
    weight = on.dense_parameters()["dense.fm_logit_weight"]
    assert float(FM_LOGIT_RATE * weight) == pytest.approx(1.0)
    b, later = batches(fb, 2, size=32)
    on.train_step(later)
    lr = on.dense_optimizer.param_groups[0]["lr"]
    g = float(FM_LOGIT_RATE * weight)
    assert abs(g - 1.0) == pytest.approx(FM_LOGIT_RATE * lr, rel=1e-3)
    off.model.load_state_dict(on.model.state_dict(), strict=False)
    got, plain, final_in = _with_and_without(on, off, b)
    fm = final_in[:, 3:3 + on.model.dense.dim]  # [wide (3), fm (dim), deep]
    torch.testing.assert_close(got, plain + g * fm.sum(dim=1))


def test_a_checkpoint_without_the_fm_weight_restores(fb, caplog):
    """A checkpoint written before fm_to_logit existed (its model without the parameter)
    restores into today's model: every parameter it holds is restored, the weight starts at
    1 and the dense optimizer starts fresh, with a warning."""
    from odl.models.deepfm import FM_LOGIT_RATE

    old = _final_dnn_module(fb, "fm_to_logit: false")
    for b in batches(fb, 3, size=32):
        old.train_step(b)
    state = old.state_dict_for_checkpoint()
    new = _final_dnn_module(fb)
    with caplog.at_level(logging.WARNING):
        new.load_checkpoint_state(state)
    assert "dense.fm_logit_weight" in caplog.text and "starts fresh" in caplog.text
    mine, theirs = new.dense_parameters(), old.dense_parameters()
    assert set(mine) - set(theirs) == {"dense.fm_logit_weight"}
    for name, t in theirs.items():
        torch.testing.assert_close(mine[name], t)
    assert float(FM_LOGIT_RATE * mine["dense.fm_logit_weight"]) == pytest.approx(1.0)
    assert new.global_step == old.global_step and not new.dense_optimizer.state
    new.train_step(batches(fb, 1, size=32)[0])  # and it trains on


def test_wide_and_deep_without_final_dnn_is_num_class_wide(fb, caplog):
    """EasyRec's WideAndDeep without final_dnn sums the wide part and the deep logits: its
    wide part is num_class wide whatever wide_output_dim says (with a warning); DeepFM
    refuses the same settings by field, as EasyRec asserts."""
    from odl.models.model_registry import check_pipeline_config

    c = config(model_config='model_class: "WideAndDeep" '
                            "wide_and_deep { dnn { hidden_units: [16] } wide_output_dim: 6 }")
    c.model_config.ClearField("deepfm")
    with caplog.at_level(logging.WARNING, logger="odl.models.deepfm"):
        tm = TrainModule(c, fb, device="cpu")
    assert "wide_output_dim: 6 is not used without final_dnn" in caplog.text
    wide = {n: w for n, w in tm.embedding_tables().items() if n.endswith(WIDE_SUFFIX)}
    assert wide and all(w.shape[1] == wide_storage_dim(1) for w in wide.values())
    out = tm.train_step(batches(fb, 1, size=32)[0])
    assert out.probs.shape == (32,) and math.isfinite(out.loss)
    deepfm = config(model_config="deepfm { wide_output_dim: 6 }")
    deepfm.train_input_path, deepfm.model_dir = "x/*.csv", "m"
    with pytest.raises(ConfigError, match="wide_output_dim"):
        check_pipeline_config(deepfm, online=False)


def test_wide_dim_layout(fb):
    assert [wide_storage_dim(d) for d in (1, 3, 4, 5, 8)] == [4, 4, 4, 8, 8]
    tm = TrainModule(config(), fb, device="cpu")
    for b in batches(fb, 3, size=64):
        tm.train_step(b)
    for name, w in tm.embedding_tables().items():
        if name.endswith(WIDE_SUFFIX):
            assert w.shape[1] == 4
            assert torch.count_nonzero(w[:, 0]) > 0  # the used column learns
            assert torch.count_nonzero(w[:, 1:]) == 0  # padding columns stay zero


def test_train_step_learns_and_predicts_before_update(fb):
    # (in-batch learning would shift the step's predictions: test_in_batch_learning.py)
    tm = TrainModule(config(train_config="in_batch_learning: false"), fb, device="cpu")
    eval_recs, eval_labels = make_records(4000, seed=999)
    eval_batch = fb.build(eval_recs).batch
    auc0 = roc_auc(eval_labels, tm.predict(eval_batch))
    train = batches(fb, 60, size=256, seed=1)
    losses = []
    for i, b in enumerate(train):
        before = tm.predict(b)
        out = tm.train_step(b)
        if i < 3:
            np.testing.assert_array_equal(out.probs, before)  # forward of the step, pre-update
        losses.append(out.loss)
    assert tm.global_step == 60
    auc = roc_auc(eval_labels, tm.predict(eval_batch))
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    assert auc > 0.75, (auc0, auc)


def _run(tm, bs):
    return [tm.train_step(b).probs for b in bs]


def test_checkpoint_round_trip_is_bit_exact(fb):
    a = TrainModule(config(), fb, device="cpu")
    warm, cont = batches(fb, 4, size=128, seed=2), batches(fb, 4, size=128, seed=3)
    _run(a, warm)
    state = a.state_dict_for_checkpoint()
    assert state["global_step"] == 4
    assert all(type(v) is torch.Tensor for v in state["model"].values())
    assert "ebc.embedding_bags.c1.weight" in state["model"]
    assert "dense.dnn.0.weight" in state["model"]
    momentum = state["sparse_optimizer"]["ebc.embedding_bags.c1.weight"]
    assert all(type(v) is torch.Tensor for v in momentum.values())
    assert any(torch.count_nonzero(v) > 0 for v in momentum.values())
    probs_a = _run(a, cont)
    final_a = a.predict(cont[0])

    b = TrainModule(config(train_config="seed: 8"), fb, device="cpu")  # different init
    c1 = state["model"]["ebc.embedding_bags.c1.weight"]
    assert not torch.equal(b.embedding_tables()["c1"], c1)
    b.load_checkpoint_state(state)
    assert b.global_step == 4
    probs_b = _run(b, cont)
    for pa, pb in zip(probs_a, probs_b, strict=True):
        np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(final_a, b.predict(cont[0]))
    sa, sb = a.state_dict_for_checkpoint(), b.state_dict_for_checkpoint()
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k

    with pytest.raises(KeyError):
        bad = dict(state, model={k: v for k, v in state["model"].items() if "c1" not in k})
        b.load_checkpoint_state(bad)


def test_warm_start_with_var_map(fb):
    a = TrainModule(config(), fb, device="cpu")
    _run(a, batches(fb, 2, size=128, seed=4))
    src = a.state_dict_for_checkpoint()["model"]

    c = config()
    c.feature_config.features[2].feature_name = "c1_new"
    c.model_config.feature_groups[0].feature_names[0] = "c1_new"
    c.model_config.feature_groups[1].feature_names[0] = "c1_new"
    fb2 = FeatureBuilder(c)
    b = TrainModule(c, fb2, device="cpu")
    init_c3 = b.embedding_tables()["c3"].clone()
    var_map = {"ebc.embedding_bags.c1_new.weight": "ebc.embedding_bags.c1.weight"}
    partial = {k: v for k, v in src.items() if "c3" not in k}
    report = b.load_parameters(partial, var_map)
    assert ("ebc.embedding_bags.c1_new.weight", "ebc.embedding_bags.c1.weight") in report.loaded
    assert "ebc.embedding_bags.c3.weight" in report.missing
    assert "ebc.embedding_bags.c1_new_wide.weight" in report.missing
    assert "ebc.embedding_bags.c1_wide.weight" in report.unused
    assert torch.equal(b.embedding_tables()["c1_new"], src["ebc.embedding_bags.c1.weight"])
    assert torch.equal(b.embedding_tables()["c3"], init_c3)  # missing -> kept init
    assert torch.equal(b.dense_parameters()["dense.dnn.0.weight"], src["dense.dnn.0.weight"])
    assert b.global_step == 0

    bad = dict(src)
    bad["dense.dnn.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="dense.dnn.0.weight.*dense.dnn.0.weight"):
        b.load_parameters(bad)


def test_lr_schedules():
    s = LrSchedule(0.1, decay_steps=100, decay_rate=0.5, staircase=True, min_lr=0.02)
    assert [s(k) for k in (0, 99, 100, 250, 1000)] == [0.1, 0.1, 0.05, 0.025, 0.02]
    s = LrSchedule(0.1, decay_steps=100, decay_rate=0.5, staircase=False)
    assert s(50) == pytest.approx(0.1 * 0.5**0.5)
    assert LrSchedule(0.3)(12345) == 0.3

    tc = text_format.Parse("""
      optimizer_config { adagrad_optimizer { learning_rate { exponential_decay_learning_rate {
        initial_learning_rate: 0.1 decay_steps: 10 decay_factor: 0.5 staircase: true
        min_learning_rate: 0.01 } } } }
      optimizer_config { adam_optimizer { learning_rate { constant_learning_rate {
        learning_rate: 0.002 } } beta1: 0.8 } }
    """, pipeline_pb2.TrainConfig())
    sparse, dense = optimizer_specs(tc)
    assert sparse.kind == "adagrad" and dense.kind == "adam"
    lrs = [sparse.schedule(k) for k in (0, 10, 25, 100)]
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.01])
    assert dense.schedule(1000) == pytest.approx(0.002)
    assert dense.params["beta1"] == pytest.approx(0.8)

    one = text_format.Parse("optimizer_config { sgd_optimizer {} }", pipeline_pb2.TrainConfig())
    sparse, dense = optimizer_specs(one)
    assert sparse.kind == dense.kind == "sgd"
    sparse, dense = optimizer_specs(pipeline_pb2.TrainConfig())
    assert (sparse.kind, sparse.schedule(0), dense.kind, dense.schedule(0)) == (
        "adagrad", 0.05, "adam", 1e-3)
    tz = text_format.Parse("""
      sparse_optimizer { sgd_optimizer { lr: 0.2 }
        exponential_decay_learning_rate { decay_steps: 5 decay_rate: 0.1 staircase: true } }
    """, pipeline_pb2.TrainConfig())
    sparse, dense = optimizer_specs(tz)
    assert sparse.schedule(5) == pytest.approx(0.02) and dense.kind == "adam"
    both = text_format.Parse("optimizer_config { sgd_optimizer {} } "
                             "dense_optimizer { sgd_optimizer {} }", pipeline_pb2.TrainConfig())
    with pytest.raises(ConfigError, match="optimizer_config"):
        optimizer_specs(both)
    rw = text_format.Parse("sparse_optimizer { rowwise_adagrad_optimizer { lr: 0.3 } }",
                           pipeline_pb2.TrainConfig())
    cls, kwargs = sparse_optimizer_args(optimizer_specs(rw)[0], "cpu")
    assert cls.__name__ == "RowWiseAdagrad" and kwargs["lr"] == pytest.approx(0.3)
    adam = text_format.Parse("sparse_optimizer { adam_optimizer {} }", pipeline_pb2.TrainConfig())
    cls, kwargs = sparse_optimizer_args(optimizer_specs(adam)[0], "cpu")  # row-sparse Adam
    assert cls is torch.optim.SGD and kwargs["lr"] == 0.0
    lamb = text_format.Parse("sparse_optimizer { lamb_optimizer {} }", pipeline_pb2.TrainConfig())
    cls, kwargs = sparse_optimizer_args(optimizer_specs(lamb)[0], "cpu")  # row-sparse LAMB
    assert cls is torch.optim.SGD and kwargs["lr"] == 0.0


def test_train_module_applies_scheduled_lrs(fb):
    c = config(train_config="")
    c.train_config.ClearField("sparse_optimizer")
    c.train_config.ClearField("dense_optimizer")
    text_format.Merge("""
      sparse_optimizer { sgd_optimizer { lr: 0.5 }
        exponential_decay_learning_rate { decay_steps: 1 decay_rate: 0.0 staircase: true } }
      dense_optimizer { sgd_optimizer { lr: 0.1 } }
    """, c.train_config)
    tm = TrainModule(c, fb, device="cpu")
    bs = batches(fb, 2, size=64, seed=5)
    t0 = {k: v.clone() for k, v in tm.embedding_tables().items()}
    tm.train_step(bs[0])  # step 0: lr 0.5
    t1 = {k: v.clone() for k, v in tm.embedding_tables().items()}
    assert not torch.equal(t0["c1"], t1["c1"])
    assert tm.current_learning_rates() == (0.0, pytest.approx(0.1))
    tm.train_step(bs[1])  # step 1: lr 0 -> tables unchanged
    for k, v in tm.embedding_tables().items():
        assert torch.equal(v, t1[k]), k


def test_unknown_model_class(fb):
    c = config()
    c.model_config.model_class = "Nope"
    with pytest.raises(ValueError, match="model_config.model_class"):
        build_model(c, fb)


def test_rowwise_adagrad_tables(fb):
    c = config()
    c.train_config.sparse_optimizer.rowwise_adagrad_optimizer.lr = 0.1
    tm = TrainModule(c, fb, device="cpu")
    tm.train_step(batches(fb, 1, size=64)[0])
    state = tm.state_dict_for_checkpoint()["sparse_optimizer"]["ebc.embedding_bags.c1.weight"]
    assert [tuple(v.shape) for v in state.values()] == [(200,)]  # one accumulator per row


def test_initial_rows_of_any_range_are_the_whole_tables_rows():
    """A rank initializes only the rows (and columns) of its shards: block by block they are
    the values the whole table gets in one process, whatever the split."""
    rows, dim = 2 * INIT_BLOCK_ROWS + 1234, 8  # three blocks, the last one short
    whole = torch.empty(rows, dim)
    wide = torch.full((rows, 4), 7.0)
    init_embedding_weights({"c1": whole, "c1_wide": wide}, seed=3)
    assert not wide.any()
    assert 0.9 * DEEP_INIT_STD < float(whole.std()) < 1.1 * DEEP_INIT_STD
    for start, stop in [(0, rows), (5, 17), (INIT_BLOCK_ROWS - 3, INIT_BLOCK_ROWS + 3),
                        (INIT_BLOCK_ROWS + 100, rows), (rows - 1, rows)]:
        parts = list(initial_rows("c1", 3, (rows, dim), start, stop))
        assert parts[0][0] == start and all(v.shape[0] <= INIT_BLOCK_ROWS for _, v in parts)
        got = torch.cat([v for _, v in parts])
        torch.testing.assert_close(got, whole[start:stop], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([v[:, 2:6] for _, v in parts]),
                                   whole[start:stop, 2:6], rtol=0, atol=0)
    other = torch.empty(rows, dim)
    init_embedding_weights({"c2": other}, seed=3)  # another table: other values
    assert not torch.equal(other, whole)
    again = torch.empty(rows, dim)
    init_embedding_weights({"c1": again}, seed=3)
    assert torch.equal(again, whole)
