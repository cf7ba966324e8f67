"""Chaos run: SIGKILL the trainer many times at random moments, then audit exactly-once.

One ``odl-train`` (a subprocess, the real CLI) trains from a topic that keeps receiving
records; it is SIGKILLed ``--kills`` times at random moments (fixed ``--seed``): during
startup / restore / recovery, mid-training (mid-step, while a multi-chunk version is being
sent), and aimed at checkpoint writes (killed as soon as a checkpoint's temporary directory
appears; checkpoints are frequent). Versions are cut into small chunks, each sent in its own
produce request (``batch.size`` just above the chunk size, ``linger.ms`` 0), so kills can leave
half-sent versions. It is restarted with the same command each time and
finally stopped with SIGTERM once it has read everything. Then:

* records lost / reflected twice: the sample ledger audited against the delta topic as
  serving assembles it (``odl.harness.exactly_once_audit``; target 0 / 0);
* half-sent versions found in the delta topic (left by kills; serving must never apply them);
* recovery time: restart to state ``training`` (target < 15 s);
* serving: ``odl-serve`` on an export of the first checkpoint replays every generation's
  versions, is SIGKILLed mid-replay, restarted, and must reach the final version and predict
  what the trainer's final checkpoint predicts (max abs diff, target <= 1e-6).

Prints one JSON document. Example::

    python bench/chaos.py --kills 40 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from odl.broker.embedded_broker import EmbeddedBroker  # noqa: E402
from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint  # noqa: E402
from odl.config.pipeline_config import load_pipeline_config  # noqa: E402
from odl.datagen.datagen_config import deepfm_config_text  # noqa: E402
from odl.datagen.synthetic_ctr import SyntheticCtrStream  # noqa: E402
from odl.export.exporter import export_checkpoint  # noqa: E402
from odl.features.feature_builder import FeatureBuilder  # noqa: E402
from odl.harness.delta_topic_audit import audit_delta_topic  # noqa: E402
from odl.harness.exactly_once_audit import reflected_exactly_once  # noqa: E402
from odl.harness.http_client import free_port, get_json, post_json  # noqa: E402
from odl.harness.topic_records import make_records, produce  # noqa: E402
from odl.harness.trainer_killer import TrainerKiller  # noqa: E402
from odl.kafka.topic_admin import create_topic, end_offsets  # noqa: E402
from odl.train.sample_ledger import read_ledger  # noqa: E402
from odl.train.train_module import TrainModule  # noqa: E402

PARTS = 2


def _serving_check(cfg: str, first_ckpt: str, final, work: str, rng: random.Random) -> dict:
    """odl-serve on an export of the first checkpoint, SIGKILLed mid-replay and restarted."""
    config = load_pipeline_config(cfg)
    export_checkpoint(config, first_ckpt, os.path.join(work, "export"))
    records = SyntheticCtrStream(seed=99).next_batch(1000).encode("csv")
    module = TrainModule(config, FeatureBuilder(config), device="cpu")
    module.load_checkpoint_state(final.state)
    expected = module.predict(FeatureBuilder(config).build(records).batch)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "odl.cli.serve_cli", "--export_dir",
           os.path.join(work, "export"), "--port", str(port)]
    log = open(os.path.join(work, "serve.log"), "ab")
    out: dict = {}
    serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (get_json(url + "/status") or {}).get(
                "versions_applied", 0) < 1:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        killed_at = (get_json(url + "/status", timeout=1) or {}).get("version")
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        t0 = time.monotonic()
        serve = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        status: dict = {}
        while time.time() < deadline + 120:
            status = get_json(url + "/status") or {}
            if status.get("version") == final.global_step and status.get("lag_messages") == 0:
                break
            time.sleep(0.1)
        served = post_json(url + "/predict", b"\n".join(records))
        diff = float(np.abs(np.asarray(served["probabilities"]) - expected).max())
        out = {
            "killed_at_version": killed_at,
            "restart_to_final_version_s": round(time.monotonic() - t0, 2),
            "final_version": status.get("version"),
            "trainer_final_step": final.global_step,
            "versions_applied_after_restart": status.get("versions_applied"),
            "rejected_messages": status.get("rejected_messages"),
            "pending_versions": status.get("pending_versions"),
            "max_abs_diff": diff,
            "parity_ok": status.get("version") == final.global_step and diff <= 1e-6,
        }
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
    return out


def main() -> int:
    """Runs the chaos scenario and prints the JSON report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--records", type=int, default=24000)
    ap.add_argument("--rate", type=float, default=600.0, help="records/s produced meanwhile")
    ap.add_argument("--max_delay", type=float, default=3.0,
                    help="kill within this many seconds after training started")
    ap.add_argument("--checkpoint_steps", type=int, default=4)
    ap.add_argument("--publish_steps", type=int, default=2)
    ap.add_argument("--max_chunk_bytes", type=int, default=16384,
                    help="small chunks: versions span many messages, so kills cut some")
    ap.add_argument("--bootstrap", default="", help="use this broker instead of an embedded one")
    ap.add_argument("--work_dir", default="")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.work_dir or tempfile.mkdtemp(prefix="odl-chaos-")
    os.makedirs(work, exist_ok=True)
    broker = None
    if args.bootstrap:
        bootstrap = args.bootstrap
    else:
        broker = EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka"))
        broker.start()
        bootstrap = broker.bootstrap
    t_begin = time.monotonic()
    try:
        suffix = f"{os.getpid()}-{int(time.time())}"
        topic, delta_topic = f"chaos-in-{suffix}", f"chaos-delta-{suffix}"
        create_topic(bootstrap, topic, PARTS)
        model_dir = os.path.join(work, "model_dir")
        # one produce request per chunk (no batching): a kill can cut a version in the middle
        sink = (f'kafka {{ server: "{bootstrap}" topic: "{delta_topic}" kafka_config {{ '
                f'key: "batch.size" value: "{args.max_chunk_bytes + 1024}" }} '
                f'kafka_config {{ key: "linger.ms" value: "0" }} }}')
        incr = (f"incr_save_config {{ sparse_save_steps: {args.publish_steps} "
                f"dense_save_steps: {args.publish_steps} max_chunk_bytes: "
                f"{args.max_chunk_bytes} {sink} }}")
        cfg = os.path.join(work, "pipeline.config")
        with open(cfg, "w") as f:
            f.write(deepfm_config_text(model_dir, server=bootstrap, topic=topic, batch_size=40,
                                       extra_train=incr,
                                       save_checkpoints_steps=args.checkpoint_steps))
        ledger = os.path.join(work, "ledger.tsv")
        ids, values = make_records(args.records, seed=args.seed)
        stop = threading.Event()
        chunk = max(1, int(args.rate / 4))

        def feed() -> None:
            for i in range(0, len(values), chunk):
                produce(bootstrap, topic, values[i : i + chunk], PARTS)
                if stop.wait(0.25):
                    return

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        killer = TrainerKiller(cfg, model_dir, os.path.join(work, "trainer.log"), ledger, rng)
        aims = ["startup"] * (args.kills // 5) + ["checkpoint"] * (args.kills // 4)
        aims += ["training"] * (args.kills - len(aims))
        rng.shuffle(aims)
        first_ckpt = os.path.join(work, "first_ckpt")
        try:
            for i, aim in enumerate(aims):
                rec = killer.start_and_kill(max_delay=args.max_delay, aim=aim)
                rec["aim"] = aim
                if i == 0 or not os.path.isdir(first_ckpt):
                    ckpts = list_checkpoints(model_dir)
                    if ckpts:
                        try:
                            shutil.copytree(ckpts[0], first_ckpt)
                        except (OSError, shutil.Error):
                            shutil.rmtree(first_ckpt, ignore_errors=True)
                print(f"kill {i + 1}/{len(aims)}: {rec}", file=sys.stderr, flush=True)
            feeder.join()
            ends = end_offsets(bootstrap, topic)
            killer.finish(ends)
        finally:
            stop.set()
            killer.cleanup()
        audit = audit_delta_topic(bootstrap, delta_topic)
        entries = read_ledger(ledger)
        lost, twice = reflected_exactly_once(ids, entries, audit.last_complete)
        final = read_checkpoint(list_checkpoints(model_dir)[-1])
        serving = _serving_check(cfg, first_ckpt, final, work, rng)
        rec_s = killer.recovery_seconds
        phases = collections.Counter(k["phase"] for k in killer.kills)
        recovered = [r for r in killer.recoveries if r.get("from_checkpoint") is not None]
        uptimes = [r["uptime_s"] for r in killer.recoveries if r.get("uptime_s") is not None]
        report = {
            "kill_points": len(killer.kills),
            "kills_by_aim": dict(collections.Counter(k["aim"] for k in killer.kills)),
            "kills_by_observed_phase": dict(phases),
            "half_sent_versions_in_topic": len(audit.incomplete),
            "complete_versions_in_topic": len(audit.complete_versions),
            "generations": len({g for g, _, _ in entries}),
            "records_produced": len(ids),
            "records_lost": len(lost),
            "records_reflected_twice": len(twice),
            "final_positions_equal_topic_end": final.positions == ends,
            "final_step": final.global_step,
            "recovery_seconds": {
                "starts_measured": len(rec_s),
                "p50": round(statistics.median(rec_s), 2) if rec_s else None,
                "max": max(rec_s) if rec_s else None,
                "all": rec_s,
                "in_process_p50": round(statistics.median(uptimes), 2) if uptimes else None,
                "in_process_max": max(uptimes) if uptimes else None,
            },
            "recovery_replay": {
                "restarts_that_replayed_versions": sum(1 for r in recovered
                                                       if r.get("versions")),
                "max_versions_replayed": max((r.get("versions", 0) for r in recovered),
                                             default=0),
                "max_replay_seconds": max((r.get("seconds", 0) for r in recovered),
                                          default=0),
                "dropped_incomplete_versions_seen": sum(
                    r.get("dropped_incomplete_versions", 0) for r in recovered),
            },
            "serving": serving,
            "elapsed_s": round(time.monotonic() - t_begin, 1),
            "seed": args.seed,
            "work_dir": work if args.keep else None,
        }
        print(json.dumps(report, indent=1))
        ok = (not lost and not twice and serving.get("parity_ok")
              and final.positions == ends)
        return 0 if ok else 1
    finally:
        if broker is not None:
            broker.stop()
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
