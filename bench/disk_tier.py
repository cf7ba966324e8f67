"""Disk tier: the training rate of a table with most rows on disk against the same table in RAM.

One dynamic table ``uid`` of N ids (``--ids``), dim ``--dim``, plus its wide table, trained
with element-wise Adagrad (EasyRec's ``adagrad_optimizer``) in DeepFM beside a 100-bucket
``cat`` feature. Two arms, each in a process of its own (clean memory figures), run in turn
``--rounds`` times (the order reversed every other round):

* **ram**: ``ev_params { max_capacity: N }``: every row in RAM;
* **tier**: the same plus ``train_config.disk_tier { ram_rows: R }`` (``--ram-rows``,
  default N / 8): R rows in RAM, the others in the tier's file under the bench's scratch
  directory.

``--cold-every K`` hands the tier file's pages back to the kernel every K steps
(``MADV_PAGEOUT``), so the reads after it come from the disk, as for a tier larger than the
page cache; without it the file stays in the page cache when the machine has the memory
(here it does) and the bench measures the tier's own work (moves, index, copies), not the
disk's latency.

Each arm admits the N ids first (the tier moves N - R rows to disk), then trains ``--steps``
batches of ``--batch`` records of a stream with a hot set: uid ranks follow a Zipf law
(exponent 1.1) over keys that drift by ``--drift`` per step (default R / 1000), so the hot
set fits in R rows and moves slowly, as a day's popular items do. Samples/s count the steps
after ``--warmup`` (their own time: a page-out is not counted); the tier arm also reports
rows moved per step. The ratio tier / ram of each round is printed, with both arms' memory
after training: anonymous (the process's own) and the tier's mapped file pages (page cache
the kernel may drop). The target is ratio >= 0.5.

    .venv/bin/python bench/disk_tier.py [--ids 10000000] [--ram-rows N/8] [--dim 16]
        [--steps 4000] [--warmup 500] [--batch 1024] [--drift R/1000] [--hidden 64,32]
        [--cold-every 0] [--rounds 2] [--json out.json] [--keep]
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

from bench.run_output import add_output_args, finish_run  # noqa: E402

ZIPF = 1.1
FILL_CHUNK = 1 << 18


ARMS = ("ram", "tier")


def config_text(work: str, args: argparse.Namespace, tier: bool) -> str:
    """The arm's pipeline config."""
    disk = (f'disk_tier {{ dir: "{work}/tier" ram_rows: {args.ram_rows} }}' if tier else "")
    return f"""
model_dir: "{work}/model_dir"
train_input_path: "{work}/unused/*.csv"
data_config {{ batch_size: {args.batch}
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "uid" input_type: STRING }}
  input_fields {{ input_name: "cat" input_type: STRING }}
  label_fields: "label" }}
feature_config {{
  features {{ input_names: "uid" embedding_dim: {args.dim}
              ev_params {{ max_capacity: {args.ids} }} }}
  features {{ input_names: "cat" embedding_dim: {args.dim} hash_bucket_size: 100 }}
}}
model_config {{ model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["uid", "cat"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["uid", "cat"] wide_deep: DEEP }}
  deepfm {{ dnn {{ hidden_units: [{args.hidden}] }} }} }}
train_config {{
  optimizer_config {{ adagrad_optimizer {{ learning_rate {{
    constant_learning_rate {{ learning_rate: 0.05 }} }} }} }}
  optimizer_config {{ adam_optimizer {{ learning_rate {{
    constant_learning_rate {{ learning_rate: 0.001 }} }} }} }}
  {disk}
}}
"""


def records(args: argparse.Namespace, step: int) -> list[bytes]:
    """One batch of the stream with a drifting hot set (module docstring)."""
    import numpy as np

    rng = np.random.default_rng(1_000_003 + step)
    rank = (rng.zipf(ZIPF, args.batch) - 1) % args.ids
    key = (rank + step * args.drift) % args.ids
    uid = (key * 2_654_435_761) % args.ids
    cat = rng.integers(0, 100, args.batch)
    label = (rng.random(args.batch) < 1 / (1 + np.exp(-((uid % 7) - 3) / 2))).astype(int)
    return [f"{y},{u},{c}".encode() for y, u, c in zip(label, uid, cat, strict=True)]


def memory_mb() -> dict[str, int]:
    """This process's resident memory now (MB): anonymous (its own) and file pages (the
    tier's mapped files, which the page cache may drop)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) // 1024
    return {"anon_mb": out.get("RssAnon", 0), "file_mb": out.get("RssFile", 0)}


def fill(tm, ids: int) -> None:  # noqa: ANN001 - a TrainModule
    """Admits the ids of the values ``0 .. ids-1`` into ``uid`` (the tier: most to disk)."""
    import numpy as np

    from odl.features.column_ops import raw_ids
    from odl.features.id_hashing import hash_strings

    table = tm.dynamic.tables["uid"]
    chunk = min(FILL_CHUNK, max(1, table.spec.capacity // 100))  # small evictions
    for start in range(0, ids, chunk):
        raw = raw_ids(hash_strings(np.arange(start, min(ids, start + chunk)).astype("S")))
        got, evicted = table.upsert(raw, 0, time.time())
        assert (got >= 0).all()
        tm.reset_dynamic_rows({"uid": evicted}, 0)  # (writes the rows moved out)


def one_arm(args: argparse.Namespace, arm: str) -> dict:
    """Builds, fills and trains one arm in this process; its figures."""
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import check_pipeline_config
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule

    configure_torch_threads(0)
    tier = arm != "ram"
    work = tempfile.mkdtemp(prefix="arm-", dir=args.work)
    config = parse_pipeline_config_text(config_text(work, args, tier))
    check_pipeline_config(config, online=False)
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    t0 = time.perf_counter()
    fill(tm, args.ids)
    out = {"arm": arm, "fill_s": round(time.perf_counter() - t0, 1)}
    batches = [fb.build(records(args, s)).batch for s in range(args.steps)]
    disk = tm.dynamic.tables["uid"].disk
    moved, secs = 0, 0.0
    for s, b in enumerate(batches):
        if s == args.warmup:
            secs = 0.0
            moved = tm.dynamic_status()["uid"].get("from_disk", 0)
        if disk is not None and args.cold_every and s % args.cold_every == 0:
            disk.page_out()  # (not timed: the kernel reclaims pages by itself)
        t0 = time.perf_counter()
        tm.train_step(b)
        secs += time.perf_counter() - t0
    status = tm.dynamic_status()["uid"]
    timed = args.steps - args.warmup
    out.update(samples_per_sec=round(timed * args.batch / secs),
               **memory_mb(), live_rows=status["live_rows"],
               disk_rows=status.get("disk_rows", 0),
               from_disk_per_step=round((status.get("from_disk", 0) - moved) / timed, 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--ram-rows", type=int, default=0, help="default: ids / 8")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--drift", type=int, default=0, help="default: ram rows / 1000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", default="64,32", help="the DNN's layer sizes")
    ap.add_argument("--cold-every", type=int, default=0,
                    help="drop the tier file's pages every this many steps (0: never)")

    ap.add_argument("--arm", choices=ARMS, default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    args.ram_rows = args.ram_rows or args.ids // 8
    args.drift = args.drift or max(1, args.ram_rows // 1000)
    if args.arm:
        print(json.dumps(one_arm(args, args.arm)))
        return 0
    arms = list(ARMS)
    work = tempfile.mkdtemp(prefix="odl-disk-tier-")
    print(f"{args.ids:,} ids, {args.ram_rows:,} in RAM with the tier, dim {args.dim}, "
          f"batch {args.batch}, drift {args.drift}/step, DNN [{args.hidden}]", flush=True)
    rounds = []
    for r in range(args.rounds):
        got = {}
        for arm in arms if r % 2 == 0 else arms[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--work", work,
                   *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("ids", "ram_rows", "dim", "steps", "warmup", "batch", "drift",
                              "hidden", "cold_every"))]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got[arm] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  round {r + 1} {arm}: {got[arm]}", flush=True)
        ratio = got["tier"]["samples_per_sec"] / got["ram"]["samples_per_sec"]
        rounds.append({**got, "ratio": round(ratio, 3)})
        print(f"round {r + 1}: tier / ram {ratio:.3f} (target >= 0.5); anonymous memory "
              f"{got['tier']['anon_mb']:,} vs {got['ram']['anon_mb']:,} MB (the tier's file "
              f"mapped: {got['tier']['file_mb']:,} MB of page cache)", flush=True)
    finish_run(args, {"ids": args.ids, "ram_rows": args.ram_rows, "rounds": rounds}, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
