"""The job seen from rank 0: every rank's report, gathered beside the step, merged for the API.

A trainer of several ranks (``torchrun``, ``odl-train --nproc N``) is one job, and rank 0's
``/status``, ``/offsets``, ``/healthz``, ``/metrics`` and dashboard describe all of it
(:mod:`odl.train.trainer_status` merges what this module gathers).

The side channel: the process group's key-value store (torchrun's rendezvous store, a
``TCPStore``; with ``odl-train --nproc`` the launcher's). Every rank's
:class:`JobStatusChannel` thread of every rank but 0 writes the rank's report under
``odl/job_status/rank_<r>`` every ``REPORT_INTERVAL_S`` seconds; rank 0's reads them (its own
report is built live for each request). Nothing of it
runs in the training step or in its collectives, so a rank stuck in a collective (a peer
stopped) still reports, and a rank that stops answering is seen by rank 0 whatever its loop
is doing. ``bench/scaling.py --job-status`` measures what the thread costs the step.

A report (:meth:`odl.train.trainer_status.TrainerStatus.rank_report`)::

    {"rank": 1, "host": "node-2", "pid": 4242, "seq": 17, "state": "training",
     "healthy": true, "reason": "training", "global_step": 120,
     "samples_trained": 4000, "samples_per_sec": 812.5, "records_consumed": 4000,
     "records_rejected": {"bad_label": 2}, "last_exchange_age_s": 0.01,
     "input": {"broker_error": null,
               "partitions": {"1": {"position": 2000, "high_watermark": 2000,
                                    "low_watermark": 0, "lag": 0, "rank": 1}},
               "source": {}}}

Ages are measured on rank 0's clock, not compared between hosts: a report's age is the time
since rank 0 first saw its ``seq``. A rank whose report is older than ``STALE_AFTER_S``
seconds, or that has written none that long after rank 0's channel started, is not
answering (a stopped, hung or dead process, or a host cut off): the job is unhealthy, and
its partitions' positions in ``/offsets`` are the last it reported (``stale_ranks`` names
it). Positions of the other ranks are at most one report interval old.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["REPORT_INTERVAL_S", "STALE_AFTER_S", "JobStatusChannel", "RankView"]

REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
_KEY_PREFIX = "odl/job_status"


@dataclass
class RankView:
    """What rank 0 knows of one rank.

    Attributes:
        rank: the rank.
        report: its last report (None: none yet).
        age_s: seconds since rank 0 saw that report first (since the channel started when
            there is none).
        answering: False once ``age_s`` exceeds ``STALE_AFTER_S``.
    """

    rank: int
    report: Optional[dict]
    age_s: float
    answering: bool


class JobStatusChannel:
    """A rank's reporting thread; on rank 0 the thread reads the other ranks' reports instead.

    Args:
        rank: this rank.
        world_size: ranks in the job.
        report: builds this rank's report (called on the channel's thread).
        store: the key-value store all ranks share (default: the process group's).
        interval_s: seconds between two reports.
        stale_after_s: a report older than this: the rank is not answering.
    """

    def __init__(self, rank: int, world_size: int, report: Callable[[], dict],
                 store: Optional[dist.Store] = None, interval_s: float = REPORT_INTERVAL_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.rank = rank
        self.world_size = world_size
        self._report = report
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(_KEY_PREFIX, base)
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._seq = 0
        self._lock = threading.Lock()
        self._reports: dict[int, dict] = {}
        self._seen_at: dict[int, float] = {}  # rank -> monotonic time its seq changed
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.last_error: Optional[str] = None

    def start(self) -> JobStatusChannel:
        """Starts the thread (the first report is written at once)."""
        self._thread = threading.Thread(target=self._run, name="job-status", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Writes a last report (the rank's final state) and ends the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)
            self._thread = None
        if self.rank != 0:
            self._publish()

    def _run(self) -> None:
        while True:
            if self.rank == 0:  # rank 0 reads the others; its own report is read live
                self._collect()
            else:
                self._publish()
            if self._stop.wait(self.interval_s):
                return

    def _publish(self) -> None:
        try:
            report = self._report()
            self._seq += 1
            report["seq"] = self._seq
            self._store.set(f"rank_{self.rank}", json.dumps(report))
            self.last_error = None
        except Exception as exc:  # a store gone at teardown, a report that failed: next time
            if self.last_error is None:
                logger.debug("rank %d: job status report not written: %s", self.rank, exc)
            self.last_error = str(exc)

    def _collect(self) -> None:
        now = time.monotonic()
        for r in range(1, self.world_size):
            key = f"rank_{r}"
            try:
                if not self._store.check([key]):
                    continue
                report = json.loads(self._store.get(key))
            except Exception as exc:  # the store unreachable: the reports age
                logger.debug("job status of rank %d not read: %s", r, exc)
                return
            with self._lock:
                before = self._reports.get(r)
                if before is None or before.get("seq") != report.get("seq"):
                    self._seen_at[r] = now
                self._reports[r] = report

    def others(self) -> list[RankView]:
        """Every other rank as rank 0 last saw it, in rank order (empty off rank 0)."""
        if self.rank != 0:
            return []
        now = time.monotonic()
        out = []
        with self._lock:
            for r in range(1, self.world_size):
                # rounded first, so a rank not answering always shows an age past the limit
                age = round(now - self._seen_at.get(r, self._started), 3)
                out.append(RankView(r, self._reports.get(r), age, age <= self.stale_after_s))
        return out
