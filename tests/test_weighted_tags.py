"""Weighted tags (EasyRec's TagFeature with a weights input or ``kv_separator``): each tag's
embedding weighs its weight, in training and in serving."""

from __future__ import annotations

import os

import numpy as np
import pytest

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.features.id_hashing import bucketize_hashes, hash_segments
from odl.train.train_module import TrainModule
from serving_plugin.serving_model import ServingModel
from tests.harness import assert_edit_refused, load_config_text

TEXT = """
model_dir: "MODEL"
kafka_train_input { server: "127.0.0.1:9092" topic: "t" group: "g" }
data_config {
  batch_size: 16
  input_fields { input_name: "clk" input_type: INT32 }
  input_fields { input_name: "user" input_type: STRING }
  input_fields { input_name: "tags" input_type: STRING }
  input_fields { input_name: "tag_w" input_type: STRING }
  input_fields { input_name: "kv" input_type: STRING }
  label_fields: "clk"
}
feature_config {
  features { input_names: "user" hash_bucket_size: 40 embedding_dim: 8 combiner: "mean" }
  features { input_names: "tags" input_names: "tag_w" feature_type: TagFeature
             hash_bucket_size: 40 embedding_dim: 8 combiner: "sum" }
  features { input_names: "kv" feature_type: TagFeature kv_separator: ":"
             hash_bucket_size: 40 embedding_dim: 8 combiner: "mean" }
}
model_config {
  model_class: "DeepFM"
  feature_groups { group_name: "deep" feature_names: ["user", "tags", "kv"] wide_deep: DEEP }
  feature_groups { group_name: "wide" feature_names: ["user", "tags", "kv"] wide_deep: WIDE }
  deepfm { dnn { hidden_units: [8] } }
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.1 } } } }
}
"""


def _row(rng: np.random.Generator) -> bytes:
    tags = [f"t{rng.integers(20)}" for _ in range(int(rng.integers(1, 4)))]
    weights = [f"{rng.uniform(0.1, 3):.3f}" for _ in tags]
    kv = "|".join(f"k{rng.integers(20)}:{rng.uniform(0.1, 3):.3f}"
                  for _ in range(int(rng.integers(1, 4))))
    clk = int(rng.random() < 0.3)
    return f"{clk},u{rng.integers(30)},{'|'.join(tags)},{'|'.join(weights)},{kv}".encode()


def _bucket(token: str, rows: int = 40) -> int:
    buf = np.frombuffer(token.encode(), dtype=np.uint8)
    return int(bucketize_hashes(hash_segments(buf, np.array([0]), np.array([len(buf)])),
                                rows)[0])


def test_weights_reach_the_batch_and_every_table_sums_them(tmp_path) -> None:
    config = load_config_text(TEXT.replace("MODEL", str(tmp_path / "m")))
    fb = FeatureBuilder(config)
    assert fb.weighted and {t.pooling for t in fb.table_specs} == {"sum"}
    built = fb.build([b"1,u1,a|b,2|0.5,x:1|y:3",
                      b'{"clk": 0, "user": "u2", "tags": ["c"], "tag_w": [4], "kv": "z:2"}',
                      b"0,u3,a|b,2,x:1",        # two tags, one weight
                      b"0,u4,a,2,x:1|y",         # a kv piece without its weight
                      b"0,u5,a,zz,x:1"])         # a weight that is not a number
    assert built.rejected == [(2, "bad_number"), (3, "bad_number"), (4, "bad_number")]
    kjt = built.batch.sparse
    w = kjt.to_dict()
    assert w["user"].weights().tolist() == [1.0, 1.0]  # mean of one value: 1
    assert w["tags"].weights().tolist() == [2.0, 0.5, 4.0]  # sum: the weights themselves
    assert w["tags"].values().tolist() == [_bucket("a"), _bucket("b"), _bucket("c")]
    assert w["kv"].values().tolist() == [_bucket("x"), _bucket("y"), _bucket("z")]
    assert w["kv"].weights().tolist() == pytest.approx([0.25, 0.75, 1.0])  # mean: w / sum


def test_weighted_tags_train_and_serve_to_parity(tmp_path) -> None:
    config = load_config_text(TEXT.replace("MODEL", str(tmp_path / "m")))
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    rng = np.random.default_rng(3)
    for _ in range(6):
        module.train_step(fb.build([_row(rng) for _ in range(64)]).batch)
    path = CheckpointManager(config.model_dir).save(
        module.global_step, module.state_dict_for_checkpoint(), {0: 1},
        {"source": "kafka", "topic": "t"}, config_to_text(config), generation="g")
    export = export_checkpoint(config, path, str(tmp_path / "exports"),
                               warn_without_topic=False).path
    values = [_row(rng) for _ in range(300)]
    want = module.predict(fb.build(values).batch)
    got, rejected = ServingModel.load(os.path.dirname(export)).predict_values(values)
    # serving pools sum_i w_i * e_i itself (F.embedding_bag with per-sample weights): the
    # trainer's fbgemm lookups weigh the tags the same way
    assert rejected == [] and np.abs(got - want).max() <= 1e-6
    # the weights matter: the same tags with other weights predict otherwise
    a = fb.build([b"1,u1,t1|t2,0.1|3,k1:1"]).batch
    b = fb.build([b"1,u1,t1|t2,3|0.1,k1:1"]).batch
    assert module.predict(a)[0] != module.predict(b)[0]


@pytest.mark.parametrize("edit, field, words", [
    (('input_name: "tag_w" input_type: STRING', 'input_name: "tag_w" input_type: DOUBLE'),
     "feature_config.features[1].input_names[1]", "STRING field"),
    (('feature_type: TagFeature kv_separator: ":"',
      'feature_type: RawFeature kv_separator: ":"'),
     "feature_config.features[2].kv_separator", "TagFeature"),
    (('input_names: "tags" input_names: "tag_w" feature_type: TagFeature',
      'input_names: "tags" input_names: "tag_w" feature_type: TagFeature kv_separator: ":"'),
     "feature_config.features[1].kv_separator", "not both"),
])
def test_weighted_tag_errors_name_the_field(tmp_path, edit, field, words) -> None:
    assert_edit_refused(TEXT.replace("MODEL", str(tmp_path / "m")), edit, field, words)


def test_torcheasyrec_weighted_id_feature_reads_what_kv_tags_read(tmp_path) -> None:
    """TorchEasyRec's ``id_feature { weighted: true }`` reads ``id:weight`` values with their
    weights, as the flat TagFeature with ``kv_separator: ":"`` does."""
    tz = TEXT.replace(
        'features { input_names: "kv" feature_type: TagFeature kv_separator: ":"\n'
        '             hash_bucket_size: 40 embedding_dim: 8 combiner: "mean" }',
        'features { id_feature { feature_name: "kv" expression: "item:kv" weighted: true\n'
        '             hash_bucket_size: 40 embedding_dim: 8 pooling: "mean" } }')
    assert tz != TEXT
    rng = np.random.default_rng(5)
    records = [_row(rng) for _ in range(16)]
    batches = [FeatureBuilder(load_config_text(text.replace("MODEL", str(tmp_path)))).build(
        records).batch for text in (TEXT, tz)]
    flat, weighted = (b.sparse.to_dict()["kv"] for b in batches)
    assert np.array_equal(flat.values().numpy(), weighted.values().numpy())
    assert np.array_equal(flat.lengths().numpy(), weighted.lengths().numpy())
    assert np.allclose(flat.weights().numpy(), weighted.weights().numpy())
    assert not np.allclose(weighted.weights().numpy(), weighted.weights().numpy()[0])
