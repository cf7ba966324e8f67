"""The disk tier of one dynamic table: rows that left RAM, in a memory-mapped file by raw id.

With ``train_config.disk_tier`` a dynamic table keeps its ``capacity`` rows in RAM (the
TorchRec table) and moves a row that has to make room (its eviction policy) to disk instead
of dropping it (:class:`DiskRows`). A row on disk is one *slot*, a record of the file
``rows.f32`` in the table's directory (``float32 [slots, width + 10]``):

* the row of every TorchRec table the dynamic table backs (a deep table and its wide twin)
  and its per-row optimizer state, side by side in the order the trainer lays out
  (``odl.train.dynamic_rows``): ``width`` values;
* the row's sightings, last step, last stream time, show and click (``COUNTERS``, five
  ``float64`` stored as ten ``float32`` words), so admission and eviction continue as if it
  had stayed.

Values and counters of a row share a record, so a move touches one page of the map a row.
Serving's tier (``serving_plugin.serving_tier``) keeps values only (``counters=False``).

Which id holds which slot is a ``RawIdIndex`` in RAM (about 32 bytes a slot: the cost of a
row on disk in RAM). The file grows by doubling, up to ``max_rows`` slots and while the disk
keeps ``KEEP_FREE_BYTES`` free; a row that finds no slot is dropped as without the tier.

A move is two-phase, because the table decides and the trainer holds the values: the table
*reserves* slots for the ids it moves out (their counters written) and later *releases*
the slots of ids that came back; between the two the trainer copies the values
(``odl.train.dynamic_rows.DynamicRows``). The file is scratch: the tier's rows live in
checkpoints (``state_dict``), and a restart rebuilds the file from the checkpoint.

A checkpoint holds the rows on disk with their slots (:meth:`DiskRows.state_dict`), so a
restore puts every row back in its slot; an incremental checkpoint holds the slots changed
since the previous checkpoint (:meth:`DiskRows.changes_of`, :meth:`DiskRows.take_changed`),
and :func:`apply_disk_changes` turns the parent's rows and an increment's changes into the
increment's rows.

A memory-mapped file and an index in RAM rather than an embedded key-value store (RocksDB):
a row has a fixed width, so a slot array needs no compaction, no serialization and no
write-ahead log (the checkpoint is the durable copy), and reads of many rows are one fancy
index into the map (the page cache holds the hot pages).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from odl.features.raw_id_index import RawIdIndex, grown_index_state

logger = logging.getLogger(__name__)

__all__ = ["CHANGES_FORMAT", "COUNTERS", "KEEP_FREE_BYTES", "DiskRows", "apply_disk_changes"]

# an increment's changes of the rows on disk (a full state has no "format")
CHANGES_FORMAT = "odl.disk_rows.changes/1"

# the per-row counters a slot keeps, in this order (DynamicTable's names)
COUNTERS = ("sightings", "last_step", "last_time", "show", "click")
# the file grows only while the disk keeps this much free
KEEP_FREE_BYTES = 1 << 30
# slots of a new tier's file
_START_SLOTS = 1 << 14
_ROWS = "rows.f32"
# Linux's madvise advice that reclaims a range's pages (Python's mmap module has no name)
_MADV_PAGEOUT = 21
# float32 words of the counters in a record
_COUNTER_WORDS = 2 * len(COUNTERS)


class DiskRows:
    """One dynamic table's rows on disk (module docstring).

    Args:
        path: the table's directory (created; files of an earlier run are replaced).
        width: float32 values of a row (weights and optimizer state of its tables).
        max_rows: the most rows on disk (0: bounded by the disk's free space only).
        columns: TorchRec table -> the first column of its weights in a row (saved with
            the rows, for ``odl-export``).
        counters: keep the ``COUNTERS`` in each record (False: values only; ``reserve``
            then takes no counters).
    """

    def __init__(self, path: str, width: int, max_rows: int = 0,
                 columns: Mapping[str, int] | None = None, counters: bool = True) -> None:
        if width < 1:
            raise ValueError(f"a disk row needs at least one value, got width {width}")
        self.path = path
        self.width = int(width)
        self.columns = {str(k): int(v) for k, v in (columns or {}).items()}
        self.max_rows = int(max_rows)
        self._counter_words = _COUNTER_WORDS if counters else 0
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
        self.index = RawIdIndex(self._first_slots())
        self._rows = self._map()
        # slots written or freed since the last take_changed (an increment's changes)
        self._changed = np.zeros(self.index.capacity, dtype=bool)
        self._full_logged = False

    def _first_slots(self) -> int:
        return min(_START_SLOTS, self.max_rows) if self.max_rows else _START_SLOTS

    def _map(self) -> np.memmap:
        """The file at the index's slots (extended: the slots it had are kept)."""
        fp = os.path.join(self.path, _ROWS)
        rows, words = self.index.capacity, self.width + self._counter_words
        with open(fp, "ab") as f:
            f.truncate(rows * words * 4)
        return np.memmap(fp, dtype=np.float32, mode="r+", shape=(rows, words))

    # -- queries ----------------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Rows on disk."""
        return self.index.live

    def ids(self) -> np.ndarray:
        """The ids on disk (slot order)."""
        return self.index.row_ids[self.index.live_rows()].copy()

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` (-1 where an id is not on disk)."""
        return self.index.lookup(np.asarray(ids, dtype=np.int64))

    def ram_bytes(self) -> int:
        """Bytes the tier holds in RAM (its index)."""
        return int(self.index.nbytes())

    def disk_bytes(self) -> int:
        """Bytes of its file (every slot, used or not)."""
        return int(self._rows.nbytes)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """The values (``float32 [n, width]``, a copy) of ``slots``."""
        s = np.asarray(slots, dtype=np.int64)
        order = np.argsort(s)  # in file order: the pages one after the other
        out = np.empty((s.shape[0], self.width), dtype=np.float32)
        out[order] = self._rows[s[order], : self.width]
        return out

    def page_out(self) -> None:
        """Writes the file's changed pages and has the kernel drop its pages from memory.

        ``MADV_PAGEOUT``: the next reads come from the disk, as for a tier larger than the
        page cache (benchmarks).
        """
        self._rows.flush()
        self._rows._mmap.madvise(_MADV_PAGEOUT)

    def read_counters(self, slots: np.ndarray) -> np.ndarray:
        """The counters (``float64 [n, 5]``, ``COUNTERS``, a copy) of ``slots``."""
        words = np.ascontiguousarray(self._rows[np.asarray(slots, dtype=np.int64), self.width:])
        return words.view(np.float64)

    # -- changes ----------------------------------------------------------------------------

    def reserve(self, ids: np.ndarray, counters: np.ndarray | None = None) -> np.ndarray:
        """Gives ``ids`` (unique, not on disk) slots and writes their counters (if kept).

        Returns:
            Their slots; ``-1`` for the ids past the tier's bound (the first ids get slots).
        """
        ids = np.asarray(ids, dtype=np.int64)
        out = np.full(ids.shape[0], -1, dtype=np.int64)
        if not ids.shape[0]:
            return out
        n = self.make_room(ids.shape[0])
        if n:
            out[:n] = self.index.insert(ids[:n])
            if self._counter_words:
                self._rows[out[:n], self.width:] = np.ascontiguousarray(
                    counters[:n], dtype=np.float64).view(np.float32)
            self._changed[out[:n]] = True
        return out

    def write(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Writes the values of reserved slots."""
        s = np.asarray(slots, dtype=np.int64)
        order = np.argsort(s)
        self._rows[s[order], : self.width] = np.asarray(values)[order]
        self._changed[s] = True

    def release(self, slots: np.ndarray) -> np.ndarray:
        """Frees slots (their rows went back to RAM, or are gone); returns their ids."""
        s = np.asarray(slots, dtype=np.int64)
        self._changed[s] = True
        return self.index.remove_rows(s)

    def drop_ids(self, ids: np.ndarray) -> int:
        """Frees the slots of the ids on disk (others ignored); returns how many."""
        freed = self.index.remove_ids(ids)
        self._changed[freed] = True
        return int(freed.shape[0])

    def make_room(self, n: int) -> int:
        """Grows the file so that ``n`` more rows fit, if allowed; returns how many fit."""
        need = self.index.live + n
        if self.max_rows:
            need = min(need, self.max_rows)
        rows = self.index.capacity
        while rows < need:
            rows *= 2
        if self.max_rows:
            rows = min(rows, self.max_rows)
        if rows > self.index.capacity:
            extra = (rows - self.index.capacity) * (self.width + self._counter_words) * 4
            if shutil.disk_usage(self.path).free - extra < KEEP_FREE_BYTES:
                if not self._full_logged:
                    logger.warning("disk tier %s: the disk keeps less than %d GiB free; the "
                                   "tier stays at %d slots (a row that finds none is not "
                                   "kept)", self.path, KEEP_FREE_BYTES >> 30,
                                   self.index.capacity)
                    self._full_logged = True
            else:
                self._grow(rows)
        return max(0, min(n, self.index.free))

    def _grow(self, rows: int) -> None:
        state = grown_index_state(self.index.state_dict(), rows)
        self._rows.flush()
        self.index = RawIdIndex(rows)
        self.index.load_state_dict(state)
        self._rows = self._map()
        changed = np.zeros(rows, dtype=bool)
        changed[: self._changed.shape[0]] = self._changed
        self._changed = changed

    # -- checkpoints ------------------------------------------------------------------------

    def _rows_of(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        return {"slots": slots, "ids": self.index.row_ids[slots].copy(),
                "values": np.asarray(self._rows[slots, : self.width]),
                "counters": np.ascontiguousarray(self._rows[slots, self.width:]).view(np.float64)}

    def state_dict(self) -> dict[str, Any]:
        """The rows on disk, each with its slot.

        Returns:
            ``slots`` (ascending), ``ids``, ``values``, ``counters``, ``slot_count`` and
            ``columns``.
        """
        return {**self._rows_of(self.index.live_rows()), "slot_count": self.index.capacity,
                "columns": dict(self.columns)}

    def take_changed(self) -> np.ndarray:
        """The slots written or freed since the last call (ascending); counting starts anew."""
        slots = np.flatnonzero(self._changed)
        self._changed[slots] = False
        return slots

    def put_back_changed(self, slots: np.ndarray) -> None:
        """Marks slots as changed again (the checkpoint that took them failed)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._changed[slots[slots < self._changed.shape[0]]] = True

    def changes_of(self, slots: np.ndarray) -> dict[str, Any]:
        """An increment's changes: the rows of ``slots`` as they are now.

        Returns:
            ``freed`` (the slots of ``slots`` now free) and, for the others, ``slots``,
            ``ids``, ``values`` and ``counters``; ``slot_count`` and ``columns``.
        """
        slots = np.asarray(slots, dtype=np.int64)
        ids = self.index.row_ids[slots]
        out = self._rows_of(slots[ids >= 0])
        return {"format": CHANGES_FORMAT, "freed": slots[ids < 0], **out,
                "slot_count": self.index.capacity, "columns": dict(self.columns)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Replaces the rows on disk with a ``state_dict``, each row in its slot.

        None or an empty state: no rows on disk.

        Raises:
            ValueError: the saved rows have another width, or more than ``max_rows``.
        """
        self._changed[:] = False
        if not state or not len(state["ids"]):
            self.index = RawIdIndex(self.index.capacity)
            return
        slots = np.asarray(state["slots"], dtype=np.int64)
        ids = np.asarray(state["ids"], dtype=np.int64)
        values = np.asarray(state["values"], dtype=np.float32)
        counters = np.asarray(state["counters"], dtype=np.float64)
        if values.shape[1:] != (self.width,):
            raise ValueError(f"the saved disk rows have {values.shape[1:]} values a row, "
                             f"this table {self.width}: the tables or their optimizer differ")
        if self.max_rows and ids.shape[0] > self.max_rows:
            raise ValueError(f"{ids.shape[0]} saved disk rows, disk_tier.max_disk_rows "
                             f"{self.max_rows}")
        rows = max(self._first_slots(), int(state.get("slot_count", 0)), int(slots.max()) + 1)
        row_ids = np.full(rows, -1, dtype=np.int64)
        row_ids[slots] = ids
        self.index = RawIdIndex(rows)  # the lowest free slot on top, as a new index's
        self.index.load_state_dict({"row_ids": row_ids,
                                    "free": np.flatnonzero(row_ids < 0)[::-1].copy()})
        self._rows = self._map()
        self._changed = np.zeros(rows, dtype=bool)
        order = np.argsort(slots)
        self._rows[slots[order], : self.width] = values[order]
        self._rows[slots[order], self.width:] = np.ascontiguousarray(
            counters[order]).view(np.float32)


def apply_disk_changes(full: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The rows on disk after an increment's ``changes`` to its parent's rows ``full``.

    ``changes`` from ``DiskRows.changes_of``; ``full`` from ``DiskRows.state_dict`` or an
    earlier apply.

    Returns:
        A full state, ``full`` left as it was.
    """
    old = np.asarray(full["slots"], dtype=np.int64)
    new = np.asarray(changes["slots"], dtype=np.int64)
    keep = ~np.isin(old, np.concatenate([new, np.asarray(changes["freed"], dtype=np.int64)]))
    slots = np.concatenate([old[keep], new])
    order = np.argsort(slots, kind="stable")
    out = {"slots": slots[order], "slot_count": int(changes["slot_count"]),
           "columns": dict(changes["columns"])}
    for key in ("ids", "values", "counters"):
        out[key] = np.concatenate([np.asarray(full[key])[keep], np.asarray(changes[key])])[order]
    return out
