"""End-to-end: odl-train against the real broker — start positions, exactly-once restart."""

from __future__ import annotations

import collections
import json
import os
import signal
import time

import pytest

from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.topic_records import make_records, produce
from odl.harness.trainer_process import start_cli_trainer, wait_cli_caught_up
from odl.kafka.topic_admin import end_offsets
from tests.harness import run_in_process, write_config

PARTS = 3


def test_start_from_nothing_trains_every_record_once(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    ids, values = make_records(400, seed=1)
    produce(kafka_bootstrap, topic, values, PARTS)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger)
    trained = ledger_sample_ids(ledger)
    assert sorted(trained) == sorted(ids)
    assert len(set(trained)) == len(trained)
    ckpt = read_checkpoint(list_checkpoints(trainer.model_dir)[-1])
    assert ckpt.positions == ends
    assert ckpt.global_step == trainer.module.global_step


def test_start_from_timestamp_trains_exactly_records_at_or_after_it(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    ids, values = make_records(500, seed=2)
    now_ms = int(time.time() * 1000)
    cut_ms = now_ms - 3_600_000
    # first 300 records one to two hours old, the rest from the cut on, 1 ms apart
    ts = [cut_ms - 3_600_000 + i for i in range(300)] + [cut_ms + i for i in range(200)]
    produce(kafka_bootstrap, topic, values, PARTS, timestamps_ms=ts)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    ledger = str(tmp_path / "ledger.tsv")
    edits = {"kafka_train_input.offset_info": json.dumps({"timestamp": cut_ms / 1000.0})}
    run_in_process(cfg, ends, ledger, edits=edits)
    assert sorted(ledger_sample_ids(ledger)) == sorted(ids[300:])


def test_start_from_explicit_offsets_trains_exactly_those(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    ids, values = make_records(300, seed=3)
    where = produce(kafka_bootstrap, topic, values, PARTS)
    ends = end_offsets(kafka_bootstrap, topic)
    starts = {0: 10, 1: 55, 2: 0}
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    ledger = str(tmp_path / "ledger.tsv")
    edits = {"kafka_train_input.offset_info": json.dumps({str(p): o for p, o in starts.items()})}
    run_in_process(cfg, ends, ledger, edits=edits)
    expected = [sid for sid, (p, o) in zip(ids, where, strict=True) if o >= starts[p]]
    assert sorted(ledger_sample_ids(ledger)) == sorted(expected)


@pytest.mark.slow
def test_stop_signal_then_restart_trains_exactly_the_new_records(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    ids1, values1 = make_records(600, seed=4)
    produce(kafka_bootstrap, topic, values1, PARTS)
    ends1 = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    model_dir = str(tmp_path / "model_dir")
    ledger = str(tmp_path / "ledger.tsv")
    log = str(tmp_path / "trainer.log")

    proc = start_cli_trainer(cfg, log, "--sample_ledger", ledger)
    wait_cli_caught_up(proc, model_dir, ends1)
    open(os.path.join(model_dir, "OSS_STOP_SIGNAL"), "w").close()
    assert proc.wait(timeout=60) == 0, open(log).read()[-3000:]
    assert not os.path.exists(os.path.join(model_dir, "OSS_STOP_SIGNAL"))
    first = ledger_sample_ids(ledger)
    assert sorted(first) == sorted(ids1)
    ckpt = read_checkpoint(list_checkpoints(model_dir)[-1])
    assert ckpt.positions == ends1

    ids2, values2 = make_records(450, seed=5)
    produce(kafka_bootstrap, topic, values2, PARTS)
    ends2 = end_offsets(kafka_bootstrap, topic)
    proc = start_cli_trainer(cfg, log, "--sample_ledger", ledger)
    wait_cli_caught_up(proc, model_dir, ends2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, open(log).read()[-3000:]

    everything = ledger_sample_ids(ledger)
    second = everything[len(first):]
    assert sorted(second) == sorted(ids2)  # exactly the new records: no gap, no overlap
    dupes = [k for k, c in collections.Counter(everything).items() if c > 1]
    assert dupes == []
    last = read_ckpt_positions(model_dir)
    assert last == ends2


def read_ckpt_positions(model_dir: str) -> dict[int, int]:
    return read_checkpoint(list_checkpoints(model_dir)[-1]).positions
