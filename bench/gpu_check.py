"""The GPU check in one go: CUDA tests and CUDA throughput, one JSON out.

A GPU machine is at hand rarely and briefly, so everything that needs one runs from this one
command, each step in a subprocess with its own time limit inside a shared budget (a step that
would not fit is skipped and says so), and the figures come back as one JSON:

* ``environment``: torch, CUDA, fbgemm-gpu and torchrec versions, the GPU, its memory, cores;
* ``cuda_tests``: ``tests/test_cuda_path.py`` (device choice, CPU/CUDA agreement of the step,
  checkpoints across devices, Adam tables, the online loop exactly once, in-batch learning,
  dynamic tables, two NCCL ranks as one process where the host has two GPUs) and the
  publisher's end-to-end test on CUDA; each test's outcome and seconds;
* ``throughput``: ``bench/train_throughput.py --device cuda`` for the DeepFM sample (online /
  TorchRec / plain PyTorch, ``--rounds`` rounds), then one round for every other model class
  while the budget lasts.

``odl-serve`` runs on the CPU (it has no device option), so it is not part of the check. Two
ranks cannot share one GPU (TorchRec places local rank r's table shards on ``cuda:r``; odl
refuses more ranks than GPUs), so the rank test needs a host with two.

    make gpu-check                     # installs fbgemm-gpu matching torch, then runs this
    python bench/gpu_check.py [--budget 480] [--rounds 3] [--json gpu_check.json]

The machine needs a CUDA build of torch and the ``fbgemm-gpu`` built for that torch and CUDA
(docs/training.md#gpu); ``--no-deps`` installs of torchrec and the project's other pins.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("DeepFM", "WideAndDeep", "FM", "MultiTower", "MultiTowerDIN", "DCN", "DCNV2",
          "MMoE", "DBMTL", "RankModel")
HEADLINE = ("samples_per_sec", "online_over_torchrec", "online_over_plain")
CUDA_TESTS = ["tests/test_cuda_path.py",
              "tests/test_publisher.py::test_trainer_publishes_versions_equal_to_checkpoints[cuda]"]


def environment() -> dict:
    """Versions and the device, read in a child so a broken install is reported, not fatal."""
    code = (
        "import json, os, torch\n"
        "out = {'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "       'cuda_available': torch.cuda.is_available(), 'cpus': os.cpu_count()}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    out.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),\n"
        "               gpus=torch.cuda.device_count(), capability=list(p.major_minor)\n"
        "               if hasattr(p, 'major_minor') else [p.major, p.minor])\n"
        "for mod in ('fbgemm_gpu', 'torchrec'):\n"
        "    try:\n"
        "        m = __import__(mod)\n"
        "        out[mod] = getattr(m, '__version__', '?')\n"
        "        out[mod + '_variant'] = getattr(m, '__variant__', '')\n"
        "    except Exception as e:\n"
        "        out[mod] = 'import failed: ' + repr(e)[:300]\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_step(cmd: list[str], limit: float) -> tuple[int, float, str]:
    """Runs ``cmd`` from the repository root for at most ``limit`` seconds.

    The step runs in a process group of its own, killed whole when the step ends: a process it
    left behind (a spawned rank still waiting for a peer that failed) must neither outlive the
    step nor hold its output open.

    Returns:
        ``(exit code or 124 on timeout, seconds, the last 3,000 characters of its output)``.
    """
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            code = 124
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.seek(0)
        out = log.read().decode(errors="replace")
    return code, round(time.monotonic() - t0, 1), out[-3000:]


def junit_outcomes(path: str) -> dict[str, dict]:
    """Each test of a JUnit XML report: ``{"outcome": passed|failed|skipped, "s": seconds}``."""
    if not os.path.exists(path):
        return {}
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                out.setdefault("_failures", {})[name] = (child.get("message") or "")[:500]
            elif child.tag == "skipped":
                outcome = "skipped"
        out[name] = {"outcome": outcome, "s": round(float(case.get("time", 0)), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all steps")
    ap.add_argument("--rounds", type=int, default=3, help="DeepFM throughput rounds")
    ap.add_argument("--num-workers", type=int, default=4,
                    help="feature build workers of the online trainer (the CUDA default)")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out: "
                    "cuda_tests, throughput, models")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    end = time.monotonic() + args.budget
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment()}
    print(json.dumps({"environment": result["environment"]}), flush=True)
    work = tempfile.mkdtemp(prefix="odl-gpu-check-")

    def left() -> float:
        return end - time.monotonic()

    if "cuda_tests" not in skip:
        xml = os.path.join(work, "cuda_tests.xml")
        code, secs, tail = run_step(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
             f"--junitxml={xml}", *CUDA_TESTS], min(240.0, left() - 30))
        tests = junit_outcomes(xml)
        result["cuda_tests"] = {"exit": code, "s": secs, "tests": tests,
                                "tail": tail if code else tail[-400:]}
        print(json.dumps({"cuda_tests": {"exit": code, "s": secs}}), flush=True)

    if "throughput" not in skip and left() > 60:
        out = os.path.join(work, "deepfm.json")
        code, secs, tail = run_step(
            [sys.executable, "bench/train_throughput.py", "--device", "cuda", "--model",
             "DeepFM", "--rounds", str(args.rounds), "--num-workers", str(args.num_workers),
             "--json", out], min(200.0, left() - 10))
        fig = json.load(open(out)) if os.path.exists(out) else {}
        result["throughput"] = {"DeepFM": {"exit": code, "s": secs, "figures": fig,
                                           **({"tail": tail} if code else {})}}
        print(json.dumps({"DeepFM": {k: fig[k] for k in HEADLINE if k in fig} or tail[-800:]}),
              flush=True)

    if "models" not in skip and "throughput" in result:
        for model in MODELS[1:]:
            if left() < 45:
                result["throughput"][model] = {"skipped": "budget spent"}
                continue
            out = os.path.join(work, f"{model}.json")
            code, secs, tail = run_step(
                [sys.executable, "bench/train_throughput.py", "--device", "cuda", "--model",
                 model, "--rounds", "1", "--batches", "60", "--num-workers",
                 str(args.num_workers), "--json", out], min(90.0, left() - 5))
            fig = json.load(open(out)) if os.path.exists(out) else {}
            result["throughput"][model] = {"exit": code, "s": secs, "figures": fig,
                                           **({"tail": tail[-1500:]} if code else {})}
            print(json.dumps({model: {k: fig[k] for k in HEADLINE if k in fig} or tail[-400:]}),
                  flush=True)

    result["seconds"] = round(args.budget - left(), 1)
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
