import json
import random

import numpy as np
import pytest
from google.protobuf import text_format

from odl.features.feature_builder import FeatureBuilder
from odl.features.id_hashing import (
    bucketize_hashes,
    fnv1a64,
    hash_segments,
    hash_strings,
    pack_strings,
)
from odl.features.record_parser import REJECT_REASONS, RecordParser
from odl.protos import pipeline_pb2

CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "price" input_type: FLOAT }
  input_fields { input_name: "age" input_type: DOUBLE default_val: "30" }
  input_fields { input_name: "user" input_type: STRING }
  input_fields { input_name: "tags" input_type: STRING }
  input_fields { input_name: "cat" input_type: STRING }
  input_fields { input_name: "shop" input_type: INT64 }
  input_fields { input_name: "sid" input_type: STRING }
  input_fields { input_name: "ts" input_type: DOUBLE }
  label_fields: "label"
  separator: ","
  sample_id_field: "sid"
  event_time_field: "ts"
}
feature_config {
  features { input_names: "price" feature_type: RawFeature }
  features { feature_name: "age_bucket" input_names: "age" feature_type: RawFeature
             boundaries: [18, 25, 40] embedding_dim: 4 }
  features { input_names: "user" hash_bucket_size: 1000 embedding_dim: 8 }
  features { input_names: "tags" hash_bucket_size: 500 embedding_dim: 8 separator: "|" }
  features { input_names: "cat" num_buckets: 7 embedding_dim: 8 embedding_name: "shared" }
  features { feature_name: "shop_id" input_names: "shop" num_buckets: 7 embedding_dim: 8
             embedding_name: "shared" }
  features { feature_name: "user_cat" input_names: ["user", "cat"] feature_type: ComboFeature
             hash_bucket_size: 100 embedding_dim: 8 combo_join_sep: "#" }
}
"""


def config():
    return text_format.Parse(CONFIG, pipeline_pb2.EasyRecConfig())


def csv(*fields):
    return ",".join(str(f) for f in fields).encode()


T0 = 1_767_225_600  # 2026-01-01T00:00:00Z: event times must be after 2000 and not ahead


GOOD = [
    csv(1, 1.5, 20, "u1", "a|b|c", 3, 12, "s0", T0 + 100.0),
    csv(0, "", "", "u2", "", -1, 5, "s1", T0 + 101.5),
    csv(1, 2.0, 50, "ü", "x", 8, 0, "s2", T0 + 102),
]


# -- hashing ----------------------------------------------------------------------------------


def test_fnv1a64_published_vectors():
    assert fnv1a64("") == 0xCBF29CE484222325
    assert fnv1a64("a") == 0xAF63DC4C8601EC8C
    assert fnv1a64("foobar") == 0x85944171F73967E8
    assert fnv1a64(b"foobar") == 0x85944171F73967E8
    h = hash_strings(["", "a", "foobar"])
    assert h.dtype == np.uint64
    assert h.tolist() == [0xCBF29CE484222325, 0xAF63DC4C8601EC8C, 0x85944171F73967E8]


def test_hash_strings_matches_scalar_reference():
    rng = random.Random(1)
    alphabet = "abcXYZ019_|é中"
    values = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
              for _ in range(2000)]
    values += ["x" * 300, "y" * 70, "\x00a", "a\x00", ""]
    h = hash_strings(values)
    assert [int(x) for x in h] == [fnv1a64(v) for v in values]
    # bytes input, numpy object arrays, and continuing from a state
    assert np.array_equal(hash_strings([v.encode() for v in values]), h)
    assert np.array_equal(hash_strings(np.array(values, dtype=object)), h)
    buf, s, e = pack_strings(["foo", "bar"])
    first = hash_segments(buf, s[:1], e[:1])
    cont = hash_segments(buf, s[1:], e[1:], init=first)
    assert int(cont[0]) == fnv1a64("foobar")


def test_bucketize_hashes():
    h = hash_strings(["a", "b", "foobar"])
    rows = bucketize_hashes(h, 1000)
    assert rows.dtype == np.int64
    assert rows.tolist() == [fnv1a64(v) % 1000 for v in ["a", "b", "foobar"]]
    with pytest.raises(ValueError):
        bucketize_hashes(h, 0)


# -- parser -----------------------------------------------------------------------------------


def test_parser_csv_rejects_each_malformed_kind():
    parser = RecordParser(config().data_config, max_record_bytes=200)
    bad = {
        "empty": b"",
        "invalid_utf8": csv(1, 1.0, 20, "u", "t", 1, 1, "s", T0).replace(b"u", b"\xff\xfe"),
        "field_count": b"1,2,3",
        "bad_number": csv(1, "abc", 20, "u", "t", 1, 1, "s", T0),
        "non_finite": csv(1, "nan", 20, "u", "t", 1, 1, "s", T0),
        "bad_label": csv(2, 1.0, 20, "u", "t", 1, 1, "s", T0),
        "oversized": csv(1, 1.0, 20, "u" * 300, "t", 1, 1, "s", T0),
    }
    values, expected = [], []
    for i, good in enumerate(GOOD):
        values.append(good)
        reason = list(bad)[i % len(bad)]
        values.append(bad[reason])
        expected.append((len(values) - 1, reason))
    for reason in list(bad)[len(GOOD):]:
        values.append(bad[reason])
        expected.append((len(values) - 1, reason))
    values.append(csv(1, "inf", 20, "u", "t", 1, 1, "s", T0))
    expected.append((len(values) - 1, "non_finite"))
    values.append(csv("", 1.0, 20, "u", "t", 1, 1, "s", T0))
    expected.append((len(values) - 1, "bad_label"))
    values.append(csv(1, 1.0, 20, "u", "t", 1, "1.5", "s", T0))  # INT64 field
    expected.append((len(values) - 1, "bad_number"))
    out = parser.parse(values)
    assert out.rejected == expected
    assert out.accepted.tolist() == [0, 2, 4]
    assert {r for _, r in out.rejected} <= set(REJECT_REASONS)
    np.testing.assert_array_equal(out.numeric["label"], [1, 0, 1])
    np.testing.assert_array_equal(out.numeric["price"], [1.5, 0.0, 2.0])  # empty -> 0
    np.testing.assert_array_equal(out.numeric["age"], [20, 30, 50])  # empty -> default_val
    assert out.texts("user") == ["u1", "u2", "ü"]
    assert out.numeric["shop"].dtype == np.int64


def test_parser_trailing_newline_and_multibyte_separator():
    parser = RecordParser(config().data_config)
    out = parser.parse([GOOD[0] + b"\n", GOOD[1] + b"\r\n", b"\n"])
    assert out.accepted.tolist() == [0, 1]
    assert out.rejected == [(2, "empty")]
    assert out.texts("ts") == [str(T0 + 100.0), str(T0 + 101.5)]
    dc = config().data_config
    dc.separator = "::"
    parser = RecordParser(dc)
    out = parser.parse([GOOD[0].replace(b",", b"::"), b"1::2"])
    assert out.accepted.tolist() == [0]
    assert out.rejected == [(1, "field_count")]
    assert out.texts("tags") == ["a|b|c"]


def test_parser_json_and_auto():
    dc = config().data_config
    parser = RecordParser(dc, list_separators={"tags": "|"})
    rec = {"label": 1, "price": 2.5, "age": None, "user": "u1", "tags": ["a", "b"],
           "cat": 3, "shop": 4, "sid": "s", "ts": 100}

    def js(**kw):
        return json.dumps({**rec, **kw}).encode()

    values = [
        js(),
        b"{not json",
        b'{"label": [1]}',
        js(price="abc"),
        js(price=True),
        json.dumps({k: v for k, v in rec.items() if k != "label"}).encode(),
        js(label=0.5),
        GOOD[0],  # CSV in AUTO mode
        js(tags={"x": 1}),
        b'{"label": 1, "price": NaN}',
        js(label=0, user="u2"),
    ]
    out = parser.parse(values)
    assert out.accepted.tolist() == [0, 7, 10]
    assert out.rejected == [(1, "bad_json"), (2, "json_type"), (3, "bad_number"),
                            (4, "json_type"), (5, "json_type"), (6, "bad_label"),
                            (8, "json_type"), (9, "non_finite")]
    assert out.texts("tags") == ["a|b", "a|b|c", "a|b"]
    assert out.texts("user") == ["u1", "u1", "u2"]
    np.testing.assert_array_equal(out.numeric["age"], [30, 20, 30])
    # JSON format: a CSV record is bad JSON
    dc.record_format = pipeline_pb2.DatasetConfig.JSON
    out = RecordParser(dc).parse([GOOD[0], js(tags="a|b"), b"[1, 2]", b"  ", js()])
    assert out.rejected == [(0, "bad_json"), (2, "json_type"), (3, "empty"), (4, "json_type")]
    # CSV format: a JSON record is just a bad CSV line
    dc.record_format = pipeline_pb2.DatasetConfig.CSV
    out = RecordParser(dc).parse([js()])
    assert out.rejected[0][1] in ("field_count", "bad_label", "bad_number")


# -- feature builder --------------------------------------------------------------------------


def test_feature_builder_outputs():
    fb = FeatureBuilder(config())
    assert fb.sparse_feature_names == ["age_bucket", "user", "tags", "cat", "shop_id", "user_cat"]
    assert fb.dense_feature_names == ["price"]
    assert fb.label_field == "label"
    specs = {t.name: t for t in fb.table_specs}
    assert specs["shared"].feature_names == ("cat", "shop_id")
    assert specs["shared"].num_rows == 7 and specs["shared"].dim == 8
    assert specs["age_bucket"].num_rows == 4
    assert specs["user"].num_rows == 1000

    values = [GOOD[0], b"garbage", GOOD[1], GOOD[2], csv(1, 1, 20, "u", "t", "x", 1, "s", T0)]
    res = fb.build(values)
    assert res.accepted.tolist() == [0, 2, 3]
    assert res.rejected == [(1, "field_count"), (4, "bad_number")]  # num_buckets "x"
    b = res.batch
    assert b.size == 3
    assert b.dense.dtype.is_floating_point and b.dense.tolist() == [[1.5], [0.0], [2.0]]
    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    assert b.sample_ids == ["s0", "s1", "s2"]
    np.testing.assert_array_equal(b.event_times, [T0 + 100.0, T0 + 101.5, T0 + 102.0])
    kjt = b.sparse.to_dict()
    # boundaries [18, 25, 40], side=right; empty age -> default 30
    assert kjt["age_bucket"].values().tolist() == [1, 2, 3]
    assert kjt["user"].values().tolist() == [fnv1a64(u) % 1000 for u in ["u1", "u2", "ü"]]
    assert kjt["user"].lengths().tolist() == [1, 1, 1]
    assert kjt["tags"].lengths().tolist() == [3, 0, 1]
    assert kjt["tags"].values().tolist() == [fnv1a64(t) % 500 for t in ["a", "b", "c", "x"]]
    assert kjt["cat"].values().tolist() == [3, -1 % 7, 8 % 7]
    assert kjt["shop_id"].values().tolist() == [12 % 7, 5, 0]
    combos = ["u1#3", "u2#-1", "ü#8"]
    assert kjt["user_cat"].values().tolist() == [fnv1a64(c) % 100 for c in combos]


def test_feature_builder_multi_valued_edge_cases_and_all_rejected():
    fb = FeatureBuilder(config())
    vals = [csv(1, 1, 20, "u", t, 1, 1, "s", T0) for t in ["|a||b|", "a", "|", "", "c|d"]]
    kjt = fb.build(vals).batch.sparse.to_dict()
    assert kjt["tags"].lengths().tolist() == [2, 1, 0, 0, 2]
    assert kjt["tags"].values().tolist() == [fnv1a64(t) % 500 for t in "abacd"]
    multi_int = [csv(1, 1, 20, "u", "", "1|9|-2", 1, "s", T0)]
    assert fb.build(multi_int).batch.sparse.to_dict()["cat"].values().tolist() == [1, 2, 5]
    res = fb.build([b"", b"x"])
    assert res.batch is None
    assert res.accepted.tolist() == []
    assert res.rejected == [(0, "empty"), (1, "field_count")]


def test_feature_builder_combo_empty_input_gives_no_id():
    fb = FeatureBuilder(config())
    b = fb.build([csv(1, 1, 20, "", "", 2, 1, "s", T0)]).batch
    assert b.sparse.to_dict()["user_cat"].lengths().tolist() == [0]
    assert b.sparse.to_dict()["user"].lengths().tolist() == [0]


def test_combo_input_seps_cross_every_value_of_the_split_inputs():
    """EasyRec's sparse cross: the tags split on "|", the user whole, one id per pair."""
    text = CONFIG.replace(
        'feature_name: "user_cat" input_names: ["user", "cat"] feature_type: ComboFeature',
        'feature_name: "user_cat" input_names: ["tags", "user", "cat"] '
        'combo_input_seps: ["|", "", ""] feature_type: ComboFeature')
    fb = FeatureBuilder(text_format.Parse(text, pipeline_pb2.EasyRecConfig()))
    rows = [csv(1, 1.5, 20, "u1", "a|b", 3, 12, "s0", T0), csv(0, 1, 20, "u2", "", 4, 5, "s1", T0),
            csv(1, 1, 20, "u3", "|c||", 5, 5, "s2", T0), csv(1, 1, 20, "", "d", 6, 5, "s3", T0)]
    kjt = fb.build(rows).batch.sparse.to_dict()["user_cat"]
    # no tag, or an empty user: no id (as an empty input of a plain ComboFeature)
    assert kjt.lengths().tolist() == [2, 0, 1, 0]
    assert kjt.values().tolist() == [fnv1a64(c) % 100 for c in ["a#u1#3", "b#u1#3", "c#u3#5"]]
    two = text.replace('["tags", "user", "cat"] combo_input_seps: ["|", "", ""]',
                       '["tags", "tags"] combo_input_seps: ["|", "|"]')
    fb = FeatureBuilder(text_format.Parse(two, pipeline_pb2.EasyRecConfig()))
    kjt = fb.build(rows[:1]).batch.sparse.to_dict()["user_cat"]
    want = ["a#a", "a#b", "b#a", "b#b"]  # the first input's values vary slowest
    assert kjt.values().tolist() == [fnv1a64(c) % 100 for c in want]


LOOKUP = CONFIG.replace(
    'features { input_names: "tags" hash_bucket_size: 500 embedding_dim: 8 separator: "|" }',
    'features { input_names: ["user", "tags"] feature_name: "tags" feature_type: LookupFeature '
    'hash_bucket_size: 500 embedding_dim: 8 separator: "|" kv_separator: ":" '
    'lookup_max_sel_elem_num: 2 }')


def test_lookup_feature_hashes_the_values_of_the_records_key():
    """EasyRec's LookupFeature: the map's pieces keyed by the record's key, the first
    lookup_max_sel_elem_num of them; a piece without kv_separator selects nothing."""
    fb = FeatureBuilder(text_format.Parse(LOOKUP, pipeline_pb2.EasyRecConfig()))
    maps = ["u1:a|u2:b|u1:c|u1:d", "u1:a|u2", "x:y", "u11:z|u1:", "u1:p:q"]
    users = ["u1", "u2", "u3", "u1", "u1"]
    rows = [csv(1, 1, 20, u, m, 3, 12, "s", T0) for u, m in zip(users, maps, strict=True)]
    kjt = fb.build(rows).batch.sparse.to_dict()["tags"]
    # u1's a, c (d is past the 2 kept); u2 has no "u2:..." piece; "u1:" selects an empty
    # value; the first ":" cuts "u1:p:q" into u1 and "p:q"
    assert kjt.lengths().tolist() == [2, 0, 0, 1, 1]
    assert kjt.values().tolist() == [fnv1a64(v) % 500 for v in ["a", "c", "", "p:q"]]


@pytest.mark.parametrize("edit, field", [
    (('kv_separator: ":"', ''), "feature_config.features[3].kv_separator"),
    (('hash_bucket_size: 500 embedding_dim: 8 separator: "|" kv_separator',
      'num_buckets: 500 embedding_dim: 8 separator: "|" kv_separator'),
     "feature_config.features[3].hash_bucket_size"),
    (('input_names: ["user", "tags"]', 'input_names: ["user", "shop"]'),
     "feature_config.features[3].input_names[1]"),
    (('lookup_max_sel_elem_num: 2', 'lookup_max_sel_elem_num: 0'),
     "feature_config.features[3].lookup_max_sel_elem_num"),
])
def test_lookup_feature_errors_name_the_field(edit, field):
    assert edit[0] in LOOKUP
    c = text_format.Parse(LOOKUP.replace(*edit), pipeline_pb2.EasyRecConfig())
    c.feature_config.features[3].feature_name = "tags"
    assert refused_field(c) == field


# CONFIG as a whole pipeline config, for the checks of odl.models.model_registry
MODEL = """
model_dir: "/tmp/odl-test-features-unused"
train_input_path: "/tmp/odl-test-features-unused.csv"
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "wide" wide_deep: WIDE
                   feature_names: ["age_bucket", "user", "tags", "cat", "shop_id", "user_cat"] }
  feature_groups { group_name: "deep" wide_deep: DEEP
                   feature_names: ["price", "user", "tags", "cat", "shop_id", "user_cat"] }
  deepfm { dnn { hidden_units: [8] } wide_output_dim: 1 }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.1 } }
  dense_optimizer { adam_optimizer { lr: 0.005 } }
}
"""


def refused_field(c) -> str:
    """The field ``check_pipeline_config`` names refusing ``c`` (CONFIG edited, + MODEL)."""
    from odl.config.config_error import ConfigError
    from odl.models.model_registry import check_pipeline_config

    c.MergeFrom(text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig()))
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(c, online=False)
    return info.value.field


def test_the_config_is_valid_as_a_pipeline_config():
    from odl.models.model_registry import check_pipeline_config

    c = config()
    c.MergeFrom(text_format.Parse(MODEL, pipeline_pb2.EasyRecConfig()))
    check_pipeline_config(c, online=False)


def test_feature_config_errors_name_the_field():
    """The feature rules are validation's (the builder takes a validated config)."""
    c = config()
    c.feature_config.features[2].num_buckets = 5  # both hash_bucket_size and num_buckets
    assert refused_field(c) == "feature_config.features[2].hash_bucket_size"
    c = config()
    c.feature_config.features[5].num_buckets = 8  # shared table with different sizes
    assert refused_field(c) == "feature_config.features[5].embedding_name"
    c = config()
    c.feature_config.features[0].combiner = "max"  # a dense number's: not read, not accepted
    assert refused_field(c) == "feature_config.features[0].combiner"
    c = config()
    c.data_config.input_fields[6].default_val = "3.5"  # the parser reads INT64 as integers
    assert refused_field(c) == "data_config.input_fields[6].default_val"
    c = config()
    c.feature_config.features[6].combo_input_seps.append("|")  # one separator per input
    assert refused_field(c) == "feature_config.features[6].combo_input_seps"
    c = config()
    c.feature_config.features[6].ClearField("input_names")
    c.feature_config.features[6].input_names.extend(["shop", "cat"])
    c.feature_config.features[6].combo_input_seps.extend(["|", ""])  # shop is INT64
    assert refused_field(c) == "feature_config.features[6].combo_input_seps[0]"
    c = config()
    c.feature_config.features[2].combo_input_seps.extend([","])  # not a ComboFeature
    assert refused_field(c) == "feature_config.features[2].combo_input_seps"


# -- vocabularies and raw value normalization (odl.config.feature_settings) ------------------

VOCAB_CONFIG = """
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "hour" input_type: STRING }
  input_fields { input_name: "tags" input_type: STRING }
  input_fields { input_name: "price" input_type: DOUBLE }
  input_fields { input_name: "age" input_type: INT64 }
  label_fields: "label"
}
feature_config {
  features { input_names: "hour" vocab_list: ["7", "8", "9"] embedding_dim: 4 }
  features { input_names: "tags" feature_type: TagFeature vocab_file: "%s" embedding_dim: 4 }
  features { input_names: "price" feature_type: RawFeature min_val: -2 max_val: 8 }
  features { feature_name: "age_b" input_names: "age" feature_type: RawFeature min_val: 0
             max_val: 100 boundaries: [0.25, 0.5] embedding_dim: 4 }
}
"""


def _vocab_builder(tmp_path, file_text="a\r\nü\nbb\n", extra="", write=True):
    from odl.config.config_forms import normalize_config_forms

    vocab = tmp_path / "tags.txt"
    if write:
        vocab.write_bytes(file_text.encode())
    c = text_format.Parse(VOCAB_CONFIG % vocab + extra, pipeline_pb2.EasyRecConfig())
    normalize_config_forms(c)  # TagFeature -> IdFeature
    return FeatureBuilder(c)


def test_a_vocabulary_the_builder_cannot_read_is_refused_by_field(tmp_path):
    """The builder reads vocab_file itself: its errors name the field as validation does."""
    _vocab_builder(tmp_path)
    (tmp_path / "tags.txt").unlink()
    from odl.config.config_error import ConfigError

    with pytest.raises(ConfigError, match="file not found") as info:
        _vocab_builder(tmp_path, write=False)
    assert info.value.field == "feature_config.features[1].vocab_file"


def test_vocabulary_ids_are_list_indices_and_oov_is_row_0(tmp_path):
    fb = _vocab_builder(tmp_path)
    specs = {t.name: t for t in fb.table_specs}
    assert specs["hour"].num_rows == 3 and specs["tags"].num_rows == 3  # one row per entry
    res = fb.build([csv(1, 9, "bb|ü|zz|a", 3, 10), csv(0, 7, "", 8, 50),
                    csv(1, 10, "b|aa|ü", -2, 75), csv(0, "", "a", 13, 100)])
    kjt = res.batch.sparse.to_dict()
    # "10" is not "7"/"8"/"9": EasyRec's default_value 0, the first entry's row
    assert kjt["hour"].values().tolist() == [2, 0, 0]
    assert kjt["hour"].lengths().tolist() == [1, 1, 1, 0]  # an empty value has no id
    # file lines, \r\n or \n, are rows 0, 1, 2; "zz", "b", "aa" are out of vocabulary
    assert kjt["tags"].values().tolist() == [2, 1, 0, 0, 0, 0, 1, 0]
    assert kjt["tags"].lengths().tolist() == [4, 0, 3, 1]


def test_raw_values_are_normalized_by_min_and_max_without_clipping(tmp_path):
    fb = _vocab_builder(tmp_path)
    assert fb.dense_feature_names == ["price"]
    res = fb.build([csv(1, 7, "a", 3, 10), csv(0, 7, "a", -2, 50), csv(1, 7, "a", 13, 75),
                    csv(0, 7, "a", -7, 100)])
    b = res.batch
    # (x - (-2)) / (8 - (-2)); 13 and -7 lie outside [min, max] and stay outside [0, 1]
    np.testing.assert_allclose(b.dense[:, 0].numpy(), [0.5, 0.0, 1.5, -0.5], rtol=1e-7)
    # boundaries [0.25, 0.5] apply to age / 100: 0.1 -> 0, 0.5 -> 2, 0.75 -> 2, 1.0 -> 2
    assert b.sparse.to_dict()["age_b"].values().tolist() == [0, 2, 2, 2]


@pytest.mark.parametrize("max_val, values, rejected, kept", [
    (1e-30, [1e10, 1e-31], [(0, "non_finite")], 0.1),  # 1e40 is beyond float32
    (1e30, [1e39, 1e29], [], 1e9),  # 1e39 is beyond float32, its normalized 1e9 is not
])
def test_the_normalized_value_must_fit_float32(tmp_path, max_val, values, rejected, kept):
    text = VOCAB_CONFIG.replace("min_val: -2 max_val: 8", f"min_val: 0 max_val: {max_val}")
    (tmp_path / "v.txt").write_text("a\n")
    c = text_format.Parse(text % (tmp_path / "v.txt"), pipeline_pb2.EasyRecConfig())
    c.feature_config.features[1].feature_type = pipeline_pb2.FeatureConfig.IdFeature
    res = FeatureBuilder(c).build([csv(1, 7, "a", v, 1) for v in values])
    assert res.rejected == rejected
    assert res.batch.dense[0, 0].item() == pytest.approx(kept, rel=1e-6)


def test_vocabulary_feature_of_a_dynamic_table_gives_the_index_as_raw_id(tmp_path):
    fb = _vocab_builder(tmp_path, extra="model_config { ev_params { max_capacity: 64 } }")
    assert {t.name: t.num_rows for t in fb.table_specs}["hour"] == 64
    kjt = fb.build([csv(1, 8, "bb|x", 3, 10)]).batch.sparse.to_dict()
    assert kjt["hour"].values().tolist() == [1]
    assert kjt["tags"].values().tolist() == [2, 0]
