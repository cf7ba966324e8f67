"""TorchEasyRec's MaskNet (``odl/models/masknet.py``): its math, its checks, parity and restarts."""

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

MASKNET_CONFIG = """
model_dir: "/tmp/unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "samples" group: "g" }
data_config {
  input_fields { input_name: "label" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "y" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  label_fields: "label"
}
feature_configs { feature_name: "x" input_names: "x" feature_type: RawFeature }
feature_configs { feature_name: "y" input_names: "y" feature_type: RawFeature embedding_dim: 4 }
feature_configs { input_names: "c1" hash_bucket_size: 200 embedding_dim: 4 }
feature_configs { input_names: "c2" feature_type: TagFeature separator: "|"
                  hash_bucket_size: 100 embedding_dim: 4 }
model_config {
  feature_groups { group_name: "all" feature_names: ["c1", "c2", "y", "x"] wide_deep: DEEP }
  mask_net { mask_net_module { n_mask_blocks: 2 mask_block { BLOCK hidden_dim: 6 }
             TOP PARALLEL } }
  NUM_CLASS
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } constant_learning_rate {} }
  dense_optimizer { adam_optimizer { lr: 0.001 } constant_learning_rate {} }
}
"""

RECORDS = [b"1,0.5,3,a,x|y", b"0,-1.25,0,c,z", b"1,2.0,-1,a,", b"0,0.0,7.5,e,x|x|w"]


def _config(parallel: bool = True, top: bool = True, num_class: int = 1,
            block: str = "reduction_ratio: 0.5", edit: tuple[str, str] = ("", "")):
    text = (MASKNET_CONFIG.replace("NUM_CLASS", f"num_class: {num_class}" if num_class > 1
                                   else "")
            .replace("BLOCK", block)
            .replace("TOP", "top_mlp { hidden_units: [5] }" if top else "")
            .replace("PARALLEL", "" if parallel else "use_parallel: false"))
    return parse_pipeline_config_text(text.replace(*edit) if edit[0] else text)


def _expected(tm: TrainModule, batch, parallel: bool, top: bool) -> np.ndarray:
    """The module docstring's formula in float64 numpy, the layers' weights applied by hand."""
    d = tm.model.dense
    (pooled,) = tm.model.lookup(batch)
    raw = batch.dense.numpy().astype(np.float64)
    proj = d.projection.weight.detach().numpy().astype(np.float64)
    e = np.concatenate([pooled.detach().numpy().astype(np.float64),
                        raw[:, d.projected_idx] * proj[0][None, :],  # y (one value) * row
                        raw[:, d.dense_idx]], axis=1)

    def w(layer):
        return (layer.weight.detach().numpy().astype(np.float64),
                layer.bias.detach().numpy().astype(np.float64))

    def layer_norm(x, ln):
        mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
        g, b = w(ln)
        return (x - mu) / np.sqrt(var + ln.eps) * g + b

    def block(h, blk):
        (w1, b1), (w2, b2) = w(blk.mask[0]), w(blk.mask[2])
        mask = np.maximum(e @ w1.T + b1, 0) @ w2.T + b2
        wf, bf = w(blk.ffn[0])
        return np.maximum(layer_norm((h * mask) @ wf.T + bf, blk.ffn[1]), 0)

    ln = layer_norm(e, d.ln_emb)
    if parallel:
        x = np.concatenate([block(ln, b) for b in d.blocks], axis=1)
    else:
        x = ln
        for b in d.blocks:
            x = block(x, b)
    if top:
        wt, bt = w(d.top[0])
        x = np.maximum(x @ wt.T + bt, 0)
    out = x @ d.out.weight.detach().numpy().astype(np.float64).T
    return out[:, 0] if out.shape[1] == 1 else out


@pytest.mark.parametrize("parallel, top, num_class", [
    (True, True, 1), (False, True, 1), (True, False, 3), (False, False, 1)])
def test_masknet_logits_are_the_mask_blocks_through_the_top_mlp(parallel: bool, top: bool,
                                                               num_class: int) -> None:
    config = _config(parallel, top, num_class)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(3)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    # e: 2 lookups of 4 + y projected to 4 + x: 13 wide; aggregation 0.5 of a block's input
    assert dense.ln_emb.normalized_shape == (13,)
    assert dense.blocks[0].mask[0].out_features == 6
    assert dense.blocks[-1].mask[0].out_features == (6 if parallel else 3)
    batch = fb.build(RECORDS).batch
    got = tm.model(batch).logits.detach().numpy()
    assert got.shape == ((4,) if num_class == 1 else (4, num_class))
    np.testing.assert_allclose(got, _expected(tm, batch, parallel, top), rtol=1e-4, atol=1e-5)
    deep = tm.model.lookup(batch)
    scripted = torch.jit.script(dense)  # what odl-export writes and odl-serve runs
    assert torch.equal(scripted(*deep, batch.dense), dense(*deep, batch.dense))


def test_masknet_aggregation_dim_counts_only_without_a_reduction_ratio() -> None:
    """As TorchEasyRec decides it: reduction_ratio (1.0 by default) wins when set."""
    fb_config = _config(block="aggregation_dim: 7")
    tm = TrainModule(fb_config, FeatureBuilder(fb_config), device="cpu")
    assert tm.model.dense.blocks[0].mask[0].out_features == 13  # 13 * the default 1.0
    fb_config = _config(block="reduction_ratio: 0 aggregation_dim: 7")
    tm = TrainModule(fb_config, FeatureBuilder(fb_config), device="cpu")
    assert tm.model.dense.blocks[0].mask[0].out_features == 7


@pytest.mark.parametrize("edit, field", [
    (("n_mask_blocks: 2", "n_mask_blocks: 0"), "model_config.mask_net.mask_net_module"
                                               ".n_mask_blocks"),
    (("hidden_dim: 6", ""), "model_config.mask_net.mask_net_module.mask_block.hidden_dim"),
    (("reduction_ratio: 0.5", "reduction_ratio: 0"),
     "model_config.mask_net.mask_net_module.mask_block.aggregation_dim"),
    (('wide_deep: DEEP }', 'wide_deep: DEEP }\n  feature_groups { group_name: "more" '
                           'feature_names: ["c1"] }'), "model_config.feature_groups"),
    (('feature_type: RawFeature embedding_dim: 4', 'feature_type: RawFeature '
                                                   'embedding_dim: 8'),
     "model_config.feature_groups[0].feature_names"),
])
def test_masknet_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    config = _config(edit=edit)
    if "embedding_dim: 8" in edit[1]:  # two projected features of different widths
        config.feature_configs[0].embedding_dim = 4
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(config, online=True)
    assert info.value.field == field


def test_masknet_is_registered_by_its_module() -> None:
    assert registered_model_classes()["MaskNet"].build.__module__ == "odl.models.masknet"


def test_masknet_learns_the_synthetic_stream() -> None:
    """Trained online on the Criteo-like stream (80 steps of 256), MaskNet ranks the next
    records above chance."""
    assert stream_auc("MaskNet", 80) > 0.6


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts (max abs diff <= 1e-6)."""
    status, diff = serving_replay_diff("MaskNet", "MaskNetDense", tmp_path, kafka_bootstrap,
                                       kafka_topic_factory)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once
    (the sample ledger), and serving from the first day's base + the pass deltas predicts
    what the restarted trainer predicts."""
    assert restart_inside_a_pass("MaskNet", tmp_path) <= 1e-6
