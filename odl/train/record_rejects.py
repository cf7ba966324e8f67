"""Records the trainer does not train on: counted, logged at a bounded rate, dead-lettered.

A record is rejected by the feature builder (malformed: ``field_count``, ``bad_number``, ...)
or after building, by the train step (``non_finite_output``: its prediction was not finite).
Either way it never stops the trainer. Each rejected record is

* counted by reason (``/status`` ``records_rejected``, ``odl_records_rejected_total{reason}``);
* logged in one summary line per ``_REJECT_LOG_INTERVAL_SECS`` with one example position;
* forwarded to ``data_config.dead_letter_topic`` when one is set (online only,
  :class:`~odl.inputs.dead_letter.DeadLetterSink`): builder rejects with their raw value,
  rejects after building with an empty value, both with their source position.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from odl.inputs.batch_prefetcher import PreparedBatch
from odl.inputs.dead_letter import DeadLetterSink
from odl.inputs.file_stream_source import SPLIT_KEY, split_dir
from odl.inputs.source_factory import online_input_kind, online_input_name
from odl.protos import pipeline_pb2
from odl.train.trainer_metrics import TrainerMetrics

logger = logging.getLogger(__name__)

__all__ = ["RejectedRecords"]

_REJECT_LOG_INTERVAL_SECS = 5.0


class _RejectLog:
    """Logs rejected records at a bounded rate (one summary line per interval)."""

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


class RejectedRecords:
    """Counts, logs and dead-letters the records of a batch that are not trained on.

    Args:
        config: the pipeline config (``data_config.dead_letter_topic`` and the input).
        online: Kafka input (dead letters are online only).
        metrics: the trainer's metrics.

    Attributes:
        counts: rejected records by reason.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, online: bool,
                 metrics: TrainerMetrics) -> None:
        self._config = config
        self._online = online
        self._metrics = metrics
        self._log = _RejectLog()
        self.counts: dict[str, int] = {}
        self.dead_letter: Optional[DeadLetterSink] = None

    def open_dead_letter(self) -> None:
        """Opens the dead-letter sink of ``data_config.dead_letter_topic`` (online only)."""
        topic = self._config.data_config.dead_letter_topic
        if not topic:
            return
        if not self._online:
            logger.warning("data_config.dead_letter_topic is ignored in offline training")
            return
        dc, ki = self._config.data_config, self._config.kafka_train_input
        server = dc.dead_letter_server or ki.server
        settings = dict(dc.dead_letter_kafka_config) or dict(ki.kafka_config)
        logger.info("forwarding rejected records to dead-letter topic %s on %s", topic, server)
        self.dead_letter = DeadLetterSink(server, topic, settings, self._metrics.registry)

    def built_rejects(self, item: PreparedBatch) -> None:
        """Takes the records the feature builder rejected in ``item``.

        Args:
            item: a prepared batch with ``rejected`` entries.
        """
        for idx, reason in item.rejected:
            self._reject(item, idx, reason)
        self._log.maybe_log()

    def untrained_rows(self, item: PreparedBatch, rows: np.ndarray, reason: str) -> None:
        """Takes batch rows ``rows`` of ``item``: built, then not trained on.

        Args:
            item: the prepared batch.
            rows: row indices into ``item.batch``.
            reason: why they were not trained on.
        """
        for row in rows.tolist():
            self._reject(item, int(item.accepted[row]), reason)
        self._log.maybe_log()

    def flush_log(self) -> None:
        """Logs what is not logged yet (at shutdown)."""
        self._log.maybe_log(force=True)

    def close(self) -> None:
        """Flushes and closes the dead-letter sink."""
        if self.dead_letter is not None:
            self.dead_letter.close(timeout=10.0)

    def _source_name(self, item: PreparedBatch) -> str:
        """The ``odl-source`` prefix: the topic, DataHub's ``project/topic`` or the split.

        A file-stream batch never spans two splits, so its split directory is the batch's.
        """
        name = online_input_name(self._config)
        if online_input_kind(self._config) == "file_stream" and SPLIT_KEY in item.positions:
            return split_dir(name, int(item.positions[SPLIT_KEY]))
        return name

    def _reject(self, item: PreparedBatch, idx: int, reason: str) -> None:
        """Counts, logs (bounded) and dead-letters raw record ``idx`` of ``item``."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self._metrics.records_rejected.labels(reason=reason).inc()
        where = f"partition {int(item.raw.partitions[idx])} offset {int(item.raw.offsets[idx])}"
        self._log.add(reason, where)
        if self.dead_letter is not None:
            # the raw value travels with builder rejects only; a record rejected after
            # building is forwarded with an empty value and its source position
            value = item.raw.values[idx] if idx < len(item.raw.values) else None
            self.dead_letter.send(
                value, reason, self._source_name(item),
                int(item.raw.partitions[idx]), int(item.raw.offsets[idx]),
                int(item.raw.timestamps_ms[idx]) if len(item.raw.timestamps_ms) else 0)
