"""TorchEasyRec's ``raw_feature.normalizer`` (``odl.config.raw_normalizer``): each method's
formula, expressions evaluated without Python, refusals by field, and the feature builder
applying it before a value is used as a number or bucketized."""

from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import text_format

from odl.config.config_error import ConfigError
from odl.config.raw_normalizer import parse_normalizer
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2

X = np.array([-4.0, 0.0, 1e-12, 2.5, 100.0])


@pytest.mark.parametrize("text, formula", [
    ("method=log10,threshold=1e-10,default=-10",
     lambda x: np.where(x > 1e-10, np.log10(np.maximum(x, 1e-300)), -10.0)),
    ("method=zscore,mean=1.5,standard_deviation=4", lambda x: (x - 1.5) / 4),
    ("method=minmax,min=-2,max=3", lambda x: (x + 2) / 5),
    ("method=expression,expr=log(x+5)", lambda x: np.log(x + 5)),
    ("method=expression,expr=sign(x)*sqrt(abs(x)) + 2^3 - x % 3",
     lambda x: np.sign(x) * np.sqrt(np.abs(x)) + 8 - np.fmod(x, 3)),
    ("method=expression,expr=min(x, 1, pi) + max(sigmoid(x), 0.2) + roundp(x / 3, 2)",
     lambda x: np.minimum(np.minimum(x, 1), math.pi) + np.maximum(1 / (1 + np.exp(-x)), 0.2)
     + np.sign(x / 3) * np.floor(np.abs(x / 3) * 100 + 0.5) / 100),
])
def test_each_method_is_its_formula(text, formula) -> None:
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(parse_normalizer(text, "f").apply(X), formula(X),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("text, fragment", [
    ("method=expression,expr=__import__('os').system('true')", "not supported"),
    ("method=expression,expr=x.real", "not supported"),
    ("method=expression,expr=y + 1", "unknown name 'y'"),
    ("method=expression,expr=rnd()", "unknown function rnd()"),
    ("method=expression,expr=x > 1 ? 1 : 0", "conditionals"),
    ("method=zscore,mean=1", "needs standard_deviation"),
    ("method=zscore,mean=1,standard_deviation=0", "must not be 0"),
    ("method=minmax,min=3,max=1", "max must be above min"),
    ("method=sqrt", "starts with method="),
])
def test_anything_else_is_refused_by_field(text, fragment) -> None:
    with pytest.raises(ConfigError) as e:
        parse_normalizer(text, "feature_configs[0].normalizer")
    assert e.value.field == "feature_configs[0].normalizer" and fragment in str(e.value)


CONFIG = """
model_dir: "m"
train_input_path: "x/*.csv"
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "n" input_type: DOUBLE }
  input_fields { input_name: "c" }
  label_fields: "label"
}
feature_configs { raw_feature { feature_name: "n" normalizer: "method=expression,expr=log(x+3)" } }
feature_configs { raw_feature { feature_name: "nb" expression: "user:n"
                                normalizer: "method=zscore,mean=10,standard_deviation=5"
                                boundaries: [-1, 0, 1] embedding_dim: 4 } }
feature_configs { id_feature { feature_name: "c" hash_bucket_size: 10 embedding_dim: 4 } }
model_config {
  feature_groups { group_name: "wide" feature_names: ["c", "nb"] wide_deep: WIDE }
  feature_groups { group_name: "deep" feature_names: ["c", "nb", "n"] wide_deep: DEEP }
  deepfm { dnn { hidden_units: [4] } }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.01 } }
}
"""


def test_the_builder_applies_it_before_use_and_rejects_what_it_cannot_take() -> None:
    config = text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())
    check_pipeline_config(config, online=False)  # the TorchEasyRec form carries it over
    assert [fc.normalizer for fc in config.feature_configs][:2] == [
        "method=expression,expr=log(x+3)", "method=zscore,mean=10,standard_deviation=5"]
    fb = FeatureBuilder(config)
    res = fb.build([b"1,1.0,a", b"0,-5,b", b"1,12.0,c", b"0,4.0,d"])
    assert res.rejected == [(1, "non_finite")]  # log(-5 + 3)
    dense = res.batch.dense.numpy()[:, fb.dense_feature_names.index("n")]
    np.testing.assert_allclose(dense, np.log(np.array([1.0, 12.0, 4.0]) + 3), rtol=1e-6)
    # nb: (x - 10) / 5 = -1.8, 0.4, -1.2 -> buckets of [-1, 0, 1]: 0, 2, 0
    ids = res.batch.sparse.to_dict()["nb"].values().tolist()
    assert ids == [0, 2, 0]


def test_min_max_and_a_normalizer_together_are_refused() -> None:
    text = CONFIG.replace('feature_configs { raw_feature { feature_name: "n" normalizer: '
                          '"method=expression,expr=log(x+3)" } }',
                          'feature_configs { input_names: "n" feature_type: RawFeature '
                          'min_val: 0 max_val: 2 normalizer: "method=minmax,min=0,max=1" }')
    with pytest.raises(ConfigError) as e:
        check_pipeline_config(text_format.Parse(text, pipeline_pb2.EasyRecConfig()),
                              online=False)
    assert e.value.field.endswith(".normalizer") and "not both" in str(e.value)
