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

    .venv/bin/python bench/scaling.py [--ranks 1,2,4] [--batch 1024] [--steps 40]
        [--warmup 5] [--row-wise-min-rows 1048576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: dict, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    try:
        config = parse_pipeline_config_text(deepfm_config_text(
            tempfile.mkdtemp(prefix="odl-scaling-"), batch_size=args["batch"], dim=16,
            buckets=100_000, hidden_units=(256, 128, 64), save_checkpoints_steps=0))
        fb = FeatureBuilder(config)
        tm = TrainModule(config, fb, device="cpu",
                         row_wise_min_rows=args["row_wise_min_rows"])
        stream = SyntheticCtrStream(seed=100 + rank)
        steps = args["warmup"] + args["steps"]
        batches = [fb.build(stream.next_batch(args["batch"]).encode("csv")).batch
                   for _ in range(steps)]
        for b in batches[:args["warmup"]]:
            tm.train_step(b)
        dist.barrier()
        t0 = time.perf_counter()
        for b in batches[args["warmup"]:]:
            tm.train_step(b)
        dist.barrier()
        secs = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        results.put((rank, float(secs.item()), None))
        dist.barrier()  # leave together: a group torn down under a peer can abort
    except BaseException as e:
        results.put((rank, None, repr(e)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, args: dict) -> float:
    """Total samples/s of ``world`` ranks (slowest rank's time)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    secs = 0.0
    for _ in range(world):
        rank, s, error = results.get(timeout=1200)
        if error:
            raise RuntimeError(f"rank {rank} of {world}: {error}")
        secs = max(secs, s)
    for p in procs:
        p.join(120)
    return world * args["batch"] * args["steps"] / secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="rank counts to measure (1 first)")
    ap.add_argument("--batch", type=int, default=1024, help="records per rank and step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--row-wise-min-rows", type=int, default=1 << 20,
                    help="tables this large are split by rows (the 100k-row tables: whole)")
    add_output_args(ap)
    args = ap.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    if ranks[0] != 1:
        ranks = [1, *ranks]
    settings = {"batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                "row_wise_min_rows": args.row_wise_min_rows}
    rows = {}
    for world in ranks:
        rate = run_world(world, settings)
        rows[world] = {"samples_per_sec": round(rate)}
        base = rows[1]["samples_per_sec"]
        rows[world]["over_n_times_one"] = round(rate / (world * base), 3)
        print(f"{world} rank(s): {rate:,.0f} samples/s, {rate / base:.2f}x one rank, "
              f"{rate / (world * base):.3f} of linear", flush=True)
    result = {"cpu_count": os.cpu_count(), "batch_per_rank": args.batch, "steps": args.steps,
              "row_wise_min_rows": args.row_wise_min_rows, "ranks": rows}
    print(json.dumps(result, indent=1))
    finish_run(args, result, tempfile.mkdtemp(prefix="odl-scaling-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
