"""Online learning quality: odl against Vowpal Wabbit on the same time-ordered stream.

Every learner predicts each record before it learns from it (progressive validation); the
figures are the AUC and logloss of those predictions over all records and over the last
20 %, and the learner's samples/s, all from one run on one machine:

* ``oracle``: the stream's true probabilities (the best any learner can do);
* ``vw linear`` / ``vw -q ui``: Vowpal Wabbit (the ``vowpalwabbit`` Python bindings,
  logistic loss, one record at a time: ``predict`` then ``learn``), namespaces ``u`` (user),
  ``i`` (item, category), ``c`` (device, hour); ``-q ui`` adds the user x item crosses; each
  at every ``--vw-lr`` learning rate (the best is the one to beat);
* ``odl batch B sparse lr S dense lr D``: odl's own training step (``TrainModule.train_step`` on
  the stream's DeepFM, or ``--config``'s model, with its batch size and its two constant
  learning rates, tables and dense part, set to B, S and D), batches of B records in
  stream order, each batch predicted before the step that learns from it (what
  ``odl-train --online`` reports as progressive AUC); the rate includes building the
  batches, ``step_ms`` is the mean training step alone; with in-batch learning
  ``shift_gain`` is how much its shift took off the step's loss at the end (``/status``'s
  ``in_batch.loss_gain``) and ``in_batch`` its phase at the end and the phase changes
  (``/status``'s ``in_batch.phase`` and ``switches``; decided by the trainer where the config
  does not write ``in_batch_learning``);
* served (``--serve-delay D``, default 2500): the AUC of what a server of each learner's
  state would have answered, each record predicted by the state that had learned the
  records before it minus D (for odl: every batch ending at or before that; predictions in
  eval mode, as ``odl-serve`` makes them). D stands for the publishing and replay delay
  (2,500 records is 0.25 s at 10k records/s, the freshness bench's p50); it is the figure
  users meet, where the progressive AUC is the learner's own;
* ``odl-train --online`` (``--broker``): the records produced to one partition of the
  embedded broker and trained by ``Trainer`` (the code of ``odl-train --online``, its process
  set up as the command sets it: torch's threads at half the CPUs, subnormals flushed) with
  ``metrics_window_samples`` = 20 % of the records; its own ``/status`` figures
  (``auc_total``: all records, from its histogram; ``auc``: the window, the last 20 %).

The stream (``--stream``) is ``odl.datagen.bursty_stream`` (the default: users in sessions
of many events within seconds, new users and items all the time, popularity that fades,
labels from a user x item model; odl trains the bursty sample's DeepFM) or the Criteo-like
stream of ``make demo`` (``criteo``: ``odl.datagen.synthetic_ctr`` at 10k records per
simulated second; odl trains a DeepFM of its 26 ids (dim 16, 100k-row tables), 13 dense
features and a 256-128-64 DNN; VW reads namespaces ``d`` (the 13 numbers) and ``c`` (the 26
ids), its quadratic form ``-q cc``, and ``-q true pairs``: each of the hidden model's three
interacting field pairs crossed alone, the form that contains the stream's hidden model, so
the best any learner of this kind gets from these records), or ``movielens``: the real
ratings of MovieLens 100k in time order (``odl.datagen.movielens_stream``, label 1 for a
rating of 4 or 5; ``--data`` is the unpacked ``ml-100k`` directory, or one of GroupLens'
later archives such as ``ml-latest-small`` (``ratings.csv``, ``movies.csv``), neither shipped
here; odl trains ``samples/movielens_online.config`` unless ``--config`` names another, e.g.
``bench/configs/movielens_latest_as_written.config`` for ``ml-latest-small``; there is no
oracle row); ``--seed``, ``--records``.

Needs ``vowpalwabbit`` (``pip install -r bench/requirements-quality.txt``); without it the
VW rows are skipped and say so.

    .venv/bin/python bench/online_quality.py [--stream bursty|criteo|movielens] [--data DIR]
        [--records 200000] [--seed 1]
        [--vw-lr 0.1,0.5,2] [--batch 256,1024] [--sparse-lr 0.1] [--dense-lr 0.001]
        [--in-batch 0,1] [--sequential 0,1] [--wide-lr-mult 1,3] [--per-record 0,1]
        [--per-record-gain 2,3] [--wide-adapt 0,1] [--table-init-acc 0,0.1]
        [--serve-delay 2500] [--config samples/X.config] [--config-as-written]
        [--broker] [--json out.json]

``--config-as-written``: ``--config`` (without it, on the bursty and Criteo-like streams, the
stream's DeepFM as its generator writes it: EasyRec's fields only) with its own batch size
and rates (what a user who brings the config gets from odl's defaults: in-batch learning
decided by the trainer from the stream, the row's ``in_batch`` says what it decided), then
the same config with ``in_batch_learning: true`` and with ``false`` (``AS_WRITTEN_EXTRAS``),
against VW's grid, in one run; with ``--broker`` each also through the embedded broker
(``odl-train --online``, wall-clock samples/s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.auc import roc_auc  # noqa: E402
from odl.config.pipeline_config import (  # noqa: E402
    load_pipeline_config,
    parse_pipeline_config_text,
)
from odl.datagen.bursty_stream import BurstyStream  # noqa: E402
from odl.datagen.datagen_config import bursty_config_text, deepfm_config_text  # noqa: E402
from odl.datagen.movielens_stream import MovieLensStream  # noqa: E402
from odl.datagen.synthetic_ctr import INTERACTION_PAIRS, SyntheticCtrStream  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.models.model_registry import check_pipeline_config  # noqa: E402
from odl.train.progressive_metrics import log_loss  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402

TAIL = 0.2  # the last share of the records reported on its own
CURVE_POINTS = 20  # the plotted AUC curve: the AUC of each 1/20 of the stream
MOVIELENS_SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "samples", "movielens_online.config")


def scores(probs: np.ndarray, labels: np.ndarray) -> dict:
    """AUC and logloss over all records and over the last ``TAIL`` of them; the AUC over the
    first ``TAIL`` (a cold learner's start) and over the rest."""
    cut = int(len(labels) * (1 - TAIL))
    head = int(len(labels) * TAIL)
    return {"auc": round(roc_auc(labels, probs), 4),
            "logloss": round(log_loss(probs, labels), 4),
            "auc_last20": round(roc_auc(labels[cut:], probs[cut:]), 4),
            "logloss_last20": round(log_loss(probs[cut:], labels[cut:]), 4),
            "auc_first20": round(roc_auc(labels[:head], probs[:head]), 4),
            "auc_after_first20": round(roc_auc(labels[head:], probs[head:]), 4)}


def auc_curve(probs: np.ndarray, labels: np.ndarray) -> list[float | None]:
    """The AUC of each of ``CURVE_POINTS`` consecutive equal parts of the stream."""
    out: list[float | None] = []
    for part in np.array_split(np.arange(len(labels)), CURVE_POINTS):
        y = labels[part]
        out.append(round(roc_auc(y, probs[part]), 4) if 0 < y.sum() < len(y) else None)
    return out


def plot_quality(path: str, result: dict) -> None:
    """The AUC along the stream of the oracle, each VW setting and each odl setting."""
    from bench.bench_plots import plot_curves
    n, k = result["records"], CURVE_POINTS
    x = [(i + 0.5) * n / k for i in range(k)]
    learners = {name: c for name, c in result["curves"].items() if name != "oracle"}
    oracle = result["rows"].get("oracle", {}).get("auc")  # far above the rest: not drawn
    plot_curves(path, x, learners, "records (middle of each 1/20 of the stream)",
                "AUC of that part", f"online quality: {result['stream']} stream, {n} records, "
                f"seed {result['seed']}" + (f" (oracle {oracle}, not drawn)" if oracle else ""))


def served_scores(served: np.ndarray | None, labels: np.ndarray) -> dict:
    """The served predictions' AUC over all records and the last ``TAIL`` (none: {})."""
    if served is None:
        return {}
    cut = int(len(labels) * (1 - TAIL))
    return {"served_auc": round(roc_auc(labels, served), 4),
            "served_auc_last20": round(roc_auc(labels[cut:], served[cut:]), 4)}


def make_stream(records: int, seed: int, kind: str = "bursty",
                data: str = "") -> tuple[list, list[bytes]]:
    """The stream's batches (labels, true probabilities; MovieLens: the one stream, no
    probabilities) and its CSV records."""
    if kind == "movielens":
        ml = MovieLensStream(data, records)
        return [ml], ml.values()
    if kind == "criteo":  # simulated event times, 10k records per second
        ctr = SyntheticCtrStream(seed=seed, events_per_second=10_000.0)
        batches: list = [ctr.next_batch(min(8192, records - k))
                         for k in range(0, records, 8192)]
    else:
        stream = BurstyStream(seed=seed)
        batches = [stream.next_batch(min(8192, records - k)) for k in range(0, records, 8192)]
    values = [v for b in batches for v in b.encode("csv")]
    return batches, values


def vw_examples(batches: list, kind: str = "bursty") -> list[str]:
    """The records in VW's text format (namespaces: module docstring)."""
    if kind == "movielens":
        return [x for ml in batches for x in ml.vw]
    out = []
    if kind == "criteo":
        for b in batches:
            for y, dense, ids in zip(b.labels.tolist(), b.dense.tolist(), b.ids.tolist(),
                                     strict=True):
                num = " ".join(f"I{j + 1}:{v}" for j, v in enumerate(dense) if v)
                cat = " ".join(f"C{j + 1}={v}" for j, v in enumerate(ids))
                out.append(f"{1 if y else -1} |d {num} |c {cat}")
        return out
    for b in batches:
        hours = b.hours()
        for y, u, i, c, d, h in zip(b.labels.tolist(), b.users.tolist(), b.items.tolist(),
                                    b.categories.tolist(), b.devices.tolist(), hours.tolist(),
                                    strict=True):
            out.append(f"{1 if y else -1} |u u{u} |i i{i} c{c} |c d{d} h{h}")
    return out


# The train_config settings the bench can vary: (command-line option, field, value type,
# row-name label). A run's settings are a {field: value} dict; a field left out keeps the
# config's value.
SETTINGS = (
    ("--in-batch", "in_batch_learning", bool, "in-batch"),
    ("--sequential", "in_batch_sequential", bool, "sequential"),
    ("--wide-lr-mult", "wide_learning_rate_multiplier", float, "wide x"),
    ("--per-record", "per_record_adagrad", bool, "per-record"),
    ("--per-record-gain", "per_record_adagrad_max_gain", float, "gain"),
    ("--wide-adapt", "wide_rate_adaptation", bool, "wide adapt"),
    # the tables' Adagrad (optimizer_config[0]), not a train_config field
    ("--table-init-acc", "initial_accumulator_value", float, "acc"),
)
TABLE_OPTIMIZER_FIELDS = ("initial_accumulator_value",)
# --config-as-written's second run: the config plus odl's in-batch learning field (its own
# defaults: the sequential pass, per-record Adagrad, the wide rate adapted from 3) and without
AS_WRITTEN_EXTRAS = ((("in_batch_learning", True),), (("in_batch_learning", False),))
# settings that need in_batch_learning: off with it unless the run names them
NEEDS_IN_BATCH = ("in_batch_sequential", "per_record_adagrad", "wide_rate_adaptation")


def odl_config(kind: str, model_dir: str, batch: int | None, sparse_lr: float | None,
               dense_lr: float | None, config_path: str = "", train: dict | None = None, **kw):
    """The odl config of a run: ``config_path`` (e.g. a sample), else the stream's DeepFM (the
    bursty sample's shape, or the Criteo-like demo's: 26 ids of dim 16 in tables of 100k
    rows, 13 dense, DNN 256-128-64); its batch size and its two ``optimizer_config``
    constant rates (tables, dense part) set to the run's (None: the config's as written),
    and the ``train`` settings (``SETTINGS`` fields) where given."""
    if kind == "movielens" and not config_path:
        config_path = MOVIELENS_SAMPLE
    if config_path:
        config = load_pipeline_config(config_path)
        config.train_config.ClearField("incr_save_config")  # learning only, no publishing
        for key, value in kw.items():  # the broker run's server / topic / window
            if key == "server":
                config.kafka_train_input.server = value
            elif key == "topic":
                config.kafka_train_input.topic = value
            elif key == "extra_train":
                text_format.Merge(value, config.train_config)
    elif kind == "criteo":
        config = parse_pipeline_config_text(deepfm_config_text(
            model_dir, dim=16, buckets=100_000, hidden_units=(256, 128, 64),
            save_checkpoints_steps=100_000, **kw))
    else:
        config = parse_pipeline_config_text(bursty_config_text(model_dir, **kw))
    config.model_dir = model_dir
    if batch is not None:
        config.data_config.batch_size = batch
    train = dict(train or {})
    if train.get("in_batch_learning") is False:
        for field in NEEDS_IN_BATCH:
            train.setdefault(field, False)
    tables, dense = config.train_config.optimizer_config[:2]
    for field, value in train.items():
        if field in TABLE_OPTIMIZER_FIELDS:
            setattr(getattr(tables, tables.WhichOneof("optimizer")), field, value)
        else:
            setattr(config.train_config, field, value)
    for entry, rate in ((tables, sparse_lr), (dense, dense_lr)):
        if rate is None:
            continue
        lr = getattr(entry, entry.WhichOneof("optimizer")).learning_rate
        if lr.WhichOneof("learning_rate") != "constant_learning_rate":
            raise SystemExit(f"{config_path}: the bench sets constant learning rates only")
        lr.constant_learning_rate.learning_rate = rate
    check_pipeline_config(config, online=True)
    return config


def settings_name(train: dict) -> str:
    """The row-name suffix of a run's ``SETTINGS`` values (those it does not set: none)."""
    out = ""
    for _option, field, kind, label in SETTINGS:
        if field in train:
            value = train[field]
            out += (f" {label} {int(value)}" if kind is bool
                    else f" {label}{value:g}" if label.endswith("x") else f" {label} {value:g}")
    return out


def settings_grid(args: argparse.Namespace) -> list[dict]:
    """Every combination of the ``SETTINGS`` values given on the command line, leaving out
    those that cannot run (a setting of ``NEEDS_IN_BATCH`` on without in-batch learning, a
    gain without per-record Adagrad)."""
    axes = []
    for option, field, kind, _label in SETTINGS:
        text = getattr(args, option[2:].replace("-", "_"))
        values = ([bool(int(x)) if kind is bool else float(x) for x in text.split(",")]
                  if text else [None])
        axes.append([(field, v) for v in values])
    grid = []
    for combo in itertools.product(*axes):
        train = {f: v for f, v in combo if v is not None}
        if train.get("in_batch_learning") is False and any(
                train.get(f) for f in NEEDS_IN_BATCH):
            continue
        if "per_record_adagrad_max_gain" in train and train.get("per_record_adagrad") is False:
            continue
        grid.append(train)
    return grid


# VW namespaces of the Criteo-like stream's interacting fields (INTERACTION_PAIRS, 0-based
# C fields) for VW's "true pairs" form, which crosses each pair alone.
PAIR_NAMESPACES = {5: "f", 13: "n", 16: "q", 24: "y", 8: "i", 22: "w"}


def vw_pair_examples(batches: list) -> tuple[list[str], str]:
    """The Criteo-like records with each interacting field in its own namespace, and the
    ``-q`` pairs that cross exactly the hidden model's interacting fields: the learner whose
    form contains the stream's hidden model (its drift aside)."""
    out = []
    for b in batches:
        for y, dense, ids in zip(b.labels.tolist(), b.dense.tolist(), b.ids.tolist(),
                                 strict=True):
            num = " ".join(f"I{j + 1}:{v}" for j, v in enumerate(dense) if v)
            cat = " ".join(f"C{j + 1}={v}" for j, v in enumerate(ids)
                           if j not in PAIR_NAMESPACES)
            own = " ".join(f"|{ns} C{j + 1}={ids[j]}" for j, ns in PAIR_NAMESPACES.items())
            out.append(f"{1 if y else -1} |d {num} |c {cat} {own}")
    pairs = " ".join(PAIR_NAMESPACES[a] + PAIR_NAMESPACES[b] for a, b in INTERACTION_PAIRS)
    return out, pairs


def run_vw(examples: list[str], lr: float, quadratic: str,
           delay: int = 0) -> tuple[np.ndarray, float, np.ndarray | None]:
    """VW's progressive predictions, its rate, and (``delay`` > 0) its served predictions:
    record m predicted by the state that learned the records before ``m - delay``."""
    import vowpalwabbit

    args = (f"--loss_function logistic --link logistic -b 24 --learning_rate {lr} --quiet"
            + "".join(f" -q {pair}" for pair in quadratic.split()))
    ws = vowpalwabbit.Workspace(args)
    n = len(examples)
    probs = np.empty(n)
    served = np.empty(n) if delay else None

    def predict(k: int) -> float:
        ex = ws.parse(examples[k])
        p = ws.predict(ex)
        ws.finish_example(ex)
        return p

    if served is not None:
        for m in range(min(delay + 1, n)):  # the initial state serves the first records
            served[m] = predict(m)
    t0 = time.perf_counter()
    for k, text in enumerate(examples):
        ex = ws.parse(text)
        probs[k] = ws.predict(ex)
        ws.learn(ex)
        ws.finish_example(ex)
        if served is not None and k + delay + 1 < n:
            served[k + delay + 1] = predict(k + delay + 1)
    rate = n / (time.perf_counter() - t0)
    ws.finish()
    return probs, rate, served


def run_odl(values: list[bytes], batch: int | None, work: str, sparse_lr: float | None = 0.1,
            dense_lr: float | None = 0.001, delay: int = 0, kind: str = "bursty",
            config_path: str = "", **settings) -> tuple[np.ndarray, float, float,
                                                        np.ndarray | None, float | None]:
    """odl's progressive predictions, its rate (building included), its mean train step in
    ms (building excluded), (``delay`` > 0) its served predictions: record m predicted
    (eval mode, as serving) by the state that learned every batch ending at or before
    ``m - delay``, and in-batch learning's ``/status`` at the end (``in_batch_status``; None
    without it). The served predictions are made after the timing."""
    config = odl_config(kind, os.path.join(work, f"odl-{batch}-{sparse_lr}-{dense_lr}"),
                        batch, sparse_lr, dense_lr, config_path, **settings)
    batch = int(config.data_config.batch_size)
    fb = FeatureBuilder(config)
    module = TrainModule(config, fb, device="cpu")
    n = len(values)
    probs = []
    stepping = 0.0
    t0 = time.perf_counter()
    for k in range(0, n, batch):
        built = fb.build(values[k:k + batch]).batch
        t1 = time.perf_counter()
        out = module.train_step(built)
        stepping += time.perf_counter() - t1
        probs.append(out.probs)
    rate = n / (time.perf_counter() - t0)
    step_ms = 1000 * stepping / -(-n // batch)
    in_batch = module.in_batch_status()  # the shift's gain and the trainer's decision
    in_batch = in_batch if "phase" in in_batch else None
    served = None
    if delay:
        module = TrainModule(config, fb, device="cpu")  # again, serving as it goes
        served = np.empty(n)

        def serve(lo: int, hi: int) -> None:
            if lo < hi:
                served[lo:hi] = module.predict(fb.build(values[lo:hi]).batch)

        serve(0, min(delay + batch, n))  # records before the first batch's state counts
        for k in range(0, n, batch):
            module.train_step(fb.build(values[k:k + batch]).batch)
            end = min(k + batch, n)  # the state now covers the records before end
            serve(min(end + delay, n), min(end + delay + batch, n))
    return np.concatenate(probs), rate, step_ms, served, in_batch


def in_batch_columns(in_batch: dict | None) -> dict:
    """A row's ``shift_gain`` and ``in_batch`` (phase, changes) from ``/status``'s."""
    if in_batch is None:
        return {}
    gain = in_batch.get("loss_gain")
    return {**({"shift_gain": round(gain, 5)} if gain is not None else {}),
            "in_batch": f"{in_batch['phase']} ({in_batch['switches']} changes)"}


def as_written_name(train: dict) -> str:
    """The suffix of a ``--config-as-written`` row: what its settings add to the config."""
    return "".join(f" + {k}: {str(v).lower()}" for k, v in train.items())


def run_broker(values: list[bytes], batch: int | None, work: str, sparse_lr: float | None,
               kind: str = "bursty", config_path: str = "", **settings) -> dict:
    import torch

    from odl.models.subnormal_floats import flush_subnormal_floats
    from odl.train.torch_runtime import configure_torch_threads

    # the process as odl-train sets it up: subnormals flushed, torch's threads at the CLI's
    # default (half the CPUs: the input process and the broker use the others)
    threads = torch.get_num_threads()
    flush_subnormal_floats()
    configure_torch_threads(0)
    try:
        return _broker_run(values, batch, work, sparse_lr, kind, config_path, **settings)
    finally:
        torch.set_num_threads(threads)


def _broker_run(values: list[bytes], batch: int | None, work: str, sparse_lr: float | None,
                kind: str, config_path: str, **settings) -> dict:
    """``run_broker``'s run in the process as it is set up."""
    from bench.train_throughput import measure_trainer_rate
    from odl.broker.embedded_broker import EmbeddedBroker
    from odl.harness.topic_records import produce
    from odl.kafka.topic_admin import end_offsets
    from odl.train.trainer import Trainer, TrainerOptions

    work = tempfile.mkdtemp(dir=work)  # a broker and model dir of this run's own
    with EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka")) as broker:
        topic = kind
        produce(broker.bootstrap, topic, values, 1)
        ends = end_offsets(broker.bootstrap, topic)
        config = odl_config(kind, os.path.join(work, "odl-train"), batch, sparse_lr,
                            None if batch is None else 0.001, config_path,
                            server=broker.bootstrap, topic=topic, **settings,
                            extra_train=f"metrics_window_samples: {int(len(values) * TAIL)}")
        trainer = Trainer(config, TrainerOptions(online=True, device="cpu", status_port=-1))

        def caught_up(_step: int, _secs: float) -> bool:
            pos = dict(trainer.positions)
            return bool(pos) and all(pos.get(p, 0) >= e for p, e in ends.items())

        rate = measure_trainer_rate(trainer, 2, caught_up)
        m = trainer.progress.summary()
        in_batch = trainer.status()["in_batch"]
    return {"auc": m["auc_total"], "logloss": m["logloss_total"], "auc_last20": m["auc"],
            "logloss_last20": m["logloss"], "samples_per_sec": round(rate),
            "samples": m["samples"],
            **in_batch_columns(in_batch if "phase" in in_batch else None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stream", choices=("bursty", "criteo", "movielens"), default="bursty",
                    help="the bursty user-item stream, the Criteo-like one of make demo, or "
                         "MovieLens 100k's ratings in time order (needs --data)")
    ap.add_argument("--data", default="",
                    help="--stream movielens: the unpacked ml-100k directory (u.data, u.user, "
                         "u.item) or ml-latest-small (ratings.csv, movies.csv); not in this "
                         "repository")
    ap.add_argument("--config", default="",
                    help="odl's pipeline config (e.g. samples/deepfm_online.config for the "
                         "criteo stream); default: the stream's DeepFM")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vw-lr", default="0.1,0.5,2", help="VW learning rates to try")
    ap.add_argument("--batch", default="256,1024", help="odl batch sizes to try")
    ap.add_argument("--sparse-lr", default="0.1",
                    help="odl table (Adagrad) learning rates to try")
    ap.add_argument("--dense-lr", default="0.001",
                    help="odl dense (Adam) learning rates to try")
    for option, field, kind, _label in SETTINGS:
        ap.add_argument(option, default="",
                        help=f"{field} values to try ({'0,1' if kind is bool else 'numbers'}; "
                             "default: the config's)")
    ap.add_argument("--serve-delay", type=int, default=2500,
                    help="also score served predictions: each record predicted by the state "
                         "that learned the records before it minus this many (0: off)")
    ap.add_argument("--broker", action="store_true",
                    help="also train through the embedded broker (odl-train --online's path)")
    ap.add_argument("--config-as-written", action="store_true",
                    help="--config as its user wrote it (its batch size and rates; without "
                         "--config, bursty and criteo: the stream's DeepFM as generated), then "
                         "the same with in_batch_learning: true and false (AS_WRITTEN_EXTRAS), "
                         "against VW; --batch, --sparse-lr, --dense-lr and the settings are "
                         "not used")
    add_output_args(ap)
    args = ap.parse_args()
    if args.config_as_written and not args.config and args.stream == "movielens":
        ap.error("--config-as-written on movielens needs --config (its default config is the "
                 "MovieLens sample, which writes odl's own fields)")
    work = tempfile.mkdtemp(prefix="odl-quality-")
    if args.stream == "movielens" and not args.data:
        ap.error("--stream movielens needs --data (the unpacked ml-100k directory)")
    batches, values = make_stream(args.records, args.seed, args.stream, args.data)
    labels = np.concatenate([b.labels for b in batches]).astype(np.float64)
    rows: dict[str, dict] = {}
    curves: dict[str, list] = {}
    if args.stream != "movielens":  # real data has no oracle
        truth = np.concatenate([b.probabilities for b in batches])
        rows["oracle"] = scores(truth, labels)
        curves["oracle"] = auc_curve(truth, labels)
    try:
        import vowpalwabbit  # noqa: F401
        examples = vw_examples(batches, args.stream)
        forms = [("linear", examples, ""),
                 *([("-q cc", examples, "cc"), ("-q true pairs", *vw_pair_examples(batches))]
                   if args.stream == "criteo" else [("-q ui", examples, "ui")])]
        for form, texts, quadratic in forms:
            for lr in [float(x) for x in args.vw_lr.split(",")]:
                probs, rate, _none = run_vw(texts, lr, quadratic)  # timed alone
                served = (run_vw(texts, lr, quadratic, args.serve_delay)[2]
                          if args.serve_delay else None)
                name = f"vw {form} lr {lr:g}"
                rows[name] = {**scores(probs, labels), "samples_per_sec": round(rate),
                              **served_scores(served, labels)}
                curves[name] = auc_curve(probs, labels)
                print(name, rows[name], flush=True)
    except ImportError:
        rows["vw"] = {"skipped": "vowpalwabbit is not installed "
                                 "(pip install -r bench/requirements-quality.txt)"}
    if args.config_as_written:
        grid = [(None, None, None, dict(extra)) for extra in ((), *AS_WRITTEN_EXTRAS)]
    else:
        grid = [(b, slr, dlr, train) for b in [int(x) for x in args.batch.split(",")]
                for slr in [float(x) for x in args.sparse_lr.split(",")]
                for dlr in [float(x) for x in args.dense_lr.split(",")]
                for train in settings_grid(args)]
    for b, slr, dlr, train in grid:
        probs, rate, step_ms, served, in_batch = run_odl(
            values, b, work, slr, dlr, args.serve_delay, args.stream, args.config, train=train)
        name = ("odl as written" + as_written_name(train) if args.config_as_written else
                f"odl batch {b} sparse lr {slr:g} dense lr {dlr:g}" + settings_name(train))
        rows[name] = {**scores(probs, labels), "samples_per_sec": round(rate),
                      "step_ms": round(step_ms, 3), **served_scores(served, labels),
                      **in_batch_columns(in_batch)}
        curves[name] = auc_curve(probs, labels)
        print(name, rows[name], flush=True)
    if args.broker:  # the first setting (--config-as-written: all three) through the broker
        for b, slr, _dlr, train in grid if args.config_as_written else grid[:1]:
            name = ("odl-train --online as written" + as_written_name(train)
                    if args.config_as_written else
                    f"odl-train --online batch {b}" + settings_name(train))
            rows[name] = run_broker(values, b, work, slr, args.stream, args.config,
                                    train=train)
            print(name, rows[name], flush=True)
    result = {"stream": args.stream, "config": args.config or "the stream's DeepFM",
              "records": len(values), "seed": args.seed,
              "positive_rate": round(float(labels.mean()), 4), "rows": rows,
              "curves": curves}
    print(json.dumps(result, indent=1))
    finish_run(args, result, work, plot=lambda path: plot_quality(path, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
