"""Dynamic tables that grow: a rebuild of the ``TrainModule`` at more rows, at a step boundary.

A *growing* dynamic table (``ev_params`` with neither ``max_capacity`` nor
``hash_bucket_size``: ``DynamicTableSpec.grows_to``) starts with ``capacity`` rows. After a
training step in which its live rows passed ``GROW_AT`` of its rows it doubles (at most to
``grows_to``):

1. the module's whole state is copied to the host (``module_state.checkpoint_state``, as a
   checkpoint does; with several ranks each rank copies its own rows, ``table_part``);
2. the module is built again, in place, at the new rows (``TrainModule.__init__`` with
   ``table_rows``: the model, the sharding plan and ``DistributedModelParallel``, the fused
   and row-sparse optimizers, the dynamic tables; the tables' rows left to this module),
   the old model freed first;
3. the copy is put back: the grown tables' rows, their fused or row-sparse optimizer state
   and their index and counters into the first rows (``odl.models.dynamic.growth``), every
   other tensor as it was; the rows added get their initial values (drawn for them alone,
   ``initial_rows``) and optimizer state. With several ranks the rebuilt module's shards lie
   elsewhere (a grown table's row blocks are larger): every rank's copy is sent to the others
   in turn, one at a time, and each rank keeps the blocks that overlap its new shards
   (``table_parts.load_blocks``, as a restore into another number of ranks reads them), so
   no rank holds more than its rows and one other rank's copy.

The step count, the random generators, the touched-rows hooks and the delete consumers are
kept, so training continues exactly as a module restored from a checkpoint of the grown
state would. Whoever sizes something by the tables' rows (the delta trackers, the chain of
incremental checkpoints) registers a hook (``TrainModule.add_table_growth_hook``), called
with the new table shapes after every rebuild.

A doubling happens only when the memory it needs is free (the copy of the state, plus the
rows added): otherwise the table stops growing there, logged once, and makes room by
eviction as a full table does. A restore builds the tables at the rows the checkpoint holds
(:func:`size_for_state`), and crash recovery grows them to hold the ids it replays
(:func:`grow_to_hold`).

With the whole index on every rank (``dynamic_index_partitions`` 1) every rank decides the
same growth at the same step; the memory check is every rank's (all must have room).

Split by id (``dynamic_index_partitions`` P > 1) a growing table's rows are a multiple of P
(its start rows and every doubling rounded up), so all partitions' blocks have the same
rows. The tables double when one partition's block has more than ``GROW_AT`` of its rows
live (with several ranks, when one on any rank does: the ranks agree each step), and each
partition's rows move to its place in the grown table (``odl.models.dynamic.growth.
row_moves``): partition p's block keeps its rows in order at ``p·b'``. The moves are
handed to the growth hooks (:attr:`TableGrowth.moves`), so that whoever counts rows by
number (the delta trackers) moves its marks with them. A rank's partitions' rows stay on
that rank, so its blocks are copied within the rank.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from odl.checkpoint.table_parts import load_blocks
from odl.features.feature_plan import TableSpec
from odl.models.dynamic.growth import (
    grown_tables_state,
    partition_rows,
    row_moves,
    saved_capacities,
)
from odl.models.dynamic.partitions import partition_of
from odl.models.embedding_tables import init_embedding_weights, initial_rows
from odl.train import module_state
from odl.train.distributed import agree, from_every_rank, from_rank
from odl.train.host_memory import available_host_memory, release_freed_memory
from odl.train.table_shards import EBC_PREFIX, init_local_shards, local_shards, local_view

if TYPE_CHECKING:
    from odl.protos import pipeline_pb2
    from odl.train.train_module import TrainModule

logger = logging.getLogger(__name__)

__all__ = ["GROW_AT", "GrowthEvent", "SizedFeatures", "TableGrowth", "grow_if_due",
           "grow_tables", "grow_to_hold", "size_for_state", "table_rows_at_start"]

# A growing table doubles after a step that leaves more than this share of its rows live.
GROW_AT = 0.75
# Attributes of the module a rebuild keeps: what others registered on it, growth's own, and
# what ``/status`` reads from another thread while the module is rebuilt.
_KEPT = ("_touched_rows_hook", "_extra_touched_rows_hooks", "growth", "global_step", "device",
         "rank", "world_size")


class _Rebuilding:
    """What ``TrainModule.dynamic`` is while the module is rebuilt: tables exist (status)."""

    def __bool__(self) -> bool:
        return True


@dataclass
class GrowthEvent:
    """One growth of the tables.

    Attributes:
        step: the global step after which they grew.
        rows: dynamic table -> ``(rows before, rows after)``.
        seconds: wall time of the growth.
    """

    step: int
    rows: dict[str, tuple[int, int]]
    seconds: float


@dataclass
class TableGrowth:
    """What a module keeps about growth across its rebuilds.

    Attributes:
        hooks: called with ``table_shapes()`` after the tables grew.
        stopped: dynamic tables that stopped growing (memory), with the rows they stay at.
        events: the growths so far, oldest first.
        frozen_status: while the module is rebuilt, its dynamic tables' status from before
            (``TrainModule.dynamic_status``, read by ``/status``); None otherwise.
        moves: while the hooks run, TorchRec table -> where its rows went
            (``[(old first row, new first row, rows)]``, ``row_moves``); None otherwise.
    """

    hooks: list[Callable[[dict[str, tuple[int, int]]], None]] = field(default_factory=list)
    stopped: dict[str, int] = field(default_factory=dict)
    events: list[GrowthEvent] = field(default_factory=list)
    frozen_status: dict[str, dict[str, Any]] | None = None
    moves: dict[str, list[tuple[int, int, int]]] | None = None


class SizedFeatures:
    """A feature builder whose growing tables have other rows; everything else delegated.

    The model is built from it (``build_model`` reads ``table_specs``); batches are still
    built by the feature builder itself, which gives a dynamic table's raw ids whatever its
    rows.

    Args:
        builder: the feature builder.
        rows: table name -> its rows (growing tables only).
    """

    def __init__(self, builder: Any, rows: Mapping[str, int]) -> None:
        self._builder = builder
        self._specs = [
            replace(s, num_rows=int(rows[s.name]),
                    dynamic=replace(s.dynamic, capacity=int(rows[s.name])))
            if s.dynamic is not None and s.name in rows else s
            for s in builder.table_specs]

    @property
    def table_specs(self) -> list[TableSpec]:
        """The builder's tables, the growing ones at their rows."""
        return list(self._specs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._builder, name)


def table_rows_at_start(config: pipeline_pb2.EasyRecConfig, builder: Any, world_size: int,
                        rows: Mapping[str, int] | None) -> Any:
    """The feature builder to build a model from: growing tables at the rows they have.

    Args:
        config: the pipeline config.
        builder: the feature builder.
        world_size: the ranks training together.
        rows: growing table -> its rows (a growth or a restore); None: their start rows.

    Returns:
        ``builder`` itself when every table has its configured rows, else a
        :class:`SizedFeatures`.
    """
    growing = {s.name: s.dynamic for s in builder.table_specs
               if s.dynamic is not None and s.dynamic.grows}
    if not growing:
        return builder
    partitions = max(1, int(config.train_config.dynamic_index_partitions))
    if partitions > 1:  # whole blocks: the rows a multiple of P
        start = {n: partition_rows(s.capacity, partitions) for n, s in growing.items()}
        rows = {**start, **{n: int(r) for n, r in (rows or {}).items() if n in growing}}
        return SizedFeatures(builder, rows)
    if not rows:
        return builder
    return SizedFeatures(builder, {n: int(r) for n, r in rows.items() if n in growing})


def _current_rows(m: TrainModule) -> dict[str, int]:
    """Growing dynamic table -> its rows now (a grown table's ``grows_to`` is kept)."""
    return {name: int(t.spec.capacity) for name, t in m.dynamic.tables.items()
            if t.spec.grows_to}


def _rebuild(m: TrainModule, rows: Mapping[str, int]) -> None:
    """Builds ``m`` again in place with the growing tables at ``rows`` (its state not kept).

    ``/status`` reads the dynamic tables' status from before until the caller clears
    ``m.growth.frozen_status`` (once the state is back).
    """
    kept = {a: getattr(m, a) for a in _KEPT}
    consumers = m.dynamic.delete_consumers()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    config, builder, device, row_wise_min_rows = m.build_arguments
    m.growth.frozen_status = m.dynamic_status()
    # the old model is freed before the new one is allocated; /status reads what is kept
    m.__dict__ = {**kept, "dynamic": _Rebuilding()}
    gc.collect()
    try:
        type(m).__init__(m, config, builder, device, row_wise_min_rows, table_rows=rows)
    except BaseException:
        m.growth.frozen_status = None
        raise
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    m.__dict__.update(kept)
    for consumer in consumers:
        m.dynamic.add_delete_consumer(consumer)
    shapes = m.table_shapes()
    for hook in list(m.growth.hooks):
        hook(shapes)


def _gaps(moves: list[tuple[int, int, int]], rows: int) -> list[tuple[int, int]]:
    """The rows of a grown table of ``rows`` rows that no move fills: ``[(first, end)]``."""
    out, at = [], 0
    for _old, new, n in sorted(moves, key=lambda move: move[1]):
        if new > at:
            out.append((at, new))
        at = new + n
    if at < rows:
        out.append((at, rows))
    return out


def _initial_values(table: str, seed: int, shape: tuple[int, ...], lo: int, hi: int
                    ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, values)`` of rows ``[lo, hi)``: their initial values, drawn for them."""
    for first, values in initial_rows(table, seed, shape, lo, hi):
        a, b = max(first, lo), min(first + values.shape[0], hi)
        if a < b:
            yield a, values[a - first : b - first]


@torch.no_grad()
def _load_grown(m: TrainModule, state: dict[str, Any], grown: Mapping[str, int],
                moves: Mapping[str, list[tuple[int, int, int]]]) -> None:
    """Puts a state saved before the tables grew into the rebuilt module (module docstring)."""
    own = m.embedding_tables()
    own_state = m.fused_optimizer.state_dict()["state"]
    for t, table_moves in moves.items():
        key = f"{EBC_PREFIX}{t}.weight"
        saved = state["model"].pop(key)
        w = own[t]
        for old, new, n in table_moves:
            w[new : new + n].copy_(saved[old : old + n].to(w.device, w.dtype))
        for lo, hi in _gaps(table_moves, w.shape[0]):  # the rows added: initial values
            for first, values in _initial_values(t, m.seed, tuple(w.shape), lo, hi):
                w[first : first + values.shape[0]].copy_(values.to(w.device, w.dtype))
        for k, v in state["sparse_optimizer"].pop(key, {}).items():
            live = local_view(own_state[key][k])
            if v.dim() and live.dim() and v.shape[0] < live.shape[0]:
                for old, new, n in table_moves:
                    live[new : new + n].copy_(v[old : old + n].to(live.device, live.dtype))
            else:
                live.copy_(v.to(live.device, live.dtype))
    state["dynamic_tables"] = grown_tables_state(state["dynamic_tables"], grown)
    module_state.load_state(m, state, strict=False)


def _moved_part(part: Mapping[str, Any], moves: Mapping[str, list[tuple[int, int, int]]]
                ) -> dict[str, Any]:
    """A rank's part document with the grown tables' row blocks where the growth puts them."""
    pieces = []
    for kind, name, key, size, blocks in part["pieces"]:
        table_moves = moves.get(name[len(EBC_PREFIX):-len(".weight")])
        if table_moves is None:
            pieces.append([kind, name, key, size, blocks])
            continue
        moved = []
        for offsets, t in blocks:
            if offsets is None or not t.dim():  # the same on every rank, or not per row
                moved.append([offsets, t])
                continue
            r0 = int(offsets[0])
            for old, new, n in table_moves:
                lo, hi = max(r0, old), min(r0 + t.shape[0], old + n)
                if lo < hi:
                    moved.append([[new + lo - old, *offsets[1:]], t[lo - r0 : hi - r0]])
        pieces.append([kind, name, key, size, moved])
    return {**part, "pieces": pieces}


@torch.no_grad()
def _load_rows_across_ranks(m: TrainModule, part: Mapping[str, Any],
                            moves: Mapping[str, list[tuple[int, int, int]]]) -> None:
    """Puts every rank's rows from before a growth into the rebuilt module's shards.

    Each rank's ``part`` (its rows and their optimizer state, ``table_part``), its blocks
    moved where the growth puts them, goes to every rank in turn; a rank copies the blocks
    that overlap its shards (a collective). The rows a grown table added (those no move
    fills) get their initial values; their optimizer state is the rebuilt module's fresh one.

    Args:
        m: the rebuilt module.
        part: this rank's part document from before the growth (its tensors compact copies).
        moves: TorchRec table of a grown dynamic table -> where its rows went (``row_moves``).
    """
    tables = {n: t for n, t in m.dmp.state_dict().items() if n.startswith(EBC_PREFIX)}
    local = {("model", n, ""): local_shards(t) for n, t in tables.items()}
    local.update({("sparse", p, k): local_shards(v) for p, st in
                  m.fused_optimizer.state_dict()["state"].items() for k, v in st.items()})
    added = []  # (table, whole shape, offsets, shard, gap) of weight rows no move fills
    for ident, shards in local.items():
        table = ident[1][len(EBC_PREFIX):-len(".weight")]
        if table not in moves:
            continue
        kept = []
        rows = int(tables[f"{EBC_PREFIX}{table}.weight"].size()[0])
        for start, shard in shards:
            if not shard.dim():
                kept.append((start, shard))
                continue
            r0, r1 = int(start[0]), int(start[0]) + shard.shape[0]
            for _old, new, n in moves[table]:  # the rows it held before come from the parts
                lo, hi = max(r0, new), min(r1, new + n)
                if lo < hi:
                    kept.append(((lo, *start[1:]), shard[lo - r0 : hi - r0]))
            if ident[0] == "model":
                for lo, hi in _gaps(moves[table], rows):
                    if max(lo, r0) < min(hi, r1):
                        added.append((table, tuple(tables[ident[1]].size()), start, shard,
                                      (max(lo, r0), min(hi, r1))))
        local[ident] = kept
    moved = _moved_part(part, moves)
    load_blocks((from_rank(moved if src == m.rank else None, src)
                 for src in range(m.world_size)), local)
    for table, shape, (r0, c0), shard, (lo, hi) in added:
        for first, values in _initial_values(table, m.seed, shape, lo, hi):
            shard[first - r0 : first - r0 + values.shape[0]].copy_(
                values[:, c0 : c0 + shard.shape[1]].to(shard.device, shard.dtype))


def _grow_across_ranks(m: TrainModule, rows: Mapping[str, int], grown: Mapping[str, int],
                       moves: Mapping[str, list[tuple[int, int, int]]]) -> None:
    """``grow_tables`` of one of several ranks (a collective; module docstring)."""
    part = module_state.table_part_copy(m)
    state = module_state.state_without_tables(m)
    _rebuild(m, rows)
    _load_rows_across_ranks(m, part, moves)
    if part.get("dynamic_parts"):  # split by id over the ranks: this rank's partitions
        state["dynamic_tables"] = {**state["dynamic_tables"],
                                   "parts": dict(part["dynamic_parts"])}
    del part
    state["dynamic_tables"] = grown_tables_state(state["dynamic_tables"], grown)
    module_state.load_state(m, state, strict=False)


def _bytes_needed(m: TrainModule, grown: Mapping[str, int]) -> tuple[int, int]:
    """``(host, device)`` bytes a growth needs beyond what the module holds now.

    The host holds the state's copy (every table and its optimizer state); the rows added
    (weights, optimizer state, index and counters) are allocated where the tables live.
    With several ranks a rank copies its own rows and holds one other rank's copy at a time
    (counted as large as its own), and the rows added are counted as if it held them all.
    """
    if m.world_size > 1:
        return _rank_bytes_needed(m, grown)
    tables, states = m.row_state_views()
    copy = sum(t.numel() * t.element_size() for t in tables.values())
    copy += sum(s.numel() * s.element_size() for ss in states.values() for s in ss)
    added = 0
    for base, rows in grown.items():
        old = m.dynamic.tables[base].spec.capacity
        added += (rows - old) * 56  # index and counters (memory_estimate's figure)
        for t in m.dynamic_torch_tables[base]:
            w = tables[t]
            per_row = w[0].numel() * w.element_size()
            per_row += sum(s.numel() * s.element_size() // max(1, w.shape[0])
                           for s in states.get(f"{EBC_PREFIX}{t}.weight", ()))
            added += (rows - old) * per_row
    if m.device.type == "cuda":
        return copy, added
    return copy + added, 0


def _rank_bytes_needed(m: TrainModule, grown: Mapping[str, int]) -> tuple[int, int]:
    """``_bytes_needed`` of one of several ranks."""
    tables = {n: t for n, t in m.dmp.state_dict().items() if n.startswith(EBC_PREFIX)}
    states = m.fused_optimizer.state_dict()["state"]
    own = 0
    for t in [*tables.values(), *(v for st in states.values() for v in st.values())]:
        own += sum(sh.numel() * sh.element_size() for _off, sh in local_shards(t))
    added = 0
    for base, rows in grown.items():
        old = m.dynamic.tables[base].spec.capacity
        per_row = 56  # index and counters (memory_estimate's figure)
        for t in m.dynamic_torch_tables[base]:
            key = f"{EBC_PREFIX}{t}.weight"
            size = tables[key].size()
            per_row += 4 * int(size[1])
            per_row += sum(4 * int(np.prod(v.size())) // max(1, int(size[0]))
                           for v in states.get(key, {}).values())
        added += (rows - old) * per_row
    if m.device.type == "cuda":
        return 2 * own, added
    return 2 * own + added, 0


def _memory_allows(m: TrainModule, grown: Mapping[str, int]) -> bool:
    """Whether the memory a growth needs is free (on every rank: a collective with ranks)."""
    host, device = _bytes_needed(m, grown)
    ok = host <= available_host_memory().bytes
    if ok and device:
        free, _total = torch.cuda.mem_get_info(m.device)
        ok = device <= free
    if m.world_size > 1:
        return all(v[0] for v in agree([int(ok)]))
    return ok


def grow_tables(m: TrainModule, grown: Mapping[str, int]) -> GrowthEvent:
    """Grows dynamic tables of ``m`` to ``grown`` rows now (module docstring).

    Args:
        m: the module (with several ranks every rank calls it: a collective).
        grown: growing dynamic table -> its new rows (at least its rows now).

    Returns:
        What grew and how long it took.
    """
    t0 = time.perf_counter()
    before = _current_rows(m)
    partitions = m.dynamic.partitions
    moves = {t: row_moves(before[base], int(rows), partitions)
             for base, rows in grown.items() for t in m.dynamic_torch_tables[base]}
    m.growth.moves = moves  # for the hooks the rebuild calls
    if m.world_size > 1:
        try:
            _grow_across_ranks(m, {**before, **grown}, grown, moves)
        finally:  # /status reads the module again
            m.growth.frozen_status = m.growth.moves = None
    else:
        state = module_state.checkpoint_state(m)
        try:
            _rebuild(m, {**before, **grown})
            _load_grown(m, state, grown, moves)
        finally:
            m.growth.frozen_status = m.growth.moves = None
        del state
    gc.collect()
    release_freed_memory()  # the old module and the copy: back to the host
    event = GrowthEvent(m.global_step, {n: (before[n], int(r)) for n, r in grown.items()},
                        time.perf_counter() - t0)
    m.growth.events.append(event)
    logger.info("dynamic tables grew after step %d in %.2f s: %s", event.step, event.seconds,
                ", ".join(f"{n} {a:,} -> {b:,} rows" for n, (a, b) in event.rows.items()))
    return event


def _fill(t: Any, partitions: int) -> float:
    """The share of a dynamic table's rows live: split by id, its fullest held partition's."""
    if partitions == 1:
        return t.live / t.spec.capacity
    return max(part.live / part.spec.capacity for _lo, part in t.held.values())


def _agreed(due: Mapping[str, int]) -> dict[str, int]:
    """Every rank's due growths joined (the most rows of each table): a collective."""
    out: dict[str, int] = {}
    for theirs in from_every_rank(dict(due)):
        for name, rows in theirs.items():
            out[name] = max(int(rows), out.get(name, 0))
    return out


def grow_if_due(m: TrainModule) -> GrowthEvent | None:
    """Doubles every growing table with more than ``GROW_AT`` of its rows live (a step's end).

    Split by id: when one partition's block has more than ``GROW_AT`` of its rows live,
    agreed by the ranks each step (a small collective while a table can still grow).

    Returns:
        The growth, or None when none was due or the memory it needs is not free.
    """
    due = {}
    partitions = m.dynamic.partitions
    for name, t in m.dynamic.tables.items():
        spec = t.spec
        if spec.grows and name not in m.growth.stopped and _fill(t, partitions) > GROW_AT:
            due[name] = partition_rows(min(2 * spec.capacity, spec.grows_to), partitions)
    if partitions > 1 and m.world_size > 1 and any(
            t.spec.grows for t in m.dynamic.tables.values()):
        due = _agreed(due)  # each rank saw its own partitions: one due is everyone's
    if not due:
        return None
    if not _memory_allows(m, due):
        for name in due:
            m.growth.stopped[name] = m.dynamic.tables[name].spec.capacity
            logger.warning("dynamic table %s stays at %d rows: the memory to double it is not "
                           "free; full, it makes room by eviction", name,
                           m.growth.stopped[name])
        return None
    return grow_tables(m, due)


def grow_to_hold(m: TrainModule, new_ids: Mapping[str, np.ndarray]) -> GrowthEvent | None:
    """Grows tables so that ids about to be given rows fit (crash recovery's replayed ids).

    Each growing table doubles until its live rows plus the ids it does not hold yet are at
    most ``GROW_AT`` of its rows (at most ``grows_to``), so recovering the rows serving
    holds evicts none of them (when the memory for it is free).

    Args:
        m: the module (with several ranks every rank calls it with the same ids).
        new_ids: dynamic table -> raw ids to be given rows.

    Returns:
        The growth, or None when none was needed.
    """
    due: dict[str, int] = {}
    partitions = m.dynamic.partitions
    for name, ids in new_ids.items():
        t = m.dynamic.tables.get(name)
        if t is None or not t.spec.grows or not len(ids):
            continue
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        missing = ids[t.lookup(ids) < 0]
        if partitions == 1:  # (live rows, rows) of the table, or of each held partition
            fills = [(t.live + missing.shape[0], 1)]
        else:
            owner = partition_of(missing, partitions)
            fills = [(part.live + int((owner == p).sum()), partitions)
                     for p, (_lo, part) in t.held.items()]
        rows = t.spec.capacity
        while (any(want > GROW_AT * rows / share for want, share in fills)
               and rows < t.spec.grows_to):
            rows = partition_rows(min(2 * rows, t.spec.grows_to), partitions)
        if rows > t.spec.capacity:
            due[name] = rows
    if m.world_size > 1:  # agreed so that no rank waits alone
        due = _agreed(due)
    if due and not _memory_allows(m, due):
        logger.warning("dynamic tables %s stay at their rows to recover: the memory to grow "
                       "them is not free; recovered ids beyond them evict others",
                       ", ".join(sorted(due)))
        return None
    return grow_tables(m, due) if due else None


def size_for_state(m: TrainModule, state: Mapping[str, Any]) -> None:
    """Builds ``m``'s growing tables at the rows a checkpoint state holds (before loading it).

    Raises:
        ValueError: the index split into another number of partitions than the
            checkpoint's and its grown rows not a multiple of it.
    """
    if not m.dynamic or "dynamic_tables" not in state:
        return
    now = _current_rows(m)
    saved = {n: r for n, r in saved_capacities(state["dynamic_tables"]).items()
             if n in now and r != now[n]}
    if not saved:
        return
    for name, rows in saved.items():
        if rows % m.dynamic.partitions:
            raise ValueError(
                f"dynamic table {name}: the checkpoint holds it at {rows:,} rows, which "
                f"dynamic_index_partitions {m.dynamic.partitions} cannot split into equal "
                "blocks: restore it with the checkpoint's dynamic_index_partitions, or one "
                "that divides its rows")
    logger.info("building dynamic tables at the rows the checkpoint holds: %s",
                ", ".join(f"{n} {r:,}" for n, r in saved.items()))
    _rebuild(m, {**now, **saved})
    if m.world_size > 1:  # a warm start keeps the rest
        init_local_shards(m.dmp, m.seed)
    else:
        init_embedding_weights(m.embedding_tables(), m.seed)
    m.growth.frozen_status = None  # a restore: the state is loaded next
