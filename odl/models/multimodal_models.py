"""EasyRec's CMBF and UNITER models (``model_class: "CMBF"`` / ``"Uniter"``) as ``CtrModel``s.

The contract is ``odl.models.ctr_model``. As EasyRec's ``easy_rec/python/model/cmbf.py`` and
``uniter.py``: the multimodal layer DBMTL also takes as its bottom
(``odl.models.cmbf.CMBFBottom``, ``odl.models.uniter.UniterBottom``) over the ``image``,
``general``, ``text`` and ``other`` feature groups (``odl.models.multimodal_inputs``), then
``final_dnn`` and ``C = max(num_class, 1)`` logits::

    h     = layer(the groups' lookups, their dense columns)      (cmbf.config / uniter.config)
    logit = Linear(final_dnn(h) -> C)                             (final_dnn unset: h itself)

Loss: the configured prediction loss (``odl.models.ctr_losses``; ``losses`` as written) +
``embedding_regularization`` * the mean squared pooled lookup. The messages have no
``l2_regularization`` (EasyRec's models read 0).

Parameter names: ``dense.layer.*`` (the layer's, named as under DBMTL's ``dense.bottom``),
``dense.final_dnn.*``, ``dense.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

from collections.abc import Sequence

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_mlp
from odl.models.cmbf import CMBFBottom
from odl.models.ctr_model import CtrModel, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.multimodal_inputs import (
    check_multimodal_groups,
    multimodal_inputs,
    validate_multimodal_layer,
)
from odl.models.uniter import UniterBottom
from odl.protos import pipeline_pb2

# the pooled group of the layer's lookups (every group it reads, in its input order)
GROUP = "multimodal"


class MultimodalDense(nn.Module):
    """The layer, ``final_dnn`` and the logits (module docstring); scriptable.

    Args:
        layer: a ``CMBFBottom`` or ``UniterBottom`` (with ``out_width``).
        dense_idx: the ``Batch.dense`` columns the layer reads after the lookups.
        final_dnn: the ``final_dnn`` settings.
        num_class: logits per sample (``[B]`` for 1, ``[B, C]`` for C > 1).
    """

    __constants__ = ["num_class", "has_dense"]
    dense_idx: list[int]

    def __init__(self, layer: nn.Module, dense_idx: Sequence[int], final_dnn: pipeline_pb2.DNN,
                 num_class: int = 1) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.dense_idx = [int(i) for i in dense_idx]
        self.has_dense = len(self.dense_idx) > 0
        self.layer = layer
        self.final_dnn, width = build_mlp(int(layer.out_width), final_dnn)
        self.out = nn.Linear(width, self.num_class)

    def forward(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1).

        Args:
            group: ``[B, lookups * dim]`` the layer's pooled lookups.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        x = torch.cat([group, dense[:, self.dense_idx]], dim=1) if self.has_dense else group
        out = self.out(self.final_dnn(self.layer(x)))
        return out.squeeze(1) if self.num_class == 1 else out


class MultimodalModel(CtrModel):
    """CMBF or UNITER over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        config: the pipeline config (``model_config.cmbf`` or ``model_config.uniter``).
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ValueError: a layer setting its modules refuse.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        mc = config.model_config
        field = mc.WhichOneof("model")
        settings = getattr(mc, field)
        lookups, columns, layout = multimodal_inputs(config, feature_builder)
        tables = build_embedding_layout(feature_builder.table_specs, lookups, [], 1,
                                        mixed_dims=True)
        self.set_tables(tables, ebc_device)
        table_of = dict(tables.deep_keys)
        dim_of = dict(zip((f for f, _t in tables.deep_keys), tables.deep_dims, strict=True))
        layer = (CMBFBottom(settings.config, layout) if field == "cmbf"
                 else UniterBottom(settings.config, layout))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        self.dense = MultimodalDense(layer, [col[c] for c in columns], settings.final_dnn,
                                     int(mc.num_class))
        self.pooled_layout = (PooledGroup.of(GROUP, tuple((f, table_of[f]) for f in lookups),
                                             [dim_of[f] for f in lookups]),)
        self.set_configured_loss(mc, (list(config.data_config.label_fields) or ["label"])[0])


def _build(config: pipeline_pb2.EasyRecConfig,
           feature_builder: FeatureBuilder) -> MultimodalModel:
    field = config.model_config.WhichOneof("model")
    try:
        return MultimodalModel(config, feature_builder)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}.config", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """The groups the layer reads, the layer's settings, ``final_dnn``."""
    mc, settings = check.config.model_config, check.settings
    if not mc.HasField(check.field) or not settings.HasField("config"):
        raise ConfigError(check.where("config"),
                          f"{mc.model_class} needs {check.field} {{ config {{ ... }} "
                          "final_dnn { ... } }")
    check_multimodal_groups(check.groups, check.field)
    validate_multimodal_layer(settings.config, check.where("config"))
    validate_dnn(settings.final_dnn, check.where("final_dnn"), required=False)


for _name in ("CMBF", "Uniter"):
    register_model(ModelClass(_name, _build, _validate, projected_raw=True))
