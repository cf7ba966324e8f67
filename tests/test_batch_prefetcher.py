"""The batch prefetcher between a source and the train loop (no broker, no model).

What the trainer relies on: batches in read order with the positions they cover, the end of
a finite input, a reader failure raised at ``get``, a bounded read-ahead, and a prompt stop.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from odl.inputs.batch_prefetcher import BatchPrefetcher
from odl.inputs.kafka_source import RawBatch


def _raw(i: int, size: int = 3) -> RawBatch:
    values = [f"r{i}-{k}".encode() for k in range(size)]
    return RawBatch(values=values, partitions=np.zeros(size, np.int32),
                    offsets=np.arange(i * size, (i + 1) * size, dtype=np.int64),
                    timestamps_ms=np.zeros(size, np.int64), positions={0: (i + 1) * size})


class _Source:
    """A finite source of ``n`` raw batches that counts its reads."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.reads = 0

    def read(self, _stop: threading.Event) -> RawBatch | None:
        if self.reads == self.fail_at:
            raise OSError("disk on fire")
        if self.reads >= self.n:
            raise StopIteration
        self.reads += 1
        return _raw(self.reads - 1)


def _build(values: list[bytes]):
    """The model batch is the values; records ending in ``-1`` are malformed."""
    accepted = [i for i, v in enumerate(values) if not v.endswith(b"-1")]
    rejected = [(i, "field_count") for i, v in enumerate(values) if v.endswith(b"-1")]
    return [values[i] for i in accepted], np.asarray(accepted, np.int64), rejected


def _drain(prefetcher: BatchPrefetcher, timeout: float = 10.0) -> list:
    out = []
    deadline = time.monotonic() + timeout
    while not prefetcher.finished:
        assert time.monotonic() < deadline, "the input did not end"
        item = prefetcher.get(timeout=0.1)
        if item is not None:
            out.append(item)
    return out


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_batches_come_in_read_order_with_their_positions_then_the_end():
    source = _Source(6)
    prefetcher = BatchPrefetcher(source.read, _build, max_queued=2)
    prefetcher.start()
    try:
        got = _drain(prefetcher)
    finally:
        prefetcher.stop()
    assert [b.positions for b in got] == [{0: 3 * (i + 1)} for i in range(6)]
    assert [b.batch for b in got] == [[f"r{i}-0".encode(), f"r{i}-2".encode()] for i in range(6)]
    assert all(b.num_records == 3 for b in got)
    assert all(b.rejected == [(1, "field_count")] for b in got)
    # a rejected record's value and source stay available (dead letters, logs)
    assert got[0].raw.values[1] == b"r0-1" and int(got[0].raw.offsets[1]) == 1
    assert prefetcher.get(timeout=0.1) is None  # after the end: nothing, at once


def test_a_failing_reader_is_raised_at_get_after_the_batches_read_before():
    source = _Source(10, fail_at=2)
    prefetcher = BatchPrefetcher(source.read, _build, max_queued=4)
    prefetcher.start()
    got = []
    try:
        with pytest.raises(RuntimeError, match="disk on fire"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                item = prefetcher.get(timeout=0.1)
                if item is not None:
                    got.append(item)
    finally:
        prefetcher.stop()
    assert [b.positions for b in got] == [{0: 3}, {0: 6}]
    assert prefetcher.finished


def test_read_ahead_is_bounded_while_nobody_takes_batches():
    source = _Source(1000)
    prefetcher = BatchPrefetcher(source.read, _build, max_queued=3)
    prefetcher.start()
    try:
        _wait_for(lambda: prefetcher.queued == 3)
        time.sleep(0.3)
        # the queue's bound plus the one batch waiting to be queued
        assert source.reads <= 3 + 1
        assert prefetcher.queued == 3
        first = prefetcher.get(timeout=1)
        assert first is not None and first.positions == {0: 3}  # still in order
        _wait_for(lambda: source.reads == 5)  # one taken, one more read
    finally:
        prefetcher.stop()


def test_stop_returns_promptly_and_reading_stops():
    source = _Source(1000)
    prefetcher = BatchPrefetcher(source.read, _build, max_queued=2)
    prefetcher.start()
    _wait_for(lambda: prefetcher.queued == 2)  # the reader now waits on a full queue
    t0 = time.monotonic()
    prefetcher.stop(timeout=5)
    assert time.monotonic() - t0 < 2
    reads = source.reads
    time.sleep(0.3)
    assert source.reads == reads  # nothing read after the stop
