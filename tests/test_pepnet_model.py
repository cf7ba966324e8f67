"""TorchEasyRec's PEPNet (``odl/models/pepnet.py``): its math, its domains, its checks, parity
and restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.features.feature_builder import FeatureBuilder
from odl.models.model_registry import check_pipeline_config, registered_model_classes
from odl.train.train_module import TrainModule
from tests.model_checks import restart_inside_a_pass, serving_replay_diff

PEPNET_CONFIG = """
model_dir: "/tmp/unused"
kafka_train_input { server: "127.0.0.1:9092" topic: "samples" group: "g" }
data_config {
  input_fields { input_name: "clk" input_type: INT32 }
  input_fields { input_name: "buy" input_type: INT32 }
  input_fields { input_name: "scene" input_type: INT32 }
  input_fields { input_name: "x" input_type: FLOAT }
  input_fields { input_name: "c1" }
  input_fields { input_name: "c2" }
  label_fields: ["clk", "buy", "scene"]
}
feature_configs { feature_name: "x" input_names: "x" feature_type: RawFeature }
feature_configs { input_names: "c1" hash_bucket_size: 200 embedding_dim: 4 }
feature_configs { input_names: "c2" feature_type: TagFeature separator: "|"
                  hash_bucket_size: 100 embedding_dim: 4 }
feature_configs { input_names: "scene" num_buckets: 3 embedding_dim: 2 }
model_config {
  feature_groups { group_name: "all" feature_names: ["c1", "c2", "x"] wide_deep: DEEP }
  feature_groups { group_name: "domain" feature_names: ["scene"] wide_deep: DEEP }
  feature_groups { group_name: "uia" feature_names: ["c1", "x"] wide_deep: DEEP }
  pepnet {
    epnet_hidden_unit: 5
    ppnet_hidden_units: [6, 3]
    ppnet_dropout_ratio: [0.0]
    domain_input_name: "scene"
    task_domain_num: 3
    task_towers { tower_name: "ctr" label_name: "clk" mlp { hidden_units: [4] } }
    task_towers { tower_name: "cvr" label_name: "buy" mlp { hidden_units: [4] } }
  }
}
train_config {
  sparse_optimizer { adagrad_optimizer { lr: 0.05 } constant_learning_rate {} }
  dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }
}
"""

RECORDS = [b"1,0,0,0.5,a,x|y", b"0,0,2,-1.25,c,z", b"1,1,1,2.0,a,", b"0,0,2,0.0,e,x|x|w",
           b"1,1,0,1.0,b,y", b"0,1,1,-0.5,c,w|x"]


def _config(edit: tuple[str, str] = ("", "")):
    text = PEPNET_CONFIG.replace(*edit) if edit[0] else PEPNET_CONFIG
    return parse_pipeline_config_text(text)


def _module(config=None) -> tuple[TrainModule, FeatureBuilder]:
    config = config or _config()
    check_pipeline_config(config, online=True)  # TorchEasyRec's task mlp read as dnn
    fb = FeatureBuilder(config)
    torch.manual_seed(3)
    return TrainModule(config, fb, device="cpu"), fb


def _linear(layer: torch.nn.Linear, x: np.ndarray) -> np.ndarray:
    return x @ layer.weight.detach().double().numpy().T + layer.bias.detach().double().numpy()


def _gate(unit, z: np.ndarray) -> np.ndarray:
    h = np.maximum(_linear(unit.hidden, z), 0.0)
    return unit.gamma / (1.0 + np.exp(-_linear(unit.out, h)))


def _expected(tm: TrainModule, batch) -> np.ndarray:
    """The module docstring's formula in float64 numpy, the layers' weights applied by hand."""
    d = tm.model.dense
    (pooled,) = tm.model.lookup(batch)
    g = pooled.detach().double().numpy()
    dense = batch.dense.double().numpy()
    x = np.concatenate([g[:, : d.main_end], dense[:, d.main_idx]], axis=1)
    dom = np.concatenate([g[:, d.main_end : d.domain_end], dense[:, d.domain_idx]], axis=1)
    x = _gate(d.epnet, np.concatenate([dom, x], axis=1)) * x
    uia = np.concatenate([g[:, d.domain_end :], dense[:, d.uia_idx]], axis=1)
    gate_in = np.concatenate([uia, x], axis=1)
    logits = []
    for t, layers in enumerate(d.ppnet):
        h = x
        for layer in layers:  # ReLU, then the gate (dropout 0)
            h = np.maximum(_linear(layer.linear, h), 0.0) * _gate(layer.gate, gate_in)
        for k in range(tm.model.domains):
            head = d.heads[t * tm.model.domains + k]
            tower = np.maximum(_linear(head.dnn[0], h), 0.0)
            logits.append(_linear(head.out, tower)[:, 0])
    return np.stack(logits, axis=1)


def test_logits_are_epnet_then_ppnet_then_one_tower_per_task_and_domain() -> None:
    tm, fb = _module()
    batch = fb.build(RECORDS).batch
    tm.model.eval()
    with torch.no_grad():
        got = tm.model(batch).logits.double().numpy()
    assert got.shape == (len(RECORDS), 6)
    assert tm.model.output_names == ("ctr_0", "ctr_1", "ctr_2", "cvr_0", "cvr_1", "cvr_2")
    np.testing.assert_allclose(got, _expected(tm, batch), rtol=1e-5, atol=1e-6)


def test_each_record_trains_the_towers_of_its_own_domain() -> None:
    """The loss reads, per task, the logit of the record's domain (its ``scene`` label): a
    batch of domains 0 and 2 leaves domain 1's towers untouched, and the loss equals the
    tasks' binary cross entropy on the selected logits."""
    tm, fb = _module()
    records = [r for r in RECORDS if r.split(b",")[2] != b"1"]
    batch = fb.build(records).batch
    out = tm.model(batch)
    picked = tm.model.task_logits(out.logits, batch)
    scene = batch.labels[:, 2].long()
    for t in range(2):
        torch.testing.assert_close(picked[:, t], out.logits[torch.arange(len(records)),
                                                             t * 3 + scene])
    labels = batch.labels[:, :2]
    want = sum(torch.nn.functional.binary_cross_entropy_with_logits(picked[:, t], labels[:, t])
               for t in range(2))
    torch.testing.assert_close(tm.model.loss(out, batch), want)
    tm.model.zero_grad()
    tm.model.loss(out, batch).backward()
    heads = tm.model.dense.heads
    for t in range(2):
        untouched = heads[t * 3 + 1].out.weight.grad
        assert untouched is None or not untouched.any()
        assert heads[t * 3].out.weight.grad.abs().sum() > 0
        assert heads[t * 3 + 2].out.weight.grad.abs().sum() > 0
    assert tm.model.dense.epnet.hidden.weight.grad.abs().sum() > 0


def test_a_record_outside_the_domains_is_rejected_as_bad_label() -> None:
    """A domain label that is not an integer in [0, task_domain_num) is rejected when the
    record is read; the label column still feeds its feature."""
    _tm, fb = _module()
    built = fb.build([b"1,0,3,0.5,a,x", b"1,0,-1,0.5,a,x", b"1,0,1.5,0.5,a,x", RECORDS[0]])
    assert dict(built.rejected) == {0: "bad_label", 1: "bad_label", 2: "bad_label"}
    assert built.batch.labels.shape[0] == 1


def test_pepnet_trains_and_its_loss_falls() -> None:
    tm, fb = _module()
    batch = fb.build(RECORDS * 8).batch
    losses = [tm.train_step(batch).loss for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]


def test_the_metrics_score_each_task_on_its_records_domains(kafka_bootstrap,
                                                            kafka_topic_factory,
                                                            tmp_path) -> None:
    """A trainer of PEPNet with domains: the progressive metrics and the eval topic (the
    training topic read by a group of its own, 20 records an evaluation) score one prediction
    per task, each record's domain's, named by the task; every record is trained once."""
    from odl.checkpoint.checkpoint_manager import list_checkpoints
    from odl.harness.topic_records import produce
    from odl.kafka.topic_admin import end_offsets
    from tests.harness import run_in_process

    topic = kafka_topic_factory(partitions=2)
    produce(kafka_bootstrap, topic, RECORDS * 40, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    text = (PEPNET_CONFIG
            .replace('server: "127.0.0.1:9092" topic: "samples"',
                     f'server: "{kafka_bootstrap}" topic: "{topic}"')
            .replace('model_dir: "/tmp/unused"', f'model_dir: "{tmp_path / "model_dir"}"')
            .replace("train_config {", "train_config {\n  save_checkpoints_steps: 5", 1)
            .replace("data_config {", "data_config {\n  batch_size: 40", 1)
            + f'kafka_eval_input {{ server: "{kafka_bootstrap}" topic: "{topic}" '
              'group: "eval" }\neval_config { num_examples: 20 }\n')
    cfg = tmp_path / "pepnet.config"
    cfg.write_text(text)
    trainer = run_in_process(str(cfg), ends)
    assert trainer.samples_trained == len(RECORDS) * 40
    tasks = trainer.status()["tasks"]
    assert set(tasks) == {"ctr", "cvr"} and tasks["cvr"]["samples"] == len(RECORDS) * 40
    evaluation = trainer.evaluator.last
    assert evaluation["samples"] == 20 and evaluation["error"] is None
    assert set(evaluation["tasks"]) == {"ctr", "cvr"}
    assert list_checkpoints(str(tmp_path / "model_dir"))

    tm, fb = _module()
    batch = fb.build(RECORDS).batch
    probs = tm.predict(batch)
    labels = batch.labels.numpy()
    scored = tm.model.metric_predictions(probs, labels)
    scene = labels[:, 2].astype(int)
    np.testing.assert_array_equal(scored, probs.reshape(-1, 2, 3)[np.arange(len(RECORDS)), :,
                                                                   scene])


def test_without_domain_or_uia_groups_it_is_a_tower_per_task() -> None:
    """No "domain" group: no EPNet; no "uia" group: no PPNet; no domain_input_name: one
    output per task."""
    config = _config(("  feature_groups { group_name: \"domain\" feature_names: [\"scene\"] "
                      "wide_deep: DEEP }\n  feature_groups { group_name: \"uia\" "
                      "feature_names: [\"c1\", \"x\"] wide_deep: DEEP }\n", ""))
    config.model_config.pepnet.ClearField("domain_input_name")
    del config.data_config.label_fields[2]
    check_pipeline_config(config, online=True)
    tm, fb = _module(config)
    assert tm.model.dense.epnet is None and len(tm.model.dense.ppnet) == 0
    assert tm.model.output_names == ("ctr", "cvr")
    assert tm.model(fb.build(RECORDS).batch).logits.shape == (len(RECORDS), 2)


@pytest.mark.parametrize("edit, field", [
    (('group_name: "all"', 'group_name: "main"'), "model_config.feature_groups"),
    (("ppnet_hidden_units: [6, 3]", ""), "model_config.pepnet.ppnet_hidden_units"),
    (("ppnet_dropout_ratio: [0.0]", "ppnet_dropout_ratio: [0.1, 0.1, 0.1]"),
     "model_config.pepnet.ppnet_dropout_ratio"),
    (("ppnet_dropout_ratio: [0.0]", "ppnet_dropout_ratio: [1.0]"),
     "model_config.pepnet.ppnet_dropout_ratio"),
    (('label_fields: ["clk", "buy", "scene"]', 'label_fields: ["clk", "buy"]'),
     "model_config.pepnet.domain_input_name"),
    (("task_domain_num: 3", "task_domain_num: 0"), "model_config.pepnet.task_domain_num"),
    (('mlp { hidden_units: [4] } }\n    task_towers { tower_name: "cvr"',
      'mlp { hidden_units: [4] } num_class: 2 }\n    task_towers { tower_name: "cvr"'),
     "model_config.pepnet.task_towers[0].num_class"),
    (("pepnet {", 'pepnet {\n    ppnet_activation: "nn.Bogus"'),
     "model_config.pepnet.ppnet_activation"),
    # in-batch learning follows one output per record, not a tower per domain
    (("train_config {", "train_config {\n  in_batch_learning: true"),
     "train_config.in_batch_learning"),
    # a label other than the domain label still cannot feed a feature
    (('input_names: "c1" hash', 'input_names: "buy" hash'), "feature_configs[1].input_names[0]"),
])
def test_pepnet_settings_are_refused_by_field(edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_pipeline_config(_config(edit), online=True)
    assert e.value.field == field


def test_pepnet_is_registered_by_its_module() -> None:
    assert registered_model_classes()["PEPNet"].build.__module__ == "odl.models.pepnet"


def test_serving_replay_matches_trainer_predictions(kafka_bootstrap, kafka_topic_factory,
                                                    tmp_path) -> None:
    """Trained from Kafka with publishing; an early export + the replayed deltas predict what
    the trainer predicts (max abs diff <= 1e-6)."""
    status, diff = serving_replay_diff("PEPNet", "PEPNetDense", tmp_path, kafka_bootstrap,
                                       kafka_topic_factory)
    assert status["versions_applied"] >= 2 and diff <= 1e-6


def test_restart_inside_a_pass_trains_every_record_once(tmp_path) -> None:
    """A file stream stopped at step 22 and restarted: every record trained exactly once
    (the sample ledger), and serving from the first day's base + the pass deltas predicts
    what the restarted trainer predicts."""
    assert restart_inside_a_pass("PEPNet", tmp_path) <= 1e-6
