"""Everything the train loop needs from the model, hiding DMP / TorchRec details.

``TrainModule`` builds the model, fuses the table optimizer into backward
(``apply_optimizer_in_backward`` -> fbgemm TBE), wraps the model in a single-process
``DistributedModelParallel`` (tables sharded table-wise on rank 0 with the fused kernel; no
data-parallel wrapper: one process has nothing to all-reduce) and runs predict-then-train
steps.

Checkpoint state (``state_dict_for_checkpoint``), all plain CPU tensors::

    {
      "format": "odl.train_module/1",
      "global_step": int,
      "model": {name: Tensor},            # parameters and buffers, e.g.
                                          # "ebc.embedding_bags.C1.weight" [rows, dim],
                                          # "dense.dnn.0.weight", "dense.wide_bias"
      "dense_optimizer": torch.optim state_dict (tensors on CPU),
      "sparse_optimizer": {table_param_name: {state_name: Tensor}},
                                          # e.g. {"ebc.embedding_bags.C1.weight":
                                          #        {"C1.momentum1": Tensor[rows]}}
    }

Table weights are full tensors (with several ranks ``state_dict_for_checkpoint`` gathers
them on rank 0; a checkpoint of several ranks is written instead from
``state_without_tables`` and each rank's ``table_part``, ``odl.checkpoint.table_parts``,
which reading the checkpoint makes whole again). Wide tables keep their stored
width (see ``odl.models.embedding_tables``). A model with dynamic tables
(``odl.models.dynamic``) adds ``"dynamic_tables"``: ``DynamicTables.state_dict()``
(id index, free rows, counters, sketch, pending deletes; tensors) plus ``"stream_time"``.

Dynamic tables: a training step first maps the batch's raw ids to rows
(``DynamicTables.remap``: admission, eviction), resets the weights and table-optimizer state
of the rows evicted to make room (``reset_embedding_rows``, accumulators to 0), trains, then
runs the tables' maintenance pass when due (expiry) and resets those rows too. ``predict``
maps without admitting. Stream time for the tables is the newest event time trained on when
the batches carry event times, else the clock.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from odl.checkpoint import table_parts
from odl.config.config_error import ConfigError
from odl.config.loss_settings import num_classes, regression_outputs
from odl.config.optimizer_support import table_kernel_kind
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.ctr_model import ModelOutput, predictions
from odl.models.dynamic.dynamic_table import DynamicTable
from odl.models.dynamic.model_tables import UNHELD, DynamicTables
from odl.models.dynamic.partitions import partition_spans
from odl.models.dynamic.resplit import resplit_state, saved_partitions
from odl.models.embedding_tables import (
    WIDE_SUFFIX,
    init_embedding_weights,
    initial_rows,
    reset_embedding_rows,
)
from odl.models.model_factory import build_model
from odl.models.subnormal_floats import flush_subnormal_floats
from odl.protos import pipeline_pb2
from odl.train.batch_row_pairs import RowPairIndex, RowPairs, TableRows
from odl.train.distributed import (
    ROW_WISE_MIN_ROWS,
    agree,
    arrays_from_every_rank,
    average_gradients,
    broadcast_parameters,
    from_every_rank,
    gather_to_rank0,
    int64_from_every_rank,
    join_process_group,
    local_world_size,
    table_placement,
)
from odl.train.in_batch_learning import InBatchLearning
from odl.train.in_batch_scan import InBatchScan, error_model_is_exact, loss_slopes
from odl.train.optimizer_builder import (
    TABLE_EPS,
    gradient_clipping,
    make_dense_optimizer,
    optimizer_specs,
    sparse_optimizer_args,
)
from odl.train.per_record_adagrad import PerRecordAdagrad, hook_pooled_gradients
from odl.train.rank_in_batch import rank_logit_shift
from odl.train.rank_per_record import RankPerRecordAdagrad

logger = logging.getLogger(__name__)

# a re-split copies the rows moving with their ids this many at a time
_RESPLIT_CHUNK_ROWS = 1 << 16

CHECKPOINT_FORMAT = "odl.train_module/1"
EBC_PREFIX = "ebc.embedding_bags."


@dataclass
class StepOutput:
    """Result of one training step.

    Attributes:
        probs: float64 predictions of the step's forward pass, i.e. made before the step's
            update (progressive validation), one per trained sample (``[B]`` unless samples
            were dropped).
        loss: the step's loss (including regularization); NaN when nothing was trained.
        dropped: ``int64`` indices (into the batch) of the samples left out because their
            prediction was not finite; they were not trained on.
    """

    probs: np.ndarray
    loss: float
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    @property
    def trained(self) -> int:
        """Number of samples the step trained on."""
        return int(self.probs.shape[0])


@dataclass
class WarmStartReport:
    """What ``load_parameters`` did.

    Attributes:
        loaded: ``(name, source name)`` pairs copied.
        missing: own names with no source tensor (kept their initial values).
        unused: source names nothing was loaded from.
    """

    loaded: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


class _NoDataParallel(DataParallelWrapper):
    """Leaves dense parameters unwrapped (no DDP).

    One process needs no all-reduce; several average their gradients in ``train_step``
    (``odl.train.distributed``).
    """

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv,
             device: torch.device) -> None:
        return None


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as given.

    A CUDA device without an index is the rank's own GPU under ``torchrun``
    (``cuda:<LOCAL_RANK>``), so the ranks of one host do not all share GPU 0.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return rank_device(torch.device(device), os.environ.get("LOCAL_RANK"))


def rank_device(device: torch.device, local_rank: str | None) -> torch.device:
    """``cuda`` without an index -> ``cuda:<local_rank>`` when a local rank is set."""
    if device.type == "cuda" and device.index is None and local_rank:
        return torch.device("cuda", int(local_rank))
    return device


def to_full_cpu(t: Any) -> torch.Tensor:
    """A plain, full, detached CPU copy of a tensor, ShardedTensor or DTensor."""
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        out = torch.empty(tuple(t.size()), dtype=t.dtype)
        for shard in t.local_shards():
            off = shard.metadata.shard_offsets
            sizes = shard.metadata.shard_sizes
            idx = tuple(slice(o, o + s) for o, s in zip(off, sizes, strict=True))
            out[idx] = shard.tensor.detach().cpu()
        return out
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _local_view(t: Any) -> torch.Tensor:
    """The writable full local tensor of a single-worker ShardedTensor / DTensor / tensor."""
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        shards = t.local_shards()
        if len(shards) != 1 or tuple(shards[0].tensor.shape) != tuple(t.size()):
            raise RuntimeError("this needs a table whole in this process, and this rank "
                               "holds part of it (a model sharded over several ranks)")
        return shards[0].tensor
    if hasattr(t, "to_local"):
        return t.to_local()
    return t


class ShardRows:
    """A whole table as far as writing rows goes, written through to this rank's shards.

    Supports what copying recovered rows needs (``publisher.delta_recovery``) and resetting
    a dynamic table's evicted rows (``reset_embedding_rows``): ``shape``, ``device``,
    ``dtype``, ``rows[:, :dim]`` (the first ``dim`` columns), ``rows[ids] = values`` (``ids``
    whole-table row numbers, ``values`` ``[len(ids), dim]``), ``index_copy_`` and
    ``index_fill_`` of rows: each shard takes the rows and columns it holds.

    Args:
        shards: ``[(offsets, shard tensor)]`` of this rank.
        shape: the whole table's ``(rows, columns)``.
        columns: the columns written (the first ``columns``; None: all).
    """

    def __init__(self, shards: list[tuple[tuple[int, ...], torch.Tensor]],
                 shape: tuple[int, ...], columns: int | None = None) -> None:
        self._shards = shards
        self._whole = shape
        self._columns = shape[1] if columns is None else columns
        self.shape = (shape[0], self._columns)
        self.device = shards[0][1].device if shards else torch.device("cpu")
        self.dtype = shards[0][1].dtype if shards else torch.float32

    def __getitem__(self, key: Any) -> ShardRows:
        rows, cols = key
        if rows != slice(None) or cols.start not in (None, 0) or cols.step not in (None, 1):
            raise TypeError("ShardRows takes [:, :dim] only")
        return ShardRows(self._shards, self._whole, min(cols.stop, self._columns))

    def index_copy_(self, dim: int, ids: torch.Tensor, values: torch.Tensor) -> ShardRows:
        """``rows[ids] = values`` (``dim`` 0), as ``Tensor.index_copy_``."""
        if dim != 0:
            raise TypeError("ShardRows copies rows only")
        self[ids] = values
        return self

    def index_fill_(self, dim: int, ids: torch.Tensor, value: float) -> ShardRows:
        """``rows[ids] = value`` (``dim`` 0), as ``Tensor.index_fill_``."""
        return self.index_copy_(dim, ids, torch.full((ids.numel(), self.shape[1]), value))

    def __setitem__(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        for (row0, col0), shard in self._shards:
            mine = (ids >= row0) & (ids < row0 + shard.shape[0])
            hi = min(self._columns, col0 + shard.shape[1])
            if not bool(mine.any()) or hi <= col0:
                continue
            local = (ids[mine] - row0).to(shard.device)
            shard[local, :hi - col0] = values[mine.to(values.device)][:, col0:hi].to(
                device=shard.device, dtype=shard.dtype)


class TrainModule:
    """Model + optimizers + DMP for one training process.

    Args:
        config: the pipeline config.
        feature_builder: the feature builder of the same config.
        device: ``"auto"`` (CUDA if available else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        row_wise_min_rows: with several ranks, tables of at least this many rows are split
            by rows (``odl.train.distributed``).

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
    ) -> None:
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":  # dense weights decay into subnormals (that module)
            flush_subnormal_floats()
        self.rank, self.world_size = join_process_group(self.device)
        self._seed = int(config.train_config.seed)
        torch.manual_seed(self._seed)
        self.model = build_model(config, feature_builder)
        self._feature_builder = feature_builder
        # per output: a regression predicts its logit, the others sigmoid(logit)
        self.regression = regression_outputs(config)
        self.softmax = num_classes(config) > 1  # a num_class model: softmax over its classes
        self._sparse_spec, self._dense_spec = optimizer_specs(config.train_config)
        cls, kwargs = sparse_optimizer_args(self._sparse_spec, self.device.type)
        # wide tables at their own rate form a second fused group (a separate kernel)
        self._wide_lr_multiplier = float(config.train_config.wide_learning_rate_multiplier)
        wide_params = [p for n, p in self.model.ebc.named_parameters()
                       if n.split(".")[-2].endswith(WIDE_SUFFIX)]
        if self._wide_lr_multiplier != 1.0 and wide_params:
            wide_ids = {id(p) for p in wide_params}
            apply_optimizer_in_backward(
                cls, [p for p in self.model.ebc.parameters() if id(p) not in wide_ids], kwargs)
            apply_optimizer_in_backward(
                cls, wide_params, {**kwargs, "lr": kwargs["lr"] * self._wide_lr_multiplier})
        else:
            apply_optimizer_in_backward(cls, self.model.ebc.parameters(), kwargs)
        self._table_kind = table_kernel_kind(self._sparse_spec.kind)
        self.model.dense.to(self.device)
        table_configs = list(self.model.ebc.embedding_bag_configs())
        tables = [c.name for c in table_configs]
        self._table_shapes = {c.name: (int(c.num_embeddings), int(c.embedding_dim))
                              for c in table_configs}
        specs = {s.name: s for s in feature_builder.table_specs
                 if s.dynamic is not None and s.name in set(tables) | {
                     t[: -len(WIDE_SUFFIX)] for t in tables if t.endswith(WIDE_SUFFIX)}}
        partitions = self._dynamic_partitions(config, specs)
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
            data_parallel_wrapper=_NoDataParallel(),
        )
        if self.world_size == 1:
            init_embedding_weights(self.embedding_tables(), self._seed)
        else:
            self._init_local_shards()
        self.dynamic = DynamicTables(
            {n: s.dynamic for n, s in specs.items()},
            {n: s.feature_names for n, s in specs.items()}, self._seed,
            record_deletes=config.train_config.HasField("incr_save_config"),
            partitions=partitions,
            held=self._held_partitions(partitions))
        # several ranks, split by id: the step's rows of every rank's records in the dynamic
        # tables, recorded beside this rank's own (it names and publishes its partitions')
        self._step_rows: KeyedJaggedTensor | None = None
        self._dynamic_features = {f for s in specs.values() for f in s.feature_names}
        # rank 0, split by id: table -> (rows, raw ids) every rank named in the last read_rows
        self._read_names: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._dynamic_torch_tables = {
            base: [t for t in (base, base + WIDE_SUFFIX) if t in tables] for base in specs}
        self._dynamic_of_torch = {t: self.dynamic.tables[base]
                                  for base, ts in self._dynamic_torch_tables.items() for t in ts}
        self._row_views: tuple[dict, dict] | None = None
        self._shard_views: dict[str, tuple[Any, list[Any]]] | None = None
        self._stream_time = 0.0
        self._dense_params = list(self._dense_module().parameters())
        if self.world_size > 1:  # every rank starts from rank 0's dense parameters
            broadcast_parameters(self._dense_params)
        self._dense_opt = make_dense_optimizer(self._dense_spec, self._dense_params)
        self._grad_clip = gradient_clipping(config.train_config)  # dense gradients only
        self.global_step = 0
        self._lrs: tuple[float, float] | None = None
        self._lr_groups: list[tuple[dict, float]] | None = None
        self._lookup_tables: list[str] = []
        self._row_pairs, self._in_batch, self._per_record = self._row_pair_learning(
            config, table_configs)
        self._touched_rows_hook: Callable[[KeyedJaggedTensor], None] | None = None
        self._extra_touched_rows_hooks: list[Callable[[KeyedJaggedTensor], None]] = []
        logger.info(
            "TrainModule on %s: %d tables, sparse %s, dense %s", self.device, len(tables),
            self._sparse_spec.kind, self._dense_spec.kind)

    def _row_pair_learning(self, config: pipeline_pb2.EasyRecConfig,
                           table_configs: list[EmbeddingBagConfig]
                           ) -> tuple[RowPairIndex | None, InBatchLearning | None,
                                      PerRecordAdagrad | None]:
        """``in_batch_learning``, ``per_record_adagrad`` and their row-pair index.

        Each is None when off.

        Validation has checked the model (one output, for in-batch learning) and the table
        optimizer (SGD or (row-wise) Adagrad; (row-wise) Adagrad for per-record
        accumulators); the classes refuse any other. With several ranks the index has no
        table storage (no rank holds whole tables): in-batch learning runs through
        ``odl.train.rank_in_batch`` and per-record Adagrad is ``RankPerRecordAdagrad``, both
        reading and writing rows in the shards that hold them.
        """
        tc = config.train_config
        if not (tc.in_batch_learning or tc.per_record_adagrad):
            return None, None, None
        if self.world_size > 1 and not tc.in_batch_sequential:
            raise ValueError("train_config.in_batch_sequential: false is not implemented for "
                             "a model sharded over several ranks yet")
        # several ranks: no rank holds whole tables; the accumulators come from their shards
        tables, states = self._row_state_views() if self.world_size == 1 else ({}, {})
        rows = {}
        for c in table_configs:
            state = states.get(f"{EBC_PREFIX}{c.name}.weight", [])
            rows[c.name] = TableRows(
                state=state[0] if state and self._table_kind != "sgd" else None,
                stored_columns=c.embedding_dim, mean_pooling=c.pooling == PoolingType.MEAN,
                lr_multiplier=(self._wide_lr_multiplier if c.name.endswith(WIDE_SUFFIX)
                               else 1.0),
                weight=tables.get(c.name))
        # per lookup of the index (group after group), the TorchRec table it reads
        self._lookup_tables = [t for g in self.model.pooled_layout for _, t in g.lookups]
        index = RowPairIndex(self.model.pooled_layout, rows,
                             rowwise=self._table_kind == "rowwise_adagrad")
        return (index,
                InBatchLearning(index, self._table_kind, TABLE_EPS,
                                InBatchScan(self._table_kind, tc.per_record_adagrad,
                                            float(tc.per_record_adagrad_max_gain), TABLE_EPS,
                                            logistic=not any(self.regression),
                                            exact=error_model_is_exact(config.model_config))
                                if tc.in_batch_sequential else None)
                if tc.in_batch_learning else None,
                (PerRecordAdagrad(index, self._table_kind, TABLE_EPS,
                                  float(tc.per_record_adagrad_max_gain))
                 if self.world_size == 1 else
                 RankPerRecordAdagrad(index, self._table_kind, TABLE_EPS,
                                      float(tc.per_record_adagrad_max_gain),
                                      self._lookup_tables, self._held_accumulators,
                                      self._write_held_rows))
                if tc.per_record_adagrad else None)

    @torch.no_grad()
    def _init_local_shards(self) -> None:
        """``init_embedding_weights`` for the shards this rank holds.

        Each shard gets the values its rows and columns have in the whole table as one
        process initializes it, drawn for its rows alone (``initial_rows``): no rank holds
        more than its shards and one block of rows.
        """
        for name, t in self._dmp.state_dict().items():
            if not (name.startswith(EBC_PREFIX) and name.endswith(".weight")):
                continue
            table = name[len(EBC_PREFIX):-len(".weight")]
            if not hasattr(t, "local_shards"):
                init_embedding_weights({table: t}, self._seed)
                continue
            for sh in t.local_shards():
                (r0, c0), (n, m) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                for first, values in initial_rows(table, self._seed, tuple(t.size()), r0,
                                                  r0 + n):
                    sh.tensor[first - r0 : first - r0 + values.shape[0]].copy_(
                        values[:, c0 : c0 + m].to(device=sh.tensor.device,
                                                  dtype=sh.tensor.dtype))

    # -- accessors --------------------------------------------------------------------------

    @property
    def dmp(self) -> DistributedModelParallel:
        """The wrapped model (for benchmarks and debugging)."""
        return self._dmp

    @property
    def fused_optimizer(self) -> Any:
        """TorchRec's keyed optimizer of the fused table updates."""
        return self._dmp.fused_optimizer

    def _module(self) -> nn.Module:
        return self._dmp.module

    def _dense_module(self) -> nn.Module:
        return self._dmp.module.dense

    def embedding_tables(self) -> dict[str, torch.Tensor]:
        """Table name -> live full weight tensor (on the model's device; do not resize)."""
        out = {}
        for name, t in self._dmp.state_dict().items():
            if name.startswith(EBC_PREFIX) and name.endswith(".weight"):
                out[name[len(EBC_PREFIX) : -len(".weight")]] = _local_view(t)
        return out

    def table_rows(self) -> dict[str, ShardRows]:
        """Table name -> its rows as written through to this rank's shards.

        For copying whole-table rows (crash recovery's delta rows) with several ranks: each
        rank writes the rows and columns its shards hold and skips the rest.
        """
        out = {}
        for name, t in self._dmp.state_dict().items():
            if name.startswith(EBC_PREFIX) and name.endswith(".weight"):
                out[name[len(EBC_PREFIX):-len(".weight")]] = ShardRows(
                    _local_shards(t), tuple(int(x) for x in t.size()))
        return out

    def table_shapes(self) -> dict[str, tuple[int, int]]:
        """Table name -> ``(rows, stored columns)`` of the whole table, on any rank."""
        return dict(self._table_shapes)

    @torch.no_grad()
    def read_rows(self, requested: Mapping[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Current values of table rows, wherever their shard lives.

        One process: ``{table: (ids, rows)}`` for the ids as given. Several ranks: a
        collective every rank calls with the rows it wants (its own touched rows, say); each
        rank contributes the wanted rows its shards hold, and rank 0 gets every table's
        sorted union of the ranks' ids with their whole rows (the other ranks get ``{}``).

        Args:
            requested: table name -> row ids (int64, sorted and unique for one process).

        Returns:
            Table name -> ``(row ids, rows [n, stored columns])``; rows on the model's
            device for one process, on the CPU when gathered.
        """
        if self.world_size == 1:
            tables = self.embedding_tables()
            return {name: (ids, tables[name].index_select(0, ids.to(tables[name].device)))
                    for name, ids in requested.items()}
        union: dict[str, np.ndarray] = {}
        for part in from_every_rank({name: ids.cpu().numpy().astype(np.int64)
                                     for name, ids in requested.items()}):
            for name, ids in part.items():
                union[name] = np.union1d(union[name], ids) if name in union else np.unique(ids)
        held: dict[str, list] = {}  # table -> [(row ids, first column, values)]
        for key, t in self._dmp.state_dict().items():
            name = key[len(EBC_PREFIX):-len(".weight")] if key.startswith(EBC_PREFIX) else ""
            if name not in union or not hasattr(t, "local_shards"):
                continue
            ids = union[name]
            for sh in t.local_shards():
                (r0, c0), (nr, _) = sh.metadata.shard_offsets, sh.metadata.shard_sizes
                mine = ids[(ids >= r0) & (ids < r0 + nr)]
                if len(mine):
                    rows = sh.tensor.index_select(
                        0, torch.from_numpy(mine - r0).to(sh.tensor.device))
                    held.setdefault(name, []).append((mine, c0, rows.cpu()))
        names: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # split by id: own rows' raw ids
        if self._dynamic_in_parts():
            for name, ids in union.items():
                dyn = self.dynamic_table(name)
                if dyn is not None:
                    raw = dyn.raw_ids(ids)
                    names[name] = (ids[raw >= 0], raw[raw >= 0])
        everyone = gather_to_rank0((held, names))
        if everyone is None:
            return {}
        self._read_names = {}
        for name in names:  # every rank's named rows of the table, sorted by row
            ids = np.concatenate([part[name][0] for _held, part in everyone if name in part])
            raw = np.concatenate([part[name][1] for _held, part in everyone if name in part])
            order = np.argsort(ids, kind="stable")
            self._read_names[name] = (ids[order], raw[order])
        shapes = self.table_shapes()
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, ids in union.items():
            values = torch.zeros((len(ids), shapes[name][1]), dtype=torch.float32)
            for part, _names in everyone:
                for mine, c0, rows in part.get(name, []):
                    at = torch.from_numpy(np.searchsorted(ids, mine))
                    values[at, c0:c0 + rows.shape[1]] = rows.to(values.dtype)
            out[name] = (torch.from_numpy(ids), values)
        return out

    def raw_ids(self, table: str, rows: np.ndarray) -> np.ndarray:
        """The raw ids rows of a dynamic table hold (-1: free).

        Split by id over several ranks a rank knows only its own partition's rows: rank 0
        names the rows of the last ``read_rows`` from what every rank sent along with them.

        Args:
            table: a TorchRec table backed by a dynamic table (``<t>`` or ``<t>_wide``).
            rows: its rows.
        """
        dyn = self.dynamic_table(table)
        if dyn is None:
            raise KeyError(f"{table} is not a dynamic table")
        rows = np.asarray(rows, dtype=np.int64)
        if not self._dynamic_in_parts():
            return dyn.raw_ids(rows)
        ids, raw = self._read_names.get(table, (np.empty(0, np.int64), np.empty(0, np.int64)))
        out = np.full(rows.shape[0], -1, dtype=np.int64)
        if not len(ids):
            return out
        at = np.minimum(np.searchsorted(ids, rows), len(ids) - 1)
        found = ids[at] == rows
        out[found] = raw[at[found]]
        return out

    def take_deleted(self, consumer: str) -> dict[str, np.ndarray]:
        """Dynamic table -> raw ids evicted since ``consumer``'s last take (unique).

        Split by id over several ranks a collective: rank 0 gets every partition's ids, the
        other ranks ``{}``.
        """
        mine = self.dynamic.take_deleted(consumer)
        if not self._dynamic_in_parts():
            return mine
        everyone = gather_to_rank0(mine)
        if everyone is None:
            return {}
        out: dict[str, np.ndarray] = {}
        for part in everyone:
            for name, ids in part.items():
                out[name] = np.union1d(out[name], ids) if name in out else np.unique(ids)
        return out

    def dense_parameters(self) -> dict[str, torch.Tensor]:
        """``dense.*`` name -> live dense parameter / buffer tensor."""
        d = self._dense_module()
        out = {f"dense.{k}": v for k, v in d.named_parameters()}
        out.update({f"dense.{k}": v for k, v in d.named_buffers()})
        return out

    def _dynamic_partitions(self, config: pipeline_pb2.EasyRecConfig,
                            specs: Mapping[str, Any]) -> int:
        """``train_config.dynamic_index_partitions``, checked against the ranks and tables.

        With N ranks, P = 1 (the whole index on every rank) or a multiple of N: rank r holds
        partitions ``[r * P / N, (r + 1) * P / N)``, whose blocks of rows make its TorchRec
        row-wise block when P = N or every dynamic table's capacity is a multiple of P.

        Raises:
            ConfigError: P not 1 or a multiple of the ranks, blocks that do not line up with
                the ranks' row-wise blocks, or a table too small to split.
        """
        field = "train_config.dynamic_index_partitions"
        partitions = max(1, int(config.train_config.dynamic_index_partitions))
        world = self.world_size
        if not specs or partitions == 1:
            return 1
        if partitions % world:
            raise ConfigError(field, f"is {partitions} with {world} ranks: it must be 1 (the "
                              f"whole index on every rank) or a multiple of {world} (each "
                              "rank holds an equal share of the partitions)")
        for name, spec in specs.items():
            capacity = spec.dynamic.capacity
            try:
                partition_spans(capacity, partitions)
            except ValueError as exc:
                raise ConfigError(field, f"table {name}: {exc}") from exc
            if 1 < world < partitions and capacity % partitions:
                raise ConfigError(field, f"is {partitions} with {world} ranks, so each rank "
                                  f"holds {partitions // world} partitions: table {name}'s "
                                  f"capacity {capacity} must then be a multiple of "
                                  f"{partitions} (its partitions' rows make each rank's "
                                  "block of the table)")
        return partitions

    def _held_partitions(self, partitions: int) -> tuple[int, ...] | None:
        """The partitions this rank holds (None: all, with one process or one partition)."""
        if self.world_size == 1 or partitions == 1:
            return None
        share = partitions // self.world_size
        return tuple(range(self.rank * share, (self.rank + 1) * share))

    def dynamic_table(self, table: str) -> DynamicTable | None:
        """The dynamic table behind a TorchRec table (``<t>`` or ``<t>_wide``), else None."""
        return self._dynamic_of_torch.get(table)

    def dynamic_status(self) -> dict[str, dict[str, Any]]:
        """Per dynamic table: ``DynamicTables.status()`` plus ``memory_bytes``.

        ``memory_bytes`` counts its rows and their optimizer state in every TorchRec table it
        backs, and its id index, counters and sketch.
        """
        out = self.dynamic.status()
        if self.world_size > 1:  # this rank's shards of the rows, the whole index
            for base, st in out.items():
                nbytes = st["map_bytes"]
                for t in self._dynamic_torch_tables[base]:
                    weight, state = self._table_shards(t)
                    held = [weight, *state]
                    nbytes += sum(x.numel() * x.element_size()
                                  for h in held for _o, x in _local_shards(h))
                st["memory_bytes"] = int(nbytes)
            return out
        tables, states = self._row_state_views()
        for base, st in out.items():
            nbytes = st["map_bytes"]
            for t in self._dynamic_torch_tables[base]:
                nbytes += tables[t].numel() * tables[t].element_size()
                nbytes += sum(v.numel() * v.element_size()
                              for v in states.get(f"{EBC_PREFIX}{t}.weight", []))
            st["memory_bytes"] = int(nbytes)
        return out

    def feature_tables(self) -> dict[str, list[str]]:
        """Embedded feature name -> tables it is looked up in (deep and wide)."""
        return self._module().layout.feature_tables()

    # -- steps ------------------------------------------------------------------------------

    def _set_lrs(self) -> None:
        lrs = (self._sparse_spec.schedule(self.global_step),
               self._dense_spec.schedule(self.global_step))
        if lrs == self._lrs:
            return
        fused = self._dmp.fused_optimizer
        for g, multiplier in self._fused_lr_groups():
            g["lr"] = lrs[0] * multiplier
        fused.step()  # fused optimizers only push the lr to the kernel here
        for g in self._dense_opt.param_groups:
            g["lr"] = lrs[1]
        self._lrs = lrs

    def _fused_lr_groups(self) -> list[tuple[dict, float]]:
        """Each fused table-optimizer parameter group with its rate multiplier.

        The wide tables' group has ``wide_learning_rate_multiplier``, the others 1.
        """
        if self._lr_groups is None:
            groups: list[tuple[dict, float]] = []
            pending: list[Any] = [self._dmp.fused_optimizer]
            while pending:
                opt = pending.pop()
                if hasattr(opt, "optimizers"):  # a CombinedOptimizer: (name, optimizer) pairs
                    pending.extend(o for _, o in opt.optimizers)
                    continue
                wide = any(n.split(".")[-2].endswith(WIDE_SUFFIX)
                           for n in getattr(opt, "params", {}))
                groups.extend((g, self._wide_lr_multiplier if wide else 1.0)
                              for g in opt.param_groups)
            self._lr_groups = groups
        return self._lr_groups

    def current_learning_rates(self) -> tuple[float, float]:
        """``(sparse, dense)`` rates for the next step."""
        return (self._sparse_spec.schedule(self.global_step),
                self._dense_spec.schedule(self.global_step))

    def set_touched_rows_hook(self, hook: Callable[[KeyedJaggedTensor], None] | None) -> None:
        """Registers ``hook(kjt)``, called once per training step with the step's ids.

        The KJT's keys are feature names; ``feature_tables()`` maps them to tables. A delta
        tracker uses this to record which rows each table touched.
        """
        self._touched_rows_hook = hook

    def add_touched_rows_hook(self, hook: Callable[[KeyedJaggedTensor], None]) -> None:
        """Registers one more ``hook(kjt)`` beside ``set_touched_rows_hook``'s.

        A second delta tracker uses it, e.g. the per-pass delta files of a file stream.
        """
        self._extra_touched_rows_hooks.append(hook)

    @torch.no_grad()
    def shrink_dynamic(self, now: float | None = None) -> dict[str, int]:
        """Runs every dynamic table's maintenance pass now (decay, expiry; a day's end).

        With several ranks a collective (every rank calls it): the ranks use the latest of
        their times.

        Args:
            now: stream time (unix seconds); default: the newest stream time trained on, or
                the clock without ``event_time_field``.

        Returns:
            Dynamic table -> rows evicted (their rows are reset).
        """
        if not self.dynamic:
            return {}
        if now is None:
            now = self._stream_time if self._stream_time > 0 else time.time()
        if self.world_size > 1:  # a collective: every rank decides at the same time
            now = max(float(t) for t in from_every_rank(float(now)))
        evicted = self.dynamic.shrink(self.global_step, now)
        if evicted:
            self.reset_dynamic_rows(evicted, self.global_step)
        return {name: int(rows.shape[0]) for name, rows in evicted.items()}

    def _stream_now(self, batch: Batch) -> float:
        if batch.event_times is not None and len(batch.event_times):
            self._stream_time = max(self._stream_time, float(np.max(batch.event_times)))
            return self._stream_time
        return time.time()

    def _row_state_views(self) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Live table weights and table-optimizer state tensors (cached views)."""
        if self._row_views is None:
            tables = self.embedding_tables()
            states: dict[str, list[torch.Tensor]] = {}
            for pname, st in self._dmp.fused_optimizer.state_dict()["state"].items():
                states[pname] = [_local_view(v) for v in st.values()
                                 if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")]
            self._row_views = (tables, states)
        return self._row_views

    def _table_shards(self, table: str) -> tuple[Any, list[Any]]:
        """A table's weight and optimizer state tensors as this rank holds them (cached).

        Each is a ShardedTensor with several ranks (``_local_shards`` gives its local
        shards and their offsets); the state list is empty for SGD.
        """
        if self._shard_views is None:
            model = self._dmp.state_dict()
            states = self._dmp.fused_optimizer.state_dict()["state"]
            self._shard_views = {
                key[len(EBC_PREFIX):-len(".weight")]: (
                    t, [v for v in states.get(key, {}).values()
                        if isinstance(v, torch.Tensor) or hasattr(v, "local_shards")])
                for key, t in model.items()
                if key.startswith(EBC_PREFIX) and key.endswith(".weight")}
        return self._shard_views[table]

    @torch.no_grad()
    def reset_dynamic_rows(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """Fresh weights and zero optimizer state for evicted rows (dynamic table -> rows).

        With several ranks each rank resets the rows its shards hold, to the values one
        process would give them. Split by id, each partition's rows draw their values from
        their own stream (the partition), so a rank knowing only its partition's evictions
        resets them as one process holding every partition does.
        """
        if self.world_size > 1:
            self._reset_dynamic_shards(evicted, step)
            return
        tables, states = self._row_state_views()
        for base, rows in evicted.items():
            for stream, r in self._reset_streams(base, rows):
                for t in self._dynamic_torch_tables[base]:
                    w = tables[t]
                    reset_embedding_rows(t, w, r, self._seed, step, stream)
                    for v in states.get(f"{EBC_PREFIX}{t}.weight", []):
                        if v.dim() >= 1 and v.shape[0] == w.shape[0]:
                            v.index_fill_(0, r.to(v.device), 0)

    def _reset_streams(self, base: str, rows: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """``[(stream, rows)]`` of evicted rows: per partition split by id, else one."""
        r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        if self.dynamic.partitions == 1:
            return [(0, r)]
        spans = partition_spans(self.dynamic.tables[base].spec.capacity,
                                self.dynamic.partitions)
        return [(p, r[(r >= lo) & (r < hi)]) for p, (lo, hi) in enumerate(spans)]

    def _reset_dynamic_shards(self, evicted: Mapping[str, np.ndarray], step: int) -> None:
        """``reset_dynamic_rows`` of one of several ranks: its own shards' rows."""
        for base, rows in evicted.items():
            r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
            for t in self._dynamic_torch_tables[base]:
                weight, state = self._table_shards(t)
                whole = ShardRows(_local_shards(weight), tuple(int(x) for x in weight.size()))
                for stream, part in self._reset_streams(base, rows):
                    reset_embedding_rows(t, whole, part, self._seed, step, stream)
                for v in state:
                    for (r0, *_c), shard in _local_shards(v):
                        inside = r[(r >= r0) & (r < r0 + shard.shape[0])] - r0
                        if inside.numel():
                            shard.index_fill_(0, inside.to(shard.device), 0)

    def record_touched_rows(self, kjt: KeyedJaggedTensor) -> None:
        """Called by ``train_step`` with the batch's ids (after the update)."""
        if self._touched_rows_hook is not None:
            self._touched_rows_hook(kjt)
        for hook in self._extra_touched_rows_hooks:
            hook(kjt)

    def train_step(self, batch: Batch, sizes: Sequence[int] | None = None) -> StepOutput:
        """One predict-then-train step.

        Args:
            batch: the batch (any device; moved to the model's).
            sizes: several ranks: every rank's batch size this step, in rank order, when the
                caller agreed them already (the trainer's turn); None: the step agrees them
                (one all-gather more).

        Returns:
            The forward pass's predictions (before the update) and the loss. They equal
            ``predict(batch)`` called just before the step unless the model has batch norm or
            dropout (the step's forward runs in train mode).
        """
        self._set_lrs()
        now = 0.0
        if self.dynamic and self.world_size > 1:
            batch, now = self._remap_ranks(batch)
        elif self.dynamic:
            now = self._stream_now(batch)
            remapped = self.dynamic.remap(batch, self.global_step + 1, now, admit=True)
            batch = remapped.batch
            if remapped.evicted:
                self.reset_dynamic_rows(remapped.evicted, self.global_step + 1)
        batch = batch.to(self.device)
        if not self._dmp.training:  # (train() walks every submodule: only when needed)
            self._dmp.train()
        if self.world_size > 1:
            before = self.global_step
            out = self._train_step_ranks(batch, sizes)
            if self.dynamic and self.global_step != before:  # every rank alike
                expired = self.dynamic.maintain(self.global_step, now)
                if expired:
                    self.reset_dynamic_rows(expired, self.global_step)
            return out
        output = self._dmp(batch)
        logits = output.logits
        finite = torch.isfinite(logits)
        dropped = np.empty(0, dtype=np.int64)
        if not bool(finite.all()):
            # A sample with a non-finite prediction (a feature value that overflows the
            # network) would turn every parameter it reaches into NaN: leave it out.
            dropped = (~finite).nonzero().flatten().cpu().numpy().astype(np.int64)
            logger.warning("%d of %d samples have a non-finite prediction and are not "
                           "trained on (non_finite_output)", len(dropped), batch.size)
            if len(dropped) == batch.size:
                return StepOutput(probs=np.empty(0, dtype=np.float64), loss=float("nan"),
                                  dropped=dropped)
            batch = batch.select(finite)
            output = self._dmp(batch)
            logits = output.logits
        # the loss at the unshifted logits: not needed by the sequential pass
        sequential = self._in_batch is not None and self._in_batch.sequential is not None
        loss = None if sequential else self._module().loss(output, batch)
        pairs = (self._row_pairs.pairs(batch.sparse, batch.size, logits.dtype)
                 if self._row_pairs is not None else None)
        if self._in_batch is not None:  # predict each record after its batch's earlier ones
            pooled = tuple(p.detach() for p in output.pooled)
            shift = self._in_batch.logit_shift(
                pairs, output, loss, self._lrs[0],
                lambda at: self._module().loss(ModelOutput(at, pooled), batch))
            output = ModelOutput(output.logits + shift, output.pooled)
            logits = output.logits
            loss = self._module().loss(output, batch)
        assert loss is not None
        pending = (self._per_record.before_backward(pairs, output.pooled)
                   if self._per_record is not None else None)
        self._dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # table rows are updated inside backward (fused)
        if pending is not None:  # each record's squared gradient in the accumulators
            self._per_record.apply(pending, self._lrs[0])
        if self._grad_clip is not None:
            self._grad_clip(self._dense_opt)
        self._dense_opt.step()
        self.global_step += 1
        self.record_touched_rows(batch.sparse)
        if self.dynamic:
            expired = self.dynamic.maintain(self.global_step, now)
            if expired:
                self.reset_dynamic_rows(expired, self.global_step)
        probs = predictions(logits.detach(), self.regression, self.softmax)
        return StepOutput(probs=probs, loss=float(loss.detach()), dropped=dropped)

    def _remap_ranks(self, batch: Batch, admit: bool = True) -> tuple[Batch, float]:
        """Dynamic tables' remap with several ranks (a collective): ``(batch, stream time)``.

        The ranks exchange their batches' ids, labels, counts and event times, and remap the
        step's records of all ranks in rank order, as one process would remap the
        concatenated batch, then each keeps its own records. With the whole index on every
        rank each rank makes every decision itself (the same everywhere); split by id
        (``odl.models.dynamic.partitions``) each rank maps the ids of its own partition and
        the ranks exchange those rows. Rows evicted for admission are reset in the shards
        that hold them. Stream time is the newest event time of the step's records (rank
        0's clock without an event time field), the same on every rank.

        Args:
            batch: this rank's batch (``empty_batch()`` when it has none).
            admit: a training step (admission, eviction, counters); False: look up only.
        """
        kjt = batch.sparse
        keys = list(kjt.keys())
        b = batch.size
        labels = batch.labels.detach().cpu().numpy().astype(np.float32)
        mine = {"values": kjt.values().cpu().numpy().astype(np.int64),
                "lengths": kjt.lengths().cpu().numpy().astype(np.int64).reshape(len(keys), b).T,
                "labels": labels.reshape(b, int(np.prod(labels.shape[1:]))),
                "times": (np.asarray(batch.event_times, dtype=np.float64)
                          if batch.event_times is not None else np.zeros(0)),
                "clock": np.array([time.time()])}
        for name, values in sorted((batch.counts or {}).items()):
            mine[f"count:{name}"] = np.asarray(values, dtype=np.float32)
        everyone = arrays_from_every_rank(mine)
        sizes = [len(p["lengths"]) for p in everyone]
        total = sum(sizes)
        times = np.concatenate([p["times"] for p in everyone])
        if len(times) and admit:
            self._stream_time = max(self._stream_time, float(times.max()))
            now = self._stream_time
        else:
            now = float(everyone[0]["clock"][0])
        if total == 0:  # no step: nothing to admit
            return batch, now
        lengths = np.concatenate([p["lengths"] for p in everyone])  # [total, keys]
        values, at = [], [0] * len(everyone)
        for k in range(len(keys)):  # per key, rank after rank (a KJT's layout)
            for r, p in enumerate(everyone):
                n = int(p["lengths"][:, k].sum())
                values.append(p["values"][at[r]:at[r] + n])
                at[r] += n
        sparse = KeyedJaggedTensor(
            keys=keys, values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.ascontiguousarray(lengths.T.reshape(-1))))
        counts = {name[len("count:"):]: np.concatenate([p[name] for p in everyone])
                  for name in mine if name.startswith("count:")}
        whole = Batch(sparse=sparse, dense=torch.zeros(total, 0),
                      labels=torch.from_numpy(np.concatenate([p["labels"] for p in everyone])
                                              .reshape((total, *labels.shape[1:]))),
                      counts=counts or None)
        step = self.global_step + 1 if admit else self.global_step
        if self.dynamic.partitions == 1:
            remapped = self.dynamic.remap(whole, step, now, admit=admit)
            mapped, evicted = remapped.batch, remapped.evicted
        else:
            found = self.dynamic.lookups(whole)
            if found is None:
                return batch, now
            rows, evicted = self.dynamic.map_lookups(found, whole, step, now, admit)
            assert found.owner is not None  # the rank holding each lookup's partition
            owner = found.owner // (self.dynamic.partitions // self.world_size)
            counts = np.bincount(owner, minlength=self.world_size).tolist()
            for r, part in enumerate(int64_from_every_rank(rows[owner == self.rank], counts)):
                if r != self.rank:
                    rows[owner == r] = part
            assert not (rows == UNHELD).any()
            mapped = self.dynamic.with_rows(whole, found, rows)
            if admit and (self._touched_rows_hook is not None
                          or self._extra_touched_rows_hooks):
                self._step_rows = mapped.sparse.permute(
                    [i for i, k in enumerate(keys) if k in self._dynamic_features])
        if evicted:
            self.reset_dynamic_rows(evicted, step)
        start = sum(sizes[:self.rank])
        keep = torch.zeros(total, dtype=torch.bool)
        keep[start:start + b] = True
        return replace(batch, sparse=mapped.select(keep).sparse), now

    def _train_step_ranks(self, batch: Batch, sizes: Sequence[int] | None = None
                          ) -> StepOutput:
        """``train_step`` of one of several ranks (a collective).

        Every rank calls it at every step, with ``empty_batch()`` when it has no records;
        the update is the one a single process makes on all ranks' records of the step
        (their mean loss): each rank's loss is weighted by its share of the step's records.
        A step with no records on any rank changes nothing. Every rank pads its batch to
        the step's largest (``Batch.padded``: samples without ids, left out of the loss),
        as TorchRec's sharded lookup needs one batch size on all ranks. Samples with a
        non-finite prediction are left out as in one process; every rank then runs its
        forward again, so the collectives match.
        """
        if sizes is None:
            sizes = [s for (s,) in agree([batch.size])]
        elif sizes[self.rank] != batch.size:
            raise ValueError(f"rank {self.rank}: a batch of {batch.size} records, but "
                             f"{sizes[self.rank]} were agreed")
        if sum(sizes) == 0:
            return StepOutput(probs=np.empty(0, dtype=np.float64), loss=float("nan"))
        # TorchRec's sharded lookup wants one batch size on every rank: pad to the largest
        output = self._dmp(batch.padded(max(sizes)))
        finite = torch.isfinite(output.logits[:batch.size])
        dropped = np.empty(0, dtype=np.int64)
        if any(bad for (bad,) in agree([int(not bool(finite.all()))])):
            # some rank drops samples: all run the forward again
            dropped = (~finite).nonzero().flatten().cpu().numpy().astype(np.int64)
            if len(dropped):
                logger.warning("%d of %d samples have a non-finite prediction and are not "
                               "trained on (non_finite_output)", len(dropped), batch.size)
            batch = batch.select(finite.reshape(batch.size, -1).all(dim=1))
            sizes = [s for (s,) in agree([batch.size])]
            if sum(sizes) == 0:
                return StepOutput(probs=np.empty(0, dtype=np.float64), loss=float("nan"),
                                  dropped=dropped)
            output = self._dmp(batch.padded(max(sizes)))
        n = batch.size
        mine = ModelOutput(output.logits[:n], tuple(p[:n] for p in output.pooled))
        pairs = (self._row_pairs.pairs(batch.sparse, n, mine.logits.dtype)
                 if self._row_pairs is not None and n else None)
        if self._in_batch is not None:  # every rank, records or not: a collective
            mine = ModelOutput(
                mine.logits + self._rank_shift(batch, output, mine, sizes, pairs), mine.pooled)
        hooked = (hook_pooled_gradients(output.pooled)
                  if isinstance(self._per_record, RankPerRecordAdagrad) else None)
        if n:
            loss = self._module().loss(mine, batch)
            weighted = loss * (n * self.world_size / sum(sizes))
        else:  # no records here: a zero loss still runs the backward's collectives
            loss = torch.tensor(float("nan"))
            weighted = output.logits.sum() * 0.0
        self._dense_opt.zero_grad(set_to_none=True)
        weighted.backward()  # table rows are updated inside backward (fused)
        if hooked is not None:  # each record's squared gradient in the accumulators
            assert isinstance(self._per_record, RankPerRecordAdagrad)
            self._per_record.apply_ranks(pairs, hooked, n, self.world_size, self._lrs[0])
        average_gradients(self._dense_params)
        if self._grad_clip is not None:
            self._grad_clip(self._dense_opt)
        self._dense_opt.step()
        self.global_step += 1
        self.record_touched_rows(batch.sparse)
        if self._step_rows is not None:  # split by id: every rank's dynamic rows of the step,
            # so this rank names and publishes its partitions' rows whoever trained them
            self.record_touched_rows(self._step_rows.to(self.device))
            self._step_rows = None
        probs = predictions(mine.logits.detach(), self.regression, self.softmax)
        return StepOutput(probs=probs, loss=float(loss.detach()), dropped=dropped)

    def _rank_shift(self, batch: Batch, output: ModelOutput, mine: ModelOutput,
                    sizes: Sequence[int], pairs: RowPairs | None) -> torch.Tensor:
        """In-batch learning's shifts of this rank's records (``odl.train.rank_in_batch``).

        ``output`` is the padded batch's forward, ``mine`` its rows of this rank's records;
        their loss slopes are the ones the ranked update gives the tables (the weighted loss's
        over the number of ranks).
        """
        assert self._in_batch is not None and self._in_batch.sequential is not None
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
                return self._module().loss(ModelOutput(at, pooled), batch) * share

            slope, curve = loss_slopes(loss_at, logits.detach())
        return rank_logit_shift(
            self.rank, self._row_pairs, self._in_batch.sequential, self._lookup_tables, pairs,
            jac, logits, slope, curve, self._lrs[0],
            self._held_accumulators if self._table_kind != "sgd" else None)

    @torch.no_grad()
    def _held_accumulators(self, tables: Sequence[str], rows: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
        """The table optimizer's accumulators of the (table, row)s this rank's shards hold.

        Returns ``(values [U, acc_width], held [U])``: 0 and False for the rows held
        elsewhere.
        """
        assert self._row_pairs is not None
        width = 1 if self._table_kind == "rowwise_adagrad" else self._row_pairs.width
        values = np.zeros((len(rows), width), dtype=np.float32)
        held = np.zeros(len(rows), dtype=bool)
        names = np.asarray(tables)
        for table in np.unique(names):
            at = np.flatnonzero(names == table)
            st = self._table_shards(str(table))[1]
            if not st:
                continue
            for (r0, *c), shard in _local_shards(st[0]):
                want = rows[at]
                inside = (want >= r0) & (want < r0 + shard.shape[0])
                if not inside.any():
                    continue
                got = shard.index_select(0, torch.from_numpy(want[inside] - r0).to(
                    shard.device)).cpu().to(torch.float32).numpy()
                got = got if got.ndim > 1 else got[:, None]
                c0 = c[0] if c else 0
                k = max(0, min(got.shape[1], width - c0))  # the pass reads `width` columns
                values[at[inside], c0:c0 + k] = got[:, :k]
                held[at[inside]] = True
        return values, held

    @torch.no_grad()
    def _write_held_rows(self, tables: Sequence[str], rows: np.ndarray, delta: np.ndarray,
                         acc: np.ndarray) -> None:
        """Adds ``delta`` to the weights and sets the accumulators ``acc`` of rows held here.

        Only the requested (table, row)s this rank's shards hold are written; the others
        are skipped.
        """
        names = np.asarray(tables)
        for table in np.unique(names):
            at = np.flatnonzero(names == table)
            weight, st = self._table_shards(str(table))
            targets = [(weight, delta, False)] + ([(st[0], acc, True)] if st else [])
            for tensor, values, is_state in targets:
                for (r0, *c), shard in _local_shards(tensor):
                    want = rows[at]
                    inside = (want >= r0) & (want < r0 + shard.shape[0])
                    if not inside.any():
                        continue
                    idx = torch.from_numpy(want[inside] - r0).to(shard.device)
                    part = torch.from_numpy(values[at[inside]]).to(shard.device, shard.dtype)
                    if shard.dim() == 1:  # row-wise accumulators
                        shard.index_copy_(0, idx, part[:, 0])
                        continue
                    c0 = c[0] if c else 0
                    k = max(0, min(shard.shape[1], part.shape[1] - c0))
                    if is_state:
                        shard[:, :k].index_copy_(0, idx, part[:, c0:c0 + k])
                    else:
                        shard[:, :k].index_add_(0, idx, part[:, c0:c0 + k])

    def empty_batch(self) -> Batch:
        """A batch of no records.

        A rank with nothing to train passes it to ``train_step`` so the other ranks' step
        can run.
        """
        return self._feature_builder.to_batch(self._feature_builder.empty_arrays())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Predictions (float64 ``[B]``) in eval mode; no update (dynamic tables: no admission).

        With several ranks a collective: every rank calls it, those with nothing to predict
        with ``empty_batch()``; each gets its own batch's predictions (the batches are padded
        to the largest, as in ``train_step``).
        """
        if self.dynamic and self.world_size > 1 and self.dynamic.partitions > 1:
            batch = self._remap_ranks(batch, admit=False)[0]  # ids of every partition
        elif self.dynamic:
            batch = self.dynamic.remap(batch, self.global_step, time.time(), admit=False).batch
        batch = batch.to(self.device)
        self._dmp.eval()
        try:
            if self.world_size > 1:
                largest = max(s for (s,) in agree([batch.size]))
                logits = self._dmp(batch.padded(largest)).logits[:batch.size]
            else:
                logits = self._dmp(batch).logits
        finally:
            self._dmp.train()
        return predictions(logits, self.regression, self.softmax)

    # -- checkpoints ------------------------------------------------------------------------

    def _named_state(self) -> dict[str, Any]:
        """Own parameter/buffer name -> live tensor (tables as writable full views)."""
        out: dict[str, Any] = {}
        for name, t in self._dmp.state_dict().items():
            out[name] = _local_view(t) if name.startswith(EBC_PREFIX) else t
        out.update(self.dense_parameters())
        return out

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Full training state as plain CPU tensors (see the module docstring).

        With several ranks this is a collective: every rank must call it; rank 0 gets the
        whole state (every table whole, in the same layout as one process's, so it restores
        into any number of ranks) and the other ranks an empty dict.
        """
        if self.world_size > 1:
            parts = self._gathered_parts()
            if parts is None:
                return {}
            out = self.state_without_tables()
            tables, out["sparse_optimizer"] = table_parts.assemble(parts)
            out["model"].update(tables)
            table_parts.merge_dynamic_parts(out, parts)
            return out
        out = self.state_without_tables(
            {k: to_full_cpu(v) for k, v in self._named_state().items()})
        out["sparse_optimizer"] = {
            pname: {k: to_full_cpu(v) for k, v in states.items()}
            for pname, states in self._dmp.fused_optimizer.state_dict()["state"].items()}
        return out

    def state_without_tables(self, model: dict[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint state but the tables, the same on every rank; not a collective.

        Step, dense part (or ``model``, when given), dense optimizer and the dynamic tables'
        state. A checkpoint of several ranks holds this in ``model.pt`` and each rank's
        ``table_part`` beside it (``odl.train.rank_checkpoint``); reading it puts the parts
        back together into ``state_dict_for_checkpoint``'s state.
        """
        out = {
            "format": CHECKPOINT_FORMAT,
            "global_step": int(self.global_step),
            "model": model if model is not None else {
                k: to_full_cpu(v) for k, v in self.dense_parameters().items()},
            "dense_optimizer": _tensors_to_cpu(self._dense_opt.state_dict()),
            "sparse_optimizer": {},
        }
        if self.dynamic:
            out["dynamic_tables"] = self.dynamic.state_dict()
            if self._dynamic_in_parts():  # each rank's partition travels in its table part
                out["dynamic_tables"]["parts"] = {}
            out["stream_time"] = float(self._stream_time)
        return out

    def _dynamic_in_parts(self) -> bool:
        """Whether the dynamic tables are split by id over the ranks (each holding its share)."""
        return bool(self.dynamic) and self.world_size > 1 and self.dynamic.partitions > 1

    @torch.no_grad()
    def load_checkpoint_state(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restores parameters, buffers, optimizer states and the global step exactly.

        Args:
            state: a dict from ``state_dict_for_checkpoint``.
            strict: raise when names differ (otherwise missing entries keep their values).

        Raises:
            KeyError: ``strict`` and a name is missing or unexpected.
            ValueError: a shape differs.
        """
        if self.world_size > 1:
            self._load_sharded_state(state, strict)
            return
        own = self._named_state()
        model = state["model"]
        if strict:
            _check_names(set(own), set(model), "model")
        for name, t in own.items():
            if name in model:
                _copy_into(t, model[name], name, name)
        own_sparse = self._dmp.fused_optimizer.state_dict()["state"]
        saved_sparse = state.get("sparse_optimizer", {})
        if strict:
            _check_names(
                {f"{p}/{k}" for p, s in own_sparse.items() for k in s},
                {f"{p}/{k}" for p, s in saved_sparse.items() for k in s},
                "sparse_optimizer")
        for pname, states in own_sparse.items():
            for k, v in states.items():
                if pname in saved_sparse and k in saved_sparse[pname]:
                    _copy_into(_local_view(v), saved_sparse[pname][k], f"{pname}/{k}",
                               f"{pname}/{k}")
        if "dense_optimizer" in state:
            self._dense_opt.load_state_dict(state["dense_optimizer"])
        self._load_dynamic_state(state, strict)
        self.global_step = int(state.get("global_step", 0))
        self._lrs = None

    def _local_pieces(self) -> dict[tuple[str, str, str], tuple[tuple[int, ...], list]]:
        """This rank's parts of the tables and their optimizer state.

        Returns:
            ``(kind, name, state key) -> (whole size, [(offsets, CPU tensor)])``.
        """
        pieces: dict[tuple[str, str, str], tuple[tuple[int, ...], list]] = {}
        for name, t in self._dmp.state_dict().items():
            if name.startswith(EBC_PREFIX):
                pieces[("model", name, "")] = _shard_pieces(t)
        for pname, states in self._dmp.fused_optimizer.state_dict()["state"].items():
            for k, v in states.items():
                pieces[("sparse", pname, k)] = _shard_pieces(v)
        return pieces

    def _gathered_parts(self) -> list[dict[str, Any]] | None:
        """Every rank's table part gathered on rank 0 (a collective).

        Returns:
            The part documents in rank order on rank 0, None on the others.
        """
        part = self.table_part()
        for piece in part["pieces"]:  # compact copies: a shard is a view of the fused
            piece[4] = [[off, t.clone()] for off, t in piece[4]]  # buffer, pickled whole
        return gather_to_rank0(part)

    def table_part(self) -> dict[str, Any]:
        """This rank's rows of every table and their optimizer state, as a part document.

        See ``odl.checkpoint.table_parts``; with one process, the whole tables. Dynamic
        tables split by id over the ranks add this rank's partition of their state.
        """
        return table_parts.part_document(
            self._local_pieces(), self.rank, self.world_size,
            self.dynamic.state_dict()["parts"] if self._dynamic_in_parts() else None)

    def _sharded_state(self) -> dict[str, Any]:
        """Own parameter / buffer name -> tables as ShardedTensors, the dense part plain."""
        own = {n: t for n, t in self._dmp.state_dict().items() if n.startswith(EBC_PREFIX)}
        own.update(self.dense_parameters())
        return own

    @torch.no_grad()
    def _load_sharded_state(self, state: Mapping[str, Any], strict: bool) -> None:
        """``load_checkpoint_state`` with several ranks: each copies its own rows.

        From whole tables, or straight from the table parts a state names
        (``read_checkpoint(whole_tables=False)``): then only the blocks overlapping this
        rank's shards are read.
        """
        model = state["model"]
        saved_sparse = state.get("sparse_optimizer", {})
        own = self._sharded_state()
        fused = self._dmp.fused_optimizer.state_dict()["state"]
        if state.get("table_parts"):
            local = {("model", n, ""): _local_shards(t) for n, t in own.items()
                     if n.startswith(EBC_PREFIX)}
            local.update({("sparse", p, k): _local_shards(v) for p, st in fused.items()
                          for k, v in st.items()})
            held = table_parts.load_blocks(
                (table_parts.read_part(p, mmap=True) for p in state["table_parts"]), local)
            if strict:  # every table; the optimizer state of the tables this rank holds
                _check_names({i for i in local if i[0] == "model"},
                             {i for i in held if i[0] == "model"}, "table parts")
                lacking = sorted(i for i in local if i[0] == "sparse" and i not in held)
                if lacking:
                    raise KeyError(f"sparse_optimizer: the checkpoint lacks {lacking}")
            own = {n: t for n, t in own.items() if not n.startswith(EBC_PREFIX)}
            fused = {}
        if strict:  # with parts, the state's "model" holds the dense part only
            _check_names(set(own), set(model), "model")
        for name, t in own.items():
            if name in model:
                _copy_shards(t, model[name], name)
        for pname, states in fused.items():
            for k, v in states.items():
                if pname in saved_sparse and k in saved_sparse[pname]:
                    _copy_shards(v, saved_sparse[pname][k], f"{pname}/{k}")
                elif strict:
                    raise KeyError(f"sparse_optimizer: the checkpoint lacks {pname}/{k}")
        if "dense_optimizer" in state:
            self._dense_opt.load_state_dict(state["dense_optimizer"])
        self._load_dynamic_state(state, strict)
        self.global_step = int(state.get("global_step", 0))
        self._lrs = None

    def _load_dynamic_state(self, state: Mapping[str, Any], strict: bool) -> None:
        """The dynamic tables' index and counters of a checkpoint state (every rank).

        A state split into another number of partitions is re-split into this model's
        (``odl.models.dynamic.resplit``): each id's row of weights and optimizer state moves
        with it, the free rows get fresh values.
        """
        if self.dynamic:
            if "dynamic_tables" not in state:
                raise KeyError("the checkpoint has no dynamic-table state but the model has "
                               f"dynamic tables {sorted(self.dynamic.tables)}")
            saved = state["dynamic_tables"]
            if saved_partitions(saved) != self.dynamic.partitions:
                self._load_resplit(saved, table_parts.TableBlocks(state), {},
                                   int(state.get("global_step", 0)), list(self.dynamic.tables),
                                   with_optimizer=True)
            else:
                self.dynamic.load_state_dict(saved)
            self._stream_time = float(state.get("stream_time", 0.0))
        elif strict and "dynamic_tables" in state:
            raise KeyError("the checkpoint has dynamic tables "
                           f"{sorted(state['dynamic_tables'].get('tables', {}))}, the model none")

    @torch.no_grad()
    def _load_resplit(self, saved: Mapping[str, Any], source: table_parts.TableBlocks,
                      var_map: Mapping[str, str], step: int, names: Sequence[str],
                      with_optimizer: bool) -> None:
        """Loads a dynamic-table state of another number of partitions, re-split into ours.

        Each kept id's row (weights, and with ``with_optimizer`` its optimizer state) is
        copied from ``source``'s old row to its new one; with ``with_optimizer`` (a restore)
        the other rows are reset as evicted rows are, otherwise (a warm start) they keep
        their initial values. With several ranks each rank writes the rows it holds.

        Args:
            saved: the checkpoint's ``"dynamic_tables"`` (every partition).
            source: the checkpoint's tables, whole or in parts.
            var_map: own parameter name -> the source's (a warm start's renames).
            step: the checkpoint's global step.
            names: the dynamic tables to load (the others keep their state).
            with_optimizer: move the optimizer state too and reset the free rows.
        """
        specs = {n: self.dynamic.tables[n].spec for n in names}
        split = resplit_state(saved, specs, self._seed, self.dynamic.partitions, step,
                              self.dynamic.delete_consumers())
        self.dynamic.load_state_dict(split.state, tables=names)
        fused = self._dmp.fused_optimizer.state_dict()["state"] if with_optimizer else {}
        for base, src in split.sources.items():
            for t in self._dynamic_torch_tables[base]:
                pname = f"{EBC_PREFIX}{t}.weight"
                weight = self._table_shards(t)[0]
                targets = [("", weight)] + [
                    (k, v) for k, v in fused.get(pname, {}).items()
                    if (isinstance(v, torch.Tensor) or hasattr(v, "local_shards"))
                    and len(v.size()) and int(v.size()[0]) == src.shape[0]]
                for key, tensor in targets:
                    shards = (_local_shards(tensor) if self.world_size > 1
                              else [((0,) * len(tensor.size()), _local_view(tensor))])
                    for offsets, shard in shards:
                        from_rows = src[offsets[0]:offsets[0] + shard.shape[0]]
                        kept = np.flatnonzero(from_rows >= 0)
                        for c in range(0, kept.shape[0], _RESPLIT_CHUNK_ROWS):
                            at = kept[c:c + _RESPLIT_CHUNK_ROWS]
                            rows = source.take(var_map.get(pname, pname),
                                               torch.from_numpy(from_rows[at]), key)
                            if shard.dim() > 1:
                                rows = rows[:, offsets[1]:offsets[1] + shard.shape[1]]
                            shard.index_copy_(0, torch.from_numpy(at).to(shard.device),
                                              rows.to(shard.device, shard.dtype))
        if with_optimizer:
            self.reset_dynamic_rows({b: np.flatnonzero(src < 0)
                                     for b, src in split.sources.items()}, step)
        logger.info("dynamic tables re-split from %d into %d partition(s) by id: %s",
                    saved_partitions(saved), self.dynamic.partitions,
                    ", ".join(f"{n} {self.dynamic.tables[n].live} rows kept on this rank, "
                              f"{split.dropped[n].shape[0]} dropped" for n in names))

    @torch.no_grad()
    def load_parameters(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        var_map: Mapping[str, str] | None = None,
        dynamic_state: Mapping[str, Any] | None = None,
        source_step: int = 0,
    ) -> WarmStartReport:
        """Warm start: copies parameters (and buffers) only, no optimizer state.

        A dynamic table's rows mean nothing without its id index: its weights are copied only
        with the source's dynamic-table state (``dynamic_state``, another checkpoint's
        ``"dynamic_tables"``), which is then loaded too (ids, counters); otherwise the table
        starts empty.

        Args:
            named_tensors: source name -> tensor (e.g. another checkpoint's ``"model"``).
            var_map: own (new) name -> source (old) name for renamed parameters.
            dynamic_state: the source checkpoint's ``"dynamic_tables"``, if any. Split into
                another number of partitions, it is re-split into this model's and each
                id's row moves with it (``odl.models.dynamic.resplit``).
            source_step: the source checkpoint's global step (the keep priority of ids a
                re-split has no room for).

        Returns:
            What was loaded, what is missing (kept initial values) and what was unused.

        Raises:
            ValueError: a source tensor's shape differs (message names both).
        """
        var_map = dict(var_map or {})
        report = WarmStartReport()
        used = set()
        saved_p = saved_partitions(dynamic_state or {})
        saved_tables = (dynamic_state or {}).get("tables", {}) if saved_p == 1 else next(
            iter((dynamic_state or {}).get("parts", {}).values()), {}).get("tables", {})
        present = [b for b in self._dynamic_torch_tables if b in saved_tables]
        skip, moved = set(), set()
        for base, torch_tables in self._dynamic_torch_tables.items():
            if base not in saved_tables:
                skip |= {f"{EBC_PREFIX}{t}.weight" for t in torch_tables}
                logger.warning("warm start: dynamic table %s starts empty (the source has no "
                               "id index for it)", base)
        if present and saved_p != self.dynamic.partitions:  # rows move with their ids
            self._load_resplit(dynamic_state, table_parts.TableBlocks({"model": named_tensors}),
                               var_map, source_step, present, with_optimizer=False)
            for base in present:
                for t in self._dynamic_torch_tables[base]:
                    name = f"{EBC_PREFIX}{t}.weight"
                    moved.add(name)
                    used.add(var_map.get(name, name))
                    report.loaded.append((name, var_map.get(name, name)))
        elif present:
            self.dynamic.load_state_dict(dynamic_state, tables=present)
        own = self._named_state() if self.world_size == 1 else self._sharded_state()
        for name, t in own.items():
            if name in moved:
                continue
            if name in skip:
                report.missing.append(name)
                continue
            src = var_map.get(name, name)
            if src not in named_tensors:
                report.missing.append(name)
                continue
            _copy_shards(t, named_tensors[src], name, src)  # each rank its own rows
            used.add(src)
            report.loaded.append((name, src))
        report.unused = sorted(set(named_tensors) - used)
        for name in report.missing:
            logger.warning("warm start: no value for %s, keeping its initial value", name)
        if report.unused:
            logger.info("warm start: %d source tensors unused: %s", len(report.unused),
                        ", ".join(report.unused[:20]))
        logger.info("warm start: loaded %d tensors", len(report.loaded))
        return report


def _check_names(own: set[str], saved: set[str], what: str) -> None:
    missing, unexpected = sorted(own - saved), sorted(saved - own)
    if missing or unexpected:
        raise KeyError(f"checkpoint {what} does not match the model: missing {missing}, "
                       f"unexpected {unexpected}")


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str, src_name: str) -> None:
    src = torch.as_tensor(src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: {name} has shape {tuple(dst.shape)} but the source "
            f"{src_name} has shape {tuple(src.shape)}")
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def _shard_pieces(t: Any) -> tuple[tuple[int, ...], list]:
    """``(whole size, [(offsets, CPU tensor)])`` of a ShardedTensor's local shards.

    On CPU a shard's tensor is a view of the rank's fused buffer, not a copy. A plain tensor
    (the same on every rank) is one piece with offsets None.
    """
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        return tuple(t.size()), [(off, x.detach().cpu()) for off, x in _local_shards(t)]
    t = torch.as_tensor(t)
    return tuple(t.shape), [(None, t.detach().cpu().clone())]


def _local_shards(t: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``[(offsets, writable tensor)]`` of a ShardedTensor's local shards.

    A plain tensor is itself at offset 0.
    """
    if hasattr(t, "local_shards") and hasattr(t, "metadata"):
        return [(tuple(sh.metadata.shard_offsets), sh.tensor) for sh in t.local_shards()]
    return [(tuple(0 for _ in t.shape), t)]


def _copy_shards(dst: Any, whole: torch.Tensor, name: str, src_name: str = "") -> None:
    """Copies each local shard of ``dst`` from the rows and columns it covers in ``whole``.

    A plain ``dst`` is copied whole.
    """
    whole = torch.as_tensor(whole)
    src_name = src_name or name
    if not (hasattr(dst, "local_shards") and hasattr(dst, "metadata")):
        _copy_into(dst, whole, name, src_name)
        return
    if tuple(dst.size()) != tuple(whole.shape):
        raise ValueError(f"shape mismatch: {name} has shape {tuple(dst.size())} but the "
                         f"source {src_name} has shape {tuple(whole.shape)}")
    for sh in dst.local_shards():
        idx = tuple(slice(o, o + n) for o, n in zip(sh.metadata.shard_offsets,
                                                    sh.metadata.shard_sizes, strict=True))
        sh.tensor.copy_(whole[idx].to(device=sh.tensor.device, dtype=sh.tensor.dtype))


def _tensors_to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors_to_cpu(v) for v in obj]
    return obj
