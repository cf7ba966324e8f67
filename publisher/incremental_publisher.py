"""Publishes the trainer's changed parameters as delta versions (EasyRec's incremental save).

The train loop calls ``maybe_publish`` after every step. A version (version = global step)
is due when the sparse part is due (``sparse_save_steps`` / ``sparse_save_secs`` since the
last sparse part) or the dense part is (``dense_save_steps`` / ``dense_save_secs``); then the
due parts are snapshotted on the train loop's thread (``publisher.version_snapshot``: touched
rows and dense variables copied out of the live model) and handed to the background sender
(``publisher.delta_sender``: encoding, back-pressure by merging, retries, fatal errors).

Besides the schedule: ``publish_if_behind`` publishes both parts when steps were trained
since the last version and that version is at least ``IDLE_PUBLISH_MIN_SECS`` old (the
trainer calls it when its input is idle, so the last steps of a burst go out without waiting
for more data; without the age floor a trainer keeping up with a steady stream, idle
between every two batches, would publish every step: at 10k samples/s ten versions a
second, each with the whole dense part, about 7 MB/s). ``sync`` publishes and waits before
each checkpoint, so every checkpoint equals a fully published version (the crash-recovery
point, ``publisher.delta_recovery``); ``flush`` publishes the final version and stops the
sender.

A version's header carries the input positions after its last trained batch, and the
min/max event time and Kafka produce time of all samples trained since the previous version.

Failures: a sink error is retried by the sender. A sink fenced by a newer trainer sets
``fenced``, and the trainer exits with code 3 (not restarted by the systemd unit); a bug in
the sender sets ``fatal_error``, and the trainer stops with a non-zero exit code (without a
checkpoint, as after a crash) so its supervisor restarts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

from prometheus_client import CollectorRegistry

from publisher.delta_sender import DeltaSender
from publisher.delta_sink import DeltaSink
from publisher.delta_tracker import DeltaTracker
from publisher.id_maps import IdMaps
from publisher.version_snapshot import ParameterSnapshotter, ParameterSource

logger = logging.getLogger(__name__)

# An idle input publishes the steps since the last version once it is this old: at most
# this much is added to a sample's freshness, and versions come at most 4 a second.
IDLE_PUBLISH_MIN_SECS = 0.25


class IncrementalPublisher:
    """Snapshots touched rows and dense variables every N steps / seconds and sends them.

    Args:
        module: the train module (``table_shapes()``, ``read_rows()``,
            ``served_dense_parameters()``).
        id_maps: ids and published widths of variables and tables.
        tracker: the touched-rows tracker registered on the module.
        sink: where encoded versions go.
        generation: the trainer generation id.
        model_name: model name written into every version.
        sparse_save_steps: sparse part every N steps (0 = not by steps).
        dense_save_steps: dense part every N steps (0 = not by steps).
        sparse_save_secs: sparse part every N seconds (0 = not by time).
        dense_save_secs: dense part every N seconds (0 = not by time).
        value_type: ``"fp32"`` or ``"fp16"``.
        max_chunk_bytes: chunk size limit.
        input_topic: input topic name written into the positions.
        registry: Prometheus registry for the metrics (the trainer's).
        start_step: global step at start (the first version is due N steps later).
        send_timeout: seconds to wait for one version's acknowledgements.
    """

    def __init__(
        self,
        module: ParameterSource,
        id_maps: IdMaps,
        tracker: DeltaTracker,
        sink: DeltaSink,
        generation: str,
        model_name: str,
        sparse_save_steps: int = 0,
        dense_save_steps: int = 0,
        sparse_save_secs: float = 0.0,
        dense_save_secs: float = 0.0,
        value_type: str = "fp32",
        max_chunk_bytes: int = 900_000,
        input_topic: str = "",
        registry: Optional[CollectorRegistry] = None,
        start_step: int = 0,
        send_timeout: float = 30.0,
    ) -> None:
        self.id_maps = id_maps
        self.sink = sink
        self.generation = generation
        self.sparse_save_steps = int(sparse_save_steps)
        self.dense_save_steps = int(dense_save_steps)
        self.sparse_save_secs = float(sparse_save_secs)
        self.dense_save_secs = float(dense_save_secs)
        self._snapshots = ParameterSnapshotter(module, id_maps, tracker, input_topic)
        self._sender = DeltaSender(sink, generation, model_name, value_type, max_chunk_bytes,
                                   send_timeout, registry)
        now = time.monotonic()
        self._last_sparse = (int(start_step), now)
        self._last_dense = (int(start_step), now)
        self._last_version = int(start_step)
        self._last_version_time = now

    @property
    def fatal_error(self) -> Optional[str]:
        """Why the publisher stopped for good (fenced, or a bug in the sender), or None."""
        return self._sender.fatal_error

    @property
    def fenced(self) -> bool:
        """The sink was taken over by a newer trainer (``fatal_error`` says so)."""
        return self._sender.fenced

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the sender thread."""
        self._sender.start()

    def flush(self, timeout: float = 30.0, step: Optional[int] = None,
              positions: Optional[Mapping[int, int]] = None) -> bool:
        """Publishes a final version (when anything changed) and waits until all are sent.

        Then stops the sender thread and closes the sink.

        Args:
            timeout: seconds to wait for the sink.
            step: the current global step (None: no final version).
            positions: the current input positions.

        Returns:
            True when everything due was published.
        """
        if step is not None and self.final_due(int(step)):
            self.snapshot(int(step), positions or {}, dense=True, sparse=True)
        deadline = time.monotonic() + timeout
        ok = self._sender.wait_sent(deadline)
        if not ok:
            logger.warning("delta publisher: stopping with unpublished versions (%s)",
                           self._sender.last_error or "sink too slow")
        self._sender.stop(deadline)
        self.sink.close()
        return ok

    def sync(self, step: int, positions: Mapping[int, int], timeout: float = 10.0) -> bool:
        """Publishes a version at ``step`` (when anything changed) and waits until it is sent.

        The trainer calls this before writing a checkpoint, so every checkpoint equals a
        fully published version (the crash-recovery point; see ``publisher.delta_recovery``).
        Unlike ``flush`` the sender keeps running.

        Args:
            step: the current global step.
            positions: the current input positions.
            timeout: seconds to wait for the sink.

        Returns:
            True when every version up to ``step`` was acknowledged by the sink.
        """
        sparse_due, dense_due = self.sync_parts(step)
        if dense_due or sparse_due:  # both parts current at ``step``, like ``flush``
            self.snapshot(int(step), positions, dense=dense_due, sparse=sparse_due)
        return self.wait_sent(timeout)

    def wait_sent(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until every queued version is acknowledged.

        Returns:
            True when all were.
        """
        return self._sender.wait_sent(time.monotonic() + timeout)

    # ------------------------------------------------------------------ what is due
    def due_parts(self, step: int) -> tuple[bool, bool]:
        """``(sparse, dense)``: the parts the schedule says are due after ``step``.

        A pending republish (``republish_pending``) makes the sparse part due with any due
        part, since only a sparse snapshot can carry it.
        """
        if step == self._last_version:
            return False, False
        now = time.monotonic()
        sparse_due = bool(
            (self.sparse_save_steps and step - self._last_sparse[0] >= self.sparse_save_steps)
            or (self.sparse_save_secs and now - self._last_sparse[1] >= self.sparse_save_secs))
        dense_due = bool(
            (self.dense_save_steps and step - self._last_dense[0] >= self.dense_save_steps)
            or (self.dense_save_secs and now - self._last_dense[1] >= self.dense_save_secs))
        return sparse_due or (dense_due and self.republish_pending), dense_due

    def behind(self, step: int) -> bool:
        """Steps were trained since the last version and it is ``IDLE_PUBLISH_MIN_SECS`` old.

        What ``publish_if_behind`` publishes on.
        """
        return (step != self._last_version
                and time.monotonic() - self._last_version_time >= IDLE_PUBLISH_MIN_SECS)

    def sync_parts(self, step: int) -> tuple[bool, bool]:
        """``(sparse, dense)``: the parts not yet current at ``step`` (what ``sync`` takes).

        A pending republish makes the sparse part due: a checkpoint must not be written
        before the rows the broker lost are sent again.
        """
        return (self._last_sparse[0] != step or self.republish_pending,
                self._last_dense[0] != step)

    def final_due(self, step: int) -> bool:
        """``flush`` at ``step`` takes a last version (steps since the last, or a republish)."""
        return step != self._last_version or self.republish_pending

    @property
    def republish_pending(self) -> bool:
        """The sink asked for every row again; the next sparse snapshot carries them."""
        return self._sender.republish_requested

    # ------------------------------------------------------------------ train loop side
    def note_times(self, event_time_ms: Optional[tuple[int, int]] = None,
                   produce_time_ms: Optional[tuple[int, int]] = None) -> None:
        """Adds a batch's event / produce time range to the next version's header.

        Args:
            event_time_ms: ``(min, max)`` event time of the batch's samples, unix ms.
            produce_time_ms: ``(min, max)`` Kafka produce time of its records, unix ms.
        """
        self._snapshots.note_times(event_time_ms, produce_time_ms)

    def maybe_publish(
        self,
        step: int,
        positions: Mapping[int, int],
        event_time_ms: Optional[tuple[int, int]] = None,
        produce_time_ms: Optional[tuple[int, int]] = None,
    ) -> bool:
        """Called after every training step; snapshots a version when one is due.

        Args:
            step: the global step after the step.
            positions: next offset per input partition after the step's batch.
            event_time_ms: ``(min, max)`` event time of the step's samples, unix ms.
            produce_time_ms: ``(min, max)`` Kafka produce time of the step's records, unix ms.

        Returns:
            True when a version was snapshotted and queued.
        """
        self.note_times(event_time_ms, produce_time_ms)
        sparse_due, dense_due = self.due_parts(step)
        if not (sparse_due or dense_due):
            return False
        self.snapshot(step, positions, dense=dense_due, sparse=sparse_due)
        return True

    def publish_if_behind(self, step: int, positions: Mapping[int, int]) -> bool:
        """Publishes the current state when steps were trained since an old enough version.

        The trainer calls this when its input is idle: steps-based publishing alone would
        hold back the last steps of a burst until more data arrives. Nothing is published
        until the last version is ``IDLE_PUBLISH_MIN_SECS`` old (``behind``).

        Args:
            step: the current global step.
            positions: next offset per input partition.

        Returns:
            True when a version was snapshotted and queued.
        """
        if not self.behind(step):
            return False
        self.snapshot(step, positions, dense=True, sparse=True)
        return True

    def snapshot(self, step: int, positions: Mapping[int, int], dense: bool,
                 sparse: bool) -> None:
        """Takes version ``step`` with the given parts now and queues it for the sender.

        A pending republish is carried by a snapshot with the sparse part (and then takes
        both parts); a dense-only snapshot leaves it pending.

        Args:
            step: the global step (the version).
            positions: next offset per input partition (every rank's, with several).
            dense: take the dense part.
            sparse: take the sparse part (with several ranks, every rank must take part:
                ``odl.train.rank_publishing``).
        """
        now = time.monotonic()
        republish = sparse and self._sender.take_republish_request()
        snap = self._snapshots.take(step, positions, dense, sparse, republish_all=republish)
        if snap.has_sparse:
            self._last_sparse = (step, now)
        if snap.has_dense:
            self._last_dense = (step, now)
        self._last_version = int(step)
        self._last_version_time = now
        self._sender.submit(snap)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """Publisher state for the trainer's ``/status``: the sender's and the sink's."""
        out = self._sender.status()
        out["snapshot_secs_total"] = round(self._snapshots.secs_total, 3)
        out.update(self.sink.status())
        return out
