"""Training, exporting and serving with everything on the cloud doubles (real ``oss2`` and
``pydatahub`` against ``odl.harness.oss_double`` / ``datahub_double``).

* An ``odl-train`` reading DataHub, whose pipeline config and ``model_dir`` are on OSS, is
  SIGKILLed during checkpoint uploads (uploads slowed so a kill lands between the model file
  and ``DONE``) and while reading and training, restarted each time, then stopped cleanly:
  every record is reflected exactly once in what serving sees (the delta topic on Kafka),
  and no reader ever took a half-uploaded checkpoint.
* ``odl-export --export_dir oss://... --oss_path oss://...`` and ``odl-serve --export_dir
  oss://...`` then predict what the trainer's final checkpoint predicts (<= 1e-6).
* While OSS is down the trainer keeps training and reports the failing checkpoints; when OSS
  is back the next checkpoint commits; ``OSS_STOP_SIGNAL`` on OSS stops it cleanly.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from odl.checkpoint.checkpoint_chain import chain_of
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint
from odl.cli import export_cli
from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.features.feature_builder import FeatureBuilder
from odl.harness.datahub_double import DatahubDouble
from odl.harness.delta_topic_audit import published_versions
from odl.harness.exactly_once_audit import reflected_exactly_once
from odl.harness.http_client import free_port, get_json, post_json
from odl.harness.topic_records import make_records, produce
from odl.harness.trainer_killer import TrainerKiller
from odl.harness.trainer_process import start_cli_trainer, trainer_json
from odl.kafka.topic_admin import end_offsets
from odl.storage import file_store
from odl.train.sample_ledger import read_ledger
from odl.train.train_module import TrainModule
from tests.harness import REPO, write_config

PARTS = 2
BUCKET = "odl-test"


def _oss_config(tmp_path, bootstrap: str, topic: str, delta_topic: str, ckpt_steps: int,
                extra: str = "", datahub: str = "") -> tuple[str, str]:
    """Writes the pipeline config to OSS; returns ``(config path, model_dir)`` (both oss://).

    ``datahub``: the endpoint of a DataHub double to read ``odl/<topic>`` from instead of
    Kafka.
    """
    model_dir = f"oss://{BUCKET}/jobs/ctr/model_dir"
    incr = (f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 '
            f'kafka {{ server: "{bootstrap}" topic: "{delta_topic}" }} }} {extra}')
    local = write_config(tmp_path, bootstrap, topic, batch_size=40, extra_train=incr,
                         save_checkpoints_steps=ckpt_steps)
    text = open(local).read().replace(str(tmp_path / "model_dir"), model_dir)
    text = text.replace("keep_checkpoint_max: 3", "keep_checkpoint_max: 4")
    if datahub:
        text = re.sub(r"kafka_train_input \{[^}]*\}",
                      f'datahub_train_input {{ akId: "dh-id" akSecret: "dh-secret" '
                      f'endpoint: "{datahub}" project: "odl" topic: "{topic}" }}', text)
    path = f"oss://{BUCKET}/jobs/ctr/pipeline.config"
    file_store.write_bytes(path, text.encode())
    return path, model_dir


def _upload_in_flight(oss, model_dir_key: str) -> bool:
    """A checkpoint's model file is on OSS and its DONE is not (a kill now cuts an upload)."""
    puts = [p for m, p, *_ in list(oss.requests_log) if m == "PUT" and model_dir_key in p]
    started = {p.rsplit("/", 2)[-2] for p in puts if p.endswith("/model.pt")}
    done = {p.rsplit("/", 2)[-2] for p in puts if p.endswith("/DONE")}
    return bool(started - done)


@pytest.mark.slow
def test_datahub_to_oss_kills_during_uploads_and_reads_exactly_once_then_serve_from_oss(
        oss, kafka_bootstrap, kafka_topic_factory, tmp_path, capsys):
    topic = "samples"
    delta_topic = kafka_topic_factory(partitions=1, prefix="delta", create=False)
    ids, values = make_records(3000, seed=31)
    with DatahubDouble() as dh:
        dh.create_topic("odl", topic, shards=PARTS)
        for shard in range(PARTS):
            dh.append("odl", topic, str(shard), values[shard::PARTS])
        ends = {shard: len(values[shard::PARTS]) for shard in range(PARTS)}
        cfg, model_dir = _oss_config(tmp_path, kafka_bootstrap, topic, delta_topic,
                                     ckpt_steps=5, datahub=dh.endpoint)
        ledger = str(tmp_path / "ledger.tsv")
        # every checkpoint object takes 0.15 s more: uploads are long enough to be cut
        oss.delay_next(10**6, 0.15, methods=("PUT",),
                       key_prefix="jobs/ctr/model_dir/model.ckpt-")
        # DataHub reads are slowed too, so kills also land while records are being read
        dh.delay_next(10**6, 0.01)
        killer = TrainerKiller(cfg, model_dir, str(tmp_path / "trainer.log"), ledger,
                               random.Random(7))
        cut = 0
        try:
            for i in range(3):  # two kills aimed at an upload, one in training
                if i % 2 == 0:
                    cut += killer.start_and_kill(
                        aim="when", when=lambda: _upload_in_flight(oss, "jobs/ctr/model_dir/"),
                        max_delay=1.0)["phase"] == "when"
                else:
                    killer.start_and_kill(aim="training", max_delay=2.0)
            oss.delay_next(0, 0.0)
            dh.delay_next(0, 0.0)
            killer.finish(ends)
        finally:
            killer.cleanup()
    assert cut >= 1, killer.kills  # at least one kill landed mid-upload

    complete = published_versions(kafka_bootstrap, delta_topic)
    lost, twice = reflected_exactly_once(ids, read_ledger(ledger), complete)
    assert lost == [] and twice == [], (len(lost), len(twice), killer.kills)
    ckpts = list_checkpoints(model_dir)
    final = read_checkpoint(ckpts[-1])
    assert final.positions == ends
    # the newest 4 are kept, and the full checkpoints and increments their chains read from
    chains = {kept: chain_of(kept, verify_links=False) for kept in ckpts[-4:]}
    assert set(ckpts) == {p for chain in chains.values() for p in chain}, (ckpts, chains)
    assert any(len(chain) > 1 for chain in chains.values()), chains  # increments on OSS
    assert final.source["source"] == "datahub" and final.source["topic"] == f"odl/{topic}"
    # nothing uncommitted left behind after the clean stop
    keys = oss.objects(BUCKET, "jobs/ctr/model_dir/")
    ckpt_dirs = {k.split("/")[3] for k in keys if k.split("/")[3].startswith("model.ckpt-")}
    assert ckpt_dirs == {p.rsplit("/", 1)[-1] for p in ckpts}, sorted(ckpt_dirs)
    assert "dh-secret" not in open(tmp_path / "trainer.log").read()

    # export to OSS (embeddings elsewhere on OSS), serve from OSS: same predictions
    env = dict(os.environ)
    export_dir = f"oss://{BUCKET}/jobs/ctr/exports"
    capsys.readouterr()
    rc = export_cli.main(["--pipeline_config_path", cfg, "--export_dir", export_dir,
                          "--oss_path", f"oss://{BUCKET}/jobs/ctr/emb"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip().startswith(export_dir + "/")
    assert oss.objects(BUCKET, "jobs/ctr/emb/")
    config = load_pipeline_config(cfg)
    fb = FeatureBuilder(config)
    records = SyntheticCtrStream(seed=5).next_batch(300).encode("csv")
    module = TrainModule(config, fb, device="cpu")
    module.load_checkpoint_state(final.state)
    expected = module.predict(fb.build(records).batch)
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.serve_cli", "--export_dir", export_dir, "--port",
         str(port), "--no_replay"], stdout=open(tmp_path / "serve.log", "ab"),
        stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and status is None:
            assert serve.poll() is None, open(tmp_path / "serve.log").read()
            status = get_json(url + "/status")
            time.sleep(0.1)
        assert status is not None and status["base_export"].startswith(export_dir)
        served = post_json(url + "/predict", b"\n".join(records))
        assert served["version"] == final.global_step
        diff = float(np.abs(np.asarray(served["probabilities"]) - expected).max())
        assert diff <= 1e-6, diff
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()


def _wait(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} waiting for {what}")
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_trains_through_an_oss_outage_and_stops_on_the_oss_stop_signal(
        oss, kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory(partitions=PARTS)
    delta_topic = kafka_topic_factory(partitions=1, prefix="delta", create=False)
    cfg, model_dir = _oss_config(
        tmp_path, kafka_bootstrap, topic, delta_topic, ckpt_steps=4)
    _ids, values = make_records(4000, seed=41)
    produce(kafka_bootstrap, topic, values[:1000], PARTS)
    proc = start_cli_trainer(cfg, str(tmp_path / "trainer.log"))
    try:
        def status() -> dict | None:
            return trainer_json(model_dir, "/status", pid=proc.pid)

        _wait(lambda: (status() or {}).get("last_checkpoint", {}).get("step"), 120,
              "a first checkpoint", proc)
        oss.set_down(True)
        produce(kafka_bootstrap, topic, values[1000:2500], PARTS)
        st = _wait(lambda: (s := status()) and s["last_checkpoint"]["error"] and
                   s["samples_trained"] >= 2000 and s, 120, "training on with OSS down", proc)
        down_step = st["last_checkpoint"]["step"]
        assert st["oss"]["healthy"] is False and st["oss"]["failures"] >= 1
        metrics = open_metrics(model_dir, proc.pid)
        assert "odl_oss_up 0.0" in metrics and "odl_checkpoint_failures_total" in metrics
        oss.set_down(False)
        produce(kafka_bootstrap, topic, values[2500:], PARTS)
        ends = end_offsets(kafka_bootstrap, topic)
        _wait(lambda: (s := status()) and s["last_checkpoint"]["error"] is None
              and s["last_checkpoint"]["step"] > down_step
              and all(s["input"]["partitions"].get(str(p), {}).get("position", -1) >= e
                      for p, e in ends.items()), 120, "a checkpoint after OSS is back", proc)
        file_store.write_bytes(f"{model_dir}/OSS_STOP_SIGNAL", b"")
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert not file_store.is_file(f"{model_dir}/OSS_STOP_SIGNAL")  # consumed
    final = read_checkpoint(list_checkpoints(model_dir)[-1])
    assert final.positions == ends


def open_metrics(model_dir: str, pid: int) -> str:
    """The trainer's ``/metrics`` text."""
    import urllib.request

    from odl.harness.trainer_process import trainer_url

    url = trainer_url(model_dir, pid)
    assert url is not None
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()
