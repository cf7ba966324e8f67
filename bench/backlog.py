"""Backlog drain: the trainer starts far behind the stream and catches up.

One run on one machine, everything real and local:

* an embedded broker of its own; a sample topic with ``--partitions`` partitions;
* ``--records`` synthetic samples (datagen's vectorised ``CtrBatch.encode``) produced BEFORE
  the trainer starts (500k by default, ~170 MB in the broker);
* ``odl-train --online`` as a subprocess (the test-size DeepFM of ``deepfm_config_text``,
  ``--batch-size``, checkpoints every ``--ckpt-steps``), status API on a free port;
* this process samples, every ``--interval`` seconds: the trainer's lag (sum over partitions of
  high watermark - position, from ``/status``) and its RSS (psutil, children included);
* a separate client thread requests ``/status`` back to back (``--status-hz`` per second)
  for the whole drain and records each latency.

Reported: lag over time (it must fall steadily), drain rate (records/s from start of training
to lag 0), peak RSS and RSS growth after the first minute-ish of training, /status latency
p50 / p99 / max (target p99 < 100 ms). The drain itself is ``odl.harness.backlog_drain``;
``tests/test_backlog.py`` runs a CI-sized version.

    .venv/bin/python bench/backlog.py [--records 500000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.harness.backlog_drain import drain, produce_backlog  # noqa: E402
from odl.kafka.topic_admin import create_topic  # noqa: E402


def main() -> None:
    """Runs the benchmark and prints the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--ckpt-steps", type=int, default=200)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--status-hz", type=float, default=20.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="odl-backlog-") as tmp:
        work = Path(tmp)
        broker = EmbeddedBroker(port=0, data_dir=work / "kafka").start()
        try:
            create_topic(broker.bootstrap, "samples", args.partitions)
            produce_secs = produce_backlog(broker.bootstrap, "samples", args.records,
                                           args.partitions)
            print(f"produced {args.records} records in {produce_secs:.1f}s", flush=True)
            run = drain(broker.bootstrap, "samples", work, args.records, args.batch_size,
                        args.ckpt_steps, args.interval, args.status_hz)
            run.produce_secs = produce_secs
        finally:
            broker.stop()
    out = run.summary()
    out["load_avg"] = os.getloadavg()
    out["lag_over_time"] = [(round(t, 1), v) for t, v in run.lag]
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if run.status_ms:
        print(f"/status p50 {statistics.median(run.status_ms):.1f} ms, p99 "
              f"{out['status_p99_ms']} ms over {len(run.status_ms)} requests")


if __name__ == "__main__":
    main()
