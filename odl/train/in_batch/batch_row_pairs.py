"""The (table row, record) reads of a training step, sorted by row, and the rows' storage.

In-batch learning (``odl.train.in_batch.in_batch_learning``) and the per-record Adagrad
accumulator (``odl.train.in_batch.per_record_adagrad``) both look at a step as its *pairs*:
one pair per read of a table row by a record through a pooled lookup (a multi-valued
feature reads several rows; a record that reads a row through two lookups of one table, or
twice through one lookup, has two pairs for it). ``RowPairIndex.pairs`` lists them sorted
by (table, row, record), so a row's pairs are contiguous and in batch order:

* ``rows[p]``, ``lookup[p]``, ``sample[p]``: the row, the lookup (index into the model's
  ``pooled_layout`` lookups, group after group) and the record of pair ``p``;
* ``weight[p]``: the pair's weight in its lookup's pooled vector (1; ``1/n`` for a mean over
  ``n`` ids; times the id's value weight for a weighted feature);
* ``new_row[p]`` / ``new_pair[p]``: ``p`` starts a row / a (row, record) run;
* ``row_start[p]`` / ``pair_start[p]``: the first pair of ``p``'s row / (row, record) run.

A pair's columns of a ``[B, group width]`` tensor per group (the pooled vectors, their
gradients, the logit's Jacobian) come from ``RowPairIndex.per_pair``: ``[P, width]``,
``width`` the widest lookup, the columns beyond a lookup's own width zero.

Storage: the fused kernel keeps the weights (and the accumulators) of its tables in one
buffer; ``RowPairIndex`` addresses each lookup's rows in it by (buffer, offset, row stride),
so reading or writing the rows of all tables costs one gather / scatter per buffer.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.models.ctr_model import PooledGroup
from odl.train.in_batch import native_kernels
from odl.train.in_batch.native_kernels import address as _ptr


def argsort(keys: torch.Tensor) -> torch.Tensor:
    """The permutation sorting ``keys`` (int64; equal keys in no particular order).

    On the CPU through numpy, whose sort is several times faster than torch's.
    """
    if keys.device.type != "cpu":
        return torch.argsort(keys)
    return torch.from_numpy(np.argsort(keys.numpy()))


@dataclass(frozen=True)
class TableRows:
    """What the pairs' users need of one TorchRec table.

    Attributes:
        state: the table optimizer's accumulator (``[rows, stored_columns]`` or ``[rows *
            stored_columns]`` for Adagrad, ``[rows]`` for row-wise Adagrad; None for SGD).
        stored_columns: the table's stored width (``odl.models.embedding_tables``).
        mean_pooling: the table pools its ids by mean (each of n ids weighs 1/n).
        lr_multiplier: the table's rate relative to the table rate.
        weight: the table's live weight ``[rows, stored_columns]`` (None: not written).
    """

    state: torch.Tensor | None
    stored_columns: int
    mean_pooling: bool
    lr_multiplier: float = 1.0
    weight: torch.Tensor | None = None


@dataclass(frozen=True)
class RowPairs:
    """The pairs of one step (module docstring); ``P`` pairs, ``b`` records."""

    b: int
    rows: torch.Tensor
    lookup: torch.Tensor
    sample: torch.Tensor
    weight: torch.Tensor
    new_row: torch.Tensor
    new_pair: torch.Tensor
    row_start: torch.Tensor
    pair_start: torch.Tensor


@dataclass(frozen=True)
class RowPlan:
    """Where ``N`` (lookup, row) entries' columns lie in one kind of storage.

    ``parts`` holds, per buffer, ``(buffer, flat offsets, positions)``: the offsets of the
    entries' valid columns in that buffer and their positions in the ``[N * columns]``
    values (None: every position, in order). ``shape`` is ``(N, columns)``.
    """

    parts: tuple[tuple[int, torch.Tensor, torch.Tensor | None], ...]
    shape: tuple[int, int]


@dataclass(frozen=True)
class InPlaceRows:
    """Where each lookup's rows lie in the fused kernel's float32 buffers on the CPU.

    Lookup ``l``'s row ``r`` is the ``columns[l]`` floats from address ``origin[l]`` plus ``r *
    row_stride[l]`` floats (``[L]`` int64 each); ``buffers`` holds the buffers alive.
    """

    origin: np.ndarray
    row_stride: np.ndarray
    columns: np.ndarray
    buffers: tuple[torch.Tensor, ...]

    def read(self, lib: ctypes.CDLL, lookup: np.ndarray, rows: np.ndarray,
             width: int) -> np.ndarray:
        """``[N, width]`` float32: the rows' columns (0 beyond a lookup's own)."""
        lookup, rows = np.ascontiguousarray(lookup), np.ascontiguousarray(rows)
        out = np.empty((len(rows), width), dtype=np.float32)
        lib.odl_rows_read(len(rows), width, _ptr(lookup), _ptr(rows), _ptr(self.origin),
                          _ptr(self.row_stride), _ptr(self.columns), _ptr(out))
        return out

    def write(self, lib: ctypes.CDLL, lookup: np.ndarray, rows: np.ndarray,
              values: np.ndarray, add: bool) -> None:
        """Adds (``add``) or writes ``[N, width]`` ``values`` at distinct (table, row)s."""
        lookup, rows = np.ascontiguousarray(lookup), np.ascontiguousarray(rows)
        values = np.ascontiguousarray(values, dtype=np.float32)
        lib.odl_rows_write(len(rows), values.shape[1], _ptr(lookup), _ptr(rows),
                           _ptr(self.origin), _ptr(self.row_stride), _ptr(self.columns),
                           _ptr(values), int(add))


class _FlatStorage:
    """Each lookup's rows of one kind of tensor (weights, accumulators) in flat buffers."""

    def __init__(self, tensors: Sequence[torch.Tensor], row_strides: Sequence[int]) -> None:
        storages: dict[int, int] = {}
        self.flat: list[torch.Tensor] = []
        self.storage = torch.zeros(len(tensors), dtype=torch.long)
        self.base = torch.zeros(len(tensors), dtype=torch.long)
        self.row_stride = torch.tensor([int(s) for s in row_strides], dtype=torch.long)
        for k, t in enumerate(tensors):
            if t.dim() > 1 and t.stride(-1) != 1:
                raise ValueError(f"unexpected table layout {tuple(t.stride())}")
            ptr = t.untyped_storage().data_ptr()
            if ptr not in storages:
                storages[ptr] = len(self.flat)
                n = t.untyped_storage().nbytes() // t.element_size()
                self.flat.append(t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,)))
            self.storage[k] = storages[ptr]
            self.base[k] = t.storage_offset()

    def in_place(self, columns: Sequence[int]) -> InPlaceRows | None:
        """The lookups' rows addressed for ``row_pairs.c`` (None: not float32 on the CPU).

        Args:
            columns: per lookup, the columns of a row it reads or writes.
        """
        if any(f.device.type != "cpu" or f.dtype != torch.float32 for f in self.flat):
            return None
        size = self.flat[0].element_size()
        origin = [self.flat[s].data_ptr() + b * size
                  for s, b in zip(self.storage.tolist(), self.base.tolist(), strict=True)]
        return InPlaceRows(np.array(origin, dtype=np.int64),
                           self.row_stride.cpu().numpy().astype(np.int64),
                           np.array(columns, dtype=np.int64), tuple(self.flat))

    def to(self, device: torch.device) -> None:
        for name in ("storage", "base", "row_stride"):
            setattr(self, name, getattr(self, name).to(device))

    def plan(self, lookup: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor | None,
             mask: torch.Tensor | None) -> RowPlan:
        """Plans ``lookup[i]``'s row ``rows[i]``.

        Its columns ``cols`` (None: one value per row), those where ``mask`` (``[N,
        columns]``; None: all) is true.
        """
        start = self.base.index_select(0, lookup) + rows * self.row_stride.index_select(
            0, lookup)
        idx = start.unsqueeze(1) if cols is None else start.unsqueeze(1) + cols
        shape = (int(idx.shape[0]), int(idx.shape[1]))
        flat_idx = idx.reshape(-1)
        if len(self.flat) == 1 and mask is None:
            return RowPlan(((0, flat_idx, None),), shape)
        keep = (mask.reshape(-1) if mask is not None
                else torch.ones(flat_idx.shape, dtype=torch.bool, device=idx.device))
        parts = []
        if len(self.flat) == 1:
            pos = keep.nonzero().flatten()
            parts.append((0, flat_idx.index_select(0, pos), pos))
        else:
            owner = self.storage.index_select(0, lookup).unsqueeze(1).expand(shape).reshape(-1)
            for k in range(len(self.flat)):
                pos = (keep & (owner == k)).nonzero().flatten()
                parts.append((k, flat_idx.index_select(0, pos), pos))
        return RowPlan(tuple(parts), shape)

    def gather(self, plan: RowPlan) -> torch.Tensor:
        """``[N, columns]``: the planned elements (0 where not planned)."""
        n, c = plan.shape
        if len(plan.parts) == 1 and plan.parts[0][2] is None:
            k, off, _ = plan.parts[0]
            return self.flat[k].index_select(0, off).view(n, c)
        out = torch.zeros(n * c, dtype=self.flat[0].dtype, device=self.flat[0].device)
        for k, off, pos in plan.parts:
            out.index_copy_(0, pos, self.flat[k].index_select(0, off))
        return out.view(n, c)

    def write(self, plan: RowPlan, values: torch.Tensor, add: bool) -> None:
        """Adds (``add``) or writes ``[N, columns]`` ``values`` at the planned elements.

        The planned rows must be distinct.
        """
        flat_values = values.reshape(-1)
        for k, off, pos in plan.parts:
            v = flat_values if pos is None else flat_values.index_select(0, pos)
            if add:
                self.flat[k].index_add_(0, off, v.to(self.flat[k].dtype))
            else:
                self.flat[k].index_copy_(0, off, v.to(self.flat[k].dtype))


class RowPairIndex:
    """Builds a step's ``RowPairs`` and reads / writes the rows they name.

    Args:
        pooled_layout: the model's ``pooled_layout``.
        tables: TorchRec table name -> ``TableRows``, for every table a lookup reads.
        rowwise: the accumulators are row-wise (one value per row).

    Raises:
        ValueError: a lookup's table is missing, or a table's layout is not addressable.
    """

    def __init__(self, pooled_layout: Sequence[PooledGroup], tables: Mapping[str, TableRows],
                 rowwise: bool = False) -> None:
        names = sorted({t for g in pooled_layout for _, t in g.lookups})
        missing = [t for t in names if t not in tables]
        if missing:
            raise ValueError(f"no table rows for {missing}")
        self.rowwise = rowwise
        self.features: list[str] = []  # per lookup
        self.tables: list[TableRows] = []  # per lookup
        self.dims: list[int] = []  # per lookup
        table_index: list[int] = []
        columns: list[int] = []  # per lookup, its first column in the groups' concatenation
        start = 0
        for group in pooled_layout:
            column = start
            for (feature, table), dim in zip(group.lookups, group.dims, strict=True):
                self.features.append(feature)
                self.tables.append(tables[table])
                self.dims.append(dim)
                table_index.append(names.index(table))
                columns.append(column)
                column += dim
            start += group.width
        self.width = max(self.dims, default=0)
        self.group_widths = [g.width for g in pooled_layout]
        # [L * width] columns of the concatenated groups, padding -> the zero column `start`
        self._gather = torch.tensor(
            [c + j if j < d else start for c, d in zip(columns, self.dims, strict=True)
             for j in range(self.width)], dtype=torch.long)
        self._table_key = torch.tensor(table_index, dtype=torch.long) * ROW_SPAN
        # the same on the CPU, for the step's reads of every rank (``row_keys``, ``jacobian_rows``)
        self._table_of_lookup = np.array(table_index, dtype=np.int64)
        self._cpu_gather = self._gather.clone()
        self.columns = start  # the groups' columns side by side
        self._mean = torch.tensor([t.mean_pooling for t in self.tables])
        self._any_mean = bool(self._mean.any())
        self.multiplier = torch.tensor([t.lr_multiplier for t in self.tables])
        self.stored = torch.tensor([float(t.stored_columns) for t in self.tables])
        self._key_order: tuple[tuple[str, ...], list[int]] | None = None
        # for row_pairs.c: the key order's lookups' keys and the lookups' mean pooling
        self._native_lookups: tuple[list[int], np.ndarray, np.ndarray] | None = None
        self._cols = torch.arange(self.width)
        self.col_mask = torch.tensor([[j < d for j in range(self.width)] for d in self.dims])
        # per lookup, on the CPU: its rate multiplier, its table's stored columns, its width
        self.lookup_multiplier = self.multiplier.numpy().astype(np.float32)
        self.lookup_stored = self.stored.numpy().astype(np.float32)
        self.lookup_width = np.array(self.dims, dtype=np.int64)
        self.lookup_first = np.array(columns, dtype=np.int64)  # its first column of the groups
        # per lookup, its columns of the groups side by side ([L, width]; padding: `columns`)
        self.lookup_columns = self._gather.numpy().reshape(len(self.dims), self.width).copy()
        self._states: _FlatStorage | None = None
        self._weights: _FlatStorage | None = None
        if self.tables and all(t.state is not None for t in self.tables):
            self._states = _FlatStorage(
                [t.state for t in self.tables],
                [t.state.stride(0) if t.state.dim() > 1 else 1 if rowwise else t.stored_columns
                 for t in self.tables])
        if self.tables and all(t.weight is not None for t in self.tables):
            self._weights = _FlatStorage([t.weight for t in self.tables],
                                         [t.weight.stride(0) for t in self.tables])
        self._device = torch.device("cpu")

    def set_multiplier(self, lookups: np.ndarray, value: float) -> None:
        """Sets the rate multiplier of the lookups where ``lookups`` (``[L]`` bool) is true."""
        self.lookup_multiplier[lookups] = value
        self.multiplier[torch.from_numpy(lookups).to(self.multiplier.device)] = value

    def on(self, device: torch.device) -> None:
        """Moves the index tensors to ``device`` (once)."""
        if self._device == device:
            return
        for name in ("_gather", "_table_key", "_mean", "multiplier", "stored", "_cols",
                     "col_mask"):
            setattr(self, name, getattr(self, name).to(device))
        for store in (self._states, self._weights):
            if store is not None:
                store.to(device)
        self._device = device

    def pairs(self, kjt: KeyedJaggedTensor, b: int, dtype: torch.dtype) -> RowPairs | None:
        """The step's pairs (module docstring), or None when its lookups read nothing."""
        device = kjt.values().device
        self.on(device)
        keys = tuple(kjt.keys())
        if self._key_order is None or self._key_order[0] != keys:
            index = {k: i for i, k in enumerate(keys)}
            self._key_order = (keys, [index.get(f, -1) for f in self.features])
        kidx = self._key_order[1]
        offsets = kjt.offset_per_key()
        lookups = [lk for lk, k in enumerate(kidx) if k >= 0 and offsets[k + 1] > offsets[k]]
        if not lookups:
            return None
        counts = [offsets[kidx[lk] + 1] - offsets[kidx[lk]] for lk in lookups]
        total = sum(counts)
        lib = native_kernels.library() if device.type == "cpu" else None
        if lib is not None:
            return self._native_pairs(lib, kjt, b, dtype, kidx, int(total))
        lk_t = torch.tensor(lookups, dtype=torch.long, device=device)
        firsts = torch.tensor([offsets[kidx[lk]] for lk in lookups], dtype=torch.long,
                              device=device)
        bases = torch.tensor([0, *itertools.accumulate(counts)][:-1], dtype=torch.long,
                             device=device)
        which = torch.repeat_interleave(torch.arange(len(lookups), device=device),
                                        torch.tensor(counts, device=device), output_size=total)
        pos = torch.arange(total, device=device) - (bases - firsts).index_select(0, which)
        lookup = lk_t.index_select(0, which)
        lengths = kjt.lengths()
        record_of_value = torch.repeat_interleave(
            torch.arange(b, device=device).repeat(len(keys)), lengths,
            output_size=int(offsets[-1]))
        sample = record_of_value.index_select(0, pos)
        rows = kjt.values().index_select(0, pos).long()
        weight = torch.ones(total, dtype=dtype, device=device)
        if self._any_mean:
            kt = torch.tensor(kidx, dtype=torch.long, device=device).index_select(0, lookup)
            n = lengths.index_select(0, kt * b + sample).clamp(min=1).to(dtype)
            weight = torch.where(self._mean.index_select(0, lookup), 1.0 / n, weight)
        if kjt.weights_or_none() is not None:
            weight = weight * kjt.weights().index_select(0, pos).to(dtype)
        # order the pairs by (table row, record): a row's earlier records first
        key = rows + self._table_key.index_select(0, lookup)
        order = argsort(key * (b + 1) + sample)
        key, sample = key.index_select(0, order), sample.index_select(0, order)
        new_row = torch.ones(total, dtype=torch.bool, device=device)
        new_row[1:] = key[1:] != key[:-1]
        new_pair = new_row.clone()
        new_pair[1:] |= sample[1:] != sample[:-1]
        at = torch.arange(total, device=device)
        return RowPairs(
            b=b, rows=rows.index_select(0, order), lookup=lookup.index_select(0, order),
            sample=sample, weight=weight.index_select(0, order), new_row=new_row,
            new_pair=new_pair,
            row_start=torch.cummax(torch.where(new_row, at, 0), 0).values,
            pair_start=torch.cummax(torch.where(new_pair, at, 0), 0).values)

    def _native_pairs(self, lib: ctypes.CDLL, kjt: KeyedJaggedTensor, b: int,
                      dtype: torch.dtype, kidx: list[int], total: int) -> RowPairs:
        """``pairs`` on the CPU in two calls of ``row_pairs.c`` around numpy's sort."""
        if self._native_lookups is None or self._native_lookups[0] != kidx:
            self._native_lookups = (kidx, np.array(kidx, dtype=np.int64),
                                    self._mean.cpu().numpy().astype(np.uint8))
        _, key_of_lookup, mean = self._native_lookups
        offsets = np.asarray(kjt.offset_per_key(), dtype=np.int64)
        lengths = np.ascontiguousarray(kjt.lengths().to(torch.int64).numpy())
        values = np.ascontiguousarray(kjt.values().to(torch.int64).numpy())
        value_weights = kjt.weights_or_none()
        vw = (np.ascontiguousarray(value_weights.detach().to(torch.float32).numpy())
              if value_weights is not None else None)
        unsorted = [np.empty(total, dtype=np.int64) for _ in range(3)]
        weight_in = np.empty(total, dtype=np.float32)
        sort_key = np.empty(total, dtype=np.int64)
        written = lib.odl_row_pair_reads(
            b, len(kidx), _ptr(key_of_lookup), _ptr(self._table_of_lookup), _ptr(mean),
            _ptr(offsets), _ptr(lengths), _ptr(values), _ptr(vw) if vw is not None else None,
            *(_ptr(a) for a in unsorted), _ptr(weight_in), _ptr(sort_key))
        assert written == total, (written, total)
        order = np.argsort(sort_key)
        lookup, sample, rows = (np.empty(total, dtype=np.int64) for _ in range(3))
        weight = np.empty(total, dtype=np.float32)
        new_row, new_pair = np.empty(total, dtype=np.bool_), np.empty(total, dtype=np.bool_)
        row_start, pair_start = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
        lib.odl_row_pair_sorted(total, b, _ptr(order), *(_ptr(a) for a in unsorted),
                                _ptr(weight_in), _ptr(sort_key), _ptr(lookup), _ptr(sample),
                                _ptr(rows), _ptr(weight), _ptr(new_row), _ptr(new_pair),
                                _ptr(row_start), _ptr(pair_start))
        t = torch.from_numpy
        return RowPairs(b=b, rows=t(rows), lookup=t(lookup), sample=t(sample),
                        weight=t(weight).to(dtype), new_row=t(new_row), new_pair=t(new_pair),
                        row_start=t(row_start), pair_start=t(pair_start))

    def per_pair(self, groups: Sequence[torch.Tensor | None], pairs: RowPairs,
                 dtype: torch.dtype) -> torch.Tensor:
        """``[P, width]``: each pair's lookup columns of its record in ``groups``.

        ``groups`` holds one ``[>= B, group width]`` tensor per ``pooled_layout`` group (None:
        zeros).
        """
        b = pairs.b
        cat = self.side_by_side(groups, b, dtype, pairs.rows.device, zero_column=True)
        per_lookup = cat.index_select(1, self._gather).view(-1, self.width)  # [B * L, width]
        return per_lookup.index_select(0, pairs.sample * len(self.features) + pairs.lookup)

    def side_by_side(self, groups: Sequence[torch.Tensor | None], b: int, dtype: torch.dtype,
                     device: torch.device, zero_column: bool = False) -> torch.Tensor:
        """``[b, columns]``: the first ``b`` rows of each group's tensor side by side.

        ``groups`` holds one ``[>= b, group width]`` tensor per ``pooled_layout`` group (None:
        zeros); ``zero_column`` appends one zero column (the padding the lookups' column
        maps point at).
        """
        parts = [g[:b].to(dtype) if g is not None
                 else torch.zeros(b, w, dtype=dtype, device=device)
                 for g, w in zip(groups, self.group_widths, strict=True)]
        if zero_column:
            parts.append(torch.zeros(b, 1, dtype=dtype, device=device))
        return torch.cat(parts, dim=1)

    def row_keys(self, lookup: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Each (lookup, row)'s table row as one int64 (the order ``pairs`` sorts by)."""
        return self._table_of_lookup[lookup] * ROW_SPAN + rows

    def jacobian_rows(self, jac: np.ndarray, sample: np.ndarray,
                      lookup: np.ndarray) -> torch.Tensor:
        """``[K, width]``: ``per_pair`` of the reads ``(sample[k], lookup[k])`` on the CPU.

        Args:
            jac: ``[N, columns]`` the pooled groups' columns side by side, per record.
            sample: ``[K]`` each read's record.
            lookup: ``[K]`` each read's lookup.
        """
        t = torch.from_numpy(jac)
        cat = torch.cat([t, t.new_zeros(t.shape[0], 1)], dim=1)
        per_lookup = cat.index_select(1, self._cpu_gather).view(-1, self.width)
        return per_lookup.index_select(0, torch.from_numpy(sample * len(self.features)
                                                           + lookup))

    def rows_in_place(self) -> tuple[InPlaceRows, InPlaceRows] | None:
        """The accumulators' and weights' rows for ``row_pairs.c``.

        None where they are not addressable, or not float32 on the CPU.
        """
        if self._states is None or self._weights is None:
            return None
        states = self._states.in_place([1] * len(self.dims) if self.rowwise else self.dims)
        weights = self._weights.in_place(self.dims)
        return (states, weights) if states is not None and weights is not None else None

    def plan_accumulators(self, lookup: torch.Tensor, rows: torch.Tensor) -> RowPlan:
        """Where (lookup, row)s' accumulators lie.

        ``[N, 1]`` row-wise, else ``[N, width]`` (the columns beyond the lookup's width not
        planned).
        """
        if self._states is None:
            raise ValueError("these tables have no accumulator")
        if self.rowwise:
            return self._states.plan(lookup, rows, None, None)
        return self._states.plan(lookup, rows, self._cols, self.col_mask.index_select(0, lookup))

    def plan_weights(self, lookup: torch.Tensor, rows: torch.Tensor) -> RowPlan:
        """Where (lookup, row)s' weights lie: ``[N, width]`` (the lookup's columns)."""
        if self._weights is None:
            raise ValueError("these tables' weights are not addressable")
        return self._weights.plan(lookup, rows, self._cols, self.col_mask.index_select(0, lookup))

    def accumulators(self, plan: RowPlan, dtype: torch.dtype) -> torch.Tensor:
        """The planned accumulators (``plan_accumulators``), 0 beyond a lookup's width."""
        assert self._states is not None
        return self._states.gather(plan).to(dtype)

    def set_accumulators(self, plan: RowPlan, values: torch.Tensor) -> None:
        """Writes the planned accumulators of distinct (table, row)s."""
        assert self._states is not None
        self._states.write(plan, values, add=False)

    def add_to_weights(self, plan: RowPlan, delta: torch.Tensor) -> None:
        """Adds ``[N, width]`` ``delta`` to the planned weights of distinct (table, row)s."""
        assert self._weights is not None
        self._weights.write(plan, delta, add=True)


# Row ids stay below 2**31 (odl.config.limits.MAX_TABLE_ROWS): a table index times this span
# plus a row is unique per table row; times (batch + 1) plus the record, the sort key fits
# int64 while tables x (batch + 1) < 2**31.
ROW_SPAN = 1 << 32
