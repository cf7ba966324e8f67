"""Secrets never leak: not in logs (at DEBUG), /status, checkpoints, exports or error messages.

Planted secrets: ``sasl.password`` in ``kafka_train_input.kafka_config`` and in the delta
producer's ``kafka_config`` (librdkafka ignores it while ``security.protocol`` is plaintext,
so the embedded broker still works), the bearer tokens of the status and serving APIs, and
``odl-export --oss_sk``. A short online run (train, checkpoint, publish, stop), an export and
a serving process run with DEBUG logs; then every file they wrote, every log and every HTTP
body is searched for the secrets.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from odl.cli import export_cli
from odl.config.config_edit import apply_edit_config_json
from odl.config.config_error import ConfigError
from odl.config.pipeline_config import parse_pipeline_config_text
from odl.harness.http_client import http_request
from odl.harness.topic_records import make_records, produce
from odl.kafka.topic_admin import end_offsets
from odl.protos import pipeline_pb2
from tests.harness import REPO, write_config

SASL_SECRET = "sasl-Pw-5d1f0b7e"
DELTA_SECRET = "delta-Pw-9a3c44e1"
OSS_SECRET = "oss-Sk-77e0c2d9"
TRAIN_TOKEN = "train-Tok-31b8f6a2"
SERVE_TOKEN = "serve-Tok-c04e9d15"
SERVE_SASL = "serve-Pw-0e6b2a8c"
SECRETS = (SASL_SECRET, DELTA_SECRET, OSS_SECRET, TRAIN_TOKEN, SERVE_TOKEN, SERVE_SASL)


def _http(url: str, token: str | None = None) -> tuple[int, bytes]:
    """GET with an optional Bearer token: the status and the body."""
    reply = http_request(url, headers={"Authorization": f"Bearer {token}"} if token else None,
                         timeout=10)
    return reply.status, reply.body


def _files_holding(root: str, secrets: tuple[str, ...], skip: set[str]) -> list[str]:
    hits = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if path in skip:
                continue
            with open(path, "rb") as f:
                data = f.read()
            hits += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return hits


@pytest.mark.slow
def test_secrets_stay_out_of_logs_status_checkpoints_and_exports(
        kafka_bootstrap, kafka_topic_factory, tmp_path):
    topic = kafka_topic_factory(partitions=2)
    deltas = kafka_topic_factory(prefix="deltas", create=False)
    dlq = kafka_topic_factory(prefix="dlq", create=False)
    _, values = make_records(256, seed=5)
    produce(kafka_bootstrap, topic, values + [b"bad,record"], 2)
    ends = end_offsets(kafka_bootstrap, topic)
    cfg = write_config(
        tmp_path, kafka_bootstrap, topic,
        kafka_extra=f'kafka_config {{ key: "sasl.password" value: "{SASL_SECRET}" }} '
                    'kafka_config { key: "sasl.username" value: "odl" }',
        extra_train=f'incr_save_config {{ sparse_save_steps: 2 dense_save_steps: 2 '
                    f'kafka {{ server: "{kafka_bootstrap}" topic: "{deltas}" '
                    f'kafka_config {{ key: "sasl.password" value: "{DELTA_SECRET}" }} }} }}')
    model_dir = str(tmp_path / "model_dir")
    token_file = tmp_path / "train.token"
    token_file.write_text(TRAIN_TOKEN + "\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    train_log = logs / "train.log"
    edits = json.dumps({"data_config.dead_letter_topic": dlq})
    trainer = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", cfg, "--online",
         "--device", "cpu", "--status_port", "0", "--log_level", "DEBUG",
         "--auth_token_file", str(token_file), "--edit_config_json", edits],
        stdout=open(train_log, "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    bodies: list[bytes] = []
    try:
        deadline = time.time() + 180
        while True:
            assert trainer.poll() is None, train_log.read_text()[-3000:]
            assert time.time() < deadline, "trainer did not catch up"
            try:
                url = json.load(open(os.path.join(model_dir, "status.json")))["url"]
            except (OSError, ValueError):
                time.sleep(0.3)
                continue
            code, body = _http(url + "/status", TRAIN_TOKEN)
            if code == 200:
                st = json.loads(body)
                pos = {int(p): v["position"] for p, v in st["input"]["partitions"].items()}
                if pos == ends and st["dead_letter"]["delivered"] == 1:
                    break
            time.sleep(0.3)
        assert _http(url + "/status")[0] == 401
        assert _http(url + "/healthz")[0] == 200
        for path in ("/status", "/offsets", "/metrics", "/healthz"):
            code, body = _http(url + path, TRAIN_TOKEN)
            assert code == 200, path
            bodies.append(body)
    finally:
        trainer.send_signal(signal.SIGTERM)
        rc = trainer.wait(120)
    assert rc == 0, train_log.read_text()[-3000:]
    assert st["records_rejected"] == {"field_count": 1}

    # odl-export in-process (saves a process start), every log record at DEBUG to a file.
    exports = tmp_path / "exports"
    handler = logging.FileHandler(logs / "export.log")
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = export_cli.main(["--pipeline_config_path", cfg, "--export_dir", str(exports),
                                  "--oss_ak", "AKID", "--oss_sk", OSS_SECRET,
                                  "--log_level", "DEBUG"])
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
    (logs / "export.out").write_text(out.getvalue() + err.getvalue())
    assert rc == 0, err.getvalue()
    assert (logs / "export.log").stat().st_size > 0

    serve_token = tmp_path / "serve.token"
    serve_token.write_text(SERVE_TOKEN)
    serve_log = logs / "serve.log"
    serve = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.serve_cli", "--export_dir", str(exports), "--port", "0",
         "--log_level", "DEBUG", "--auth_token_file", str(serve_token),
         "--kafka_config", json.dumps({"sasl.password": SERVE_SASL})],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    serve_out = []
    try:
        port = None
        for line in iter(serve.stdout.readline, b""):
            serve_out.append(line)
            if b"ready on http://127.0.0.1:" in line:
                port = int(line.split(b"127.0.0.1:")[1].split()[0])
                break
        assert port, b"".join(serve_out).decode()[-3000:]
        base = f"http://127.0.0.1:{port}"
        assert _http(base + "/status")[0] == 401
        assert _http(base + "/status", "nope")[0] == 401
        assert _http(base + "/healthz")[0] == 200
        for path in ("/status", "/metrics"):
            code, body = _http(base + path, SERVE_TOKEN)
            assert code == 200, path
            bodies.append(body)
        predicted = http_request(base + "/predict", values[0],
                                 {"Authorization": f"Bearer {SERVE_TOKEN}"})
        assert predicted.status == 200
    finally:
        serve.send_signal(signal.SIGTERM)
        out, _ = serve.communicate(timeout=60)
        serve_out.append(out or b"")
    serve_log.write_bytes(b"".join(serve_out))
    assert serve.returncode == 0

    # DEBUG logs were really written, and the secrets are nowhere.
    assert b"DEBUG" in train_log.read_bytes()
    assert os.listdir(model_dir) and any(n.startswith("model.ckpt-") for n in os.listdir(model_dir))
    assert _files_holding(model_dir, SECRETS, set()) == []
    assert _files_holding(str(exports), SECRETS, set()) == []
    assert _files_holding(str(logs), SECRETS, set()) == []
    for body in bodies:
        assert not any(s.encode() in body for s in SECRETS), body[:500]
    # The saved configs show the masks, not nothing: the keys are kept.
    saved = [os.path.join(d, n) for d, _, ns in os.walk(tmp_path) for n in ns
             if n == "pipeline.config" and os.path.join(d, n) != cfg]
    assert saved and all('"***"' in open(p).read() for p in saved)


SECRET = "Zq9-never-print-me"


@pytest.mark.parametrize("text", [
    f'kafka_train_input {{ kafka_config {{ key: "sasl.password" value: {SECRET} }} }}',
    f'kafka_train_input {{ kafka_config {{ key: "sasl.password" value: "{SECRET}',
    f'kafka_train_input {{\n  kafka_config {{\n    key: "sasl.password"\n    value: {SECRET}\n'
    '  }\n}',
    f'datahub_train_input {{ akId: "id" akSecret: "{SECRET}',
    f'datahub_train_input {{ akId: "id" akSecret: "{SECRET}" unknown_field: 1 }}',
])
def test_config_parse_errors_do_not_echo_secret_values(text):
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config_text(text)
    assert SECRET not in str(info.value)
    assert "kafka_config" in str(info.value) or "datahub" in str(info.value)


@pytest.mark.parametrize("edit", [
    {"kafka_train_input.kafka_config": SECRET},
    {"kafka_train_input.kafka_config": [SECRET]},
    {"kafka_train_input.kafka_config": {"sasl.password": [SECRET]}},
    {"kafka_train_input": f'kafka_config {{ key: "sasl.password" value: {SECRET} }}'},
])
def test_config_edit_errors_do_not_echo_secret_values(edit):
    with pytest.raises(ConfigError) as info:
        apply_edit_config_json(pipeline_pb2.EasyRecConfig(), json.dumps(edit))
    assert SECRET not in str(info.value)
