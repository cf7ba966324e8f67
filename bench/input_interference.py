"""How much the input pipeline slows the train step, in a thread of the trainer or in a process.

The online loop's step runs slower than the same step on pre-built batches (docs/benchmarks.md).
This bench separates the causes. It times the in-memory TorchRec step (the DeepFM of
``bench/train_throughput.py``) three ways, in one run:

* alone;
* while a thread of the same process runs the input pipeline (``KafkaSource.read_batch`` from
  the embedded broker + ``FeatureBuilder.build``), paced at ``--rate`` records/s: the GIL and
  the cores are shared;
* while a child process runs the same pipeline at the same pace: only cores, caches and memory
  bandwidth are shared.

If the thread costs more than the process, moving the input out of the trainer process pays;
if both cost the same, the input competes for the machine, not for the GIL. The input loops
over the topic from offset 0 again each time it catches up.

    .venv/bin/python bench/input_interference.py [--rate 25000] [--rounds 2] [--device cpu]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.train_throughput import (  # noqa: E402
    BATCH,
    PARTITIONS,
    TOPIC,
    make_config,
    time_steps,
)
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.topic_records import produce  # noqa: E402
from odl.inputs.kafka_source import KafkaSource  # noqa: E402
from odl.inputs.start_positions import start_positions_from_config  # noqa: E402
from odl.kafka.topic_admin import create_topic  # noqa: E402
from odl.protos import pipeline_pb2  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads, usable_cpus  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402


def input_loop(config_bytes: bytes, bootstrap: str, rate: float, stop, counter) -> None:
    """Reads and builds batches at ``rate`` records/s until ``stop`` is set.

    Args:
        config_bytes: the serialized pipeline config.
        bootstrap: the broker.
        rate: records per second to pace to.
        stop: a threading or multiprocessing event.
        counter: a shared integer; set to the records built so far.
    """
    config = pipeline_pb2.EasyRecConfig.FromString(config_bytes)
    features = FeatureBuilder(config)
    built, t0 = 0, time.perf_counter()
    while not stop.is_set():
        source = KafkaSource(servers=bootstrap, topic=TOPIC, group="input-interference",
                             batch_size=BATCH,
                             start=start_positions_from_config(None, 0, [], None))
        source.open()
        while not stop.is_set():
            raw = source.read_batch()
            if raw is None or len(raw) == 0:
                break  # caught up: start over from offset 0
            features.build(raw.values)
            built += len(raw)
            counter.value = built
            ahead = built / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        source.close()


def _timed_with_input(runner, stop, counter, step, batches, timeout: float = 120.0) -> float:
    """Starts ``runner`` (a thread or process running ``input_loop``), waits for its first
    batch (a child process imports torch first), times ``step``, then stops the runner."""
    runner.start()
    try:
        deadline = time.monotonic() + timeout
        while counter.value == 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the input {runner} built nothing in {timeout:.0f} s")
            time.sleep(0.05)
        return time_steps(step, batches, 10)
    finally:
        stop.set()
        runner.join(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=25000,
                    help="records/s the input is paced to (about the online loop's rate)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=150, help="timed steps per measurement")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torch-threads", type=int, default=0)
    add_output_args(ap)
    args = ap.parse_args()
    threads = configure_torch_threads(args.torch_threads)
    work = tempfile.mkdtemp(prefix="odl-bench-")
    n = 2 * args.batches * BATCH
    values = list(SyntheticCtrStream(seed=5).next_batch(n).encode("csv"))
    rates: dict[str, list[float]] = {"alone": [], "input_thread": [], "input_process": []}
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        create_topic(broker.bootstrap, TOPIC, partitions=PARTITIONS)
        produce(broker.bootstrap, TOPIC, values, PARTITIONS)
        broker.wait_until_idle()
        config = make_config(os.path.join(work, "model_dir"), broker.bootstrap, TOPIC)
        features = FeatureBuilder(config)
        batches = [features.build(values[i : i + BATCH]).batch
                   for i in range(0, (args.batches + 10) * BATCH, BATCH)]
        module = TrainModule(config, features, device=args.device)
        blob = config.SerializeToString()
        ctx = mp.get_context("spawn")
        for r in range(args.rounds):
            rates["alone"].append(time_steps(module.train_step, batches, 10))

            stop, counter = threading.Event(), mp.Value("q", 0)
            thread = threading.Thread(target=input_loop, daemon=True,
                                      args=(blob, broker.bootstrap, args.rate, stop, counter))
            rates["input_thread"].append(
                _timed_with_input(thread, stop, counter, module.train_step, batches))
            stop, counter = ctx.Event(), ctx.Value("q", 0)
            proc = ctx.Process(target=input_loop, daemon=True,
                               args=(blob, broker.bootstrap, args.rate, stop, counter))
            rates["input_process"].append(
                _timed_with_input(proc, stop, counter, module.train_step, batches))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
                  flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "step_samples_per_sec": {k: round(v) for k, v in med.items()},
        "per_round": {k: [round(x) for x in v] for k, v in rates.items()},
        "thread_over_alone": round(med["input_thread"] / med["alone"], 3),
        "process_over_alone": round(med["input_process"] / med["alone"], 3),
        "input_rate": args.rate,
        "device": args.device,
        "torch_threads": threads,
        "cpus": usable_cpus(),
    }
    print(f"step with the input in a thread / alone  = {result['thread_over_alone']:.3f}")
    print(f"step with the input in a process / alone = {result['process_over_alone']:.3f}")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
