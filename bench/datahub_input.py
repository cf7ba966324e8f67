"""DataHub input rate on loopback vs the trainer's step rate (target: the trainer is the limit,
and the input reads >= 20k records/s).

One run, one machine. The DataHub double (``odl/harness/datahub_double.py``) runs in a process
of its own and holds ``--records`` synthetic CTR records (CSV, the datagen schema) in
``--shards`` shards of a BLOB topic. In this process, measured one after the other:

1. ``read``: ``DatahubSource`` (the real ``pydatahub`` SDK, JSON protocol, LZ4 bodies) reads
   every record in batches of ``--batch-size``: records/s;
2. ``read+build``: the same plus ``FeatureBuilder.build_arrays`` per batch, which is what the
   input child process does for the trainer: records/s;
3. ``train``: ``TrainModule.train_step`` of ``samples/deepfm_online.config``'s DeepFM (the
   demo's model) on batches built from the same records, in memory: samples/s.

``input_over_train`` = read+build / train: above 1 the trainer, not the input, is the limit.
The double serves from Python in a second process on the same cores (JSON, base64, LZ4), a
cost a real DataHub does not put on the trainer's machine, so the wall-clock read rate is a
lower bound; ``*_per_client_cpu_s`` divide by this process's CPU time instead (what reading
costs the trainer host; the input runs in its own child process). Prints JSON.

    .venv/bin/python bench/datahub_input.py [--records 200000] [--shards 4]
                                            [--batch-size 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from datahub import DataHub  # noqa: E402
from datahub.models import BlobRecord  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from bench.trainer_rate import train_samples_per_sec  # noqa: E402
from odl.cli.cli_logging import setup_logging  # noqa: E402
from odl.config.pipeline_config import load_pipeline_config  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.loopback_server import run_in_child  # noqa: E402
from odl.harness.topic_records import make_records  # noqa: E402
from odl.inputs.datahub_source import DatahubSource, parse_datahub_start  # noqa: E402
from odl.train.torch_runtime import configure_torch_threads  # noqa: E402

_DOUBLE = ("from odl.harness.datahub_double import DatahubDouble\n"
           "d = DatahubDouble().start()\nd.create_topic('bench', 'samples', shards={shards})")


def _read(endpoint: str, batch_size: int, total: int, builder=None) -> tuple[float, float]:
    """(records per wall second, records per CPU second of this process)."""
    src = DatahubSource(endpoint, "bench", "bench", "bench", "samples",
                        parse_datahub_start("", "", None), batch_size, batch_timeout_ms=200)
    src.open()
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while n < total:
        b = src.read_batch()
        if b is None:
            continue
        if builder is not None:
            builder.build_arrays(b.values)
        n += len(b)
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=1024)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    configure_torch_threads(0)
    work = tempfile.mkdtemp(prefix="odl-bench-datahub-")
    double, endpoint = run_in_child(_DOUBLE.format(shards=args.shards))
    try:
        _ids, values = make_records(args.records, seed=3)
        client = DataHub("bench", "bench", endpoint, enable_pb=False, user_agent="bench")
        t0 = time.perf_counter()
        for i in range(0, len(values), 1000):
            client.put_records("bench", "samples",
                               [BlobRecord(blob_data=v) for v in values[i:i + 1000]])
        load_s = time.perf_counter() - t0
        config = load_pipeline_config(os.path.join(_ROOT, "samples", "deepfm_online.config"))
        config.data_config.batch_size = args.batch_size
        builder = FeatureBuilder(config)
        read_rate, read_cpu = _read(endpoint, args.batch_size, args.records)
        build_rate, build_cpu = _read(endpoint, args.batch_size, args.records, builder)
        train_rate = train_samples_per_sec(config, builder, values, args.batch_size)
        result = {
            "records": args.records, "shards": args.shards, "batch_size": args.batch_size,
            "load_s": round(load_s, 2),
            "read_records_per_s": round(read_rate),
            "read_records_per_client_cpu_s": round(read_cpu),
            "read_build_records_per_s": round(build_rate),
            "read_build_records_per_client_cpu_s": round(build_cpu),
            "train_samples_per_s": round(train_rate),
            "input_over_train": round(build_rate / train_rate, 2),
            "input_cpu_over_train": round(build_cpu / train_rate, 2),
        }
        print(json.dumps(result, indent=1))
        finish_run(args, result, work)
    finally:
        double.stdin.close()
        double.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
