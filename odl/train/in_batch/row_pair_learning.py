"""In-batch learning and per-record Adagrad as one training step uses them.

``train_config.in_batch_learning`` predicts each record after its batch's earlier ones (a
logit shift, :mod:`odl.train.in_batch.in_batch_learning`); ``per_record_adagrad`` counts a
batch's records one by one in Adagrad's accumulators
(:mod:`odl.train.in_batch.per_record_adagrad`). Both read a step's (table row, record) pairs
(:mod:`odl.train.in_batch.batch_row_pairs`) and see the step's records of every rank through
its exchange (:mod:`odl.train.in_batch.step_exchange`; the identity with one rank); the
rows they read and correct are the ones each rank holds (:mod:`odl.train.in_batch.held_rows`).
:class:`RowPairLearning` is what ``TrainModule.train_step`` calls: the pairs, the shift
before the loss, and the accumulator corrections around the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from odl.config.in_batch_settings import (
    IN_BATCH_AUTO,
    IN_BATCH_OFF,
    in_batch_mode,
    in_batch_refusal,
    per_record_adagrad_on,
)
from odl.features.batch import Batch
from odl.models.ctr_model import ModelOutput
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.protos import pipeline_pb2
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs, TableRows
from odl.train.in_batch.held_rows import HeldRows, ShardedTables, WholeTables
from odl.train.in_batch.in_batch_choice import InBatchChoice
from odl.train.in_batch.in_batch_learning import InBatchLearning
from odl.train.in_batch.in_batch_scan import InBatchScan, error_model_is_exact
from odl.train.in_batch.log_loss import record_log_loss
from odl.train.in_batch.per_record_adagrad import PerRecordAdagrad, hook_pooled_gradients
from odl.train.in_batch.step_exchange import StepExchange
from odl.train.in_batch.wide_rate import WideRate, start_level, wide_lookups
from odl.train.optimizer_builder import TABLE_EPS
from odl.train.table_shards import EBC_PREFIX, read_held_accumulators, write_held_rows

if TYPE_CHECKING:
    from odl.train.train_module import TrainModule

LossFn = Callable[[ModelOutput, Batch], torch.Tensor]
LogLossWeights = Callable[[Batch], np.ndarray | None]


class RowPairLearning:
    """A step's in-batch learning and per-record Adagrad (module docstring).

    Made by :meth:`build`; ``in_batch`` and ``per_record`` are None when off. Which steps
    run them is ``choice``'s (``odl.train.in_batch.in_batch_choice``): every step where the
    config writes ``in_batch_learning: true``, decided by the stream where it is unwritten.

    Args:
        index: the row-pair index of the model's lookups.
        in_batch: in-batch learning, or None.
        per_record: per-record Adagrad, or None.
        group_widths: the width of each pooled group of the model, in order.
        loss: the model's loss of an output on a batch.
        choice: the steps that run them (None: every step).
        log_loss_weights: the model's ``CtrModel.log_loss_weights`` (None: the slopes of
            ``loss`` always come from autograd).
    """

    def __init__(self, index: RowPairIndex, in_batch: InBatchLearning | None,
                 per_record: PerRecordAdagrad | None, group_widths: Sequence[int],
                 loss: LossFn, choice: InBatchChoice | None = None,
                 log_loss_weights: LogLossWeights | None = None) -> None:
        self.index = index
        self.in_batch = in_batch
        self.per_record = per_record
        self.choice = choice or InBatchChoice(auto=False)
        # the wide tables' rate (in-batch learning with wide tables), else None
        self.wide_rate = in_batch.wide_rate if in_batch is not None else None
        self._group_widths = list(group_widths)
        self._loss = loss
        self._log_loss_weights = log_loss_weights

    @classmethod
    def build(cls, module: TrainModule, config: pipeline_pb2.EasyRecConfig,
              table_configs: list[EmbeddingBagConfig]) -> RowPairLearning | None:
        """``in_batch_learning``, per-record Adagrad and their row-pair index.

        None when both are off (per-record Adagrad: ``per_record_adagrad_on``). Validation
        has checked the model (one output, for in-batch learning) and the table optimizer
        (SGD or (row-wise) Adagrad; (row-wise) Adagrad for per-record accumulators); the
        classes refuse any other. A rank that holds whole tables (one process) reads and
        writes their rows through the index's buffers; with several ranks no rank does, and
        the rows are read and written in the shards that hold them.

        Args:
            module: the train module (its tables, ranks and model).
            config: the pipeline config.
            table_configs: the model's tables.

        Raises:
            ValueError: ``in_batch_sequential: false`` with several ranks (not verified
                there; validation refuses it by field).
        """
        tc = config.train_config
        mode = in_batch_mode(config, module.world_size)
        per_record_on = per_record_adagrad_on(config, module.world_size)
        if mode == IN_BATCH_OFF and not per_record_on:
            return None
        whole_tables = module.world_size == 1
        if not whole_tables and mode != IN_BATCH_OFF and not tc.in_batch_sequential:
            raise ValueError("train_config.in_batch_sequential: false is not implemented for "
                             "a model sharded over several ranks yet")
        kind = module.table_kind
        tables, states = module.row_state_views() if whole_tables else ({}, {})
        rows = {}
        for c in table_configs:
            state = states.get(f"{EBC_PREFIX}{c.name}.weight", [])
            rows[c.name] = TableRows(
                state=state[0] if state and kind != "sgd" else None,
                stored_columns=c.embedding_dim, mean_pooling=c.pooling == PoolingType.MEAN,
                lr_multiplier=(module.wide_lr_multiplier if c.name.endswith(WIDE_SUFFIX)
                               else 1.0),
                weight=tables.get(c.name))
        layout = module.model.pooled_layout
        index = RowPairIndex(layout, rows, rowwise=kind == "rowwise_adagrad")
        held: HeldRows = WholeTables(index)
        if not whole_tables:
            held = ShardedTables(
                [t for g in layout for _, t in g.lookups],  # per lookup, the table it reads
                functools.partial(read_held_accumulators, module.table_shards,
                                  1 if kind == "rowwise_adagrad" else index.width),
                functools.partial(write_held_rows, module.table_shards))
        exchange = StepExchange(module.rank, module.world_size)
        in_batch = None
        if mode != IN_BATCH_OFF:
            scan = (InBatchScan(kind, per_record_on,
                                float(tc.per_record_adagrad_max_gain), TABLE_EPS,
                                logistic=not any(module.regression),
                                exact=error_model_is_exact(config.model_config))
                    if tc.in_batch_sequential else None)
            wide = np.array([t.endswith(WIDE_SUFFIX) for g in layout for _, t in g.lookups],
                            dtype=bool)
            wide_rate = (WideRate(wide_lookups(index, wide, kind), start_level(tc, True),
                                  tc.wide_rate_adaptation) if wide.any() else None)
            in_batch = InBatchLearning(index, kind, TABLE_EPS, scan, held, exchange,
                                       wide_rate, wide)
            in_batch.off_multiplier = start_level(tc, False)
        per_record = None
        if per_record_on:
            per_record = PerRecordAdagrad(index, kind, TABLE_EPS,
                                          float(tc.per_record_adagrad_max_gain), held, exchange)
        choice = InBatchChoice(auto=mode == IN_BATCH_AUTO)
        if in_batch is not None:
            in_batch.choice = choice
        return cls(index, in_batch, per_record, [g.width for g in layout], module.step_loss,
                   choice, module.model.log_loss_weights)

    def step_plan(self, step: int) -> tuple[bool, bool]:
        """Whether step ``step`` (counted from 0) runs the shift, and per-record Adagrad."""
        shift = self.in_batch is not None and self.choice.shifting(step)
        per_record = self.per_record is not None and (
            self.in_batch is None or (shift and self.choice.per_record))
        return shift, per_record

    def wide_multiplier(self) -> float | None:
        """The wide tables' multiplier of the next step (None: no adapted wide rate)."""
        if self.in_batch is None or self.in_batch.wide_rate is None:
            return None
        return self.in_batch.wide_multiplier

    def end_step(self, records: int, shifted: bool) -> None:
        """Ends a step of ``records`` records (every rank's): the choice's decision."""
        if self.in_batch is None:
            return
        self.choice.end_step(self.in_batch.gain, records, shifted)

    def status(self) -> dict | None:
        """``/status``'s ``in_batch``: choice, gain, wide multiplier, where the slopes come from."""
        if self.in_batch is None:
            return None
        wide = self.wide_multiplier()
        return {**self.choice.status(), **self.in_batch.gain.status(),
                "wide_multiplier": round(wide, 4) if wide is not None else None,
                "loss_slopes": self.in_batch.slopes_from}

    def pairs(self, batch: Batch, n: int, dtype: torch.dtype) -> RowPairs | None:
        """The step's (table row, record) pairs of this rank's ``n`` records."""
        return self.index.pairs(batch.sparse, n, dtype) if n else None

    def shift(self, batch: Batch, output: ModelOutput, mine: ModelOutput,
              sizes: Sequence[int], pairs: RowPairs | None, lr: float) -> torch.Tensor:
        """In-batch learning's logit shifts of this rank's records (a collective with ranks).

        Args:
            batch: this rank's batch.
            output: the step's forward (padded to the step's largest batch with ranks).
            mine: its rows of this rank's records.
            sizes: every rank's records this step.
            pairs: :meth:`pairs`.
            lr: the tables' learning rate.

        Returns:
            ``[n]`` shifts to add to ``mine.logits``.
        """
        assert self.in_batch is not None
        n = batch.size
        jac = None
        if pairs is not None:
            grads = torch.autograd.grad(output.logits[:n].sum(), output.pooled,
                                        retain_graph=True, allow_unused=True)
            logits = mine.logits
            jac = torch.cat([g[:n].detach() if g is not None
                             else logits.new_zeros(n, w)
                             for g, w in zip(grads, self._group_widths, strict=True)], 1)
        pooled = tuple(p.detach() for p in mine.pooled)
        share = n / sum(sizes)  # the step's table update: each rank's loss by its share

        def loss_at(at: torch.Tensor) -> torch.Tensor:
            return self._loss(ModelOutput(at, pooled), batch) * share

        weights = self._log_loss_weights(batch) if self._log_loss_weights is not None else None
        log_loss = record_log_loss(weights, batch.labels, share)
        return self.in_batch.logit_shift(pairs, jac, mine.logits.detach(), loss_at, lr,
                                         log_loss)

    def trained_loss(self, loss: float, n: int, sizes: Sequence[int]) -> None:
        """The step's loss on this rank's ``n`` shifted records (in-batch learning's gain)."""
        if self.in_batch is not None:
            self.in_batch.trained_loss(loss * n / sum(sizes) if n else 0.0)

    def before_backward(self, output: ModelOutput) -> list[torch.Tensor | None] | None:
        """Hooks the pooled groups for per-record Adagrad (None: off)."""
        if self.per_record is None:
            return None
        return hook_pooled_gradients(output.pooled)

    def after_backward(self, grads: list[torch.Tensor | None] | None, pairs: RowPairs | None,
                       n: int, lr: float) -> None:
        """Each record's squared gradient in the accumulators (a collective with ranks)."""
        if self.per_record is not None and grads is not None:
            self.per_record.apply(pairs, grads, n, lr)


def in_batch_status(learning: RowPairLearning | None, config: pipeline_pb2.EasyRecConfig,
                    world_size: int) -> dict:
    """``/status``'s ``in_batch``: mode, phase, gain (``RowPairLearning.status``).

    Off: the mode, and where the config does not write ``in_batch_learning``, what keeps it
    off (``in_batch_refusal``).
    """
    status = learning.status() if learning is not None else None
    if status is not None:
        return status
    refusal = (in_batch_refusal(config, world_size)
               if not config.train_config.HasField("in_batch_learning") else None)
    return {"mode": IN_BATCH_OFF, **({"why": f"{refusal[0]}: {refusal[1]}"} if refusal else {})}
