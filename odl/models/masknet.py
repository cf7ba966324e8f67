"""TorchEasyRec's MaskNet (``model_class: "MaskNet"``, settings ``mask_net {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. One feature group (the model's first): its pooled
embeddings, its projected raw features (``embedding_dim`` and no ``boundaries``: each a
``dim``-wide vector, ``RawProjection``) and its raw values, concatenated into ``e``
``[B, F]``. With ``C =
max(num_class, 1)`` outputs and TorchEasyRec's MaskBlock (``tzrec/modules/masknet.py``)::

    block(h, e) = ReLU(LayerNorm(W_f (h * mask(e)) + b_f))          (hidden_dim wide)
    mask(e)     = W_2 ReLU(W_1 e + b_1) + b_2                       (as wide as h)
    parallel:  x = concat(block_1(LayerNorm(e), e), ..., block_n(LayerNorm(e), e))
    serial:    x = block_n(... block_2(block_1(LayerNorm(e), e), e) ..., e)
    logit      = Linear(top_mlp(x) -> C, no bias)        (top_mlp absent: x itself)

``W_1``'s width (the aggregation) is ``int(input width * reduction_ratio)`` when
``reduction_ratio`` is set (1.0 unless written 0), else ``aggregation_dim``, as TorchEasyRec
decides it.

Loss: the configured prediction loss (``odl.models.ctr_losses``) +
``mask_net.l2_regularization`` * the squared dense Linear kernels + ``embedding_regularization``
* the mean squared pooled lookup.

Parameter names: ``dense.projection.weight``, ``dense.ln_emb.*``, ``dense.blocks.<i>.mask.*``,
``dense.blocks.<i>.ffn.*``, ``dense.top.*``, ``dense.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs, projected_raw
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import RawProjection, build_mlp
from odl.models.ctr_model import CtrModel, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import embedded_and_dense
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def aggregation_width(block: pipeline_pb2.TzMaskBlock, input_width: int) -> int:
    """The mask generator's hidden width, as TorchEasyRec decides it (module docstring)."""
    if block.reduction_ratio:
        return int(input_width * block.reduction_ratio)
    return int(block.aggregation_dim)


class MaskBlock(nn.Module):
    """One mask block: ``ReLU(LayerNorm(Linear(h * mask(e))))``.

    Args:
        input_width: width of ``h`` (the embeddings in parallel, the previous block's output
            in serial).
        feature_width: width of ``e``.
        settings: the block's settings.
    """

    def __init__(self, input_width: int, feature_width: int,
                 settings: pipeline_pb2.TzMaskBlock) -> None:
        super().__init__()
        agg = aggregation_width(settings, input_width)
        self.mask = nn.Sequential(nn.Linear(feature_width, agg), nn.ReLU(),
                                  nn.Linear(agg, input_width))
        hidden = int(settings.hidden_dim)
        self.ffn = nn.Sequential(nn.Linear(input_width, hidden), nn.LayerNorm(hidden),
                                 nn.ReLU())

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The block's output ``[B, hidden_dim]``."""
        return self.ffn(h * self.mask(e))


class MaskNetDense(nn.Module):
    """MaskNet after the embedding lookup (the module docstring); scriptable.

    Args:
        emb_width: width of the group's pooled lookups.
        dense_idx: ``Batch.dense`` columns of the group's raw values.
        module: ``mask_net.mask_net_module``.
        num_class: outputs (``[B]`` logits for 1, ``[B, C]`` for C > 1).
        projected_idx: ``Batch.dense`` columns of the group's projected raw features.
        projected_widths: columns per projected feature.
        projected_dim: their ``embedding_dim``.
    """

    __constants__ = ["parallel", "num_class", "has_projected"]
    dense_idx: list[int]
    projected_idx: list[int]

    def __init__(self, emb_width: int, dense_idx: Sequence[int],
                 module: pipeline_pb2.TzMaskNetModule, num_class: int = 1,
                 projected_idx: Sequence[int] = (), projected_widths: Sequence[int] = (),
                 projected_dim: int = 0) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.dense_idx = [int(i) for i in dense_idx]
        self.projected_idx = [int(i) for i in projected_idx]
        self.has_projected = len(self.projected_idx) > 0
        width = (int(emb_width) + len(self.dense_idx)
                 + len(list(projected_widths)) * int(projected_dim))
        self.parallel = bool(module.use_parallel)
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.projection = (RawProjection(projected_widths, int(projected_dim))
                           if self.has_projected else None)
        self.ln_emb = nn.LayerNorm(width)
        n, hidden = int(module.n_mask_blocks), int(module.mask_block.hidden_dim)
        if self.parallel:
            self.blocks = nn.ModuleList(MaskBlock(width, width, module.mask_block)
                                        for _ in range(n))
            out = hidden * n
        else:
            self.blocks = nn.ModuleList(MaskBlock(width if i == 0 else hidden, width,
                                                  module.mask_block) for i in range(n))
            out = hidden
        if module.HasField("top_mlp") and module.top_mlp.hidden_units:
            self.top, out = build_mlp(out, module.top_mlp)
        else:
            self.top = nn.Identity()
        self.out = nn.Linear(out, self.num_class, bias=False)

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1).

        Args:
            emb: ``[B, emb_width]`` the group's pooled lookups.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        parts = [emb]
        projection = self.projection
        if projection is not None:
            parts.append(projection(dense[:, self.projected_idx]))
        parts.append(dense[:, self.dense_idx])
        e = torch.cat(parts, dim=1)
        ln = self.ln_emb(e)
        if self.parallel:
            x = torch.cat([block(ln, e) for block in self.blocks], dim=1)
        else:
            x = ln
            for block in self.blocks:
                x = block(x, e)
        out = self.out(self.top(x))
        return out.squeeze(1) if self.num_class == 1 else out


class MaskNet(CtrModel):
    """MaskNet over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        embedded: the group's embedded features.
        raw: the group's ``Batch.dense`` columns of plain raw values.
        model_config: the ``EasyRecModel`` (``mask_net``, regularization, losses).
        output_name: the name of the model's output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, feature_builder: FeatureBuilder, embedded: Sequence[str],
                 raw: Sequence[str], model_config: pipeline_pb2.EasyRecModel,
                 output_name: str = "label",
                 ebc_device: "torch.device | str" = "meta",
                 projected: Sequence[Sequence[str]] = (), projected_dim: int = 0) -> None:
        super().__init__()
        layout = build_embedding_layout(feature_builder.table_specs, list(embedded), [], 1,
                                        mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        settings = model_config.mask_net
        self.dense = MaskNetDense(sum(dim_of[f] for f in embedded), [col[c] for c in raw],
                                  settings.mask_net_module, int(model_config.num_class),
                                  [col[c] for cols in projected for c in cols],
                                  [len(cols) for cols in projected], projected_dim)
        self.pooled_layout = (
            PooledGroup.of(model_config.feature_groups[0].group_name,
                           tuple((f, table_of[f]) for f in embedded),
                           [dim_of[f] for f in embedded]),
        )
        self.kernel_l2 = float(settings.l2_regularization)
        self.set_configured_loss(model_config, output_name)


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> MaskNet:
    mc = config.model_config
    embedded, raw = embedded_and_dense(mc, feature_builder)[mc.feature_groups[0].group_name]
    dims = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)}
    projected = [f for f in raw if dims.get(f, 0) > 0]
    columns_of = feature_builder.dense_feature_columns
    return MaskNet(feature_builder, embedded, [f for f in raw if f not in projected], mc,
                   output_name=(list(config.data_config.label_fields) or ["label"])[0],
                   projected=[columns_of[f] for f in projected],
                   projected_dim=dims[projected[0]] if projected else 0)


def _validate(check: ModelCheck) -> None:
    """One feature group of embedded or raw features; the blocks; the top MLP."""
    mc, features = check.config.model_config, check.features
    module = check.settings.mask_net_module
    if not check.settings.HasField("mask_net_module"):
        raise ConfigError(check.where("mask_net_module"),
                          "MaskNet needs mask_net_module { n_mask_blocks mask_block "
                          "{ hidden_dim } }")
    if module.n_mask_blocks < 1:
        raise ConfigError(check.where("mask_net_module.n_mask_blocks"), "must be >= 1")
    block = module.mask_block
    if block.hidden_dim < 1:
        raise ConfigError(check.where("mask_net_module.mask_block.hidden_dim"),
                          "required: the width of each block's feed-forward layer")
    if block.reduction_ratio < 0:
        raise ConfigError(check.where("mask_net_module.mask_block.reduction_ratio"),
                          "must be >= 0")
    if not block.reduction_ratio and block.aggregation_dim < 1:
        raise ConfigError(check.where("mask_net_module.mask_block.aggregation_dim"),
                          "give reduction_ratio or aggregation_dim (the mask generator's "
                          "width)")
    if module.HasField("top_mlp"):
        validate_dnn(module.top_mlp, check.where("mask_net_module.top_mlp"), required=False)
    if check.settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    if len(mc.feature_groups) != 1:
        raise ConfigError("model_config.feature_groups",
                          f"MaskNet reads one feature group, got {len(mc.feature_groups)}")
    projected = {n: features[n].embedding_dim for n in mc.feature_groups[0].feature_names
                 if projected_raw(features[n])}
    if len(set(projected.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(projected.items())[:6])
        raise ConfigError("model_config.feature_groups[0].feature_names",
                          f"MaskNet's projected raw features need one embedding_dim; got "
                          f"{shown}")
    sequence = pipeline_pb2.FeatureConfig.SequenceFeature
    for j, name in enumerate(mc.feature_groups[0].feature_names):
        if features[name].feature_type == sequence:
            raise ConfigError(f"model_config.feature_groups[0].feature_names[{j}]",
                              f"SequenceFeature {name!r}: MaskNet reads no sequences")
    if not mc.feature_groups[0].feature_names:
        raise ConfigError("model_config.feature_groups[0].feature_names",
                          "MaskNet needs at least one feature")

register_model(ModelClass("MaskNet", _build, _validate, projected_raw=True))
