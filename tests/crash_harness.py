"""Kill -9 helpers shared by ``tests/test_crash_recovery.py`` and ``bench/chaos.py``.

``TrainerKiller`` runs ``odl-train`` as a subprocess, SIGKILLs it at random moments and
restarts it with the same command; ``published_versions`` reads the delta topic as serving
does; ``reflected_exactly_once`` audits a sample ledger against it.

What "reflected" means (the exactly-once audit): the ledger has one
``<generation> <step> <sample_id>`` line per trained sample. The model serving sees after a
generation's last complete version ``L`` holds the samples that generation trained at steps
``<= L``; whatever it trained after ``L`` died with it (the next generation recovers to ``L``
and reads those records again). So the records reflected are, over all generations, the ledger
lines with ``step <= L[generation]``, and every produced sample_id must be among them exactly
once.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from confluent_kafka import Consumer, TopicPartition

from odl.kafka.client_settings import delta_consumer_config
from publisher.delta_codec import DeltaFormatError, VersionAssembler, decode_chunk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> Optional[dict]:
    """GET a JSON document; None when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def post_json(url: str, body: bytes, timeout: float = 30.0) -> dict:
    """POST text, return the JSON answer."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


@dataclass
class DeltaTopicAudit:
    """What serving's assembler makes of a whole delta topic.

    Attributes:
        last_complete: generation -> highest complete version.
        complete_versions: complete versions in topic order as ``(generation, version)``.
        incomplete: versions that never completed (half-sent), as ``(generation, version)``.
        rejected: corrupt messages.
        end_offset: the topic's end when read.
    """

    last_complete: dict[str, int] = field(default_factory=dict)
    complete_versions: list[tuple[str, int]] = field(default_factory=list)
    incomplete: list[tuple[str, int]] = field(default_factory=list)
    rejected: int = 0
    end_offset: int = 0


def audit_delta_topic(bootstrap: str, topic: str, timeout: float = 60.0) -> DeltaTopicAudit:
    """Reads the whole delta topic with serving's decoder and assembler."""
    audit = DeltaTopicAudit()
    consumer = Consumer(delta_consumer_config(bootstrap, f"odl-audit-{uuid.uuid4().hex[:8]}"))
    try:
        tp = TopicPartition(topic, 0)
        low, high = consumer.get_watermark_offsets(tp, timeout=10, cached=False)
        audit.end_offset = int(high)
        consumer.assign([TopicPartition(topic, 0, int(low))])
        assembler = VersionAssembler(max_pending_versions=1 << 20, max_pending_bytes=1 << 62)
        seen: set[tuple[str, int]] = set()
        nxt, deadline = int(low), time.monotonic() + timeout
        while nxt < high and time.monotonic() < deadline:
            # transaction markers take offsets without being delivered: follow the position
            nxt = max(nxt, consumer.position([TopicPartition(topic, 0)])[0].offset)
            for msg in consumer.consume(500, timeout=0.5):
                if msg.error() is not None:
                    continue
                nxt = max(nxt, msg.offset() + 1)
                try:
                    chunk = decode_chunk(msg.value() or b"")
                except DeltaFormatError:
                    audit.rejected += 1
                    continue
                seen.add((chunk.header.generation, chunk.header.version))
                version = assembler.add(chunk)
                if version is not None:
                    key = (version.header.generation, int(version.header.version))
                    audit.complete_versions.append(key)
                    audit.last_complete[key[0]] = max(audit.last_complete.get(key[0], -1), key[1])
        assert nxt >= high, f"delta topic {topic} not read to its end ({nxt} < {high})"
        done = set(audit.complete_versions)
        audit.incomplete = sorted(k for k in seen if k not in done)
    finally:
        consumer.close()
    return audit


def published_versions(bootstrap: str, topic: str) -> dict[str, int]:
    """Generation -> its last complete version in the delta topic."""
    return audit_delta_topic(bootstrap, topic).last_complete


def reflected_exactly_once(
    produced: Iterable[str],
    entries: Iterable[tuple[str, int, str]],
    last_complete: dict[str, int],
) -> tuple[list[str], list[str]]:
    """Audits a ledger: ``(lost ids, ids reflected more than once)``; both empty = exactly once.

    Args:
        produced: every sample_id produced.
        entries: ``(generation, step, sample_id)`` ledger lines.
        last_complete: generation -> last complete version (``published_versions``).
    """
    counts = collections.Counter(
        sid for gen, step, sid in entries if step <= last_complete.get(gen, -1))
    produced = list(produced)
    lost = [sid for sid in produced if counts[sid] == 0]
    twice = [sid for sid, c in counts.items() if c > 1]
    unknown = set(counts) - set(produced)
    assert not unknown, f"ledger has ids nobody produced: {sorted(unknown)[:5]}"
    return lost, twice


class TrainerKiller:
    """Starts ``odl-train`` with the same command again and again and SIGKILLs it.

    Args:
        config_path: the pipeline config.
        model_dir: its model_dir (status.json, checkpoints).
        log_path: trainer output (appended).
        ledger: ``--sample_ledger`` path.
        rng: random source of the kill delays.
        startup_kill_fraction: share of kills aimed before training starts (restore, recovery).

    Attributes:
        kills: one dict per kill: ``delay`` after training started (or after start),
            ``phase`` ("startup", "training", "checkpoint"), ``step`` last seen.
        recovery_seconds: per start that reached training, start -> state ``training``.
    """

    def __init__(self, config_path: str, model_dir: str, log_path: str, ledger: str,
                 rng: random.Random, startup_kill_fraction: float = 0.2) -> None:
        self.cmd = [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path",
                    config_path, "--online", "--device", "cpu", "--status_port", "0",
                    "--sample_ledger", ledger]
        self.model_dir = model_dir
        self.log_path = log_path
        self.rng = rng
        self.startup_kill_fraction = startup_kill_fraction
        self.kills: list[dict] = []
        self.recovery_seconds: list[float] = []
        self.recoveries: list[dict] = []
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> float:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()
        return time.monotonic()

    def _status(self) -> Optional[dict]:
        assert self.proc is not None
        try:
            with open(os.path.join(self.model_dir, "status.json")) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None
        if doc.get("pid") != self.proc.pid:
            return None
        return get_json(doc["url"] + "/status", timeout=2)

    def _wait_training(self, t0: float, timeout: float = 120.0) -> dict:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited with {self.proc.returncode}; see "
                                     f"{self.log_path}")
            st = self._status()
            if st is not None and st.get("state") == "training":
                self.recovery_seconds.append(round(time.monotonic() - t0, 3))
                rec = dict(st.get("recovery") or {})
                rec["uptime_s"] = st.get("uptime_s")  # since the Trainer was constructed
                self.recoveries.append(rec)
                return st
            time.sleep(0.05)
        raise TimeoutError("trainer did not reach state 'training'")

    def _kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def start_and_kill(self, max_delay: float = 3.0, startup_max: float = 8.0,
                       aim: Optional[str] = None) -> dict:
        """One start, then SIGKILL at a random moment; returns the kill's record.

        Args:
            max_delay: kill within this many seconds after training started.
            startup_max: a startup kill comes this many seconds after the start at most.
            aim: ``"startup"``, ``"training"`` or ``"checkpoint"`` (kill as soon as a
                checkpoint is being written, within ``max_delay`` of training + 10 s);
                None = startup with probability ``startup_kill_fraction``, else training.
        """
        t0 = self._start()
        if aim is None:
            aim = "startup" if self.rng.random() < self.startup_kill_fraction else "training"
        if aim == "checkpoint":
            self._wait_training(t0)
            delay = self.rng.uniform(0.0, max_delay)
            time.sleep(delay)
            pattern = os.path.join(self.model_dir, ".model.ckpt-*.tmp-*")
            end = time.monotonic() + 10.0
            while time.monotonic() < end and not glob.glob(pattern):
                time.sleep(0.002)
            step = None
            phase = "training"
        elif aim == "startup":
            delay = self.rng.uniform(0.5, startup_max)
            end = t0 + delay
            trained = False
            while time.monotonic() < end:
                st = self._status()
                if st is not None and st.get("state") == "training":
                    trained = True
                    break
                time.sleep(0.02)
            if trained:  # started faster than the delay: kill it while training instead
                self.recovery_seconds.append(round(time.monotonic() - t0, 3))
                time.sleep(max(0.0, end - time.monotonic()))
            step = None
            phase = "training" if trained else "startup"
        else:
            self._wait_training(t0)
            delay = self.rng.uniform(0.0, max_delay)
            time.sleep(delay)
            st = self._status() or {}
            step = st.get("global_step")
            phase = "training"
        self._kill()
        if glob.glob(os.path.join(self.model_dir, ".model.ckpt-*.tmp-*")):
            phase = "checkpoint"
        rec = {"delay": round(delay, 3), "phase": phase, "step": step}
        self.kills.append(rec)
        return rec

    def finish(self, ends: dict[int, int], timeout: float = 180.0) -> dict:
        """Starts once more, waits until the trainer has read up to ``ends``, stops it cleanly."""
        t0 = self._start()
        self._wait_training(t0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None
            st = self._status()
            parts = (st or {}).get("input", {}).get("partitions", {})
            if parts and all(parts.get(str(p), {}).get("position", -1) >= e
                             for p, e in ends.items()):
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"trainer did not catch up with {ends}")
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(90)
        assert rc == 0, f"clean stop exited with {rc}; see {self.log_path}"
        return st or {}

    def cleanup(self) -> None:
        """Kills a trainer still running (test failure paths)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
