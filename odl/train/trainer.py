"""The training daemon: read, predict-then-train, checkpoint with positions, stop cleanly.

One ``Trainer`` runs one pipeline config, online (Kafka) or offline (files):

* start: restore the newest intact checkpoint of ``model_dir`` (model, optimizer, step and
  input positions), else warm-start parameters from ``fine_tune_checkpoint``;
* loop: the input process (online, ``data_config.input_process``) or a background thread
  reads and builds batches; the train loop scores each batch
  before training on it (progressive validation), logs rates / AUC / logloss / lag every
  ``log_step_count_steps`` and checkpoints every ``save_checkpoints_steps`` /
  ``save_checkpoints_secs``;
* stop: SIGTERM/SIGINT, the ``OSS_STOP_SIGNAL`` file in ``model_dir`` (when
  ``enable_oss_stop_signal``; the file is removed once acted on), ``dead_line``, ``num_steps``
  or the end of offline input: finish the step, checkpoint, exit 0.

A checkpoint stores the NEXT offset per partition of exactly the batches trained, so a clean
stop and restart trains every record exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from odl.checkpoint.checkpoint_manager import (
    CheckpointError,
    CheckpointManager,
    read_checkpoint,
    resolve_checkpoint_path,
)
from odl.config.pipeline_config import (
    config_to_text,
    parse_dead_line,
    parse_offset_info,
)
from odl.features.feature_builder import FeatureBuilder
from odl.http.server import BackgroundHttpServer
from odl.inputs.batch_prefetcher import BatchPrefetcher, PreparedBatch
from odl.inputs.dead_letter import DeadLetterSink
from odl.inputs.feature_build_worker import FeatureBuildWorkers
from odl.inputs.file_source import FileSource
from odl.inputs.kafka_input_process import KafkaInputProcess
from odl.inputs.kafka_source import KafkaSource, StartPositions, start_positions_from_config
from odl.protos import pipeline_pb2
from odl.train.progressive_metrics import ProgressiveMetrics
from odl.train.sample_ledger import SampleLedger
from odl.train.status_app import build_status_app
from odl.train.torch_runtime import usable_cpus
from odl.train.train_module import TrainModule
from odl.train.trainer_metrics import TrainerMetrics
from publisher.delta_codec import build_id_maps
from publisher.delta_recovery import (
    DeltaRecoveryError,
    RecoveredState,
    apply_recovered_state,
    delta_topic_end,
    read_published_state,
)
from publisher.incremental_publisher import (
    DeltaSink,
    IncrementalPublisher,
    build_delta_sink,
    build_publisher,
    dense_variable_shapes,
    published_table_dims,
)
from publisher.kafka_sink import DeltaSinkError, DeltaSinkUnsupported, KafkaSink

logger = logging.getLogger(__name__)

STOP_SIGNAL_FILE = "OSS_STOP_SIGNAL"
STATUS_FILE = "status.json"
_REJECT_LOG_INTERVAL_SECS = 5.0
_RATE_WINDOW_SECS = 5.0
_CHECKPOINT_SYNC_SECS = 10.0
_CHECKPOINT_RETRY_SECS = 5.0
# /status recomputes the progressive metrics (a sort of the window) at most this often
_PROGRESS_CACHE_SECS = 1.0
_RECOVERY_RETRY_MAX_SECS = 30.0
_FRESH_START_DELTA_WAIT_SECS = 10.0


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
    """

    online: bool = True
    device: str = "auto"
    status_port: int = 0
    status_host: str = "127.0.0.1"
    sample_ledger: Optional[str] = None
    continue_train: bool = True
    auth_token: Optional[str] = field(default=None, repr=False)


class _RejectLog:
    """Logs malformed records at a bounded rate (one summary line per interval)."""

    def __init__(self) -> None:
        self._since_log: dict[str, int] = {}
        self._example: Optional[str] = None
        self._last = 0.0

    def add(self, reason: str, where: str) -> None:
        self._since_log[reason] = self._since_log.get(reason, 0) + 1
        if self._example is None:
            self._example = f"{reason} at {where}"

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._since_log or (not force and now - self._last < _REJECT_LOG_INTERVAL_SECS):
            return
        logger.warning(
            "skipped %d malformed records %s (e.g. %s)",
            sum(self._since_log.values()),
            dict(sorted(self._since_log.items())),
            self._example,
        )
        self._since_log, self._example, self._last = {}, None, now


# data_config.num_workers when unset and training on CUDA: the step there is short and mostly
# Python, so building batches in the reader thread holds the GIL the step needs (measured on
# an H100 host with 16 cores: 76k samples/s with none, ~100k with 4, no more with 8)
_CUDA_DEFAULT_WORKERS = 4


def effective_num_workers(data_config: pipeline_pb2.DatasetConfig, device_type: str) -> int:
    """Feature build worker processes to start.

    Args:
        data_config: the pipeline's ``data_config``.
        device_type: ``"cpu"`` or ``"cuda"``, the device the model trains on.

    Returns:
        ``num_workers`` when set; otherwise 0 on CPU and, on CUDA, 4 where the host has at
        least 8 CPUs this process may use (0 below that).
    """
    if data_config.HasField("num_workers"):
        return int(data_config.num_workers)
    if device_type != "cuda":
        return 0
    cpus = usable_cpus()
    workers = _CUDA_DEFAULT_WORKERS if cpus >= 2 * _CUDA_DEFAULT_WORKERS else 0
    logger.info("data_config.num_workers unset on CUDA: %d feature build worker(s) (%d CPUs)",
                workers, cpus)
    return workers


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
        os.makedirs(self.model_dir, exist_ok=True)
        tc = config.train_config
        self.generation = uuid.uuid4().hex[:16]
        self.stop_event = threading.Event()
        self.stop_reason: Optional[str] = None
        self.state = "starting"
        self.started_at = time.time()
        self.metrics = TrainerMetrics()
        self.progress = ProgressiveMetrics(tc.metrics_window_samples)
        self.checkpoints = CheckpointManager(self.model_dir, tc.keep_checkpoint_max)
        self.features = FeatureBuilder(config)
        self.module = TrainModule(config, self.features, device=options.device)
        self.positions: dict[int, int] = {}
        self.samples_trained = 0
        self.records_rejected: dict[str, int] = {}
        self.last_loss: Optional[float] = None
        self.samples_per_sec = 0.0
        self.last_checkpoint_error: Optional[str] = None
        self.last_sample_time_ms: Optional[int] = None
        self._reject_log = _RejectLog()
        # with data_config.input_process one KafkaInputProcess is both
        self._source: Optional[KafkaSource | KafkaInputProcess] = None
        self._file_source: Optional[FileSource] = None
        self._prefetcher: Optional[BatchPrefetcher | KafkaInputProcess] = None
        self._http: Optional[BackgroundHttpServer] = None
        self._ledger: Optional[SampleLedger] = None
        self._dead_line = parse_dead_line(tc.dead_line) if tc.dead_line else None
        self._config_text = config_to_text(config, redact=True)
        self._lock = threading.Lock()
        self.publisher: Optional[IncrementalPublisher] = None
        self._restored_delta_offset: Optional[int] = None
        # (monotonic time, progress.summary()): the window AUC sorts up to
        # metrics_window_samples predictions, too slow for every /status request
        self._progress_cache: Optional[tuple[float, dict]] = None
        self._restored_step: Optional[int] = None
        self._restored_generation: Optional[str] = None
        self._recovery_incomplete = False
        self.recovery: Optional[dict] = None
        self._dead_letter: Optional[DeadLetterSink] = None
        self._input_opened = False  # start positions resolved, partitions assigned
        # why the trainer stopped on a failure (exit code ``exit_code``), None for a clean stop
        self.failure: Optional[str] = None
        self.exit_code = 0
        self._delta_sink: Optional[DeltaSink] = None

    # ------------------------------------------------------------------ restore
    def _restore(self) -> Optional[dict[int, int]]:
        """Restores the newest intact checkpoint, then brings it forward to the last version.

        Returns:
            The input positions to start from (None: the config's start positions).
        """
        positions = self._restore_checkpoint()
        if self._delta_topic() is not None:
            positions = self._recover_published(positions)
        return positions

    def _delta_topic(self) -> Optional[tuple[str, str, dict[str, str]]]:
        """``(server, topic, kafka_config)`` of the Kafka delta topic when online + publishing."""
        tc = self.config.train_config
        if not self.options.online or not tc.HasField("incr_save_config"):
            return None
        isc = tc.incr_save_config
        if isc.WhichOneof("incr_update") != "kafka":
            return None
        return isc.kafka.server, isc.kafka.topic, dict(isc.kafka.kafka_config)

    def _recover_published(self, positions: Optional[dict[int, int]]) -> Optional[dict[int, int]]:
        """Replays this trainer's own delta topic onto the restored checkpoint.

        Versions published after the checkpoint (by a trainer that was then killed) are
        already in serving; the recovery point is the last COMPLETE one: its values are
        copied onto the live tensors and its step and input positions replace the
        checkpoint's, so no record is trained twice as serving sees it and none is skipped.
        A version half-sent when the trainer died is ignored (serving drops it too).
        Optimizer state (Adagrad / Adam accumulators) stays the checkpoint's.
        """
        delta = self._delta_topic()
        assert delta is not None
        server, topic, extra = delta
        prev_state, self.state = self.state, "recovering"
        try:
            sink = self._delta_sink
            if isinstance(sink, KafkaSink) and sink.fence:
                # fence any other producer first, so nothing lands after the read below
                self._recovery_call(
                    lambda: sink.claim(5.0),
                    give_up_secs=(_FRESH_START_DELTA_WAIT_SECS if self._restored_step is None
                                  else None))
                if self.stop_event.is_set():
                    return positions
            if self._restored_step is None:
                # Fresh start: versions after the topic's current end are this lineage's.
                end = self._recovery_call(lambda: delta_topic_end(server, topic, extra, 5.0),
                                          give_up_secs=_FRESH_START_DELTA_WAIT_SECS)
                if end is None:
                    if not self.stop_event.is_set():
                        logger.warning(
                            "delta topic %s unreachable at a fresh start: no model.ckpt-0 "
                            "recovery base; until the first checkpoint, a kill -9 may let "
                            "serving see records twice", topic)
                    return positions
                self._restored_delta_offset = end
                self.recovery = {"from_checkpoint": None, "delta_topic": topic,
                                 "start_offset": end, "versions": 0}
                return positions
            start = self._restored_delta_offset
            if start is None:
                logger.warning("the restored checkpoint has no delta_topic_offset: versions "
                               "published after it cannot be recovered")
                return positions
            restored_step = self._restored_step
            owner = self._restored_generation
            state = self._recovery_call(lambda: read_published_state(
                server, topic, start, extra, min_version=restored_step, stop=self.stop_event,
                owner=owner))
            if state is None:
                self._recovery_incomplete = True
                return positions
            return self._apply_recovered(state, positions)
        finally:
            self.state = prev_state

    def _recovery_call(self, fn, give_up_secs: Optional[float] = None):  # noqa: ANN001, ANN202
        """Calls ``fn`` until it succeeds (broker down: retry with backoff).

        Returns None when a stop is requested or ``give_up_secs`` passed.
        """
        delay = 1.0
        deadline = None if give_up_secs is None else time.monotonic() + give_up_secs
        while not self.stop_event.is_set():
            try:
                return fn()
            except DeltaSinkUnsupported:
                raise
            except (DeltaRecoveryError, DeltaSinkError) as exc:
                if self.stop_event.is_set():
                    break
                if deadline is not None and time.monotonic() + delay > deadline:
                    logger.warning("crash recovery: %s; giving up", exc)
                    return None
                logger.warning("crash recovery: %s; retrying in %.0fs", exc, delay)
                self.stop_event.wait(delay)
                delay = min(delay * 2, _RECOVERY_RETRY_MAX_SECS)
        logger.warning("crash recovery abandoned (stop requested): no checkpoint will be written")
        return None

    def _apply_recovered(self, state: RecoveredState,
                         positions: Optional[dict[int, int]]) -> Optional[dict[int, int]]:
        self._restored_delta_offset = state.end_offset
        info = {
            "from_checkpoint": self._restored_step,
            "delta_topic": state.topic,
            "start_offset": state.start_offset,
            "end_offset": state.end_offset,
            "versions": state.versions,
            "skipped_versions": state.skipped_versions,
            "dropped_incomplete_versions": state.dropped_versions,
            "rejected": dict(state.rejected),
            "version": state.version,
            "rows": state.rows,
            "dense_variables": len(state.dense),
            "seconds": round(state.seconds, 3),
        }
        self.recovery = info
        if state.version is None:
            logger.info("crash recovery: no complete version after checkpoint step %d "
                        "(delta offsets %d..%d, %d incomplete dropped): the checkpoint is the "
                        "recovery point", self._restored_step, state.start_offset,
                        state.end_offset, state.dropped_versions)
            return positions
        id_maps = build_id_maps(dense_variable_shapes(self.module),
                                published_table_dims(self.module))
        apply_recovered_state(self.module.embedding_tables(), self.module.dense_parameters(),
                              id_maps, state)
        self.module.global_step = int(state.version)
        recovered = state.positions_for(self.config.kafka_train_input.topic)
        if recovered:
            positions = recovered
        else:
            logger.warning("crash recovery: version %d has no positions for input topic %s; "
                           "keeping the checkpoint's", state.version,
                           self.config.kafka_train_input.topic)
        logger.info(
            "crash recovery: checkpoint step %d + %d published versions -> version %d "
            "(generations %s): %d rows, %d dense variables; %d incomplete versions dropped; "
            "positions %s; delta offsets %d..%d in %.2fs",
            self._restored_step, state.versions, state.version, state.generations, state.rows,
            len(state.dense), state.dropped_versions, positions, state.start_offset,
            state.end_offset, state.seconds)
        return positions

    def _restore_checkpoint(self) -> Optional[dict[int, int]]:
        tc = self.config.train_config
        if self.options.continue_train:
            latest = self.checkpoints.latest()
            if latest is not None:
                ckpt = read_checkpoint(latest)
                self.module.load_checkpoint_state(ckpt.state)
                self._restored_step = ckpt.global_step
                self._restored_generation = ckpt.manifest.get("generation") or None
                if "delta_topic_offset" in ckpt.source:
                    self._restored_delta_offset = int(ckpt.source["delta_topic_offset"])
                logger.info(
                    "restored %s: step %d, positions %s", latest, ckpt.global_step, ckpt.positions
                )
                self.checkpoints.last_saved_path = latest
                self.checkpoints.last_saved_step = ckpt.global_step
                self.metrics.checkpoint_step.set(ckpt.global_step)
                if self.options.online:
                    topic = ckpt.source.get("topic")
                    if topic and topic != self.config.kafka_train_input.topic:
                        logger.warning(
                            "checkpoint positions are for topic %s, config reads %s: "
                            "starting from the config's start positions",
                            topic,
                            self.config.kafka_train_input.topic,
                        )
                        return None
                    return ckpt.positions
                return None
        if tc.fine_tune_checkpoint:
            path = resolve_checkpoint_path(tc.fine_tune_checkpoint)
            ckpt = read_checkpoint(path)
            var_map = (
                _read_var_map(tc.fine_tune_ckpt_var_map) if tc.fine_tune_ckpt_var_map else None
            )
            report = self.module.load_parameters(ckpt.state["model"], var_map)
            logger.info("warm-started parameters from %s: %s", path, report)
        return None

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        """Trains until a stop condition; returns the process exit code (0 on clean stop)."""
        try:
            self._start_status_server()
            if self.config.train_config.HasField("incr_save_config"):
                self._delta_sink = build_delta_sink(self.config)
            restored_positions = self._restore()
            if self._delta_sink is not None:
                self.publisher = build_publisher(
                    self.config, self.module, self.generation, self.metrics.registry,
                    start_step=self.module.global_step, sink=self._delta_sink)
            self._dead_letter = self._open_dead_letter()
            if self.options.sample_ledger:
                self._ledger = SampleLedger(self.options.sample_ledger)
            try:
                self._open_input(restored_positions)
            except InterruptedError:  # stopped while waiting for the topic: a clean stop
                if not self.stop_event.is_set():
                    raise
                logger.info("stopped before the input was open (%s)", self.stop_reason)
                return 0
            self._input_opened = True
            if (self._delta_topic() is not None and self._restored_step is None
                    and self._restored_delta_offset is not None
                    and not self.stop_event.is_set()):
                # the first recovery point of a fresh start: where its versions begin
                self._checkpoint()
            self.state = "training"
            self._loop()
        except DeltaSinkUnsupported as exc:  # the broker refuses fencing: a setup error
            self._fail(str(exc), 2)
        finally:
            self._shutdown()
        if self.failure is not None:
            logger.error("exiting with code %d: %s", self.exit_code, self.failure)
            return self.exit_code
        return 0

    def _fail(self, why: str, exit_code: int) -> None:
        """Stops the trainer on a failure; ``run`` returns ``exit_code``."""
        if self.failure is None:
            self.failure, self.exit_code = why, exit_code
        self._request_stop(why)

    def _open_input(self, restored_positions: Optional[dict[int, int]]) -> None:
        num_workers = effective_num_workers(self.config.data_config, self.module.device.type)
        if self.options.online and self.config.data_config.input_process:
            self._open_input_process(restored_positions, num_workers)
            return
        # started first: their start-up (about 0.5 s) overlaps opening the input
        workers = (FeatureBuildWorkers(self.config, num_workers).start()
                   if num_workers else None)
        try:
            self._open_source_and_prefetcher(restored_positions, workers)
        except BaseException:
            if workers is not None and self._prefetcher is None:
                workers.close()
            raise

    def _kafka_start(self, restored_positions: Optional[dict[int, int]]
                     ) -> tuple[StartPositions, dict]:
        """The start rules and ``KafkaSource`` arguments of ``kafka_train_input``."""
        ki, dc = self.config.kafka_train_input, self.config.data_config
        start = start_positions_from_config(
            parse_offset_info(ki.offset_info) if ki.offset_info else None,
            ki.offset_time,
            list(ki.offset),
            restored_positions,
        )
        args = {
            "servers": ki.server,
            "topic": ki.topic,
            "group": ki.group,
            "batch_size": dc.batch_size,
            "batch_timeout_ms": dc.batch_timeout_ms,
            "fetch_interval_ms": dc.fetch_interval_ms,
            "kafka_config": dict(ki.kafka_config),
        }
        return start, args

    def _warn_on_partition_count(self) -> None:
        """Logs a partition count that differs from the config's (informational field)."""
        ki = self.config.kafka_train_input
        assert self._source is not None
        if ki.partitions and ki.partitions != len(self._source.partitions):
            logger.warning(
                "kafka_train_input.partitions is %d but topic %s has %d partitions; "
                "reading all of them",
                ki.partitions,
                ki.topic,
                len(self._source.partitions),
            )

    def _open_input_process(self, restored_positions: Optional[dict[int, int]],
                            num_workers: int) -> None:
        """Reads and builds in a child process (``data_config.input_process``)."""
        start, args = self._kafka_start(restored_positions)
        proc = KafkaInputProcess(self.config, self.features, args, start,
                                 num_workers=num_workers)
        self._source = proc
        proc.start()
        self.state = "waiting_for_topic"
        self.positions = proc.open(self.stop_event)
        self._warn_on_partition_count()
        self._prefetcher = proc

    def _open_source_and_prefetcher(self, restored_positions: Optional[dict[int, int]],
                                    workers: Optional[FeatureBuildWorkers]) -> None:
        dc = self.config.data_config
        if self.options.online:
            start, args = self._kafka_start(restored_positions)
            source = KafkaSource(start=start, **args)
            self._source = source
            self.state = "waiting_for_topic"
            self.positions = source.open(self.stop_event)
            self._warn_on_partition_count()
            read = source.read_batch
        else:
            self._file_source = FileSource(
                self.config.train_input_path, dc.batch_size, dc.num_epochs
            )
            it = self._file_source.batches()

            def read(_stop: threading.Event):
                return next(it)

        self._prefetcher = BatchPrefetcher(
            read, self._build, workers=workers, to_batch=self.features.to_batch)
        self._prefetcher.start()

    def _build(self, values: list[bytes]):
        result = self.features.build(values)
        return result.batch, result.accepted, result.rejected

    def _loop(self) -> None:
        tc = self.config.train_config
        log_every = max(1, tc.log_step_count_steps)
        poll_secs = max(0.1, tc.stop_signal_poll_secs)
        signal_path = os.path.join(self.model_dir, STOP_SIGNAL_FILE)
        next_signal_check = 0.0
        last_ckpt_time = time.monotonic()
        last_ckpt_step = self.module.global_step
        window_start = time.monotonic()
        window_samples = 0
        assert self._prefetcher is not None
        while not self.stop_event.is_set():
            if self.publisher is not None and self.publisher.fatal_error is not None:
                # fenced: another trainer owns the delta topic (3, not restarted by systemd);
                # else a publisher bug (1: a restart resumes from the last checkpoint)
                self._fail(self.publisher.fatal_error, 3 if self.publisher.fenced else 1)
                break
            now = time.monotonic()
            if tc.enable_oss_stop_signal and now >= next_signal_check:
                next_signal_check = now + poll_secs
                if os.path.exists(signal_path):
                    self._request_stop(f"{STOP_SIGNAL_FILE} found in model_dir")
                    _consume_signal_file(signal_path)
                    break
            if self._dead_line is not None and time.time() >= self._dead_line:
                self._request_stop("dead_line reached")
                break
            if tc.HasField("num_steps") and self.module.global_step >= tc.num_steps:
                self._request_stop(f"num_steps {tc.num_steps} reached")
                break
            item = self._prefetcher.get(timeout=0.1)
            self._update_input_state()
            if item is None:
                if self._prefetcher.finished:
                    self._request_stop("end of input")
                    break
                if self.publisher is not None:  # idle input: publish the last steps now
                    with self._lock:
                        positions = dict(self.positions)
                    self.publisher.publish_if_behind(self.module.global_step, positions)
                if (self.last_checkpoint_error is not None
                        and self.module.global_step != self.checkpoints.last_saved_step
                        and time.monotonic() - last_ckpt_time >= _CHECKPOINT_RETRY_SECS):
                    # idle (no new records) after a failed checkpoint: retry without waiting
                    # for the next due step, so health recovers once the cause is gone
                    self._checkpoint()
                    last_ckpt_time = time.monotonic()
                    last_ckpt_step = self.module.global_step
                continue
            trained = self._train_on(item)
            window_samples += trained
            step = self.module.global_step
            elapsed = time.monotonic() - window_start
            if elapsed >= _RATE_WINDOW_SECS:  # the rate /status shows, refreshed every few s
                self.samples_per_sec = window_samples / elapsed
                window_start, window_samples = time.monotonic(), 0
            if trained and step % log_every == 0:
                self._log_progress()
            every_steps, every_secs = tc.save_checkpoints_steps, tc.save_checkpoints_secs
            due_steps = every_steps and step - last_ckpt_step >= every_steps
            due_secs = (
                every_secs and time.monotonic() - last_ckpt_time >= every_secs
            )
            if (due_steps or due_secs) and step != last_ckpt_step:
                self._checkpoint()
                last_ckpt_time, last_ckpt_step = time.monotonic(), step

    def _train_on(self, item: PreparedBatch) -> int:
        self.metrics.records_consumed.inc(item.num_records)
        if item.rejected:
            self._count_rejects(item)
        batch = item.batch
        trained = 0
        if batch is not None and batch.size:
            out = self.module.train_step(batch)
            labels = batch.labels.detach().cpu().numpy()
            sample_ids = batch.sample_ids
            if len(out.dropped):
                keep = np.ones(batch.size, dtype=bool)
                keep[out.dropped] = False
                labels = labels[keep]
                if sample_ids is not None:
                    sample_ids = [sid for sid, k in zip(sample_ids, keep.tolist(), strict=True)
                                  if k]
                self._reject_untrained(item, out.dropped, "non_finite_output")
            trained = out.trained
        if trained:
            self.progress.update(out.probs, labels)
            self.samples_trained += trained
            self.last_loss = float(out.loss)
            self.metrics.samples_trained.inc(trained)
            self.metrics.steps.inc()
            self.metrics.global_step.set(self.module.global_step)
            self.metrics.loss.set(self.last_loss)
            if self._ledger is not None and sample_ids is not None:
                # flushed before the step can be published (crash audits)
                self._ledger.write_step(self.generation, self.module.global_step, sample_ids)
        if len(item.raw.timestamps_ms):
            self.last_sample_time_ms = int(item.raw.timestamps_ms.max())
        with self._lock:
            self.positions.update(item.positions)
        if self.publisher is not None:
            self._maybe_publish(item)
        return trained

    def _maybe_publish(self, item: PreparedBatch) -> None:
        """Hands the step's positions and time ranges to the delta publisher."""
        assert self.publisher is not None
        event = produce = None
        times = item.batch.event_times if item.batch is not None else None
        if times is not None and len(times):
            finite = times[np.isfinite(times)]
            if len(finite):
                event = (int(finite.min() * 1000), int(finite.max() * 1000))
        if len(item.raw.timestamps_ms):
            produce = (int(item.raw.timestamps_ms.min()), int(item.raw.timestamps_ms.max()))
        with self._lock:
            positions = dict(self.positions)
        self.publisher.maybe_publish(self.module.global_step, positions, event, produce)

    def _count_rejects(self, item: PreparedBatch) -> None:
        for idx, reason in item.rejected:
            self._count_reject(item, idx, reason)
        self._reject_log.maybe_log()

    def _count_reject(self, item: PreparedBatch, idx: int, reason: str) -> None:
        """Counts, logs (bounded) and dead-letters raw record ``idx`` of ``item``."""
        self.records_rejected[reason] = self.records_rejected.get(reason, 0) + 1
        self.metrics.records_rejected.labels(reason=reason).inc()
        where = f"partition {int(item.raw.partitions[idx])} offset {int(item.raw.offsets[idx])}"
        self._reject_log.add(reason, where)
        if self._dead_letter is not None:
            # the raw value travels with builder rejects only; a record rejected after
            # building is forwarded with an empty value and its source position
            value = item.raw.values[idx] if idx < len(item.raw.values) else None
            self._dead_letter.send(
                value, reason, self.config.kafka_train_input.topic,
                int(item.raw.partitions[idx]), int(item.raw.offsets[idx]),
                int(item.raw.timestamps_ms[idx]) if len(item.raw.timestamps_ms) else 0)

    def _reject_untrained(self, item: PreparedBatch, rows: np.ndarray, reason: str) -> None:
        """Rejects batch rows ``rows`` of ``item`` (built, then not trained on)."""
        for row in rows.tolist():
            self._count_reject(item, int(item.accepted[row]), reason)
        self._reject_log.maybe_log()

    def _open_dead_letter(self) -> Optional[DeadLetterSink]:
        """The dead-letter sink of ``data_config.dead_letter_topic`` (online only), or None."""
        topic = self.config.data_config.dead_letter_topic
        if not topic:
            return None
        if not self.options.online:
            logger.warning("data_config.dead_letter_topic is ignored in offline training")
            return None
        ki = self.config.kafka_train_input
        logger.info("forwarding rejected records to dead-letter topic %s", topic)
        return DeadLetterSink(ki.server, topic, dict(ki.kafka_config), self.metrics.registry)

    def _update_input_state(self) -> None:
        src = self._source
        if src is None:
            return
        if src.broker_error is not None:
            self.metrics.broker_up.set(0)
            if self.state == "training":
                self.state = "waiting_for_broker"
        else:
            self.metrics.broker_up.set(1)
            if self.state == "waiting_for_broker":
                self.state = "training"

    def _log_progress(self) -> None:
        m = self.progress.summary()
        self._progress_cache = (time.monotonic(), m)
        self.metrics.samples_per_sec.set(self.samples_per_sec)
        if m["auc"] is not None:
            self.metrics.auc.set(m["auc"])
        if m["logloss"] is not None:
            self.metrics.logloss.set(m["logloss"])
        lags = self._lags()
        for p, lag in lags.items():
            self.metrics.lag.labels(partition=str(p)).set(lag)
        for p, pos in self.positions.items():
            self.metrics.position.labels(partition=str(p)).set(pos)
        logger.info(
            "step %d samples %d %.0f samples/s loss %.4f auc %s logloss %s (total auc %s) lag %s",
            self.module.global_step,
            self.samples_trained,
            self.samples_per_sec,
            self.last_loss if self.last_loss is not None else float("nan"),
            m["auc"],
            m["logloss"],
            m["auc_total"],
            lags,
        )

    def _lags(self) -> dict[int, int]:
        if self._source is None:
            return {}
        out = {}
        for p, st in self._source.partition_state.items():
            pos = self.positions.get(p, st.position)
            out[p] = max(0, st.high_watermark - pos) if st.high_watermark >= 0 else -1
        return out

    # ------------------------------------------------------------------ checkpoint
    def _checkpoint(self) -> bool:
        if self._recovery_incomplete:
            logger.warning("not checkpointing: crash recovery did not finish")
            return False
        if self.publisher is not None:
            # A checkpoint must equal a fully published version (the crash-recovery point).
            with self._lock:
                positions = dict(self.positions)
            # no use stalling the train loop for a delta broker known to be down
            sync_secs = 0.0 if self._delta_broker_error() else _CHECKPOINT_SYNC_SECS
            if not self.publisher.sync(self.module.global_step, positions, timeout=sync_secs):
                self.metrics.checkpoint_failures.inc()
                self.last_checkpoint_error = (
                    f"delta version {self.module.global_step} not published: checkpoint "
                    "skipped (a checkpoint must equal a published version)")
                logger.warning("%s; the next checkpoint will retry", self.last_checkpoint_error)
                return False
        prev_state = self.state
        self.state = "checkpointing"
        try:
            with self._lock:
                positions = dict(self.positions)
            source = (
                {"source": "kafka", "topic": self.config.kafka_train_input.topic}
                if self.options.online
                else {"source": "files", "path": self.config.train_input_path}
            )
            source.update(self._delta_replay_point())
            self.checkpoints.save(
                self.module.global_step,
                self.module.state_dict_for_checkpoint(),
                positions,
                source,
                self._config_text,
                self.generation,
            )
            self.metrics.checkpoint_step.set(self.module.global_step)
            self.last_checkpoint_error = None
            if self._source is not None:
                self._source.request_commit(positions)
            return True
        except CheckpointError as exc:
            self.metrics.checkpoint_failures.inc()
            self.last_checkpoint_error = str(exc)
            logger.error("%s; training continues and the next checkpoint will retry", exc)
            return False
        finally:
            self.state = prev_state if prev_state != "checkpointing" else "training"

    def _delta_replay_point(self) -> dict:
        """Where serving must start replaying the delta topic to continue this checkpoint.

        Every version published so far is at a step <= the checkpoint's, and versions carry
        full values, so replaying from just after the last delivered version is exact.
        """
        if self.publisher is None:
            return {}
        sink = self.publisher.sink
        out: dict = {}
        if hasattr(sink, "topic"):
            out["delta_topic"] = sink.topic
            out["delta_server"] = getattr(sink, "servers", "")
        last = self.publisher.status().get("last_offset")
        if last is not None and last >= 0:
            out["delta_topic_offset"] = int(last) + 1
        elif self._restored_delta_offset is not None:
            out["delta_topic_offset"] = self._restored_delta_offset
        return out

    # ------------------------------------------------------------------ stop
    def request_stop(self, reason: str) -> None:
        """Asks the loop to finish the current step, checkpoint and exit (thread/signal safe)."""
        self._request_stop(reason)

    def _request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            logger.info("stopping: %s", reason)
        self.stop_event.set()

    def _shutdown(self) -> None:
        self.state = "stopping"
        if self._prefetcher is not None:
            self._prefetcher.stop()
        self._reject_log.maybe_log(force=True)
        if self.publisher is not None:  # first, so the final checkpoint covers the last version
            self.publisher.flush(timeout=30.0, step=self.module.global_step,
                                 positions=dict(self.positions))
        elif self._delta_sink is not None:  # stopped before the publisher was built
            self._delta_sink.close()
        # one more checkpoint on every clean stop, also when the state was only brought
        # forward by crash recovery (nothing trained in this run, but a newer step); not
        # before the input was open: its positions are unknown then, and a checkpoint without
        # them would override the config's start positions on the next start
        if (self._input_opened and self.failure is None
                and self.module.global_step != self.checkpoints.last_saved_step):
            self._checkpoint()
        if self._source is not None:
            self._source.commit_now(self.positions)
            self._source.close()
        if self._ledger is not None:
            self._ledger.close()
        if self._dead_letter is not None:
            self._dead_letter.close(timeout=10.0)
        self.state = "stopped"
        if self.samples_trained:
            self._log_progress()
        if self._http is not None:
            self._http.stop()

    # ------------------------------------------------------------------ status
    def _start_status_server(self) -> None:
        if self.options.status_port < 0:
            return
        app = build_status_app(self, self.metrics.registry)
        self._http = BackgroundHttpServer(app, self.options.status_host, self.options.status_port,
                                          auth_token=self.options.auth_token,
                                          name="odl-train status API")
        port = self._http.start()
        doc = {
            "host": self.options.status_host,
            "port": port,
            "pid": os.getpid(),
            "url": f"http://{self.options.status_host}:{port}",
            "generation": self.generation,
        }
        tmp = os.path.join(self.model_dir, f".{STATUS_FILE}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(self.model_dir, STATUS_FILE))

    def status(self) -> dict:
        """The status document served at ``/status``."""
        partitions = {}
        if self._source is not None:
            with self._lock:
                positions = dict(self.positions)
            for p, st in sorted(self._source.partition_state.items()):
                pos = positions.get(p, st.position)
                partitions[str(p)] = {
                    "position": pos,
                    "high_watermark": st.high_watermark,
                    "lag": max(0, st.high_watermark - pos) if st.high_watermark >= 0 else None,
                }
        src = self._source
        return {
            "state": (
                "waiting_for_broker"
                if self.state == "training" and src is not None and src.broker_error is not None
                else self.state
            ),
            "mode": "online" if self.options.online else "offline",
            "generation": self.generation,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "global_step": self.module.global_step,
            "samples_trained": self.samples_trained,
            "samples_per_sec": round(self.samples_per_sec, 1),
            "records_consumed": src.records_consumed if src else self.samples_trained,
            "records_rejected": dict(self.records_rejected),
            "loss": self.last_loss,
            "progressive": self._progress_summary(),
            "last_checkpoint": {
                "path": self.checkpoints.last_saved_path,
                "step": self.checkpoints.last_saved_step,
                "time": self.checkpoints.last_saved_time,
                "error": self.last_checkpoint_error,
            },
            "input": {
                "topic": self.config.kafka_train_input.topic if self.options.online else None,
                "broker_error": src.broker_error if src else None,
                "queued_batches": self._prefetcher.queued if self._prefetcher else 0,
                "last_sample_time_ms": self.last_sample_time_ms,
                "partitions": partitions,
            },
            "stop_reason": self.stop_reason,
            "failure": self.failure,
            "device": str(self.module.device),
            "publisher": self.publisher.status() if self.publisher is not None else None,
            "recovery": self.recovery,
            "dead_letter": self._dead_letter.status() if self._dead_letter is not None else None,
        }

    def _progress_summary(self) -> dict:
        """Progressive metrics, recomputed when samples were added and the last is over 1 s old."""
        cached = self._progress_cache
        if cached is None or (cached[1]["samples"] != self.progress.samples
                              and time.monotonic() - cached[0] > _PROGRESS_CACHE_SECS):
            cached = (time.monotonic(), self.progress.summary())
            self._progress_cache = cached
        return cached[1]

    def offsets(self) -> dict:
        """Trained positions served at ``/offsets``."""
        with self._lock:
            positions = dict(self.positions)
        return {
            "topic": self.config.kafka_train_input.topic if self.options.online else None,
            "global_step": self.module.global_step,
            "positions": {str(p): o for p, o in sorted(positions.items())},
        }

    def _delta_broker_error(self) -> Optional[str]:
        """Why the delta publisher's broker is unreachable, or None."""
        sink = self.publisher.sink if self.publisher is not None else None
        return getattr(sink, "broker_error", None)

    def health(self) -> tuple[bool, str]:
        """Healthy unless a broker is unreachable, publishing or checkpoints fail, or stopped."""
        if self._source is not None and self._source.broker_error is not None:
            return False, f"waiting_for_broker: {self._source.broker_error}"
        delta_error = self._delta_broker_error()
        if delta_error:
            return False, f"waiting_for_broker (delta topic): {delta_error}"
        if self.publisher is not None:
            pub = self.publisher.status()
            if pub["fatal_error"]:
                return False, pub["fatal_error"]
            if pub["last_error"]:
                return False, f"delta publishing failing: {pub['last_error']}"
        if self.last_checkpoint_error:
            return False, f"checkpoint failing: {self.last_checkpoint_error}"
        if self.state in ("stopped",):
            return False, "stopped"
        return True, self.state


def _read_var_map(path: str) -> dict[str, str]:
    """Reads a ``new_name<TAB>old_name`` per line file."""
    out = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise ValueError(f"{path}:{lineno}: expected 'new_name<TAB>old_name', got {line!r}")
            out[parts[0].strip()] = parts[1].strip()
    return out


def _consume_signal_file(path: str) -> None:
    """Removes the stop signal once acted on, so the next start does not stop at once."""
    try:
        os.remove(path)
        logger.info("removed %s after acting on it", path)
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)


def mean_or_none(values: np.ndarray) -> Optional[float]:
    """Mean of an array or None when empty."""
    return float(values.mean()) if len(values) else None
