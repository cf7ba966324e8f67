"""EasyRec's AutoInt (``model_class: "AutoInt"``, settings ``autoint {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. As EasyRec's ``easy_rec/python/model/autoint.py``:
the feature group ``all`` (or the model's only group), every feature of one ``embedding_dim``
``D`` (its embedded features, projected raw features and the vectors of its
``sequence_features``' target attention), read as ``F`` tokens ``[B, F, D]``; then
``interacting_layer_num`` interacting layers (EasyRec's ``MultiHeadAttention`` with
``use_res``) of ``H = multi_head_num`` heads of ``S = multi_head_size``::

    q, k, v = x W_q, x W_k, x W_v                       (no bias; [B, F, H * S], per head S)
    head_h  = softmax(q_h k_h^T * sqrt(S)) v_h          (EasyRec divides by S ** -0.5)
    x'      = ReLU(concat(head_1, ..., head_H) + x W_res)
    logit   = Linear(flatten(x) -> C)                    (C = max(num_class, 1))

Loss: the configured prediction loss (``odl.models.ctr_losses``) + ``autoint.
l2_regularization`` * the squared dense Linear kernels + ``embedding_regularization`` * the
mean squared pooled lookup.

Parameter names: ``dense.projection.weight`` (projected raw features), ``dense.sequences.*``
(the group's sequence blocks), ``dense.layers.<l>.{query,key,value,res}.weight``,
``dense.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.feature_configs import embedded_feature, feature_configs, projected_raw
from odl.config.model_validation import sequence_combiner_width
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import RawProjection
from odl.models.ctr_model import CtrModel, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import all_group, group_input
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.sequence_layers import GroupSequences
from odl.protos import pipeline_pb2

_FT = pipeline_pb2.FeatureConfig.FeatureType


class InteractingLayer(nn.Module):
    """One interacting layer (module docstring); scriptable.

    Args:
        width: the tokens' width in.
        heads: ``H``.
        size: ``S``.
    """

    __constants__ = ["heads", "size", "scale"]

    def __init__(self, width: int, heads: int, size: int) -> None:
        super().__init__()
        self.heads, self.size = int(heads), int(size)
        self.scale = math.sqrt(float(size))
        out = self.heads * self.size
        self.query = nn.Linear(width, out, bias=False)
        self.key = nn.Linear(width, out, bias=False)
        self.value = nn.Linear(width, out, bias=False)
        self.res = nn.Linear(width, out, bias=False)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.heads, self.size).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, F, width]`` -> ``[B, F, H * S]``."""
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scale, dim=-1)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return torch.relu(out + self.res(x))


class AutoIntDense(nn.Module):
    """AutoInt after the embedding lookup (module docstring); scriptable.

    Args:
        tokens: ``F``, the group's vectors.
        dim: ``D``.
        dense_idx: ``Batch.dense`` columns the group's sequences read (their dense columns and
            lengths), in ``GroupSequences``' order.
        settings: ``autoint``.
        num_class: outputs.
        sequences: the group's sequence blocks combined, or None.
        projected_idx: ``Batch.dense`` columns of its projected raw features.
        projected_widths: columns per projected feature.
    """

    __constants__ = ["tokens", "dim", "num_class", "has_dense"]
    dense_idx: list[int]
    projected_idx: list[int]

    def __init__(self, tokens: int, dim: int, dense_idx: Sequence[int],
                 settings: pipeline_pb2.AutoInt, num_class: int = 1,
                 sequences: Optional[GroupSequences] = None,
                 projected_idx: Sequence[int] = (), projected_widths: Sequence[int] = ()) -> None:
        super().__init__()
        self.tokens, self.dim = int(tokens), int(dim)
        self.num_class = max(int(num_class), 1)
        self.dense_idx = [int(i) for i in dense_idx]
        self.has_dense = len(self.dense_idx) > 0
        self.projected_idx = [int(i) for i in projected_idx]
        self.sequences = sequences
        self.projection = (RawProjection(projected_widths, dim) if self.projected_idx else None)
        width = self.dim
        layers = []
        for _ in range(int(settings.interacting_layer_num)):
            layers.append(InteractingLayer(width, settings.multi_head_num,
                                           settings.multi_head_size))
            width = int(settings.multi_head_num) * int(settings.multi_head_size)
        self.layers = nn.ModuleList(layers)
        self.out = nn.Linear(self.tokens * width, self.num_class)

    def forward(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1)."""
        x = group
        sequences = self.sequences
        if sequences is not None:
            x = sequences(torch.cat([group, dense[:, self.dense_idx]], dim=1)
                          if self.has_dense else group)
        projection = self.projection
        if projection is not None:
            x = torch.cat([x, projection(dense[:, self.projected_idx])], dim=1)
        h = x.reshape(x.shape[0], self.tokens, self.dim)
        for layer in self.layers:
            h = layer(h)
        out = self.out(h.reshape(h.shape[0], -1))
        return out.squeeze(1) if self.num_class == 1 else out


class AutoInt(CtrModel):
    """AutoInt over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        config: the pipeline config.
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ValueError: vectors that are not ``D`` wide tokens.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        mc = config.model_config
        group = all_group(mc)
        features = {fc.feature_name: fc for fc in feature_configs(config)}
        projected = [f for f in _group_config(mc).feature_names
                     if f in features and projected_raw(features[f])]
        read = group_input(config, feature_builder, group, leave_out=projected)
        emb, raw = read.lookups, read.raw
        columns_of = feature_builder.dense_feature_columns
        proj_cols = [c for f in projected for c in columns_of[f]]
        layout = build_embedding_layout(feature_builder.table_specs, list(dict.fromkeys(emb)),
                                        [], 1, mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        width = sum(dim_of[f] for f in emb)
        seqs = read.sequences(dim_of)
        if seqs is not None:
            width = int(seqs.out_width)
        dim = _model_dim(mc, features)
        width += len(projected) * dim
        if width % dim:
            raise ValueError(f"the group's vectors ({width} columns) are not {dim}-wide tokens")
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        settings = mc.autoint
        self.dense = AutoIntDense(width // dim, dim, [col[c] for c in raw], settings,
                                  int(mc.num_class), seqs, [col[c] for c in proj_cols],
                                  [len(columns_of[f]) for f in projected])
        self.pooled_layout = (PooledGroup.of(group, tuple((f, table_of[f]) for f in emb),
                                             [dim_of[f] for f in emb]),)
        self.kernel_l2 = float(settings.l2_regularization)
        self.set_configured_loss(mc, (list(config.data_config.label_fields) or ["label"])[0])


def _group_config(mc: pipeline_pb2.EasyRecModel) -> pipeline_pb2.FeatureGroupConfig:
    name = all_group(mc)
    return next(g for g in mc.feature_groups if g.group_name == name)


def _model_dim(mc: pipeline_pb2.EasyRecModel, features: dict) -> int:
    """``D``: the one ``embedding_dim`` of the group's features (checked by ``_validate``)."""
    g = _group_config(mc)
    return next(int(features[f].embedding_dim) for f in g.feature_names
                if f in features and features[f].embedding_dim)


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> AutoInt:
    try:
        return AutoInt(config, feature_builder)
    except ValueError as e:
        raise ConfigError("model_config.autoint", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """The settings; one group of features of one ``embedding_dim``, no plain raw values."""
    mc, settings, features = check.config.model_config, check.settings, check.features
    if not mc.HasField("autoint"):
        raise ConfigError(check.where(), "AutoInt needs autoint { multi_head_num "
                                         "multi_head_size interacting_layer_num }")
    for name in ("multi_head_num", "multi_head_size", "interacting_layer_num"):
        value = getattr(settings, name)
        if not 1 <= value <= limits.MAX_HIDDEN_UNITS:
            raise ConfigError(check.where(name), f"must be 1 to {limits.MAX_HIDDEN_UNITS:,}")
    if settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    gi = check.groups[all_group(mc)]
    group = mc.feature_groups[gi]
    where = f"model_config.feature_groups[{gi}].feature_names"
    dims: dict[str, int] = {}
    for j, name in enumerate(group.feature_names):
        fc = features[name]
        if fc.feature_type == _FT.SequenceFeature:
            width = sequence_combiner_width(fc)
            if not width:
                raise ConfigError(f"{where}[{j}]", f"SequenceFeature {name!r}: AutoInt reads "
                                                   "a sequence through the group's "
                                                   "sequence_features or a sequence_combiner")
            dims[name] = width
        elif embedded_feature(fc) or projected_raw(fc):
            dims[name] = int(fc.embedding_dim)
        else:
            raise ConfigError(f"{where}[{j}]", f"RawFeature {name!r} has no embedding_dim: "
                                               "AutoInt's tokens are embeddings (give it "
                                               "boundaries or an embedding_dim)")
    for sf in group.sequence_features:
        for m in sf.seq_att_map:
            for name in [*m.key, *m.hist_seq]:
                if name in features:
                    dims[name] = int(features[name].embedding_dim)
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={d}" for n, d in list(dims.items())[:6])
        raise ConfigError(where, f"AutoInt needs one embedding_dim for the group's features "
                                 f"(EasyRec's rule); got {shown}")


register_model(ModelClass("AutoInt", _build, _validate, group_attention="all",
                          projected_raw=True))
