"""How much batching costs a per-sample learner: logistic regression with Adagrad, one
record at a time or in batches, on MovieLens 100k in time order.

A linear model over the same features VW reads (``odl.datagen.movielens_stream``: user,
age, gender, occupation, zip3, movie, genres, year, hour, weekday, plus a constant), each
feature one weight with its own Adagrad accumulator, ``lr`` the step rate; every record is
predicted before it is learned from (progressive AUC). Rules within a batch of B records:

* ``plain``: every record predicted with the weights of the batch's start; each weight then
  steps once on the batch's summed gradient ``S`` (accumulator ``+= S**2``), as a batched
  trainer's fused Adagrad kernel does;
* ``in-batch``: odl's in-batch learning (``odl.train.in_batch.in_batch_learning``) on this linear
  model: record j predicted after a batched Adagrad step on the unshifted errors of the
  batch's earlier records that share its features, then trained (``plain`` update) on the
  shifted predictions' errors;
* ``in-batch-q``: the same with per-record accumulators in the shift and the update
  (``odl.train.in_batch.per_record_adagrad``, largest gain 3);
* ``in-batch-seq`` / ``in-batch-q-seq``: sequential in-batch learning
  (``odl.train.in_batch.in_batch_scan``): the earlier records' errors in the shift are those
  of their own shifted predictions, computed record by record, without / with per-record
  accumulators.

B = 1 is per-sample Adagrad (what VW does, up to VW's own normalisation). The point is to
tell apart what a batch costs from what odl's DeepFM costs: run with the same batch sizes
as ``bench/online_quality.py --stream movielens`` and compare.

    .venv/bin/python bench/batched_logistic.py --data DIR [--lr 0.1,0.3] [--batch 1,16,64,256]
        [--rule plain,in-batch,in-batch-q,in-batch-seq,in-batch-q-seq] [--json out.json]

Pure Python: 1-2 s per setting for the 100k records.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.auc import roc_auc  # noqa: E402
from odl.datagen.movielens_stream import MovieLensStream  # noqa: E402

GAIN = 3.0  # the per-record rule's largest gain, as per_record_adagrad_max_gain's default


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(min(z, 30.0), -30.0)))


def progressive(feats: list[list[str]], y: np.ndarray, lr: float, batch: int,
                rule: str) -> np.ndarray:
    """Each record's prediction before it is learned from, under ``rule`` (docstring)."""
    per_record = rule.startswith("in-batch-q")
    sequential = rule.endswith("-seq")
    shift_on = rule != "plain"
    w: dict[str, float] = defaultdict(float)
    acc: dict[str, float] = defaultdict(float)
    p = np.empty(len(y))

    def growth(s: float, q: float) -> float:
        return max(q, s * s / GAIN ** 2) if per_record else s * s

    for lo in range(0, len(y), batch):
        idx = range(lo, min(lo + batch, len(y)))
        z = {j: sum(w[t] for t in feats[j]) for j in idx}
        s_earlier: dict[str, float] = defaultdict(float)
        q_earlier: dict[str, float] = defaultdict(float)
        for j in idx:
            shift = 0.0
            if shift_on:
                for t in feats[j]:
                    s = s_earlier[t]
                    if s:
                        shift -= lr * s / math.sqrt(acc[t] + growth(s, q_earlier[t]) + 1e-16)
                # the error the earlier records step with: at the shifted prediction
                # (sequential), else at the batch's start
                g0 = _sigmoid(z[j] + shift if sequential else z[j]) - y[j]
                for t in feats[j]:
                    s_earlier[t] += g0
                    q_earlier[t] += g0 * g0
            p[j] = _sigmoid(z[j] + shift)
        s_sum: dict[str, float] = defaultdict(float)
        q_sum: dict[str, float] = defaultdict(float)
        for j in idx:
            g = p[j] - y[j]
            for t in feats[j]:
                s_sum[t] += g
                q_sum[t] += g * g
        for t, s in s_sum.items():
            acc[t] += growth(s, q_sum[t])
            w[t] -= lr * s / math.sqrt(acc[t] + 1e-16)
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="the unpacked ml-100k directory")
    ap.add_argument("--lr", default="0.3", help="Adagrad rates to try")
    ap.add_argument("--batch", default="1,16,64,256", help="batch sizes to try")
    ap.add_argument("--rule", default="plain,in-batch,in-batch-q-seq",
                    help="rules within a batch: plain, in-batch, in-batch-q, in-batch-seq, "
                         "in-batch-q-seq")
    add_output_args(ap)
    args = ap.parse_args()
    stream = MovieLensStream(args.data)
    feats = [[t for t in ex.split()[1:] if not t.startswith("|")] + ["constant"]
             for ex in stream.vw]
    y = stream.labels.astype(np.float64)
    cut = int(len(y) * 0.8)
    rows = {}
    for lr in [float(x) for x in args.lr.split(",")]:
        for b in [int(x) for x in args.batch.split(",")]:
            for rule in args.rule.split(","):
                if b == 1 and rule != "plain":
                    continue  # one record: nothing earlier in its batch
                t0 = time.perf_counter()
                p = progressive(feats, y, lr, b, rule)
                name = f"lr {lr:g} batch {b} {rule}"
                rows[name] = {"auc": round(roc_auc(y, p), 4),
                              "auc_last20": round(roc_auc(y[cut:], p[cut:]), 4),
                              "seconds": round(time.perf_counter() - t0, 1)}
                print(name, rows[name], flush=True)
    result = {"records": len(y), "rows": rows}
    finish_run(args, result, tempfile.mkdtemp(prefix="odl-batched-logistic-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
