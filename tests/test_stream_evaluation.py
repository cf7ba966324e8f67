"""Evaluation beside online training (kafka_eval_input): scored at every checkpoint with the
model of that step, never trained on, resumed after a restart from the checkpoint."""

from __future__ import annotations

import pytest

from odl.auc import roc_auc
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.topic_records import produce
from odl.kafka.topic_admin import end_offsets
from odl.train.progressive_metrics import log_loss
from odl.train.stream_evaluation import StreamEvaluator
from odl.train.train_module import TrainModule
from tests.harness import run_in_process, write_config


def _eval_config(tmp_path, bootstrap, train_topic, eval_topic, extra: str = "") -> str:
    cfg = write_config(tmp_path, bootstrap, train_topic, batch_size=100)
    text = open(cfg).read().replace("save_checkpoints_steps: 50", "save_checkpoints_steps: 6")
    text += (f'\nkafka_eval_input {{ server: "{bootstrap}" topic: "{eval_topic}" '
             f'group: "odl_test" }}\n{extra}\n')
    open(cfg, "w").write(text)
    return cfg


def test_an_evaluation_scores_the_new_records_with_the_model(kafka_bootstrap,
                                                             kafka_topic_factory, tmp_path):
    held_out = kafka_topic_factory(partitions=3)
    records = SyntheticCtrStream(seed=4).next_batch(500).encode("csv")
    produce(kafka_bootstrap, held_out, records, 3)
    cfg = _eval_config(tmp_path, kafka_bootstrap, "unused", held_out,
                       "eval_config { num_examples: 200 }")
    config = load_pipeline_config(cfg)
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    ev = StreamEvaluator(config, fb, module.predict, [("label", 0)])
    try:
        sizes = [ev.evaluate(7)["samples"] for _ in range(4)]
        assert sizes == [200, 200, 100, 0]  # num_examples at a time, then nothing new
        assert ev.positions() == end_offsets(kafka_bootstrap, held_out)
        everything = type(config)()
        everything.CopyFrom(config)
        everything.eval_config.num_examples = 0  # every record, from the start
        ev2 = StreamEvaluator(everything, fb, module.predict, [("label", 0)])
        result = ev2.evaluate(7)
        ev2.close()
        # a fresh start honours offset_info, as kafka_train_input does
        everything.kafka_eval_input.offset_info = '{"0": 100}'
        ev3 = StreamEvaluator(everything, fb, module.predict, [("label", 0)])
        first = ev3.evaluate(7)["samples"]
        ev3.close()
        assert first == 500 - 100
    finally:
        ev.close()
    built = fb.build(records).batch
    probs = module.predict(built)
    labels = built.labels.numpy()
    assert result["samples"] == 500 and result["step"] == 7
    assert result["auc"] == pytest.approx(roc_auc(labels > 0.5, probs), abs=1e-6)
    assert result["logloss"] == pytest.approx(log_loss(probs, labels), abs=1e-6)


@pytest.mark.slow
def test_eval_topic_is_scored_at_checkpoints_never_trained_and_resumed(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    train, held_out = kafka_topic_factory(partitions=2), kafka_topic_factory(partitions=2)
    produce(kafka_bootstrap, train, SyntheticCtrStream(seed=3).next_batch(1200).encode("csv"), 2)
    produce(kafka_bootstrap, held_out, SyntheticCtrStream(seed=4).next_batch(700).encode("csv"),
            2)
    cfg = _eval_config(tmp_path, kafka_bootstrap, train, held_out)
    trainer = run_in_process(cfg, end_offsets(kafka_bootstrap, train))
    assert trainer.samples_trained == 1200  # the eval records are scored, not trained on
    assert trainer.evaluator.samples_total == 700  # each once, at the checkpoints
    assert trainer.evaluator.last["step"] == trainer.module.global_step
    last = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert ({int(p): o for p, o in last.source["eval_positions"].items()}
            == end_offsets(kafka_bootstrap, held_out))
    # a restart goes on after the saved positions: only the new records are scored
    produce(kafka_bootstrap, held_out, SyntheticCtrStream(seed=5).next_batch(300).encode("csv"),
            2)
    produce(kafka_bootstrap, train, SyntheticCtrStream(seed=6).next_batch(200).encode("csv"), 2)
    again = run_in_process(cfg, end_offsets(kafka_bootstrap, train))
    assert again.samples_trained == 200 and again.evaluator.samples_total == 300
    status = again.status()["evaluation"]
    assert status == again.evaluator.last and status["samples_total"] == 300
    assert status["error"] is None


def test_a_datahub_eval_topic_is_scored_and_resumed(tmp_path):
    """datahub_eval_input: the same evaluation over DataHub shards (the loopback double),
    num_examples at a time, resumed from the saved sequences."""
    from odl.harness.datahub_double import DatahubDouble

    records = SyntheticCtrStream(seed=5).next_batch(300).encode("csv")
    with DatahubDouble() as dh:
        dh.create_topic("p", "held", shards=2)
        dh.append("p", "held", "0", records[:200])
        dh.append("p", "held", "1", records[200:])
        cfg = write_config(tmp_path, "127.0.0.1:1", "unused", batch_size=50)
        text = open(cfg).read() + (
            f'\ndatahub_eval_input {{ endpoint: "{dh.endpoint}" akId: "id" akSecret: "s" '
            'project: "p" topic: "held" }\neval_config { num_examples: 120 }\n')
        open(cfg, "w").write(text)
        config = load_pipeline_config(cfg)
        fb = FeatureBuilder(config)
        module = TrainModule(config, fb, device="cpu")
        ev = StreamEvaluator(config, fb, module.predict, [("label", 0)])
        try:
            results = [ev.evaluate(3) for _ in range(3)]
            assert [r["samples"] for r in results] == [120, 120, 60]
            assert all(r["error"] is None for r in results)
            assert ev.positions() == {0: 200, 1: 100}
            assert ev.topic == "p/held"
            assert ev.evaluate(3)["samples"] == 0  # nothing new
            dh.append("p", "held", "1", records[:30])
            assert ev.evaluate(4)["samples"] == 30
            saved = ev.positions()
        finally:
            ev.close()
        # a restart goes on from the checkpoint's sequences
        dh.append("p", "held", "0", records[:10])
        ev2 = StreamEvaluator(config, fb, module.predict, [("label", 0)], saved)
        try:
            assert ev2.evaluate(5)["samples"] == 10
        finally:
            ev2.close()


@pytest.mark.parametrize("extra, field", [
    ('datahub_eval_input { endpoint: "http://127.0.0.1:1" project: "p" topic: "h" }\n'
     'kafka_eval_input { server: "127.0.0.1:1" topic: "e" group: "g" }', "datahub_eval_input"),
    ('datahub_eval_input { project: "p" topic: "h" }', "datahub_eval_input.endpoint"),
    ('datahub_eval_input { endpoint: "http://127.0.0.1:1" project: "p" topic: "h" '
     'offset_time: "soon" }', "datahub_eval_input.offset_time"),
])
def test_datahub_eval_input_errors_name_the_field(tmp_path, extra, field):
    from odl.config.config_error import ConfigError
    from odl.models.model_registry import check_pipeline_config

    cfg = write_config(tmp_path, "127.0.0.1:1", "unused", batch_size=50)
    open(cfg, "a").write("\n" + extra + "\n")
    with pytest.raises(ConfigError) as e:
        check_pipeline_config(load_pipeline_config(cfg), online=True)
    assert e.value.field == field, e.value


@pytest.mark.slow
def test_easyrecs_form_the_training_topic_with_another_group(kafka_bootstrap,
                                                            kafka_topic_factory, tmp_path):
    """EasyRec's online-training configs name the training topic in kafka_eval_input with a
    group of its own: accepted as written; training still reads every record once, and the
    evaluation reads the same records with positions of its own and says what it scored."""
    from odl.config.config_error import ConfigError
    from odl.models.model_registry import check_pipeline_config

    topic = kafka_topic_factory(partitions=2)
    produce(kafka_bootstrap, topic, SyntheticCtrStream(seed=3).next_batch(1200).encode("csv"), 2)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=100)
    text = open(cfg).read().replace("save_checkpoints_steps: 50", "save_checkpoints_steps: 6")
    same_group = text + (f'\nkafka_eval_input {{ server: "{kafka_bootstrap}" topic: "{topic}" '
                         'group: "odl_test" }\n')
    open(cfg, "w").write(same_group)
    with pytest.raises(ConfigError) as e:  # one group for both would share its commits
        check_pipeline_config(load_pipeline_config(cfg), online=True)
    assert e.value.field == "kafka_eval_input.group"

    open(cfg, "w").write(same_group.replace('group: "odl_test" }\n', 'group: "odl_eval" }\n'))
    trainer = run_in_process(cfg, ends)
    assert trainer.samples_trained == 1200  # the evaluation took no record from training
    assert trainer.evaluator.samples_total == 1200  # and read every record once itself
    status = trainer.status()["evaluation"]
    assert status["reads_training_topic"] is True and status["error"] is None
    last = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert last.positions == ends
    assert {int(p): o for p, o in last.source["eval_positions"].items()} == ends
