"""Training throughput: the online loop from Kafka vs the in-memory TorchRec step vs plain PyTorch.

One run, one machine, the same DeepFM (26 hashed id features of dim 16, 13 dense features,
batch 1024, DNN 256-128-64, wide + FM + deep) and the same synthetic records:

* online:   ``Trainer`` (odl-train --online) reading the records from the embedded broker —
            Kafka fetch, parsing and hashing in the input process
            (``data_config.input_process``, the default), parsing and hashing there in
            ``--num-workers`` feature build processes (0: in its reader thread),
            predict-then-train, progressive metrics; checkpoints off; measured from step
            ``--warmup`` to the end;
* online_threads (``--input-process both`` or ``0``): the same trainer with
            ``input_process: false``, reading and building in threads of its own process;
* torchrec: ``TrainModule.train_step`` on the same batches pre-built in memory;
* plain:    ``bench/plain_pytorch_deepfm.PlainDeepFM`` (nn.EmbeddingBag(sparse=True) +
            torch.optim) on the same pre-built batches.

Prints samples/s of each and the ratios online/torchrec (target >= 0.85) and
torchrec/plain, online/plain (target >= 1.5). Machines here are noisy (one measurement can
be 20% off the next): the three are measured ``--rounds`` times, in the order
online-torchrec-plain in even rounds and the reverse in odd ones, and the headline ratios are
the medians over rounds of the ratio within each round (the ratio of the median rates is
printed beside them). The broker's CPU use during each measurement is reported too: the
records are produced once, before the first round, and the bench waits for the embedded
broker's save of them to finish (see ``odl.broker.embedded_broker``).

    .venv/bin/python bench/train_throughput.py [--batches 120] [--rounds 5] [--num-workers 0]
        [--input-process 1|0|both] [--device cpu|cuda|auto] [--torch-threads 0]
        [--model DeepFM|WideAndDeep|MultiTower|MultiTowerDIN|MultiTowerBST|DCN|DCNV2|MMoE|
                 DBMTL|FM|DLRM|ESMM|PLE|MaskNet|WuKong|CMBF|Uniter|SimpleMultiTask|PEPNet|AutoInt|
                 RocketLaunching|RankModel|MultiTaskModel]
        [--json out.json]
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
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from bench.bench_plots import plot_rounds  # noqa: E402
from bench.plain_pytorch_deepfm import PlainDeepFM  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.config.model_classes import IMPLEMENTED_MODEL_CLASSES  # noqa: E402
from odl.config.pipeline_config import parse_pipeline_config_text  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.model_configs import as_model_config_text, records_for_model  # noqa: E402
from odl.harness.topic_records import produce  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads, usable_cpus  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402
from odl.train.trainer import Trainer, TrainerOptions  # noqa: E402

BATCH = 1024
PARTITIONS = 4
TOPIC = "bench"


def make_config(model_dir: str, server: str, topic: str, model: str = "DeepFM"):
    text = deepfm_config_text(
        model_dir, server=server, topic=topic, batch_size=BATCH, dim=16, buckets=100_000,
        hidden_units=(256, 128, 64), save_checkpoints_steps=0,
        # the batched step the plain PyTorch baseline takes (in-batch learning's cost is
        # bench/online_quality.py's step_ms)
        extra_train="metrics_window_samples: 100000 in_batch_learning: false",
    )
    return parse_pipeline_config_text(as_model_config_text(text, model))


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def time_steps(step, batches, warmup: int) -> float:
    for b in batches[:warmup]:
        step(b)
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    return (len(batches) - warmup) * BATCH / (time.perf_counter() - t0)


def measure_trainer_rate(trainer: Trainer, warmup: int,
                         done: Callable[[int, float], bool],
                         on_mark: Callable[[str], None] | None = None) -> float:
    """Runs ``trainer``; samples/s from global step ``warmup`` until ``done`` says stop.

    Args:
        trainer: a trainer, not started.
        warmup: steps excluded from the measurement.
        done: ``done(step, seconds_since_warmup)``; True ends the measurement and the run.
        on_mark: called with ``"start"`` and ``"end"`` as the measurement starts and ends
            (e.g. to read CPU counters over the same window).

    Returns:
        Samples trained per second between the two marks.
    """
    marks: dict[str, tuple[float, int]] = {}

    def watch() -> None:
        while True:
            step, samples = trainer.module.global_step, trainer.samples_trained
            if "start" not in marks and step >= warmup:
                marks["start"] = (time.perf_counter(), samples)
                if on_mark is not None:
                    on_mark("start")
            since = time.perf_counter() - marks["start"][0] if "start" in marks else 0.0
            if ("start" in marks and done(step, since)) or trainer.stop_event.is_set():
                marks["end"] = (time.perf_counter(), trainer.samples_trained)
                if on_mark is not None:
                    on_mark("end")
                trainer.request_stop("benchmark done")
                return
            time.sleep(0.02)  # rarely: this thread competes for the GIL with the trainer

    threading.Thread(target=watch, daemon=True).start()
    trainer.run()
    (t0, s0), (t1, s1) = marks["start"], marks["end"]
    return (s1 - s0) / (t1 - t0)


def online_rate(config, ends: dict[int, int], warmup: int, device: str,
                input_process: bool = True) -> float:
    config.data_config.input_process = input_process
    trainer = Trainer(config, TrainerOptions(online=True, device=device, status_port=-1))

    def caught_up(step: int, _secs: float) -> bool:
        pos = dict(trainer.positions)
        return bool(pos) and all(pos.get(p, 0) >= e for p, e in ends.items()) and step > warmup

    return measure_trainer_rate(trainer, warmup, caught_up)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=120, help="batches of 1024 per measurement")
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-workers", type=int, default=0,
                    help="data_config.num_workers of the online trainer (0 = build in its "
                         "reader thread)")
    ap.add_argument("--input-process", choices=("1", "0", "both"), default="1",
                    help="data_config.input_process of the online trainer; both: measure "
                         "each (online = 1, online_threads = 0)")
    add_output_args(ap)
    ap.add_argument("--device", default="cpu",
                    help="cpu, cuda or auto, for all three (the online trainer's --device)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads for all three (0 = odl's auto: half the CPUs)")
    ap.add_argument("--model", choices=IMPLEMENTED_MODEL_CLASSES, default="DeepFM",
                    help="the model over the same features (as_model_config_text); the plain "
                         "PyTorch baseline is DeepFM's only")
    args = ap.parse_args()
    setup_logging("WARNING")
    threads = configure_torch_threads(args.torch_threads)

    work = tempfile.mkdtemp(prefix="odl-bench-")
    n = args.batches * BATCH
    stream = SyntheticCtrStream(seed=5)
    # with the columns the model's config reads (the multi-task models' second label,
    # MultiTowerDIN's behaviour sequence)
    values = records_for_model(args.model, stream, stream.next_batch(n))
    names = {"1": ["online"], "0": ["online_threads"],
             "both": ["online", "online_threads"]}[args.input_process] + ["torchrec"]
    if args.model == "DeepFM":
        names.append("plain")
    rates: dict[str, list[float]] = {k: [] for k in names}
    broker_cpu: dict[str, list[float]] = {k: [] for k in names}
    online = names[0]  # the headline online variant
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        # One topic for all rounds (each round's trainer starts from offset 0 in a new
        # model_dir). The embedded broker rewrites its whole data file after a write; wait for
        # that save so it does not share the machine with the first measurement.
        create_topic(broker.bootstrap, TOPIC, partitions=PARTITIONS)
        produce(broker.bootstrap, TOPIC, values, PARTITIONS)
        ends = end_offsets(broker.bootstrap, TOPIC)
        broker.wait_until_idle()
        broker_proc = psutil.Process(broker.pid)
        for r in range(args.rounds):
            config = make_config(os.path.join(work, f"model_dir_{r}"), broker.bootstrap, TOPIC,
                                 args.model)
            config.data_config.num_workers = args.num_workers  # used by the online trainer
            features = FeatureBuilder(config)
            batches = [features.build(values[i : i + BATCH]).batch for i in range(0, n, BATCH)]
            # ABBA order: the two compared measurements sit side by side in every round and
            # neither always goes first
            order = list(rates) if r % 2 == 0 else list(reversed(rates))
            for name in order:
                broker.wait_until_idle()  # e.g. the save after the last trainer's commit
                cpu0, t0 = _cpu_seconds(broker_proc), time.perf_counter()
                if name.startswith("online"):
                    # a fresh model_dir each: a trainer would resume the other's checkpoint
                    config.model_dir = os.path.join(work, f"model_dir_{r}_{name}")
                    rate = online_rate(config, ends, args.warmup, args.device,
                                       input_process=name == "online")
                elif name == "torchrec":
                    module = TrainModule(config, features, device=args.device)
                    rate = time_steps(module.train_step, batches, args.warmup)
                    del module
                else:
                    plain = PlainDeepFM(config, features, device=args.device)
                    rate = time_steps(plain.step, batches, args.warmup)
                    del plain
                rates[name].append(rate)
                broker_cpu[name].append(
                    (_cpu_seconds(broker_proc) - cpu0) / (time.perf_counter() - t0))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
                  + f" ({online}/torchrec {rates[online][-1] / rates['torchrec'][-1]:.3f};"
                  f" broker CPU during {online} {broker_cpu[online][-1]:.2f} cores)", flush=True)

    med = {k: statistics.median(v) for k, v in rates.items()}

    def paired(a: str, b: str) -> list[float]:
        return [round(x / y, 3) for x, y in zip(rates[a], rates[b], strict=True)]

    pairs = {"online_over_torchrec": paired(online, "torchrec")}
    if "plain" in rates:
        pairs["torchrec_over_plain"] = paired("torchrec", "plain")
        pairs["online_over_plain"] = paired(online, "plain")
    if "online_threads" in rates and online != "online_threads":
        pairs["online_threads_over_torchrec"] = paired("online_threads", "torchrec")
    result = {
        "samples_per_sec": {k: round(v) for k, v in med.items()},
        "samples_per_sec_per_round": {k: [round(x) for x in v] for k, v in rates.items()},
        # headline: median over rounds of the ratio within a round (paired measurements)
        **{k: round(statistics.median(v), 3) for k, v in pairs.items()},
        "per_round": pairs,
        "ratio_of_medians": {
            "online_over_torchrec": round(med[online] / med["torchrec"], 3),
            **({"online_over_plain": round(med[online] / med["plain"], 3)}
               if "plain" in med else {}),
        },
        "model": args.model,
        "input_process": args.input_process,
        "batches": args.batches,
        "torch_threads": threads,
        "device": args.device,
        "cpus": usable_cpus(),
        "num_workers": args.num_workers,
        "rounds": args.rounds,
        "broker_cpu_cores": {k: round(max(v), 3) for k, v in broker_cpu.items()},
    }
    print(json.dumps(result, indent=1))
    print("medians over rounds of the per-round ratios (ratio of median rates in brackets):")
    for key, label, target in (("online_over_torchrec", "online loop / in-memory TorchRec",
                                " (target >= 0.85)"),
                               ("online_over_plain", "online loop / plain PyTorch     ",
                                " (target >= 1.5)"),
                               ("torchrec_over_plain", "TorchRec step / plain PyTorch   ", ""),
                               ("online_threads_over_torchrec",
                                "online, input in threads / TorchRec", "")):
        if key not in result:
            continue
        rom = result["ratio_of_medians"].get(key)
        print(f"{label} = {result[key]:.3f}" + (f" [{rom:.3f}]" if rom else "") + target)
    finish_run(args, result, work, plot=lambda path: plot_rounds(
        path, result["samples_per_sec_per_round"], "samples/s",
        f"train throughput: {args.model}, {args.device}, input process {args.input_process}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
