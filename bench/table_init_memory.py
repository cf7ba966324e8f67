"""Table initialization's memory: what a process holds beyond its own table rows at start-up.

One process and N ranks (gloo, started as ``torchrun`` would start them) build a DeepFM with
one id table of ``--rows`` rows (dim ``--dim``, plus its wide table), split by rows over the
ranks, and initialize it. Each process's peak resident-memory growth while building the
``TrainModule`` (the kernel's high-water mark, reset by ``/proc/self/clear_refs`` just
before; ``VmHWM`` minus the RSS before) is set against the table bytes it holds afterwards
(its rows' weights and Adagrad state). Two ways, each in fresh processes:

* ``blocks``: what ``odl-train`` does (``odl.models.embedding_tables.initial_rows``): each
  process draws only the rows it holds, one block of ``INIT_BLOCK_ROWS`` rows at a time;
* ``whole``: the baseline, a replica of drawing each whole table and cutting it (a full
  random tensor and a full copy of the table per table, in every process).

Printed per way and rank count: each rank's peak growth, the bytes it holds, the growth
beyond them, and the wall time of building the module.

    .venv/bin/python bench/table_init_memory.py [--rows 8000000] [--dim 16] [--ranks 2]
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

from bench.process_memory import reset_peak, status_kb  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.harness.spawned_ranks import run_ranks  # noqa: E402


def _whole_table_draw() -> None:
    """Replaces the block-wise initialization with drawing whole tables (the baseline)."""
    import torch

    import odl.train.train_module as train_module
    from odl.models.embedding_tables import DEEP_INIT_STD, WIDE_SUFFIX, table_seed

    def draw(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        full = torch.empty(shape, dtype=torch.float32)
        if name.endswith(WIDE_SUFFIX):
            return full.zero_()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(table_seed(seed, name))
        full.copy_(torch.randn(shape, generator=gen, dtype=torch.float32) * DEEP_INIT_STD)
        return full

    def init_whole(tables, seed: int) -> None:  # noqa: ANN001
        for name, weight in tables.items():
            weight.copy_(draw(name, tuple(weight.shape), seed))

    def init_shards(dmp, seed: int) -> None:  # noqa: ANN001
        for name, t in dmp.state_dict().items():
            if not (name.startswith("ebc.embedding_bags.") and name.endswith(".weight")):
                continue
            table = name[len("ebc.embedding_bags."):-len(".weight")]
            full = draw(table, tuple(t.size()), seed)
            for sh in t.local_shards():
                (r0, c0), (n, m) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                sh.tensor.copy_(full[r0:r0 + n, c0:c0 + m])

    train_module.init_embedding_weights = init_whole
    train_module.init_local_shards = init_shards


def _rank(rank: int, world: int, args: dict) -> dict:
    """One process: build the module, measure its peak growth and the table bytes it holds."""
    import torch
    import torch.distributed as dist

    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.datagen_config import deepfm_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.distributed import join_process_group
    from odl.train.train_module import TrainModule

    if args["way"] == "whole":
        _whole_table_draw()
    config = parse_pipeline_config_text(deepfm_config_text(
        args["model_dir"], batch_size=256, dim=args["dim"], buckets=args["rows"],
        sparse_fields=("C1",), hidden_units=(64, 32), save_checkpoints_steps=0))
    fb = FeatureBuilder(config)
    join_process_group(torch.device("cpu"))
    dist.barrier()
    rss0 = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    tm = TrainModule(config, fb, device="cpu", row_wise_min_rows=1)
    secs = time.perf_counter() - t0
    peak = (status_kb("VmHWM") - rss0) * 1024
    held = 0
    for name, t in tm.dmp.state_dict().items():
        if name.startswith("ebc.embedding_bags.") and hasattr(t, "local_shards"):
            held += sum(sh.tensor.numel() * 4 for sh in t.local_shards())
        elif name.startswith("ebc.embedding_bags."):
            held += t.numel() * 4
    state = tm.fused_optimizer.state_dict()["state"]
    for per_table in state.values():
        for v in per_table.values():
            if hasattr(v, "local_shards"):
                held += sum(sh.tensor.numel() * sh.tensor.element_size()
                            for sh in v.local_shards())
            elif isinstance(v, torch.Tensor):
                held += v.numel() * v.element_size()
    dist.barrier()
    return {"peak_growth_mb": round(peak / 2**20, 1), "held_mb": round(held / 2**20, 1),
            "beyond_held_mb": round((peak - held) / 2**20, 1), "seconds": round(secs, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8_000_000, help="rows of the id table")
    ap.add_argument("--dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the split run")
    add_output_args(ap)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="odl-table-init-")
    result: dict = {"rows": args.rows, "dim": args.dim, "cpu_count": os.cpu_count(), "runs": {}}
    for world in (1, args.ranks):
        for way in ("whole", "blocks"):
            settings = {"rows": args.rows, "dim": args.dim, "way": way,
                        "model_dir": os.path.join(work, f"{way}{world}")}
            got = run_ranks(_rank, world, world, settings, timeout=1800)
            result["runs"][f"{way}/{world}"] = got
            for rank, r in sorted(got.items()):
                print(f"{way:6} {world} rank(s), rank {rank}: peak growth "
                      f"{r['peak_growth_mb']:,.0f} MB, holds {r['held_mb']:,.0f} MB, beyond "
                      f"{r['beyond_held_mb']:,.0f} MB, {r['seconds']:.2f} s", flush=True)
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
