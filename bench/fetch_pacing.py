"""What Kafka fetch pacing (``data_config.fetch_interval_ms``) saves, and what it costs.

The embedded broker, ``odl-datagen`` producing ``--rate`` samples/s into a 4-partition topic
for ``--seconds``, and the trainer's real reader (``KafkaSource.read_batch`` with batch 1024,
batch timeout 100 ms) in a thread of this process, once unpaced (``fetch_interval_ms`` 0,
librdkafka's own pacing) and once paced (``--interval``, default 10 ms), alternating for
``--rounds`` rounds on a fresh topic each. Over the middle of each stream (after
``--warmup`` s) it reports:

* CPU cores used by the broker and by this process (the reader: librdkafka's threads plus
  the Python loop; datagen runs in its own process and is reported apart);
* fetch requests per second (librdkafka's own counter from its statistics callback);
* records read per second and the read latency per record (time ``read_batch`` returned it
  minus its produce timestamp), p50 / p99;
* then, with the stream over, ``--idle-seconds`` of an idle input: broker and reader CPU and
  fetch requests (the paced reader has parked by then; an unpaced one keeps fetching).

Medians over rounds, then paced / unpaced ratios. Load from other work skews the CPU figures;
the load average is printed.

    .venv/bin/python bench/fetch_pacing.py [--rate 10000] [--seconds 20] [--warmup 5]
                                           [--interval 10] [--rounds 2] [--json out.json]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.inputs.kafka_source import KafkaSource  # noqa: E402
from odl.inputs.start_positions import StartPositions  # noqa: E402
from odl.kafka.topic_admin import create_topic  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTITIONS = 4
BATCH = 1024


class _FetchCounter:
    """Latest Fetch request count (all brokers) from librdkafka statistics."""

    def __init__(self) -> None:
        self.by_broker: dict[str, int] = {}

    def __call__(self, stats_json: str) -> None:
        for name, broker in json.loads(stats_json).get("brokers", {}).items():
            fetches = (broker.get("req") or {}).get("Fetch")
            if fetches is not None:
                self.by_broker[name] = int(fetches)

    @property
    def total(self) -> int:
        return sum(self.by_broker.values())


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def one_run(bootstrap: str, broker_pid: int, topic: str, interval_ms: int,
            args: argparse.Namespace) -> dict:
    """One stream read with the given pacing; figures over the window after warm-up."""
    create_topic(bootstrap, topic, partitions=PARTITIONS)
    counter = _FetchCounter()
    source = KafkaSource(bootstrap, topic, f"bench-{topic}", StartPositions(), batch_size=BATCH,
                         batch_timeout_ms=100, fetch_interval_ms=interval_ms,
                         kafka_config={"statistics.interval.ms": "500", "stats_cb": counter})
    source.open()
    stop = threading.Event()
    latencies: list[np.ndarray] = []
    window = {"open": False, "records": 0}

    def read() -> None:
        while not stop.is_set():
            raw = source.read_batch(stop)
            if raw is None:
                continue
            if window["open"]:
                latencies.append(time.time() - raw.timestamps_ms / 1000.0)
                window["records"] += len(raw.values)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    gen = subprocess.Popen(
        [sys.executable, "-m", "odl.cli.datagen_cli", "--bootstrap", bootstrap, "--topic", topic,
         "--partitions", "0", "-q", "--rate", str(args.rate), "--seconds", str(args.seconds)],
        cwd=REPO, stdout=subprocess.DEVNULL)
    procs = {"broker": psutil.Process(broker_pid), "reader": psutil.Process(),
             "datagen": psutil.Process(gen.pid)}
    time.sleep(args.warmup)
    t0, c0, f0 = time.monotonic(), {k: _cpu(p) for k, p in procs.items()}, counter.total
    window["open"] = True
    time.sleep(args.seconds - args.warmup - 2)  # stop before datagen's end
    window["open"] = False
    t1, c1, f1 = time.monotonic(), {k: _cpu(p) for k, p in procs.items()}, counter.total
    gen.wait(60)
    # the input idle at its end: the paced reader parks after a batch timeout with nothing
    idle_procs = {k: procs[k] for k in ("broker", "reader")}
    time.sleep(1.0)
    t2, c2, f2 = time.monotonic(), {k: _cpu(p) for k, p in idle_procs.items()}, counter.total
    time.sleep(args.idle_seconds)
    t3, c3, f3 = time.monotonic(), {k: _cpu(p) for k, p in idle_procs.items()}, counter.total
    parked = source.parked
    stop.set()
    reader.join(10)
    source.close()
    span = t1 - t0
    lat = np.concatenate(latencies) if latencies else np.zeros(1)
    return {
        "cpu_cores": {k: (c1[k] - c0[k]) / span for k in procs},
        "fetches_per_sec": (f1 - f0) / span,
        "records_per_sec": window["records"] / span,
        "latency_p50_ms": float(np.percentile(lat, 50)) * 1000,
        "latency_p99_ms": float(np.percentile(lat, 99)) * 1000,
        "idle_cpu_cores": {k: (c3[k] - c2[k]) / (t3 - t2) for k in idle_procs},
        "idle_fetches_per_sec": (f3 - f2) / (t3 - t2),
        "idle_parked": parked,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=10000.0, help="samples/s produced")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of stream per run")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds excluded at the start")
    ap.add_argument("--idle-seconds", type=float, default=5.0,
                    help="seconds measured with the input idle after each stream")
    ap.add_argument("--interval", type=int, default=10, help="paced fetch_interval_ms")
    ap.add_argument("--rounds", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"unpaced": [], "paced": []}
    work = tempfile.mkdtemp(prefix="odl-bench-pacing-")
    with EmbeddedBroker(port=0, data_dir=work) as b:
        for r in range(args.rounds):
            for name, interval in (("unpaced", 0), ("paced", args.interval)):
                res = one_run(b.bootstrap, b.pid, f"pacing-{name}-{r}", interval, args)
                runs[name].append(res)
                print(f"round {r} {name}: " + json.dumps(res, default=lambda x: round(x, 3)),
                      flush=True)

    def med(name: str, key: str, sub: str | None = None) -> float:
        vals = [(x[key][sub] if sub else x[key]) for x in runs[name]]
        return statistics.median(vals)

    summary = {}
    for name in runs:
        summary[name] = {
            "broker_cores": med(name, "cpu_cores", "broker"),
            "reader_cores": med(name, "cpu_cores", "reader"),
            "datagen_cores": med(name, "cpu_cores", "datagen"),
            "fetches_per_sec": med(name, "fetches_per_sec"),
            "records_per_sec": med(name, "records_per_sec"),
            "latency_p50_ms": med(name, "latency_p50_ms"),
            "latency_p99_ms": med(name, "latency_p99_ms"),
            "idle_broker_cores": med(name, "idle_cpu_cores", "broker"),
            "idle_reader_cores": med(name, "idle_cpu_cores", "reader"),
            "idle_fetches_per_sec": med(name, "idle_fetches_per_sec"),
        }
    p, u = summary["paced"], summary["unpaced"]
    result = {
        "rate": args.rate, "interval_ms": args.interval, "rounds": args.rounds,
        "summary": {k: {m: round(v, 3) for m, v in s.items()} for k, s in summary.items()},
        "paced_over_unpaced": {
            "reader_cores": round(p["reader_cores"] / u["reader_cores"], 3),
            "broker_cores": round(p["broker_cores"] / u["broker_cores"], 3),
            "fetches_per_sec": round(p["fetches_per_sec"] / u["fetches_per_sec"], 4),
            "records_per_sec": round(p["records_per_sec"] / u["records_per_sec"], 3),
        },
        "latency_added_p99_ms": round(p["latency_p99_ms"] - u["latency_p99_ms"], 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result, indent=1))
    print(f"paced / unpaced at {args.rate:,.0f} samples/s: reader CPU "
          f"{result['paced_over_unpaced']['reader_cores']}, broker CPU "
          f"{result['paced_over_unpaced']['broker_cores']}, fetch requests "
          f"{result['paced_over_unpaced']['fetches_per_sec']}, records read "
          f"{result['paced_over_unpaced']['records_per_sec']}; read latency p99 "
          f"{p['latency_p99_ms']:.0f} ms vs {u['latency_p99_ms']:.0f} ms")
    print(f"input idle: reader {p['idle_reader_cores']:.3f} vs {u['idle_reader_cores']:.3f} "
          f"cores, broker {p['idle_broker_cores']:.3f} vs {u['idle_broker_cores']:.3f} cores, "
          f"{p['idle_fetches_per_sec']:,.0f} vs {u['idle_fetches_per_sec']:,.0f} fetches/s "
          "(paced and parked vs unpaced)")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
