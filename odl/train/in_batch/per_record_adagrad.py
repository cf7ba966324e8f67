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

``lr`` is the table's rate of the step (wide tables: times the step's multiplier, which
under in-batch learning ``odl.train.in_batch.wide_rate`` sets). A row read by one record,
and every row of a one-record batch, are left as the fused kernel made them (``sum_j g_j**2
= S**2`` there). For ``k`` records with the same gradient and ``G = 0`` the row moves
``min(sqrt(k), c)`` times as far as the fused step (per-sample Adagrad would move it about
``2 * sqrt(k)`` times as far, correcting itself after each record; the batch cannot, so
``c`` bounds the overshoot of a row that a whole batch reads, such as a device's or an
hour's, while the accumulators are still small). Where the records' gradients cancel (a
frequent row near its optimum) the accumulator grows more than the fused kernel's and the
row moves less.

The rule is applied after the fused backward as a correction of the rows the kernel
updated. The kernel left a shared row's accumulator at ``G + fused`` (``fused = S**2``;
row-wise ``sum(S**2) / stored_columns``), so ``G`` is that less ``fused``; the row's weights
get ``lr * S * (1 / (sqrt(G + fused) + eps) - 1 / (sqrt(G + Q) + eps))`` added and its
accumulator is set to ``G + Q``. The records' gradients come from hooks on the pooled groups
during that backward (they include the loss's embedding regularization), so ``S`` is the
gradient the kernel applied.

The batch is the step's: with several ranks, every rank's records of the step (the update
one process makes on the ranks' records together). Each rank sums, per table row its
records read, the gradient its records put on the row, the sum of its records' squared
gradients and how many of its records read it (``RowGradientSums``; the gradients over the
number of ranks, the share of TorchRec's averaged table update, 1 with one rank); the
``StepExchange`` gives every rank every rank's sums (the identity with one rank), which are
added per row; and the rank holding a shared row corrects it (``held_rows``).

It is meant to run with in-batch learning (``odl.train.in_batch.in_batch_learning``), whose
errors already account for the batch's earlier records; validation refuses it alone, which
the bench found to overshoot (``docs/benchmarks.md``). Unwritten, it runs wherever in-batch
learning trains (row-wise) Adagrad tables (``optimizer_support.per_record_adagrad_on``).

Not covered: SGD tables (a batched SGD step already is the sum of per-record steps) and
other optimizers; rows that the model reads outside its pooled lookups keep the fused update.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from odl.config.optimizer_support import PER_RECORD_TABLE_KINDS
from odl.train.in_batch import native_kernels
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs
from odl.train.in_batch.held_rows import HeldRows
from odl.train.in_batch.native_kernels import address as _ptr
from odl.train.in_batch.step_exchange import StepExchange


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


@dataclass(frozen=True)
class RowGradientSums:
    """One rank's part of a step for per-record Adagrad: ``R`` table rows its records read.

    Attributes:
        key: ``[R]`` int64, the row as ``RowPairIndex.row_keys`` numbers it.
        lookup: ``[R]`` int64, a lookup reading it.
        rows: ``[R]`` int64, the row in its table.
        readers: ``[R]`` int64, how many of the rank's records read it.
        total: ``[R, width]``, the gradient the records put on it (``S``; float32, the
            ranks' parts added in float64).
        squares: ``[R, 1 | width]``, the sum of their squared gradients (``Q``; summed over
            the columns for row-wise Adagrad).
    """

    key: np.ndarray
    lookup: np.ndarray
    rows: np.ndarray
    readers: np.ndarray
    total: np.ndarray
    squares: np.ndarray


def _added_per_row(parts: list[RowGradientSums]) -> RowGradientSums:
    """Every rank's sums added per row (one entry per row)."""
    key = np.concatenate([p.key for p in parts])
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    total = np.zeros((len(uniq), parts[0].total.shape[1]))
    squares = np.zeros((len(uniq), parts[0].squares.shape[1]))
    readers = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(total, inverse, np.concatenate([p.total for p in parts]))
    np.add.at(squares, inverse, np.concatenate([p.squares for p in parts]))
    np.add.at(readers, inverse, np.concatenate([p.readers for p in parts]))
    return RowGradientSums(uniq, np.concatenate([p.lookup for p in parts])[first],
                           np.concatenate([p.rows for p in parts])[first], readers, total,
                           squares)


class PerRecordAdagrad:
    """Applies the module docstring's accumulator rule after each step's fused backward.

    Args:
        index: the model's ``RowPairIndex``.
        kind: the table kernel, one of ``PER_RECORD_TABLE_KINDS``.
        eps: the fused kernel's epsilon.
        max_gain: the most a row's step may exceed the fused step (``c`` in the module
            docstring, at least 1).
        held: the table rows this rank holds (read and corrected).
        exchange: the step's exchange between the ranks.

    Raises:
        ValueError: ``kind`` is not one of ``PER_RECORD_TABLE_KINDS``, or ``max_gain`` < 1.
    """

    def __init__(self, index: RowPairIndex, kind: str, eps: float, max_gain: float,
                 held: HeldRows, exchange: StepExchange) -> None:
        if kind not in PER_RECORD_TABLE_KINDS:
            raise ValueError(f"per-record accumulators apply to {PER_RECORD_TABLE_KINDS} "
                             f"tables, not {kind!r}")
        if not max_gain >= 1:
            raise ValueError(f"max_gain must be at least 1, got {max_gain}")
        self._floor = 1.0 / float(max_gain) ** 2
        self.kind = kind
        self.eps = float(eps)
        self._index = index
        self._held = held
        self._exchange = exchange

    @torch.no_grad()
    def apply(self, pairs: RowPairs | None, grads: Sequence[torch.Tensor | None], n: int,
              lr: float) -> int:
        """Corrects the shared rows this rank holds (module docstring).

        A collective with several ranks: every rank calls it after every step's backward.

        Args:
            pairs: this rank's row reads (None: none).
            grads: the pooled groups' gradients (``hook_pooled_gradients`` before the
                backward; the rows of a batch padded to the step's largest).
            n: this rank's records (the first ``n`` rows of ``grads``).
            lr: the table rate of the step.

        Returns:
            The number of shared rows this rank corrected (read by two or more records).
        """
        parts = self._exchange.every_rank(self._row_sums(pairs, grads, n))
        # one rank's sums already are one entry per row
        sums = parts[0] if len(parts) == 1 else _added_per_row(parts)
        shared = np.flatnonzero(sums.readers > 1)
        if not len(shared):
            return 0
        read = self._held.accumulators(sums.lookup[shared], sums.rows[shared])
        at = np.flatnonzero(read.held)
        if not len(at):
            return 0
        index = self._index
        total = sums.total[shared[at]].astype(np.float64)
        q, lookup = sums.squares[shared[at]].astype(np.float64), read.lookup[at]
        if self.kind == "rowwise_adagrad":
            stored = index.lookup_stored[lookup][:, None].astype(np.float64)
            fused = (total * total).sum(1, keepdims=True) / stored
            q = q / stored
        else:
            fused = total * total
        q = np.maximum(q, fused * self._floor)  # at most max_gain times the fused step
        before = read.values[at].astype(np.float64) - fused  # the fused kernel added `fused`
        rate = lr * index.lookup_multiplier[lookup][:, None].astype(np.float64)
        delta = rate * total * (1.0 / (np.sqrt(np.maximum(before + fused, 0)) + self.eps)
                                - 1.0 / (np.sqrt(np.maximum(before + q, 0)) + self.eps))
        self._held.update(read, at, delta.astype(np.float32), (before + q).astype(np.float32))
        return len(at)

    def _row_sums(self, pairs: RowPairs | None, grads: Sequence[torch.Tensor | None],
                  n: int) -> RowGradientSums:
        """This rank's part of the step (``RowGradientSums``)."""
        index = self._index
        width = index.width
        qw = 1 if self.kind == "rowwise_adagrad" else width
        if pairs is None or not n or all(g is None for g in grads):
            empty = np.empty(0, dtype=np.int64)
            return RowGradientSums(empty, empty, empty, empty,
                                   np.empty((0, width), dtype=np.float32),
                                   np.empty((0, qw), dtype=np.float32))
        scale = 1.0 / self._exchange.world_size  # TorchRec averages the tables' gradients
        lib = native_kernels.library() if pairs.rows.device.type == "cpu" else None
        if lib is not None:
            return self._native_row_sums(lib, pairs, grads, n, scale)
        dtype = next(g.dtype for g in grads if g is not None)
        g = index.per_pair(grads, pairs, dtype)  # (pairs.b = n records)
        g.mul_((pairs.weight.to(dtype) * scale).unsqueeze(1))  # each read's weight
        run = torch.cumsum(pairs.new_pair.long(), 0) - 1  # (row, record) run of a read
        runs = int(run[-1]) + 1
        per_record = (g if runs == g.shape[0]  # no record reads a row twice
                      else g.new_zeros(runs, width).index_add_(0, run, g))
        squares = per_record * per_record
        if self.kind == "rowwise_adagrad":
            squares = squares.sum(1, keepdim=True)
        row_seg = torch.cumsum(pairs.new_row.long(), 0) - 1
        row_of_run = row_seg.index_select(0, pairs.new_pair.nonzero().flatten())
        nrows = int(row_seg[-1]) + 1
        sums = g.new_zeros(nrows, width + qw).index_add_(
            0, row_of_run, torch.cat([per_record, squares], 1)).to("cpu", torch.float32).numpy()
        heads = pairs.new_row.nonzero().flatten()
        lookup = pairs.lookup.index_select(0, heads).cpu().numpy().astype(np.int64, copy=False)
        rows = pairs.rows.index_select(0, heads).cpu().numpy().astype(np.int64, copy=False)
        return RowGradientSums(
            index.row_keys(lookup, rows), lookup, rows,
            torch.bincount(row_of_run, minlength=nrows).cpu().numpy().astype(np.int64, copy=False),
            sums[:, :width], sums[:, width:])

    def _native_row_sums(self, lib: ctypes.CDLL, pairs: RowPairs,
                         grads: Sequence[torch.Tensor | None], n: int,
                         scale: float) -> RowGradientSums:
        """``_row_sums`` on the CPU in one call of ``row_pairs.c``."""
        index = self._index
        width, columns = index.width, index.columns
        rowwise = self.kind == "rowwise_adagrad"
        cat = np.ascontiguousarray(index.side_by_side(
            grads, n, torch.float32, torch.device("cpu")).detach().numpy())
        sample, lookup = pairs.sample.numpy(), pairs.lookup.numpy()
        weight = np.ascontiguousarray(pairs.weight.to(torch.float32).numpy())
        new_row, new_pair = pairs.new_row.numpy(), pairs.new_pair.numpy()
        p = len(sample)
        total = np.empty((p, width), dtype=np.float32)
        squares = np.empty((p, 1 if rowwise else width), dtype=np.float32)
        readers, head = np.empty(p, dtype=np.int64), np.empty(p, dtype=np.int64)
        run = np.empty(width, dtype=np.float64)
        rows_written = lib.odl_row_gradient_sums(
            p, width, columns, int(rowwise), scale, _ptr(sample), _ptr(lookup), _ptr(weight),
            _ptr(new_row), _ptr(new_pair), _ptr(index.lookup_first), _ptr(index.lookup_width),
            _ptr(cat), _ptr(run), _ptr(total), _ptr(squares), _ptr(readers), _ptr(head))
        head = head[:rows_written]
        lookup, rows = lookup[head], pairs.rows.numpy()[head]
        return RowGradientSums(index.row_keys(lookup, rows), lookup, rows,
                               readers[:rows_written], total[:rows_written],
                               squares[:rows_written])
