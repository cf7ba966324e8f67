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

Which errors the earlier records step with: by default their errors at the batch's starting
state (``dloss`` above, one batched pass). With ``train_config.in_batch_sequential`` they are
their own shifted predictions' errors, found in one pass over the records in order
(``odl.train.in_batch.in_batch_scan``, whose docstring states that variant).

Not covered (the logit is not shifted by them): sequence lookups that are not pooled
(target attention's items), dense parameters, and second-order terms. Batch norm in the
dense part couples records; the shift then uses its train-mode Jacobian as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from odl.config.optimizer_support import IN_BATCH_TABLE_KINDS
from odl.models.ctr_model import ModelOutput
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs
from odl.train.in_batch.in_batch_scan import InBatchScan, ScanPairs, record_order, scan_pairs


class InBatchLearning:
    """Computes the logit shift of the module docstring for every step of one model.

    Args:
        index: the model's ``RowPairIndex`` (its tables' accumulators for Adagrad kinds).
        kind: the table kernel, one of ``IN_BATCH_TABLE_KINDS``.
        eps: the fused kernel's epsilon.
        sequential: the pass of ``odl.train.in_batch.in_batch_scan``
            (``in_batch_sequential``); None: the earlier records' errors at the batch's
            starting state.

    Raises:
        ValueError: ``kind`` is not one of ``IN_BATCH_TABLE_KINDS``.
    """

    def __init__(self, index: RowPairIndex, kind: str, eps: float,
                 sequential: InBatchScan | None = None) -> None:
        if kind not in IN_BATCH_TABLE_KINDS:
            raise ValueError(f"in-batch learning supports {IN_BATCH_TABLE_KINDS} tables, not "
                             f"{kind!r}")
        self.kind = kind
        self.eps = float(eps)
        self._index = index
        self.sequential = sequential

    def logit_shift(self, pairs: RowPairs | None, output: ModelOutput,
                    loss: torch.Tensor | None, lr: float,
                    loss_at: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> torch.Tensor:
        """The ``[B]`` shift of ``output.logits`` (module docstring); no gradient flows.

        Args:
            pairs: the step's row reads (``RowPairIndex.pairs`` of the batch's ids, after any
                dynamic-table remap); None: nothing read.
            output: the step's forward output (logits ``[B]``, pooled groups in the graph).
            loss: the step's loss on ``output`` (its graph is kept for the backward); the
                sequential pass does not need it (None).
            lr: the table rate of this step.
            loss_at: the step's loss at given ``[B]`` logits; needed when ``sequential``.

        Returns:
            Float tensor ``[B]`` on the logits' device.
        """
        logits = output.logits
        b = logits.shape[0]
        shift = torch.zeros(b, dtype=logits.dtype, device=logits.device)
        if pairs is None or b < 2:
            return shift
        jac = torch.autograd.grad(logits.sum(), output.pooled, retain_graph=True,
                                  allow_unused=True)
        if self.sequential is not None:
            if loss_at is None:
                raise ValueError("in_batch_sequential needs the loss at given logits")
            with torch.no_grad():
                prepared = self._scan_pairs(pairs, jac, lr, logits.dtype)
            return self.sequential.shift(prepared, logits.detach(), loss_at)
        if loss is None:
            raise ValueError("the batched shift needs the step's loss")
        (dloss,) = torch.autograd.grad(loss, logits, retain_graph=True)
        with torch.no_grad():
            return self._shift(pairs, dloss.detach(), jac, lr, shift)

    def _scan_pairs(self, pairs: RowPairs, jac: Sequence[torch.Tensor | None], lr: float,
                    dtype: torch.dtype) -> ScanPairs:
        """The pass's inputs.

        Only the pairs of rows that two or more records read: a row that one record reads
        shifts nothing.
        """
        slot = torch.cumsum(pairs.new_row.long(), 0) - 1
        readers = torch.zeros(int(slot[-1]) + 1, dtype=torch.long, device=slot.device)
        readers.index_add_(0, slot, pairs.new_pair.long())
        keep = (readers.index_select(0, slot) > 1).nonzero().flatten()
        first = pairs.new_row.index_select(0, keep)
        slot = torch.cumsum(first.long(), 0) - 1  # the kept rows, numbered
        index = self._index
        heads = keep.index_select(0, first.nonzero().flatten())  # each kept row's first pair
        lookup, rows = pairs.lookup.index_select(0, heads), pairs.rows.index_select(0, heads)
        acc = None
        if self.kind != "sgd":
            acc = index.accumulators(index.plan_accumulators(lookup, rows), dtype)
        # the pairs in the pass's (record, row) order, so that it reads them in sequence
        order = record_order(pairs.sample.index_select(0, keep), slot)
        keep, slot = keep.index_select(0, order), slot.index_select(0, order)
        shared = replace(pairs, **{f: getattr(pairs, f).index_select(0, keep) for f in (
            "lookup", "sample", "weight")})
        return scan_pairs(shared.sample, slot, index.per_pair(jac, shared, dtype),
                          shared.weight, lr * index.multiplier.index_select(0, lookup), acc,
                          index.stored.index_select(0, lookup),
                          index.col_mask.sum(1).index_select(0, lookup), in_record_order=True)

    def _shift(self, pairs: RowPairs, dloss: torch.Tensor,
               jac: Sequence[torch.Tensor | None], lr: float,
               shift: torch.Tensor) -> torch.Tensor:
        index = self._index
        dtype = shift.dtype
        lookup, sample, weight = pairs.lookup, pairs.sample, pairs.weight
        jrow = index.per_pair(jac, pairs, dtype)  # [P, width]
        grads = (weight * dloss.index_select(0, sample)).unsqueeze(1) * jrow
        cum = torch.cat([grads.new_zeros(1, index.width), torch.cumsum(grads, 0)])
        # S_r(i): the row's gradient from strictly earlier records
        earlier = (cum.index_select(0, pairs.pair_start)
                   - cum.index_select(0, pairs.row_start))
        rate = (lr * index.multiplier.index_select(0, lookup)).to(dtype).unsqueeze(1)
        if self.kind == "sgd":
            change = earlier.mul_(-rate)
        else:
            acc = index.accumulators(index.plan_accumulators(lookup, pairs.rows), dtype)
            if self.kind == "rowwise_adagrad":
                stored = index.stored.index_select(0, lookup).unsqueeze(1)
                acc.add_((earlier * earlier).sum(1, keepdim=True).div_(stored))
            else:
                acc.addcmul_(earlier, earlier)
            # -lr * S / sqrt(G + S**2), eps as the kernel's: (x + eps**2)**-0.5 differs from
            # 1 / (sqrt(x) + eps) by a relative eps / sqrt(x) where S != 0 (and is 0 at S = 0)
            change = earlier.mul_(acc.add_(self.eps * self.eps).rsqrt_()).mul_(-rate)
        return shift.index_add_(0, sample, weight * (jrow * change).sum(1))
