"""SequenceFeature (positions as keys, length as a dense column) and its DIN config checks."""

from __future__ import annotations

import numpy as np
import pytest

from odl.config.config_error import ConfigError
from odl.datagen.datagen_config import deepfm_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.features.feature_plan import sequence_key, sequence_length_column
from odl.features.id_hashing import bucketize_hashes, hash_segments
from odl.harness.model_configs import as_model_config_text
from tests.harness import assert_edit_refused, load_config_text

TEXT = as_model_config_text(deepfm_config_text("/tmp/odl-seq-unused", dim=8, buckets=50,
                                               hidden_units=(16,)), "MultiTowerDIN")


def _row(fb: FeatureBuilder, history: str) -> bytes:
    dense = ",".join("1.0" for _ in range(13))
    ids = ",".join(f"c{i}" for i in range(1, 27))
    return f"s1,1767225600.0,1,{dense},{ids},{history}".encode()


def _bucket(token: str, rows: int = 50) -> int:
    buf = np.frombuffer(token.encode(), dtype=np.uint8)
    h = hash_segments(buf, np.array([0]), np.array([len(buf)]))
    return int(bucketize_hashes(h, rows)[0])


def test_positions_are_keys_and_the_kept_length_a_dense_column():
    fb = FeatureBuilder(load_config_text(TEXT))
    keys = [sequence_key("hist_C3", p) for p in range(5)]
    assert [k for k in fb.sparse_feature_names if k.startswith("hist_C3")] == keys
    assert fb.dense_feature_names[-1] == sequence_length_column("hist_C3")
    assert fb.feature_to_table[keys[3]] == "hist_C3"
    histories = ["a|b|c", "", "a|b|c|d|e|f|g", "z"]  # the third is cut to its first 5
    batch = fb.build([_row(fb, h) for h in histories]).batch
    assert batch.dense[:, -1].tolist() == [3.0, 0.0, 5.0, 1.0]
    kjt = batch.sparse.to_dict()
    want = [["a", "b", "c"], [], ["a", "b", "c", "d", "e"], ["z"]]
    for p, key in enumerate(keys):
        got = kjt[key].to_padded_dense(desired_length=1, padding_value=-1).flatten().tolist()
        expect = [_bucket(w[p]) if p < len(w) else -1 for w in want]
        assert got == expect, (key, got, expect)


@pytest.mark.parametrize("edit, field, words", [
    (('din_towers { input: "din" dnn { hidden_units: [8, 1] } }',
      'din_towers { input: "din" dnn { hidden_units: [8, 4] } }'),
     "model_config.multi_tower.din_towers[0].dnn.hidden_units", "1 unit"),
    (('din_towers { input: "din"', 'din_towers { input: "seq"'),
     "model_config.multi_tower.din_towers[0].input", "seq_att_groups"),
    (('seq_att_map { key: "C3" hist_seq: "hist_C3" }',
      'seq_att_map { key: "C3" hist_seq: "C4" }'),
     "model_config.seq_att_groups[0].seq_att_map[0].hist_seq", "SequenceFeature"),
    (('feature_names: "C2" feature_names: "C3"',
      'feature_names: "C2" feature_names: "hist_C3" feature_names: "C3"'),
     "model_config.feature_groups[0].feature_names[2]", "sequence_combiner"),
    (('seq_att_map { key: "C3" hist_seq: "hist_C3" }',
      'seq_att_map { key: "C3" hist_seq: "hist_C3" aux_hist_seq: "C4" }'),
     "model_config.seq_att_groups[0].seq_att_map[0].aux_hist_seq", "SequenceFeature"),
])
def test_din_config_errors_name_the_field(edit, field, words):
    assert_edit_refused(TEXT, edit, field, words)


def test_a_din_tower_ignores_the_settings_only_group_attention_reads(caplog):
    """EasyRec's DIN tower reads neither aux_hist_seq nor need_key_feature /
    allow_key_transform: odl warns and builds the same tower."""
    from odl.models.model_registry import build_model

    text = TEXT.replace('seq_att_map { key: "C3" hist_seq: "hist_C3" }',
                        'need_key_feature: false allow_key_transform: true '
                        'seq_att_map { key: "C3" hist_seq: "hist_C3" aux_hist_seq: "hist_C3" }')
    with caplog.at_level("WARNING"):
        config = load_config_text(text)
    warned = " ".join(r.getMessage() for r in caplog.records)
    for field in ("aux_hist_seq", "need_key_feature", "allow_key_transform"):
        assert f"{field} has no effect in a DIN tower" in warned, field
    model = build_model(config, FeatureBuilder(config))
    plain = build_model(load_config_text(TEXT), FeatureBuilder(load_config_text(TEXT)))
    assert [tuple(p.shape) for p in model.dense.parameters()] == [
        tuple(p.shape) for p in plain.dense.parameters()]


def test_easyrec_multi_tower_ignores_din_towers_and_says_so(caplog):
    """EasyRec's MultiTower does not read din_towers (MultiTowerDIN does): odl loads such a
    config, warns, and builds no DIN tower."""
    from odl.models.model_registry import build_model

    text = TEXT.replace('model_class: "MultiTowerDIN"', 'model_class: "MultiTower"')
    with caplog.at_level("WARNING"):
        config = load_config_text(text)
    assert any("din_towers has no effect" in r.getMessage() for r in caplog.records)
    model = build_model(config, FeatureBuilder(config))
    names = [type(m).__name__ for m in model.dense.modules()]
    assert "TargetAttention" not in names
    din = build_model(load_config_text(TEXT), FeatureBuilder(load_config_text(TEXT)))
    assert "TargetAttention" in [type(m).__name__ for m in din.dense.modules()]


def test_keys_and_sequences_must_be_as_wide():
    text = TEXT.replace('feature_type: SequenceFeature separator: "|" embedding_dim: 8',
                        'feature_type: SequenceFeature separator: "|" embedding_dim: 16')
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field == "model_config.seq_att_groups[0]" and "as wide" in str(e.value)


def test_torcheasyrec_sequence_feature_and_sequence_group_become_a_din_tower(tmp_path):
    """TorchEasyRec's sequence_feature {} / SEQUENCE group / multi_tower_din read as
    EasyRec's SequenceFeatures, seq_att_groups and MultiTowerDIN (its DIN encoder form)."""
    from odl.models.model_registry import build_model
    from odl.protos import pipeline_pb2

    text = """
model_dir: "MODEL"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config { batch_size: 8 label_fields: "clk" }
feature_configs { id_feature { feature_name: "cate" num_buckets: 100 embedding_dim: 8 } }
feature_configs { sequence_feature { sequence_name: "click" sequence_length: 4
  sequence_delim: ";"
  features { id_feature { feature_name: "cate" num_buckets: 100 embedding_dim: 8 } } } }
model_config {
  feature_groups { group_name: "deep" feature_names: "cate" group_type: DEEP }
  feature_groups { group_name: "seq" feature_names: ["cate", "click__cate"]
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
""".replace("MODEL", str(tmp_path / "m"))
    config = load_config_text(text)
    mc = config.model_config
    assert mc.model_class == "MultiTowerDIN" and [g.group_name for g in mc.feature_groups] == [
        "deep"]
    (att,) = mc.seq_att_groups
    assert list(att.seq_att_map[0].key) == ["cate"]
    assert list(att.seq_att_map[0].hist_seq) == ["click__cate"]
    seq = next(f for f in config.feature_configs if f.feature_name == "click__cate")
    assert (seq.feature_type, seq.separator, seq.max_seq_len) == (
        pipeline_pb2.FeatureConfig.SequenceFeature, ";", 4)
    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    din = model.dense.towers[1]
    assert type(din).__name__ == "TargetAttention" and not din.with_key and din.seq_len == 4
    built = fb.build([b'{"clk": 1, "cate": "3", "click__cate": "3;7;9"}'])
    assert not built.rejected and built.batch.dense[0, -1].item() == 3.0


def test_deepfm_embedding_regularization_averages_over_every_deep_lookup():
    """embedding_regularization is a mean over (sample, deep lookup): a combined
    SequenceFeature's positions count as lookups of the deep group."""
    import dataclasses

    import torch

    from odl.models.model_registry import build_model

    deepfm = deepfm_config_text("/tmp/odl-seq-unused", dim=8, buckets=50, hidden_units=(16,))
    field = next(line for line in TEXT.splitlines() if '"hist_C3" input_type' in line)
    feature = next(line for line in TEXT.splitlines() if 'input_names: "hist_C3"' in line)
    text = deepfm.replace(
        '  input_fields { input_name: "C26" input_type: STRING }\n',
        '  input_fields { input_name: "C26" input_type: STRING }\n' + field + "\n").replace(
        "model_config {", feature[:-1] + "sequence_combiner { attention {} } }\nmodel_config {",
        1).replace('feature_names: "I13" wide_deep: DEEP',
                   'feature_names: "I13" feature_names: "hist_C3" wide_deep: DEEP')
    config = load_config_text(text)
    fb = FeatureBuilder(config)
    model = build_model(config, fb)
    torch.manual_seed(0)
    for table in model.ebc.embedding_bags.values():
        table.weight = torch.nn.Parameter(torch.randn_like(table.weight, device="cpu"))
    batch = fb.build([_row(fb, h) for h in ("a|b|c", "", "a|b|c|d|e|f|g", "z")]).batch
    output = model(batch)
    deep, _wide = output.pooled
    regular = sum(1 for f, _t in model.pooled_layout[0].lookups if not f.startswith("hist_C3"))
    lookups = regular + 5  # hist_C3 keeps 5 positions (max_seq_len)
    assert len(model.pooled_layout[0].lookups) == lookups
    model.regularization = dataclasses.replace(model.regularization, l2=0.0, wide=0.0,
                                               embedding=0.0)
    plain = model.loss(output, batch)
    model.regularization = dataclasses.replace(model.regularization, embedding=0.5)
    term = model.loss(output, batch) - plain
    per_lookup = deep.detach().reshape(4, lookups, 8).square().sum(dim=-1)
    assert term.item() == pytest.approx(0.5 * per_lookup.mean().item(), rel=1e-5)
