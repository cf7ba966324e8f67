"""Helpers for tests that run the trainer against the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Optional

import psutil
from confluent_kafka import Producer

from odl.config.pipeline_config import load_pipeline_config, validate_pipeline_config
from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream, encode
from odl.kafka.client_settings import producer_config
from odl.kafka.topic_admin import end_offsets
from odl.train.sample_ledger import read_ledger as read_ledger_file
from odl.train.trainer import Trainer, TrainerOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def produce(
    bootstrap: str,
    topic: str,
    values: list[bytes],
    partitions: int,
    keys: Optional[list[str]] = None,
    timestamps_ms: Optional[list[int]] = None,
) -> list[tuple[int, int]]:
    """Produces values round robin over partitions; returns (partition, offset) per value."""
    producer = Producer(producer_config(bootstrap))
    where: list[Optional[tuple[int, int]]] = [None] * len(values)
    errors: list[str] = []

    def report(i: int):
        def cb(err, msg):
            if err is not None:
                errors.append(str(err))
            else:
                where[i] = (msg.partition(), msg.offset())

        return cb

    for i, v in enumerate(values):
        kw = {}
        if timestamps_ms is not None:
            kw["timestamp"] = timestamps_ms[i]
        while True:
            try:
                producer.produce(
                    topic,
                    value=v,
                    key=keys[i] if keys else None,
                    partition=i % partitions,
                    on_delivery=report(i),
                    **kw,
                )
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.05)
        if i % 1000 == 999:
            producer.poll(0)
    assert producer.flush(30) == 0
    assert not errors, errors
    return [w for w in where if w is not None]


def make_records(n: int, seed: int = 0, fmt: str = "csv") -> tuple[list[str], list[bytes]]:
    """n synthetic records: (sample_ids, encoded values)."""
    stream = SyntheticCtrStream(seed=seed)
    recs = stream.next_records(n)
    return [r["sample_id"] for r in recs], [encode(r, fmt) for r in recs]


def write_config(tmp_path, bootstrap: str, topic: str, name: str = "pipeline.config", **kw) -> str:
    model_dir = str(tmp_path / "model_dir")
    path = str(tmp_path / name)
    with open(path, "w") as f:
        f.write(deepfm_config_text(model_dir, server=bootstrap, topic=topic, **kw))
    return path


def run_in_process(
    config_path: str,
    ends: dict[int, int],
    ledger: Optional[str] = None,
    edits: Optional[dict] = None,
    timeout: float = 120,
    status_port: int = -1,
    device: str = "cpu",
) -> Trainer:
    """Runs a Trainer in this process until it has trained up to ``ends``; returns it stopped."""
    config = load_pipeline_config(config_path, json.dumps(edits) if edits else None)
    validate_pipeline_config(config, online=True)
    trainer = Trainer(
        config,
        TrainerOptions(
            online=True, device=device, status_port=status_port, sample_ledger=ledger
        ),
    )
    done = threading.Event()

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline and not done.is_set():
            pos = dict(trainer.positions)
            caught_up = pos and all(pos.get(p, 0) >= e for p, e in ends.items())
            if trainer.state == "training" and caught_up:
                trainer.request_stop("test: caught up")
                return
            time.sleep(0.05)
        trainer.request_stop("test: timeout")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert trainer.run() == 0
    finally:
        done.set()
    assert trainer.stop_reason == "test: caught up", trainer.stop_reason
    return trainer


def run_in_thread(trainer: Trainer) -> tuple[threading.Thread, dict]:
    """Runs ``trainer.run()`` in a daemon thread; the dict gets ``rc`` or ``error``."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["rc"] = trainer.run()
        except BaseException as exc:  # noqa: BLE001 (the test inspects it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def read_ledger_entries(path: str) -> list[tuple[str, int, str]]:
    """``(generation, step, sample_id)`` per complete line of a ``--sample_ledger`` file."""
    return read_ledger_file(path)


def read_ledger(path: str) -> list[str]:
    """The sample ids of a ``--sample_ledger`` file, in order."""
    return [sid for _, _, sid in read_ledger_entries(path)]


def start_cli_trainer(config_path: str, log_path: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", config_path,
           "--online", "--device", "cpu", "--status_port", "0", *extra]
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def http_json(model_dir: str, path: str) -> Optional[dict]:
    try:
        with open(os.path.join(model_dir, "status.json")) as f:
            url = json.load(f)["url"]
        with urllib.request.urlopen(url + path, timeout=5) as r:
            return json.load(r)
    except (OSError, ValueError, KeyError):
        return None


def wait_cli_caught_up(proc: subprocess.Popen, model_dir: str, ends: dict[int, int], pid: int,
                       timeout: float = 180) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
        st = http_json(model_dir, "/offsets")
        if st is not None:
            status = http_json(model_dir, "/status")
            if status and status.get("pid") == pid:
                pos = {int(k): v for k, v in st["positions"].items()}
                if pos and all(pos.get(p, 0) >= e for p, e in ends.items()):
                    return st
        time.sleep(0.3)
    raise TimeoutError(f"trainer did not catch up with {ends}")


__all__ = ["end_offsets", "produce", "make_records", "write_config", "run_in_process",
           "read_ledger", "read_ledger_entries", "start_cli_trainer", "http_json",
           "wait_cli_caught_up"]


def odl_helper_processes() -> list[psutil.Process]:
    """Live descendants of this process that are odl helpers (input process, build workers)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "odl.inputs.kafka_input_process" in cmd or "odl.inputs.feature_build_worker" in cmd:
            found.append(child)
    return found
