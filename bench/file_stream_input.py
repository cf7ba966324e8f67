"""File-stream input rate vs the trainer's step rate (target: the trainer, not the reader, is
the limit).

One run, one machine. ``odl-datagen --split-dir``'s writer (``odl.datagen.split_writer``)
writes ``--splits`` splits of ``--per-split`` synthetic CTR records (CSV, the datagen schema,
``--parts`` files each, donefile last) into a temporary ``train_data_dir``. In this process,
measured one after the other:

1. ``read``: ``FileStreamSource`` reads every record in batches of ``--batch-size`` (listing
   splits, checking donefiles, reading the files): records/s;
2. ``read+build``: the same plus ``FeatureBuilder.build_arrays`` per batch, which is what the
   input child process does for the trainer: records/s;
3. ``train``: ``TrainModule.train_step`` of ``samples/deepfm_online.config``'s DeepFM on
   batches built from the same records, in memory: samples/s.

``input_over_train`` = read+build / train: above 1 the trainer is the limit (the input runs in
its own child process, so on a machine with a core for it both run at once).

With ``--saves``, three more measurements: the whole trainer (``Trainer``, input process, one
day with ``end_day``, ``split_per_pass`` 2, ``checkpoint_per_pass`` 1) over the same splits,
``plain`` (no train AUC), ``train_auc`` (the default ``train_auc_samples``), and ``saves``
(``model_save_path``: a delta per pass, pass checkpoints, the starting and the day's base; no
train AUC): ``*_over_plain`` = the ratio of samples per second of wall time, bases included.
Prints JSON.

    .venv/bin/python bench/file_stream_input.py [--splits 12] [--per-split 20000] [--parts 4]
                                                [--batch-size 1024] [--saves] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.trainer_rate import train_samples_per_sec  # noqa: E402
from odl.cli.cli_logging import setup_logging  # noqa: E402
from odl.config.pipeline_config import load_pipeline_config  # noqa: E402
from odl.datagen.split_writer import write_splits  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.inputs.file_stream_source import FileStreamSource, FileStreamStart  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402

DAY = time.strftime("%Y%m%d", time.gmtime(time.time() - 86400))  # yesterday (UTC)


def _first_split(splits: int, interval: int = 5) -> str:
    """``HHMM`` of the first of ``splits`` splits that end the day (the day's end is seen)."""
    minute = max(0, 1440 - splits * interval)
    return f"{minute // 60:02d}{minute % 60:02d}"


def _read(root: str, batch_size: int, total: int, builder=None) -> tuple[float, float, list]:
    """(records per wall second, per CPU second of this process, the values read)."""
    src = FileStreamSource(root, FileStreamStart(None, DAY), batch_size, split_interval=5,
                           data_donefile="to.hadoop.done", data_sleep_second=0.0,
                           missing_split_wait_secs=0.0)
    src.open()
    stop = threading.Event()
    values: list[bytes] = []
    t0, c0 = time.perf_counter(), time.process_time()
    while len(values) < total:
        b = src.read_batch(stop)
        if b is None:
            continue
        if builder is not None:
            builder.build_arrays(b.values)
        values += b.values
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(values) / wall, len(values) / max(cpu, 1e-9), values


def _trainer_run(root: str, work: str, name: str, batch_size: int, total: int,
                 saves: bool, train_auc: bool) -> dict:
    """One whole trainer run over the day's splits: samples/s and what it wrote."""
    from odl.export.exporter import export_checkpoint
    from odl.train.trainer import Trainer, TrainerOptions

    config = load_pipeline_config(os.path.join(_ROOT, "samples", "deepfm_online.config"))
    config.ClearField("kafka_train_input")
    config.train_config.ClearField("incr_save_config")  # no delta topic: files only
    config.model_dir = os.path.join(work, name, "model_dir")
    config.data_config.batch_size = batch_size
    config.train_config.save_checkpoints_steps = 1_000_000
    fs = config.file_stream_input
    fs.train_data_dir, fs.split_interval, fs.split_per_pass = root, 5, 2
    fs.start_day = fs.end_day = DAY
    fs.data_donefile, fs.data_sleep_second, fs.missing_split_wait_secs = "to.hadoop.done", 0, 0
    if saves:
        fs.model_save_path = os.path.join(work, name, "saves")
    if not train_auc:
        fs.train_auc_samples = 0
    trainer = Trainer(config, TrainerOptions(online=True, status_port=-1,
                                             export_base=export_checkpoint))
    t0 = time.perf_counter()
    assert trainer.run() == 0 and trainer.samples_trained == total, trainer.failure
    wall = time.perf_counter() - t0
    out = {"samples_per_s": round(total / wall), "wall_s": round(wall, 2),
           "passes": len(trainer.passes.closed) if trainer.passes else 0}
    if trainer.pass_saves is not None:
        out.update(deltas=trainer.pass_saves.deltas_written,
                   bases=trainer.pass_saves.bases_written)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--splits", type=int, default=12)
    ap.add_argument("--per-split", type=int, default=20_000)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--saves", action="store_true",
                    help="also run the whole trainer without and with model_save_path")
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    configure_torch_threads(0)
    work = tempfile.mkdtemp(prefix="odl-bench-filestream-")
    root = os.path.join(work, "data")
    t0 = time.perf_counter()
    written = write_splits(root, DAY, args.splits, args.per_split, parts=args.parts, seed=3,
                           start=_first_split(args.splits))
    write_s = time.perf_counter() - t0
    total = written["records"]
    config = load_pipeline_config(os.path.join(_ROOT, "samples", "deepfm_online.config"))
    config.data_config.batch_size = args.batch_size
    builder = FeatureBuilder(config)
    read_rate, read_cpu, _ = _read(root, args.batch_size, total)
    build_rate, build_cpu, values = _read(root, args.batch_size, total, builder)
    train_rate = train_samples_per_sec(config, builder, values, args.batch_size)
    result = {
        "splits": args.splits, "per_split": args.per_split, "parts": args.parts,
        "batch_size": args.batch_size, "write_s": round(write_s, 2),
        "read_records_per_s": round(read_rate),
        "read_records_per_cpu_s": round(read_cpu),
        "read_build_records_per_s": round(build_rate),
        "read_build_records_per_cpu_s": round(build_cpu),
        "train_samples_per_s": round(train_rate),
        "input_over_train": round(build_rate / train_rate, 2),
    }
    if args.saves:
        runs = {name: _trainer_run(root, work, name, args.batch_size, total, saves, auc)
                for name, saves, auc in (("plain", False, False), ("train_auc", False, True),
                                         ("saves", True, False))}
        base = runs["plain"]["samples_per_s"]
        result.update({f"trainer_{k}": v for k, v in runs.items()})
        result.update({f"{k}_over_plain": round(v["samples_per_s"] / base, 3)
                       for k, v in runs.items() if k != "plain"})
    print(json.dumps(result, indent=1))
    finish_run(args, result, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
