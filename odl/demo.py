"""``make demo``: the whole online loop on this machine, for about a minute.

Starts the embedded broker, streams synthetic CTR samples with ``odl-datagen``, trains a
TorchRec DeepFM on them with ``odl-train --online`` (samples/deepfm_online.config), prints the
trainer's ``/status`` along the way, stops the trainer with ``OSS_STOP_SIGNAL``, restarts it to
show it continuing exactly where it stopped, and shuts everything down. Everything lives under
``.odl/demo`` (removed at the start of each run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from typing import Optional

from odl.broker.embedded_broker import EmbeddedBroker
from odl.broker.topic_admin import create_topic, end_offsets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "samples", "deepfm_online.config")
TOPIC = "odl_samples"


def _status(model_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(model_dir, "status.json")) as f:
            url = json.load(f)["url"]
        with urllib.request.urlopen(url + "/status", timeout=2) as r:
            return json.load(r)
    except (OSError, ValueError, KeyError):
        return None


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _show(st: dict) -> None:
    prog = st.get("progressive", {})
    lag = {p: v.get("lag") for p, v in st.get("input", {}).get("partitions", {}).items()}
    _say(
        f"state={st['state']} step={st['global_step']} samples={st['samples_trained']} "
        f"rate={st['samples_per_sec']}/s auc={prog.get('auc')} logloss={prog.get('logloss')} "
        f"lag={lag} last_ckpt={st['last_checkpoint']['step']}"
    )


def _start_trainer(bootstrap: str, model_dir: str, log) -> subprocess.Popen:
    edits = json.dumps({"kafka_train_input.server": bootstrap, "model_dir": model_dir})
    cmd = [
        sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", CONFIG,
        "--online", "--edit_config_json", edits, "--status_port", "0",
    ]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait_status(model_dir: str, proc: subprocess.Popen, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited with {proc.returncode}; see its log")
        st = _status(model_dir)
        if st is not None:
            return st
        time.sleep(0.5)
    raise TimeoutError("trainer status API did not come up")


def _stop_with_signal(model_dir: str, proc: subprocess.Popen) -> int:
    _say("writing OSS_STOP_SIGNAL into model_dir")
    open(os.path.join(model_dir, "OSS_STOP_SIGNAL"), "w").close()
    return proc.wait(timeout=120)


def main(argv: Optional[list[str]] = None) -> int:
    """Runs the demo; returns 0 when every step worked."""
    ap = argparse.ArgumentParser(prog="odl-demo")
    ap.add_argument("--seconds", type=float, default=60.0, help="first training run length")
    ap.add_argument("--rate", type=int, default=3000, help="datagen samples/s")
    args = ap.parse_args(argv)

    work = os.path.join(ROOT, ".odl", "demo")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model_dir = os.path.join(work, "model_dir")
    broker = EmbeddedBroker(port=0, data_dir=os.path.join(work, "kafka"))
    procs: list[subprocess.Popen] = []
    ok = False
    try:
        broker.start()
        _say(f"embedded broker up at {broker.bootstrap} (pid {broker.pid})")
        create_topic(broker.bootstrap, TOPIC, partitions=4)
        gen_log = open(os.path.join(work, "datagen.log"), "w")
        gen = subprocess.Popen(
            [sys.executable, "-m", "odl.cli.datagen_cli", "--bootstrap", broker.bootstrap,
             "--topic", TOPIC, "--partitions", "4", "--rate", str(args.rate),
             "--seconds", str(args.seconds + 20), "--seed", "7"],
            stdout=subprocess.PIPE, stderr=gen_log, cwd=ROOT, text=True,
        )
        procs.append(gen)
        _say(f"odl-datagen streaming {args.rate} samples/s into topic {TOPIC}")
        train_log = open(os.path.join(work, "trainer.log"), "w")
        trainer = _start_trainer(broker.bootstrap, model_dir, train_log)
        procs.append(trainer)
        st = _wait_status(model_dir, trainer)
        _say(f"odl-train --online is up; status API at {json.load(open(os.path.join(model_dir, 'status.json')))['url']}")
        t_end = time.time() + args.seconds
        while time.time() < t_end:
            time.sleep(10)
            st = _status(model_dir)
            if st:
                _show(st)
        rc = _stop_with_signal(model_dir, trainer)
        _say(f"trainer stopped with exit code {rc}")
        if rc != 0:
            return 1
        ckpts = sorted(d for d in os.listdir(model_dir) if d.startswith("model.ckpt-"))
        last = max(ckpts, key=lambda d: int(d.split("-")[1]))
        with open(os.path.join(model_dir, last, "positions.json")) as f:
            saved = json.load(f)["positions"]
        _say(f"checkpoints: {ckpts}; {last} covers positions {saved}")

        _say("restarting the trainer: it restores the checkpoint and continues from those positions")
        trainer = _start_trainer(broker.bootstrap, model_dir, train_log)
        procs.append(trainer)
        st = _wait_status(model_dir, trainer)
        time.sleep(15)
        st = _status(model_dir) or st
        _show(st)
        gen.terminate()
        out, _ = gen.communicate(timeout=30)
        summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        _say(f"odl-datagen produced {summary.get('produced')} samples, oracle AUC {summary.get('oracle_auc')}")
        # let the trainer catch up with the end of the stream, then stop it
        ends = end_offsets(broker.bootstrap, TOPIC)
        _say(f"waiting for the trainer to reach the end of the stream {ends}")
        deadline = time.time() + 300
        next_show = time.time() + 10
        while time.time() < deadline:
            st = _status(model_dir)
            parts = (st or {}).get("input", {}).get("partitions", {})
            if parts and all(parts[str(p)]["position"] >= e for p, e in ends.items()):
                break
            if st and time.time() >= next_show:
                _show(st)
                next_show = time.time() + 10
            time.sleep(1)
        rc = _stop_with_signal(model_dir, trainer)
        ckpts = sorted((d for d in os.listdir(model_dir) if d.startswith("model.ckpt-")),
                       key=lambda d: int(d.split("-")[1]))
        with open(os.path.join(model_dir, ckpts[-1], "positions.json")) as f:
            saved = {int(k): v for k, v in json.load(f)["positions"].items()}
        _say(f"trainer stopped with exit code {rc}; final checkpoint {ckpts[-1]}")
        _say(f"checkpoint positions {saved} == broker end offsets {ends}: {saved == ends}")
        ok = rc == 0 and saved == ends
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        broker.stop(timeout=60)
        _say(f"broker stopped; logs in {work}. Demo {'succeeded' if ok else 'FAILED'}.")


if __name__ == "__main__":
    sys.exit(main())
