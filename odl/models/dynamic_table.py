"""Dynamic embedding tables: raw ids, admission, eviction, bounded memory.

One engine behind the three config forms of ``odl.config.dynamic_table_config`` (EasyRec
``ev_params``, TorchEasyRec ``zch``, PaddleRec ``ctr_accessor_param``). A dynamic table is a
TorchRec table of ``capacity`` rows (allocated once: memory is flat) plus a
:class:`~odl.features.raw_id_index.RawIdIndex` from raw ids to rows and per-row counters.

Per training step (:meth:`DynamicTables.remap` with ``admit=True``), per dynamic table, over
the ids of every feature reading it:

1. ids with a row are mapped to it;
2. the others are *candidates*: counted (when the spec has an admission threshold) in a
   count-min sketch of show and click counts (depth 4, ``width`` a power of two near the
   capacity, at most 2**20; every counter is halved once ``10 x width`` sightings have been
   added, so old sightings fade). A count-min sketch never under-counts: an id seen
   ``filter_freq`` times is always admitted, and one seen fewer times only when hash
   collisions inflate its estimate. A candidate is admitted when its estimated count reaches
   ``admit_freq``, its estimated score reaches ``admit_score`` and, with an
   ``admit_probability`` below 1, a draw seeded by (id, step) falls below it (a new chance at
   every step the id appears in); the rest are *rejected*
   for this step (counted, no row: they contribute nothing to the lookup, like an id serving
   does not know);
3. admitted ids take free rows; when too few are free, the lowest-priority rows not used by
   this batch are evicted first, in blocks of at least 1 % of the capacity (and 8 times the
   rows needed) so the ranking (O(capacity)) runs rarely. Priority (higher = kept): ``lru``
   last step seen; ``lfu`` sightings since admission; ``distance_lfu`` sightings / (steps
   since seen + 1) ** decay_exponent; ``score`` click_coeff * click + nonclk_coeff * (show -
   click);
4. the rows used get their counters updated: sightings, last step, last stream time, show
   (+1 per sample, or its ``show_field``) and click (+1 per sample with a positive label, or
   its ``click_field``; a multi-task model's first label).

Every ``maintenance_interval`` steps (:meth:`DynamicTables.maintain`) rows expire: unseen
for more than ``steps_to_live`` steps, show / click decayed by ``decay_rate_per_day`` per day
of stream time and evicted below ``delete_threshold``, unseen for more than
``delete_after_unseen_days`` days. Stream time is the newest event time trained on when the
config has ``data_config.event_time_field``, else the trainer's clock.

Evicted rows are returned to the caller (``TrainModule``), which resets their weights (the
table's initializer, seeded by table and step) and optimizer state before the rows are
reused; when the trainer publishes deltas their ids are kept for the next delta version as
deletes (:meth:`DynamicTables.take_deleted`), once per *delete consumer*: the delta
publisher (``"publisher"``, ``record_deletes``) and the per-pass delta files of a file
stream (``"pass_delta"``) each take their own copy. A table that has to make
room ranks its rows once per block (at least 1 % of the capacity and 8 times the rows the
step needs): exactly, by one ``argpartition`` up to 65,536 rows, beyond that from a
threshold taken on a strided sample of 32,768 rows, then exactly among the rows at or below
it. All decisions depend only on the ids, labels, steps and stream times trained on, so a
checkpoint (:meth:`DynamicTables.state_dict`: the index, the free-row stack, the counters,
the sketch) restores the tables exactly.

With ``partitions`` > 1 (``train_config.dynamic_index_partitions``) every table is split by
id into that many tables of a block of its rows each (``odl.models.dynamic_partitions``):
all of the above runs per partition, and a process may hold only some partitions (a rank
its own): :meth:`DynamicTables.map_lookups` then leaves the other partitions' ids
``UNHELD`` for the caller to fill in from the ranks holding them.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.batch import Batch
from odl.features.raw_id_index import RawIdIndex, RawIdIndexGroup, drop_unmapped, mix64
from odl.models.dynamic_partitions import PartitionedDynamicTable, partition_of, partition_spans

logger = logging.getLogger(__name__)

__all__ = ["CountMinSketch", "DynamicTable", "DynamicTables", "state_arrays", "state_tensors"]

STATE_FORMAT = "odl.dynamic_tables/1"
# the delete consumer of the delta publisher (``DynamicTable.record_deletes``)
PUBLISHER_DELETES = "publisher"
# Once a table has to make room it evicts at least this fraction of its capacity, and at
# least this many times the rows the step needs, so the ranking runs rarely.
EVICT_BLOCK_FRACTION = 0.01
EVICT_BLOCK_SHORTS = 8
_SKETCH_DEPTH = 4
_SKETCH_MAX_WIDTH = 1 << 20
_SECS_PER_DAY = 86400.0
_NO_CLICKS = np.zeros(0)


class CountMinSketch:
    """Show and click counts of ids without a row (see the module docstring).

    Args:
        width: counters per row (rounded up to a power of two, at most 2**20).
        seed: hash seed.
        clicks: count clicks too (a score threshold needs them; a frequency one does not).
    """

    def __init__(self, width: int, seed: int, clicks: bool = True) -> None:
        w = 1024
        while w < width and w < _SKETCH_MAX_WIDTH:
            w *= 2
        self.width = w
        self._mask = np.uint64(w - 1)
        rng = np.random.default_rng(seed)
        self._salts = rng.integers(1, 1 << 62, size=_SKETCH_DEPTH, dtype=np.int64).astype(
            np.uint64)
        self.show = np.zeros((_SKETCH_DEPTH, w), dtype=np.float32)
        self.click = np.zeros((_SKETCH_DEPTH, w if clicks else 0), dtype=np.float32)
        self.added = 0.0

    def nbytes(self) -> int:
        """Bytes of the counters."""
        return self.show.nbytes + self.click.nbytes

    @property
    def salts(self) -> np.ndarray:
        """The per-row hash salts (two sketches count alike only with equal salts)."""
        return self._salts

    def add(self, ids: np.ndarray, shows: np.ndarray,
            clicks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Adds sightings of unique ``ids``; returns their estimated (show, click) totals."""
        uids = ids.astype(np.uint64)
        counts_clicks = self.click.shape[1] > 0
        est_s = np.full(ids.shape[0], np.inf, dtype=np.float64)
        est_c = np.full(ids.shape[0], np.inf if counts_clicks else 0.0, dtype=np.float64)
        for d in range(_SKETCH_DEPTH):
            col = (mix64(uids ^ self._salts[d]) & self._mask).astype(np.int64)
            np.add.at(self.show[d], col, shows.astype(np.float32))
            est_s = np.minimum(est_s, self.show[d, col])
            if counts_clicks:
                np.add.at(self.click[d], col, clicks.astype(np.float32))
                est_c = np.minimum(est_c, self.click[d, col])
        self.added += float(shows.sum())
        if self.added > 10.0 * self.width:
            self.show *= 0.5
            self.click *= 0.5
            self.added *= 0.5
        return est_s, est_c

    def state_dict(self) -> dict[str, Any]:
        """The counters."""
        return {"show": self.show.copy(), "click": self.click.copy(),
                "salts": self._salts.copy(), "added": self.added}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores ``state_dict``'s counters (same width)."""
        if (np.asarray(state["show"]).shape != self.show.shape
                or np.asarray(state["click"]).shape != self.click.shape):
            raise ValueError("saved sketch has another width")
        self.show = np.asarray(state["show"], dtype=np.float32).copy()
        self.click = np.asarray(state["click"], dtype=np.float32).copy()
        self._salts = np.asarray(state["salts"]).astype(np.uint64)
        self.added = float(state["added"])


@dataclass
class TableCounters:
    """Lifetime counts of one dynamic table.

    Attributes:
        admitted: ids given a row.
        rejected: candidate ids refused a row (once per step they appeared in).
        evicted: rows evicted (to make room or expired).
        expired: of those, rows evicted by a maintenance pass.
    """

    admitted: int = 0
    rejected: int = 0
    evicted: int = 0
    expired: int = 0


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
        self.sketch = (CountMinSketch(c, seed ^ (hash_name(name) & 0xFFFF),
                                      clicks=spec.admit_score > 0 or spec.keeps_scores)
                       if spec.counts_candidates else None)
        self.counters = TableCounters()
        self.decayed_at: Optional[float] = None
        self.now = 0.0  # newest stream time seen (unix seconds)
        self._deleted: dict[str, list[np.ndarray]] = {}

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
            row_of_u = np.full(u.shape[0], -1, dtype=np.int64)
            row_of_u[want] = new_rows
            rows[miss] = row_of_u[inv]
            self.counters.admitted += int(want.shape[0])
            self.counters.rejected += int(u.shape[0] - want.shape[0])
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
        self._remove(victims)
        return victims

    def _remove(self, rows: np.ndarray, evicted: bool = True) -> None:
        """Frees rows and clears their counters.

        An eviction is counted and, when deltas are published, its ids kept as deletes.
        """
        rows = np.sort(rows)
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
        rows = self.index.lookup(np.unique(np.asarray(ids, dtype=np.int64)))
        rows = np.sort(rows[rows >= 0])
        if rows.shape[0]:
            self._remove(rows, evicted=False)
        return rows

    def upsert(self, ids: np.ndarray, step: int, now: float) -> tuple[np.ndarray, np.ndarray]:
        """Gives ``ids`` (unique) rows whatever the admission rule (crash recovery).

        Returns:
            ``(rows of ids, evicted rows)``; ids that found no room get ``-1``.
        """
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
        return {
            "index": self.index.state_dict(),
            "sightings": self.sightings.copy(),
            "last_step": self.last_step.copy(),
            "last_time": self.last_time.copy(),
            "show": self.show.copy(),
            "click": self.click.copy(),
            "sketch": self.sketch.state_dict() if self.sketch is not None else None,
            "counters": dict(vars(self.counters)),
            "decayed_at": self.decayed_at,
            "now": self.now,
            "deleted": self._pending(PUBLISHER_DELETES),
            "deleted_by": {c: self._pending(c) for c in sorted(self._deleted)
                           if c != PUBLISHER_DELETES},
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


@dataclass
class RemapResult:
    """What :meth:`DynamicTables.remap` did.

    Attributes:
        batch: the batch with rows in place of raw ids (ids without a row dropped).
        evicted: table -> rows evicted during admission (to reset before use).
    """

    batch: Batch
    evicted: dict[str, np.ndarray] = field(default_factory=dict)


class _Partition:
    """One partition of every dynamic table: its index group, shared counters and tables.

    Args:
        specs: table name -> spec (``capacity``: this partition's rows).
        seed: the model's seed.
        record_deletes: keep evicted ids for the delta publisher.
    """

    def __init__(self, specs: Mapping[str, DynamicTableSpec], seed: int,
                 record_deletes: bool) -> None:
        names = list(specs)
        self.group = RawIdIndexGroup([specs[n].capacity for n in names])
        total = int(self.group.row_offsets[-1])
        self.sightings = np.zeros(total, dtype=np.float64)
        self.last_step = np.zeros(total, dtype=np.int64)
        self.last_time = np.zeros(total, dtype=np.float64)
        self.tables: dict[str, DynamicTable] = {}
        for i, name in enumerate(names):
            lo, hi = self.group.row_offsets[i], self.group.row_offsets[i + 1]
            self.tables[name] = DynamicTable(
                name, specs[name], seed, self.group.members[i],
                (self.sightings[lo:hi], self.last_step[lo:hi], self.last_time[lo:hi]))
            self.tables[name].record_deletes = record_deletes

    def count_sightings(self, rows: np.ndarray, member: np.ndarray, step: int,
                        now: float) -> None:
        """Sightings and last step / time of the rows used (-1: none), all tables at once."""
        used = rows >= 0
        g = rows[used] + self.group.row_offsets[member[used]]
        np.add.at(self.sightings, g, 1.0)
        self.last_step[g] = step
        self.last_time[g] = now


@dataclass
class Lookups:
    """The dynamic-table lookups of a batch (``DynamicTables.lookups``).

    Attributes:
        where: position of each lookup in the batch's jagged values.
        ids: its raw id.
        member: its table (index into the tables, in order).
        seg: lookups of plan entry j are ``[seg[j], seg[j + 1])`` (table after table).
        owner: its id's partition (None with one partition).
    """

    where: np.ndarray
    ids: np.ndarray
    member: np.ndarray
    seg: list[int]
    owner: Optional[np.ndarray]


# rows of lookups whose id belongs to a partition this process does not hold
UNHELD = -2


class DynamicTables:
    """The dynamic tables of one model, keyed by table name (module docstring).

    With ``partitions`` > 1 every table is split by id (``odl.models.dynamic_partitions``)
    and ``tables[name]`` is a ``PartitionedDynamicTable`` over the partitions held here.

    Args:
        specs: table name -> spec (only dynamic tables).
        table_features: table name -> features looked up in it.
        seed: the model's seed.
        record_deletes: keep evicted ids for the delta publisher.
        partitions: P, the partitions every table is split into by id.
        held: the partitions this process holds (None: all; several ranks: its own).
    """

    def __init__(self, specs: Mapping[str, DynamicTableSpec],
                 table_features: Mapping[str, Sequence[str]], seed: int = 0,
                 record_deletes: bool = False, partitions: int = 1,
                 held: Optional[Sequence[int]] = None) -> None:
        names = list(specs)
        self.partitions = int(partitions)
        self.held = tuple(range(self.partitions)) if held is None else tuple(sorted(held))
        spans = {n: partition_spans(specs[n].capacity, self.partitions) for n in names}
        self._parts = {
            p: _Partition({n: replace(specs[n], capacity=spans[n][p][1] - spans[n][p][0])
                           for n in names}, seed, record_deletes)
            for p in self.held}
        # per held partition, the first global row of each table (index: member)
        self._first_row = {p: np.asarray([spans[n][p][0] for n in names], dtype=np.int64)
                           for p in self.held}
        self.tables: dict[str, Any]
        if self.partitions == 1:
            self.tables = dict(self._parts[0].tables)
        else:
            self.tables = {n: PartitionedDynamicTable(
                n, specs[n], self.partitions,
                {p: (spans[n][p][0], self._parts[p].tables[n]) for p in self.held})
                for n in names}
        self._member = {name: i for i, name in enumerate(names)}
        self._table_features = {n: list(table_features[n]) for n in self.tables}
        self._keys: Optional[list[str]] = None
        self._plan: list[tuple[str, list[int]]] = []

    def __bool__(self) -> bool:
        return bool(self.tables)

    def _build_plan(self, keys: list[str]) -> None:
        pos = {k: i for i, k in enumerate(keys)}
        plan = [(name, [pos[f] for f in feats if f in pos])
                for name, feats in self._table_features.items()]
        self._plan = [(name, idx) for name, idx in plan if idx]
        self._keys = keys

    def remap(self, batch: Batch, step: int, now: float, admit: bool) -> RemapResult:
        """Replaces the raw ids of dynamic tables by rows (every partition held here).

        Args:
            batch: a batch as the feature builder made it (CPU tensors).
            step: the step being trained (training) or the current step.
            now: stream time (unix seconds).
            admit: admit, evict and count (a training step) or only look up (prediction).

        Returns:
            The remapped batch and the rows evicted per table.
        """
        found = self.lookups(batch)
        if found is None:
            return RemapResult(batch)
        rows, evicted = self.map_lookups(found, batch, step, now, admit)
        return RemapResult(self.with_rows(batch, found, rows), evicted)

    def lookups(self, batch: Batch) -> Optional[Lookups]:
        """Every dynamic-table lookup of a batch, table after table (None: there are none)."""
        kjt = batch.sparse
        keys = list(kjt.keys())
        if keys != self._keys:
            self._build_plan(keys)
        values = kjt.values().numpy()
        counts = kjt.lengths().numpy().reshape(len(keys), batch.size).astype(np.int64).sum(1)
        starts = np.cumsum(counts) - counts
        # every dynamic lookup of the batch, table after table (one segment per table)
        spans, members, seg = [], [], [0]
        for name, key_idx in self._plan:
            for k in key_idx:
                spans.append(np.arange(starts[k], starts[k] + counts[k]))
            seg.append(seg[-1] + int(sum(counts[k] for k in key_idx)))
            members.append(self._member[name])
        if not spans:
            return None
        where = np.concatenate(spans)
        ids = values[where]
        return Lookups(where=where, ids=ids,
                       member=np.repeat(np.asarray(members, dtype=np.int64), np.diff(seg)),
                       seg=seg, owner=(partition_of(ids, self.partitions)
                                       if self.partitions > 1 else None))

    def map_lookups(self, found: Lookups, batch: Batch, step: int, now: float,
                    admit: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rows of ``found``'s ids in the held partitions (module docstring, 1-4).

        Returns:
            ``(rows, evicted)``: a global row per lookup (-1: none; ``UNHELD`` for an id of a
            partition not held here) and table -> global rows evicted for admission.
        """
        ids, member, seg = found.ids, found.member, found.seg
        # per held partition: its lookups (None: all of them) and their local rows
        picks: dict[int, Optional[np.ndarray]] = (
            {0: None} if found.owner is None
            else {p: np.flatnonzero(found.owner == p) for p in self.held})
        local = {p: self._parts[p].group.lookup(ids if at is None else ids[at],
                                                member if at is None else member[at])
                 for p, at in picks.items()}
        evicted: dict[str, list[np.ndarray]] = {}
        if admit:
            lengths2d = batch.sparse.lengths().numpy().reshape(
                len(self._keys or []), batch.size).astype(np.int64)
            y = batch.labels.numpy()
            # a multi-task batch's clicks are its first label column
            labels = ((y if y.ndim == 1 else y[:, 0]) > 0).astype(np.float64)
            counts = batch.counts or {}

            def per_lookup(per_sample: np.ndarray, key_idx: list[int]) -> np.ndarray:
                return np.concatenate([np.repeat(per_sample, lengths2d[k]) for k in key_idx])

            for j, (name, key_idx) in enumerate(self._plan):
                spec = self._parts[self.held[0]].tables[name].spec
                clicks = _NO_CLICKS
                if spec.keeps_scores or spec.admit_score > 0:
                    clicks = per_lookup(counts[spec.click_field] if spec.click_field
                                        else labels, key_idx)
                shows = per_lookup(counts[spec.show_field], key_idx) if spec.show_field else None
                for p, at in picks.items():
                    table = self._parts[p].tables[name]
                    if at is None:  # one partition: the table's segment
                        part, sub = slice(seg[j], seg[j + 1]), slice(None)
                    else:  # this partition's lookups inside the segment
                        a, b = np.searchsorted(at, (seg[j], seg[j + 1]))
                        part, sub = slice(int(a), int(b)), at[a:b] - seg[j]
                    t_rows = local[p][part]  # a view: admit_missing fills it in
                    t_clicks = clicks if clicks is _NO_CLICKS else clicks[sub]
                    t_shows = shows[sub] if shows is not None else None
                    if (t_rows < 0).any():
                        ev = table.admit_missing(ids[seg[j]:seg[j + 1]][sub], t_clicks, t_rows,
                                                 step, t_shows)
                        if ev.shape[0]:
                            lo = int(self._first_row[p][self._member[name]])
                            evicted.setdefault(name, []).append(ev + lo)
                    table.count_used(t_rows, t_clicks, step, now, t_shows)
            for p, at in picks.items():
                self._parts[p].count_sightings(local[p], member if at is None else member[at],
                                               step, now)
        if found.owner is None:
            rows = local[0]
        else:
            rows = np.full(ids.shape[0], UNHELD, dtype=np.int64)
            for p, at in picks.items():
                r = local[p]
                rows[at] = np.where(r >= 0, r + self._first_row[p][member[at]], -1)
        return rows, {name: np.concatenate(ev) for name, ev in evicted.items()}

    def with_rows(self, batch: Batch, found: Lookups, rows: np.ndarray) -> Batch:
        """``batch`` with ``rows`` in place of its dynamic raw ids (rows -1 dropped)."""
        if (rows == UNHELD).any():
            raise ValueError("rows of ids of partitions not held here are missing")
        kjt = batch.sparse
        values = kjt.values().numpy()
        new_values = values.copy()
        new_values[found.where] = rows
        keep = np.ones(values.shape[0], dtype=bool)
        keep[found.where] = rows >= 0
        out_values, out_lengths = drop_unmapped(new_values, kjt.lengths().numpy(), keep)
        sparse = KeyedJaggedTensor(keys=list(kjt.keys()), values=torch.from_numpy(out_values),
                                   lengths=torch.from_numpy(np.ascontiguousarray(out_lengths)))
        return Batch(sparse=sparse, dense=batch.dense, labels=batch.labels,
                     sample_ids=batch.sample_ids, event_times=batch.event_times,
                     counts=batch.counts, extras=batch.extras, group_keys=batch.group_keys,
                     session_keys=batch.session_keys)

    def maintain(self, step: int, now: float) -> dict[str, np.ndarray]:
        """Runs the maintenance pass of every table due at ``step``; returns evicted rows."""
        out = {}
        for name, table in self.tables.items():
            if step % table.spec.maintenance_interval == 0 and table.has_maintenance:
                ev = table.maintain(step, now)
                if ev.shape[0]:
                    out[name] = ev
        return out

    def shrink(self, step: int, now: float) -> dict[str, np.ndarray]:
        """Runs every table's maintenance pass now (a day's end); returns evicted rows."""
        out = {}
        for name, table in self.tables.items():
            if table.has_maintenance:
                ev = table.maintain(step, now)
                if ev.shape[0]:
                    out[name] = ev
        return out

    def add_delete_consumer(self, consumer: str) -> None:
        """Keeps evicted ids of every table for ``take_deleted(consumer)`` from now on."""
        for table in self.tables.values():
            table.add_delete_consumer(consumer)

    def take_deleted(self, consumer: str = "publisher") -> dict[str, np.ndarray]:
        """Table -> ids evicted since ``consumer``'s last call (tables with none left out)."""
        out = {}
        for name, table in self.tables.items():
            ids = table.take_deleted(consumer)
            if ids.shape[0]:
                out[name] = ids
        return out

    def status(self) -> dict[str, dict[str, Any]]:
        """Per table: form, capacity, live rows, admitted, rejected, evicted, map bytes.

        Split by id: the capacity and counts are the held partitions'; ``partitions`` and
        ``held`` say which.
        """
        out = {}
        for name, t in self.tables.items():
            c = t.counters
            capacity = (t.spec.capacity if self.partitions == 1 else
                        sum(p.spec.capacity for _lo, p in t.held.values()))
            out[name] = {"form": t.spec.form, "policy": t.spec.policy,
                         "capacity": capacity, "live_rows": t.live,
                         "admitted": c.admitted, "rejected": c.rejected,
                         "evicted": c.evicted, "expired": c.expired,
                         "map_bytes": t.map_bytes()}
            if self.partitions > 1:
                out[name].update(partitions=self.partitions, held=list(self.held))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The held partitions' state, arrays as tensors.

        ``{"format", "tables": {name: DynamicTable.state_dict()}}`` with one partition;
        ``{"format", "partitions": P, "parts": {p: {"tables": ...}}}`` split by id.
        """
        if self.partitions == 1:
            return {"format": STATE_FORMAT,
                    "tables": {n: state_tensors(t.state_dict()) for n, t in self.tables.items()}}
        return {"format": STATE_FORMAT, "partitions": self.partitions,
                "parts": {p: {"tables": {n: state_tensors(t.state_dict())
                                         for n, t in self._parts[p].tables.items()}}
                          for p in self.held}}

    def delete_consumers(self) -> set[str]:
        """The consumers evicted ids are kept for (``add_delete_consumer``)."""
        return {c for part in self._parts.values() for t in part.tables.values()
                for c in t.delete_consumers}

    def load_state_dict(self, state: Mapping[str, Any],
                        tables: Sequence[str] | None = None) -> None:
        """Restores ``state_dict`` (the held partitions' parts of it).

        A state of another number of partitions is refused: ``TrainModule`` re-splits it
        first (``odl.models.dynamic_resplit``), moving the rows' weights with their ids.

        Args:
            state: a ``state_dict``.
            tables: restore only these tables (the others keep their state); None: every
                table, and the saved tables must be these.

        Raises:
            ValueError: the saved tables or partitions differ from these.
        """
        saved_p = int(state.get("partitions", 1))
        if saved_p != self.partitions:
            raise ValueError(
                f"the checkpoint's dynamic tables are split by id into {saved_p} "
                f"partition(s), this model's into {self.partitions}: set "
                f"train_config.dynamic_index_partitions to {saved_p} to continue from it")
        parts = ({0: state} if self.partitions == 1
                 else {int(p): v for p, v in (state.get("parts") or {}).items()})
        for p in self.held:
            if p not in parts:
                raise ValueError(f"the checkpoint lacks partition {p} of the dynamic tables "
                                 f"(it has {sorted(parts)})")
            saved = parts[p].get("tables", {})
            if tables is None and set(saved) != set(self.tables):
                raise ValueError(f"checkpoint has dynamic tables {sorted(saved)}, the model "
                                 f"{sorted(self.tables)}")
            for name, t in self._parts[p].tables.items():
                if tables is None or name in tables:
                    t.load_state_dict(state_arrays(saved[name]))


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
