"""The Kafka input in a child process, seen from the trainer: ``KafkaInputProcess``.

In the trainer's own process the input (``KafkaSource.read_batch`` and feature building,
Python and numpy) shares the GIL and the interpreter with the train step, and the step runs
slower beside it (docs/benchmarks.md). ``KafkaInputProcess`` runs the whole input in one
child process instead (:mod:`odl.inputs.kafka_input_child`) and only receives finished
arrays, which it wraps as tensors without a copy.

The object offers what the trainer uses of a ``KafkaSource`` (``open``, ``partitions``,
``partition_state``, ``broker_error``, ``records_consumed``, ``retention`` (its report),
``request_commit``, ``commit_now``, ``close``) and of a ``BatchPrefetcher`` (``get``,
``finished``, ``queued``, ``stop``), so the train loop is the same with or without it.
Positions travel with every batch; the trainer checkpoints the positions of what it trained,
so batches still in flight when it stops are read again on the next start.

A receiver thread turns the child's messages (:mod:`odl.inputs.input_process_messages`)
into queued batches and the source's live state. Flow control is by credit: the trainer
grants ``max_queued`` batches at start and one more for each batch it takes; the child's
own prefetcher holds at most ``max_queued`` more. A child that fails or exits ends the
batch stream, and ``open`` / ``get`` raise with its reason.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Optional

from odl.inputs.batch_prefetcher import END, PreparedBatch, PreparedBatchQueue
from odl.inputs.child_process import spawn_child
from odl.inputs.input_process_messages import (
    FAILED,
    TIMEOUT,
    CloseRequest,
    CommitRequest,
    CreditGrant,
    InputBatch,
    InputClosed,
    InputFailure,
    InputOpened,
    InputProcessInit,
    InputStatus,
    ToChild,
)
from odl.inputs.kafka_source import PartitionState, RawBatch
from odl.inputs.start_positions import StartPositions
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    from odl.features.feature_builder import FeatureBuilder

logger = logging.getLogger(__name__)

# Seconds the child may take to import its modules and start (it answers InputOpened later).
_START_TIMEOUT_SECS = 120.0
# Seconds close() waits for the child to commit, close its consumer and exit.
_CLOSE_TIMEOUT_SECS = 15.0


class InputProcessError(RuntimeError):
    """The input process failed, exited or could not start."""


class KafkaInputProcess(PreparedBatchQueue):
    """A ``KafkaSource`` + batch builder running in a child process (see the module docstring).

    Args:
        pipeline_config: the pipeline config.
        features: the trainer's feature builder (wraps received arrays as tensors).
        source_args: ``KafkaSource`` keyword arguments except ``start`` (servers, topic,
            group, batch_size, batch_timeout_ms, fetch_interval_ms, kafka_config).
        start: the start position rules.
        num_workers: feature build worker processes the child starts (0: none).
        max_queued: batches buffered on each side of the socket.
    """

    def __init__(
        self,
        pipeline_config: pipeline_pb2.EasyRecConfig,
        features: FeatureBuilder,
        source_args: dict[str, Any],
        start: StartPositions,
        num_workers: int = 0,
        max_queued: int = 3,
    ) -> None:
        super().__init__()  # unbounded: the credits bound it
        self._features = features
        self._init = InputProcessInit(
            config=pipeline_config.SerializeToString(),
            source_args=dict(source_args),
            start=start,
            num_workers=int(num_workers),
            max_queued=max(1, int(max_queued) - 1),
            credit=max(1, int(max_queued)),
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        self.topic = str(source_args.get("topic", ""))
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._conn: Optional[Connection] = None
        self._send_lock = threading.Lock()
        self._receiver: Optional[threading.Thread] = None
        self._opened = threading.Event()
        self._heard = threading.Event()  # any message from the child arrived
        self._closed = threading.Event()
        self._opened_msg: Optional[InputOpened] = None
        self._error: Optional[InputFailure] = None
        self._stopping = False
        self._closing = False
        self._final_positions: Optional[dict[int, int]] = None
        self._partitions: list[int] = []
        self.partition_state: dict[int, PartitionState] = {}
        self.broker_error: Optional[str] = None
        self.records_consumed = 0
        self.source_status: dict = {}
        # the child's retention risk report (odl.inputs.retention_risk), as it last sent it
        self.retention: Optional[dict] = None

    # ------------------------------------------------------------------ start
    def start(self) -> KafkaInputProcess:
        """Starts the child (it begins opening the source at once; ``open`` waits for it).

        Returns:
            ``self``.
        """
        self._proc, self._sock, self._conn = spawn_child("odl.inputs.kafka_input_child")
        self._send(self._init)
        self._receiver = threading.Thread(target=self._receive, name="input-receiver",
                                          daemon=True)
        self._receiver.start()
        logger.info("started the input process (pid %d) for topic %s", self._proc.pid,
                    self.topic)
        return self

    @property
    def pid(self) -> Optional[int]:
        """The child's process id."""
        return self._proc.pid if self._proc is not None else None

    def open(self, stop_event: Optional[threading.Event] = None) -> dict[int, int]:
        """Waits until the child has resolved the start positions and assigned the partitions.

        Args:
            stop_event: aborts waiting (for the child, or for the topic to appear) when set.

        Returns:
            The start position (next offset) per assigned partition.

        Raises:
            InterruptedError: ``stop_event`` was set first.
            TimeoutError: the topic did not appear within ``topic_wait_secs``.
            InputProcessError: the child failed or exited.
        """
        if self._proc is None:
            raise InputProcessError("open() before start()")
        started = time.monotonic()
        while not self._opened.wait(0.1):
            if self._error is not None:  # also set by the receiver when the child exits
                self._raise_error()
            if stop_event is not None and stop_event.is_set():
                raise InterruptedError("stopped while waiting for the topic")
            if not self._heard.is_set() and time.monotonic() - started > _START_TIMEOUT_SECS:
                raise InputProcessError(
                    f"input process did not start within {_START_TIMEOUT_SECS:.0f}s")
        assert self._opened_msg is not None
        self._partitions = list(self._opened_msg.partitions)
        return dict(self._opened_msg.starts)

    def _raise_error(self) -> None:
        assert self._error is not None
        if self._error.kind == TIMEOUT:
            raise TimeoutError(self._error.text)
        raise InputProcessError(f"input process failed:\n{self._error.text}")

    # ------------------------------------------------------------------ receive
    def _receive(self) -> None:
        """Receiver thread: batches onto the queue, status into the attributes."""
        assert self._conn is not None
        try:
            while True:
                msg = self._conn.recv()
                self._heard.set()
                if isinstance(msg, InputBatch):
                    self._apply_status(msg.status)
                    self._queue.put(self._prepared(msg))
                elif isinstance(msg, InputStatus):
                    self._apply_status(msg)
                elif isinstance(msg, InputOpened):
                    self._opened_msg = msg
                    self._opened.set()
                elif isinstance(msg, InputFailure):
                    self._error = msg
                    if self._opened.is_set():
                        logger.error("input process failed:\n%s", msg.text)
                    self._queue.put(END)
                    return
                elif isinstance(msg, InputClosed):
                    if not self._closing:  # a finite input (file_stream_input) ended
                        self._queue.put(END)
                    self._closed.set()
                    return
        except (EOFError, OSError) as exc:
            if not self._closing:
                code = self._proc.poll() if self._proc is not None else None
                self._error = InputFailure(FAILED, f"input process pid {self.pid} exited (code "
                                                   f"{code}): {exc or 'connection closed'}")
                logger.error("%s", self._error.text)
                self._queue.put(END)
        except Exception as exc:  # a message that does not unpickle, a to_batch failure
            self._error = InputFailure(FAILED, f"receiving from the input process: {exc!r}")
            logger.error("%s", self._error.text, exc_info=exc)
            self._queue.put(END)
        finally:
            self._closed.set()

    def _apply_status(self, status: InputStatus) -> None:
        for p, (pos, high, low) in status.partition_state.items():
            st = self.partition_state.get(p)
            if st is None:
                self.partition_state[p] = PartitionState(pos, high, low)
            else:
                st.position, st.high_watermark, st.low_watermark = pos, high, low
        self.broker_error = status.broker_error
        self.records_consumed = status.records_consumed
        self.source_status = dict(status.source)
        if status.retention is not None:  # a batch's status leaves it out
            self.retention = status.retention

    def _prepared(self, item: InputBatch) -> PreparedBatch:
        n = len(item.partitions)
        values: list[bytes] = []
        if item.rejected_values:
            values = [b""] * n
            for idx, value in item.rejected_values.items():
                values[idx] = value
        raw = RawBatch(values=values, partitions=item.partitions, offsets=item.offsets,
                       timestamps_ms=item.timestamps_ms, positions=item.positions)
        batch = self._features.to_batch(item.arrays) if item.arrays is not None else None
        return PreparedBatch(batch=batch, positions=item.positions, num_records=n,
                             rejected=item.rejected, raw=raw, accepted=item.accepted,
                             read_time=item.read_time)

    # ------------------------------------------------------------------ the prefetcher side
    def _taken(self) -> None:
        if not self._stopping:
            self._send(CreditGrant(1), quiet=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"input failed: {self._error.text}")

    def stop(self, timeout: float = 10.0) -> None:  # noqa: ARG002 (BatchPrefetcher's signature)
        """Stops taking batches; the child stops reading once its buffers are full.

        Batches in flight are dropped; they are read again on the next start. ``close``
        ends the child.
        """
        self._stopping = True

    # ------------------------------------------------------------------ the source side
    @property
    def partitions(self) -> list[int]:
        """Assigned partitions."""
        return list(self._partitions)

    def request_commit(self, positions: dict[int, int]) -> None:
        """Asks the child to commit ``positions`` to the consumer group (monitoring only).

        Args:
            positions: next offset per partition.
        """
        self._send(CommitRequest(dict(positions)), quiet=True)

    def commit_now(self, positions: dict[int, int]) -> None:
        """Sets the positions the child commits synchronously when it is closed.

        Args:
            positions: next offset per partition.
        """
        self._final_positions = dict(positions) if positions else None

    def close(self, timeout: float = _CLOSE_TIMEOUT_SECS) -> None:
        """Tells the child to commit, close its consumer and exit, and waits for it.

        Args:
            timeout: seconds to wait before the child is killed.
        """
        if self._proc is None or self._closing:
            return
        self._stopping = self._closing = True
        self._send(CloseRequest(self._final_positions), quiet=True)
        if not self._closed.wait(timeout):
            logger.warning("input process pid %d did not close within %.0fs", self._proc.pid,
                           timeout)
        try:
            self._proc.wait(max(0.5, timeout / 3))
        except subprocess.TimeoutExpired:
            logger.warning("input process pid %d did not exit; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait(5.0)
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._receiver is not None:
            self._receiver.join(5.0)
        if self._conn is not None:
            self._conn.close()
        if self._sock is not None:
            self._sock.close()

    def _send(self, msg: ToChild, quiet: bool = False) -> None:
        assert self._conn is not None
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:
            if not quiet:
                raise InputProcessError(f"input process pid {self.pid} is gone: {exc}") from exc
            logger.debug("input process gone, %s not sent: %s", type(msg).__name__, exc)
