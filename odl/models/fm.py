"""EasyRec's FM (``model_class: "FM"``, settings ``fm {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. A factorization machine: first-order weights of
the "wide" group plus the pairwise term over the "deep" group's embeddings, and a bias; no
DNN. With ``C = max(num_class, 1)`` outputs::

    wide  = sum over wide lookups of their C weights                           [B, C]
            (+ a linear term over the dense features of the wide group)
    v_i   = the deep lookups' vectors (one embedding_dim), then sum_k value_jk * p_jk for
            each projected raw feature j of the deep group (EasyRec's RawFeature with
            embedding_dim and no boundaries; value_j * p_j for one value)
    fm    = 0.5 * ((sum_i v_i)**2 - sum_i v_i**2)                              [B, D]
    logit = wide + sum(fm) + bias                          (C = 1)
    logit = wide + Linear(fm -> C) + bias                  (C > 1, EasyRec's fm_logits)

Loss: the configured prediction loss (``odl.models.ctr_losses``) + ``fm.l2_regularization``
* the squared dense Linear kernels + ``embedding_regularization`` * the mean squared pooled
lookup of each group (``deepfm_loss``'s terms).

Parameter names: ``dense.bias``, ``dense.wide_dense.weight``, ``dense.fm_out.*``,
``dense.projection.weight`` (the projected raw features' rows), then with
``model_config.variational_dropout`` ``dense.wide_dropout.logit_p`` (the wide group's
lookups and dense columns) and ``dense.fm_dropout.logit_p`` (the FM vectors), masked before
they are read, as EasyRec's input layer masks both groups.

This module has no ``from __future__ import annotations``: TorchScript reads ``FMDense``'s
class annotations as types.
"""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import RawProjection, fm_term
from odl.models.ctr_losses import (
    random_loss_weights,
    sample_weight_tensor,
    session_tensor,
)
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.deepfm import DeepFMRegularization, check_fm_group, deepfm_loss
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.feature_dropout import FeatureDropout, variational_dropout_loss
from odl.models.group_inputs import dense_columns, model_groups
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class FMDense(nn.Module):
    """FM after the embedding lookup (the module docstring); scriptable.

    Args:
        num_deep: lookups of the "deep" group (the FM vectors).
        dim: their embedding dim.
        num_wide: lookups of the "wide" group.
        wide_dense_idx: ``Batch.dense`` columns of the wide group's dense features.
        num_class: outputs (``[B]`` logits for 1, ``[B, C]`` for C > 1).
        projected_idx: ``Batch.dense`` columns of the deep group's projected raw features.
        projected_widths: columns per projected feature (default: 1 each).
        variational_dropout: ``model_config.variational_dropout``: the wide group's input
            (its lookups, then its dense columns) and the FM vectors each masked by their
            ``FeatureDropout``, as EasyRec's input layer masks both groups; None: none.
    """

    __constants__ = ["num_deep", "dim", "num_wide", "num_class", "num_projected"]
    wide_dense_idx: list[int]
    projected_idx: list[int]

    def __init__(self, num_deep: int, dim: int, num_wide: int, wide_dense_idx: Sequence[int],
                 num_class: int = 1, projected_idx: Sequence[int] = (),
                 projected_widths: "Sequence[int] | None" = None,
                 variational_dropout: "pipeline_pb2.VariationalDropoutLayer | None" = None
                 ) -> None:
        super().__init__()
        self.projected_idx = [int(i) for i in projected_idx]
        widths = ([1] * len(self.projected_idx) if projected_widths is None
                  else [int(w) for w in projected_widths])
        self.num_projected = len(widths) if self.projected_idx else 0
        self.num_deep = int(num_deep)
        self.dim = int(dim)
        self.num_wide = int(num_wide)
        self.num_class = max(int(num_class), 1)
        self.wide_dense_idx = [int(i) for i in wide_dense_idx]
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.bias = nn.Parameter(torch.zeros(self.num_class))
        self.wide_dense = (nn.Linear(len(self.wide_dense_idx), self.num_class, bias=False)
                           if self.wide_dense_idx else None)
        self.fm_out = nn.Linear(self.dim, self.num_class) if self.num_class > 1 else None
        self.projection = RawProjection(widths, self.dim) if self.num_projected else None
        drop = variational_dropout
        wide_widths = [self.num_class] * self.num_wide + [1] * len(self.wide_dense_idx)
        vectors = self.num_deep + self.num_projected
        self.wide_dropout = (FeatureDropout(wide_widths, drop)
                             if drop is not None and wide_widths else None)
        self.fm_dropout = (FeatureDropout([self.dim] * vectors, drop)
                           if drop is not None and vectors else None)

    def forward(self, deep: torch.Tensor, wide: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` (``[B, C]`` for C > 1) of the pooled groups and dense features."""
        b = dense.shape[0]
        logits = self.bias.expand(b, self.num_class)
        wide_dense = self.wide_dense
        wide_values = wide  # (read only with wide_dense, set below then)
        wide_dropout = self.wide_dropout
        if wide_dropout is not None:  # the wide group's lookups and dense columns together
            wide, wide_values = wide_dropout.over_pair(wide, dense[:, self.wide_dense_idx])
        elif wide_dense is not None:
            wide_values = dense[:, self.wide_dense_idx]
        if self.num_wide > 0:
            logits = logits + wide.reshape(b, self.num_wide, self.num_class).sum(dim=1)
        if wide_dense is not None:
            logits = logits + wide_dense(wide_values)
        vectors = deep
        projection = self.projection
        if projection is not None:
            proj = projection(dense[:, self.projected_idx])
            vectors = proj if self.num_deep == 0 else torch.cat([deep, proj], dim=1)
        fm_dropout = self.fm_dropout
        if fm_dropout is not None:
            vectors = fm_dropout(vectors)
        fm = fm_term(vectors.reshape(b, self.num_deep + self.num_projected, self.dim))
        fm_out = self.fm_out
        if fm_out is not None:
            return logits + fm_out(fm)
        return (logits + fm.sum(dim=1, keepdim=True)).squeeze(1)


class FM(CtrModel):
    """FM over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        layout: table layout (deep lookups: the FM vectors; wide lookups ``num_class`` wide).
        dense_features: names of ``Batch.dense`` columns, in order.
        wide_dense: the wide group's dense features.
        model_config: the ``EasyRecModel`` (``fm``, regularization, losses).
        output_name: the name of the model's output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    LOGITS_ONLY_IN_CTR_LOSS = True

    def __init__(self, layout: EmbeddingLayout, dense_features: Sequence[str],
                 wide_dense: Sequence[str], model_config: pipeline_pb2.EasyRecModel,
                 output_name: str = "label", ebc_device: "torch.device | str" = "meta",
                 projected: Sequence[str] = (), projected_dim: int = 0,
                 projected_widths: "Sequence[int] | None" = None) -> None:
        super().__init__()
        self.set_tables(layout, ebc_device)
        col = {n: i for i, n in enumerate(dense_features)}
        dims = set(layout.deep_dims) | ({int(projected_dim)} if projected else set())
        self.dense = FMDense(len(layout.deep_keys), dims.pop() if len(dims) == 1 else 0,
                             len(layout.wide_keys), [col[n] for n in wide_dense],
                             int(model_config.num_class),
                             projected_idx=[col[n] for n in projected],
                             projected_widths=projected_widths,
                             variational_dropout=(model_config.variational_dropout
                                                  if model_config.HasField("variational_dropout")
                                                  else None))
        self.pooled_layout = (
            PooledGroup.of("deep", tuple(layout.deep_keys), list(layout.deep_dims)),
            PooledGroup("wide", tuple(layout.wide_keys), layout.wide_output_dim),
        )
        self.set_configured_loss(model_config, output_name)
        self.regularization = DeepFMRegularization(
            l2=float(model_config.fm.l2_regularization),
            embedding=float(model_config.embedding_regularization),
            wide=float(model_config.embedding_regularization))

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The prediction loss plus the regularization (module docstring)."""
        deep, wide = output.pooled
        loss = deepfm_loss(output.logits, batch.labels, deep, wide, self.dense,
                           self.regularization, self.loss_terms, self.learned,
                           term_weights=random_loss_weights(self.model_config,
                                                            len(self.loss_terms),
                                                            output.logits),
                           softmax=self.dense.num_class > 1, sessions=session_tensor(batch),
                           data_weights=sample_weight_tensor(batch))
        if self.model_config.HasField("variational_dropout"):
            loss = loss + variational_dropout_loss(list(self.dense.modules()),
                                                   output.logits.shape[0])
        return loss


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> FM:
    mc = config.model_config
    groups = model_groups(mc, feature_builder)
    # EasyRec's projected raw features (embedding_dim, no boundaries): FM vectors
    dims = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)}
    projected = [f for f in groups["deep_dense"] if dims.get(f, 0) > 0]
    unread = [f for f in groups["deep_dense"] if f not in projected]
    if unread:
        logger.warning("FM reads the embedded and projected raw features of its deep group; "
                       "its dense features %s are not read (as in EasyRec: put them in the "
                       "wide group for a first-order term)", unread)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, groups["deep_sparse"],
                                        groups["wide_sparse"], max(int(mc.num_class), 1))
    except ValueError as e:
        raise ConfigError("model_config.feature_groups", str(e)) from e
    widths = {f: len(c) for f, c in feature_builder.dense_feature_columns.items()}
    return FM(layout, feature_builder.dense_feature_names,
              dense_columns(feature_builder, groups["wide_dense"]), mc,
              output_name=(list(config.data_config.label_fields) or ["label"])[0],
              projected=dense_columns(feature_builder, projected),
              projected_dim=dims[projected[0]] if projected else 0,
              projected_widths=[widths[f] for f in projected])


def _validate(check: ModelCheck) -> None:
    """The "wide" and "deep" groups; the deep group's embedded features of one dim."""
    mc, features = check.config.model_config, check.features
    for required in ("wide", "deep"):
        if required not in check.groups:
            raise ConfigError("model_config.feature_groups",
                              f'FM needs a feature group named "{required}"')
    if check.settings.l2_regularization < 0:
        raise ConfigError(check.where("l2_regularization"), "must be >= 0")
    sequence = pipeline_pb2.FeatureConfig.SequenceFeature
    for i, g in enumerate(mc.feature_groups):
        for j, name in enumerate(g.feature_names):
            fc = features[name]
            where = f"model_config.feature_groups[{i}].feature_names[{j}]"
            if fc.feature_type == sequence:
                raise ConfigError(where, f"SequenceFeature {name!r}: FM reads no sequences")
    check_fm_group(check, "deep")


register_model(ModelClass("FM", _build, _validate, projected_raw=True,
                          variational_dropout=True))
