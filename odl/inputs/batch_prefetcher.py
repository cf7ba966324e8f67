"""Reads and builds batches in the background so the train loop only trains.

The reader thread pulls :class:`~odl.inputs.kafka_source.RawBatch` objects from a source and
turns them into model batches, which go on a small bounded queue (back-pressure: reading
pauses while the trainer is behind). Positions travel with each batch, so whatever is still
queued when the trainer stops is simply read again next time.

Two ways to build:

* in the reader thread (``workers`` None): ``build`` parses and hashes, holding the GIL the
  train step also needs;
* in worker processes (:class:`~odl.inputs.feature_build_worker.FeatureBuildWorkers`): the
  reader thread submits each batch's records and a collector thread takes the results in
  order, wraps them as tensors (``to_batch``) and queues them. At most ``workers.capacity``
  batches are out at the workers at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from odl.inputs.feature_build_worker import FeatureBuildWorkers
from odl.inputs.kafka_source import RawBatch

if TYPE_CHECKING:  # torch stays out of the input process (odl/inputs/kafka_input_child.py)
    from odl.features.batch import Batch
    from odl.features.feature_builder import BatchArrays

logger = logging.getLogger(__name__)

END = object()  # queued after the last batch (end of input, or a failure)


@dataclass
class PreparedBatch:
    """A built batch and what it covers.

    Attributes:
        batch: the model batch, None when every record was rejected.
        positions: next offset per partition after this batch.
        num_records: records read (accepted + rejected).
        rejected: (index into the raw batch, reason) per malformed record.
        raw: the raw batch (values kept only while needed for rejected records).
        accepted: indices of the raw records that made it into ``batch``.
        read_time: when the batch left the source (time.time()).
    """

    batch: Optional[Batch]
    positions: dict[int, int]
    num_records: int
    rejected: list[tuple[int, str]]
    raw: RawBatch
    accepted: np.ndarray
    read_time: float


class PreparedBatchQueue:
    """The trainer's end of a batch source: prepared batches, then ``END``.

    Args:
        max_queued: the queue's bound (0: unbounded, the producer bounds it).
    """

    def __init__(self, max_queued: int = 0) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.finished = False

    def get(self, timeout: float) -> Optional[PreparedBatch]:
        """Next prepared batch, or None if none arrived within ``timeout`` or the input ended.

        Raises:
            RuntimeError: the input failed.
        """
        if self.finished:
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is END:
            self.finished = True
            self._raise_if_failed()
            return None
        self._taken()
        return item

    @property
    def queued(self) -> int:
        """Batches waiting for the trainer."""
        return self._queue.qsize()

    def _raise_if_failed(self) -> None:
        """Raises the input's failure, if it failed (called once, at ``END``)."""

    def _taken(self) -> None:
        """Called for each batch handed to the trainer."""


class BatchPrefetcher(PreparedBatchQueue):
    """Background reader + builder with a bounded queue.

    Args:
        read: returns the next raw batch, None when nothing is available now, and raises
            StopIteration at the end of a finite input. Receives the stop event.
        build: turns raw record values into ``(batch, accepted, rejected)`` (used when
            ``workers`` is None).
        max_queued: batches buffered ahead of the trainer.
        workers: started feature build workers; the prefetcher owns them from here on and
            closes them in ``stop``.
        to_batch: wraps a worker's arrays as a batch (required with ``workers``).
    """

    def __init__(
        self,
        read: Callable[[threading.Event], Optional[RawBatch]],
        build: Callable[[list[bytes]], tuple[Optional[Batch], np.ndarray, list[tuple[int, str]]]],
        max_queued: int = 4,
        workers: Optional[FeatureBuildWorkers] = None,
        to_batch: Optional[Callable[[BatchArrays], Batch]] = None,
    ) -> None:
        if workers is not None and to_batch is None:
            raise ValueError("to_batch is required with workers")
        super().__init__(max_queued)
        self._read = read
        self._build = build
        self._workers = workers
        self._to_batch = to_batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-reader", daemon=True)
        self._collector: Optional[threading.Thread] = None
        # raw batches submitted to the workers, oldest first (END when the input ended)
        self._submitted: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(workers.capacity if workers is not None else 0)
        self._error: Optional[BaseException] = None

    def start(self) -> None:
        """Starts the reader thread (and the collector thread when building in workers)."""
        if self._workers is not None:
            self._collector = threading.Thread(
                target=self._collect, name="batch-collector", daemon=True)
            self._collector.start()
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    raw = self._read(self._stop)
                except StopIteration:
                    self._end()
                    return
                if raw is None:
                    continue
                if self._workers is not None:
                    if not self._acquire_slot():
                        return
                    self._submitted.put(raw)
                    self._workers.submit(raw.values)
                    continue
                batch, accepted, rejected = self._build(raw.values)
                if not self._put(self._prepared(raw, batch, accepted, rejected)):
                    return
        except BaseException as exc:  # surfaced to the train loop by get()
            self._fail(exc)

    def _acquire_slot(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return False

    def _end(self) -> None:
        """The input ended: queue the end marker behind whatever is still being built."""
        if self._workers is not None:
            self._submitted.put(END)
        else:
            self._put(END)

    def _fail(self, exc: BaseException) -> None:
        if self._stop.is_set():  # e.g. a worker socket closed by stop()
            logger.debug("batch reader ended while stopping: %s", exc)
            return
        logger.error("batch reader failed: %s", exc, exc_info=exc)
        if self._error is None:
            self._error = exc
        self._put(END)

    def _collect(self) -> None:
        """Collector thread: worker results, in submission order, onto the queue."""
        assert self._workers is not None and self._to_batch is not None
        try:
            while not self._stop.is_set():
                try:
                    raw = self._submitted.get(timeout=0.1)
                except queue.Empty:
                    continue
                if raw is END:
                    self._put(END)
                    return
                result = self._workers.collect(self._stop)
                if result is None:  # stopping
                    return
                batch = self._to_batch(result.arrays) if result.arrays is not None else None
                self._slots.release()
                if not self._put(self._prepared(raw, batch, result.accepted, result.rejected)):
                    return
        except BaseException as exc:
            self._fail(exc)

    @staticmethod
    def _prepared(raw: RawBatch, batch: Optional[Batch], accepted: np.ndarray,
                  rejected: list[tuple[int, str]]) -> PreparedBatch:
        if not rejected:
            raw.values = []  # not needed any more; frees memory early
        return PreparedBatch(
            batch=batch,
            positions=raw.positions,
            num_records=len(raw.partitions),
            rejected=rejected,
            raw=raw,
            accepted=accepted,
            read_time=time.time(),
        )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"input reader failed: {self._error}") from self._error

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the threads and the workers.

        Nothing more is read or built. Batches still queued are not trained: the trainer stops
        taking them, checkpoints the positions of what it trained, and reads them again on
        the next start.
        """
        self._stop.set()
        if self._collector is not None:
            self._collector.join(timeout)
        if self._workers is not None:
            self._workers.close()  # also wakes a reader blocked sending to a worker
        self._thread.join(timeout)
