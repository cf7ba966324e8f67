"""The Kafka input in a child process (data_config.input_process): same training, clear
failures, no stray processes."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import torch
from confluent_kafka import Consumer, TopicPartition

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.config.pipeline_config import load_pipeline_config
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.topic_records import make_records, produce
from odl.inputs.input_pipeline import KafkaProcessInput
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import end_offsets
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import odl_helper_processes, run_in_process, run_in_thread, write_config

BAD = [b"", b"\xff\xfe garbage", b"1,2,3"]


def _wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_input_process_trains_the_same_as_input_threads(kafka_bootstrap, kafka_topic_factory,
                                                        tmp_path):
    """One partition and full batches: both ways build the same batches in the same order,
    so they must train every record once, count the same rejects and end with equal weights."""
    topic = kafka_topic_factory(partitions=1)
    ids, values = make_records(640, seed=11)
    values[100:100] = BAD  # rejected in the child, counted in the trainer
    produce(kafka_bootstrap, topic, values, 1)
    ends = end_offsets(kafka_bootstrap, topic)
    runs = {}
    for flag in (True, False):
        sub = tmp_path / f"process_{flag}"
        sub.mkdir()
        cfg = write_config(sub, kafka_bootstrap, topic, batch_size=64)
        ledger = str(sub / "ledger.tsv")
        # a long batch timeout: batches are cut by size only, never by timing
        edits = {"data_config.input_process": flag, "data_config.batch_timeout_ms": 5000}
        trainer = run_in_process(cfg, ends, ledger, edits=edits)
        assert isinstance(trainer.input_pipeline, KafkaProcessInput) is flag
        assert sorted(ledger_sample_ids(ledger)) == sorted(ids)
        assert sum(trainer.records_rejected.values()) == len(BAD)
        st = trainer.status()
        assert st["records_consumed"] == len(values)
        assert st["input"]["partitions"]["0"]["lag"] == 0
        assert st["input"]["partitions"]["0"]["high_watermark"] == ends[0]
        ckpt = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
        assert ckpt.positions == ends
        runs[flag] = (trainer.records_rejected, ckpt)
    assert runs[True][0] == runs[False][0]
    a, b = runs[True][1], runs[False][1]
    assert a.global_step == b.global_step == -(-len(values) // 64)
    for key, value in a.state["model"].items():
        assert torch.equal(value, b.state["model"][key]), key
    assert not odl_helper_processes()


def _start_trainer(tmp_path, kafka_bootstrap, topic, **edits):
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=32)
    config = load_pipeline_config(cfg, json.dumps(edits) if edits else None)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    thread, outcome = run_in_thread(trainer)
    return trainer, thread, outcome


def test_a_killed_input_process_fails_the_trainer_with_a_clear_error(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory(partitions=2)
    _, values = make_records(300, seed=12)
    produce(kafka_bootstrap, topic, values, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    trainer, thread, outcome = _start_trainer(tmp_path, kafka_bootstrap, topic)
    _wait_for(lambda: dict(trainer.positions) == ends, what="the backlog trained")
    pid = trainer.input_pipeline.pid
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    err = outcome.get("error")
    assert isinstance(err, RuntimeError) and f"input process pid {pid} exited" in str(err)
    # what was trained before is checkpointed, so a restart loses and repeats nothing
    ckpt = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert ckpt.positions == ends
    assert not odl_helper_processes()


def test_input_process_ignores_signals_and_ends_with_the_trainer(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """systemd and Ctrl-C signal the whole group: the trainer, not the signal, ends the child,
    after committing the trained positions to the consumer group."""
    topic = kafka_topic_factory(partitions=2)
    _, values = make_records(200, seed=13)
    produce(kafka_bootstrap, topic, values, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    trainer, thread, outcome = _start_trainer(tmp_path, kafka_bootstrap, topic)
    _wait_for(lambda: trainer.state == "training", what="training")
    child = psutil.Process(trainer.input_pipeline.pid)
    child.send_signal(signal.SIGTERM)
    child.send_signal(signal.SIGINT)
    _, more = make_records(100, seed=14)
    produce(kafka_bootstrap, topic, more, 2)
    ends = end_offsets(kafka_bootstrap, topic)
    _wait_for(lambda: dict(trainer.positions) == ends, what="records produced after the signals")
    assert child.is_running()
    trainer.request_stop("test")
    thread.join(30)
    assert outcome.get("rc") == 0, outcome
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert not odl_helper_processes()
    consumer = Consumer(consumer_config(kafka_bootstrap, trainer.config.kafka_train_input.group))
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=10)
    finally:
        consumer.close()
    assert {tp.partition: tp.offset for tp in committed} == ends


@pytest.mark.parametrize("input_process", [True, False])
def test_stop_while_waiting_for_the_topic_is_a_clean_stop(kafka_bootstrap, tmp_path,
                                                          input_process):
    """Exit 0 and no checkpoint: one without positions would override the config's start
    positions on the next start."""
    trainer, thread, outcome = _start_trainer(
        tmp_path, kafka_bootstrap, f"odl-test-missing-{os.getpid()}-{time.time_ns()}",
        **{"data_config.input_process": input_process})
    _wait_for(lambda: trainer.state == "waiting_for_topic" and trainer.input_pipeline is not None
              and trainer.input_pipeline.broker_error is not None, what="waiting for the topic")
    assert "does not exist" in trainer.status()["input"]["broker_error"]
    trainer.request_stop("test")
    thread.join(30)
    assert not thread.is_alive()
    assert outcome == {"rc": 0}
    assert list_checkpoints(trainer.model_dir) == []
    assert not odl_helper_processes()


def test_input_process_with_feature_build_workers(kafka_bootstrap, kafka_topic_factory,
                                                  tmp_path):
    topic = kafka_topic_factory(partitions=3)
    ids, values = make_records(500, seed=15)
    produce(kafka_bootstrap, topic, values, 3)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic, batch_size=64)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger, edits={"data_config.num_workers": 2})
    assert isinstance(trainer.input_pipeline, KafkaProcessInput)
    assert sorted(ledger_sample_ids(ledger)) == sorted(ids)
    assert not odl_helper_processes()
