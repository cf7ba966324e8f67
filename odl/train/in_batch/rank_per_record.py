"""Per-record Adagrad with several ranks: each shared row corrected by the rank holding it.

The rule is ``odl.train.in_batch.per_record_adagrad``'s, applied to the step's records of every rank
(the update one process makes on the ranks' records together). After the ranked step's
fused backward (a collective every rank calls):

1. each rank sums, per table row its records read, the gradient its records put on the row
   (``S_r``), the sum of its records' squared gradients (``Q_r``) and how many of its records
   read the row; the gradients are the pooled groups' (``odl.train.in_batch.per_record_adagrad.
   hook_pooled_gradients``) over the number of ranks, the share of TorchRec's averaged
   table update;
2. every rank receives every rank's sums (``arrays_from_every_rank``) and adds them per row:
   ``S``, ``Q``, the number of records; a row is shared when two or more records read it;
3. the rank holding a shared row corrects it in its shard as one process would: the fused
   kernel left the accumulator at ``G + fused`` (``fused = S**2``; row-wise
   ``sum(S**2) / stored_columns``), so ``G`` is that less ``fused``; the row's weights get
   ``lr * S * (1 / (sqrt(G + fused) + eps) - 1 / (sqrt(G + Q) + eps))`` added and its
   accumulator becomes ``G + Q`` (``Q`` at least ``fused / c**2``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from odl.train.distributed import arrays_from_every_rank
from odl.train.in_batch.batch_row_pairs import ROW_SPAN, RowPairIndex, RowPairs
from odl.train.in_batch.per_record_adagrad import PerRecordAdagrad
from odl.train.in_batch.rank_in_batch import HeldAccumulators

# (tables, rows, weight deltas [U, width], accumulators [U, acc_width]) for held rows only
WriteHeld = Callable[[Sequence[str], np.ndarray, np.ndarray, np.ndarray], None]


class RankPerRecordAdagrad(PerRecordAdagrad):
    """The module docstring's correction for one model of several ranks.

    Args:
        index: the model's ``RowPairIndex`` (no storage needed).
        kind: the table kernel, one of ``PER_RECORD_TABLE_KINDS``.
        eps: the fused kernel's epsilon.
        max_gain: ``per_record_adagrad_max_gain`` (at least 1).
        lookup_tables: per lookup of ``index``, the TorchRec table it reads.
        read_held: reads the accumulators of rows this rank's shards hold.
        write_held: adds weight deltas and sets accumulators of rows this rank holds.

    Raises:
        ValueError: ``kind`` is not one of ``PER_RECORD_TABLE_KINDS``, or ``max_gain`` < 1.
    """

    def __init__(self, index: RowPairIndex, kind: str, eps: float, max_gain: float,
                 lookup_tables: Sequence[str], read_held: HeldAccumulators,
                 write_held: WriteHeld) -> None:
        super().__init__(index, kind, eps, max_gain)
        self._tables = list(lookup_tables)
        table_ids = {t: i for i, t in enumerate(sorted(set(self._tables)))}
        self._table_of_lookup = np.array([table_ids[t] for t in self._tables],
                                         dtype=np.int64)
        self._read, self._write = read_held, write_held

    @torch.no_grad()
    def apply_ranks(self, pairs: RowPairs | None, grads: Sequence[torch.Tensor | None], n: int,
                    world_size: int, lr: float) -> int:
        """Corrects the shared rows this rank holds (a collective; module docstring).

        Args:
            pairs: this rank's row reads (None: none).
            grads: the pooled groups' gradients (``hook_pooled_gradients`` before the
                backward; the padded batch's rows).
            n: this rank's records (the first ``n`` rows of ``grads``).
            world_size: the number of ranks.
            lr: the table rate of the step.

        Returns:
            The number of shared rows this rank corrected.
        """
        index = self._index
        width = index.width
        qw = 1 if self.kind == "rowwise_adagrad" else width
        mine = {"key": np.empty(0, dtype=np.int64), "lookup": np.empty(0, dtype=np.int64),
                "rows": np.empty(0, dtype=np.int64), "readers": np.empty(0, dtype=np.int64),
                "s": np.empty((0, width), dtype=np.float64),
                "q": np.empty((0, qw), dtype=np.float64)}
        if pairs is not None and n and any(g is not None for g in grads):
            per_pair = index.per_pair([g[:n] if g is not None else None for g in grads],
                                      pairs, torch.float64)
            g = (pairs.weight.to(torch.float64).unsqueeze(1) * per_pair / world_size)
            run = torch.cumsum(pairs.new_pair.long(), 0) - 1  # (row, record) run of a pair
            runs = int(run[-1]) + 1
            per_record = g.new_zeros(runs, width).index_add_(0, run, g)
            squares = per_record * per_record
            if self.kind == "rowwise_adagrad":
                squares = squares.sum(1, keepdim=True)
            row_seg = torch.cumsum(pairs.new_row.long(), 0) - 1
            row_of_run = row_seg.index_select(0, pairs.new_pair.nonzero().flatten())
            nrows = int(row_seg[-1]) + 1
            s = g.new_zeros(nrows, width).index_add_(0, row_of_run, per_record)
            q = g.new_zeros(nrows, qw).index_add_(0, row_of_run, squares)
            readers = torch.bincount(row_of_run, minlength=nrows)
            heads = pairs.new_row.nonzero().flatten()
            lookup = pairs.lookup.index_select(0, heads).cpu().numpy().astype(np.int64)
            rows = pairs.rows.index_select(0, heads).cpu().numpy().astype(np.int64)
            mine = {"key": self._table_of_lookup[lookup] * ROW_SPAN + rows,
                    "lookup": lookup, "rows": rows,
                    "readers": readers.cpu().numpy().astype(np.int64),
                    "s": s.cpu().numpy(), "q": q.cpu().numpy()}
        everyone = arrays_from_every_rank(mine)
        key = np.concatenate([p["key"] for p in everyone])
        if not len(key):
            return 0
        uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        s = np.zeros((len(uniq), width))
        q = np.zeros((len(uniq), qw))
        readers = np.zeros(len(uniq), dtype=np.int64)
        np.add.at(s, inverse, np.concatenate([p["s"] for p in everyone]))
        np.add.at(q, inverse, np.concatenate([p["q"] for p in everyone]))
        np.add.at(readers, inverse, np.concatenate([p["readers"] for p in everyone]))
        shared = np.flatnonzero(readers > 1)
        if not len(shared):
            return 0
        lookup = np.concatenate([p["lookup"] for p in everyone])[first[shared]]
        rows = np.concatenate([p["rows"] for p in everyone])[first[shared]]
        tables = [self._tables[i] for i in lookup]
        acc, held = self._read(tables, rows)
        if not held.any():
            return 0
        at = np.flatnonzero(held)
        total, q = s[shared[at]], q[shared[at]]
        lk = torch.from_numpy(lookup[at])
        if self.kind == "rowwise_adagrad":
            stored = index.stored.cpu().index_select(0, lk).numpy()[:, None].astype(np.float64)
            fused = (total * total).sum(1, keepdims=True) / stored
            q = q / stored
        else:
            fused = total * total
        q = np.maximum(q, fused * self._floor)  # at most max_gain times the fused step
        before = acc[at].astype(np.float64) - fused  # the fused kernel added `fused`
        rate = lr * index.multiplier.cpu().index_select(0, lk).numpy()[:, None]
        delta = rate * total * (1.0 / (np.sqrt(np.maximum(before + fused, 0)) + self.eps)
                                - 1.0 / (np.sqrt(np.maximum(before + q, 0)) + self.eps))
        self._write([tables[i] for i in at], rows[at], delta.astype(np.float32),
                    (before + q).astype(np.float32))
        return len(at)
