"""Kill -9 at random moments: ``TrainerKiller`` starts ``odl-train`` again and again.

Each start runs the same command (``odl.harness.trainer_process.train_command`` with a
``--sample_ledger``); a kill is aimed at start-up (restore, recovery), at training, or at a
checkpoint write (as soon as a checkpoint's temporary directory appears). ``finish`` starts
it once more and stops it cleanly once it has read everything. The ledger and the delta topic
then go to the exactly-once audit (``odl.harness.exactly_once_audit``).
"""

from __future__ import annotations

import glob
import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Optional

from odl.harness.trainer_process import start_cli_trainer, trainer_json
from odl.storage.file_store import cache_dir_for

logger = logging.getLogger(__name__)

_CHECKPOINT_TMP = ".model.ckpt-*.tmp-*"  # a checkpoint being written


class TrainerKiller:
    """Starts ``odl-train`` with the same command again and again and SIGKILLs it.

    Args:
        config_path: the pipeline config.
        model_dir: its model_dir (status.json, checkpoints).
        log_path: trainer output (appended).
        ledger: ``--sample_ledger`` path.
        rng: random source of the kill delays.
        startup_kill_fraction: share of kills aimed before training starts (restore, recovery).

    Attributes:
        kills: one dict per kill: ``delay`` after training started (or after start),
            ``phase`` ("startup", "training", "checkpoint"), ``step`` last seen.
        recovery_seconds: per start that reached training, start -> state ``training``.
        recoveries: per start that reached training, its ``/status`` ``recovery`` document
            plus ``uptime_s``.
    """

    def __init__(self, config_path: str, model_dir: str, log_path: str, ledger: str,
                 rng: random.Random, startup_kill_fraction: float = 0.2) -> None:
        self.config_path = config_path
        self.ledger = ledger
        self.model_dir = model_dir
        self.log_path = log_path
        self.rng = rng
        self.startup_kill_fraction = startup_kill_fraction
        self.kills: list[dict] = []
        self.recovery_seconds: list[float] = []
        self.recoveries: list[dict] = []
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> float:
        self.proc = start_cli_trainer(self.config_path, self.log_path,
                                      "--sample_ledger", self.ledger)
        return time.monotonic()

    def _status(self) -> Optional[dict]:
        assert self.proc is not None
        return trainer_json(self.model_dir, "/status", pid=self.proc.pid, timeout=2)

    def _checkpoint_being_written(self) -> bool:
        # an oss:// model_dir's checkpoints are written in its local mirror first
        return bool(glob.glob(os.path.join(cache_dir_for(self.model_dir), _CHECKPOINT_TMP)))

    def _wait_training(self, t0: float, timeout: float = 120.0) -> dict:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            st = self._status()
            if st is not None and st.get("state") == "training":
                self.recovery_seconds.append(round(time.monotonic() - t0, 3))
                rec = dict(st.get("recovery") or {})
                rec["uptime_s"] = st.get("uptime_s")  # since the Trainer was constructed
                self.recoveries.append(rec)
                return st
            time.sleep(0.05)
        raise TimeoutError("trainer did not reach state 'training'")

    def _kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def start_and_kill(self, max_delay: float = 3.0, startup_max: float = 8.0,
                       aim: Optional[str] = None,
                       when: Optional[Callable[[], bool]] = None) -> dict:
        """One start, then SIGKILL at a random moment.

        Args:
            max_delay: kill within this many seconds after training started.
            startup_max: a startup kill comes this many seconds after the start at most.
            aim: ``"startup"``, ``"training"``, ``"checkpoint"`` (kill as soon as a
                checkpoint is being written, within ``max_delay`` of training + 10 s) or
                ``"when"`` (kill as soon as ``when()`` is true, within ``max_delay`` of
                training + 30 s; the phase is ``"when"`` if it was); None = startup with
                probability ``startup_kill_fraction``, else training.
            when: the condition of ``aim="when"`` (e.g. an upload in flight).

        Returns:
            The kill's record (also appended to ``kills``).
        """
        t0 = self._start()
        if aim is None:
            aim = "startup" if self.rng.random() < self.startup_kill_fraction else "training"
        step = None
        hit = False
        if aim == "when":
            assert when is not None, "aim='when' needs when="
            self._wait_training(t0)
            delay = self.rng.uniform(0.0, max_delay)
            time.sleep(delay)
            end = time.monotonic() + 30.0
            while time.monotonic() < end and not hit:
                hit = when()
                if not hit:
                    time.sleep(0.002)
            phase = "training"
        elif aim == "checkpoint":
            self._wait_training(t0)
            delay = self.rng.uniform(0.0, max_delay)
            time.sleep(delay)
            end = time.monotonic() + 10.0
            while time.monotonic() < end and not self._checkpoint_being_written():
                time.sleep(0.002)
            phase = "training"
        elif aim == "startup":
            delay = self.rng.uniform(0.5, startup_max)
            end = t0 + delay
            trained = False
            while time.monotonic() < end:
                st = self._status()
                if st is not None and st.get("state") == "training":
                    trained = True
                    break
                time.sleep(0.02)
            if trained:  # started faster than the delay: kill it while training instead
                self.recovery_seconds.append(round(time.monotonic() - t0, 3))
                time.sleep(max(0.0, end - time.monotonic()))
            phase = "training" if trained else "startup"
        else:
            self._wait_training(t0)
            delay = self.rng.uniform(0.0, max_delay)
            time.sleep(delay)
            step = (self._status() or {}).get("global_step")
            phase = "training"
        self._kill()
        if hit:
            phase = "when"
        elif self._checkpoint_being_written():
            phase = "checkpoint"
        rec = {"delay": round(delay, 3), "phase": phase, "step": step}
        self.kills.append(rec)
        logger.debug("killed odl-train: %s", rec)
        return rec

    def finish(self, ends: dict[int, int], timeout: float = 180.0) -> dict:
        """Starts once more, waits until the trainer has read up to ``ends``, stops it cleanly.

        Args:
            ends: partition -> offset to reach.
            timeout: seconds to catch up in.

        Returns:
            The trainer's last ``/status`` document.

        Raises:
            TimeoutError: it did not catch up in time.
            RuntimeError: the clean stop did not exit 0.
        """
        t0 = self._start()
        self._wait_training(t0)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            st = self._status()
            parts = (st or {}).get("input", {}).get("partitions", {})
            if parts and all(parts.get(str(p), {}).get("position", -1) >= e
                             for p, e in ends.items()):
                break
            time.sleep(0.2)
        else:
            raise TimeoutError(f"trainer did not catch up with {ends}")
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(90)
        if rc != 0:
            raise RuntimeError(f"clean stop exited with {rc}; see {self.log_path}")
        return st or {}

    def cleanup(self) -> None:
        """Kills a trainer still running (failure paths)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
