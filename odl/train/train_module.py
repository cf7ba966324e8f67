"""Everything the train loop needs from the model, hiding DMP / TorchRec details.

``TrainModule`` builds the model, fuses the table optimizer into backward
(``apply_optimizer_in_backward`` -> fbgemm TBE), wraps the model in a single-process
``DistributedModelParallel`` (tables sharded table-wise on rank 0 with the fused kernel; no
data-parallel wrapper: one process has nothing to all-reduce) and runs predict-then-train
steps. Tables whose optimizer fbgemm lacks run row-sparse (``odl.train.row_sparse_tables``).

Its checkpoint state (what a checkpoint holds, save, restore into any number of ranks, warm
start) is written in ``odl.train.module_state``; the tables as this rank holds them are read
and written through ``odl.train.table_shards``.

Dynamic tables: a training step first maps the batch's raw ids to rows
(``DynamicTables.remap``: admission, eviction), resets the weights and table-optimizer state
of the rows evicted to make room (``reset_embedding_rows``, accumulators to 0), trains, then
runs the tables' maintenance pass when due (expiry) and resets those rows too. ``predict``
maps without admitting. Stream time for the tables is the newest event time trained on when
the batches carry event times, else the clock.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.config.in_batch_settings import IN_BATCH_OFF, IN_BATCH_ON, in_batch_mode
from odl.config.loss_settings import num_classes, regression_outputs, task_classes, ziln_settings
from odl.config.optimizer_support import (
    dense_ema_used,
    table_gradient_multiplier,
    table_kernel_kind,
)
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_model import ModelOutput, predictions
from odl.models.dynamic.dynamic_table import DynamicTable
from odl.models.dynamic.model_tables import DynamicTables
from odl.models.embedding_tables import WIDE_SUFFIX, init_embedding_weights
from odl.models.model_registry import build_model
from odl.models.subnormal_floats import flush_subnormal_floats
from odl.protos import pipeline_pb2
from odl.train import module_state
from odl.train.dense_ema import build_dense_ema
from odl.train.dense_parts import build_dense_optimizer
from odl.train.distributed import (
    ROW_WISE_MIN_ROWS,
    NoDataParallel,
    agree,
    average_gradients,
    broadcast_parameters,
    join_process_group,
    local_world_size,
    table_placement,
)
from odl.train.dynamic_rows import DynamicRows, dynamic_partitions, held_partitions
from odl.train.frozen_parameters import changing_tables, freeze_dense, frozen_parameters
from odl.train.in_batch.in_batch_learning import ShiftGain
from odl.train.in_batch.row_pair_learning import RowPairLearning, in_batch_status
from odl.train.in_batch.wide_rate import WideRate, start_level
from odl.train.learning_rates import LearningRates
from odl.train.optimizer_builder import (
    dense_part_specs,
    gradient_clipping,
    optimizer_specs,
    table_accumulator_start,
)
from odl.train.published_rows import PublishedRows
from odl.train.row_sparse_rules import row_sparse_rule
from odl.train.row_sparse_tables import RowSparseTables
from odl.train.step_output import StepOutput
from odl.train.table_gradient_scale import scale_table_gradients
from odl.train.table_growth import TableGrowth, grow_if_due, size_for_state, table_rows_at_start
from odl.train.table_shards import (
    EBC_PREFIX,
    ShardRows,
    fill_states,
    init_local_shards,
    local_shards,
    local_view,
)
from odl.train.torch_runtime import resolve_device

logger = logging.getLogger(__name__)


class TrainModule:
    """Model + optimizers + DMP for one training process.

    Args:
        config: the pipeline config.
        feature_builder: the feature builder of the same config.
        device: ``"auto"`` (CUDA if available else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        row_wise_min_rows: with several ranks, tables of at least this many rows are split
            by rows (``odl.train.distributed``).
        table_rows: growing dynamic table -> its rows (``odl.train.table_growth``: a growth or
            a restore rebuilds the module with them and writes the tables' rows itself);
            None: their start rows, every table initialized.

    Attributes:
        global_step: number of training steps taken (restored by ``load_checkpoint_state``).
        rank: this process's rank; world_size: the ranks training the model together (1
            unless started by ``torchrun``; ``odl.train.distributed``).
        device: the device the model runs on.
    """

    def __init__(
        self,
        config: pipeline_pb2.EasyRecConfig,
        feature_builder: FeatureBuilder,
        device: str = "auto",
        row_wise_min_rows: int = ROW_WISE_MIN_ROWS,
        table_rows: Mapping[str, int] | None = None,
    ) -> None:
        self.build_arguments = (config, feature_builder, device, row_wise_min_rows)
        # a rebuild at more rows (odl.train.table_growth) keeps its growth record and step
        self.growth: TableGrowth = self.__dict__.get("growth") or TableGrowth()
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":  # dense weights decay into subnormals (that module)
            flush_subnormal_floats()
        self.rank, self.world_size = join_process_group(self.device)
        self.seed = int(config.train_config.seed)
        torch.manual_seed(self.seed)
        sized = table_rows_at_start(config, feature_builder, self.world_size, table_rows)
        self.model = build_model(config, sized)
        self.frozen = freeze_dense(self.model, frozen_parameters(config, self.model))
        self._feature_builder = feature_builder
        # per output: a regression predicts its logit, the others sigmoid(logit)
        self.regression = regression_outputs(config)
        self.softmax = num_classes(config) > 1  # a num_class model: softmax over its classes
        self.task_classes = task_classes(config)  # a two-class task: softmax over its pair
        self.ziln = ziln_settings(config)  # a ZILN_LOSS model: probability and value
        self._sparse_spec, self._dense_spec = optimizer_specs(config.train_config)
        self.in_batch_mode = in_batch_mode(config, self.world_size)
        # the wide tables' multiplier at the start (in-batch learning: adapted while training)
        self.wide_lr_multiplier = start_level(config.train_config,
                                              self.in_batch_mode == IN_BATCH_ON)
        self.rates = LearningRates(self._sparse_spec, self._dense_spec, self.wide_lr_multiplier,
                                   separate_wide=self.in_batch_mode != IN_BATCH_OFF)
        self.rates.fuse_table_optimizer(self.model.ebc, self.device.type, self.frozen.tables)
        self.table_kind = table_kernel_kind(self._sparse_spec.kind)
        self.model.dense.to(self.device)
        table_configs = list(self.model.ebc.embedding_bag_configs())
        tables = [c.name for c in table_configs]
        self._table_shapes = {c.name: (int(c.num_embeddings), int(c.embedding_dim))
                              for c in table_configs}
        specs = {s.name: s for s in sized.table_specs
                 if s.dynamic is not None and s.name in set(tables) | {
                     t[: -len(WIDE_SUFFIX)] for t in tables if t.endswith(WIDE_SUFFIX)}}
        partitions = dynamic_partitions(config, specs, self.world_size)
        split_by_id = {t for base in specs for t in (base, base + WIDE_SUFFIX)
                       if partitions > 1 and t in tables}
        placement = table_placement(
            {c.name: (c.num_embeddings, c.embedding_dim) for c in table_configs},
            self.world_size, row_wise_min_rows, row_wise=split_by_id)
        plan = construct_module_sharding_plan(
            self.model.ebc,
            {t: (row_wise(compute_kernel="fused") if placement[t].row_wise
                 else table_wise(rank=placement[t].rank, compute_kernel="fused"))
             for t in tables},
            local_size=local_world_size(self.world_size), world_size=self.world_size,
            device_type=self.device.type,
        )
        # the dense part is not wrapped in DDP: with several ranks train_step all-reduces
        # its gradients itself (odl.train.distributed.average_gradients)
        self._dmp = DistributedModelParallel(
            self.model, device=self.device, plan=ShardingPlan({"ebc": plan}),
            data_parallel_wrapper=NoDataParallel(),
        )
        self._table_views: dict[str, torch.Tensor] | None = None  # embedding_tables()'s
        # (registered before the row-sparse tables' hooks, which capture the scaled gradient)
        self._gradient_scale = scale_table_gradients(
            self._dmp, table_gradient_multiplier(config.train_config), self.frozen.tables)
        rule = row_sparse_rule(self._sparse_spec, self.device.type)  # None: fused updates
        self.row_sparse = None if rule is None else RowSparseTables(
            self._dmp, rule, self.wide_lr_multiplier, self.world_size,
            self._sparse_spec.params.get("max_gradient"), self.frozen.tables)
        if table_rows is None and self.world_size == 1:  # (a rebuild writes every row)
            init_embedding_weights(self.embedding_tables(), self.seed)
        elif table_rows is None:
            init_local_shards(self._dmp, self.seed)
        # TF's Adagrad starts its accumulators at initial_accumulator_value, fbgemm's at 0
        self.table_state_start = table_accumulator_start(self._sparse_spec, self.device.type)
        if self.table_state_start:
            fill_states(self._dmp.fused_optimizer.state_dict()["state"], self.table_state_start)
        self.dynamic = DynamicTables(
            {n: s.dynamic for n, s in specs.items()},
            {n: s.feature_names for n, s in specs.items()}, self.seed,
            record_deletes=config.train_config.HasField("incr_save_config"),
            partitions=partitions,
            held=held_partitions(partitions, self.rank, self.world_size))
        self.published_rows = PublishedRows(self)
        self.dynamic_rows = DynamicRows(
            self, {f for s in specs.values() for f in s.feature_names})
        self.dynamic_torch_tables = {
            base: [t for t in (base, base + WIDE_SUFFIX) if t in tables] for base in specs}
        self._dynamic_of_torch = {t: self.dynamic.tables[base]
                                  for base, ts in self.dynamic_torch_tables.items() for t in ts}
        self._row_views: tuple[dict, dict] | None = None
        self._shard_views: dict[str, tuple[Any, list[Any]]] | None = None
        self.dynamic_rows.attach_disk_tier(config)
        self.stream_time = 0.0
        if self.world_size > 1:  # every rank starts from rank 0's dense parameters
            broadcast_parameters(list(self._dense_module().parameters()))
        self._dense_params = [p for p in self._dense_module().parameters() if p.requires_grad]
        self.dense_optimizer = build_dense_optimizer(
            [(f"dense.{n}", p) for n, p in self._dense_module().named_parameters()],
            self._dense_spec, dense_part_specs(config.train_config))
        self._grad_clip = gradient_clipping(config.train_config)  # dense gradients only
        self.dense_ema = build_dense_ema(config, self._dense_module())  # None: no ema
        self.serves_dense_ema = self.dense_ema is not None and dense_ema_used(config, "export")
        self.evaluates_dense_ema = self.dense_ema is not None and dense_ema_used(config, "eval")
        self.global_step: int = self.__dict__.get("global_step", 0)
        # in-batch learning and per-record Adagrad (None when both are off)
        self.row_pair_learning = RowPairLearning.build(self, config, table_configs)
        self._touched_rows_hook: Callable[[KeyedJaggedTensor], None] | None = None
        self._extra_touched_rows_hooks: list[Callable[[KeyedJaggedTensor], None]] = []
        logger.info(
            "TrainModule on %s: %d tables, sparse %s, dense %s", self.device, len(tables),
            self._sparse_spec.kind, self._dense_spec.kind)

    # -- accessors --------------------------------------------------------------------------

    @property
    def dmp(self) -> DistributedModelParallel:
        """The wrapped model (for benchmarks and debugging)."""
        return self._dmp

    @property
    def fused_optimizer(self) -> Any:
        """TorchRec's keyed optimizer of the fused table updates (row-sparse state joined)."""
        fused = self._dmp.fused_optimizer
        return fused if self.row_sparse is None else self.row_sparse.optimizer_view(fused)

    def step_loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The model's training loss of ``output`` on ``batch``."""
        return self._module().training_loss(output, batch)

    def _module(self) -> nn.Module:
        return self._dmp.module

    def _dense_module(self) -> nn.Module:
        return self._dmp.module.dense

    def embedding_tables(self) -> dict[str, torch.Tensor]:
        """Table name -> live full weight tensor (on the model's device; do not resize).

        The views are taken once (the DMP's ``state_dict`` costs milliseconds, and the
        publisher reads the tables at every version): the tables' storage lives as long as
        the DMP, restores copy into it, and a table that grows builds a new module.
        """
        if self._table_views is None:
            self._table_views = {
                name[len(EBC_PREFIX) : -len(".weight")]: local_view(t)
                for name, t in self._dmp.state_dict().items()
                if name.startswith(EBC_PREFIX) and name.endswith(".weight")}
        return dict(self._table_views)

    def table_rows(self) -> dict[str, ShardRows]:
        """Table name -> its rows as written through to this rank's shards.

        For copying whole-table rows (crash recovery's delta rows) with several ranks: each
        rank writes the rows and columns its shards hold and skips the rest.
        """
        out = {}
        for name, t in self._dmp.state_dict().items():
            if name.startswith(EBC_PREFIX) and name.endswith(".weight"):
                out[name[len(EBC_PREFIX):-len(".weight")]] = ShardRows(
                    local_shards(t), tuple(int(x) for x in t.size()))
        return out

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """Table name -> ``(rows, stored columns)`` of the whole table, on any rank."""
        return dict(self._table_shapes)

    def read_rows(self, requested: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Current values of table rows, wherever their shard lives (``PublishedRows``).

        With several ranks a collective: rank 0 gets every rank's wanted rows, the others
        ``{}``.
        """
        return self.published_rows.read_rows(requested)

    def raw_ids(self, table: str, rows: np.ndarray) -> np.ndarray:
        """The raw ids rows of a dynamic table hold (-1: free; ``PublishedRows.raw_ids``)."""
        return self.published_rows.raw_ids(table, rows)

    def take_deleted(self, consumer: str) -> dict[str, np.ndarray]:
        """Dynamic table -> raw ids evicted since ``consumer``'s last take (unique).

        Split by id over several ranks a collective: rank 0 gets every partition's ids.
        """
        return self.published_rows.take_deleted(consumer)

    def dense_parameters(self) -> dict[str, torch.Tensor]:
        """``dense.*`` name -> live dense parameter / buffer tensor."""
        d = self._dense_module()
        out = {f"dense.{k}": v for k, v in d.named_parameters()}
        out.update({f"dense.{k}": v for k, v in d.named_buffers()})
        return out

    def served_dense_parameters(self) -> dict[str, torch.Tensor]:
        """``dense_parameters()`` as serving receives them (the EMA where it is served).

        The dense EMA's averages stand in for the parameters where
        ``export_config.use_dense_ema`` says so (``odl.train.dense_ema``).
        """
        out = self.dense_parameters()
        if self.serves_dense_ema:
            out.update(self.dense_ema.averages())
        return out

    def dynamic_table(self, table: str) -> DynamicTable | None:
        """The dynamic table behind a TorchRec table (``<t>`` or ``<t>_wide``), else None."""
        return self._dynamic_of_torch.get(table)

    def feature_tables(self, changing: bool = False) -> dict[str, list[str]]:
        """Embedded feature -> its tables; ``changing``: not the frozen fixed ones (trackers')."""
        out = self._module().layout.feature_tables()
        return changing_tables(out, self.frozen, self._dynamic_of_torch) if changing else out

    # -- steps ------------------------------------------------------------------------------

    def current_learning_rates(self) -> tuple[float, float]:
        """``(sparse, dense)`` rates for the next step."""
        return self.rates.at(self.global_step)

    def set_touched_rows_hook(self, hook: Callable[[KeyedJaggedTensor], None] | None) -> None:
        """Registers ``hook(kjt)``, called once per training step with the step's ids.

        The KJT's keys are feature names; ``feature_tables()`` maps them to tables. A delta
        tracker uses this to record which rows each table touched.
        """
        self._touched_rows_hook = hook

    def add_table_growth_hook(self, hook: Callable[[dict[str, tuple[int, int]]], None]) -> None:
        """Registers ``hook(table_shapes())``, called after growing tables grew."""
        self.growth.hooks.append(hook)

    def add_touched_rows_hook(self, hook: Callable[[KeyedJaggedTensor], None]) -> None:
        """Registers one more ``hook(kjt)`` beside ``set_touched_rows_hook``'s.

        A second delta tracker uses it, e.g. the per-pass delta files of a file stream.
        """
        self._extra_touched_rows_hooks.append(hook)

    def row_state_views(self) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Live table weights and table-optimizer state tensors (cached views)."""
        if self._row_views is None:
            tables = self.embedding_tables()
            states: dict[str, list[torch.Tensor]] = {}
            for pname, st in self.fused_optimizer.state_dict()["state"].items():
                states[pname] = [local_view(v) for v in st.values()
                                 if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")]
            self._row_views = (tables, states)
        return self._row_views

    def table_shards(self, table: str) -> tuple[Any, list[Any]]:
        """A table's weight and optimizer state tensors as this rank holds them (cached).

        Each is a ShardedTensor with several ranks (``_local_shards`` gives its local
        shards and their offsets); the state list is empty for SGD.
        """
        if self._shard_views is None:
            model = self._dmp.state_dict()
            states = self.fused_optimizer.state_dict()["state"]
            self._shard_views = {
                key[len(EBC_PREFIX):-len(".weight")]: (
                    t, [v for v in states.get(key, {}).values()
                        if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")])
                for key, t in model.items()
                if key.startswith(EBC_PREFIX) and key.endswith(".weight")}
        return self._shard_views[table]

    @property
    def has_touched_rows_hooks(self) -> bool:
        """Whether anything records the rows each step touches (a publisher, pass saves)."""
        return self._touched_rows_hook is not None or bool(self._extra_touched_rows_hooks)

    def dynamic_status(self) -> dict[str, dict[str, Any]]:
        """Per dynamic table: ``DynamicTables.status()`` plus ``memory_bytes``.

        ``memory_bytes`` counts its rows and their optimizer state in every TorchRec table it
        backs, and its id index, counters and sketch. While growing tables grow, the status
        from before the growth.
        """
        frozen = self.growth.frozen_status
        return frozen if frozen is not None else self.dynamic_rows.status()

    def shrink_dynamic(self, now: float | None = None) -> dict[str, int]:
        """Runs every dynamic table's maintenance pass now (``DynamicRows.shrink``).

        Returns:
            Dynamic table -> rows evicted (their rows are reset).
        """
        return self.dynamic_rows.shrink(now)

    def reset_dynamic_rows(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """Fresh weights and restarted optimizer state for evicted rows (dynamic table -> rows)."""
        self.dynamic_rows.reset(evicted, step)

    def record_touched_rows(self, kjt: KeyedJaggedTensor) -> None:
        """Called by ``train_step`` with the batch's ids (after the update)."""
        if self._touched_rows_hook is not None:
            self._touched_rows_hook(kjt)
        for hook in self._extra_touched_rows_hooks:
            hook(kjt)

    def train_step(self, batch: Batch, sizes: Sequence[int] | None = None) -> StepOutput:
        """One predict-then-train step of this rank (a collective with several ranks).

        One process is the one rank of a job of one. With several, every rank calls it at
        every step, with ``empty_batch()`` when it has no records, and the update is the one
        a single process makes on all ranks' records of the step (their mean loss): each
        rank's loss is weighted by its share of the step's records, the dense gradients are
        averaged. A step with no records on any rank changes nothing. Every rank pads its
        batch to the step's largest (``Batch.padded``: samples without ids, left out of the
        loss), as TorchRec's sharded lookup needs one batch size on all ranks. Samples with
        a non-finite prediction (a feature value that overflows the network would turn every
        parameter it reaches into NaN) are left out; when any rank leaves some out, every
        rank runs its forward again, so the collectives match.

        Args:
            batch: the batch (any device; moved to the model's).
            sizes: every rank's batch size this step, in rank order, when the caller agreed
                them already (the trainer's turn); None: the step agrees them (one
                all-gather more with several ranks).

        Returns:
            The forward pass's predictions (before the update) and the loss. They equal
            ``predict(batch)`` called just before the step unless the model has batch norm or
            dropout (the step's forward runs in train mode) or the step runs in-batch
            learning (each record shifted by the batch's earlier ones:
            ``odl.train.in_batch``).
        """
        wide = (self.row_pair_learning.wide_multiplier() if self.row_pair_learning is not None
                else None)
        if wide is not None:  # taken by the fused kernel at the forward
            self.rates.set_wide_multiplier(wide, self.fused_optimizer)
        self.rates.set(self.global_step, self.fused_optimizer, self.dense_optimizer)
        before = self.global_step
        now = 0.0
        if self.dynamic:
            batch, now = self.dynamic_rows.remap(batch)
        batch = batch.to(self.device)
        if not self._dmp.training:  # (train() walks every submodule: only when needed)
            self._dmp.train()
        out = self._step(batch, sizes)
        if self.dynamic and self.global_step != before:  # every rank alike
            expired = self.dynamic.maintain(self.global_step, now)
            if expired:
                self.dynamic_rows.reset(expired, self.global_step)
            grow_if_due(self)  # growing tables double at a step's end (every rank alike)
        return out

    def _step_sizes(self, batch: Batch, sizes: Sequence[int] | None) -> list[int]:
        """Every rank's batch size, in rank order (``[batch.size]`` with one rank)."""
        if sizes is None:
            return [batch.size] if self.world_size == 1 else [s for (s,) in agree([batch.size])]
        if sizes[self.rank] != batch.size:
            raise ValueError(f"rank {self.rank}: a batch of {batch.size} records, but "
                             f"{sizes[self.rank]} were agreed")
        return list(sizes)

    def _forward(self, batch: Batch, sizes: Sequence[int]) -> tuple[ModelOutput, ModelOutput]:
        """The forward of the batch padded to the step's largest, and its rows of ``batch``."""
        most = max(sizes)
        output = self._dmp(batch.padded(most) if most > batch.size else batch)
        if most == batch.size:
            return output, output
        # (an auxiliary loss stays the padded batch's: padding rows join it)
        return output, output.rows(batch.size)

    def _step(self, batch: Batch, sizes: Sequence[int] | None) -> StepOutput:
        """``train_step`` after the dynamic tables' remap (see there)."""
        sizes = self._step_sizes(batch, sizes)
        if sum(sizes) == 0:
            return StepOutput(probs=np.empty(0, dtype=np.float64), loss=float("nan"))
        output, mine = self._forward(batch, sizes)
        finite = torch.isfinite(mine.logits)
        if finite.dim() > 1:  # several outputs: a sample is finite when all its logits are
            finite = finite.all(dim=1)
        dropped = np.empty(0, dtype=np.int64)
        bad = int(not bool(finite.all()))
        if bad if self.world_size == 1 else any(b for (b,) in agree([bad])):
            dropped = (~finite).nonzero().flatten().cpu().numpy().astype(np.int64)
            if len(dropped):
                logger.warning("%d of %d samples have a non-finite prediction and are not "
                               "trained on (non_finite_output)", len(dropped), batch.size)
            batch = batch.select(finite)
            sizes = self._step_sizes(batch, None)
            if sum(sizes) == 0:
                return StepOutput(probs=np.empty(0, dtype=np.float64), loss=float("nan"),
                                  dropped=dropped)
            output, mine = self._forward(batch, sizes)
        n = batch.size
        learning = self.row_pair_learning
        shifting, per_record = (learning.step_plan(self.global_step) if learning is not None
                                else (False, False))
        pairs = (learning.pairs(batch, n, mine.logits.dtype)
                 if learning is not None and (shifting or per_record) else None)
        if shifting:  # each record predicted after its batch's earlier ones
            mine = dataclasses.replace(mine, logits=mine.logits + learning.shift(
                batch, output, mine, sizes, pairs, self.rates.tables))
        if n:
            loss = self._module().training_loss(mine, batch)
            weighted = loss if len(sizes) == 1 else loss * (n * len(sizes) / sum(sizes))
        else:  # no records here: a zero loss still runs the backward's collectives
            loss = torch.tensor(float("nan"))
            weighted = output.logits.sum() * 0.0
        if shifting:  # (in-batch learning: the shift's gain)
            learning.trained_loss(float(loss.detach()), n, sizes)
        pending = learning.before_backward(output) if per_record else None
        self.dense_optimizer.zero_grad(set_to_none=True)
        weighted.backward()  # table rows are updated inside backward (fused)
        if per_record:  # each record's squared gradient in the accumulators
            learning.after_backward(pending, pairs, n, self.rates.tables)
        if self.row_sparse is not None:  # the touched rows of Adam, FTRL, ... tables
            self.row_sparse.apply(self.rates.tables, self.global_step + 1)
        average_gradients(self._dense_params)  # nothing to average with one rank
        if self._grad_clip is not None:
            self._grad_clip(self.dense_optimizer)
        self.dense_optimizer.step()
        if self.dense_ema is not None:
            self.dense_ema.update()
        if learning is not None:  # in-batch learning decided by the stream: its windows
            learning.end_step(sum(sizes), shifting)
        self.global_step += 1
        self.record_touched_rows(batch.sparse)
        step_rows = self.dynamic_rows.take_step_rows()
        if step_rows is not None:  # split by id: every rank's dynamic rows of the step, so
            # this rank names and publishes its partitions' rows whoever trained them
            self.record_touched_rows(step_rows.to(self.device))
        probs = predictions(mine.logits.detach(), self.regression, self.softmax,
                            self.task_classes, self.ziln)
        return StepOutput(probs=probs, loss=float(loss.detach()), dropped=dropped)

    def empty_batch(self) -> Batch:
        """A batch of no records (a rank with nothing to train passes it to ``train_step``)."""
        return self._feature_builder.to_batch(self._feature_builder.empty_arrays())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Predictions (float64 ``[B]``) in eval mode; no update (dynamic tables: no admission).

        Ids on a disk tier come back to RAM first, their values unchanged, as for a step.
        With several ranks a collective: every rank calls it, those with nothing to predict
        with ``empty_batch()``; each gets its own batch's predictions (the batches are padded
        to the largest, as in ``train_step``).
        """
        if self.dynamic and self.world_size > 1 and self.dynamic.partitions > 1:
            batch = self.dynamic_rows.remap_ranks(batch, admit=False)[0]  # ids of every partition
        elif self.dynamic:  # ids on a disk tier come back to RAM, their values unchanged
            remapped = self.dynamic.remap(batch, self.global_step, time.time(), admit=False)
            if remapped.evicted or self.dynamic_rows.disk_tier:
                self.dynamic_rows.reset(remapped.evicted, self.global_step)
            batch = remapped.batch
        batch = batch.to(self.device)
        self._dmp.eval()
        try:
            logits = self._forward(batch, self._step_sizes(batch, None))[1].logits
        finally:
            self._dmp.train()
        return predictions(logits, self.regression, self.softmax, self.task_classes,
                           self.ziln)

    # -- checkpoints (odl.train.module_state) ------------------------------------------------

    @property
    def dynamic_split_over_ranks(self) -> bool:
        """Whether the dynamic tables are split by id over the ranks (each holding its share)."""
        return bool(self.dynamic) and self.world_size > 1 and self.dynamic.partitions > 1

    @property
    def wide_rate(self) -> WideRate | None:
        """The wide tables' adapted rate (in-batch learning with wide tables), else None."""
        return self.row_pair_learning.wide_rate if self.row_pair_learning is not None else None

    @property
    def in_batch_gain(self) -> ShiftGain | None:
        """How much in-batch learning's shift lowers the step's loss (None: not on)."""
        learning = self.row_pair_learning
        return learning.in_batch.gain if learning is not None and learning.in_batch else None

    def in_batch_status(self) -> dict:
        """``/status``'s ``in_batch`` (``row_pair_learning.in_batch_status``)."""
        return in_batch_status(self.row_pair_learning, self.build_arguments[0], self.world_size)

    def set_global_step(self, step: int) -> None:
        """Sets the step (a restore); the learning rates follow it at the next step."""
        self.global_step = int(step)
        self.rates.reset()

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """The full training state as plain CPU tensors (``module_state.checkpoint_state``).

        With several ranks a collective: rank 0 gets the whole state, the others ``{}``.
        """
        return module_state.checkpoint_state(self)

    def state_without_tables(self, model: dict[str, Any] | None = None,
                             dynamic_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint state but the tables, the same on every rank; not a collective."""
        return module_state.state_without_tables(self, model, dynamic_state)

    def table_part(self) -> dict[str, Any]:
        """This rank's rows of every table and their optimizer state, as a part document."""
        return module_state.table_part(self)

    def load_checkpoint_state(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restores a checkpoint state exactly (``module_state.load_state``).

        Raises:
            KeyError: ``strict`` and a name is missing or unexpected.
            ValueError: a shape differs.
        """
        size_for_state(self, state)  # growing tables at the rows the checkpoint holds
        if self.row_sparse is not None:  # a checkpoint of the substitutes before row-sparse
            state = self.row_sparse.upgrade_state(dict(state), self.rates)
        module_state.load_state(self, state, strict)

    def load_parameters(self, named_tensors: Mapping[str, torch.Tensor],
                        var_map: Mapping[str, str] | None = None,
                        dynamic_state: Mapping[str, Any] | None = None,
                        source_step: int = 0) -> module_state.WarmStartReport:
        """Warm start: parameters only, with renames (``module_state.load_parameters``).

        Raises:
            ValueError: a source tensor's shape differs.
        """
        if dynamic_state is not None:  # growing tables at the rows the source holds
            size_for_state(self, {"dynamic_tables": dynamic_state})
        return module_state.load_parameters(self, named_tensors, var_map, dynamic_state,
                                            source_step)
