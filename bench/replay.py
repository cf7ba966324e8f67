"""Serving: delta replay throughput (embedding rows/s) and ``/predict`` latency.

One run, one machine, the benchmark model shape (26 hashed id features of dim 16 with their
wide tables, 13 dense features, DNN 256-128-64, 100k buckets per feature):

1. base export: a ``TrainModule`` trained a few steps on synthetic batches, one checkpoint
   (``delta_topic_offset`` 0), ``export_checkpoint`` naming the delta topic;
2. delta topic: ``--versions`` versions (default 20) of ``--rows`` touched rows in all
   (default 2,000,000; each version touches the same ids in a deep table and its wide table,
   spread over all 52 tables) plus every dense variable, encoded with ``encode_version``
   (fp32, ``max_chunk_bytes`` 900 kB, as the publisher does) and produced to the embedded
   broker before serving starts;
3. end to end: ``ServingService(export).start()`` (real uvicorn on 127.0.0.1, the
   ``DeltaReplayer`` consuming the topic) -> the model's ``last_apply_time`` of the last
   version; rows/s = rows / (that - start). Target >= 1M rows/s;
4. in process: the same chunks (bytes in memory) through ``decode_chunk`` ->
   ``VersionAssembler.add`` -> ``ServingModel.apply_version`` on a freshly loaded model, each
   stage timed: the baseline without the broker, showing where the time goes;
5. ``/predict`` latency from a separate client process (``http.client`` keep-alive, one
   request at a time; a client in the serving process would distort it through the GIL):
   p50 / p99 of 1-record requests (``--requests``, target p99 <= 10 ms) and of 256-record
   requests (``--requests-256``), after a warm-up, with the replay finished; measured at
   torch's default intra-op threads (or ``--torch-threads``) and again with 1 thread
   (``predict_torch_threads_1``): on a busy 2-core machine the OpenMP workers of a tiny
   forward pass wait on each other when another process holds a core.

Steps 3 and 4 are repeated ``--rounds`` times (alternating); medians are reported. Prints a
JSON summary and a few human lines (~1-2 minutes with the defaults).

    .venv/bin/python bench/replay.py [--rows 2000000] [--versions 20] [--rounds 2]
                                     [--requests 500] [--requests-256 100] [--torch-threads 0]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

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
from odl.kafka.topic_admin import create_topic  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402
from publisher.delta_decoder import decode_chunk  # noqa: E402
from publisher.delta_encoder import encode_version  # noqa: E402
from publisher.delta_format import VersionHeader  # noqa: E402
from publisher.id_maps import read_id_maps  # noqa: E402
from publisher.version_assembler import VersionAssembler  # noqa: E402
from serving_plugin.serving_model import ServingModel  # noqa: E402
from serving_plugin.serving_service import ServingService  # noqa: E402

BATCH = 1024
BUCKETS = 100_000
MAX_CHUNK_BYTES = 900_000

# Runs in its own process: POSTs each body ``n`` times over one keep-alive connection and
# prints the latencies (ms) as JSON.
CLIENT = r"""
import http.client, json, sys, time
port, warmup = int(sys.argv[1]), int(sys.argv[2])
out = {}
for spec in sys.argv[3:]:
    name, n, path = spec.split(":", 2)
    body = open(path, "rb").read()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    hdr = {"Content-Type": "text/plain"}
    lat = []
    for i in range(warmup + int(n)):
        t0 = time.perf_counter()
        conn.request("POST", "/predict", body, hdr)
        r = conn.getresponse()
        data = r.read()
        dt = time.perf_counter() - t0
        if r.status != 200:
            sys.exit(f"status {r.status}: {data[:200]!r}")
        if i >= warmup:
            lat.append(dt * 1000.0)
    conn.close()
    out[name] = lat
print(json.dumps(out))
"""


def make_config(model_dir: str, server: str, topic: str):
    text = deepfm_config_text(
        model_dir, server=server, topic="samples", batch_size=BATCH, dim=16, buckets=BUCKETS,
        hidden_units=(256, 128, 64), save_checkpoints_steps=0,
        extra_train=("incr_save_config { sparse_save_steps: 2 dense_save_steps: 2 "
                     f'kafka {{ server: "{server}" topic: "{topic}" }} }}'),
    )
    return parse_pipeline_config_text(text)


def build_export(work: str, server: str, topic: str, steps: int = 3) -> tuple[str, int]:
    """Trains a few steps, writes a checkpoint (delta offset 0), exports it."""
    model_dir = os.path.join(work, "model_dir")
    config = make_config(model_dir, server, topic)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    stream = SyntheticCtrStream(seed=11)
    for _ in range(steps):
        tm.train_step(fb.build(stream.next_batch(BATCH).encode("csv")).batch)
    ckpt = CheckpointManager(model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {p: 0 for p in range(4)},
        {"source": "kafka", "topic": "samples", "delta_topic_offset": 0},
        config_to_text(config), generation="base")
    res = export_checkpoint(config, ckpt, os.path.join(work, "exports"), delta_server=server,
                            delta_topic=topic)
    return res.path, tm.global_step


def make_versions(export: str, total_rows: int, n_versions: int, first_version: int,
                  seed: int = 0) -> tuple[list[list[bytes]], int]:
    """Encodes ``n_versions`` versions touching ``total_rows`` rows in all."""
    maps = read_id_maps(export)
    rng = np.random.default_rng(seed)
    deep = sorted(n for n in maps.tables if not n.endswith("_wide"))
    per_version = total_rows // n_versions
    groups = [(maps.tables[n], maps.tables.get(f"{n}_wide")) for n in deep]
    tables_per_row = sum(1 + (w is not None) for _, w in groups)
    k = max(1, per_version // tables_per_row)
    out, rows = [], 0
    for v in range(n_versions):
        sparse = {}
        for info, wide in groups:
            ids = rng.choice(info.num_rows, size=min(k, info.num_rows), replace=False)
            ids = np.sort(ids).astype(np.int64)
            sparse[info.id] = (ids, rng.normal(0, 0.05, (ids.size, info.dim)).astype(np.float32))
            rows += ids.size
            if wide is not None:
                sparse[wide.id] = (ids, rng.normal(0, 0.05, (ids.size, wide.dim))
                                   .astype(np.float32))
                rows += ids.size
        dense = {d.id: rng.normal(0, 0.05, d.shape).astype(np.float32)
                 for d in maps.dense.values()}
        now_ms = int(time.time() * 1000)
        header = VersionHeader(model_name="bench", version=first_version + v + 1,
                               generation="gen-bench", kind="both", min_event_time_ms=now_ms,
                               max_event_time_ms=now_ms,
                               positions=[("samples", p, (v + 1) * 1000) for p in range(4)],
                               publish_time_ms=now_ms)
        out.append(encode_version(header, dense, sparse, "fp32", MAX_CHUNK_BYTES))
    return out, rows


def end_to_end(export_root: str, n_versions: int, rows: int) -> dict:
    """Fresh service replaying the whole topic; rows/s from start to last apply."""
    svc = ServingService(export_root)
    try:
        t0 = time.time()
        svc.start("127.0.0.1", 0)
        deadline = time.monotonic() + 300
        while svc.model.state.versions_applied < n_versions:
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay stalled: {svc.status()}")
            time.sleep(0.01)
        st = svc.model.state
        secs = st.last_apply_time - t0
        assert st.rows_applied == rows, (st.rows_applied, rows)
        assert svc.replayer.rejected_total == 0, svc.replayer.rejected
        return {"seconds": secs, "rows_per_sec": rows / secs,
                "apply_seconds": st.apply_seconds}
    finally:
        svc.stop()


def in_process(export_root: str, versions: list[list[bytes]], rows: int) -> dict:
    """decode -> assemble -> apply on a loaded model, no broker, each stage timed."""
    model = ServingModel.load(export_root, verify=False)
    asm = VersionAssembler()
    t_dec = t_asm = t_app = 0.0
    applied = 0
    t_start = time.perf_counter()
    for chunks in versions:
        for c in chunks:
            t0 = time.perf_counter()
            chunk = decode_chunk(c)
            t1 = time.perf_counter()
            version = asm.add(chunk)
            t2 = time.perf_counter()
            t_dec += t1 - t0
            t_asm += t2 - t1
            if version is not None:
                applied += model.apply_version(version)
                t_app += time.perf_counter() - t2
    total = time.perf_counter() - t_start
    assert applied == rows
    return {"seconds": total, "rows_per_sec": rows / total, "decode_seconds": t_dec,
            "assemble_seconds": t_asm, "apply_seconds": t_app}


def predict_latency(export_root: str, work: str, n1: int, n256: int, warmup: int) -> dict:
    stream = SyntheticCtrStream(seed=99)
    recs = stream.next_batch(256).encode("csv")
    bodies = {"1": recs[0], "256": b"\n".join(recs)}
    paths = {}
    for name, body in bodies.items():
        paths[name] = os.path.join(work, f"body_{name}.txt")
        with open(paths[name], "wb") as f:
            f.write(body)
    svc = ServingService(export_root, replay=False)
    port = svc.start("127.0.0.1", 0)
    try:
        out = subprocess.run(
            [sys.executable, "-c", CLIENT, str(port), str(warmup),
             f"1:{n1}:{paths['1']}", f"256:{n256}:{paths['256']}"],
            check=True, capture_output=True, text=True, timeout=600)
    finally:
        svc.stop()
    lat = json.loads(out.stdout)
    res = {}
    for name, xs in lat.items():
        a = np.asarray(xs)
        res[f"records_{name}"] = {"requests": int(a.size),
                                  "p50_ms": round(float(np.percentile(a, 50)), 3),
                                  "p99_ms": round(float(np.percentile(a, 99)), 3),
                                  "max_ms": round(float(a.max()), 3)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000, help="embedding rows in all versions")
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="replay measurements of each kind")
    ap.add_argument("--requests", type=int, default=500, help="1-record /predict requests")
    ap.add_argument("--requests-256", type=int, default=100, help="256-record requests")
    ap.add_argument("--warmup", type=int, default=30, help="untimed requests per body")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads of serving (0 = odl-serve's auto rule)")
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    configure_torch_threads(args.torch_threads)  # as odl-serve does
    threads = torch.get_num_threads()
    load_before = os.getloadavg()

    work = tempfile.mkdtemp(prefix="odl-bench-replay-")
    topic = "deltas"
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        create_topic(broker.bootstrap, topic, partitions=1)
        t0 = time.perf_counter()
        export, base_version = build_export(work, broker.bootstrap, topic)
        export_root = os.path.dirname(export)
        versions, rows = make_versions(export, args.rows, args.versions, base_version)
        chunks = [c for v in versions for c in v]
        nbytes = sum(len(c) for c in chunks)
        produce(broker.bootstrap, topic, chunks, config={"message.max.bytes": str(2 << 20)})
        print(f"setup: export + {args.versions} versions, {rows:,} rows, {len(chunks)} chunks, "
              f"{nbytes / 1e6:.1f} MB produced in {time.perf_counter() - t0:.1f}s", flush=True)

        e2e, inproc = [], []
        for r in range(args.rounds):
            e2e.append(end_to_end(export_root, args.versions, rows))
            inproc.append(in_process(export_root, versions, rows))
            print(f"round {r}: end to end {e2e[-1]['rows_per_sec']:,.0f} rows/s "
                  f"({e2e[-1]['seconds']:.2f}s), in process {inproc[-1]['rows_per_sec']:,.0f} "
                  f"rows/s ({inproc[-1]['seconds']:.2f}s: decode {inproc[-1]['decode_seconds']:.2f}"
                  f", assemble {inproc[-1]['assemble_seconds']:.2f}, apply "
                  f"{inproc[-1]['apply_seconds']:.2f})", flush=True)
        latency = predict_latency(export_root, work, args.requests, args.requests_256,
                                  args.warmup)
        latency_1 = None
        if threads != 1:  # new service, new server thread: it picks the new setting up
            torch.set_num_threads(1)
            latency_1 = predict_latency(export_root, work, args.requests, args.requests_256,
                                        args.warmup)

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(x[key] for x in runs)

    result = {
        "rows": rows,
        "versions": args.versions,
        "chunks": len(chunks),
        "delta_bytes": nbytes,
        "replay_end_to_end": {
            "rows_per_sec": round(med(e2e, "rows_per_sec")),
            "seconds": round(med(e2e, "seconds"), 3),
            "apply_seconds": round(med(e2e, "apply_seconds"), 3),
        },
        "replay_in_process": {
            "rows_per_sec": round(med(inproc, "rows_per_sec")),
            "seconds": round(med(inproc, "seconds"), 3),
            "decode_seconds": round(med(inproc, "decode_seconds"), 3),
            "assemble_seconds": round(med(inproc, "assemble_seconds"), 3),
            "apply_seconds": round(med(inproc, "apply_seconds"), 3),
        },
        "end_to_end_over_in_process": round(med(e2e, "rows_per_sec") /
                                            med(inproc, "rows_per_sec"), 3),
        "predict": latency,
        "torch_threads": threads,
        "predict_torch_threads_1": latency_1,
        "rounds": args.rounds,
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(result, indent=1))
    e, p = result["replay_end_to_end"], result["predict"]
    print(f"replay from the broker: {e['rows_per_sec']:,} rows/s (target >= 1,000,000)")
    print(f"replay in process:      {result['replay_in_process']['rows_per_sec']:,} rows/s "
          f"(end to end / in process = {result['end_to_end_over_in_process']:.3f})")
    print(f"/predict 1 record:   p50 {p['records_1']['p50_ms']:.2f} ms, "
          f"p99 {p['records_1']['p99_ms']:.2f} ms (target p99 <= 10 ms)")
    print(f"/predict 256 records: p50 {p['records_256']['p50_ms']:.2f} ms, "
          f"p99 {p['records_256']['p99_ms']:.2f} ms  ({threads} torch threads)")
    if latency_1:
        q = latency_1
        print(f"with 1 torch thread: 1 record p50 {q['records_1']['p50_ms']:.2f} ms, p99 "
              f"{q['records_1']['p99_ms']:.2f} ms; 256 records p50 "
              f"{q['records_256']['p50_ms']:.2f} ms, p99 {q['records_256']['p99_ms']:.2f} ms")
    print(f"load average before / after: {result['load_average']['before'][0]} / "
          f"{result['load_average']['after'][0]} (other work on the machine skews all figures)")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
