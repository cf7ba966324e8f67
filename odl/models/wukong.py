"""TorchEasyRec's WuKong (``model_class: "WuKong"``, settings ``wukong {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. The "sparse" group's embeddings (or the only
group's), all of one width ``D``, are the feature vectors ``X`` ``[B, n, D]``; a "dense"
group (raw values and any embedded features, concatenated) goes through ``dense_mlp``, whose
output (``D`` wide) is one more vector, the first. Each layer, as TorchEasyRec's
``WuKongLayer`` (``tzrec/modules/interaction.py``), with ``k`` vectors in::

    lcb(X)  = (X^T W_lcb)^T                                   [B, lcb_feature_num, D]
    fmb(X)  = Linear(mlp(LayerNorm(flatten(X (X^T W_fm)))))   [B, fmb_feature_num, D]
              (W_fm [k, compressed_feature_num]; the Linear reshaped to fmb_feature_num x D)
    X'      = LayerNorm_D(concat(fmb(X), lcb(X)) + residual(X))
    residual(X) = X when k == lcb + fmb, else (X^T W_res)^T

then ``logit = Linear(final(flatten(X)) -> C)`` (``C = max(num_class, 1)``).

Loss: the configured prediction loss (``odl.models.ctr_losses``) + ``wukong.l2_regularization``
* the squared dense Linear kernels + ``embedding_regularization`` * the mean squared pooled
lookup of each group.

Parameter names: ``dense.dense_mlp.*`` (absent without a "dense" group),
``dense.layers.<i>.lcb.weight``, ``dense.layers.<i>.fmb.*``, ``dense.layers.<i>.norm.*``,
``dense.layers.<i>.residual.weight`` (when the widths differ), ``dense.final.*``,
``dense.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import embedded_feature
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_mlp
from odl.models.ctr_model import CtrModel, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import embedded_and_dense
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class LinearCompress(nn.Module):
    """TorchEasyRec's LinearCompressBlock: ``k`` vectors to ``out`` by a learned mix."""

    def __init__(self, vectors_in: int, vectors_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(int(vectors_in), int(vectors_out)))
        nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k, D]`` -> ``[B, out, D]``."""
        return torch.matmul(x.permute(0, 2, 1), self.weight).permute(0, 2, 1)


class FactorizationMachineBlock(nn.Module):
    """TorchEasyRec's FactorizationMachineBlock (the optimized FM of the module docstring)."""

    __constants__ = ["vectors_in", "vectors_out", "dim", "compressed"]

    def __init__(self, dim: int, vectors_in: int, vectors_out: int, compressed: int,
                 mlp: pipeline_pb2.DNN) -> None:
        super().__init__()
        self.dim, self.vectors_in = int(dim), int(vectors_in)
        self.vectors_out, self.compressed = int(vectors_out), int(compressed)
        self.weight = nn.Parameter(torch.empty(self.vectors_in, self.compressed))
        self.norm = nn.LayerNorm(self.vectors_in * self.compressed)
        self.mlp, width = build_mlp(self.vectors_in * self.compressed, mlp)
        self.out = nn.Linear(width, self.vectors_out * self.dim)
        nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k, D]`` -> ``[B, vectors_out, D]``."""
        compressed = torch.matmul(x.permute(0, 2, 1), self.weight)        # [B, D, c]
        pairs = torch.matmul(x, compressed)                                # [B, k, c]
        flat = pairs.reshape(-1, self.vectors_in * self.compressed)
        return self.out(self.mlp(self.norm(flat))).reshape(-1, self.vectors_out, self.dim)


class WuKongLayer(nn.Module):
    """One WuKong layer: FMB and LCB, the residual, LayerNorm over ``D``."""

    def __init__(self, dim: int, vectors_in: int,
                 settings: pipeline_pb2.TzWuKongLayer) -> None:
        super().__init__()
        lcb, fmb = int(settings.lcb_feature_num), int(settings.fmb_feature_num)
        self.lcb = LinearCompress(vectors_in, lcb)
        self.fmb = FactorizationMachineBlock(dim, vectors_in, fmb,
                                             int(settings.compressed_feature_num),
                                             settings.feature_num_mlp)
        self.norm = nn.LayerNorm(int(dim))
        self.residual = (LinearCompress(vectors_in, lcb + fmb) if vectors_in != lcb + fmb
                         else nn.Identity())
        self.vectors_out = lcb + fmb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, k, D]`` -> ``[B, lcb + fmb, D]``."""
        return self.norm(torch.cat([self.fmb(x), self.lcb(x)], dim=1) + self.residual(x))


class WuKongDense(nn.Module):
    """WuKong after the embedding lookup (the module docstring); scriptable.

    Args:
        settings: ``model_config.wukong``.
        num_sparse: the sparse group's lookups (``n``).
        dim: their width ``D``.
        dense_idx: ``Batch.dense`` columns of the "dense" group's raw values.
        dense_emb_width: columns of the "dense" group's pooled lookups.
        has_dense_group: a "dense" group exists (``dense_mlp`` is built).
        num_class: outputs (``[B]`` logits for 1, ``[B, C]`` for C > 1).
    """

    __constants__ = ["num_sparse", "dim", "num_class", "dense_emb_width"]
    dense_idx: list[int]

    def __init__(self, settings: pipeline_pb2.TzWuKong, num_sparse: int, dim: int,
                 dense_idx: Sequence[int], dense_emb_width: int, has_dense_group: bool,
                 num_class: int = 1) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.num_sparse, self.dim = int(num_sparse), int(dim)
        self.dense_idx = [int(i) for i in dense_idx]
        self.dense_emb_width = int(dense_emb_width)
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.dense_mlp = (build_mlp(len(self.dense_idx) + self.dense_emb_width,
                                    settings.dense_mlp)[0] if has_dense_group else None)
        vectors = self.num_sparse + (1 if has_dense_group else 0)
        layers = []
        for layer_settings in settings.wukong_layers:
            layer = WuKongLayer(self.dim, vectors, layer_settings)
            vectors = layer.vectors_out
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.final, width = build_mlp(vectors * self.dim, settings.final)
        self.out = nn.Linear(width, self.num_class)

    def forward(self, sparse: torch.Tensor, dense_emb: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1).

        Args:
            sparse: ``[B, n * D]`` the sparse group's pooled lookups.
            dense_emb: ``[B, dense_emb_width]`` the dense group's pooled lookups.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        x = sparse.reshape(-1, self.num_sparse, self.dim)
        dense_mlp = self.dense_mlp
        if dense_mlp is not None:
            values = dense[:, self.dense_idx]
            if self.dense_emb_width > 0:
                values = torch.cat([values, dense_emb], dim=1)
            x = torch.cat([dense_mlp(values).unsqueeze(1), x], dim=1)
        for layer in self.layers:
            x = layer(x)
        out = self.out(self.final(x.reshape(x.shape[0], -1)))
        return out.squeeze(1) if self.num_class == 1 else out


class WuKong(CtrModel):
    """WuKong over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        sparse: the sparse group's embedded features.
        dense_emb: the dense group's embedded features.
        dense_raw: the dense group's ``Batch.dense`` columns.
        has_dense_group: a "dense" group exists.
        model_config: the ``EasyRecModel`` (``wukong``, regularization, losses).
        output_name: the name of the model's output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, feature_builder: FeatureBuilder, sparse: Sequence[str],
                 dense_emb: Sequence[str], dense_raw: Sequence[str], has_dense_group: bool,
                 model_config: pipeline_pb2.EasyRecModel, output_name: str = "label",
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        layout = build_embedding_layout(feature_builder.table_specs,
                                        list(sparse) + list(dense_emb), [], 1, mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        settings = model_config.wukong
        self.dense = WuKongDense(settings, len(sparse), dim_of[sparse[0]],
                                 [col[c] for c in dense_raw],
                                 sum(dim_of[f] for f in dense_emb), has_dense_group,
                                 int(model_config.num_class))
        self.pooled_layout = (
            PooledGroup.of("sparse", tuple((f, table_of[f]) for f in sparse),
                           [dim_of[f] for f in sparse]),
            PooledGroup.of("dense", tuple((f, table_of[f]) for f in dense_emb),
                           [dim_of[f] for f in dense_emb]),
        )
        self.kernel_l2 = float(settings.l2_regularization)
        self.set_configured_loss(model_config, output_name)


def sparse_group_name(model_config: pipeline_pb2.EasyRecModel) -> str:
    """The sparse group: "sparse", or the only group (TorchEasyRec's one-group form)."""
    groups = model_config.feature_groups
    return groups[0].group_name if len(groups) == 1 else "sparse"


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> WuKong:
    mc = config.model_config
    groups = embedded_and_dense(mc, feature_builder)
    sparse, _raw = groups[sparse_group_name(mc)]
    has_dense = len(mc.feature_groups) > 1 and "dense" in groups
    dense_emb, dense_raw = groups["dense"] if has_dense else ([], [])
    return WuKong(feature_builder, sparse, dense_emb, dense_raw, has_dense, mc,
                  output_name=(list(config.data_config.label_fields) or ["label"])[0])


def _validate(check: ModelCheck) -> None:
    """The groups, one embedding width, the layers, dense_mlp's last width, final."""
    mc, features, groups, settings = (check.config.model_config, check.features, check.groups,
                                      check.settings)
    sparse_name = sparse_group_name(mc)
    if sparse_name not in groups:
        raise ConfigError("model_config.feature_groups",
                          'WuKong needs a feature group named "sparse" (its embedded '
                          "features), or one group")
    if not settings.wukong_layers:
        raise ConfigError(check.where("wukong_layers"), "required: at least one layer")
    for i, layer in enumerate(settings.wukong_layers):
        for name in ("lcb_feature_num", "fmb_feature_num", "compressed_feature_num"):
            if getattr(layer, name) < 1:
                raise ConfigError(check.where(f"wukong_layers[{i}].{name}"), "must be >= 1")
        validate_dnn(layer.feature_num_mlp, check.where(f"wukong_layers[{i}].feature_num_mlp"),
                     required=True)
    validate_dnn(settings.final, check.where("final"), required=True)
    if settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    sequence = pipeline_pb2.FeatureConfig.SequenceFeature
    dims: dict[str, int] = {}
    for i, g in enumerate(mc.feature_groups):
        for j, name in enumerate(g.feature_names):
            where = f"model_config.feature_groups[{i}].feature_names[{j}]"
            if features[name].feature_type == sequence:
                raise ConfigError(where, f"SequenceFeature {name!r}: WuKong reads no sequences")
            if g.group_name == sparse_name:
                if not embedded_feature(features[name]):
                    raise ConfigError(where, f"{name!r} is a raw value: the {sparse_name!r} "
                                             'group takes embedded features (raw values go '
                                             'in the "dense" group)')
                dims[name] = int(features[name].embedding_dim)
    si = groups[sparse_name]
    if not dims:
        raise ConfigError(f"model_config.feature_groups[{si}].feature_names",
                          f"the {sparse_name!r} group needs at least one embedded feature")
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(dims.items())[:6])
        raise ConfigError(f"model_config.feature_groups[{si}].feature_names",
                          f"WuKong needs every feature of the {sparse_name!r} group to have "
                          f"the same embedding_dim; got {shown}")
    if len(mc.feature_groups) > 1 and "dense" in groups:
        validate_dnn(settings.dense_mlp, check.where("dense_mlp"), required=True)
        dim = next(iter(dims.values()))
        if settings.dense_mlp.hidden_units[-1] != dim:
            raise ConfigError(check.where("dense_mlp.hidden_units"),
                              f"the last hidden unit ({settings.dense_mlp.hidden_units[-1]}) "
                              f"must equal the {sparse_name!r} group's embedding_dim ({dim}): "
                              "its output is one more feature vector")


register_model(ModelClass("WuKong", _build, _validate))
