"""MMoE and DBMTL: the blocks' math, per-task labels and losses, and their config forms."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.datagen.conversion_labels import conversion_labels, encode_with_conversions
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.models.model_registry import build_model
from tests.harness import load_config_text


def _text(model: str) -> str:
    return as_model_config_text(deepfm_config_text("/tmp/odl-mt-unused", dim=8, buckets=50,
                                                   hidden_units=(16,)), model)


def _model_and_batch(model: str, n: int = 64, text: str | None = None):
    """The model (CPU tables) of ``text`` (default: the model's test config) and a batch."""
    config = load_config_text(_text(model) if text is None else text)
    fb = FeatureBuilder(config)
    m = build_model(config, fb)
    m.ebc = m.ebc.__class__(tables=m.layout.configs, device=torch.device("cpu"))
    sample = SyntheticCtrStream(seed=5, start_time=1.7e9).next_batch(n)
    batch = fb.build(encode_with_conversions(sample, 5)).batch
    return m, batch, sample


def test_labels_are_one_column_per_label_field_and_tasks_train_on_their_own():
    m, batch, sample = _model_and_batch("MMoE")
    assert batch.labels.shape == (64, 2)
    assert np.array_equal(batch.labels[:, 0].numpy(), sample.labels)
    assert np.array_equal(batch.labels[:, 1].numpy(), conversion_labels(sample, 5))
    assert m.output_names == ("ctr", "cvr") and m.output_labels == (0, 1)
    out = m(batch)
    assert out.logits.shape == (64, 2)
    m.l2 = m.embedding_regularization = 0.0
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    want = bce(out.logits[:, 0], batch.labels[:, 0]) + bce(out.logits[:, 1], batch.labels[:, 1])
    assert torch.allclose(m.loss(out, batch), want, atol=1e-6)
    # a task of weight 0 sends no gradient into its own tower
    m.task_loss.weights = [1.0, 0.0]
    m.zero_grad()
    m.loss(m(batch), batch).backward()
    assert float(m.dense.heads[1].out.weight.grad.abs().sum()) == 0.0
    assert float(m.dense.heads[0].out.weight.grad.abs().sum()) > 0.0


def test_a_two_class_task_has_two_logits_and_predicts_its_class_one_probability():
    """A task tower's num_class: 2 (EasyRec's and TorchEasyRec's, as for JRC_LOSS): its two
    logits train by softmax cross entropy over the 0/1 label one-hot, and its output is
    softmax(pair)[1]; the other task keeps one logit."""
    from odl.config.loss_settings import task_classes
    from odl.models.ctr_model import predictions

    text = _text("DBMTL").replace('tower_name: "cvr"', 'tower_name: "cvr" num_class: 2')
    assert text != _text("DBMTL")
    m, batch, _ = _model_and_batch("DBMTL", text=text)
    assert task_classes(load_config_text(text)) == (1, 2)
    out = m(batch)
    assert out.logits.shape == (64, 3) and m.output_names == ("ctr", "cvr")
    m.l2 = m.embedding_regularization = 0.0
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    y = batch.labels[:, 1]
    ce = -(torch.stack([1 - y, y], 1) * torch.log_softmax(out.logits[:, 1:3], 1)).sum(1).mean()
    want = bce(out.logits[:, 0], batch.labels[:, 0]) + ce
    assert torch.allclose(m.loss(out, batch), want, atol=1e-6)
    probs = predictions(out.logits.detach(), [False, False], False, (1, 2))
    assert probs.shape == (64, 2)
    assert np.allclose(probs[:, 0], torch.sigmoid(out.logits[:, 0]).detach().numpy())
    assert np.allclose(probs[:, 1], torch.softmax(out.logits[:, 1:3], 1)[:, 1].detach().numpy())
    assert torch.allclose(torch.jit.script(m.dense)(*_dense_inputs(m, batch)), out.logits)


def _dense_inputs(m, batch):
    """The scripted dense part's inputs of a batch (the pooled group, the dense columns)."""
    out = m(batch)
    return out.pooled[0], batch.dense


def test_a_task_num_class_above_two_or_with_a_pointwise_loss_is_refused():
    base = _text("DBMTL")
    for edit, field in [('tower_name: "cvr" num_class: 3', "task_towers[1].num_class"),
                        ('tower_name: "cvr" num_class: 2 loss_type: L2_LOSS',
                         "task_towers[1].loss_type"),
                        ('tower_name: "cvr" num_class: 2 task_space_indicator_label: "label"',
                         "task_towers[1].task_space_indicator_label")]:
        with pytest.raises(ConfigError) as e:
            load_config_text(base.replace('tower_name: "cvr"', edit))
        assert e.value.field.endswith(field), e.value.field


def test_dbmtl_relations_feed_later_tasks_only():
    m, batch, _ = _model_and_batch("DBMTL")
    with torch.no_grad():
        before = m(batch).logits.clone()
        m.dense.heads[0].relation_dnn[0].bias.add_(1.0)  # ctr's relation output changes
        after_ctr = m(batch).logits.clone()
        m.dense.heads[1].relation_dnn[0].bias.add_(1.0)  # cvr's relation output changes
        after_cvr = m(batch).logits
    assert not torch.allclose(before[:, 0], after_ctr[:, 0])
    assert not torch.allclose(before[:, 1], after_ctr[:, 1])  # cvr reads ctr's relation output
    assert torch.equal(after_ctr[:, 0], after_cvr[:, 0])  # ctr does not read cvr


@pytest.mark.parametrize("edit, field", [
    (('relation_tower_names: "ctr"', 'relation_tower_names: "cvr"'),
     "model_config.dbmtl.task_towers[1].relation_tower_names[0]"),
    (('label_name: "buy"', 'label_name: "pay"'), "model_config.dbmtl.task_towers[1].label_name"),
    (('  label_fields: "buy"\n', '  label_fields: "buy"\n  label_fields: "event_time"\n'),
     "data_config.label_fields"),
    (('tower_name: "cvr"', 'tower_name: "ctr"'), "model_config.dbmtl.task_towers[1].tower_name"),
])
def test_multi_task_config_errors_name_the_field(edit, field):
    with pytest.raises(ConfigError) as e:
        load_config_text(_text("DBMTL").replace(*edit))
    assert e.value.field == field, e.value


def test_several_labels_need_a_multi_task_model():
    text = _text("DeepFM").replace('  label_fields: "label"\n',
                                   '  label_fields: "label"\n  label_fields: "event_time"\n')
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field == "data_config.label_fields" and "multi-task" in str(e.value)


def test_torcheasyrec_form_builds_the_same_model():
    easyrec = _text("DBMTL")
    tz = (easyrec.replace('model_class: "DBMTL"\n', "")
          .replace("bottom_dnn {", "bottom_mlp {")
          .replace("relation_dnn {", "relation_mlp {")
          .replace('label_name: "buy" dnn {', 'label_name: "buy" mlp {')
          .replace('label_name: "label" dnn {', 'label_name: "label" metrics { auc {} } '
                   "losses { binary_cross_entropy {} } mlp {"))
    assert "bottom_mlp" in tz and "relation_mlp" in tz and " mlp {" in tz
    shapes = []
    for text in (easyrec, tz):
        config = load_config_text(text)
        model = build_model(config, FeatureBuilder(config))
        shapes.append([(n, tuple(p.shape)) for n, p in model.dense.named_parameters()])
    assert shapes[0] == shapes[1]


def test_task_space_weights_the_loss_by_the_indicator_label():
    text = _text("MMoE").replace(
        'tower_name: "cvr" label_name: "buy"',
        'tower_name: "cvr" label_name: "buy" task_space_indicator_label: "label" '
        "in_task_space_weight: 1.0 out_task_space_weight: 0.0")
    m, batch, _ = _model_and_batch("MMoE", text=text)
    m.l2 = m.embedding_regularization = 0.0
    out = m(batch)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    clicked = batch.labels[:, 0] > 0
    assert 0 < int(clicked.sum()) < 64
    # cvr is trained on the clicked samples only (the conversion space)
    want = (bce(out.logits[:, 0], batch.labels[:, 0])
            + bce(out.logits[clicked, 1], batch.labels[clicked, 1]))
    assert torch.allclose(m.loss(out, batch), want, atol=1e-6)


def test_task_space_needs_a_label_field_and_a_pointwise_loss():
    base = _text("MMoE")
    with pytest.raises(ConfigError) as e:
        load_config_text(base.replace('tower_name: "cvr" label_name: "buy"',
                                      'tower_name: "cvr" label_name: "buy" '
                                      'task_space_indicator_label: "clicks"'))
    assert e.value.field == "model_config.mmoe.task_towers[1].task_space_indicator_label"
    with pytest.raises(ConfigError) as e:
        load_config_text(base.replace('tower_name: "cvr" label_name: "buy"',
                                      'tower_name: "cvr" label_name: "buy" '
                                      'task_space_indicator_label: "label" '
                                      'loss_type: PAIR_WISE_LOSS'))
    assert "pointwise" in str(e.value)


def test_uncertainty_weighting_learns_a_weight_per_marked_term():
    text = _text("DBMTL").replace('model_class: "DBMTL"', 'model_class: "DBMTL"\n'
                                  "  loss_weight_strategy: Uncertainty")
    text = text.replace('tower_name: "cvr" label_name: "buy"',
                        'tower_name: "cvr" label_name: "buy" losses { loss_type: CLASSIFICATION '
                        "learn_loss_weight: true } losses { loss_type: SIGMOID_L2_LOSS "
                        "learn_loss_weight: true weight: 0.5 }")
    m, batch, _ = _model_and_batch("DBMTL", text=text)
    u = m.dense.loss_uncertainty
    assert u.shape == (2,)
    from odl.train.memory_estimate import estimate_memory

    assert estimate_memory(load_config_text(text), "cpu").dense_parameters == sum(
        p.numel() for p in m.dense.parameters())
    with torch.no_grad():
        u.copy_(torch.tensor([0.3, -0.2]))
    m.l2 = m.embedding_regularization = 0.0
    out = m(batch)
    y = batch.labels
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    l2 = (torch.sigmoid(out.logits[:, 1]) - y[:, 1]).square().mean()
    want = (bce(out.logits[:, 0], y[:, 0])
            + torch.exp(torch.tensor(-0.3)) * bce(out.logits[:, 1], y[:, 1]) + 0.15
            + 0.5 * torch.exp(torch.tensor(0.2)) * 0.5 * l2 - 0.1)
    loss = m.loss(out, batch)
    assert torch.allclose(loss, want, atol=1e-5)
    loss.backward()
    assert u.grad is not None and bool((u.grad != 0).all())
    # without the strategy a learned weight is refused, as EasyRec does
    with pytest.raises(ConfigError) as e:
        load_config_text(text.replace("  loss_weight_strategy: Uncertainty\n", ""))
    assert e.value.field.endswith("losses[0].learn_loss_weight")


def test_random_strategy_weighs_every_task_term_by_a_fresh_softmax_draw():
    """EasyRec's Random loss weights: softmax(N(0, 1)) over all terms, drawn every step."""
    text = _text("DBMTL").replace('model_class: "DBMTL"', 'model_class: "DBMTL"\n'
                                  "  loss_weight_strategy: Random")
    text = text.replace('tower_name: "cvr" label_name: "buy"',
                        'tower_name: "cvr" label_name: "buy" losses { loss_type: CLASSIFICATION '
                        "weight: 7 } losses { loss_type: SIGMOID_L2_LOSS }")
    m, batch, _ = _model_and_batch("DBMTL", text=text)
    m.l2 = m.embedding_regularization = 0.0
    out = m(batch)
    y = batch.labels
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    terms = torch.stack([bce(out.logits[:, 0], y[:, 0]), bce(out.logits[:, 1], y[:, 1]),
                         (torch.sigmoid(out.logits[:, 1]) - y[:, 1]).square().mean()])
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        w = torch.softmax(torch.randn(3), dim=0)  # ctr's one term, cvr's two
        torch.manual_seed(seed)
        loss = m.loss(out, batch)
        assert torch.allclose(loss, (w * terms).sum(), atol=1e-6)  # weight 7 is replaced
        losses.append(float(loss))
    assert losses[0] != losses[1]


NAMED_EXPERTS = ('experts { expert_name: "a" dnn { hidden_units: [24, 16] } } '
                 'experts { expert_name: "b" dnn { hidden_units: [16] } }')


def test_easyrecs_named_experts_each_build_their_own_dnn():
    """EasyRec's older MMoE form: one DNN per named expert, mixed by the gates."""
    text = _text("MMoE").replace("expert_dnn { hidden_units: [16] }\n    num_expert: 3",
                                 NAMED_EXPERTS)
    m, batch, _ = _model_and_batch("MMoE", text=text)
    experts = m.dense.experts.experts
    assert len(experts) == 2 and len(m.dense.experts.gates[0].out.weight) == 2
    assert [p.shape[0] for n, p in experts[0].named_parameters() if n.endswith("weight")] == [
        24, 16]
    assert m(batch).logits.shape == (64, 2)


@pytest.mark.parametrize("experts, fragment", [
    (NAMED_EXPERTS.replace("[16] }", "[8] }"), "last hidden_units must be equal"),
    (NAMED_EXPERTS + " num_expert: 2", "not both"),
])
def test_named_experts_are_checked_by_field(experts, fragment):
    text = _text("MMoE").replace("expert_dnn { hidden_units: [16] }\n    num_expert: 3", experts)
    with pytest.raises(ConfigError) as e:
        load_config_text(text)
    assert e.value.field == "model_config.mmoe.experts" and fragment in str(e.value)


def test_projected_raw_features_feed_the_multi_task_input():
    """EasyRec's projected RawFeature (embedding_dim, no boundaries) in an MMoE group: a
    learned vector times the value, part of the experts' input."""
    text = _text("MMoE")
    # the first dense feature gets an embedding_dim: projected
    first = re.search(r'feature_configs \{ input_names: "(\w+)" feature_type: RawFeature \}',
                       text).group(1)
    text = text.replace(f'input_names: "{first}" feature_type: RawFeature }}',
                        f'input_names: "{first}" feature_type: RawFeature embedding_dim: 8 }}')
    m, batch, _ = _model_and_batch("MMoE", text=text)
    assert m.dense.projection is not None and m.dense.projection.weight.shape == (1, 8)
    col = m.dense.projected_idx[0]
    with torch.no_grad():
        before = m(batch).logits.clone()
        batch.dense[:, col] += 1.0
        after = m(batch).logits
    assert not torch.allclose(before, after)


def test_simple_multi_task_towers_read_the_group_input_itself():
    """EasyRec's SimpleMultiTask: no bottom, no experts; each task's DNN reads the group's
    whole input, trains on its own label, and the tasks share nothing but the tables."""
    m, batch, sample = _model_and_batch("SimpleMultiTask")
    dense = m.dense
    assert dense.experts is None and len(dense.bottom) == 0  # an empty Sequential
    width = m.pooled_layout[0].width + len(dense.dense_idx)
    firsts = [next(x for x in h.dnn.modules() if isinstance(x, torch.nn.Linear))
              for h in dense.heads]
    assert [f.in_features for f in firsts] == [width, width]
    assert m.output_names == ("ctr", "cvr") and m.output_labels == (0, 1)
    assert np.array_equal(batch.labels[:, 1].numpy(), conversion_labels(sample, 5))
    # the cvr task's loss moves its own tower only
    m.l2 = m.embedding_regularization = 0.0
    m.task_loss.weights = [0.0, 1.0]
    m.zero_grad()
    m.loss(m(batch), batch).backward()
    assert float(firsts[0].weight.grad.abs().sum()) == 0.0
    assert float(firsts[1].weight.grad.abs().sum()) > 0.0
