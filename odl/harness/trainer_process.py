"""Real ``odl-train`` processes: start one, find its status API, wait until it caught up.

A trainer started with ``--status_port 0`` writes ``status.json`` (host, port, pid, url) into
its model dir once its status API listens; the helpers here find it there and only trust a
file written by the process they started.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from odl.harness.http_client import get_json
from odl.storage.file_store import cache_dir_for

logger = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_STATUS_FILE = "status.json"  # written by the trainer once its status API listens


def train_command(config_path: str, *extra: str) -> list[str]:
    """The ``odl-train --online`` command line the harness runs (CPU, status API on port 0).

    Args:
        config_path: the pipeline config.
        *extra: more arguments (e.g. ``--sample_ledger PATH``).

    Returns:
        The argument vector.
    """
    return [sys.executable, "-m", "odl.cli.train_cli", "--pipeline_config_path", config_path,
            "--online", "--device", "cpu", "--status_port", "0", *extra]


def start_cli_trainer(config_path: str, log_path: str, *extra: str,
                      env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Starts ``odl-train --online`` as a subprocess.

    Args:
        config_path: the pipeline config.
        log_path: its output goes here (appended).
        *extra: more arguments.
        env: its environment (default: this process's).

    Returns:
        The process.
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(train_command(config_path, *extra), stdout=log,
                                stderr=subprocess.STDOUT, cwd=_REPO_ROOT, env=env)
    logger.debug("started odl-train pid %d (log %s)", proc.pid, log_path)
    return proc


def trainer_url(model_dir: str, pid: Optional[int] = None) -> Optional[str]:
    """The status API URL a trainer wrote into its model dir.

    Args:
        model_dir: the trainer's model dir.
        pid: only trust a ``status.json`` written by this process.

    Returns:
        The URL, or None while there is none (or only an older process's).
    """
    try:
        # a trainer of an oss:// model_dir writes status.json into the local mirror
        with open(os.path.join(cache_dir_for(model_dir), _STATUS_FILE)) as f:
            doc = json.load(f)
        if pid is not None and doc.get("pid") != pid:
            return None
        return str(doc["url"])
    except (OSError, ValueError, KeyError):
        return None


def trainer_json(model_dir: str, path: str, pid: Optional[int] = None,
                 timeout: float = 5.0) -> Optional[Any]:
    """GETs one of a trainer's endpoints (``/status``, ``/offsets``).

    Args:
        model_dir: the trainer's model dir.
        path: the endpoint.
        pid: only ask the process with this pid.
        timeout: socket timeout in seconds.

    Returns:
        The JSON document, or None while the trainer is not up.
    """
    url = trainer_url(model_dir, pid)
    return None if url is None else get_json(url + path, timeout=timeout)


def wait_cli_caught_up(proc: subprocess.Popen, model_dir: str, ends: dict[int, int],
                       timeout: float = 180.0) -> dict:
    """Waits until a trainer's positions reach ``ends``.

    Args:
        proc: the trainer process.
        model_dir: its model dir.
        ends: partition -> offset to reach (e.g. the topic's end offsets).
        timeout: seconds.

    Returns:
        The trainer's ``/offsets`` document at that moment.

    Raises:
        RuntimeError: the trainer exited.
        TimeoutError: it did not catch up in time.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited early with {proc.returncode}")
        offsets = trainer_json(model_dir, "/offsets", pid=proc.pid)
        if offsets is not None:
            pos = {int(k): v for k, v in offsets["positions"].items()}
            if pos and all(pos.get(p, 0) >= e for p, e in ends.items()):
                return offsets
        time.sleep(0.3)
    raise TimeoutError(f"trainer did not catch up with {ends}")
