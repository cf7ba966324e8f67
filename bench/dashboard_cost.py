"""What the dashboard costs the trainer: samples/s with its history and an open page vs without.

One run, one machine, the train_throughput DeepFM on a backlog in the embedded broker:

* off: ``Trainer`` with its status API up and no dashboard history
  (``--dashboard_interval_s 0``), nobody reading it;
* on:  the default history (a point every 2 s from the status document) and a page open on
  it: a thread doing what the page's script does, ``GET /status`` and
  ``GET /history?since=<last>`` every 2 s.

Both read the same records from offset 0 into a fresh model_dir, in ABBA order over
``--rounds`` rounds; the headline is the median over rounds of on / off within a round
(target >= 0.99: the dashboard costs under 1 %). The rates of one round differ by several
per cent from noise alone, more than the cost measured, so the bench also times what one
history point costs after each "on" run (the window's progressive metrics recomputed, the
status document, the point) and the page's two requests during it (wall time, client and
server in this one process), and reports their sum as a share of the 2 s interval: an upper
bound of the dashboard's CPU share of one core.

    .venv/bin/python bench/dashboard_cost.py [--batches 80] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.train_throughput import BATCH, make_config, measure_trainer_rate  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.harness.http_client import get_json  # noqa: E402
from odl.harness.topic_records import produce  # noqa: E402
from odl.harness.trainer_process import trainer_url  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402
from odl.train.trainer import Trainer, TrainerOptions  # noqa: E402
from odl.train.trainer_dashboard import HISTORY_INTERVAL_S, history_point  # noqa: E402

TOPIC = "bench-dashboard"
PARTITIONS = 4
PAGE_INTERVAL_S = 2.0


def open_page(model_dir: str, stop: threading.Event, counts: dict) -> None:
    """What an open dashboard page asks of the trainer, every ``PAGE_INTERVAL_S`` seconds."""
    since = None
    while not stop.wait(PAGE_INTERVAL_S):
        base = trainer_url(model_dir, os.getpid())  # the status API, once it listens
        if base is None:
            continue
        t0 = time.perf_counter()
        get_json(base + "/status")
        doc = get_json(base + "/history" + ("" if since is None else f"?since={since}"))
        counts.setdefault("page_ms", []).append((time.perf_counter() - t0) * 1000)
        counts["requests"] += 2
        if doc and doc["t"]:
            since = doc["t"][-1]
            counts["points"] += len(doc["t"])


def rate(config, ends: dict[int, int], warmup: int, dashboard: bool) -> tuple[float, dict]:
    """Samples/s of one trainer over the backlog, with or without the dashboard."""
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=0,
                                             dashboard_interval_s=2.0 if dashboard else 0.0))
    stop = threading.Event()
    counts: dict = {"requests": 0, "points": 0}
    page = threading.Thread(target=open_page, args=(config.model_dir, stop, counts),
                            daemon=True)
    if dashboard:
        page.start()

    def caught_up(step: int, _secs: float) -> bool:
        pos = dict(trainer.positions)
        return bool(pos) and all(pos.get(p, 0) >= e for p, e in ends.items()) and step > warmup

    try:
        value = measure_trainer_rate(trainer, warmup, caught_up)
    finally:
        stop.set()
    if dashboard:  # one point's cost, the window full (the sampler's work every interval)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            trainer.progress.summary()
            history_point(trainer.status())
            times.append(time.perf_counter() - t0)
        counts["point_ms"] = statistics.median(times) * 1000
    return value, counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=80, help="batches of 1024 per measurement")
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from timing")
    ap.add_argument("--rounds", type=int, default=5)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    work = tempfile.mkdtemp(prefix="odl-bench-dashboard-")
    values = SyntheticCtrStream(seed=7).next_batch(args.batches * BATCH).encode("csv")
    rates: dict[str, list[float]] = {"off": [], "on": []}
    page_requests: list[int] = []
    point_ms: list[float] = []
    page_ms: list[float] = []
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        create_topic(broker.bootstrap, TOPIC, partitions=PARTITIONS)
        produce(broker.bootstrap, TOPIC, values, PARTITIONS)
        ends = end_offsets(broker.bootstrap, TOPIC)
        broker.wait_until_idle()
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for kind in order:
                broker.wait_until_idle()
                config = make_config(os.path.join(work, f"model_dir_{r}_{kind}"),
                                     broker.bootstrap, TOPIC)
                value, counts = rate(config, ends, args.warmup, kind == "on")
                rates[kind].append(value)
                if kind == "on":
                    page_requests.append(counts["requests"])
                    point_ms.append(counts["point_ms"])
                    page_ms += counts.get("page_ms", [])
            print(f"round {r}: off {rates['off'][-1]:,.0f}/s, on {rates['on'][-1]:,.0f}/s "
                  f"({rates['on'][-1] / rates['off'][-1]:.3f})", flush=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    result = {
        "on_over_off": round(statistics.median(ratios), 3),
        "per_round": [round(x, 3) for x in ratios],
        "samples_per_sec": {k: round(statistics.median(v)) for k, v in rates.items()},
        "samples_per_sec_per_round": {k: [round(x) for x in v] for k, v in rates.items()},
        "page_requests_per_round": page_requests,
        "history_point_ms": round(statistics.median(point_ms), 3),
        "page_requests_ms": round(statistics.median(page_ms), 3) if page_ms else None,
        "share_of_one_core_bound": round(
            (statistics.median(point_ms) + (statistics.median(page_ms) if page_ms else 0))
            / 1000 / HISTORY_INTERVAL_S, 5),
        "batches": args.batches,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=1))
    print(f"dashboard on / off: {result['on_over_off']} (median of per-round ratios; "
          f"target >= 0.99); per 2 s: a point {result['history_point_ms']} ms + the page's "
          f"requests {result['page_requests_ms']} ms = at most "
          f"{100 * result['share_of_one_core_bound']:.2f} % of one core")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
