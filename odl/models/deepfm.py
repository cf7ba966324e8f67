"""EasyRec's DeepFM and WideAndDeep as ``CtrModel``s (contract: ``odl.models.ctr_model``).

Both share one dense part (``DeepFMDense``); WideAndDeep is DeepFM without the FM term
(``use_fm`` false: no ``fm`` below, in the sum or in ``final_dnn``'s input). The dense part
is fed ``deep [B, num_deep * dim]``, ``wide [B, num_wide * wide_output_dim]`` (the two
pooled groups) and the raw dense features::

    wide  = sum over wide lookups of their wide_output_dim weights              [B, W]
            (+ a linear term over the dense features of a wide group) + bias
    v_i   = the deep lookups' vectors, each deep SequenceFeature's combined vector (its
            sequence_combiner over its positions), then sum_k value_jk * p_jk for each
            projected raw feature j (value_j * p_j for one value)
    fm    = 0.5 * ((sum_i v_i)**2 - sum_i v_i**2)  over the v_i                    [B, D]
    deep  = DNN(concat(v_i, deep dense features))                                [B, H]
    logit = sum(wide) + sum(fm) + Linear(deep -> 1)              (no final_dnn)
    logit = Linear(final_dnn(concat(wide, fm, deep)) -> 1)       (with final_dnn)
            + sum(wide)                      (DeepFM's wide_to_logit, odl's default)
            + g * sum(fm)                    (DeepFM's fm_to_logit, odl's default)

``g`` is a learned scalar from 1, stored as ``dense.fm_logit_weight`` = g / 30 so that Adam
moves it 30 times as fast as the other dense parameters: where FM's sum in the logit does
not help (the Criteo-like stream) it is within 0.04 of 0 after 390 steps, where it does
(MovieLens) it stays well above 0 (docs/training.md).

Loss (``deepfm_loss``): the configured prediction loss (``odl.models.ctr_losses``; binary
cross entropy by default)
    + l2_regularization * sum of squared dense Linear weights (kernels, not biases)
    + embedding_regularization * mean over (sample, deep lookup) of ||pooled embedding||**2
    + wide_regularization (or embedding_regularization when 0) * same over wide lookups.
The embedding terms use the pooled vectors of the step (cheap), which equal the looked-up
rows for single-valued features.

Parameter names: the tables are ``ebc.embedding_bags.<table>.weight``; every dense parameter
lives under ``dense.`` (``dense.dnn.*``, ``dense.deep_out.*``, ``dense.final_dnn.*``,
``dense.final_out.*``, ``dense.wide_bias``, ``dense.wide_dense.*``, ``dense.projection.weight``
(the projected raw features' rows), then with ``model_config.variational_dropout``
``dense.wide_dropout.logit_p`` and ``dense.deep_dropout.logit_p`` (the groups' masks,
``odl.models.feature_dropout``; FM reads the masked deep vectors)), then with
``fm_to_logit`` ``dense.fm_logit_weight`` (``ADDED_PARAMETERS``: a checkpoint written
without it restores, the weight starting at 1).

This module has no ``from __future__ import annotations``: TorchScript reads
``DeepFMDense``'s class annotations as types.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.feature_configs import embedded_feature, feature_configs, projected_raw
from odl.config.model_classes import model_settings
from odl.config.model_validation import (
    check_dropout_group,
    sequence_combiner_width,
    validate_dnn,
)
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import RawProjection, build_mlp, fm_term
from odl.models.ctr_losses import (
    ctr_loss,
    embedding_l2,
    linear_kernel_l2,
    random_loss_weights,
    sample_weight_tensor,
    session_tensor,
)
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.feature_dropout import FeatureDropout, variational_dropout_loss
from odl.models.group_inputs import dense_columns, model_groups, sequence_blocks
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.sequence_layers import GroupSequences, SequenceBlock
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

# fm_to_logit's weight moves at this multiple of the dense rate (it is stored divided by it),
# so that it can fall from 1 to 0 within a few hundred steps
FM_LOGIT_RATE = 30.0


class DeepFMDense(nn.Module):
    """DeepFM after the embedding lookup (see the module docstring); scriptable.

    Args:
        cfg: the DeepFM or WideAndDeep settings (towers).
        num_deep: deep lookups.
        dim: deep embedding dim.
        num_wide: wide lookups.
        wide_output_dim: columns of each wide lookup.
        deep_dense_idx: dense-feature columns fed to the deep tower.
        wide_dense_idx: dense-feature columns fed to the wide linear term.
        num_dense: dense-feature columns in a batch.
        use_fm: add the FM term (DeepFM); false: WideAndDeep.
        deep_width: columns of the deep group when its lookups differ in width (``dim``
            0; WideAndDeep only); None: ``num_deep * dim``.
        projected_idx: dense-feature columns of the deep group's projected raw features
            (EasyRec's RawFeature with ``embedding_dim`` and no ``boundaries``): each
            feature becomes a ``dim``-wide vector after the deep lookups (``RawProjection``).
        projected_widths: columns per projected feature (``raw_input_dim``; default: 1
            each).
        sequences: the deep group's SequenceFeatures' combiners (their positions end
            ``deep``), or None.
        sequence_length_idx: dense-feature columns of those sequences' lengths.
        num_class: logits per sample (``[B]`` for 1; ``[B, C]`` for C > 1: the deep Linear is
            C wide, the wide part ``wide_output_dim`` = C wide and FM is added to each).
        variational_dropout: ``model_config.variational_dropout`` (None: none): the wide
            group's input (its lookups, then its dense columns) and the deep group's (its
            lookups, projected features, dense columns; FM reads the masked vectors) each
            masked by a ``FeatureDropout``, as EasyRec's input layer masks both groups. Not
            with sequences.
        lookup_widths: the deep lookups' widths, in order (for the deep group's mask).

    Raises:
        ValueError: nothing feeds the deep tower, or an unsupported DNN setting.
    """

    __constants__ = ["num_deep", "dim", "num_wide", "wide_output_dim", "has_deep_dense",
                     "all_deep_dense", "use_fm", "num_projected", "num_sequences", "num_class",
                     "wide_to_logit", "fm_logit_rate"]
    deep_dense_idx: list[int]
    wide_dense_idx: list[int]
    projected_idx: list[int]
    sequence_length_idx: list[int]

    def __init__(
        self,
        cfg: "pipeline_pb2.DeepFM | pipeline_pb2.WideAndDeep",
        num_deep: int,
        dim: int,
        num_wide: int,
        wide_output_dim: int,
        deep_dense_idx: Sequence[int],
        wide_dense_idx: Sequence[int],
        num_dense: int,
        use_fm: bool = True,
        deep_width: "int | None" = None,
        projected_idx: Sequence[int] = (),
        sequences: "GroupSequences | None" = None,
        sequence_length_idx: Sequence[int] = (),
        projected_widths: "Sequence[int] | None" = None,
        num_class: int = 1,
        variational_dropout: "pipeline_pb2.VariationalDropoutLayer | None" = None,
        lookup_widths: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.num_class = max(int(num_class), 1)
        self.projected_idx = [int(i) for i in projected_idx]
        widths = ([1] * len(self.projected_idx) if projected_widths is None
                  else [int(w) for w in projected_widths])
        if sum(widths) != len(self.projected_idx):
            raise ValueError("projected_widths must add up to the projected columns")
        self.num_projected = len(widths)
        self.sequence_length_idx = [int(i) for i in sequence_length_idx]
        self.num_sequences = len(self.sequence_length_idx)
        self.use_fm = (bool(use_fm)
                       and int(num_deep) + self.num_projected + self.num_sequences > 0)
        if (self.use_fm or self.num_projected) and int(dim) <= 0:
            raise ValueError("FM and projected raw features need one embedding_dim for every "
                             "deep lookup")
        self.num_deep = int(num_deep)
        self.dim = int(dim)
        self.num_wide = int(num_wide)
        self.wide_output_dim = int(wide_output_dim)
        self.deep_dense_idx = [int(i) for i in deep_dense_idx]
        self.wide_dense_idx = [int(i) for i in wide_dense_idx]
        self.has_deep_dense = len(self.deep_dense_idx) > 0
        self.all_deep_dense = self.deep_dense_idx == list(range(int(num_dense)))
        width = self.num_deep * self.dim if deep_width is None else int(deep_width)
        if sequences is not None:  # the sequences' positions become one vector each
            width = sequences.out_width
        deep_in = width + self.num_projected * self.dim + len(self.deep_dense_idx)
        if deep_in == 0:
            raise ValueError("DeepFM needs at least one feature in a deep group")
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.dnn, deep_width = build_mlp(deep_in, cfg.dnn)
        self.wide_bias = nn.Parameter(torch.zeros(1))
        self.wide_dense = (nn.Linear(len(self.wide_dense_idx), self.wide_output_dim, bias=False)
                           if self.wide_dense_idx else None)
        if cfg.HasField("final_dnn"):
            fm_dim = self.dim if self.use_fm else 0
            final_in = self.wide_output_dim + fm_dim + deep_width
            self.final_dnn, final_width = build_mlp(final_in, cfg.final_dnn)
            self.final_out = nn.Linear(final_width, self.num_class)
            self.deep_out = None
            self.wide_to_logit = (self.num_class == 1 and "wide_to_logit" in
                                  cfg.DESCRIPTOR.fields_by_name and cfg.wide_to_logit)
        else:
            self.final_dnn = None
            self.final_out = None
            self.deep_out = nn.Linear(deep_width, self.num_class)
            self.wide_to_logit = False
        self.projection = (RawProjection(widths, self.dim) if self.num_projected else None)
        self.sequences = sequences
        drop = variational_dropout
        if drop is not None and sequences is not None:
            raise ValueError("variational dropout over a deep group with sequences is not "
                             "implemented")
        wide_widths = [self.wide_output_dim] * self.num_wide + [1] * len(self.wide_dense_idx)
        deep_widths = ([int(w) for w in lookup_widths] + [self.dim] * self.num_projected
                       + [1] * len(self.deep_dense_idx))
        self.wide_dropout = (FeatureDropout(wide_widths, drop)
                             if drop is not None and wide_widths else None)
        self.deep_dropout = FeatureDropout(deep_widths, drop) if drop is not None else None
        # registered last, so a checkpoint written without it keeps every other position
        gate = (self.final_dnn is not None and self.use_fm and self.num_class == 1
                and "fm_to_logit" in cfg.DESCRIPTOR.fields_by_name and cfg.fm_to_logit)
        self.fm_logit_rate = FM_LOGIT_RATE
        self.fm_logit_weight = (nn.Parameter(torch.full((1,), 1.0 / FM_LOGIT_RATE))
                                if gate else None)

    def forward(self, deep: torch.Tensor, wide: torch.Tensor,
                dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            deep: ``[B, num_deep * dim]`` pooled deep lookups.
            wide: ``[B, num_wide * wide_output_dim]`` pooled wide lookups.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        b = dense.shape[0]
        w = self.wide_bias.expand(b, self.wide_output_dim)
        wide_dense = self.wide_dense
        wide_values = wide  # (read only with wide_dense, set below then)
        wide_dropout = self.wide_dropout
        if wide_dropout is not None:  # the wide group's lookups and dense columns together
            wide, wide_values = wide_dropout.over_pair(wide, dense[:, self.wide_dense_idx])
        elif wide_dense is not None:
            wide_values = dense[:, self.wide_dense_idx]
        if self.num_wide > 0:
            w = w + wide.reshape(b, self.num_wide, self.wide_output_dim).sum(dim=1)
        if wide_dense is not None:
            w = w + wide_dense(wide_values)
        parts: list[torch.Tensor] = []
        fm = torch.zeros(0)
        emb = deep
        sequences = self.sequences
        if sequences is not None:
            emb = sequences(torch.cat([deep, dense[:, self.sequence_length_idx]], dim=1))
        projection = self.projection
        if projection is not None:
            proj = projection(dense[:, self.projected_idx])
            emb = proj if emb.shape[1] == 0 else torch.cat([emb, proj], dim=1)
        vectors = self.num_deep + self.num_sequences + self.num_projected
        if vectors > 0:
            parts.append(emb)
        if self.has_deep_dense:
            if self.all_deep_dense:
                parts.append(dense)
            else:
                parts.append(dense[:, self.deep_dense_idx])
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        deep_dropout = self.deep_dropout
        if deep_dropout is not None:
            x = deep_dropout(x)
        if vectors > 0 and self.use_fm:  # (masked: the vectors lead x)
            vecs = emb if deep_dropout is None else x[:, : vectors * self.dim]
            fm = fm_term(vecs.reshape(b, vectors, self.dim))
        h = self.dnn(x)
        final_dnn = self.final_dnn
        final_out = self.final_out
        if final_dnn is not None and final_out is not None:
            cat = [w]
            if self.use_fm:
                cat.append(fm)
            cat.append(h)
            out = final_out(final_dnn(torch.cat(cat, dim=1)))
            if self.num_class > 1:
                return out
            logit = out.squeeze(1)
            if self.wide_to_logit:  # the first-order path around the final DNN
                logit = logit + w.sum(dim=1)
            fm_logit_weight = self.fm_logit_weight
            if fm_logit_weight is not None:  # FM's sum around it, through a learned weight
                logit = logit + (self.fm_logit_rate * fm_logit_weight) * fm.sum(dim=1)
            return logit
        deep_out = self.deep_out
        assert deep_out is not None
        if self.num_class > 1:  # [B, C]: the wide part is C wide (wide_output_dim)
            logits = deep_out(h) + w
            if self.use_fm:
                logits = logits + fm.sum(dim=1, keepdim=True)
            return logits
        logit = deep_out(h).squeeze(1) + w.sum(dim=1)
        if self.use_fm:
            logit = logit + fm.sum(dim=1)
        return logit


@dataclass(frozen=True)
class DeepFMRegularization:
    """Weights of DeepFM's regularization terms (module docstring).

    Attributes:
        l2: on the squared dense Linear kernels.
        embedding: on the pooled deep vectors.
        wide: on the pooled wide vectors.
    """

    l2: float
    embedding: float
    wide: float

    @classmethod
    def from_config(cls, model_config: pipeline_pb2.EasyRecModel) -> "DeepFMRegularization":
        """The weights an ``EasyRecModel`` config asks for.

        Args:
            model_config: the model config (its ``deepfm`` or ``wide_and_deep`` and
                ``embedding_regularization``).

        Returns:
            The weights.
        """
        _field, cfg = model_settings(model_config)
        dense_reg = getattr(cfg, "dense_regularization", 0.0)
        wide_reg = getattr(cfg, "wide_regularization", 0.0)
        return cls(
            l2=float(cfg.l2_regularization or dense_reg),
            embedding=float(model_config.embedding_regularization),
            wide=float(wide_reg or model_config.embedding_regularization),
        )


def deepfm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    deep: torch.Tensor,
    wide: torch.Tensor,
    dense: DeepFMDense,
    weights: DeepFMRegularization,
    terms: list[pipeline_pb2.Loss],
    learned: list[bool] | None = None,
    deep_lookups: int | None = None,
    term_weights: torch.Tensor | None = None,
    softmax: bool = False,
    sessions: torch.Tensor | None = None,
    data_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prediction loss plus DeepFM's regularization (module docstring).

    Args:
        logits: ``[B]`` logits of ``dense`` on ``deep``, ``wide``.
        labels: ``[B]`` float labels.
        deep: the step's pooled deep lookups ``[B, num_deep * dim]``.
        wide: the step's pooled wide lookups ``[B, num_wide * wide_output_dim]``.
        dense: the dense part (its Linear kernels and the lookup counts).
        weights: the regularization weights.
        terms: the configured loss terms (``odl.models.ctr_losses.loss_terms``).
        learned: per term, whether its weight is learned (``dense.loss_uncertainty``).
        deep_lookups: lookups in ``deep`` per sample (sequence positions included);
            None: ``dense.num_deep``.
        term_weights: the terms' weights of this step (the ``Random`` strategy), or None.
        softmax: a ``num_class`` model's ``[B, C]`` logits (softmax cross entropy).
        sessions: the batch's session keys (JRC_LOSS), or None.
        data_weights: the batch's ``data_config.sample_weight`` values, or None.

    Returns:
        Scalar loss.
    """
    loss = ctr_loss(logits, labels, terms, learned=learned,
                    uncertainty=getattr(dense, "loss_uncertainty", None),
                    term_weights=term_weights, softmax=softmax, sessions=sessions,
                    data_weights=data_weights)
    if weights.l2:
        loss = loss + weights.l2 * linear_kernel_l2(dense)
    deep_lookups = dense.num_deep if deep_lookups is None else deep_lookups
    if weights.embedding and deep_lookups:
        loss = loss + weights.embedding * embedding_l2(deep, deep_lookups)
    if weights.wide and dense.num_wide:
        loss = loss + weights.wide * embedding_l2(wide, dense.num_wide)
    return loss


class DeepFM(CtrModel):
    """DeepFM (or WideAndDeep) over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        layout: table layout (deep and wide lookups).
        dense_features: names of ``Batch.dense`` columns, in order.
        deep_dense: dense features in the deep group.
        wide_dense: dense features in a wide group.
        model_config: the ``EasyRecModel`` (DeepFM / WideAndDeep settings, regularization).
        output_name: the name of the model's one output (the label it predicts).
        ebc_device: device of the tables (``meta``: materialized by DMP).
        projected: the deep group's projected raw features' ``Batch.dense`` columns.
        projected_dim: their ``embedding_dim`` (the deep lookups' dim).
        projected_widths: columns per projected feature (default: 1 each).
        sequences: the deep groups' sequence blocks, looked up after the other lookups.
        deep_features: the deep groups' embedded features (a block's key may be one too).
        use_fm: add the FM term (DeepFM); false: WideAndDeep.

    Raises:
        ValueError: nothing feeds the deep tower, or an unsupported DNN setting.
    """

    LOGITS_ONLY_IN_CTR_LOSS = True
    ADDED_PARAMETERS = ("dense.fm_logit_weight",)

    def __init__(
        self,
        layout: EmbeddingLayout,
        dense_features: Sequence[str],
        deep_dense: Sequence[str],
        wide_dense: Sequence[str],
        model_config: pipeline_pb2.EasyRecModel,
        output_name: str = "label",
        ebc_device: "torch.device | str" = "meta",
        projected: Sequence[str] = (),
        projected_dim: int = 0,
        sequences: Sequence[SequenceBlock] = (),
        deep_features: Sequence[str] = (),
        projected_widths: "Sequence[int] | None" = None,
        use_fm: bool = True,
    ) -> None:
        super().__init__()
        self.set_tables(layout, ebc_device)
        col = {n: i for i, n in enumerate(dense_features)}
        # the deep group: its other lookups, then each sequence block's
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        table_of = dict(layout.deep_keys)
        in_blocks = {k for b in sequences for k in b.lookups}
        wanted = set(deep_features)
        regular = [(f, t) for f, t in layout.deep_keys
                   if (f in wanted if wanted else f not in in_blocks)]
        deep_keys = regular + [(k, table_of[k]) for b in sequences for k in b.lookups]
        seqs = None
        if any(b.dense for b in sequences):
            raise ValueError("a deep group's target attention reads embedded keys and "
                             "sequences only (dense ones: the tower and multi-task models)")
        if sequences:
            seqs = GroupSequences.of_blocks(
                list(sequences), dim_of, sum(dim_of[f] for f, _t in deep_keys), len(sequences))
        _field, settings = model_settings(model_config)
        regular_dims = {dim_of[f] for f, _t in regular}
        self.dense = DeepFMDense(
            settings,
            num_deep=len(regular),
            dim=int(projected_dim) or (regular_dims.pop() if len(regular_dims) == 1 else 0),
            num_wide=len(layout.wide_keys),
            wide_output_dim=layout.wide_output_dim,
            deep_dense_idx=[col[n] for n in deep_dense],
            wide_dense_idx=[col[n] for n in wide_dense],
            num_dense=len(dense_features),
            use_fm=use_fm,
            deep_width=sum(dim_of[f] for f, _t in regular),
            projected_idx=[col[n] for n in projected],
            projected_widths=projected_widths,
            num_class=int(model_config.num_class),
            sequences=seqs,
            sequence_length_idx=[col[b.length_column] for b in sequences],
            variational_dropout=(model_config.variational_dropout
                                 if model_config.HasField("variational_dropout") else None),
            lookup_widths=[dim_of[f] for f, _t in regular],
        )
        self.pooled_layout = (
            PooledGroup.of("deep", tuple(deep_keys), [dim_of[f] for f, _t in deep_keys]),
            PooledGroup("wide", tuple(layout.wide_keys), layout.wide_output_dim),
        )
        self.set_configured_loss(model_config, output_name)
        self.regularization = DeepFMRegularization.from_config(model_config)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """``deepfm_loss`` of the step's logits and pooled lookups.

        Args:
            output: ``forward(batch)``'s result.
            batch: the batch (labels).

        Returns:
            Scalar loss.
        """
        deep, wide = output.pooled
        loss = deepfm_loss(output.logits, batch.labels, deep, wide, self.dense,
                           self.regularization, self.loss_terms, self.learned,
                           deep_lookups=len(self.pooled_layout[0].lookups),
                           term_weights=random_loss_weights(self.model_config,
                                                            len(self.loss_terms),
                                                            output.logits),
                           softmax=self.dense.num_class > 1,
                           sessions=session_tensor(batch),
                           data_weights=sample_weight_tensor(batch))
        if self.model_config.HasField("variational_dropout"):
            loss = loss + variational_dropout_loss(list(self.dense.modules()),
                                                   output.logits.shape[0])
        return loss


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
           use_fm: bool) -> DeepFM:
    """DeepFM (``use_fm``) or WideAndDeep over the "deep" and "wide" groups."""
    mc = config.model_config
    labels = list(config.data_config.label_fields) or ["label"]
    groups = model_groups(mc, feature_builder)
    field, settings = model_settings(mc)
    wide_dim = int(settings.wide_output_dim) or 1
    if not use_fm and not settings.HasField("final_dnn") and wide_dim != max(mc.num_class, 1):
        # EasyRec's WideAndDeep sums the wide part and the deep logits without final_dnn,
        # its wide part then num_class wide whatever wide_output_dim says
        logger.warning("model_config.%s.wide_output_dim: %d is not used without final_dnn; "
                       "the wide part is num_class (%d) wide, as in EasyRec", field, wide_dim,
                       max(mc.num_class, 1))
        wide_dim = max(mc.num_class, 1)
    try:
        blocks = [b for g in mc.feature_groups if g.wide_deep == pipeline_pb2.DEEP
                  for b in sequence_blocks(config, feature_builder).get(g.group_name, [])]
        positions = [k for b in blocks for k in b.lookups if k not in groups["deep_sparse"]]
        layout = build_embedding_layout(
            feature_builder.table_specs, groups["deep_sparse"] + positions, groups["wide_sparse"],
            wide_dim, mixed_dims=not use_fm)
    except ValueError as e:
        raise ConfigError("model_config.feature_groups", str(e)) from e
    if not settings.dnn.hidden_units:
        raise ConfigError(f"model_config.{field}.dnn.hidden_units",
                          "at least one layer is needed")
    # EasyRec's projected raw features (embedding_dim, no boundaries) in the deep group
    dims = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)}
    projected = [f for f in groups["deep_dense"] if dims.get(f, 0) > 0]
    deep_dense = [f for f in groups["deep_dense"] if f not in projected]
    widths = {f: len(c) for f, c in feature_builder.dense_feature_columns.items()}
    try:
        return DeepFM(layout, feature_builder.dense_feature_names,
                      dense_columns(feature_builder, deep_dense),
                      dense_columns(feature_builder, groups["wide_dense"]), mc,
                      output_name=labels[0], projected=dense_columns(feature_builder, projected),
                      projected_dim=dims[projected[0]] if projected else 0,
                      projected_widths=[widths[f] for f in projected],
                      sequences=blocks, deep_features=groups["deep_sparse"], use_fm=use_fm)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e


def _validate(check: ModelCheck, use_fm: bool) -> None:
    """The "wide" and "deep" groups, the towers, the wide width; FM's one embedding dim."""
    mc, groups, features = check.config.model_config, check.groups, check.features
    d, where = check.settings, check.where()
    for required in ("wide", "deep"):
        if required not in groups:
            raise ConfigError("model_config.feature_groups",
                              f'{check.model_class} needs a feature group named "{required}"')
    for i, g in enumerate(mc.feature_groups):
        for j, name in enumerate(g.feature_names):
            if (g.wide_deep != pipeline_pb2.DEEP
                    and features[name].feature_type == pipeline_pb2.FeatureConfig.SequenceFeature):
                raise ConfigError(f"model_config.feature_groups[{i}].feature_names[{j}]",
                                  f"SequenceFeature {name!r}: sequences are combined in DEEP "
                                  "groups (not in a wide part)")
    if not mc.HasField(check.field):
        raise ConfigError(where, f"{check.model_class} needs {check.field} "
                                 "{ dnn { hidden_units } }")
    validate_dnn(d.dnn, f"{where}.dnn", required=True)
    if d.HasField("final_dnn"):
        validate_dnn(d.final_dnn, f"{where}.final_dnn", required=True)
    if d.wide_output_dim <= 0:
        raise ConfigError(f"{where}.wide_output_dim", "must be > 0")
    if d.wide_output_dim > limits.MAX_WIDE_OUTPUT_DIM:
        raise ConfigError(f"{where}.wide_output_dim", f"{d.wide_output_dim} is above the "
                                                      f"limit of {limits.MAX_WIDE_OUTPUT_DIM}")
    if use_fm and not d.HasField("final_dnn") and d.wide_output_dim != mc.num_class:
        # (WideAndDeep then makes its wide part num_class wide, as EasyRec does: _build)
        raise ConfigError(f"{where}.wide_output_dim",
                          "without final_dnn the wide and deep outputs are summed, so "
                          f"wide_output_dim must equal num_class ({mc.num_class})")
    for name in ("l2_regularization", "wide_regularization", "dense_regularization"):
        if name in d.DESCRIPTOR.fields_by_name and getattr(d, name) < 0:
            raise ConfigError(f"{where}.{name}", "must be >= 0")
    deep_gi = groups["deep"]
    projected = {n: features[n].embedding_dim for n in mc.feature_groups[deep_gi].feature_names
                 if projected_raw(features[n])}
    if len(set(projected.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(projected.items())[:6])
        raise ConfigError(f"model_config.feature_groups[{deep_gi}].feature_names",
                          f"the deep group's projected raw features need one embedding_dim; "
                          f"got {shown}")
    if use_fm:  # FM takes inner products of the group's embeddings: one dim
        check_fm_group(check, "fm" if "fm" in groups else "deep")
    if mc.HasField("variational_dropout") and use_fm and "fm" in groups:
        raise ConfigError("model_config.variational_dropout",
                          'variational dropout with an "fm" group is not implemented (the '
                          "wide and deep groups only)")
    check_dropout_group(mc, mc.feature_groups[deep_gi], features)


def check_fm_group(check: ModelCheck, group: str) -> None:
    """The FM term's group: at least one embedded feature, all of one width.

    Args:
        check: the model being checked.
        group: the group the FM term reads.

    Raises:
        ConfigError: naming the group's ``feature_names``.
    """
    features = check.features
    gi = check.groups[group]
    dims = {n: (sequence_combiner_width(features[n])
                if features[n].feature_type == pipeline_pb2.FeatureConfig.SequenceFeature
                else features[n].embedding_dim)
            for n in check.config.model_config.feature_groups[gi].feature_names
            if embedded_feature(features[n]) or projected_raw(features[n])}
    where = f"model_config.feature_groups[{gi}].feature_names"
    if not dims:
        raise ConfigError(where, f'the "{group}" group needs at least one embedded feature '
                                 "for FM")
    if len(set(dims.values())) > 1:
        shown = ", ".join(f"{n}={v}" for n, v in list(dims.items())[:6])
        raise ConfigError(where, f'FM needs every embedded feature of the "{group}" group to '
                                 f"have the same embedding_dim; got {shown}"
                                 f"{', ...' if len(dims) > 6 else ''}")


register_model(ModelClass(
    "DeepFM", lambda config, fb: _build(config, fb, use_fm=True),
    lambda check: _validate(check, use_fm=True), projected_raw=True, variational_dropout=True))
register_model(ModelClass(
    "WideAndDeep", lambda config, fb: _build(config, fb, use_fm=False),
    lambda check: _validate(check, use_fm=False), group_attention="deep",
    attention_dense_parts=False, projected_raw=True, variational_dropout=True))
