"""Serving's disk tier: dynamic tables with a bounded set of rows in RAM and the rest on disk.

``odl-serve --disk_tier_dir DIR --ram_rows N`` serves every dynamic table that may hold more
than ``N`` ids (its export's ``rows`` or ``max_rows``) from two tiers (:class:`TieredTable`):

* **RAM**: ``N`` rows of the table's tensor, found through a ``RawIdIndex`` as without the
  tier;
* **disk**: every other row, values only, in ``DIR/<table>/rows.f32``
  (``odl.models.dynamic.disk_rows.DiskRows``: a memory-mapped file of fixed-width records
  whose slot index stays in RAM: 32 bytes a slot, 32-64 bytes a row on disk).

**Prediction reads rows on disk and never moves them.** Before a batch's lookups the batch's
distinct ids that are on disk are copied into *staging rows* that follow the table's ``N``
RAM rows (:meth:`TieredTable.stage`, :meth:`TieredTable.fill_staged`), and the lookup maps
those ids there. One ``embedding_bag`` over the group's storage then pools rows of both
tiers in the request's order, so a prediction equals the same export served from RAM bit for
bit. The staging rows double when a batch needs more (the group's storage grows:
``serving_plugin.table_growth.grown_tables``).

**Versions write both tiers.** A row in RAM is written in place. A row on disk, or a new id,
comes to RAM: the trainer publishes the rows it trains, so a version's ids are the ids the
stream reads now. When RAM is full, the least recently used rows (by the lookups and
versions that read or wrote them; the oldest of a random sample) move to disk to make room.
A version's deletes free rows in either tier. A version that needs more rows than the two
tiers can hold (``--max_disk_rows``, or a disk that keeps less than 1 GiB free) is refused as
``capacity`` before anything is written (:meth:`TieredTable.room_for`).

**The tier's files are scratch.** The export is the durable copy: a start rebuilds the tier
from it, the export's first rows (the trainer's rows in RAM) filling RAM and the rest going
to disk. One process owns a tier directory (:class:`TierDirectory`: a lock, and a marker
file, so a directory that holds files odl-serve did not write, such as a trainer's
``disk_tier.dir``, is refused rather than emptied).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import numpy as np
import torch

from odl.features.raw_id_index import RawIdIndex
from odl.models.dynamic.disk_rows import DiskRows

__all__ = ["DiskTierSettings", "RowLookup", "TierDirectory", "TierDirectoryError",
           "TieredTable"]

# staging rows of a table at the start (doubled when a batch's ids on disk need more)
STAGING_START_ROWS = 1024
# random RAM rows looked at per row to move to disk (the oldest of them move)
_SAMPLE_PER_VICTIM = 8
# the marker file that says odl-serve owns a directory
_MARKER = "ODL_SERVING_DISK_TIER"
_LOCK = ".lock"


class RowLookup(Protocol):
    """Raw ids -> rows of a dynamic table's tensor (-1: no row), as ``RawIdIndex.lookup``."""

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (-1 where an id has none)."""


@dataclass(frozen=True)
class DiskTierSettings:
    """``odl-serve``'s disk tier options.

    Attributes:
        dir: the tier's directory on local disk (one subdirectory per table).
        ram_rows: rows each tiered dynamic table keeps in RAM (> 0).
        max_disk_rows: the most rows of one table on disk (0: while the disk keeps 1 GiB
            free).
    """

    dir: str
    ram_rows: int
    max_disk_rows: int = 0

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("a disk tier needs a directory (--disk_tier_dir)")
        if self.ram_rows < 1:
            raise ValueError(f"--ram_rows must be > 0 with a disk tier, got {self.ram_rows}")
        if self.max_disk_rows < 0:
            raise ValueError(f"--max_disk_rows must be >= 0, got {self.max_disk_rows}")


class TierDirectoryError(RuntimeError):
    """The tier directory is in use by another process or holds files odl-serve did not write."""


class TierDirectory:
    """Owns a tier directory for this process (module docstring).

    Args:
        path: the directory (created when missing).

    Raises:
        TierDirectoryError: another process holds it, or it holds files without odl-serve's
            marker.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        entries = set(os.listdir(self.path)) - {_LOCK}
        if entries and _MARKER not in entries:
            raise TierDirectoryError(
                f"disk tier dir {self.path} holds files odl-serve did not write "
                f"({', '.join(sorted(entries)[:3])}): give odl-serve a directory of its own")
        self._lock = open(os.path.join(self.path, _LOCK), "a+b")  # noqa: SIM115 - held open
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock.close()
            raise TierDirectoryError(f"disk tier dir {self.path} is in use by another "
                                     "odl-serve") from e
        with open(os.path.join(self.path, _MARKER), "w", encoding="utf-8") as f:
            f.write("odl-serve's disk tier: scratch files, rebuilt from the export at start\n")

    def table_dir(self, table: str) -> str:
        """The directory of one table's rows."""
        return os.path.join(self.path, table)

    def close(self) -> None:
        """Releases the directory."""
        if not self._lock.closed:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()


class TieredTable:
    """One dynamic table served from RAM and disk (module docstring).

    Args:
        path: its directory on disk (emptied).
        dim: its row width.
        settings: the tier's options.
        most_rows: the most ids its export allows (the id maps' rows).
    """

    def __init__(self, path: str, dim: int, settings: DiskTierSettings, most_rows: int) -> None:
        self.ram = RawIdIndex(settings.ram_rows)
        self.disk = DiskRows(path, width=dim, max_rows=settings.max_disk_rows, counters=False)
        self.most_rows = int(most_rows)
        self.last_used = np.zeros(settings.ram_rows, dtype=np.int64)
        self._tick = 0
        self._rng = np.random.default_rng(0)
        self._staged_ids = np.empty(0, dtype=np.int64)
        self._staged_slots = np.empty(0, dtype=np.int64)
        # the staged batch's distinct ids (sorted) and their rows in the table's tensor
        self._batch_ids = np.empty(0, dtype=np.int64)
        self._batch_rows = np.empty(0, dtype=np.int64)
        self.disk_reads = 0   # rows staged from disk for predictions
        self.to_disk = 0      # rows moved from RAM to disk to make room
        self.from_disk = 0    # rows on disk that a version brought to RAM

    # -- sizes ------------------------------------------------------------------------------

    @property
    def ram_rows(self) -> int:
        """Rows in RAM (the first rows of the table's tensor)."""
        return self.ram.capacity

    @property
    def live(self) -> int:
        """Ids held, both tiers."""
        return self.ram.live + self.disk.live

    def status(self) -> dict[str, Any]:
        """``/status``'s figures of the table."""
        return {"capacity": self.ram.capacity + (self.disk.max_rows or self.disk.index.capacity),
                "live_rows": self.live, "ram_rows": self.ram.capacity,
                "ram_live": self.ram.live, "disk_rows": self.disk.live,
                "disk_file_bytes": self.disk.disk_bytes(), "disk_index_bytes":
                self.disk.ram_bytes(), "disk_reads": self.disk_reads, "to_disk": self.to_disk,
                "from_disk": self.from_disk}

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id has a row in either tier."""
        return (self.ram.lookup(ids) >= 0) | (self.disk.slots(ids) >= 0)

    # -- prediction -------------------------------------------------------------------------

    def stage(self, ids: np.ndarray) -> int:
        """Finds a batch's ids on disk (every id the batch reads of this table).

        Returns:
            The staging rows they need (:meth:`fill_staged` copies them).
        """
        self._tick += 1
        u = np.unique(np.asarray(ids, dtype=np.int64))
        rows = self.ram.lookup(u)
        self.last_used[rows[rows >= 0]] = self._tick
        miss = np.flatnonzero(rows < 0)
        slots = self.disk.slots(u[miss]) if miss.shape[0] else miss
        on_disk = slots >= 0
        self._staged_ids, self._staged_slots = u[miss[on_disk]], slots[on_disk]
        rows[miss[on_disk]] = self.ram.capacity + np.arange(self._staged_ids.shape[0])
        self._batch_ids, self._batch_rows = u, rows
        return int(self._staged_ids.shape[0])

    def fill_staged(self, table: torch.Tensor) -> None:
        """Copies the staged rows after the RAM rows of ``table`` (it has room for them)."""
        k = self._staged_ids.shape[0]
        if k:
            table[self.ram.capacity : self.ram.capacity + k] = torch.from_numpy(
                self.disk.read(self._staged_slots))
            self.disk_reads += k

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` in the table's tensor: RAM rows, staging rows, -1 for no row.

        The ids of the batch last staged are answered from the stage's result (the rows of
        its distinct ids); any other id through the RAM index (RAM rows only).
        """
        ids = np.asarray(ids, dtype=np.int64)
        known = self._batch_ids
        if not known.shape[0]:
            return self.ram.lookup(ids)
        pos = np.searchsorted(known, ids).clip(max=known.shape[0] - 1)
        found = known[pos] == ids
        if found.all():
            return self._batch_rows[pos]
        rows = self.ram.lookup(ids)
        rows[found] = self._batch_rows[pos[found]]
        return rows

    # -- versions ---------------------------------------------------------------------------

    def room_for(self, ids: np.ndarray, gone: np.ndarray) -> tuple[int, int]:
        """Rows a version's ids need beyond those it frees, and the room the tiers have.

        Grows the disk file when it has to (and may).

        Returns:
            ``(new ids, rows free for them)``; the version fits when the first is not more.
        """
        held = self.holds(ids)
        new = int(((~held) | np.isin(ids, gone)).sum())
        freed = int(self.holds(gone).sum()) if gone.shape[0] else 0
        after = self.live - freed + new
        on_disk = max(0, after - self.ram.capacity)
        if on_disk > self.disk.live:
            self.disk.make_room(on_disk - self.disk.live)
        free_disk = self.disk.index.capacity - self.disk.live
        return new, self.ram.free + free_disk + freed

    def _forget_batch(self) -> None:
        """Drops the staged batch's rows (a version is changing the tiers)."""
        self._batch_ids = self._staged_ids = np.empty(0, dtype=np.int64)
        self._batch_rows = self._staged_slots = np.empty(0, dtype=np.int64)

    def delete(self, table: torch.Tensor, gone: np.ndarray) -> None:
        """Frees the rows of deleted ids in both tiers (RAM rows zeroed)."""
        self._forget_batch()
        freed = self.ram.remove_ids(gone)
        if freed.shape[0]:
            table.index_fill_(0, torch.from_numpy(freed), 0.0)
        self.disk.drop_ids(gone)

    def write(self, table: torch.Tensor, ids: np.ndarray, values: torch.Tensor) -> None:
        """Writes a version's rows (unique ids; :meth:`room_for` said they fit)."""
        self._forget_batch()
        self._tick += 1
        rows = self.ram.lookup(ids)
        hit = np.flatnonzero(rows >= 0)
        if hit.shape[0]:
            self.last_used[rows[hit]] = self._tick
            sel = torch.from_numpy(hit)
            table.index_copy_(0, torch.from_numpy(rows[hit]), values.index_select(0, sel))
        rest = np.flatnonzero(rows < 0)
        if not rest.shape[0]:
            return
        if rest.shape[0] > self.ram.free:
            self._move_out(table, rest.shape[0] - self.ram.free)
        fit = min(rest.shape[0], self.ram.free)
        if fit:  # the first of the others come to RAM (from disk, or new)
            incoming = ids[rest[:fit]]
            self.from_disk += self.disk.drop_ids(incoming)  # the version brings the values
            new_rows = self.ram.insert(incoming)
            self.last_used[new_rows] = self._tick
            table.index_copy_(0, torch.from_numpy(new_rows),
                              values.index_select(0, torch.from_numpy(rest[:fit])))
        if fit < rest.shape[0]:  # more than RAM holds: the others are written on disk
            stay = rest[fit:]
            slots = self.disk.slots(ids[stay])
            there = slots >= 0
            vals = values.index_select(0, torch.from_numpy(stay)).numpy()
            if there.any():
                self.disk.write(slots[there], vals[there])
            if not there.all():
                self._to_disk(ids[stay[~there]], vals[~there])

    def load(self, table: torch.Tensor, ids: np.ndarray, values: np.ndarray) -> None:
        """Adds an export's rows (ids new to both tiers): RAM while it has free rows, then disk.

        Raises:
            ValueError: the disk has no room for them.
        """
        fit = min(ids.shape[0], self.ram.free)
        if fit:
            rows = self.ram.insert(ids[:fit])
            table[torch.from_numpy(rows)] = torch.from_numpy(
                np.array(values[:fit], dtype=np.float32))  # (a copy of a read-only map)
        if fit < ids.shape[0]:
            self._to_disk(ids[fit:], np.asarray(values[fit:], dtype=np.float32))

    def _to_disk(self, ids: np.ndarray, values: np.ndarray) -> None:
        slots = self.disk.reserve(ids)
        if (slots < 0).any():
            raise ValueError(f"disk tier {self.disk.path}: no room for {int((slots < 0).sum())} "
                             f"of {ids.shape[0]} rows (--max_disk_rows, or the disk's free "
                             "space)")
        self.disk.write(slots, values)

    def _move_out(self, table: torch.Tensor, n: int) -> None:
        """Moves up to ``n`` least recently used RAM rows (not used at this tick) to disk."""
        rows = self._victims(n)
        if not rows.shape[0]:
            return
        values = table.index_select(0, torch.from_numpy(rows)).numpy()
        ids = self.ram.remove_rows(rows)
        self._to_disk(ids, values)
        self.to_disk += int(rows.shape[0])

    def _victims(self, n: int) -> np.ndarray:
        """The rows to move out: the oldest of a sample, or of all rows when it is short."""
        cap = self.ram.capacity
        rows = self._movable(self._rng.integers(0, cap, size=min(cap, _SAMPLE_PER_VICTIM * n)))
        if rows.shape[0] > 2 * n:  # the oldest, then distinct (a sample may repeat a row)
            rows = rows[np.argpartition(self.last_used[rows], 2 * n - 1)[: 2 * n]]
        rows = np.unique(rows)
        if rows.shape[0] < n:
            rows = self._movable(np.arange(cap))
        if rows.shape[0] > n:
            rows = rows[np.argpartition(self.last_used[rows], n - 1)[:n]]
        return np.sort(rows)

    def _movable(self, rows: np.ndarray) -> np.ndarray:
        return rows[(self.ram.row_ids[rows] >= 0) & (self.last_used[rows] < self._tick)]


def tiered(settings: Optional[DiskTierSettings], rows: int, max_rows: int) -> bool:
    """Whether a dynamic table is served from the tier: it may hold more than ``ram_rows``.

    Args:
        settings: the tier (None: no tier).
        rows: the table's rows in the export.
        max_rows: the most rows a growing table may reach (0: not growing).
    """
    return settings is not None and max(rows, max_rows) > settings.ram_rows
