"""Backlog drain: the trainer starts far behind the stream and catches up.

One run on one machine, everything real and local:

* an embedded broker of its own; a sample topic with ``--partitions`` partitions;
* ``--records`` synthetic samples (datagen's vectorised ``CtrBatch.encode``) produced BEFORE
  the trainer starts (500k by default, ~170 MB in the broker);
* ``odl-train --online`` as a subprocess (the test-size DeepFM of ``deepfm_config_text``,
  ``--batch-size``, checkpoints every ``--ckpt-steps``), status API on a free port;
* this process samples, every ``--interval`` seconds: the trainer's lag (sum over partitions of
  high watermark - position, from ``/status``) and its RSS (psutil, children included);
* a separate client thread requests ``/status`` back to back (``--status-hz`` per second)
  for the whole drain and records each latency.

Reported: lag over time (it must fall steadily), drain rate (records/s from start of training
to lag 0), peak RSS and RSS growth after the first minute-ish of training, /status latency
p50 / p99 / max (target p99 < 100 ms). ``tests/test_backlog.py`` runs a CI-sized version.

    .venv/bin/python bench/backlog.py [--records 500000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from confluent_kafka import Producer  # noqa: E402

from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.kafka.client_settings import producer_config  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402


def produce_backlog(bootstrap: str, topic: str, n: int, partitions: int, seed: int = 0,
                    chunk: int = 50_000) -> float:
    """Produces ``n`` synthetic CSV records round robin; returns the seconds it took."""
    t0 = time.monotonic()
    producer = Producer(producer_config(bootstrap, {"linger.ms": "20",
                                                    "queue.buffering.max.kbytes": "262144"}))
    stream = SyntheticCtrStream(seed=seed)
    i = 0
    while i < n:
        values = stream.next_batch(min(chunk, n - i)).encode("csv")
        for v in values:
            while True:
                try:
                    producer.produce(topic, value=v, partition=i % partitions)
                    break
                except BufferError:
                    producer.poll(0.05)
            i += 1
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("records not acknowledged")
    return time.monotonic() - t0


@dataclass
class BacklogRun:
    """What one drain measured."""

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

        def pct(q: float) -> float | None:
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


def _get(url: str, timeout: float = 10.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError, urllib.error.URLError):
        return None


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
    """
    run = BacklogRun(records=records)
    model_dir = work / "model_dir"
    cfg = work / "pipeline.config"
    cfg.write_text(deepfm_config_text(str(model_dir), server=bootstrap, topic=topic,
                                      batch_size=batch_size, save_checkpoints_steps=ckpt_steps,
                                      extra_train=extra_train))
    ends = end_offsets(bootstrap, topic)
    log = open(work / "trainer.log", "ab")
    t_launch = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(cfg),
         "--online", "--device", "cpu", "--status_port", "0"],
        stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    ps = psutil.Process(proc.pid)
    stop = threading.Event()
    try:
        url = None
        while url is None:
            if proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {proc.returncode}; see {log.name}")
            if time.monotonic() - t_launch > 300:
                raise TimeoutError("trainer did not start")
            try:
                doc = json.loads((model_dir / "status.json").read_text())
                if doc.get("pid") == proc.pid:
                    url = doc["url"]
            except (OSError, ValueError):
                pass
            run.rss.append((-(time.monotonic() - t_launch), _tree_rss(ps)))
            time.sleep(0.2)
        while True:  # training starts when the first records are trained
            st = _get(url + "/status")
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
                    with urllib.request.urlopen(url + "/status", timeout=10) as r:
                        r.read()
                    run.status_ms.append((time.perf_counter() - a) * 1000)
                except OSError:
                    run.status_errors += 1
                stop.wait(max(0.0, period - (time.perf_counter() - a)))

        th = threading.Thread(target=client, daemon=True)
        th.start()
        while True:
            now = time.monotonic() - t0
            run.rss.append((now, _tree_rss(ps)))
            st = _get(url + "/status")
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
        log.close()
    return run


def main() -> None:
    """Runs the benchmark and prints the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--ckpt-steps", type=int, default=200)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--status-hz", type=float, default=20.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="odl-backlog-") as tmp:
        work = Path(tmp)
        broker = EmbeddedBroker(port=0, data_dir=work / "kafka").start()
        try:
            create_topic(broker.bootstrap, "samples", args.partitions)
            produce_secs = produce_backlog(broker.bootstrap, "samples", args.records,
                                           args.partitions)
            print(f"produced {args.records} records in {produce_secs:.1f}s", flush=True)
            run = drain(broker.bootstrap, "samples", work, args.records, args.batch_size,
                        args.ckpt_steps, args.interval, args.status_hz)
            run.produce_secs = produce_secs
        finally:
            broker.stop()
    out = run.summary()
    out["load_avg"] = os.getloadavg()
    out["lag_over_time"] = [(round(t, 1), v) for t, v in run.lag]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if run.status_ms:
        print(f"/status p50 {statistics.median(run.status_ms):.1f} ms, p99 "
              f"{out['status_p99_ms']} ms over {len(run.status_ms)} requests")


if __name__ == "__main__":
    main()
