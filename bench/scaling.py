"""Scaling: samples/s of one model trained by 1, 2, 4 ranks (TorchRec sharding, gloo on CPU).

For each rank count N, N processes are started as ``torchrun`` would start them (``RANK``,
``WORLD_SIZE``, ``MASTER_*`` in the environment) and train one model together
(``odl.train.distributed``: tables placed whole or split by rows over the ranks, dense
gradients averaged): weak scaling, each rank its own batches of ``--batch`` records of the
Criteo-like stream (26 hashed ids of dim 16 in 100k-row tables, 13 dense features, DNN
256-128-64, the training-throughput bench's model), built in memory beforehand. After
``--warmup`` steps, ``--steps`` steps are timed between two barriers on every rank; the
figure is ``N x batch x steps / the slowest rank's seconds`` and its ratio to N times the
1-rank rate of the same run (the target on CPU: >= 0.8 per added rank, i.e. N ranks >= 0.8 N
times one). Each rank runs one torch thread; ranks beyond the host's cores share them, and
the output says how many cores there are.

``--in-batch`` trains with sequential in-batch learning (``odl.train.in_batch``: one pass over
every rank's records per step).

``--phases`` also prints, per rank, the milliseconds per timed step spent in the step's
parts: ``agree`` (the step's all-gathers: the finite-prediction flag, and the batch sizes
when the step agrees them),
``forward`` (TorchRec's input distribution, lookup and output distribution, the dense
forward), ``backward`` (the pooled-gradient all-to-all, the fused table update, the dense
backward) and ``allreduce`` (the dense gradients' mean); the rest of the step is the
turn's all-gather, the loss, the optimizer step and bookkeeping.

Each step of several ranks starts as ``odl-train``'s does: one all-gather of the turn (rank
0's publishing flags, every rank's batch size), then the step with the sizes agreed.
``--sizes-agreed-by both`` measures each rank count also with the step agreeing the sizes
itself (one all-gather more, what ``TrainModule.train_step`` does when given none) and
prints the ratio.

``--publish-steps 0,2`` measures each rank count also with delta publishing every 2 steps
(``odl.train.rank_publishing``, rank 0 writing versions into a directory, as the train loop
drives it: rank 0's flags exchanged each turn, the version taken before the next step) and
prints the rate with publishing over the rate without, for the same rank count.

``--job-status 1.0,0.01`` measures each rank count of several ranks also with every rank's
job-status thread (``odl.train.job_status``: a report of the rank's state and 64 partitions
written to the process group's store every given seconds, rank 0 reading the others') and
prints the rate with it over the rate without. 1.0 is ``odl-train``'s interval; a shorter
one magnifies the cost.

    .venv/bin/python bench/scaling.py [--ranks 1,2,4] [--batch 1024] [--steps 40]
        [--warmup 5] [--row-wise-min-rows 1048576] [--publish-steps 0] [--in-batch]
        [--phases] [--sizes-agreed-by turn|step|both] [--job-status 1.0]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.harness.spawned_ranks import run_ranks  # noqa: E402


def _rank(rank: int, world: int, args: dict) -> float:
    """One rank's timed steps: seconds of the slowest rank."""
    import torch.distributed as dist

    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.distributed import agree
    from odl.train.rank_publishing import RankPublishing
    from odl.train.train_module import TrainModule
    from publisher.publisher_factory import build_delta_sink

    every = args["publish_steps"]
    incr = (f'incr_save_config {{ sparse_save_steps: {every} dense_save_steps: {every} '
            f'fs {{ incr_save_dir: "versions" }} }}' if every else "")
    if args.get("in_batch"):
        incr += " in_batch_learning: true"
    config = parse_pipeline_config_text(deepfm_config_text(
        args["model_dir"], batch_size=args["batch"], dim=16, buckets=100_000,
        hidden_units=(256, 128, 64), save_checkpoints_steps=0, extra_train=incr))
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=args["row_wise_min_rows"])
    publishing = (RankPublishing.build(config, tm, "bench", rank, None,
                                       build_delta_sink(config) if rank == 0 else None)
                  if every else None)

    def step(b) -> None:
        if world == 1:  # one process: TrainingLoop's turn is its own, no collective
            tm.train_step(b)
            return
        # as TrainingLoop with several ranks: the turn (rank 0's publishing flags, every
        # rank's batch size), publishing, then the step with the sizes agreed (or agreeing
        # them itself)
        flags = publishing.turn_flags(tm.global_step) if publishing is not None else 0
        turn = agree([flags, b.size])
        if publishing is not None:
            publishing.after_turn(tm.global_step, turn[0][0], True, {rank: tm.global_step})
        tm.train_step(b, [t[1] for t in turn] if args["sizes_in_turn"] else None)
    stream = SyntheticCtrStream(seed=100 + rank)
    steps = args["warmup"] + args["steps"]
    batches = [fb.build(stream.next_batch(args["batch"]).encode("csv")).batch
               for _ in range(steps)]
    phases = _time_phases(tm) if args.get("phases") else None
    for b in batches[:args["warmup"]]:
        step(b)
    if phases is not None:
        phases.clear()
    channel = _job_status(rank, world, tm, args["job_status_s"]) if args.get(
        "job_status_s") else None
    dist.barrier()
    t0 = time.perf_counter()
    for b in batches[args["warmup"]:]:
        step(b)
    dist.barrier()
    if channel is not None:
        channel.stop()
        if rank == 0:
            assert all(v.report is not None for v in channel.others())
    if phases is not None:
        print(f"  rank {rank} of {world}, ms per step: " + " ".join(
            f"{name} {secs / args['steps'] * 1e3:.2f}" for name, secs in phases.items()),
            flush=True)
    secs = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    if publishing is not None:
        publishing.flush(None, {}, timeout=30.0)
    return float(secs.item())


def _job_status(rank: int, world: int, tm, interval_s: float):  # noqa: ANN001, ANN202
    """A running job-status channel with a report the size of a trainer's (64 partitions)."""
    from odl.train.job_status import JobStatusChannel

    def report() -> dict:
        step = tm.global_step
        return {"rank": rank, "host": "bench", "pid": os.getpid(), "state": "training",
                "healthy": True, "reason": "training", "global_step": step,
                "samples_trained": step * 1024, "samples_per_sec": 1.0,
                "records_consumed": step * 1024, "records_rejected": {"bad_label": 0},
                "last_exchange_age_s": 0.0,
                "input": {"broker_error": None, "partitions": {
                    str(p): {"position": step, "high_watermark": step, "low_watermark": 0,
                             "lag": 0, "rank": rank} for p in range(rank, 64, world)}}}

    return JobStatusChannel(rank, world, report, interval_s=interval_s).start()


def _time_phases(tm) -> dict[str, float]:  # noqa: ANN001 - a TrainModule
    """Wraps the step's parts with timers (this process only); returns name -> seconds."""
    import odl.train.train_module as train_module

    spent: dict[str, float] = {}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    train_module.agree = timed("agree", train_module.agree)
    train_module.average_gradients = timed("allreduce", train_module.average_gradients)
    tm.dmp.forward = timed("forward", tm.dmp.forward)
    torch.Tensor.backward = timed("backward", torch.Tensor.backward)
    return spent


def run_world(world: int, args: dict) -> float:
    """Total samples/s of ``world`` ranks (slowest rank's time)."""
    secs = max(run_ranks(_rank, world, world, args, timeout=1200).values())
    return world * args["batch"] * args["steps"] / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="rank counts to measure (1 first)")
    ap.add_argument("--batch", type=int, default=1024, help="records per rank and step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--row-wise-min-rows", type=int, default=1 << 20,
                    help="tables this large are split by rows (the 100k-row tables: whole)")
    ap.add_argument("--publish-steps", default="0",
                    help="comma list: 0 = no publishing, N = a delta version every N steps")
    ap.add_argument("--in-batch", action="store_true",
                    help="train with sequential in-batch learning")
    ap.add_argument("--phases", action="store_true",
                    help="print each rank's milliseconds per step in the step's parts")
    ap.add_argument("--sizes-agreed-by", choices=("turn", "step", "both"), default="turn",
                    help="several ranks: the batch sizes travel in the loop's turn (as "
                         "odl-train does), or the step agrees them itself (one all-gather "
                         "more); both: measure both and print turn / step")
    ap.add_argument("--job-status", default="",
                    help="comma list of report intervals (s): several ranks also measured "
                         "with the job-status thread at each; prints with / without")
    add_output_args(ap)
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    if ranks[0] != 1:
        ranks = [1, *ranks]
    publish = [int(x) for x in args.publish_steps.split(",")]
    work = tempfile.mkdtemp(prefix="odl-scaling-")
    rows: dict = {}
    for world in ranks:
        for every in publish:
            settings = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                        "row_wise_min_rows": args.row_wise_min_rows, "publish_steps": every,
                        "in_batch": args.in_batch, "phases": args.phases,
                        "job_status_s": 0.0,
                        "sizes_in_turn": args.sizes_agreed_by != "step",
                        "model_dir": os.path.join(work, f"m{world}_{every}")}
            rate = run_world(world, settings)
            row = rows.setdefault(world, {})
            if world > 1 and not every and args.sizes_agreed_by == "both":
                step_rate = run_world(world, {**settings, "sizes_in_turn": False,
                                              "model_dir": os.path.join(work, f"s{world}")})
                row["sizes_agreed_by_step"] = {"samples_per_sec": round(step_rate),
                                               "turn_over_step": round(rate / step_rate, 3)}
                print(f"{world} rank(s), sizes agreed by the step itself: {step_rate:,.0f} "
                      f"samples/s (in the turn / by the step: {rate / step_rate:.3f})",
                      flush=True)
            for interval in ([float(x) for x in args.job_status.split(",")]
                             if world > 1 and not every and args.job_status else []):
                with_rate = run_world(world, {**settings, "job_status_s": interval,
                                              "model_dir": os.path.join(work, f"j{world}")})
                row[f"job_status_every_{interval}s"] = {
                    "samples_per_sec": round(with_rate), "over_without": round(with_rate / rate, 3)}
                print(f"{world} rank(s), job status every {interval} s: {with_rate:,.0f} "
                      f"samples/s ({with_rate / rate:.3f} of without)", flush=True)
            if not every:
                base = rate if world == 1 else rows[1]["samples_per_sec"]
                row.update(samples_per_sec=round(rate),
                           over_n_times_one=round(rate / (world * base), 3))
                print(f"{world} rank(s): {rate:,.0f} samples/s, {rate / base:.2f}x one rank, "
                      f"{rate / (world * base):.3f} of linear", flush=True)
            else:
                key = f"publishing_every_{every}"
                row[key] = {"samples_per_sec": round(rate)}
                if "samples_per_sec" in row:
                    row[key]["over_without"] = round(rate / row["samples_per_sec"], 3)
                print(f"{world} rank(s), a version every {every} steps: {rate:,.0f} "
                      f"samples/s ({row[key].get('over_without')} of without)", flush=True)
    result = {"cpu_count": os.cpu_count(), "batch_per_rank": args.batch, "steps": args.steps,
              "in_batch": args.in_batch,
              "row_wise_min_rows": args.row_wise_min_rows, "ranks": rows}
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
