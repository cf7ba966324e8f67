"""Evaluation beside online training on a held-out stream (Kafka or DataHub).

The stream is ``kafka_eval_input`` or ``datahub_eval_input``: a held-out topic, or, in
EasyRec's online-training form, the training topic itself read with positions of its own
(Kafka: another consumer group). On the training topic the evaluation scores records that
training may already have learned from, so its figures trail the progressive metrics (which
score each record before training on it); the result says ``reads_training_topic``.

At every checkpoint the trainer scores, with the model of that step, the records of the eval
topic it has not scored yet: every record that arrived since the last evaluation, or the
oldest ``eval_config.num_examples`` of them. It reads up to the topic's end offsets (DataHub:
each shard's latest sequence) as they were when the evaluation started, builds the records
with the trainer's feature builder,
predicts in eval mode (no training, no dynamic-table admission: ids the model has never
admitted contribute nothing, as in serving; TorchEasyRec's dense EMA in place of the dense
parameters where ``eval_config.use_dense_ema`` says, ``odl.train.dense_ema``) and reports

* AUC, logloss and the positive-label rate of the scored records (and GAUC when a
  ``grouped_auc`` metric names a grouping column), of the first output, and per output of a
  multi-task model;
* in ``/status`` (``evaluation``: the last result with its step and sample count), in
  ``/metrics`` (``odl_eval_auc``, ``odl_eval_logloss``, ``odl_eval_samples``) and in the log.

The eval topic's next positions (offsets per partition, DataHub: sequences per shard) are
saved in every checkpoint (its ``source`` entry ``"eval_positions"``), so a restarted trainer
goes on with the records after them; without a checkpoint it starts where the section's
``offset_info`` / ``offset_time`` / ``offset`` say (as for the train input of the same kind),
else at the earliest records. With several ranks rank 0 alone reads and scores; the trainer
makes the other ranks join each prediction (:func:`evaluate_at_checkpoint`). Malformed records are
skipped (counted in the result as ``rejected``). An unreachable broker or DataHub makes one
evaluation report an error; training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import numpy as np
import requests
from confluent_kafka import Consumer, KafkaException, TopicPartition
from datahub.exceptions import DatahubException

from odl.auc import grouped_auc, roc_auc
from odl.config.field_formats import parse_offset_info, parse_offset_time
from odl.config.input_validation import eval_reads_training_topic
from odl.config.loss_settings import regression_outputs
from odl.config.metric_settings import grouped_auc_reduction
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.inputs.datahub_source import DatahubSource, datahub_endpoint, parse_datahub_start
from odl.inputs.start_positions import start_positions_from_config
from odl.kafka.client_settings import consumer_config
from odl.protos import pipeline_pb2
from odl.train.distributed import from_rank0
from odl.train.progressive_metrics import log_loss
from odl.train.train_module import TrainModule
from odl.train.trainer_metrics import TrainerMetrics

logger = logging.getLogger(__name__)

# Seconds one evaluation waits for records it knows exist (below the end offsets it saw).
_READ_TIMEOUT_SECS = 30.0


def _round(v: float) -> Optional[float]:
    return None if v != v else round(float(v), 6)


class _KafkaReader:
    """The records of a Kafka eval topic not scored yet (``kafka_eval_input``)."""

    def __init__(self, ks: pipeline_pb2.KafkaServer,
                 positions: Optional[Mapping[int, int]]) -> None:
        self.topic = ks.topic
        self._consumer = Consumer(consumer_config(ks.server, ks.group + "-eval",
                                                  dict(ks.kafka_config)))
        self._positions: dict[int, int] = {int(p): int(o) for p, o in (positions or {}).items()}
        # a fresh start: the section's offset_info / offset_time / offset, else the earliest
        self._start = start_positions_from_config(
            parse_offset_info(ks.offset_info, "kafka_eval_input.offset_info")
            if ks.offset_info else None,
            int(parse_offset_time(ks.offset_time) or 0), list(ks.offset),
            dict(self._positions) if positions is not None else None)

    def positions(self) -> dict[int, int]:
        """The next offset to score per partition."""
        return dict(self._positions)

    def _partitions(self) -> list[int]:
        meta = self._consumer.list_topics(self.topic, timeout=10)
        topic = meta.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            raise KafkaException(f"eval topic {self.topic!r} has no partitions")
        return sorted(topic.partitions)

    def read(self, limit: int) -> list[bytes]:
        """The records to score (at most ``limit``; 0: all).

        From the saved positions up to the end offsets seen now.
        """
        ends: dict[int, int] = {}
        assign = []
        partitions = self._partitions()
        if self._start is not None:  # the first evaluation of a fresh start
            self._positions.update(self._first_positions(partitions))
            self._start = None
        for p in partitions:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p),
                                                             timeout=10)
            start = max(self._positions.get(p, low), low)
            self._positions[p] = start
            if high > start:
                ends[p] = high
                assign.append(TopicPartition(self.topic, p, start))
        if not assign:
            return []
        self._consumer.assign(assign)
        values: list[bytes] = []
        deadline = time.monotonic() + _READ_TIMEOUT_SECS
        while ends and time.monotonic() < deadline:
            if limit and len(values) >= limit:
                break
            for msg in self._consumer.consume(num_messages=1000, timeout=0.5):
                if msg.error() is not None:
                    continue
                p, off = msg.partition(), msg.offset()
                if p not in ends or off < self._positions[p]:
                    continue
                if limit and len(values) >= limit:
                    break
                values.append(msg.value() or b"")
                self._positions[p] = off + 1
                if self._positions[p] >= ends[p]:
                    del ends[p]
        self._consumer.unassign()
        return values

    def _first_positions(self, partitions: list[int]) -> dict[int, int]:
        """Where a fresh start begins: the configured offsets or time, else the earliest."""
        start = self._start
        assert start is not None
        if start.checkpoint is not None:
            return dict(start.checkpoint)
        if start.offsets is not None:
            return {p: o for p, o in start.offsets.items() if p in partitions}
        if start.timestamp_s is not None:
            ms = int(start.timestamp_s * 1000)
            found = self._consumer.offsets_for_times(
                [TopicPartition(self.topic, p, ms) for p in partitions], timeout=10)
            out = {}
            for tp in found:
                if tp.offset >= 0:
                    out[tp.partition] = tp.offset
                else:  # nothing at or after the time yet: from the end
                    out[tp.partition] = self._consumer.get_watermark_offsets(
                        TopicPartition(self.topic, tp.partition), timeout=10)[1]
            return out
        return {}

    def close(self) -> None:
        """Closes the consumer."""
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError):  # already closed
            pass


class _DatahubReader:
    """The records of a DataHub eval topic not scored yet (``datahub_eval_input``)."""

    def __init__(self, ds: pipeline_pb2.DatahubServer, batch_size: int,
                 positions: Optional[Mapping[int, int]]) -> None:
        self.topic = f"{ds.project}/{ds.topic}"
        start = parse_datahub_start(ds.offset_info, ds.offset_time,
                                    {int(k): int(v) for k, v in positions.items()}
                                    if positions is not None else None)
        self._batch_size = max(1, int(batch_size))
        self._source = DatahubSource(datahub_endpoint(ds.endpoint, ds.region), ds.akId,
                                     ds.akSecret, ds.project, ds.topic, start,
                                     self._batch_size, batch_timeout_ms=50)
        self._positions: dict[int, int] = {int(p): int(o) for p, o in (positions or {}).items()}
        self._opened = False

    def positions(self) -> dict[int, int]:
        """The next sequence to score per shard."""
        return dict(self._positions)

    def read(self, limit: int) -> list[bytes]:
        """The records to score (at most ``limit``; 0: all).

        From the saved sequences up to each shard's latest one seen now.
        """
        stop = threading.Event()
        timer = threading.Timer(_READ_TIMEOUT_SECS, stop.set)
        timer.start()
        try:
            if not self._opened:
                self._positions = self._source.open(stop)
                self._opened = True
            ends = self._source.end_positions(stop)
            values: list[bytes] = []
            while any(self._positions.get(p, 0) < e for p, e in ends.items()):
                want = self._batch_size if not limit else min(self._batch_size,
                                                              limit - len(values))
                if want <= 0 or stop.is_set():
                    break
                self._source.batch_size = want
                batch = self._source.read_batch(stop)
                if batch is None:
                    break
                values += batch.values
                self._positions.update(batch.positions)
            return values
        finally:
            timer.cancel()

    def close(self) -> None:
        """Releases the HTTP session."""
        self._source.close()


class StreamEvaluator:
    """Scores a held-out topic with the trainer's model (module docstring).

    Args:
        config: the pipeline config (``kafka_eval_input`` or ``datahub_eval_input``,
            ``eval_config``).
        features: the trainer's feature builder.
        predict: ``batch -> probabilities`` (``TrainModule.predict``), ``[B]`` or
            ``[B, outputs]``.
        outputs: ``(output name, label column)`` per scored output
            (``CtrModel.metric_outputs``; by default every output of the model).
        positions: the eval topic's next position per partition / shard (from a checkpoint),
            or None.
        regression: per scored output, whether it is a regression (None: per model output,
            ``regression_outputs``).
        scored: ``(predictions [N, outputs], labels [N, columns]) -> scored predictions``
            (``CtrModel.metric_predictions``), or None: the predictions as they are.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, features: FeatureBuilder,
                 predict: Any, outputs: list[tuple[str, int]],
                 positions: Optional[Mapping[int, int]] = None,
                 regression: Optional[list[bool]] = None,
                 scored: Optional[Callable[[np.ndarray, np.ndarray], np.ndarray]] = None
                 ) -> None:
        self._features = features
        self._predict = predict
        self._outputs = list(outputs)
        self._scored = scored
        self._batch_size = max(1, int(config.data_config.batch_size))
        self._limit = int(config.eval_config.num_examples)
        self._gauc_reduction = grouped_auc_reduction(config)
        self._regression = (list(regression) if regression is not None
                            else regression_outputs(config))
        self._reader: Union[_KafkaReader, _DatahubReader] = (
            _KafkaReader(config.kafka_eval_input, positions)
            if config.kafka_eval_input.topic else
            _DatahubReader(config.datahub_eval_input, self._batch_size, positions))
        self.topic = self._reader.topic
        self.reads_training_topic = eval_reads_training_topic(config)
        if self.reads_training_topic:
            logger.info("the evaluation reads the training topic %s with positions of its own "
                        "(EasyRec's form): it scores records training may have learned from, "
                        "so its AUC trails the progressive AUC, which scores each record "
                        "before training on it", self.topic)
        self.last: Optional[dict[str, Any]] = None
        self.evaluations = 0
        self.samples_total = 0  # records scored by this process's evaluations

    def positions(self) -> dict[int, int]:
        """The next position to score per partition / shard (what a checkpoint saves)."""
        return self._reader.positions()

    def evaluate(self, step: int) -> dict[str, Any]:
        """Scores the records not scored yet with the model of ``step``.

        Args:
            step: the global step of the model.

        Returns:
            The result (also kept as ``last``): ``step``, ``reads_training_topic``,
            ``samples``, ``samples_total`` (since the trainer started), ``rejected``, ``auc``,
            ``logloss``, ``positive_rate``, [``gauc``], [``tasks``], ``seconds``, ``error``.
        """
        t0 = time.monotonic()
        result: dict[str, Any] = {"step": int(step), "time": time.time(),
                                  "reads_training_topic": self.reads_training_topic}
        try:
            values = self._reader.read(self._limit)
        except (KafkaException, DatahubException, requests.exceptions.RequestException,
                InterruptedError) as exc:
            logger.warning("evaluation at step %d: cannot read %s: %s", step, self.topic, exc)
            result.update(samples=0, rejected=0, error=str(exc),
                          seconds=round(time.monotonic() - t0, 3))
            self.last = result
            return result
        probs, labels, groups, rejected = [], [], [], 0
        for i in range(0, len(values), self._batch_size):
            built = self._features.build(values[i : i + self._batch_size])
            rejected += len(built.rejected)
            if built.batch is None:
                continue
            p = np.asarray(self._predict(built.batch), dtype=np.float64)
            probs.append(p.reshape(p.shape[0], -1))
            y = built.batch.labels.detach().cpu().numpy()
            labels.append(y.reshape(y.shape[0], -1))
            if built.batch.group_keys is not None:
                groups.append(built.batch.group_keys)
        result.update(samples=int(sum(len(p) for p in probs)), rejected=rejected, error=None)
        self.samples_total += result["samples"]
        result["samples_total"] = self.samples_total
        if probs:
            p_all = np.concatenate(probs)
            y_all = np.concatenate(labels)
            if self._scored is not None:  # the model's scored view (one per task)
                p_all = self._scored(p_all, y_all)
                p_all = p_all.reshape(p_all.shape[0], -1)
            g_all = np.concatenate(groups) if groups else None
            scores = [self._scores(p_all[:, i], y_all[:, col], g_all, self._regression[i])
                      for i, (_name, col) in enumerate(self._outputs)]
            result.update(scores[0])
            if len(self._outputs) > 1:
                result["tasks"] = {name: s for (name, _c), s in zip(self._outputs, scores,
                                                                     strict=True)}
        result["seconds"] = round(time.monotonic() - t0, 3)
        self.last = result
        self.evaluations += 1
        logger.info("evaluation at step %d: %d records of %s, auc %s logloss %s%s (%.2fs)",
                    step, result["samples"], self.topic, result.get("auc"),
                    result.get("logloss"),
                    f" gauc {result['gauc']}" if "gauc" in result else "", result["seconds"])
        return result

    def _scores(self, probs: np.ndarray, labels: np.ndarray,
                groups: Optional[np.ndarray], regression: bool = False) -> dict[str, Any]:
        if regression:  # predicted values: squared error, no AUC / logloss
            return {"mse": _round(float(np.mean(np.square(probs - labels)))),
                    "positive_rate": _round(float(np.mean(labels)))}
        labels = (labels > 0).astype(np.float64)  # a ZILN model's values: positive or not
        out = {"auc": _round(roc_auc(labels > 0.5, probs)),
               "logloss": _round(log_loss(probs, labels)),
               "positive_rate": _round(float(np.mean(labels)))}
        if groups is not None:
            out["gauc"] = _round(grouped_auc(labels > 0.5, probs, groups,
                                             self._gauc_reduction))
        return out

    def close(self) -> None:
        """Closes the reader (its consumer or HTTP session)."""
        self._reader.close()


def rank_predict(module: TrainModule) -> Callable[[Batch], np.ndarray]:
    """Rank 0's predict for the evaluator: with several ranks the others join each one."""
    if module.world_size == 1:
        return module.predict

    def predict(batch: Batch) -> np.ndarray:
        from_rank0(True)  # one more batch: the other ranks take part in its forward
        return module.predict(batch)

    return predict


def evaluate_at_checkpoint(evaluator: StreamEvaluator | None, module: TrainModule,
                           metrics: TrainerMetrics) -> None:
    """Scores the eval stream's new records and sets the eval gauges.

    Several ranks (a collective): rank 0 reads and scores; every other rank joins each of
    its predictions with an empty batch until rank 0 says it is done.

    Args:
        evaluator: rank 0's evaluator (None on the other ranks).
        module: the model.
        metrics: the trainer's metrics.
    """
    # (TorchEasyRec's dense EMA predicts in place of the parameters where configured)
    with module.dense_ema.swapped() if module.evaluates_dense_ema else contextlib.nullcontext():
        if module.world_size > 1 and module.rank != 0:
            while from_rank0(None):
                module.predict(module.empty_batch())
            return
        try:
            assert evaluator is not None
            result = evaluator.evaluate(module.global_step)
            metrics.eval_samples.set(result["samples"])
            for key, gauge in (("auc", metrics.eval_auc), ("logloss", metrics.eval_logloss)):
                if result.get(key) is not None:
                    gauge.set(result[key])
        finally:
            if module.world_size > 1:
                from_rank0(False)
