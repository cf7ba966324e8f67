"""Dynamic embedding tables vs a fixed hashed table of the same rows: speed, AUC, memory.

One run, one machine, one synthetic stream, two variants trained on identical records:

* stream: ``--samples`` records ``label,uid,cat``. ``uid`` is drawn from a Zipf law of
  exponent ``--zipf`` over ``--distinct`` ids (popularity rank -> id through a random
  permutation of the id space; ids are written as text ``u<id>``, so both variants hash the
  same strings); ``cat`` is one of 100 categories. Each uid and each category has a hidden
  weight (standard normal, seeded); the label is Bernoulli(sigmoid(``--bias`` +
  ``--scale`` * w_uid + 0.5 * w_cat)). With many more distinct uids than rows, a fixed table
  (``hash_bucket_size``) pools the weights of every uid sharing a bucket; a dynamic table
  keeps a row per live uid. The oracle AUC (of the true probabilities) is the ceiling;
* fixed:   ``uid`` with ``hash_bucket_size: --capacity``;
* dynamic: ``uid`` with ``zch { zch_size: --capacity <--policy> {} }`` (plus
  ``filter_freq`` with ``--filter-freq``): the same rows, so the same table memory.

Both: DeepFM (wide uid+cat, deep uid+cat, DNN 64-32, dim ``--dim``), adagrad / adam,
batch ``--batch-size``, ``TrainModule.train_step`` on CPU (predict-then-train: the
predictions are progressive validation). Each variant runs in a subprocess of its own (clean
resident-memory figures; the first variant's tables are gone before the second starts),
builds every batch with its own ``FeatureBuilder`` before the clock starts, then times only
the ``train_step`` calls (the first ``--warmup`` steps left out of the rate), by the wall
clock and by the process's CPU time.

Prints per variant: samples/s, progressive AUC over all samples and over the last 20 %,
for the dynamic one the table's status (live rows, admitted, rejected, evicted) and its
resident memory (RSS) every ``--rss-every`` steps beside the live rows; then the ratio
dynamic/fixed of samples/s (target >= 0.8) over the whole run and over the steps after the
dynamic table filled (where evictions run), the AUC differences dynamic - fixed (target
>= 0), and the RSS growth of the dynamic run from the step its table first held 99 % of its
capacity to the end (flat memory: near 0), beside the fixed run's growth over the same steps.
The RSS lines also show the ids evicted but not yet taken as deletes (a delta publisher takes
them once per version; ``--drain-every N`` keeps them, as a publishing trainer does, and
takes them every N steps, untimed; without it the table keeps none, as a trainer without
``incr_save_config``). Machines here are noisy: compare
the ratios, measured in the same run, not the absolute rates. The variants run one after the
other, so a neighbour's load can fall on one of them only: the ratio of samples per CPU
second of the training process leaves out the time it waits for a core, though not the
slowdown of sharing a core (its caches, a hyperthread sibling) with that neighbour.
``--profile N`` runs the dynamic variant's steps under cProfile and prints its top N
functions.

``--many-tables`` measures the other end instead: ``samples/deepfm_online.config`` (27 id
tables of 10 to 200k rows, dim 16, DNN 256-128-64) as it is vs with every id table dynamic
(EasyRec's ``model_config.ev_params``, capacity = each table's ``hash_bucket_size``, so the
same rows), on the synthetic CTR stream, ``--rounds`` ABBA rounds of ``--steps`` steps in one
process; it prints the median ratio of samples/s. Here the engine's per-table work, not one
large table, is what costs. ``--capacity N`` gives every dynamic table N rows instead (the
fixed tables keep theirs), so the small ones fill and evict.

    .venv/bin/python bench/dynamic_tables.py [--quick] [--distinct 10000000]
        [--capacity 1000000] [--samples 12000000] [--zipf 1.05] [--batch-size 1024]
        [--dim 16] [--policy lru|lfu|distance_lfu] [--filter-freq 0] [--drain-every 0]
        [--variants fixed,dynamic] [--torch-threads 0] [--profile 0] [--json out.json]
    .venv/bin/python bench/dynamic_tables.py --many-tables [--filter-freq 2] [--rounds 6]
        [--steps 30] [--capacity N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.auc import roc_auc  # noqa: E402
from odl.cli.cli_logging import setup_logging

CATS = 100
CAT_BUCKETS = 1000
FILL_FRACTION = 0.99
VARIANTS = ("fixed", "dynamic")
QUICK = {"distinct": 200_000, "capacity": 20_000, "samples": 200_000}
DEFAULTS = {"distinct": 10_000_000, "capacity": 1_000_000, "samples": 12_000_000}

CONFIG = """
data_config {{
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "uid" }}
  input_fields {{ input_name: "cat" }}
  label_fields: "label"
}}
feature_config {{
  features {{ input_names: "uid" embedding_dim: {dim} {uid_table} }}
  features {{ input_names: "cat" hash_bucket_size: {cat_buckets} embedding_dim: {dim} }}
}}
model_config {{
  model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["uid", "cat"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["uid", "cat"] wide_deep: DEEP }}
  deepfm {{ dnn {{ hidden_units: [64, 32] }} wide_output_dim: 1 }}
}}
train_config {{
  sparse_optimizer {{ adagrad_optimizer {{ lr: 0.05 }} }}
  dense_optimizer {{ adam_optimizer {{ lr: 0.001 }} }}
  seed: 3
}}
"""


def config_text(variant: str, args: argparse.Namespace) -> str:
    if variant == "fixed":
        uid_table = f"hash_bucket_size: {args.capacity}"
    else:
        ff = f" filter_freq: {args.filter_freq}" if args.filter_freq else ""
        uid_table = f"zch {{ zch_size: {args.capacity} {args.policy} {{}}{ff} }}"
    return CONFIG.format(dim=args.dim, uid_table=uid_table, cat_buckets=CAT_BUCKETS)


# -- the stream ------------------------------------------------------------------------------


def make_stream(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """uid, cat, label and true probability of every record (vectorized, seeded)."""
    rng = np.random.default_rng(args.seed)
    cdf = np.cumsum(np.arange(1, args.distinct + 1, dtype=np.float64) ** -args.zipf)
    cdf /= cdf[-1]
    rank = np.searchsorted(cdf, rng.random(args.samples), side="right")
    del cdf
    rank = np.minimum(rank, args.distinct - 1)
    perm = rng.permutation(args.distinct)  # popularity rank -> id
    uid = perm[rank]
    del perm, rank
    w_uid = rng.standard_normal(args.distinct).astype(np.float32)  # hidden weight per id
    w_cat = rng.standard_normal(CATS).astype(np.float32)
    cat = rng.integers(0, CATS, args.samples)
    logit = args.bias + args.scale * w_uid[uid].astype(np.float64) + 0.5 * w_cat[cat]
    prob = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(args.samples) < prob).astype(np.int8)
    return {"uid": uid.astype(np.int64), "cat": cat.astype(np.int16), "label": label,
            "prob": prob.astype(np.float32)}


def csv_lines(stream: dict[str, np.ndarray], lo: int, hi: int) -> list[bytes]:
    """Records ``lo:hi`` as CSV bytes (``label,u<uid>,c<cat>``)."""
    return [b"%d,u%d,c%d" % t for t in zip(stream["label"][lo:hi].tolist(),
                                           stream["uid"][lo:hi].tolist(),
                                           stream["cat"][lo:hi].tolist(), strict=True)]


def distinct_seen(uid: np.ndarray, capacity: int) -> tuple[int, int]:
    """(distinct uids in the stream, records read when ``capacity`` of them were seen; -1)."""
    u, first = np.unique(uid, return_index=True)
    if u.shape[0] < capacity:
        return int(u.shape[0]), -1
    return int(u.shape[0]), int(np.partition(first, capacity - 1)[capacity - 1]) + 1


# -- one variant (child process) -------------------------------------------------------------


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_variant(args: argparse.Namespace) -> int:
    """Trains one variant on the stream in ``--work``; writes its figures and predictions."""
    import torch
    from google.protobuf import text_format

    from odl.features.feature_builder import FeatureBuilder
    from odl.protos import pipeline_pb2
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule

    variant = args.child
    threads = configure_torch_threads(args.torch_threads)
    data = np.load(os.path.join(args.work, "stream.npz"))
    stream = {k: data[k] for k in ("uid", "cat", "label")}
    n = stream["uid"].shape[0]
    bs = args.batch_size
    cfg = text_format.Parse(config_text(variant, args), pipeline_pb2.EasyRecConfig())
    features = FeatureBuilder(cfg)
    t0 = time.perf_counter()
    batches = []
    chunk = 64 * bs
    for lo in range(0, n, chunk):
        lines = csv_lines(stream, lo, min(n, lo + chunk))
        for i in range(0, len(lines), bs):
            batches.append(features.build(lines[i : i + bs]).batch)
    build_s = time.perf_counter() - t0
    del stream, data, lines
    gc.collect()
    rss_built = rss_mb()
    module = TrainModule(cfg, features, device="cpu")
    gc.collect()
    rss_start = rss_mb()
    dyn = module.dynamic.tables.get("uid") if module.dynamic else None
    if dyn is not None and args.drain_every:
        dyn.record_deletes = True  # as a publishing trainer's table
    capacity = args.capacity
    # written now (np.empty / np.zeros pages would be faulted in during the run and show
    # as growth of the resident memory)
    probs = np.full(n, np.nan, dtype=np.float32)
    step_s = np.full(len(batches), np.nan, dtype=np.float64)
    step_cpu_s = np.full(len(batches), np.nan, dtype=np.float64)  # this process's CPU time
    trace = []  # (step, samples, rss MB, live rows, evicted, pending deletes)

    def sample(step: int) -> tuple:
        if dyn is None:
            return (step, pos, rss_mb(), -1, 0, 0)
        # ids evicted but not yet taken by a publisher (DynamicTable.take_deleted)
        pending = dyn.pending_deletes()
        return (step, pos, rss_mb(), dyn.index.live, dyn.counters.evicted, pending)

    drained = 0
    fill_step = evict_step = -1
    print(f"[{variant}] built {len(batches)} batches in {build_s:.1f}s; RSS {rss_built:.0f} MB "
          f"built, {rss_start:.0f} MB with the model ({threads} torch threads)", flush=True)
    profiler = None
    if args.profile and dyn is not None:
        import cProfile

        profiler = cProfile.Profile()
    pos = 0
    wall0 = time.perf_counter()
    for i, batch in enumerate(batches):
        if profiler is not None and i == args.warmup:
            profiler.enable()
        t, c = time.perf_counter(), time.process_time()
        out = module.train_step(batch)
        step_s[i] = time.perf_counter() - t
        step_cpu_s[i] = time.process_time() - c
        b = batch.size
        if out.dropped.shape[0]:
            keep = np.ones(b, dtype=bool)
            keep[out.dropped] = False
            probs[pos : pos + b] = 0.5
            probs[pos : pos + b][keep] = out.probs
        else:
            probs[pos : pos + b] = out.probs
        pos += b
        live = dyn.index.live if dyn is not None else -1
        if args.drain_every and dyn is not None and (i + 1) % args.drain_every == 0:
            # as a delta publisher does once per version (not timed)
            drained += sum(x.shape[0] for x in module.dynamic.take_deleted().values())
        if dyn is not None and fill_step < 0 and live >= FILL_FRACTION * capacity:
            fill_step = i + 1
            trace.append(sample(i + 1))
        if dyn is not None and evict_step < 0 and dyn.counters.evicted:
            evict_step = i + 1
            trace.append(sample(i + 1))
        if (i + 1) % args.rss_every == 0 or i + 1 == len(step_s):
            trace.append(sample(i + 1))
            evicted, pending = trace[-1][4], trace[-1][5]
            done = step_s[: i + 1]
            rate = (i + 1 - min(args.warmup, i)) * bs / max(done[min(args.warmup, i):].sum(),
                                                             1e-9)
            print(f"[{variant}] step {i + 1:6d}  samples {pos:9,d}  RSS {trace[-1][2]:7.0f} MB"
                  f"  live_rows {live:9,d}  evicted {evicted:9,d}  pending deletes "
                  f"{pending:9,d}  {rate:8,.0f} samples/s",
                  flush=True)
    wall = time.perf_counter() - wall0
    if profiler is not None:
        import pstats

        profiler.disable()
        print(f"[{variant}] cProfile of train_step (steps {args.warmup}..), top "
              f"{args.profile} by cumulative time:", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(
            args.profile)
        print(f"[{variant}] top {args.profile} by own time:", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(
            args.profile)
    np.save(os.path.join(args.work, f"probs_{variant}.npy"), probs[:pos])
    np.save(os.path.join(args.work, f"step_s_{variant}.npy"), step_s)
    np.save(os.path.join(args.work, f"step_cpu_s_{variant}.npy"), step_cpu_s)
    result = {
        "variant": variant,
        "steps": len(step_s),
        "samples": pos,
        "train_step_seconds": round(float(step_s[args.warmup:].sum()), 3),
        "loop_seconds": round(wall, 3),
        "build_seconds": round(build_s, 2),
        "rss_mb_after_build": round(rss_built, 1),
        "rss_mb_with_model": round(rss_start, 1),
        "rss_mb_end": round(rss_mb(), 1),
        "fill_step": fill_step,
        "first_eviction_step": evict_step,
        # [step, samples, RSS MB, live rows, evicted, pending deletes]
        "rss_trace": [[s, p, round(r, 1), lv, ev, pd] for s, p, r, lv, ev, pd in trace],
        "deletes_drained": drained,
        "torch_threads": threads,
        "torch_version": torch.__version__,
    }
    if module.dynamic:
        result["status"] = module.dynamic.status()
    with open(os.path.join(args.work, f"result_{variant}.json"), "w") as f:
        json.dump(result, f)
    return 0


# -- the parent ------------------------------------------------------------------------------


def child_args(args: argparse.Namespace, variant: str, work: str) -> list[str]:
    out = [sys.executable, os.path.abspath(__file__), "--child", variant, "--work", work]
    for k in ("distinct", "capacity", "samples", "batch_size", "dim", "policy",
              "filter_freq", "torch_threads", "warmup", "rss_every", "profile",
              "drain_every"):
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def rate(step_s: np.ndarray, first: int, bs: int) -> float:
    t = step_s[first:]
    return float(t.shape[0] * bs / t.sum()) if t.shape[0] else float("nan")


def many_tables(args: argparse.Namespace) -> int:
    """``--many-tables``: the sample config's 27 id tables, fixed vs all dynamic, same rows."""
    import torch

    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 2) // 2))
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "samples", "deepfm_online.config")).read()
    # EasyRec's model-wide form: every id feature dynamic, capacity = its hash_bucket_size
    cap = f" max_capacity: {args.capacity}" if args.capacity else ""
    ev = f"ev_params {{ filter_freq: {max(args.filter_freq, 0)}{cap} }}"
    texts = {"fixed": text,
             "dynamic": text.replace('model_class: "DeepFM"', f'model_class: "DeepFM"\n  {ev}')}
    stream = SyntheticCtrStream(seed=args.seed)
    records = [stream.next_batch(args.batch_size).encode("csv")
               for _ in range(args.rounds * args.steps + args.warmup)]
    modules, batches = {}, {}
    for v, t in texts.items():
        cfg = parse_pipeline_config_text(t)
        fb = FeatureBuilder(cfg)
        batches[v] = [fb.build(r).batch for r in records]
        modules[v] = TrainModule(cfg, fb, device="cpu")
        for b in batches[v][: args.warmup]:
            modules[v].train_step(b)
    ratios, rates = [], {"fixed": [], "dynamic": []}
    order = ["fixed", "dynamic"]
    for r in range(args.rounds):
        lo = args.warmup + r * args.steps
        for v in (order if r % 2 == 0 else order[::-1]):  # ABBA
            t0 = time.perf_counter()
            for b in batches[v][lo : lo + args.steps]:
                modules[v].train_step(b)
            rates[v].append(args.steps * args.batch_size / (time.perf_counter() - t0))
        ratios.append(rates["dynamic"][-1] / rates["fixed"][-1])
        print(f"round {r}: fixed {rates['fixed'][-1]:,.0f} dynamic {rates['dynamic'][-1]:,.0f} "
              f"samples/s, ratio {ratios[-1]:.3f}", flush=True)
    status = modules["dynamic"].dynamic_status()
    result = {
        "mode": "many_tables", "tables": len(status), "batch_size": args.batch_size,
        "filter_freq": args.filter_freq, "rounds": args.rounds, "steps": args.steps,
        "fixed_samples_per_sec": round(float(np.median(rates["fixed"]))),
        "dynamic_samples_per_sec": round(float(np.median(rates["dynamic"]))),
        "dynamic_over_fixed_median": round(float(np.median(ratios)), 3),
        "live_rows": sum(s["live_rows"] for s in status.values()),
        "capacity": sum(s["capacity"] for s in status.values()),
        "admitted": sum(s["admitted"] for s in status.values()),
        "rejected": sum(s["rejected"] for s in status.values()),
        "evicted": sum(s["evicted"] for s in status.values()),
    }
    print(json.dumps(result, indent=1))
    print(f"{len(status)} dynamic tables / fixed: median ratio "
          f"{result['dynamic_over_fixed_median']:.3f} over {args.rounds} ABBA rounds "
          "(target >= 0.8)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke size: " + ", ".join(f"{k} {v:,}" for k, v in QUICK.items()))
    ap.add_argument("--distinct", type=int, help=f"distinct uids (default "
                    f"{DEFAULTS['distinct']:,})")
    ap.add_argument("--capacity", type=int,
                    help=f"rows of the uid table, both variants (default "
                         f"{DEFAULTS['capacity']:,})")
    ap.add_argument("--samples", type=int, help=f"records (default {DEFAULTS['samples']:,})")
    ap.add_argument("--zipf", type=float, default=1.05,
                    help="Zipf exponent of uid popularity (1.05: 1M distinct uids of 10M have "
                         "been seen after 5.7M records, under half of the default 12M)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--policy", choices=("lru", "lfu", "distance_lfu"), default="lru",
                    help="eviction policy of the dynamic table")
    ap.add_argument("--filter-freq", type=int, default=0,
                    help="zch.filter_freq of the dynamic table (0: admit at once)")
    ap.add_argument("--scale", type=float, default=1.5, help="weight of the uid's hidden logit")
    ap.add_argument("--bias", type=float, default=-1.0, help="logit bias (CTR ~ 0.3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from the rates")
    ap.add_argument("--rss-every", type=int, default=0,
                    help="steps between RSS samples (0: about 25 per run)")
    ap.add_argument("--variants", default="fixed,dynamic",
                    help="comma-separated, run in this order")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0 = odl's auto: half the CPUs)")
    ap.add_argument("--drain-every", type=int, default=0,
                    help="take the dynamic table's pending deletes every this many steps, as a "
                         "delta publisher does (0: never, as a trainer without "
                         "incr_save_config)")
    ap.add_argument("--profile", type=int, default=0,
                    help="cProfile the dynamic variant's steps; print this many functions")
    ap.add_argument("--many-tables", action="store_true",
                    help="instead: samples/deepfm_online.config's 27 id tables, fixed vs all "
                         "dynamic (model_config.ev_params, filter_freq --filter-freq, capacity "
                         "= each hash_bucket_size), ABBA rounds in one process")
    ap.add_argument("--rounds", type=int, default=6, help="--many-tables: ABBA rounds")
    ap.add_argument("--steps", type=int, default=30, help="--many-tables: steps per round")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    if args.many_tables:  # before the Zipf defaults: --capacity is unset unless given
        return many_tables(args)
    for k, v in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.rss_every <= 0:
        args.rss_every = max(1, args.samples // args.batch_size // 25)
    if args.child:
        return run_variant(args)
    wall0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="odl-bench-dyn-")
    t0 = time.perf_counter()
    stream = make_stream(args)
    np.savez(os.path.join(work, "stream.npz"), **stream)
    distinct, fill_at = distinct_seen(stream["uid"], args.capacity)
    labels, true_p = stream["label"], stream["prob"]
    del stream
    n = labels.shape[0]
    tail = n - n // 5
    oracle = {"all": roc_auc(labels, true_p), "last_20pct": roc_auc(labels[tail:], true_p[tail:])}
    print(f"stream: {n:,} records, {distinct:,} distinct uids of {args.distinct:,} (Zipf "
          f"{args.zipf}), {args.capacity:,} rows; the stream has seen {args.capacity:,} "
          f"distinct uids after {fill_at:,} records; CTR {labels.mean():.3f}; oracle AUC "
          f"{oracle['all']:.4f} (last 20 %: {oracle['last_20pct']:.4f}); made in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    res: dict[str, dict] = {}
    for v in variants:
        subprocess.run(child_args(args, v, work), check=True)
        with open(os.path.join(work, f"result_{v}.json")) as f:
            res[v] = json.load(f)
        p = np.load(os.path.join(work, f"probs_{v}.npy"))
        step_s = np.load(os.path.join(work, f"step_s_{v}.npy"))
        res[v]["auc"] = {"all": round(roc_auc(labels, p), 4),
                         "last_20pct": round(roc_auc(labels[tail:], p[tail:]), 4)}
        res[v]["samples_per_sec"] = round(rate(step_s, args.warmup, args.batch_size))
        res[v]["_step_s"] = step_s
        res[v]["_step_cpu_s"] = np.load(os.path.join(work, f"step_cpu_s_{v}.npy"))
        res[v]["samples_per_cpu_sec"] = round(rate(res[v]["_step_cpu_s"], args.warmup,
                                                   args.batch_size))

    bs = args.batch_size
    result: dict = {
        "distinct": args.distinct, "capacity": args.capacity, "samples": n,
        "zipf": args.zipf, "batch_size": bs, "dim": args.dim, "policy": args.policy,
        "filter_freq": args.filter_freq, "distinct_in_stream": distinct,
        "records_until_capacity_distinct": fill_at,
        "oracle_auc": {k: round(v, 4) for k, v in oracle.items()},
    }
    for v, r in res.items():
        result[v] = {k: x for k, x in r.items() if not k.startswith("_")}
    if "dynamic" in res:
        d = res["dynamic"]
        fill = d["fill_step"]
        trace = d["rss_trace"]
        if fill > 0:
            at_fill = next(r for r in trace if r[0] == fill)[2]
            end = trace[-1][2]
            result["rss_growth_after_fill_mb"] = round(end - at_fill, 1)
            result["rss_growth_after_fill_pct"] = round(100 * (end - at_fill) / at_fill, 2)
            ev = d["first_eviction_step"]
            if ev > 0:
                # the first eviction's working arrays (O(capacity)) stay with the allocator:
                # a step once, not a slope; this is the growth after it
                at_ev = next(r for r in trace if r[0] == ev)[2]
                result["rss_growth_after_first_eviction_mb"] = round(end - at_ev, 1)
            result["dynamic_post_fill_samples_per_sec"] = round(
                rate(d["_step_s"], max(fill, args.warmup), bs))
        else:
            result["rss_growth_after_fill_mb"] = None
    if "fixed" in res and "dynamic" in res:
        f, d = res["fixed"], res["dynamic"]
        result["dynamic_over_fixed_samples_per_sec"] = round(
            d["samples_per_sec"] / f["samples_per_sec"], 3)
        fill = d["fill_step"]
        if 0 < fill < len(d["_step_s"]):
            first = max(fill, args.warmup)
            result["fixed_post_fill_samples_per_sec"] = round(rate(f["_step_s"], first, bs))
            result["dynamic_over_fixed_post_fill"] = round(
                rate(d["_step_s"], first, bs) / rate(f["_step_s"], first, bs), 3)
            result["dynamic_over_fixed_post_fill_cpu"] = round(
                rate(d["_step_cpu_s"], first, bs) / rate(f["_step_cpu_s"], first, bs), 3)
        result["dynamic_over_fixed_samples_per_cpu_sec"] = round(
            d["samples_per_cpu_sec"] / f["samples_per_cpu_sec"], 3)
        result["auc_dynamic_minus_fixed"] = {
            k: round(d["auc"][k] - f["auc"][k], 4) for k in ("all", "last_20pct")}
        if fill > 0:
            # the fixed run's growth over the same steps (from its last sample at or before
            # the dynamic fill): what the process grows anyway (allocator, torch caches)
            before = [r for r in f["rss_trace"] if r[0] <= fill] or f["rss_trace"][:1]
            result["fixed_rss_growth_same_steps_mb"] = round(
                f["rss_trace"][-1][2] - before[-1][2], 1)
    result["wall_seconds"] = round(time.perf_counter() - wall0, 1)
    # the RSS traces were printed line by line above; --json keeps them
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "rss_trace"}
                          if isinstance(v, dict) else v) for k, v in result.items()}, indent=1))

    print(f"oracle AUC {oracle['all']:.4f} (last 20 %: {oracle['last_20pct']:.4f})")
    for v, r in res.items():
        line = (f"{v:8s} {r['samples_per_sec']:8,d} samples/s  AUC {r['auc']['all']:.4f} "
                f"(last 20 %: {r['auc']['last_20pct']:.4f})")
        if "status" in r:
            s = r["status"]["uid"]
            line += (f"  live {s['live_rows']:,} admitted {s['admitted']:,} rejected "
                     f"{s['rejected']:,} evicted {s['evicted']:,}")
        print(line)
    if "dynamic_over_fixed_samples_per_sec" in result:
        post = result.get("dynamic_over_fixed_post_fill")
        print(f"dynamic / fixed samples/s = {result['dynamic_over_fixed_samples_per_sec']:.3f}"
              + (f" (after the table filled: {post:.3f})" if post is not None else "")
              + " (target >= 0.8)")
        post_cpu = result.get("dynamic_over_fixed_post_fill_cpu")
        print("the same per CPU second of the training process (waits for a core left out): "
              f"{result['dynamic_over_fixed_samples_per_cpu_sec']:.3f}"
              + (f" (after the table filled: {post_cpu:.3f})" if post_cpu is not None else ""))
        a = result["auc_dynamic_minus_fixed"]
        print(f"AUC dynamic - fixed = {a['all']:+.4f} (last 20 %: {a['last_20pct']:+.4f})"
              " (target >= 0)")
    if result.get("rss_growth_after_fill_mb") is not None:
        print(f"dynamic RSS growth from the fill (step {res['dynamic']['fill_step']}) to the end"
              f" = {result['rss_growth_after_fill_mb']:+.1f} MB "
              f"({result['rss_growth_after_fill_pct']:+.2f} %)"
              + (f"; after the first eviction (step {res['dynamic']['first_eviction_step']}): "
                 f"{result['rss_growth_after_first_eviction_mb']:+.1f} MB"
                 if "rss_growth_after_first_eviction_mb" in result else "")
              + (f"; the fixed run over the same steps: "
                 f"{result['fixed_rss_growth_same_steps_mb']:+.1f} MB"
                 if "fixed_rss_growth_same_steps_mb" in result else ""))
        pending = res["dynamic"]["rss_trace"][-1][5]
        print(f"pending deletes at the end: {pending:,} ids ({pending * 8 / 2**20:.1f} MB; "
              f"--drain-every {args.drain_every}, {res['dynamic']['deletes_drained']:,} "
              "drained)")
    elif "dynamic" in res:
        print("the dynamic table never reached 99 % of its capacity: no RSS growth figure")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
