"""Freshness of the whole loop: sample produced -> trained -> published -> applied by serving.

One run on one machine, everything real and local, the benchmark model shape (26 hashed id
features of dim 16 + their wide tables, 13 dense, DNN 256-128-64, batch 1024):

* embedded broker; sample topic with 4 partitions, delta topic with 1;
* base: ``odl-datagen`` produces ``--warm-batches`` x 1024 samples, an ``odl-train --online``
  subprocess trains exactly those (``num_steps``), publishing, and stops with a checkpoint
  that records the delta-topic replay offset; ``export_checkpoint`` exports it (this is the
  "early checkpoint": periodic checkpoints are off during the measurement, they would stall
  the train loop for seconds, production checkpoints every few minutes);
* serving: ``ServingService`` on that export in this process (real uvicorn on 127.0.0.1)
  replaying the delta topic; its model's ``apply_version`` is wrapped to log, per applied
  version, the wall time right after it was applied and the header (input positions =
  next offset per partition that the version covers, publish time, bytes, rows);
* the trainer is started again (a new generation that restores the base checkpoint) with
  ``incr_save_config`` publishing sparse + dense every ``--publish-steps`` steps to the
  delta topic; then ``odl-datagen`` produces at ``--rate`` samples/s (default 10,000) for
  ``--seconds`` into the 4 partitions, each record's Kafka timestamp set at produce time.

Afterwards the sample topic is read back (partition, offset, produce timestamp). A sample's
freshness latency = apply time of the first applied version whose position for the sample's
partition exceeds its offset - its produce timestamp. Reported over the steady-state window
(samples produced after the first ``--warmup`` seconds of the stream): p50 / p99 / max,
split into produce -> version snapshot (``publish_time_ms``) and snapshot -> applied.
Samples never covered before the drain timeout count as infinitely late. Target: p99 <= 1 s
at >= 10k samples/s.

Also reported:

* bytes per version vs the floor ``sum(rows x (8 + 4 dim)) + 4 x dense floats`` (the
  publisher's ``last_floor_ratio`` definition; the sparse-only floor of the design figure
  is shown too). Target <= 1.1;
* achieved rates: datagen samples/s, trainer samples/s in the window, trainer lag;
* publishing cost: after the run, the trainer (in process, ``Trainer``, status server off)
  reads the first ``--rate-batches`` batches of the same sample topic with publishing on
  and off (fresh model each, ``--rate-rounds`` alternating rounds, medians), nothing else
  running: on / off samples/s. Target: publishing costs <= 10 %.

With ``--served-auc``: the AUC of serving's predictions asked as each sample arrives (a
consumer of the sample topic posts what it fetches to ``/predict`` over HTTP; the labels
score them afterwards), next to the trainer's progressive AUC of the same stream: what
users meet against what the trainer reports (``ServedPredictions``).

Everything (broker, datagen, trainer, serving) shares this machine's cores; when it cannot
keep up with ``--rate`` the output says so (achieved rates, lag) -- measure a lower
``--rate`` honestly then. The load average before and after is printed, since other work
on the machine skews every figure. ``--torch-threads N`` sets torch's intra-op threads of
the trainer (``OMP_NUM_THREADS``) and of serving / the rate runs (``torch.set_num_threads``);
by default (0) each takes what ``odl-train`` and ``odl-serve`` take
(``configure_torch_threads``: half the CPUs, 1 on 2 cores), so the in-process serving and
rate runs match the daemons. With more threads than the processes leave free, OpenMP
workers of one process wait on workers that another has pushed off the CPU.

    .venv/bin/python bench/freshness.py [--rate 10000] [--seconds 60] [--warmup 15]
                                        [--publish-steps 2] [--torch-threads 0] [--served-auc]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from bench.bench_plots import plot_cdf  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.train_throughput import measure_trainer_rate  # noqa: E402
from odl.auc import roc_auc  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.checkpoint.checkpoint_manager import (  # noqa: E402
    POSITIONS_FILE,
    resolve_checkpoint_path,
)
from odl.cli.cli_logging import setup_logging
from odl.config.pipeline_config import parse_pipeline_config_text  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.export.exporter import export_checkpoint  # noqa: E402
from odl.harness.trainer_process import trainer_json  # noqa: E402
from odl.kafka.client_settings import consumer_config  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402
from odl.train.trainer import Trainer, TrainerOptions  # noqa: E402
from serving_plugin.serving_service import ServingService  # noqa: E402

BATCH = 1024
PARTITIONS = 4
SAMPLES = "samples"
DELTAS = "deltas"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_text(model_dir: str, server: str, group: str, publish_steps: int,
                delta_topic: str | None) -> str:
    incr = ""
    if delta_topic:
        incr = (f"incr_save_config {{ sparse_save_steps: {publish_steps} "
                f"dense_save_steps: {publish_steps} "
                f'kafka {{ server: "{server}" topic: "{delta_topic}" }} }}')
    text = deepfm_config_text(
        model_dir, server=server, topic=SAMPLES, batch_size=BATCH, dim=16, buckets=100_000,
        hidden_units=(256, 128, 64), save_checkpoints_steps=0,
        extra_train="metrics_window_samples: 100000\n  " + incr,
    )
    text = text.replace("data_config {", f"data_config {{\n  num_workers: {NUM_WORKERS}\n"
                        f"  input_process: {'true' if INPUT_PROCESS else 'false'}", 1)
    return text.replace('group: "odl_test"', f'group: "{group}"')


NUM_WORKERS = 0  # data_config.num_workers of the trainer (--num-workers)
INPUT_PROCESS = True  # data_config.input_process of the trainer (--input-process)
CHILD_ENV: dict[str, str] | None = None  # OMP_NUM_THREADS for the children (--torch-threads)


def datagen(bootstrap: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "odl.cli.datagen_cli", "--bootstrap", bootstrap,
           "--topic", SAMPLES, "--partitions", "0", "--seed", "1", "-q", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=REPO, text=True, env=CHILD_ENV)


def start_trainer(config_path: str, log_path: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", config_path,
           "--online", "--device", "cpu", "--status_port", "0", "--log_level", "WARNING",
           *extra]
    return subprocess.Popen(cmd, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            cwd=REPO, env=CHILD_ENV)


class ServedPredictions(threading.Thread):
    """odl-serve's prediction of every sample of the live stream, asked as it arrives.

    A consumer of the sample topic (from ``starts``, the stream's first offsets) posts each
    chunk it fetches to serving's ``/predict`` (HTTP, the records as produced; serving reads
    no label) and keeps, per record, its label, the served probability, the version that
    answered and the delay from the record's produce time to the answer. The label is only
    used for scoring afterwards, and only answers from a version that had not trained on the
    record count (an answer that came after the version covering its record was applied
    would score a model that has seen the label).

    Args:
        bootstrap: broker.
        starts: partition -> first offset of the live stream.
        url: serving's ``/predict`` URL.
        label_index: the label's CSV column.
    """

    def __init__(self, bootstrap: str, starts: dict[int, int], url: str, label_index: int):
        super().__init__(name="served-predictions", daemon=True)
        self.bootstrap, self.starts = bootstrap, starts
        self.url, self.label_index = url, label_index
        self.done = threading.Event()
        self.labels: list[int] = []
        self.probs: list[float] = []
        self.produced_ms: list[int] = []
        self.positions: list[tuple[int, int]] = []  # (partition, offset)
        self.delays_s: list[float] = []
        self.versions: list[int] = []
        self.errors = 0

    def run(self) -> None:
        c = Consumer(consumer_config(self.bootstrap, "odl-bench-served"))
        c.assign([TopicPartition(SAMPLES, p, o) for p, o in self.starts.items()])
        with httpx.Client(timeout=30.0) as http:
            while not self.done.is_set():
                msgs = [m for m in c.consume(num_messages=1000, timeout=0.02)
                        if m.error() is None]
                if not msgs:
                    continue
                values = [m.value() for m in msgs]
                r = http.post(self.url, content=b"\n".join(values))
                now = time.time()
                if r.status_code != 200:
                    self.errors += len(values)
                    continue
                body = r.json()
                self.probs.extend(body["probabilities"])
                self.versions.extend([int(body.get("version") or 0)] * len(values))
                for m, v in zip(msgs, values, strict=True):
                    self.labels.append(int(v.split(b",")[self.label_index]))
                    self.produced_ms.append(m.timestamp()[1])
                    self.positions.append((m.partition(), m.offset()))
                    self.delays_s.append(now - m.timestamp()[1] / 1000)
        c.close()

    def summary(self, t_from: float, applied: list[dict]) -> dict:
        """Served AUC of the answers from versions that had not trained on their record.

        Args:
            t_from: the end of the warm-up (unix s): the AUC from then on, by produce time,
                is reported too.
            applied: the apply log (per version its ``positions``: partition -> next offset).

        Returns:
            The AUCs, the share of answers left out, the produce-to-answer delay.
        """
        if not self.labels:
            return {"samples": 0, "errors": self.errors}
        covers = {v["version"]: v["positions"] for v in applied}
        seen = np.asarray([covers.get(v, {}).get(part, 0) > off for v, (part, off)
                           in zip(self.versions, self.positions, strict=True)])
        keep = ~seen
        y, p = np.asarray(self.labels)[keep], np.asarray(self.probs)[keep]
        after = (np.asarray(self.produced_ms) >= t_from * 1000)[keep]
        delays = np.asarray(self.delays_s)
        return {"samples": int(keep.sum()), "errors": self.errors,
                "answered_after_trained_on": round(float(seen.mean()), 4),
                "served_auc": round(roc_auc(y, p), 4),
                "served_auc_after_warmup": round(roc_auc(y[after], p[after]), 4)
                if after.any() and 0 < y[after].mean() < 1 else None,
                "answer_delay_s": {"p50": round(float(np.percentile(delays, 50)), 4),
                                   "p99": round(float(np.percentile(delays, 99)), 4)}}


def read_timestamps(bootstrap: str, ends: dict[int, int]) -> dict[int, np.ndarray]:
    """Produce timestamps (ms) of every record, indexed by offset, per partition."""
    c = Consumer(consumer_config(bootstrap, "odl-bench-ts"))
    c.assign([TopicPartition(SAMPLES, p, 0) for p in ends])
    ts = {p: np.full(e, -1, np.int64) for p, e in ends.items()}
    left = sum(ends.values())
    deadline = time.monotonic() + 120
    while left > 0 and time.monotonic() < deadline:
        for m in c.consume(num_messages=10000, timeout=1.0):
            if m.error() is not None:
                continue
            p, o = m.partition(), m.offset()
            if o < ends[p] and ts[p][o] < 0:
                ts[p][o] = m.timestamp()[1]
                left -= 1
    c.close()
    if left:
        raise RuntimeError(f"{left} sample records could not be read back")
    return ts


def percentiles(x: np.ndarray) -> dict:
    """p50 / p99 / max (empirical quantiles; "inf" where never-served samples reach)."""
    if x.size == 0:
        return {"p50": None, "p99": None, "max": None}

    def fmt(v: float) -> float | str:
        return round(float(v), 3) if np.isfinite(v) else "inf"

    return {"p50": fmt(np.percentile(x, 50, method="inverted_cdf")),
            "p99": fmt(np.percentile(x, 99, method="inverted_cdf")),
            "max": fmt(np.max(x))}


def freshness(log: list[dict], ts: dict[int, np.ndarray], t_from: float, t_to: float
              ) -> tuple[dict, dict[str, np.ndarray]]:
    """Per-sample latency of the samples produced in [t_from, t_to] (unix seconds).

    Returns:
        The percentiles, and the per-sample seconds of each stage (for the plot).
    """
    apply_t = np.array([v["applied"] for v in log])
    publish_t = np.array([v["publish_ms"] / 1000.0 for v in log])
    lat, to_snapshot, to_apply = [], [], []
    uncovered = 0
    for p, stamps in ts.items():
        offs = np.arange(stamps.size)
        sel = (stamps >= t_from * 1000) & (stamps <= t_to * 1000)
        offs, produced = offs[sel], stamps[sel] / 1000.0
        pos = np.maximum.accumulate(np.array([v["positions"].get(p, 0) for v in log]))
        idx = np.searchsorted(pos, offs, side="right")  # first version with pos > offset
        ok = idx < len(log)
        uncovered += int((~ok).sum())
        lat.append(apply_t[idx[ok]] - produced[ok])
        to_snapshot.append(publish_t[idx[ok]] - produced[ok])
        to_apply.append(apply_t[idx[ok]] - publish_t[idx[ok]])
    lat_a = np.concatenate(lat) if lat else np.zeros(0)
    if uncovered:  # never served before the end: infinitely late
        lat_a = np.concatenate([lat_a, np.full(uncovered, np.inf)])
    stages = {"produced → served": lat_a[np.isfinite(lat_a)],
              "produced → published": np.concatenate(to_snapshot),
              "published → applied": np.concatenate(to_apply)}
    return {
        "samples": int(lat_a.size),
        "uncovered": uncovered,
        "latency_s": percentiles(lat_a),
        "produce_to_snapshot_s": percentiles(stages["produced → published"]),
        "snapshot_to_applied_s": percentiles(stages["published → applied"]),
    }, stages


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """user + system CPU seconds so far of each process and its children (the trainer's input
    process among them), live ones included."""
    named = {proc.pid for proc in procs.values()}

    def live_descendants(proc: psutil.Process) -> float:
        """CPU of live descendants, not descending into the other named processes."""
        total = 0.0
        for child in proc.children():
            if child.pid in named:
                continue
            try:
                c = child.cpu_times()
                total += c.user + c.system + live_descendants(child)
            except psutil.Error:
                continue  # exited meanwhile: counted in children_* once reaped
        return total

    out = {}
    for name, proc in procs.items():
        try:
            t = proc.cpu_times()
            out[name] = t.user + t.system + live_descendants(proc)
            if proc.pid != os.getpid():  # reaped children of the bench are named processes
                out[name] += t.children_user + t.children_system
        except psutil.Error:
            out[name] = float("nan")
    return out


def rate_run(text: str, steps: int, warmup: int, max_seconds: float,
             broker: psutil.Process | None = None) -> tuple[float, dict[str, float]]:
    """Trainer samples/s from step ``warmup`` to ``steps`` or ``max_seconds`` after it
    (in process, like train_throughput), and the CPU seconds per 1,000 samples trained in
    that window of the trainer (this process and its input process) and of the broker."""
    config = parse_pipeline_config_text(text)
    trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))
    me = psutil.Process()
    cpu: dict[str, tuple[dict[str, float], int]] = {}

    def mark(name: str) -> None:
        procs = {"trainer": me, **({"broker": broker} if broker is not None else {})}
        cpu[name] = (cpu_seconds(procs), trainer.samples_trained)

    rate = measure_trainer_rate(
        trainer, warmup, lambda step, secs: step >= steps or secs > max_seconds, on_mark=mark)
    (c0, s0), (c1, s1) = cpu["start"], cpu["end"]
    return rate, {k: round(1000 * (c1[k] - c0[k]) / max(1, s1 - s0), 4) for k in c1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=10000.0, help="samples/s produced")
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of live stream")
    ap.add_argument("--warmup", type=float, default=15.0,
                    help="seconds of the stream excluded from the figures")
    ap.add_argument("--publish-steps", type=int, default=2,
                    help="sparse_save_steps = dense_save_steps")
    ap.add_argument("--warm-batches", type=int, default=16, help="batches trained for the base")
    ap.add_argument("--drain", type=float, default=60.0,
                    help="seconds to wait after the stream for serving to cover everything")
    ap.add_argument("--rate-batches", type=int, default=40,
                    help="batches per publishing on/off rate measurement (0 = skip)")
    ap.add_argument("--rate-rounds", type=int, default=2)
    ap.add_argument("--num-workers", type=int, default=0,
                    help="the trainer's data_config.num_workers (0 = build in its reader thread)")
    ap.add_argument("--input-process", type=int, choices=(0, 1), default=1,
                    help="the trainer's data_config.input_process (1: read and build in a "
                         "child process, the default; 0: in threads of the trainer)")
    ap.add_argument("--rate-max-seconds", type=float, default=15.0,
                    help="cap on one rate measurement (a slow machine stops it early)")
    ap.add_argument("--served-auc", action="store_true",
                    help="also ask serving for a prediction of every sample as it arrives "
                         "and report their AUC next to the trainer's progressive AUC")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads of trainer and serving (0 = the daemons' "
                         "auto: half the CPUs)")
    add_output_args(ap)
    args = ap.parse_args()
    global NUM_WORKERS, INPUT_PROCESS
    NUM_WORKERS = args.num_workers
    INPUT_PROCESS = bool(args.input_process)
    setup_logging("WARNING")
    global CHILD_ENV
    configure_torch_threads(args.torch_threads)  # serving and the rate runs, as the daemons
    if args.torch_threads:
        CHILD_ENV = dict(os.environ, OMP_NUM_THREADS=str(args.torch_threads))

    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="odl-bench-fresh-")
    model_dir = os.path.join(work, "model_dir")
    os.makedirs(model_dir)
    t_setup = time.monotonic()
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        bs = broker.bootstrap
        create_topic(bs, SAMPLES, partitions=PARTITIONS)
        create_topic(bs, DELTAS, partitions=1)
        cfg_path = os.path.join(work, "pipeline.config")
        with open(cfg_path, "w") as f:
            f.write(config_text(model_dir, bs, "bench-fresh", args.publish_steps, DELTAS))

        # -- base: train the warm-up batches, checkpoint at stop, export
        warm = args.warm_batches * BATCH
        assert datagen(bs, "--rate", "0", "--count", str(warm)).wait(120) == 0
        steps_json = json.dumps({"train_config.num_steps": args.warm_batches})
        ta = start_trainer(cfg_path, os.path.join(work, "trainer_a.log"),
                           "--edit_config_json", steps_json)
        if ta.wait(300) != 0:
            raise RuntimeError(f"base trainer failed, see {work}/trainer_a.log")
        ckpt_path = resolve_checkpoint_path(model_dir)
        with open(os.path.join(ckpt_path, POSITIONS_FILE)) as f:
            base_source = json.load(f)
        config = parse_pipeline_config_text(open(cfg_path).read())
        export = export_checkpoint(config, model_dir, os.path.join(work, "exports"),
                                   delta_server=bs, delta_topic=DELTAS).path
        print(f"base: {os.path.basename(ckpt_path)}, delta offset "
              f"{base_source.get('delta_topic_offset')}, exported in "
              f"{time.monotonic() - t_setup:.0f}s since start", flush=True)

        # -- serving, with an apply log
        svc = ServingService(os.path.dirname(export))
        applied: list[dict] = []
        apply_version = svc.model.apply_version

        def logged_apply(version):
            rows = apply_version(version)
            now = time.time()
            h = version.header
            applied.append({
                "applied": now, "version": int(h.version), "generation": h.generation,
                "publish_ms": int(h.publish_time_ms),
                "positions": {int(p): int(o) for _t, p, o in h.positions},
                "bytes": int(version.nbytes), "rows": rows,
                "floor_sparse": int(sum(len(i) * (8 + 4 * v.shape[1])
                                        for i, v in version.sparse.values())),
                "dense_floats": int(sum(a.size for a in version.dense.values())),
                "chunks": int(version.chunk_count),
            })
            return rows

        svc.model.apply_version = logged_apply
        svc_port = svc.start("127.0.0.1", 0)

        # -- the trainer again (restores the base), then the live stream
        tb = start_trainer(cfg_path, os.path.join(work, "trainer_b.log"))
        deadline = time.monotonic() + 180
        while True:
            st = trainer_json(model_dir, "/status")
            if st and st.get("pid") == tb.pid and st.get("state") == "training":
                break
            if tb.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainer did not start, see {work}/trainer_b.log")
            time.sleep(0.2)
        served = None
        if args.served_auc:
            fields = [f.input_name for f in config.data_config.input_fields]
            served = ServedPredictions(bs, end_offsets(bs, SAMPLES),
                                       f"http://127.0.0.1:{svc_port}/predict",
                                       fields.index(config.data_config.label_fields[0]))
            served.start()
        gen_start = time.time()
        gen = datagen(bs, "--rate", str(args.rate), "--seconds", str(args.seconds))
        # (time, samples_trained, lag, CPU seconds per process) once a second
        samples_log: list[tuple[float, int, int, dict[str, float]]] = []
        procs = {"broker": psutil.Process(broker.pid), "datagen": psutil.Process(gen.pid),
                 "trainer": psutil.Process(tb.pid), "serving (bench process)": psutil.Process()}
        while gen.poll() is None:
            st = trainer_json(model_dir, "/status")
            if st:
                lag = sum((p.get("lag") or 0) for p in st["input"]["partitions"].values())
                samples_log.append((time.time(), st["samples_trained"], lag, cpu_seconds(procs)))
            time.sleep(1.0)
        gen_end = time.time()
        gen_summary = json.loads(gen.stdout.read().strip().splitlines()[-1])
        ends = end_offsets(bs, SAMPLES)
        deadline = time.monotonic() + args.drain
        drained = False
        while time.monotonic() < deadline:
            last = applied[-1]["positions"] if applied else {}
            if all(last.get(p, 0) >= e for p, e in ends.items()):
                drained = True
                break
            time.sleep(0.1)
        if served is not None:  # every record answered, or the drain's deadline
            while (len(served.labels) + served.errors < sum(ends.values())
                   - sum(served.starts.values()) and time.monotonic() < deadline + 30):
                time.sleep(0.1)
            served.done.set()
            served.join(60)
        final_status = trainer_json(model_dir, "/status") or {}
        tb.send_signal(signal.SIGTERM)
        tb.wait(120)
        serving_status = svc.status()
        svc.stop()
        load_after_stream = os.getloadavg()

        ts = read_timestamps(bs, ends)
        fresh, stages = freshness(applied, ts, gen_start + args.warmup, gen_end)

        # -- publishing on vs off, same batches, nothing else running
        rates: dict[str, list[float]] = {"off": [], "on": []}
        # CPU seconds per 1,000 samples of the trainer / the broker, per arm and round
        rate_cpu: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        broker_proc = psutil.Process(broker.pid) if broker.pid else None
        if args.rate_batches:
            for r in range(args.rate_rounds):
                # a delta topic per round: each round's model is another model_dir, and a
                # trainer refuses a topic another model publishes to (delta_topic_owner)
                create_topic(bs, f"deltas-rate-{r}", partitions=1)
                for kind in ("off", "on"):
                    md = os.path.join(work, f"rate_{kind}_{r}")
                    text = config_text(md, bs, f"bench-rate-{kind}-{r}", args.publish_steps,
                                       f"deltas-rate-{r}" if kind == "on" else None)
                    rate, cpu = rate_run(text, args.rate_batches, 5, args.rate_max_seconds,
                                         broker_proc)
                    rates[kind].append(rate)
                    rate_cpu[kind].append(cpu)
                print(f"rate round {r}: publishing off {rates['off'][-1]:,.0f}/s, on "
                      f"{rates['on'][-1]:,.0f}/s; CPU s per 1k samples trainer "
                      f"{rate_cpu['off'][-1]['trainer']} / {rate_cpu['on'][-1]['trainer']}, "
                      f"broker {rate_cpu['off'][-1].get('broker')} / "
                      f"{rate_cpu['on'][-1].get('broker')}", flush=True)

    # -- figures
    window = [v for v in applied if gen_start + args.warmup <= v["applied"] <= gen_end]
    steady = [s for s in samples_log if s[0] >= gen_start + args.warmup]
    train_rate = ((steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
                  if len(steady) >= 2 else None)
    nbytes = sum(v["bytes"] for v in window)
    floor_sparse = sum(v["floor_sparse"] for v in window)
    floor = floor_sparse + 4 * sum(v["dense_floats"] for v in window)
    pub = final_status.get("publisher") or {}


    def cores(a: tuple, b: tuple) -> dict[str, float]:
        """CPU cores per process between two ``samples_log`` entries."""
        return {k: round((b[3][k] - a[3][k]) / (b[0] - a[0]), 2) for k in a[3]}

    cpu_cores = cores(steady[0], steady[-1]) if len(steady) >= 2 else None
    result = {
        "rate_target": args.rate,
        "datagen": {"produced": gen_summary["produced"], "seconds": gen_summary["seconds"],
                    "samples_per_sec": round(gen_summary["produced"] / gen_summary["seconds"])},
        "trainer_samples_per_sec_window": round(train_rate) if train_rate else None,
        "trainer_lag_max_window": max((s[2] for s in steady), default=None),
        "trainer_lag_end_of_stream": samples_log[-1][2] if samples_log else None,
        "drained": drained,
        "freshness": fresh,
        "versions_applied_window": len(window),
        "version_interval_s": (round((window[-1]["applied"] - window[0]["applied"]) /
                                     (len(window) - 1), 3) if len(window) > 1 else None),
        "bytes_per_version": round(nbytes / len(window)) if window else None,
        "rows_per_version": round(sum(v["rows"] for v in window) / len(window)) if window else None,
        "chunks_per_version": (round(sum(v["chunks"] for v in window) / len(window), 2)
                               if window else None),
        "bytes_over_floor": round(nbytes / floor, 4) if floor else None,
        "bytes_over_sparse_floor": round(nbytes / floor_sparse, 4) if floor_sparse else None,
        "publisher": {k: pub.get(k) for k in ("versions_published", "versions_merged",
                                              "bytes_published", "rows_published",
                                              "failures", "snapshot_secs_total")},
        "serving": {k: serving_status.get(k) for k in ("versions_applied", "rows_applied",
                                                       "rejected_messages")},
        "publishing_cost": None,
        "served_predictions": (
            {**served.summary(gen_start + args.warmup, applied),
             "trainer_progressive_auc_total": (final_status.get("progressive") or {}).get(
                 "auc_total"),
             "trainer_progressive_auc_window": (final_status.get("progressive") or {}).get(
                 "auc")} if served is not None else None),
        "cpu_cores_window": cpu_cores,
        # per status poll: seconds into the stream, samples trained, lag, CPU cores per
        # process since the previous poll
        "timeline": [
            [round(cur[0] - gen_start, 1), cur[1], cur[2]]
            + (list(cores(samples_log[i - 1], cur).values()) if i else [])
            for i, cur in enumerate(samples_log)],
        "timeline_columns": ["seconds", "samples_trained", "lag"] + list(procs),
        "cpu_count": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after_stream": [round(x, 2) for x in load_after_stream]},
        "torch_threads": args.torch_threads or torch.get_num_threads(),
        "input_process": INPUT_PROCESS,
        "num_workers": NUM_WORKERS,
        "publish_steps": args.publish_steps,
        "seconds": args.seconds,
        "warmup": args.warmup,
    }
    if rates["off"]:
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        result["publishing_cost"] = {"samples_per_sec_off": round(off),
                                     "samples_per_sec_on": round(on),
                                     "on_over_off": round(on / off, 3),
                                     "per_round": [round(b / a, 3) for a, b in
                                                   zip(rates["off"], rates["on"], strict=True)],
                                     "batches": args.rate_batches, "rounds": args.rate_rounds}
        for who in ("trainer", "broker"):
            arms = {k: [c[who] for c in v if who in c] for k, v in rate_cpu.items()}
            if arms["off"] and arms["on"]:
                result["publishing_cost"][f"{who}_cpu_ms_per_sample"] = {
                    k: round(statistics.median(v), 4) for k, v in arms.items()}
    print(json.dumps(result, indent=1))
    lat = fresh["latency_s"]
    if cpu_cores:
        print("CPU in the window (cores): " + ", ".join(f"{k} {v}" for k, v in cpu_cores.items())
              + f" of {os.cpu_count()}")
    achieved = result["datagen"]["samples_per_sec"]
    print(f"stream: {achieved:,} samples/s produced (asked {args.rate:,.0f}), trainer "
          f"{result['trainer_samples_per_sec_window'] or 0:,} samples/s in the window, max lag "
          f"{result['trainer_lag_max_window']} records")
    if achieved < 0.95 * args.rate or (train_rate or 0) < 0.95 * achieved:
        print("NOTE: this machine did not sustain the asked rate through datagen + broker + "
              "trainer + serving; the latency below is at the achieved rate")
    print(f"freshness p50 {lat['p50']} s, p99 {lat['p99']} s, max {lat['max']} s over "
          f"{fresh['samples']:,} samples ({fresh['uncovered']} never served) "
          f"(target p99 <= 1 s at >= 10k samples/s)")
    print(f"delta bytes / floor = {result['bytes_over_floor']} (target <= 1.1; "
          f"{result['bytes_per_version']} bytes, {result['rows_per_version']} rows per version)")
    sp = result["served_predictions"]
    if sp and sp.get("samples"):
        print(f"served AUC {sp['served_auc']} ({sp['served_auc_after_warmup']} after the "
              f"warm-up) over {sp['samples']:,} predictions asked as each sample arrived "
              f"(answer {sp['answer_delay_s']['p50']} s after produce, p99 "
              f"{sp['answer_delay_s']['p99']} s; {sp['answered_after_trained_on']:.1%} left "
              f"out, answered by a version that had trained on them); the trainer's "
              f"progressive AUC "
              f"{sp['trainer_progressive_auc_total']} (its window "
              f"{sp['trainer_progressive_auc_window']})")
    if result["publishing_cost"]:
        pc = result["publishing_cost"]
        print(f"trainer with publishing / without = {pc['on_over_off']} "
              f"({pc['samples_per_sec_on']:,} vs {pc['samples_per_sec_off']:,} samples/s; "
              f"per round {pc['per_round']}; target >= 0.90)")
        for who in ("trainer", "broker"):
            c = pc.get(f"{who}_cpu_ms_per_sample")
            if c:
                print(f"{who} CPU ms per sample, publishing on / off: {c['on']} / {c['off']}"
                      + (f" = {c['on'] / c['off']:.3f}" if c["off"] else ""))
    finish_run(args, result, work, plot=lambda path: plot_cdf(
        path, stages, "seconds", f"freshness: {args.rate} samples/s for {args.seconds} s, "
        f"publish every {args.publish_steps} steps"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
