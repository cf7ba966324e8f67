"""The training daemon: read, predict-then-train, publish, checkpoint with positions, stop.

One ``Trainer`` runs one pipeline config, online (Kafka) or offline (files):

* start: the status API (:mod:`odl.train.trainer_status`), the delta sink, the restored
  state (:mod:`odl.train.crash_recovery`: the newest intact checkpoint brought forward to the
  last published version, or a warm start), the publisher, the dead-letter sink, then the
  input (:func:`odl.inputs.input_pipeline.build_input_pipeline`, whichever layout the config
  asks for);
* loop (:mod:`odl.train.training_loop`: when each rank steps, publishes, checkpoints and
  stops): each batch is scored before it is trained on (progressive validation); rates, AUC,
  logloss and lag are logged every ``log_step_count_steps``; the publisher gets every step's
  positions and time ranges; a checkpoint is taken every ``save_checkpoints_steps`` /
  ``save_checkpoints_secs`` (one process writes it in the background,
  :mod:`odl.train.checkpoint_writer`, so training does not stall). Records that are not
  trained on are counted and dead-lettered (:mod:`odl.train.record_rejects`);
* stop (:mod:`odl.train.stop_conditions`): finish the step, publish the last version,
  checkpoint, commit the positions to the consumer group, exit 0. A failure (a fenced or
  broken publisher, a refused fencing producer) stops the same way with its exit code.

Contracts:

* A checkpoint stores the NEXT offset per partition of exactly the batches trained, so a
  clean stop and restart trains every record exactly once.
* With a publisher, every checkpoint equals a fully published version (the crash-recovery
  point): the version at the checkpoint's step is acknowledged first, else the checkpoint is
  skipped and retried.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from odl.checkpoint.checkpoint_manager import CheckpointManager
from odl.config.config_redaction import config_to_text
from odl.config.loss_settings import regression_outputs
from odl.config.metric_settings import grouped_auc_field, grouped_auc_reduction
from odl.features.feature_builder import FeatureBuilder
from odl.http.server import BackgroundHttpServer
from odl.inputs.batch_prefetcher import PreparedBatch
from odl.inputs.dead_letter import DeadLetterSink
from odl.inputs.input_pipeline import InputPipeline, build_input_pipeline
from odl.inputs.source_factory import online_input_kind
from odl.protos import pipeline_pb2
from odl.storage.oss_store import StorageError
from odl.train.crash_recovery import CrashRecovery, RestoredState
from odl.train.distributed import (
    check_several_ranks,
    from_rank0,
    leave_process_group,
)
from odl.train.job_status import JobStatusChannel
from odl.train.pass_boundaries import PassBoundaries
from odl.train.pass_metrics import PassMetrics
from odl.train.pass_saves import BaseExporter, PassSaves
from odl.train.progressive_metrics import ProgressiveMetrics, TaskMetrics, output_column
from odl.train.rank_publishing import RankPublishing
from odl.train.record_rejects import RejectedRecords
from odl.train.sample_ledger import SampleLedger
from odl.train.stop_conditions import StopConditions
from odl.train.stream_evaluation import StreamEvaluator, rank_predict
from odl.train.torch_runtime import effective_num_workers
from odl.train.train_module import TrainModule
from odl.train.trainer_checkpoints import TrainerCheckpoints
from odl.train.trainer_metrics import TrainerMetrics
from odl.train.trainer_status import TrainerStatus, start_status_server
from odl.train.training_loop import TrainingLoop
from publisher.delta_sink import DeltaSink, DeltaSinkUnsupported
from publisher.delta_topic_owner import check_delta_topic_owner
from publisher.incremental_publisher import IncrementalPublisher
from publisher.model_identity import new_generation
from publisher.publisher_factory import build_delta_sink, build_publisher

logger = logging.getLogger(__name__)

@dataclass
class TrainerOptions:
    """Command-line choices that are not part of the pipeline config.

    Attributes:
        online: read Kafka (True) or train_input_path files (False).
        device: "auto", "cpu" or "cuda".
        status_port: port of the status API (0 = any free port, -1 = no server).
        status_host: address of the status API.
        sample_ledger: append a tab-separated ``generation step sample_id`` line per trained
            sample to this file (flushed every step).
        continue_train: restore from model_dir's newest checkpoint when there is one.
        auth_token: bearer token the status API requires (all but /healthz); never logged.
        dashboard_interval_s: seconds between two points of the dashboard's history
            (``GET /`` and ``/history`` of the status API); 0 keeps no history.
        export_base: writes an export of a checkpoint (``odl.export.exporter.
            export_checkpoint``; the CLI hands it in): the day bases of
            ``file_stream_input.model_save_path``. None: no bases.
        take_over_delta_topic: publish to the delta topic even when its newest version is
            another model's (``publisher.delta_topic_owner``).
    """

    online: bool = True
    device: str = "auto"
    status_port: int = 0
    status_host: str = "127.0.0.1"
    sample_ledger: Optional[str] = None
    continue_train: bool = True
    auth_token: Optional[str] = field(default=None, repr=False)
    dashboard_interval_s: float = 2.0
    export_base: Optional[BaseExporter] = field(default=None, repr=False)
    take_over_delta_topic: bool = False


class Trainer:
    """Runs one training pipeline until told to stop.

    Args:
        config: a validated pipeline config.
        options: command-line choices.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, options: TrainerOptions) -> None:
        self.config = config
        self.options = options
        self.model_dir = config.model_dir
        tc = config.train_config
        self.generation = new_generation(self.model_dir)
        self.stops = StopConditions(tc, self.model_dir)
        self.stop_event = self.stops.event
        self.state = "starting"
        self.started_at = time.time()
        self.metrics = TrainerMetrics()
        # GAUC beside AUC when a grouped_auc metric names a grouping column
        regression = regression_outputs(config)
        self.progress = ProgressiveMetrics(tc.metrics_window_samples,
                                           grouped=bool(grouped_auc_field(config)),
                                           gauc_reduction=grouped_auc_reduction(config),
                                           regression=regression[0])
        fs = config.file_stream_input
        file_stream = options.online and config.HasField("file_stream_input")
        self.passes = (PassMetrics(fs.split_interval, fs.split_per_pass,
                                   train_auc_samples=fs.train_auc_samples)
                       if file_stream else None)
        self.checkpoints = CheckpointManager(self.model_dir, tc.keep_checkpoint_max,
                                             tc.full_checkpoint_every)
        self.checkpointing = TrainerCheckpoints(self)
        self.features = FeatureBuilder(config)
        self.module = TrainModule(config, self.features, device=options.device)
        if self.module.world_size > 1:
            check_several_ranks(config, self.module.world_size)
            self.generation = str(from_rank0(self.generation))  # one job, one generation
        model = self.module.model
        self._label_column = int(model.output_labels[0])
        # several scored outputs (multi-task): per-task progressive metrics beside the first's
        self._scored_outputs, scored_regression = model.metric_outputs(regression)
        self.tasks = (TaskMetrics(self._scored_outputs, self.progress, tc.metrics_window_samples,
                                  scored_regression)
                      if len(self._scored_outputs) > 1 else None)
        self._scored_regression = scored_regression
        # day/pass saves (before restore: the checkpoint holds their pending rows and deletes)
        self.pass_saves = (PassSaves(config, self.module, self.generation, options.export_base)
                           if file_stream and fs.model_save_path else None)
        self.pass_boundaries = (
            PassBoundaries(config, self.module, self.passes, self.pass_saves, self.metrics,
                           self.checkpoints, self.checkpointing.take, self.positions_snapshot,
                           self._label_column)
            if self.passes is not None else None)
        self.positions: dict[int, int] = {}
        self.samples_trained = 0
        self.last_loss: Optional[float] = None
        self.samples_per_sec = 0.0
        self.last_checkpoint_error: Optional[str] = None
        self.last_sample_time_ms: Optional[int] = None
        self.last_exchange_at: Optional[float] = None  # monotonic time of the last turn
        self._rejects = RejectedRecords(config, options.online, self.metrics)
        self.input_pipeline: Optional[InputPipeline] = None
        self._http: Optional[BackgroundHttpServer] = None
        self._ledger: Optional[SampleLedger] = None
        self.config_text = config_to_text(config, redact=True)
        self._lock = threading.Lock()
        self.publisher: Optional[IncrementalPublisher] = None  # rank 0's with several ranks
        # several ranks: every rank's part in publishing (rank_publishing)
        self.rank_publishing: Optional[RankPublishing] = None
        # several ranks: the loop ended on a stop all ranks agreed, none failed; only then
        # may the shutdown run collectives (a last version, a last checkpoint)
        self.ranks_stopped_together = False
        self.restored = RestoredState()
        # evaluation on kafka_eval_input at every checkpoint (online, opened with the input)
        self.evaluator: Optional[StreamEvaluator] = None
        self.recovery: Optional[dict] = None
        self._input_opened = False  # start positions resolved, partitions assigned
        # online with an eval stream: an evaluation at every checkpoint
        self.evaluates = options.online and bool(config.kafka_eval_input.topic
                                                  or config.datahub_eval_input.topic)
        # why the trainer stopped on a failure (exit code ``exit_code``), None for a clean stop
        self.failure: Optional[str] = None
        self.exit_code = 0
        self._delta_sink: Optional[DeltaSink] = None
        self._status = TrainerStatus(self)

    # ------------------------------------------------------------------ what others read
    @property
    def online(self) -> bool:
        """Kafka input (True) or files."""
        return self.options.online

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the trainer stops, None until a stop is requested."""
        return self.stops.reason

    @property
    def checkpoint_writing(self) -> bool:
        """Whether a checkpoint is being written in the background (outcome not yet taken)."""
        return self.checkpointing.writer.in_flight

    @property
    def records_rejected(self) -> dict[str, int]:
        """Records not trained on, by reason."""
        return self._rejects.counts

    @property
    def dead_letter(self) -> Optional[DeadLetterSink]:
        """The dead-letter sink, when ``data_config.dead_letter_topic`` is set (online)."""
        return self._rejects.dead_letter

    def positions_snapshot(self) -> dict[int, int]:
        """A copy of the trained positions (next offset per partition).

        Returns:
            The positions.
        """
        with self._lock:
            return dict(self.positions)

    def status(self) -> dict:
        """The status document served at ``/status``."""
        return self._status.document()

    def offsets(self) -> dict:
        """Trained positions served at ``/offsets``."""
        return self._status.offsets()

    def log_progress(self) -> None:
        """Logs the progress line (rates, AUC, logloss, lag)."""
        self._status.log_progress()

    def health(self) -> tuple[bool, str]:
        """Healthy unless a broker is unreachable, publishing or checkpoints fail, or stopped.

        Also sets the ``odl_healthy`` gauge.
        """
        ok, reason = self._status.health(self.delta_broker_error())
        self.metrics.healthy.set(1 if ok else 0)
        return ok, reason

    # ------------------------------------------------------------------ start
    def restore(self) -> Optional[dict[int, int]]:
        """Restores the trainer's state at start (see :mod:`odl.train.crash_recovery`).

        Returns:
            The input positions to start from (None: the config's start positions).
        """
        recovery = CrashRecovery(
            self.config, self.options.online, self.options.continue_train, self.module,
            self.checkpoints, self.metrics, self.stop_event, self._delta_sink, self._set_state)
        restored = recovery.restore()
        self.checkpointing.restored()  # the next increment's rows are counted from here
        if self.pass_saves is not None:
            self.pass_saves.load_state_dict(restored.pass_saves_state)
            if restored.recovered_version is not None:
                self.pass_saves.mark_all_rows()
        if self.pass_boundaries is not None:
            self.pass_boundaries.resume(restored)
        self.restored = restored
        self.recovery = restored.report
        return restored.positions

    def _set_state(self, state: str) -> str:
        """Sets ``state``; returns the previous one."""
        prev, self.state = self.state, state
        return prev

    def run(self) -> int:
        """Trains until a stop condition; returns the process exit code (0 on clean stop)."""
        try:
            if self.options.status_port >= 0 and self.module.rank == 0:
                self._http = start_status_server(
                    self, self.metrics.registry, self.options.status_host,
                    self.options.status_port, self.options.auth_token, self.model_dir,
                    self.generation, self.options.dashboard_interval_s)
            if self.module.world_size > 1:  # every rank's report, rank 0's view of the job
                self._status.job = JobStatusChannel(self.module.rank, self.module.world_size,
                                                    self._status.rank_report).start()
            publishes = self.config.train_config.HasField("incr_save_config")
            if publishes and self.module.rank == 0:  # one sink, rank 0's
                isc = self.config.train_config.incr_save_config
                if isc.WhichOneof("incr_update") == "kafka":  # before claiming its producer
                    check_delta_topic_owner(isc.kafka.server, isc.kafka.topic, self.model_dir,
                                            self.options.take_over_delta_topic,
                                            dict(isc.kafka.kafka_config))
                self._delta_sink = build_delta_sink(self.config)
            restored_positions = self.restore()
            if publishes and self.module.world_size > 1:
                self.rank_publishing = RankPublishing.build(
                    self.config, self.module, self.generation, self.module.rank,
                    self.metrics.registry, self._delta_sink)
                self.publisher = self.rank_publishing.publisher
            elif self._delta_sink is not None:
                self.publisher = build_publisher(
                    self.config, self.module, self.generation, self.metrics.registry,
                    start_step=self.module.global_step, sink=self._delta_sink)
            self._rejects.open_dead_letter()
            if self.options.sample_ledger:
                self._ledger = SampleLedger(
                    self.options.sample_ledger if self.module.world_size == 1
                    else f"{self.options.sample_ledger}.rank{self.module.rank}")
            try:
                self._open_input(restored_positions)
            except InterruptedError:  # stopped while waiting for the topic: a clean stop
                if not self.stops.requested:
                    raise
                logger.info("stopped before the input was open (%s)", self.stop_reason)
                return 0
            self._input_opened = True
            if self.evaluates and self.module.rank == 0:  # rank 0 reads the eval stream
                self.evaluator = StreamEvaluator(
                    self.config, self.features, rank_predict(self.module), self._scored_outputs,
                    self.restored.eval_positions, regression=self._scored_regression,
                    scored=self.module.model.metric_predictions)
            if self.restored.needs_base_checkpoint and not self.stops.requested:
                # the first recovery point of a fresh start: where its versions begin
                self.checkpointing.take()
            if self.pass_boundaries is not None and not self.stops.requested:
                self.pass_boundaries.first_base()
            self.state = "training"
            # what start-up made (modules, the model, the restored state) leaves the
            # collector's view: no full collection walks it while the loop holds the GIL
            gc.freeze()
            TrainingLoop(self).run()
        except DeltaSinkUnsupported as exc:  # the broker refuses fencing: a setup error
            self.fail(str(exc), 2)
        except StorageError as exc:  # OSS down while restoring: never start from nothing
            self.fail(f"{exc}; not starting without the checkpoints of {self.model_dir} "
                       "(a restart retries)", 1)
        finally:
            self._shutdown()
        if self.failure is not None:
            logger.error("exiting with code %d: %s", self.exit_code, self.failure)
            return self.exit_code
        if self.module.world_size > 1:
            leave_process_group()  # after a clean stop, all ranks together
        return 0

    def fail(self, why: str, exit_code: int) -> None:
        """Stops the trainer on a failure; ``run`` returns ``exit_code``."""
        if self.failure is None:
            self.failure, self.exit_code = why, exit_code
        self.stops.request(why)

    def _open_input(self, restored_positions: Optional[dict[int, int]]) -> None:
        num_workers = effective_num_workers(self.config.data_config, self.module.device.type)
        self.input_pipeline = build_input_pipeline(
            self.config, self.features, self.options.online, restored_positions, num_workers,
            self.module.rank, self.module.world_size)
        if self.options.online and online_input_kind(self.config) != "file_stream":
            self.state = "waiting_for_topic"
        self.positions = self.input_pipeline.open(self.stop_event)

    # ------------------------------------------------------------------ a step
    def train_empty(self, sizes: Optional[list[int]] = None) -> int:
        """This rank's part of a step it holds no records for (several ranks)."""
        self.module.train_step(self.module.empty_batch(), sizes)
        return 0

    def train_on(self, item: PreparedBatch, sizes: Optional[list[int]] = None) -> int:
        """Trains ``item``; with several ranks ``sizes`` are every rank's batch sizes."""
        if self.pass_boundaries is not None:
            self.pass_boundaries.begin(item)
        self.metrics.records_consumed.inc(item.num_records)
        if item.rejected:
            self._rejects.built_rejects(item)
        batch = item.batch
        trained = 0
        if (batch is None or not batch.size) and sizes is not None and sum(sizes):
            self.train_empty(sizes)  # the others step: take part with nothing
        if batch is not None and batch.size:
            out = self.module.train_step(batch, sizes)
            labels = batch.labels.detach().cpu().numpy()
            sample_ids = batch.sample_ids
            groups = batch.group_keys
            if len(out.dropped):
                keep = np.ones(batch.size, dtype=bool)
                keep[out.dropped] = False
                labels = labels[keep]
                groups = groups[keep] if groups is not None else None
                if sample_ids is not None:
                    sample_ids = [sid for sid, k in zip(sample_ids, keep.tolist(), strict=True)
                                  if k]
                self._rejects.untrained_rows(item, out.dropped, "non_finite_output")
            trained = out.trained
        if trained:
            scored = self.module.model.metric_predictions(out.probs, labels)
            probs = output_column(scored, 0)
            if self.tasks is not None:
                self.tasks.update(scored, labels, groups)
            labels = output_column(labels, self._label_column)
            self.progress.update(probs, labels, groups)
            if self.pass_boundaries is not None:
                self.pass_boundaries.trained(item, probs, labels)
            self.samples_trained += trained
            self.last_loss = float(out.loss)
            self.metrics.samples_trained.inc(trained)
            self.metrics.steps.inc()
            self.metrics.global_step.set(self.module.global_step)
            self.metrics.loss.set(self.last_loss)
            learning = self.module.row_pair_learning
            wide_rate = self.module.wide_rate
            if wide_rate is not None and learning is not None:
                self.metrics.wide_rate_level.set(wide_rate.level)
                self.metrics.wide_rate_multiplier.set(learning.wide_multiplier() or 1.0)
            gain = self.module.in_batch_gain
            if gain is not None and learning is not None:
                if gain.value is not None:
                    self.metrics.in_batch_loss_gain.set(gain.value)
                self.metrics.in_batch_active.set(int(learning.choice.active))
            if self._ledger is not None and sample_ids is not None:
                # flushed before the step can be published (crash audits)
                self._ledger.write_step(self.generation, self.module.global_step, sample_ids)
        if len(item.raw.timestamps_ms):
            self.last_sample_time_ms = int(item.raw.timestamps_ms.max())
        with self._lock:
            self.positions.update(item.positions)
        if self.publisher is not None or self.rank_publishing is not None:
            self._maybe_publish(item)
        return trained

    def _maybe_publish(self, item: PreparedBatch) -> None:
        """Hands the step's positions and time ranges to the delta publisher.

        Several ranks: only the time ranges; the next turn says whether a version is due.
        """
        event = produce = None
        times = item.batch.event_times if item.batch is not None else None
        if times is not None and len(times):
            finite = times[np.isfinite(times)]
            if len(finite):
                event = (int(finite.min() * 1000), int(finite.max() * 1000))
        if len(item.raw.timestamps_ms):
            produce = (int(item.raw.timestamps_ms.min()), int(item.raw.timestamps_ms.max()))
        if self.rank_publishing is not None:
            self.rank_publishing.note_times(event, produce)
            return
        assert self.publisher is not None
        self.publisher.maybe_publish(self.module.global_step, self.positions_snapshot(), event,
                                     produce)

    def update_input_state(self) -> None:
        """Follows the input's broker: ``waiting_for_broker`` while it is unreachable."""
        pipeline = self.input_pipeline
        if pipeline is None:
            return
        if pipeline.broker_error is not None:
            self.metrics.broker_up.set(0)
            if self.state == "training":
                self.state = "waiting_for_broker"
        else:
            self.metrics.broker_up.set(1)
            if self.state == "waiting_for_broker":
                self.state = "training"

    # ------------------------------------------------------------------ stop
    def request_stop(self, reason: str) -> None:
        """Asks the loop to finish the current step, checkpoint and exit (thread/signal safe)."""
        self.stops.request(reason)

    def _shutdown(self) -> None:
        self.state = "stopping"
        if self.input_pipeline is not None:
            self.input_pipeline.stop()
        self._rejects.flush_log()
        together = self.module.world_size == 1 or self.ranks_stopped_together
        if self.rank_publishing is not None:  # a last version only when all stopped cleanly
            self.rank_publishing.flush(self.module.global_step if together else None,
                                        dict(self.positions), timeout=30.0)
        elif self.publisher is not None:  # first, so the final checkpoint covers it
            self.publisher.flush(timeout=30.0, step=self.module.global_step,
                                 positions=dict(self.positions))
        elif self._delta_sink is not None:  # stopped before the publisher was built
            self._delta_sink.close()
        self.checkpointing.writer.wait()  # a background checkpoint in flight ends first
        # one more checkpoint on every clean stop, also when the state was only brought
        # forward by crash recovery (nothing trained in this run, but a newer step); not
        # before the input was open: its positions are unknown then, and a checkpoint without
        # them would override the config's start positions on the next start
        if (self._input_opened and self.failure is None and together
                and self.module.global_step != self.checkpoints.last_saved_step):
            self.checkpointing.take()
        if self.input_pipeline is not None:
            self.input_pipeline.commit_now(self.positions)
            self.input_pipeline.close()
        if self._ledger is not None:
            self._ledger.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self._rejects.close()
        gc.unfreeze()  # (a process that goes on, e.g. tests, collects them again)
        self.state = "stopped"
        if self._status.job is not None:
            self._status.job.stop()  # its last report says so
        if self.samples_trained:
            self._status.log_progress()
        if self._http is not None:
            self._http.stop()

    def delta_broker_error(self) -> Optional[str]:
        """Why the delta publisher's broker is unreachable, or None."""
        return self.publisher.sink.broker_error if self.publisher is not None else None
