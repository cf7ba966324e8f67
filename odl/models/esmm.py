"""EasyRec's ESMM (``model_class: "ESMM"``, settings ``esmm {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. Entire Space Multi-task Model: a CVR tower and a
CTR tower over shared embeddings. The towers' input ``x`` is, with ``esmm.groups``, each
group's DNN over its features (pooled embeddings, then dense features; a group's sequences
combined as in the other models, ``GroupSequences``), concatenated in ``groups`` order;
without it, the "all" group (or the model's only group) itself::

    logit_cvr = Linear(cvr_tower.dnn(x) -> 1)        (y_cvr with loss_type L2_LOSS)
    logit_ctr = Linear(ctr_tower.dnn(x) -> 1)
    pCTCVR    = sigmoid(logit_cvr) * sigmoid(logit_ctr)          (y_cvr * pCTR for L2_LOSS)

Outputs, EasyRec's order and names (``probs_<tower>``, ``probs_ctcvr``): the CVR tower's
``tower_name``, the CTR tower's, then ``ctcvr`` (the settings message's ``product_output``),
logits ``[B, 3]``; the third column is the logit of pCTCVR,
``log p - log(1 - p)`` with ``log p = logsigmoid(logit_cvr) + logsigmoid(logit_ctr)`` (for
L2_LOSS: the value ``y_cvr * pCTR`` itself, a regression output). The CVR and CTR outputs are
scored on their own labels; the CTCVR output on the CVR tower's label (click and conversion
when a conversion implies a click, as in EasyRec's samples).

Loss (EasyRec's ``esmm.py``), over every sample of the batch::

    ctr_tower.weight * sum_i BCE(logit_ctr_i, click_i)
  + cvr_tower.weight * sum_i BCE(pCTCVR_i, click_i * conversion_i)     (CLASSIFICATION)
  | cvr_tower.weight * mean_i (y_ctcvr_i - click_i * conversion_i)**2  (L2_LOSS)
  + l2_regularization * the squared dense Linear kernels
  + embedding_regularization * mean over (sample, lookup) of the squared pooled embedding

(sums, not means, as EasyRec's ``reduce_sum``). The click label is the CTR tower's label, the
conversion label the CVR tower's.

Parameter names: ``dense.groups.<g>.*`` (a group's DNN; with sequences ``0.*`` their blocks,
``1.*`` the DNN; with ``model_config.variational_dropout`` ``0.logit_p`` its probabilities,
``1.*`` the DNN), ``dense.heads.<t>.dnn.*``, ``dense.heads.<t>.out.*`` (t = 0: CVR, 1: CTR).

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn
from torch.nn import functional

from odl.config.config_error import ConfigError
from odl.config.loss_settings import sample_weight_field
from odl.config.model_classes import product_output, task_label_names, task_towers
from odl.config.model_validation import check_dropout_group, validate_dnn
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_optional_mlp
from odl.models.ctr_losses import linear_kernel_l2
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.feature_dropout import FeatureDropout, variational_dropout_loss
from odl.models.group_inputs import all_group, embedded_and_dense, sequence_blocks
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.multi_task_models import TaskHead
from odl.models.sequence_layers import GroupSequences, SequenceBlock
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)

def product_logit(logit_a: torch.Tensor, logit_b: torch.Tensor) -> torch.Tensor:
    """The logit of ``sigmoid(logit_a) * sigmoid(logit_b)``, computed in log space.

    ``log p`` is kept below -1e-30, so the logit stays finite (about 69 at most).
    """
    log_p = torch.clamp(functional.logsigmoid(logit_a) + functional.logsigmoid(logit_b),
                        max=-1e-30)
    # log(1 - p) = log1mexp(log p): two forms, each accurate on its side of -ln 2
    log_not_p = torch.where(log_p > -0.6931471805599453, torch.log(-torch.expm1(log_p)),
                            torch.log1p(-torch.exp(log_p)))
    return log_p - log_not_p


class ESMMDense(nn.Module):
    """The groups' DNNs, the two towers and pCTCVR (module docstring); scriptable.

    Args:
        groups: per input group ``(width of its lookups, its dense columns, its DNN or
            None)``, in order (one group without a DNN: the towers read it itself).
        towers: the CVR tower's DNN, then the CTR tower's (None: no hidden layer).
        cvr_regression: the CVR tower is a regression (``L2_LOSS``).
        sequences: per group, the ``GroupSequences`` combining its sequences (their lookups
            end its lookups, their lengths end its dense columns), or None.
        dropouts: per group, its ``FeatureDropout`` (``model_config.variational_dropout``,
            applied to the group's input before its DNN) or None.

    Raises:
        ValueError: a group with no input.
    """

    __constants__ = ["cvr_regression"]
    group_cols: list[int]
    group_dense: list[list[int]]

    def __init__(self, groups: Sequence[tuple[int, Sequence[int], Optional[pipeline_pb2.DNN]]],
                 towers: Sequence[Optional[pipeline_pb2.DNN]], cvr_regression: bool,
                 sequences: "Sequence[GroupSequences | None] | None" = None,
                 dropouts: "Sequence[FeatureDropout | None] | None" = None) -> None:
        super().__init__()
        self.cvr_regression = bool(cvr_regression)
        self.group_cols = [0]
        self.group_dense = []
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        self.groups = nn.ModuleList()
        width = 0
        for i, (lookup_width, dense_cols, dnn) in enumerate(groups):
            in_width = int(lookup_width) + len(dense_cols)
            if in_width == 0:
                raise ValueError(f"feature group {i} of the model reads no feature")
            self.group_cols.append(self.group_cols[-1] + int(lookup_width))
            self.group_dense.append([int(c) for c in dense_cols])
            seqs = sequences[i] if sequences else None
            if seqs is not None:
                in_width = seqs.out_width
            mlp, out = build_optional_mlp(in_width, dnn)
            dropout = dropouts[i] if dropouts else None
            if seqs is not None:
                self.groups.append(nn.Sequential(seqs, mlp))
            elif dropout is not None:  # the group's input, before its DNN
                self.groups.append(nn.Sequential(dropout, mlp))
            else:
                self.groups.append(mlp)
            width += out
        self.heads = nn.ModuleList(TaskHead(width, dnn, [], 0, None) for dnn in towers)

    def forward(self, groups: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 3]``: CVR, CTR, CTCVR.

        Args:
            groups: ``[B, lookups]`` every group's pooled lookups, group after group.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits (the CTCVR column a value for a regression CVR tower).
        """
        outs: list[torch.Tensor] = []
        for i, group in enumerate(self.groups):
            parts: list[torch.Tensor] = []
            start = self.group_cols[i]
            end = self.group_cols[i + 1]
            if end > start:
                parts.append(groups[:, start:end])
            cols = self.group_dense[i]
            if len(cols) > 0:
                parts.append(dense[:, cols])
            x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            outs.append(group(x))
        x = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        logits: list[torch.Tensor] = []
        for head in self.heads:
            logits.append(head.out(head.relation_dnn(head.dnn(x))).squeeze(1))
        cvr, ctr = logits[0], logits[1]
        if self.cvr_regression:
            ctcvr = cvr * torch.sigmoid(ctr)
        else:
            ctcvr = product_logit(cvr, ctr)
        return torch.stack([cvr, ctr, ctcvr], dim=1)


class ESMMModel(CtrModel):
    """ESMM over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        layout: table layout (every embedded feature of the input groups, as deep lookups).
        dense_features: names of ``Batch.dense`` columns, in order.
        groups: per input group ``(name, embedded features, dense features, DNN or None)``.
        model_config: the ``EasyRecModel`` (``esmm``).
        label_columns: the ``Batch.labels`` columns of the CVR and the CTR tower's labels.
        sequences: feature group -> its sequence blocks (their lookups end the group's
            embedded features, their length columns its dense features).
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ValueError: a group reads nothing.
    """

    def __init__(
        self,
        layout: EmbeddingLayout,
        dense_features: Sequence[str],
        groups: Sequence[tuple[str, list[str], list[str], Optional[pipeline_pb2.DNN]]],
        model_config: pipeline_pb2.EasyRecModel,
        label_columns: tuple[int, int],
        sequences: "dict[str, list[SequenceBlock]] | None" = None,
        ebc_device: "torch.device | str" = "meta",
    ) -> None:
        super().__init__()
        self.set_tables(layout, ebc_device)
        settings = model_config.esmm
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        col = {n: i for i, n in enumerate(dense_features)}
        lookups: list[tuple[str, str]] = []
        specs = []
        seq_mods: list[GroupSequences | None] = []
        drops: list[FeatureDropout | None] = []
        for name, embedded, dense, dnn in groups:
            lookups += [(f, table_of[f]) for f in embedded]
            width = sum(dim_of[f] for f in embedded)
            specs.append((width, [col[n] for n in dense], dnn))
            blocks = (sequences or {}).get(name, [])
            seq_mods.append(GroupSequences.of_blocks(blocks, dim_of, width, len(dense))
                            if blocks else None)
            drops.append(FeatureDropout([dim_of[f] for f in embedded] + [1] * len(dense),
                                        model_config.variational_dropout)
                         if model_config.HasField("variational_dropout") else None)
        towers = (settings.cvr_tower, settings.ctr_tower)
        self.cvr_regression = settings.cvr_tower.loss_type == pipeline_pb2.L2_LOSS
        self.dense = ESMMDense(specs, [t.dnn if t.HasField("dnn") else None for t in towers],
                               self.cvr_regression, seq_mods, drops)
        self.variational_dropout = any(d is not None for d in drops)
        self.pooled_layout = (PooledGroup.of("groups", tuple(lookups),
                                             [dim_of[f] for f, _t in lookups]),)
        self.output_names = (towers[0].tower_name, towers[1].tower_name,
                             product_output(model_config))
        cvr_col, ctr_col = (int(c) for c in label_columns)
        self.output_labels = (cvr_col, ctr_col, cvr_col)
        self.tower_weights = (float(towers[0].weight), float(towers[1].weight))
        self.l2 = float(settings.l2_regularization)
        self.embedding_regularization = float(model_config.embedding_regularization)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The CTR and CTCVR losses plus the regularization terms (module docstring).

        Args:
            output: ``forward(batch)``'s result.
            batch: the batch (labels ``[B, label columns]``).

        Returns:
            Scalar loss.
        """
        logits = output.logits
        labels = batch.labels if batch.labels.dim() == 2 else batch.labels.unsqueeze(1)
        labels = labels.to(logits.dtype)
        cvr_col, ctr_col, _ = self.output_labels
        click = labels[:, ctr_col]
        ctcvr_label = click * labels[:, cvr_col]
        w_cvr, w_ctr = self.tower_weights
        loss = w_ctr * functional.binary_cross_entropy_with_logits(logits[:, 1], click,
                                                                    reduction="sum")
        if self.cvr_regression:
            loss = loss + w_cvr * (logits[:, 2] - ctcvr_label).square().mean()
        else:
            loss = loss + w_cvr * functional.binary_cross_entropy_with_logits(
                logits[:, 2], ctcvr_label, reduction="sum")
        if self.l2:
            loss = loss + self.l2 * linear_kernel_l2(self.dense)
        if self.variational_dropout:
            loss = loss + variational_dropout_loss(list(self.dense.modules()), logits.shape[0])
        return self.add_regularization(loss, output, 0.0)


def _input_groups(mc: pipeline_pb2.EasyRecModel
                  ) -> list[tuple[str, Optional[pipeline_pb2.DNN]]]:
    """``(feature group, DNN or None)`` per input group: ``esmm.groups``, or the one group."""
    if mc.esmm.groups:
        return [(g.input, g.dnn if g.HasField("dnn") else None) for g in mc.esmm.groups]
    return [(all_group(mc), None)]


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> ESMMModel:
    """ESMM over its input groups; the towers' label columns."""
    mc = config.model_config
    label_fields = list(config.data_config.label_fields) or ["label"]
    sequences = sequence_blocks(config, feature_builder)
    features = embedded_and_dense(mc, feature_builder, sequences)
    groups = [(name, *features[name], dnn) for name, dnn in _input_groups(mc)]
    embedded: list[str] = []
    for _name, emb, _dense, _dnn in groups:
        embedded += [f for f in emb if f not in embedded]
    cvr_label, ctr_label = task_label_names(mc, label_fields)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, embedded, [], 1,
                                        mixed_dims=True)
        return ESMMModel(layout, feature_builder.dense_feature_names, groups, mc,
                         (label_fields.index(cvr_label), label_fields.index(ctr_label)),
                         sequences)
    except ValueError as e:
        raise ConfigError("model_config.esmm", str(e)) from e


def _validate_tower(check: ModelCheck, name: str, loss_types: tuple[int, ...]) -> str:
    """One tower's settings; returns its label."""
    where = check.where(name)
    config = check.config
    if not check.settings.HasField(name):
        raise ConfigError(where, 'required (e.g. { tower_name: "ctr" dnn { hidden_units: '
                                 "[64] } })")
    tower = getattr(check.settings, name)
    if not tower.tower_name:
        raise ConfigError(f"{where}.tower_name", "required (the tower's output name)")
    if tower.num_class != 1:
        raise ConfigError(f"{where}.num_class",
                          f"num_class {tower.num_class} is an EasyRec value that ESMM does not "
                          "take (only 1)")
    if tower.loss_type not in loss_types:
        names = " or ".join(pipeline_pb2.LossType.Name(k) for k in loss_types)
        raise ConfigError(f"{where}.loss_type", f"ESMM's {name} trains {names}, not "
                                                f"{pipeline_pb2.LossType.Name(tower.loss_type)}")
    for field in ("losses", "relation_tower_names"):
        if getattr(tower, field):
            raise ConfigError(f"{where}.{field}", "not implemented for ESMM (EasyRec's ESMM "
                                                  "reads loss_type and weight)")
    for field in ("relation_dnn", "task_space_indicator_label"):
        if tower.HasField(field):
            raise ConfigError(f"{where}.{field}", "not implemented for ESMM (it trains both "
                                                  "towers on every sample)")
    if tower.weight < 0:
        raise ConfigError(f"{where}.weight", "must be >= 0")
    if tower.HasField("dnn"):
        validate_dnn(tower.dnn, f"{where}.dnn", required=False)
    label_fields = list(config.data_config.label_fields)
    index = [path for path, _t in task_towers(config.model_config)].index(where)
    label = task_label_names(config.model_config, label_fields)[index]
    if label not in label_fields:
        raise ConfigError(f"{where}.label_name",
                          f"{label or 'no label'!r} is not one of data_config.label_fields "
                          f"{label_fields}")
    return label


def _validate(check: ModelCheck) -> None:
    """The input groups, the two towers and their labels, the loss settings."""
    mc, settings = check.config.model_config, check.settings
    where = check.where()
    if not mc.HasField("esmm"):
        raise ConfigError(where, "ESMM needs esmm { cvr_tower { ... } ctr_tower { ... } }")
    if not settings.groups and "all" not in check.groups and len(check.groups) != 1:
        raise ConfigError("model_config.feature_groups",
                          'ESMM without esmm.groups reads the feature group named "all" (or '
                          f"the only group); groups are {sorted(check.groups)}")
    for i, g in enumerate(settings.groups):
        if g.input not in check.groups:
            raise ConfigError(f"{where}.groups[{i}].input",
                              f"no feature group named {g.input!r} (groups: "
                              f"{sorted(check.groups)})")
        if g.HasField("dnn"):
            validate_dnn(g.dnn, f"{where}.groups[{i}].dnn", required=False)
    labels = [_validate_tower(check, "cvr_tower", (pipeline_pb2.CLASSIFICATION,
                                                   pipeline_pb2.L2_LOSS)),
              _validate_tower(check, "ctr_tower", (pipeline_pb2.CLASSIFICATION,))]
    names = [settings.cvr_tower.tower_name, settings.ctr_tower.tower_name,
             product_output(mc)]
    if len(set(names)) != 3:
        raise ConfigError(f"{where}.ctr_tower.tower_name",
                          f"the outputs {names} need different names")
    if labels[0] == labels[1]:
        raise ConfigError(f"{where}.cvr_tower.label_name",
                          f"the towers read one label ({labels[0]!r}); ESMM trains the CVR "
                          "tower on the conversion label, the CTR tower on the click label")
    unused = [lf for lf in check.config.data_config.label_fields if lf not in labels]
    if unused:
        raise ConfigError("data_config.label_fields",
                          f"label fields {unused} are not trained by any tower")
    if settings.l2_regularization < 0:
        raise ConfigError(f"{where}.l2_regularization", "must be >= 0")
    if mc.loss_weight_strategy != pipeline_pb2.EasyRecModel.Fixed:
        strategy = pipeline_pb2.EasyRecModel.LossWeightStrategy.Name(mc.loss_weight_strategy)
        raise ConfigError("model_config.loss_weight_strategy",
                          f"ESMM weighs its losses by the towers' weight (Fixed); {strategy} is "
                          "not implemented for it")
    if sample_weight_field(check.config):
        raise ConfigError("data_config.sample_weight", "not implemented for ESMM (EasyRec's "
                                                       "ESMM does not weigh its losses by it)")
    for name, _dnn in _input_groups(mc):
        check_dropout_group(mc, mc.feature_groups[check.groups[name]], check.features)


register_model(ModelClass("ESMM", _build, _validate, group_attention="all",
                          variational_dropout=True))
