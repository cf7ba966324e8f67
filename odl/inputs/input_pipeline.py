"""The trainer's input: one interface over the three ways records are read and built.

:func:`build_input_pipeline` picks the layout from the mode and the config:

* **online, ``data_config.input_process`` (the default)**: :class:`KafkaProcessInput`, a
  :class:`~odl.inputs.kafka_input_process.KafkaInputProcess` child process that consumes,
  parses and builds; the trainer's process only receives finished arrays;
* **online, ``input_process: false``**: :class:`KafkaThreadInput`, a
  :class:`~odl.inputs.kafka_source.KafkaSource` read by a
  :class:`~odl.inputs.batch_prefetcher.BatchPrefetcher` in threads of the trainer's process;
* **offline**: :class:`FileInput`, a :class:`~odl.inputs.file_source.FileSource` read by a
  ``BatchPrefetcher``.

Online, the source is a Kafka topic or a DataHub topic
(:mod:`odl.inputs.datahub_source`), chosen by :mod:`odl.inputs.source_factory`; both hand
out batches with positions per partition (DataHub: per shard, the next sequence), so every
layout, checkpoints and crash recovery treat them alike.

The two prefetcher layouts build in ``num_workers`` feature build worker processes when
that is > 0 (:mod:`odl.inputs.feature_build_worker`); the child process starts its own.

Every layout is an :class:`InputPipeline`: ``open`` resolves the start positions (Kafka: the
checkpoint's, else the config's ``offset_info`` / ``offset_time`` / ``offset``), ``get``
hands out built batches with the positions after each, and ``close`` commits the trained
positions to the consumer group (monitoring only; the checkpoint is the source of truth).
Batches still queued when the trainer stops are dropped and read again on the next start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Protocol

from odl.inputs.batch_prefetcher import BatchPrefetcher, PreparedBatch
from odl.inputs.feature_build_worker import FeatureBuildWorkers
from odl.inputs.file_source import FileSource
from odl.inputs.kafka_input_process import KafkaInputProcess
from odl.inputs.kafka_source import (
    KafkaSource,
    PartitionState,
    RawBatch,
)
from odl.inputs.source_factory import (
    build_source,
    online_source_args,
    source_retention,
    source_status,
)
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    from odl.features.batch import Batch
    from odl.features.feature_builder import FeatureBuilder

logger = logging.getLogger(__name__)

__all__ = [
    "FileInput",
    "InputPipeline",
    "KafkaProcessInput",
    "KafkaThreadInput",
    "build_input_pipeline",
]


class InputPipeline(Protocol):
    """What the train loop uses of its input, whichever layout runs."""

    @property
    def finished(self) -> bool:
        """True once a finite input has handed out its last batch."""
        ...

    @property
    def queued(self) -> int:
        """Built batches waiting for the trainer."""
        ...

    @property
    def partition_state(self) -> Mapping[int, PartitionState]:
        """Live position and watermarks per partition (empty for files)."""
        ...

    @property
    def broker_error(self) -> Optional[str]:
        """Why the broker is unreachable (or the topic missing), or None."""
        ...

    @property
    def records_consumed(self) -> int:
        """Records read from the input so far."""
        ...

    @property
    def source_status(self) -> dict[str, Any]:
        """What the source reports of itself beyond partitions (a file stream's splits)."""
        ...

    @property
    def retention(self) -> Optional[dict[str, Any]]:
        """Whether retention will delete records before they are read.

        Per partition and in all (``odl.inputs.retention_risk.RetentionReport.as_dict``);
        None where the source has no such thing (files, DataHub, a file stream) or before the
        first report.
        """
        ...

    def open(self, stop_event: threading.Event) -> dict[int, int]:
        """Starts reading, once the start positions are known.

        Args:
            stop_event: aborts waiting (for the broker or the topic) when set.

        Returns:
            The start position (next offset) per partition; empty for files.

        Raises:
            InterruptedError: ``stop_event`` was set while waiting.
        """
        ...

    def get(self, timeout: float) -> Optional[PreparedBatch]:
        """The next built batch, or None if none arrived within ``timeout`` or the input ended.

        Raises:
            RuntimeError: the input failed.
        """
        ...

    def stop(self) -> None:
        """Stops reading and building; queued batches are dropped."""
        ...

    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Asks for ``positions`` to be committed to the consumer group (monitoring only)."""
        ...

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Sets the positions committed when the input is closed."""
        ...

    def close(self) -> None:
        """Releases the source (Kafka: commits, closes the consumer or ends the child)."""
        ...


def _warn_on_partition_count(ki: pipeline_pb2.KafkaServer, partitions: list[int]) -> None:
    """Logs a partition count that differs from the config's (an informational field)."""
    if ki.partitions and ki.partitions != len(partitions):
        logger.warning(
            "kafka_train_input.partitions is %d but topic %s has %d partitions; "
            "reading all of them",
            ki.partitions,
            ki.topic,
            len(partitions),
        )


class _PrefetchedInput:
    """Batches built by a :class:`BatchPrefetcher` in threads of this process.

    Args:
        features: the trainer's feature builder.
        workers: started feature build workers (None: build in the reader thread); owned
            from here on.
    """

    def __init__(self, features: FeatureBuilder, workers: Optional[FeatureBuildWorkers]) -> None:
        self._features = features
        self._workers = workers
        self._prefetcher: Optional[BatchPrefetcher] = None

    def _start_prefetcher(self, read: Any) -> None:
        self._prefetcher = BatchPrefetcher(
            read, self._build, workers=self._workers, to_batch=self._features.to_batch)
        self._prefetcher.start()

    def _build(self, values: list[bytes]) -> tuple[Optional[Batch], Any, list[tuple[int, str]]]:
        result = self._features.build(values)
        return result.batch, result.accepted, result.rejected

    @property
    def finished(self) -> bool:
        """True once a finite input has handed out its last batch."""
        return self._prefetcher is not None and self._prefetcher.finished

    @property
    def queued(self) -> int:
        """Built batches waiting for the trainer."""
        return self._prefetcher.queued if self._prefetcher is not None else 0

    def get(self, timeout: float) -> Optional[PreparedBatch]:
        """The next built batch, or None (see :meth:`InputPipeline.get`)."""
        return self._prefetcher.get(timeout) if self._prefetcher is not None else None

    def stop(self) -> None:
        """Stops the reader (and collector) threads and the workers."""
        if self._prefetcher is not None:
            self._prefetcher.stop()
        elif self._workers is not None:
            self._workers.close()


class KafkaThreadInput(_PrefetchedInput):
    """Online input read and built in threads of the trainer's process.

    Args:
        source: the Kafka source (not yet open).
        kafka_input: the config's ``kafka_train_input``.
        features: the trainer's feature builder.
        workers: started feature build workers, or None.
    """

    def __init__(self, source: KafkaSource, kafka_input: pipeline_pb2.KafkaServer,
                 features: FeatureBuilder, workers: Optional[FeatureBuildWorkers]) -> None:
        super().__init__(features, workers)
        self._source = source
        self._kafka_input = kafka_input

    def open(self, stop_event: threading.Event) -> dict[int, int]:
        """Assigns the partitions at their start positions and starts reading.

        Args:
            stop_event: aborts waiting for the broker or the topic.

        Returns:
            The start position per partition.
        """
        try:
            positions = self._source.open(stop_event)
            _warn_on_partition_count(self._kafka_input, self._source.partitions)
            self._start_prefetcher(self._source.read_batch)
        except BaseException:
            self.stop()
            raise
        return positions

    @property
    def partition_state(self) -> Mapping[int, PartitionState]:
        """Live position and watermarks per partition."""
        return self._source.partition_state

    @property
    def broker_error(self) -> Optional[str]:
        """Why the broker is unreachable (or the topic missing), or None."""
        return self._source.broker_error

    @property
    def source_status(self) -> dict[str, Any]:
        """The source's own report (a file stream's splits), empty for Kafka and DataHub."""
        return source_status(self._source)

    @property
    def retention(self) -> Optional[dict[str, Any]]:
        """The Kafka source's retention risk report (None before the first)."""
        return source_retention(self._source)

    @property
    def records_consumed(self) -> int:
        """Records read from Kafka so far."""
        return self._source.records_consumed

    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Commits ``positions`` to the consumer group on the next read."""
        self._source.request_commit(positions)

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Commits ``positions`` to the consumer group now."""
        self._source.commit_now(positions)

    def close(self) -> None:
        """Closes the consumer."""
        self._source.close()


class FileInput(_PrefetchedInput):
    """Offline input: CSV or Parquet files, read and built in threads of this process.

    Args:
        pattern: ``train_input_path`` (globs, comma separated).
        batch_size: records per batch.
        num_epochs: passes over the files.
        features: the trainer's feature builder.
        workers: started feature build workers, or None.
        rank: this rank of ``world_size`` (it reads its share of the batches,
            ``odl.inputs.file_source.FileSource``).
        world_size: ranks training the model together.
    """

    def __init__(self, pattern: str, batch_size: int, num_epochs: int,
                 features: FeatureBuilder, workers: Optional[FeatureBuildWorkers],
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(features, workers)
        self._args = (pattern, batch_size, num_epochs, rank, world_size)
        self._source: Optional[FileSource] = None

    def open(self, stop_event: threading.Event) -> dict[int, int]:
        """Finds the files and starts reading.

        Args:
            stop_event: unused (files need no waiting).

        Returns:
            An empty dict: file batches carry no positions.

        Raises:
            FileNotFoundError: ``train_input_path`` matches no files.
        """
        try:
            self._source = FileSource(*self._args)
            batches = self._source.batches()

            def read(_stop: threading.Event) -> Optional[RawBatch]:
                return next(batches)

            self._start_prefetcher(read)
        except BaseException:
            self.stop()
            raise
        return {}

    @property
    def partition_state(self) -> Mapping[int, PartitionState]:
        """Empty: files have no partitions."""
        return {}

    @property
    def broker_error(self) -> Optional[str]:
        """Always None."""
        return None

    @property
    def source_status(self) -> dict[str, Any]:
        """Empty: offline files report nothing more."""
        return {}

    @property
    def retention(self) -> Optional[dict[str, Any]]:
        """None: files have no retention."""
        return None

    @property
    def records_consumed(self) -> int:
        """Records read from the files so far."""
        return self._source.records_consumed if self._source is not None else 0

    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit for files."""

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Nothing to commit for files."""

    def close(self) -> None:
        """Nothing to release (the reader closes each file at its end)."""


class KafkaProcessInput:
    """Online input read and built in a child process (``data_config.input_process``).

    Args:
        process: the input process (not yet started).
        kafka_input: the config's ``kafka_train_input``.
    """

    def __init__(self, process: KafkaInputProcess, kafka_input: pipeline_pb2.KafkaServer) -> None:
        self._process = process
        self._kafka_input = kafka_input

    @property
    def pid(self) -> Optional[int]:
        """The child's process id (None before ``open``)."""
        return self._process.pid

    def open(self, stop_event: threading.Event) -> dict[int, int]:
        """Starts the child and waits until it has assigned the partitions.

        Args:
            stop_event: aborts waiting for the child, the broker or the topic.

        Returns:
            The start position per partition.
        """
        self._process.start()
        positions = self._process.open(stop_event)
        _warn_on_partition_count(self._kafka_input, self._process.partitions)
        return positions

    @property
    def finished(self) -> bool:
        """True once the child has ended its input (after a failure)."""
        return self._process.finished

    @property
    def queued(self) -> int:
        """Batches received from the child, waiting for the trainer."""
        return self._process.queued

    @property
    def partition_state(self) -> Mapping[int, PartitionState]:
        """Per partition state, as the child last reported it."""
        return self._process.partition_state

    @property
    def broker_error(self) -> Optional[str]:
        """The child's broker error, as it last reported it."""
        return self._process.broker_error

    @property
    def source_status(self) -> dict[str, Any]:
        """The source's own report, as the child last sent it."""
        return self._process.source_status

    @property
    def retention(self) -> Optional[dict[str, Any]]:
        """The retention risk report, as the child last sent it (None: DataHub, file streams)."""
        return self._process.retention

    @property
    def records_consumed(self) -> int:
        """Records the child has read from Kafka, as it last reported."""
        return self._process.records_consumed

    def get(self, timeout: float) -> Optional[PreparedBatch]:
        """The next batch from the child, or None (see :meth:`InputPipeline.get`)."""
        return self._process.get(timeout)

    def stop(self) -> None:
        """Stops taking batches; ``close`` ends the child."""
        self._process.stop()

    def request_commit(self, positions: Mapping[int, int]) -> None:
        """Asks the child to commit ``positions`` to the consumer group."""
        self._process.request_commit(dict(positions))

    def commit_now(self, positions: Mapping[int, int]) -> None:
        """Sets the positions the child commits when it is closed."""
        self._process.commit_now(dict(positions))

    def close(self) -> None:
        """Tells the child to commit, close its consumer and exit, and waits for it."""
        self._process.close()


def build_input_pipeline(
    config: pipeline_pb2.EasyRecConfig,
    features: FeatureBuilder,
    online: bool,
    restored_positions: Optional[dict[int, int]],
    num_workers: int,
    rank: int = 0,
    world_size: int = 1,
) -> InputPipeline:
    """Builds the input layout that ``config`` and the mode ask for (see the module docstring).

    Feature build workers of the in-process layouts are started here, so that their start-up
    overlaps opening the input.

    Args:
        config: the pipeline config.
        features: the trainer's feature builder.
        online: Kafka (True) or ``train_input_path`` files (False).
        restored_positions: positions from the restored checkpoint (Kafka only; None: the
            config's start positions).
        num_workers: feature build worker processes (0: build in the reader).
        rank: this rank of ``world_size`` (a Kafka input reads its share of the partitions,
            a file input its share of the batches).
        world_size: ranks training the model together.

    Returns:
        The input, not yet open.
    """
    dc = config.data_config
    if online and dc.input_process:
        start, args = online_source_args(config, restored_positions, rank, world_size)
        process = KafkaInputProcess(config, features, args, start, num_workers=num_workers)
        return KafkaProcessInput(process, config.kafka_train_input)
    workers = FeatureBuildWorkers(config, num_workers).start() if num_workers else None
    try:
        if online:
            start, args = online_source_args(config, restored_positions, rank, world_size)
            return KafkaThreadInput(build_source(start, args), config.kafka_train_input,
                                    features, workers)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return FileInput(config.train_input_path, dc.batch_size, dc.num_epochs, features, workers,
                     rank, world_size)
