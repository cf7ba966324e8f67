"""EasyRec's and TorchEasyRec's RocketLaunching (``rocket_launching {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. As ``easy_rec/python/model/rocket_launching.py``
and ``tzrec/models/rocket_launching.py``: over the group ``all`` (or the model's only group:
its lookups, its sequences combined, its raw values, ``x``), a booster network and a light
network; the light one reads ``x`` without passing gradients back to it, so the tables and
``share_dnn`` learn through the booster only::

    s       = share_dnn(x)                                (unset: x)
    booster = Linear(booster_dnn(s) -> C)                 (C = max(num_class, 1))
    light   = Linear(light_dnn(stop_gradient(s)) -> C)    the model's output, served

Loss: the configured prediction loss of the light logits + the same of the booster logits +
the hint loss ``mean((light - stop_gradient(booster))**2)`` + with
``feature_based_distillation``, per light hidden layer ``i`` and the first booster hidden
layer ``j`` of its width, ``-0.1 * mean_b(cos(light_i, stop_gradient(booster_j)))``
(``COSINE``) or ``||light_i - stop_gradient(booster_j)||`` over the batch (``EUCLID``,
TorchEasyRec's sign; EasyRec's negates it) + ``l2_regularization`` * the squared dense Linear
kernels + ``embedding_regularization`` * the mean squared pooled lookup. The booster runs in
training only: predictions, progressive metrics, exports and serving are the light
network's.

Parameter names: ``dense.share.*``, ``dense.booster.<l>.*``, ``dense.booster_out.*``,
``dense.light.<l>.*``, ``dense.light_out.*``, ``dense.sequences.*`` (the group's sequence
blocks).

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.model_validation import validate_dnn
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_mlp
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import all_group, group_input
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.sequence_layers import GroupSequences
from odl.protos import pipeline_pb2

# EasyRec's and TorchEasyRec's weight of a cosine similarity term
SIMILARITY_WEIGHT = -0.1


def _layers(in_width: int, dnn: pipeline_pb2.DNN) -> tuple[nn.ModuleList, int]:
    """A DNN one hidden layer per module (their outputs are the distilled features)."""
    layers = nn.ModuleList()
    width = in_width
    for i, units in enumerate(dnn.hidden_units):
        one = pipeline_pb2.DNN(hidden_units=[units], activation=dnn.activation,
                               use_bn=dnn.use_bn)
        if i < len(dnn.dropout_ratio):
            one.dropout_ratio.append(dnn.dropout_ratio[i])
        layer, width = build_mlp(width, one)
        layers.append(layer)
    return layers, width


def layer_pairs(light: Sequence[int], booster: Sequence[int]) -> list[tuple[int, int]]:
    """``(light layer, booster layer)`` pairs of the feature-based distillation.

    Each light hidden layer with the first booster hidden layer of its width (EasyRec's and
    TorchEasyRec's pairing).
    """
    pairs = []
    for i, units in enumerate(light):
        for j, other in enumerate(booster):
            if units == other:
                pairs.append((i, j))
                break
    return pairs


class RocketDense(nn.Module):
    """Both networks after the embedding lookup (module docstring); scriptable.

    Args:
        in_width: the group input's width (after its sequences are combined).
        dense_idx: ``Batch.dense`` columns the group reads after its lookups.
        settings: ``rocket_launching``.
        num_class: outputs.
        sequences: the group's sequence blocks combined, or None.
    """

    __constants__ = ["num_class", "has_dense", "euclid"]
    dense_idx: list[int]
    pairs: list[tuple[int, int]]

    def __init__(self, in_width: int, dense_idx: Sequence[int],
                 settings: pipeline_pb2.RocketLaunching, num_class: int = 1,
                 sequences: Optional[GroupSequences] = None) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.dense_idx = [int(i) for i in dense_idx]
        self.has_dense = len(self.dense_idx) > 0
        self.sequences = sequences
        self.share, width = build_mlp(in_width, settings.share_dnn)  # (empty: identity)
        self.booster, booster_width = _layers(width, settings.booster_dnn)
        self.booster_out = nn.Linear(booster_width, self.num_class)
        self.light, light_width = _layers(width, settings.light_dnn)
        self.light_out = nn.Linear(light_width, self.num_class)
        self.pairs = (layer_pairs(list(settings.light_dnn.hidden_units),
                                  list(settings.booster_dnn.hidden_units))
                      if settings.feature_based_distillation else [])
        self.euclid = settings.feature_distillation_function == pipeline_pb2.EUCLID

    def _shared(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = torch.cat([group, dense[:, self.dense_idx]], dim=1) if self.has_dense else group
        sequences = self.sequences
        if sequences is not None:
            x = sequences(x)
        return self.share(x)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        return out.squeeze(1) if self.num_class == 1 else out

    def forward(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The light network's logits ``[B]`` (``[B, C]`` for C > 1): the served output."""
        h = self._shared(group, dense)
        for layer in self.light:
            h = layer(h)
        return self._logits(self.light_out(h))

    def both(self, group: torch.Tensor, dense: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Training: ``(light logits, booster logits, the feature-based distillation loss)``."""
        s = self._shared(group, dense)
        light_hidden: list[torch.Tensor] = []
        h = s.detach()
        for layer in self.light:
            h = layer(h)
            light_hidden.append(h)
        booster_hidden: list[torch.Tensor] = []
        b = s
        for layer in self.booster:
            b = layer(b)
            booster_hidden.append(b)
        light = self._logits(self.light_out(h))
        booster = self._logits(self.booster_out(b))
        loss = torch.zeros((), dtype=light.dtype, device=light.device)
        for i, j in self.pairs:
            target = booster_hidden[j].detach()
            if self.euclid:
                loss = loss + torch.sqrt(torch.sum(torch.square(target - light_hidden[i])))
            else:
                cos = torch.sum(nn.functional.normalize(target, dim=1)
                                * nn.functional.normalize(light_hidden[i], dim=1), dim=1)
                loss = loss + SIMILARITY_WEIGHT * torch.mean(cos)
        return light, booster, loss


@dataclass
class RocketOutput(ModelOutput):
    """``ModelOutput`` with the booster's logits (training only)."""

    booster: Optional[torch.Tensor] = None

    def rows(self, n: int) -> "RocketOutput":
        """As ``ModelOutput.rows``, the booster's logits cut too."""
        out = super().rows(n)
        out.booster = self.booster[:n] if self.booster is not None else None
        return out


class RocketLaunching(CtrModel):
    """RocketLaunching over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        config: the pipeline config.
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    LOGITS_ONLY_IN_CTR_LOSS = False  # the booster's and the distillation terms

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        mc = config.model_config
        group = all_group(mc)
        read = group_input(config, feature_builder, group)
        layout = build_embedding_layout(feature_builder.table_specs,
                                        list(dict.fromkeys(read.lookups)), [], 1,
                                        mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        seqs = read.sequences(dim_of)
        width = (int(seqs.out_width) if seqs is not None
                 else sum(dim_of[f] for f in read.lookups) + len(read.raw))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        settings = mc.rocket_launching
        self.dense = RocketDense(width, [col[c] for c in read.raw], settings,
                                 int(mc.num_class), seqs)
        self.pooled_layout = (PooledGroup.of(group, tuple((f, table_of[f])
                                                          for f in read.lookups),
                                             [dim_of[f] for f in read.lookups]),)
        self.kernel_l2 = float(settings.l2_regularization)
        self.set_configured_loss(mc, (list(config.data_config.label_fields) or ["label"])[0])

    def forward(self, batch: Batch) -> ModelOutput:
        """Lookup, then the light network (and, in training, the booster and distillation)."""
        pooled = self.lookup(batch)
        if not self.training:
            return ModelOutput(self.dense(*pooled, batch.dense), pooled)
        light, booster, distillation = self.dense.both(*pooled, batch.dense)
        return RocketOutput(light, pooled, distillation, booster)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The light network's loss, the booster's, the hint loss and the rest.

        The rest: the forward's feature-based terms and the regularization.
        """
        loss = self.configured_loss(output, batch, self.kernel_l2)
        booster = getattr(output, "booster", None)
        if booster is not None:
            loss = loss + self.prediction_loss(booster, batch)
            loss = loss + torch.mean(torch.square(output.logits - booster.detach()))
        return loss


def _build(config: pipeline_pb2.EasyRecConfig,
           feature_builder: FeatureBuilder) -> RocketLaunching:
    try:
        return RocketLaunching(config, feature_builder)
    except ValueError as e:
        raise ConfigError("model_config.rocket_launching", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """Its networks, the group it reads, the similarity."""
    mc, settings = check.config.model_config, check.settings
    if not mc.HasField("rocket_launching"):
        raise ConfigError(check.where(), "RocketLaunching needs rocket_launching { booster_dnn "
                                         "light_dnn }")
    for name in ("booster_dnn", "light_dnn"):
        validate_dnn(getattr(settings, name), check.where(name), required=True)
    if settings.HasField("share_dnn"):
        validate_dnn(settings.share_dnn, check.where("share_dnn"), required=False)
    if settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    if settings.feature_distillation_function == pipeline_pb2.INNER_PRODUCT:
        raise ConfigError(check.where("feature_distillation_function"),
                          "COSINE or EUCLID (EasyRec's RocketLaunching compares no other way)")
    all_group(mc)  # (refused by field without one)


register_model(ModelClass("RocketLaunching", _build, _validate, group_attention="all"))
