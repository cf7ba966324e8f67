"""Memory a training run will need, estimated before anything is allocated.

``odl-train`` (also with ``--validate_only``) refuses a config whose estimate exceeds a
fraction of the memory available, with one line naming the field that needs the memory
(:func:`check_memory`), instead of starting and being killed half-way through allocating.

The tables and the dense parameters are read from the model itself: :func:`estimate_memory`
builds it as training does (``odl.models.model_registry.build_model``) on the ``meta``
device, the tables as always and the dense part inside ``with torch.device("meta")``, so a
huge table or DNN costs no memory to count, and what is counted is what the model holds.

Formula (bytes; every value is fp32, 4 bytes):

* Tables: every table of ``model.ebc.embedding_bag_configs()`` (deep tables named like the
  ``TableSpec``, wide tables ``<table>_wide``), ``num_embeddings`` rows of its stored
  ``embedding_dim`` (a multiple of 4, ``odl.models.embedding_tables``); a dynamic table's
  rows are its capacity, plus 56 bytes per row (72 with show / click) for its id index and
  counters and 16 MiB at most for its admission sketch (32 MiB when it counts clicks),
  counted once per table even when it also has a wide twin. A *growing* dynamic table
  (``ev_params`` without a written capacity, ``odl.train.table_growth``) counts its start
  rows: it grows only once the memory a doubling needs is available. The estimate reports
  the rows the growing tables can reach (:func:`growth_limit`): their ``grows_to``, or fewer
  when the memory left allows fewer (with ``dynamic_index_partitions`` P > 1 the rows are a
  multiple of P). With a disk tier
  (``train_config.disk_tier``) the rows are ``ram_rows``, and the tier's index of the rows on
  disk adds ``DISK_INDEX_BYTES_PER_ROW`` a row of ``max_disk_rows``; a tier without that
  bound is not counted (logged: its index grows with the ids on disk).
  ``tables = 4 x sum(rows x stored dim)``.
* Table optimizer state (fbgemm's fused optimizer, one state per table):
  ``sgd`` none; ``adagrad`` (element-wise, odl's default and EasyRec's) ``rows x dim``
  floats; ``rowwise_adagrad`` ``rows`` floats; ``adam`` ``2 x rows x dim`` floats.
* Dense part: ``4 x P x (2 + s)`` for the ``P`` parameters of ``model.dense`` (every
  layer, learned loss weight and sequence combiner of the model), their gradients, and
  ``s`` floats of optimizer state per parameter (``sgd`` 0, ``adagrad`` 1, ``adam`` 2), one
  more with TorchEasyRec's dense EMA (``dense_optimizer.ema``).
* Activations: ``4 x 3 x batch_size x (pooled width + dense input columns + sum of the
  out_features of every nn.Linear in model.dense)``, where the pooled width is that of
  ``model.pooled_layout`` (``sum(g.width)``) and the dense input columns are
  ``FeatureBuilder.dense_feature_names``: forward values, their gradients and one
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

Available memory: host memory is :func:`odl.train.host_memory.available_host_memory`
(psutil's figure, lowered to the room left under a cgroup memory limit); device memory is
the free memory CUDA reports. A run is refused when an estimate exceeds
``fraction x available``; ``fraction`` is 0.8 unless ``--max_memory_fraction`` or the
environment variable ``ODL_MAX_MEMORY_FRACTION`` say otherwise (0 turns the check off).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.config_fields import is_map_field
from odl.config.dynamic_table_config import DynamicTableSpec
from odl.config.limits import ROW_WISE_MIN_ROWS
from odl.config.model_classes import model_settings
from odl.config.optimizer_support import (
    dense_ema_configured,
    optimizer_choices,
    table_kernel_kind,
)
from odl.features.feature_builder import FeatureBuilder
from odl.models.dynamic.growth import partition_rows
from odl.models.embedding_tables import WIDE_SUFFIX
from odl.models.model_registry import build_model, registered_model_classes
from odl.protos import pipeline_pb2
from odl.train.host_memory import AvailableMemory, available_host_memory

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
# RAM of a disk tier's index a row on disk, its doubling slack included
# (``odl.models.dynamic.disk_rows``)
DISK_INDEX_BYTES_PER_ROW = 65

DEFAULT_MAX_MEMORY_FRACTION = 0.8
MAX_MEMORY_FRACTION_ENV = "ODL_MAX_MEMORY_FRACTION"

# Table optimizer state: (floats per row, floats per row and dimension).
# Row-sparse kinds (odl.train.row_sparse_tables) keep theirs per table value as well: FTRL
# its accumulator and linear term, momentum its buffer, Adam / AdamW two moments, the
# partial row-wise ones a first moment per value and a second per row.
_SPARSE_STATE = {"sgd": (0, 0), "adagrad": (0, 1), "rowwise_adagrad": (1, 0), "adam": (0, 2),
                 "adamw": (0, 2), "lamb": (0, 2), "ftrl": (0, 2), "momentum": (0, 1),
                 "momentumw": (0, 1), "lars_sgd": (0, 1), "rmsprop": (0, 2),
                 "adadelta": (0, 2), "partial_rowwise_adam": (1, 1),
                 "partial_rowwise_lamb": (1, 1), "adagrad_decay": (1, 1),
                 "rowwise_adagrad_with_decay": (1, 0)}
# TorchEasyRec's RMSprop keeps no momentum buffer
_TZREC_SPARSE_STATE = {"rmsprop": (0, 1)}
# Dense optimizer state floats per parameter.
_DENSE_STATE = {"sgd": 0, "momentum": 1, "adagrad": 1, "rowwise_adagrad": 1, "adam": 2,
                "adamw": 2, "ftrl": 2, "momentumw": 1, "rmsprop": 2, "adadelta": 2,
                "adagrad_decay": 1}


def _dense_ema_copies(config: pipeline_pb2.EasyRecConfig) -> int:
    """1 with TorchEasyRec's dense EMA (a copy of every dense parameter), else 0."""
    return int(dense_ema_configured(config.train_config))


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
        grows_to: rows a growing dynamic table may reach (0: the table keeps ``rows``).
    """

    name: str
    rows: int
    dim: int
    weight_bytes: int
    state_bytes: int
    map_bytes: int = 0
    grows_to: int = 0


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
        growth_reach: growing dynamic table (deep and wide twins) -> the rows it can reach
            within the memory allowed (:func:`check_memory` fills it in).
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
    growth_reach: dict[str, int] = field(default_factory=dict)

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


def _gib(n: float) -> str:
    if n < (1 << 30):
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.1f} GiB"


def _map_bytes(dyn: DynamicTableSpec | None, rows: int = 0) -> int:
    """Bytes of a dynamic table's id index, counters and sketch (0 for a fixed table).

    Args:
        dyn: the table's spec (None: a fixed table).
        rows: the rows counted (0: its capacity).
    """
    if dyn is None:
        return 0
    per_row = DYNAMIC_MAP_BYTES_PER_ROW + (16 if dyn.keeps_scores else 0)
    sketch = 0
    if dyn.counts_candidates:  # 4 rows of float32 show (and click) counters
        width = 1024
        while width < dyn.max_rows and width < 1 << 20:
            width *= 2
        sketch = 16 * width * (2 if dyn.admit_score > 0 or dyn.keeps_scores else 1)
    return per_row * (rows or dyn.capacity) + sketch


def estimate_memory(config: pipeline_pb2.EasyRecConfig, device_type: str, ranks: int = 1,
                    ranks_on_host: int = 1) -> MemoryEstimate:
    """Estimates the memory of training ``config`` on ``device_type``.

    Builds the model on the ``meta`` device (tables and dense part: nothing is allocated)
    and counts its tables and dense parameters (call it on a validated config).

    Args:
        config: the pipeline config.
        device_type: ``"cpu"`` or ``"cuda"``.
        ranks: processes training the model together (``torchrun``).
        ranks_on_host: of those, the ones on this host.

    Returns:
        The estimate.

    Raises:
        ConfigError: the features or the model cannot be built from the config.
    """
    feature_builder = FeatureBuilder(config)
    registered_model_classes()  # the model modules imported outside the meta context
    with torch.device("meta"):
        model = build_model(config, feature_builder)
    specs = {s.name: s for s in feature_builder.table_specs}
    sparse, dense = optimizer_choices(config.train_config)
    kind = table_kernel_kind(sparse.kind)
    per_row, per_value = ((_TZREC_SPARSE_STATE.get(kind) if sparse.form == "tzrec" else None)
                          or _SPARSE_STATE.get(kind, (0, 2)))
    tables: list[TableEstimate] = []
    mapped: set[str] = set()  # dynamic tables whose index is counted (once per deep/wide pair)
    partitions = max(1, int(config.train_config.dynamic_index_partitions))
    for c in model.ebc.embedding_bag_configs():
        base = c.name if c.name in specs else c.name.removesuffix(WIDE_SUFFIX)
        spec = specs.get(base)
        dyn = spec.dynamic if spec is not None else None
        rows, dim = int(c.num_embeddings), int(c.embedding_dim)
        grows_to = dyn.grows_to if dyn is not None and dyn.grows else 0
        if grows_to and partitions > 1:  # built and grown in whole blocks
            rows = partition_rows(rows, partitions)
        map_bytes = 0 if base in mapped or dyn is None else _map_bytes(dyn, rows)
        if map_bytes and dyn.disk_rows > 0:  # a bounded disk tier's index
            map_bytes += DISK_INDEX_BYTES_PER_ROW * dyn.disk_rows
        mapped.add(base)
        tables.append(TableEstimate(
            c.name, rows, dim, BYTES_PER_VALUE * rows * dim,
            BYTES_PER_VALUE * rows * (per_row + per_value * dim) + map_bytes, map_bytes,
            grows_to))
    params = sum(p.numel() for p in model.dense.parameters())
    pooled = sum(g.width for g in model.pooled_layout)
    dense_in = len(feature_builder.dense_feature_names)
    hidden = sum(m.out_features for m in model.dense.modules() if isinstance(m, nn.Linear))
    batch = int(config.data_config.batch_size)
    return MemoryEstimate(
        ranks=max(1, int(ranks)),
        ranks_on_host=max(1, int(ranks_on_host)),
        index_partitions=max(1, int(config.train_config.dynamic_index_partitions)),
        device_type=device_type,
        sparse_kind=sparse.kind,
        dense_kind=dense.kind,
        tables=sorted(tables, key=lambda t: -t.weight_bytes),
        dense_parameters=params,
        dense_bytes=BYTES_PER_VALUE * params * (2 + _DENSE_STATE.get(dense.kind, 2)
                                                + _dense_ema_copies(config)),
        activation_bytes=(BYTES_PER_VALUE * ACTIVATION_COPIES * batch
                          * (pooled + dense_in + hidden)),
        metrics_bytes=METRICS_BYTES_PER_SAMPLE * int(config.train_config.metrics_window_samples),
    )


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


def _dnn_fields(message: Any, path: str) -> list[tuple[int, str]]:
    """``(sum of hidden_units, path)`` of every DNN set in a settings message.

    A DNN is a message with ``hidden_units``; nested messages are searched, in field order.
    """
    found: list[tuple[int, str]] = []
    for fd in message.DESCRIPTOR.fields:
        if fd.message_type is None or is_map_field(fd):
            continue
        if fd.is_repeated:
            items = [(f"{path}{fd.name}[{i}]", m) for i, m in enumerate(getattr(message, fd.name))]
        else:
            items = [(f"{path}{fd.name}", getattr(message, fd.name))] \
                if message.HasField(fd.name) else []
        for where, sub in items:
            if "hidden_units" in fd.message_type.fields_by_name:
                found.append((sum(int(u) for u in sub.hidden_units), f"{where}.hidden_units"))
            else:
                found += _dnn_fields(sub, f"{where}.")
    return found


def _blame(config: pipeline_pb2.EasyRecConfig, est: MemoryEstimate, sparse: int) -> str:
    """The config field behind the largest part of an estimate.

    The tables: the features; the dense part: the widest DNN of the model's settings (most
    hidden units, the first of equals), or the settings message when it has none; the
    activations: the batch size; the metrics: their window.
    """
    parts = {
        "tables": sparse,
        "dense": est.dense_bytes,
        "activations": est.activation_bytes,
        "metrics": est.metrics_bytes,
    }
    largest = max(parts, key=lambda k: parts[k])
    if largest == "dense":
        name, settings = model_settings(config.model_config)
        if settings is None:
            return "model_config"
        dnns = _dnn_fields(settings, "")
        if not dnns:
            return f"model_config.{name}"
        widest = max(units for units, _where in dnns)
        return f"model_config.{name}." + next(w for u, w in dnns if u == widest)
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


def growth_limit(est: MemoryEstimate, allowed_bytes: float) -> dict[str, int]:
    """The rows each growing dynamic table can reach within ``allowed_bytes``.

    Every growing table is assumed to grow alike (to the same number of rows, at most its
    ``grows_to``): the room the estimate leaves is shared out by their bytes per row (on
    CPU twice, as the estimate counts the tables: a checkpoint's copy beside them).

    Args:
        est: the estimate (growing tables at their start rows).
        allowed_bytes: the memory the run may use (host, or device on CUDA).

    Returns:
        Growing table (deep and wide twins each) -> the rows it can reach (>= its start
        rows); empty when no table grows.
    """
    growing = [t for t in est.tables if t.grows_to > t.rows]
    if not growing:
        return {}
    used = est.device_bytes if est.device_type == "cuda" else est.host_bytes
    copies = 1 if est.device_type == "cuda" else 2
    per_row = sum(copies * (t.weight_bytes + t.state_bytes) / t.rows for t in growing)
    now = sum(copies * (t.weight_bytes + t.state_bytes) for t in growing)
    reach = int((allowed_bytes - used + now) // per_row) if per_row else 0
    return {t.name: max(t.rows, min(t.grows_to, reach)) for t in growing}


def growth_notes(est: MemoryEstimate) -> list[str]:
    """One line per growing dynamic table: its start rows and the rows it can reach."""
    return [f"dynamic table {t.name} grows: counted at its start, {t.rows:,} rows; it may "
            f"reach {est.growth_reach[t.name]:,} rows (grows_to {t.grows_to:,}"
            f"{'' if est.growth_reach[t.name] >= t.grows_to else ', as far as the memory allows'})"
            for t in est.tables  # one line per table (its wide twin grows with it)
            if t.name in est.growth_reach and not t.name.endswith(WIDE_SUFFIX)]


def _with_growth(est: MemoryEstimate, allowed_bytes: float | None) -> MemoryEstimate:
    """``est`` with its ``growth_reach`` (``None``: no limit), logged."""
    reach = growth_limit(est, allowed_bytes) if allowed_bytes else {
        t.name: t.grows_to for t in est.tables if t.grows_to > t.rows}
    est = replace(est, growth_reach=reach)
    for line in growth_notes(est):
        logger.info("%s", line)
    return est


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
    tier = config.train_config.disk_tier
    if tier.dir and not tier.max_disk_rows:
        logger.info("the dynamic tables keep rows on disk without a bound "
                    "(disk_tier.max_disk_rows 0): each costs about %d bytes of RAM for its "
                    "slot in the tier's index, not counted here", DISK_INDEX_BYTES_PER_ROW)
    logger.info("estimated memory: host %s, device %s (tables %s + %s state %s, dense %s%s)",
                _gib(est.host_bytes), _gib(est.device_bytes), _gib(est.table_bytes),
                est.sparse_kind, _gib(est.table_state_bytes), _gib(est.dense_bytes),
                f"; {est.ranks} ranks, {est.ranks_on_host} on this host, "
                f"{_gib(est.rank_sparse_bytes)} of tables each" if est.ranks > 1 else "")
    if fraction <= 0:
        return _with_growth(est, None)
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
    est = _with_growth(est, fraction * device_available
                       if device_type == "cuda" and device_available is not None else allowed)
    if est.host_bytes > allowed:
        sparse = est.sparse_bytes * (1 if device_type == "cuda" else 2)
        where = "this host has" if avail.source == "host" else f"{avail.source} leaves"
        raise ConfigError(
            _blame(config, est, sparse),
            f"training needs an estimated {_gib(est.host_bytes)} of host memory "
            f"({_describe(est, 'host')}) but {where} {_gib(avail.bytes)} available and "
            f"odl uses at most {fraction * 100:g}% of it: {_gib(allowed)} ({how})")
    return est
