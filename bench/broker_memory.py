"""Memory of the embedded broker: RSS against the data it keeps, and what retention does to it.

The embedded broker (``noida-db``) keeps every record in memory and, a moment after any
write, serializes all of its data to ``kafka.json`` (see ``odl.broker.embedded_broker``).
Each part uses a fresh broker and one topic, records of random bytes:

1. *no retention*: ``--step-mb`` at a time up to ``--max-mb`` per record size
   (``--record-bytes``); after each step, once the broker's save is done, its RSS (steady)
   and its peak RSS during that step (``VmHWM``, reset before the step);
2. *size retention*: a topic created with ``Retention`` ``--retention-mb`` per partition
   (``retention.bytes``, ``segment.bytes`` an eighth of it); ``--stream-mb`` produced at
   ``--stream-mb-per-sec``, sampled every 0.25 s: how far the start offset moved, the most
   data kept, steady and peak RSS;
3. *age retention*: ``--age-secs`` (``retention.ms``); 20 MB produced at once: seconds from
   the last write until the broker has dropped everything, RSS before and after;
4. *keeper*: a topic created without retention on a broker run by ``odl-kafka up
   --retention_mb`` (the retention keeper sets it), then the same stream as in 2.

Prints a JSON summary (~2-3 minutes; peak RSS reaches about 6 times the largest ``--max-mb``).

    .venv/bin/python bench/broker_memory.py [--record-bytes 250 10000 900000] [--max-mb 100]
        [--step-mb 25] [--retention-mb 16] [--stream-mb 160] [--age-secs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from bench.process_memory import reset_peak, status_kb  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker, wait_process_idle  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.kafka.client_settings import consumer_config, producer_config  # noqa: E402
from odl.kafka.topic_admin import Retention, create_topic  # noqa: E402

logger = logging.getLogger("bench.broker_memory")
MIB = 1 << 20


def peak_rss_mib(pid: int) -> float:
    """Peak RSS since the last reset (``VmHWM``), MiB."""
    return status_kb("VmHWM", pid) / 1024


def rss_mib(pid: int) -> float:
    """Current RSS, MiB."""
    return psutil.Process(pid).memory_info().rss / MIB


class Writer:
    """Produces records of one size to partition 0 of a topic."""

    def __init__(self, bootstrap: str, topic: str, record_bytes: int) -> None:
        conf = producer_config(bootstrap)
        conf["message.max.bytes"] = max(1_000_000, record_bytes + (64 << 10))
        self.producer = Producer(conf)
        self.topic = topic
        self.value = os.urandom(record_bytes)

    def write(self, n: int) -> None:
        """Produces ``n`` records and waits for their acknowledgement."""
        for _ in range(n):
            while True:
                try:
                    self.producer.produce(self.topic, self.value, partition=0)
                    break
                except BufferError:
                    self.producer.poll(0.01)
        if self.producer.flush(120) != 0:
            raise RuntimeError("records not acknowledged")


def watermarks(consumer: Consumer, topic: str) -> tuple[int, int]:
    """(low, high) of partition 0."""
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10,
                                               cached=False)
    return int(low), int(high)


def unbounded(work: str, record_bytes: int, max_mb: int, step_mb: int) -> list[dict]:
    """Part 1: RSS against data kept, without retention."""
    rows = []
    with EmbeddedBroker(0, os.path.join(work, f"unbounded-{record_bytes}")) as broker:
        create_topic(broker.bootstrap, "t", 1, config={"max.message.bytes": str(16 << 20)})
        writer = Writer(broker.bootstrap, "t", record_bytes)
        idle = rss_mib(broker.pid)
        per_step = max(1, step_mb * 1_000_000 // record_bytes)
        written = 0
        for _ in range(max(1, max_mb // step_mb)):
            reset_peak(broker.pid)
            writer.write(per_step)
            written += per_step
            broker.wait_until_idle(timeout=600)
            row = {"record_bytes": record_bytes, "kept_mb": round(written * record_bytes / 1e6, 1),
                   "idle_rss_mib": round(idle), "steady_rss_mib": round(rss_mib(broker.pid)),
                   "peak_rss_mib": round(peak_rss_mib(broker.pid))}
            rows.append(row)
            logger.info("no retention: %s", row)
        broker.stop(timeout=120)
    return rows


def stream_with_retention(bootstrap: str, pid: int, topic: str, stream_mb: int,
                          mb_per_sec: float, record_bytes: int = 10_000) -> dict:
    """Parts 2 and 4: ``stream_mb`` written at ``mb_per_sec``; what the broker keeps."""
    writer = Writer(bootstrap, topic, record_bytes)
    consumer = Consumer(consumer_config(bootstrap, "bench"))
    per_tick = max(1, int(mb_per_sec * 1e6 * 0.25 / record_bytes))
    total = int(stream_mb * 1e6 / record_bytes)
    reset_peak(pid)
    kept_max = 0.0
    written = 0
    t0 = time.monotonic()
    while written < total:
        writer.write(per_tick)
        written += per_tick
        low, high = watermarks(consumer, topic)
        kept_max = max(kept_max, (high - low) * record_bytes / 1e6)
        time.sleep(max(0.0, t0 + written * record_bytes / (mb_per_sec * 1e6) - time.monotonic()))
    wait_process_idle(pid, timeout=600)
    low, high = watermarks(consumer, topic)
    steady = rss_mib(pid)
    consumer.close()
    return {"written_mb": round(written * record_bytes / 1e6, 1),
            "start_offset": low, "end_offset": high,
            "kept_mb_at_end": round((high - low) * record_bytes / 1e6, 2),
            "kept_mb_max": round(kept_max, 2),
            "steady_rss_mib_at_end": round(steady),
            "peak_rss_mib": round(peak_rss_mib(pid)),
            "seconds": round(time.monotonic() - t0, 1)}


def size_retention(work: str, retention_mb: float, stream_mb: int, mb_per_sec: float) -> dict:
    """Part 2: a topic created with a size limit."""
    retention = Retention.from_flags(retention_mb, 24)
    with EmbeddedBroker(0, os.path.join(work, "size")) as broker:
        create_topic(broker.bootstrap, "t", 1, retention=retention)
        res = stream_with_retention(broker.bootstrap, broker.pid, "t", stream_mb, mb_per_sec)
        broker.stop(timeout=120)
    res["topic_config"] = retention.topic_config()
    logger.info("size retention: %s", res)
    return res


def age_retention(work: str, age_secs: float) -> dict:
    """Part 3: a topic created with an age limit; 20 MB written at once."""
    retention = Retention(-1, int(age_secs * 1000))
    with EmbeddedBroker(0, os.path.join(work, "age")) as broker:
        create_topic(broker.bootstrap, "t", 1, retention=retention)
        Writer(broker.bootstrap, "t", 10_000).write(2000)
        t_last = time.monotonic()
        broker.wait_until_idle(timeout=600)
        before = rss_mib(broker.pid)
        consumer = Consumer(consumer_config(broker.bootstrap, "bench"))
        while True:
            low, high = watermarks(consumer, "t")
            if low == high or time.monotonic() - t_last > age_secs + 120:
                break
            time.sleep(0.1)
        emptied = time.monotonic() - t_last
        consumer.close()
        broker.wait_until_idle(timeout=600)
        res = {"retention_ms": retention.retention_ms, "written_mb": 20.0,
               "emptied": low == high, "seconds_after_last_write": round(emptied, 1),
               "rss_mib_before": round(before), "rss_mib_after": round(rss_mib(broker.pid))}
        broker.stop(timeout=120)
    logger.info("age retention: %s", res)
    return res


def kafka_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``odl-kafka`` with this interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "odl.cli.kafka_cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=True)


def keeper(work: str, retention_mb: float, stream_mb: int, mb_per_sec: float) -> dict:
    """Part 4: ``odl-kafka up --retention_mb``; a topic created without retention."""
    data_dir = os.path.join(work, "cli")
    bootstrap = kafka_cli("up", "--port", "0", "--data-dir", data_dir, "--retention_mb",
                          str(retention_mb)).stdout.strip()
    try:
        with open(os.path.join(data_dir, "broker.json")) as f:
            state = json.load(f)
        create_topic(bootstrap, "t", 1)
        res = stream_with_retention(bootstrap, state["pid"], "t", stream_mb, mb_per_sec)
    finally:
        kafka_cli("down", "--data-dir", data_dir)
    logger.info("keeper: %s", res)
    return res


def main() -> int:
    """Runs the benchmark; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record-bytes", type=int, nargs="+", default=[250, 10_000, 900_000])
    ap.add_argument("--max-mb", type=int, default=100, help="part 1: data written per size")
    ap.add_argument("--step-mb", type=int, default=25)
    ap.add_argument("--retention-mb", type=float, default=16.0, help="parts 2, 4: MiB")
    ap.add_argument("--stream-mb", type=int, default=160, help="parts 2, 4: MB written")
    ap.add_argument("--stream-mb-per-sec", type=float, default=8.0)
    ap.add_argument("--age-secs", type=float, default=5.0, help="part 3: retention.ms / 1000")
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("INFO")
    logging.getLogger("odl").setLevel(logging.WARNING)
    work = tempfile.mkdtemp(prefix="odl-bench-broker-memory-")
    load_before = os.getloadavg()
    result: dict = {"unbounded": []}
    for size in args.record_bytes:
        result["unbounded"] += unbounded(work, size, args.max_mb, args.step_mb)
        shutil.rmtree(os.path.join(work, f"unbounded-{size}"), ignore_errors=True)
    result["size_retention"] = size_retention(work, args.retention_mb, args.stream_mb,
                                              args.stream_mb_per_sec)
    result["age_retention"] = age_retention(work, args.age_secs)
    result["keeper"] = keeper(work, args.retention_mb, args.stream_mb, args.stream_mb_per_sec)
    largest = {r["record_bytes"]: r for r in result["unbounded"]}.values()  # last step each
    result["mib_per_mb_kept"] = {
        str(r["record_bytes"]): {
            "steady": round((r["steady_rss_mib"] - r["idle_rss_mib"]) / r["kept_mb"], 2),
            "peak": round((r["peak_rss_mib"] - r["idle_rss_mib"]) / r["kept_mb"], 2)}
        for r in largest}
    result["load_average"] = {"before": [round(x, 2) for x in load_before],
                              "after": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
