"""Incremental checkpoints: bytes and seconds after touching 1 % of a large table, vs full.

For each table kind (``--kinds``: ``fixed``, a table of N hash buckets; ``dynamic``, EasyRec's
``ev_params { max_capacity: N }`` filled with N admitted ids; ``tier``, the same with
``train_config.disk_tier { ram_rows: N / 8 }``, so 7 / 8 of the ids are on disk), in a
process of its own:
DeepFM on ``uid`` (the N-row table, dim ``--dim``, and its wide table of N rows) and ``cat``
(100 buckets), tables trained with ``--optimizer`` as ``bench/table_scale.py`` does. Then:

1. **full**: a full checkpoint, as the trainer takes it (the state copied, then written):
   seconds and bytes;
2. **touch**: steps of ``--batch`` records whose uids are ``--touch`` (1 %) of the N ids, each
   once (a random sample); the rows changed are counted by ``CheckpointRows``, the per-step
   time of its hook is measured;
3. **increment**: the next checkpoint, an increment of the full one (the changed rows taken,
   the state but the tables copied, the rows copied, all written): seconds and bytes; the
   ratios increment / full are printed, measured in the same run;
4. **restore**: the chain and an equal full checkpoint read (``read_checkpoint``), seconds,
   and their tables (and a dynamic table's ids and counters) compared bitwise.

A dynamic table's increment holds its changed rows' ids and counters, not its whole index
(``odl.models.dynamic.state_changes``), plus its admission sketch whole; with ``--partitions
P`` (``dynamic_index_partitions``) the index is split by id into P partitions, each with its
changes. With the disk tier the increment holds the tier's slots written or freed (the ids
the touch brought back to RAM and those it moved out). Prints one line per stage and a JSON
table.

    .venv/bin/python bench/incremental_checkpoint.py [--rows 10000000] [--kinds fixed,dynamic,tier]
        [--dim 16] [--optimizer adagrad|rowwise_adagrad|adam] [--touch 0.01]
        [--batch 4096] [--partitions 1] [--json out.json] [--keep]
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

from bench.disk_tier import fill as fill_tier  # noqa: E402
from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.table_scale import OPTIMIZERS, fill, rss_mb, tree_bytes  # noqa: E402


def config_text(work: str, rows: int, kind: str, args: argparse.Namespace) -> str:
    """The bench's pipeline config: ``uid`` a fixed or dynamic table of ``rows`` rows."""
    uid = (f"ev_params {{ max_capacity: {rows} }}" if kind in ("dynamic", "tier")
           else f"hash_bucket_size: {rows}")
    tier = (f'disk_tier {{ dir: "{work}/tier" ram_rows: {rows // 8} }}' if kind == "tier"
            else "")
    return f"""
model_dir: "{work}/model_dir"
train_input_path: "{work}/unused/*.csv"
data_config {{ batch_size: {args.batch}
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "uid" input_type: STRING }}
  input_fields {{ input_name: "cat" input_type: STRING }}
  label_fields: "label" }}
feature_config {{
  features {{ input_names: "uid" embedding_dim: {args.dim} {uid} }}
  features {{ input_names: "cat" embedding_dim: {args.dim} hash_bucket_size: 100 }}
}}
model_config {{ model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["uid", "cat"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["uid", "cat"] wide_deep: DEEP }}
  deepfm {{ dnn {{ hidden_units: [64, 32] }} }} }}
train_config {{ {OPTIMIZERS[args.optimizer]} full_checkpoint_every: 10
  dynamic_index_partitions: {args.partitions} {tier} }}
"""


def touch_batches(rows: int, kind: str, args: argparse.Namespace) -> list[list[bytes]]:
    """Batches whose uids are ``--touch`` of the ids, each once, in random order."""
    import numpy as np

    rng = np.random.default_rng(7)
    uids = rng.choice(rows, size=max(1, int(rows * args.touch)), replace=False)
    cats = rng.integers(0, 100, uids.shape[0])
    labels = rng.integers(0, 2, uids.shape[0])
    lines = [f"{y},{u},{c}".encode() for y, u, c in zip(labels, uids, cats, strict=True)]
    return [lines[i:i + args.batch] for i in range(0, len(lines), args.batch)]


def one_kind(rows: int, kind: str, args: argparse.Namespace, work: str) -> dict:
    """Every stage for one table kind (in this process); the figures."""
    import torch

    from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import check_pipeline_config
    from odl.train.checkpoint_rows import CheckpointRows
    from odl.train.module_state import changed_rows_part
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule

    configure_torch_threads(0)
    text = config_text(work, rows, kind, args)
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=False)
    out: dict = {"rows": rows, "kind": kind, "dim": args.dim, "optimizer": args.optimizer,
                 "touch": args.touch}
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    ids = rows
    if kind == "dynamic":
        # split by id, a partition holds the ids that hash to it: fill short of every
        # partition's capacity (the touched ids below are among the filled ones)
        ids = rows if args.partitions == 1 else int(rows * 0.98)
        fill(tm, ids)
        out["filled_ids"] = ids
    elif kind == "tier":  # the ids past the RAM rows move to disk as they are admitted
        fill_tier(tm, rows)
        out["filled_ids"] = rows
    tracker = CheckpointRows(tm)
    hook_secs = [0.0]
    record = tracker._tracker.record  # noqa: SLF001 - timing the hook the step calls

    def timed(kjt) -> None:  # noqa: ANN001 - a KeyedJaggedTensor
        t = time.perf_counter()
        record(kjt)
        hook_secs[0] += time.perf_counter() - t

    tm._extra_touched_rows_hooks[-1] = timed  # noqa: SLF001 - the hook CheckpointRows added
    manager = CheckpointManager(config.model_dir, keep_max=0, full_every=10)
    source = {"source": "bench"}

    gc.collect()
    t0 = time.perf_counter()
    tracker.take()
    full = manager.save(tm.global_step, tm.state_dict_for_checkpoint(), {0: 0}, source,
                        text, "bench")
    out["full_s"] = round(time.perf_counter() - t0, 3)
    out["full_bytes"] = tree_bytes(full)
    out["rss_mb"] = round(rss_mb())
    print(f"{kind} table of {rows:,} rows: full checkpoint {out['full_bytes']:,} bytes in "
          f"{out['full_s']} s", flush=True)

    batches = [fb.build(b).batch for b in touch_batches(ids, kind, args)]
    t0 = time.perf_counter()
    for b in batches:
        tm.train_step(b)
    out["touch_steps"] = len(batches)
    out["step_ms"] = round((time.perf_counter() - t0) * 1e3 / len(batches), 2)
    out["hook_ms_per_step"] = round(hook_secs[0] * 1e3 / len(batches), 3)

    gc.collect()
    t0 = time.perf_counter()
    changed = tracker.take()
    assert manager.increment_allowed()
    inc = manager.save(tm.global_step,
                       tm.state_without_tables(dynamic_state=tracker.dynamic_changes),
                       {0: 1}, source, text, "bench", rows=changed_rows_part(tm, changed))
    out["increment_s"] = round(time.perf_counter() - t0, 3)
    out["increment_bytes"] = tree_bytes(inc)
    out["changed_rows"] = int(len(changed.get("uid", ())))
    out["bytes_ratio"] = round(out["increment_bytes"] / out["full_bytes"], 4)
    out["seconds_ratio"] = round(out["increment_s"] / out["full_s"], 4)
    print(f"  touched {out['changed_rows']:,} rows in {len(batches)} steps "
          f"({out['step_ms']} ms a step, the changed-rows hook {out['hook_ms_per_step']} ms); "
          f"increment {out['increment_bytes']:,} bytes in {out['increment_s']} s: "
          f"bytes {out['bytes_ratio']:.2%}, seconds {out['seconds_ratio']:.2%} of the full "
          "checkpoint", flush=True)

    reference = manager.save(tm.global_step + 1, tm.state_dict_for_checkpoint(), {0: 1},
                             source, text, "bench")  # full_every: a full one of the same state
    del tm, batches
    gc.collect()
    t0 = time.perf_counter()
    whole = read_checkpoint(reference).state
    out["restore_full_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    chained = read_checkpoint(inc).state
    out["restore_chain_s"] = round(time.perf_counter() - t0, 2)
    for name, t in whole["model"].items():
        assert torch.equal(t, chained["model"][name]), name
    for name, states in whole["sparse_optimizer"].items():
        for key, t in states.items():
            assert torch.equal(t, chained["sparse_optimizer"][name][key]), (name, key)
    if kind in ("dynamic", "tier"):  # the id index and counters (and the rows on disk) too
        assert_same_tree(whole["dynamic_tables"], chained["dynamic_tables"])
    print(f"  read: full {out['restore_full_s']} s, full + increment "
          f"{out['restore_chain_s']} s; tables bitwise equal", flush=True)
    return out


def assert_same_tree(a, b, where: str = "") -> None:  # noqa: ANN001 - nested states
    """Two nested states (dicts, tensors, numbers) are equal, bitwise."""
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--kinds", default="fixed,dynamic")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    ap.add_argument("--touch", type=float, default=0.01, help="share of the rows touched")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--partitions", type=int, default=1,
                    help="train_config.dynamic_index_partitions (the index split by id)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    if args.one:  # one kind, in its own process: print its figures as the last line
        print(json.dumps(one_kind(args.rows, args.one, args, args.work)), flush=True)
        return 0
    work = tempfile.mkdtemp(prefix="odl-incremental-checkpoint-")
    table = []
    for kind in args.kinds.split(","):
        sub = os.path.join(work, kind)
        os.makedirs(sub)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", kind, "--work", sub,
               "--rows", str(args.rows), "--dim", str(args.dim), "--optimizer",
               args.optimizer, "--touch", str(args.touch), "--batch", str(args.batch),
               "--partitions", str(args.partitions)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if done.returncode != 0 or not lines:
            print(f"{kind}: failed (exit {done.returncode})", flush=True)
            table.append({"kind": kind, "failed": done.returncode})
            continue
        table.append(json.loads(lines[-1]))
    result = {"cpu_count": os.cpu_count(), "rows": args.rows, "partitions": args.partitions,
              "kinds": table}
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
