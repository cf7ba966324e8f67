"""Reads and builds batches in a background thread so the train loop only trains.

The reader thread pulls :class:`~odl.inputs.kafka_source.RawBatch` objects from a source,
turns them into model batches with the feature builder and puts them on a small bounded queue
(back-pressure: reading pauses while the trainer is behind). Positions travel with each batch,
so whatever is still queued when the trainer stops is simply read again next time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

from odl.features.batch import Batch
from odl.inputs.kafka_source import RawBatch

logger = logging.getLogger(__name__)

_END = object()


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


class BatchPrefetcher:
    """Background reader + builder with a bounded queue.

    Args:
        read: returns the next raw batch, None when nothing is available now, and raises
            StopIteration at the end of a finite input. Receives the stop event.
        build: turns raw record values into ``(batch, accepted, rejected)``.
        max_queued: batches buffered ahead of the trainer.
    """

    def __init__(
        self,
        read: Callable[[threading.Event], Optional[RawBatch]],
        build: Callable[[list[bytes]], tuple[Optional[Batch], np.ndarray, list[tuple[int, str]]]],
        max_queued: int = 4,
    ) -> None:
        self._read = read
        self._build = build
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-reader", daemon=True)
        self._error: Optional[BaseException] = None
        self.finished = False
        self.build_seconds = 0.0
        self.read_seconds = 0.0

    def start(self) -> None:
        """Starts the reader thread."""
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
                t0 = time.perf_counter()
                try:
                    raw = self._read(self._stop)
                except StopIteration:
                    self._put(_END)
                    return
                t1 = time.perf_counter()
                self.read_seconds += t1 - t0
                if raw is None:
                    continue
                batch, accepted, rejected = self._build(raw.values)
                self.build_seconds += time.perf_counter() - t1
                if not rejected:
                    raw.values = []  # not needed any more; frees memory early
                item = PreparedBatch(
                    batch=batch,
                    positions=raw.positions,
                    num_records=len(raw.partitions),
                    rejected=rejected,
                    raw=raw,
                    accepted=accepted,
                    read_time=time.time(),
                )
                if not self._put(item):
                    return
        except BaseException as exc:  # surfaced to the train loop by get()
            logger.exception("batch reader failed")
            self._error = exc
            self._put(_END)

    def get(self, timeout: float) -> Optional[PreparedBatch]:
        """Next prepared batch, or None if none arrived within ``timeout``.

        Raises:
            RuntimeError: the reader thread failed.
        """
        if self.finished:
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END:
            self.finished = True
            if self._error is not None:
                raise RuntimeError(f"input reader failed: {self._error}") from self._error
            return None
        return item

    @property
    def queued(self) -> int:
        """Batches waiting for the trainer."""
        return self._queue.qsize()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the reader thread (queued batches are dropped; they are re-read next start)."""
        self._stop.set()
        self._thread.join(timeout)
