"""What the trainer reports about itself: ``/status``, ``/offsets``, ``/healthz``, progress lines.

:class:`TrainerStatus` builds the documents the status API (:mod:`odl.train.status_app`)
serves and, every ``log_step_count_steps``, the progress log line and the Prometheus gauges
(rate, progressive AUC / logloss, lag and position per partition).

The progressive metrics rank up to ``metrics_window_samples`` predictions; ``/status``
reuses the last summary while it is under ``_PROGRESS_CACHE_SECS`` old or no sample was added.

Health (``/healthz``): unhealthy while the input's or the delta topic's broker is unreachable,
while publishing or checkpoints fail, and once stopped; the reason is the first that applies.
An input at risk of losing records to retention (``input.retention.state`` ``behind`` or
``losing``, :mod:`odl.inputs.retention_risk`) stays healthy, since a restart would only make
it fall further behind, and the reason carries the warning (``training; behind: partition 0
will lose data in ~40 s ...``). ``/healthz`` and ``/metrics`` refresh the retention gauges
(a trainer held in a long step logs no progress, yet its input keeps reporting).

Retention in ``/status``: ``input.retention`` is the input's summary (the worst partition's
state, the fewest seconds to loss and least headroom of any partition, records lost, the
topic's limits, ``warning``: the text ``/healthz`` adds, None while ok; None for files,
DataHub and file streams), and each ``input.partitions[p].retention`` that partition's
figures.

Several ranks (:mod:`odl.train.job_status`): rank 0's documents describe the job. Every rank
writes a report (:meth:`TrainerStatus.rank_report`) beside its loop; rank 0 merges them:

- ``input.partitions``: every rank's partitions (shards, splits), each with ``rank``, the rank
  that reads it; positions of other ranks as last reported (at most a second old).
- ``samples_trained``, ``samples_per_sec``, ``records_consumed``, ``records_rejected``: sums
  over the ranks (rank 0's own figures are in ``ranks[0]``).
- ``world_size``, and ``ranks``: per rank its host, pid, state, health and reason, step,
  samples, rate, rejects, partitions, ``last_exchange_age_s`` (seconds since its loop last
  exchanged a turn with the others: all ranks' grow together while one is stuck),
  ``report_age_s`` and ``answering`` (False once its report is ``STALE_AFTER_S`` old), and
  ``source``, its input's own report (a file stream's split, file and record).
- ``/offsets``: every partition's position, ``partition_ranks``, and ``stale_ranks`` (ranks
  not answering: their positions are the last they reported).
- ``/healthz``: unhealthy when any rank is, or is not answering (``rank 1: <its reason>``,
  ``rank 1 has not reported for 7 s``); ``/status``'s ``job_warning`` holds that reason
  (None while every other rank answers and is healthy).
- ``/metrics``: ``odl_partition_lag`` / ``odl_partition_position`` for every partition, and
  per rank (``rank`` label) ``odl_rank_up``, ``odl_rank_samples_trained``,
  ``odl_rank_samples_per_second``, ``odl_rank_global_step``, ``odl_rank_report_age_seconds``.

One process is the job of one rank: the same fields, ``world_size`` 1 and one entry in
``ranks``.

File written by :func:`start_status_server`, ``model_dir/status.json`` (where to reach the API
of the running trainer; rewritten at every start)::

    {"host": "127.0.0.1", "port": 41234, "pid": 12345,
     "url": "http://127.0.0.1:41234", "generation": "<16 hex digits>"}

written atomically (temporary file, then rename). For an ``oss://`` model_dir it is written
to the model_dir's local mirror (``odl.storage.file_store.cache_dir_for``), where local tools
look, and to OSS (best effort: a failure is logged, training starts anyway).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Optional, Protocol

from prometheus_client import CollectorRegistry

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.http.metric_history import HistorySampler, MetricHistory
from odl.http.server import BackgroundHttpServer
from odl.inputs.dead_letter import DeadLetterSink
from odl.inputs.input_pipeline import InputPipeline
from odl.inputs.retention_risk import input_warning
from odl.inputs.source_factory import online_input_name
from odl.protos import pipeline_pb2
from odl.storage import file_store
from odl.storage.oss_store import StorageError, oss_health
from odl.storage.storage_path import is_remote, join
from odl.train.job_status import JobStatusChannel, RankView
from odl.train.pass_metrics import PassMetrics
from odl.train.pass_saves import PassSaves
from odl.train.progressive_metrics import ProgressiveMetrics, TaskMetrics
from odl.train.status_app import TrainerStatusProvider, build_status_app
from odl.train.stream_evaluation import StreamEvaluator
from odl.train.train_module import TrainModule
from odl.train.trainer_dashboard import HISTORY_INTERVAL_S, history_point
from odl.train.trainer_metrics import TrainerMetrics
from publisher.incremental_publisher import IncrementalPublisher

logger = logging.getLogger(__name__)

__all__ = ["STATUS_FILE", "TrainerStatus", "TrainerView", "start_status_server"]

STATUS_FILE = "status.json"
# /status recomputes the progressive metrics (a sort of the window) at most this often
_PROGRESS_CACHE_SECS = 1.0


class TrainerView(Protocol):
    """What the status documents read of the trainer."""

    config: pipeline_pb2.EasyRecConfig
    generation: str
    started_at: float
    state: str
    module: TrainModule
    progress: ProgressiveMetrics
    tasks: Optional[TaskMetrics]
    checkpoints: CheckpointManager
    metrics: TrainerMetrics
    samples_trained: int
    samples_per_sec: float
    last_loss: Optional[float]
    last_checkpoint_error: Optional[str]
    checkpoint_writing: bool
    last_sample_time_ms: Optional[int]
    last_exchange_at: Optional[float]
    failure: Optional[str]
    publisher: Optional[IncrementalPublisher]
    recovery: Optional[dict]
    input_pipeline: Optional[InputPipeline]
    passes: Optional[PassMetrics]
    evaluator: Optional[StreamEvaluator]
    pass_saves: Optional[PassSaves]

    @property
    def online(self) -> bool:
        """Kafka input (True) or files."""
        ...

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the trainer stops, None until then."""
        ...

    @property
    def records_rejected(self) -> dict[str, int]:
        """Rejected records by reason."""
        ...

    @property
    def dead_letter(self) -> Optional[DeadLetterSink]:
        """The dead-letter sink, when one is open."""
        ...

    def positions_snapshot(self) -> dict[int, int]:
        """A copy of the trained positions (next offset per partition)."""
        ...

    def delta_broker_error(self) -> Optional[str]:
        """Why the delta publisher's broker is unreachable, or None."""
        ...


class TrainerStatus:
    """Builds the trainer's status documents and progress reports.

    Args:
        trainer: the trainer.
    """

    def __init__(self, trainer: TrainerView) -> None:
        self._trainer = trainer
        # (monotonic time, progress.summary()): the window AUC sorts up to
        # metrics_window_samples predictions, too slow for every /status request
        self._progress_cache: Optional[tuple[float, dict]] = None
        self._tasks_cache: Optional[dict] = None
        # several ranks: the channel of every rank's report (set when the trainer starts it)
        self.job: Optional[JobStatusChannel] = None
        self._host = socket.gethostname()

    def _topic(self) -> Optional[str]:
        t = self._trainer
        return online_input_name(t.config) if t.online else None

    def document(self) -> dict:
        """The status document served at ``/status``.

        Returns:
            A JSON-serializable dict.
        """
        t = self._trainer
        src = t.input_pipeline
        retention = src.retention if src is not None else None
        partitions = self._partitions(with_retention=True)
        mine = self.rank_report()
        ranks = self._rank_views(mine)
        job = _job_totals(ranks)
        for view in ranks[1:]:
            for p, st in ((view.report or {}).get("input") or {}).get("partitions", {}).items():
                partitions.setdefault(p, {**st, "rank": view.rank})
        partitions = dict(sorted(partitions.items(), key=lambda kv: int(kv[0])))
        broker_error = src.broker_error if src is not None else None
        dead_letter = t.dead_letter
        return {
            "state": (
                "waiting_for_broker"
                if t.state == "training" and broker_error is not None
                else t.state
            ),
            "mode": "online" if t.online else "offline",
            "generation": t.generation,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - t.started_at, 3),
            "global_step": t.module.global_step,
            "world_size": len(ranks),
            "samples_trained": job["samples_trained"],
            "samples_per_sec": round(job["samples_per_sec"], 1),
            "records_consumed": job["records_consumed"],
            "records_rejected": job["records_rejected"],
            "loss": t.last_loss,
            "progressive": self.progress_summary(),
            "tasks": self.tasks_summary(),
            "last_checkpoint": {
                "path": t.checkpoints.last_saved_path,
                "step": t.checkpoints.last_saved_step,
                "time": t.checkpoints.last_saved_time,
                "error": t.last_checkpoint_error,
                "writing": t.checkpoint_writing,
                "upload_seconds": t.checkpoints.last_upload_seconds,
            },
            "oss": oss_health(),
            "input": {
                "topic": self._topic(),
                "broker_error": broker_error,
                "queued_batches": src.queued if src is not None else 0,
                "last_sample_time_ms": t.last_sample_time_ms,
                "partitions": partitions,
                "retention": ({**{k: v for k, v in retention.items() if k != "partitions"},
                               "warning": input_warning(retention)}
                              if retention is not None else None),
                "source": src.source_status if src is not None else {},
            },
            "stop_reason": t.stop_reason,
            "failure": t.failure,
            "device": str(t.module.device),
            "publisher": t.publisher.status() if t.publisher is not None else None,
            "dynamic_tables": t.module.dynamic_status() if t.module.dynamic else None,
            "wide_rate": t.module.wide_rate.status() if t.module.wide_rate is not None else None,
            "in_batch": t.module.in_batch_status(),
            "passes": t.passes.status() if t.passes is not None else None,
            "evaluation": t.evaluator.last if t.evaluator is not None else None,
            "pass_saves": t.pass_saves.status() if t.pass_saves is not None else None,
            "recovery": t.recovery,
            "dead_letter": dead_letter.status() if dead_letter is not None else None,
            "ranks": [_rank_entry(v) for v in ranks],
            # another rank unhealthy or not answering (what /healthz says then), else None
            "job_warning": _ranks_health(ranks[1:], "")[1] or None,
        }

    def _partitions(self, with_retention: bool = False) -> dict[str, dict]:
        """This rank's partitions: position, watermarks, lag, its rank (and retention)."""
        t = self._trainer
        src = t.input_pipeline
        if src is None:
            return {}
        retention = src.retention if with_retention else None
        risks = (retention or {}).get("partitions") or {}
        positions = t.positions_snapshot()
        out = {}
        for p, st in sorted(src.partition_state.items()):
            pos = positions.get(p, st.position)
            out[str(p)] = {
                "position": pos,
                "high_watermark": st.high_watermark,
                "low_watermark": st.low_watermark,
                "lag": max(0, st.high_watermark - pos) if st.high_watermark >= 0 else None,
                "rank": t.module.rank,
            }
            if retention is not None:
                out[str(p)]["retention"] = risks.get(str(p))
        return out

    def rank_report(self) -> dict:
        """This rank's report to rank 0 (:mod:`odl.train.job_status`)."""
        t = self._trainer
        src = t.input_pipeline
        ok, reason = self._health(t.delta_broker_error())
        exchanged = t.last_exchange_at
        return {
            "rank": t.module.rank,
            "host": self._host,
            "pid": os.getpid(),
            "state": t.state,
            "healthy": ok,
            "reason": reason,
            "global_step": t.module.global_step,
            "samples_trained": t.samples_trained,
            "samples_per_sec": round(t.samples_per_sec, 1),
            # offline, the file reader runs ahead of training: report what was trained
            "records_consumed": (src.records_consumed if src is not None and t.online
                                 else t.samples_trained),
            "records_rejected": dict(t.records_rejected),
            "last_exchange_age_s": (round(time.monotonic() - exchanged, 3)
                                    if exchanged is not None else None),
            "input": {"broker_error": src.broker_error if src is not None else None,
                      "partitions": self._partitions(),
                      "source": src.source_status if src is not None else {}},
        }

    def _rank_views(self, mine: dict) -> list[RankView]:
        """Every rank, rank 0 (this one's live report) first."""
        return [RankView(self._trainer.module.rank, mine, 0.0, True),
                *(self.job.others() if self.job is not None else [])]

    def progress_summary(self) -> dict:
        """Progressive metrics, recomputed when samples were added and the last is over 1 s old.

        Returns:
            ``ProgressiveMetrics.summary()``.
        """
        progress = self._trainer.progress
        cached = self._progress_cache
        if cached is None or (cached[1]["samples"] != progress.samples
                              and time.monotonic() - cached[0] > _PROGRESS_CACHE_SECS):
            cached = (time.monotonic(), progress.summary())
            self._progress_cache = cached
        return cached[1]

    def tasks_summary(self) -> Optional[dict]:
        """Per-task progressive metrics of a multi-task model (None for one output).

        Recomputed with :meth:`progress_summary` (same cache rule).

        Returns:
            Task name -> ``ProgressiveMetrics.summary()``.
        """
        tasks = self._trainer.tasks
        if tasks is None:
            return None
        before = self._progress_cache
        self.progress_summary()
        if self._tasks_cache is None or self._progress_cache is not before:
            self._tasks_cache = tasks.summary()
        return self._tasks_cache

    def offsets(self) -> dict:
        """Trained positions served at ``/offsets``.

        Returns:
            ``{"topic", "global_step", "positions": {partition: next offset},
            "partition_ranks": {partition: rank}, "stale_ranks": [rank, ...]}``.
        """
        t = self._trainer
        owners = {p: t.module.rank for p in t.positions_snapshot()}
        positions = t.positions_snapshot()
        stale = []
        for view in (self.job.others() if self.job is not None else []):
            if not view.answering:
                stale.append(view.rank)
            parts = ((view.report or {}).get("input") or {}).get("partitions") or {}
            for p, st in parts.items():
                positions.setdefault(int(p), st["position"])
                owners.setdefault(int(p), view.rank)
        return {
            "topic": self._topic(),
            "global_step": t.module.global_step,
            "positions": {str(p): o for p, o in sorted(positions.items())},
            "partition_ranks": {str(p): r for p, r in sorted(owners.items())},
            "stale_ranks": stale,
        }

    def health(self, delta_broker_error: Optional[str]) -> tuple[bool, str]:
        """Healthy unless a broker is unreachable, publishing or checkpoints fail, or stopped.

        A retention warning (see the module docstring) is appended to a healthy reason. With
        several ranks, unhealthy also when another rank is or does not answer. Also refreshes
        the retention gauges and, with several ranks, the per-rank gauges and every
        partition's lag and position.

        Args:
            delta_broker_error: why the delta publisher's broker is unreachable, or None.

        Returns:
            ``(healthy, reason)``.
        """
        t = self._trainer
        src = t.input_pipeline
        retention = src.retention if src is not None else None
        t.metrics.set_retention(retention)
        mine = self.rank_report()  # this rank's health is in it (delta_broker_error's)
        ok, reason = mine["healthy"], mine["reason"]
        views = self._rank_views(mine)
        t.metrics.set_ranks(views)
        if ok:
            ok, reason = _ranks_health(views[1:], reason)
        warning = input_warning(retention) if ok else None
        return ok, f"{reason}; {warning}" if warning else reason

    def _health(self, delta_broker_error: Optional[str]) -> tuple[bool, str]:
        t = self._trainer
        src = t.input_pipeline
        if src is not None and src.broker_error is not None:
            return False, f"waiting_for_broker: {src.broker_error}"
        if delta_broker_error:
            return False, f"waiting_for_broker (delta topic): {delta_broker_error}"
        if t.publisher is not None:
            pub = t.publisher.status()
            if pub["fatal_error"]:
                return False, pub["fatal_error"]
            if pub["last_error"]:
                return False, f"delta publishing failing: {pub['last_error']}"
        if t.last_checkpoint_error:
            return False, f"checkpoint failing: {t.last_checkpoint_error}"
        if t.state in ("stopped",):
            return False, "stopped"
        return True, t.state

    def log_progress(self) -> None:
        """Logs the progress line and sets the rate, progressive and per-partition gauges."""
        t = self._trainer
        m = t.progress.summary()
        self._progress_cache = (time.monotonic(), m)
        metrics = t.metrics
        metrics.samples_per_sec.set(t.samples_per_sec)
        if m["auc"] is not None:
            metrics.auc.set(m["auc"])
        if m["logloss"] is not None:
            metrics.logloss.set(m["logloss"])
        if m.get("gauc") is not None:
            metrics.gauc.set(m["gauc"])
        if m.get("mse") is not None:
            metrics.mse.set(m["mse"])
        if t.tasks is not None:
            self._tasks_cache = t.tasks.summary()
            for name, tm in self._tasks_cache.items():
                if tm["auc"] is not None:
                    metrics.task_auc.labels(task=name).set(tm["auc"])
                if tm["logloss"] is not None:
                    metrics.task_logloss.labels(task=name).set(tm["logloss"])
                if tm.get("mse") is not None:
                    metrics.task_mse.labels(task=name).set(tm["mse"])
        positions = t.positions_snapshot()
        lags = self._lags(positions)
        for p, lag in lags.items():
            metrics.lag.labels(partition=str(p)).set(lag)
        if t.input_pipeline is not None:
            metrics.set_retention(t.input_pipeline.retention)
        for p, pos in positions.items():
            metrics.position.labels(partition=str(p)).set(pos)
        if t.module.dynamic:
            dynamic = t.module.dynamic_status()
            metrics.set_dynamic_tables(dynamic)
            logger.info("dynamic tables: %s", ", ".join(
                f"{n} {d['live_rows']}/{d['capacity']} rows"
                + (f" (partition {', '.join(map(str, d['held']))} of {d['partitions']})"
                   if "held" in d else "")
                + f", +{d['admitted']} -{d['evicted']} refused {d['rejected']}"
                for n, d in dynamic.items()))
        logger.info(
            "step %d samples %d %.0f samples/s loss %.4f auc %s logloss %s (total auc %s)%s "
            "lag %s",
            t.module.global_step,
            t.samples_trained,
            t.samples_per_sec,
            t.last_loss if t.last_loss is not None else float("nan"),
            m["auc"],
            m["logloss"],
            m["auc_total"],
            (f" gauc {m['gauc']}" if "gauc" in m else "")
            + (f" mse {m['mse']}" if "mse" in m else ""),
            lags,
        )
        if self._tasks_cache is not None and t.tasks is not None:
            logger.info("tasks: %s", ", ".join(
                f"{name} mse {tm['mse']}" if "mse" in tm else
                f"{name} auc {tm['auc']} logloss {tm['logloss']}"
                for name, tm in self._tasks_cache.items()))

    def _lags(self, positions: Mapping[int, int]) -> dict[int, int]:
        """Records behind the log end per partition (-1: the end is not known yet)."""
        src = self._trainer.input_pipeline
        if src is None:
            return {}
        out = {}
        for p, st in src.partition_state.items():
            pos = positions.get(p, st.position)
            out[p] = max(0, st.high_watermark - pos) if st.high_watermark >= 0 else -1
        return out


def _job_totals(ranks: list[RankView]) -> dict:
    """Samples, rate, records and rejects summed over the ranks' last reports."""
    reports = [v.report for v in ranks if v.report is not None]
    rejected: dict[str, int] = {}
    for r in reports:
        for reason, n in r["records_rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + n
    return {
        "samples_trained": sum(r["samples_trained"] for r in reports),
        "samples_per_sec": sum(r["samples_per_sec"] for r in reports),
        "records_consumed": sum(r["records_consumed"] for r in reports),
        "records_rejected": rejected,
    }


def _rank_entry(view: RankView) -> dict:
    """One rank in ``/status``'s ``ranks``."""
    r = view.report or {}
    return {
        "rank": view.rank,
        "answering": view.answering,
        "report_age_s": view.age_s,
        **{k: r.get(k) for k in ("host", "pid", "state", "healthy", "reason", "global_step",
                                 "samples_trained", "samples_per_sec", "records_consumed",
                                 "records_rejected", "last_exchange_age_s")},
        "partitions": sorted(int(p) for p in ((r.get("input") or {}).get("partitions") or {})),
        # what its source reads now (a file stream's split, file and record; DataHub's shards)
        "source": (r.get("input") or {}).get("source"),
    }


def _ranks_health(others: list[RankView], reason: str) -> tuple[bool, str]:
    """The job's health given rank 0's (healthy, ``reason``): the first other rank's trouble."""
    for view in others:
        if not view.answering:
            return False, f"rank {view.rank} has not reported for {view.age_s:.0f} s"
        if view.report is not None and not view.report["healthy"]:
            return False, f"rank {view.rank}: {view.report['reason']}"
    return True, reason


def start_status_server(provider: TrainerStatusProvider, registry: CollectorRegistry,
                        host: str, port: int, auth_token: Optional[str], model_dir: str,
                        generation: str,
                        history_interval_s: float = HISTORY_INTERVAL_S) -> BackgroundHttpServer:
    """Starts the status API and writes ``model_dir/status.json`` (see the module docstring).

    Besides the API, a thread samples the dashboard's history from the status document every
    ``history_interval_s`` seconds (``odl.train.trainer_dashboard``) until the server stops.

    Args:
        provider: what answers ``/status``, ``/offsets`` and ``/healthz`` (the trainer).
        registry: the trainer's Prometheus registry (``/metrics``).
        host: address to bind.
        port: port to bind (0: any free port).
        auth_token: bearer token the API requires (all but ``/healthz``), None for none.
        model_dir: where ``status.json`` goes.
        generation: the trainer's generation id.
        history_interval_s: seconds between two points of the dashboard's history (0: none
            kept; the page then shows the header only).

    Returns:
        The running server.
    """
    history = MetricHistory(history_interval_s or HISTORY_INTERVAL_S)
    app = build_status_app(provider, registry, history)
    server = BackgroundHttpServer(app, host, port, auth_token=auth_token,
                                  name="odl-train status API")
    bound = server.start()
    if history_interval_s > 0:  # the dashboard's figures, sampled from /status's document
        sampler = HistorySampler(history, lambda: history_point(provider.status()),
                                 name="trainer-history").start()
        server.stop_with(sampler.stop)
    doc = {
        "host": host,
        "port": bound,
        "pid": os.getpid(),
        "url": f"http://{host}:{bound}",
        "generation": generation,
    }
    data = json.dumps(doc).encode()
    # local tools find the API in the local mirror of a remote model_dir
    file_store.write_bytes(os.path.join(file_store.cache_dir_for(model_dir), STATUS_FILE), data)
    if is_remote(model_dir):
        try:
            file_store.write_bytes(join(model_dir, STATUS_FILE), data)
        except StorageError as exc:
            logger.warning("could not write %s: %s", join(model_dir, STATUS_FILE), exc)
    return server
