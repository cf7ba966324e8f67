"""The dynamic tables' rows inside a ``TrainModule``: remap across ranks, reset, maintenance.

``odl.models.dynamic`` decides which ids hold which rows; this module applies its decisions
to the model's tables. Evicted rows get fresh weights (the table's initializer, seeded by
table, step and partition) and restarted optimizer state, in the shards that hold them; the
maintenance pass (:meth:`DynamicRows.shrink`) runs every rank's decision at the same stream
time. With several ranks :meth:`DynamicRows.remap_ranks` is the step's collective remap: the
ranks exchange their batches' ids and remap the step's records as one process would.
:func:`dynamic_partitions` and :func:`held_partitions` check and place the split by id
(``train_config.dynamic_index_partitions``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.config_error import ConfigError
from odl.features.batch import Batch
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
        if evicted:
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
        ``initial_accumulator_value``).

        With several ranks each rank resets the rows its shards hold, to the values one
        process would give them. Split by id, each partition's rows draw their values from
        their own stream (the partition), so a rank knowing only its partition's evictions
        resets them as one process holding every partition does.
        """
        if self._m.world_size > 1:
            self._reset_shards(evicted, step)
            return
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
        if remapped.evicted:
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
