"""Dynamic tables split by id into partitions held by the ranks: the id index sharded by id.

With ``train_config.dynamic_index_partitions: P`` > 1 every dynamic table is P independent
tables (``DynamicTables`` builds them):

* **ids**: id x belongs to partition ``partition_of(x, P)``, a salted hash of the raw id
  (``(mix64(x ^ PARTITION_SALT) >> 32) % P``, independent of the index's own slot hash);
* **rows**: partition p owns the rows ``partition_spans(capacity, P)[p]``, the block TorchRec's
  row-wise sharding gives rank p of P (``ceil(capacity / P)`` rows each, the last one the
  rest). N ranks (P a multiple of N) hold P / N consecutive partitions each, whose blocks
  make the rank's row-wise block of N when P = N or the capacity is a multiple of P, so an
  id's row always lives on the rank that holds its index entry;
* **decisions**: each partition is a dynamic table of its block's rows with its own index,
  free rows, counters and sketch: admission, eviction and expiry of partition p depend only
  on the ids of partition p, in the order they are trained.

So ranks holding the partitions make exactly the decisions of one process holding all P
(the tests compare the two), and the checkpoints move between any numbers of ranks that
divide P. No rank holds more than its own partitions of the index and counters; the ranks
exchange the step's ids and each maps the ids it owns (``TrainModule._remap_ranks``).

:class:`PartitionedDynamicTable` gives one table's held partitions the interface of a
``DynamicTable`` in the table's global rows (publishing, crash recovery, export, status):
calls about ids or rows of a partition this process does not hold answer "no row" (-1,
False) and change nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from odl.features.raw_id_index import mix64

if TYPE_CHECKING:
    from odl.models.dynamic.dynamic_table import DynamicTable, TableCounters

__all__ = ["PARTITION_SALT", "PartitionedDynamicTable", "partition_of", "partition_spans"]

# salts the partition hash so it is independent of the index's slot hash (``mix64(id)``'s
# low bits): the ids of one partition still spread over its index's slots
PARTITION_SALT = np.uint64(0x5BD1E9955BD1E995)


def partition_of(ids: np.ndarray, partitions: int) -> np.ndarray:
    """The partition (``int64``, ``[0, partitions)``) of each raw id."""
    if partitions <= 1:
        return np.zeros(np.asarray(ids).shape[0], dtype=np.int64)
    h = mix64(np.asarray(ids).astype(np.uint64) ^ PARTITION_SALT) >> np.uint64(32)
    return (h % np.uint64(partitions)).astype(np.int64)


def partition_spans(capacity: int, partitions: int) -> list[tuple[int, int]]:
    """``[(first row, end row)]`` of each partition: TorchRec's row-wise blocks.

    Raises:
        ValueError: a partition would hold no row (capacity too small for P).
    """
    block = -(-int(capacity) // int(partitions))
    spans = [(min(p * block, capacity), min((p + 1) * block, capacity))
             for p in range(partitions)]
    if any(hi <= lo for lo, hi in spans):
        raise ValueError(f"a dynamic table of {capacity} rows cannot be split into "
                         f"{partitions} partitions of {block} rows (each needs a row)")
    return spans


class PartitionedDynamicTable:
    """One dynamic table's held partitions behind ``DynamicTable``'s interface (global rows).

    Args:
        name: the table's name.
        spec: the whole table's spec (``capacity`` all partitions' rows).
        partitions: P.
        held: partition -> ``(first row, its DynamicTable)`` for the partitions held here.
    """

    def __init__(self, name: str, spec: Any, partitions: int,
                 held: Mapping[int, tuple[int, DynamicTable]]) -> None:
        self.name = name
        self.spec = spec
        self.partitions = partitions
        self.held = dict(sorted(held.items()))

    # -- routing ----------------------------------------------------------------------------

    def _by_id(self, ids: np.ndarray):
        """``(first row, table, mask)`` per held partition, over ``ids``."""
        owner = partition_of(ids, self.partitions)
        for p, (lo, table) in self.held.items():
            yield lo, table, owner == p

    def _by_row(self, rows: np.ndarray):
        """``(first row, table, mask)`` per held partition, over global ``rows``."""
        for lo, table in self.held.values():
            yield lo, table, (rows >= lo) & (rows < lo + table.spec.capacity)

    # -- queries ----------------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Newest stream time seen (every partition sees every step's time)."""
        return max(t.now for _lo, t in self.held.values())

    @property
    def live(self) -> int:
        """Rows holding an id, in the held partitions."""
        return sum(t.index.live for _lo, t in self.held.values())

    @property
    def counters(self) -> TableCounters:
        """Lifetime counts, summed over the held partitions."""
        first = next(iter(self.held.values()))[1].counters
        out = type(first)()
        for _lo, t in self.held.values():
            for k, v in vars(t.counters).items():
                setattr(out, k, getattr(out, k) + v)
        return out

    @property
    def has_maintenance(self) -> bool:
        """Whether a maintenance pass can change anything (``DynamicTable``'s)."""
        return next(iter(self.held.values()))[1].has_maintenance

    @property
    def needs_clicks(self) -> bool:
        """Whether admission reads the clicks (``DynamicTable``'s)."""
        return next(iter(self.held.values()))[1].needs_clicks

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Global rows of ``ids`` (-1 where none, or not held here)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.full(ids.shape[0], -1, dtype=np.int64)
        for lo, table, m in self._by_id(ids):
            r = table.lookup(ids[m])
            rows[m] = np.where(r >= 0, r + lo, -1)
        return rows

    def raw_ids(self, rows: np.ndarray) -> np.ndarray:
        """The raw id each global row holds (-1: free, or not held here)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(rows.shape[0], -1, dtype=np.int64)
        for lo, table, m in self._by_row(rows):
            out[m] = table.raw_ids(rows[m] - lo)
        return out

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """Bool per global row: in a partition held here."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.zeros(rows.shape[0], dtype=bool)
        for _lo, _table, m in self._by_row(rows):
            out |= m
        return out

    def unheld_rows(self) -> np.ndarray:
        """Global rows of the partitions not held here (ascending)."""
        spans = partition_spans(self.spec.capacity, self.partitions)
        return np.concatenate([np.empty(0, dtype=np.int64)] + [
            np.arange(lo, hi, dtype=np.int64) for p, (lo, hi) in enumerate(spans)
            if p not in self.held])

    def live_rows(self) -> np.ndarray:
        """Global rows holding an id, in the held partitions (ascending)."""
        return np.concatenate([t.live_rows() + lo for lo, t in self.held.values()])

    def _per_row(self, rows: np.ndarray, fn, fill) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(rows.shape[0], fill)
        for lo, table, m in self._by_row(rows):
            out[m] = fn(table, rows[m] - lo)
        return out

    def score(self, rows: np.ndarray) -> np.ndarray:
        """``DynamicTable.score`` of global rows (0 outside the held partitions)."""
        return self._per_row(rows, lambda t, r: t.score(r), 0.0)

    def publishable(self, rows: np.ndarray, now: float) -> np.ndarray:
        """``DynamicTable.publishable`` of global rows (False outside the held partitions)."""
        return self._per_row(rows, lambda t, r: t.publishable(r, now), False)

    def exportable(self, rows: np.ndarray) -> np.ndarray:
        """``DynamicTable.exportable`` of global rows (False outside the held partitions)."""
        return self._per_row(rows, lambda t, r: t.exportable(r), False)

    def map_bytes(self) -> int:
        """Bytes of the held partitions' indexes, counters and sketches."""
        return sum(t.map_bytes() for _lo, t in self.held.values())

    # -- deletes ----------------------------------------------------------------------------

    @property
    def record_deletes(self) -> bool:
        """Whether evicted ids are kept for the delta publisher."""
        return next(iter(self.held.values()))[1].record_deletes

    @record_deletes.setter
    def record_deletes(self, on: bool) -> None:
        for _lo, t in self.held.values():
            t.record_deletes = on

    def add_delete_consumer(self, consumer: str) -> None:
        """``DynamicTable.add_delete_consumer`` of every held partition."""
        for _lo, t in self.held.values():
            t.add_delete_consumer(consumer)

    def take_deleted(self, consumer: str = "publisher") -> np.ndarray:
        """Ids the held partitions evicted since ``consumer``'s last call (unique, sorted)."""
        return np.unique(np.concatenate([np.empty(0, dtype=np.int64)] + [
            t.take_deleted(consumer) for _lo, t in self.held.values()]))

    def pending_deletes(self, consumer: str = "publisher") -> int:
        """Evicted ids not yet taken by ``consumer``, in the held partitions."""
        return sum(t.pending_deletes(consumer) for _lo, t in self.held.values())

    # -- changes ----------------------------------------------------------------------------

    def forget(self, ids: np.ndarray) -> np.ndarray:
        """``DynamicTable.forget`` of the held partitions' ids; returns freed global rows."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        freed = [t.forget(ids[m]) + lo for lo, t, m in self._by_id(ids)]
        return np.sort(np.concatenate([np.empty(0, dtype=np.int64)] + freed))

    def upsert(self, ids: np.ndarray, step: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """``DynamicTable.upsert`` of the held partitions' ids (global rows; -1 elsewhere)."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = np.full(ids.shape[0], -1, dtype=np.int64)
        evicted = [np.empty(0, dtype=np.int64)]
        for lo, table, m in self._by_id(ids):
            r, ev = table.upsert(ids[m], step, now)
            rows[m] = np.where(r >= 0, r + lo, -1)
            evicted.append(ev + lo)
        return rows, np.concatenate(evicted)

    def maintain(self, step: int, now: float) -> np.ndarray:
        """One maintenance pass of every held partition; returns evicted global rows."""
        return np.concatenate([np.empty(0, dtype=np.int64)] + [
            t.maintain(step, now) + lo for lo, t in self.held.values()])

