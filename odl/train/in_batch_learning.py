"""In-batch learning: each record of a batch predicted after its batch's earlier records.

A training step predicts a whole batch from the state before it, so on a bursty stream (one
user emitting many events within seconds) a record is predicted without anything learned
from the records just before it in the same batch, which a per-sample learner would have
used. ``train_config.in_batch_learning`` closes that part of the gap at the cost of a few
tensor operations per step, keeping the batch's speed.

Contract (``InBatchLearning.logit_shift``), for a model with one output. Let ``L`` be the
step's loss at the batch's starting state and, for record ``i`` and a table row ``r`` that
it reads, ``S_r(i)`` the gradient that ``L`` puts on row ``r`` from the records *before*
``i`` in the batch (strictly earlier positions; several lookups of a table, shared tables,
sum / mean pooling and per-value weights counted as the lookup counts them). ``D_r(i)`` is
the change one step of the table optimizer makes to row ``r`` from its current state when
its gradient is ``S_r(i)``:

* SGD: ``D = -lr * S``;
* Adagrad (element-wise): ``D = -lr * S / (sqrt(G + S**2) + eps)``, ``G`` the row's
  accumulator;
* row-wise Adagrad: ``D = -lr * S / (sqrt(G + sum(S**2) / stored_columns) + eps)``.

``lr`` is the table's current rate (``wide_learning_rate_multiplier`` applied to wide
tables) and ``eps`` the fused kernel's. Record ``i``'s logit is shifted by the first-order
change the rows it reads would make: ``sum over its lookups f of a_if * <dlogit_i/de_if,
D_r(i)>`` (``a_if`` the lookup's weight of the row). For a wide (first-order) lookup this is
exactly the logit after such a step; for an embedding read by the dense part it is the
first-order term. The dense parameters are not shifted.

``TrainModule.train_step`` then computes the loss on the shifted logits, so what the tables
and the dense part learn from record ``i`` is its error after the earlier records were
learned (per-sample learning, to first order, in one batched update), and reports the
shifted predictions (the progressive metrics). The state a step leaves, what checkpoints,
publishing and serving see, is the ordinary batched update with those errors: serving's
predictions (``TrainModule.predict``, ``odl-serve``) are not shifted.

Not covered (the logit is not shifted by them): sequence lookups that are not pooled
(target attention's items), dense parameters, and second-order terms. Batch norm in the
dense part couples records; the shift then uses its train-mode Jacobian as it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.optimizer_support import IN_BATCH_TABLE_KINDS
from odl.models.ctr_model import ModelOutput, PooledGroup


@dataclass(frozen=True)
class TableRows:
    """What the shift needs of one TorchRec table.

    Attributes:
        state: the table optimizer's accumulator (``[rows, stored_columns]`` or ``[rows *
            stored_columns]`` for Adagrad, ``[rows]`` for row-wise Adagrad; None for SGD).
        stored_columns: the table's stored width (``odl.models.embedding_tables``).
        mean_pooling: the table pools its ids by mean (each of n ids weighs 1/n).
        lr_multiplier: the table's rate relative to the table rate.
    """

    state: torch.Tensor | None
    stored_columns: int
    mean_pooling: bool
    lr_multiplier: float = 1.0


class InBatchLearning:
    """Computes the logit shift of the module docstring for every step of one model.

    Args:
        pooled_layout: the model's ``pooled_layout``.
        tables: TorchRec table name -> ``TableRows``, for every table a lookup reads.
        kind: the table kernel, one of ``IN_BATCH_TABLE_KINDS``.
        eps: the fused kernel's epsilon.

    Raises:
        ValueError: ``kind`` is not one of ``IN_BATCH_TABLE_KINDS``, or a lookup's table is
            missing.
    """

    def __init__(self, pooled_layout: Sequence[PooledGroup], tables: Mapping[str, TableRows],
                 kind: str, eps: float) -> None:
        if kind not in IN_BATCH_TABLE_KINDS:
            raise ValueError(f"in-batch learning supports {IN_BATCH_TABLE_KINDS} tables, not "
                             f"{kind!r}")
        self.kind = kind
        self.eps = float(eps)
        names = sorted({t for g in pooled_layout for _, t in g.lookups})
        missing = [t for t in names if t not in tables]
        if missing:
            raise ValueError(f"no table rows for {missing}")
        self._features: list[str] = []  # per lookup
        self._tables: list[TableRows] = []  # per lookup
        self._dims: list[int] = []  # per lookup
        table_index: list[int] = []
        columns: list[int] = []  # per lookup, its first column in the groups' concatenation
        start = 0
        for group in pooled_layout:
            column = start
            for (feature, table), dim in zip(group.lookups, group.dims, strict=True):
                self._features.append(feature)
                self._tables.append(tables[table])
                self._dims.append(dim)
                table_index.append(names.index(table))
                columns.append(column)
                column += dim
            start += group.width
        self.width = max(self._dims, default=0)
        # [L * width] columns of the concatenated groups, padding -> the zero column `start`
        self._gather = torch.tensor(
            [c + j if j < d else start for c, d in zip(columns, self._dims, strict=True)
             for j in range(self.width)], dtype=torch.long)
        self._table_key = torch.tensor(table_index, dtype=torch.long) * _ROW_SPAN
        self._mean = torch.tensor([t.mean_pooling for t in self._tables])
        self._any_mean = bool(self._mean.any())
        self._multiplier = torch.tensor([t.lr_multiplier for t in self._tables])
        self._stored = torch.tensor([float(t.stored_columns) for t in self._tables])
        self._key_order: tuple[tuple[str, ...], list[int]] | None = None
        self._cols = torch.arange(self.width)
        self._col_mask = torch.tensor([[j < d for j in range(self.width)] for d in self._dims])
        self._flat: list[torch.Tensor] = []
        self._storage = torch.zeros(len(self._dims), dtype=torch.long)
        self._base = torch.zeros(len(self._dims), dtype=torch.long)
        self._row_stride = torch.zeros(len(self._dims), dtype=torch.long)
        if kind != "sgd":
            self._index_accumulators()

    def _index_accumulators(self) -> None:
        """Each lookup's accumulator as (storage, offset, row stride).

        The accumulators of one fused kernel's tables share one buffer, so a step reads all
        pairs' accumulators in one gather per kernel.
        """
        rowwise = self.kind == "rowwise_adagrad"
        storages: dict[int, int] = {}
        for k, table in enumerate(self._tables):
            st = table.state
            if st is None:
                raise ValueError("an Adagrad table has no accumulator")
            if st.dim() > 1 and st.stride(-1) != 1:
                raise ValueError(f"unexpected accumulator layout {tuple(st.stride())}")
            ptr = st.untyped_storage().data_ptr()
            if ptr not in storages:
                storages[ptr] = len(self._flat)
                n = st.untyped_storage().nbytes() // st.element_size()
                self._flat.append(st.new_empty(0).set_(st.untyped_storage(), 0, (n,), (1,)))
            self._storage[k] = storages[ptr]
            self._base[k] = st.storage_offset()
            self._row_stride[k] = (st.stride(0) if st.dim() > 1
                                   else 1 if rowwise else table.stored_columns)

    def _on(self, device: torch.device) -> None:
        if self._gather.device != device:
            for name in ("_gather", "_table_key", "_mean", "_multiplier", "_stored", "_cols",
                         "_col_mask", "_storage", "_base", "_row_stride"):
                setattr(self, name, getattr(self, name).to(device))

    def logit_shift(self, batch_sparse: KeyedJaggedTensor, output: ModelOutput,
                    loss: torch.Tensor, lr: float) -> torch.Tensor:
        """The ``[B]`` shift of ``output.logits`` (module docstring); no gradient flows.

        Args:
            batch_sparse: the step's ids (the batch's KJT, after any dynamic-table remap).
            output: the step's forward output (logits ``[B]``, pooled groups in the graph).
            loss: the step's loss on ``output`` (its graph is kept for the backward).
            lr: the table rate of this step.

        Returns:
            Float tensor ``[B]`` on the logits' device.
        """
        logits = output.logits
        b = logits.shape[0]
        device = logits.device
        shift = torch.zeros(b, dtype=logits.dtype, device=device)
        if not self._features or b < 2:
            return shift
        self._on(device)
        (dloss,) = torch.autograd.grad(loss, logits, retain_graph=True)
        jac = torch.autograd.grad(logits.sum(), output.pooled, retain_graph=True,
                                  allow_unused=True)
        with torch.no_grad():
            return self._shift(batch_sparse, dloss.detach(), jac, lr, shift)

    def _shift(self, kjt: KeyedJaggedTensor, dloss: torch.Tensor,
               jac: Sequence[torch.Tensor | None], lr: float,
               shift: torch.Tensor) -> torch.Tensor:
        b = shift.shape[0]
        device = shift.device
        dtype = shift.dtype
        keys = tuple(kjt.keys())
        if self._key_order is None or self._key_order[0] != keys:
            index = {k: i for i, k in enumerate(keys)}
            self._key_order = (keys, [index.get(f, -1) for f in self._features])
        kidx = self._key_order[1]
        offsets = kjt.offset_per_key()
        lookups = [lk for lk, k in enumerate(kidx) if k >= 0 and offsets[k + 1] > offsets[k]]
        if not lookups:
            return shift
        counts = [offsets[kidx[lk] + 1] - offsets[kidx[lk]] for lk in lookups]
        total = sum(counts)
        # every pair (a lookup's read of a row for a record), lookup after lookup
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
        groups = [g if g is not None else shift.new_zeros(b, 0) for g in jac]
        cat = torch.cat([*(g.to(dtype) for g in groups), shift.new_zeros(b, 1)], dim=1)
        per_lookup = cat.index_select(1, self._gather).view(-1, self.width)  # [B * L, width]
        jrow = per_lookup.index_select(0, sample * len(self._features) + lookup)  # [P, width]
        weight = torch.ones(total, dtype=dtype, device=device)
        if self._any_mean:
            kt = torch.tensor(kidx, dtype=torch.long, device=device).index_select(0, lookup)
            n = lengths.index_select(0, kt * b + sample).clamp(min=1).to(dtype)
            weight = torch.where(self._mean.index_select(0, lookup), 1.0 / n, weight)
        if kjt.weights_or_none() is not None:
            weight = weight * kjt.weights().index_select(0, pos).to(dtype)
        # order the pairs by (table row, record): a row's earlier records first
        key = rows + self._table_key.index_select(0, lookup)
        order = torch.argsort(key * (b + 1) + sample)
        key, sample = key.index_select(0, order), sample.index_select(0, order)
        weight, jrow = weight.index_select(0, order), jrow.index_select(0, order)
        lookup = lookup.index_select(0, order)
        new_row = torch.ones(total, dtype=torch.bool, device=device)
        new_row[1:] = key[1:] != key[:-1]
        new_pair = new_row.clone()
        new_pair[1:] |= sample[1:] != sample[:-1]
        at = torch.arange(total, device=device)
        row_start = torch.cummax(torch.where(new_row, at, 0), 0).values
        pair_start = torch.cummax(torch.where(new_pair, at, 0), 0).values
        grads = (weight * dloss.index_select(0, sample)).unsqueeze(1) * jrow
        cum = torch.cat([grads.new_zeros(1, self.width), torch.cumsum(grads, 0)])
        # S_r(i): the row's gradient from strictly earlier records
        earlier = cum.index_select(0, pair_start) - cum.index_select(0, row_start)
        rate = (lr * self._multiplier.index_select(0, lookup)).to(dtype).unsqueeze(1)
        if self.kind == "sgd":
            change = earlier.mul_(-rate)
        else:
            acc = self._accumulators(lookup, rows.index_select(0, order), dtype)
            if self.kind == "rowwise_adagrad":
                stored = self._stored.index_select(0, lookup).unsqueeze(1)
                acc.add_((earlier * earlier).sum(1, keepdim=True).div_(stored))
            else:
                acc.addcmul_(earlier, earlier)
            # -lr * S / sqrt(G + S**2), eps as the kernel's: (x + eps**2)**-0.5 differs from
            # 1 / (sqrt(x) + eps) by a relative eps / sqrt(x) where S != 0 (and is 0 at S = 0)
            change = earlier.mul_(acc.add_(self.eps * self.eps).rsqrt_()).mul_(-rate)
        return shift.index_add_(0, sample, weight * (jrow * change).sum(1))

    def _accumulators(self, lookup: torch.Tensor, rows: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """Each pair's row accumulator: ``[P, 1]`` row-wise, else ``[P, width]`` (padding 0)."""
        start = (self._base.index_select(0, lookup)
                 + rows * self._row_stride.index_select(0, lookup))
        if self.kind == "rowwise_adagrad":
            idx, mask = start.unsqueeze(1), None
        else:
            mask = self._col_mask.index_select(0, lookup)
            idx = torch.where(mask, start.unsqueeze(1) + self._cols, 0)
        if len(self._flat) == 1:
            acc = self._flat[0].index_select(0, idx.view(-1)).view(idx.shape)
        else:
            storage = self._storage.index_select(0, lookup).unsqueeze(1)
            acc = torch.zeros(idx.shape, dtype=self._flat[0].dtype, device=idx.device)
            for k, flat in enumerate(self._flat):
                mine = storage == k
                got = flat.index_select(0, torch.where(mine, idx, 0).view(-1)).view(idx.shape)
                acc = torch.where(mine, got, acc)
        acc = acc.to(dtype)
        return acc * mask if mask is not None else acc


# Row ids stay below 2**31 (odl.config.limits.MAX_TABLE_ROWS): a table index times this span
# plus a row is unique per table row; times (batch + 1) plus the record, the sort key fits
# int64 while tables x (batch + 1) < 2**31.
_ROW_SPAN = 1 << 32
