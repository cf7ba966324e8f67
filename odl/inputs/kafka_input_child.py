"""The Kafka input process itself: the child's side of ``KafkaInputProcess``.

Started by :mod:`odl.inputs.child_process` (SIGINT and SIGTERM ignored from its first
moment: the trainer decides when the input stops). It reads ``InputProcessInit``, opens a
:class:`~odl.inputs.kafka_source.KafkaSource` feeding a
:class:`~odl.inputs.batch_prefetcher.BatchPrefetcher` that builds numpy arrays (in the
prefetcher's reader thread, or in ``num_workers`` feature build workers it starts), and
sends each built batch against a credit (messages: :mod:`odl.inputs.input_process_messages`).

Three threads: the main one sends batches; a command thread takes credits, commit requests
and the close request; a status thread reports the consumer's state. The child imports
numpy, pyarrow, protobuf and confluent-kafka, not torch. It exits when the trainer sends
``CloseRequest`` (after committing the final positions and closing the consumer) or closes
the socket (including by dying). Its log lines go to the trainer's stderr, tagged
``odl-input[pid]``.
"""

from __future__ import annotations

import logging
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from odl.inputs.child_process import run_child
from odl.inputs.input_process_messages import (
    FAILED,
    STATUS_INTERVAL_SECS,
    TIMEOUT,
    CloseRequest,
    CommitRequest,
    CreditGrant,
    FailureKind,
    InputBatch,
    InputClosed,
    InputFailure,
    InputOpened,
    InputProcessInit,
    InputStatus,
    ToTrainer,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class _ChildSession:
    """The child's shared state: the connection, the credit and the stop flag."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.stop = threading.Event()
        self.credit = 0
        self.credit_cond = threading.Condition()
        self.final_positions: Optional[dict[int, int]] = None
        self.source: Any = None  # set before the trainer can send a commit (after opened)

    def send(self, msg: ToTrainer) -> None:
        """Sends one message to the trainer (thread-safe)."""
        with self.send_lock:
            self.conn.send(msg)

    def commands(self) -> None:
        """Command thread: credits, commits and close from the trainer."""
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, CreditGrant):
                    with self.credit_cond:
                        self.credit += int(msg.batches)
                        self.credit_cond.notify()
                elif isinstance(msg, CommitRequest) and self.source is not None:
                    self.source.request_commit(msg.positions)
                elif isinstance(msg, CloseRequest):
                    self.final_positions = msg.final_positions
                    break
        except (EOFError, OSError):
            pass  # the trainer closed the socket or died: stop too
        self.stop.set()
        with self.credit_cond:
            self.credit_cond.notify()

    def status(self, retention: bool = True) -> InputStatus:
        """The consumer's state now.

        Args:
            retention: include the retention risk report (the periodic reports do; a batch's
                leaves it out, it changes once a second at most).
        """
        src = self.source
        if src is None:
            return InputStatus()
        try:
            states = {p: (st.position, st.high_watermark, st.low_watermark)
                      for p, st in list(src.partition_state.items())}
        except RuntimeError:  # resized while copied; the next report has it
            states = {}
        from odl.inputs.source_factory import (  # imported after start-up
            source_retention,
            source_status,
        )

        return InputStatus(partition_state=states, broker_error=src.broker_error,
                           records_consumed=src.records_consumed, source=source_status(src),
                           retention=source_retention(src) if retention else None)

    def report_status(self) -> None:
        """Status thread: the consumer's state every ``STATUS_INTERVAL_SECS`` until stopped."""
        while not self.stop.wait(STATUS_INTERVAL_SECS):
            try:
                self.send(self.status())
            except (OSError, ValueError):
                return

    def take_credit(self) -> bool:
        """Waits for a credit and takes it; False once stopped."""
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
        init = conn.recv()
    except (EOFError, OSError):
        return 0
    if not isinstance(init, InputProcessInit):
        logger.error("input process: expected InputProcessInit first, got %s",
                     type(init).__name__)
        return 1
    logging.getLogger().setLevel(init.log_level)
    session = _ChildSession(conn)
    session.credit = init.credit
    threading.Thread(target=session.commands, name="input-commands", daemon=True).start()
    prefetcher = None
    try:
        from odl.features.feature_builder import FeatureBuilder
        from odl.inputs.batch_prefetcher import BatchPrefetcher
        from odl.inputs.feature_build_worker import FeatureBuildWorkers
        from odl.inputs.source_factory import build_source

        config = pipeline_pb2.EasyRecConfig.FromString(init.config)
        builder = FeatureBuilder(config)
        workers = (FeatureBuildWorkers(config, init.num_workers).start()
                   if init.num_workers else None)
        source = build_source(init.start, init.source_args)
        session.source = source
        threading.Thread(target=session.report_status, name="input-status",
                         daemon=True).start()
        try:
            starts = source.open(session.stop)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        session.send(InputOpened(starts=dict(starts), partitions=source.partitions))

        def build(values: list[bytes]):  # noqa: ANN202
            result = builder.build_arrays(values)
            return result.arrays, result.accepted, result.rejected

        prefetcher = BatchPrefetcher(source.read_batch, build, max_queued=init.max_queued,
                                     workers=workers, to_batch=lambda arrays: arrays)
        prefetcher.start()
        while session.take_credit():
            item = None
            while item is None and not session.stop.is_set():
                item = prefetcher.get(timeout=0.1)  # raises the input's failure, if any
                if item is None and prefetcher.finished:
                    break  # a finite stream (file_stream_input's end_day) ended
            if item is None:
                break
            rejected_values = ({i: item.raw.values[i] for i, _ in item.rejected
                                if i < len(item.raw.values)} if item.rejected else {})
            session.send(InputBatch(
                arrays=item.batch, accepted=item.accepted, rejected=item.rejected,
                rejected_values=rejected_values, positions=item.positions,
                partitions=item.raw.partitions, offsets=item.raw.offsets,
                timestamps_ms=item.raw.timestamps_ms, read_time=item.read_time,
                status=session.status(retention=False)))
    except InterruptedError:
        pass  # closed while waiting for the topic
    except TimeoutError as exc:
        _send_failure(session, TIMEOUT, str(exc))
        return 1
    except (EOFError, OSError) as exc:
        if not session.stop.is_set():
            logger.error("input process: %s", exc)
            return 1
    except BaseException:
        _send_failure(session, FAILED, traceback.format_exc())
        _close_source(session, prefetcher)
        return 1
    _close_source(session, prefetcher)
    try:
        session.send(InputClosed())
    except (OSError, ValueError):
        pass
    return 0


def _send_failure(session: _ChildSession, kind: FailureKind, text: str) -> None:
    try:
        session.send(InputFailure(kind=kind, text=text))
    except (OSError, ValueError):
        logger.error("input process failed (%s): %s", kind, text)


def _close_source(session: _ChildSession, prefetcher: Any) -> None:
    """Stops reading, commits the trainer's final positions and closes the consumer."""
    session.stop.set()
    if prefetcher is not None:
        prefetcher.stop()
    if session.source is not None:
        if session.final_positions:
            session.source.commit_now(session.final_positions)
        session.source.close()


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the input process (see :func:`odl.inputs.child_process.run_child`).

    Args:
        argv: command-line arguments (``--fd N``); None: ``sys.argv[1:]``.

    Returns:
        The exit code.
    """
    return run_child(argv, "odl Kafka input process (internal)", "odl-input", _serve)
