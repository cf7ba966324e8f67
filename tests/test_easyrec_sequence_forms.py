"""EasyRec's sequence forms: several values per position (``seq_multi_sep``),
``sequence_length``, ``num_buckets`` over a sequence's numbers, projected sequences of
numbers, and the target attention's ``aux_hist_seq`` / ``allow_key_transform`` /
``need_key_feature``; each against a reference written out here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.feature_configs import feature_configs
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.features.id_hashing import bucketize_hashes, hash_segments
from odl.models.sequence_layers import (
    KEY_LINEAR,
    KEY_PADDED,
    AttentionLayout,
    TargetAttention,
)
from odl.protos import pipeline_pb2
from tests.harness import assert_edit_refused, load_config_text

CONFIG = """
model_dir: "/tmp/odl-easyrec-sequence-forms-unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config {
  batch_size: 8
  separator: ","
  input_fields { input_name: "clk" input_type: INT32 }
  input_fields { input_name: "user" input_type: STRING }
  input_fields { input_name: "brand" input_type: STRING }
  input_fields { input_name: "brands" input_type: STRING }
  input_fields { input_name: "prices" input_type: STRING }
  input_fields { input_name: "vecs" input_type: STRING }
  label_fields: "clk"
}
feature_configs { input_names: "user" hash_bucket_size: 50 embedding_dim: 4 }
feature_configs { input_names: "brand" hash_bucket_size: 50 embedding_dim: 4
                  embedding_name: "brand" }
feature_configs { input_names: "brands" feature_type: SequenceFeature hash_bucket_size: 50
                  embedding_dim: 4 embedding_name: "brand" separator: "|"
                  seq_multi_sep: ";" sequence_length: 3 }
feature_configs { input_names: "prices" feature_type: SequenceFeature
                  sub_feature_type: RawFeature num_buckets: 4 min_val: 0 max_val: 100
                  embedding_dim: 4 separator: "|" seq_multi_sep: ";" sequence_length: 3 }
feature_configs { input_names: "vecs" feature_type: SequenceFeature
                  sub_feature_type: RawFeature raw_input_dim: 2 embedding_dim: 4
                  separator: "|" seq_multi_sep: ";" sequence_length: 3 }
model_config {
  model_class: "DBMTL"
  feature_groups {
    group_name: "all" feature_names: ["user", "brand"] wide_deep: DEEP
    sequence_features {
      group_name: "seq" allow_key_transform: true
      seq_att_map { key: "brand" hist_seq: "brands" hist_seq: "vecs" aux_hist_seq: "prices" }
    }
  }
  dbmtl {
    bottom_dnn { hidden_units: [8] use_bn: false }
    task_towers { tower_name: "ctr" label_name: "clk" dnn { hidden_units: [4] use_bn: false } }
  }
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
}
"""


def _hash(token: str, rows: int = 50) -> int:
    buf = np.frombuffer(token.encode(), dtype=np.uint8)
    return int(bucketize_hashes(hash_segments(buf, np.array([0]), np.array([len(buf)])),
                                rows)[0])


def test_the_easyrec_spellings_become_odls_settings():
    config = load_config_text(CONFIG)
    fcs = {fc.feature_name: fc for fc in feature_configs(config)}
    assert [fcs[f].max_seq_len for f in ("brands", "prices", "vecs")] == [3, 3, 3]
    assert not any(fc.HasField("sequence_length") for fc in config.feature_configs)
    # num_buckets over [min_val, max_val]: the equal-width buckets over the raw numbers
    assert list(fcs["prices"].boundaries) == [0.0, 25.0, 50.0, 75.0]
    assert not fcs["prices"].num_buckets and not fcs["prices"].HasField("max_val")


def test_a_sequence_length_that_contradicts_max_seq_len_is_refused():
    assert_edit_refused(CONFIG, ('embedding_name: "brand" separator: "|"',
                                 'embedding_name: "brand" separator: "|" max_seq_len: 5'),
                        "feature_configs[2].sequence_length", "max_seq_len")


def test_positions_of_several_values_become_bags_and_numbers_per_position():
    fb = FeatureBuilder(load_config_text(CONFIG))
    rows = [b"1,u1,b1,x;y|z|p;q;r|cut,10;60|99,1;2|3;4",
            b"0,u2,b2,w,,5;6|7;8|9;10|11;12",
            b"1,u3,b3,a|b,30,1;2;3",  # three numbers at a position of two: rejected
            b"0,u4,b4,;|c,200,"]
    built = fb.build(rows)
    assert built.rejected == [(2, "bad_number")]
    kjt = built.batch.sparse.to_dict()
    brands = {p: kjt[sequence_key("brands", p)] for p in range(3)}
    # each sample's bag at each position (the 4th position of the first record is cut)
    want = [[["x", "y"], ["z"], ["p", "q", "r"]], [["w"], [], []], [[], ["c"], []]]
    for p in range(3):
        got = [t.tolist() for t in brands[p].to_dense()]
        assert got == [[_hash(v) for v in sample[p]] for sample in want], p
    # prices: each number's bucket of [0, 25, 50, 75] (200 is past the last: bucket 4)
    prices = {p: kjt[sequence_key("prices", p)] for p in range(3)}
    assert prices[0].values().tolist() == [0 + 1, 3, 4]  # 10 -> 1, 60 -> 3; 200 -> 4
    assert prices[1].values().tolist() == [4]  # 99 -> 4
    dense = dict(zip(fb.dense_feature_names, built.batch.dense.T.tolist(), strict=True))
    assert [dense[f"vecs#{k}"] for k in range(6)] == [[1, 5, 0], [2, 6, 0], [3, 7, 0],
                                                       [4, 8, 0], [0, 9, 0], [0, 10, 0]]
    assert dense[sequence_length_column("brands")] == [3, 1, 2]
    assert dense[sequence_length_column("vecs")] == [2, 3, 0]
    assert dense[sequence_length_column("prices")] == [2, 0, 1]


def _reference(att: TargetAttention, k: torch.Tensor, h: torch.Tensor, a: torch.Tensor,
               length: torch.Tensor, with_key: bool) -> torch.Tensor:
    """DIN's attention written out sample by sample (EasyRec's target_attention)."""
    out = []
    for i in range(k.shape[0]):
        n = int(length[i])
        scores = torch.stack([att.mlp(torch.cat([k[i], h[i, p], k[i] - h[i, p],
                                                 k[i] * h[i, p]]).unsqueeze(0))[0, 0]
                              for p in range(h.shape[1])])
        scores = torch.where(torch.arange(h.shape[1]) < n, scores,
                             torch.full_like(scores, -2.0**32 + 1))
        w = torch.softmax(scores, dim=0).unsqueeze(1)
        parts = [(w * h[i]).sum(0), (w * a[i]).sum(0)]
        out.append(torch.cat(parts + ([k[i]] if with_key else [])))
    return torch.stack(out)


@pytest.mark.parametrize("transform", [KEY_PADDED, KEY_LINEAR])
@pytest.mark.parametrize("with_key", [True, False])
def test_target_attention_with_aux_projected_numbers_and_a_transformed_key(transform, with_key):
    torch.manual_seed(0)
    b, n = 5, 3
    # key: 3 embedded + 1 dense; items: 4 embedded + 2 numbers projected to 2 (width 6);
    # aux: 2 embedded + 1 number as it is (width 3)
    layout = AttentionLayout(key_embedded=3, item_embedded=4, aux_embedded=2, key_dense=1,
                             item_dense=((2, 2),), aux_dense=((1, 0),),
                             key_transform=transform, with_key=with_key)
    att = TargetAttention(layout, n, pipeline_pb2.DNN(hidden_units=[5, 1]))
    assert att.out_width == 6 + 3 + (6 if with_key else 0)
    ke, kd = torch.randn(b, 3), torch.randn(b, 1)
    he, ae = torch.randn(b, n, 4), torch.randn(b, n, 2)
    hn, an = torch.randn(b, n, 2), torch.randn(b, n, 1)
    length = torch.tensor([3.0, 1.0, 2.0, 0.0, 3.0])
    x = torch.cat([ke, torch.cat([he, ae], dim=2).reshape(b, -1), kd,
                   torch.cat([hn, an], dim=2).reshape(b, -1), length.unsqueeze(1)], dim=1)
    k = torch.cat([ke, kd], dim=1)
    h = torch.cat([he, hn @ att.projections[0].weight.T], dim=2)
    if transform == KEY_PADDED:  # zeros after the key's 4 columns, to the items' 6
        k = torch.cat([k, torch.zeros(b, 2)], dim=1)
    else:  # both through their Linear layers (with bias)
        k = k @ att.key_map.weight.T + att.key_map.bias
        h = h @ att.item_map.weight.T + att.item_map.bias
    a = torch.cat([ae, an], dim=2)
    want = _reference(att, k, h, a, length, with_key)
    got = att(x)
    keep = length > 0  # a sample of no position: uniform weights over the padding (batch)
    assert torch.allclose(got[keep], want[keep], atol=1e-5)
    assert torch.allclose(torch.jit.script(att)(x), got, atol=1e-6)


def test_a_key_of_another_width_needs_allow_key_transform():
    assert_edit_refused(CONFIG, ("allow_key_transform: true", ""),
                        "model_config.feature_groups[0].sequence_features[0]",
                        "allow_key_transform")


def test_the_model_reads_the_forms_and_trains():
    """The config above builds and trains: the brand table shared by the id and the
    sequence, the key (4 wide) padded to the items' 8 (4 embedded + 4 projected)."""
    from odl.train.train_module import TrainModule

    config = load_config_text(CONFIG)
    fb = FeatureBuilder(config)
    assert fb.feature_to_table["brand"] == fb.feature_to_table[sequence_key("brands", 0)]
    module = TrainModule(config, fb, device="cpu")
    (att,) = [m for m in module.model.dense.modules() if isinstance(m, TargetAttention)]
    assert att.key_pad == 4 and att.out_width == 8 + 4 + 8  # items 4 + 4, aux 4, key 8
    before = att.projections[0].weight.detach().clone()
    rows = [b"1,u1,b1,x;y|z,10;60|99,1;2|3;4", b"0,u2,b2,w,5,5;6"] * 4
    for _ in range(2):
        out = module.train_step(fb.build(rows).batch)
        assert np.isfinite(out.loss)
    assert not torch.equal(att.projections[0].weight, before)  # the projection learns


def test_variational_dropout_of_a_group_with_attention_leaves_the_attended_vector():
    """EasyRec drops a group's input-layer features; its target attention's vector joins
    after: in evaluation the group's lookups and numbers are scaled by 1 - p, the attention's
    output is not."""
    import copy

    from odl.train.train_module import TrainModule

    text = CONFIG.replace("model_config {", "model_config {\n  variational_dropout { "
                          "regularization_lambda: 0.01 }", 1)
    config = load_config_text(text)
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    seqs = module.model.dense.sequences
    assert seqs.dropped == [] and seqs.dropout is not None  # the group's only block: attention
    plain = copy.deepcopy(seqs)
    plain.dropout = None
    seqs.eval()
    plain.eval()
    x = torch.randn(6, plain.regular + sum(plain.widths) + plain.raw
                    + sum(plain.dense_widths) + plain.num_sequences)
    x[:, -1] = 2.0  # the sequence's length
    got, want = seqs(x), plain(x)
    keep = 1.0 - torch.sigmoid(seqs.dropout.logit_p)  # user, brand: one p per feature
    reg = plain.regular
    assert reg == 8 and keep.shape == (2,)
    assert torch.allclose(got[:, :4], want[:, :4] * keep[0])
    assert torch.allclose(got[:, 4:8], want[:, 4:8] * keep[1])
    assert torch.equal(got[:, reg:], want[:, reg:])  # the attended vector, as it was
    before = seqs.dropout.logit_p.detach().clone()
    module.model.train()
    built = fb.build([b"1,u1,b1,x;y|z,10;60|99,1;2|3;4", b"0,u2,b2,w,5,5;6"] * 4)
    module.train_step(built.batch)
    assert not torch.equal(seqs.dropout.logit_p, before)  # the probabilities learn
