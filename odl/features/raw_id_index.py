"""Raw id -> row index of a dynamic embedding table, vectorized with numpy.

A dynamic table (``odl.config.dynamic_table_config``) uses ids as they are: a hashed string's
63-bit FNV-1a value or an integer id (``FeatureBuilder``), never reduced modulo a bucket
count. ``RawIdIndex`` maps such ids (``int64`` in ``[0, 2**63)``) to rows ``[0, capacity)``
of the table's storage and keeps the free rows. The trainer's dynamic tables
(``odl.models.dynamic``) and serving's (``serving_plugin.serving_model``) both use
it, so the two sides drop and map ids by the same rules.

Layout:

* ``row_ids[row]``: the raw id a row holds, ``-1`` when free (the authoritative state; a
  checkpoint stores it with the free-row stack, everything else is derived);
* an open-addressing hash index of ``slots`` (a power of two >= 4 x capacity, ``int32``, so
  the load stays <= 1/4 and the index costs 16 bytes a row): ``slot_row[slot]`` is a row,
  ``-1`` empty or ``-2`` a tombstone left by a removal. The home slot of an id is
  ``splitmix64(id) & (slots - 1)``; collisions probe linearly. Lookups run one vectorized
  probe round per step of the longest chain (a handful at this load). Once tombstones
  exceed a quarter of the slots the index is rebuilt from ``row_ids``;
* ``free``: a stack of free rows; rows are taken from its top, freed rows pushed on it, so
  allocation is deterministic and a restored stack allocates exactly as the saved one would.

``drop_unmapped`` rewrites jagged ids (KeyedJaggedTensor values and lengths) after mapping:
ids without a row are dropped from their bags, so they contribute nothing (sum pooling) and
are not counted (mean pooling).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["RAW_ID_MASK", "RawIdIndex", "RawIdIndexGroup", "drop_unmapped", "grown_index_state",
           "mix64", "slots_for"]

# Raw ids are 63-bit: hashes and negative integers are masked to [0, 2**63).
RAW_ID_MASK = (1 << 63) - 1
_EMPTY = -1
_TOMBSTONE = -2
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of ``ids`` (``uint64``): consecutive ids spread over the slots."""
    z = np.asarray(ids).astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


class RawIdIndex:
    """Raw id -> row map of one table with a fixed number of rows (module docstring).

    Args:
        capacity: rows of the table.
        row_ids: storage for ``row_ids`` (``int64 [capacity]``, filled with -1), e.g. a view of
            a :class:`RawIdIndexGroup`'s buffer; None: its own.
        slot_row: storage for the slots (``int32 [slots_for(capacity)]``, filled with -1).
    """

    def __init__(self, capacity: int, row_ids: np.ndarray | None = None,
                 slot_row: np.ndarray | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        if self.capacity >= 1 << 31:
            raise ValueError(f"capacity must be < 2**31, got {capacity}")
        slots = slots_for(self.capacity)
        self._mask = np.uint64(slots - 1)
        self._slots = slots
        self.row_ids = (np.full(self.capacity, _EMPTY, dtype=np.int64) if row_ids is None
                        else row_ids)
        self._slot_row = (np.full(slots, _EMPTY, dtype=np.int32) if slot_row is None
                          else slot_row)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # top = row 0
        self._free_top = self.capacity
        self._tombstones = 0

    # -- queries ----------------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Rows holding an id."""
        return self.capacity - self._free_top

    @property
    def free(self) -> int:
        """Free rows."""
        return self._free_top

    def nbytes(self) -> int:
        """Bytes of the index's arrays."""
        return self.row_ids.nbytes + self._slot_row.nbytes + self._free.nbytes

    def live_rows(self) -> np.ndarray:
        """Rows holding an id, ascending."""
        return np.flatnonzero(self.row_ids >= 0)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (``int64``; ``-1`` where an id has none). Duplicates are fine."""
        return self._find(np.asarray(ids, dtype=np.int64))[0]

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, slots)`` of ``ids``; ``-1`` for both where an id is absent."""
        if ids.shape[0] == 0 or self.live == 0:
            empty = np.full(ids.shape[0], _EMPTY, dtype=np.int64)
            return empty, empty.copy()
        zero = np.zeros(ids.shape[0], dtype=np.int64)
        return _probe(self._slot_row, self.row_ids, ids,
                      np.full(ids.shape[0], self._mask, dtype=np.uint64), zero, zero)

    # -- changes ----------------------------------------------------------------------------

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Gives each id a free row and returns the rows, in order.

        Args:
            ids: ``int64`` ids in ``[0, 2**63)``, unique, none of them present.

        Returns:
            Their rows.

        Raises:
            ValueError: fewer free rows than ids.
        """
        ids = np.asarray(ids, dtype=np.int64)
        n = ids.shape[0]
        if n > self._free_top:
            raise ValueError(f"{n} ids but only {self._free_top} free rows")
        if n == 0:
            return np.empty(0, dtype=np.int64)
        rows = self._free[self._free_top - n : self._free_top][::-1].copy()
        self._free_top -= n
        self.row_ids[rows] = ids
        self._place(ids, rows)
        return rows

    def remove_rows(self, rows: np.ndarray) -> np.ndarray:
        """Frees rows (each holding an id) and returns the ids they held, in order.

        Args:
            rows: distinct live rows.

        Returns:
            The ids removed.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape[0] == 0:
            return np.empty(0, dtype=np.int64)
        ids = self.row_ids[rows].copy()
        if (ids < 0).any():
            raise ValueError("remove_rows: a row holds no id")
        _, slots = self._find(ids)
        self._slot_row[slots] = _TOMBSTONE
        self._tombstones += rows.shape[0]
        self.row_ids[rows] = _EMPTY
        self._free[self._free_top : self._free_top + rows.shape[0]] = rows
        self._free_top += rows.shape[0]
        if self._tombstones * 4 > self._slots:
            self._rebuild()
        return ids

    def remove_ids(self, ids: np.ndarray) -> np.ndarray:
        """Frees the rows of the ids present (absent ids are ignored); returns those rows."""
        rows = self.lookup(np.unique(np.asarray(ids, dtype=np.int64)))
        rows = rows[rows >= 0]
        self.remove_rows(rows)
        return rows

    def _place(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Writes absent ``ids`` (unique) into the index at their first free slot."""
        home = mix64(ids) & self._mask
        probe = np.zeros(ids.shape[0], dtype=np.uint64)
        pending = np.arange(ids.shape[0])
        while pending.shape[0]:
            s = ((home[pending] + probe[pending]) & self._mask).astype(np.int64)
            before = self._slot_row[s]
            open_ = before < 0
            cand = pending[open_]
            so = s[open_]
            # several candidates for one slot: the last write wins, so write in reverse
            # order and the first candidate keeps the slot
            self._slot_row[so[::-1]] = rows[cand[::-1]]
            won = self._slot_row[so] == rows[cand]
            self._tombstones -= int((before[open_][won] == _TOMBSTONE).sum())
            placed = np.zeros(ids.shape[0], dtype=bool)
            placed[cand[won]] = True
            pending = pending[~placed[pending]]
            probe[pending] += np.uint64(1)

    def _rebuild(self) -> None:
        self._slot_row.fill(_EMPTY)
        self._tombstones = 0
        rows = self.live_rows()
        if rows.shape[0]:
            self._place(self.row_ids[rows], rows)

    # -- checkpoints ------------------------------------------------------------------------

    def free_stack(self) -> np.ndarray:
        """The free rows, bottom to top (the next admission takes the top): a view."""
        return self._free[: self._free_top]

    def state_dict(self) -> dict[str, np.ndarray]:
        """``row_ids`` and the free-row stack (bottom to top): everything needed to restore."""
        return {"row_ids": self.row_ids.copy(), "free": self._free[: self._free_top].copy()}

    def load_state_dict(self, state: dict) -> None:
        """Restores a ``state_dict`` of a table with the same capacity.

        Raises:
            ValueError: the capacity differs or the state is inconsistent.
        """
        row_ids = np.asarray(state["row_ids"], dtype=np.int64)
        free = np.asarray(state["free"], dtype=np.int64)
        if row_ids.shape != (self.capacity,):
            raise ValueError(f"saved table has {row_ids.shape[0]} rows, this one "
                             f"{self.capacity}")
        empty = row_ids < 0
        listed = np.zeros(self.capacity, dtype=bool)  # the free rows, each once (no sort)
        if free.shape[0] and (int(free.min()) < 0 or int(free.max()) >= self.capacity):
            raise ValueError("saved free rows are outside the table")
        listed[free] = True
        if free.shape[0] != int(empty.sum()) or not np.array_equal(listed, empty):
            raise ValueError("saved free rows do not match the saved row ids")
        live = np.sort(row_ids[row_ids >= 0])  # (a sort: np.unique's hashing is slower)
        if live.shape[0] > 1 and bool((live[1:] == live[:-1]).any()):
            raise ValueError("saved row ids are not unique")
        self.row_ids[:] = row_ids  # in place: the storage may be a group's buffer
        self._free = np.empty(self.capacity, dtype=np.int64)
        self._free[: free.shape[0]] = free
        self._free_top = int(free.shape[0])
        self._rebuild()


def grown_index_state(state: dict, capacity: int) -> dict[str, np.ndarray]:
    """A ``RawIdIndex.state_dict`` at ``capacity`` rows: every id in its row.

    The rows added are free, below the old free rows on the stack (taken after them), the
    lowest of them first, so the index allocates as one that had them from the start would
    once its old free rows are used.

    Raises:
        ValueError: ``capacity`` is below the saved rows.
    """
    row_ids = np.asarray(state["row_ids"], dtype=np.int64)
    old = int(row_ids.shape[0])
    if capacity < old:
        raise ValueError(f"an index of {old} rows cannot grow to {capacity}")
    grown = np.full(capacity, _EMPTY, dtype=np.int64)
    grown[:old] = row_ids
    return {"row_ids": grown,
            "free": np.concatenate([np.arange(capacity - 1, old - 1, -1, dtype=np.int64),
                                    np.asarray(state["free"], dtype=np.int64)])}


def slots_for(capacity: int) -> int:
    """Hash slots of an index of ``capacity`` rows: a power of two >= 4 x capacity, >= 16."""
    slots = 16
    while slots < 4 * int(capacity):
        slots *= 2
    return slots


class RawIdIndexGroup:
    """Several indexes in two shared buffers, so one call looks ids up in all of them.

    Each member is a normal :class:`RawIdIndex` (inserts, removals, checkpoints) whose
    ``row_ids`` and slots are views of the group's buffers; :meth:`lookup` probes every
    member at once (a model's dynamic tables, one vectorized pass per step instead of one
    per table).

    Args:
        capacities: rows of each member, in order.
    """

    def __init__(self, capacities: list[int]) -> None:
        caps = [int(c) for c in capacities]
        slots = [slots_for(c) for c in caps]
        self.row_offsets = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        self.slot_offsets = np.concatenate([[0], np.cumsum(slots)]).astype(np.int64)
        self._masks = np.asarray([s - 1 for s in slots], dtype=np.uint64)
        self._row_ids = np.full(int(self.row_offsets[-1]), _EMPTY, dtype=np.int64)
        self._slot_row = np.full(int(self.slot_offsets[-1]), _EMPTY, dtype=np.int32)
        self.members = [
            RawIdIndex(c, self._row_ids[self.row_offsets[i] : self.row_offsets[i + 1]],
                       self._slot_row[self.slot_offsets[i] : self.slot_offsets[i + 1]])
            for i, c in enumerate(caps)
        ]

    def lookup(self, ids: np.ndarray, member: np.ndarray) -> np.ndarray:
        """Rows (each in its member's ``[0, capacity)``) of ``ids[i]`` in ``member[i]``; -1: none.

        Args:
            ids: raw ids.
            member: index of the member each id is looked up in.

        Returns:
            ``int64`` rows.
        """
        ids = np.asarray(ids, dtype=np.int64)
        return _probe(self._slot_row, self._row_ids, ids, self._masks[member],
                      self.slot_offsets[member], self.row_offsets[member])[0]


def _probe(slot_row: np.ndarray, row_ids: np.ndarray, ids: np.ndarray, mask: np.ndarray,
           slot_base: np.ndarray, row_base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The linear-probing search behind every lookup, vectorized over the ids.

    Args:
        slot_row: slots (local rows, -1 empty, -2 tombstone), one buffer for all indexes.
        row_ids: raw id per row, one buffer for all indexes.
        ids: raw ids to find.
        mask: per id, its index's ``slots - 1``.
        slot_base: per id, where its index's slots start in ``slot_row``.
        row_base: per id, where its index's rows start in ``row_ids``.

    Returns:
        ``(rows, slots)`` per id, local to its index; ``-1`` for both where absent.
    """
    n = ids.shape[0]
    rows = np.full(n, _EMPTY, dtype=np.int64)
    slots = np.full(n, _EMPTY, dtype=np.int64)
    home = mix64(ids) & mask
    idx = np.arange(n)
    probe = np.uint64(0)
    while idx.shape[0]:
        s = ((home + probe) & mask).astype(np.int64)
        r = slot_row[s + slot_base].astype(np.int64)
        hit = r >= 0
        hit[hit] = row_ids[r[hit] + row_base[hit]] == ids[idx[hit]]
        rows[idx[hit]] = r[hit]
        slots[idx[hit]] = s[hit]
        more = (r != _EMPTY) & ~hit
        idx, home, mask, slot_base, row_base = (idx[more], home[more], mask[more],
                                                slot_base[more], row_base[more])
        probe += np.uint64(1)
    return rows, slots


def drop_unmapped(values: np.ndarray, lengths: np.ndarray,
                  keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drops the values where ``keep`` is false from their bags.

    Args:
        values: jagged values (one per id), bag after bag.
        lengths: ids per bag (any integer dtype), ``sum(lengths) == len(values)``.
        keep: bool per value.

    Returns:
        ``(kept values, new lengths)`` (lengths keep their dtype).
    """
    if keep.all():
        return values, lengths
    bag = np.repeat(np.arange(lengths.shape[0]), lengths.astype(np.int64))
    new_lengths = np.bincount(bag[keep], minlength=lengths.shape[0]).astype(lengths.dtype)
    return values[keep], new_lengths
