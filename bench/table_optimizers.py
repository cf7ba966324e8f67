"""Table optimizers on the in-memory train step: fused Adagrad against the row-sparse kinds.

fbgemm's CPU kernels cover SGD and (row-wise) Adagrad; EasyRec's Adam, FTRL, momentum,
MomentumW and RMSProp tables and DeepRec's AdagradDecay (``adagrad_decay_optimizer``) run
row-sparse (``odl.train.row_sparse_tables``: the touched rows updated after backward), and
so do TorchEasyRec's LAMB, LARS-SGD, partial row-wise Adam /
LAMB, RMSprop, Adadelta and row-wise Adagrad with a decay (its ``sparse_optimizer`` /
``dense_optimizer`` form; the last named ``rowwise_adagrad_optimizer_l2_decay`` here). Each
kind trains the bursty sample model (DeepFM, batch ``--batch``, id tables of ``--buckets``
rows) on the same pre-built batches, in turn within each round (order rotated per round);
prints samples/s per kind and its ratio to fused Adagrad, the median over rounds of the
per-round ratio. Run it at two ``--buckets`` to see that the row-sparse cost follows the
batch, not the table.

    .venv/bin/python bench/table_optimizers.py [--batch 1024] [--buckets 100000]
        [--rounds 5] [--torch-threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.config.pipeline_config import parse_pipeline_config_text  # noqa: E402
from odl.datagen.bursty_stream import BurstyStream  # noqa: E402
from odl.datagen.datagen_config import bursty_config_text  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402

EASYREC_KINDS = ("adagrad_optimizer", "adam_optimizer", "ftrl_optimizer", "momentum_optimizer",
                 "momentumw_optimizer", "rms_prop_optimizer", "adagrad_decay_optimizer")
# kinds that exist in TorchEasyRec's form only
TZREC_KINDS = ("lamb_optimizer", "lars_sgd_optimizer", "partial_rowwise_adam_optimizer",
               "partial_rowwise_lamb_optimizer", "rmsprop_optimizer", "adadelta_optimizer",
               "rowwise_adagrad_optimizer_l2_decay")
# TorchEasyRec's row-wise Adagrad with a decay (row-sparse on CPU): the kind's settings
TZREC_SETTINGS = {"rowwise_adagrad_optimizer_l2_decay":
                  ("rowwise_adagrad_optimizer", "weight_decay: 0.01 weight_decay_mode: L2")}
KINDS = EASYREC_KINDS + TZREC_KINDS


def config_text(kind: str, model_dir: str, batch: int, buckets: int) -> str:
    """The bursty sample's config with ``kind`` for the tables (TorchEasyRec's kinds with
    the sample's rates in that form), in-batch learning off."""
    # in-batch learning off for every kind: it runs with fused Adagrad tables only, and its
    # cost (or its measuring phase's) is not the table update's
    text = bursty_config_text(model_dir, batch_size=batch, buckets=buckets,
                              extra_train="in_batch_learning: false")
    if kind in EASYREC_KINDS:
        return text.replace("adagrad_optimizer", kind, 1)
    start = text.index("  optimizer_config")
    end = text.index("  save_checkpoints_steps")
    message, fields = TZREC_SETTINGS.get(kind, (kind, ""))
    tzrec = (f"sparse_optimizer {{ {message} {{ lr: 0.1 {fields} }} constant_learning_rate {{}} }} "
             "dense_optimizer { adam_optimizer { lr: 0.001 } constant_learning_rate {} }")
    return text[:start] + "  " + tzrec + "\n" + text[end:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--buckets", type=int, default=100_000, help="rows of each id table")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per kind and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--torch-threads", type=int, default=2)
    add_output_args(ap)
    args = ap.parse_args()
    configure_torch_threads(args.torch_threads)
    work = tempfile.mkdtemp(prefix="odl-bench-table-opt-")
    records = BurstyStream(seed=1).next_batch(args.batch * args.steps).encode("csv")
    modules = {}
    for kind in KINDS:
        config = parse_pipeline_config_text(config_text(kind, os.path.join(work, kind),
                                                        args.batch, args.buckets))
        fb = FeatureBuilder(config)
        tm = TrainModule(config, fb, device="cpu")
        batches = [fb.build(records[k:k + args.batch]).batch
                   for k in range(0, len(records), args.batch)]
        for b in batches[:2]:  # warm-up
            tm.train_step(b)
        modules[kind] = (tm, batches)
    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
        for kind in order:
            tm, batches = modules[kind]
            t0 = time.perf_counter()
            for b in batches:
                tm.train_step(b)
            rates[kind].append(len(batches) * args.batch / (time.perf_counter() - t0))
        print(f"round {r}: " + ", ".join(
            f"{k.removesuffix('_optimizer')} {rates[k][-1]:,.0f}/s" for k in KINDS), flush=True)
    base = rates["adagrad_optimizer"]
    result = {
        "samples_per_sec": {k: round(statistics.median(v)) for k, v in rates.items()},
        "over_fused_adagrad": {k: round(statistics.median(x / y for x, y in zip(v, base,
                                                                                  strict=True)), 3)
                               for k, v in rates.items() if k != "adagrad_optimizer"},
        "batch": args.batch, "buckets": args.buckets, "rounds": args.rounds,
        "torch_threads": args.torch_threads,
    }
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)


if __name__ == "__main__":
    main()
