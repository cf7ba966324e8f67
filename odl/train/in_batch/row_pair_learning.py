"""In-batch learning and per-record Adagrad as one training step uses them.

``train_config.in_batch_learning`` predicts each record after its batch's earlier ones (a
logit shift, :mod:`odl.train.in_batch.in_batch_learning`); ``per_record_adagrad`` counts a
batch's records one by one in Adagrad's accumulators
(:mod:`odl.train.in_batch.per_record_adagrad`). Both read a step's (table row, record) pairs
(:mod:`odl.train.in_batch.batch_row_pairs`). One rank holds whole tables and reads and
writes their rows directly; several read and write them in the shards that hold them
(:mod:`odl.train.in_batch.rank_in_batch`, :mod:`odl.train.in_batch.rank_per_record`).
:class:`RowPairLearning` is what ``TrainModule.train_step`` calls: the pairs, the shift
before the loss, and the accumulator corrections around the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from odl.features.batch import Batch
from odl.models.ctr_model import ModelOutput
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.protos import pipeline_pb2
from odl.train.in_batch.batch_row_pairs import RowPairIndex, RowPairs, TableRows
from odl.train.in_batch.in_batch_learning import InBatchLearning
from odl.train.in_batch.in_batch_scan import InBatchScan, error_model_is_exact, loss_slopes
from odl.train.in_batch.per_record_adagrad import PerRecordAdagrad, hook_pooled_gradients
from odl.train.in_batch.rank_in_batch import rank_logit_shift
from odl.train.in_batch.rank_per_record import RankPerRecordAdagrad
from odl.train.optimizer_builder import TABLE_EPS
from odl.train.table_shards import EBC_PREFIX, read_held_accumulators, write_held_rows

if TYPE_CHECKING:
    from odl.train.train_module import TrainModule

LossFn = Callable[[ModelOutput, Batch], torch.Tensor]


class RowPairLearning:
    """A step's in-batch learning and per-record Adagrad (module docstring).

    Made by :meth:`build`; ``in_batch`` and ``per_record`` are None when off.

    Args:
        index: the row-pair index of the model's lookups.
        in_batch: in-batch learning, or None.
        per_record: per-record Adagrad (``RankPerRecordAdagrad`` with several ranks), or None.
        rank: this process's rank; world_size: the ranks.
        lookup_tables: per lookup of the index, the TorchRec table it reads.
        read_held: reads per-record accumulators from the shards that hold them (ranks).
        table_kind: the tables' optimizer kernel (``"sgd"``, ``"adagrad"``, ...).
        loss: the model's loss of an output on a batch.
    """

    def __init__(self, index: RowPairIndex, in_batch: InBatchLearning | None,
                 per_record: PerRecordAdagrad | None, rank: int, world_size: int,
                 lookup_tables: list[str], read_held: Callable[..., Any], table_kind: str,
                 loss: LossFn) -> None:
        self.index = index
        self.in_batch = in_batch
        self.per_record = per_record
        self._rank = rank
        self._world_size = world_size
        self._lookup_tables = lookup_tables
        self._read_held = read_held
        self._table_kind = table_kind
        self._loss = loss

    @classmethod
    def build(cls, module: TrainModule, config: pipeline_pb2.EasyRecConfig,
              table_configs: list[EmbeddingBagConfig]) -> RowPairLearning | None:
        """``in_batch_learning``, ``per_record_adagrad`` and their row-pair index.

        None when both are off. Validation has checked the model (one output, for in-batch
        learning) and the table optimizer (SGD or (row-wise) Adagrad; (row-wise) Adagrad
        for per-record accumulators); the classes refuse any other. With several ranks the
        index has no table storage (no rank holds whole tables): in-batch learning runs
        through ``rank_in_batch`` and per-record Adagrad is ``RankPerRecordAdagrad``, both
        reading and writing rows in the shards that hold them.

        Args:
            module: the train module (its tables, ranks and model).
            config: the pipeline config.
            table_configs: the model's tables.

        Raises:
            ValueError: ``in_batch_sequential: false`` with several ranks.
        """
        tc = config.train_config
        if not (tc.in_batch_learning or tc.per_record_adagrad):
            return None
        world = module.world_size
        if world > 1 and not tc.in_batch_sequential:
            raise ValueError("train_config.in_batch_sequential: false is not implemented for "
                             "a model sharded over several ranks yet")
        kind = module.table_kind
        # several ranks: no rank holds whole tables; the accumulators come from their shards
        tables, states = module.row_state_views() if world == 1 else ({}, {})
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
        # per lookup of the index (group after group), the TorchRec table it reads
        lookup_tables = [t for g in layout for _, t in g.lookups]
        index = RowPairIndex(layout, rows, rowwise=kind == "rowwise_adagrad")
        # per-record accumulators of several ranks: read from the shards that hold them
        read_held = functools.partial(read_held_accumulators, module.table_shards,
                                      1 if kind == "rowwise_adagrad" else index.width)
        in_batch = None
        if tc.in_batch_learning:
            scan = (InBatchScan(kind, tc.per_record_adagrad,
                                float(tc.per_record_adagrad_max_gain), TABLE_EPS,
                                logistic=not any(module.regression),
                                exact=error_model_is_exact(config.model_config))
                    if tc.in_batch_sequential else None)
            in_batch = InBatchLearning(index, kind, TABLE_EPS, scan)
        per_record: PerRecordAdagrad | None = None
        if tc.per_record_adagrad:
            gain = float(tc.per_record_adagrad_max_gain)
            per_record = (PerRecordAdagrad(index, kind, TABLE_EPS, gain) if world == 1 else
                          RankPerRecordAdagrad(index, kind, TABLE_EPS, gain, lookup_tables,
                                               read_held,
                                               functools.partial(write_held_rows,
                                                                 module.table_shards)))
        return cls(index, in_batch, per_record, module.rank, world, lookup_tables, read_held,
                   kind, module.step_loss)

    def pairs(self, batch: Batch, n: int, dtype: torch.dtype) -> RowPairs | None:
        """The step's (table row, record) pairs of this rank's ``n`` records."""
        return self.index.pairs(batch.sparse, n, dtype) if n else None

    def shift(self, batch: Batch, output: ModelOutput, mine: ModelOutput,
              sizes: Sequence[int], pairs: RowPairs | None, lr: float) -> torch.Tensor:
        """In-batch learning's logit shifts of this rank's records.

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
        if self._world_size > 1:
            return self._rank_shift(batch, output, mine, sizes, pairs, lr)
        # the loss at the unshifted logits: not needed by the sequential pass
        loss = None if self.in_batch.sequential is not None else self._loss(mine, batch)
        pooled = tuple(p.detach() for p in mine.pooled)
        return self.in_batch.logit_shift(
            pairs, mine, loss, lr, lambda at: self._loss(ModelOutput(at, pooled), batch))

    def _rank_shift(self, batch: Batch, output: ModelOutput, mine: ModelOutput,
                    sizes: Sequence[int], pairs: RowPairs | None, lr: float) -> torch.Tensor:
        """The shifts with several ranks (``odl.train.in_batch.rank_in_batch``).

        Their loss slopes are the ones the ranked update gives the tables (the weighted
        loss's over the number of ranks).
        """
        assert self.in_batch is not None and self.in_batch.sequential is not None
        n = batch.size
        logits = mine.logits
        jac: tuple[torch.Tensor | None, ...] = tuple(None for _ in output.pooled)
        slope = curve = np.empty(0, dtype=np.float32)
        if n:
            grads = torch.autograd.grad(output.logits[:n].sum(), output.pooled,
                                        retain_graph=True, allow_unused=True)
            jac = tuple(g[:n] if g is not None else None for g in grads)
            pooled = tuple(p.detach() for p in mine.pooled)
            share = n / sum(sizes)  # the weighted loss over the ranks: each record's share

            def loss_at(at: torch.Tensor) -> torch.Tensor:
                return self._loss(ModelOutput(at, pooled), batch) * share

            slope, curve = loss_slopes(loss_at, logits.detach())
        return rank_logit_shift(
            self._rank, self.index, self.in_batch.sequential, self._lookup_tables, pairs,
            jac, logits, slope, curve, lr,
            self._read_held if self._table_kind != "sgd" else None)

    def before_backward(self, pairs: RowPairs | None, output: ModelOutput,
                        mine: ModelOutput) -> Any:
        """What per-record Adagrad keeps of the step before its backward (None: off)."""
        if self.per_record is None:
            return None
        if isinstance(self.per_record, RankPerRecordAdagrad):
            return hook_pooled_gradients(output.pooled)
        return self.per_record.before_backward(pairs, mine.pooled)

    def after_backward(self, pending: Any, pairs: RowPairs | None, n: int, lr: float) -> None:
        """Each record's squared gradient in the accumulators, after the backward."""
        if self.per_record is None:
            return
        if isinstance(self.per_record, RankPerRecordAdagrad):
            self.per_record.apply_ranks(pairs, pending, n, self._world_size, lr)
        elif pending is not None:
            self.per_record.apply(pending, lr)
