"""One dynamic table: its id index, per-row counters, admission, eviction and expiry.

The rules it applies (one per step, the ``maintenance_interval`` pass, the deletes kept for
the publisher) are the engine's, written in :mod:`odl.models.dynamic`. Its state
(:meth:`DynamicTable.state_dict`: the index, the free-row stack, the counters, the sketch)
restores it exactly.

With a disk tier (``DynamicTable.tier``, :mod:`odl.models.dynamic.disk_rows`) a row that has
to make room, or is unseen for ``spec.disk_after_unseen_days``, moves to disk with its
counters instead of being dropped (no delete is published: serving keeps the id), and an id
on disk that a batch reads comes back at once, whatever the admission rule. The table
records each move (ids, rows, slots) for the trainer, which copies the values
(:mod:`odl.models.dynamic.disk_moves`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.raw_id_index import RawIdIndex, mix64
from odl.models.dynamic.admission_sketch import CountMinSketch
from odl.models.dynamic.disk_moves import DiskMoves, RowMoves
from odl.models.dynamic.disk_rows import DiskRows

__all__ = ["DynamicTable", "TableCounters", "state_arrays", "state_tensors"]

STATE_FORMAT = "odl.dynamic_tables/1"
# the delete consumer of the delta publisher (``DynamicTable.record_deletes``)
PUBLISHER_DELETES = "publisher"
# Once a table has to make room it evicts at least this fraction of its capacity, and at
# least this many times the rows the step needs, so the ranking runs rarely.
EVICT_BLOCK_FRACTION = 0.01
EVICT_BLOCK_SHORTS = 8
_SECS_PER_DAY = 86400.0


@dataclass
class TableCounters:
    """Lifetime counts of one dynamic table.

    Attributes:
        admitted: ids given a row.
        rejected: candidate ids refused a row (once per step they appeared in).
        evicted: rows evicted (to make room or expired).
        expired: of those, rows evicted by a maintenance pass.
        to_disk: rows moved to the disk tier.
        from_disk: rows moved back from the disk tier.
    """

    admitted: int = 0
    rejected: int = 0
    evicted: int = 0
    expired: int = 0
    to_disk: int = 0
    from_disk: int = 0


class DynamicTable:
    """One dynamic table's index, counters and policy (see the module docstring).

    Args:
        name: the table's name.
        spec: its admission / eviction settings.
        seed: the model's seed (sketch hashing).
        index: its id index (e.g. a member of a ``RawIdIndexGroup``); None: its own.
        counters: ``(sightings, last_step, last_time)`` storage (views of shared buffers,
            zero-filled); None: its own.
    """

    def __init__(self, name: str, spec: DynamicTableSpec, seed: int = 0,
                 index: Optional[RawIdIndex] = None,
                 counters: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> None:
        self.name = name
        self.spec = spec
        # evicted ids are kept for take_deleted only for the consumers that publish them
        self.delete_consumers: set[str] = set()
        c = spec.capacity
        self.index = RawIdIndex(c) if index is None else index
        if counters is None:
            counters = (np.zeros(c, dtype=np.float64), np.zeros(c, dtype=np.int64),
                        np.zeros(c, dtype=np.float64))
        self.sightings, self.last_step, self.last_time = counters
        self.show = np.zeros(c if spec.keeps_scores else 0, dtype=np.float64)
        self.click = np.zeros(c if spec.keeps_scores else 0, dtype=np.float64)
        # sized for the most rows the table can have, so a growing table keeps its sketch
        self.sketch = (CountMinSketch(spec.max_rows, seed ^ (hash_name(name) & 0xFFFF),
                                      clicks=spec.admit_score > 0 or spec.keeps_scores)
                       if spec.counts_candidates else None)
        self.counters = TableCounters()
        self.decayed_at: Optional[float] = None
        self.now = 0.0  # newest stream time seen (unix seconds)
        self._deleted: dict[str, list[np.ndarray]] = {}
        self.tier: Optional[DiskMoves] = None  # the disk tier (``attach_disk``)

    @property
    def disk(self) -> Optional[DiskRows]:
        """The disk tier's store (None: no tier)."""
        return self.tier.disk if self.tier is not None else None

    def attach_disk(self, disk: DiskRows) -> None:
        """Gives the table a disk tier (module docstring)."""
        self.tier = DiskMoves(disk)

    def take_moves(self) -> Optional[RowMoves]:
        """Moves between RAM and disk since the last call (None: none, or no tier)."""
        return self.tier.take() if self.tier is not None else None

    def take_moved_out(self, consumer: str = PUBLISHER_DELETES) -> np.ndarray:
        """Ids moved to disk since ``consumer``'s last call (unique, sorted)."""
        if self.tier is None:
            return np.empty(0, dtype=np.int64)
        return self.tier.take_moved_out(consumer)

    def disk_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)`` of those of ``ids`` on the disk tier (values: slot layout)."""
        if self.tier is None or not len(ids):
            return np.empty(0, dtype=np.int64), np.empty((0, 0), dtype=np.float32)
        return self.tier.rows_on_disk(ids)

    @property
    def record_deletes(self) -> bool:
        """Whether evicted ids are kept for the delta publisher (consumer ``"publisher"``)."""
        return PUBLISHER_DELETES in self.delete_consumers

    @record_deletes.setter
    def record_deletes(self, on: bool) -> None:
        if on:
            self.add_delete_consumer(PUBLISHER_DELETES)
        else:
            self.delete_consumers.discard(PUBLISHER_DELETES)
            self._deleted.pop(PUBLISHER_DELETES, None)

    def add_delete_consumer(self, consumer: str) -> None:
        """Keeps evicted ids from now on for ``take_deleted(consumer)``."""
        self.delete_consumers.add(consumer)

    # -- queries ----------------------------------------------------------------------------

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (``-1`` where none); no admission, no counters."""
        return self.index.lookup(ids)

    def raw_ids(self, rows: np.ndarray) -> np.ndarray:
        """The raw id each row holds (-1: free)."""
        return self.index.row_ids[np.asarray(rows, dtype=np.int64)]

    def live_rows(self) -> np.ndarray:
        """Rows holding an id (ascending)."""
        return self.index.live_rows()

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """Bool per row: held by this process (every row of a table of one partition)."""
        return np.ones(np.asarray(rows).shape[0], dtype=bool)

    def unheld_rows(self) -> np.ndarray:
        """Rows of partitions held elsewhere: none."""
        return np.empty(0, dtype=np.int64)

    @property
    def live(self) -> int:
        """Rows holding an id."""
        return self.index.live

    def score(self, rows: np.ndarray) -> np.ndarray:
        """PaddleRec's score of rows (0 when the table keeps no show / click counts)."""
        if not self.spec.keeps_scores:
            return np.zeros(rows.shape[0])
        s, c = self.show[rows], self.click[rows]
        return self.spec.click_coeff * c + self.spec.nonclk_coeff * (s - c)

    def publishable(self, rows: np.ndarray, now: float) -> np.ndarray:
        """Bool per live row: published in a delta (``delta_threshold``, ``delta_keep_days``)."""
        ok = np.ones(rows.shape[0], dtype=bool)
        if self.spec.delta_threshold is not None:
            ok &= self.score(rows) >= self.spec.delta_threshold
        if self.spec.delta_keep_days is not None:
            ok &= (now - self.last_time[rows]) <= self.spec.delta_keep_days * _SECS_PER_DAY
        return ok

    def exportable(self, rows: np.ndarray) -> np.ndarray:
        """Bool per live row: written by ``odl-export`` (``base_threshold``)."""
        if self.spec.base_threshold is None:
            return np.ones(rows.shape[0], dtype=bool)
        return self.score(rows) >= self.spec.base_threshold

    def map_bytes(self) -> int:
        """Bytes of the index, the counters and the sketch (the table rows not included)."""
        n = (self.index.nbytes() + self.sightings.nbytes + self.last_step.nbytes
             + self.last_time.nbytes + self.show.nbytes + self.click.nbytes)
        return n + (self.sketch.nbytes() if self.sketch is not None else 0)

    # -- training ---------------------------------------------------------------------------

    def admit(self, ids: np.ndarray, clicks: np.ndarray, step: int,
              now: float) -> tuple[np.ndarray, np.ndarray]:
        """Maps one step's ids to rows, admitting and evicting (module docstring, 1-4).

        Args:
            ids: raw ids, one per lookup (duplicates allowed).
            clicks: 1.0 where the id's sample has a positive label, else 0.0.
            step: the step being trained (counters record it).
            now: stream time (unix seconds).

        Returns:
            ``(rows, evicted rows)``; rows are ``-1`` for ids left without one.
        """
        rows = self.index.lookup(ids)
        evicted = self.admit_missing(ids, clicks, rows, step)
        self.count_used(rows, clicks, step, now)
        used = rows >= 0
        r = rows[used] if not used.all() else rows
        if r.shape[0]:
            np.add.at(self.sightings, r, 1.0)
            self.last_step[r] = step
            self.last_time[r] = now
        return rows, evicted

    def admit_missing(self, ids: np.ndarray, clicks: np.ndarray, rows: np.ndarray,
                      step: int, shows: Optional[np.ndarray] = None) -> np.ndarray:
        """Steps 2-3 of ``admit`` for the ids whose ``rows`` are -1 (``rows`` is filled in).

        Args:
            ids: raw ids, one per lookup.
            clicks: clicks per lookup (read when the table counts clicks).
            rows: their rows, -1 where none (filled in for the ids admitted).
            step: the step being trained.
            shows: shows per lookup (``show_field``); None: 1 each.

        Returns:
            The rows evicted to make room.
        """
        miss = rows < 0
        evicted = np.empty(0, dtype=np.int64)
        if miss.any():
            u, inv, cnt = np.unique(ids[miss], return_inverse=True, return_counts=True)
            if shows is not None:
                cnt = np.bincount(inv, weights=shows[miss], minlength=u.shape[0])
            clk = (np.bincount(inv, weights=clicks[miss], minlength=u.shape[0])
                   if self.needs_clicks else np.zeros(u.shape[0]))
            ok = np.ones(u.shape[0], dtype=bool)
            slot_u = self.tier.slots(u) if self.tier is not None else None
            prior_s = prior_c = None
            if self.sketch is not None:
                est_s, est_c = self.sketch.add(u, cnt.astype(np.float64), clk)
                if self.spec.admit_freq > 1:
                    ok &= est_s >= self.spec.admit_freq
                if self.spec.admit_score > 0:
                    score = (self.spec.click_coeff * est_c
                             + self.spec.nonclk_coeff * (est_s - est_c))
                    ok &= score >= self.spec.admit_score
                prior_s = np.maximum(est_s - cnt, 0.0)
                prior_c = np.maximum(est_c - clk, 0.0)
            if self.spec.admit_probability < 1.0:
                ok &= _chance(u, step) < self.spec.admit_probability
            if slot_u is not None:  # an id on disk was admitted before: it comes back
                ok |= slot_u >= 0
            want = np.flatnonzero(ok)
            short = want.shape[0] - self.index.free
            if short > 0:
                evicted = self._evict_for_room(short, rows[~miss], step)
                want = want[: self.index.free]
            new_rows = self.index.insert(u[want])
            self.sightings[new_rows] = 0.0
            if self.spec.keeps_scores:
                self.show[new_rows] = prior_s[want] if prior_s is not None else 0.0
                self.click[new_rows] = prior_c[want] if prior_c is not None else 0.0
            back = (self.tier.move_in(self, u[want], new_rows, slot_u[want])
                    if slot_u is not None else 0)
            row_of_u = np.full(u.shape[0], -1, dtype=np.int64)
            row_of_u[want] = new_rows
            rows[miss] = row_of_u[inv]
            self.counters.admitted += int(want.shape[0]) - back
            self.counters.rejected += int(u.shape[0] - want.shape[0])
        return evicted

    def bring_back(self, ids: np.ndarray, rows: np.ndarray, step: int) -> np.ndarray:
        """A prediction's lookups: ids on disk whose ``rows`` are -1 come back to RAM.

        No admission and no counting (a prediction learns nothing); the rows that make room
        move to disk as for a training step's admissions. ``rows`` is filled in.

        Returns:
            The rows that left RAM to make room.
        """
        miss = rows < 0
        if self.tier is None or not miss.any():
            return np.empty(0, dtype=np.int64)
        u, inv = np.unique(ids[miss], return_inverse=True)
        slot_u = self.tier.slots(u)
        want = np.flatnonzero(slot_u >= 0)
        evicted = np.empty(0, dtype=np.int64)
        if not want.shape[0]:
            return evicted
        short = want.shape[0] - self.index.free
        if short > 0:
            evicted = self._evict_for_room(short, rows[~miss], step)
            want = want[: self.index.free]
        new_rows = self.index.insert(u[want])
        self.tier.move_in(self, u[want], new_rows, slot_u[want])
        row_of_u = np.full(u.shape[0], -1, dtype=np.int64)
        row_of_u[want] = new_rows
        rows[miss] = row_of_u[inv]
        return evicted

    def count_used(self, rows: np.ndarray, clicks: np.ndarray, step: int, now: float,
                   shows: Optional[np.ndarray] = None) -> None:
        """Counts show / click of the rows used (step 4, per table) and the stream time.

        Sightings and last step / time are counted by the caller (``admit``, or
        ``DynamicTables.remap`` for all tables at once).
        """
        self.now = max(self.now, now)
        if self.spec.keeps_scores:
            used = rows >= 0
            r = rows[used] if not used.all() else rows
            if shows is None:
                np.add.at(self.show, r, 1.0)
            else:
                np.add.at(self.show, r, shows[used] if r is not rows else shows)
            np.add.at(self.click, r, clicks[used] if r is not rows else clicks)

    @property
    def has_maintenance(self) -> bool:
        """Whether a maintenance pass can change anything (decay or an expiry rule)."""
        spec = self.spec
        return bool(spec.steps_to_live or spec.delete_threshold is not None
                    or spec.delete_after_unseen_days is not None
                    or (spec.keeps_scores and spec.decay_rate_per_day < 1.0))

    @property
    def needs_clicks(self) -> bool:
        """Whether ``admit`` reads the clicks (show / click counts or a score threshold)."""
        return self.spec.keeps_scores or self.spec.admit_score > 0

    def priority(self, rows: Optional[np.ndarray], step: int) -> np.ndarray:
        """Keep priority of ``rows`` (higher = kept; None: every row, without copying)."""
        policy = self.spec.policy
        sel = slice(None) if rows is None else rows
        if policy == "lru":
            return self.last_step[sel]
        if policy == "lfu":
            return self.sightings[sel]
        if policy == "distance_lfu":
            age = (step - self.last_step[sel]).astype(np.float64) + 1.0
            return self.sightings[sel] / np.power(age, self.spec.decay_exponent)
        return self.score(np.arange(self.spec.capacity) if rows is None else rows)

    def _evict_for_room(self, short: int, protect: np.ndarray, step: int) -> np.ndarray:
        full = self.index.free == 0
        live = None if full else self.index.live_rows()
        prio = self.priority(live, step)
        protect = np.unique(protect)
        n_live = self.spec.capacity if live is None else int(live.shape[0])
        evictable = n_live - int(protect.shape[0])
        block = max(EVICT_BLOCK_SHORTS * short,
                    int(np.ceil(self.spec.capacity * EVICT_BLOCK_FRACTION)))
        k = min(evictable, max(short, block))
        if k <= 0:
            return np.empty(0, dtype=np.int64)
        # the k + |protect| lowest, then the protected ones left out: exactly the k lowest
        # evictable rows
        pos = _lowest(prio, min(n_live, k + protect.shape[0]))
        victims = pos if live is None else live[pos]
        if protect.shape[0]:
            free = ~np.isin(victims, protect, assume_unique=True)
            victims = victims[free][np.argsort(prio[pos][free], kind="stable")[:k]]
        self._remove(victims, to_disk=True)
        return victims

    def _remove(self, rows: np.ndarray, evicted: bool = True, to_disk: bool = False) -> None:
        """Frees rows and clears their counters.

        An eviction is counted and, when deltas are published, its ids kept as deletes.
        ``to_disk`` with a disk tier: the rows move to disk instead (not an eviction), but
        for those past the tier's bound.
        """
        rows = np.sort(rows)
        if to_disk and self.tier is not None and rows.shape[0]:
            dropped = self.tier.move_out(self, rows)
            if dropped.shape[0] < rows.shape[0]:
                self._free_rows(np.setdiff1d(rows, dropped, assume_unique=True),
                                evicted=False)
            rows = dropped
        self._free_rows(rows, evicted)

    def _free_rows(self, rows: np.ndarray, evicted: bool) -> None:
        """``_remove`` of sorted rows, without the disk tier."""
        gone = self.index.remove_rows(rows)
        self.sightings[rows] = 0.0
        if self.spec.keeps_scores:
            self.show[rows] = 0.0
            self.click[rows] = 0.0
        if evicted:
            for consumer in self.delete_consumers:
                self._deleted.setdefault(consumer, []).append(gone)
            self.counters.evicted += int(rows.shape[0])

    def maintain(self, step: int, now: float) -> np.ndarray:
        """One maintenance pass (decay, expiry); returns the rows evicted."""
        spec = self.spec
        if spec.keeps_scores and spec.decay_rate_per_day < 1.0:
            if self.decayed_at is not None and now > self.decayed_at:
                f = spec.decay_rate_per_day ** ((now - self.decayed_at) / _SECS_PER_DAY)
                self.show *= f
                self.click *= f
            if self.decayed_at is None or now > self.decayed_at:
                self.decayed_at = now
        live = self.index.live_rows()
        if live.shape[0] == 0:
            return np.empty(0, dtype=np.int64)
        expired = np.zeros(live.shape[0], dtype=bool)
        if spec.steps_to_live:
            expired |= (step - self.last_step[live]) > spec.steps_to_live
        if spec.delete_threshold is not None:
            expired |= self.score(live) < spec.delete_threshold
        if spec.delete_after_unseen_days is not None:
            expired |= (now - self.last_time[live]) > spec.delete_after_unseen_days * _SECS_PER_DAY
        victims = live[expired]
        if victims.shape[0]:
            self._remove(victims)
            self.counters.expired += int(victims.shape[0])
        if self.tier is not None and spec.disk_after_unseen_days is not None:
            kept = live[~expired]  # rows unseen that long move to disk (still live)
            unseen = kept[(now - self.last_time[kept])
                          > spec.disk_after_unseen_days * _SECS_PER_DAY]
            if unseen.shape[0]:
                self._remove(unseen, to_disk=True)
                victims = np.concatenate([victims, unseen])
        return victims

    def take_deleted(self, consumer: str = "publisher") -> np.ndarray:
        """Ids evicted since ``consumer``'s last call (unique, sorted)."""
        pending = self._deleted.pop(consumer, None)
        if not pending:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(pending))

    def pending_deletes(self, consumer: str = "publisher") -> int:
        """Evicted ids not yet taken by ``consumer`` (duplicates counted)."""
        return sum(a.shape[0] for a in self._deleted.get(consumer, ()))

    def forget(self, ids: np.ndarray) -> np.ndarray:
        """Removes ids (absent ones ignored) without publishing a delete; returns freed rows.

        Used by crash recovery for ids whose delete serving already has.
        """
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        if self.disk is not None:
            self.disk.drop_ids(ids)
        rows = self.index.lookup(ids)
        rows = np.sort(rows[rows >= 0])
        if rows.shape[0]:
            self._remove(rows, evicted=False)
        return rows

    def upsert(self, ids: np.ndarray, step: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Gives ``ids`` (unique) rows whatever the admission rule (crash recovery).

        With a disk tier the ids' rows on disk are dropped: the values given to the rows
        replace them.

        Returns:
            ``(rows of ids, evicted rows)``; ids that found no room get ``-1``.
        """
        if self.disk is not None:
            self.disk.drop_ids(ids)
        rows = self.index.lookup(ids)
        miss = np.flatnonzero(rows < 0)
        evicted = np.empty(0, dtype=np.int64)
        if miss.shape[0]:
            short = miss.shape[0] - self.index.free
            if short > 0:
                evicted = self._evict_for_room(short, rows[rows >= 0], step)
                miss = miss[: self.index.free]
            rows[miss] = self.index.insert(ids[miss])
            self.sightings[rows[miss]] = 1.0
        ok = rows >= 0
        self.last_step[rows[ok]] = step
        self.last_time[rows[ok]] = now
        return rows, evicted

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (index, counters, sketch, pending deletes)."""
        out = {
            "index": self.index.state_dict(),
            "sightings": self.sightings.copy(),
            "last_step": self.last_step.copy(),
            "last_time": self.last_time.copy(),
            "show": self.show.copy(),
            "click": self.click.copy(),
        }
        out.update(self.state_dict_without_rows())
        return out

    def state_dict_without_rows(self, tier_slots: Optional[np.ndarray] = None
                                ) -> dict[str, Any]:
        """The part of ``state_dict`` that is not per row: sketch, counts, pending deletes.

        With a disk tier also its rows: all of them, or as the changes of ``tier_slots``
        (an increment's, ``odl.models.dynamic.disk_rows``).
        """
        return {
            "sketch": self.sketch.state_dict() if self.sketch is not None else None,
            "counters": dict(vars(self.counters)),
            "decayed_at": self.decayed_at,
            "now": self.now,
            "deleted": self._pending(PUBLISHER_DELETES),
            "deleted_by": {c: self._pending(c) for c in sorted(self._deleted)
                           if c != PUBLISHER_DELETES},
            "tier": self.tier.state_dict(tier_slots) if self.tier is not None else None,
        }

    def _pending(self, consumer: str) -> np.ndarray:
        pending = self._deleted.get(consumer)
        return np.unique(np.concatenate(pending)) if pending else np.empty(0, dtype=np.int64)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict`` (same capacity and form)."""
        self.index.load_state_dict(state["index"])
        # in place: the counters may be views of shared buffers
        self.sightings[:] = np.asarray(state["sightings"], dtype=np.float64)
        self.last_step[:] = np.asarray(state["last_step"], dtype=np.int64)
        self.last_time[:] = np.asarray(state["last_time"], dtype=np.float64)
        if self.spec.keeps_scores:
            if np.asarray(state["show"]).shape[0] != self.spec.capacity:
                raise ValueError(f"dynamic table {self.name}: the checkpoint keeps no "
                                 "show/click counts")
            self.show = np.asarray(state["show"], dtype=np.float64).copy()
            self.click = np.asarray(state["click"], dtype=np.float64).copy()
        if self.sketch is not None and state.get("sketch") is not None:
            self.sketch.load_state_dict(state["sketch"])
        self.counters = TableCounters(**state.get("counters", {}))
        tier = state.get("tier") or {}
        on_disk = int(np.asarray(tier["disk"]["ids"]).shape[0]) if tier else 0
        if self.tier is not None:
            self.tier.load_state_dict(tier, self.delete_consumers)
        elif on_disk:
            raise ValueError(f"dynamic table {self.name}: the checkpoint holds {on_disk} of "
                             "its rows on disk: set train_config.disk_tier.dir to restore "
                             "them")
        self.decayed_at = state.get("decayed_at")
        self.now = float(state.get("now", 0.0))
        self._deleted = {}
        saved = {PUBLISHER_DELETES: state.get("deleted", [])}
        saved.update(state.get("deleted_by") or {})
        for consumer, ids in saved.items():
            ids = np.asarray(ids, dtype=np.int64)
            if ids.shape[0] and consumer in self.delete_consumers:
                self._deleted[consumer] = [ids]


# Above this many rows the k lowest priorities are found from a strided sample's threshold
# (two passes over the rows) instead of one argpartition of all of them.
_EXACT_SELECT_ROWS = 1 << 16
_SAMPLE_ROWS = 1 << 15


def _lowest(prio: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` lowest values of ``prio`` (any order; deterministic)."""
    n = prio.shape[0]
    if k >= n:
        return np.arange(n)
    if n > _EXACT_SELECT_ROWS:
        stride = n // _SAMPLE_ROWS
        sample = prio[::stride]
        q = min(sample.shape[0] - 1, int(np.ceil(1.2 * k / stride)) + 1)
        threshold = np.partition(sample, q)[q]
        cand = np.flatnonzero(prio <= threshold)
        if cand.shape[0] >= k:
            if cand.shape[0] == k:
                return cand
            return cand[np.argpartition(prio[cand], k - 1)[:k]]
    return np.argpartition(prio, k - 1)[:k]


def _chance(ids: np.ndarray, step: int) -> np.ndarray:
    """A uniform number in [0, 1) per (id, step), the same in every run (no RNG state)."""
    salt = mix64(np.asarray([step], dtype=np.int64))[0]
    return (mix64(ids.astype(np.uint64) ^ salt) >> np.uint64(11)).astype(np.float64) / 2.0**53


def hash_name(name: str) -> int:
    """A stable number of a table name (sketch seeds)."""
    return zlib.crc32(name.encode("utf-8"))


def state_tensors(obj: Any) -> Any:
    """Numpy arrays -> tensors, recursively (checkpoints load with ``weights_only``)."""
    if isinstance(obj, np.ndarray):
        arr = obj.astype(np.int64) if obj.dtype == np.uint64 else obj
        return torch.from_numpy(np.ascontiguousarray(arr))
    if isinstance(obj, dict):
        return {k: state_tensors(v) for k, v in obj.items()}
    return obj


def state_arrays(obj: Any) -> Any:
    """Tensors -> numpy arrays, recursively."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: state_arrays(v) for k, v in obj.items()}
    return obj
