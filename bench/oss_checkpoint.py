"""Checkpoint to OSS vs to a local disk, for a 1M-row table (target: OSS <= 2x local).

One run, one machine. The OSS side is the loopback test double (``odl/harness/oss_double.py``)
in a process of its own, reached by the real ``oss2`` SDK, so the figure is the cost of odl's
OSS path (local staging, sha256, multipart upload with MANIFEST and DONE last, listing,
pruning) on loopback, not of a real OSS region's network.

The state is what a trainer checkpoints for one ``--rows`` x ``--dim`` table trained with
Adagrad: the weights and an optimizer state of the same size (float32), plus a small dense
part. Rounds alternate local and OSS (ABAB), each a ``CheckpointManager.save`` (keep 2) and
then a restore (``read_checkpoint`` of the newest, from a cold local mirror for OSS). Prints
medians and the OSS/local ratios as JSON.

    .venv/bin/python bench/oss_checkpoint.py [--rows 1000000] [--dim 16] [--rounds 4]
                                            [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.run_output import add_output_args, finish_run  # noqa: E402
from odl.checkpoint.checkpoint_manager import CheckpointManager, read_checkpoint  # noqa: E402
from odl.cli.cli_logging import setup_logging
from odl.harness.loopback_server import run_in_child  # noqa: E402
from odl.storage.file_store import cache_dir_for  # noqa: E402
from odl.storage.oss_store import oss_health, reset_oss_store  # noqa: E402

_DOUBLE = "from odl.harness.oss_double import OssDouble\nd = OssDouble().start()"


def _state(rows: int, dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"ebc.t.weight": torch.randn(rows, dim, generator=g),
                      "dense.w": torch.randn(256, 256, generator=g)},
            "optimizer": {"ebc.t.momentum1": torch.rand(rows, dim, generator=g)},
            "global_step": 0}


def _round(mgr: CheckpointManager, model_dir: str, step: int, state: dict) -> tuple[float,
                                                                                    float]:
    t0 = time.perf_counter()
    path = mgr.save(step, state, {0: step}, {"source": "bench"}, "cfg")
    save_s = time.perf_counter() - t0
    if model_dir.startswith("oss://"):
        shutil.rmtree(cache_dir_for(path), ignore_errors=True)  # a cold restore
    t0 = time.perf_counter()
    ckpt = read_checkpoint(path)
    restore_s = time.perf_counter() - t0
    assert ckpt.global_step == step
    return save_s, restore_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    add_output_args(ap)
    args = ap.parse_args()
    setup_logging("WARNING")
    work = tempfile.mkdtemp(prefix="odl-bench-oss-")
    double, endpoint = run_in_child(_DOUBLE)
    try:
        os.environ.update({"OSS_ACCESS_KEY_ID": "bench", "OSS_ACCESS_KEY_SECRET": "bench",
                           "OSS_ENDPOINT": endpoint,
                           "ODL_CACHE_DIR": os.path.join(work, "cache")})
        reset_oss_store()
        state = _state(args.rows, args.dim)
        local_dir = os.path.join(work, "local_model_dir")
        oss_dir = "oss://bench/model_dir"
        managers = {"local": CheckpointManager(local_dir, keep_max=2),
                    "oss": CheckpointManager(oss_dir, keep_max=2)}
        dirs = {"local": local_dir, "oss": oss_dir}
        times: dict[str, dict[str, list[float]]] = {
            k: {"save": [], "restore": []} for k in managers}
        for r in range(args.rounds):
            order = ("local", "oss") if r % 2 == 0 else ("oss", "local")
            for kind in order:
                save_s, restore_s = _round(managers[kind], dirs[kind], r + 1, state)
                times[kind]["save"].append(save_s)
                times[kind]["restore"].append(restore_s)
        ckpt_mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _d, fs in
                      os.walk(os.path.join(local_dir, f"model.ckpt-{args.rounds}"))
                      for f in fs) / 1e6
        med = {k: {op: statistics.median(v) for op, v in ops.items()}
               for k, ops in times.items()}
        result = {
            "rows": args.rows, "dim": args.dim, "rounds": args.rounds,
            "checkpoint_mb": round(ckpt_mb, 1),
            "local_save_s": round(med["local"]["save"], 3),
            "oss_save_s": round(med["oss"]["save"], 3),
            "local_restore_s": round(med["local"]["restore"], 3),
            "oss_restore_s": round(med["oss"]["restore"], 3),
            "save_ratio_oss_over_local": round(med["oss"]["save"] / med["local"]["save"], 2),
            "restore_ratio_oss_over_local": round(
                med["oss"]["restore"] / med["local"]["restore"], 2),
            "oss": oss_health(),
            "rounds_s": times,
        }
        print(json.dumps(result, indent=1))
        finish_run(args, result, work)
    finally:
        double.stdin.close()
        double.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
