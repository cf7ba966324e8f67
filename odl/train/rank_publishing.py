"""Delta publishing of a model trained by several ranks: rank 0 sends, every rank takes part.

Rank 0 holds the delta sink and the ``IncrementalPublisher``: one producer, one fence, one
stream of versions, so serving replays exactly what a single process would publish and its
all-or-nothing assembly, parity and the crash-recovery point hold unchanged. The other ranks
hold a ``ParameterSnapshotter`` (``publisher_factory.build_rank_snapshotter``) over a tracker
of the rows their own batches touch. A version is complete only when every rank's part is in
it: it is assembled on rank 0 from all of them before it is sent.

When: rank 0's schedule (``sparse_save_steps`` / ``_secs``, ``dense_save_*``) decides. Its
``turn_flags`` travel in the train loop's exchange at the start of each turn
(``odl.train.training_loop``), so every rank publishes at the same turn, before that turn's
step; when no rank holds a batch and steps were trained since the last version, the
version is published too (an idle input, as one process publishes the last steps of a
burst without waiting for more data).

How (``publish``, a collective): every rank sends rank 0 its input positions and the event /
produce time range of the samples it trained since the last version; for a sparse part every
rank hands its touched rows to ``TrainModule.read_rows``, which reads each row from the shard
that holds it and brings the union to rank 0; rank 0 then queues the version with the dense
part from its own replica (equal on every rank) and the positions of every partition.

``sync`` (before a checkpoint) and ``flush`` (at a clean stop) take rank 0's decision to
every rank first, and every rank learns whether the version was acknowledged, so all ranks
skip or write a checkpoint together.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

from prometheus_client import CollectorRegistry

from odl.train.distributed import from_rank0, gather_to_rank0
from publisher.delta_sink import DeltaSink
from publisher.incremental_publisher import IncrementalPublisher
from publisher.publisher_factory import build_publisher, build_rank_snapshotter
from publisher.version_snapshot import ParameterSnapshotter

logger = logging.getLogger(__name__)

# bits of rank 0's turn flag
DUE_SPARSE = 1
DUE_DENSE = 2
BEHIND = 4


class RankPublishing:
    """One rank's part in publishing a model trained by several ranks.

    Args:
        rank: this process's rank.
        publisher: rank 0's running publisher (None on the other ranks).
        snapshotter: the snapshotter of a rank other than 0 (None on rank 0).
    """

    def __init__(self, rank: int, publisher: Optional[IncrementalPublisher],
                 snapshotter: Optional[ParameterSnapshotter]) -> None:
        if (publisher is None) == (rank == 0) or (snapshotter is None) == (rank != 0):
            raise ValueError("rank 0 publishes, the other ranks take part with a snapshotter")
        self.rank = rank
        self.publisher = publisher
        self._snapshotter = snapshotter

    @classmethod
    def build(cls, config: Any, module: Any, generation: str, rank: int,
              registry: Optional[CollectorRegistry], sink: Optional[DeltaSink]) -> RankPublishing:
        """Rank 0: the publisher over ``sink``; another rank: its snapshotter.

        Args:
            config: the pipeline config.
            module: the ``TrainModule``.
            generation: the trainer generation id.
            rank: this process's rank.
            registry: the trainer's Prometheus registry.
            sink: rank 0's delta sink (None on the other ranks).

        Returns:
            This rank's part.
        """
        if rank == 0:
            return cls(0, build_publisher(config, module, generation, registry,
                                          start_step=module.global_step, sink=sink), None)
        return cls(rank, None, build_rank_snapshotter(config, module))

    def note_times(self, event_time_ms: Optional[tuple[int, int]],
                   produce_time_ms: Optional[tuple[int, int]]) -> None:
        """Adds this rank's batch's time ranges to the next version's header."""
        if self.publisher is not None:
            self.publisher.note_times(event_time_ms, produce_time_ms)
        else:
            assert self._snapshotter is not None
            self._snapshotter.note_times(event_time_ms, produce_time_ms)

    def turn_flags(self, step: int) -> int:
        """Rank 0's flags for this turn (``DUE_SPARSE | DUE_DENSE | BEHIND``); 0 elsewhere."""
        if self.publisher is None:
            return 0
        sparse, dense = self.publisher.due_parts(step)
        return ((DUE_SPARSE if sparse else 0) | (DUE_DENSE if dense else 0)
                | (BEHIND if self.publisher.behind(step) else 0))

    def after_turn(self, step: int, flags: int, any_batch: bool,
                   positions: Mapping[int, int]) -> None:
        """Publishes what rank 0's ``flags`` say (a collective when anything is due).

        Args:
            step: the global step.
            flags: rank 0's ``turn_flags`` of this turn.
            any_batch: some rank holds a batch this turn.
            positions: this rank's input positions.
        """
        if any_batch:
            sparse, dense = bool(flags & DUE_SPARSE), bool(flags & DUE_DENSE)
        else:  # idle everywhere: publish the steps trained since the last version
            sparse = dense = bool(flags & BEHIND)
        if sparse or dense:
            self.publish(step, positions, sparse=sparse, dense=dense)

    def publish(self, step: int, positions: Mapping[int, int], sparse: bool,
                dense: bool) -> None:
        """Takes version ``step`` from every rank's part (a collective; module docstring).

        Args:
            step: the global step (equal on every rank).
            positions: this rank's input positions.
            sparse: take the sparse part (every rank must pass the same).
            dense: take the dense part.
        """
        if self._snapshotter is not None:
            gather_to_rank0((dict(positions), self._snapshotter.take_time_ranges()))
            if sparse:  # this rank's touched rows into the collective read; rank 0 keeps them
                self._snapshotter.take(step, {}, dense=False, sparse=True)
            return
        assert self.publisher is not None
        parts = gather_to_rank0((dict(positions), (None, None)))
        assert parts is not None
        everyone: dict[int, int] = {}
        for rank_positions, (event, produce) in parts:
            everyone.update(rank_positions)
            self.publisher.note_times(tuple(event) if event else None,
                                      tuple(produce) if produce else None)
        self.publisher.snapshot(step, everyone, dense=dense, sparse=sparse)

    def sync(self, step: int, positions: Mapping[int, int], timeout: float) -> bool:
        """``IncrementalPublisher.sync`` across ranks (a collective).

        Returns:
            True on every rank when rank 0's version at ``step`` was acknowledged within
            ``timeout`` seconds.
        """
        parts = from_rank0(self.publisher.sync_parts(step) if self.publisher else None)
        sparse, dense = parts  # type: ignore[misc]
        if sparse or dense:
            self.publish(step, positions, sparse=sparse, dense=dense)
        return bool(from_rank0(self.publisher.wait_sent(timeout) if self.publisher else None))

    def flush(self, step: Optional[int], positions: Mapping[int, int],
              timeout: float) -> bool:
        """``IncrementalPublisher.flush`` across ranks: the last version, then rank 0 stops.

        Args:
            step: the global step for a last version, taken by all ranks together (a
                collective); None after a failure: no last version, rank 0 only waits for
                the versions already queued.
            positions: this rank's input positions.
            timeout: seconds rank 0 waits for its sink.

        Returns:
            True when everything due was published (always True on ranks other than 0).
        """
        if step is not None and from_rank0(
                self.publisher.final_due(step) if self.publisher else None):
            self.publish(step, positions, sparse=True, dense=True)
        if self.publisher is None:
            return True
        return self.publisher.flush(timeout=timeout)

    def status(self) -> dict[str, Any]:
        """Rank 0's publisher status (``{}`` on the other ranks)."""
        return self.publisher.status() if self.publisher is not None else {}
