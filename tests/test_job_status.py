"""Rank 0's API describes the whole job of several ranks (``odl.train.job_status``).

* The reporting channel itself: a rank's reports reach rank 0's view; a rank that stops
  reporting is shown not answering after the staleness limit.
* For real: ``odl-train --nproc 2`` on a file stream: rank 0's ``/status`` counts every
  record over the ranks and each rank's ``source`` says which split it reads.

On Kafka (4 partitions, a rank stopped with SIGSTOP and resumed) and DataHub:
``tests/test_distributed_online.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch.distributed as dist

from odl.harness.http_client import get_json
from odl.harness.topic_records import make_records
from odl.train.job_status import JobStatusChannel
from odl.train.trainer_status import STATUS_FILE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(cond, what: str, secs: float, proc: subprocess.Popen | None = None,
              log_path=None):  # noqa: ANN001, ANN201
    """Polls ``cond`` until it returns something true; fails after ``secs`` seconds."""
    deadline = time.monotonic() + secs
    while True:
        got = cond()
        if got:
            return got
        if proc is not None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, (what, log_path.read_text()[-3000:]
                                             if log_path is not None else "")
        time.sleep(0.1)


def test_reports_reach_rank_0_and_a_silent_rank_is_not_answering() -> None:
    store = dist.HashStore()
    step = {"n": 0}
    rank1 = JobStatusChannel(1, 2, lambda: {"global_step": step["n"]}, store=store,
                             interval_s=0.05, stale_after_s=0.5)
    rank0 = JobStatusChannel(0, 2, lambda: {"global_step": 0}, store=store,
                             interval_s=0.05, stale_after_s=0.5)
    assert rank1.others() == []  # only rank 0 keeps the others' reports
    rank0.start()
    try:
        # nothing from rank 1 yet: not known, still answering while the limit has not passed
        (view,) = rank0.others()
        assert view.report is None and view.answering
        rank1.start()
        step["n"] = 7
        _wait_for(lambda: (rank0.others()[0].report or {}).get("global_step") == 7,
                  "rank 1's report", 5)
        assert rank0.others()[0].answering
        rank1.stop()  # no report after its last one: it ages
        view = _wait_for(lambda: next((v for v in rank0.others() if not v.answering), None),
                         "rank 1 not answering", 5)
        assert view.rank == 1 and view.age_s > 0.5 and view.report["global_step"] == 7
    finally:
        rank0.stop()
        rank1.stop()


def _metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _healthz(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_two_ranks_on_a_file_stream_report_the_split_each_reads(tmp_path):
    """A file stream (``file_stream_input``) under ``odl-train --nproc 2``, waiting for the
    next split after two: rank 0's ``/status`` counts every record over the ranks, and each
    rank's ``source`` says it waits at the same split, having read two. The run's output at
    ``--log_level WARNING`` is empty."""
    from tests.test_file_stream import _config as stream_config
    from tests.test_file_stream import _write_split

    data = tmp_path / "data"
    ids, values = make_records(400, seed=43)
    _write_split(data, "20261124", "0000", [values[:200]])
    _write_split(data, "20261124", "0100", [values[200:300], values[300:]])
    cfg = tmp_path / "stream.config"
    cfg.write_text(stream_config(tmp_path, str(data), "20261126").replace(
        "missing_split_wait_secs: 0", "missing_split_wait_secs: 3600"))
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", str(cfg),
             "--online", "--device", "cpu", "--nproc", "2", "--status_port", "0",
             "--log_level", "WARNING"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            status_file = tmp_path / "model_dir" / STATUS_FILE
            url = _wait_for(lambda: status_file.exists() and json.loads(
                status_file.read_text())["url"], "status.json", 120, proc, log_path)

            def waiting_after_both() -> dict | None:
                st = get_json(url + "/status") or {}
                return st if st.get("samples_trained") == len(ids) and all(
                    (r["source"] or {}).get("waiting") for r in st["ranks"]) else None

            status = _wait_for(waiting_after_both, "both splits trained", 120, proc, log_path)
            sources = [r["source"] for r in status["ranks"]]
            assert [(s["split"], s["splits_read"]) for s in sources] == [
                ("20261124/0200", 2)] * 2
            assert all(r["samples_trained"] == len(ids) // 2 for r in status["ranks"])
            assert _healthz(url)[0] == 200
            for rank in psutil.Process(proc.pid).children(recursive=True):
                if rank.pid in [r["pid"] for r in status["ranks"]]:
                    rank.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, log_path.read_text()[-3000:]
            # at WARNING a clean run says nothing: no launcher banner, no library warnings
            assert log_path.read_text() == ""
        finally:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait(30)
