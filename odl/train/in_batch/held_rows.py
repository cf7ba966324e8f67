"""The table rows this rank holds: their accumulators read, their corrections written.

In-batch learning reads the accumulators of the rows a step's records share, and per-record
Adagrad corrects those rows after the fused update. Which rows a rank can read or write is the
table placement's business, not theirs: a rank holding whole tables (one process) reads and
writes any row through the ``RowPairIndex``'s flat buffers (:class:`WholeTables`); a rank of
a sharded model reads and writes the rows its shards hold (:class:`ShardedTables`), and
``StepExchange.held_values`` takes each row's values from the rank holding it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from odl.train.in_batch import native_kernels
from odl.train.in_batch.batch_row_pairs import RowPairIndex

# (tables, rows) -> (accumulators [U, acc_width], held [U] bool) of the rows this rank holds
ReadShards = Callable[[Sequence[str], np.ndarray], tuple[np.ndarray, np.ndarray]]
# (tables, rows, weight deltas [U, width], accumulators [U, acc_width]) for held rows only
WriteShards = Callable[[Sequence[str], np.ndarray, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class RowsRead:
    """The accumulators of ``U`` (lookup, row)s as this rank read them.

    Attributes:
        values: ``[U, acc_width]`` float32, 0 where not held here (``acc_width`` 1 for
            row-wise Adagrad, else the index's width, 0 beyond a lookup's own columns).
        held: ``[U]`` bool, this rank holds the row.
        lookup: ``[U]`` the rows' lookups.
        rows: ``[U]`` the rows in their tables.
        where: where the held rows lie (the holder's own; None: not kept).
    """

    values: np.ndarray
    held: np.ndarray
    lookup: np.ndarray
    rows: np.ndarray
    where: Any = None


class HeldRows(Protocol):
    """The rows of the model's lookups that this rank holds, by (lookup, row)."""

    def accumulators(self, lookup: np.ndarray, rows: np.ndarray) -> RowsRead:
        """The accumulators of the (lookup, row)s, as ``RowsRead``."""
        ...

    def update(self, read: RowsRead, at: np.ndarray, delta: np.ndarray,
               acc: np.ndarray) -> None:
        """Adds ``delta`` ``[A, width]`` to the weights and sets the accumulators ``acc``.

        Of the rows ``read.lookup[at]``, ``read.rows[at]``: distinct table rows, all held
        here.
        """
        ...


class WholeTables:
    """Every row, through the index's buffers (a rank holding whole tables).

    Args:
        index: a ``RowPairIndex`` built with the tables' weights and accumulators.
    """

    def __init__(self, index: RowPairIndex) -> None:
        self._index = index
        # on the CPU: the rows read and written in place by row_pairs.c (None: through plans)
        self._lib = native_kernels.library()
        self._in_place = index.rows_in_place() if self._lib is not None else None
        # the last rows read and where they lie: a step reads its shared rows' accumulators
        # before the backward (the shift) and after it (per-record Adagrad)
        self._last: RowsRead | None = None

    def _at(self, lookup: np.ndarray, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        device = self._index.multiplier.device
        return (torch.from_numpy(np.ascontiguousarray(lookup)).to(device),
                torch.from_numpy(np.ascontiguousarray(rows)).to(device))

    def accumulators(self, lookup: np.ndarray, rows: np.ndarray) -> RowsRead:
        """See ``HeldRows.accumulators``: every row is held."""
        index = self._index
        if self._in_place is not None:
            values = self._in_place[0].read(self._lib, lookup, rows,
                                            1 if index.rowwise else index.width)
            return RowsRead(values, np.ones(len(rows), dtype=bool), lookup, rows)
        last = self._last
        if (last is not None and np.array_equal(last.rows, rows)
                and np.array_equal(last.lookup, lookup)):
            at, plan = last.where
        else:
            at = self._at(lookup, rows)
            plan = index.plan_accumulators(*at)
        values = index.accumulators(plan, torch.float32).cpu().numpy()
        self._last = RowsRead(values, np.ones(len(rows), dtype=bool), lookup, rows, (at, plan))
        return self._last

    def update(self, read: RowsRead, at: np.ndarray, delta: np.ndarray,
               acc: np.ndarray) -> None:
        """See ``HeldRows.update``."""
        index = self._index
        if self._in_place is not None:
            states, weights = self._in_place
            lookup, rows = read.lookup[at], read.rows[at]
            weights.write(self._lib, lookup, rows, delta, add=True)
            states.write(self._lib, lookup, rows, acc, add=False)
            return
        (lookup, rows), plan = read.where
        if len(at) != len(read.rows):  # a part of the rows read: plan them again
            lookup, rows = self._at(read.lookup[at], read.rows[at])
            plan = index.plan_accumulators(lookup, rows)
        device = lookup.device
        index.add_to_weights(index.plan_weights(lookup, rows), torch.from_numpy(delta).to(device))
        index.set_accumulators(plan, torch.from_numpy(acc).to(device))


class ShardedTables:
    """The rows this rank's shards hold (a rank of a model sharded over several ranks).

    Args:
        lookup_tables: per lookup of the index, the TorchRec table it reads.
        read: reads the accumulators of the rows this rank's shards hold
            (``table_shards.read_held_accumulators``).
        write: adds weight deltas and sets accumulators of rows this rank holds
            (``table_shards.write_held_rows``).
    """

    def __init__(self, lookup_tables: Sequence[str], read: ReadShards,
                 write: WriteShards) -> None:
        self._tables = list(lookup_tables)
        self._read, self._write = read, write

    def accumulators(self, lookup: np.ndarray, rows: np.ndarray) -> RowsRead:
        """See ``HeldRows.accumulators``."""
        values, held = self._read([self._tables[i] for i in lookup], rows)
        return RowsRead(values, held, lookup, rows)

    def update(self, read: RowsRead, at: np.ndarray, delta: np.ndarray,
               acc: np.ndarray) -> None:
        """See ``HeldRows.update``."""
        self._write([self._tables[i] for i in read.lookup[at]], read.rows[at], delta, acc)
