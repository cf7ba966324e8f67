"""Memory a training run will need, estimated from the config before anything is allocated.

``odl-train`` (also with ``--validate_only``) refuses a config whose estimate exceeds a
fraction of the memory available, with one line naming the field that needs the memory
(:func:`check_memory`), instead of starting and being killed half-way through allocating.

Formula (bytes; every value is fp32, 4 bytes):

* Tables, as the model builds them (``odl.models.embedding_tables``): each table
  (``embedding_name``, or the feature name) with a feature in a ``DEEP`` / ``WIDE_AND_DEEP``
  group is a deep table of ``rows x embedding_dim``; each with a feature in a ``WIDE`` /
  ``WIDE_AND_DEEP`` group is also a wide table of ``rows x ceil4(wide_output_dim)``.
  ``rows`` = ``hash_bucket_size``, ``num_buckets``, the entries of ``vocab_list`` /
  ``vocab_file`` or ``len(boundaries) + 1``; a dynamic table's capacity, plus 56 bytes per
  row (72 with show / click) for its id index and counters and 16 MiB at most for its
  admission sketch (32 MiB when it counts clicks).
  ``tables = 4 x sum(rows x stored dim)``.
* Table optimizer state (fbgemm's fused optimizer, one state per table):
  ``sgd`` none; ``adagrad`` (element-wise, odl's default and EasyRec's) ``rows x dim``
  floats; ``rowwise_adagrad`` ``rows`` floats; ``adam`` ``2 x rows x dim`` floats.
* Dense part: ``4 x P x (2 + s)`` for the ``P`` parameters of the DeepFM towers (DNN
  ``Linear`` layers with biases, BatchNorm scales and shifts, the deep/final output layer,
  the wide bias and the wide linear term over dense features), their gradients, and ``s``
  floats of optimizer state per parameter (``sgd`` 0, ``adagrad`` 1, ``adam`` 2).
* Activations: ``4 x 3 x batch_size x (pooled embedding width + DNN input width + sum of
  hidden_units of dnn and final_dnn)``: forward values, their gradients and one
  intermediate each (a rough upper bound).
* Progressive metrics: ``48 x metrics_window_samples`` (three float64 windows and the sort
  buffers of the window AUC).
* Runtime: ``RUNTIME_BYTES`` (512 MiB: Python with torch, TorchRec and fbgemm loaded).

On CPU everything is host memory, and the tables and their state count twice: writing a
checkpoint copies them into plain CPU tensors beside the live ones, and restoring one loads
them beside the model::

    host = 2 x (tables + table state) + dense + activations + metrics + runtime

On CUDA the model lives in device memory and the checkpoint copy in host memory::

    device = tables + table state + dense + activations
    host   = tables + table state + dense + metrics + runtime

With N ranks (``torchrun``: ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` of them on this host)
"tables + table state" above is one rank's share (``MemoryEstimate.rank_sparse_bytes``): an
N-th of every table and its state, plus the largest table below ``ROW_WISE_MIN_ROWS`` rows
(placed whole on one rank), plus the dynamic tables' id index and counters whole (or an
N-th with ``dynamic_index_partitions`` > 1); the device figure is per rank, the host figure
that of the ranks on this host together.

Available memory: host memory is ``psutil.virtual_memory().available``, lowered to the room
left under a cgroup memory limit (cgroup v2 ``memory.max`` minus ``memory.current`` less
reclaimable page cache, or cgroup v1 ``memory.limit_in_bytes``) of this process's cgroup or
any of its parents; device memory is the free memory CUDA reports. A run is refused when an
estimate exceeds ``fraction x available``; ``fraction`` is 0.8 unless ``--max_memory_fraction``
or the environment variable ``ODL_MAX_MEMORY_FRACTION`` say otherwise (0 turns the check off).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from odl.config.config_error import ConfigError
from odl.config.dynamic_table_config import dynamic_table_spec
from odl.config.feature_configs import embedded_feature, feature_configs
from odl.config.feature_settings import has_vocabulary, vocabulary_size
from odl.config.limits import ROW_WISE_MIN_ROWS
from odl.config.model_classes import (
    is_multi_task_model,
    is_tower_model,
    multi_task_settings,
    sequence_attention_features,
    tower_settings,
    uses_fm,
    wide_deep_settings,
)
from odl.config.optimizer_support import optimizer_choices, table_kernel_kind
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "AvailableMemory",
    "DEFAULT_MAX_MEMORY_FRACTION",
    "MAX_MEMORY_FRACTION_ENV",
    "MemoryEstimate",
    "RUNTIME_BYTES",
    "TableEstimate",
    "available_host_memory",
    "check_memory",
    "estimate_memory",
    "resolve_max_memory_fraction",
]

BYTES_PER_VALUE = 4
RUNTIME_BYTES = 512 << 20
METRICS_BYTES_PER_SAMPLE = 48
ACTIVATION_COPIES = 3
# A dynamic table's id index (row ids, 2 hash slots, free stack) and row counters (sightings,
# last step, last time), per row; show / click add 16 (odl.models.dynamic.dynamic_table).
DYNAMIC_MAP_BYTES_PER_ROW = 56
WIDE_DIM_ALIGN = 4  # odl.models.embedding_tables.WIDE_DIM_ALIGN (not imported: no torch here)

DEFAULT_MAX_MEMORY_FRACTION = 0.8
MAX_MEMORY_FRACTION_ENV = "ODL_MAX_MEMORY_FRACTION"

# Table optimizer state: (floats per row, floats per row and dimension).
_SPARSE_STATE = {"sgd": (0, 0), "adagrad": (0, 1), "rowwise_adagrad": (1, 0), "adam": (0, 2),
                 "lamb": (0, 2)}
# Dense optimizer state floats per parameter.
_DENSE_STATE = {"sgd": 0, "momentum": 1, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2,
                "adamw": 2, "ftrl": 2}

_FT = pipeline_pb2.FeatureConfig.FeatureType
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number close to 2**63


@dataclass(frozen=True)
class TableEstimate:
    """One embedding table of the model.

    Attributes:
        name: table name (``<table>_wide`` for a wide table).
        rows: number of rows.
        dim: stored columns.
        weight_bytes: ``4 x rows x dim``.
        state_bytes: its optimizer state (and a dynamic table's id index and counters).
        map_bytes: of ``state_bytes``, a dynamic table's id index and counters.
    """

    name: str
    rows: int
    dim: int
    weight_bytes: int
    state_bytes: int
    map_bytes: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated memory of one training run (see the module docstring for the formula).

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        sparse_kind: the tables' optimizer.
        dense_kind: the dense part's optimizer.
        tables: every table, largest first.
        dense_parameters: number of dense parameters ``P``.
        dense_bytes: parameters, gradients and optimizer state of the dense part.
        activation_bytes: activations of one step.
        metrics_bytes: progressive metrics window.
        runtime_bytes: the process itself.
        ranks: processes training the model together (``torchrun``'s ``WORLD_SIZE``).
        ranks_on_host: of those, the ones on this host (``LOCAL_WORLD_SIZE``).
        index_partitions: ``train_config.dynamic_index_partitions``.
    """

    device_type: str
    sparse_kind: str
    dense_kind: str
    tables: list[TableEstimate] = field(default_factory=list)
    dense_parameters: int = 0
    dense_bytes: int = 0
    activation_bytes: int = 0
    metrics_bytes: int = 0
    runtime_bytes: int = RUNTIME_BYTES
    ranks: int = 1
    ranks_on_host: int = 1
    index_partitions: int = 1

    @property
    def table_bytes(self) -> int:
        """Weights of all tables."""
        return sum(t.weight_bytes for t in self.tables)

    @property
    def table_state_bytes(self) -> int:
        """Optimizer state of all tables."""
        return sum(t.state_bytes for t in self.tables)

    @property
    def sparse_bytes(self) -> int:
        """Tables and their optimizer state."""
        return self.table_bytes + self.table_state_bytes

    @property
    def rank_sparse_bytes(self) -> int:
        """Tables and their optimizer state one rank holds (all of them with one process).

        With N ranks: an N-th of every table, plus the largest table below
        ``ROW_WISE_MIN_ROWS`` rows (those are placed whole, so a rank may hold one more
        than its share); a dynamic table's id index and counters whole on every rank unless
        ``index_partitions`` splits them.
        """
        if self.ranks <= 1:
            return self.sparse_bytes
        maps = sum(t.map_bytes for t in self.tables)
        rows_bytes = self.sparse_bytes - maps
        whole = [t.weight_bytes + t.state_bytes - t.map_bytes for t in self.tables
                 if t.rows < ROW_WISE_MIN_ROWS]
        index = maps // self.ranks if self.index_partitions > 1 else maps
        return -(-rows_bytes // self.ranks) + max(whole, default=0) + index

    @property
    def host_bytes(self) -> int:
        """Host (CPU) memory needed, by every rank on this host together."""
        if self.device_type == "cuda":
            one = (self.rank_sparse_bytes + self.dense_bytes + self.metrics_bytes
                   + self.runtime_bytes)
        else:
            one = (2 * self.rank_sparse_bytes + self.dense_bytes + self.activation_bytes
                   + self.metrics_bytes + self.runtime_bytes)
        return one * max(1, self.ranks_on_host)

    @property
    def device_bytes(self) -> int:
        """CUDA device memory needed by one rank (0 on CPU)."""
        if self.device_type != "cuda":
            return 0
        return self.rank_sparse_bytes + self.dense_bytes + self.activation_bytes


@dataclass(frozen=True)
class AvailableMemory:
    """Memory a new process can use.

    Attributes:
        bytes: available bytes.
        source: where the figure comes from (``"host"``, or the cgroup directory whose
            limit is the tighter one).
    """

    bytes: int
    source: str


def _gib(n: float) -> str:
    if n < (1 << 30):
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.1f} GiB"


def _rows(fc: pipeline_pb2.FeatureConfig, model_ev: pipeline_pb2.EVParams | None) -> int:
    if fc.feature_type == _FT.RawFeature or fc.boundaries:  # a number (sequence) in buckets
        return len(fc.boundaries) + 1
    dyn = dynamic_table_spec(fc, model_ev, "feature")
    if dyn is not None:
        return dyn.capacity
    if has_vocabulary(fc):
        return vocabulary_size(fc)
    return int(fc.hash_bucket_size or fc.num_buckets)


def _map_bytes(fc: pipeline_pb2.FeatureConfig, model_ev: pipeline_pb2.EVParams | None) -> int:
    """Bytes of a dynamic table's id index, counters and sketch (0 for a fixed table)."""
    if fc.feature_type == _FT.RawFeature:
        return 0
    dyn = dynamic_table_spec(fc, model_ev, "feature")
    if dyn is None:
        return 0
    per_row = DYNAMIC_MAP_BYTES_PER_ROW + (16 if dyn.keeps_scores else 0)
    sketch = 0
    if dyn.counts_candidates:  # 4 rows of float32 show (and click) counters
        width = 1024
        while width < dyn.capacity and width < 1 << 20:
            width *= 2
        sketch = 16 * width * (2 if dyn.admit_score > 0 or dyn.keeps_scores else 1)
    return per_row * dyn.capacity + sketch


def _width(fc: pipeline_pb2.FeatureConfig) -> int:
    """Columns of one lookup or value of a feature (a key's or a sequence item's part)."""
    if embedded_feature(fc):
        return int(fc.embedding_dim)
    return 1 if fc.feature_type == _FT.SequenceFeature else int(fc.raw_input_dim)


def _group_input(fc: pipeline_pb2.FeatureConfig) -> tuple[int, int]:
    """``(columns, dense parameters)`` a feature adds to a feature group's input.

    An embedded feature its embedding; a sequence its combiner's vector (and weights); a
    projected raw feature its vector (and the vector it learns); a dense raw feature 1.
    """
    dim = int(fc.embedding_dim)
    if fc.feature_type == _FT.SequenceFeature:
        comb = fc.sequence_combiner
        if comb.HasField("text_cnn"):
            t = comb.text_cnn
            filters = [int(f) for f in t.num_filters]
            return sum(filters), sum(int(k) * dim * f + f
                                     for k, f in zip(t.filter_sizes, filters, strict=False))
        return dim, dim  # attention: one score weight per column
    if embedded_feature(fc):
        return dim, 0
    if fc.feature_type == _FT.RawFeature and dim > 0:
        return dim, dim * int(fc.raw_input_dim)
    return int(fc.raw_input_dim), 0


def _attention_params(key: int, dnn: pipeline_pb2.DNN) -> int:
    """Parameters of a target attention's MLP over ``[k, h, k - h, k * h]`` (last layer plain)."""
    units = [int(u) for u in dnn.hidden_units]
    params, w = 0, 4 * key
    for i, u in enumerate(units):
        params += w * u + u
        if dnn.use_bn and i < len(units) - 1:
            params += 2 * u
        w = u
    return params


def _group_attention(group: pipeline_pb2.FeatureGroupConfig,
                     features: dict[str, pipeline_pb2.FeatureConfig]) -> tuple[int, int, list[str]]:
    """``(columns, dense parameters, features)`` a group's ``sequence_features`` add."""
    cols = params = 0
    names: list[str] = []
    for sa in group.sequence_features:
        keys = [k for m in sa.seq_att_map for k in m.key]
        hists = [h for m in sa.seq_att_map for h in m.hist_seq]
        if sa.pooling:  # TorchEasyRec's pooling encoder: the items only, no parameter
            cols += sum(_width(features[h]) for h in hists if h in features)
            names += hists
            continue
        key = sum(_width(features[k]) for k in keys if k in features)
        names += keys + hists
        if sa.HasField("attn_mlp"):  # TorchEasyRec's DIN encoder: MLP, Linear to 1; [att]
            p, out = _mlp_params(4 * key, sa.attn_mlp)
            cols += key
            params += p + out + 1
            continue
        dnn = sa.seq_dnn if sa.HasField("seq_dnn") else pipeline_pb2.DNN(
            hidden_units=[128, 64, 32, 1])  # EasyRec's default (odl.models.model_factory)
        cols += 2 * key
        params += _attention_params(key, dnn)
    return cols, params, names


def _mlp_params(in_dim: int, dnn: pipeline_pb2.DNN) -> tuple[int, int]:
    """``(parameters, output width)`` of one DNN tower."""
    params, width = 0, in_dim
    for units in dnn.hidden_units:
        params += width * int(units) + int(units)
        if dnn.use_bn:
            params += 2 * int(units)
        width = int(units)
    return params, width


def _tower_params(mc: pipeline_pb2.EasyRecModel,
                  features: dict[str, pipeline_pb2.FeatureConfig]) -> tuple[int, int]:
    """``(dense parameters, hidden units)`` of a MultiTower / DCN model."""
    _field, settings, towers = tower_settings(mc)
    groups = {g.group_name: list(g.feature_names) for g in mc.feature_groups}
    params = hidden = width = 0
    for kind, group, tower in towers:
        if kind == "din":  # attention MLP over [k, h, k - h, k * h]; output [attended, k]
            keys, _hists = sequence_attention_features(mc, group)
            key = sum(_width(features[k]) for k in keys if k in features)
            if tower.HasField("attn_mlp"):  # TorchEasyRec's encoder: MLP, Linear to 1; [att]
                p, out = _mlp_params(4 * key, tower.attn_mlp)
                params += p + out + 1
                hidden += sum(int(u) for u in tower.attn_mlp.hidden_units)
                width += key
                continue
            params += _attention_params(key, tower.dnn)
            hidden += sum(int(u) for u in tower.dnn.hidden_units)
            width += 2 * key
            continue
        in_width = 0
        for name in groups.get(group, []):
            fc = features.get(name)
            if fc is not None:
                cols, extra = _group_input(fc)
                in_width += cols
                params += extra
        for g in mc.feature_groups:
            if g.group_name == group:
                cols, extra, _names = _group_attention(g, features)
                in_width += cols
                params += extra
        if kind == "cross":
            params += 2 * int(tower) * in_width
            width += in_width
        elif kind == "cross_v2":
            cross, backbone = tower
            out = in_width
            if backbone is not None:
                p, out = _mlp_params(in_width, backbone)
                params += p
                hidden += sum(int(u) for u in backbone.hidden_units)
            rank = int(cross.low_rank)
            params += int(cross.cross_num) * (2 * out * rank + out)
            width += out
        else:
            p, out = _mlp_params(in_width, tower)
            params += p
            width += out
            hidden += sum(int(u) for u in tower.hidden_units)
    final_params, final_width = _mlp_params(width, settings.final_dnn)
    hidden += sum(int(u) for u in settings.final_dnn.hidden_units)
    classes = max(int(mc.num_class), 1)
    return params + final_params + (final_width + 1) * classes, hidden


def _multi_task_params(mc: pipeline_pb2.EasyRecModel,
                       features: dict[str, pipeline_pb2.FeatureConfig]) -> tuple[int, int]:
    """``(dense parameters, hidden units)`` of an MMoE / DBMTL model."""
    field, settings = multi_task_settings(mc)
    names = [g.group_name for g in mc.feature_groups]
    group = "all" if "all" in names else (names[0] if names else "")
    width = params = hidden = 0
    for g in mc.feature_groups:
        if g.group_name == group:
            for name in g.feature_names:
                fc = features.get(name)
                if fc is not None:
                    cols, extra = _group_input(fc)
                    width += cols
                    params += extra
            cols, extra, _names = _group_attention(g, features)
            width += cols
            params += extra
    if field == "dbmtl" and settings.HasField("bottom_dnn"):
        p, width = _mlp_params(width, settings.bottom_dnn)
        params += p
        hidden += sum(int(u) for u in settings.bottom_dnn.hidden_units)
    num_tasks = len(settings.task_towers)
    if field == "mmoe" or settings.HasField("expert_dnn"):
        experts = max(1, int(settings.num_expert))
        gate_in = width
        if field == "mmoe" and settings.HasField("gate_mlp"):
            gp, gate_in = _mlp_params(width, settings.gate_mlp)
            params += num_tasks * gp
        params += num_tasks * (gate_in * experts + experts)
        p, width = _mlp_params(width, settings.expert_dnn)
        params += experts * p
        hidden += experts * sum(int(u) for u in settings.expert_dnn.hidden_units)
    outs: dict[str, int] = {}
    for t in settings.task_towers:
        p, tower_width = _mlp_params(width, t.dnn)
        rel_in = tower_width + sum(outs.get(r, 0) for r in t.relation_tower_names)
        rp, rel_width = _mlp_params(rel_in, t.relation_dnn)
        outs[t.tower_name] = rel_width
        params += p + rp + rel_width + 1
        hidden += sum(int(u) for u in t.dnn.hidden_units) + sum(
            int(u) for u in t.relation_dnn.hidden_units)
    return params, hidden


def estimate_memory(config: pipeline_pb2.EasyRecConfig, device_type: str, ranks: int = 1,
                    ranks_on_host: int = 1) -> MemoryEstimate:
    """Estimates the memory of training ``config`` on ``device_type``.

    Reads only the config (call it on a validated config); allocates nothing.

    Args:
        config: the pipeline config.
        device_type: ``"cpu"`` or ``"cuda"``.
        ranks: processes training the model together (``torchrun``).
        ranks_on_host: of those, the ones on this host.

    Returns:
        The estimate.
    """
    features = {fc.feature_name: fc for fc in feature_configs(config)}
    mc = config.model_config
    deep_feats: list[str] = []
    wide_feats: list[str] = []
    towers = tower_settings(mc)[2] if is_tower_model(mc) else None
    if is_multi_task_model(mc):  # one group, read through deep tables
        names = [g.group_name for g in mc.feature_groups]
        towers = [("dnn", "all" if "all" in names else names[0], None)] if names else []
    for kind, group, _tower in towers or []:
        if kind == "din":  # a DIN tower's keys and sequences
            keys, hists = sequence_attention_features(mc, group)
            deep_feats += [n for n in keys + hists if n not in deep_feats]
    for g in mc.feature_groups:
        if towers is not None:  # towers read their groups through deep tables only
            if any(group == g.group_name for _kind, group, _t in towers):
                names = list(g.feature_names) + _group_attention(g, features)[2]
                deep_feats += [n for n in names if n not in deep_feats]
            continue
        for name in g.feature_names:
            if g.wide_deep in (pipeline_pb2.DEEP, pipeline_pb2.WIDE_AND_DEEP) \
                    and name not in deep_feats:
                deep_feats.append(name)
            if g.wide_deep in (pipeline_pb2.WIDE, pipeline_pb2.WIDE_AND_DEEP) \
                    and name not in wide_feats:
                wide_feats.append(name)
    sparse, dense = optimizer_choices(config.train_config)
    per_row, per_value = _SPARSE_STATE.get(table_kernel_kind(sparse.kind), (0, 2))
    _field, d = wide_deep_settings(mc)
    wide_out = max(1, int(d.wide_output_dim))
    wide_dim = -(-wide_out // WIDE_DIM_ALIGN) * WIDE_DIM_ALIGN

    tables: dict[str, TableEstimate] = {}

    model_ev = mc.ev_params if mc.HasField("ev_params") else None

    mapped: set[str] = set()  # dynamic tables whose index is counted (once per deep/wide pair)

    def add_table(name: str, rows: int, dim: int, fc: pipeline_pb2.FeatureConfig) -> None:
        if name in tables:
            return
        base = fc.embedding_name or fc.feature_name
        map_bytes = 0 if base in mapped else _map_bytes(fc, model_ev)
        mapped.add(base)
        tables[name] = TableEstimate(
            name, rows, dim, BYTES_PER_VALUE * rows * dim,
            BYTES_PER_VALUE * rows * (per_row + per_value * dim) + map_bytes, map_bytes)

    deep_in = pooled = fm_dim = extra_params = 0
    for name in deep_feats:
        fc = features.get(name)
        if fc is None:
            continue
        cols, extra = _group_input(fc)
        deep_in += cols
        extra_params += extra
        if not embedded_feature(fc):
            continue
        dim = int(fc.embedding_dim)
        # stored with a multiple of 4 columns (odl.models.embedding_tables.storage_dim)
        add_table(fc.embedding_name or name, _rows(fc, model_ev),
                  -(-dim // WIDE_DIM_ALIGN) * WIDE_DIM_ALIGN, fc)
        pooled += dim
        fm_dim = max(fm_dim, dim)
    if towers is None:  # WideAndDeep deep groups' target attention (sequence_features)
        for g in mc.feature_groups:
            if g.wide_deep != pipeline_pb2.DEEP:
                continue
            cols, extra, names = _group_attention(g, features)
            deep_in += cols
            extra_params += extra
            for name in names:
                fc = features.get(name)
                if fc is not None and embedded_feature(fc):
                    dim = int(fc.embedding_dim)
                    add_table(fc.embedding_name or name, _rows(fc, model_ev),
                              -(-dim // WIDE_DIM_ALIGN) * WIDE_DIM_ALIGN, fc)
                    pooled += dim
    wide_dense = 0
    for name in wide_feats:
        fc = features.get(name)
        if fc is None:
            continue
        if not embedded_feature(fc):
            wide_dense += int(fc.raw_input_dim)
            continue
        add_table(f"{fc.embedding_name or name}_wide", _rows(fc, model_ev), wide_dim, fc)
        pooled += wide_dim

    if is_tower_model(mc):
        params, hidden = _tower_params(mc, features)
    elif is_multi_task_model(mc):
        params, hidden = _multi_task_params(mc, features)
    else:
        if not uses_fm(mc):
            fm_dim = 0
        classes = max(int(mc.num_class), 1)
        params, deep_width = _mlp_params(deep_in, d.dnn)
        params += 1 + wide_dense * wide_out  # wide bias, wide linear term over dense features
        params += extra_params  # sequence combiners, projected raw features
        hidden = sum(int(u) for u in d.dnn.hidden_units)
        if d.HasField("final_dnn"):
            final_params, final_width = _mlp_params(wide_out + fm_dim + deep_width,
                                                    d.final_dnn)
            params += final_params + (final_width + 1) * classes
            hidden += sum(int(u) for u in d.final_dnn.hidden_units)
        else:
            params += (deep_width + 1) * classes
    if mc.loss_weight_strategy == pipeline_pb2.EasyRecModel.Uncertainty:  # learned weights
        terms = list(mc.losses)
        if is_multi_task_model(mc):
            terms = [t for task in multi_task_settings(mc)[1].task_towers for t in task.losses]
        params += sum(1 for t in terms if t.learn_loss_weight)
    dense_bytes = BYTES_PER_VALUE * params * (2 + _DENSE_STATE.get(dense.kind, 2))
    batch = int(config.data_config.batch_size)
    activations = BYTES_PER_VALUE * ACTIVATION_COPIES * batch * (pooled + deep_in + hidden)
    metrics = METRICS_BYTES_PER_SAMPLE * int(config.train_config.metrics_window_samples)
    return MemoryEstimate(
        ranks=max(1, int(ranks)),
        ranks_on_host=max(1, int(ranks_on_host)),
        index_partitions=max(1, int(config.train_config.dynamic_index_partitions)),
        device_type=device_type,
        sparse_kind=sparse.kind,
        dense_kind=dense.kind,
        tables=sorted(tables.values(), key=lambda t: -t.weight_bytes),
        dense_parameters=params,
        dense_bytes=dense_bytes,
        activation_bytes=activations,
        metrics_bytes=metrics,
    )


# --------------------------------------------------------------------------- available memory


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_room(directory: str, v2: bool) -> int | None:
    """Bytes left under ``directory``'s memory limit, or None when it has none."""
    if v2:
        limit_text = _read(os.path.join(directory, "memory.max"))
        usage_text = _read(os.path.join(directory, "memory.current"))
        reclaimable = "inactive_file"
    else:
        limit_text = _read(os.path.join(directory, "memory.limit_in_bytes"))
        usage_text = _read(os.path.join(directory, "memory.usage_in_bytes"))
        reclaimable = "total_inactive_file"
    if limit_text is None or not limit_text.isdigit():
        return None  # "max", missing or unreadable: no limit here
    limit = int(limit_text)
    if limit >= _UNLIMITED:
        return None
    usage = int(usage_text) if usage_text and usage_text.isdigit() else 0
    usage -= _stat_value(_read(os.path.join(directory, "memory.stat")), reclaimable)
    return max(0, limit - max(0, usage))


def _cgroup_dirs(cgroup_root: str, proc_cgroup: str) -> list[tuple[str, bool]]:
    """This process's memory cgroup directories, innermost first, each with ``is_v2``."""
    text = _read(proc_cgroup) or ""
    found: list[tuple[str, bool]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, rel = parts
        if controllers == "":
            base, v2 = cgroup_root, True
        elif "memory" in controllers.split(","):
            base, v2 = os.path.join(cgroup_root, "memory"), False
        else:
            continue
        segments = [s for s in rel.split("/") if s and s not in (".", "..")]
        for depth in range(len(segments), -1, -1):
            found.append((os.path.join(base, *segments[:depth]), v2))
    if not found:  # no /proc/self/cgroup: a container's own root, if any
        found = [(cgroup_root, True), (os.path.join(cgroup_root, "memory"), False)]
    return found


def available_host_memory(
    cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"
) -> AvailableMemory:
    """Host memory this process may still use: psutil's figure, capped by cgroup limits.

    Args:
        cgroup_root: where the cgroup file system is mounted.
        proc_cgroup: the process's cgroup membership file.

    Returns:
        The smaller of ``psutil.virtual_memory().available`` and the room left under the
        memory limit of this process's cgroup or any parent cgroup.
    """
    import psutil

    best = AvailableMemory(int(psutil.virtual_memory().available), "host")
    seen: set[str] = set()
    for directory, v2 in _cgroup_dirs(cgroup_root, proc_cgroup):
        if directory in seen:
            continue
        seen.add(directory)
        room = _cgroup_room(directory, v2)
        if room is not None and room < best.bytes:
            best = AvailableMemory(room, f"cgroup {directory}")
    return best


def resolve_max_memory_fraction(value: float | None = None) -> float:
    """The fraction of available memory a run may use.

    Args:
        value: ``--max_memory_fraction`` when given; else the environment variable
            ``ODL_MAX_MEMORY_FRACTION``; else 0.8.

    Returns:
        A finite fraction >= 0; 0 turns the memory check off.

    Raises:
        ConfigError: the value is not a finite number >= 0.
    """
    where = "--max_memory_fraction"
    if value is None:
        text = os.environ.get(MAX_MEMORY_FRACTION_ENV, "").strip()
        if not text:
            return DEFAULT_MAX_MEMORY_FRACTION
        where = MAX_MEMORY_FRACTION_ENV
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(where, f"expected a number >= 0, got {text[:40]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(where, f"expected a finite number >= 0, got {value}")
    return float(value)


def _blame(config: pipeline_pb2.EasyRecConfig, est: MemoryEstimate, sparse: int) -> str:
    """The config field behind the largest part of an estimate."""
    parts = {
        "tables": sparse,
        "dense": est.dense_bytes,
        "activations": est.activation_bytes,
        "metrics": est.metrics_bytes,
    }
    largest = max(parts, key=lambda k: parts[k])
    if largest == "dense" and is_multi_task_model(config.model_config):
        field, _settings = multi_task_settings(config.model_config)
        return f"model_config.{field}"
    if largest == "dense" and is_tower_model(config.model_config):
        field, _settings, _towers = tower_settings(config.model_config)
        return f"model_config.{field}.final_dnn.hidden_units"
    if largest == "dense":
        field, d = wide_deep_settings(config.model_config)
        if d.HasField("final_dnn") and sum(d.final_dnn.hidden_units) > sum(d.dnn.hidden_units):
            return f"model_config.{field}.final_dnn.hidden_units"
        return f"model_config.{field}.dnn.hidden_units"
    if largest == "activations":
        return "data_config.batch_size"
    if largest == "metrics":
        return "train_config.metrics_window_samples"
    return "feature_configs" if config.feature_configs else "feature_config.features"


def _describe(est: MemoryEstimate, where: str) -> str:
    twice = est.device_type != "cuda" and where == "host"
    tables = (f"embedding tables {_gib(est.table_bytes)} + {est.sparse_kind} state "
              f"{_gib(est.table_state_bytes)}")
    if twice:
        tables += ", both twice while a checkpoint is written or read"
    largest = ", ".join(f"{t.name}: {t.rows:,} rows x {t.dim}" for t in est.tables[:3])
    act = "" if (est.device_type == "cuda" and where == "host") else \
        f", activations {_gib(est.activation_bytes)}"
    extra = f", metrics and runtime {_gib(est.metrics_bytes + est.runtime_bytes)}" \
        if where == "host" else ""
    ranks = (f"; {est.ranks} ranks ({est.ranks_on_host} on this host), each holding about "
             f"{_gib(est.rank_sparse_bytes)} of the tables and their state"
             if est.ranks > 1 else "")
    return (f"{tables}, dense part {_gib(est.dense_bytes)}{act}{extra}"
            f"{f'; largest tables {largest}' if largest else ''}{ranks}")


def check_memory(
    config: pipeline_pb2.EasyRecConfig,
    device_type: str,
    fraction: float,
    host_available: AvailableMemory | None = None,
    device_available: int | None = None,
    ranks: int = 1,
    ranks_on_host: int = 1,
) -> MemoryEstimate:
    """Refuses a config whose estimated memory exceeds ``fraction`` of what is available.

    Args:
        config: a validated pipeline config.
        device_type: the resolved device, ``"cpu"`` or ``"cuda"``.
        fraction: the share of available memory a run may use (0: no check).
        host_available: available host memory (default: :func:`available_host_memory`).
        device_available: free CUDA memory in bytes (needed for ``"cuda"``; None skips the
            device side).
        ranks: processes training the model together: each holds its share of the tables
            (``MemoryEstimate.rank_sparse_bytes``), its device its own.
        ranks_on_host: of those, the ones sharing this host's memory.

    Returns:
        The estimate.

    Raises:
        ConfigError: naming the field behind the largest part of the estimate, with the
            estimate and the limit.
    """
    est = estimate_memory(config, device_type, ranks, ranks_on_host)
    logger.info("estimated memory: host %s, device %s (tables %s + %s state %s, dense %s%s)",
                _gib(est.host_bytes), _gib(est.device_bytes), _gib(est.table_bytes),
                est.sparse_kind, _gib(est.table_state_bytes), _gib(est.dense_bytes),
                f"; {est.ranks} ranks, {est.ranks_on_host} on this host, "
                f"{_gib(est.rank_sparse_bytes)} of tables each" if est.ranks > 1 else "")
    if fraction <= 0:
        return est
    how = (f"--max_memory_fraction or {MAX_MEMORY_FRACTION_ENV} sets the share, 0 turns "
           "the check off")
    if device_type == "cuda" and device_available is not None:
        allowed = fraction * device_available
        if est.device_bytes > allowed:
            raise ConfigError(
                _blame(config, est, est.sparse_bytes),
                f"training needs an estimated {_gib(est.device_bytes)} of CUDA memory "
                f"({_describe(est, 'device')}) but the device has {_gib(device_available)} "
                f"free and odl uses at most {fraction * 100:g}% of it: {_gib(allowed)} "
                f"({how})")
    avail = host_available if host_available is not None else available_host_memory()
    allowed = fraction * avail.bytes
    if est.host_bytes > allowed:
        sparse = est.sparse_bytes * (1 if device_type == "cuda" else 2)
        where = "this host has" if avail.source == "host" else f"{avail.source} leaves"
        raise ConfigError(
            _blame(config, est, sparse),
            f"training needs an estimated {_gib(est.host_bytes)} of host memory "
            f"({_describe(est, 'host')}) but {where} {_gib(avail.bytes)} available and "
            f"odl uses at most {fraction * 100:g}% of it: {_gib(allowed)} ({how})")
    return est
