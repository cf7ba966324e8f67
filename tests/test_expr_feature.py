"""EasyRec's ExprFeature: its expression read as EasyRec reads it, one dense column per
record, and its errors by field."""

from __future__ import annotations

import numpy as np
import pytest

from odl.config.config_error import ConfigError
from odl.config.expr_feature import compile_expression
from odl.features.feature_builder import FeatureBuilder
from tests.harness import assert_edit_refused, load_config_text

CONFIG = """
model_dir: "/tmp/odl-expr-feature-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config {
  batch_size: 8
  input_fields { input_name: "clk" input_type: INT32 }
  input_fields { input_name: "user" input_type: STRING }
  input_fields { input_name: "age" input_type: INT32 }
  input_fields { input_name: "item_age" input_type: STRING }
  label_fields: "clk"
}
feature_config {
  features { input_names: "user" hash_bucket_size: 100 embedding_dim: 4 }
  features { feature_name: "fits" input_names: ["age", "item_age"] feature_type: ExprFeature
             expression: "(age>=item_age) & (age<=(item_age+5))" }
}
model_config {
  model_class: "MultiTower"
  feature_groups { group_name: "all" feature_names: ["user", "fits"] wide_deep: DEEP }
  multi_tower { towers { input: "all" dnn { hidden_units: [4] use_bn: false } }
                final_dnn { hidden_units: [2] use_bn: false } }
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
}
"""

A = np.array([0.0, 1.0, 3.0, 6.0, 9.0])
B = np.array([1.0, 1.0, 2.0, 8.0, 1.0])


@pytest.mark.parametrize("text, want", [
    ("a>=1", A >= 1),
    ("a<(b+5)", A < B + 5),
    ("a==b", A == B),
    ("(a>=b) & (a<=(b+5))", (A >= B) & (A <= B + 5)),
    ("(a>=b) | (a>5)", (A >= B) | (A > 5)),
    ("a*2+b/2", A * 2 + B / 2),
    # EasyRec applies the operators left to right with no precedence:
    # ((a > 1) & b) < 2, which holds everywhere (a 0 / 1 is below 2)
    ("a>1&b<2", np.ones(5)),
    ("a>b>0", (A > B).astype(float) > 0),
])
def test_expressions_read_as_easyrec_reads_them(text, want):
    got = compile_expression(text, ["a", "b"], "expression")({"a": A, "b": B})
    assert np.array_equal(np.broadcast_to(got, (5,)), np.asarray(want, dtype=float))


@pytest.mark.parametrize("text, words", [
    ("", "needs an expression"), ("c>1", "not one of input_names"), ("(a>1", "incomplete"),
    ("a>1)", "unbalanced"), (">1", "without a left operand"), ("a b", "not arithmetic"),
    ("a**2", "only + - * /"),
])
def test_malformed_expressions_are_refused(text, words):
    with pytest.raises(ConfigError) as e:
        compile_expression(text, ["a", "b"], "feature_config.features[1].expression")
    assert e.value.field == "feature_config.features[1].expression" and words in str(e.value)


def test_the_feature_is_one_dense_column_and_a_non_number_input_is_rejected():
    fb = FeatureBuilder(load_config_text(CONFIG))
    assert fb.dense_feature_columns["fits"] == ["fits"]
    built = fb.build([b"1,u1,3,2", b"0,u2,9,1", b"1,u3,6,8", b"0,u4,4,x"])
    assert built.rejected == [(3, "bad_number")]
    assert built.batch.dense[:, 0].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("edit, field, words", [
    (('expression: "(age>=item_age) & (age<=(item_age+5))"',
      'expression: "(age>=item_age) & (age<=(item_age+5))" embedding_dim: 4'),
     "feature_config.features[1].embedding_dim", "one number"),
    (('expression: "(age>=item_age) & (age<=(item_age+5))"', 'expression: "user>1"'),
     "feature_config.features[1].expression", "not one of input_names"),
    (('features { input_names: "user" hash_bucket_size: 100 embedding_dim: 4 }',
      'features { input_names: "user" hash_bucket_size: 100 embedding_dim: 4 '
      'expression: "user" }'),
     "feature_config.features[0].expression", "belongs to an ExprFeature"),
])
def test_expr_feature_errors_name_the_field(edit, field, words):
    assert_edit_refused(CONFIG, edit, field, words)
