"""Delta version snapshots: what is copied out of the live model, and how two merge.

A snapshot is the content of one delta version before encoding. ``ParameterSnapshotter``
takes it on the train loop's thread: the CURRENT values of the embedding rows the
``DeltaTracker`` saw touched since the last sparse snapshot (the module's ``read_rows``,
wide tables cut to their published width) and / or a copy of every dense variable of the id
maps, with the input positions after the last trained batch and the min/max event time and
Kafka produce time of the samples trained since the previous snapshot.

Several ranks (``odl.train.rank_publishing``): every rank holds a snapshotter and its own
tracker, and all take each sparse snapshot together. ``read_rows`` is then a collective that
brings the union of the ranks' touched rows, read from the shards that hold them, to rank 0;
rank 0's snapshot is the version, the others' are empty and dropped.

``merge_snapshots`` folds two snapshots into one when the sender is behind: the union of the
rows with the newer values, the newer version, positions and publish time, the widened time
ranges. The merged snapshot is what the newer one alone would have been had the older one
never been taken.

Republishing: the snapshotter remembers every row it has ever put into a snapshot (one bit
per row). ``take(..., republish_all=True)`` puts all of them, and every dense variable, into
one snapshot (after the broker lost acknowledged versions), marked ``full``; a merge with a
full snapshot is full too.

Dynamic tables (``odl.models.dynamic``; the module's ``dynamic_table(name)``): the
touched rows are published under the raw ids they hold at snapshot time (a row freed since
it was touched is left out, a row given to another id since is sent under that id), only
rows the table says are publishable (``delta_threshold``, ``delta_keep_days``), and the ids
the table evicted since the previous sparse snapshot go out as deletes. Republishing sends
every live row. ``merge_snapshots`` keeps the order of deletes and rows: an id deleted by the
newer snapshot leaves the older one's rows, and deletes always apply before rows.

Header times outside ``[0, 2**63)`` ms, which the int64 header fields cannot hold, are
written as 0 ("unknown"); the feature builder already rejects event times outside a sane
window.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np
import torch

from odl.models.dynamic.dynamic_table import PUBLISHER_DELETES, DynamicTable
from publisher.delta_format import VersionHeader
from publisher.delta_tracker import DeltaTracker
from publisher.id_maps import IdMaps

logger = logging.getLogger(__name__)

_INT64_MAX = (1 << 63) - 1


class ParameterSource(Protocol):
    """What the snapshotter reads from the train module."""

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """Table name -> ``(rows, stored columns)``."""

    def read_rows(self, requested: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Table name -> ``(row ids, current rows)`` of the requested rows.

        With several ranks a collective: each rank requests its own rows, and the sorted
        union of all ranks' with their values comes back on rank 0 (``{}`` elsewhere).
        """

    def dense_parameters(self) -> dict[str, torch.Tensor]:
        """Dense variable name -> live tensor."""

    def served_dense_parameters(self) -> dict[str, torch.Tensor]:
        """Dense variable name -> the tensor serving receives.

        The live one, or its moving average where the config serves one.
        """

    def dynamic_table(self, table: str) -> Optional[DynamicTable]:
        """The dynamic table behind a table name, None for a fixed table."""


def merge_time_range(a: Optional[list[int]], b: Optional[list[int]]) -> Optional[list[int]]:
    """The smallest ``[min, max]`` range covering both (None: no range)."""
    if a is None:
        return None if b is None else list(b)
    if b is None:
        return list(a)
    return [min(a[0], b[0]), max(a[1], b[1])]


def _header_time(value: Optional[int]) -> int:
    """A time for an int64 header field: the value, or 0 (unknown) when it does not fit."""
    if value is None or not 0 <= value <= _INT64_MAX:
        return 0
    return int(value)


@dataclass
class VersionSnapshot:
    """The content of one delta version, copied out of the model.

    Attributes:
        version: the global step.
        has_dense: the dense part is in it.
        has_sparse: the sparse part is in it.
        dense: variable id -> values.
        sparse: table id -> ``(ids int64 [n], values [n, dim])``.
        event_range: ``[min, max]`` event time of its samples (unix ms), or None.
        produce_range: ``[min, max]`` Kafka produce time of its samples, or None.
        positions: ``(topic, partition, next_offset)`` after its last trained batch.
        publish_time_ms: when it was taken (unix ms).
        taken_at: when it was taken (``time.monotonic()``; the oldest, once merged).
        merged: snapshots merged into it.
        deletes: table id -> raw ids deleted from a dynamic table (applied before ``sparse``).
        full: a republish: every row ever published and every dense variable are in it.
        rows: embedding rows in it.
    """

    version: int
    has_dense: bool
    has_sparse: bool
    dense: dict[int, np.ndarray]
    sparse: dict[int, tuple[np.ndarray, np.ndarray]]
    event_range: Optional[list[int]]
    produce_range: Optional[list[int]]
    positions: list[tuple[str, int, int]]
    publish_time_ms: int
    taken_at: float
    merged: int = 0
    deletes: dict[int, np.ndarray] = field(default_factory=dict)
    full: bool = False
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = sum(len(ids) for ids, _ in self.sparse.values())

    @property
    def kind(self) -> str:
        """``"both"``, ``"dense"`` or ``"sparse"``."""
        if self.has_dense and self.has_sparse:
            return "both"
        return "dense" if self.has_dense else "sparse"

    def header(self, model_name: str, generation: str,
               last_full: Optional[tuple[int, int]] = None) -> VersionHeader:
        """The version header of this snapshot.

        Args:
            model_name: model name written into the version.
            generation: the trainer generation id.
            last_full: ``(version, first chunk's offset)`` of the generation's newest full
                republish acknowledged so far, or None.

        Returns:
            The header (times that do not fit int64 become 0).
        """
        event = self.event_range or [0, 0]
        produce = self.produce_range or [0, 0]
        return VersionHeader(
            model_name=model_name,
            version=self.version,
            generation=generation,
            kind=self.kind,
            min_event_time_ms=_header_time(event[0]),
            max_event_time_ms=_header_time(event[1]),
            min_produce_time_ms=_header_time(produce[0]),
            max_produce_time_ms=_header_time(produce[1]),
            positions=self.positions,
            publish_time_ms=self.publish_time_ms,
            full_republish=self.full,
            last_full_version=last_full[0] if last_full else 0,
            last_full_offset=last_full[1] if last_full else -1,
        )

    def payload_floor_bytes(self, bytes_per_value: int) -> int:
        """Bytes of ids and values alone (the size an encoding cannot go below)."""
        rows = sum(len(ids) * (8 + bytes_per_value * v.shape[1])
                   for ids, v in self.sparse.values())
        rows += sum(8 * len(ids) for ids in self.deletes.values())
        return rows + sum(a.size * bytes_per_value for a in self.dense.values())


def merge_snapshots(old: VersionSnapshot, new: VersionSnapshot) -> VersionSnapshot:
    """One snapshot with old's and new's content; new's values and header win.

    Args:
        old: the older snapshot.
        new: the newer snapshot.

    Returns:
        The merged snapshot.
    """
    sparse = dict(old.sparse)
    for tid, gone in new.deletes.items():  # the newer deletes drop the older rows
        if tid in sparse and len(gone):
            old_ids, old_values = sparse[tid]
            keep = ~np.isin(old_ids, gone)
            sparse[tid] = (old_ids[keep], old_values[keep])
    deletes = dict(old.deletes)
    for tid, gone in new.deletes.items():
        deletes[tid] = (np.union1d(deletes[tid], gone) if tid in deletes
                        else np.asarray(gone, dtype=np.int64))
    for tid, (ids, values) in new.sparse.items():
        if tid not in sparse:
            sparse[tid] = (ids, values)
            continue
        old_ids, old_values = sparse[tid]
        all_ids = np.concatenate([ids, old_ids])
        all_values = np.concatenate([values, old_values])
        uniq, first = np.unique(all_ids, return_index=True)  # first occurrence = newer value
        sparse[tid] = (uniq, all_values[first])
    dense = dict(old.dense)
    dense.update(new.dense)
    return VersionSnapshot(
        version=new.version,
        has_dense=old.has_dense or new.has_dense,
        has_sparse=old.has_sparse or new.has_sparse,
        dense=dense,
        sparse=sparse,
        event_range=merge_time_range(old.event_range, new.event_range),
        produce_range=merge_time_range(old.produce_range, new.produce_range),
        positions=new.positions,
        publish_time_ms=new.publish_time_ms,
        taken_at=old.taken_at,
        merged=old.merged + new.merged + 1,
        deletes=deletes,
        full=old.full or new.full,
    )


class ParameterSnapshotter:
    """Takes snapshots of the live model (see the module docstring).

    Args:
        module: the train module (``table_shapes()``, ``read_rows()``,
            ``served_dense_parameters()``).
        id_maps: ids and published widths of variables and tables.
        tracker: the touched-rows tracker registered on the module.
        input_topic: input topic name written into the positions.
        delete_consumer: whose evicted ids of dynamic tables this snapshotter takes as deletes
            (``DynamicTable.take_deleted``): the delta publisher's, or another writer's.

    Attributes:
        secs_total: seconds spent taking snapshots so far.
    """

    def __init__(self, module: ParameterSource, id_maps: IdMaps, tracker: DeltaTracker,
                 input_topic: str = "", delete_consumer: str = PUBLISHER_DELETES) -> None:
        self.module = module
        self.id_maps = id_maps
        self.tracker = tracker
        self.input_topic = input_topic
        self.delete_consumer = delete_consumer
        self._event_range: Optional[list[int]] = None
        self._produce_range: Optional[list[int]] = None
        self._published_rows: dict[str, torch.Tensor] = {}  # table -> rows ever published
        self.secs_total = 0.0
        for name in module.table_shapes():  # evictions become deletes from now on
            dyn = self._dynamic(name)
            if dyn is not None:
                dyn.add_delete_consumer(delete_consumer)

    def note_times(self, event_time_ms: Optional[tuple[int, int]] = None,
                   produce_time_ms: Optional[tuple[int, int]] = None) -> None:
        """Adds a batch's event / produce time range to the next snapshot.

        Args:
            event_time_ms: ``(min, max)`` event time, unix ms.
            produce_time_ms: ``(min, max)`` Kafka produce time, unix ms.
        """
        if event_time_ms is not None:
            self._event_range = merge_time_range(self._event_range, list(event_time_ms))
        if produce_time_ms is not None:
            self._produce_range = merge_time_range(self._produce_range, list(produce_time_ms))

    @torch.no_grad()
    def take(self, step: int, positions: Mapping[int, int], dense: bool, sparse: bool,
             republish_all: bool = False) -> VersionSnapshot:
        """Copies the due parts out of the model.

        Args:
            step: the global step (the version).
            positions: next offset per input partition.
            dense: copy every dense variable.
            sparse: copy the rows touched since the last sparse snapshot.
            republish_all: copy both parts, the sparse one with every row ever published.

        Returns:
            The snapshot; the noted time ranges start afresh.
        """
        t0 = time.perf_counter()
        taken_at = time.monotonic()
        if republish_all:
            dense = sparse = True
        sparse_out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        deletes: dict[int, np.ndarray] = {}
        if sparse:
            sparse_out, deletes = self._copy_rows(step, republish_all)
        dense_out: dict[int, np.ndarray] = {}
        if dense:
            params = self.module.served_dense_parameters()
            for name, info in self.id_maps.dense.items():
                dense_out[info.id] = params[name].detach().to("cpu", copy=True).numpy()
        snap = VersionSnapshot(
            version=int(step),
            has_dense=dense,
            has_sparse=sparse,
            dense=dense_out,
            sparse=sparse_out,
            event_range=self._event_range,
            produce_range=self._produce_range,
            positions=[(self.input_topic, int(p), int(o)) for p, o in sorted(positions.items())],
            publish_time_ms=int(time.time() * 1000),
            taken_at=taken_at,
            deletes=deletes,
            full=republish_all,
        )
        self._event_range = self._produce_range = None
        self.secs_total += time.perf_counter() - t0
        return snap

    def _dynamic(self, name: str) -> Optional[DynamicTable]:
        getter = getattr(self.module, "dynamic_table", None)
        return getter(name) if getter is not None else None

    def _take_deleted(self, shapes: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Dynamic table -> ids evicted since this snapshotter's last take.

        Through the module's ``take_deleted`` where it has one (several ranks with the index
        split by id: a collective bringing every partition's ids to rank 0).
        """
        taker = getattr(self.module, "take_deleted", None)
        if taker is not None:
            return taker(self.delete_consumer)
        out: dict[str, np.ndarray] = {}
        for name in shapes:
            dyn = self._dynamic(name)
            if dyn is not None and dyn.name not in out:
                out[dyn.name] = dyn.take_deleted(self.delete_consumer)
        return out

    def _add_moved_out(self, shapes: Mapping[str, Any],
                       out: dict[int, tuple[np.ndarray, np.ndarray]],
                       republish_all: bool) -> None:
        """Adds the rows moved to a disk tier since the last take, read from disk.

        A row may have been updated since the last version and moved out before this one
        (``DynamicTable.take_moved_out``): its values are sent from its slot. An id back in
        RAM is not on disk, and is sent from its row when a step touched it. A republish
        sends every row on disk.
        """
        moved: dict[str, np.ndarray] = {}
        for name in shapes:
            dyn = self._dynamic(name)
            info = self.id_maps.tables.get(name)
            if dyn is None or info is None or getattr(dyn, "disk", None) is None:
                continue
            if dyn.name not in moved:
                moved[dyn.name] = dyn.take_moved_out(self.delete_consumer)
                if republish_all:
                    moved[dyn.name] = dyn.disk.ids()
            keys, values = dyn.disk_rows(moved[dyn.name])
            if not keys.shape[0]:
                continue
            first = dyn.disk.columns[name]
            values = values[:, first:first + info.dim]
            if info.id in out:
                old_keys, old_values = out[info.id]
                keys = np.concatenate([old_keys, keys])
                values = np.concatenate([old_values, values])
            out[info.id] = (keys, values)

    def _raw_ids(self, name: str, dyn: DynamicTable, rows: np.ndarray) -> np.ndarray:
        """The raw ids ``rows`` of a dynamic table hold (-1: free).

        Through the module where it names them (several ranks with the index split by id:
        rank 0 knows them from the read).
        """
        namer = getattr(self.module, "raw_ids", None)
        return namer(name, rows) if namer is not None else dyn.raw_ids(rows)

    def take_time_ranges(self) -> tuple[Optional[list[int]], Optional[list[int]]]:
        """The noted ``(event, produce)`` time ranges, which then start afresh.

        A rank other than 0 sends them to rank 0, whose snapshot covers every rank's.
        """
        out = (self._event_range, self._produce_range)
        self._event_range = self._produce_range = None
        return out

    def _copy_rows(self, step: int, republish_all: bool) -> tuple[
            dict[int, tuple[np.ndarray, np.ndarray]], dict[int, np.ndarray]]:
        touched = self.tracker.take()
        shapes = self.module.table_shapes()
        deletes: dict[int, np.ndarray] = {}
        gone = self._take_deleted(shapes)
        for name in shapes:
            dyn = self._dynamic(name)
            info = self.id_maps.tables.get(name)
            if dyn is None or info is None:
                continue
            if dyn.name in gone and gone[dyn.name].shape[0]:
                deletes[info.id] = gone[dyn.name]
        if republish_all:
            for name, mask in self._published_rows.items():
                ids = mask.nonzero().flatten()
                if name in touched:
                    ids = torch.unique(torch.cat([ids, touched[name].cpu()]))
                touched[name] = ids
            for name in shapes:
                dyn = self._dynamic(name)
                if dyn is not None:  # and every row of partitions held elsewhere (split by
                    # id over ranks): their ranks name the live ones in the read
                    touched[name] = torch.from_numpy(np.union1d(dyn.live_rows(),
                                                                dyn.unheld_rows()))
        requested: dict[str, torch.Tensor] = {}
        for name, ids in touched.items():
            if name not in self.id_maps.tables:
                continue
            dyn = self._dynamic(name)
            if dyn is not None:
                keys = ids.cpu().numpy().astype(np.int64, copy=False)
                raw = dyn.raw_ids(keys)
                ok = raw >= 0
                ok[ok] = dyn.publishable(keys[ok], dyn.now)
                if republish_all:
                    ok |= ~dyn.holds(keys)
                ids = ids[torch.from_numpy(ok).to(ids.device)]
                if not ids.shape[0]:
                    continue
            requested[name] = ids
        got = self.module.read_rows(requested)  # several ranks: all take part, rank 0 gets
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for name, (ids, rows) in got.items():
            info = self.id_maps.tables[name]
            dyn = self._dynamic(name)
            if dyn is not None:  # the raw id each row holds (several ranks: of the union)
                keys = self._raw_ids(name, dyn, ids.cpu().numpy().astype(np.int64, copy=False))
                live = keys >= 0  # not: free rows of a republish of partitions held elsewhere
                if not live.all():
                    rows, keys = rows[torch.from_numpy(live).to(rows.device)], keys[live]
            else:  # remembered for a republish (the union of every rank's rows)
                if name not in self._published_rows:
                    self._published_rows[name] = torch.zeros(shapes[name][0], dtype=torch.bool)
                keys = ids.cpu().numpy().astype(np.int64, copy=False)
                self._published_rows[name][ids.cpu()] = True
            out[info.id] = (keys, rows[:, : info.dim].cpu().numpy())
        self._add_moved_out(shapes, out, republish_all)
        if republish_all:
            logger.warning("delta version %d republishes all %d rows ever published (the "
                           "broker lost acknowledged versions)", step,
                           sum(len(ids) for ids, _ in out.values()))
        return out, deletes
