"""Checkpoint save of several ranks: each rank's own table part vs every table gathered on
rank 0 — rank 0's peak memory and the save's time.

N ranks (gloo, started as ``torchrun`` would start them) build the Criteo-like DeepFM with
its 26 id tables of ``--rows`` rows (dim 16), placed whole on the ranks or split by rows
(``--row-wise-min-rows``, the trainer's default 1M), train
``--steps`` steps, then save one checkpoint into a fresh model_dir, in fresh processes for
each way:

* ``gather``: ``TrainModule.state_dict_for_checkpoint`` (every rank's rows gathered on rank
  0, put together whole) and rank 0's ``CheckpointManager.save``;
* ``parts``: ``odl.train.rank_checkpoint.save_across_ranks`` (each rank writes its own rows,
  rank 0 the rest and the commit).

Each rank's peak resident memory during the save is measured from the kernel's high-water
mark (``/proc/self/clear_refs`` resets it just before the save; ``VmHWM`` minus the RSS
before the save), and the save's wall time between two barriers. Fresh ranks then restore
the checkpoint twice, measured the same way: read whole (``read_checkpoint``:
the whole tables of the ``gather`` checkpoint, the parts put together for ``parts``), and
as a restart of several ranks reads it (``read_checkpoint(whole_tables=False)``): each rank
copies its own rows out of the mapped state file (``gather``, the layout of a checkpoint
written by one process) or reads only the blocks of its own rows from the parts
(``parts``). Each restore runs in fresh processes that build the model and restore, so no
memory of the save is reused. Last, one fresh process exports each checkpoint
(``export_checkpoint``, which writes each table block by block from the mapped checkpoint),
measured the same way, and by its allocated memory alone (``RssAnon`` sampled every 5 ms:
the mapped checkpoint's pages count in the high-water mark but are the page cache's, not
the process's). Printed: per way and rank the peak growth in MB and the
seconds, and parts / gather for rank 0. The tables' bytes (weights and optimizer state, all
ranks) are printed for scale.

    .venv/bin/python bench/rank_checkpoint_memory.py [--ranks 2] [--rows 500000] [--steps 2]
        [--row-wise-min-rows 1048576] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.process_memory import reset_peak, status_kb  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.harness.spawned_ranks import run_ranks  # noqa: E402


def _config(args: dict):
    """The bench's pipeline config."""
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.datagen_config import deepfm_config_text

    return parse_pipeline_config_text(deepfm_config_text(
        args["model_dir"], batch_size=256, dim=16, buckets=args["rows"],
        hidden_units=(256, 128, 64), save_checkpoints_steps=0))


def _module(args: dict):
    """This rank's TrainModule of the bench's model, and its FeatureBuilder."""
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    config = _config(args)
    fb = FeatureBuilder(config)
    return TrainModule(config, fb, device="cpu",
                       row_wise_min_rows=args["row_wise_min_rows"]), fb


def _restore(rank: int, world: int, args: dict) -> dict:
    """One rank, fresh: restore the way's checkpoint, read whole or as a restart reads it."""
    import torch.distributed as dist

    from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint

    tm, _fb = _module(args)
    path = CheckpointManager(args["model_dir"], keep_max=0).latest()
    dist.barrier()
    rss0 = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    ckpt = read_checkpoint(path, whole_tables=args["whole"])
    tm.load_checkpoint_state(ckpt.state)
    del ckpt
    dist.barrier()
    return {"peak_growth_mb": round((status_kb("VmHWM") - rss0) / 1024, 1),
            "seconds": round(time.perf_counter() - t0, 2)}


def _export(args: dict) -> dict:
    """One fresh process exporting the way's checkpoint: its peak growth and seconds."""
    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.export.exporter import export_checkpoint

    config = _config(args)
    path = CheckpointManager(args["model_dir"], keep_max=0).latest()
    rss0, anon0 = status_kb("VmRSS"), status_kb("RssAnon")
    reset_peak()
    peak = [anon0]
    done = threading.Event()

    def sample() -> None:  # the kernel keeps no high-water mark of anonymous memory
        while not done.wait(0.005):
            peak[0] = max(peak[0], status_kb("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    export_checkpoint(config, path, os.path.join(args["work"], "export-" + args["way"]),
                      warn_without_topic=False)
    secs = time.perf_counter() - t0
    done.set()
    sampler.join()
    return {"peak_growth_mb": round((status_kb("VmHWM") - rss0) / 1024, 1),
            "anon_peak_growth_mb": round((peak[0] - anon0) / 1024, 1),
            "seconds": round(secs, 2)}


def _rank(rank: int, world: int, args: dict) -> dict:
    """One rank: build, train, save one way; its figures."""
    import torch.distributed as dist

    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.train.rank_checkpoint import save_across_ranks

    tm, fb = _module(args)
    stream = SyntheticCtrStream(seed=7 + rank)
    for _ in range(args["steps"]):
        tm.train_step(fb.build(stream.next_batch(256).encode("csv")).batch)
    manager = CheckpointManager(args["model_dir"], keep_max=0)
    tables = sum(t.numel() * t.element_size() for p in tm.table_part()["pieces"]
                 for _off, t in p[4])
    dist.barrier()
    rss0 = status_kb("VmRSS")
    reset_peak()  # the high-water mark starts again from now
    t0 = time.perf_counter()
    if args["way"] == "parts":
        save_across_ranks(manager, tm, {rank: 0}, {"source": "kafka"}, "cfg", "bench")
    else:
        state = tm.state_dict_for_checkpoint()
        if rank == 0:
            manager.save(tm.global_step, state, {0: 0}, {"source": "kafka"}, "cfg", "bench")
        del state
    dist.barrier()
    secs = time.perf_counter() - t0
    peak_mb = (status_kb("VmHWM") - rss0) / 1024
    out = {"rss_before_mb": round(rss0 / 1024, 1), "peak_growth_mb": round(peak_mb, 1),
           "seconds": round(secs, 2), "own_table_mb": round(tables / 2**20, 1)}
    return out


def run_way(way: str, world: int, args: dict) -> dict[int, dict]:
    """Each rank's figures for one way of saving, then of restoring what it saved read
    whole and as a restart reads it, each in fresh processes."""
    args = dict(args, way=way, model_dir=os.path.join(args["work"], way))
    out = run_ranks(_rank, world, world, args)
    for whole, key in ((True, "restore_whole"), (False, "restore_own")):
        for rank, figures in run_ranks(_restore, world, world,
                                       dict(args, whole=whole)).items():
            out[rank][key] = figures
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out[0]["export"] = pool.submit(_export, args).result()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=500_000, help="rows of each of the 26 tables")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--row-wise-min-rows", type=int, default=1 << 20,
                    help="tables this large are split by rows, smaller ones placed whole")
    add_output_args(ap)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="odl-rank-ckpt-")
    base = {"rows": args.rows, "steps": args.steps, "work": work,
            "row_wise_min_rows": args.row_wise_min_rows}
    result: dict = {"ranks": args.ranks, "rows_per_table": args.rows, "cores": os.cpu_count()}
    for way in ("gather", "parts"):
        result[way] = run_way(way, args.ranks, base)
        print(way, result[way], flush=True)
    for way in ("gather", "parts"):  # what each way wrote, from its manifest
        ckpt = os.path.join(work, way, f"model.ckpt-{args.steps}")
        with open(os.path.join(ckpt, "MANIFEST.json")) as f:
            files = json.load(f)["files"]
        result[f"{way}_files_mb"] = {n: round(v["bytes"] / 2**20, 1) for n, v in files.items()
                                     if v["bytes"] > 2**20}
        print(way, "files over 1 MB:", result[f"{way}_files_mb"])
    result["tables_mb_all_ranks"] = round(sum(
        r["own_table_mb"] for r in result["parts"].values()), 1)
    g, p = result["gather"][0], result["parts"][0]
    result["rank0_peak_parts_over_gather"] = round(p["peak_growth_mb"]
                                                   / max(g["peak_growth_mb"], 1e-9), 3)
    result["seconds_parts_over_gather"] = round(p["seconds"] / max(g["seconds"], 1e-9), 3)
    print(f"tables (weights + optimizer state, all ranks): {result['tables_mb_all_ranks']} MB")
    print(f"rank 0 peak growth during the save: gather {g['peak_growth_mb']} MB, parts "
          f"{p['peak_growth_mb']} MB (parts / gather {result['rank0_peak_parts_over_gather']})")
    print(f"save seconds: gather {g['seconds']}, parts {p['seconds']} "
          f"(parts / gather {result['seconds_parts_over_gather']})")
    for way, own in (("gather", "own rows of the mapped file"),
                     ("parts", "own blocks of the parts")):
        for rank, r in sorted(result[way].items()):
            print(f"restore of the {way} checkpoint, rank {rank}: read whole "
                  f"{r['restore_whole']['peak_growth_mb']} MB in "
                  f"{r['restore_whole']['seconds']} s, {own} "
                  f"{r['restore_own']['peak_growth_mb']} MB in {r['restore_own']['seconds']} s")
    for way in ("gather", "parts"):
        e = result[way][0]["export"]
        whole = max(r["restore_whole"]["peak_growth_mb"] for r in result[way].values())
        result[f"{way}_export_over_read_whole"] = round(e["peak_growth_mb"] / whole, 3)
        print(f"export of the {way} checkpoint in a fresh process: peak growth "
              f"{e['peak_growth_mb']} MB (of which allocated, not mapped file pages: "
              f"{e['anon_peak_growth_mb']} MB) in {e['seconds']} s; / a rank reading it "
              f"whole {result[f'{way}_export_over_read_whole']}")
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
