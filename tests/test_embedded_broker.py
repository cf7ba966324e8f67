from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from odl.broker.embedded_broker import BrokerError, EmbeddedBroker, free_port
from odl.broker.topic_admin import create_topic, end_offsets
from odl.kafka_client import consumer_config, producer_config

REPO = Path(__file__).resolve().parents[1]


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


def _produce(bootstrap: str, topic: str, n: int, partitions: int) -> None:
    producer = Producer(producer_config(bootstrap))
    errors: list[object] = []
    for i in range(n):
        producer.produce(
            topic,
            key=str(i).encode(),
            value=f"v{i}".encode(),
            partition=i % partitions,
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
    assert producer.flush(10) == 0
    assert errors == []


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
        _produce(bootstrap, topic, 10, 2)

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
    _produce(kafka_bootstrap, topic, 7, 3)
    assert end_offsets(kafka_bootstrap, topic) == {0: 3, 1: 2, 2: 2}


def test_topic_factory_gives_unique_topics(kafka_bootstrap: str, kafka_topic_factory) -> None:
    a = kafka_topic_factory(2)
    b = kafka_topic_factory(2)
    assert a != b
    assert end_offsets(kafka_bootstrap, a) == {0: 0, 1: 0}
