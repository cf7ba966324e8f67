"""Table scale: what one dynamic table of 1M to 100M admitted rows costs to train, save and serve.

For each size N (``--rows``), in a process of its own (clean memory figures): DeepFM on two
id features, ``uid`` with EasyRec's ``ev_params { max_capacity: N }`` (a dynamic table of N
rows, dim ``--dim``, and its wide table of N rows, dim 1) and ``cat`` (100 buckets), tables
trained with ``--optimizer`` (``adagrad``: element-wise, EasyRec's ``adagrad_optimizer``;
``rowwise_adagrad``; ``adam``: row-sparse lazy Adam), dense Adam. Then, timed one by one:

1. **build**: the ``TrainModule`` (tables allocated and initialized); RSS after it.
2. **fill**: N ids admitted into ``uid``'s tables (``DynamicTable.upsert`` of the ids the
   feature builder gives the values ``0 .. N-1``), so the table is full, as after a long run.
3. **train**: ``--steps`` steps of ``--batch`` records whose uid follows a Zipf law
   (exponent 1.1) over the N ids with a hot set that drifts (the rank -> id map shifts by
   N / 1000 every step), publishing a delta version every ``--publish-steps`` steps into a
   directory (``incr_save_config.fs``); samples/s over the steps after ``--warmup``, delta
   bytes per version, RSS after.
4. **save**: one checkpoint (``CheckpointManager.save`` of the module's state): seconds, bytes.
5. **restore**: the module freed, a new one built and the checkpoint read and loaded:
   seconds (build and read+load separately), peak RSS of the process.
6. **export**: ``export_checkpoint`` of that checkpoint: seconds, bytes.
7. **serve**: ``odl-serve --export_dir ... --no_replay`` started, seconds to the first
   ``/predict`` answered; its RSS then.

Prints one line per stage and a JSON table. The sizing guide in docs/operations.md reads
bytes per row from it. Machines here are noisy and small (the 2-core VM has 23 GiB): run the
largest sizes alone, with ``--optimizer rowwise_adagrad`` when element-wise state does not fit.

    .venv/bin/python bench/table_scale.py [--rows 1000000,10000000,30000000] [--dim 16]
        [--optimizer adagrad|rowwise_adagrad|adam] [--steps 60] [--warmup 10]
        [--batch 1024] [--publish-steps 10] [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.run_output import add_output_args, finish_run  # noqa: E402

FILL_CHUNK = 1 << 20
ZIPF = 1.1

OPTIMIZERS = {
    "adagrad": "optimizer_config { adagrad_optimizer { learning_rate { "
               "constant_learning_rate { learning_rate: 0.05 } } } } "
               "optimizer_config { adam_optimizer { learning_rate { "
               "constant_learning_rate { learning_rate: 0.001 } } } }",
    "adam": "optimizer_config { lazy_adam_optimizer { learning_rate { "
            "constant_learning_rate { learning_rate: 0.001 } } } } "
            "optimizer_config { adam_optimizer { learning_rate { "
            "constant_learning_rate { learning_rate: 0.001 } } } }",
    "rowwise_adagrad": "sparse_optimizer { rowwise_adagrad_optimizer { lr: 0.05 } "
                       "constant_learning_rate {} } dense_optimizer { adam_optimizer { "
                       "lr: 0.001 } constant_learning_rate {} }",
}


def config_text(work: str, rows: int, args: argparse.Namespace) -> str:
    """The bench's pipeline config for a table of ``rows`` rows."""
    return f"""
model_dir: "{work}/model_dir"
train_input_path: "{work}/unused/*.csv"
data_config {{ batch_size: {args.batch}
  input_fields {{ input_name: "label" input_type: INT32 }}
  input_fields {{ input_name: "uid" input_type: STRING }}
  input_fields {{ input_name: "cat" input_type: STRING }}
  label_fields: "label" }}
feature_config {{
  features {{ input_names: "uid" embedding_dim: {args.dim} ev_params {{ max_capacity: {rows} }} }}
  features {{ input_names: "cat" embedding_dim: {args.dim} hash_bucket_size: 100 }}
}}
model_config {{ model_class: "DeepFM"
  feature_groups {{ group_name: "wide" feature_names: ["uid", "cat"] wide_deep: WIDE }}
  feature_groups {{ group_name: "deep" feature_names: ["uid", "cat"] wide_deep: DEEP }}
  deepfm {{ dnn {{ hidden_units: [64, 32] }} }} }}
train_config {{
  {OPTIMIZERS[args.optimizer]}
  incr_save_config {{ sparse_save_steps: {args.publish_steps}
    dense_save_steps: {args.publish_steps} fs {{ incr_save_dir: "{work}/versions" }} }}
}}
"""


def rss_mb() -> float:
    """Resident memory of this process now (MB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    """Peak resident memory of this process (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def records(rows: int, batch: int, step: int, seed: int) -> list[bytes]:
    """One batch of the drifting Zipf stream (module docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed * 100_003 + step)
    rank = np.minimum(rng.zipf(ZIPF, batch) - 1, rows - 1)
    uid = (rank * 2_654_435_761 + step * max(1, rows // 1000)) % rows
    cat = rng.integers(0, 100, batch)
    label = (rng.random(batch) < 1 / (1 + np.exp(-((uid % 7) - 3) / 2))).astype(int)
    return [f"{y},{u},{c}".encode() for y, u, c in zip(label, uid, cat, strict=True)]


def fill(tm, rows: int) -> None:  # noqa: ANN001 - a TrainModule
    """Admits the ids of the values ``0 .. rows-1`` into every dynamic table of ``uid``."""
    import numpy as np

    from odl.features.column_ops import raw_ids
    from odl.features.id_hashing import hash_strings

    tables = [t for name, t in tm.dynamic.tables.items() if name.startswith("uid")]
    now = time.time()
    for start in range(0, rows, FILL_CHUNK):
        ids = raw_ids(hash_strings(np.arange(start, min(rows, start + FILL_CHUNK)).astype("S")))
        for t in tables:
            got, evicted = t.upsert(ids, 0, now)
            assert (got >= 0).all() and not len(evicted), t.name


def one_size(rows: int, args: argparse.Namespace, work: str) -> dict:
    """Every stage for one table size (in this process); the figures."""
    from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.export.exporter import export_checkpoint
    from odl.features.feature_builder import FeatureBuilder
    from odl.models.model_registry import check_pipeline_config
    from odl.train.torch_runtime import configure_torch_threads
    from odl.train.train_module import TrainModule
    from publisher.publisher_factory import build_publisher

    configure_torch_threads(0)
    text = config_text(work, rows, args)
    config = parse_pipeline_config_text(text)
    check_pipeline_config(config, online=False)
    out: dict = {"rows": rows, "dim": args.dim, "optimizer": args.optimizer}
    t0 = time.perf_counter()
    fb = FeatureBuilder(config)
    tm = TrainModule(config, fb, device="cpu")
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["rss_built_mb"] = round(rss_mb())
    t0 = time.perf_counter()
    fill(tm, rows)
    out["fill_s"] = round(time.perf_counter() - t0, 2)
    out["rss_filled_mb"] = round(rss_mb())
    print(f"{rows:,} rows: built in {out['build_s']} s ({out['rss_built_mb']} MB), filled in "
          f"{out['fill_s']} s ({out['rss_filled_mb']} MB)", flush=True)

    publisher = build_publisher(config, tm, "bench", start_step=tm.global_step)
    batches = [fb.build(records(rows, args.batch, s, 1)).batch for s in range(args.steps)]
    t_timed = None
    for s, b in enumerate(batches):
        if s == args.warmup:
            t_timed = time.perf_counter()
        tm.train_step(b)
        publisher.maybe_publish(tm.global_step, {0: (s + 1) * args.batch})
    secs = time.perf_counter() - t_timed
    publisher.flush(timeout=120.0, step=tm.global_step, positions={0: args.steps * args.batch})
    versions = [f for f in os.listdir(os.path.join(work, "versions"))]
    out["samples_per_sec"] = round((args.steps - args.warmup) * args.batch / secs)
    out["delta_versions"] = len(versions)
    out["delta_bytes_per_version"] = round(tree_bytes(os.path.join(work, "versions"))
                                           / max(1, len(versions)))
    out["rss_trained_mb"] = round(rss_mb())
    print(f"  train {out['samples_per_sec']:,} samples/s, {len(versions)} delta versions of "
          f"{out['delta_bytes_per_version']:,} bytes", flush=True)

    manager = CheckpointManager(config.model_dir, keep_max=2)
    t0 = time.perf_counter()
    ckpt = manager.save(tm.global_step, tm.state_dict_for_checkpoint(), {0: 0},
                        {"source": "bench"}, text, "bench")
    out["save_s"] = round(time.perf_counter() - t0, 2)
    out["checkpoint_bytes"] = tree_bytes(ckpt)
    out["peak_after_save_mb"] = round(peak_mb())
    print(f"  checkpoint saved in {out['save_s']} s, {out['checkpoint_bytes']:,} bytes",
          flush=True)
    del tm, publisher, batches
    gc.collect()

    t0 = time.perf_counter()
    tm = TrainModule(config, FeatureBuilder(config), device="cpu")
    out["restore_build_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    tm.load_checkpoint_state(read_checkpoint(ckpt).state)
    out["restore_load_s"] = round(time.perf_counter() - t0, 2)
    out["peak_after_restore_mb"] = round(peak_mb())
    live = int(tm.dynamic.status()["uid"]["live_rows"])
    assert live == rows, (live, rows)
    print(f"  restored: build {out['restore_build_s']} s + read and load "
          f"{out['restore_load_s']} s", flush=True)
    del tm
    gc.collect()

    t0 = time.perf_counter()
    export_dir = os.path.join(work, "exports")
    result = export_checkpoint(config, ckpt, export_dir, warn_without_topic=False)
    out["export_s"] = round(time.perf_counter() - t0, 2)
    out["export_bytes"] = tree_bytes(export_dir)
    print(f"  exported in {out['export_s']} s, {out['export_bytes']:,} bytes", flush=True)
    out.update(serve(result.path, rows, args, work))
    return out


def serve(export_dir: str, rows: int, args: argparse.Namespace, work: str) -> dict:
    """Seconds from ``odl-serve``'s start to its first answered ``/predict``, and its RSS."""
    from odl.harness.http_client import free_port, post_json

    port = free_port()
    body = b"\n".join(r.split(b",", 1)[1] for r in records(rows, 64, 0, 2))
    with open(os.path.join(work, "serve.log"), "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "odl.cli.serve_cli", "--export_dir",
                                 export_dir, "--port", str(port), "--no_replay"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            answer = None
            while answer is None:
                if proc.poll() is not None or time.perf_counter() - t0 > 1800:
                    raise RuntimeError(f"odl-serve did not answer: {work}/serve.log")
                try:
                    answer = post_json(f"http://127.0.0.1:{port}/predict", body)
                except OSError:
                    answer = None
                if answer is None:
                    time.sleep(0.2)
            secs = time.perf_counter() - t0
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"  odl-serve answered after {secs:.1f} s ({rss // 1024} MB)", flush=True)
    return {"serve_first_predict_s": round(secs, 2), "serve_rss_mb": rss // 1024}


def plot(path: str, table: list[dict], optimizer: str) -> None:
    """The cost curves: seconds and sizes against the rows."""
    from bench.bench_plots import plot_scale

    done = [t for t in table if "failed" not in t]
    rows = [t["rows"] for t in done]
    seconds = {"checkpoint save": [t["save_s"] for t in done],
               "restore (build + load)": [t["restore_build_s"] + t["restore_load_s"]
                                          for t in done],
               "export": [t["export_s"] for t in done],
               "odl-serve to first prediction": [t["serve_first_predict_s"] for t in done]}
    gigabytes = {"checkpoint": [t["checkpoint_bytes"] / 1e9 for t in done],
                 "export": [t["export_bytes"] / 1e9 for t in done],
                 "trainer RSS": [t["rss_trained_mb"] / 1e3 for t in done],
                 "odl-serve RSS": [t["serve_rss_mb"] / 1e3 for t in done]}
    plot_scale(path, rows, seconds, gigabytes, f"one dynamic table, dim 16, {optimizer}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1000000,10000000,30000000",
                    help="comma list of table sizes (admitted rows)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--publish-steps", type=int, default=10)
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    if args.one:  # one size, in its own process: print its figures as the last line
        print(json.dumps(one_size(args.one, args, args.work)), flush=True)
        return 0
    work = tempfile.mkdtemp(prefix="odl-table-scale-")
    table = []
    for rows in (int(x) for x in args.rows.split(",")):
        sub = os.path.join(work, f"rows_{rows}")
        os.makedirs(sub)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(rows), "--work", sub,
               "--dim", str(args.dim), "--optimizer", args.optimizer, "--steps",
               str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--publish-steps", str(args.publish_steps)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if done.returncode != 0 or not lines:
            print(f"{rows:,} rows: failed (exit {done.returncode}); see the output above",
                  flush=True)
            table.append({"rows": rows, "failed": done.returncode})
            break
        table.append(json.loads(lines[-1]))
    result = {"cpu_count": os.cpu_count(), "optimizer": args.optimizer, "sizes": table}
    print(json.dumps(result, indent=1))
    finish_run(args, result, work, lambda path: plot(path, table, args.optimizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
