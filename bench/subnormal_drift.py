"""Dense weights drifting into the subnormal range: the step rate over a long run, flushed or not.

``samples/deepfm_online.config`` (DeepFM, DNN 256-128-64 over 461 inputs, L2 1e-5, Adam on the
dense part) trained in memory with ``TrainModule.train_step`` on the Criteo-like synthetic
stream (batch 1,024) for ``--steps`` steps, twice, each in a process of its own (the setting is
per process): once as odl-train runs it (subnormal floats flushed to zero,
``odl.models.subnormal_floats``) and once with flushing off. Every ``--every`` steps each
prints the step rate over the last stretch and how many dense weights are subnormal, and
which rows they lie in (a ReLU unit whose incoming weights all decay, i.e. a dead unit).

Prints per stretch: samples/s flushed and unflushed and their ratio; at the end the ratio
over the last stretch (where the unflushed run has its subnormals) and the subnormal count.

    .venv/bin/python bench/subnormal_drift.py [--steps 2500] [--every 250] [--json out.json]
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
from odl.cli.cli_logging import setup_logging  # noqa: E402

CONFIG = "samples/deepfm_online.config"
BATCH = 1024


def _subnormal_counts(module) -> dict[str, list[int]]:
    """Per 2-D dense weight: [subnormal elements, rows that are over 90 % tiny]."""
    import torch

    tiny = torch.finfo(torch.float32).tiny
    out = {}
    for name, p in module.model.dense.named_parameters():
        w = p.detach()
        bits = w.view(torch.int32) & 0x7FFFFFFF  # read as bits: a flushing CPU reads 0
        sub = (bits > 0) & (bits < 0x00800000)
        if w.dim() == 2 and sub.any():
            dead = int(((w.abs() < tiny * 1e8).float().mean(1) > 0.9).sum())
            out[name] = [int(sub.sum()), dead]
    return out


def run_one(flush: bool, steps: int, every: int) -> list[dict]:
    """Trains ``steps`` steps in this process; one dict per stretch of ``every`` steps."""
    import torch

    from odl.config.pipeline_config import load_pipeline_config
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train import train_module
    from odl.train.train_module import TrainModule

    if not flush:  # what a process without odl's setting computes
        train_module.flush_subnormal_floats = lambda: False
        torch.set_flush_denormal(False)
    torch.set_num_threads(1)  # odl-train's default on 2 cores
    config = load_pipeline_config(CONFIG)
    config.model_dir = tempfile.mkdtemp(prefix="odl-subnormal-")
    features = FeatureBuilder(config)
    module = TrainModule(config, features, device="cpu")
    stream = SyntheticCtrStream(seed=5)
    stretches, busy = [], 0.0
    for step in range(1, steps + 1):
        batch = features.build(stream.next_batch(BATCH).encode()).batch
        start = time.perf_counter()
        module.train_step(batch)
        busy += time.perf_counter() - start
        if step % every == 0:
            stretches.append({"step": step, "samples_per_s": round(every * BATCH / busy),
                              "subnormal": _subnormal_counts(module)})
            busy = 0.0
    return stretches


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--one", choices=("flushed", "unflushed"), help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("ERROR")
    if args.one:  # a child: one run, its stretches as JSON on the last line
        print(json.dumps(run_one(args.one == "flushed", args.steps, args.every)))
        return 0
    runs = {}
    for name in ("flushed", "unflushed"):  # one after the other: they would share the cores
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name,
                              "--steps", str(args.steps), "--every", str(args.every)],
                             capture_output=True, text=True, check=True)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'step':>6} {'flushed /s':>11} {'unflushed /s':>13} {'ratio':>6}  "
          "unflushed subnormal weights (elements, dead rows)")
    for a, b in zip(runs["flushed"], runs["unflushed"], strict=True):
        ratio = a["samples_per_s"] / b["samples_per_s"]
        print(f"{a['step']:>6} {a['samples_per_s']:>11,} {b['samples_per_s']:>13,} "
              f"{ratio:>6.2f}  {b['subnormal'] or '-'}")
    last_f, last_u = runs["flushed"][-1], runs["unflushed"][-1]
    result = {"config": CONFIG, "steps": args.steps, "runs": runs,
              "last_ratio": round(last_f["samples_per_s"] / last_u["samples_per_s"], 3),
              "flushed_subnormal": last_f["subnormal"],
              "unflushed_subnormal": last_u["subnormal"]}
    print(f"last {args.every} steps: flushed / unflushed {result['last_ratio']:.2f}; "
          f"subnormal weights flushed {sum(v[0] for v in last_f['subnormal'].values())}, "
          f"unflushed {sum(v[0] for v in last_u['subnormal'].values())}")
    finish_run(args, result, tempfile.mkdtemp(prefix="odl-subnormal-bench-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
