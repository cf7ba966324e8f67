"""EasyRec's vector labels and knowledge distillation (``odl.config.vector_labels``,
``odl.models.distillation``): the soft labels are read as EasyRec splits them, each ``kd``
loss equals a numpy port of EasyRec's TF formulas, the term trains the model toward the
teacher on one rank and on two, and what odl does not compute is refused by field.

The model is EasyRec's own sample, ``tests/compat_configs/easyrec/deepfm_multi_cls_small.config``
(DeepFM, ``num_class: 5``, ``kd_soft`` of five numbers split on ``\x03``, a cross-entropy
``kd`` at temperature 2), trained as the compatibility test trains it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.distillation import EPSILON, kd_loss
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.startup_checks import check_start
from odl.train.train_module import TrainModule
from tests.harness import rank_dense_parameters
from tests.test_config_compat import _HERE, _records, _small_cpu_config, try_load

_SAMPLE = os.path.join(_HERE, "easyrec", "deepfm_multi_cls_small.config")
_L = pipeline_pb2.LossType


def _sample(model_dir: str = "unused"):
    config = _small_cpu_config(try_load.load_one(_SAMPLE, "easyrec"))
    config.model_dir = model_dir
    return config


# ---- EasyRec's formulas, in numpy ---------------------------------------------------------

def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _logit(p):
    p = np.clip(p, EPSILON, 1 - EPSILON)
    return np.log(p / (1 - p))


def _easyrec_kd(kd, pred, label):
    """``build_kd_loss`` of easy_rec/python/builders/loss_builder.py, line by line."""
    eps, t, w = EPSILON, kd.temperature, kd.loss_weight
    n = 1 if pred.ndim < 2 else pred.shape[-1]
    if kd.loss_type == _L.BINARY_CROSS_ENTROPY_LOSS:
        if not kd.label_is_logits:
            label = _logit(label)
        if not kd.pred_is_logits:
            pred = _logit(pred)
        if t > 0:
            label, pred = label / t, pred / t
        label = _sigmoid(label)
        # keras binary_crossentropy(from_logits=True): sigmoid_cross_entropy_with_logits
        losses = np.maximum(pred, 0) - pred * label + np.log1p(np.exp(-np.abs(pred)))
        return losses.mean() * w
    if kd.loss_type == _L.KL_DIVERGENCE_LOSS:
        if not kd.label_is_logits:
            label = _logit(label) if n == 1 else np.log(label + eps) - np.log(label + eps).max()
        if not kd.pred_is_logits:
            pred = _logit(pred) if n == 1 else np.log(pred + eps) - np.log(pred + eps).max()
        if t > 0:
            label, pred = label / t, pred / t
        if n > 1:
            label, pred = _softmax(label), _softmax(pred)
        else:
            label, pred = _sigmoid(label), _sigmoid(pred)
            label = np.stack([1 - label, label], 1)
            pred = np.stack([1 - pred, pred], 1)
        y, p = np.clip(label, eps, 1), np.clip(pred, eps, 1)  # keras KLD
        return (y * np.log(y / p)).sum(-1).mean() * w
    if kd.loss_type == _L.CROSS_ENTROPY_LOSS:
        if not kd.label_is_logits:
            label = np.log(label + eps)
        if not kd.pred_is_logits:
            pred = np.log(pred + eps)
        if t > 0:
            label, pred = label / t, pred / t
        if n > 1:
            label, pred = _softmax(label), _softmax(pred)
        else:
            label, pred = _sigmoid(label), _sigmoid(pred)
        # tf.losses.log_loss, SUM_BY_NONZERO_WEIGHTS with a scalar weight
        losses = -label * np.log(pred + eps) - (1 - label) * np.log(1 - pred + eps)
        return losses.mean() * w
    return ((pred - label) ** 2).mean() * w  # tf.losses.mean_squared_error


@pytest.mark.parametrize("loss_type", ["CROSS_ENTROPY_LOSS", "BINARY_CROSS_ENTROPY_LOSS",
                                       "KL_DIVERGENCE_LOSS", "L2_LOSS"])
@pytest.mark.parametrize("width", [1, 5])
@pytest.mark.parametrize("logits", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["logits", "label_probs", "pred_probs", "both_probs"])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.0])
def test_each_loss_is_easyrecs_formula(loss_type, width, logits, temperature) -> None:
    rng = np.random.default_rng(width * 7 + int(temperature * 3))
    shape = (16,) if width == 1 else (16, width)

    def side(is_logits):
        x = rng.normal(size=shape) * 2
        if is_logits:
            return x
        return _softmax(x) if width > 1 else _sigmoid(x)

    label, pred = side(logits[0]), side(logits[1])
    kd = pipeline_pb2.KD(loss_type=_L.Value(loss_type), label_is_logits=logits[0],
                         pred_is_logits=logits[1], temperature=temperature, loss_weight=0.7)
    got = kd_loss(kd, torch.tensor(pred), torch.tensor(label), width)
    np.testing.assert_allclose(float(got), _easyrec_kd(kd, pred, label), rtol=1e-9, atol=1e-12)


# ---- the labels ----------------------------------------------------------------------------

def test_loading_moves_the_soft_label_out_of_the_trained_labels() -> None:
    config = _sample()
    dc = config.data_config
    assert list(dc.label_fields) == ["label"] and not dc.label_dim and not dc.label_sep
    assert [(v.input_name, v.dim, v.separator) for v in dc.vector_labels] == [
        ("kd_soft", 5, "\x03")]


def _record_with(config, soft: str) -> bytes:
    """One record of the sample's schema whose soft label reads ``soft``."""
    names = [f.input_name for f in config.data_config.input_fields]
    row = _records(config, 1, seed=0)[0].decode().split(config.data_config.separator)
    row[names.index("kd_soft")] = soft
    return config.data_config.separator.join(row).encode()


def test_soft_labels_are_split_as_easyrec_splits_them() -> None:
    """The sample's ``\x03``: exactly five finite numbers, else ``bad_label``; an empty
    ``label_sep`` splits the text into single characters (TF's ``string_split``)."""
    config = _sample()
    texts = ["0.5\x03-1\x032e-3\x037\x031", "1\x032\x033\x034", "1\x032\x033\x034\x035\x036",
             "1\x03x\x033\x034\x035", "", "1\x032\x03nan\x034\x035"]
    built = FeatureBuilder(config).build([_record_with(config, t) for t in texts])
    assert dict(built.rejected) == {k: "bad_label" for k in range(1, 6)}
    np.testing.assert_allclose(built.batch.label_vectors["kd_soft"], [[0.5, -1, 2e-3, 7, 1]],
                               rtol=1e-6)
    config.data_config.vector_labels[0].separator = ""
    built = FeatureBuilder(config).build([_record_with(config, t)
                                          for t in ("31402", "3140", "31.02")])
    assert dict(built.rejected) == {1: "bad_label", 2: "bad_label"}
    np.testing.assert_array_equal(built.batch.label_vectors["kd_soft"], [[3, 1, 4, 0, 2]])


# ---- training -----------------------------------------------------------------------------

def _teacher_records(config, n: int, seed: int) -> list[bytes]:
    """Records whose soft label always favours class 3 (logit 9 for class 3, 0 else)."""
    names = [f.input_name for f in config.data_config.input_fields]
    k = names.index("kd_soft")
    sep = config.data_config.separator
    out = []
    for r in _records(config, n, seed=seed):
        row = r.decode().split(sep)
        row[k] = "\x03".join(["0", "0", "0", "9", "0"])
        out.append(sep.join(row).encode())
    return out


def _class3(tm, batch) -> float:
    tm.model.eval()
    with torch.no_grad():
        p = torch.softmax(tm.model(batch).logits, -1)[:, 3].mean()
    tm.model.train()
    return float(p)


def test_the_distillation_term_trains_the_model_toward_the_teacher(tmp_path) -> None:
    """The same records with and without the kd term (at a rate 100 times the sample's, to
    see it in 30 steps): the hard labels are classes 0 and 1 only, the teacher favours class
    3; only with the term does the model keep predicting class 3."""
    probe = FeatureBuilder(_sample()).build(_teacher_records(_sample(), 64, seed=99)).batch
    got = {}
    for weight in (1.0, 0.0):
        config = _sample(str(tmp_path / str(weight)))
        config.model_config.kd[0].loss_weight = weight
        rate = config.train_config.optimizer_config[0].adam_optimizer.learning_rate
        rate.exponential_decay_learning_rate.initial_learning_rate = 0.01  # (1e-4 as written)
        fb = FeatureBuilder(config)
        torch.manual_seed(0)
        tm = TrainModule(config, fb, device="cpu")
        assert (tm.model.distillation is not None) and tm.in_batch_mode == "off"
        first = _class3(tm, probe)
        for step in range(30):
            tm.train_step(fb.build(_teacher_records(config, 32, seed=step)).batch)
        got[weight] = (first, _class3(tm, probe))
    # the hard labels (0 / 1) drive class 3 to nothing; the teacher keeps it alive
    assert got[0.0][1] < 1e-3 < 0.02 < got[1.0][1]
    assert got[1.0][1] > 100 * got[0.0][1]


def _kd_rank(rank: int, world: int, model_dir: str, steps: list) -> dict:
    """One rank training its share of ``steps``; its dense parameters after them."""
    return rank_dense_parameters(_sample(model_dir), rank, steps)


def test_two_ranks_train_one_model_with_the_distillation_term(ranks, tmp_path) -> None:
    """Each rank's soft labels reach its loss (the last step's batches of different sizes):
    the dense part stays one set across the ranks and moves."""
    config = _sample()
    steps = [[_teacher_records(config, 32, seed=10 * k), _teacher_records(
        config, 32 if k < 2 else 20, seed=10 * k + 1)] for k in range(3)]
    got = ranks.run(_kd_rank, 2, str(tmp_path / "m"), steps)
    for name, (value, moved) in got[0].items():
        np.testing.assert_array_equal(value, got[1][name][0], err_msg=name)
        assert moved or "bias" in name or "batch_norm" in name, name


# ---- refusals -----------------------------------------------------------------------------

def _edited(edit):
    config = _sample()
    edit(config)
    return config


@pytest.mark.parametrize(("edit", "field", "message"), [
    (lambda c: c.model_config.kd[0].__setattr__("soft_label_name", "label"),
     "model_config.kd[0].soft_label_name", "is not one of data_config.label_fields"),
    (lambda c: c.model_config.kd[0].__setattr__("loss_type", _L.JRC_LOSS),
     "model_config.kd[0].loss_type", "odl's distillation losses are"),
    (lambda c: c.model_config.kd[0].__setattr__("temperature", -1.0),
     "model_config.kd[0].temperature", "must be >= 0"),
    (lambda c: c.model_config.__setattr__("loss_type", _L.KL_DIVERGENCE_LOSS),
     "model_config.loss_type", "a distillation loss"),
    (lambda c: c.model_config.ClearField("kd"),
     "data_config.vector_labels[0]", "only a model_config.kd reads such a label"),
    (lambda c: c.data_config.input_fields[-1].__setattr__("input_type",
                                                           pipeline_pb2.DatasetConfig.INT64),
     "data_config.vector_labels[0].input_name", "a STRING field"),
    (lambda c: (c.train_config.__setattr__("in_batch_learning", True),
                c.model_config.__setattr__("num_class", 1),
                c.train_config.optimizer_config[0].Clear(),
                c.train_config.optimizer_config[0].adagrad_optimizer.SetInParent()),
     "model_config.kd", "does not take distillation losses"),
])
def test_what_odl_does_not_compute_is_refused_by_field(edit, field, message) -> None:
    config = _edited(edit)
    if field == "data_config.vector_labels[0].input_name":  # (the soft label's field)
        names = [f.input_name for f in config.data_config.input_fields]
        assert names[-1] == "kd_soft"
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == field


@pytest.mark.parametrize("case", ["pred_name", "width"])
def test_a_prediction_the_model_lacks_is_refused_at_start(case) -> None:
    """At start (and --validate_only), where the model is built: a prediction it does not
    have, or a soft label of another width than the prediction."""
    config = _sample()
    if case == "pred_name":
        config.model_config.kd[0].pred_name = "probs_ctr"
        field, message = "model_config.kd[0].pred_name", "it has logits, probs"
    else:
        config.data_config.vector_labels[0].dim = 3
        field, message = "model_config.kd[0].soft_label_name", "holds 3 numbers per record"
    check_pipeline_config(config, online=True)
    with pytest.raises(ConfigError, match=message) as err:
        check_start(config, online=True, device="cpu")
    assert err.value.field == field


def test_a_json_record_may_give_its_soft_label_as_a_list() -> None:
    """JSON records: the soft label as a list of numbers, joined on its separator."""
    import json

    config = _sample()
    names = [f.input_name for f in config.data_config.input_fields]
    row = _records(config, 1, seed=0)[0].decode().split(config.data_config.separator)
    record = dict(zip(names, row, strict=True))
    record["label"] = 2
    record["kd_soft"] = [0.5, -1, 2e-3, 7, 1]
    built = FeatureBuilder(config).build([json.dumps(record).encode()])
    assert not built.rejected
    np.testing.assert_allclose(built.batch.label_vectors["kd_soft"], [[0.5, -1, 2e-3, 7, 1]],
                               rtol=1e-6)
