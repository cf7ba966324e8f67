"""The Kafka input in a child process: consume, parse and build off the trainer's process.

In the trainer's own process the input (``KafkaSource.read_batch`` and feature building,
Python and numpy) shares the GIL and the interpreter with the train step, and the step runs
slower beside it (docs/benchmarks.md: +9-20 % on CPU, +34-38 % on CUDA, where the step is
mostly Python). ``KafkaInputProcess`` runs the whole input in one child process instead: a
:class:`~odl.inputs.kafka_source.KafkaSource` feeding a
:class:`~odl.inputs.batch_prefetcher.BatchPrefetcher` that builds numpy arrays (in the child's
reader thread, or in ``num_workers`` feature build workers the child starts). The trainer's
process only receives finished arrays and wraps them as tensors without a copy.

The object offers what the trainer uses of a ``KafkaSource`` (``open``, ``partitions``,
``partition_state``, ``broker_error``, ``records_consumed``, ``request_commit``,
``commit_now``, ``close``) and of a ``BatchPrefetcher`` (``get``, ``finished``, ``queued``,
``stop``), so the train loop is the same with or without it. Positions travel with every batch
as before; the trainer checkpoints the positions of what it trained, so batches still in
flight when it stops are read again on the next start.

Flow control is by credit: the trainer grants ``max_queued`` batches at start and one more for
each batch it takes, and the child sends a batch only against a credit. The child's own
prefetcher holds at most ``max_queued`` more.

The child is started by :mod:`odl.inputs.child_process` (SIGINT and SIGTERM ignored from its first
moment: the trainer decides when the input stops) and imports numpy, pyarrow, protobuf and
confluent-kafka, not torch. It exits when the trainer sends ``close`` or closes the socket
(including by dying). Its log lines go to the trainer's stderr, tagged ``odl-input[pid]``.

Wire layout, over one socketpair (``odl.inputs.child_process`` framing); both ends are this module:

* trainer -> child, first: ``("init", InputProcessInit)``
* trainer -> child: ``("credit", n)``: room for n more batches;
  ``("commit", {partition: next_offset})``: commit to the consumer group on the next read
  (monitoring only); ``("close", {partition: next_offset} | None)``: stop reading, commit
  those positions synchronously, close the consumer and exit 0
* child -> trainer: ``("opened", starts, partitions)`` once the partitions are assigned;
  ``("batch", InputBatch)``; ``("status", InputStatus)`` every ``_STATUS_SECS``;
  ``("error", kind, text)`` with kind ``"timeout"`` (the topic did not appear in time) or
  ``"failed"`` (then it exits 1); ``("closed",)`` last, after a ``close``.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from odl.inputs.batch_prefetcher import END, PreparedBatch, PreparedBatchQueue
from odl.inputs.child_process import run_child, spawn_child
from odl.inputs.kafka_source import PartitionState, RawBatch, StartPositions
from odl.protos import pipeline_pb2

if TYPE_CHECKING:
    from odl.features.feature_builder import FeatureBuilder

logger = logging.getLogger(__name__)

# How often the child reports the consumer's state (watermarks, broker error, counters).
_STATUS_SECS = 0.25
# Seconds the child may take to import its modules and start (it answers "opened" later).
_START_TIMEOUT_SECS = 120.0
# Seconds close() waits for the child to commit, close its consumer and exit.
_CLOSE_TIMEOUT_SECS = 15.0


class InputProcessError(RuntimeError):
    """The input process failed, exited or could not start."""


@dataclass
class InputProcessInit:
    """What the child needs to open the source (sent once, first).

    Attributes:
        config: the serialized pipeline config (for the feature builder).
        source_args: ``KafkaSource`` keyword arguments except ``start``.
        start: the start position rules.
        num_workers: feature build worker processes the child starts (0: build in its reader).
        max_queued: batches the child's prefetcher builds ahead.
        credit: batches the trainer can take at once (its initial credit).
        log_level: the trainer's logging level.
    """

    config: bytes
    source_args: dict[str, Any] = field(repr=False)  # holds kafka_config (may hold secrets)
    start: StartPositions
    num_workers: int = 0
    max_queued: int = 2
    credit: int = 3
    log_level: int = logging.INFO


@dataclass
class InputStatus:
    """The consumer's live state, as the child last saw it.

    Attributes:
        partition_state: per partition ``(position, high_watermark, low_watermark)``.
        broker_error: why the broker is unreachable, or None.
        records_consumed: records read from Kafka so far.
    """

    partition_state: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    broker_error: Optional[str] = None
    records_consumed: int = 0


@dataclass
class InputBatch:
    """One built batch as it crosses the socket.

    Attributes:
        arrays: the feature builder's ``BatchArrays``, None when every record was rejected.
        accepted: indices of the raw records in ``arrays``.
        rejected: (index, reason) per malformed record.
        rejected_values: the raw value of each rejected record, by index (dead letters).
        positions: next offset per partition after this batch.
        partitions: partition of each raw record.
        offsets: offset of each raw record.
        timestamps_ms: Kafka timestamp of each raw record.
        read_time: when the batch left the source (time.time()).
        status: the consumer's state when the batch was sent.
    """

    arrays: Any
    accepted: np.ndarray
    rejected: list[tuple[int, str]]
    rejected_values: dict[int, bytes]
    positions: dict[int, int]
    partitions: np.ndarray
    offsets: np.ndarray
    timestamps_ms: np.ndarray
    read_time: float
    status: InputStatus


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
        self._open_result: Optional[tuple[dict[int, int], list[int]]] = None
        self._error: Optional[tuple[str, str]] = None
        self._stopping = False
        self._closing = False
        self._final_positions: Optional[dict[int, int]] = None
        self._partitions: list[int] = []
        self.partition_state: dict[int, PartitionState] = {}
        self.broker_error: Optional[str] = None
        self.records_consumed = 0

    # ------------------------------------------------------------------ start
    def start(self) -> KafkaInputProcess:
        """Starts the child (it begins opening the source at once; ``open`` waits for it).

        Returns:
            ``self``.
        """
        self._proc, self._sock, self._conn = spawn_child("odl.inputs.kafka_input_process")
        self._send(("init", self._init))
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
        assert self._open_result is not None
        starts, self._partitions = self._open_result
        return dict(starts)

    def _raise_error(self) -> None:
        assert self._error is not None
        kind, text = self._error
        if kind == "timeout":
            raise TimeoutError(text)
        raise InputProcessError(f"input process failed:\n{text}")

    # ------------------------------------------------------------------ receive
    def _receive(self) -> None:
        """Receiver thread: batches onto the queue, status into the attributes."""
        assert self._conn is not None
        try:
            while True:
                msg = self._conn.recv()
                self._heard.set()
                kind = msg[0]
                if kind == "batch":
                    item: InputBatch = msg[1]
                    self._apply_status(item.status)
                    self._queue.put(self._prepared(item))
                elif kind == "status":
                    self._apply_status(msg[1])
                elif kind == "opened":
                    self._open_result = (msg[1], msg[2])
                    self._opened.set()
                elif kind == "error":
                    self._error = (msg[1], msg[2])
                    if self._opened.is_set():
                        logger.error("input process failed:\n%s", msg[2])
                    self._queue.put(END)
                    return
                elif kind == "closed":
                    self._closed.set()
                    return
        except (EOFError, OSError) as exc:
            if not self._closing:
                code = self._proc.poll() if self._proc is not None else None
                self._error = ("failed", f"input process pid {self.pid} exited (code {code}): "
                                         f"{exc or 'connection closed'}")
                logger.error("%s", self._error[1])
                self._queue.put(END)
        except Exception as exc:  # a message that does not unpickle, a to_batch failure
            self._error = ("failed", f"receiving from the input process: {exc!r}")
            logger.error("%s", self._error[1], exc_info=exc)
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
            self._send(("credit", 1), quiet=True)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"input failed: {self._error[1]}")

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
        self._send(("commit", dict(positions)), quiet=True)

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
        self._send(("close", self._final_positions), quiet=True)
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

    def _send(self, msg: tuple, quiet: bool = False) -> None:
        assert self._conn is not None
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as exc:
            if not quiet:
                raise InputProcessError(f"input process pid {self.pid} is gone: {exc}") from exc
            logger.debug("input process gone, %s not sent: %s", msg[0], exc)


# ---------------------------------------------------------------------------- the child
class _Child:
    """The child's side: a command thread, a status thread and the batch-sending loop."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.stop = threading.Event()
        self.credit = 0
        self.credit_cond = threading.Condition()
        self.final_positions: Optional[dict[int, int]] = None
        self.source: Any = None  # set before the trainer can send a commit (after "opened")

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def commands(self) -> None:
        """Command thread: credits, commits and close from the trainer."""
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "credit":
                    with self.credit_cond:
                        self.credit += int(msg[1])
                        self.credit_cond.notify()
                elif msg[0] == "commit" and self.source is not None:
                    self.source.request_commit(msg[1])
                elif msg[0] == "close":
                    self.final_positions = msg[1]
                    break
        except (EOFError, OSError):
            pass  # the trainer closed the socket or died: stop too
        self.stop.set()
        with self.credit_cond:
            self.credit_cond.notify()

    def status(self) -> InputStatus:
        src = self.source
        if src is None:
            return InputStatus()
        try:
            states = {p: (st.position, st.high_watermark, st.low_watermark)
                      for p, st in list(src.partition_state.items())}
        except RuntimeError:  # resized while copied; the next report has it
            states = {}
        return InputStatus(partition_state=states, broker_error=src.broker_error,
                           records_consumed=src.records_consumed)

    def report_status(self) -> None:
        """Status thread: the consumer's state every ``_STATUS_SECS`` until stopped."""
        while not self.stop.wait(_STATUS_SECS):
            try:
                self.send(("status", self.status()))
            except (OSError, ValueError):
                return

    def take_credit(self) -> bool:
        with self.credit_cond:
            while self.credit <= 0 and not self.stop.is_set():
                self.credit_cond.wait(0.1)
            if self.stop.is_set():
                return False
            self.credit -= 1
            return True


def _serve(conn: Connection) -> int:
    """The child: open the source, then build and send batches until closed."""
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return 0
    init: InputProcessInit = msg[1]
    logging.getLogger().setLevel(init.log_level)
    child = _Child(conn)
    child.credit = init.credit
    threading.Thread(target=child.commands, name="input-commands", daemon=True).start()
    prefetcher = None
    try:
        from odl.features.feature_builder import FeatureBuilder
        from odl.inputs.batch_prefetcher import BatchPrefetcher
        from odl.inputs.feature_build_worker import FeatureBuildWorkers
        from odl.inputs.kafka_source import KafkaSource

        config = pipeline_pb2.EasyRecConfig.FromString(init.config)
        builder = FeatureBuilder(config)
        workers = (FeatureBuildWorkers(config, init.num_workers).start()
                   if init.num_workers else None)
        source = KafkaSource(start=init.start, **init.source_args)
        child.source = source
        threading.Thread(target=child.report_status, name="input-status", daemon=True).start()
        try:
            starts = source.open(child.stop)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        child.send(("opened", dict(starts), source.partitions))

        def build(values: list[bytes]):  # noqa: ANN202
            result = builder.build_arrays(values)
            return result.arrays, result.accepted, result.rejected

        prefetcher = BatchPrefetcher(source.read_batch, build, max_queued=init.max_queued,
                                     workers=workers, to_batch=lambda arrays: arrays)
        prefetcher.start()
        while child.take_credit():
            item = None
            while item is None and not child.stop.is_set():
                item = prefetcher.get(timeout=0.1)
                if item is None and prefetcher.finished:
                    raise RuntimeError("the Kafka input ended")
            if item is None:
                break
            rejected_values = ({i: item.raw.values[i] for i, _ in item.rejected
                                if i < len(item.raw.values)} if item.rejected else {})
            child.send(("batch", InputBatch(
                arrays=item.batch, accepted=item.accepted, rejected=item.rejected,
                rejected_values=rejected_values, positions=item.positions,
                partitions=item.raw.partitions, offsets=item.raw.offsets,
                timestamps_ms=item.raw.timestamps_ms, read_time=item.read_time,
                status=child.status())))
    except InterruptedError:
        pass  # closed while waiting for the topic
    except TimeoutError as exc:
        _send_error(child, "timeout", str(exc))
        return 1
    except (EOFError, OSError) as exc:
        if not child.stop.is_set():
            logger.error("input process: %s", exc)
            return 1
    except BaseException:
        _send_error(child, "failed", traceback.format_exc())
        _close_source(child, prefetcher)
        return 1
    _close_source(child, prefetcher)
    try:
        child.send(("closed",))
    except (OSError, ValueError):
        pass
    return 0


def _send_error(child: _Child, kind: str, text: str) -> None:
    try:
        child.send(("error", kind, text))
    except (OSError, ValueError):
        logger.error("input process failed (%s): %s", kind, text)


def _close_source(child: _Child, prefetcher: Any) -> None:
    """Stops reading, commits the trainer's final positions and closes the consumer."""
    child.stop.set()
    if prefetcher is not None:
        prefetcher.stop()
    if child.source is not None:
        if child.final_positions:
            child.source.commit_now(child.final_positions)
        child.source.close()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the input process (see :func:`odl.inputs.child_process.run_child`)."""
    return run_child(argv, "odl Kafka input process (internal)", "odl-input", _serve)


__all__ = ["KafkaInputProcess", "InputProcessError", "InputBatch", "InputStatus",
           "InputProcessInit"]
