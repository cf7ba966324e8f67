"""Tests of odl.config: loading, edit_config_json, validation, redaction and saving."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import time
from pathlib import Path

import pytest
import torch

from odl.config.config_edit import apply_edit_config_json
from odl.config.config_error import ConfigError, ConfigErrors
from odl.config.config_redaction import config_to_text, save_pipeline_config
from odl.config.easyrec_compat import unwritten_batch_norm_dnns
from odl.config.feature_configs import feature_configs
from odl.config.field_formats import parse_dead_line, parse_offset_info
from odl.config.pipeline_config import load_pipeline_config, parse_pipeline_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import build_model, check_pipeline_config
from odl.protos import pipeline_pb2

ROOT = Path(__file__).resolve().parent.parent
ONLINE = ROOT / "samples" / "deepfm_online.config"
OFFLINE = ROOT / "samples" / "deepfm_offline.config"

# An EasyRec ODL user's config, in EasyRec's style (nested feature_config form, tf.nn.relu,
# two optimizer_config entries, EasyRec's exponential decay), trimmed to a few features.
EASYREC_STYLE = """
model_dir: "oss://bucket/easy_rec/odl_deepfm"
kafka_train_input {
  server: "alikafka-host:9092"
  topic: "rec_samples"
  group: "easyrec_odl"
  partitions: 4
  offset_info: '{"0": 10, "1": 20, "2": 0, "3": 5}'
}
data_config {
  input_fields {
    input_name: "clk"
    input_type: INT32
    default_val: "0"
  }
  input_fields {
    input_name: "user_id"
    input_type: STRING
  }
  input_fields {
    input_name: "item_id"
    input_type: INT64
  }
  input_fields {
    input_name: "price"
    input_type: DOUBLE
    default_val: "0.0"
  }
  input_fields {
    input_name: "age"
    input_type: DOUBLE
  }
  label_fields: "clk"
  batch_size: 4096
  input_type: KafkaInput
  separator: ","
}
feature_config: {
  features: {
    input_names: "user_id"
    feature_type: IdFeature
    embedding_dim: 8
    hash_bucket_size: 100000
  }
  features: {
    input_names: "item_id"
    feature_type: IdFeature
    embedding_dim: 8
    num_buckets: 50000
  }
  features: {
    input_names: "age"
    feature_type: RawFeature
    boundaries: [18.0, 25.0, 35.0, 50.0]
    embedding_dim: 8
  }
  features: {
    input_names: "price"
    feature_type: RawFeature
  }
  features: {
    feature_name: "user_item"
    input_names: ["user_id", "item_id"]
    feature_type: ComboFeature
    embedding_dim: 8
    hash_bucket_size: 1000000
  }
}
model_config: {
  model_class: 'DeepFM'
  feature_groups: {
    group_name: 'wide'
    feature_names: 'user_id'
    feature_names: 'item_id'
    feature_names: 'age'
    wide_deep: WIDE
  }
  feature_groups: {
    group_name: 'deep'
    feature_names: 'user_id'
    feature_names: 'item_id'
    feature_names: 'age'
    feature_names: 'price'
    feature_names: 'user_item'
    wide_deep: DEEP
  }
  deepfm {
    dnn {
      hidden_units: [128, 64, 32]
      activation: "tf.nn.relu"
    }
    final_dnn {
      hidden_units: [32]
    }
    l2_regularization: 1e-5
  }
  embedding_regularization: 1e-7
}
train_config {
  log_step_count_steps: 200
  optimizer_config: {
    adagrad_optimizer: {
      learning_rate: {
        exponential_decay_learning_rate {
          initial_learning_rate: 0.01
          decay_steps: 10000
          decay_factor: 0.5
          min_learning_rate: 0.0001
        }
      }
    }
  }
  optimizer_config: {
    adam_optimizer: {
      learning_rate: {
        constant_learning_rate {
          learning_rate: 0.0005
        }
      }
    }
  }
  save_checkpoints_steps: 2000
  enable_oss_stop_signal: true
  dead_line: "20301231 23:59:59"
}
"""


def write(tmp_path: Path, text: str, name: str = "pipeline.config") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_text(tmp_path: Path, text: str, **kwargs) -> pipeline_pb2.EasyRecConfig:
    return load_pipeline_config(write(tmp_path, text), **kwargs)


@pytest.fixture()
def online() -> pipeline_pb2.EasyRecConfig:
    return load_pipeline_config(str(ONLINE))


def error_of(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return info.value


# ------------------------------------------------------------------ samples / loading


def test_online_sample_loads_and_validates() -> None:
    config = load_pipeline_config(str(ONLINE))
    check_pipeline_config(config, online=True)
    assert config.model_dir == ".odl/deepfm_online"
    assert config.kafka_train_input.topic == "odl_samples"
    assert len(config.data_config.input_fields) == 42
    feats = feature_configs(config)
    names = [f.feature_name for f in feats]
    assert names[:3] == ["C1", "C2", "C3"] and "I1_bucket" in names and "C6_C14" in names
    rows = sum(f.hash_bucket_size or f.num_buckets or len(f.boundaries) + 1
               for f in feats if f.embedding_dim)
    assert rows <= 2_000_000
    assert len(config.train_config.optimizer_config) == 2


def test_offline_sample_loads_and_validates() -> None:
    config = load_pipeline_config(str(OFFLINE))
    check_pipeline_config(config, online=False)
    assert config.train_input_path
    assert config.train_config.HasField("sparse_optimizer")
    assert config.train_config.num_steps > 0
    # Same model as the online sample.
    online_cfg = load_pipeline_config(str(ONLINE))
    assert [f.SerializeToString() for f in feature_configs(config)] == [
        f.SerializeToString() for f in feature_configs(online_cfg)]
    assert config.model_config == online_cfg.model_config


def test_easyrec_style_config_loads(tmp_path: Path) -> None:
    config = load_text(tmp_path, EASYREC_STYLE, model_dir=str(tmp_path / "m"))
    check_pipeline_config(config, online=True)
    assert config.model_dir == str(tmp_path / "m")
    feats = feature_configs(config)
    assert [f.feature_name for f in feats] == ["user_id", "item_id", "age", "price", "user_item"]
    # The config's own messages are not modified by feature_configs().
    assert config.feature_config.features[0].feature_name == ""
    assert parse_offset_info(config.kafka_train_input.offset_info) == (
        "offsets", {0: 10, 1: 20, 2: 0, 3: 5})


def test_torcheasyrec_style_model_class_inferred(tmp_path: Path) -> None:
    text = EASYREC_STYLE.replace("model_class: 'DeepFM'", "")
    config = load_text(tmp_path, text)
    assert config.model_config.model_class == "DeepFM"
    wide_and_deep = load_text(tmp_path, text.replace("deepfm {", "wide_and_deep {"))
    assert wide_and_deep.model_config.model_class == "WideAndDeep"


@pytest.mark.parametrize("path", sorted((ROOT / "samples").glob("*.config")),
                         ids=lambda p: p.name)
def test_every_sample_config_validates(path: Path) -> None:
    config = load_pipeline_config(str(path))
    online = any(config.HasField(f) for f in ("kafka_train_input", "datahub_train_input",
                                              "file_stream_input"))
    check_pipeline_config(config, online=online)
    from odl.train.memory_estimate import estimate_memory

    est = estimate_memory(config, "cpu")  # what odl-train --validate_only checks next
    model = build_model(config, FeatureBuilder(config))
    assert est.tables and est.dense_parameters == sum(
        p.numel() for p in model.dense.parameters()) > 0


def test_wide_and_deep_sample_is_the_deepfm_sample_without_fm() -> None:
    wd = load_pipeline_config(str(ROOT / "samples" / "wide_and_deep_online.config"))
    fm = load_pipeline_config(str(ONLINE))
    assert wd.model_config.model_class == "WideAndDeep"
    assert list(wd.model_config.feature_groups) == list(fm.model_config.feature_groups)
    assert wd.model_config.wide_and_deep.dnn == fm.model_config.deepfm.dnn


def test_missing_file(tmp_path: Path) -> None:
    err = error_of(load_pipeline_config, str(tmp_path / "nope.config"))
    assert err.field == "pipeline_config_path"
    assert "file not found" in str(err)


def test_parse_error_names_field_and_position(tmp_path: Path) -> None:
    err = error_of(load_text, tmp_path, 'model_dir: "x"\ntrain_config {\n  num_steps: "abc"\n}\n')
    assert err.field == "train_config.num_steps"
    assert str(err).startswith(
        "invalid config field 'train_config.num_steps': expected an integer, got \"abc\"")
    assert ":3:14" in str(err)


def test_parse_error_inside_repeated_message(tmp_path: Path) -> None:
    text = ('feature_configs { input_names: "a" }\n'
            'feature_configs { input_names: "b" embedding_dim: x }\n')
    err = error_of(load_text, tmp_path, text)
    assert err.field == "feature_configs[1].embedding_dim"


def test_unknown_field(tmp_path: Path) -> None:
    err = error_of(load_text, tmp_path, 'model_dir: "x"\ntrain_config { num_stepz: 3 }\n')
    assert err.field == "train_config.num_stepz"
    assert "unknown field 'num_stepz'" in str(err)
    assert "did you mean 'num_steps'" in str(err)
    assert ":2:16" in str(err)


@pytest.mark.parametrize(
    "text, field",
    [
        ('hive_train_input { }', "hive_train_input"),
        ("train_config { force_restore_shape_compatible: true }",
         "train_config.force_restore_shape_compatible"),
        ("model_config { masknet { } }", "model_config.masknet"),
        # a model's settings message lists its own (pipeline.proto's message option)
        ("model_config { dbmtl { use_feature_bn: true } }", "model_config.dbmtl.use_feature_bn"),
        ("model_config { dbmtl { use_feature_bn: false } }",
         "model_config.dbmtl.use_feature_bn"),
        ('feature_configs { input_names: "a" } feature_configs { precision: 3 }',
         "feature_configs[1].precision"),
        # TorchEasyRec's data and train settings that would change what is trained
        ("data_config { sample_mask_prob: 0.1 }", "data_config.sample_mask_prob"),
        ('data_config { sample_weight_fields: "w" }', "data_config.sample_weight_fields"),
        ("data_config { batch_cost_size: 100 }", "data_config.batch_cost_size"),
        ("train_config { delta_embedding_dump_config { } }",
         "train_config.delta_embedding_dump_config"),
    ],
)
def test_easyrec_field_not_implemented(tmp_path: Path, text: str, field: str) -> None:
    err = error_of(load_text, tmp_path, text)
    assert err.field == field
    assert "is an EasyRec field that odl does not implement yet" in str(err)


@pytest.mark.parametrize(
    "text, field",
    [
        ('eval_config { metrics_set { auc {} } metrics_set { recall_at_topk { topk: 5 } } }',
         "eval_config.metrics_set[1].recall_at_topk"),
        ('export_config { exporter_type: "final" multi_value_fields { input_name: ["a"] } }',
         "export_config.exporter_type"),
        ('export_config { exporter_type: "final" multi_value_fields { input_name: ["a"] } }',
         "export_config.multi_value_fields"),
        ("train_config { sync_replicas: true }", "train_config.sync_replicas"),
        ("train_config { incr_save_config { debug_save_update: true } }",
         "train_config.incr_save_config.debug_save_update"),
        ("train_config { optimizer_config { use_moving_average: false } }",
         "train_config.optimizer_config[0].use_moving_average"),
        ("data_config { prefetch_size: 32 chief_redundant: true }", "data_config.prefetch_size"),
        # parameter-server settings of EasyRec's distributed jobs
        ("data_config { shard: true }", "data_config.shard"),
        ("train_config { sparse_accumulator_type: \"multi_map\" }",
         "train_config.sparse_accumulator_type"),
        ('feature_configs { input_names: "a" max_partitions: 4 }',
         "feature_configs[0].max_partitions"),
        # TorchEasyRec's data-loader and checkpoint-timing settings
        ("data_config { pin_memory: true in_order: false }", "data_config.pin_memory"),
        ('data_config { odps_data_compression: "ZSTD" }', "data_config.odps_data_compression"),
        ("train_config { save_checkpoints_timestamp_interval: 3600 }",
         "train_config.save_checkpoints_timestamp_interval"),
    ],
)
def test_easyrec_field_without_effect_is_accepted_with_a_warning(
        tmp_path: Path, text: str, field: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="odl.config.pipeline_config"):
        config = load_text(tmp_path, text + '\nmodel_dir: "m"')
    assert config.model_dir == "m"  # parsed on past the field
    warnings = [r.getMessage() for r in caplog.records]
    assert any(f"config field {field} has no effect in odl" in w for w in warnings), warnings


def test_easyrec_field_that_would_change_the_model_is_refused(tmp_path: Path) -> None:
    err = error_of(load_text, tmp_path, "train_config { use_moving_average: true }")
    assert err.field == "train_config.use_moving_average"
    assert "would change the trained model" in str(err) and ":1:16" in str(err)


def test_every_field_error_of_a_config_in_one_run(tmp_path: Path) -> None:
    text = ("train_config {\n  num_stepz: 3\n  force_restore_shape_compatible: true\n"
            "  sync_replicas: true\n}\nmodel_config { dssm { } }\nmodl_dir: 'x'\n")
    err = error_of(load_text, tmp_path, text)
    assert isinstance(err, ConfigErrors)
    assert [e.field for e in err.errors] == [
        "train_config.num_stepz", "train_config.force_restore_shape_compatible",
        "model_config.dssm", "modl_dir"]
    assert str(err).startswith("4 config errors:") and ":7:1" in str(err)


@pytest.mark.parametrize("input_type", ["DataHubInput", "OdpsInputV2", "CSVInput",
                                        "KafkaInput"])
def test_every_easyrec_input_type_is_accepted_the_input_section_decides(
        online: pipeline_pb2.EasyRecConfig, input_type: str) -> None:
    """EasyRec's input_type is informational: a config written for another input keeps it and
    trains from the section that is set."""
    from google.protobuf import text_format

    text = text_format.MessageToString(online).replace(
        "input_type: KafkaInput", f"input_type: {input_type}")
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    assert pipeline_pb2.DatasetConfig.InputType.Name(config.data_config.input_type) == input_type
    assert config.kafka_train_input.topic == online.kafka_train_input.topic


@pytest.mark.parametrize(
    "text, field, value",
    [
        ('feature_configs { input_names: "a" feature_type: PassThroughFeature }',
         "feature_configs[0].feature_type", "PassThroughFeature"),
        ("model_config { loss_type: LISTWISE_RANK_LOSS }", "model_config.loss_type",
         "LISTWISE_RANK_LOSS"),
        ("model_config { loss_type: PAIRWISE_HINGE_LOSS }", "model_config.loss_type",
         "PAIRWISE_HINGE_LOSS"),
    ],
)
def test_easyrec_value_not_implemented(tmp_path: Path, text: str, field: str, value: str) -> None:
    err = error_of(load_text, tmp_path, text)
    assert err.field == field
    assert f"{value} is an EasyRec value that odl does not implement yet" in str(err)


def test_unknown_enum_value(tmp_path: Path) -> None:
    err = error_of(load_text, tmp_path, 'feature_configs { feature_type: Bogus }')
    assert err.field == "feature_configs[0].feature_type"
    assert "unknown value 'Bogus'" in str(err) and "IdFeature" in str(err)


def test_model_class_not_implemented_and_num_class_below_one(tmp_path: Path) -> None:
    err = error_of(load_text, tmp_path, 'model_config { model_class: "DSSM" }')
    assert err.field == "model_config.model_class"
    assert "EasyRec value that odl does not implement yet" in str(err)
    err = error_of(load_text, tmp_path, 'model_config { model_class: "DeepFM" num_class: 0 }')
    assert err.field == "model_config.num_class"


def test_parse_error_does_not_echo_secret_line(tmp_path: Path) -> None:
    text = ('kafka_train_input {\n  kafka_config { key: "sasl.password" value: "hunter2" '
            'bogus: 1 }\n}\n')
    err = error_of(load_text, tmp_path, text)
    assert "hunter2" not in str(err)


def test_config_error_is_value_error_and_picklable() -> None:
    err = ConfigError("a.b", "bad")
    assert isinstance(err, ValueError)
    assert str(err) == "invalid config field 'a.b': bad"
    again = pickle.loads(pickle.dumps(err))
    assert (again.field, again.message) == ("a.b", "bad")


# ------------------------------------------------------------------ edit_config_json


def test_edit_flat_and_json_text(online) -> None:
    apply_edit_config_json(online, '{"train_config.num_steps": 10, '
                                   '"kafka_train_input.server": "h:9092"}')
    assert online.train_config.num_steps == 10
    assert online.kafka_train_input.server == "h:9092"


def test_edit_via_loader(tmp_path: Path) -> None:
    config = load_pipeline_config(str(ONLINE), edit_config_json={"data_config.batch_size": 64},
                                  model_dir=str(tmp_path))
    assert config.data_config.batch_size == 64
    assert config.model_dir == str(tmp_path)


def test_edit_numeric_strings_accepted(online) -> None:
    apply_edit_config_json(online, {"train_config.num_steps": "12",
                                    "model_config.embedding_regularization": "0.5",
                                    "train_config.enable_oss_stop_signal": "false"})
    assert online.train_config.num_steps == 12
    assert online.model_config.embedding_regularization == pytest.approx(0.5)
    assert online.train_config.enable_oss_stop_signal is False


def test_edit_nested_merges(online) -> None:
    apply_edit_config_json(online, {"train_config": {"num_steps": 10,
                                                     "keep_checkpoint_max": 7}})
    assert online.train_config.num_steps == 10
    assert online.train_config.keep_checkpoint_max == 7
    assert online.train_config.save_checkpoints_steps == 200  # kept
    assert len(online.train_config.optimizer_config) == 2  # kept


def test_edit_indexed_repeated(online) -> None:
    apply_edit_config_json(online, {
        "feature_configs[0].boundaries": [1, 2, 3],
        "model_config.feature_groups[1].feature_names": ["C1", "I1"],
        "model_config.deepfm.dnn.hidden_units[0]": 512,
        "feature_configs[-1].embedding_dim": 4,
    })
    assert list(online.feature_configs[0].boundaries) == [1.0, 2.0, 3.0]
    assert list(online.model_config.feature_groups[1].feature_names) == ["C1", "I1"]
    assert list(online.model_config.deepfm.dnn.hidden_units) == [512, 128, 64]
    assert online.feature_configs[-1].embedding_dim == 4


def test_edit_selector(online) -> None:
    apply_edit_config_json(online, {"feature_configs[input_names[0]=C3].embedding_dim": 8,
                                    "feature_configs[feature_name=C6_C14].hash_bucket_size": 7,
                                    "feature_configs[hash_bucket_size>=200000].embedding_dim":
                                        32})
    feats = {f.feature_name: f for f in feature_configs(online)}
    assert feats["C3"].embedding_dim == 32  # 200000 buckets: the later edit wins
    assert feats["C6_C14"].hash_bucket_size == 7
    assert feats["C4"].embedding_dim == 16
    assert feats["C12"].embedding_dim == 32


def test_edit_selector_quoted_and_slice(online) -> None:
    apply_edit_config_json(online, {"feature_configs[input_names[0]='C2'].embedding_dim": 8,
                                    "feature_configs[:1].embedding_dim": 4})
    assert online.feature_configs[0].embedding_dim == 4
    assert online.feature_configs[1].embedding_dim == 8


def test_edit_feature_configs_reaches_nested_form() -> None:
    config = load_pipeline_config(str(OFFLINE))
    apply_edit_config_json(config, {"feature_configs[input_names[0]=C1].embedding_dim": 8})
    assert config.feature_config.features[0].embedding_dim == 8
    assert not config.feature_configs


def test_edit_enum_by_name_and_number(online) -> None:
    apply_edit_config_json(online, {"data_config.input_fields[1].input_type": "FLOAT",
                                    "data_config.record_format": 2})
    assert online.data_config.input_fields[1].input_type == (
        pipeline_pb2.DatasetConfig.FLOAT)
    assert online.data_config.record_format == pipeline_pb2.DatasetConfig.JSON


def test_edit_map(online) -> None:
    apply_edit_config_json(online, {"kafka_train_input.kafka_config": {
        "security.protocol": "SASL_SSL", "sasl.password": "pw", "retries": 3}})
    apply_edit_config_json(online, {"kafka_train_input.kafka_config": {"retries": None}})
    assert dict(online.kafka_train_input.kafka_config) == {
        "security.protocol": "SASL_SSL", "sasl.password": "pw"}


def test_edit_repeated_message_list_and_text(online) -> None:
    apply_edit_config_json(online, {"train_config.optimizer_config": [
        {"sgd_optimizer": {"learning_rate": {"constant_learning_rate": {"learning_rate": 0.1}}}},
    ]})
    assert len(online.train_config.optimizer_config) == 1
    assert online.train_config.optimizer_config[0].WhichOneof("optimizer") == "sgd_optimizer"
    apply_edit_config_json(online, {"model_config.deepfm.final_dnn": "hidden_units: [8, 4]"})
    assert list(online.model_config.deepfm.final_dnn.hidden_units) == [8, 4]


def test_edit_null_clears(online) -> None:
    apply_edit_config_json(online, {"train_config.keep_checkpoint_max": None})
    assert not online.train_config.HasField("keep_checkpoint_max")


@pytest.mark.parametrize(
    "edits, field, text",
    [
        ({"train_config.num_steps": "abc"}, "train_config.num_steps",
         "expected an integer, got \"abc\""),
        ({"train_config.num_steps": -1}, "train_config.num_steps", "out of range"),
        ({"train_config.bogus": 1}, "train_config.bogus", "unknown field 'bogus'"),
        ({"train_config.use_moving_average": True}, "train_config.use_moving_average",
         "would change the trained model"),
        ({"train_config.force_restore_shape_compatible": True},
         "train_config.force_restore_shape_compatible",
         "EasyRec field that odl does not implement yet"),
        ({"nothing.at_all": 1}, "nothing.at_all", "unknown field 'nothing'"),
        ({"feature_configs[99].embedding_dim": 1}, "feature_configs[99].embedding_dim",
         "out of range"),
        ({"feature_configs[input_names[0]=ZZ].embedding_dim": 1},
         "feature_configs[input_names[0]=ZZ].embedding_dim", "matched no element"),
        ({"feature_configs.embedding_dim": 1}, "feature_configs.embedding_dim", "repeated"),
        ({"data_config.input_type": "NoSuchInput"}, "data_config.input_type", "expected one of"),
        ({"model_config.loss_type": "CIRCLE_LOSS"}, "model_config.loss_type",
         "EasyRec value that odl does not implement yet"),
        ({"train_config": 3}, "train_config", "expected an object"),
        ({"train_config": {"num_steps": "x"}}, "train_config.num_steps", "expected an integer"),
        ({"kafka_train_input.kafka_config": ["a"]}, "kafka_train_input.kafka_config",
         "expected an object"),
        ({"train_config.enable_oss_stop_signal": "maybe"},
         "train_config.enable_oss_stop_signal", "expected true or false"),
        ({"model_config.model_class": ["DeepFM"]}, "model_config.model_class",
         "expected a single value"),
    ],
)
def test_edit_errors_name_the_path(online, edits, field, text) -> None:
    err = error_of(apply_edit_config_json, online, edits)
    assert err.field == field
    assert text in str(err)


def test_edit_malformed_json(online) -> None:
    err = error_of(apply_edit_config_json, online, "{not json")
    assert err.field == "edit_config_json"
    err = error_of(apply_edit_config_json, online, "[1, 2]")
    assert err.field == "edit_config_json"


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "edits, online_mode, field",
    [
        ({"model_dir": ""}, True, "model_dir"),
        ({"kafka_train_input.server": ""}, True, "kafka_train_input.server"),
        ({"kafka_train_input.server": "nohostport"}, True, "kafka_train_input.server"),
        ({"kafka_train_input.topic": ""}, True, "kafka_train_input.topic"),
        ({}, False, "train_input_path"),
        ({"train_input_path": "odps://proj/tables/t"}, False, "train_input_path"),
        ({"data_config.batch_size": 0}, True, "data_config.batch_size"),
        ({"data_config.input_fields": []}, True, "data_config.input_fields"),
        ({"data_config.input_fields[4].input_name": "I1"}, True,
         "data_config.input_fields[4].input_name"),
        ({"data_config.input_fields[3].default_val": "x"}, True,
         "data_config.input_fields[3].default_val"),
        ({"data_config.label_fields": []}, True, "data_config.label_fields"),
        ({"data_config.label_fields": ["nope"]}, True, "data_config.label_fields[0]"),
        ({"data_config.label_fields": ["C1"]}, True, "data_config.label_fields[0]"),
        ({"data_config.sample_id_field": "nope"}, True, "data_config.sample_id_field"),
        ({"data_config.event_time_field": "C1"}, True, "data_config.event_time_field"),
        ({"feature_configs[2].input_names": ["nope"]}, True, "feature_configs[2].input_names[0]"),
        ({"feature_configs[2].input_names": ["label"]}, True,
         "feature_configs[2].input_names[0]"),
        ({"feature_configs[1].feature_name": "C1"}, True, "feature_configs[1].feature_name"),
        ({"feature_configs[0].embedding_dim": 0}, True, "feature_configs[0].embedding_dim"),
        ({"feature_configs[0].num_buckets": 10}, True, "feature_configs[0].hash_bucket_size"),
        ({"feature_configs[0].hash_bucket_size": 0}, True,
         "feature_configs[0].hash_bucket_size"),
        ({"feature_configs[feature_name=I1_bucket].boundaries": [3, 2]}, True,
         "feature_configs[39].boundaries"),
        ({"feature_configs[feature_name=I1_bucket].embedding_dim": 0}, True,
         "feature_configs[39].embedding_dim"),
        # a projected raw feature joins FM: it needs FM's dim
        ({"feature_configs[feature_name=I2].embedding_dim": 4}, True,
         "model_config.feature_groups[1].feature_names"),
        ({"feature_configs[27].feature_name": "I2", "feature_configs[27].input_names": ["C1"]},
         True,
         "feature_configs[27].input_names[0]"),
        ({"feature_configs[feature_name=C6_C14].input_names": ["C6"]}, True,
         "feature_configs[40].input_names"),
        ({"feature_configs[0].combiner": "max"}, True, "feature_configs[0].combiner"),
        ({"model_config.feature_groups[0].feature_names": ["C1", "nope"]}, True,
         "model_config.feature_groups[0].feature_names[1]"),
        ({"model_config.feature_groups[0].group_name": "deep"}, True,
         "model_config.feature_groups[1].group_name"),
        ({"model_config.feature_groups[0].group_name": "linear"}, True,
         "model_config.feature_groups"),
        ({"model_config.deepfm": None}, True, "model_config.deepfm"),
        ({"model_config.deepfm.dnn.hidden_units": []}, True,
         "model_config.deepfm.dnn.hidden_units"),
        ({"model_config.deepfm.dnn.activation": "softsign"}, True,
         "model_config.deepfm.dnn.activation"),
        ({"model_config.deepfm.dnn.dropout_ratio": [0.5]}, True,
         "model_config.deepfm.dnn.dropout_ratio"),
        ({"model_config.deepfm.wide_output_dim": 4}, True,
         "model_config.deepfm.wide_output_dim"),
        ({"feature_configs[input_names[0]=C5].embedding_dim": 8}, True,
         "model_config.feature_groups[1].feature_names"),
        ({"kafka_train_input.offset_info": "{bad"}, True, "kafka_train_input.offset_info"),
        ({"kafka_train_input.offset_info": '{"timestamp": 1}', "kafka_train_input.offset_time": 5},
         True, "kafka_train_input.offset_time"),
        ({"train_config.dead_line": "tomorrow"}, True, "train_config.dead_line"),
        ({"train_config.optimizer_config": []}, True, "train_config.optimizer_config"),
        ({"train_config.optimizer_config": [{}, {}, {}]}, True, "train_config.optimizer_config"),
        ({"train_config.optimizer_config": [{}]}, True, "train_config.optimizer_config[0]"),
        ({"train_config.sparse_optimizer": {"sgd_optimizer": {"lr": 0.1}}}, True,
         "train_config.optimizer_config"),
        ({"train_config.optimizer_config[1].adam_optimizer.beta1": 1.5}, True,
         "train_config.optimizer_config[1].adam_optimizer.beta1"),
        ({"train_config.optimizer_config[0].adagrad_optimizer.learning_rate."
          "constant_learning_rate.learning_rate": 0}, True,
         "train_config.optimizer_config[0].adagrad_optimizer.learning_rate."
         "constant_learning_rate.learning_rate"),
        ({"train_config.num_steps": 0}, True, "train_config.num_steps"),
        ({"train_config.log_step_count_steps": 0}, True, "train_config.log_step_count_steps"),
        ({"train_config.stop_signal_poll_secs": 0}, True, "train_config.stop_signal_poll_secs"),
        ({"train_config.fine_tune_checkpoint": "x",
          "train_config.fine_tune_ckpt_var_map": "/no/such/map.txt"}, True,
         "train_config.fine_tune_ckpt_var_map"),
    ],
)
def test_validation_names_the_field(online, edits, online_mode, field) -> None:
    apply_edit_config_json(online, edits)
    err = error_of(check_pipeline_config, online, online=online_mode)
    assert err.field == field, str(err)
    assert str(err).startswith(f"invalid config field '{field}': ")


def test_validation_both_feature_forms(online) -> None:
    online.feature_config.features.add(input_names=["C1"], embedding_dim=16,
                                       hash_bucket_size=10)
    err = error_of(check_pipeline_config, online, online=True)
    assert err.field == "feature_config"


def test_validation_nested_feature_form_paths() -> None:
    config = load_pipeline_config(str(OFFLINE))
    apply_edit_config_json(config, {"feature_config.features[2].embedding_dim": 0})
    err = error_of(check_pipeline_config, config, online=False)
    assert err.field == "feature_config.features[2].embedding_dim"


def test_validation_tzrec_optimizers_go_together() -> None:
    config = load_pipeline_config(str(OFFLINE))
    config.train_config.ClearField("dense_optimizer")
    err = error_of(check_pipeline_config, config, online=False)
    assert err.field == "train_config.dense_optimizer"


def test_validation_fine_tune_var_map_exists(online, tmp_path: Path) -> None:
    var_map = tmp_path / "map.txt"
    var_map.write_text("a\tb\n")
    apply_edit_config_json(online, {"train_config.fine_tune_checkpoint": str(tmp_path),
                                    "train_config.fine_tune_ckpt_var_map": str(var_map)})
    check_pipeline_config(online, online=True)


# ------------------------------------------------------------------ helpers


def test_parse_offset_info() -> None:
    assert parse_offset_info("") is None
    assert parse_offset_info('{"timestamp": 1767225600}') == ("timestamp", 1767225600.0)
    assert parse_offset_info('{"timestamp": 1767225600.5}') == ("timestamp", 1767225600.5)
    assert parse_offset_info('{"0": 5, "3": 0}') == ("offsets", {0: 5, 3: 0})
    for bad in ("{bad", "[1]", "{}", '{"timestamp": "x"}', '{"timestamp": 1, "0": 2}',
                '{"a": 1}', '{"0": -1}', '{"0": 1.5}', '{"timestamp": 1767225600000}'):
        with pytest.raises(ConfigError) as info:
            parse_offset_info(bad)
        assert info.value.field == "kafka_train_input.offset_info"


def test_parse_dead_line() -> None:
    assert parse_dead_line("") is None
    expected = time.mktime(time.strptime("20260508 23:59:59", "%Y%m%d %H:%M:%S"))
    assert parse_dead_line("20260508 23:59:59") == expected
    assert parse_dead_line("1767225600") == 1767225600.0
    assert parse_dead_line(" 1767225600.5 ") == 1767225600.5
    for bad in ("2026-05-08", "tomorrow", "-5"):
        with pytest.raises(ConfigError) as info:
            parse_dead_line(bad)
        assert info.value.field == "train_config.dead_line"


# ------------------------------------------------------------------ saving / redaction


def test_config_to_text_redacts_secrets(online) -> None:
    apply_edit_config_json(online, {"kafka_train_input.kafka_config": {
        "sasl.password": "hunter2-secret-value", "ssl.key.password": "k3y-pass",
        "sasl.username": "alice", "sasl.oauthbearer.client.secret": "0auth-s3cret",
        "api.token": "t0ken"}})
    text = config_to_text(online)
    for secret in ("hunter2-secret-value", "k3y-pass", "0auth-s3cret", "t0ken"):
        assert secret not in text
    assert "alice" in text and '"***"' in text
    # Not modified in place; unredacted on request.
    assert online.kafka_train_input.kafka_config["sasl.password"] == "hunter2-secret-value"
    assert "hunter2-secret-value" in config_to_text(online, redact=False)


def test_save_is_atomic_redacted_and_reloadable(online, tmp_path: Path) -> None:
    online.kafka_train_input.kafka_config["sasl.password"] = "hunter2-secret-value"
    path = tmp_path / "sub" / "pipeline.config"
    save_pipeline_config(online, str(path))
    saved = path.read_text()
    assert "hunter2-secret-value" not in saved
    assert os.listdir(path.parent) == ["pipeline.config"]  # no temp file left behind
    again = load_pipeline_config(str(path))
    assert again.kafka_train_input.kafka_config["sasl.password"] == "***"
    online.kafka_train_input.kafka_config["sasl.password"] = "***"
    assert again == online
    check_pipeline_config(again, online=True)


def test_round_trip_easyrec_style(tmp_path: Path) -> None:
    config = load_text(tmp_path, EASYREC_STYLE)
    path = tmp_path / "out.config"
    save_pipeline_config(config, str(path))
    assert load_pipeline_config(str(path)) == config
    assert json.loads(config.kafka_train_input.offset_info)["1"] == 20


def test_wide_and_deep_concatenates_mixed_embedding_dims_and_fm_refuses_them(
        tmp_path: Path) -> None:
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import build_model

    edit = ('input_names: "C1" feature_type: IdFeature embedding_dim: 16',
            'input_names: "C1" feature_type: IdFeature embedding_dim: 8')
    text = (ROOT / "samples" / "wide_and_deep_online.config").read_text().replace(*edit)
    config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    deep = build_model(config, FeatureBuilder(config)).pooled_layout[0]
    assert deep.dim == 0 and dict(zip(deep.lookups, deep.dims, strict=True))[("C1", "C1")] == 8
    assert deep.width == 8 + 16 * (len(deep.lookups) - 1)
    err = error_of(check_pipeline_config, load_text(tmp_path, ONLINE.read_text().replace(
        *edit)), online=True)
    assert err.field.startswith("model_config.feature_groups[")
    assert "FM needs" in str(err) and "C1=8" in str(err)


@pytest.mark.parametrize("form", ["'1650765731'", "1650765731", '"20220424 02:02:11"'])
def test_kafka_offset_time_takes_easyrec_strings_and_numbers(tmp_path: Path, form: str) -> None:
    from odl.inputs.source_factory import online_source_args

    text = ONLINE.read_text().replace('group: "odl_deepfm"',
                                      f'group: "odl_deepfm"\n  offset_time: {form}')
    config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    start, _args = online_source_args(config, None)
    assert start.timestamp_s == 1650765731.0


@pytest.mark.parametrize("form, why", [('"yesterday"', "neither unix seconds"),
                                       ("1650765731000", "milliseconds")])
def test_kafka_offset_time_refuses_what_it_cannot_read(tmp_path: Path, form: str,
                                                        why: str) -> None:
    text = ONLINE.read_text().replace('group: "odl_deepfm"',
                                      f'group: "odl_deepfm"\n  offset_time: {form}')
    err = error_of(check_pipeline_config, load_text(tmp_path, text), online=True)
    assert err.field == "kafka_train_input.offset_time" and why in str(err)


def test_easyrec_and_torcheasyrec_spellings_become_odl_forms(tmp_path: Path) -> None:
    text = ONLINE.read_text()
    text = text.replace('feature_configs { input_names: "C1" feature_type: IdFeature',
                        'feature_configs { input_names: "C1" feature_type: TagFeature')
    text = text.replace("  deepfm {\n    dnn {", "  losses { binary_cross_entropy {} }\n"
                                             "  deepfm {\n    deep {")
    text = text.replace("train_config {", "train_config {\n  num_epochs: 3", 1)
    config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    ft = pipeline_pb2.FeatureConfig.FeatureType
    assert feature_configs(config)[0].feature_type == ft.IdFeature  # tags: a multi-valued id
    assert config.model_config.deepfm.dnn.hidden_units == [256, 128, 64]
    assert not config.model_config.deepfm.HasField("deep")
    assert config.model_config.losses[0].loss_type == pipeline_pb2.CLASSIFICATION
    assert config.data_config.num_epochs == 3 and not config.train_config.HasField("num_epochs")
    weighted = text.replace('input_names: "C1" feature_type: TagFeature',
                            'input_names: "C1" input_names: "C2" feature_type: TagFeature')
    fc = feature_configs(load_text(tmp_path, weighted))[0]  # tags, then their weights
    assert fc.feature_type == ft.IdFeature and list(fc.input_names) == ["C1", "C2"]



def test_torcheasyrec_feature_schema_becomes_the_flat_form(tmp_path: Path) -> None:
    text = ONLINE.read_text()
    text = text.replace(
        'feature_configs { input_names: "C1" feature_type: IdFeature embedding_dim: 16 '
        'hash_bucket_size: 10000 }',
        'feature_configs { id_feature { feature_name: "C1" expression: "item:C1" '
        'hash_bucket_size: 10000 embedding_dim: 16 pooling: "mean" } }')
    text = text.replace('group_name: "wide"', 'group_name: "wide" group_type: WIDE')
    assert "id_feature" in text and "group_type" in text
    config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    c1 = feature_configs(config)[0]
    assert (c1.feature_name, list(c1.input_names), c1.hash_bucket_size, c1.combiner) == (
        "C1", ["C1"], 10000, "mean")
    assert config.model_config.feature_groups[0].wide_deep == pipeline_pb2.WIDE
    both = text.replace('id_feature { feature_name: "C1"',
                        'embedding_dim: 8 id_feature { feature_name: "C1"')
    err = error_of(load_text, tmp_path, both)
    assert err.field == "feature_configs[0].id_feature" and "not both" in str(err)


def test_torcheasyrec_config_without_input_fields_reads_the_columns_by_name(
        tmp_path: Path) -> None:
    """TorchEasyRec takes columns from its table's schema: odl derives them, labels first."""
    from odl.features.feature_builder import FeatureBuilder

    text = """
model_dir: "MODEL"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config { batch_size: 8 label_fields: "clk" }
feature_configs { id_feature { feature_name: "user_id" expression: "user:user_id"
                               hash_bucket_size: 100 embedding_dim: 8 } }
feature_configs { id_feature { feature_name: "item_id" hash_bucket_size: 100
                               embedding_dim: 8 } }
feature_configs { raw_feature { feature_name: "price" expression: "item:price" } }
model_config {
  feature_groups { group_name: "wide" feature_names: ["user_id", "item_id"]
                   group_type: WIDE }
  feature_groups { group_name: "deep" feature_names: ["user_id", "item_id", "price"]
                   group_type: DEEP }
  deepfm { deep { hidden_units: [8] } }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } }
  dense_optimizer { adam_optimizer { lr: 0.001 } }
}
""".replace("MODEL", str(tmp_path / "m"))
    config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    types = pipeline_pb2.DatasetConfig
    assert [(f.input_name, f.input_type) for f in config.data_config.input_fields] == [
        ("clk", types.DOUBLE), ("user_id", types.STRING), ("item_id", types.STRING),
        ("price", types.DOUBLE)]
    built = FeatureBuilder(config).build([
        b'{"price": 2.5, "item_id": "i1", "user_id": "u7", "clk": 1}',
        b"0,u8,i2,1.5"])  # CSV: the derived order
    assert not built.rejected and built.batch.labels.tolist() == [1.0, 0.0]
    assert built.batch.dense[:, 0].tolist() == [2.5, 1.5]
    # an EasyRec (flat) config without input_fields is still an error
    flat = re.sub(r"feature_configs \{[^}]*\}[^}]*\}\s*", "", text, count=0)
    flat = flat.replace("model_config {", 'feature_configs { input_names: "user_id" '
                        "feature_type: IdFeature hash_bucket_size: 100 embedding_dim: 8 }\n"
                        "model_config {", 1)
    flat = flat.replace('feature_names: ["user_id", "item_id"]', 'feature_names: "user_id"')
    flat = flat.replace('feature_names: ["user_id", "item_id", "price"]',
                        'feature_names: "user_id"')
    err = error_of(check_pipeline_config, load_text(tmp_path, flat), online=True)
    assert err.field == "data_config.input_fields"


def test_fg_mode_dag_reads_the_columns_and_bucketize_is_refused(tmp_path: Path,
                                                                caplog) -> None:
    text = ONLINE.read_text().replace("data_config {", "data_config {\n  fg_mode: FG_DAG", 1)
    with caplog.at_level(logging.WARNING):
        config = load_text(tmp_path, text)
    check_pipeline_config(config, online=True)
    assert "no feature generator" in caplog.text
    err = error_of(load_text, tmp_path, text.replace("FG_DAG", "FG_BUCKETIZE"))
    assert err.field == "data_config.fg_mode"


def _feature(config: pipeline_pb2.EasyRecConfig,
             name: str) -> tuple[int, pipeline_pb2.FeatureConfig]:
    return next((i, fc) for i, fc in enumerate(config.feature_configs)
                if (fc.feature_name or fc.input_names[0]) == name)


def _combo_num_buckets(c):
    i, fc = _feature(c, "C6_C14")
    fc.hash_bucket_size, fc.num_buckets = 0, 100
    return f"feature_configs[{i}].hash_bucket_size"


def _empty_separator(c):
    i, fc = _feature(c, "C1")
    fc.separator = ""
    return f"feature_configs[{i}].separator"


def _shared_table_other_combiner(c):
    _i, first = _feature(c, "C1")
    i, fc = _feature(c, "C2")
    fc.embedding_name, fc.hash_bucket_size, fc.combiner = "C1", first.hash_bucket_size, "mean"
    return f"feature_configs[{i}].embedding_name"


def _shared_table_other_boundaries(c):
    _i, fc = _feature(c, "I2")  # listed before I1_bucket: the later one is refused
    fc.boundaries.extend([1.0, 2.0])
    fc.embedding_dim, fc.embedding_name = 16, "I1_bucket"
    i, _fc = _feature(c, "I1_bucket")
    return f"feature_configs[{i}].embedding_name"


def _dynamic_bucketized_number(c):
    i, fc = _feature(c, "I1_bucket")
    fc.zch.zch_size = 100
    return f"feature_configs[{i}].zch"


def _string_click_field(c):
    i, fc = _feature(c, "C1")
    fc.ctr_accessor_param.click_field = "C2"
    return f"feature_configs[{i}].ctr_accessor_param.click_field"


def _no_label(c):
    c.data_config.ClearField("label_fields")
    return "data_config.label_fields"


def _label_twice(c):
    c.data_config.label_fields.append("label")  # DeepFM trains one: refused before the repeat
    return "data_config.label_fields"


def _unknown_sample_id_field(c):
    c.data_config.sample_id_field = "no_such_column"
    return "data_config.sample_id_field"


def _fractional_int_default(c):
    c.data_config.input_fields[2].default_val = "3.5"  # an INT32 field: an integer
    return "data_config.input_fields[2].default_val"


def _infinite_float_default(c):
    c.data_config.input_fields[3].default_val = "1e400"  # I1, FLOAT: inf
    return "data_config.input_fields[3].default_val"


def _no_input(c):
    i, fc = _feature(c, "C6_C14")
    fc.ClearField("input_names")
    return f"feature_configs[{i}].input_names"


def _duplicate_feature_name(c):
    i, fc = _feature(c, "C2")
    fc.feature_name = "C1"
    return f"feature_configs[{i}].feature_name"


def _unknown_input(c):
    i, fc = _feature(c, "C6_C14")
    fc.input_names[1] = "no_such_column"
    return f"feature_configs[{i}].input_names[1]"


def _no_raw_input_dim(c):
    i, fc = _feature(c, "I2")
    fc.raw_input_dim = 0
    return f"feature_configs[{i}].raw_input_dim"


def _numbers_from_a_float_field(c):
    i, fc = _feature(c, "I2")
    fc.raw_input_dim = 3
    return f"feature_configs[{i}].input_names[0]"


def _numbers_without_separator(c):
    i, fc = _feature(c, "I2")
    fc.feature_name, fc.input_names[0], fc.raw_input_dim, fc.separator = "I2", "C1", 3, ""
    return f"feature_configs[{i}].separator"


def _buckets_of_several_numbers(c):
    i, fc = _feature(c, "I1_bucket")
    fc.input_names[0], fc.raw_input_dim = "C1", 2
    return f"feature_configs[{i}].boundaries"


def _descending_boundaries(c):
    i, fc = _feature(c, "I1_bucket")
    fc.boundaries[0] = 9.0
    return f"feature_configs[{i}].boundaries"


def _sequence_of_combos(c):
    i, fc = _feature(c, "C1")
    fc.feature_type = pipeline_pb2.FeatureConfig.SequenceFeature
    fc.sub_feature_type = pipeline_pb2.FeatureConfig.ComboFeature
    return f"feature_configs[{i}].sub_feature_type"


def _vocabulary_and_buckets(c):
    i, fc = _feature(c, "C1")
    fc.vocab_list.extend(["a", "b"])
    return f"feature_configs[{i}].hash_bucket_size"


def _ids_of_both_sizes(c):
    i, fc = _feature(c, "C1")
    fc.num_buckets = 10
    return f"feature_configs[{i}].hash_bucket_size"


def _ids_of_no_size(c):
    i, fc = _feature(c, "C1")
    fc.hash_bucket_size = 0
    return f"feature_configs[{i}].hash_bucket_size"


def _weighted_tags_in_a_dynamic_table(c):
    i, fc = _feature(c, "C1")
    fc.kv_separator = ":"
    fc.zch.zch_size = 100
    return f"feature_configs[{i}].input_names"


def _weights_twice(c):
    i, fc = _feature(c, "C1")
    fc.input_names.append("C2")
    fc.kv_separator = ":"
    return f"feature_configs[{i}].kv_separator"


def _dense_number_pooled_by_max(c):
    i, fc = _feature(c, "I2")
    fc.combiner = "max"  # a dense number is not pooled: still only sum or mean
    return f"feature_configs[{i}].combiner"


def _shared_table_other_rows(c):
    i, fc = _feature(c, "C2")
    fc.embedding_name = "C1"
    return f"feature_configs[{i}].embedding_name"


def _shared_table_other_dim(c):
    _i, first = _feature(c, "C1")
    i, fc = _feature(c, "C2")
    fc.embedding_name, fc.hash_bucket_size, fc.embedding_dim = (
        "C1", first.hash_bucket_size, 8)
    return f"feature_configs[{i}].embedding_name"


def _shared_table_one_dynamic(c):
    _i, first = _feature(c, "C1")
    first.ev_params.max_capacity = 100
    i, fc = _feature(c, "C2")
    fc.embedding_name, fc.hash_bucket_size = "C1", first.hash_bucket_size
    return f"feature_configs[{i}].embedding_name"


@pytest.mark.parametrize("edit", [
    _no_label, _label_twice, _unknown_sample_id_field, _fractional_int_default,
    _infinite_float_default, _no_input, _duplicate_feature_name, _unknown_input,
    _no_raw_input_dim, _numbers_from_a_float_field, _numbers_without_separator,
    _buckets_of_several_numbers, _descending_boundaries, _sequence_of_combos,
    _vocabulary_and_buckets, _ids_of_both_sizes, _ids_of_no_size,
    _weighted_tags_in_a_dynamic_table, _weights_twice, _combo_num_buckets, _empty_separator,
    _dense_number_pooled_by_max, _shared_table_other_rows, _shared_table_other_dim,
    _shared_table_other_combiner, _shared_table_other_boundaries, _shared_table_one_dynamic,
    _dynamic_bucketized_number, _string_click_field,
], ids=lambda f: f.__name__.strip("_"))
def test_static_feature_rules_are_refused_by_field_at_validation(edit) -> None:
    """Each static rule the feature plan relies on is validation's, refused by its field."""
    config = load_pipeline_config(str(ONLINE))
    field = edit(config)
    assert error_of(check_pipeline_config, config, online=True).field == field


_FT = pipeline_pb2.FeatureConfig.FeatureType
_SIZES = ([0, 5, 100], [0, 7, 100], [0, 8, 16])


def _edit_a_feature(c: pipeline_pb2.EasyRecConfig, rng) -> None:
    """One random edit of a feature (or of an input field) touching a feature rule."""
    features = c.feature_configs or c.feature_config.features
    fields = c.data_config.input_fields
    fc = rng.choice(features)
    op = rng.randrange(18)
    if op == 0:
        fc.separator = rng.choice(["", ",", "|"])
    elif op == 1:
        fc.combiner = rng.choice(["sum", "mean", "max"])
    elif op in (2, 3, 4):
        setattr(fc, ("num_buckets", "hash_bucket_size", "embedding_dim")[op - 2],
                rng.choice(_SIZES[op - 2]))
    elif op == 5:
        other = rng.choice(features)
        fc.embedding_name = other.embedding_name or other.feature_name or other.input_names[0]
    elif op == 6:
        del fc.boundaries[:]
        fc.boundaries.extend(rng.choice([[1.0, 2.0], [2.0, 1.0], [0.5]]))
    elif op == 7:
        fc.raw_input_dim = rng.choice([0, 1, 3])
    elif op == 8:
        fc.feature_type = rng.choice([_FT.IdFeature, _FT.RawFeature, _FT.ComboFeature,
                                      _FT.SequenceFeature])
    elif op == 9:
        fc.sub_feature_type = rng.choice([_FT.IdFeature, _FT.RawFeature, _FT.ComboFeature])
    elif op == 10:
        fc.input_names.append(rng.choice(fields).input_name)
    elif op == 11:
        fc.input_names[0] = rng.choice(fields).input_name
    elif op == 12:
        fc.kv_separator = rng.choice([":", ""])
    elif op == 13:
        fc.zch.zch_size = rng.choice([0, 50])
    elif op == 14:
        setattr(fc.ctr_accessor_param, rng.choice(["show_field", "click_field"]),
                rng.choice(fields).input_name)
    elif op == 15:
        del fc.vocab_list[:]
        fc.vocab_list.extend(["a", "b"])
    elif op == 16:
        rng.choice(fields).default_val = rng.choice(["3.5", "1e400", "x", "true", "7"])
    else:
        rng.choice(fields).input_type = rng.choice(
            [pipeline_pb2.DatasetConfig.STRING, pipeline_pb2.DatasetConfig.INT64,
             pipeline_pb2.DatasetConfig.DOUBLE])


def test_what_the_feature_builder_refuses_validation_refuses_first() -> None:
    """The builder refuses nothing static that validation accepts.

    Random edits of the features of three samples (both feature list forms, sequences):
    every config ``check_pipeline_config`` accepts builds its feature plan, which builds a
    record of ones without raising (no record ``unprocessable``), and both outcomes occur
    often enough for that to say something.
    """
    import random

    rng = random.Random(34)
    samples = {p: load_pipeline_config(str(ROOT / "samples" / p))
               for p in ("deepfm_online.config", "deepfm_offline.config", "din_online.config")}
    accepted = refused = 0
    for _ in range(160):
        name = rng.choice(sorted(samples))
        config = pipeline_pb2.EasyRecConfig()
        config.CopyFrom(samples[name])
        for _edit in range(rng.randint(1, 2)):
            _edit_a_feature(config, rng)
        try:
            check_pipeline_config(config, online=name != "deepfm_offline.config")
        except ConfigError:
            refused += 1
            continue
        accepted += 1
        builder = FeatureBuilder(config)  # raises nothing: every static rule was validation's
        dc = config.data_config
        record = dc.separator.join("1" for _f in dc.input_fields).encode()
        assert "unprocessable" not in dict(builder.build_arrays([record]).rejected).values()
    assert accepted >= 30 and refused >= 30, (accepted, refused)


# ------------------------------------------------------------------ batch normalization default


def test_easyrec_dnns_without_use_bn_are_named_once_and_built_without_normalization(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """EasyRec's DNN defaults to use_bn: true, odl's to false: the DNNs that rely on the
    default are named in one warning, and the model built has no normalization there."""
    with caplog.at_level("WARNING", logger="odl.config.easyrec_compat"):
        config = load_text(tmp_path, EASYREC_STYLE, model_dir=str(tmp_path / "m"))
    warned = [r.getMessage() for r in caplog.records if "use_bn" in r.getMessage()]
    assert len(warned) == 1, warned
    assert warned[0].startswith("model_config.deepfm.dnn, model_config.deepfm.final_dnn: ")
    model = build_model(config, FeatureBuilder(config))
    assert not [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]

    # written either way: silent, and true builds EasyRec's normalized layers
    caplog.clear()
    written = EASYREC_STYLE.replace('activation: "tf.nn.relu"',
                                    'activation: "tf.nn.relu" use_bn: false').replace(
        "hidden_units: [32]", "hidden_units: [32] use_bn: true")
    with caplog.at_level("WARNING", logger="odl.config.easyrec_compat"):
        config = load_text(tmp_path, written, model_dir=str(tmp_path / "m"))
    assert not [r for r in caplog.records if "use_bn" in r.getMessage()]
    model = build_model(config, FeatureBuilder(config))
    assert len([m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]) == 1


@pytest.mark.parametrize("sample", sorted((ROOT / "samples").glob("*.config")),
                         ids=lambda p: p.name)
def test_samples_and_torcheasyrec_form_rely_on_no_batch_norm_default(sample: Path) -> None:
    """odl's samples write use_bn where EasyRec's default would differ; TorchEasyRec's form
    (sparse_optimizer / dense_optimizer, whose MLP defaults to false) is never listed."""
    config = parse_pipeline_config_text(sample.read_text(), str(sample))
    assert unwritten_batch_norm_dnns(config) == []


def test_torcheasyrec_form_is_not_listed() -> None:
    text = """
model_config { deepfm { deep { hidden_units: [8] } final { hidden_units: [4] } } }
train_config { sparse_optimizer { adagrad_optimizer { lr: 0.05 } } }
"""
    assert unwritten_batch_norm_dnns(parse_pipeline_config_text(text)) == []
    easyrec = text.replace("deep {", "dnn {").replace("final {", "final_dnn {").replace(
        "sparse_optimizer { adagrad_optimizer { lr: 0.05 } }",
        "optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {"
        " learning_rate: 0.05 } } } }")
    assert unwritten_batch_norm_dnns(parse_pipeline_config_text(easyrec)) == [
        "model_config.deepfm.dnn", "model_config.deepfm.final_dnn"]


def test_torcheasyrec_delimiter_is_the_separator(tmp_path: Path) -> None:
    config = load_text(tmp_path, 'data_config { delimiter: "\\t" }\nmodel_dir: "m"')
    assert config.data_config.separator == "\t"
    assert not config.data_config.HasField("delimiter")
    err = error_of(load_text, tmp_path, 'data_config { delimiter: ";" separator: "," }')
    assert err.field == "data_config.delimiter"


def test_a_field_written_twice_takes_its_last_value_as_in_easyrec(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """EasyRec loads configs with text_format.Merge: a singular field written twice in one
    message takes its last value (one warning names it); in different messages nothing is
    a duplicate."""
    text = ("train_config {\n  log_step_count_steps: 100\n  optimizer_config { sgd_optimizer "
            "{ learning_rate { constant_learning_rate { learning_rate: 0.1 } } } }\n"
            "  log_step_count_steps: 10\n}\n"
            'eval_config { num_examples: 5 }\nmodel_dir: "m"\n')
    with caplog.at_level("WARNING", logger="odl.config.pipeline_config"):
        config = load_text(tmp_path, text)
    assert config.train_config.log_step_count_steps == 10
    assert config.eval_config.num_examples == 5
    assert [r.getMessage() for r in caplog.records
            if "more than once" in r.getMessage()] == [
        "config field train_config.log_step_count_steps is written more than once; its last "
        "value is used, as EasyRec's loader takes it"]
