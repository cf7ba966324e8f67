"""The dynamic tables' rows inside a ``TrainModule``: remap across ranks, reset, maintenance.

``odl.models.dynamic`` decides which ids hold which rows; this module applies its decisions
to the model's tables. Evicted rows get fresh weights (the table's initializer, seeded by
table, step and partition) and restarted optimizer state, in the shards that hold them; the
maintenance pass (:meth:`DynamicRows.shrink`) runs every rank's decision at the same stream
time. With several ranks :meth:`DynamicRows.remap_ranks` is the step's collective remap: the
ranks exchange their batches' ids and remap the step's records as one process would.
:func:`dynamic_partitions` and :func:`held_partitions` check and place the split by id
(``train_config.dynamic_index_partitions``).

With the disk tier (``train_config.disk_tier``, :mod:`odl.models.dynamic.disk_rows`) the
tables record the rows that moved between RAM and disk in a remap or maintenance pass, and
:meth:`DynamicRows.reset` moves their values before and after the reset: a row leaving RAM
is written to its slot (every TorchRec table of the dynamic table and its per-row optimizer
state, side by side) before its RAM row gets fresh values, and a row coming back is read
into its new RAM row after, so the step that reads it sees it as it was.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.config_error import ConfigError
from odl.features.batch import Batch
from odl.models.dynamic.disk_moves import RowMoves
from odl.models.dynamic.disk_rows import DiskRows
from odl.models.dynamic.model_tables import UNHELD
from odl.models.dynamic.partitions import partition_spans
from odl.models.embedding_tables import reset_embedding_rows
from odl.protos import pipeline_pb2
from odl.train.distributed import arrays_from_every_rank, from_every_rank, int64_from_every_rank
from odl.train.table_shards import EBC_PREFIX, ShardRows, local_shards

if TYPE_CHECKING:
    from odl.train.train_module import TrainModule

__all__ = ["DynamicRows", "dynamic_partitions", "held_partitions"]


def dynamic_partitions(config: pipeline_pb2.EasyRecConfig, specs: Mapping[str, Any],
                       world_size: int) -> int:
    """``train_config.dynamic_index_partitions``, checked against the ranks and tables.

    With N ranks, P = 1 (the whole index on every rank) or a multiple of N: rank r holds
    partitions ``[r * P / N, (r + 1) * P / N)``, whose blocks of rows make its TorchRec
    row-wise block when P = N or every dynamic table's capacity is a multiple of P.

    Raises:
        ConfigError: P not 1 or a multiple of the ranks, blocks that do not line up with
            the ranks' row-wise blocks, or a table too small to split.
    """
    field = "train_config.dynamic_index_partitions"
    partitions = max(1, int(config.train_config.dynamic_index_partitions))
    world = world_size
    if not specs or partitions == 1:
        return 1
    if partitions % world:
        raise ConfigError(field, f"is {partitions} with {world} ranks: it must be 1 (the "
                          f"whole index on every rank) or a multiple of {world} (each "
                          "rank holds an equal share of the partitions)")
    for name, spec in specs.items():
        capacity = spec.dynamic.capacity
        try:
            partition_spans(capacity, partitions)
        except ValueError as exc:
            raise ConfigError(field, f"table {name}: {exc}") from exc
        if 1 < world < partitions and capacity % partitions:
            raise ConfigError(field, f"is {partitions} with {world} ranks, so each rank "
                              f"holds {partitions // world} partitions: table {name}'s "
                              f"capacity {capacity} must then be a multiple of "
                              f"{partitions} (its partitions' rows make each rank's "
                              "block of the table)")
    return partitions


def held_partitions(partitions: int, rank: int, world_size: int) -> tuple[int, ...] | None:
    """The partitions this rank holds (None: all, with one process or one partition)."""
    if world_size == 1 or partitions == 1:
        return None
    share = partitions // world_size
    return tuple(range(rank * share, (rank + 1) * share))


class DynamicRows:
    """The dynamic tables' rows of one ``TrainModule`` (module docstring).

    Args:
        module: the module whose tables hold the rows.
        features: the features looked up in dynamic tables.
    """

    def __init__(self, module: TrainModule, features: set[str]) -> None:
        self._m = module
        self._features = features
        # several ranks, split by id: the step's rows of every rank's records in the dynamic
        # tables, recorded beside this rank's own (it names and publishes its partitions')
        self._step_rows: KeyedJaggedTensor | None = None
        self.disk_tier = False  # attach_disk_tier

    def attach_disk_tier(self, config: pipeline_pb2.EasyRecConfig) -> None:
        """Gives every dynamic table its disk tier when the config has one (module docstring).

        Raises:
            ConfigError: several ranks or the index split by id, or a table whose optimizer
                state is not float32.
        """
        tier = config.train_config.disk_tier
        if not config.train_config.HasField("disk_tier") or not tier.dir or not self._m.dynamic:
            return
        if self._m.world_size > 1 or self._m.dynamic.partitions > 1:
            raise ConfigError("train_config.disk_tier", "runs with one process and "
                              "dynamic_index_partitions 1 (each rank would hold its own "
                              "rows on disk: not supported yet)")
        tables = self._m.row_state_views()[0]
        for base, table in self._m.dynamic.tables.items():
            layout = self._disk_layout(base)
            for x in layout:
                if x.dtype != torch.float32:
                    raise ConfigError("train_config.disk_tier", f"table {base} holds "
                                      f"{x.dtype} values; the disk tier keeps float32 rows")
            columns, at = {}, 0
            for x in layout:
                for t in self._m.dynamic_torch_tables[base]:
                    if x is tables[t]:
                        columns[t] = at
                at += x.shape[1]
            table.attach_disk(DiskRows(os.path.join(tier.dir, base), at,
                                       max(0, table.spec.disk_rows), columns))
        self.disk_tier = True

    def _disk_layout(self, base: str) -> list[torch.Tensor]:
        """``[rows, k]`` views of the tensors a disk row of ``base`` holds, in slot order."""
        tables, states = self._m.row_state_views()
        out = []
        for t in self._m.dynamic_torch_tables[base]:
            w = tables[t]
            out.append(w)
            out.extend(v.reshape(w.shape[0], -1)
                       for v in states.get(f"{EBC_PREFIX}{t}.weight", [])
                       if v.dim() >= 1 and v.shape[0] == w.shape[0])
        return out

    @torch.no_grad()
    def disk_row_values(self, base: str, rows: np.ndarray) -> np.ndarray:
        """RAM rows of dynamic table ``base`` as the disk tier lays them out (``[n, width]``)."""
        r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        values = [x.index_select(0, r.to(x.device)).to("cpu", torch.float32)
                  for x in self._disk_layout(base)]
        return torch.cat(values, 1).numpy()

    def _write_out(self, base: str, moves: RowMoves) -> None:
        """Writes the values of rows that left RAM to their slots (before the reset)."""
        if moves.out_ids.shape[0]:
            self._m.dynamic.tables[base].disk.write(
                moves.out_slots, self.disk_row_values(base, moves.out_rows))

    @torch.no_grad()
    def _read_in(self, base: str, moves: RowMoves) -> None:
        """Reads the values of rows back in RAM from their slots (after the reset)."""
        if not moves.in_ids.shape[0]:
            return
        disk = self._m.dynamic.tables[base].disk
        values = torch.from_numpy(disk.read(moves.in_slots))
        r = torch.from_numpy(moves.in_rows)
        at = 0
        for x in self._disk_layout(base):
            k = x.shape[1]
            x.index_copy_(0, r.to(x.device), values[:, at:at + k].to(x.device, x.dtype))
            at += k
        disk.release(moves.in_slots)

    def take_step_rows(self) -> KeyedJaggedTensor | None:
        """The last ``remap_ranks``' rows of every rank's records (split by id), once."""
        rows, self._step_rows = self._step_rows, None
        return rows

    def status(self) -> dict[str, dict[str, Any]]:
        """Per dynamic table: ``DynamicTables.status()`` plus ``memory_bytes``.

        ``memory_bytes`` counts its rows and their optimizer state in every TorchRec table it
        backs, and its id index, counters and sketch.
        """
        out = self._m.dynamic.status()
        if self._m.world_size > 1:  # this rank's shards of the rows, the whole index
            for base, st in out.items():
                nbytes = st["map_bytes"]
                for t in self._m.dynamic_torch_tables[base]:
                    weight, state = self._m.table_shards(t)
                    held = [weight, *state]
                    nbytes += sum(x.numel() * x.element_size()
                                  for h in held for _o, x in local_shards(h))
                st["memory_bytes"] = int(nbytes)
            return out
        tables, states = self._m.row_state_views()
        for base, st in out.items():
            nbytes = st["map_bytes"]
            for t in self._m.dynamic_torch_tables[base]:
                nbytes += tables[t].numel() * tables[t].element_size()
                nbytes += sum(v.numel() * v.element_size()
                              for v in states.get(f"{EBC_PREFIX}{t}.weight", []))
            st["memory_bytes"] = int(nbytes)
        return out

    @torch.no_grad()
    def shrink(self, now: float | None = None) -> dict[str, int]:
        """Runs every dynamic table's maintenance pass now (decay, expiry; a day's end).

        With several ranks a collective (every rank calls it): the ranks use the latest of
        their times.

        Args:
            now: stream time (unix seconds); default: the newest stream time trained on, or
                the clock without ``event_time_field``.

        Returns:
            Dynamic table -> rows evicted (their rows are reset).
        """
        if not self._m.dynamic:
            return {}
        if now is None:
            now = self._m.stream_time if self._m.stream_time > 0 else time.time()
        if self._m.world_size > 1:  # a collective: every rank decides at the same time
            now = max(float(t) for t in from_every_rank(float(now)))
        evicted = self._m.dynamic.shrink(self._m.global_step, now)
        if evicted or self.disk_tier:
            self.reset(evicted, self._m.global_step)
        return {name: int(rows.shape[0]) for name, rows in evicted.items()}

    def stream_now(self, batch: Batch) -> float:
        """The stream time of a step: its newest event time when it has any, else the clock."""
        if batch.event_times is not None and len(batch.event_times):
            self._m.stream_time = max(self._m.stream_time, float(np.max(batch.event_times)))
            return self._m.stream_time
        return time.time()

    @torch.no_grad()
    def reset(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """Fresh weights and optimizer state for evicted rows (dynamic table -> rows).

        The state restarts where the table optimizer starts it (0, or a fused Adagrad's
        ``initial_accumulator_value``). With the disk tier, rows that moved to disk are
        written out first and rows that came back read in after (module docstring).

        With several ranks each rank resets the rows its shards hold, to the values one
        process would give them. Split by id, each partition's rows draw their values from
        their own stream (the partition), so a rank knowing only its partition's evictions
        resets them as one process holding every partition does.
        """
        moves = ({base: m for base, t in self._m.dynamic.tables.items()
                  if (m := t.take_moves()) is not None} if self.disk_tier else {})
        for base, m in moves.items():
            self._write_out(base, m)
        if self._m.world_size > 1:
            self._reset_shards(evicted, step)
            return
        self._reset_rows(evicted, step)
        for base, m in moves.items():
            self._read_in(base, m)

    def _reset_rows(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """``reset`` of one process."""
        tables, states = self._m.row_state_views()
        for base, rows in evicted.items():
            for stream, r in self._reset_streams(base, rows):
                for t in self._m.dynamic_torch_tables[base]:
                    w = tables[t]
                    reset_embedding_rows(t, w, r, self._m.seed, step, stream)
                    for v in states.get(f"{EBC_PREFIX}{t}.weight", []):
                        if v.dim() >= 1 and v.shape[0] == w.shape[0]:
                            v.index_fill_(0, r.to(v.device), self._m.table_state_start)

    def _reset_streams(self, base: str, rows: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """``[(stream, rows)]`` of evicted rows: per partition split by id, else one."""
        r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        if self._m.dynamic.partitions == 1:
            return [(0, r)]
        spans = partition_spans(self._m.dynamic.tables[base].spec.capacity,
                                self._m.dynamic.partitions)
        return [(p, r[(r >= lo) & (r < hi)]) for p, (lo, hi) in enumerate(spans)]

    def _reset_shards(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """``reset_dynamic_rows`` of one of several ranks: its own shards' rows."""
        for base, rows in evicted.items():
            r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            for t in self._m.dynamic_torch_tables[base]:
                weight, state = self._m.table_shards(t)
                whole = ShardRows(local_shards(weight), tuple(int(x) for x in weight.size()))
                for stream, part in self._reset_streams(base, rows):
                    reset_embedding_rows(t, whole, part, self._m.seed, step, stream)
                for v in state:
                    for (r0, *_c), shard in local_shards(v):
                        inside = r[(r >= r0) & (r < r0 + shard.shape[0])] - r0
                        if inside.numel():
                            shard.index_fill_(0, inside.to(shard.device),
                                             self._m.table_state_start)

    def remap(self, batch: Batch) -> tuple[Batch, float]:
        """A training step's remap of this rank's batch: ``(batch, stream time)``.

        One rank remaps (admission, eviction, counters) and resets the rows evicted for
        admission; several do it together (:meth:`remap_ranks`).
        """
        if self._m.world_size > 1:
            return self.remap_ranks(batch)
        now = self.stream_now(batch)
        remapped = self._m.dynamic.remap(batch, self._m.global_step + 1, now, admit=True)
        if remapped.evicted or self.disk_tier:
            self.reset(remapped.evicted, self._m.global_step + 1)
        return remapped.batch, now

    def remap_ranks(self, batch: Batch, admit: bool = True) -> tuple[Batch, float]:
        """Dynamic tables' remap with several ranks (a collective): ``(batch, stream time)``.

        The ranks exchange their batches' ids, labels, counts and event times, and remap the
        step's records of all ranks in rank order, as one process would remap the
        concatenated batch, then each keeps its own records. With the whole index on every
        rank each rank makes every decision itself (the same everywhere); split by id
        (``odl.models.dynamic.partitions``) each rank maps the ids of its own partition and
        the ranks exchange those rows. Rows evicted for admission are reset in the shards
        that hold them. Stream time is the newest event time of the step's records (rank
        0's clock without an event time field), the same on every rank.

        Args:
            batch: this rank's batch (``empty_batch()`` when it has none).
            admit: a training step (admission, eviction, counters); False: look up only.
        """
        kjt = batch.sparse
        keys = list(kjt.keys())
        b = batch.size
        labels = batch.labels.detach().cpu().numpy().astype(np.float32)
        mine = {"values": kjt.values().cpu().numpy().astype(np.int64),
                "lengths": kjt.lengths().cpu().numpy().astype(np.int64).reshape(len(keys), b).T,
                "labels": labels.reshape(b, int(np.prod(labels.shape[1:]))),
                "times": (np.asarray(batch.event_times, dtype=np.float64)
                          if batch.event_times is not None else np.zeros(0)),
                "clock": np.array([time.time()])}
        for name, values in sorted((batch.counts or {}).items()):
            mine[f"count:{name}"] = np.asarray(values, dtype=np.float32)
        everyone = arrays_from_every_rank(mine)
        sizes = [len(p["lengths"]) for p in everyone]
        total = sum(sizes)
        times = np.concatenate([p["times"] for p in everyone])
        if len(times) and admit:
            self._m.stream_time = max(self._m.stream_time, float(times.max()))
            now = self._m.stream_time
        else:
            now = float(everyone[0]["clock"][0])
        if total == 0:  # no step: nothing to admit
            return batch, now
        lengths = np.concatenate([p["lengths"] for p in everyone])  # [total, keys]
        values, at = [], [0] * len(everyone)
        for k in range(len(keys)):  # per key, rank after rank (a KJT's layout)
            for r, p in enumerate(everyone):
                n = int(p["lengths"][:, k].sum())
                values.append(p["values"][at[r]:at[r] + n])
                at[r] += n
        sparse = KeyedJaggedTensor(
            keys=keys, values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.ascontiguousarray(lengths.T.reshape(-1))))
        counts = {name[len("count:"):]: np.concatenate([p[name] for p in everyone])
                  for name in mine if name.startswith("count:")}
        whole = Batch(sparse=sparse, dense=torch.zeros(total, 0),
                      labels=torch.from_numpy(np.concatenate([p["labels"] for p in everyone])
                                              .reshape((total, *labels.shape[1:]))),
                      counts=counts or None)
        step = self._m.global_step + 1 if admit else self._m.global_step
        if self._m.dynamic.partitions == 1:
            remapped = self._m.dynamic.remap(whole, step, now, admit=admit)
            mapped, evicted = remapped.batch, remapped.evicted
        else:
            found = self._m.dynamic.lookups(whole)
            if found is None:
                return batch, now
            rows, evicted = self._m.dynamic.map_lookups(found, whole, step, now, admit)
            assert found.owner is not None  # the rank holding each lookup's partition
            owner = found.owner // (self._m.dynamic.partitions // self._m.world_size)
            counts = np.bincount(owner, minlength=self._m.world_size).tolist()
            for r, part in enumerate(int64_from_every_rank(rows[owner == self._m.rank], counts)):
                if r != self._m.rank:
                    rows[owner == r] = part
            assert not (rows == UNHELD).any()
            mapped = self._m.dynamic.with_rows(whole, found, rows)
            if admit and self._m.has_touched_rows_hooks:
                self._step_rows = mapped.sparse.permute(
                    [i for i, k in enumerate(keys) if k in self._features])
        if evicted:
            self.reset(evicted, step)
        start = sum(sizes[:self._m.rank])
        keep = torch.zeros(total, dtype=torch.bool)
        keep[start:start + b] = True
        return replace(batch, sparse=mapped.select(keep).sparse), now
