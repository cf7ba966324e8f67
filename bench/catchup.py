"""Serving catch-up: a serving started on an old export, many versions behind the topic end.

One run, one machine, the embedded broker:

1. base export: a small DeepFM (26 hashed id features, ``--dim``, ``--buckets``, DNN
   ``--hidden``) trained a few steps, one checkpoint (``delta_topic_offset`` 0), exported
   naming the delta topic;
2. delta topic: ``--versions`` versions (default 1,500) of ``--rows`` embedding rows each
   (deep table + its wide table, spread over the 26 features), the dense variables in every
   ``--dense-every``-th version, encoded as the publisher does (fp32, 900 kB chunks) and
   produced before serving starts; the broker's save of them is waited out;
3. ``ServingService(export).start()`` (the real ``DeltaReplayer``), its state sampled every
   20 ms until the last version is applied: time to the first applied version, to the last,
   versions/s and rows/s over the whole catch-up, how long ``/status`` said
   ``waiting_for_broker`` (with the reasons it gave), and how much the process grew while
   it held the fetched backlog.

``--live-writes N`` keeps writing N small records a second to another topic during each
catch-up, as a running trainer and datagen do: every write makes the embedded broker save
all its data again, so it is busy saving throughout (see ``odl.broker.embedded_broker``).
``--kafka-config`` passes extra librdkafka settings to the delta consumer (as
``odl-serve --kafka_config``). Prints a JSON summary.

    .venv/bin/python bench/catchup.py [--versions 1500] [--rows 2000] [--dense-every 10]
                                      [--live-writes 0] [--rounds 1]
                                      [--kafka-config '{"k": "v"}'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from confluent_kafka import Producer  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.checkpoint.checkpoint_manager import CheckpointManager  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.config.config_redaction import config_to_text  # noqa: E402
from odl.config.pipeline_config import parse_pipeline_config_text  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.export.exporter import export_checkpoint  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.topic_records import produce  # noqa: E402
from odl.kafka.client_settings import producer_config  # noqa: E402
from odl.kafka.topic_admin import create_topic  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402
from publisher.delta_encoder import encode_version  # noqa: E402
from publisher.delta_format import VersionHeader  # noqa: E402
from publisher.id_maps import read_id_maps  # noqa: E402
from serving_plugin.serving_service import ServingService  # noqa: E402

logger = logging.getLogger("bench.catchup")

BATCH = 256
MAX_CHUNK_BYTES = 900_000
TOPIC = "deltas"
LIVE_TOPIC = "samples"


def build_export(work: str, server: str, dim: int, buckets: int,
                 hidden: tuple[int, ...]) -> tuple[str, int]:
    """Trains a few steps, writes a checkpoint at delta offset 0 and exports it.

    Returns:
        The export directory and the base's global step.
    """
    model_dir = os.path.join(work, "model_dir")
    text = deepfm_config_text(model_dir, server=server, topic="samples", batch_size=BATCH,
                              dim=dim, buckets=buckets, hidden_units=hidden,
                              save_checkpoints_steps=0)
    config = parse_pipeline_config_text(text)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    for _ in range(3):
        tm.train_step(fb.build(stream.next_batch(BATCH).encode("csv")).batch)
    ckpt = CheckpointManager(model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {p: 0 for p in range(4)},
        {"source": "kafka", "topic": "samples", "delta_topic_offset": 0},
        config_to_text(config), generation="base")
    res = export_checkpoint(config, ckpt, os.path.join(work, "exports"), delta_server=server,
                            delta_topic=TOPIC)
    return res.path, tm.global_step


def make_versions(export: str, n_versions: int, rows: int, dense_every: int,
                  first_version: int) -> tuple[list[list[bytes]], int]:
    """Encodes ``n_versions`` versions of about ``rows`` embedding rows each.

    Returns:
        The chunks of every version, and the rows in all.
    """
    maps = read_id_maps(export)
    rng = np.random.default_rng(0)
    deep = sorted(n for n in maps.tables if not n.endswith("_wide"))
    groups = [(maps.tables[n], maps.tables.get(f"{n}_wide")) for n in deep]
    per_table = max(1, rows // sum(1 + (w is not None) for _, w in groups))
    out: list[list[bytes]] = []
    total = 0
    for v in range(n_versions):
        sparse = {}
        for info, wide in groups:
            ids = np.sort(rng.choice(info.num_rows, size=min(per_table, info.num_rows),
                                     replace=False)).astype(np.int64)
            sparse[info.id] = (ids, rng.normal(0, 0.05, (ids.size, info.dim)).astype(np.float32))
            total += ids.size
            if wide is not None:
                sparse[wide.id] = (ids, rng.normal(0, 0.05, (ids.size, wide.dim))
                                   .astype(np.float32))
                total += ids.size
        dense = {}
        if dense_every and v % dense_every == 0:
            dense = {d.id: rng.normal(0, 0.05, d.shape).astype(np.float32)
                     for d in maps.dense.values()}
        now_ms = int(time.time() * 1000)
        header = VersionHeader(model_name="bench", version=first_version + v + 1,
                               generation="gen-catchup", kind="both" if dense else "sparse",
                               min_event_time_ms=now_ms, max_event_time_ms=now_ms,
                               positions=[("samples", p, (v + 1) * 100) for p in range(4)],
                               publish_time_ms=now_ms)
        out.append(encode_version(header, dense, sparse, "fp32", MAX_CHUNK_BYTES))
    return out, total


class LiveWriter:
    """Writes ``rate`` records of 250 bytes a second to ``LIVE_TOPIC`` in a thread."""

    def __init__(self, bootstrap: str, rate: float) -> None:
        self._producer = Producer(producer_config(bootstrap))
        self._rate = rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        value = b"x" * 250
        while not self._stop.wait(1.0 / self._rate):
            self._producer.produce(LIVE_TOPIC, value=value, partition=0)
            self._producer.poll(0)

    def __enter__(self) -> LiveWriter:
        if self._rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._producer.flush(30)


def catch_up(export_root: str, n_versions: int, rows: int, kafka_extra: dict,
             timeout: float) -> dict:
    """Starts a service on the old export and follows it until the last version applied."""
    svc = ServingService(export_root, kafka_extra=kafka_extra)
    states: dict[str, float] = {}
    reasons: set[str] = set()
    first = None
    proc = psutil.Process()
    rss_start = rss_max = proc.memory_info().rss
    t0 = time.monotonic()
    svc.start("127.0.0.1", 0)
    last_log = t0
    try:
        prev = t0
        while True:
            now = time.monotonic()
            st = svc.model.state
            state = svc.state()
            states[state] = states.get(state, 0.0) + (now - prev)
            prev = now
            if svc.replayer.broker_error:
                reasons.add(svc.replayer.broker_error)
            if first is None and st.versions_applied > 0:
                first = now - t0
            rss_max = max(rss_max, proc.memory_info().rss)
            if st.versions_applied >= n_versions or now - t0 > timeout:
                break
            if now - last_log >= 5.0:
                last_log = now
                logger.info("%.0fs: %d of %d versions applied, state %s, next offset %d",
                            now - t0, st.versions_applied, n_versions, state,
                            svc.replayer.next_offset)
            time.sleep(0.02)
        total = time.monotonic() - t0
        done = st.versions_applied >= n_versions
        if done and st.rows_applied != rows:
            raise RuntimeError(f"applied {st.rows_applied} rows, expected {rows}")
        if not done:
            logger.warning("catch-up stalled: %d of %d versions applied after %.0fs",
                           st.versions_applied, n_versions, total)
        return {"completed": done,
                "versions_applied": st.versions_applied,
                "first_version_seconds": None if first is None else round(first, 3),
                "seconds": round(total, 3),
                "versions_per_sec": round(st.versions_applied / total, 1),
                "rows_per_sec": round(st.rows_applied / total),
                "seconds_by_state": {k: round(v, 2) for k, v in states.items()},
                "broker_errors": sorted(reasons),
                "rejected": svc.replayer.rejected_total,
                "rss_growth_mib": round((rss_max - rss_start) / 2**20)}
    finally:
        svc.stop()


def main() -> int:
    """Runs the benchmark; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=1500)
    ap.add_argument("--rows", type=int, default=2000, help="embedding rows per version")
    ap.add_argument("--dense-every", type=int, default=10,
                    help="dense variables in every N-th version (0 = never)")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--buckets", type=int, default=20000)
    ap.add_argument("--hidden", default="64,32", help="DNN layer sizes")
    ap.add_argument("--live-writes", type=float, default=0.0,
                    help="small records a second written to another topic during catch-up")
    ap.add_argument("--rounds", type=int, default=1, help="catch-ups from the same topic")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per catch-up before it counts as stalled")
    ap.add_argument("--kafka-config", default="{}",
                    help="extra librdkafka settings for the delta consumer (JSON object)")
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("INFO")
    for name in ("odl", "serving_plugin", "publisher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    configure_torch_threads(0)
    kafka_extra = json.loads(args.kafka_config)
    hidden = tuple(int(x) for x in args.hidden.split(","))
    work = tempfile.mkdtemp(prefix="odl-bench-catchup-")
    load_before = os.getloadavg()
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        create_topic(broker.bootstrap, TOPIC, partitions=1)
        create_topic(broker.bootstrap, LIVE_TOPIC, partitions=1)
        export, base_version = build_export(work, broker.bootstrap, args.dim, args.buckets,
                                            hidden)
        versions, rows = make_versions(export, args.versions, args.rows, args.dense_every,
                                       base_version)
        chunks = [c for v in versions for c in v]
        nbytes = sum(len(c) for c in chunks)
        t0 = time.perf_counter()
        produce(broker.bootstrap, TOPIC, chunks, config={"message.max.bytes": str(2 << 20)},
                flush_timeout=300)
        produce_secs = time.perf_counter() - t0
        broker.wait_until_idle(timeout=600)
        broker_rss = psutil.Process(broker.pid).memory_info().rss
        logger.info("%d versions, %d chunks, %.1f MB, %d rows produced in %.1fs (broker RSS "
                    "%.0f MiB)", args.versions, len(chunks), nbytes / 1e6, rows, produce_secs,
                    broker_rss / 2**20)
        runs = []
        for r in range(args.rounds):
            broker.wait_until_idle(timeout=600)
            with LiveWriter(broker.bootstrap, args.live_writes):
                runs.append(catch_up(os.path.dirname(export), args.versions, rows, kafka_extra,
                                     args.timeout))
            logger.info("round %d: %s", r, json.dumps(runs[-1]))

    def med(key: str) -> float | None:
        values = [x[key] for x in runs if x["completed"]]
        return statistics.median(values) if values else None

    result = {
        "versions": args.versions,
        "rows": rows,
        "chunks": len(chunks),
        "delta_bytes": nbytes,
        "kafka_config": kafka_extra,
        "live_writes_per_sec": args.live_writes,
        "completed_runs": sum(x["completed"] for x in runs),
        "first_version_seconds": med("first_version_seconds"),
        "seconds": med("seconds"),
        "versions_per_sec": med("versions_per_sec"),
        "rows_per_sec": med("rows_per_sec"),
        "broker_rss_mib": round(broker_rss / 2**20),
        "runs": runs,
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
