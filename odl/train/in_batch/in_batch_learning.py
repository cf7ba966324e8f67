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

``lr`` is the table's current rate (wide tables: times the step's multiplier of
``odl.train.in_batch.wide_rate``, which every few steps runs this shift twice more to judge
the wide rate; ``WideRate``) and ``eps`` the fused kernel's. Record ``i``'s logit is shifted
by the first-order change the rows it reads would make: ``sum over its lookups f of a_if *
<dlogit_i/de_if, D_r(i)>`` (``a_if`` the lookup's weight of the row). For a wide
(first-order) lookup this is exactly the logit after such a step; for an embedding read by
the dense part it is the first-order term. The dense parameters are not shifted.

``TrainModule.train_step`` then computes the loss on the shifted logits, so what the tables
and the dense part learn from record ``i`` is its error after the earlier records were
learned (per-sample learning, to first order, in one batched update), and reports the
shifted predictions (the progressive metrics). The state a step leaves, what checkpoints,
publishing and serving see, is the ordinary batched update with those errors: serving's
predictions (``TrainModule.predict``, ``odl-serve``) are not shifted.

Which errors the earlier records step with: with ``train_config.in_batch_sequential`` (the
default) their own shifted predictions' errors, found in one pass over the records in order
(``odl.train.in_batch.in_batch_scan``, whose docstring states that variant); with
``in_batch_sequential: false`` their errors at the batch's starting state (the loss's slope
above, one batched computation).

The batch is the step's: with several ranks, every rank's records of the step, rank 0's
first, as one process training their concatenation would see them (``TrainModule``'s step).
Each rank gives its part of the step (``RecordReads``: its records' logits and loss slopes,
``dlogit/d pooled``, its row reads) to the ``StepExchange`` (the identity with one rank), the
accumulators of the shared rows come from the ranks holding them (``held_rows``), and every
rank computes the same shifts of all records and keeps its own. A record's loss slope is the
one the step's table update sees: its rank's loss weighted by the rank's share of the step's
records (1 with one rank). Only rows that two or more records read shift anything, so only
their reads are kept after the exchange.

Not covered (the logit is not shifted by them): sequence lookups that are not pooled
(target attention's items), dense parameters, and second-order terms. Batch norm in the
dense part couples records; the shift then uses its train-mode Jacobian as it is.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from odl.config.optimizer_support import IN_BATCH_TABLE_KINDS
from odl.train.in_batch import native_kernels
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs
from odl.train.in_batch.held_rows import HeldRows
from odl.train.in_batch.in_batch_scan import (
    InBatchScan,
    ScanPairs,
    loss_and_slopes,
    loss_slopes,
    scan_pairs,
)
from odl.train.in_batch.log_loss import LogLoss, log_loss_matches
from odl.train.in_batch.native_kernels import address as _ptr
from odl.train.in_batch.step_exchange import StepExchange
from odl.train.in_batch.wide_rate import PROBE_FACTOR, WideRate

if TYPE_CHECKING:
    from odl.train.in_batch.in_batch_choice import InBatchChoice

LossAt = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RecordReads:
    """One rank's part of a step for in-batch learning: ``n`` records, ``P`` row reads.

    Attributes:
        base: ``[n]`` float32, the records' logits at the step's start.
        slope: ``[n]`` float32, each record's loss slope there (as the table update sees it).
        curve: ``[n]`` float32, the slope's derivative in the record's own logit.
        jac: ``[n, columns]`` float32, ``dlogit/d pooled``, the groups side by side.
        lookup: ``[P]`` int64, each read's lookup.
        rows: ``[P]`` int64, its table row.
        sample: ``[P]`` int64, its record (numbered within the rank).
        weight: ``[P]`` float32, its weight in the lookup's pooled vector.
        previous: ``[2]`` float64, the rank's part of the previous step's loss at that
            step's unshifted and at its shifted logits (NaN: no previous step;
            ``ShiftGain``).
    """

    base: np.ndarray
    slope: np.ndarray
    curve: np.ndarray
    jac: np.ndarray
    lookup: np.ndarray
    rows: np.ndarray
    sample: np.ndarray
    weight: np.ndarray
    previous: np.ndarray


# Weight of a step's gain in ShiftGain's smoothed one.
GAIN_SMOOTHING = 0.05


@dataclass
class ShiftGain:
    """How much the shift lowers the stream's loss: whether in-batch learning pays on it.

    Per step, ``(L(l) - L(l + shift)) / L(l)``: the step's loss (every rank's records, as the
    step trains on it) at the records' unshifted logits and at the shifted ones, smoothed
    over steps (``GAIN_SMOOTHING``). The shift is what the batch's earlier records teach its
    later ones, so the gain says whether in-batch learning pays on the stream: several per
    cent where one user's events come in bursts, about nothing where records share rows only
    through popular ids (measured figures in ``docs/training.md``). Not part of the
    checkpoint: a restarted run measures anew.

    Attributes:
        value: the smoothed gain (None before a step was measured).
        steps: the steps measured.
        last: the newest measured step's gain.
    """

    value: float | None = None
    steps: int = 0
    last: float | None = None

    def observe(self, base: float | None, shifted: float) -> None:
        """Adds a step's losses at the unshifted (``base``; None: none) and shifted logits."""
        if base is None or not (math.isfinite(base) and math.isfinite(shifted)) or base <= 0:
            return
        gain = (base - shifted) / base
        self.last = gain
        self.value = (gain if self.value is None
                      else (1 - GAIN_SMOOTHING) * self.value + GAIN_SMOOTHING * gain)
        self.steps += 1

    def status(self) -> dict:
        """The figures of ``/status``'s ``in_batch``."""
        return {"loss_gain": round(self.value, 6) if self.value is not None else None,
                "steps_measured": self.steps}


@dataclass(frozen=True)
class RecordSlopes:
    """One rank's records' loss slopes and their derivatives at given logits (``[n]`` each)."""

    slope: np.ndarray
    curve: np.ndarray


@dataclass(frozen=True)
class StepLoss:
    """One rank's part of a step's loss (``[1]`` float64), for the wide rate's probes."""

    value: np.ndarray


@dataclass(frozen=True)
class SharedReads:
    """The step's reads of rows that two or more records read, in (row, record) order.

    Records are numbered over the whole step, rank after rank; ``K`` reads of ``U`` rows.

    Attributes:
        sample: ``[K]`` each read's record.
        lookup: ``[K]`` its lookup.
        weight: ``[K]`` its weight.
        slot: ``[K]`` its row, numbered ``0..U-1``.
        new_row: ``[K]`` the read starts its row's reads.
        new_pair: ``[K]`` the read starts its (row, record)'s reads.
        head_lookup: ``[U]`` a lookup reading each row.
        head_rows: ``[U]`` each row in its table.
    """

    sample: np.ndarray
    lookup: np.ndarray
    weight: np.ndarray
    slot: np.ndarray
    new_row: np.ndarray
    new_pair: np.ndarray
    head_lookup: np.ndarray
    head_rows: np.ndarray


def shared_reads(parts: list[RecordReads], index: RowPairIndex) -> SharedReads | None:
    """The reads of ``parts`` (every rank's, in rank order) that ``SharedReads`` keeps.

    Each part lists its reads in (row, record) order (``RowPairIndex.pairs``), so one part
    is in order already; several are put in order together.

    Returns:
        None when no row is read by two or more records.
    """
    if len(parts) == 1:
        lookup, rows, sample, weight = (parts[0].lookup, parts[0].rows, parts[0].sample,
                                        parts[0].weight)
        key = index.row_keys(lookup, rows)
    else:
        starts = np.cumsum([0] + [len(p.base) for p in parts])
        lookup = np.concatenate([p.lookup for p in parts])
        rows = np.concatenate([p.rows for p in parts])
        sample = np.concatenate([p.sample + start for p, start in zip(parts, starts,
                                                                        strict=False)])
        weight = np.concatenate([p.weight for p in parts])
        key = index.row_keys(lookup, rows)
        order = np.argsort(key * (int(starts[-1]) + 1) + sample)
        lookup, rows, sample, weight, key = (lookup[order], rows[order], sample[order],
                                             weight[order], key[order])
    if len(key) < 2:
        return None
    lib = native_kernels.library()
    if lib is not None:
        return _native_shared_reads(lib, key, lookup, rows, sample, weight)
    new_row = np.ones(len(key), dtype=bool)
    new_row[1:] = key[1:] != key[:-1]
    new_pair = new_row.copy()
    new_pair[1:] |= sample[1:] != sample[:-1]
    slot = np.cumsum(new_row) - 1
    readers = np.bincount(slot, weights=new_pair)
    keep = np.flatnonzero(readers[slot] > 1)
    if not len(keep):
        return None
    first = new_row[keep]
    heads = keep[first]
    return SharedReads(sample=sample[keep], lookup=lookup[keep], weight=weight[keep],
                       slot=np.cumsum(first) - 1, new_row=first, new_pair=new_pair[keep],
                       head_lookup=lookup[heads], head_rows=rows[heads])


def _native_shared_reads(lib: ctypes.CDLL, key: np.ndarray, lookup: np.ndarray,
                         rows: np.ndarray, sample: np.ndarray,
                         weight: np.ndarray) -> SharedReads | None:
    """``shared_reads``'s selection in one call of ``row_pairs.c``."""
    n = len(key)
    key, sample = np.ascontiguousarray(key), np.ascontiguousarray(sample)
    keep, slot = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    new_row, new_pair = np.empty(n, dtype=np.bool_), np.empty(n, dtype=np.bool_)
    kept = lib.odl_shared_reads(n, _ptr(key), _ptr(sample), _ptr(keep), _ptr(slot),
                                _ptr(new_row), _ptr(new_pair))
    if not kept:
        return None
    keep, first = keep[:kept], new_row[:kept]
    heads = keep[first]
    return SharedReads(sample=sample[keep], lookup=lookup[keep], weight=weight[keep],
                       slot=slot[:kept], new_row=first, new_pair=new_pair[:kept],
                       head_lookup=lookup[heads], head_rows=rows[heads])


class InBatchLearning:
    """Computes the logit shift of the module docstring for every step of one model.

    Args:
        index: the model's ``RowPairIndex``.
        kind: the table kernel, one of ``IN_BATCH_TABLE_KINDS``.
        eps: the fused kernel's epsilon.
        sequential: the pass of ``odl.train.in_batch.in_batch_scan``
            (``in_batch_sequential``); None: the earlier records' errors at the batch's
            starting state.
        held: the table rows this rank holds (their accumulators).
        exchange: the step's exchange between the ranks.
        wide_rate: the wide tables' rate (``odl.train.in_batch.wide_rate``), or None
            (no wide tables): the step's multiplier as the step before left it, its
            sensitivity updated from each step's Jacobian, its level probed every few steps.
        wide: ``[L]`` bool, the lookups that read a wide table (with ``wide_rate``).

    Raises:
        ValueError: ``kind`` is not one of ``IN_BATCH_TABLE_KINDS``.
    """

    def __init__(self, index: RowPairIndex, kind: str, eps: float,
                 sequential: InBatchScan | None, held: HeldRows,
                 exchange: StepExchange, wide_rate: WideRate | None = None,
                 wide: np.ndarray | None = None) -> None:
        if kind not in IN_BATCH_TABLE_KINDS:
            raise ValueError(f"in-batch learning supports {IN_BATCH_TABLE_KINDS} tables, not "
                             f"{kind!r}")
        self.kind = kind
        self.eps = float(eps)
        self._index = index
        self.sequential = sequential
        self._held = held
        self._exchange = exchange
        self.wide_rate = wide_rate
        self._wide = (wide if wide is not None
                      else np.zeros(len(index.lookup_multiplier), dtype=bool))
        self.gain = ShiftGain()
        # the stream's decision (None: on at every step); while it measures, the wide tables
        # learn at off_multiplier in the logit's space, once off at off_multiplier, their
        # rate without in-batch learning
        self.choice: InBatchChoice | None = None
        self.off_multiplier = 1.0
        # this rank's part of the step's loss at the unshifted logits (None: the step's
        # loss at the shifted ones plus ``_drop``, the log loss's drop from the shift), and
        # the last step's (unshifted, shifted) parts, which the next step exchanges: the
        # gain is measured from every rank's
        self._base_part: float | None = None
        self._drop = 0.0
        self._previous = np.full(2, np.nan)
        # whether the model's log loss gives its loss's slopes (None: not checked yet)
        self._log_loss_ok: bool | None = None
        # where the last shifted step's loss slopes came from: "closed_form" (the model's
        # cross entropy, ``odl.train.in_batch.log_loss``) or "autograd" (None: no step yet)
        self.slopes_from: str | None = None

    def logit_shift(self, pairs: RowPairs | None, jac: torch.Tensor | None,
                    logits: torch.Tensor, loss_at: LossAt, lr: float,
                    log_loss: LogLoss | None = None) -> torch.Tensor:
        """This rank's ``[n]`` shifts of ``logits`` (module docstring); no gradient flows.

        A collective with several ranks: every rank calls it at every step, with or without
        records.

        Args:
            pairs: this rank's row reads (``RowPairIndex.pairs`` of its batch's ids, after
                any dynamic-table remap); None: nothing read.
            jac: ``[n, columns]`` ``dlogit/d pooled`` of this rank's records (the groups side
                by side); None where ``pairs`` is.
            logits: ``[n]`` this rank's records' logits at the step's start.
            loss_at: this rank's part of the step's loss at given ``[n]`` logits (the rest
                of the forward fixed), weighted as the table update weighs it.
            lr: the table rate of this step.
            log_loss: ``loss_at``'s cross entropy in closed form
                (``odl.train.in_batch.log_loss``), or None: the slopes come from autograd.

        Returns:
            Tensor ``[n]`` like ``logits``.
        """
        n = int(logits.shape[0])
        log_loss = self._checked_log_loss(log_loss, logits, loss_at)
        self.slopes_from = "closed_form" if log_loss is not None else "autograd"
        mine, self._base_part = _record_reads(self._index, pairs, jac, logits, loss_at,
                                              log_loss, self._previous)
        parts = self._exchange.every_rank(mine)
        self.gain.observe(float(sum(p.previous[0] for p in parts)),
                          float(sum(p.previous[1] for p in parts)))
        self._previous = np.full(2, np.nan)  # until the step reports it (``trained_loss``)
        offset = int(sum(len(p.base) for p in parts[:self._exchange.rank]))
        base = np.concatenate([p.base for p in parts])
        shift = np.zeros(len(base), dtype=np.float32)
        jac_all = np.concatenate([p.jac for p in parts])
        wide_rate = self.wide_rate
        if wide_rate is not None:  # the step's wide rate, as the fused kernel has it
            self._index.set_multiplier(self._wide, self.wide_multiplier)
        shared = shared_reads(parts, self._index)
        if shared is not None:
            acc = None
            if self.kind != "sgd":
                read = self._held.accumulators(shared.head_lookup, shared.head_rows)
                acc = self._exchange.held_values(read.values, read.held)
            slope = np.concatenate([p.slope for p in parts])
            if self.sequential is not None:
                curve = np.concatenate([p.curve for p in parts])
                prepared = self._prepared(shared, jac_all, acc, lr)
                slopes_at = self._slopes_at(offset, n, logits, loss_at, log_loss)
                scan = self.sequential

                def shift_with(factor: float) -> np.ndarray:
                    wide = self._wide[shared.head_lookup]
                    pairs_at = prepared if factor == 1.0 else replace(
                        prepared, rate=np.where(wide, prepared.rate * np.float32(factor),
                                                prepared.rate).astype(np.float32))
                    return scan.solve(pairs_at, base, slope, curve, slopes_at)
            else:
                def shift_with(factor: float) -> np.ndarray:
                    return self._batched(shared, jac_all, acc, lr, slope, len(base), factor)
            shift = shift_with(1.0)
            if wide_rate is not None and self.wide_engaged and wide_rate.probe_due():
                self._probe(shift_with, base, offset, logits, loss_at, log_loss)
        if wide_rate is not None:  # the next step's wide rate
            wide_rate.observe(jac_all)
        own = np.ascontiguousarray(shift[offset:offset + n])
        if log_loss is not None:
            mine_base = base[offset:offset + n]
            self._drop = log_loss.value(mine_base) - log_loss.value(mine_base + own)
        return torch.from_numpy(own).to(logits.device, logits.dtype)

    @property
    def wide_engaged(self) -> bool:
        """Whether the wide tables learn at ``wide_rate``'s multiplier."""
        return self.choice is None or self.choice.wide_engaged

    @property
    def wide_multiplier(self) -> float:
        """The wide tables' multiplier of the next step (with ``wide_rate``)."""
        assert self.wide_rate is not None
        if self.wide_engaged:
            return self.wide_rate.multiplier
        if self.choice is not None and self.choice.measuring:
            return self.wide_rate.at_level(self.off_multiplier)
        return self.off_multiplier

    def trained_loss(self, part: float) -> None:
        """Takes this rank's part of the step's loss at the shifted logits.

        As the step trained on it, weighted as ``loss_at`` weighs it (0 without records):
        ``ShiftGain``'s second figure, exchanged with the next step with the first (the
        loss at the unshifted logits).
        """
        shifted = float(part)
        base = self._base_part if self._base_part is not None else shifted + self._drop
        self._previous = np.array([base, shifted], dtype=np.float64)

    def _checked_log_loss(self, log_loss: LogLoss | None, logits: torch.Tensor,
                          loss_at: LossAt) -> LogLoss | None:
        """``log_loss``, where its slopes are ``loss_at``'s (checked once), else None."""
        if log_loss is None or self._log_loss_ok is False:
            return None
        if self._log_loss_ok is None and logits.shape[0]:
            _, slope, curve = loss_and_slopes(loss_at, logits.detach())
            self._log_loss_ok = log_loss_matches(
                log_loss, slope, curve, logits.detach().to("cpu", torch.float32).numpy())
            if not self._log_loss_ok:
                return None
        return log_loss

    def _probe(self, shift_with: Callable[[float], np.ndarray], base: np.ndarray, offset: int,
               logits: torch.Tensor, loss_at: LossAt, log_loss: LogLoss | None) -> None:
        """The wide rate's probes (``WideRate.judge``); no state changes.

        The step's loss at the shifts with the wide rows' rates times and divided by
        ``PROBE_FACTOR``, summed over the ranks (with ``log_loss``, its cross entropy: the
        terms without the logits are the same at both).
        """
        assert self.wide_rate is not None
        passes = self.sequential.passes if self.sequential is not None else 0
        n = int(logits.shape[0])
        losses = []
        for factor in (PROBE_FACTOR, 1.0 / PROBE_FACTOR):
            at = base + shift_with(factor)
            mine = 0.0
            mine_at = np.ascontiguousarray(at[offset:offset + n])
            if n and log_loss is not None:
                mine = log_loss.value(mine_at)
            elif n:
                with torch.no_grad():
                    mine = float(loss_at(torch.from_numpy(mine_at).to(logits.device,
                                                                       logits.dtype)))
            parts = self._exchange.every_rank(StepLoss(np.array([mine], dtype=np.float64)))
            losses.append(float(sum(p.value[0] for p in parts)))
        self.wide_rate.judge(*losses, records=len(base))
        if self.sequential is not None:
            self.sequential.passes = passes

    def _slopes_at(self, offset: int, n: int, logits: torch.Tensor, loss_at: LossAt,
                   log_loss: LogLoss | None
                   ) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """The step's records' loss slopes at given logits: each rank gives its records'."""
        def slopes_at(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            mine_at = np.ascontiguousarray(at[offset:offset + n])
            mine = RecordSlopes(*(log_loss.slopes(mine_at) if log_loss is not None else _slopes(
                loss_at, torch.from_numpy(mine_at).to(logits.device, logits.dtype))))
            parts = self._exchange.every_rank(mine)
            return (np.concatenate([p.slope for p in parts]),
                    np.concatenate([p.curve for p in parts]))
        return slopes_at

    def _prepared(self, shared: SharedReads, jac: np.ndarray, acc: np.ndarray | None,
                  lr: float) -> ScanPairs:
        """The step's shared reads prepared for the sequential pass (``InBatchScan.solve``)."""
        index = self._index
        heads = shared.head_lookup
        lib = native_kernels.library()
        if lib is not None:
            return self._native_prepared(lib, shared, jac, acc, lr)
        # the reads in the pass's (record, row) order, so that it reads them in sequence
        order = np.argsort(shared.sample * (int(shared.slot[-1]) + 1) + shared.slot)
        sample, lookup = shared.sample[order], shared.lookup[order]
        prepared = scan_pairs(
            torch.from_numpy(sample), torch.from_numpy(shared.slot[order]),
            index.jacobian_rows(jac, sample, lookup),
            torch.from_numpy(shared.weight[order]),
            torch.from_numpy(lr * index.lookup_multiplier[heads]),
            torch.from_numpy(acc) if acc is not None else None,
            torch.from_numpy(index.lookup_stored[heads]),
            torch.from_numpy(index.lookup_width[heads]), in_record_order=True)
        return prepared

    def _native_prepared(self, lib: ctypes.CDLL, shared: SharedReads, jac: np.ndarray,
                         acc: np.ndarray | None, lr: float) -> ScanPairs:
        """``_prepared`` in one call of ``row_pairs.c``."""
        index = self._index
        k, records, width = len(shared.sample), int(jac.shape[0]), index.width
        heads = shared.head_lookup
        jac = np.ascontiguousarray(jac, dtype=np.float32)
        weight = np.ascontiguousarray(shared.weight, dtype=np.float32)
        sample, slot = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
        weight_out, jrow = np.empty(k, dtype=np.float32), np.empty((k, width), dtype=np.float32)
        # the kernel reads these by address: each is held by a name until it returns
        lookup = np.ascontiguousarray(shared.lookup)
        read_sample = np.ascontiguousarray(shared.sample)
        read_slot = np.ascontiguousarray(shared.slot)
        count = np.zeros(records + 1, dtype=np.int64)
        lib.odl_scan_reads(k, records, width, index.columns, _ptr(read_sample), _ptr(lookup),
                           _ptr(weight), _ptr(read_slot), _ptr(index.lookup_first),
                           _ptr(index.lookup_width), _ptr(jac),
                           _ptr(count), _ptr(sample), _ptr(slot), _ptr(weight_out), _ptr(jrow))
        return ScanPairs(
            order=np.arange(k, dtype=np.int64), sample=sample, slot=slot,
            cols=index.lookup_width[heads], jrow=jrow, weight=weight_out,
            rate=(lr * index.lookup_multiplier[heads]).astype(np.float32),
            acc=(np.ascontiguousarray(acc, dtype=np.float32) if acc is not None
                 else np.zeros((len(heads), 0), dtype=np.float32)),
            stored=index.lookup_stored[heads], slots=len(heads))

    def _batched(self, shared: SharedReads, jac: np.ndarray, acc: np.ndarray | None,
                 lr: float, slope: np.ndarray, records: int, wide_factor: float = 1.0
                 ) -> np.ndarray:
        """The shifts with the earlier records' errors at the step's start (the contract).

        The wide lookups' rates are times ``wide_factor`` (a probe's).
        """
        index = self._index
        sample = torch.from_numpy(shared.sample)
        lookup = shared.lookup
        weight = torch.from_numpy(shared.weight)
        jrow = index.jacobian_rows(jac, shared.sample, lookup)
        grads = (weight * torch.from_numpy(slope).index_select(0, sample)).unsqueeze(1) * jrow
        cum = torch.cat([grads.new_zeros(1, index.width), torch.cumsum(grads, 0)])
        at = torch.arange(len(shared.sample))
        row_start = torch.cummax(torch.where(torch.from_numpy(shared.new_row), at, 0), 0)
        pair_start = torch.cummax(torch.where(torch.from_numpy(shared.new_pair), at, 0), 0)
        # S_r(i): the row's gradient from strictly earlier records
        earlier = (cum.index_select(0, pair_start.values)
                   - cum.index_select(0, row_start.values))
        multiplier = index.lookup_multiplier[lookup]
        if wide_factor != 1.0:
            multiplier = np.where(self._wide[lookup], multiplier * np.float32(wide_factor),
                                  multiplier).astype(np.float32)
        rate = torch.from_numpy(lr * multiplier).unsqueeze(1)
        if self.kind == "sgd":
            change = earlier.mul_(-rate)
        else:
            assert acc is not None
            per_read = torch.from_numpy(acc[shared.slot])
            if self.kind == "rowwise_adagrad":
                stored = torch.from_numpy(index.lookup_stored[lookup]).unsqueeze(1)
                per_read.add_((earlier * earlier).sum(1, keepdim=True).div_(stored))
            else:
                per_read.addcmul_(earlier, earlier)
            # -lr * S / sqrt(G + S**2), eps as the kernel's: (x + eps**2)**-0.5 differs from
            # 1 / (sqrt(x) + eps) by a relative eps / sqrt(x) where S != 0 (and is 0 at S = 0)
            change = earlier.mul_(per_read.add_(self.eps * self.eps).rsqrt_()).mul_(-rate)
        shift = torch.zeros(records, dtype=torch.float32)
        return shift.index_add_(0, sample, weight * (jrow * change).sum(1)).numpy()


def _slopes(loss_at: LossAt, at: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``loss_slopes`` of ``n`` records; empty arrays for none."""
    if not at.shape[0]:
        return np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float32)
    return loss_slopes(loss_at, at)


def _record_reads(index: RowPairIndex, pairs: RowPairs | None, jac: torch.Tensor | None,
                  logits: torch.Tensor, loss_at: LossAt, log_loss: LogLoss | None,
                  previous: np.ndarray) -> tuple[RecordReads, float | None]:
    """This rank's part of the step (``RecordReads``; ``previous`` the last step's losses).

    Returns:
        The part, and the rank's loss at the unshifted logits (None with ``log_loss``,
        which gives the slopes without it).
    """
    n = int(logits.shape[0])
    base = logits.detach().to("cpu", torch.float32).numpy()
    loss: float | None = None
    if log_loss is not None:
        slope, curve = log_loss.slopes(base)
    elif n:
        loss, slope, curve = loss_and_slopes(loss_at, logits.detach())
    else:
        loss, (slope, curve) = 0.0, _slopes(loss_at, logits.detach())
    previous = np.asarray(previous, dtype=np.float64)
    if pairs is None or jac is None:
        empty = np.empty(0, dtype=np.int64)
        return RecordReads(base, slope, curve, np.zeros((n, index.columns), dtype=np.float32),
                           empty, empty, empty, np.empty(0, dtype=np.float32), previous), loss
    return RecordReads(
        base, slope, curve, jac.detach().to("cpu", torch.float32).numpy(),
        *(t.to("cpu", torch.int64).numpy() for t in (pairs.lookup, pairs.rows, pairs.sample)),
        pairs.weight.detach().to("cpu", torch.float32).numpy(), previous), loss
