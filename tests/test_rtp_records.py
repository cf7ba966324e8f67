"""EasyRec's RTP records (``input_type: RTPInput`` with ``selected_cols`` / ``rtp_separator``):
parsed as the plain records they hold, trained as those, served from whole lines or the
features column alone, and the layout's settings refused by field where they cannot work.
EasyRec's own RTP sample (``taobao_fg_incr_save``) trains and serves to parity in
``tests/test_config_compat.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.features.record_parser import RecordParser
from odl.models.model_registry import check_pipeline_config
from odl.train.train_module import TrainModule

# the label (the schema's third field) in column 1, the features in column 2, column 0 unread
RTP = 'input_type: RTPInput selected_cols: "1,2" rtp_separator: ";" separator: "\\002"'


def _text(data_edit: str = RTP, model_dir: str = "/tmp/odl-rtp-unused") -> str:
    text = deepfm_config_text(model_dir, dim=8, buckets=50, hidden_units=(16,))
    if "RTPInput" in data_edit:
        text = text.replace("  input_type: KafkaInput\n", "", 1)
    return text.replace("data_config {", "data_config {\n  " + data_edit, 1)


def _records(n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """The same samples as plain CSV records and as RTP lines."""
    plain = SyntheticCtrStream(seed=seed).next_batch(n).encode("csv")
    rtp = []
    for line in plain:
        fields = line.split(b",")
        features = b"\x02".join(fields[:2] + fields[3:])
        rtp.append(b";".join([b"unread", fields[2], features]))
    return plain, rtp


def test_rtp_lines_parse_as_the_plain_records_they_hold() -> None:
    rtp_config = parse_pipeline_config_text(_text())
    plain_config = parse_pipeline_config_text(_text(""))
    plain, rtp = _records(50, seed=3)
    broken = [b"only;two", b"x;1;" + b"\x02".join([b"a"] * 5)]  # no features column; 5 fields
    # a JSON object (a DataHub TUPLE topic's record) is read by name, as without the layout
    names = [f.input_name for f in plain_config.data_config.input_fields]
    as_json = json.dumps(dict(zip(names, plain[0].decode().split(","), strict=True))).encode()
    got = RecordParser(rtp_config.data_config).parse(rtp + broken + [as_json])
    want = RecordParser(plain_config.data_config).parse(plain + [plain[0]])
    assert got.num_rows == want.num_rows == 51
    for f in plain_config.data_config.input_fields:
        assert got.texts(f.input_name) == want.texts(f.input_name), f.input_name
    assert sorted(got.rejected) == [(50, "field_count"), (51, "field_count")]


def test_columns_selected_by_name_are_the_records_columns_in_that_order() -> None:
    """EasyRec's ODPS form (``OdpsRTPInput``, ``selected_cols: "label,features"``, a table's
    columns by name): a record holds the named columns in that order."""
    by_name = ('input_type: OdpsRTPInput selected_cols: "label, features" rtp_separator: ";" '
               'separator: "\\002"')
    config = parse_pipeline_config_text(_text(by_name))
    check_pipeline_config(config, online=True)
    plain_config = parse_pipeline_config_text(_text(""))
    plain, rtp = _records(20, seed=4)
    two_columns = [line.split(b";", 1)[1] for line in rtp]  # the label, the features
    got = RecordParser(config.data_config).parse(two_columns)
    want = RecordParser(plain_config.data_config).parse(plain)
    assert got.num_rows == want.num_rows == 20 and not got.rejected
    for f in plain_config.data_config.input_fields:
        assert got.texts(f.input_name) == want.texts(f.input_name), f.input_name


def test_rtp_records_train_and_serve_as_plain_ones(tmp_path) -> None:
    """A model trained on RTP lines equals one trained on the plain records; its export
    serves whole lines, the features column alone and JSON objects (labels filled in)
    alike, as the trainer predicts."""
    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.config.config_redaction import config_to_text
    from odl.export.exporter import export_checkpoint
    from serving_plugin.serving_model import ServingModel

    modules = {}
    for name, edit in (("rtp", RTP), ("plain", "")):
        config = parse_pipeline_config_text(_text(edit, str(tmp_path / name)))
        check_pipeline_config(config, online=True)
        fb = FeatureBuilder(config)
        tm = TrainModule(config, fb, device="cpu")
        for step in range(3):
            plain, rtp = _records(64, seed=step)
            tm.train_step(fb.build(rtp if name == "rtp" else plain).batch)
        modules[name] = (config, fb, tm)
    config, fb, tm = modules["rtp"]
    plain, rtp = _records(40, seed=9)
    want = tm.predict(fb.build(rtp).batch)
    assert np.array_equal(want, modules["plain"][2].predict(modules["plain"][1].build(
        plain).batch))
    path = CheckpointManager(config.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 192},
        {"source": "kafka", "topic": "samples"}, config_to_text(config), generation="gen0")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    served = ServingModel.load(str(tmp_path / "exports"))
    assert export.startswith(str(tmp_path / "exports"))
    whole, rejected = served.predict_values(rtp)
    features_only, rejected_too = served.predict_values([r.split(b";")[2] for r in rtp])
    names = [f.input_name for f in config.data_config.input_fields]
    objects = [json.dumps({k: v for k, v in zip(names, p.decode().split(","), strict=True)
                           if k != "label"}).encode() for p in plain]  # no label: filled in
    as_json, rejected_json = served.predict_values(objects)
    assert rejected == rejected_too == rejected_json == []
    np.testing.assert_allclose(whole, want, atol=1e-6, rtol=0)
    assert np.array_equal(features_only, whole) and np.array_equal(as_json, whole)


@pytest.mark.parametrize("edit, field", [
    ('selected_cols: "0,3"', "data_config.selected_cols"),  # not an RTP input type
    ('rtp_separator: "|"', "data_config.rtp_separator"),
    ("input_type: RTPInput", "data_config.selected_cols"),  # the layout is required
    ('input_type: RTPInput selected_cols: "0,x"', "data_config.selected_cols"),
    ('input_type: OdpsRTPInput selected_cols: "clk,clk"', "data_config.selected_cols"),
    ('input_type: OdpsRTPInput selected_cols: "a,b,features"', "data_config.selected_cols"),
    ('input_type: RTPInput selected_cols: "3"', "data_config.selected_cols"),
    ('input_type: RTPInput selected_cols: "0,1,3"', "data_config.selected_cols"),  # 1 label
    ('input_type: RTPInput selected_cols: "0,3" rtp_separator: ","',
     "data_config.rtp_separator"),  # the features' separator
    ('input_type: RTPInput selected_cols: "0,3" record_format: JSON',
     "data_config.record_format"),
])
def test_rtp_settings_are_refused_by_field(edit: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(_text(edit)), online=True)
    assert info.value.field == field, info.value
