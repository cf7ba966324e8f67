"""Backlog drain: a real ``odl-train`` starts far behind its topic and catches up.

``produce_backlog`` fills a topic with synthetic records before the trainer starts; ``drain``
starts ``odl-train --online`` (a subprocess) and samples, until the lag is 0, the trainer's
lag (from ``/status``) and its RSS (children included) while a client thread requests
``/status`` back to back and records each latency. ``bench/backlog.py`` runs it at full size,
``tests/test_backlog.py`` CI-sized.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from odl.datagen.datagen_config import deepfm_config_text
from odl.datagen.synthetic_ctr import SyntheticCtrStream
from odl.harness.http_client import get_json, http_request
from odl.harness.topic_records import produce
from odl.harness.trainer_process import start_cli_trainer, trainer_url
from odl.kafka.topic_admin import end_offsets

logger = logging.getLogger(__name__)

# batched, with room for a large chunk in flight
_BACKLOG_PRODUCER = {"linger.ms": "20", "queue.buffering.max.kbytes": "262144"}


def produce_backlog(bootstrap: str, topic: str, n: int, partitions: int, seed: int = 0,
                    chunk: int = 50_000) -> float:
    """Produces ``n`` synthetic CSV records round robin, ``chunk`` at a time.

    Args:
        bootstrap: the broker's bootstrap servers.
        topic: the sample topic.
        n: records.
        partitions: the topic's partitions.
        seed: the synthetic stream's seed.
        chunk: records encoded and produced at a time.

    Returns:
        The seconds it took.
    """
    t0 = time.monotonic()
    stream = SyntheticCtrStream(seed=seed)
    done = 0
    while done < n:
        values = stream.next_batch(min(chunk, n - done)).encode("csv")
        produce(bootstrap, topic, values, partitions, config=_BACKLOG_PRODUCER)
        done += len(values)
    return time.monotonic() - t0


@dataclass
class BacklogRun:
    """What one drain measured.

    Attributes:
        records: records in the backlog.
        produce_secs: seconds producing them took.
        start_secs: trainer launch -> first record trained.
        drain_secs: first record trained -> lag 0.
        lag: ``(seconds since training started, lag)`` samples.
        rss: ``(seconds since training started, bytes)`` samples (negative: before).
        status_ms: ``/status`` latencies seen by the client thread.
        status_errors: ``/status`` requests that failed.
        final: the ``/status`` document at lag 0.
    """

    records: int
    produce_secs: float = 0.0
    start_secs: float = 0.0
    drain_secs: float = 0.0
    lag: list[tuple[float, int]] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    status_ms: list[float] = field(default_factory=list)
    status_errors: int = 0
    final: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Figures for the report."""
        ms = sorted(self.status_ms)

        def pct(q: float) -> Optional[float]:
            return round(ms[min(len(ms) - 1, int(q * len(ms)))], 1) if ms else None

        lags = [v for _, v in self.lag]
        rises = sum(1 for a, b in zip(lags, lags[1:], strict=False) if b > a)
        rss = [v for _, v in self.rss]
        train_rss = [v for t, v in self.rss if t >= 0]
        first = train_rss[: max(1, len(train_rss) // 4)]
        return {
            "records": self.records,
            "produce_secs": round(self.produce_secs, 1),
            "trainer_start_secs": round(self.start_secs, 1),
            "drain_secs": round(self.drain_secs, 1),
            "drain_records_per_sec": round(self.records / self.drain_secs) if self.drain_secs
            else None,
            "lag_samples": len(lags),
            "lag_rises": rises,
            "peak_rss_mb": round(max(rss) / 2**20, 1) if rss else None,
            "rss_first_quarter_max_mb": round(max(first) / 2**20, 1) if train_rss else None,
            "rss_growth_after_first_quarter_mb": round((max(train_rss) - max(first)) / 2**20, 1)
            if train_rss else None,
            "status_requests": len(ms),
            "status_errors": self.status_errors,
            "status_p50_ms": pct(0.50),
            "status_p99_ms": pct(0.99),
            "status_max_ms": round(ms[-1], 1) if ms else None,
            "final_global_step": self.final.get("global_step"),
            "final_samples_per_sec": self.final.get("samples_per_sec"),
        }


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def drain(bootstrap: str, topic: str, work: Path, records: int, batch_size: int = 512,
          ckpt_steps: int = 200, interval: float = 1.0, status_hz: float = 20.0,
          timeout: float = 1800.0, extra_train: str = "") -> BacklogRun:
    """Starts ``odl-train`` behind ``records`` already produced records and waits for lag 0.

    Args:
        bootstrap: the broker.
        topic: the sample topic (already holding the backlog).
        work: a directory for the config, model_dir and log.
        records: records in the topic (the backlog).
        batch_size: samples per step.
        ckpt_steps: checkpoint interval.
        interval: seconds between lag / RSS samples.
        status_hz: /status requests per second from the client thread.
        timeout: give up after this many seconds.
        extra_train: extra train_config text.

    Returns:
        The measurements.

    Raises:
        RuntimeError: the trainer exited.
        TimeoutError: it did not start or drain in time.
    """
    run = BacklogRun(records=records)
    model_dir = work / "model_dir"
    cfg = work / "pipeline.config"
    cfg.write_text(deepfm_config_text(str(model_dir), server=bootstrap, topic=topic,
                                      batch_size=batch_size, save_checkpoints_steps=ckpt_steps,
                                      extra_train=extra_train))
    ends = end_offsets(bootstrap, topic)
    log_path = str(work / "trainer.log")
    t_launch = time.monotonic()
    proc = start_cli_trainer(str(cfg), log_path)
    ps = psutil.Process(proc.pid)
    stop = threading.Event()
    try:
        url = None
        while url is None:
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - t_launch > 300:
                raise TimeoutError("trainer did not start")
            url = trainer_url(str(model_dir), pid=proc.pid)
            run.rss.append((-(time.monotonic() - t_launch), _tree_rss(ps)))
            time.sleep(0.2)
        while True:  # training starts when the first records are trained
            st = get_json(url + "/status", timeout=10)
            if st and st.get("samples_trained", 0) > 0:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {proc.returncode}")
            time.sleep(0.05)
        t0 = time.monotonic()
        run.start_secs = t0 - t_launch

        def client() -> None:
            period = 1.0 / status_hz
            while not stop.is_set():
                a = time.perf_counter()
                try:
                    if http_request(url + "/status", timeout=10).status != 200:
                        raise OSError("error status")
                    run.status_ms.append((time.perf_counter() - a) * 1000)
                except OSError:
                    run.status_errors += 1
                stop.wait(max(0.0, period - (time.perf_counter() - a)))

        th = threading.Thread(target=client, daemon=True)
        th.start()
        while True:
            now = time.monotonic() - t0
            run.rss.append((now, _tree_rss(ps)))
            st = get_json(url + "/status", timeout=10)
            if st is not None:
                parts = st["input"]["partitions"]
                pos = {int(p): v["position"] for p, v in parts.items()}
                lag = sum(max(0, e - pos.get(p, 0)) for p, e in ends.items())
                run.lag.append((now, lag))
                if lag == 0:
                    run.drain_secs = now
                    run.final = st
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {proc.returncode}")
            if now > timeout:
                raise TimeoutError(f"lag still {run.lag[-1] if run.lag else '?'}")
            time.sleep(interval)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    logger.info("backlog of %d drained in %.1fs", records, run.drain_secs)
    return run
