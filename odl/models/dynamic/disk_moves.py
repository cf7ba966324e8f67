"""The moves of one dynamic table's rows between RAM and its disk tier.

A ``DynamicTable`` with a disk tier (``train_config.disk_tier``) holds a :class:`DiskMoves`:
the tier's store (:class:`~odl.models.dynamic.disk_rows.DiskRows`) and the moves the table
decided that the trainer has not applied yet. The table moves a row **out** when it has to
make room (or the row is unseen for ``disk_after_unseen_days``): its counters go to a slot,
its id leaves the index, and no delete is recorded (serving keeps the id). It moves an id
**in** when a batch reads an id on disk, whatever the admission rule: the id gets a row and
its counters back. The trainer then copies the values (``odl.train.dynamic_rows``): out
before it resets the RAM rows, in after (:meth:`DiskMoves.take`).

The ids moved out are also kept for each delete consumer (:meth:`DiskMoves.take_moved_out`):
a row may leave RAM after a step updated it and before the next version, so the publisher
sends it from its slot. Pending ones are part of the table's checkpointed state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from odl.models.dynamic.disk_rows import DiskRows

if TYPE_CHECKING:
    from odl.models.dynamic.dynamic_table import DynamicTable

__all__ = ["DiskMoves", "RowMoves"]


@dataclass
class RowMoves:
    """Rows that moved between RAM and the disk tier since the last ``take``.

    Attributes:
        out_ids: ids moved to disk; ``out_rows`` the RAM rows they left (values still there
            until the trainer resets them), ``out_slots`` their slots.
        in_ids: ids moved back; ``in_rows`` their new RAM rows, ``in_slots`` the slots that
            still hold their values (released once copied).
    """

    out_ids: np.ndarray
    out_rows: np.ndarray
    out_slots: np.ndarray
    in_ids: np.ndarray
    in_rows: np.ndarray
    in_slots: np.ndarray


def _joined(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> np.ndarray:
    return np.concatenate([p[k] for p in parts]) if parts else np.empty(0, dtype=np.int64)


class DiskMoves:
    """One table's disk tier and its pending moves (module docstring).

    Args:
        disk: the tier's store.
    """

    def __init__(self, disk: DiskRows) -> None:
        self.disk = disk
        self._out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids, rows, slots)
        self._in: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._moved: dict[str, list[np.ndarray]] = {}  # consumer -> ids moved out

    def slots(self, ids: np.ndarray) -> np.ndarray | None:
        """Slots of ``ids`` (-1: not on disk); None when the tier is empty."""
        return self.disk.slots(ids) if self.disk.live else None

    def move_in(self, table: DynamicTable, ids: np.ndarray, rows: np.ndarray,
                slots: np.ndarray) -> int:
        """Ids just given ``rows``: those with a slot take their counters back.

        Returns:
            How many came back from disk.
        """
        back = slots >= 0
        if not back.any():
            return 0
        ids, rows, slots = ids[back], rows[back], slots[back]
        counters = self.disk.read_counters(slots)
        table.sightings[rows] = counters[:, 0]
        table.last_step[rows] = counters[:, 1].astype(np.int64)
        table.last_time[rows] = counters[:, 2]
        if table.spec.keeps_scores:
            table.show[rows] = counters[:, 3]
            table.click[rows] = counters[:, 4]
        self._in.append((ids, rows, slots))
        table.counters.from_disk += int(ids.shape[0])
        return int(ids.shape[0])

    def move_out(self, table: DynamicTable, rows: np.ndarray) -> np.ndarray:
        """Gives live ``rows`` slots (counters written, still in the index).

        Returns:
            The rows that found no slot (the tier is full), to be evicted.
        """
        ids = table.index.row_ids[rows]
        zeros = np.zeros(rows.shape[0])
        scores = table.spec.keeps_scores
        counters = np.stack([table.sightings[rows], table.last_step[rows].astype(np.float64),
                             table.last_time[rows], table.show[rows] if scores else zeros,
                             table.click[rows] if scores else zeros], axis=1)
        slots = self.disk.reserve(ids, counters)
        ok = slots >= 0
        if ok.any():
            self._out.append((ids[ok], rows[ok], slots[ok]))
            table.counters.to_disk += int(ok.sum())
            for consumer in table.delete_consumers:
                self._moved.setdefault(consumer, []).append(ids[ok])
        return rows[~ok]

    def take(self) -> RowMoves | None:
        """The moves since the last call (None: none)."""
        if not self._out and not self._in:
            return None
        moves = RowMoves(_joined(self._out, 0), _joined(self._out, 1), _joined(self._out, 2),
                         _joined(self._in, 0), _joined(self._in, 1), _joined(self._in, 2))
        self._out, self._in = [], []
        return moves

    def take_moved_out(self, consumer: str) -> np.ndarray:
        """Ids moved to disk since ``consumer``'s last call (unique, sorted)."""
        pending = self._moved.pop(consumer, None)
        return np.unique(np.concatenate(pending)) if pending else np.empty(0, dtype=np.int64)

    def rows_on_disk(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)`` of those of ``ids`` on disk (values in the slot layout)."""
        ids = np.asarray(ids, dtype=np.int64)
        slots = self.disk.slots(ids)
        on = slots >= 0
        return ids[on], self.disk.read(slots[on])

    def state_dict(self, changed: np.ndarray | None = None) -> dict[str, Any]:
        """The rows on disk and the ids moved out not yet taken, per consumer.

        Args:
            changed: slots changed since the previous checkpoint: the rows on disk as their
                changes (an increment); None: all of them.
        """
        disk = self.disk.state_dict() if changed is None else self.disk.changes_of(changed)
        return {"disk": disk,
                "moved_out_by": {c: np.unique(np.concatenate(v))
                                 for c, v in sorted(self._moved.items()) if v}}

    def load_state_dict(self, state: Mapping[str, Any], consumers: Iterable[str]) -> None:
        """Restores a full ``state_dict`` (the moved-out ids of ``consumers`` only)."""
        self.disk.load_state_dict(state.get("disk"))
        self._out, self._in = [], []
        keep = set(consumers)
        self._moved = {c: [np.asarray(ids, dtype=np.int64)]
                       for c, ids in (state.get("moved_out_by") or {}).items()
                       if c in keep and len(ids)}
