"""TorchEasyRec's WuKong (``odl/models/wukong.py``): its math, its checks, parity and restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config, registered_model_classes
from odl.train.train_module import TrainModule
from tests.model_checks import restart_inside_a_pass, serving_replay_diff, stream_auc

WUKONG_CONFIG = """
model_dir: "/tmp/unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "samples" group: "g" }
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "y" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  input_fields { input_name: "c3" }
  label_fields: "label"
}
feature_configs { input_names: "x" feature_type: RawFeature }
feature_configs { input_names: "y" feature_type: RawFeature }
feature_configs { input_names: "c1" hash_bucket_size: 200 embedding_dim: 4 }
feature_configs { input_names: "c2" hash_bucket_size: 200 embedding_dim: 4 }
feature_configs { input_names: "c3" feature_type: TagFeature separator: "|"
                  hash_bucket_size: 100 embedding_dim: 4 }
model_config {
  feature_groups { group_name: "dense" feature_names: ["x", "y"] wide_deep: DEEP }
  feature_groups { group_name: "sparse" feature_names: ["c1", "c2", "c3"] wide_deep: DEEP }
  wukong {
    dense_mlp { hidden_units: [6, 4] }
    wukong_layers { lcb_feature_num: 3 fmb_feature_num: 2 compressed_feature_num: 3
                    feature_num_mlp { hidden_units: [5] } }
    wukong_layers { lcb_feature_num: 3 fmb_feature_num: 2 compressed_feature_num: 2
                    feature_num_mlp { hidden_units: [5] } }
    final { hidden_units: [7] }
  }
  NUM_CLASS
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } constant_learning_rate {} }
  dense_optimizer { adam_optimizer { lr: 0.001 } constant_learning_rate {} }
}
"""

RECORDS = [b"1,0.5,3,a,b,x|y", b"0,-1.25,0,c,b,z", b"1,2.0,-1,a,d,", b"0,0.0,7.5,e,f,x|x|w"]


def _config(num_class: int = 1, edit: tuple[str, str] = ("", "")):
    text = WUKONG_CONFIG.replace("NUM_CLASS", f"num_class: {num_class}" if num_class > 1
                                 else "")
    return parse_pipeline_config_text(text.replace(*edit) if edit[0] else text)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float64)


def _mlp(x: np.ndarray, seq: torch.nn.Module) -> np.ndarray:
    for layer in seq:
        if isinstance(layer, torch.nn.Linear):
            x = x @ _np(layer.weight).T + _np(layer.bias)
        else:
            x = np.maximum(x, 0.0)
    return x


def _layer_norm(x: np.ndarray, ln: torch.nn.LayerNorm) -> np.ndarray:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + ln.eps) * _np(ln.weight) + _np(ln.bias)


def _expected(tm: TrainModule, batch) -> np.ndarray:
    """The module docstring's formula in float64 numpy, TorchEasyRec's layer written out."""
    d = tm.model.dense
    sparse, _dense_emb = tm.model.lookup(batch)
    b = sparse.shape[0]
    x = _np(sparse).reshape(b, 3, 4)
    first = _mlp(_np(batch.dense)[:, d.dense_idx], d.dense_mlp)
    x = np.concatenate([first[:, None, :], x], axis=1)                 # [B, 4, D]
    for layer in d.layers:
        k = x.shape[1]
        lcb = np.einsum("bkd,ko->bod", x, _np(layer.lcb.weight))
        fm = layer.fmb
        inner = np.einsum("bkd,kc->bdc", x, _np(fm.weight))            # X^T W
        pairs = np.einsum("bkd,bdc->bkc", x, inner).reshape(b, k * fm.compressed)
        f = _mlp(_layer_norm(pairs, fm.norm), fm.mlp) @ _np(fm.out.weight).T + _np(fm.out.bias)
        f = f.reshape(b, fm.vectors_out, fm.dim)
        res = (x if isinstance(layer.residual, torch.nn.Identity)
               else np.einsum("bkd,ko->bod", x, _np(layer.residual.weight)))
        x = _layer_norm(np.concatenate([f, lcb], axis=1) + res, layer.norm)
    out = _mlp(x.reshape(b, -1), d.final) @ _np(d.out.weight).T + _np(d.out.bias)
    return out[:, 0] if out.shape[1] == 1 else out


@pytest.mark.parametrize("num_class", [1, 3])
def test_wukong_logits_are_its_layers_through_the_final_mlp(num_class: int) -> None:
    config = _config(num_class)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(3)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    # 1 + 3 vectors in: the first layer projects its residual, the second's is the identity
    assert not isinstance(dense.layers[0].residual, torch.nn.Identity)
    assert isinstance(dense.layers[1].residual, torch.nn.Identity)
    assert dense.final[0].in_features == 5 * 4
    batch = fb.build(RECORDS).batch
    got = tm.model(batch).logits.detach().numpy()
    assert got.shape == ((4,) if num_class == 1 else (4, num_class))
    np.testing.assert_allclose(got, _expected(tm, batch), rtol=1e-4, atol=1e-5)
    deep = tm.model.lookup(batch)
    scripted = torch.jit.script(dense)  # what odl-export writes and odl-serve runs
    assert torch.equal(scripted(*deep, batch.dense), dense(*deep, batch.dense))


def test_one_group_is_the_sparse_group_without_a_dense_mlp() -> None:
    config = _config(edit=('  feature_groups { group_name: "dense" feature_names: ["x", "y"] '
                           'wide_deep: DEEP }\n', ""))
    check_pipeline_config(config, online=True)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    assert tm.model.dense.dense_mlp is None
    assert tm.model.dense.layers[0].lcb.weight.shape[0] == 3


@pytest.mark.parametrize("edit, field", [
    (("dense_mlp { hidden_units: [6, 4] }", "dense_mlp { hidden_units: [6, 8] }"),
     "model_config.wukong.dense_mlp.hidden_units"),
    (("lcb_feature_num: 3 fmb_feature_num: 2 compressed_feature_num: 3",
      "lcb_feature_num: 0 fmb_feature_num: 2 compressed_feature_num: 3"),
     "model_config.wukong.wukong_layers[0].lcb_feature_num"),
    (("final { hidden_units: [7] }", ""), "model_config.wukong.final.hidden_units"),
    (('"c2" hash_bucket_size: 200 embedding_dim: 4', '"c2" hash_bucket_size: 200 '
      "embedding_dim: 8"), "model_config.feature_groups[1].feature_names"),
    (('feature_names: ["c1", "c2", "c3"]', 'feature_names: ["c1", "x"]'),
     "model_config.feature_groups[1].feature_names[1]"),
    (('group_name: "sparse"', 'group_name: "ids"'), "model_config.feature_groups"),
])
def test_wukong_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(edit=edit), online=True)
    assert info.value.field == field


def test_wukong_is_registered_by_its_module() -> None:
    assert registered_model_classes()["WuKong"].build.__module__ == "odl.models.wukong"


def test_wukong_learns_the_synthetic_stream() -> None:
    """Trained online on the Criteo-like stream (80 steps of 256), WuKong ranks the next
    records above chance."""
    assert stream_auc("WuKong", 80) > 0.6


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts (max abs diff <= 1e-6)."""
    status, diff = serving_replay_diff("WuKong", "WuKongDense", tmp_path, kafka_bootstrap,
                                       kafka_topic_factory)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once
    (the sample ledger), and serving from the first day's base + the pass deltas predicts
    what the restarted trainer predicts."""
    assert restart_inside_a_pass("WuKong", tmp_path) <= 1e-6
