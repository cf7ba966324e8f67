"""EasyRec's feature settings (``odl.config.feature_settings``): expanded names, vocabularies
and raw value normalization as configs give them: loading, validation, tables, memory."""

from __future__ import annotations

import re

import pytest

from odl.config.config_error import ConfigError
from odl.config.config_forms import normalize_config_forms
from odl.config.feature_settings import expand_names, with_vocab_files_inlined
from odl.config.pipeline_config import load_pipeline_config, parse_pipeline_config_text
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config
from odl.train.memory_estimate import estimate_memory


def _text(tmp_path) -> str:
    return deepfm_config_text(str(tmp_path / "m"), batch_size=64)


def _feature(text: str, name: str, extra: str) -> str:
    """The config with ``extra`` added to the feature reading ``name``."""
    old = f'feature_configs {{ input_names: "{name}" '
    assert text.count(old) == 1
    return text.replace(old, f'feature_configs {{ input_names: "{name}" {extra} ')


def _validated(text: str):
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    return config


def test_expand_names_is_easyrecs_auto_expand_names() -> None:
    assert expand_names("c[1-3]") == ["c1", "c2", "c3"]
    assert expand_names("field_[9-10]") == ["field_9", "field_10"]
    assert expand_names("c[2-2]x") == ["c2"]  # EasyRec's re.match drops what follows
    assert expand_names("c1") == ["c1"] and expand_names("9[1-2]") == ["9[1-2]"]
    with pytest.raises(ConfigError, match=r"\[3-1\]"):
        expand_names("c[3-1]", "data_config.input_fields[0].input_name")


def test_auto_expand_input_fields_and_group_names(tmp_path) -> None:
    text = _text(tmp_path)
    fields = "".join(f'  input_fields {{ input_name: "C{i}" input_type: STRING }}\n'
                     for i in range(1, 27))
    assert fields in text
    text = text.replace(fields, '  input_fields { input_name: "C[1-26]" input_type: STRING }\n')
    groups = "".join(f' feature_names: "C{i}"' for i in range(1, 27))
    assert text.count(groups) == 2
    text = text.replace(groups, ' feature_names: "C[1-26]"')
    with pytest.raises(ConfigError) as info:  # without the flag the range is one column
        _validated(text)
    assert info.value.field.endswith(".input_names[0]") and "'C1'" in str(info.value)
    config = _validated(text.replace("  label_fields:",
                                     "  auto_expand_input_fields: true\n  label_fields:"))
    names = [f.input_name for f in config.data_config.input_fields]
    assert names[16:] == [f"C{i}" for i in range(1, 27)]
    assert list(config.model_config.feature_groups[0].feature_names) == [
        f"C{i}" for i in range(1, 27)]
    fb = FeatureBuilder(config)
    assert fb.sparse_feature_names == [f"C{i}" for i in range(1, 27)]
    normalize_config_forms(config)  # idempotent
    assert [f.input_name for f in config.data_config.input_fields] == names


def test_raw_num_buckets_over_min_max_are_equal_width_boundaries(tmp_path) -> None:
    text = _feature(_text(tmp_path), "I1", "min_val: 10 max_val: 30 num_buckets: 4 "
                                            "embedding_dim: 8")
    config = _validated(text)
    fc = [f for f in config.feature_configs if f.input_names[0] == "I1"][0]
    assert list(fc.boundaries) == [0.0, 0.25, 0.5, 0.75] and fc.num_buckets == 0
    fb = FeatureBuilder(config)
    assert {t.name: t.num_rows for t in fb.table_specs}["I1"] == 5
    assert "I1" in fb.sparse_feature_names and "I1" not in fb.dense_feature_names


@pytest.mark.parametrize("name, extra, field, message", [
    ("C1", "min_val: 0 max_val: 1", "feature_configs[0].min_val", "normalize a RawFeature"),
    ("I1", "min_val: 5 max_val: 5", "feature_configs[26].max_val", "must be above min_val"),
    ("I1", "max_val: -1", "feature_configs[26].max_val", "must be above min_val"),
    ("C2", 'vocab_list: ["a"]', "feature_configs[1].hash_bucket_size", "give one of"),
    ("I3", 'vocab_list: ["a"]', "feature_configs[28].vocab_list", "not of a RawFeature"),
    ("C3", 'vocab_file: "/nonexistent/odl_vocab.txt"', "feature_configs[2].vocab_file",
     "file not found: /nonexistent/odl_vocab.txt"),
])
def test_feature_settings_are_checked_by_field(tmp_path, name, extra, field, message) -> None:
    text = _feature(_text(tmp_path), name, extra)
    if "vocab" in extra and name != "C2":
        text = text.replace(f'"{name}" {extra} feature_type: IdFeature embedding_dim: 8 '
                            "hash_bucket_size: 2000", f'"{name}" {extra} embedding_dim: 8')
    with pytest.raises(ConfigError) as info:
        _validated(text)
    assert info.value.field == field
    assert message in info.value.message


def test_hash_bucket_size_on_a_raw_feature_is_ignored_with_a_warning(tmp_path, caplog) -> None:
    text = _feature(_text(tmp_path), "I2", "hash_bucket_size: 100")
    with caplog.at_level("WARNING"):
        config = _validated(text)
    assert "feature_configs[27].hash_bucket_size has no effect on a RawFeature" in caplog.text
    fb = FeatureBuilder(config)
    assert "I2" in fb.dense_feature_names and "I2" not in fb.sparse_feature_names
    assert config.feature_configs[27].hash_bucket_size == 0


@pytest.mark.parametrize("vocab, message", [
    ('vocab_list: ["a", "b", "a"]', "'a' repeats (entries 0 and 2)"),
    ('vocab_list: ["a", ""]', "entry 1 is empty"),
])
def test_a_vocabulary_has_unique_entries(tmp_path, vocab, message) -> None:
    text = _text(tmp_path).replace(
        'input_names: "C4" feature_type: IdFeature embedding_dim: 8 hash_bucket_size: 2000',
        f'input_names: "C4" feature_type: IdFeature embedding_dim: 8 {vocab}')
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        _validated(text)
    assert info.value.field == "feature_configs[3].vocab_list"


def test_vocab_file_is_relative_to_the_config_and_sizes_the_table(tmp_path, monkeypatch) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "c5.txt").write_text("x\ny\nz\n", encoding="utf-8")
    text = _text(tmp_path).replace(
        'input_names: "C5" feature_type: IdFeature embedding_dim: 8 hash_bucket_size: 2000',
        'input_names: "C5" feature_type: TagFeature embedding_dim: 8 vocab_file: "c5.txt"')
    path = conf_dir / "pipeline.config"
    path.write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # not the config's directory
    config = load_pipeline_config(str(path))
    assert config.feature_configs[4].vocab_file == str(conf_dir / "c5.txt")
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    assert {t.name: t.num_rows for t in fb.table_specs}["C5"] == 3
    est = {t.name: t.rows for t in estimate_memory(config, "cpu").tables}
    assert est["C5"] == 3 and est["C5_wide"] == 3 and est["C6"] == 2000
    (conf_dir / "c5.txt").unlink()
    with pytest.raises(ConfigError, match="file not found") as info:
        check_pipeline_config(load_pipeline_config(str(path)), online=True)
    assert info.value.field == "feature_configs[4].vocab_file"


def test_an_export_writes_the_vocab_file_as_its_list(tmp_path) -> None:
    (tmp_path / "c5.txt").write_text("x\ny\nz\n", encoding="utf-8")
    text = _text(tmp_path).replace(
        'input_names: "C5" feature_type: IdFeature embedding_dim: 8 hash_bucket_size: 2000',
        f'input_names: "C5" embedding_dim: 8 vocab_file: "{tmp_path / "c5.txt"}"')
    config = _validated(text)
    inlined = with_vocab_files_inlined(config)
    assert config.feature_configs[4].vocab_file  # the original is left as it is
    fc = inlined.feature_configs[4]
    assert list(fc.vocab_list) == ["x", "y", "z"] and not fc.vocab_file
    (tmp_path / "c5.txt").unlink()  # the inlined config no longer needs the file
    check_pipeline_config(inlined, online=True)
    assert {t.name: t.num_rows for t in FeatureBuilder(inlined).table_specs}["C5"] == 3
    assert with_vocab_files_inlined(inlined) is inlined


def test_shared_names_add_a_feature_per_column_with_the_same_settings(tmp_path):
    """EasyRec's shared_names: copies of a feature's settings, one per listed column."""
    from odl.config.feature_configs import feature_configs
    from tests.harness import REPO

    sample = tmp_path / "sample.config"
    sample.write_text(open(f"{REPO}/samples/deepfm_online.config").read())
    text = (sample.read_text()
            .replace('feature_configs { input_names: "C1" feature_type: IdFeature '
                     'embedding_dim: 16 hash_bucket_size: 10000 }',
                     'feature_configs { input_names: "C1" feature_type: IdFeature '
                     'embedding_dim: 16 hash_bucket_size: 10000 shared_names: "C2" }'))
    text = re.sub(r'feature_configs \{ input_names: "C2" [^}]*\}\n', "", text)
    assert "shared_names" in text and 'input_names: "C2"' not in text
    path = tmp_path / "p.config"
    path.write_text(text)
    config = load_pipeline_config(str(path))
    features = {fc.feature_name: fc for fc in feature_configs(config)}
    c2 = features["C2"]
    assert list(c2.input_names) == ["C2"] and not c2.shared_names
    assert (c2.embedding_dim, c2.hash_bucket_size) == (16, 10000)
    check_pipeline_config(config, online=True)
    assert FeatureBuilder(config).feature_to_table["C2"] == "C2"  # its own table
