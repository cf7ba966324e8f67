"""``make demo``: the whole online loop on this machine in about three minutes.

1. starts the embedded broker and streams synthetic CTR samples with ``odl-datagen``;
2. trains a TorchRec DeepFM on them with ``odl-train --online``
   (samples/deepfm_online.config), publishing changed rows every 5 steps to a delta topic,
   and prints the trainer's ``/status`` every 10 s;
3. exports the newest checkpoint with ``odl-export`` and starts ``odl-serve`` on it, which
   replays the delta topic and follows the trainer (its ``/status`` is printed too);
4. stops the trainer with ``OSS_STOP_SIGNAL``, waits until serving has applied the trainer's
   last version and compares serving's ``/predict`` with the trainer's own model at that step;
5. restarts the trainer, which continues exactly where its checkpoint left off, lets it reach
   the end of the stream, stops it, and checks that its checkpoint covers exactly the broker's
   end offsets;
6. shuts everything down. Logs stay in ``.odl/demo`` (removed at the start of each run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Optional

from odl.broker.embedded_broker import EmbeddedBroker
from odl.kafka.topic_admin import (
    DEFAULT_RETENTION_HOURS,
    DEFAULT_RETENTION_MB,
    Retention,
    create_topic,
    end_offsets,
)
from odl.train.torch_runtime import quiet_library_noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "samples", "deepfm_online.config")
TOPIC = "odl_samples"
DELTA_TOPIC = "odl_deltas"


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _get(url: str, timeout: float = 3) -> Optional[dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def _trainer_url(model_dir: str) -> Optional[str]:
    """The trainer's status API, from the ``status.json`` it wrote."""
    try:
        with open(os.path.join(model_dir, "status.json")) as f:
            return str(json.load(f)["url"])
    except (OSError, ValueError, KeyError):
        return None


def _trainer_status(model_dir: str) -> Optional[dict]:
    url = _trainer_url(model_dir)
    return None if url is None else _get(url + "/status")


def _show_trainer(st: dict) -> None:
    prog = st.get("progressive", {})
    lag = {p: v.get("lag") for p, v in st.get("input", {}).get("partitions", {}).items()}
    pub = st.get("publisher") or {}
    _say(
        f"trainer: step={st['global_step']} samples={st['samples_trained']} "
        f"rate={st['samples_per_sec']}/s auc={prog.get('auc')} logloss={prog.get('logloss')} "
        f"lag={lag} last_ckpt={st['last_checkpoint']['step']} "
        f"published_version={pub.get('last_version')} ({pub.get('last_rows')} rows, "
        f"{pub.get('last_bytes')} bytes)"
    )


def _show_serving(st: dict) -> None:
    fresh = st.get("freshness_seconds")
    _say(
        f"serving: version={st.get('version')} applied={st.get('versions_applied')} "
        f"rows={st.get('rows_applied')} freshness={fresh if fresh is None else round(fresh, 2)}s "
        f"lag={st.get('lag_messages')} rejected={st.get('rejected_messages')}"
    )


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process still running; SIGKILL one that has not exited after 60 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _start_trainer(bootstrap: str, model_dir: str, log) -> subprocess.Popen:
    edits = json.dumps({
        "kafka_train_input.server": bootstrap,
        "model_dir": model_dir,
        "train_config.incr_save_config.kafka.server": bootstrap,
        "train_config.save_checkpoints_steps": 30,
        "train_config.keep_checkpoint_max": 10,
    })
    cmd = _py("odl.cli.train_cli", "--pipeline_config_path", CONFIG, "--online",
              "--edit_config_json", edits, "--status_port", "0")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait_trainer(model_dir: str, proc: subprocess.Popen, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited with {proc.returncode}; see its log")
        st = _trainer_status(model_dir)
        if st is not None and st.get("pid") == proc.pid:
            return st
        time.sleep(0.5)
    raise TimeoutError("trainer status API did not come up")


def _stop_trainer(model_dir: str, proc: subprocess.Popen) -> int:
    _say("writing OSS_STOP_SIGNAL into model_dir")
    open(os.path.join(model_dir, "OSS_STOP_SIGNAL"), "w").close()
    return proc.wait(timeout=180)


def _checkpoints(model_dir: str) -> list[str]:
    found = [d for d in os.listdir(model_dir) if d.startswith("model.ckpt-")]
    return sorted(found, key=lambda d: int(d.split("-")[1]))


def _wait_serving_version(url: str, version: int, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    st: dict = {}
    while time.time() < deadline:
        st = _get(url + "/status") or {}
        if st.get("version") == version:
            return st
        time.sleep(0.5)
    raise TimeoutError(f"serving did not reach version {version}: {st}")


def _parity(url: str, model_dir: str, ckpt: str) -> float:
    """Max |serving - trainer| on 1,000 fresh records at the trainer's final step."""
    from odl.checkpoint.checkpoint_manager import read_checkpoint
    from odl.config.pipeline_config import parse_pipeline_config_text
    from odl.datagen.synthetic_ctr import SyntheticCtrStream
    from odl.features.feature_builder import FeatureBuilder
    from odl.train.train_module import TrainModule

    path = os.path.join(model_dir, ckpt)
    with open(os.path.join(path, "pipeline.config")) as f:
        config = parse_pipeline_config_text(f.read())
    features = FeatureBuilder(config)
    module = TrainModule(config, features, device="cpu")
    module.load_checkpoint_state(read_checkpoint(path).state)
    records = SyntheticCtrStream(seed=123).next_batch(1000).encode("csv")
    expected = module.predict(features.build(records).batch)
    req = urllib.request.Request(url + "/predict", data=b"\n".join(records), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        served = json.load(r)["probabilities"]
    return max(abs(a - b) for a, b in zip(served, expected, strict=True))


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the demo; returns 0 when every check held."""
    ap = argparse.ArgumentParser(prog="odl-demo")
    ap.add_argument("--seconds", type=float, default=60.0, help="first training run length")
    ap.add_argument("--rate", type=int, default=3000, help="datagen samples/s")
    args = ap.parse_args(argv)
    quiet_library_noise()  # the parity check builds a model in this process

    work = os.path.join(ROOT, ".odl", "demo")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model_dir = os.path.join(work, "model_dir")
    export_dir = os.path.join(work, "export")
    broker = EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka"))
    procs: list[subprocess.Popen] = []
    checks: dict[str, bool] = {}
    try:
        broker.start()
        _say(f"embedded broker up at {broker.bootstrap} (pid {broker.pid})")
        create_topic(broker.bootstrap, TOPIC, partitions=4,
                     retention=Retention.from_flags(DEFAULT_RETENTION_MB,
                                                    DEFAULT_RETENTION_HOURS))
        gen = subprocess.Popen(
            _py("odl.cli.datagen_cli", "--bootstrap", broker.bootstrap, "--topic", TOPIC,
                "--partitions", "4", "--rate", str(args.rate),
                "--seconds", str(args.seconds + 30), "--seed", "7"),
            stdout=subprocess.PIPE, stderr=open(os.path.join(work, "datagen.log"), "w"),
            cwd=ROOT, text=True,
        )
        procs.append(gen)
        _say(f"odl-datagen streaming {args.rate} samples/s into topic {TOPIC}")
        train_log = open(os.path.join(work, "trainer.log"), "w")
        trainer = _start_trainer(broker.bootstrap, model_dir, train_log)
        procs.append(trainer)
        _wait_trainer(model_dir, trainer)
        _say(f"odl-train --online is up (log: {train_log.name}); its live dashboard: "
             f"{_trainer_url(model_dir)}/")

        serve_url = None
        t_end = time.time() + args.seconds
        while time.time() < t_end:
            time.sleep(10)
            st = _trainer_status(model_dir)
            if st:
                _show_trainer(st)
            if serve_url is None and os.path.isdir(model_dir) and _checkpoints(model_dir):
                newest = _checkpoints(model_dir)[-1]
                _say(f"exporting {newest} with odl-export and starting odl-serve on it")
                subprocess.run(
                    _py("odl.cli.export_cli", "--pipeline_config_path", CONFIG,
                        "--checkpoint_path", os.path.join(model_dir, newest),
                        "--export_dir", export_dir, "--log_level", "WARNING"),
                    check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                )
                port = _free_port()
                procs.append(subprocess.Popen(
                    _py("odl.cli.serve_cli", "--export_dir", export_dir, "--port", str(port)),
                    stdout=open(os.path.join(work, "serving.log"), "w"),
                    stderr=subprocess.STDOUT, cwd=ROOT,
                ))
                serve_url = f"http://127.0.0.1:{port}"
                _say(f"odl-serve's live dashboard: {serve_url}/")
            elif serve_url is not None:
                sst = _get(serve_url + "/status")
                if sst:
                    _show_serving(sst)

        rc = _stop_trainer(model_dir, trainer)
        ckpts = _checkpoints(model_dir)
        final = ckpts[-1]
        final_step = int(final.split("-")[1])
        _say(f"trainer stopped with exit code {rc}; final checkpoint {final}")
        checks["trainer stopped cleanly"] = rc == 0
        if serve_url is not None:
            sst = _wait_serving_version(serve_url, final_step)
            _show_serving(sst)
            diff = _parity(serve_url, model_dir, final)
            _say(f"serving at version {final_step} vs the trainer's model at step {final_step}: "
                 f"max |diff| over 1,000 predictions = {diff:.2e}")
            checks["serving predictions equal the trainer's (<= 1e-6)"] = diff <= 1e-6

        _say("restarting the trainer: it restores its checkpoint and continues from its positions")
        trainer = _start_trainer(broker.bootstrap, model_dir, train_log)
        procs.append(trainer)
        _wait_trainer(model_dir, trainer)
        gen.wait(timeout=args.seconds + 120)
        out = gen.stdout.read() if gen.stdout else ""
        summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        _say(f"odl-datagen produced {summary.get('produced')} samples, "
             f"oracle AUC {summary.get('oracle_auc')}")
        ends = end_offsets(broker.bootstrap, TOPIC)
        _say(f"waiting for the trainer to reach the end of the stream {ends}")
        deadline = time.time() + 300
        next_show = 0.0
        while time.time() < deadline:
            st = _trainer_status(model_dir)
            parts = (st or {}).get("input", {}).get("partitions", {})
            if parts and all(parts[str(p)]["position"] >= e for p, e in ends.items()):
                break
            if st and time.time() >= next_show:
                _show_trainer(st)
                next_show = time.time() + 10
            time.sleep(1)
        rc = _stop_trainer(model_dir, trainer)
        final = _checkpoints(model_dir)[-1]
        with open(os.path.join(model_dir, final, "positions.json")) as f:
            saved = {int(k): v for k, v in json.load(f)["positions"].items()}
        _say(f"trainer stopped with exit code {rc}; final checkpoint {final}")
        _say(f"checkpoint positions {saved}")
        _say(f"broker end offsets     {ends}")
        checks["restart stopped cleanly"] = rc == 0
        checks["every record trained exactly once (positions == end offsets)"] = saved == ends
        if serve_url is not None:
            sst = _wait_serving_version(serve_url, int(final.split("-")[1]))
            _show_serving(sst)
            checks["serving followed the restarted trainer"] = True
        return 0 if checks and all(checks.values()) else 1
    except Exception as exc:  # the demo reports, then cleans up
        _say(f"FAILED: {type(exc).__name__}: {exc}")
        return 1
    finally:
        _stop_all(procs)
        broker.stop(timeout=60)
        for name, ok in checks.items():
            _say(f"{'ok  ' if ok else 'FAIL'} {name}")
        ok = bool(checks) and all(checks.values())
        _say(f"everything stopped; logs in {work}. Demo {'succeeded' if ok else 'FAILED'}.")


if __name__ == "__main__":
    sys.exit(main())
