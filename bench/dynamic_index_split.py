"""Dynamic tables with several ranks: the id index whole on every rank vs split by id.

N ranks (gloo, started as ``torchrun`` would start them) train ``bench/dynamic_tables.py``'s
model (DeepFM, wide + deep ``uid`` and ``cat``) with ``uid`` a dynamic table of
``--capacity`` rows (``zch``, lru) on its Zipf stream of ``--distinct`` ids, so the table
fills and evicts, in fresh processes for each way:

* ``whole``: ``dynamic_index_partitions: 1``, every rank holds the whole index and counters
  and remaps every rank's records of the step;
* ``split``: ``dynamic_index_partitions: N``, rank r holds partition r (the ids hashing to
  it, its block of the rows) and maps only the step's ids it owns; the ranks exchange the
  rows.

A table split by id is always split by rows over the ranks; ``--row-wise-min-rows``
(default: the capacity) splits it by rows in ``whole`` too, as the trainer's default
(1M rows) does for tables at least that large, so only the index differs.

Both run the same records: step k gives rank r records ``[k*B*N + r*B, ... + B)`` (B =
``--batch-size`` per rank). Printed per way and rank: the bytes of its index, counters and
sketch (``map_bytes``), its resident memory (RSS) after the run, the time of its
``train_step`` calls after ``--warmup`` steps (samples/s of all ranks), live rows and
evictions; then split / whole of rank 0's map bytes, of the RSS growth over the run, and
of samples/s. Machines here are noisy: compare the ratios of one run.

    .venv/bin/python bench/dynamic_index_split.py [--ranks 2] [--capacity 100000]
        [--distinct 4000000] [--steps 300] [--batch-size 1024] [--warmup 20]
        [--row-wise-min-rows 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.harness.spawned_ranks import run_ranks  # noqa: E402


def _rank(rank: int, world: int, args: dict) -> dict:
    """One rank of one way: build, train the shared schedule, its figures."""
    import numpy as np
    import psutil

    from bench.dynamic_tables import config_text, csv_lines, make_stream
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule

    configure_torch_threads(1)  # the ranks share the cores
    ns = argparse.Namespace(**args)
    config = parse_pipeline_config_text(config_text("dynamic", ns))
    config.data_config.batch_size = ns.batch_size
    config.train_config.dynamic_index_partitions = world if ns.way == "split" else 1
    fb = FeatureBuilder(config)
    rss0 = psutil.Process().memory_info().rss
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=ns.row_wise_min_rows)
    stream = make_stream(ns)
    per_step = ns.batch_size * world
    batches = [fb.build(csv_lines(stream, k * per_step + rank * ns.batch_size,
                                  k * per_step + (rank + 1) * ns.batch_size)).batch
               for k in range(ns.steps)]
    del stream
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        tm.train_step(batch)
        times.append(time.perf_counter() - t0)
    table = tm.dynamic.tables["uid"]
    step_s = float(np.sum(times[ns.warmup:]))
    return {"map_bytes": int(table.map_bytes()), "live_rows": int(table.live),
            "evicted": int(table.counters.evicted),
            "rss_growth_mb": round((psutil.Process().memory_info().rss - rss0) / 2**20, 1),
            "samples_per_s": round((ns.steps - ns.warmup) * per_step / step_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=100_000)
    ap.add_argument("--distinct", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=1024, help="records per rank and step")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--row-wise-min-rows", type=int, default=0,
                    help="tables this large are split by rows (0: --capacity, so the dynamic "
                         "table is split by rows both ways, as a table of 1M rows or more is "
                         "by the trainer's default)")
    add_output_args(ap)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="odl-index-split-")
    base = {"capacity": args.capacity, "distinct": args.distinct, "steps": args.steps,
            "batch_size": args.batch_size, "warmup": args.warmup, "dim": 16,
            "row_wise_min_rows": args.row_wise_min_rows or args.capacity,
            "policy": "lru", "filter_freq": 0, "zipf": 1.05, "seed": 11, "bias": -1.5,
            "scale": 1.0, "samples": args.steps * args.batch_size * args.ranks}
    result: dict = {"ranks": args.ranks, "capacity": args.capacity, "cores": os.cpu_count()}
    for way in ("whole", "split"):
        result[way] = run_ranks(_rank, args.ranks, args.ranks, dict(base, way=way),
                                timeout=3600)
        for rank, r in sorted(result[way].items()):
            print(f"{way} rank {rank}: index+counters {r['map_bytes'] / 2**20:.1f} MB, RSS "
                  f"growth {r['rss_growth_mb']} MB, {r['samples_per_s']} samples/s (all "
                  f"ranks), live rows {r['live_rows']}, evicted {r['evicted']}", flush=True)
    w, s = result["whole"][0], result["split"][0]
    result["map_bytes_split_over_whole"] = round(s["map_bytes"] / w["map_bytes"], 3)
    result["rss_growth_split_over_whole"] = round(s["rss_growth_mb"] / w["rss_growth_mb"], 3)
    result["samples_per_s_split_over_whole"] = round(s["samples_per_s"] / w["samples_per_s"], 3)
    print(f"rank 0, split / whole: index+counters {result['map_bytes_split_over_whole']}, "
          f"RSS growth {result['rss_growth_split_over_whole']}, samples/s "
          f"{result['samples_per_s_split_over_whole']}")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
