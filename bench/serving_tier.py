"""Serving's disk tier: predictions and version applies of a table mostly on disk, against RAM.

One export of DeepFM with a dynamic table ``uid`` of N ids (``--ids``), dim ``--dim``, and
its wide table (dim 1), beside a 100-bucket ``cat`` feature: a ``TrainModule`` admits the
ids of the values ``0 .. N-1`` (``bench.table_scale.fill``), saves a checkpoint and
``odl-export`` writes it (once, in a process of its own). Then two arms, each in a process
of its own (clean memory figures), run in turn ``--rounds`` times (the order reversed every
other round):

* **ram**: ``ServingModel.load(export)``: every row in RAM;
* **tier**: ``ServingModel.load(export, disk_tier=...)`` with ``--ram-rows`` R (default
  N / 8) rows a table in RAM and the others in the tier's file (``odl-serve
  --disk_tier_dir``).

Each arm loads the export (seconds), then answers ``--requests`` requests of
``--request-records`` records of ``bench.disk_tier``'s stream (uid ranks follow a Zipf law
over keys that drift by ``--drift`` per request, default R / 1000: a hot set that fits in R
rows and moves), and applies a version every ``--version-every`` requests: ``--version-rows``
rows of ids drawn from the same stream a little ahead (the trainer publishes the rows it
trains), new values, both uid tables. The export's first R rows fill RAM, and those are not
the stream's hot ids: the versions bring the hot ids to RAM as the run goes. Requests after
``--warmup`` are timed: records/s of ``ServingModel.predict_batch`` (the lookups and the
dense part; the request's parsing is the same in both arms and not counted), p50 / p99 per
request, and rows/s of the version applies. ``--cold-every K`` hands the tier file's pages
back to the kernel every K requests (``MADV_PAGEOUT``; not timed), as for a tier larger than
the page cache. Memory after the run: anonymous (the process's own, with the tiers' slot
indexes, also printed alone) and the tier's mapped file pages.

    .venv/bin/python bench/serving_tier.py [--ids 10000000] [--ram-rows N/8] [--dim 16]
        [--requests 3000] [--warmup 500] [--request-records 64] [--version-every 20]
        [--version-rows 20000] [--drift R/1000] [--cold-every 0] [--rounds 2]
        [--json out.json] [--keep]
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

from bench.disk_tier import memory_mb, records  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402

ARMS = ("ram", "tier")
# how far ahead of the requests a version's ids are drawn (the trainer reads ahead of serving)
VERSION_LEAD = 5


def prepare(args: argparse.Namespace, work: str) -> dict:
    """Builds, fills, checkpoints and exports the model (module docstring)."""
    from bench.table_scale import config_text, fill
    from odl.checkpoint.checkpoint_manager import CheckpointManager
    from odl.config.config_redaction import config_to_text
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.export.exporter import export_checkpoint
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import check_pipeline_config
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule

    configure_torch_threads(0)
    opts = argparse.Namespace(batch=args.request_records, dim=args.dim, publish_steps=10,
                              optimizer="rowwise_adagrad")
    config = parse_pipeline_config_text(config_text(work, args.ids, opts))
    config.train_config.ClearField("incr_save_config")
    check_pipeline_config(config, online=False)
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    t0 = time.perf_counter()
    fill(tm, args.ids)
    ckpt = CheckpointManager(config.model_dir).save(
        tm.global_step, tm.state_dict_for_checkpoint(), {0: 0}, {"source": "kafka"},
        config_to_text(config), generation="bench")
    del tm
    export = export_checkpoint(config, ckpt, os.path.join(work, "export"),
                               warn_without_topic=False)
    return {"export": export.path, "prepare_s": round(time.perf_counter() - t0, 1)}


def one_arm(args: argparse.Namespace, arm: str, export: str) -> dict:
    """Loads the export in this process and serves the requests and versions."""
    import numpy as np

    from odl.features.column_ops import raw_ids
    from odl.features.id_hashing import hash_strings
    from odl.train.torch_runtime import configure_torch_threads
    from publisher.delta_format import DeltaVersion, VersionHeader
    from serving_plugin.serving_model import ServingModel
    from serving_plugin.serving_tier import DiskTierSettings

    configure_torch_threads(0)
    tier = (DiskTierSettings(tempfile.mkdtemp(prefix="tier-", dir=args.work), args.ram_rows)
            if arm == "tier" else None)
    t0 = time.perf_counter()
    model = ServingModel.load(export, verify=False, disk_tier=tier)
    load_s = time.perf_counter() - t0
    fb = model.feature_builder
    req = argparse.Namespace(ids=args.ids, batch=args.request_records, drift=args.drift)
    ver = argparse.Namespace(ids=args.ids, batch=args.version_rows, drift=args.drift)
    tables = [(model.id_maps.tables[n].id, model.tables[n].shape[1]) for n in ("uid", "uid_wide")]
    rng = np.random.default_rng(7)
    times, apply_s, applied = [], 0.0, 0  # (the applies after the warm-up)
    for i in range(args.requests):
        batch = fb.build(records(req, i)).batch
        if tier is not None and args.cold_every and i % args.cold_every == 0:
            for t in model.tiers.values():
                t.disk.page_out()
        t1 = time.perf_counter()
        model.predict_batch(batch)
        if i >= args.warmup:
            times.append(time.perf_counter() - t1)
        if i % args.version_every == 0:
            uid = [r.split(b",")[1] for r in records(ver, i + VERSION_LEAD)]
            ids = np.unique(raw_ids(hash_strings(np.array(uid, dtype="S"))))
            sparse = {tid: (ids, rng.normal(0, 0.01, (ids.shape[0], dim)).astype(np.float32))
                      for tid, dim in tables}
            version = DeltaVersion(VersionHeader("bench", i + 1, "bench"), "float32", {},
                                   sparse, 1, 0)
            t1 = time.perf_counter()
            rows = model.apply_version(version)
            if i >= args.warmup:
                apply_s += time.perf_counter() - t1
                applied += rows
    timed = np.array(times)
    out = {"arm": arm, "load_s": round(load_s, 1),
           "records_per_sec": round(len(times) * args.request_records / timed.sum()),
           "p50_ms": round(float(np.percentile(timed, 50)) * 1e3, 2),
           "p99_ms": round(float(np.percentile(timed, 99)) * 1e3, 2),
           "apply_rows_per_sec": round(applied / max(apply_s, 1e-9)),
           **memory_mb()}
    if tier is not None:
        st = model.dynamic_status()["uid"]
        index = sum(model.dynamic_status()[n]["disk_index_bytes"] for n in model.tiers)
        out.update(ram_live=st["ram_live"], disk_rows=st["disk_rows"],
                   disk_index_mb=index >> 20,  # the tiers' indexes, every tiered table
                   disk_reads_per_request=round(st["disk_reads"] / args.requests, 1),
                   to_disk=st["to_disk"], from_disk=st["from_disk"])
    model.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--ram-rows", type=int, default=0, help="default: ids / 8")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--request-records", type=int, default=64)
    ap.add_argument("--version-every", type=int, default=20)
    ap.add_argument("--version-rows", type=int, default=20000)
    ap.add_argument("--drift", type=int, default=0, help="default: ram rows / 1000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cold-every", type=int, default=0,
                    help="drop the tier file's pages every this many requests (0: never)")

    ap.add_argument("--arm", choices=("prepare", *ARMS), default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--export", default="", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    args.ram_rows = args.ram_rows or args.ids // 8
    args.drift = args.drift or max(1, args.ram_rows // 1000)
    if args.arm == "prepare":
        print(json.dumps(prepare(args, args.work)))
        return 0
    if args.arm:
        print(json.dumps(one_arm(args, args.arm, args.export)))
        return 0
    work = tempfile.mkdtemp(prefix="odl-serving-tier-")
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("ids", "ram_rows", "dim", "requests", "warmup", "request_records",
                       "version_every", "version_rows", "drift", "cold_every")]

    def child(arm: str, export: str = "") -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--work", work,
               "--export", export, *passed]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    print(f"{args.ids:,} ids, {args.ram_rows:,} a table in RAM with the tier, dim {args.dim}; "
          f"requests of {args.request_records} records, a version of {args.version_rows:,} "
          f"rows every {args.version_every}, drift {args.drift}/request", flush=True)
    prepared = child("prepare")
    print(f"  export written in {prepared['prepare_s']} s", flush=True)
    rounds = []
    for r in range(args.rounds):
        got = {}
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            got[arm] = child(arm, prepared["export"])
            print(f"  round {r + 1} {arm}: {got[arm]}", flush=True)
        ratio = got["tier"]["records_per_sec"] / got["ram"]["records_per_sec"]
        apply_ratio = got["tier"]["apply_rows_per_sec"] / got["ram"]["apply_rows_per_sec"]
        rounds.append({**got, "ratio": round(ratio, 3), "apply_ratio": round(apply_ratio, 3)})
        print(f"round {r + 1}: predictions tier / ram {ratio:.3f}, version applies "
              f"{apply_ratio:.3f}; anonymous memory {got['tier']['anon_mb']:,} vs "
              f"{got['ram']['anon_mb']:,} MB (the tier's file mapped: "
              f"{got['tier']['file_mb']:,} MB of page cache)", flush=True)
    finish_run(args, {"ids": args.ids, "ram_rows": args.ram_rows, "rounds": rounds}, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
