"""Per-record Adagrad accumulators: a batch's records count one by one in a row's accumulator.

Adagrad scales a row's step by the root of its accumulated squared gradients. The fused
kernel accumulates the *batch's* gradient of a row, ``S**2`` with ``S = sum_j g_j`` over the
records ``j`` that read it, and steps ``-lr * S / (sqrt(G + S**2) + eps)``: however many
records of the batch read the row, it moves by at most ``lr`` per column, as it would for one
record. A per-sample learner takes one step per record. On a bursty stream (a new user's or
item's burst of events lands in one batch) that makes a batch learn a new id's first events
several times more slowly than a per-sample learner does.

Contract (``PerRecordAdagrad.apply``), for every table row ``r`` read by at least two records
of a step through the model's pooled lookups (``odl.train.in_batch.batch_row_pairs``), ``g_j`` the
gradient the step's loss puts on ``r`` through record ``j``'s reads (the record's pooled
gradient times each read's weight, summed over the record's reads of ``r``), ``S = sum_j
g_j``, ``G`` its accumulator before the step and ``c`` the largest gain
(``train_config.per_record_adagrad_max_gain``):

* Adagrad (element-wise): ``Q = max(sum_j g_j**2, S**2 / c**2)``;
* row-wise Adagrad: ``Q = max(sum_j sum(g_j**2), sum(S**2) / c**2) / stored_columns``;
* ``G <- G + Q`` and the row moves by ``-lr * S / (sqrt(G + Q) + eps)``.

``lr`` is the table's rate of the step (``wide_learning_rate_multiplier`` applied to wide
tables). A row read by one record, and every row of a one-record batch, are left as the
fused kernel made them (``sum_j g_j**2 = S**2`` there). For ``k`` records with the same
gradient and ``G = 0`` the row moves ``min(sqrt(k), c)`` times as far as the fused step
(per-sample Adagrad would move it about ``2 * sqrt(k)`` times as far, correcting itself after
each record; the batch cannot, so ``c`` bounds the overshoot of a row that a whole batch
reads, such as a device's or an hour's, while the accumulators are still small). Where the
records' gradients cancel (a frequent row near its optimum) the accumulator grows more than
the fused kernel's and the row moves less.

The rule is applied after the fused backward as a correction of the rows the kernel
updated: their weights get ``-lr * S * (1 / (sqrt(G + Q) + eps) - 1 / (sqrt(G + S**2) +
eps))`` added (row-wise: ``sum(S**2) / stored_columns`` for ``S**2``) and their accumulators
are set to ``G + Q``. The records' gradients come from hooks on the pooled groups during
that backward (they include the loss's embedding regularization), so ``S`` is the gradient
the kernel applied.

It is meant to run with in-batch learning (``odl.train.in_batch.in_batch_learning``), whose errors
already account for the batch's earlier records; validation refuses it alone, which the
bench found to overshoot (``docs/benchmarks.md``).

With several ranks ``odl.train.in_batch.rank_per_record`` applies the same rule, each shared row
corrected by the rank holding it.

Not covered: SGD tables (a batched SGD step already is the sum of per-record steps) and
other optimizers; rows that the model reads outside its pooled lookups keep the fused update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from odl.config.optimizer_support import PER_RECORD_TABLE_KINDS
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs, RowPlan


def hook_pooled_gradients(pooled: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Hooks the pooled groups; the backward leaves their gradients in the returned list.

    Args:
        pooled: the step's pooled groups (``ModelOutput.pooled``).

    Returns:
        One slot per group, filled with its gradient by the backward (None: no gradient).
    """
    grads: list[torch.Tensor | None] = [None] * len(pooled)

    def keep(k: int):
        def hook(grad: torch.Tensor) -> None:
            grads[k] = grad
        return hook

    for k, t in enumerate(pooled):
        if t.requires_grad:
            t.register_hook(keep(k))
    return grads


class PerRecordAdagrad:
    """Applies the module docstring's accumulator rule after each step's fused backward.

    Args:
        index: the model's ``RowPairIndex`` (weights and accumulators addressable).
        kind: the table kernel, one of ``PER_RECORD_TABLE_KINDS``.
        eps: the fused kernel's epsilon.
        max_gain: the most a row's step may exceed the fused step (``c`` in the module
            docstring, at least 1).

    Raises:
        ValueError: ``kind`` is not one of ``PER_RECORD_TABLE_KINDS``, or ``max_gain`` < 1.
    """

    def __init__(self, index: RowPairIndex, kind: str, eps: float,
                 max_gain: float = 3.0) -> None:
        if kind not in PER_RECORD_TABLE_KINDS:
            raise ValueError(f"per-record accumulators apply to {PER_RECORD_TABLE_KINDS} "
                             f"tables, not {kind!r}")
        if not max_gain >= 1:
            raise ValueError(f"max_gain must be at least 1, got {max_gain}")
        self._floor = 1.0 / float(max_gain) ** 2
        self.kind = kind
        self.eps = float(eps)
        self._index = index

    def before_backward(self, pairs: RowPairs | None,
                        pooled: Sequence[torch.Tensor]) -> _Pending | None:
        """Reads the shared rows' accumulators and hooks the pooled groups.

        The shared rows are those that two or more records read; the backward leaves the
        pooled groups' gradients in the result.

        Args:
            pairs: the step's row reads (as the step's forward read them); None: nothing.
            pooled: the step's pooled groups (``ModelOutput.pooled``).

        Returns:
            What ``apply`` needs after the backward, or None when no row is shared.
        """
        if pairs is None or pairs.b < 2:
            return None
        index = self._index
        run = torch.cumsum(pairs.new_pair.long(), 0) - 1  # (row, record) run of each pair
        row_seg = torch.cumsum(pairs.new_row.long(), 0) - 1
        first_pair = pairs.new_pair.nonzero().flatten()
        row_of_run = row_seg.index_select(0, first_pair)
        shared = (torch.bincount(row_of_run) > 1).nonzero().flatten()
        if shared.numel() == 0:
            return None
        starts = pairs.new_row.nonzero().flatten().index_select(0, shared)
        lookup = pairs.lookup.index_select(0, starts)
        rows = pairs.rows.index_select(0, starts)
        dtype = pooled[0].dtype if pooled else torch.float32
        with torch.no_grad():
            states = index.plan_accumulators(lookup, rows)
            acc = index.accumulators(states, dtype)
            weights = index.plan_weights(lookup, rows)
        grads = hook_pooled_gradients(pooled)
        return _Pending(pairs, grads, run, row_of_run, shared, lookup, states, weights, acc)

    @torch.no_grad()
    def apply(self, pending: _Pending | None, lr: float) -> int:
        """Corrects the shared rows the step's fused update wrote (module docstring).

        Args:
            pending: ``before_backward``'s result, after the backward.
            lr: the table rate of this step.

        Returns:
            The number of rows corrected (read by two or more records).
        """
        if pending is None or all(g is None for g in pending.grads):
            return 0
        index = self._index
        pairs = pending.pairs
        acc = pending.acc
        dtype = acc.dtype
        grads = pairs.weight.to(dtype).unsqueeze(1) * index.per_pair(pending.grads, pairs, dtype)
        runs = int(pending.run[-1]) + 1
        per_record = (grads if runs == grads.shape[0]  # no record reads a row twice
                      else grads.new_zeros(runs, index.width).index_add_(0, pending.run, grads))
        squares = per_record * per_record
        if self.kind == "rowwise_adagrad":
            squares = squares.sum(1, keepdim=True)
        nrows = int(pending.row_of_run[-1]) + 1
        width = index.width
        sums = grads.new_zeros(nrows, width + squares.shape[1]).index_add_(
            0, pending.row_of_run, torch.cat([per_record, squares], 1)).index_select(
            0, pending.shared)
        total, q = sums[:, :width], sums[:, width:]
        lookup = pending.lookup
        if self.kind == "rowwise_adagrad":
            stored = index.stored.index_select(0, lookup).unsqueeze(1)
            fused = (total * total).sum(1, keepdim=True) / stored
            q = q / stored
        else:
            fused = total * total
        q = torch.maximum(q, fused * self._floor)  # at most max_gain times the fused step
        rate = (lr * index.multiplier.index_select(0, lookup)).to(dtype).unsqueeze(1)
        delta = rate * total * ((acc + fused).sqrt_().add_(self.eps).reciprocal_()
                                - (acc + q).sqrt_().add_(self.eps).reciprocal_())
        index.add_to_weights(pending.weights, delta)
        index.set_accumulators(pending.states, acc + q)
        return int(pending.shared.shape[0])


@dataclass
class _Pending:
    """A step's shared rows between ``before_backward`` and ``apply``."""

    pairs: RowPairs
    grads: list[torch.Tensor | None]  # the pooled groups' gradients, filled by the backward
    run: torch.Tensor  # [P] each pair's (row, record) run
    row_of_run: torch.Tensor  # [runs] each run's row (index among the step's rows)
    shared: torch.Tensor  # indices of the rows two or more records read
    lookup: torch.Tensor  # [shared] a lookup reading the row
    states: RowPlan  # where the rows' accumulators lie
    weights: RowPlan  # where the rows' weights lie
    acc: torch.Tensor  # [shared, 1 | width] their accumulators before the step
