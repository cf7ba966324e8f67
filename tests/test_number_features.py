"""RawFeatures of several numbers (``raw_input_dim`` / TorchEasyRec's ``value_dim``),
SequenceFeatures of numbers, and TorchEasyRec's sequence groups and encoders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.models.model_registry import build_model
from odl.models.sequence_layers import AttentionLayout, SequencePool, TargetAttention
from odl.protos import pipeline_pb2
from tests.harness import assert_edit_refused, load_config_text

EASYREC = """
model_dir: "/tmp/odl-number-features-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config {
  batch_size: 8
  input_fields { input_name: "clk" input_type: INT32 }
  input_fields { input_name: "user" input_type: STRING }
  input_fields { input_name: "vec" input_type: STRING }
  input_fields { input_name: "prices" input_type: STRING }
  label_fields: "clk"
}
feature_config {
  features { input_names: "user" hash_bucket_size: 100 embedding_dim: 8 }
  features { input_names: "vec" feature_type: RawFeature raw_input_dim: 3 separator: ";"
             min_val: 0 max_val: 10 }
  features { input_names: "prices" feature_type: SequenceFeature sub_feature_type: RawFeature
             boundaries: [1, 5, 10] embedding_dim: 8 max_seq_len: 4 separator: "|"
             sequence_combiner { attention {} } }
}
model_config {
  model_class: "WideAndDeep"
  feature_groups { group_name: "deep" feature_names: ["user", "vec", "prices"]
                   wide_deep: DEEP }
  feature_groups { group_name: "wide" feature_names: ["user", "vec"] wide_deep: WIDE }
  wide_and_deep { dnn { hidden_units: [8] } }
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
}
"""


def _built(text: str, rows: list[bytes]):
    fb = FeatureBuilder(load_config_text(text))
    return fb, fb.build(rows)


def test_a_raw_feature_of_several_numbers_is_that_many_dense_columns():
    fb, built = _built(EASYREC, [b"1,u1,1;2;3,", b'{"clk": 0, "user": "u2", "vec": [4, 5, 10]}',
                                 b"0,u3,,", b"1,u4,1;2,", b"1,u5,1;x;3,", b"0,u6,1;2;3;4,"])
    cols = ["vec#0", "vec#1", "vec#2"]
    assert fb.dense_feature_columns["vec"] == cols and fb.dense_feature_names[:3] == cols
    assert sorted(built.rejected) == [(3, "bad_number"), (4, "bad_number"), (5, "bad_number")]
    dense = built.batch.dense[:, :3].numpy()
    # normalized by min_val / max_val; an empty value reads zeros (normalized too)
    assert np.allclose(dense, [[0.1, 0.2, 0.3], [0.4, 0.5, 1.0], [0.0, 0.0, 0.0]])


def test_a_sequence_of_numbers_is_bucketized_position_by_position():
    fb, built = _built(EASYREC, [b"1,u1,1;2;3,0.5|7|12|3|9", b"0,u2,1;2;3,", b"1,u3,1;2;3,2|z"])
    assert built.rejected == [(2, "bad_number")]
    kjt = built.batch.sparse.to_dict()
    keys = [sequence_key("prices", p) for p in range(4)]
    assert [k for k in fb.sparse_feature_names if k.startswith("prices")] == keys
    got = [kjt[k].to_padded_dense(desired_length=1, padding_value=-1).flatten().tolist()
           for k in keys]
    # boundaries [1, 5, 10]: 0.5 -> 0, 7 -> 2, 12 -> 3, 3 -> 1 (the fifth item is cut)
    assert got == [[0, -1], [2, -1], [3, -1], [1, -1]]
    assert built.batch.dense[:, -1].tolist() == [4.0, 0.0]
    assert fb.dense_feature_names[-1] == sequence_length_column("prices")
    build_model(load_config_text(EASYREC), fb)  # the attention combiner reads its buckets


@pytest.mark.parametrize("edit, field, words", [
    (("input_type: STRING }\n  input_fields { input_name: \"prices\"",
      "input_type: DOUBLE }\n  input_fields { input_name: \"prices\""),
     "feature_config.features[1].input_names[0]", "STRING field"),
    (("raw_input_dim: 3", "raw_input_dim: 3 boundaries: [1, 2]"),
     "feature_config.features[1].boundaries", "raw_input_dim 1"),
    (("boundaries: [1, 5, 10] embedding_dim: 8", "embedding_dim: 8"),
     "model_config.feature_groups[0].feature_names[2]", "target attention only"),
    (("boundaries: [1, 5, 10] embedding_dim: 8", "embedding_dim: 8 raw_input_dim: 2"),
     "feature_config.features[2].raw_input_dim", "seq_multi_sep"),
    (("boundaries: [1, 5, 10] embedding_dim: 8",
      'boundaries: [1, 5, 10] embedding_dim: 8 seq_multi_sep: "|"'),
     "feature_config.features[2].seq_multi_sep", "differ from separator"),
    (("boundaries: [1, 5, 10] embedding_dim: 8", "boundaries: [1, 5, 10]"),
     "feature_config.features[2].embedding_dim", "embedding_dim > 0"),
    (("sub_feature_type: RawFeature", "sub_feature_type: RawFeature hash_bucket_size: 9"),
     "feature_config.features[2].hash_bucket_size", "takes boundaries"),
])
def test_number_feature_errors_name_the_field(edit, field, words):
    assert_edit_refused(EASYREC, edit, field, words)


def test_dense_number_sequences_are_read_by_target_attention_only():
    text = EASYREC.replace("boundaries: [1, 5, 10] embedding_dim: 8 ", "")
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field == "model_config.feature_groups[0].feature_names[2]"
    assert "read by target attention only" in str(e.value)


TZ_DIN = """
model_dir: "/tmp/odl-number-features-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config { batch_size: 8 label_fields: "clk" }
feature_configs { id_feature { feature_name: "item" num_buckets: 50 embedding_dim: 8 } }
feature_configs { raw_feature { feature_name: "price" } }
feature_configs { raw_feature { feature_name: "emb" value_dim: 3 separator: ";" } }
feature_configs { sequence_feature { sequence_name: "click" sequence_length: 3
  sequence_delim: "|"
  features { id_feature { feature_name: "item" num_buckets: 50 embedding_dim: 8 } }
  features { raw_feature { feature_name: "price" } } } }
model_config {
  feature_groups { group_name: "deep" feature_names: ["item", "price", "emb"]
                   group_type: DEEP }
  feature_groups { group_name: "seq"
                   feature_names: ["item", "price", "click__item", "click__price"]
                   group_type: SEQUENCE }
  multi_tower_din {
    towers { input: "deep" mlp { hidden_units: [8] } }
    din_towers { input: "seq" attn_mlp { hidden_units: [8] } }
    final { hidden_units: [4] }
  }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } }
  dense_optimizer { adam_optimizer { lr: 0.001 } }
}
"""


def test_torcheasyrec_value_dim_and_a_sequence_of_numbers_feed_a_din_tower():
    config = load_config_text(TZ_DIN)
    fields = {f.input_name: f.input_type for f in config.data_config.input_fields}
    string, double = pipeline_pb2.DatasetConfig.STRING, pipeline_pb2.DatasetConfig.DOUBLE
    assert (fields["price"], fields["emb"], fields["click__price"]) == (double, string, string)
    fb = FeatureBuilder(config)
    assert fb.dense_feature_columns["emb"] == ["emb#0", "emb#1", "emb#2"]
    assert fb.dense_sequence_features == {"click__price": 3}
    built = fb.build([b'{"clk": 1, "item": "3", "price": 2.5, "emb": "1;2;3", '
                      b'"click__item": "3|4", "click__price": "1.5|4.5"}'])
    assert not built.rejected
    row = dict(zip(fb.dense_feature_names, built.batch.dense[0].tolist(), strict=True))
    assert [row[f"click__price#{p}"] for p in range(3)] == [1.5, 4.5, 0.0]
    assert row["click__price#len"] == 2.0 and row["emb#2"] == 3.0
    model = build_model(config, fb)
    din = model.dense.towers[1]
    # the key: item (8) + price (1); each item: click__item (8) + click__price (1)
    assert (din.width, din.seq_len, din.key_dense, din.dense_sizes) == (9, 3, 1, [1])
    assert model.dense.towers[0][0].in_features == 8 + 1 + 3  # item, price, emb's 3 numbers


def test_target_attention_with_dense_parts_attends_over_the_whole_items():
    """The dense columns join the key and each item: the same as one all-embedded input."""
    torch.manual_seed(0)
    dnn = pipeline_pb2.DNN(hidden_units=[6])
    b, n, ke, ie = 4, 3, 5, 4  # key 5 embedded + 1 dense; items 4 embedded + 2 dense
    mixed = TargetAttention(AttentionLayout.plain(6, dense_key=1, dense_item=2), n, dnn,
                            encoder=True)
    plain = TargetAttention(AttentionLayout.plain(6), n, dnn, encoder=True)
    plain.load_state_dict(mixed.state_dict())
    k_emb, k_dense = torch.randn(b, ke), torch.randn(b, 1)
    h_emb, h_dense = torch.randn(b, n, ie), torch.randn(b, n, 2)
    length = torch.tensor([[3.0], [1.0], [0.0], [2.0]])
    x_mixed = torch.cat([k_emb, h_emb.reshape(b, -1), k_dense, h_dense.reshape(b, -1), length],
                        dim=1)
    x_plain = torch.cat([k_emb, k_dense, torch.cat([h_emb, h_dense], dim=2).reshape(b, -1),
                         length], dim=1)
    assert torch.allclose(mixed(x_mixed), plain(x_plain), atol=1e-6)
    assert torch.allclose(torch.jit.script(mixed)(x_mixed), mixed(x_mixed))


def test_sequence_pool_averages_or_sums_the_items_within_the_length():
    h = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    x = torch.cat([h.reshape(1, -1), torch.tensor([[2.0]])], dim=1)
    assert SequencePool(2, 3, "mean")(x).tolist() == [[2.0, 3.0]]
    assert SequencePool(2, 3, "sum")(x).tolist() == [[4.0, 6.0]]
    empty = torch.cat([h.reshape(1, -1), torch.tensor([[0.0]])], dim=1)
    assert SequencePool(2, 3, "mean")(empty).tolist() == [[0.0, 0.0]]


TZ_MMOE = """
model_dir: "/tmp/odl-number-features-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config { batch_size: 8 label_fields: ["clk", "buy"] }
feature_configs { id_feature { feature_name: "user" num_buckets: 50 embedding_dim: 8 } }
feature_configs { id_feature { feature_name: "item" num_buckets: 50 embedding_dim: 8 } }
feature_configs { sequence_feature { sequence_name: "click" sequence_length: 4
  features { id_feature { feature_name: "item" num_buckets: 50 embedding_dim: 8 } } } }
model_config {
  feature_groups {
    group_name: "all" feature_names: ["user", "item"] group_type: DEEP
    sequence_groups { feature_names: ["item", "click__item"] }
    sequence_encoders { din_encoder { attn_mlp { hidden_units: [8] } } }
    sequence_encoders { pooling_encoder { pooling_type: "sum" } }
  }
  mmoe {
    expert_mlp { hidden_units: [8] } num_expert: 2
    task_towers { tower_name: "ctr" label_name: "clk" mlp { hidden_units: [4] }
                  losses { binary_cross_entropy {} } }
    task_towers { tower_name: "cvr" label_name: "buy" mlp { hidden_units: [4] }
                  losses { binary_cross_entropy {} } }
  }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } }
  dense_optimizer { adam_optimizer { lr: 0.001 } }
}
"""


def test_sequence_encoders_of_a_multi_task_group_become_its_sequence_blocks():
    config = load_config_text(TZ_MMOE)
    (group,) = config.model_config.feature_groups
    din, pool = group.sequence_features
    assert (din.group_name, list(din.seq_att_map[0].key), list(din.seq_att_map[0].hist_seq)) == (
        "all", ["item"], ["click__item"])
    assert din.HasField("attn_mlp") and pool.pooling == "sum"
    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    seqs = model.dense.sequences
    assert [type(m).__name__ for m in seqs.combiners] == ["TargetAttention", "SequencePool"]
    # user, item, then the attention's key and 4 positions, then the pool's 4 positions
    lookups = [f for f, _t in model.pooled_layout[0].lookups]
    positions = [sequence_key("click__item", p) for p in range(4)]
    assert lookups == ["user", "item", "item"] + positions + positions
    assert seqs.out_width == 8 + 8 + 8 + 8  # user, item, attended sequence, pooled sequence
    from odl.train.train_module import TrainModule

    module = TrainModule(config, fb, device="cpu")
    built = fb.build([b'{"clk": 1, "buy": 0, "user": "1", "item": "3", "click__item": "3|4"}',
                      b'{"clk": 0, "buy": 0, "user": "2", "item": "5", "click__item": ""}'])
    assert not built.rejected
    out = module.train_step(built.batch)
    assert np.isfinite(out.loss) and tuple(out.probs.shape) == (2, 2)


@pytest.mark.parametrize("edit, field, words", [
    (("    sequence_encoders { pooling_encoder { pooling_type: \"sum\" } }\n", ""),
     None, None),  # one encoder per group is enough
    (("sequence_groups { feature_names", "sequence_groups { group_name: \"a\" feature_names"),
     None, None),  # an encoder without input reads the only group, named or not
    (("pooling_type: \"sum\"", "pooling_type: \"max\""),
     "model_config.feature_groups[0].sequence_encoders[1].pooling_encoder.pooling_type",
     "mean or sum"),
    (("din_encoder { attn_mlp", "din_encoder { input: \"b\" attn_mlp"),
     "model_config.feature_groups[0].sequence_encoders[0].din_encoder.input",
     "sequence_groups"),
    (("    sequence_encoders { din_encoder { attn_mlp { hidden_units: [8] } } }\n"
      "    sequence_encoders { pooling_encoder { pooling_type: \"sum\" } }\n", ""),
     "model_config.feature_groups[0].sequence_encoders", "give both"),
    (("feature_names: [\"item\", \"click__item\"]", "feature_names: [\"item\"]"),
     "model_config.feature_groups[0].sequence_groups[0].feature_names", "no sequence"),
    (("sequence_encoders { din_encoder {", "sequence_encoders { simple_attention {"),
     "model_config.feature_groups[0].sequence_encoders[0].simple_attention",
     "a TorchEasyRec field that odl does not implement yet"),
])
def test_sequence_group_rules_are_torcheasyrecs(edit, field, words):
    assert edit[0] in TZ_MMOE, edit[0]
    text = TZ_MMOE.replace(*edit)
    if field is None:
        load_config_text(text)
        return
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field == field and words in str(e.value), e.value


def test_dense_query_and_items_of_a_group_encoder_join_its_attention():
    """A raw query feature and a sequence of numbers in a DEEP group's sequence group
    (TorchEasyRec's dbmtl_has_sequence_mock form): the attention's key and items hold them."""
    from odl.train.train_module import TrainModule

    text = (TZ_MMOE
            .replace('feature_configs { sequence_feature',
                     'feature_configs { raw_feature { feature_name: "price" } }\n'
                     'feature_configs { sequence_feature')
            .replace('features { id_feature { feature_name: "item" num_buckets: 50 '
                     'embedding_dim: 8 } } } }',
                     'features { id_feature { feature_name: "item" num_buckets: 50 '
                     'embedding_dim: 8 } }\n  features { raw_feature { feature_name: "price" '
                     '} } } }')
            .replace('sequence_groups { feature_names: ["item", "click__item"] }',
                     'sequence_groups { feature_names: ["item", "price", "click__item", '
                     '"click__price"] }')
            .replace('    sequence_encoders { pooling_encoder { pooling_type: "sum" } }\n', ""))
    config = load_config_text(text)
    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    (att,) = model.dense.sequences.combiners
    assert (att.width, att.key_dense, att.dense_sizes, att.seq_len) == (9, 1, [1], 4)
    assert model.dense.sequences.dense_widths == [1 + 4]  # price, then click__price's 4
    module = TrainModule(config, fb, device="cpu")
    built = fb.build([b'{"clk": 1, "buy": 1, "user": "1", "item": "3", "price": 2.0, '
                      b'"click__item": "3|4", "click__price": "1.0|2.5"}'])
    assert not built.rejected
    assert np.isfinite(module.train_step(built.batch).loss)
    # WideAndDeep's deep groups read embedded keys and sequences only
    with pytest.raises(ConfigError) as e:
        load_config_text(EASYREC.replace(
            "wide_deep: DEEP }",
            'wide_deep: DEEP sequence_features { group_name: "s" '
            'seq_att_map { key: "vec" hist_seq: "prices" } } }'))
    assert "not an embedded (non-sequence) feature" in str(e.value)
