"""Re-splitting the dynamic tables' state into another number of partitions by id.

A checkpoint's dynamic tables are split by id into the P partitions of the
``train_config.dynamic_index_partitions`` it was trained with
(``odl.models.dynamic.partitions``). A job restored with another P' (to run on more ranks
than P allows, or to put the index back together) has the state re-split at restore
(``TrainModule.load_checkpoint_state``; a warm start from a checkpoint with another P
likewise). :func:`resplit_state` builds the state of P' partitions from the saved one, for
every table, from the saved partitions alone (so every rank computes the same result):

* **ids**: every live id moves to its partition under P' (``partition_of(id, P')``) with
  its counters (sightings, last step and time, show and click). Its new row is in that
  partition's block; ids take rows in the order of their old rows. ``sources[table]`` says,
  for every new row, the old row whose weights and optimizer state it takes (-1: a free
  row, which the caller resets to fresh values as an eviction does);
* **overflow**: a new partition's block may hold fewer rows than ids hash to it (a full
  table's ids do not split evenly). The ids of lowest keep priority (the table's eviction
  policy, at the checkpoint's step) are dropped, as an eviction would drop them: counted as
  evicted and kept as deletes for the delta publisher and every other delete consumer, so
  serving forgets them too;
* **admission sketch**: the saved partitions' count-min counters are summed and folded (or
  repeated) to each new partition's width. A column of the new sketch then sums the old
  columns its ids hashed to, so it still never under-counts: an id seen ``admit_freq`` times
  before the re-split is still admitted at its next sighting;
* **pending deletes** go to the new partition of each id; the **lifetime counters**
  (admitted, rejected, evicted, expired) are divided evenly over the new partitions (their
  sum, what ``/status`` adds up, is kept); stream time ``now`` is the newest and the decay
  time the newest of the saved partitions'.

Decisions after the re-split are those of P' partitions, so a job that re-splits does not
train as one that never stopped would (the same holds for any change of P); what it
trained is kept, row for row.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from odl.config.dynamic_table_config import DynamicTableSpec
from odl.features.raw_id_index import RawIdIndex
from odl.models.dynamic.admission_sketch import CountMinSketch
from odl.models.dynamic.dynamic_table import (
    PUBLISHER_DELETES,
    STATE_FORMAT,
    DynamicTable,
    TableCounters,
    hash_name,
    state_arrays,
    state_tensors,
)
from odl.models.dynamic.partitions import partition_of, partition_spans

logger = logging.getLogger(__name__)

__all__ = ["Resplit", "resplit_state", "saved_partitions"]


@dataclass
class Resplit:
    """A dynamic-table state re-split into another number of partitions.

    Attributes:
        state: every partition's state, in ``DynamicTables.state_dict()``'s form for P'.
        sources: table -> old global row of each new global row (``int64 [capacity]``; -1
            for a free row).
        dropped: table -> ids dropped for want of rows in their new partition.
    """

    state: dict[str, Any]
    sources: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: dict[str, np.ndarray] = field(default_factory=dict)


def saved_partitions(saved: Mapping[str, Any]) -> int:
    """The number of partitions a saved dynamic-table state is split into."""
    return int(saved.get("partitions", 1))


def _saved_tables(saved: Mapping[str, Any], name: str) -> dict[int, Mapping[str, Any]]:
    """Partition -> the saved state of table ``name`` in it.

    Raises:
        ValueError: a partition, or the table in one, is missing.
    """
    if saved_partitions(saved) == 1:
        parts = {0: saved}
    else:
        parts = {int(p): v for p, v in (saved.get("parts") or {}).items()}
        missing = sorted(set(range(saved_partitions(saved))) - set(parts))
        if missing:
            raise ValueError(f"the checkpoint lacks partitions {missing} of the dynamic tables")
    if any(name not in part.get("tables", {}) for part in parts.values()):
        raise ValueError(f"the checkpoint has no dynamic table {name}")
    return {p: parts[p]["tables"][name] for p in sorted(parts)}


def _fold(counts: np.ndarray, width: int) -> np.ndarray:
    """Count-min columns ``[depth, w]`` folded (or repeated) to ``width`` columns.

    Both widths are powers of two and an id's column is its hash's low bits, so column c of
    the result covers the old columns congruent to c modulo the smaller width.
    """
    depth, w = counts.shape
    if w == 0:
        return counts
    if width <= w:
        return counts.reshape(depth, w // width, width).sum(axis=1)
    return np.tile(counts, (1, width // w))


def _split_evenly(total: int, n: int) -> list[int]:
    """``total`` as n integers summing to it (the first ones one larger)."""
    base, extra = divmod(int(total), n)
    return [base + (1 if q < extra else 0) for q in range(n)]


def resplit_state(saved: Mapping[str, Any], specs: Mapping[str, DynamicTableSpec],
                  seed: int, partitions: int, step: int,
                  delete_consumers: Iterable[str] = ()) -> Resplit:
    """Re-splits a saved dynamic-table state into ``partitions`` partitions.

    Args:
        saved: a checkpoint's ``"dynamic_tables"`` with every partition (one process's, or
            the ranks' parts merged).
        specs: table name -> its spec (the whole table's ``capacity``), as trained.
        seed: the model's seed (the sketches' hashing).
        partitions: P', the partitions to split into.
        step: the checkpoint's global step (keep priority of an overflow).
        delete_consumers: consumers to hand dropped ids to as deletes, beside the delta
            publisher's and those the saved state has pending deletes for.

    Returns:
        The re-split state, where each row's values come from and the ids dropped.

    Raises:
        ValueError: the saved state lacks a partition or a table, its shapes are not those
            of ``specs``, or a table has rows on a disk tier.
    """
    old_p = saved_partitions(saved)
    out: dict[str, Any] = {"format": STATE_FORMAT}
    new_parts: dict[int, dict[str, Any]] = {q: {} for q in range(partitions)}
    result = Resplit(state=out)
    for name, spec in specs.items():
        old_spans = partition_spans(spec.capacity, old_p)
        old_tables: list[tuple[int, DynamicTable, Mapping[str, Any]]] = []
        for p, st in _saved_tables(saved, name).items():
            tier = st.get("tier") or {}
            if tier and len(tier["disk"]["ids"]):
                raise ValueError(f"dynamic table {name}: the checkpoint holds rows on disk "
                                 "(train_config.disk_tier), which are not re-split into "
                                 "partitions: restore it with dynamic_index_partitions 1 "
                                 "and the disk tier")
            lo, hi = old_spans[p]
            table = DynamicTable(name, replace(spec, capacity=hi - lo), seed)
            arrays = state_arrays(dict(st))
            table.load_state_dict({k: v for k, v in arrays.items()
                                   if k not in ("deleted", "deleted_by")})
            old_tables.append((lo, table, arrays))
        parts, sources, dropped = _resplit_table(name, spec, seed, old_tables, partitions,
                                                 step, delete_consumers)
        for q, st in parts.items():
            new_parts[q][name] = state_tensors(st)
        result.sources[name] = sources
        result.dropped[name] = dropped
        if dropped.shape[0]:
            logger.warning("dynamic table %s: %d ids did not fit their new partition's %d "
                           "rows and were dropped (lowest %s priority) as deletes", name,
                           dropped.shape[0], -(-spec.capacity // partitions), spec.policy)
    if partitions == 1:
        out["tables"] = new_parts[0]
    else:
        out["partitions"] = partitions
        out["parts"] = {q: {"tables": t} for q, t in new_parts.items()}
    return result


def _resplit_table(name: str, spec: DynamicTableSpec, seed: int,
                   old_tables: list[tuple[int, DynamicTable, Mapping[str, Any]]],
                   partitions: int, step: int, delete_consumers: Iterable[str]
                   ) -> tuple[dict[int, dict[str, Any]], np.ndarray, np.ndarray]:
    """One table of ``resplit_state``: ``(partition -> state, sources, dropped ids)``."""
    # every live id with its old global row, counters and keep priority
    ids, rows, prio = [], [], []
    cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                         ("sightings", "last_step", "last_time", "show", "click")}
    for lo, table, _arrays in old_tables:
        live = table.live_rows()
        ids.append(table.raw_ids(live))
        rows.append(live + lo)
        prio.append(np.asarray(table.priority(live, step), dtype=np.float64))
        for k in cols:
            arr = getattr(table, k)
            cols[k].append(arr[live] if arr.shape[0] else np.zeros(live.shape[0]))
    all_ids = np.concatenate(ids)
    old_rows = np.concatenate(rows)
    keep_prio = np.concatenate(prio)
    values = {k: np.concatenate(v) for k, v in cols.items()}
    owner = partition_of(all_ids, partitions)
    spans = partition_spans(spec.capacity, partitions)

    sources = np.full(spec.capacity, -1, dtype=np.int64)
    kept_mask = np.ones(all_ids.shape[0], dtype=bool)
    placed: dict[int, tuple[np.ndarray, np.ndarray, RawIdIndex]] = {}
    for q, (lo, hi) in enumerate(spans):
        mine = np.flatnonzero(owner == q)
        if mine.shape[0] > hi - lo:  # keep the highest priority (ties: the older row)
            order = np.lexsort((old_rows[mine], -keep_prio[mine]))
            kept_mask[mine[order[hi - lo:]]] = False
            mine = np.sort(mine[order[: hi - lo]])
        mine = mine[np.argsort(old_rows[mine], kind="stable")]
        index = RawIdIndex(hi - lo)
        new_rows = index.insert(all_ids[mine])
        sources[new_rows + lo] = old_rows[mine]
        placed[q] = (mine, new_rows, index)
    dropped = np.sort(all_ids[~kept_mask])

    # pending deletes of every consumer, plus the dropped ids
    pending: dict[str, list[np.ndarray]] = {PUBLISHER_DELETES: [dropped]}
    for consumer in delete_consumers:
        pending.setdefault(consumer, [dropped])
    for _lo, _table, arrays in old_tables:
        pending[PUBLISHER_DELETES].append(np.asarray(arrays.get("deleted", []),
                                                     dtype=np.int64))
        for consumer, got in (arrays.get("deleted_by") or {}).items():
            pending.setdefault(consumer, [dropped]).append(np.asarray(got, dtype=np.int64))
    pending_ids = {c: np.unique(np.concatenate(v)) for c, v in pending.items()}

    totals = TableCounters()
    for _lo, table, _arrays in old_tables:
        for k, v in vars(table.counters).items():
            setattr(totals, k, getattr(totals, k) + v)
    totals.evicted += int(dropped.shape[0])
    shares = {k: _split_evenly(v, partitions) for k, v in vars(totals).items()}
    now = max(t.now for _lo, t, _a in old_tables)
    decayed = [t.decayed_at for _lo, t, _a in old_tables if t.decayed_at is not None]
    sketches = [t.sketch for _lo, t, _a in old_tables if t.sketch is not None]

    parts: dict[int, dict[str, Any]] = {}
    for q, (lo, hi) in enumerate(spans):
        cap = hi - lo
        mine, new_rows, index = placed[q]
        st: dict[str, Any] = {"index": index.state_dict()}
        for k, dtype in (("sightings", np.float64), ("last_step", np.int64),
                         ("last_time", np.float64)):
            arr = np.zeros(cap, dtype=dtype)
            arr[new_rows] = values[k][mine]
            st[k] = arr
        for k in ("show", "click"):
            arr = np.zeros(cap if spec.keeps_scores else 0, dtype=np.float64)
            if spec.keeps_scores:
                arr[new_rows] = values[k][mine]
            st[k] = arr
        st["sketch"] = _merged_sketch(name, spec, seed, cap, sketches)
        st["counters"] = {k: shares[k][q] for k in shares}
        st["decayed_at"] = max(decayed) if decayed else None
        st["now"] = now
        of_q = {c: v[partition_of(v, partitions) == q] for c, v in pending_ids.items()}
        st["deleted"] = of_q.pop(PUBLISHER_DELETES)
        st["deleted_by"] = {c: v for c, v in sorted(of_q.items()) if v.shape[0]}
        parts[q] = st
    return parts, sources, dropped


def _merged_sketch(name: str, spec: DynamicTableSpec, seed: int, capacity: int,
                   old: list[CountMinSketch]) -> dict[str, Any] | None:
    """The sketch of a new partition of ``capacity`` rows from the old partitions' sketches.

    None (an empty sketch) when the table counts no candidates or the old sketches were
    hashed differently.
    """
    if not spec.counts_candidates or not old:
        return None
    fresh = CountMinSketch(capacity, seed ^ (hash_name(name) & 0xFFFF),
                           clicks=old[0].click.shape[1] > 0)
    if any(not np.array_equal(s.salts, fresh.salts) for s in old):
        logger.warning("dynamic table %s: the saved admission sketch was hashed with another "
                       "seed; candidates' counts start over", name)
        return None
    state = fresh.state_dict()
    state["show"] = sum(_fold(s.show, fresh.width) for s in old).astype(np.float32)
    if fresh.click.shape[1]:
        state["click"] = sum(_fold(s.click, fresh.width) for s in old).astype(np.float32)
    state["added"] = float(sum(s.added for s in old))
    return state
