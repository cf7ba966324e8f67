"""Embedding table layout: TorchRec ``EmbeddingBagConfig``s from the feature builder's tables.

Deep tables: one per ``TableSpec`` that has a feature in a deep group (DEEP or
WIDE_AND_DEEP), named like the spec, looked up by those features; stored with
``storage_dim(embedding_dim)`` columns (``embedding_dim`` rounded up to a multiple of 4, as
wide tables below: e.g. 10 is stored as 12) and read at ``embedding_dim``.

Wide tables (first-order weights): one per ``TableSpec`` that has a feature in a wide group
(WIDE or WIDE_AND_DEEP), named ``<table>_wide``. fbgemm's fused kernel only accepts dims that
are multiples of 4, so a wide table is *stored* with ``wide_storage_dim(wide_output_dim)``
(``wide_output_dim`` rounded up to a multiple of 4) columns and only its first
``wide_output_dim`` columns are used; the padding columns start at zero, are never read by the
model and so never receive a gradient (they stay zero). Exporters publish only the first
``wide_output_dim`` columns. Note: with *row-wise* Adagrad (TorchEasyRec's
``rowwise_adagrad_optimizer``) the accumulator of a wide row is the mean squared gradient over
the stored columns, i.e. ``g**2 * wide_output_dim / storage_dim``; element-wise optimizers
(the default Adagrad, SGD, Adam) are unaffected by the padding.

Order: deep tables first, in order of the deep groups' features, then wide tables in order
of the wide groups' features (features within a table in table order); ``deep_keys`` and
``wide_keys`` list the lookups in this order. ``CtrModel.lookup`` finds each lookup's columns
in the EBC's pooled output by name, whatever order TorchRec emits them in.

Initialization (``init_embedding_weights``), seeded per table so it does not depend on table
order: deep tables ``N(0, DEEP_INIT_STD**2)``, drawn in blocks of ``INIT_BLOCK_ROWS`` rows
each seeded by the table and the block (``initial_rows``), so a rank holding some rows of a
table draws only those and gets what one process holding the whole table has; wide tables
zero.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from odl.features.feature_plan import TableSpec

logger = logging.getLogger(__name__)

WIDE_SUFFIX = "_wide"
WIDE_DIM_ALIGN = 4
DEEP_INIT_STD = 0.05
INIT_BLOCK_ROWS = 1 << 16  # rows drawn from one seeded generator at initialization


def storage_dim(dim: int) -> int:
    """Stored columns of a table read at ``dim``: rounded up to a multiple of 4 (fbgemm)."""
    return -(-int(dim) // WIDE_DIM_ALIGN) * WIDE_DIM_ALIGN


def wide_storage_dim(wide_output_dim: int) -> int:
    """Stored columns of a wide table: ``wide_output_dim`` rounded up to a multiple of 4."""
    return storage_dim(wide_output_dim)


@dataclass(frozen=True)
class EmbeddingLayout:
    """Tables of a model and which features read them.

    Attributes:
        configs: TorchRec configs, deep tables first, then wide tables.
        deep_keys: ``(feature, table)`` per deep lookup, in pooled-output order.
        wide_keys: ``(feature, table)`` per wide lookup, in pooled-output order.
        wide_output_dim: used columns of each wide table.
        deep_dim: common dim of the deep tables (0 when there are none, or when they differ).
        deep_dims: dim of each deep lookup's table, in ``deep_keys`` order.
        read_dims: table -> the columns the model reads (and publishing publishes) of it:
            its ``embedding_dim`` (deep) or ``wide_output_dim`` (wide); its stored width may
            be larger (a multiple of 4).
        weighted: the tables are looked up with the batch's per-value weights
            (``FeatureBuilder.weighted``; the model's ``EmbeddingBagCollection`` is then
            built with ``is_weighted``).
    """

    configs: list[EmbeddingBagConfig]
    deep_keys: list[tuple[str, str]]
    wide_keys: list[tuple[str, str]]
    wide_output_dim: int
    deep_dim: int
    deep_dims: list[int]
    read_dims: dict[str, int]
    weighted: bool = False

    @property
    def wide_tables(self) -> list[str]:
        """Names of the wide tables."""
        return [c.name for c in self.configs if c.name.endswith(WIDE_SUFFIX)]

    def feature_tables(self) -> dict[str, list[str]]:
        """Feature name -> tables it is looked up in."""
        out: dict[str, list[str]] = {}
        for f, t in self.deep_keys + self.wide_keys:
            out.setdefault(f, []).append(t)
        return out


def build_embedding_layout(
    table_specs: Sequence[TableSpec],
    deep_features: Sequence[str],
    wide_features: Sequence[str],
    wide_output_dim: int = 1,
    mixed_dims: bool = False,
) -> EmbeddingLayout:
    """Builds the table configs for a model's deep and wide embedded features.

    Args:
        table_specs: the feature builder's tables.
        deep_features: embedded features feeding the deep part (and FM), in group order.
        wide_features: embedded features feeding the wide part, in group order.
        wide_output_dim: used columns of each wide table.
        mixed_dims: deep tables may have different dims (models that concatenate their
            lookups; FM needs one dim).

    Returns:
        The layout.

    Raises:
        ValueError: a deep feature's table has no ``embedding_dim``, or deep dims differ
            without ``mixed_dims``.
    """
    by_feature = {f: spec for spec in table_specs for f in spec.feature_names}
    for f in list(deep_features) + list(wide_features):
        if f not in by_feature:
            raise ValueError(f"feature {f!r} is not an embedded feature")

    def grouped(features: Sequence[str]) -> list[tuple[TableSpec, list[str]]]:
        order: dict[str, tuple[TableSpec, list[str]]] = {}
        for f in features:
            spec = by_feature[f]
            entry = order.setdefault(spec.name, (spec, []))
            if f not in entry[1]:
                entry[1].append(f)
        # Features inside a table follow the table's own order (TorchRec's output order).
        return [(s, [f for f in s.feature_names if f in fs]) for s, fs in order.values()]

    configs: list[EmbeddingBagConfig] = []
    deep_keys: list[tuple[str, str]] = []
    wide_keys: list[tuple[str, str]] = []
    deep_dims: list[int] = []
    read_dims: dict[str, int] = {}
    for spec, feats in grouped(deep_features):
        if spec.dim <= 0:
            raise ValueError(
                f"table {spec.name!r} (features {', '.join(feats)}) is used by a deep group "
                "but has no embedding_dim")
        if deep_dims and spec.dim != deep_dims[0] and not mixed_dims:
            raise ValueError(
                f"DeepFM needs one embedding_dim for all deep features: table {spec.name!r} "
                f"has {spec.dim}, others {deep_dims[0]}")
        configs.append(_config(spec.name, spec.num_rows, storage_dim(spec.dim), feats,
                               spec.pooling))
        read_dims[spec.name] = int(spec.dim)
        deep_keys += [(f, spec.name) for f in feats]
        deep_dims += [spec.dim] * len(feats)
    deep_dim = deep_dims[0] if deep_dims and len(set(deep_dims)) == 1 else 0
    wdim = wide_storage_dim(wide_output_dim)
    for spec, feats in grouped(wide_features):
        name = spec.name + WIDE_SUFFIX
        configs.append(_config(name, spec.num_rows, wdim, feats, spec.pooling))
        read_dims[name] = int(wide_output_dim)
        wide_keys += [(f, name) for f in feats]
    return EmbeddingLayout(configs, deep_keys, wide_keys, int(wide_output_dim), deep_dim,
                           deep_dims, read_dims, any(t.weighted for t in table_specs))


def _config(name: str, rows: int, dim: int, feats: list[str], pooling: str) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name,
        embedding_dim=dim,
        num_embeddings=rows,
        feature_names=list(feats),
        pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
    )


def table_seed(seed: int, table: str) -> int:
    """Per-table init seed: ``seed`` mixed with the CRC32 of the table name."""
    return (int(seed) * 1000003 + zlib.crc32(table.encode("utf-8"))) % (2**63 - 1)


def initial_rows(name: str, seed: int, shape: Sequence[int], start: int = 0,
                 stop: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """The initial values of rows ``[start, stop)`` of a table, one block at a time.

    A deep table's rows are drawn in blocks of ``INIT_BLOCK_ROWS`` rows, block ``k`` from a
    generator seeded by the table and ``k``, so any range of rows (a rank's shard) gets the
    values the whole table has without drawing the rest, and no more than one block is held
    beside the table. Wide tables are zeros.

    Args:
        name: the table's name.
        seed: the training seed.
        shape: the whole table's ``(rows, stored dim)``.
        start: first row wanted.
        stop: row after the last wanted (None: the table's end).

    Yields:
        ``(first row, float32 values [n, stored dim])``, in row order, covering the range.
    """
    rows, dim = int(shape[0]), int(shape[1])
    stop = rows if stop is None else min(int(stop), rows)
    block = max(int(start), 0) // INIT_BLOCK_ROWS
    while block * INIT_BLOCK_ROWS < stop:
        first = block * INIT_BLOCK_ROWS
        n = min(INIT_BLOCK_ROWS, rows - first)
        if name.endswith(WIDE_SUFFIX):
            values = torch.zeros((n, dim), dtype=torch.float32)
        else:
            gen = torch.Generator(device="cpu")
            gen.manual_seed((table_seed(seed, name) * 1000003 + block) % (2**63 - 1))
            values = torch.randn((n, dim), generator=gen, dtype=torch.float32) * DEEP_INIT_STD
        lo, hi = max(first, int(start)), min(first + n, stop)
        yield lo, values[lo - first : hi - first]
        block += 1


@torch.no_grad()
def init_embedding_weights(tables: Mapping[str, torch.Tensor], seed: int) -> None:
    """Initializes table weights in place (deep: seeded normal; wide: zeros).

    Block by block (``initial_rows``): the same values whichever rows a process holds.

    Args:
        tables: table name -> full weight tensor (written in place; any device).
        seed: the training seed.
    """
    for name, weight in tables.items():
        for first, values in initial_rows(name, seed, tuple(weight.shape)):
            weight[first : first + values.shape[0]].copy_(
                values.to(device=weight.device, dtype=weight.dtype))


@torch.no_grad()
def reset_embedding_rows(name: str, weight: torch.Tensor, rows: torch.Tensor, seed: int,
                         step: int, stream: int = 0) -> None:
    """Re-initializes rows of a table in place (evicted rows of a dynamic table).

    Deep tables get fresh ``N(0, DEEP_INIT_STD**2)`` values from a generator seeded by the
    table, ``step`` and ``stream``, so a restored trainer resets exactly as the original
    would; wide tables get zeros.

    Args:
        name: the table's name.
        weight: its full weight tensor (any device).
        rows: ``int64`` rows to reset.
        seed: the training seed.
        step: the step at which the rows are reset.
        stream: which of several independent draws of the same step (a partition of a
            table split by id); 0 for a table of one.
    """
    if rows.numel() == 0:
        return
    rows = rows.to(weight.device)
    if name.endswith(WIDE_SUFFIX):
        weight.index_fill_(0, rows, 0.0)
        return
    gen = torch.Generator(device="cpu")
    gen.manual_seed((table_seed(seed, name) + 7919 * int(step) + 15485863 * int(stream))
                    % (2**63 - 1))
    values = torch.randn((rows.numel(), weight.shape[1]), generator=gen,
                         dtype=torch.float32) * DEEP_INIT_STD
    weight.index_copy_(0, rows, values.to(device=weight.device, dtype=weight.dtype))

