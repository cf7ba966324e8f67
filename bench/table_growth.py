"""The cost of one growth of a dynamic table: seconds and peak resident memory per doubling.

A DeepFM with one growing dynamic table (``ev_params`` without ``max_capacity``, dim
``--dim``, plus its wide twin) and a small fixed table, Adagrad tables, CPU. For each start
size S of ``--sizes``, in a fresh process: the module is built at S rows, its index filled
to 76 % of S with ids (past the growth threshold, ``odl.train.table_growth.GROW_AT``) and one
training step taken; then the table is doubled (``grow_tables``: state copied to the host,
the module rebuilt at 2 S rows, the state put back). Printed per size: the seconds of the
doubling, the RSS before and after, the peak RSS during it (``VmHWM`` reset just before) and
the peak beyond the RSS before, against the bytes the table held before (weights and
Adagrad state of both twins, index and counters).

    .venv/bin/python bench/table_growth.py [--sizes 262144,1048576,4194304] [--dim 16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.process_memory import reset_peak, status_kb  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402

_MIB = 2**20


def _one(rows: int, dim: int, work_dir: str) -> dict:
    """One process: a table of ``rows`` rows, filled past the threshold, doubled once."""
    import numpy as np

    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.table_growth import grow_tables
    from odl.train.train_module import TrainModule

    text = deepfm_config_text(work_dir, batch_size=256, dim=dim, buckets=1000,
                              sparse_fields=("C1", "C2"), hidden_units=(64, 32),
                              save_checkpoints_steps=0)
    config = parse_pipeline_config_text(text)
    c1 = next(f for f in config.feature_configs if f.input_names[0] == "C1")
    c1.ClearField("hash_bucket_size")  # no capacity written: the table grows
    c1.ev_params.init_capacity = rows
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    table = tm.dynamic.tables["C1"]
    n = int(0.76 * rows)
    table.index.insert(np.arange(1, n + 1, dtype=np.int64) * 7919)
    held = sum(t.numel() * t.element_size() for name, t in tm.embedding_tables().items()
               if name.startswith("C1"))
    held += sum(s.numel() * s.element_size() for p, ss in tm.row_state_views()[1].items()
                if ".C1" in p for s in ss)
    held += table.map_bytes()
    rss0 = status_kb("VmRSS") * 1024
    reset_peak()
    t0 = time.perf_counter()
    event = grow_tables(tm, {"C1": 2 * rows})
    secs = time.perf_counter() - t0
    peak = status_kb("VmHWM") * 1024
    rss1 = status_kb("VmRSS") * 1024
    assert tm.dynamic.tables["C1"].live == n and event.rows["C1"] == (rows, 2 * rows)
    return {"rows": rows, "grown_to": 2 * rows, "live": n, "seconds": round(secs, 3),
            "table_mb_before": round(held / _MIB, 1),
            "rss_before_mb": round(rss0 / _MIB, 1), "peak_mb": round(peak / _MIB, 1),
            "rss_after_mb": round(rss1 / _MIB, 1),
            "peak_beyond_before_mb": round((peak - rss0) / _MIB, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="262144,1048576,4194304",
                    help="start rows of the growing table, comma-separated")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work-dir", default="", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.dim, args.work_dir)))
        return 0
    work_dir = tempfile.mkdtemp(prefix="odl-table-growth-")
    results = []
    for rows in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(rows),
               "--dim", str(args.dim), "--work-dir", work_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{result['rows']:>10,} -> {result['grown_to']:>10,} rows: "
              f"{result['seconds']:.2f} s, table {result['table_mb_before']} MiB, RSS "
              f"{result['rss_before_mb']} -> {result['rss_after_mb']} MiB, peak "
              f"{result['peak_mb']} MiB (+{result['peak_beyond_before_mb']} MiB)", flush=True)
    finish_run(args, {"dim": args.dim, "results": results}, work_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
