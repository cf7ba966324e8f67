"""``make demo-cloud``: the online loop on Alibaba Cloud's parts, played by local doubles.

The same story as ``make demo`` with samples read from DataHub and every file on OSS. No
cloud account is needed: the OSS and DataHub test doubles (``odl/harness/oss_double.py``,
``odl/harness/datahub_double.py``) run in this process on loopback and the real ``oss2`` and
``pydatahub`` SDKs talk to them; deltas go to the embedded Kafka broker as in production.

1. starts the doubles and the broker, writes the pipeline config to
   ``oss://odl-demo/ctr/pipeline.config`` (``samples/deepfm_online.config`` with
   ``datahub_train_input`` and ``model_dir: oss://odl-demo/ctr/model_dir``), and feeds
   synthetic samples into a 4-shard DataHub topic;
2. runs ``odl-train --online`` with the credentials in the environment only
   (``OSS_ACCESS_KEY_ID`` ..., ``DATAHUB_ACCESS_KEY_ID`` ...), printing its ``/status``;
3. stops it with ``OSS_STOP_SIGNAL`` written to OSS, checks that its last checkpoint (on OSS)
   covers exactly what DataHub holds;
4. ``odl-export --export_dir oss://odl-demo/ctr/exports --oss_path oss://odl-demo/ctr/emb``,
   then ``odl-serve --export_dir oss://odl-demo/ctr/exports``, and compares serving's
   predictions with the trainer's checkpoint;
5. stops everything. Logs stay in ``.odl/demo-cloud``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Optional

from odl.broker.embedded_broker import EmbeddedBroker
from odl.demos.kafka_demo import (
    _free_port,
    _get,
    _py,
    _say,
    _show_serving,
    _show_trainer,
    _stop_all,
)
from odl.harness.datahub_double import DatahubDouble
from odl.harness.oss_double import OssDouble
from odl.kafka.topic_admin import create_topic
from odl.train.torch_runtime import quiet_library_noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "samples", "deepfm_online.config")
BUCKET = "odl-demo"
MODEL_DIR = f"oss://{BUCKET}/ctr/model_dir"
CONFIG_PATH = f"oss://{BUCKET}/ctr/pipeline.config"
EXPORT_DIR = f"oss://{BUCKET}/ctr/exports"
SHARDS = 4


def _trainer_status(env: dict, pid: int) -> Optional[dict]:
    from odl.storage.file_store import cache_dir_for

    os.environ["ODL_CACHE_DIR"] = env["ODL_CACHE_DIR"]
    try:
        with open(os.path.join(cache_dir_for(MODEL_DIR), "status.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return _get(doc["url"] + "/status") if doc.get("pid") == pid else None


def main(argv: Optional[list[str]] = None) -> int:  # noqa: C901 - one linear story
    """Runs the cloud demo; returns 0 when every check held."""
    quiet_library_noise()  # the checks build models in this process
    work = os.path.join(ROOT, ".odl", "demo-cloud")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    oss, dh = OssDouble().start(), DatahubDouble().start()
    broker = EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka"))
    procs: list[subprocess.Popen] = []
    checks: dict[str, bool] = {}
    env = dict(os.environ, OSS_ACCESS_KEY_ID="demo-oss-id", OSS_ACCESS_KEY_SECRET="demo-secret",
               OSS_ENDPOINT=oss.endpoint, DATAHUB_ACCESS_KEY_ID="demo-dh-id",
               DATAHUB_ACCESS_KEY_SECRET="demo-dh-secret",
               ODL_CACHE_DIR=os.path.join(work, "cache"))
    os.environ.update({k: env[k] for k in ("OSS_ACCESS_KEY_ID", "OSS_ACCESS_KEY_SECRET",
                                           "OSS_ENDPOINT", "ODL_CACHE_DIR")})
    try:
        from odl.datagen.synthetic_ctr import SyntheticCtrStream
        from odl.storage import file_store

        broker.start()
        create_topic(broker.bootstrap, "odl_deltas", partitions=1)
        _say(f"OSS double at {oss.endpoint}, DataHub double at {dh.endpoint}, "
             f"broker at {broker.bootstrap}")
        text = open(CONFIG).read()
        text = re.sub(r'model_dir: "[^"]*"', f'model_dir: "{MODEL_DIR}"', text, count=1)
        text = re.sub(r"kafka_train_input \{[^}]*\}",
                      f'datahub_train_input {{ endpoint: "{dh.endpoint}" project: "odl" '
                      f'topic: "samples" }}', text, count=1)
        text = text.replace("127.0.0.1:9092", broker.bootstrap)
        file_store.write_bytes(CONFIG_PATH, text.encode())
        _say(f"pipeline config written to {CONFIG_PATH} (model_dir {MODEL_DIR})")
        dh.create_topic("odl", "samples", shards=SHARDS)
        stream = SyntheticCtrStream(seed=7)
        fed = 0
        for _ in range(6):
            records = stream.next_batch(5000).encode("csv")
            for s in range(SHARDS):
                dh.append("odl", "samples", str(s), records[s::SHARDS])
            fed += len(records)
        _say(f"{fed} samples in DataHub odl/samples ({SHARDS} shards)")

        log = open(os.path.join(work, "trainer.log"), "w")
        trainer = subprocess.Popen(
            _py("odl.cli.train_cli", "--pipeline_config_path", CONFIG_PATH, "--online",
                "--status_port", "0", "--edit_config_json",
                json.dumps({"train_config.save_checkpoints_steps": 20})),
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        procs.append(trainer)
        ends = {s: fed // SHARDS for s in range(SHARDS)}
        deadline = time.time() + 240
        next_show = 0.0
        st = None
        while time.time() < deadline:
            if trainer.poll() is not None:
                raise RuntimeError(f"trainer exited with {trainer.returncode}; see {log.name}")
            st = _trainer_status(env, trainer.pid)
            parts = (st or {}).get("input", {}).get("partitions", {})
            if st and time.time() >= next_show:
                _show_trainer(st)
                next_show = time.time() + 5
            if parts and all(parts.get(str(p), {}).get("position", -1) >= e
                             for p, e in ends.items()):
                break
            time.sleep(0.5)
        _say("trainer read everything; writing OSS_STOP_SIGNAL to the model_dir on OSS")
        file_store.write_bytes(f"{MODEL_DIR}/OSS_STOP_SIGNAL", b"")
        rc = trainer.wait(180)
        checks["trainer stopped cleanly"] = rc == 0
        from odl.checkpoint.checkpoint_manager import list_checkpoints, read_checkpoint

        ckpts = list_checkpoints(MODEL_DIR)
        final = read_checkpoint(ckpts[-1])
        _say(f"checkpoints on OSS: {[c.rsplit('/', 1)[-1] for c in ckpts]}")
        _say(f"final checkpoint positions {final.positions}, DataHub ends {ends}")
        checks["every record trained exactly once (positions == DataHub ends)"] = \
            final.positions == ends

        out = subprocess.run(
            _py("odl.cli.export_cli", "--pipeline_config_path", CONFIG_PATH, "--export_dir",
                EXPORT_DIR, "--oss_path", f"oss://{BUCKET}/ctr/emb", "--log_level", "WARNING"),
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        checks["odl-export to OSS"] = out.returncode == 0
        _say(f"exported to {out.stdout.strip()}")
        port = _free_port()
        serve = subprocess.Popen(
            _py("odl.cli.serve_cli", "--export_dir", EXPORT_DIR, "--port", str(port)),
            stdout=open(os.path.join(work, "serving.log"), "w"), stderr=subprocess.STDOUT,
            cwd=ROOT, env=env)
        procs.append(serve)
        url = f"http://127.0.0.1:{port}"
        sst = None
        deadline = time.time() + 120
        while time.time() < deadline and not (sst and sst.get("version") == final.global_step
                                              and sst.get("lag_messages") == 0):
            sst = _get(url + "/status")
            time.sleep(0.5)
        if sst:
            _show_serving(sst)
        diff = _parity(url, final)
        _say(f"serving from {EXPORT_DIR} vs the trainer's checkpoint on OSS: max |diff| over "
             f"1,000 predictions = {diff:.2e}")
        checks["serving predictions equal the trainer's (<= 1e-6)"] = diff <= 1e-6
        secrets = ("demo-secret", "demo-dh-secret")
        logs = "".join(open(os.path.join(work, n)).read() for n in ("trainer.log", "serving.log"))
        checks["no secret in any log"] = not any(s in logs for s in secrets)
        return 0 if all(checks.values()) else 1
    except Exception as exc:  # the demo reports, then cleans up
        _say(f"FAILED: {type(exc).__name__}: {exc}")
        return 1
    finally:
        _stop_all(procs)
        broker.stop(timeout=60)
        oss.stop()
        dh.stop()
        for name, ok in checks.items():
            _say(f"{'ok  ' if ok else 'FAIL'} {name}")
        ok = bool(checks) and all(checks.values())
        _say(f"everything stopped; logs in {work}. Cloud demo {'succeeded' if ok else 'FAILED'}.")


def _parity(url: str, ckpt) -> float:
    """Max |serving - trainer| on 1,000 fresh records at the checkpoint's step."""
    import urllib.request

    from odl.config.pipeline_config import load_pipeline_config
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    config = load_pipeline_config(CONFIG_PATH)
    features = FeatureBuilder(config)
    module = TrainModule(config, features, device="cpu")
    module.load_checkpoint_state(ckpt.state)
    records = SyntheticCtrStream(seed=123).next_batch(1000).encode("csv")
    expected = module.predict(features.build(records).batch)
    req = urllib.request.Request(url + "/predict", data=b"\n".join(records), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        served = json.load(r)["probabilities"]
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


if __name__ == "__main__":
    sys.exit(main())
