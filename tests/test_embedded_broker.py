from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from odl.broker.embedded_broker import BrokerError, EmbeddedBroker, free_port
from odl.cli.kafka_cli import pid_is_broker, pid_is_keeper
from odl.harness.topic_records import produce
from odl.kafka.client_settings import consumer_config
from odl.kafka.topic_admin import Retention, create_topic, end_offsets, topic_configs
from tests.harness import wait_for_value

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
EXTERNAL_BOOTSTRAP_ENV = "ODL_KAFKA_BOOTSTRAP"  # as in conftest.py


def _kafka_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "odl.cli.kafka_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def _numbered(n: int) -> list[bytes]:
    return [f"v{i}".encode() for i in range(n)]


def _wait(condition, timeout: float, what: str):
    return wait_for_value(condition, what, timeout)


def _watermarks(bootstrap: str, topic: str) -> tuple[int, int]:
    consumer = Consumer(consumer_config(bootstrap, "odl-test"))
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
    finally:
        consumer.close()


def _retention_of(bootstrap: str, topic: str) -> dict[str, tuple[str, bool]]:
    return topic_configs(bootstrap, [topic])[topic]


def _consume_all(bootstrap: str, topic: str, partitions: int, n: int) -> list[bytes]:
    consumer = Consumer(consumer_config(bootstrap, "odl-test"))
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    values: list[bytes] = []
    deadline = time.monotonic() + 10
    try:
        while len(values) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            values.append(msg.value())
    finally:
        consumer.close()
    return values


@pytest.mark.kafka  # starts a broker of its own
def test_cli_up_status_down_and_data_survives_restart(tmp_path: Path) -> None:
    data_dir = str(tmp_path / "kafka")
    port = free_port()
    up = _kafka_cli("up", "--port", str(port), "--data-dir", data_dir)
    assert up.returncode == 0, up.stderr
    bootstrap = up.stdout.strip()
    assert bootstrap == f"127.0.0.1:{port}"
    try:
        state = json.loads((Path(data_dir) / "broker.json").read_text())
        assert state["port"] == port and state["bootstrap"] == bootstrap
        assert isinstance(state["pid"], int)

        again = _kafka_cli("up", "--port", str(free_port()), "--data-dir", data_dir)
        assert again.returncode == 2
        assert "already running" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1

        topic = "roundtrip"
        assert create_topic(bootstrap, topic, 2) == 2
        produce(bootstrap, topic, _numbered(10), 2)

        status = _kafka_cli("status", "--data-dir", data_dir)
        assert status.returncode == 0, status.stderr
        assert bootstrap in status.stdout
        assert str(state["pid"]) in status.stdout
        assert "roundtrip  partitions=2  messages=10" in status.stdout

        down = _kafka_cli("down", "--data-dir", data_dir)
        assert down.returncode == 0, down.stderr
        assert "stopped" in down.stdout
        assert not (Path(data_dir) / "broker.json").exists()
        stopped = _kafka_cli("status", "--data-dir", data_dir)
        assert stopped.returncode == 1
        assert "not running" in stopped.stdout

        up2 = _kafka_cli("up", "--port", "0", "--data-dir", data_dir)
        assert up2.returncode == 0, up2.stderr
        bootstrap = up2.stdout.strip()
        assert end_offsets(bootstrap, topic) == {0: 5, 1: 5}
        values = _consume_all(bootstrap, topic, 2, 10)
        assert sorted(values) == sorted(f"v{i}".encode() for i in range(10))
    finally:
        _kafka_cli("down", "--data-dir", data_dir)


def test_cli_up_refuses_taken_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = _kafka_cli("up", "--port", str(port), "--data-dir", str(tmp_path))
    assert res.returncode == 2
    assert "in use" in res.stderr


@pytest.mark.kafka  # starts a broker of its own
def test_embedded_broker_context_manager(tmp_path: Path) -> None:
    with EmbeddedBroker(port=0, data_dir=tmp_path) as broker:
        assert broker.is_running()
        assert broker.pid is not None
        assert broker.bootstrap.startswith("127.0.0.1:")
        assert broker.port > 0
        with pytest.raises(BrokerError):
            broker.start()
    assert not broker.is_running()
    assert (tmp_path / "broker.log").exists()


def test_embedded_broker_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(BrokerError, match="in use"):
            EmbeddedBroker(port=s.getsockname()[1], data_dir=tmp_path).start()


def test_create_topic_idempotent(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = kafka_topic_factory(create=False)
    assert create_topic(kafka_bootstrap, topic, 3) == 3
    assert create_topic(kafka_bootstrap, topic, 3) == 3
    assert create_topic(kafka_bootstrap, topic, 5) == 3  # existing topic left unchanged
    assert end_offsets(kafka_bootstrap, topic) == {0: 0, 1: 0, 2: 0}
    produce(kafka_bootstrap, topic, _numbered(7), 3)
    assert end_offsets(kafka_bootstrap, topic) == {0: 3, 1: 2, 2: 2}


def test_topic_factory_gives_unique_topics(kafka_bootstrap: str, kafka_topic_factory) -> None:
    a = kafka_topic_factory(2)
    b = kafka_topic_factory(2)
    assert a != b
    assert end_offsets(kafka_bootstrap, a) == {0: 0, 1: 0}


def test_create_topic_with_retention_keeps_only_the_newest_records(
        kafka_bootstrap: str, kafka_topic_factory) -> None:
    """Size retention set at creation: the log start moves and about the limit is kept."""
    topic = kafka_topic_factory(create=False)
    retention = Retention.from_flags(retention_mb=2, retention_hours=1)
    create_topic(kafka_bootstrap, topic, 1, retention=retention,
                 config={"max.message.bytes": "2000000"})
    assert _retention_of(kafka_bootstrap, topic) == {
        "retention.bytes": (str(2 * MIB), True), "retention.ms": ("3600000", True),
        "segment.bytes": (str(MIB), True)}
    if os.environ.get(EXTERNAL_BOOTSTRAP_ENV):
        return  # a real Kafka enforces retention every log.retention.check.interval.ms (5 min)
    produce(kafka_bootstrap, topic, [os.urandom(10_000)] * 800)  # 8 MB
    # the broker deletes whole segments, oldest first, one retention pass after another:
    # wait until it has deleted down to the limit plus at most one segment
    low, high = _wait(lambda: ((m := _watermarks(kafka_bootstrap, topic))[1] - m[0]) * 10_000
                      <= 2 * MIB + MIB + 100_000 and m, 15, "the log to shrink to the limit")
    assert high == 800
    assert (high - low) * 10_000 >= 2 * MIB  # never below the limit


@pytest.mark.kafka  # starts a broker of its own
def test_cli_up_gives_topics_without_retention_the_default(tmp_path: Path) -> None:
    """``odl-kafka up --retention_mb/--retention_hours``: topics created by anyone get them
    unless they set their own; ``create-topic`` sets its own; a restart with other values
    updates what the keeper set and nothing else; ``down`` stops the keeper too."""
    data_dir = str(tmp_path / "kafka")
    up = _kafka_cli("up", "--port", "0", "--data-dir", data_dir, "--retention_mb", "2",
                    "--retention_hours", "1")
    assert up.returncode == 0, up.stderr
    bootstrap = up.stdout.strip()
    state = json.loads((Path(data_dir) / "broker.json").read_text())
    keeper = state["retention_keeper_pid"]
    try:
        assert state["retention"] == {"retention_bytes": 2 * MIB, "retention_ms": 3_600_000}
        assert pid_is_keeper(keeper)
        create_topic(bootstrap, "plain", 1, config={"max.message.bytes": "2000000"})
        create_topic(bootstrap, "own", 1, config={"retention.bytes": "-1"})
        made = _kafka_cli("create-topic", "explicit", "--data-dir", data_dir, "--partitions",
                          "2", "--retention_mb", "4", "--retention_hours", "0")
        assert made.returncode == 0, made.stderr
        assert "created topic explicit (2 partitions" in made.stdout

        _wait(lambda: _retention_of(bootstrap, "plain")["retention.bytes"][0] == str(2 * MIB),
              10, "the keeper to set retention on 'plain'")
        assert _retention_of(bootstrap, "plain") == {
            "retention.bytes": (str(2 * MIB), True), "retention.ms": ("3600000", True),
            "segment.bytes": (str(MIB), True)}
        _wait(lambda: _retention_of(bootstrap, "own")["retention.ms"][0] == "3600000",
              10, "the keeper to set retention.ms on 'own'")
        own = _retention_of(bootstrap, "own")
        assert own["retention.bytes"] == ("-1", True) and own["segment.bytes"][1] is False
        assert _retention_of(bootstrap, "explicit") == {
            "retention.bytes": (str(4 * MIB), True), "retention.ms": ("-1", True),
            "segment.bytes": (str(MIB), True)}

        produce(bootstrap, "plain", [os.urandom(10_000)] * 600)  # 6 MB
        low, high = _wait(lambda: (m := _watermarks(bootstrap, "plain"))[0] > 0 and m, 15,
                          "the log start of 'plain' to move")
        assert (high - low) * 10_000 <= 3 * MIB + 100_000

        status = _kafka_cli("status", "--data-dir", data_dir)
        assert status.returncode == 0, status.stderr
        assert f"default retention: 2 MiB per partition, 1 h (keeper pid {keeper})" in status.stdout
        assert f"plain  partitions=1  messages={high - low}  start_offsets=0:{low}" in status.stdout
        assert "retention: 4 MiB per partition, no age limit" in status.stdout
        assert "MiB RSS" in status.stdout

        down = _kafka_cli("down", "--data-dir", data_dir)
        assert down.returncode == 0, down.stderr
        assert not pid_is_keeper(keeper) and not pid_is_broker(state["pid"])

        up = _kafka_cli("up", "--port", "0", "--data-dir", data_dir, "--retention_mb", "3")
        assert up.returncode == 0, up.stderr
        bootstrap = up.stdout.strip()
        keeper = json.loads((Path(data_dir) / "broker.json").read_text())["retention_keeper_pid"]
        _wait(lambda: _retention_of(bootstrap, "plain")["retention.bytes"][0] == str(3 * MIB),
              10, "the new default on 'plain'")
        assert _retention_of(bootstrap, "plain")["retention.ms"][0] == str(24 * 3_600_000)
        assert _retention_of(bootstrap, "own")["retention.bytes"] == ("-1", True)
        assert _retention_of(bootstrap, "explicit")["retention.bytes"] == (str(4 * MIB), True)
    finally:
        _kafka_cli("down", "--data-dir", data_dir)
    assert not pid_is_keeper(keeper)


def test_cli_rejects_negative_retention(tmp_path: Path) -> None:
    res = _kafka_cli("up", "--port", "0", "--data-dir", str(tmp_path), "--retention_mb", "-1")
    assert res.returncode == 2
    assert "retention" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "broker.json").exists()
