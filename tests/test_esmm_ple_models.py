"""EasyRec's ESMM and PLE (``odl/models/esmm.py``, ``odl/models/ple.py``): their math, their
checks by field, online training, checkpoint restore, serving parity and restarts."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.loss_settings import regression_outputs
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.datagen.conversion_labels import encode_with_conversions
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.model_configs import as_model_config_text
from odl.models.model_registry import build_model, check_pipeline_config, model_class_of
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import as_model
from tests.test_file_stream import _parity, _saves_config, _serve_from, _write_two_days
from tests.test_online_parity import (
    _check_serving_parity,
    _incr_save,
    _train_with_publishing,
)

bce = torch.nn.functional.binary_cross_entropy_with_logits


def _text(model: str, *edits: tuple[str, str]) -> str:
    text = as_model_config_text(deepfm_config_text("/tmp/odl-esmm-unused", dim=8, buckets=50,
                                                   hidden_units=(16,)), model)
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


def _module_and_batch(text: str, n: int = 64, seed: int = 0):
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=True)
    fb = FeatureBuilder(config)
    torch.manual_seed(seed)
    tm = TrainModule(config, fb, device="cpu")
    sample = SyntheticCtrStream(seed=5, start_time=1.7e9).next_batch(n)
    return tm, fb.build(encode_with_conversions(sample, 5)).batch, config


def _scripted_equal(tm: TrainModule, batch) -> bool:
    pooled = tm.model.lookup(batch)
    scripted = torch.jit.script(tm.model.dense)  # what odl-export writes and odl-serve runs
    return torch.equal(scripted(*pooled, batch.dense), tm.model.dense(*pooled, batch.dense))


# --- ESMM ------------------------------------------------------------------------------------

def test_esmm_outputs_cvr_ctr_and_their_product_and_trains_on_click_and_ctcvr():
    tm, batch, config = _module_and_batch(_text("ESMM"))
    model = tm.model
    assert model.output_names == ("cvr", "ctr", "ctcvr")
    assert model.output_labels == (1, 0, 1)  # label_fields: label (click), buy
    assert regression_outputs(config) == [False, False, False]
    out = model(batch)
    cvr, ctr, ctcvr = out.logits.detach().double().unbind(1)
    np.testing.assert_allclose(torch.sigmoid(ctcvr), torch.sigmoid(cvr) * torch.sigmoid(ctr),
                               rtol=1e-5)
    model.l2 = model.embedding_regularization = 0.0
    click, buy = batch.labels[:, 0], batch.labels[:, 1]
    want = (bce(out.logits[:, 1], click, reduction="sum")
            + bce(out.logits[:, 2], click * buy, reduction="sum"))
    assert torch.allclose(model.loss(out, batch), want, rtol=1e-5)
    assert _scripted_equal(tm, batch)
    probs = tm.predict(batch)
    assert probs.shape == (64, 3)
    np.testing.assert_allclose(probs[:, 2], probs[:, 0] * probs[:, 1], rtol=1e-5)


def test_esmm_product_logit_is_finite_at_the_extremes():
    from odl.models.esmm import product_logit

    a = torch.tensor([-200.0, -30.0, 0.0, 30.0, 200.0, 5.0])
    b = torch.tensor([-200.0, 30.0, 0.0, 30.0, 200.0, -1.0])
    logit = product_logit(a, b)
    assert torch.isfinite(logit).all()
    want = torch.sigmoid(a.double()) * torch.sigmoid(b.double())
    np.testing.assert_allclose(torch.sigmoid(logit.double())[1:4], want[1:4], rtol=1e-5)
    np.testing.assert_allclose(torch.sigmoid(logit.double())[5], want[5], rtol=1e-5)


def test_esmm_regression_cvr_predicts_a_value_times_pctr():
    text = _text("ESMM", ('tower_name: "cvr" label_name: "buy"',
                          'tower_name: "cvr" label_name: "buy" loss_type: L2_LOSS'))
    tm, batch, config = _module_and_batch(text)
    assert regression_outputs(config) == [True, False, True]
    out = tm.model(batch)
    cvr, ctr, ctcvr = out.logits.detach().unbind(1)
    assert torch.allclose(ctcvr, cvr * torch.sigmoid(ctr), rtol=1e-6)
    tm.model.l2 = tm.model.embedding_regularization = 0.0
    click, buy = batch.labels[:, 0], batch.labels[:, 1]
    want = (bce(out.logits[:, 1], click, reduction="sum")
            + (out.logits[:, 2] - click * buy).square().mean())
    assert torch.allclose(tm.model.loss(out, batch), want, rtol=1e-5)
    probs = tm.predict(batch)
    np.testing.assert_allclose(probs[:, 2], ctcvr.double().numpy(), rtol=1e-6)


def test_esmm_towers_read_label_fields_in_easyrecs_order_and_the_all_group_without_groups():
    """EasyRec orders ESMM's towers CVR first: without label_name the CVR tower reads
    label_fields[0]. Without esmm.groups the towers read the "all" group itself."""
    text = _text("ESMM", ('label_fields: "label"\n  label_fields: "buy"',
                          'label_fields: "buy"\n  label_fields: "label"'),
                 (' label_name: "buy"', ""), (' label_name: "label"', ""),
                 ('groups { input: "all" dnn { hidden_units: [16] } }\n', ""))
    tm, batch, _ = _module_and_batch(text)
    assert tm.model.output_labels == (0, 1, 0)
    dense = tm.model.dense
    assert len(dense.groups) == 1 and len(dense.groups[0]) == 0  # no DNN: the group itself
    assert dense.heads[0].dnn[0].in_features == tm.model.pooled_layout[0].width + 13
    assert _scripted_equal(tm, batch)


@pytest.mark.parametrize("edit, field", [
    (('ctr_tower { tower_name: "ctr" label_name: "label" dnn { hidden_units: [8] } }', ""),
     "model_config.esmm.ctr_tower"),
    (('tower_name: "ctr" label_name: "label"', 'tower_name: "ctr" label_name: "label" '
      "loss_type: L2_LOSS"), "model_config.esmm.ctr_tower.loss_type"),
    (('tower_name: "cvr" label_name: "buy"', 'tower_name: "cvr" label_name: "buy" '
      "loss_type: CROSS_ENTROPY_LOSS"), "model_config.esmm.cvr_tower.loss_type"),
    (('tower_name: "cvr" label_name: "buy"', 'tower_name: "cvr" label_name: "buy" '
      "num_class: 2"), "model_config.esmm.cvr_tower.num_class"),
    (('tower_name: "cvr" label_name: "buy"', 'tower_name: "cvr" label_name: "buy" '
      "losses { loss_type: CLASSIFICATION }"), "model_config.esmm.cvr_tower.losses"),
    (('tower_name: "cvr" label_name: "buy"', 'tower_name: "cvr" label_name: "buy" '
      'task_space_indicator_label: "label"'),
     "model_config.esmm.cvr_tower.task_space_indicator_label"),
    (('label_name: "buy"', 'label_name: "pay"'), "model_config.esmm.cvr_tower.label_name"),
    (('label_name: "buy"', 'label_name: "label"'), "model_config.esmm.cvr_tower.label_name"),
    (('tower_name: "cvr"', 'tower_name: "ctcvr"'), "model_config.esmm.ctr_tower.tower_name"),
    (('tower_name: "cvr"', 'tower_name: ""'), "model_config.esmm.cvr_tower.tower_name"),
    (('input: "all"', 'input: "user"'), "model_config.esmm.groups[0].input"),
    (('groups { input: "all" dnn { hidden_units: [16] } }',
      'groups { input: "all" dnn { hidden_units: [0] } }'),
     "model_config.esmm.groups[0].dnn.hidden_units[0]"),
    (("  esmm {", "  loss_weight_strategy: Uncertainty\n  esmm {"),
     "model_config.loss_weight_strategy"),
    (("  esmm {", "  esmm {\n    l2_regularization: -1"), "model_config.esmm.l2_regularization"),
    (('  label_fields: "buy"', '  label_fields: "buy"\n  sample_weight: "I1"'),
     "data_config.sample_weight"),
])
def test_esmm_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(_text("ESMM", edit)), online=True)
    assert info.value.field == field, info.value


def test_esmm_named_by_its_message_alone_is_esmm():
    config = parse_pipeline_config_text(_text("ESMM", ('model_class: "ESMM"\n', "")))
    check_pipeline_config(config, online=True)
    assert model_class_of(config.model_config).name == "ESMM"


# --- PLE -------------------------------------------------------------------------------------

def _reference_ple(dense, x: torch.Tensor) -> list[torch.Tensor]:
    """EasyRec's CGC layers (ple.py), written out over the module's weights."""
    def mix(gate, experts):
        w = torch.softmax(gate, dim=1)
        return sum(w[:, j : j + 1] * e for j, e in enumerate(experts))

    networks = dense.experts.networks
    inputs, shared = [x, x], x
    for i, net in enumerate(networks):
        shared_out = [e(shared) for e in net.shared_experts]
        task_out = [[e(inputs[t]) for e in net.task_experts[t]] for t in range(2)]
        new = [mix(net.task_gates[t](inputs[t]), task_out[t] + shared_out) for t in range(2)]
        if i < len(networks) - 1:
            shared = mix(net.shared_gate(shared), task_out[0] + task_out[1] + shared_out)
        else:
            assert net.shared_gate is None
        inputs = new
    return [head.out(head.dnn(inputs[t])).squeeze(1) for t, head in enumerate(dense.heads)]


def test_ple_extraction_networks_feed_each_task_its_mixture():
    tm, batch, config = _module_and_batch(_text("PLE"))
    model = tm.model
    assert model.output_names == ("ctr", "cvr") and model.output_labels == (0, 1)
    networks = model.dense.experts.networks
    assert [len(n.task_experts[0]) for n in networks] == [2, 1]
    assert [len(n.shared_experts) for n in networks] == [1, 1]
    (group,) = model.lookup(batch)
    x = torch.cat([group, batch.dense[:, model.dense.dense_idx]], dim=1)
    with torch.no_grad():
        want = torch.stack(_reference_ple(model.dense, x), dim=1)
        got = model(batch).logits
    assert torch.allclose(got, want, atol=1e-6)
    model.l2 = model.embedding_regularization = 0.0
    out = model(batch)
    loss = bce(out.logits[:, 0], batch.labels[:, 0]) + bce(out.logits[:, 1], batch.labels[:, 1])
    assert torch.allclose(model.loss(out, batch), loss, atol=1e-6)
    assert _scripted_equal(tm, batch)


def test_ple_torcheasyrec_form_is_the_same_model():
    easyrec = _text("PLE")
    tz = _text("PLE", ('model_class: "PLE"\n', ""), ('label_name: "buy" dnn {',
                                                      'label_name: "buy" mlp {'),
               ('label_name: "label" dnn {', 'label_name: "label" metrics { auc {} } '
                "losses { binary_cross_entropy {} } mlp {"))
    shapes = []
    for text in (easyrec, tz):
        config = parse_pipeline_config_text(text)
        check_pipeline_config(config, online=True)
        assert model_class_of(config.model_config).name == "PLE"
        model = build_model(config, FeatureBuilder(config))
        shapes.append([(n, tuple(p.shape)) for n, p in model.dense.named_parameters()])
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize("edit, field", [
    (("expert_num_per_task: 2", "expert_num_per_task: 0"),
     "model_config.ple.extraction_networks[0].expert_num_per_task"),
    (("share_expert_net { hidden_units: [16] }", "share_expert_net { hidden_units: [16, 4] }"),
     "model_config.ple.extraction_networks[0].share_expert_net.hidden_units"),
    (("task_expert_net { hidden_units: [16] }", ""),
     "model_config.ple.extraction_networks[0].task_expert_net.hidden_units"),
    (("share_num: 1 task_expert_net { hidden_units: [16] } share_expert_net "
      "{ hidden_units: [16] }", "share_num: 1 task_expert_net { hidden_units: [16] }"),
     "model_config.ple.extraction_networks[0].share_expert_net.hidden_units"),
    (('label_name: "buy"', 'label_name: "pay"'), "model_config.ple.task_towers[1].label_name"),
    (('tower_name: "cvr"', 'tower_name: "ctr"'), "model_config.ple.task_towers[1].tower_name"),
    (('tower_name: "cvr"', 'tower_name: "cvr" relation_tower_names: "ctr"'),
     "model_config.ple.task_towers[1].relation_tower_names"),
    (("  ple {", "  ple {\n    l2_regularization: -1"), "model_config.ple.l2_regularization"),
])
def test_ple_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(_text("PLE", edit)), online=True)
    assert info.value.field == field, info.value


def test_ple_without_extraction_networks_is_refused():
    text = _text("PLE")
    start = text.index("    extraction_networks")
    end = text.index("    task_towers")
    with pytest.raises(ConfigError) as info:
        check_pipeline_config(parse_pipeline_config_text(text[:start] + text[end:]),
                              online=True)
    assert info.value.field == "model_config.ple.extraction_networks"


# --- both: learning, restore, parity, restart --------------------------------------------------

@pytest.mark.parametrize("model", ["ESMM", "PLE"])
def test_learns_online_and_restores_to_the_same_predictions(model: str) -> None:
    """40 steps of the synthetic stream with conversions: the loss goes down; a checkpoint
    restored into a module of another seed predicts and trains on exactly as the first."""
    text = as_model(deepfm_config_text("/tmp/odl-esmm-unused"), model)
    config = parse_pipeline_config_text(text)
    fb = FeatureBuilder(config)
    torch.manual_seed(0)
    a = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    losses = [a.train_step(fb.build(encode_with_conversions(stream.next_batch(256), 5)).batch).loss
              for _ in range(40)]
    assert np.mean(losses[-8:]) < 0.9 * np.mean(losses[:8]), losses
    state = a.state_dict_for_checkpoint()
    torch.manual_seed(7)
    b = TrainModule(config, fb, device="cpu")
    batch = fb.build(encode_with_conversions(stream.next_batch(128), 5)).batch
    assert not np.array_equal(a.predict(batch), b.predict(batch))
    b.load_checkpoint_state(state)
    np.testing.assert_array_equal(a.predict(batch), b.predict(batch))
    np.testing.assert_array_equal(a.train_step(batch).probs, b.train_step(batch).probs)
    np.testing.assert_array_equal(a.predict(batch), b.predict(batch))


@pytest.mark.parametrize("model", ["ESMM", "PLE"])
def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path, model: str) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts, every output (max abs diff <= 1e-6)."""
    delta_topic = f"odl-deltas-{os.getpid()}-{time.time_ns()}"
    trainer, cfg = _train_with_publishing(
        tmp_path, kafka_bootstrap, kafka_topic_factory,
        _incr_save("kafka", f"{kafka_bootstrap}|{delta_topic}"), n=800, model=model)
    outputs = {"ESMM": ("cvr", "ctr", "ctcvr"), "PLE": ("ctr", "cvr")}[model]
    assert trainer.module.model.output_names == outputs
    assert trainer.publisher.status()["last_version"] == trainer.module.global_step
    status, diff = _check_serving_parity(tmp_path, trainer, cfg, kafka_bootstrap)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


@pytest.mark.parametrize("model", ["ESMM"])
def test_restart_inside_a_pass_trains_every_record_once(tmp_path, model: str) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once,
    and serving from the first day's base + the pass deltas predicts what the restarted
    trainer predicts. (PLE's restore is the multi-task models'; its checkpoint round trip is
    above, its deltas in the parity test.)"""
    from odl.export.exporter import export_checkpoint

    data, saves = tmp_path / "data", tmp_path / "saves"
    ids, values = _write_two_days(data, model=model)
    ledger = str(tmp_path / "ledger.tsv")
    runs = []
    for extra in ("num_steps: 22", ""):
        text = as_model(_saves_config(tmp_path, str(data), str(saves), extra,
                                      dynamic='model_class: "DeepFM"\n  '
                                              "ev_params { max_capacity: 4000 }"), model)
        trainer = Trainer(parse_pipeline_config_text(text),
                          TrainerOptions(online=True, device="cpu", status_port=-1,
                                         sample_ledger=ledger, export_base=export_checkpoint))
        assert trainer.run() == 0
        runs.append(trainer)
    assert runs[0].module.global_step == 22
    trained = [sid for _g, _s, sid in read_ledger(ledger)]
    assert sorted(trained) == sorted(ids) and len(set(trained)) == len(trained)
    service = _serve_from(str(saves / "20261123" / "base"), str(saves))
    assert service.model.state.version == runs[1].module.global_step
    assert _parity(service, runs[1], 34, values[-170:]) <= 1e-6
