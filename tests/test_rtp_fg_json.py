"""EasyRec's fg_json_path: input fields and features made from an RTP FG fg.json, by
EasyRec's converter's rules, written out here per feature kind."""

from __future__ import annotations

import json
import os

import pytest

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import load_pipeline_config
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2

FT = pipeline_pb2.FeatureConfig.FeatureType
DT = pipeline_pb2.DatasetConfig

CONFIG = """
model_dir: "/tmp/odl-rtp-fg-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
fg_json_path: "%s"
data_config {
  label_fields: "clk"
  input_type: RTPInput
  separator: "\\002"
  selected_cols: "0,3"
  rtp_separator: ";"
  input_fields { input_name: "replaced" }
}
feature_config { features { feature_name: "kept" input_names: "user" hash_bucket_size: 9
                            embedding_dim: 4 } }
model_config {
  model_class: "MultiTower"
  feature_groups { group_name: "all" feature_names: ["user", "tags", "price"] }
  multi_tower { towers { input: "all" dnn { hidden_units: [4] use_bn: false } } }
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
}
"""

FG = {
    "embedding_dim": 8,
    "features": [
        {"expression": "user:user", "feature_name": "user", "feature_type": "id_feature",
         "hash_bucket_size": 100, "combiner": "mean", "shared_name": "users",
         "extra_combo_info": {"feature_names": ["tags"], "hash_bucket_size": 50}},
        {"expression": "user:tags", "feature_name": "tags", "feature_type": "id_feature",
         "is_multi": True, "kv_separator": ":", "vocab_list": ["a", "b"],
         "embedding_dimension": 4},
        {"expression": "item:price", "feature_name": "price", "feature_type": "raw_feature"},
        {"expression": "item:vec", "feature_name": "vec", "feature_type": "raw_feature",
         "value_dimension": 3, "default_value": "0"},
        {"expression": "item:age", "feature_name": "age", "feature_type": "raw_feature",
         "bucketize_boundaries": "1,5,10"},
        {"map": "user:m", "key": "item:k", "feature_name": "hit", "feature_type":
         "lookup_feature", "hash_bucket_size": 30, "filter_freq": 2},
        {"map": "user:m", "key": "item:k", "feature_name": "score", "feature_type":
         "lookup_feature", "needDiscrete": False, "boundaries": [0.5, 1.5]},
        {"sequence_name": "click", "features": [
            {"feature_name": "item", "feature_type": "id_feature", "num_buckets": 20},
            {"feature_name": "price", "feature_type": "raw_feature"}]},
    ],
}


def _write(tmp_path, fg, config_dir="conf", fg_path="fg/fg.json"):
    fg_file = tmp_path / config_dir / fg_path
    fg_file.parent.mkdir(parents=True, exist_ok=True)
    fg_file.write_text(json.dumps(fg))
    config_file = tmp_path / config_dir / "pipeline.config"
    config_file.write_text(CONFIG % fg_path)
    return str(config_file)


def test_the_fg_json_becomes_input_fields_and_features(tmp_path):
    config = load_pipeline_config(_write(tmp_path, FG))
    assert not config.fg_json_path  # expanded: checkpoints and exports keep the result
    fields = [(f.input_name, DT.FieldType.Name(f.input_type), f.default_val)
              for f in config.data_config.input_fields]
    assert fields == [("clk", "INT32", "0"), ("user", "STRING", ""), ("tags", "STRING", ""),
                      ("price", "DOUBLE", "0.0"), ("vec", "STRING", "0"),
                      ("age", "INT32", ""), ("hit", "STRING", ""),
                      ("score", "DOUBLE", "0.0"), ("click_item", "STRING", "0"),
                      ("click_price", "STRING", "0.0")]
    fcs = {fc.feature_name or fc.input_names[0]: fc for fc in config.feature_config.features}
    assert list(fcs)[0] == "kept"  # the config's own features stay first
    user, tags = fcs["user"], fcs["tags"]
    assert (user.feature_type, user.hash_bucket_size, user.embedding_dim, user.combiner,
            user.embedding_name, user.separator) == (FT.IdFeature, 100, 8, "mean", "users",
                                                     "\x03")
    assert (list(tags.vocab_list), tags.kv_separator, tags.embedding_dim, tags.combiner) == (
        ["a", "b"], ":", 4, "sum")
    assert (fcs["price"].feature_type, fcs["vec"].raw_input_dim) == (FT.RawFeature, 3)
    assert (fcs["age"].feature_type, fcs["age"].num_buckets) == (FT.IdFeature, 4)
    hit = fcs["hit"]  # filter_freq: a dynamic table that grows, not EasyRec's 2**63 - 1
    assert (hit.feature_type, hit.ev_params.filter_freq, hit.hash_bucket_size) == (
        FT.IdFeature, 2, 0)
    assert (fcs["score"].feature_type, list(fcs["score"].boundaries),
            fcs["score"].embedding_dim) == (FT.RawFeature, [0.5, 1.5], 8)
    combo = fcs["combo__user_tags"]
    assert (combo.feature_type, list(combo.input_names), combo.hash_bucket_size,
            combo.combiner) == (FT.ComboFeature, ["user", "tags"], 50, "mean")
    item, price = fcs["click_item"], fcs["click_price"]
    assert (item.feature_type, item.sub_feature_type, item.num_buckets) == (
        FT.SequenceFeature, FT.IdFeature, 20)
    assert (price.feature_type, price.sub_feature_type) == (FT.SequenceFeature, FT.RawFeature)
    check_pipeline_config(config, online=True)  # a config odl trains


def test_a_relative_path_is_read_beside_the_config_else_from_the_working_directory(
        tmp_path, monkeypatch):
    config_file = _write(tmp_path, FG, config_dir="conf", fg_path="fg.json")
    os.remove(tmp_path / "conf" / "fg.json")
    (tmp_path / "fg.json").write_text(json.dumps(FG))  # EasyRec's: the working directory
    monkeypatch.chdir(tmp_path)
    assert load_pipeline_config(config_file).feature_config.features[1].input_names == ["user"]
    os.remove(tmp_path / "fg.json")
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(config_file)
    assert e.value.field == "fg_json_path" and "fg.json" in str(e.value)


@pytest.mark.parametrize("feature, words", [
    ({"feature_name": "x", "feature_type": "id_feature"}, "hash_bucket_size"),
    ({"feature_name": "x", "feature_type": "raw_feature", "normalizer_fn": "log"},
     "normalizer_fn"),
    ({"feature_name": "x", "feature_type": "expr_feature"}, "expr_feature"),
    ({"feature_type": "id_feature"}, "feature_name"),
])
def test_a_feature_the_converter_refuses_names_it(tmp_path, feature, words):
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(_write(tmp_path, {"features": [feature]}))
    assert e.value.field.startswith("fg_json_path") and words in str(e.value)


def test_a_path_marked_expanded_keeps_the_configs_own_fields_and_reads_no_file(tmp_path):
    """EasyRec writes ``!`` before the path once it has expanded a config (its
    ``fg_test_extensions_final.config``): the fields are the config's, no file is read."""
    config_file = tmp_path / "pipeline.config"
    config_file.write_text(CONFIG % "!fg/missing.json")
    config = load_pipeline_config(str(config_file))
    assert not config.fg_json_path
    assert [f.input_name for f in config.data_config.input_fields] == ["replaced"]
    assert [fc.feature_name for fc in config.feature_config.features] == ["kept"]
