"""Trainer behaviour a user relies on: bad records, status API, config errors, learning."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from odl.config.pipeline_config import load_pipeline_config
from odl.datagen.synthetic_ctr import SyntheticCtrStream, encode
from odl.harness.exactly_once_audit import ledger_sample_ids
from odl.harness.http_client import get_json, http_request
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.models.model_registry import check_pipeline_config
from odl.train.trainer import Trainer, TrainerOptions
from tests.harness import REPO, run_in_process, wait_for_value, write_config

PARTS = 2

BAD_RECORDS = {
    "empty": b"",
    "field_count": b"a,b,c",
    "invalid_utf8": b"\xff\xfe\xfa" * 20,
    "bad_json": b'{"sample_id": "x", ',
}


def _bad_number(good: bytes) -> bytes:
    cols = good.split(b",")
    cols[3] = b"not-a-number"  # I1
    return b",".join(cols)


def _non_finite(good: bytes) -> bytes:
    cols = good.split(b",")
    cols[4] = b"nan"  # I2
    return b",".join(cols)


def test_bad_records_are_skipped_counted_and_good_ones_trained_once(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    ids, values = make_records(300, seed=11)
    mixed: list[bytes] = []
    expected_bad: dict[str, int] = {}
    good_ids = []
    for i, (sid, v) in enumerate(zip(ids, values, strict=True)):
        if i % 10 == 3:
            reason, bad = list(BAD_RECORDS.items())[i % len(BAD_RECORDS)]
        elif i % 10 == 7:
            if i % 20 == 7:
                reason, bad = "bad_number", _bad_number(v)
            else:
                reason, bad = "non_finite", _non_finite(v)
        else:
            mixed.append(v)
            good_ids.append(sid)
            continue
        mixed.append(bad)
        expected_bad[reason] = expected_bad.get(reason, 0) + 1
    produce(kafka_bootstrap, topic, mixed, PARTS)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    ledger = str(tmp_path / "ledger.tsv")
    trainer = run_in_process(cfg, ends, ledger, status_port=0)
    assert sorted(ledger_sample_ids(ledger)) == sorted(good_ids)
    assert trainer.records_rejected == expected_bad
    # the counts are exported to Prometheus, per reason
    from prometheus_client import generate_latest

    text = generate_latest(trainer.metrics.registry).decode()
    for reason, n in expected_bad.items():
        assert f'odl_records_rejected_total{{reason="{reason}"}} {float(n)}' in text


def test_status_api_reports_progress_offsets_and_metrics(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    topic = kafka_topic_factory(partitions=PARTS)
    _, values = make_records(400, seed=12)
    produce(kafka_bootstrap, topic, values, PARTS)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(tmp_path, kafka_bootstrap, topic)
    config = load_pipeline_config(cfg)
    check_pipeline_config(config, online=True)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=0))
    runner = threading.Thread(target=trainer.run, daemon=True)
    runner.start()
    try:
        deadline = time.time() + 60
        status = None
        while time.time() < deadline:
            try:
                doc = json.load(open(tmp_path / "model_dir" / "status.json"))
                got = get_json(doc["url"] + "/status")
                if got is not None:
                    status = got
                    # the progressive figures may lag by up to a second (recomputed at most
                    # once a second); their "samples" says what they cover
                    if (status["state"] == "training" and status["samples_trained"] == 400
                            and status["progressive"]["samples"] == 400):
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        assert status is not None and status["samples_trained"] == 400, status
        parts = status["input"]["partitions"]
        assert {int(p): v["position"] for p, v in parts.items()} == ends
        assert all(v["lag"] == 0 for v in parts.values())
        assert status["progressive"]["auc"] is not None, json.dumps(status["progressive"])
        assert status["progressive"]["window_samples"] == 400
        offsets = get_json(doc["url"] + "/offsets")
        assert {int(p): o for p, o in offsets["positions"].items()} == ends
        assert get_json(doc["url"] + "/healthz")["ok"] is True
        metrics = http_request(doc["url"] + "/metrics", timeout=5).body.decode()
        assert "odl_samples_trained_total 400.0" in metrics
        assert doc["url"].startswith("http://127.0.0.1:")
    finally:
        trainer.request_stop("test done")
        runner.join(60)
    assert trainer.state == "stopped"


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "odl.cli.train_cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize(
    "edits, field",
    [
        ({"train_config.num_steps": "abc"}, "train_config.num_steps"),
        ({"data_config.batch_size": 0}, "data_config.batch_size"),
        ({"train_config.no_such_field": 1}, "train_config.no_such_field"),
        ({"kafka_train_input.offset_info": "{not json"}, "kafka_train_input.offset_info"),
    ],
)
def test_config_errors_exit_2_and_name_the_field(tmp_path, edits, field):
    cfg = write_config(tmp_path, "127.0.0.1:1", "t")
    res = _run_cli(
        "--pipeline_config_path", cfg, "--online", "--edit_config_json", json.dumps(edits)
    )
    assert res.returncode == 2, res.stderr
    assert field in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_easyrec_field_not_implemented_is_refused_with_exit_2(tmp_path):
    cfg = tmp_path / "p.config"
    text = open(write_config(tmp_path, "127.0.0.1:1", "t")).read()
    cfg.write_text(text + "\nhive_train_input { }\n")
    res = _run_cli("--pipeline_config_path", str(cfg), "--online")
    assert res.returncode == 2
    assert "hive_train_input" in res.stderr and "not implement" in res.stderr


@pytest.mark.slow
def test_progressive_auc_reaches_90_percent_of_oracle(
    kafka_bootstrap, kafka_topic_factory, tmp_path
):
    """On the datagen stream with the sample DeepFM config, progressive AUC >= 0.9 x oracle."""
    topic = kafka_topic_factory(partitions=4)
    stream = SyntheticCtrStream(seed=21)
    n = 60_000
    batch = stream.next_batch(n)
    values = [encode(r, "csv") for r in batch.to_records()]
    produce(kafka_bootstrap, topic, values, 4)
    ends = end_offsets(kafka_bootstrap, topic)
    edits = {
        "kafka_train_input.server": kafka_bootstrap,
        "kafka_train_input.topic": topic,
        "train_config.incr_save_config.kafka.server": kafka_bootstrap,
        "train_config.incr_save_config.kafka.topic": f"{topic}-deltas",
        "model_dir": str(tmp_path / "model_dir"),
        "train_config.save_checkpoints_steps": 0,
        "train_config.metrics_window_samples": 20_000,
    }
    trainer = run_in_process(f"{REPO}/samples/deepfm_online.config", ends, edits=edits, timeout=240)
    oracle = stream.oracle_auc()
    auc = trainer.progress.window_auc()
    print(f"progressive AUC (last 20k) {auc:.4f}, oracle {oracle:.4f}, ratio {auc / oracle:.3f}")
    assert auc >= 0.9 * oracle


def _catches(pid: int, signum: int) -> bool:
    """Process ``pid`` has a handler of its own for ``signum`` (Linux: SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((int(ln.split()[1], 16) for ln in f if ln.startswith("SigCgt:")), 0)
    except OSError:  # gone (the caller sees it exit)
        return False
    return bool(caught >> (signum - 1) & 1)


def test_ctrl_c_during_start_up_exits_130_with_one_line(tmp_path):
    """SIGINT while odl-train imports and builds: one line, exit 130, no traceback."""
    import signal as _signal

    cfg = tmp_path / "p.config"
    cfg.write_text(open(f"{REPO}/samples/deepfm_online.config").read().replace(
        'model_dir: ".odl/deepfm_online"', f'model_dir: "{tmp_path / "m"}"'))
    proc = subprocess.Popen([sys.executable, "-m", "odl.cli.train_cli", "--online",
                             "--pipeline_config_path", str(cfg)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # as soon as odl-train's start-up handlers are in (it then imports torch and builds the
    # model: several seconds); a SIGINT before them would hit Python's own import-time
    # KeyboardInterrupt, which is not what this test is about
    wait_for_value(lambda: proc.poll() is not None or _catches(proc.pid, _signal.SIGTERM),
                   "odl-train's start-up signal handlers", timeout=60, interval=0.005)
    proc.send_signal(_signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    if not (tmp_path / "m" / "status.json").exists():  # stopped before the trainer ran
        assert proc.returncode == 130, err
        lines = [ln for ln in err.splitlines() if ln.startswith("odl-train:")]
        assert lines == ["odl-train: SIGINT during start-up: stopped before training"], err
    else:  # a very fast machine got past start-up: the clean stop then
        assert proc.returncode == 0, err
