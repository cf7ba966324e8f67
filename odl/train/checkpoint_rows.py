"""The table rows changed since the last checkpoint: what an incremental checkpoint writes.

An increment (``odl.checkpoint.checkpoint_chain``) holds the rows whose weights or
table-optimizer state changed since its parent. Two things change a row:

* a training step: every row a step looks up is updated (fused or row-sparse optimizer,
  in-batch learning): a ``publisher.delta_tracker.DeltaTracker`` of its own records them,
  registered as one more touched-rows hook of the ``TrainModule`` (one bitmap scatter per
  feature and step, as the publisher's; its bitmaps are not the publisher's, which clear
  at every version);
* a dynamic table's decision: a row evicted, expired or shrunk away is reset (fresh
  weights, restarted optimizer state) without being looked up. Those rows are found at the
  checkpoint by comparing each row's raw id with its id at the previous checkpoint (a row
  that changed ids or became free), one vectorized pass over the index.

The same rows are the only ones whose dynamic-table state (id, counters) changed, so dynamic
tables go into an increment as changes too (``odl.models.dynamic.state_changes``): those
rows, the part of the free-row stack that moved (compared with the stack at the previous
checkpoint) and, after a decay of the show / click scores, the scores whole; per partition
when the tables are split by id. A table's disk tier goes in as its slots written or freed
since the previous checkpoint (``odl.models.dynamic.disk_rows``; counted by the tier). One
process gets them from :attr:`CheckpointRows.dynamic_changes`; several ranks from
:meth:`CheckpointRows.dynamic_changes_of` with the rows of every rank joined (each rank
counts the rows its own records looked up): every rank holding the whole index gives the
same document (rank 0's is written), a rank holding some partitions the changes of its own.

:meth:`CheckpointRows.take` hands out both, per TorchRec table, and starts counting anew;
a checkpoint that then fails puts them back (:meth:`CheckpointRows.put_back`). With several
ranks each rank knows the rows its own batches touched and its own partitions' ids; the
checkpoint's union over the ranks (``odl.train.rank_checkpoint``) is what each rank writes
of its shards. Anything else that changes rows (restoring, crash recovery's replay,
re-splitting dynamic tables, a warm start) makes the next checkpoint full instead
(``CheckpointManager.chain`` cleared), after which counting starts from that state
(:meth:`CheckpointRows.restart`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from odl.models.dynamic.state_changes import CHANGES_FORMAT, kept_free_rows, table_changes
from publisher.delta_tracker import DeltaTracker

if TYPE_CHECKING:
    from odl.models.dynamic.dynamic_table import DynamicTable
    from odl.train.train_module import TrainModule

logger = logging.getLogger(__name__)

__all__ = ["CheckpointRows"]


class CheckpointRows:
    """Rows changed since the last checkpoint, per TorchRec table (module docstring).

    Args:
        module: the train module whose steps it follows (hooked on construction).
    """

    def __init__(self, module: TrainModule) -> None:
        self._m = module
        shapes = module.table_shapes()
        self._tracker = DeltaTracker(module.feature_tables(changing=True),
                                     {t: n for t, (n, _c) in shapes.items()})
        module.add_touched_rows_hook(self._tracker.record)
        module.add_table_growth_hook(  # growing dynamic tables: the bitmaps follow
            lambda shapes: self._tracker.grow({t: n for t, (n, _c) in shapes.items()},
                                              module.growth.moves))
        self._ids_at_checkpoint: dict[str, np.ndarray] = {}
        # (partition, dynamic table) -> free-row stack and score-decay time at the previous
        # checkpoint, and before the last take (put back when it fails)
        self._marks: dict[tuple[int, str], tuple[np.ndarray, object]] = {}
        self._marks_before: dict[tuple[int, str], tuple[np.ndarray, object]] = {}
        # dynamic table -> its disk tier's slots changed up to the last take
        self._tier_slots: dict[str, np.ndarray] = {}
        # the dynamic tables' state as changes since the previous checkpoint, made by
        # ``take`` (None: the tables' whole state goes into the checkpoint)
        self.dynamic_changes: dict | None = None
        self.restart()

    def _held_tables(self) -> Iterator[tuple[int, int, str, DynamicTable]]:
        """``(partition, first row, name, DynamicTable)`` of every held partition's table."""
        dynamic = self._m.dynamic
        if not dynamic:
            return
        for base, table in dynamic.tables.items():
            if dynamic.partitions == 1:
                yield 0, 0, base, table
            else:
                for p, (lo, part) in table.held.items():
                    yield p, lo, base, part

    def _dynamic_marks(self) -> dict[tuple[int, str], tuple[np.ndarray, object]]:
        return {(p, base): (table.index.free_stack().copy(), table.decayed_at)
                for p, _lo, base, table in self._held_tables()}

    def _dynamic_ids(self) -> dict[str, np.ndarray]:
        """Dynamic table -> the raw id each row holds now (-1: free; own partitions)."""
        if not self._m.dynamic:
            return {}
        return {base: table.raw_ids(np.arange(table.spec.capacity, dtype=np.int64))
                for base, table in self._m.dynamic.tables.items()}

    def restart(self) -> None:
        """Counts from the module's current state: nothing changed yet."""
        self._tracker.take()
        self._ids_at_checkpoint = self._dynamic_ids()
        self._marks = self._dynamic_marks()
        self._take_tier_slots()
        self.dynamic_changes = None

    def _take_tier_slots(self) -> dict[str, np.ndarray]:
        """Disk-tier slots changed since the last take, per dynamic table with a tier."""
        self._tier_slots = {base: table.disk.take_changed()
                            for _p, _lo, base, table in self._held_tables()
                            if table.disk is not None}
        return self._tier_slots

    def take(self) -> dict[str, np.ndarray]:
        """The rows changed since the last ``take`` / ``restart``; counting starts anew.

        Returns:
            TorchRec table name -> sorted unique ``int64`` whole-table row numbers.
        """
        out = {t: ids.cpu().numpy().astype(np.int64, copy=False)
               for t, ids in self._tracker.take().items()}
        now = self._dynamic_ids()
        for base, ids in now.items():
            before = self._ids_at_checkpoint.get(base)
            moved = (np.flatnonzero(ids != before) if before is not None
                     and before.shape == ids.shape else np.arange(ids.shape[0]))
            if not moved.shape[0]:
                continue
            for t in self._m.dynamic_torch_tables.get(base, ()):
                out[t] = np.union1d(out[t], moved) if t in out else moved.astype(np.int64)
        self._ids_at_checkpoint = now
        self.dynamic_changes = self._take_dynamic_changes(out)
        return out

    def _take_dynamic_changes(self, rows: Mapping[str, np.ndarray]) -> dict | None:
        """Marks the checkpoint; one process: its dynamic tables' changes (``take``'s rows)."""
        self._marks_before = self._marks
        self._marks = self._dynamic_marks()
        self._take_tier_slots()
        return self.dynamic_changes_of(rows) if self._m.world_size == 1 else None

    def dynamic_changes_of(self, rows: Mapping[str, np.ndarray]) -> dict | None:
        """The dynamic tables' changes since the previous checkpoint, after ``take``.

        Args:
            rows: TorchRec table -> rows changed: ``take``'s, with several ranks every
                rank's joined.

        Returns:
            The changes document (``odl.models.dynamic.state_changes``; split by id: of the
            partitions held here), or None (no dynamic tables, or tables that differ from
            the previous checkpoint's): the state goes in whole.
        """
        if not self._m.dynamic or not self._marks or set(self._marks_before) != set(
                self._marks):
            return None
        parts: dict[int, dict] = {}
        empty = np.empty(0, dtype=np.int64)
        for p, lo, base, table in self._held_tables():
            changed = empty
            for t in self._m.dynamic_torch_tables.get(base, ()):
                changed = np.union1d(changed, rows.get(t, empty))
            local = changed[(changed >= lo) & (changed < lo + table.spec.capacity)] - lo
            free_before, decayed_before = self._marks_before[(p, base)]
            parts.setdefault(p, {"format": CHANGES_FORMAT, "tables": {}})["tables"][base] = \
                table_changes(table, local,
                              kept_free_rows(free_before, table.index.free_stack()),
                              scores_whole=table.decayed_at != decayed_before,
                              tier_slots=self._tier_slots.get(base))
        if self._m.dynamic.partitions == 1:
            return parts[0]
        return {"format": CHANGES_FORMAT, "partitions": self._m.dynamic.partitions,
                "parts": parts}

    def put_back(self, rows: Mapping[str, np.ndarray]) -> None:
        """Marks rows as changed again (a checkpoint that took them failed)."""
        self._tracker.put_back({t: torch.from_numpy(np.ascontiguousarray(ids))
                                for t, ids in rows.items() if len(ids)})
        self._marks = self._marks_before  # the next changes are counted from the parent
        for _p, _lo, base, table in self._held_tables():
            if base in self._tier_slots:
                table.disk.put_back_changed(self._tier_slots[base])
        self._tier_slots = {}
        self.dynamic_changes = None
