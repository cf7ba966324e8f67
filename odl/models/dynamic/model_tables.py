"""The dynamic tables of one model: a batch's raw ids to rows, across tables and partitions.

:class:`DynamicTables` runs the engine's per-step rules (:mod:`odl.models.dynamic`) for
every dynamic table a batch looks up: the lookups of all tables are mapped at once
(:meth:`DynamicTables.remap`), sightings are counted per partition for all of its tables
together, and evicted rows are returned for the caller to reset. With ``partitions`` > 1
every table is split by id (:mod:`odl.models.dynamic.partitions`) and a process may hold
only some partitions: :meth:`DynamicTables.map_lookups` then leaves the other partitions'
ids ``UNHELD`` for the caller to fill in from the ranks holding them. Its state
(:meth:`DynamicTables.state_dict`) is every held partition's tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.batch import Batch
from odl.features.raw_id_index import RawIdIndexGroup, drop_unmapped
from odl.models.dynamic.dynamic_table import (
    STATE_FORMAT,
    DynamicTable,
    state_arrays,
    state_tensors,
)
from odl.models.dynamic.partitions import PartitionedDynamicTable, partition_of, partition_spans

__all__ = ["UNHELD", "DynamicTables", "Lookups", "RemapResult"]

_NO_CLICKS = np.zeros(0)


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

    With ``partitions`` > 1 every table is split by id (``odl.models.dynamic.partitions``)
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
            admit: admit, evict and count (a training step) or only look up (prediction;
                ids on a disk tier come back to RAM, moving others out).

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
        elif found.owner is None:  # a prediction: ids on a disk tier come back to RAM
            for j, (name, _k) in enumerate(self._plan):
                table = self._parts[0].tables[name]
                t_rows = local[0][seg[j]:seg[j + 1]]  # a view: bring_back fills it in
                if table.tier is not None and (t_rows < 0).any():
                    ev = table.bring_back(ids[seg[j]:seg[j + 1]], t_rows, step)
                    if ev.shape[0]:
                        lo = int(self._first_row[0][self._member[name]])
                        evicted.setdefault(name, []).append(ev + lo)
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
        return replace(batch, sparse=sparse)  # every per-sample field kept

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

        A growing table adds ``grows_to``, the most rows it may reach (``capacity``: its rows now).
        A table with a disk tier adds ``disk_rows`` (ids on disk), ``disk_file_bytes`` and the
        moves ``to_disk`` / ``from_disk``; its ``map_bytes`` count the tier's index.

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
            elif getattr(t, "disk", None) is not None:  # the disk tier: its rows and moves
                out[name].update(disk_rows=t.disk.live, disk_file_bytes=t.disk.disk_bytes(),
                                 to_disk=c.to_disk, from_disk=c.from_disk)
                out[name]["map_bytes"] += t.disk.ram_bytes()
            if t.spec.grows_to:  # a growing table: the most rows it may reach
                out[name]["grows_to"] = t.spec.grows_to
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
        first (``odl.models.dynamic.resplit``), moving the rows' weights with their ids.

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
