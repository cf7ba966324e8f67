"""``odl-train --online`` as two ranks under ``torchrun``: each reads its partitions, they
step in lock-step, checkpoint and publish together, and every record is trained exactly once
(as the checkpoints and as serving see it). Files and file streams on two ranks:
``test_distributed_file_stream.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from odl.checkpoint.checkpoint_manager import (
    checkpoint_step,
    list_checkpoints,
    read_checkpoint,
)
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.export.exporter import export_checkpoint
from odl.features.feature_builder import FeatureBuilder
from odl.harness.datahub_double import DatahubDouble
from odl.harness.delta_topic_audit import published_versions
from odl.harness.exactly_once_audit import ledger_sample_ids, reflected_exactly_once
from odl.harness.http_client import free_port, get_json, post_json
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.train.job_status import STALE_AFTER_S
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from odl.train.trainer_status import STATUS_FILE
from tests.harness import make_half_dynamic, write_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stream(bootstrap: str, topic_factory, tmp_path, partitions: int, records: int,
            seed: int, batch_size: int, checkpoint_steps: int, extra_train: str = ""):
    """A topic of ``records`` test records over ``partitions`` and a config reading it:
    ``(sample ids, end offsets, config path)``."""
    topic = topic_factory(partitions=partitions)
    ids, values = make_records(records, seed=seed)
    produce(bootstrap, topic, values, partitions)
    cfg = write_config(tmp_path, bootstrap, topic, batch_size=batch_size,
                       save_checkpoints_steps=checkpoint_steps, extra_train=extra_train)
    return ids, end_offsets(bootstrap, topic), cfg


def _torchrun(cfg: str, ledger: str, log, *extra: str,
              launch: tuple[str, ...] = ("--standalone", "--nproc_per_node", "2"),
              status_port: int = -1) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch, *extra,
           "-m", "odl.cli.train_cli", "--pipeline_config_path", cfg, "--online",
           "--device", "cpu", "--status_port", str(status_port), "--sample_ledger", ledger,
           "--log_level", "WARNING"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait_until(cond, proc: subprocess.Popen, log_path, secs: float = 240) -> None:
    deadline = time.monotonic() + secs
    while not cond():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.3)


def _kill_tree(proc: subprocess.Popen) -> None:
    """torchrun and every process under it (ranks, their input processes), if still up."""
    if proc.poll() is not None:
        return
    for child in psutil.Process(proc.pid).children(recursive=True):
        child.kill()
    proc.kill()
    proc.wait(30)


def _stop_ranks(proc: subprocess.Popen, log_path) -> None:
    """SIGTERM to the ranks themselves (torchrun's agent reports its own SIGTERM as a
    failure): the first to see it tells the other, both checkpoint and exit 0, and so does
    torchrun."""
    for rank in psutil.Process(proc.pid).children():
        rank.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0, log_path.read_text()[-3000:]


def _entries(ledger: str) -> list[tuple[str, int, str]]:
    return read_ledger(ledger + ".rank0") + read_ledger(ledger + ".rank1")


def _trained(ledger: str, generation: str | None = None) -> set[str]:
    """Sample ids in the ranks' ledgers (of one generation, or all)."""
    return {sid for gen, _, sid in _entries(ledger) if generation in (None, gen)}


def _job_documents(model_dir, samples: int, proc: subprocess.Popen, log_path
                   ) -> tuple[dict, dict]:
    """Rank 0's ``/status`` once it counts ``samples`` trained over the job, and
    ``/offsets`` then."""
    status_file = model_dir / STATUS_FILE
    _wait_until(status_file.exists, proc, log_path)
    url = json.loads(status_file.read_text())["url"]
    status: dict = {}

    def counted() -> bool:
        status.update(get_json(url + "/status") or {})
        return status.get("samples_trained") == samples

    _wait_until(counted, proc, log_path, secs=30)
    return status, get_json(url + "/offsets")


def _train_all_and_stop(cfg: str, ids: list[str], tmp_path, job: list | None = None,
                        while_up=None) -> str:  # noqa: ANN001
    """Two ranks under torchrun until their ledgers hold every id, then a clean stop (the
    final checkpoint covers every record); returns the ledger path (one file per rank).
    ``job``: rank 0 serves its API, and its ``/status`` and ``/offsets`` once the job counts
    every record are appended to it; then ``while_up(url, proc, log_path)`` runs, if given,
    before the stop."""
    ledger = str(tmp_path / "ledger.tsv")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = _torchrun(cfg, ledger, log, status_port=-1 if job is None else 0)
        try:
            _wait_until(lambda: _trained(ledger) >= set(ids), proc, log_path)
            if job is not None:
                job.extend(_job_documents(tmp_path / "model_dir", len(ids), proc, log_path))
                if while_up is not None:
                    url = json.loads((tmp_path / "model_dir" / STATUS_FILE).read_text())["url"]
                    while_up(url, proc, log_path)
            _stop_ranks(proc, log_path)
        finally:
            _kill_tree(proc)
    return ledger


def _rank_1_stopped_and_resumed(url: str, proc: subprocess.Popen, log_path) -> None:
    """Rank 0's ``/metrics`` has every partition's lag and rank 1's gauges; rank 1 stopped
    with SIGSTOP makes ``/healthz`` 503 naming it within seconds, ``/status`` and
    ``/offsets`` say so; after SIGCONT the job is healthy again."""
    from tests.test_job_status import _get_text, _healthz, _metric

    status = get_json(url + "/status")
    metrics = _get_text(url + "/metrics")
    for p in status["input"]["partitions"]:
        assert _metric(metrics, "odl_partition_lag", partition=p) == 0
    assert _metric(metrics, "odl_rank_up", rank="1") == 1
    assert _metric(metrics, "odl_rank_samples_trained", rank="1") == status["ranks"][1][
        "samples_trained"]
    assert _healthz(url)[0] == 200
    rank1 = psutil.Process(status["ranks"][1]["pid"])
    rank1.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        def unhealthy() -> bool:
            return _healthz(url)[0] == 503
        _wait_until(unhealthy, proc, log_path, secs=30)
        assert time.monotonic() - stopped_at < STALE_AFTER_S + 5
        body = _healthz(url)[1]
        assert "rank 1 has not reported" in body["reason"], body
        assert [r["answering"] for r in get_json(url + "/status")["ranks"]] == [True, False]
        assert get_json(url + "/offsets")["stale_ranks"] == [1]
        assert _metric(_get_text(url + "/metrics"), "odl_rank_up", rank="1") == 0
    finally:
        rank1.send_signal(signal.SIGCONT)
    _wait_until(lambda: _healthz(url)[0] == 200, proc, log_path, secs=30)


@pytest.mark.slow
def test_two_ranks_under_torchrun_train_every_record_once(kafka_bootstrap, kafka_topic_factory,
                                                         tmp_path):
    """Two ranks train every record of a 4-partition topic once; rank 0 scores an eval
    stream at every checkpoint (the other rank joining its predictions) and the checkpoints
    keep the eval positions. Rank 0's API describes the job: every partition at its end with
    the rank reading it, the job's samples and each rank's; a rank stopped with SIGSTOP is
    seen within seconds and the job recovers after SIGCONT."""
    eval_topic = kafka_topic_factory(partitions=1, prefix="eval")
    produce(kafka_bootstrap, eval_topic, make_records(300, seed=31)[1], 1)
    ids, ends, cfg = _stream(kafka_bootstrap, kafka_topic_factory, tmp_path, partitions=4,
                             records=1500, seed=21, batch_size=64, checkpoint_steps=4)
    with open(cfg, "a") as f:
        f.write(f'\nkafka_eval_input {{ server: "{kafka_bootstrap}" topic: "{eval_topic}" }}\n')
    job: list = []
    ledger = _train_all_and_stop(cfg, ids, tmp_path, job, _rank_1_stopped_and_resumed)
    status, offsets = job
    parts = status["input"]["partitions"]
    assert {p: st["position"] for p, st in parts.items()} == {str(p): e for p, e in ends.items()}
    assert {st["rank"] for st in parts.values()} == {0, 1}
    assert status["world_size"] == 2 and [r["rank"] for r in status["ranks"]] == [0, 1]
    assert all(r["samples_trained"] > 0 and r["healthy"] for r in status["ranks"])
    assert sorted(status["ranks"][0]["partitions"] + status["ranks"][1]["partitions"]) == [
        0, 1, 2, 3]
    assert offsets["positions"] == {str(p): e for p, e in ends.items()}
    assert offsets["stale_ranks"] == []
    assert {int(p): r for p, r in offsets["partition_ranks"].items()} == {
        int(p): st["rank"] for p, st in parts.items()}
    model_dir = str(tmp_path / "model_dir")
    trained = ledger_sample_ids(ledger + ".rank0") + ledger_sample_ids(ledger + ".rank1")
    assert sorted(trained) == sorted(ids)  # every record once, over both ranks
    assert ledger_sample_ids(ledger + ".rank0") and ledger_sample_ids(ledger + ".rank1")
    ckpt = read_checkpoint(list_checkpoints(model_dir)[-1])
    assert ckpt.positions == ends
    assert ckpt.source["eval_positions"] == {"0": 300}  # every eval record scored
    # the checkpoint, written by rank 0 from both ranks' rows, restores into one process
    config = load_pipeline_config(cfg)
    one = TrainModule(config, FeatureBuilder(config), device="cpu")
    one.load_checkpoint_state(ckpt.state)
    assert one.global_step == ckpt.global_step > 0


@pytest.mark.slow
def test_two_ranks_split_a_datahub_topics_shards(tmp_path):
    """DataHub input under torchrun (the real SDK against the loopback double): rank r reads
    the shards s with s % 2 == r, every record is trained once over both ranks, and the final
    checkpoint holds every shard's end. Rank 0's ``/status`` and ``/offsets`` show every
    shard at its end with the rank reading it, and the job's samples."""
    ids, values = make_records(900, seed=24)
    with DatahubDouble() as dh:
        dh.create_topic("odl", "samples", shards=3)
        for s in range(3):
            dh.append("odl", "samples", str(s), values[s::3])
        cfg = write_config(tmp_path, "127.0.0.1:1", "unused", batch_size=64,
                           save_checkpoints_steps=4)
        text = re.sub(r"kafka_train_input \{[^}]*\}",
                      'datahub_train_input { akId: "dh-id" akSecret: "dh-secret" '
                      f'endpoint: "{dh.endpoint}" project: "odl" topic: "samples" }}',
                      open(cfg).read())
        open(cfg, "w").write(text)
        job: list = []
        ledger = _train_all_and_stop(cfg, ids, tmp_path, job)
    assert sorted(ledger_sample_ids(ledger + ".rank0") + ledger_sample_ids(ledger + ".rank1")
                  ) == sorted(ids)
    ckpt = read_checkpoint(list_checkpoints(str(tmp_path / "model_dir"))[-1])
    assert ckpt.positions == {0: 300, 1: 300, 2: 300}
    status, offsets = job
    assert {p: (st["position"], st["rank"]) for p, st in status["input"]["partitions"].items()
            } == {"0": (300, 0), "1": (300, 1), "2": (300, 0)}  # shard s on rank s % 2
    assert [(r["rank"], r["partitions"]) for r in status["ranks"]] == [(0, [0, 2]), (1, [1])]
    assert [r["samples_trained"] for r in status["ranks"]] == [600, 300]
    assert offsets["positions"] == {"0": 300, "1": 300, "2": 300}


@pytest.mark.slow
def test_two_hosts_meet_at_a_rendezvous_and_train_every_record_once(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """Two torchrun agents (one per host, here both on loopback) of one rank each, meeting
    at a c10d rendezvous as the systemd/odl-train-hosts.conf drop-in starts them: the job
    trains every record once over both hosts' ranks, and a SIGTERM on one host stops both."""
    ids, ends, cfg = _stream(kafka_bootstrap, kafka_topic_factory, tmp_path, partitions=2,
                             records=800, seed=23, batch_size=64, checkpoint_steps=4)
    ledger = str(tmp_path / "ledger.tsv")
    launch = ("--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
              "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "odl-hosts-test")
    logs = [tmp_path / f"host{h}.log" for h in range(2)]
    with open(logs[0], "wb") as log0, open(logs[1], "wb") as log1:
        hosts = [_torchrun(cfg, ledger, log, launch=launch) for log in (log0, log1)]
        try:
            _wait_until(lambda: _trained(ledger) >= set(ids), hosts[0], logs[0])
            _stop_ranks(hosts[1], logs[1])  # the other host's rank stops with it
            assert hosts[0].wait(120) == 0, logs[0].read_text()[-3000:]
        finally:
            for proc in hosts:
                _kill_tree(proc)
    trained = ledger_sample_ids(ledger + ".rank0") + ledger_sample_ids(ledger + ".rank1")
    assert sorted(trained) == sorted(ids)
    assert read_checkpoint(list_checkpoints(str(tmp_path / "model_dir"))[-1]).positions == ends


@pytest.mark.slow
def test_kill_9_of_one_rank_restarts_both_at_the_last_version_serving_sees(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    """SIGKILL of rank 1 mid-stream while rank 0 publishes both ranks' rows: torchrun
    restarts both ranks; rank 0 reads the delta topic and both continue from the last
    complete version (its rows on whichever rank's shard holds them, its positions of every
    partition). Every record is reflected in the versions serving applies exactly once, and
    serving replaying the topic onto an export of the first checkpoint predicts what the
    final checkpoint predicts. Every other id feature's tables are dynamic (EasyRec's
    ``ev_params``, small enough to evict) with their index split by id over the two ranks
    (each rank publishes and recovers its own partitions' ids), the others fixed tables
    placed whole on either rank: the kill lands on both kinds."""
    delta_topic = kafka_topic_factory(partitions=1, prefix="delta", create=False)
    incr = (f"incr_save_config {{ sparse_save_steps: 3 dense_save_steps: 3 "
            f'kafka {{ server: "{kafka_bootstrap}" topic: "{delta_topic}" }} }}')
    ids, ends, cfg = _stream(kafka_bootstrap, kafka_topic_factory, tmp_path, partitions=2,
                             records=3000, seed=22, batch_size=32, checkpoint_steps=8,
                             extra_train=incr)
    text = open(cfg).read().replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 0")
    open(cfg, "w").write(text.replace("train_config {",
                                      "train_config {\n  dynamic_index_partitions: 2", 1))
    assert len(make_half_dynamic(cfg, "ev_params { max_capacity: 256 }")) >= 2
    ledger = str(tmp_path / "ledger.tsv")
    model_dir = str(tmp_path / "model_dir")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "wb") as log:
        proc = _torchrun(cfg, ledger, log, "--max-restarts", "1")
        try:
            def mid_stream() -> bool:  # a checkpoint's step is in its name: nothing loaded
                ckpts = list_checkpoints(model_dir)
                return bool(ckpts) and checkpoint_step(ckpts[-1]) >= 10
            _wait_until(mid_stream, proc, log_path)
            ranks = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
            ranks[-1].kill()  # SIGKILL, no goodbye
            killed = read_checkpoint(list_checkpoints(model_dir)[-1]).manifest["generation"]
            want = set(ids)

            def caught_up() -> bool:  # the new generation trained what serving lacks
                entries = _entries(ledger)
                new = {sid for gen, _, sid in entries if gen != killed}
                # kept (below) is a part of the ledger: until the ledger holds every id the
                # answer is no, without reading the whole delta topic
                if not new or not {sid for _, _, sid in entries} >= want:
                    return False
                complete = published_versions(kafka_bootstrap, delta_topic)
                kept = {sid for gen, step, sid in entries
                        if gen == killed and step <= complete.get(killed, -1)}
                return kept | new >= want
            _wait_until(caught_up, proc, log_path)
            _stop_ranks(proc, log_path)
        finally:
            _kill_tree(proc)
    complete = published_versions(kafka_bootstrap, delta_topic)
    assert len(complete) == 2  # the killed job's and the restarted one's
    lost, twice = reflected_exactly_once(ids, _entries(ledger), complete)
    assert lost == [] and twice == []
    final = read_checkpoint(list_checkpoints(model_dir)[-1])
    assert final.positions == ends
    assert complete[final.manifest["generation"]] == final.global_step
    # each rank's partition of the dynamic tables in the checkpoint, both evicting
    parts = final.state["dynamic_tables"]["parts"]
    assert sorted(parts) == [0, 1]
    assert all(any(int(t["counters"]["evicted"]) for t in part["tables"].values())
               for part in parts.values())

    # serving: the first checkpoint's export plus the topic is the final model
    config = load_pipeline_config(cfg)
    export_dir = str(tmp_path / "export")
    export_checkpoint(config, list_checkpoints(model_dir)[0], export_dir)
    records = SyntheticCtrStream(seed=99).next_batch(300).encode("csv")
    one = TrainModule(config, FeatureBuilder(config), device="cpu")
    one.load_checkpoint_state(final.state)
    expected = one.predict(FeatureBuilder(config).build(records).batch)
    port = free_port()
    with open(tmp_path / "serve.log", "wb") as serve_log:
        serve = subprocess.Popen([sys.executable, "-m", "odl.cli.serve_cli", "--export_dir",
                                  export_dir, "--port", str(port)], cwd=REPO,
                                 stdout=serve_log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            status: dict = {}
            deadline = time.monotonic() + 120
            while status.get("version") != final.global_step or status.get("lag_messages"):
                assert serve.poll() is None and time.monotonic() < deadline, status
                time.sleep(0.2)
                status = get_json(url + "/status") or {}
            served = post_json(url + "/predict", b"\n".join(records))
        finally:
            serve.terminate()
            serve.wait(30)
    assert served["version"] == final.global_step
    assert float(np.abs(np.asarray(served["probabilities"]) - expected).max()) <= 1e-6
