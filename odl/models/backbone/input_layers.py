"""A feature group as a backbone block reads it (EasyRec's ``input_layer``).

Every feature of the group becomes one vector, in group order, the group's sequences last
(each SequenceFeature combined by its ``sequence_combiner``, each ``sequence_features``
entry by its target attention, as the other models read a group):

* an embedded feature: its pooled lookup (its table's ``embedding_dim`` columns), or in a
  WIDE group its wide lookup (``wide_output_dim`` columns);
* a raw feature: its values (``raw_input_dim`` columns); in a WIDE group its values times a
  learned ``[raw_input_dim, wide_output_dim]`` matrix (no bias), so that every vector of a
  wide group has the wide width;
* a projected raw feature (``embedding_dim``, no ``boundaries``): ``value * p``
  (``RawProjection``).

The block's output is, by its ``input_layer`` settings: the vectors concatenated (default,
``[B, width]``); ``only_output_feature_list`` (the list of vectors);
``only_output_3d_tensor`` (``[B, n, dim]``, one width); ``output_2d_tensor_and_feature_list``
(``[concatenated, list]``). As EasyRec's input layer does: ``do_batch_norm`` /
``do_layer_norm`` normalize the concatenated tensor and, when a list is output, each vector
with its own parameters; ``dropout_rate`` drops the concatenated tensor's columns and each
listed vector's; ``feature_dropout_rate`` drops whole features in training (kept ones scaled
by ``1 / (1 - rate)``, one draw per batch, EasyRec's Bernoulli per feature) instead of the
normalization. ``output_seq_and_normal_feature`` hands out the group's sequences as they
are (:class:`RawSequenceInput`).

Every input layer reads one tensor of pooled lookups, the backbone's (each
``(feature, table)`` looked up once however many blocks read it), and ``Batch.dense``.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.models.backbone.dense_layers import LastAxisBatchNorm
from odl.models.backbone.value_specs import Spec, tensor
from odl.protos import pipeline_pb2

# how a group's feature is read
POOLED = 0  # columns of the pooled lookups
RAW = 1  # Batch.dense columns
READER = 2  # the output of one of the layer's readers (sequence, projection, wide raw)


@dataclass(frozen=True)
class FeatureSource:
    """Where one feature's vector comes from.

    Attributes:
        name: the feature (or the sequence block's first feature), for messages.
        kind: :data:`POOLED`, :data:`RAW` or :data:`READER`.
        width: its columns.
        start: POOLED: its first column in the pooled lookups.
        columns: RAW: its ``Batch.dense`` columns.
        reader: READER: the module ``forward(pooled, dense) -> [B, width]``.
    """

    name: str
    kind: int
    width: int
    start: int = 0
    columns: tuple[int, ...] = ()
    reader: nn.Module | None = None


class SequenceReader(nn.Module):
    """A sequence block's vector: its lookups, dense columns and length through its combiner."""

    pooled_idx: list[int]
    dense_idx: list[int]

    def __init__(self, pooled_idx: list[int], dense_idx: list[int], combiner: nn.Module
                 ) -> None:
        super().__init__()
        self.pooled_idx = [int(i) for i in pooled_idx]
        self.dense_idx = [int(i) for i in dense_idx]  # its dense columns, then its length
        self.combiner = combiner

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """``[B, combiner width]``."""
        return self.combiner(torch.cat([pooled[:, self.pooled_idx],
                                        dense[:, self.dense_idx]], dim=1))


class DenseReader(nn.Module):
    """Dense columns through a module (a projection, a wide raw feature's matrix)."""

    dense_idx: list[int]

    def __init__(self, dense_idx: list[int], inner: nn.Module) -> None:
        super().__init__()
        self.dense_idx = [int(i) for i in dense_idx]
        self.inner = inner

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """``inner(dense[:, columns])``."""
        return self.inner(dense[:, self.dense_idx])


class GroupInput(nn.Module):
    """One ``input_layer`` block (module docstring); scriptable.

    The group's columns are gathered in one step from ``[pooled, dense, the readers'
    outputs]`` and cut into the features' vectors with one split (one gradient scatter each
    way, however many features).

    Args:
        sources: the group's features in order.
        settings: the block's ``input_layer``.
        where: its config path, for errors.
        pooled_width: columns of the pooled lookups the layer reads.
        dense_width: columns of ``Batch.dense``.

    Raises:
        ConfigError: ``only_output_3d_tensor`` over vectors of several widths, both
            normalizations, a rate outside [0, 1).
    """

    __constants__ = ["mode", "norm", "feature_rate", "list_out"]
    widths: list[int]
    gather: list[int]

    def __init__(self, sources: list[FeatureSource], settings: pipeline_pb2.BackboneInputLayer,
                 where: str, pooled_width: int, dense_width: int) -> None:
        super().__init__()
        s = settings
        if s.do_batch_norm and s.do_layer_norm:
            raise ConfigError(where, "do_batch_norm and do_layer_norm cannot both be set")
        for field in ("dropout_rate", "feature_dropout_rate"):
            rate = getattr(s, field)
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"{where}.{field}", f"must be in [0, 1), got {rate}")
        if not sources:
            raise ConfigError(where, "the group has no features")
        self.widths = [int(src.width) for src in sources]
        # columns of cat([pooled, dense, readers' outputs]) in group order
        self.gather = []
        readers: list[nn.Module] = []
        read_start = int(pooled_width) + int(dense_width)
        for src in sources:
            if src.kind == POOLED:
                self.gather += range(int(src.start), int(src.start) + int(src.width))
            elif src.kind == RAW:
                self.gather += [int(pooled_width) + int(c) for c in src.columns]
            else:
                self.gather += range(read_start, read_start + int(src.width))
                read_start += int(src.width)
                readers.append(src.reader)
        self.readers = nn.ModuleList(readers)
        self.mode = ("list" if s.only_output_feature_list else
                     "3d" if s.only_output_3d_tensor else
                     "both" if s.output_2d_tensor_and_feature_list else "tensor")
        self.list_out = self.mode != "tensor"
        if self.mode == "3d" and len(set(self.widths)) != 1:
            raise ConfigError(f"{where}.only_output_3d_tensor",
                              f"needs features of one width; got {sorted(set(self.widths))}")
        self.feature_rate = float(s.feature_dropout_rate)
        self.norm = ("" if self.feature_rate > 0 else "bn" if s.do_batch_norm
                     else "ln" if s.do_layer_norm else "")
        total = sum(self.widths)
        per_feature = self.list_out and (self.norm != "")
        if self.norm == "bn":
            self.norm_all: nn.Module = LastAxisBatchNorm(total)
            self.norm_each = nn.ModuleList(LastAxisBatchNorm(w) for w in self.widths) \
                if per_feature else nn.ModuleList()
        elif self.norm == "ln":
            self.norm_all = nn.LayerNorm(total, eps=1e-6)
            self.norm_each = nn.ModuleList(nn.LayerNorm(w, eps=1e-6) for w in self.widths) \
                if per_feature else nn.ModuleList()
        else:
            self.norm_all = nn.Identity()
            self.norm_each = nn.ModuleList()
        rate = float(s.dropout_rate)
        self.dropout: nn.Module = nn.Dropout(rate) if rate > 0 else nn.Identity()
        self.spec: Spec = self._spec()

    def _spec(self) -> Spec:
        total = sum(self.widths)
        vectors = [tensor(w) for w in self.widths]
        if self.mode == "list":
            return vectors
        if self.mode == "3d":
            return tensor(len(self.widths), self.widths[0])
        if self.mode == "both":
            return [tensor(total), vectors]
        return tensor(total)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> list[torch.Tensor]:
        """The block's output leaves."""
        parts = [pooled, dense]
        for reader in self.readers:
            parts.append(reader(pooled, dense))
        index = torch.tensor(self.gather, dtype=torch.long, device=pooled.device)
        gathered = torch.cat(parts, dim=1).index_select(1, index)
        dropping = self.feature_rate > 0 and self.training
        if dropping:  # whole features, one draw per batch, kept ones scaled up
            keep = 1.0 - self.feature_rate
            mask = torch.bernoulli(torch.full([len(self.widths)], keep, device=pooled.device))
            widths = torch.tensor(self.widths, device=pooled.device)
            gathered = gathered * (mask / keep).repeat_interleave(widths)
        features = self.norm_all(gathered)
        if not dropping:
            features = self.dropout(features)
        if not self.list_out:
            return [features]
        vectors = list(torch.split(gathered, self.widths, dim=1))
        for i, norm in enumerate(self.norm_each):
            vectors[i] = norm(vectors[i])
        for i in range(len(vectors)):
            vectors[i] = self.dropout(vectors[i])
        if self.mode == "list":
            return vectors
        if self.mode == "3d":
            return [torch.stack(vectors, dim=1)]
        return [features] + vectors


class RawSequenceInput(nn.Module):
    """``output_seq_and_normal_feature``: a group's sequences as they are, and its others.

    EasyRec's form with ``concat_seq_feature`` (its default): ``[sequences, lengths,
    targets]``, the group's SequenceFeatures' position vectors concatenated per position
    (``[B, L, sum of dims]``; one ``max_seq_len`` for all), the first sequence's lengths
    (``[B]``, as float) and the group's other features concatenated (``[B, width]``; left out
    when there are none). Positions past a sequence's length are zero vectors. Scriptable.

    Args:
        pooled_idx: per position, the pooled columns of its vector (sequence after sequence
            within it), position after position.
        positions: ``L``.
        dim: the position vector's width.
        length_column: the ``Batch.dense`` column of the lengths.
        targets: the group's other features.
    """

    __constants__ = ["positions", "dim", "length_column", "has_targets"]
    pooled_idx: list[int]

    def __init__(self, pooled_idx: list[int], positions: int, dim: int, length_column: int,
                 targets: Optional[GroupInput]) -> None:
        super().__init__()
        self.pooled_idx = [int(i) for i in pooled_idx]
        self.positions = int(positions)
        self.dim = int(dim)
        self.length_column = int(length_column)
        self.has_targets = targets is not None
        self.targets = targets
        self.spec: Spec = [tensor(self.positions, self.dim), tensor()]
        if targets is not None:
            self.spec.append(targets.spec)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> list[torch.Tensor]:
        """``[sequences, lengths, targets]`` (module docstring)."""
        b = pooled.shape[0]
        seq = pooled[:, self.pooled_idx].reshape(b, self.positions, self.dim)
        out = [seq, dense[:, self.length_column]]
        targets = self.targets
        if targets is not None:
            out.extend(targets(pooled, dense))
        return out
