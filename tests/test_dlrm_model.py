"""EasyRec's DLRM (``odl/models/dlrm.py``): its math, its checks, parity and restarts."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import (
    build_model,
    check_pipeline_config,
    model_class_of,
    registered_model_classes,
)
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import as_model
from tests.model_checks import stream_auc
from tests.test_file_stream import _parity, _saves_config, _serve_from, _write_two_days
from tests.test_online_parity import (
    _check_serving_parity,
    _incr_save,
    _train_with_publishing,
)

DLRM_CONFIG = """
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
feature_config {
  features { input_names: "x" feature_type: RawFeature }
  features { input_names: "y" feature_type: RawFeature }
  features { input_names: "c1" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c2" hash_bucket_size: 200 embedding_dim: 8 }
  features { input_names: "c3" feature_type: TagFeature separator: "|"
             hash_bucket_size: 100 embedding_dim: 8 }
}
model_config {
  model_class: "DLRM"
  feature_groups { group_name: "dense" feature_names: ["x", "y"] wide_deep: DEEP }
  feature_groups { group_name: "sparse" feature_names: ["c1", "c2", "c3"] wide_deep: DEEP }
  dlrm { bot_dnn { hidden_units: [16, 8] } top_dnn { hidden_units: [16] } ARCH }
  NUM_CLASS
}
train_config {
  optimizer_config { adagrad_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.05 } } } }
  optimizer_config { adam_optimizer { learning_rate { constant_learning_rate {
    learning_rate: 0.001 } } } }
}
"""

RECORDS = [b"1,0.5,3,a,b,x|y", b"0,-1.25,0,c,b,z", b"1,2.0,-1,a,d,", b"0,0.0,7.5,e,f,x|x|w"]


def _config(num_class: int = 1, arch: str = "", edit: tuple[str, str] = ("", "")):
    text = DLRM_CONFIG.replace("NUM_CLASS", f"num_class: {num_class}" if num_class > 1 else "")
    text = text.replace("ARCH", arch)
    return parse_pipeline_config_text(text.replace(*edit) if edit[0] else text)


def _expected(tm: TrainModule, batch, op: str, itself: bool, with_dense: bool,
              with_sparse: bool = True) -> np.ndarray:
    """The module docstring's formula, in float64 numpy (the towers' layers applied by hand)."""
    dense = tm.model.dense
    sparse, _dense_emb = tm.model.lookup(batch)
    v = sparse.detach().numpy().astype(np.float64)

    def mlp(x: np.ndarray, seq: torch.nn.Sequential) -> np.ndarray:
        for layer in seq:
            if isinstance(layer, torch.nn.Linear):
                x = x @ layer.weight.detach().numpy().T + layer.bias.detach().numpy()
            else:
                x = np.maximum(x, 0.0)
        return x

    d = mlp(batch.dense.numpy().astype(np.float64), dense.bottom)
    if op == "cat":
        x = np.concatenate([d, v], axis=1)
    else:
        vecs = [d] + [v[:, 8 * i: 8 * i + 8] for i in range(3)]
        pairs = [np.einsum("bd,bd->b", vecs[i], vecs[j])
                 for i in range(len(vecs)) for j in range(i if itself else i + 1, len(vecs))]
        parts = [np.stack(pairs, axis=1)] + ([v] if with_sparse else []) + (
            [d] if with_dense else [])
        x = np.concatenate(parts, axis=1)
    out = mlp(x, dense.top) @ dense.out.weight.detach().numpy().T + dense.out.bias.detach().numpy()
    return out[:, 0] if out.shape[1] == 1 else out


@pytest.mark.parametrize("arch, num_class", [
    ("", 1),
    ('arch_interaction_itself: true arch_with_dense_feature: true', 1),
    ('arch_interaction_op: "cat"', 1),
    ("", 3),
])
def test_dlrm_logits_are_the_interaction_through_the_top_tower(arch: str, num_class: int) -> None:
    """logit = Linear(top_dnn(concat(dot products of [bot_dnn(dense), v_i], v_i[, d])))."""
    config = _config(num_class, arch)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(3)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(RECORDS).batch
    op = "cat" if "cat" in arch else "dot"
    itself, with_dense = "itself: true" in arch, "dense_feature: true" in arch
    pairs = {"dot": 6 + (4 if itself else 0), "cat": 0}[op]
    assert tm.model.dense.top[0].in_features == pairs + 24 + (8 if with_dense or op == "cat"
                                                                 else 0)
    expected = _expected(tm, batch, op, itself, with_dense)
    got = tm.model(batch).logits.detach().numpy()
    assert got.shape == ((4,) if num_class == 1 else (4, num_class))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    deep = tm.model.lookup(batch)
    scripted = torch.jit.script(tm.model.dense)  # what odl-export writes and odl-serve runs
    assert torch.equal(scripted(*deep, batch.dense), tm.model.dense(*deep, batch.dense))


def test_dlrm_loss_adds_l2_on_kernels_and_the_embedding_term() -> None:
    config = _config(arch="l2_regularization: 0.5")
    config.model_config.embedding_regularization = 0.25
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    batch = fb.build(RECORDS).batch
    out = tm.model(batch)
    kernels = sum(float(m.weight.square().sum()) for m in tm.model.dense.modules()
                  if isinstance(m, torch.nn.Linear))
    sparse = out.pooled[0].detach().numpy()
    emb = float((sparse ** 2).sum()) / (4 * 3)
    p = 1 / (1 + np.exp(-out.logits.detach().numpy().astype(np.float64)))
    y = np.array([1, 0, 1, 0], dtype=np.float64)
    bce = float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
    got = float(tm.model.loss(out, batch))
    assert got == pytest.approx(bce + 0.5 * kernels + 0.25 * emb, rel=1e-5)


def test_dlrm_learns_the_synthetic_stream() -> None:
    """Trained online on the Criteo-like stream (100 steps of 256), DLRM ranks the next
    records well above chance."""
    auc = stream_auc("DLRM", 100)
    assert auc > 0.6, auc


@pytest.mark.parametrize("edit, field", [
    (('group_name: "sparse"', 'group_name: "ids"'), "model_config.feature_groups"),
    (('group_name: "dense"', 'group_name: "values"'), "model_config.feature_groups"),
    (("top_dnn { hidden_units: [16] }", ""), "model_config.dlrm.top_dnn.hidden_units"),
    (("bot_dnn { hidden_units: [16, 8] }", ""), "model_config.dlrm.bot_dnn.hidden_units"),
    (("bot_dnn { hidden_units: [16, 8] }", "bot_dnn { hidden_units: [16, 4] }"),
     "model_config.dlrm.bot_dnn.hidden_units"),
    (("ARCH", 'arch_interaction_op: "sum"'), "model_config.dlrm.arch_interaction_op"),
    (("ARCH", "l2_regularization: -1"), "model_config.dlrm.l2_regularization"),
    (("ARCH", "dense_mlp { hidden_units: [8] }"), "model_config.dlrm.dense_mlp"),
    (('"c2" hash_bucket_size: 200 embedding_dim: 8', '"c2" hash_bucket_size: 200 '
      "embedding_dim: 4"), "model_config.feature_groups[1].feature_names"),
    (('feature_names: ["c1", "c2", "c3"]', 'feature_names: ["c1", "x"]'),
     "model_config.feature_groups[1].feature_names[1]"),
    (('features { input_names: "x" feature_type: RawFeature }',
      'features { input_names: "x" feature_type: RawFeature embedding_dim: 8 }'),
     "model_config.feature_groups[0].feature_names[0]"),
])
def test_dlrm_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    text = DLRM_CONFIG.replace("NUM_CLASS", "").replace(*edit).replace("ARCH", "")
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(text), online=True)
    assert info.value.field == field
    if "hidden_units: [16, 4]" in edit[1]:  # the message names both sizes
        assert "(4)" in str(info.value) and "embedding_dim (8)" in str(info.value)


def test_cat_takes_embeddings_of_different_sizes() -> None:
    config = _config(arch='arch_interaction_op: "cat"', edit=(
        '"c2" hash_bucket_size: 200 embedding_dim: 8', '"c2" hash_bucket_size: 200 '
        "embedding_dim: 4"))
    check_pipeline_config(config, online=True)
    model = build_model(config, FeatureBuilder(config))
    assert model.dense.top[0].in_features == 8 + 8 + 4 + 8
    assert model.pooled_layout[0].dims == (8, 4, 8)


def test_embedded_features_of_the_dense_group_join_the_bottom_tower() -> None:
    """EasyRec concatenates a group's features: c1's vector joins x and y into bot_dnn."""
    config = _config(edit=('feature_names: ["x", "y"]', 'feature_names: ["x", "y", "c1"]'))
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    assert tm.model.pooled_layout[1].lookups == (("c1", "c1"),)
    assert tm.model.dense.bottom[0].in_features == 2 + 8
    batch = fb.build(RECORDS).batch
    sparse, dense_emb = tm.model.lookup(batch)
    np.testing.assert_array_equal(dense_emb.detach().numpy(), sparse[:, :8].detach().numpy())
    bottom = tm.model.dense.bottom[0]
    with torch.no_grad():  # only c1's columns of the first layer: d depends on c1 alone
        bottom.weight[:, :2] = 0.0
    d = tm.model.dense.bottom(torch.cat([batch.dense, dense_emb], dim=1)).detach().numpy()
    c1 = sparse[:, :8].detach().numpy()
    again = np.maximum(np.maximum(c1 @ bottom.weight[:, 2:].detach().numpy().T
                                  + bottom.bias.detach().numpy(), 0)
                       @ tm.model.dense.bottom[2].weight.detach().numpy().T
                       + tm.model.dense.bottom[2].bias.detach().numpy(), 0)
    np.testing.assert_allclose(d, again, rtol=1e-5, atol=1e-6)
    assert tm.model(batch).logits.shape == (4,)


def test_torcheasyrec_spelling_is_the_same_model() -> None:
    """TorchEasyRec's ``dlrm { dense_mlp final }`` (no model_class): d always joins the top
    tower, no L2 term; with one feature group, that group is the sparse group."""
    tz = ('model_class: "DLRM"', ""), ("bot_dnn", "dense_mlp"), ("top_dnn", "final")
    text = DLRM_CONFIG.replace("NUM_CLASS", "").replace("ARCH", "")
    for edit in tz:
        text = text.replace(*edit)
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    assert model_class_of(config.model_config).name == "DLRM"
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    assert tm.model.arch.l2 == 0.0 and tm.model.dense.with_dense
    assert tm.model.dense.top[0].in_features == 6 + 24 + 8
    batch = fb.build(RECORDS).batch
    np.testing.assert_allclose(tm.model(batch).logits.detach().numpy(),
                               _expected(tm, batch, "dot", False, True), rtol=1e-5, atol=1e-6)
    one_group = text.replace(
        'feature_groups { group_name: "dense" feature_names: ["x", "y"] wide_deep: DEEP }', ""
    ).replace('group_name: "sparse"', 'group_name: "all"')
    config = parse_pipeline_config_text(one_group)
    check_pipeline_config(config, online=True)
    dense = build_model(config, FeatureBuilder(config)).dense
    assert dense.bottom is None and dense.top[0].in_features == 3 + 24


def test_dlrm_is_registered_by_its_module() -> None:
    assert registered_model_classes()["DLRM"].build.__module__ == "odl.models.dlrm"


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts (max abs diff <= 1e-6)."""
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), model="DLRM")
    dense = trainer.module.model.dense
    assert type(dense).__name__ == "DLRMDense" and dense.num_sparse == 26
    assert dense.bottom[0].in_features == 13
    assert trainer.publisher.status()["last_version"] == trainer.module.global_step
    status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once
    (the sample ledger), and serving from the first day's base + the pass deltas predicts
    what the restarted trainer predicts."""
    from odl.export.exporter import export_checkpoint

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data, model="DLRM")
    ledger = str(tmp_path / "ledger.tsv")
    runs = []
    for extra in ("num_steps: 22", ""):
        text = as_model(_saves_config(tmp_path, str(data), str(saves), extra,
                                      dynamic='model_class: "DeepFM"\n  '
                                              "ev_params { max_capacity: 4000 }"), "DLRM")
        trainer = Trainer(parse_pipeline_config_text(text),
                          TrainerOptions(online=True, device="cpu", status_port=-1,
                                         sample_ledger=ledger, export_base=export_checkpoint))
        assert trainer.run() == 0
        runs.append(trainer)
    assert runs[0].module.global_step == 22
    assert type(runs[1].module.model.dense).__name__ == "DLRMDense"
    trained = [sid for _g, _s, sid in read_ledger(ledger)]
    assert sorted(trained) == sorted(ids) and len(set(trained)) == len(trained)
    service = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert service.model.state.version == runs[1].module.global_step
    assert _parity(service, runs[1], 34, values[-170:]) <= 1e-6
