"""Restoring a checkpoint of dynamic tables into another number of partitions (a re-split).

``bench/dynamic_tables.py``'s model (DeepFM, wide + deep ``uid`` and ``cat``) with ``uid`` a
dynamic table of ``--capacity`` rows (``zch``, lru) split into ``--from`` partitions by id:
``--steps`` training steps of ``--batch-size`` records of its Zipf stream give rows and
the optimizer state trained values, then new random ids fill every partition to ``--fill``
of its rows (``upsert``), and its checkpoint state restored, in a fresh
process for each way, into a new one-process model:

* ``same``: with ``--from`` partitions (the index, counters and rows copied as they are);
* ``resplit``: with ``--to`` partitions (``odl.models.dynamic.resplit``: every id moved
  with its row of weights and optimizer state, free rows reset, a full partition's
  overflow dropped).

Printed per way: the seconds of ``load_checkpoint_state``, the growth of the process's peak
resident memory (RSS) during it, and, for the re-split, the ids kept and dropped; then
resplit / same of the time and the re-split's extra peak memory per row of the table.
Machines here are noisy: compare the ratios of one run.

    .venv/bin/python bench/dynamic_resplit.py [--capacity 1000000] [--from 2] [--to 4]
        [--fill 1.0] [--steps 20] [--batch-size 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.harness.spawned_ranks import run_ranks  # noqa: E402


def _way(rank: int, args: dict) -> dict:
    """One way in a fresh process: fill and train a model, restore its state, figures."""
    import resource
    import time

    import numpy as np

    from bench.dynamic_tables import config_text, csv_lines, make_stream
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.dynamic.partitions import partition_of
    from odl.train.train_module import TrainModule

    ns = argparse.Namespace(**args)

    config = parse_pipeline_config_text(config_text("dynamic", ns))
    config.data_config.batch_size = ns.batch_size
    fb = FeatureBuilder(config)

    def model(partitions: int) -> TrainModule:
        config.train_config.dynamic_index_partitions = partitions
        return TrainModule(config, fb, device="cpu")

    source = model(ns.parts_from)
    stream = make_stream(ns)
    for k in range(ns.steps):
        source.train_step(fb.build(csv_lines(stream, k * ns.batch_size,
                                             (k + 1) * ns.batch_size)).batch)
    # then new ids into each partition's free rows, up to --fill of its rows
    table = source.dynamic.tables["uid"]
    parts = table.held if hasattr(table, "held") else {0: (0, table)}
    rng = np.random.default_rng(ns.seed)
    fresh = np.unique(rng.integers(1 << 40, 1 << 41, 2 * ns.capacity))
    owner = partition_of(fresh, ns.parts_from)
    for p, (_lo, part) in parts.items():
        short = int(part.spec.capacity * ns.fill) - part.live
        if short > 0:
            table.upsert(fresh[owner == p][:short], step=ns.steps, now=0.0)
    state = source.state_dict_for_checkpoint()
    live = int(source.dynamic.tables["uid"].live)
    del source, stream, fresh
    target = model(ns.parts_to if ns.way == "resplit" else ns.parts_from)
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    target.load_checkpoint_state(state)
    seconds = time.perf_counter() - t0
    peak1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kept = int(target.dynamic.tables["uid"].live)
    return {"seconds": round(seconds, 3), "peak_rss_growth_mb": round((peak1 - peak0) / 1024, 1),
            "live_before": live, "kept": kept, "dropped": live - kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--from", dest="parts_from", type=int, default=2)
    ap.add_argument("--to", dest="parts_to", type=int, default=4)
    ap.add_argument("--fill", type=float, default=1.0, help="fraction of the rows holding ids")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4096)
    add_output_args(ap)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="odl-resplit-")
    base = {"capacity": args.capacity, "parts_from": args.parts_from,
            "parts_to": args.parts_to, "fill": args.fill, "steps": args.steps,
            "batch_size": args.batch_size, "distinct": 4_000_000, "dim": 16,
            "policy": "lru", "filter_freq": 0, "zipf": 1.05, "seed": 11, "bias": -1.5,
            "scale": 1.0, "samples": args.steps * args.batch_size}
    result: dict = {"capacity": args.capacity, "from": args.parts_from, "to": args.parts_to,
                    "cores": os.cpu_count()}
    for way in ("same", "resplit"):
        result[way] = run_ranks(_way, 1, dict(base, way=way), timeout=3600)[0]
        r = result[way]
        print(f"{way}: restore {r['seconds']} s, peak RSS growth {r['peak_rss_growth_mb']} MB, "
              f"{r['kept']} of {r['live_before']} ids kept ({r['dropped']} dropped)",
              flush=True)
    s, r = result["same"], result["resplit"]
    result["seconds_resplit_over_same"] = round(r["seconds"] / s["seconds"], 2)
    result["resplit_peak_rss_growth_per_row_bytes"] = round(
        (r["peak_rss_growth_mb"] - s["peak_rss_growth_mb"]) * 2**20 / args.capacity, 1)
    print(f"resplit / same: restore time {result['seconds_resplit_over_same']}; the re-split's "
          f"extra peak RSS {result['resplit_peak_rss_growth_per_row_bytes']} bytes per row")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
