"""EasyRec's MultiTaskModel (``odl/models/multi_task_backbone.py``): task towers over a
backbone; each task learns its label, serving predicts what the trainer predicts, a restart
trains every record once; the output's shapes and the tasks' settings are checked by field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.datagen.conversion_labels import conversion_labels
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text, records_for_model
from odl.models.model_registry import check_pipeline_config, registered_model_classes
from odl.train.train_module import TrainModule
from tests.harness import load_config_text
from tests.model_checks import restart_inside_a_pass, serving_replay_diff

MMOE_BLOCK = ('keras_layer { class_name: "MMoE" mmoe { num_task: 2 num_expert: 3\n'
              "        expert_mlp { hidden_units: [32, 16] use_bn: false use_final_bn: false } }"
              " } }")


def _config(edit: tuple[str, str] = ("", "")):
    text = as_model_config_text(deepfm_config_text("/tmp/unused"), "MultiTaskModel")
    assert edit[0] in text
    return load_config_text(text.replace(edit[0], edit[1], 1))


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels.astype(bool)
    return float((ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2)
                 / (pos.sum() * (~pos).sum()))


def test_multi_task_model_is_registered_by_its_module() -> None:
    entry = registered_model_classes()["MultiTaskModel"]
    assert entry.build.__module__ == "odl.models.multi_task_backbone"


def test_each_task_reads_its_mmoe_input_and_learns_its_own_label() -> None:
    """The MMoE block's two task inputs feed "ctr" and "cvr" (cvr related to ctr); after 80
    online steps both rank new records above chance, each against its own label."""
    config = _config()
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    tm = TrainModule(config, fb, device="cpu")
    dense = tm.model.dense
    assert not dense.shared and [h.relations for h in dense.heads] == [[], [0]]
    assert tm.model.output_names == ("ctr", "cvr") and tm.model.output_labels == (0, 1)
    stream = SyntheticCtrStream(seed=5)
    for _ in range(80):
        b = stream.next_batch(256)
        tm.train_step(fb.build(records_for_model("MultiTaskModel", stream, b)).batch)
    held = stream.next_batch(4000)
    scores = tm.predict(fb.build(records_for_model("MultiTaskModel", stream, held)).batch)
    assert scores.shape == (4000, 2)
    assert _auc(scores[:, 0], np.asarray(held.labels)) > 0.6
    assert _auc(scores[:, 1], conversion_labels(held, 5)) > 0.6


def test_a_tensor_output_or_a_top_mlp_feeds_every_task_the_same_input() -> None:
    shared = _config((MMOE_BLOCK, 'keras_layer { class_name: "MLP" mlp { hidden_units: [16] '
                                  "use_final_bn: false } } }"))
    fb = FeatureBuilder(shared)
    dense = TrainModule(shared, fb, device="cpu").model.dense
    assert dense.shared and all(h.dnn[0].in_features == 16 for h in dense.heads)
    top = _config(("  }\n  model_params {", "    top_mlp { hidden_units: [12] use_bn: false "
                                          "use_final_bn: false }\n  }\n  model_params {"))
    dense = TrainModule(top, FeatureBuilder(top), device="cpu").model.dense
    assert dense.shared and all(h.dnn[0].in_features == 12 for h in dense.heads)
    scripted = torch.jit.script(dense.eval())
    pooled = torch.randn(5, TrainModule(top, FeatureBuilder(top), device="cpu")
                         .model.pooled_layout[0].width)
    raw = torch.randn(5, len(FeatureBuilder(top).dense_feature_names))
    torch.testing.assert_close(scripted(pooled, raw), dense(pooled, raw))


@pytest.mark.parametrize("edit, field, words", [
    (("num_task: 2", "num_task: 3"), "model_config.backbone.concat_blocks",
     "one [B, d] tensor per"),
    (('relation_tower_names: "ctr"', 'relation_tower_names: "later"'),
     "model_config.model_params.task_towers[1].relation_tower_names[0]", "earlier task"),
    (('label_name: "buy"', 'label_name: "nope"'),
     "model_config.model_params.task_towers[1].label_name", "label_fields"),
    (('tower_name: "cvr"', 'tower_name: "ctr"'),
     "model_config.model_params.task_towers[1].tower_name", "duplicate"),
])
def test_multi_task_settings_are_refused_by_field(edit, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(edit), online=True)
    assert info.value.field.startswith(field), info.value.field
    assert words in str(info.value)


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts, both tasks (max abs diff <= 1e-6)."""
    status, diff = serving_replay_diff("MultiTaskModel", "TaskBackboneDense", tmp_path,
                                       kafka_bootstrap, kafka_topic_factory)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once,
    and serving from the first day's base + the pass deltas predicts what the restarted
    trainer predicts."""
    assert restart_inside_a_pass("MultiTaskModel", tmp_path) <= 1e-6


def test_the_mmoe_layer_mixes_its_experts_by_each_tasks_softmax_gate() -> None:
    """With expert_mlp: task t's input is sum_k softmax(G_t x)_k * expert_k(x); without it,
    the input's first items are the experts' outputs and the last the gates' input."""
    from odl.models.backbone.block_registry import BlockArgs, block_builder
    from odl.models.backbone.value_specs import tensor
    from odl.protos import pipeline_pb2

    p = pipeline_pb2.MMoELayer(num_task=2, num_expert=3, expert_mlp=pipeline_pb2.MLP(
        hidden_units=[4], final_activation="relu"))
    built = block_builder("MMoE")(BlockArgs("MMoE", p, tensor(6), "w"))
    m = built.module
    assert built.spec == [tensor(4), tensor(4)]
    x = torch.randn(5, 6)
    experts = torch.stack([torch.relu(x @ e[0].weight.T) for e in m.experts], dim=1)
    for t, out in enumerate(torch.jit.script(m)([x])):
        gate = torch.softmax(x @ m.gates[t].weight.T + m.gates[t].bias, dim=1)
        torch.testing.assert_close(out, (experts * gate.unsqueeze(2)).sum(dim=1))
    bare = block_builder("MMoE")(BlockArgs(
        "MMoE", pipeline_pb2.MMoELayer(num_task=1, num_expert=2),
        [tensor(4), tensor(4), tensor(3)], "w"))
    e1, e2, g = torch.randn(5, 4), torch.randn(5, 4), torch.randn(5, 3)
    w = torch.softmax(g @ bare.module.gates[0].weight.T + bare.module.gates[0].bias, dim=1)
    torch.testing.assert_close(bare.module([e1, e2, g])[0], w[:, :1] * e1 + w[:, 1:] * e2)
    with pytest.raises(ConfigError, match="gates' input"):
        block_builder("MMoE")(BlockArgs("MMoE", pipeline_pb2.MMoELayer(num_task=1, num_expert=2),
                                        [tensor(4), tensor(3)], "w"))


def test_a_task_reads_its_relations_through_relation_dnn_only() -> None:
    """EasyRec's MultiTaskModel: relation_tower_names without relation_dnn add nothing to
    the task's input (DBMTL's would)."""
    config = _config(("relation_dnn { hidden_units: [8] } ", ""))
    dense = TrainModule(config, FeatureBuilder(config), device="cpu").model.dense
    assert [h.relations for h in dense.heads] == [[], []]
    assert dense.heads[1].out.in_features == 8


def test_order_calibration_adds_the_named_tasks_probability_excess() -> None:
    """cvr's ORDER_CALIBRATE_LOSS (weight 2) against ctr: the loss is both tasks' cross
    entropy plus 2 * mean(relu(p_cvr - p_ctr)); alone, or in a single-task model, it is
    refused by field."""
    from odl.datagen.synthetic_ctr import SyntheticCtrStream

    config = _config(('relation_tower_names: "ctr" ', 'relation_tower_names: "ctr" '
                      "losses { loss_type: CLASSIFICATION } "
                      "losses { loss_type: ORDER_CALIBRATE_LOSS weight: 2 } "))
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    model = TrainModule(config, fb, device="cpu").model
    stream = SyntheticCtrStream(seed=3)
    batch = fb.build(records_for_model("MultiTaskModel", stream, stream.next_batch(64))).batch
    out = model(batch)
    model.l2 = model.embedding_regularization = 0.0
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    p = torch.sigmoid(out.logits)
    want = (bce(out.logits[:, 0], batch.labels[:, 0]) + bce(out.logits[:, 1], batch.labels[:, 1])
            + 2 * torch.relu(p[:, 1] - p[:, 0]).mean())
    torch.testing.assert_close(model.loss(out, batch), want)
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(_config(('relation_tower_names: "ctr" ', 'relation_tower_names: '
                                       '"ctr" losses { loss_type: ORDER_CALIBRATE_LOSS } ')),
                              online=True)
    assert info.value.field == "model_config.model_params.task_towers[1].losses[0].loss_type"
    single = as_model_config_text(deepfm_config_text("/tmp/unused"), "RankModel").replace(
        "model_params {", "losses { loss_type: CLASSIFICATION } losses { loss_type: "
        "ORDER_CALIBRATE_LOSS }\n  model_params {", 1)
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(load_config_text(single), online=True)
    assert info.value.field == "model_config.losses[1].loss_type"


def test_the_aitm_layer_attends_from_its_own_tower_over_the_detached_earlier_ones() -> None:
    from odl.models.backbone.block_registry import BlockArgs, block_builder
    from odl.models.backbone.value_specs import tensor
    from odl.protos import pipeline_pb2

    built = block_builder("AITMTower")(BlockArgs(
        "AITMTower", pipeline_pb2.AITMTower(project_dim=3), [tensor(4), tensor(5)], "w"))
    m = built.module
    assert built.spec == tensor(3)
    own = torch.randn(6, 4, requires_grad=True)
    dep = torch.randn(6, 5, requires_grad=True)

    def lin(layer, x):
        return x @ layer.weight.T + layer.bias

    items = [own, dep]
    q = lin(m.queries[0], own)
    k = torch.stack([lin(m.keys[i], x) for i, x in enumerate(items)], dim=1)
    v = torch.stack([lin(m.values[i], x) for i, x in enumerate(items)], dim=1)
    w = torch.softmax((k * q.unsqueeze(1)).sum(2) / 3 ** 0.5, dim=1)
    want = (w.unsqueeze(2) * v).sum(1)
    out = m([own, dep])[0]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.jit.script(m)([own, dep])[0], want)
    out.sum().backward()
    assert dep.grad is None and own.grad is not None
