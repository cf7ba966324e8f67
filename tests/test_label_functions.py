"""EasyRec's ``user_define_fn`` on label fields (``odl.config.label_functions``): the labels
trained on are the function's values of the column, records it fails on are rejected as
``bad_label`` one by one, the file is found where EasyRec finds it and runs in the input
process too, and what odl cannot run is refused by field."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import load_pipeline_config
from odl.features.feature_builder import FeatureBuilder
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.models.model_registry import check_pipeline_config
from odl.protos import pipeline_pb2
from tests.harness import odl_helper_processes, run_in_process, write_config
from tests.test_config_compat import _HERE, try_load

_UDF_SAMPLE = os.path.join(_HERE, "easyrec", "multi_tower_on_taobao_test_udf.config")


def _label_index(config) -> int:
    names = [f.input_name for f in config.data_config.input_fields]
    return names.index(config.data_config.label_fields[0])


def _csv(config, label_texts: list[str]) -> list[bytes]:
    """Records of ``config``'s fields with the label column as given: for EasyRec's sample
    every other column "1", for the test config its synthetic stream's columns."""
    k, n = _label_index(config), len(config.data_config.input_fields)
    sep = config.data_config.separator
    if config.data_config.event_time_field:  # the test config: a stream's real records
        rows = [v.decode().split(sep) for v in make_records(len(label_texts), seed=1)[1]]
    else:
        rows = [["1"] * n for _ in label_texts]
    for row, text in zip(rows, label_texts, strict=True):
        row[k] = text
    return [sep.join(row).encode() for row in rows]


def test_easyrecs_sample_trains_on_its_remapped_clicks() -> None:
    """multi_tower_on_taobao_test_udf as fetched: ``clk`` of 0..9 becomes EasyRec's
    ``remap_lbl`` of it (``np.where(labels < 5, 0, 1)``), for every record."""
    config = try_load.load_one(_UDF_SAMPLE, "easyrec")
    path = config.data_config.input_fields[_label_index(config)].user_define_fn_path
    assert os.path.isabs(path) and path.startswith(_HERE)  # found beside the config
    clicks = np.random.default_rng(3).integers(0, 10, size=200)
    built = FeatureBuilder(config).build(_csv(config, [str(c) for c in clicks]))
    assert not built.rejected
    np.testing.assert_array_equal(built.batch.labels.numpy().ravel(),
                                  np.where(clicks < 5, 0, 1))


def _udf_config(tmp_path, source: str, fn: str = "f", res_type: str = "INT64") -> object:
    """A small DeepFM config whose label goes through ``fn`` of a file holding ``source``."""
    (tmp_path / "udf").mkdir(exist_ok=True)
    (tmp_path / "udf" / "labels.py").write_text("import numpy as np\n\n" + source)
    path = write_config(tmp_path, "127.0.0.1:9", "t")
    config = load_pipeline_config(path)
    field = config.data_config.input_fields[_label_index(config)]
    field.user_define_fn = fn
    field.user_define_fn_path = str(tmp_path / "udf" / "labels.py")
    if res_type:
        field.user_define_fn_res_type = pipeline_pb2.DatasetConfig.FieldType.Value(res_type)
    return config


def test_records_the_function_fails_on_are_rejected_one_by_one(tmp_path) -> None:
    """The batch's call raises (one record holds 7): every record is retried alone, the 7 is
    ``bad_label``, a NaN result too, and the others train on the function's values."""
    config = _udf_config(tmp_path, (
        "def f(x):\n"
        "    if (x == 7).any():\n"
        "        raise ValueError('seven')\n"
        "    return np.where(x == 3, np.nan, x % 2)\n"), res_type="DOUBLE")
    check_pipeline_config(config, online=True)
    built = FeatureBuilder(config).build(_csv(config, ["4", "7", "3", "5", "abc", "1.5"]))
    assert dict(built.rejected) == {1: "bad_label", 2: "bad_label", 4: "bad_number",
                                    5: "bad_label"}  # 1.5: the INT label holds no integer
    np.testing.assert_array_equal(built.batch.labels.numpy().ravel(), [0, 1])


def test_a_result_that_is_not_one_value_per_record_rejects_the_records(tmp_path) -> None:
    config = _udf_config(tmp_path, "def f(x):\n    return x.sum()\n")
    built = FeatureBuilder(config).build(_csv(config, ["1", "0", "1"]))
    assert dict(built.rejected) == {0: "bad_label", 1: "bad_label", 2: "bad_label"}


def test_a_tensorflow_function_runs_with_numpy(tmp_path) -> None:
    """No path: EasyRec's TF function by name, here on a regression label."""
    config = _udf_config(tmp_path, "", fn="tf.math.log1p", res_type="")
    field = config.data_config.input_fields[_label_index(config)]
    field.ClearField("user_define_fn_path")
    config.model_config.loss_type = pipeline_pb2.LossType.Value("L2_LOSS")
    check_pipeline_config(config, online=True)
    built = FeatureBuilder(config).build(_csv(config, ["0", "3", "250"]))
    assert not built.rejected
    np.testing.assert_allclose(built.batch.labels.numpy().ravel(), np.log1p([0, 3, 250]),
                               rtol=1e-6)


def test_a_relative_path_is_read_beside_the_config_else_from_the_working_directory(
        tmp_path, monkeypatch) -> None:
    config = _udf_config(tmp_path, "def f(x):\n    return 1 - x\n")
    k = _label_index(config)
    config.data_config.input_fields[k].user_define_fn_path = "udf/labels.py"
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "pipeline.config").write_text(str(config))
    monkeypatch.chdir(tmp_path)  # not beside the config: from the working directory
    loaded = load_pipeline_config(str(beside / "pipeline.config"))
    assert loaded.data_config.input_fields[k].user_define_fn_path == str(
        tmp_path / "udf" / "labels.py")
    (beside / "udf").mkdir()
    (beside / "udf" / "labels.py").write_text("def f(x):\n    return x\n")
    loaded = load_pipeline_config(str(beside / "pipeline.config"))  # beside it first
    assert loaded.data_config.input_fields[k].user_define_fn_path == str(
        beside / "udf" / "labels.py")


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"source": "def g(x):\n    return x\n"}, "user_define_fn_path", "defines no function 'f'"),
    ({"source": "def f(x:\n"}, "user_define_fn_path", "fails to load: SyntaxError"),
    ({"path": "/nonexistent/labels.py"}, "user_define_fn_path", "cannot read"),
    ({"res_type": ""}, "user_define_fn_res_type", "required with user_define_fn_path"),
    ({"res_type": "STRING"}, "user_define_fn_res_type", "a label is a number"),
    ({"tf": "tf.nn.softmax"}, "user_define_fn", "odl runs tf.math.log1p"),
    ({"feature": True}, "user_define_fn", "EasyRec applies user_define_fn to labels only"),
])
def test_what_odl_cannot_run_is_refused_by_field(tmp_path, change, field, message) -> None:
    config = _udf_config(tmp_path, change.get("source", "def f(x):\n    return x\n"),
                         res_type=change.get("res_type", "INT64"))
    k = _label_index(config)
    target = config.data_config.input_fields[k]
    if "path" in change:
        target.user_define_fn_path = change["path"]
    if "tf" in change:
        target.ClearField("user_define_fn_path")
        target.user_define_fn = change["tf"]
    if change.get("feature"):  # on a feature's column instead of the label's
        other = config.data_config.input_fields[(k + 1) % len(config.data_config.input_fields)]
        other.user_define_fn, other.user_define_fn_path = "f", target.user_define_fn_path
        target.ClearField("user_define_fn")
        target.ClearField("user_define_fn_path")
        target.ClearField("user_define_fn_res_type")
        k = (k + 1) % len(config.data_config.input_fields)
    with pytest.raises(ConfigError, match=message) as err:
        check_pipeline_config(config, online=True)
    assert err.value.field == f"data_config.input_fields[{k}].{field}"


def test_the_input_process_runs_the_function_and_the_trainer_counts_its_rejects(
        kafka_bootstrap, kafka_topic_factory, tmp_path) -> None:
    """Online, features built in the input process: every positive record is refused by the
    function (NaN), counted as bad_label, and exactly the others are trained."""
    topic = kafka_topic_factory(partitions=1)
    ids, values = make_records(320, seed=5)
    produce(kafka_bootstrap, topic, values, 1)
    ends = end_offsets(kafka_bootstrap, topic)
    (tmp_path / "labels.py").write_text(
        "import numpy as np\n\ndef negatives(x):\n    return np.where(x == 1, np.nan, x)\n")
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=32)
    config = load_pipeline_config(cfg)
    k = _label_index(config)
    label = config.data_config.label_fields[0]
    positives = sum(1 for v in values if json.loads(v)[label] == 1) if values[0][:1] == b"{" \
        else sum(1 for v in values if v.decode().split(",")[k] == "1")
    assert 0 < positives < len(values)
    where = f"data_config.input_fields[{k}]"
    edits = {"data_config.input_process": True, f"{where}.user_define_fn": "negatives",
             f"{where}.user_define_fn_path": str(tmp_path / "labels.py"),
             f"{where}.user_define_fn_res_type": "DOUBLE"}
    trainer = run_in_process(cfg, ends, edits=edits)
    assert trainer.records_rejected == {"bad_label": positives}
    assert trainer.status()["samples_trained"] == len(values) - positives
    assert not odl_helper_processes()
