"""EasyRec's ``data_config.sample_weight``: each sample's loss weighted by a column's value.

* the loss is TF's ``SUM_BY_NONZERO_WEIGHTS`` of the weighted per-sample losses, for a
  binary model and a ``num_class`` model;
* a step on records weighted 0 or 1 trains the model exactly as a step on the weight-1
  records alone (tables and dense part); weights 3 triple the loss of weights 1 through the
  real parser, builder and dynamic tables' path;
* a record whose weight is not a number is rejected, by reason;
* the settings that cannot take weights are refused by field. (Serving, which leaves the
  column unread, is checked on EasyRec's ``deepfm_with_sample_weight`` sample in
  ``tests/test_config_compat.py``: trained, exported and served with equal predictions.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_losses import ctr_loss
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from odl.train.train_module import TrainModule

CONFIG = """
model_dir: "m"
train_input_path: "x/*.csv"
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "w" input_type: FLOAT }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "u" }
  label_fields: "label"
  sample_weight: "w"
}
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "c1" hash_bucket_size: 100 embedding_dim: 4 }
  features { input_names: "u" embedding_dim: 4 ev_params { max_capacity: 500 } }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" feature_names: ["c1", "u"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c1", "u", "x"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [8] } }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.01 } }
  seed: 3
}
"""


def config(text: str = CONFIG) -> pipeline_pb2.EasyRecConfig:
    c = text_format.Parse(text, pipeline_pb2.EasyRecConfig())
    check_pipeline_config(c, online=False)
    return c


def records(n: int, seed: int, weights: list[float]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [f"{int(rng.random() < 0.4)},{weights[i % len(weights)]:g},{rng.normal():.3f},"
            f"c{rng.integers(100)},u{rng.integers(300)}".encode() for i in range(n)]


def test_the_loss_is_tfs_sum_by_nonzero_weights() -> None:
    terms = [pipeline_pb2.Loss(loss_type=pipeline_pb2.CLASSIFICATION)]
    s = torch.tensor([2.0, -1.0, 0.5, -0.3], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    w = torch.tensor([2.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    per = torch.nn.functional.binary_cross_entropy_with_logits(s, y, reduction="none")
    want = float((w * per).sum() / 3)  # three nonzero weights
    assert float(ctr_loss(s, y, terms, data_weights=w)) == pytest.approx(want, rel=1e-12)
    # a num_class model: the softmax cross entropy per sample, weighted the same way
    logits = torch.tensor([[1.0, 0.2, -1.0], [0.0, 0.5, 0.1]], dtype=torch.float64)
    onehot = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    ce = -(onehot * torch.log_softmax(logits, dim=1)).sum(dim=1)
    got = ctr_loss(logits, onehot, terms, softmax=True,
                   data_weights=torch.tensor([0.0, 3.0], dtype=torch.float64))
    assert float(got) == pytest.approx(float(3.0 * ce[1]), rel=1e-12)


def test_zero_weights_train_as_if_those_records_were_absent() -> None:
    # fixed tables: a dynamic table would give the kept records' ids other rows (and so
    # other initial values) when the weight-0 records' ids are admitted before them
    c = config(CONFIG.replace("ev_params { max_capacity: 500 }", "hash_bucket_size: 300"))
    fb = FeatureBuilder(c)
    weighted = records(64, 1, [1.0, 0.0])  # every other record weighs nothing
    kept = weighted[0::2]
    a = TrainModule(c, fb, device="cpu")
    b = TrainModule(c, fb, device="cpu")
    batch = fb.build(weighted).batch
    assert batch.sample_weights is not None
    np.testing.assert_array_equal(batch.sample_weights, np.tile([1.0, 0.0], 32))
    a.train_step(batch)
    b.train_step(fb.build(kept).batch)
    for name, t in a.dense_parameters().items():
        torch.testing.assert_close(t, b.dense_parameters()[name], rtol=0, atol=1e-7,
                                   msg=name)
    # the weight-0 records' rows got no gradient: tables equal too (their rows untouched)
    for name, t in a.embedding_tables().items():
        torch.testing.assert_close(t, b.embedding_tables()[name], rtol=0, atol=1e-7,
                                   msg=name)


def test_a_weight_scales_its_samples_loss() -> None:
    """All weights 3: three times the loss of all weights 1, from the same start (the batch
    goes through the dynamic table's remap, which keeps its weights)."""
    c = config()
    fb = FeatureBuilder(c)
    ones = TrainModule(c, fb, device="cpu").train_step(fb.build(records(32, 4, [1.0])).batch)
    threes = TrainModule(c, fb, device="cpu").train_step(fb.build(records(32, 4, [3.0])).batch)
    assert threes.loss == pytest.approx(3 * ones.loss, rel=1e-5)


def test_a_record_without_a_numeric_weight_is_rejected() -> None:
    fb = FeatureBuilder(config())
    good = records(3, 5, [1.0])
    bad_text = good[0].replace(b",1,", b",heavy,", 1)
    bad_inf = good[1].replace(b",1,", b",inf,", 1)
    res = fb.build([bad_text, bad_inf, good[2]])
    assert res.batch.size == 1
    assert sorted(reason for _i, reason in res.rejected) == ["bad_number", "non_finite"]


@pytest.mark.parametrize("edit, fragment", [
    (('sample_weight: "w"', 'sample_weight: "nope"'), "not an input field"),
    (('sample_weight: "w"', 'sample_weight: "c1"'), "numeric input field"),
    (('sample_weight: "w"', 'sample_weight: "label"'), "is a label field"),
    (("seed: 3", "seed: 3 in_batch_learning: true"), "in_batch_learning"),
    (('model_class: "DeepFM"', 'model_class: "DeepFM" losses { loss_type: PAIR_WISE_LOSS }'),
     "PAIR_WISE_LOSS"),
])
def test_settings_that_take_no_weights_are_refused_by_field(edit, fragment) -> None:
    text = CONFIG.replace(*edit)
    with pytest.raises(ConfigError) as e:
        config(text)
    assert e.value.field == "data_config.sample_weight" and fragment in str(e.value)
