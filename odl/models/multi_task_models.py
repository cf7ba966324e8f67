"""EasyRec's MMoE, DBMTL and SimpleMultiTask as ``CtrModel``s (``odl.models.ctr_model``).

All read one feature group (``"all"``, or the model's only group; DBMTL with
``bottom_uniter`` or ``bottom_cmbf`` reads the image / general / text / other groups instead
(``odl.models.multimodal_inputs``), its bottom ``odl.models.uniter`` / ``odl.models.cmbf``):
the pooled embeddings of its embedded features, then its dense (raw) features, ``x``; the
group's sequences (a SequenceFeature with a ``sequence_combiner``, a target attention or
pooling of its ``sequence_features`` / TorchEasyRec's ``sequence_encoders``) each become
one vector in ``x`` (``GroupSequences``). Per task ``t`` (``task_towers`` in order)::

    h       = bottom_dnn(x)                       DBMTL with bottom_dnn; else h = x
    in_t    = sum_e gate_t(h)_e * expert_e(h)     with expert_dnn (MMoE always); else in_t = h
                                                  (SimpleMultiTask: in_t = x)
    in_t    = mixture(h)_t                        a model's own mixture (PLE's extraction
                                                  networks, odl.models.ple) instead
    tower_t = dnn_t(in_t)                          (no dnn: in_t)
    rel_t   = relation_dnn_t(concat(tower_t, rel_r for r in relation_tower_names_t))
    logit_t = Linear(rel_t -> 1, or 2)            (DBMTL; MMoE: rel_t = tower_t)

The blocks are those of ``odl.models.building_blocks`` and
``odl.models.sequence_layers``. A relation names an earlier task (it
reads that task's ``rel`` output), as in EasyRec's DBMTL.

Outputs: one logit per task, ``[B, T]`` (``[B]`` with one task), two for a task tower of
``num_class: 2`` (softmax cross entropy or JRC over its 0/1 label one-hot; its prediction
``softmax(pair)[1]``, ``odl.config.loss_settings.task_classes``), named by the tasks'
``tower_name`` (``model.output_names``); task ``t`` is trained on the label column
``model.output_labels[t]`` of ``Batch.labels`` (its ``label_name``, else the ``label_fields``
entry at its position; ``odl.config.model_classes.task_label_names``).

Loss: sum over tasks of ``weight_t`` * the task's prediction loss (``losses`` / ``loss_type``
of the task, ``odl.models.ctr_losses``) + ``l2_regularization`` * the squared dense Linear
kernels + ``embedding_regularization`` * mean over (sample, lookup) of the squared pooled
embedding. A task with a ``task_space_indicator_label`` weighs each sample's loss by
``in_task_space_weight`` when that label is > 0, else ``out_task_space_weight``, normalized
(``sum(w * loss) / sum(w)``, TorchEasyRec's weighting).

Parameter names: ``dense.bottom.*`` (with ``bottom_uniter``: ``dense.bottom.modalities.<i>.*``,
``dense.bottom.token_types``, ``dense.bottom.cls``, ``dense.bottom.layers.<l>.*``,
``dense.bottom.other.*``; with ``bottom_cmbf``: ``dense.bottom.image.*``,
``dense.bottom.image_layers.<l>.*``, ``dense.bottom.text.<i>.*``,
``dense.bottom.text_layers.<l>.*``, ``dense.bottom.token_types``, ``dense.bottom.cross.<l>.*``,
``dense.bottom.other.*``), ``dense.experts.experts.<e>.*``,
``dense.experts.gates.<t>.*``, ``dense.heads.<t>.dnn.*``, ``dense.heads.<t>.relation_dnn.*``,
``dense.heads.<t>.out.*``, ``dense.sequences.combiners.<i>.*`` (the group's sequence
blocks), ``dense.dropout.logit_p`` (MMoE's and DBMTL's ``model_config.variational_dropout``:
the group's input, its lookups, projected raw features and dense columns, masked by
``odl.models.feature_dropout`` before the bottom, as EasyRec's input layer does; with
sequences in the group ``dense.sequences.dropout.logit_p``: its other lookups, its
SequenceFeatures' combined vectors and its dense columns, the target attention's vectors
not masked, as EasyRec appends them after its input layer).

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.feature_configs import feature_configs, projected_group_dim
from odl.config.model_classes import model_settings
from odl.config.model_validation import check_dropout_group, validate_dnn
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import ExpertGates, RawProjection, build_optional_mlp
from odl.models.cmbf import CMBFBottom
from odl.models.ctr_losses import linear_kernel_l2
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import EmbeddingLayout, build_embedding_layout
from odl.models.feature_dropout import FeatureDropout, variational_dropout_loss
from odl.models.group_inputs import all_group, embedded_and_dense, sequence_blocks
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.multimodal_inputs import (
    check_multimodal_groups,
    multimodal_inputs,
    validate_multimodal_layer,
)
from odl.models.sequence_layers import (
    GroupSequences,
    SequenceBlock,
    SequencePool,
    TargetAttention,
)
from odl.models.task_losses import TaskLoss
from odl.models.task_towers import (
    TaskHead,
    task_head_settings,
    task_label_columns,
    validate_task_towers,
)
from odl.models.uniter import UniterBottom
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class MultiTaskDense(nn.Module):
    """The bottom, the experts and the task heads (module docstring); scriptable.

    Args:
        embedded_width: columns of the pooled ``all`` group.
        dense_idx: the group's columns of the raw dense features.
        bottom: DBMTL's ``bottom_dnn``, or None.
        experts: ``(one DNN per expert, gate_dnn or None)``, or None.
        tasks: per task ``(dnn or None, relation task indices, relation_dnn or None, logits)``
            (logits: 1, or 2 for a two-class task).
        sequences: the ``GroupSequences`` combining the group's sequences (their lookups end
            the pooled group, their lengths end ``dense_idx``), or None.
        projected_idx: the group's columns of EasyRec's projected raw features (a
            ``RawProjection`` makes each a ``projected_dim``-wide vector after the lookups).
        projected_widths: columns per projected feature.
        projected_dim: their ``embedding_dim``.
        mixture: instead of ``experts``, ``(input width, number of tasks) -> module`` mapping
            the bottom output to one input per task (a list), with ``out_width``; or None.
        dropout: the variational dropout of the group's input (its columns in order:
            lookups, projected features, dense columns), or None.
        bottom_module: a bottom reading the group's input instead of ``bottom`` (DBMTL's
            ``bottom_uniter`` / ``bottom_cmbf``), with ``out_width``; or None.

    Raises:
        ValueError: no input, no task, a bad expert setting, projected features beside
            sequences.
    """

    __constants__ = ["has_embedded", "has_dense", "num_tasks", "num_logits", "has_projected"]
    dense_idx: list[int]
    projected_idx: list[int]

    def __init__(self, embedded_width: int, dense_idx: Sequence[int],
                 bottom: Optional[pipeline_pb2.DNN],
                 experts: Optional[tuple[list[pipeline_pb2.DNN], Optional[pipeline_pb2.DNN]]],
                 tasks: Sequence[tuple[Optional[pipeline_pb2.DNN], Sequence[int],
                                       Optional[pipeline_pb2.DNN], int]],
                 sequences: Optional[GroupSequences] = None,
                 projected_idx: Sequence[int] = (), projected_widths: Sequence[int] = (),
                 projected_dim: int = 0,
                 mixture: Optional[Callable[[int, int], nn.Module]] = None,
                 dropout: Optional[FeatureDropout] = None,
                 bottom_module: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.dense_idx = [int(i) for i in dense_idx]
        self.projected_idx = [int(i) for i in projected_idx]
        self.has_embedded = int(embedded_width) > 0
        self.has_dense = len(self.dense_idx) > 0
        self.has_projected = len(self.projected_idx) > 0
        self.num_tasks = len(tasks)
        self.num_logits = sum(int(t[3]) for t in tasks)
        if self.has_projected and sequences is not None:
            raise ValueError("projected raw features and sequences in one group are not "
                             "implemented for the multi-task models")
        in_width = (int(embedded_width) + len(self.dense_idx)
                    + len(list(projected_widths)) * int(projected_dim))
        if in_width == 0:
            raise ValueError("the model's feature group has no feature")
        self.sequences = sequences
        if sequences is not None:
            in_width = sequences.out_width
        if not tasks:
            raise ValueError("at least one task tower is needed")
        # Registration order fixes the dense optimizer's parameter order in checkpoints.
        if bottom_module is not None:
            self.bottom, width = bottom_module, int(bottom_module.out_width)
        else:
            self.bottom, width = build_optional_mlp(in_width, bottom)
        self.experts: Optional[ExpertGates] = None
        if experts is not None:
            expert_dnns, gate_dnn = experts
            self.experts = ExpertGates(width, expert_dnns, len(tasks), gate_dnn)
            width = self.experts.out_width
        elif mixture is not None:
            self.experts = mixture(width, len(tasks))
            width = int(self.experts.out_width)
        heads: list[TaskHead] = []
        for dnn, relations, relation_dnn, num_class in tasks:
            rel_width = sum(heads[r].out_width for r in relations)
            heads.append(TaskHead(width, dnn, relations, rel_width, relation_dnn, num_class))
        self.heads = nn.ModuleList(heads)
        # registered last: the checkpoints' parameter order of models without it stays
        self.projection = (RawProjection(projected_widths, int(projected_dim))
                           if self.has_projected else None)
        self.dropout = dropout

    def forward(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_logits]``, task after task.

        A two-class task has two; ``[B]`` with one logit in all.

        Args:
            group: ``[B, lookups * dim]`` pooled lookups of the group.
            dense: ``[B, num_dense]`` raw dense features.

        Returns:
            The logits.
        """
        parts: list[torch.Tensor] = []
        if self.has_embedded:
            parts.append(group)
        projection = self.projection
        if projection is not None:
            parts.append(projection(dense[:, self.projected_idx]))
        if self.has_dense:
            parts.append(dense[:, self.dense_idx])
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        dropout = self.dropout
        if dropout is not None:
            x = dropout(x)
        sequences = self.sequences
        if sequences is not None:
            x = sequences(x)
        h = self.bottom(x)
        experts = self.experts
        if experts is not None:
            inputs = experts(h)
        else:
            inputs = [h for _ in range(self.num_tasks)]
        rel: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for i, head in enumerate(self.heads):
            r_out, logit = head(inputs[i], rel)
            rel.append(r_out)
            logits.append(logit)
        if self.num_logits == 1:
            return logits[0].squeeze(1)
        return torch.cat(logits, dim=1)


def _dnn(msg: object, name: str) -> Optional[pipeline_pb2.DNN]:
    return getattr(msg, name) if msg.HasField(name) else None  # type: ignore[attr-defined]


class TaskTowerModel(CtrModel):
    """MMoE or DBMTL over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        layout: table layout (the group's embedded features, as deep lookups).
        dense_features: names of ``Batch.dense`` columns, in order.
        group_dense: the group's dense features.
        model_config: the ``EasyRecModel`` (``mmoe`` or ``dbmtl``).
        label_columns: per task, its column of ``Batch.labels``.
        space_columns: per task, the ``Batch.labels`` column of its
            ``task_space_indicator_label``, or None.
        ebc_device: device of the tables (``meta``: materialized by DMP).
        regular: the group's embedded features (None: every deep lookup of ``layout``);
            with ``sequences``, the blocks' lookups follow them.
        sequences: the group's sequence blocks (their length columns end ``group_dense``).
        projected: the ``Batch.dense`` columns of each of the group's projected raw features
            (EasyRec's RawFeature with ``embedding_dim`` and no ``boundaries``), not in
            ``group_dense``.
        projected_dim: their ``embedding_dim``.
        mixture: the tasks' inputs from the shared input (``MultiTaskDense``'s), instead of
            the settings' experts.
        bottom_module: DBMTL's ``bottom_uniter`` / ``bottom_cmbf`` module, or None.

    Raises:
        ValueError: a relation names an unknown or later task, or a bad setting.
    """

    def __init__(
        self,
        layout: EmbeddingLayout,
        dense_features: Sequence[str],
        group_dense: Sequence[str],
        model_config: pipeline_pb2.EasyRecModel,
        label_columns: Sequence[int],
        space_columns: "Sequence[int | None] | None" = None,
        ebc_device: "torch.device | str" = "meta",
        regular: "Sequence[str] | None" = None,
        sequences: Sequence[SequenceBlock] = (),
        projected: Sequence[Sequence[str]] = (),
        projected_dim: int = 0,
        mixture: Optional[Callable[[int, int], nn.Module]] = None,
        bottom_module: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.set_tables(layout, ebc_device)
        col = {n: i for i, n in enumerate(dense_features)}
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        regular_lookups = (list(regular) if regular is not None
                           else [f for f, _t in layout.deep_keys])
        lookups = regular_lookups + [k for b in sequences for k in b.lookups]
        seqs = None
        if sequences:  # the blocks' lookups end the group, their lengths its dense columns
            seqs = GroupSequences.of_blocks(list(sequences), dim_of,
                                            sum(dim_of[f] for f in lookups), len(group_dense))
        field, settings = model_settings(model_config)
        names, tasks = task_head_settings(settings.task_towers)
        experts = None
        if field == "mmoe" or (field == "dbmtl" and settings.HasField("expert_dnn")):
            named = list(settings.experts) if field == "mmoe" else []
            experts = ([e.dnn for e in named] if named
                       else [settings.expert_dnn] * int(settings.num_expert),
                       _dnn(settings, "gate_mlp") if field == "mmoe" else None)
        bottom = _dnn(settings, "bottom_dnn") if field == "dbmtl" else None
        dropout = None
        if model_config.HasField("variational_dropout") and seqs is not None:
            # the group's features and its SequenceFeatures' combined vectors; the target
            # attention's vectors join after (EasyRec's input layer, then its attention)
            combined = [i for i, b in enumerate(sequences)
                        if not isinstance(b.module, (TargetAttention, SequencePool))]
            raw = len(group_dense) - sum(len(b.dense) + 1 for b in sequences)
            seqs.set_dropout(FeatureDropout(
                [dim_of[f] for f in regular_lookups]
                + [int(sequences[i].module.out_width) for i in combined] + [1] * raw,
                model_config.variational_dropout), combined)
        elif model_config.HasField("variational_dropout"):
            dropout = FeatureDropout([dim_of[f] for f in lookups]
                                     + [projected_dim] * len(projected) + [1] * len(group_dense),
                                     model_config.variational_dropout)
        self.variational_dropout = model_config.HasField("variational_dropout")
        self.dense = MultiTaskDense(sum(dim_of[f] for f in lookups),
                                    [col[n] for n in group_dense], bottom, experts, tasks, seqs,
                                    [col[c] for cols in projected for c in cols],
                                    [len(cols) for cols in projected], projected_dim,
                                    mixture=mixture, dropout=dropout,
                                    bottom_module=bottom_module)
        self.pooled_layout = (PooledGroup.of("all", tuple((f, table_of[f]) for f in lookups),
                                             [dim_of[f] for f in lookups]),)
        self.output_names = tuple(names)
        self.output_labels = tuple(int(c) for c in label_columns)
        self.task_loss = TaskLoss(model_config, list(settings.task_towers), label_columns,
                                  space_columns, self.dense)
        self.model_config = model_config
        self.l2 = float(settings.l2_regularization)
        self.embedding_regularization = float(model_config.embedding_regularization)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The weighted task losses plus the regularization terms (module docstring).

        Args:
            output: ``forward(batch)``'s result.
            batch: the batch (labels ``[B]`` or ``[B, label columns]``).

        Returns:
            Scalar loss.
        """
        logits = output.logits
        loss = self.task_loss(logits, batch, self.dense)
        if self.l2:
            loss = loss + self.l2 * linear_kernel_l2(self.dense)
        if self.variational_dropout:
            loss = loss + variational_dropout_loss(list(self.dense.modules()), logits.shape[0])
        return self.add_regularization(loss, output, 0.0)


def build_multi_task_model(
    config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
    mixture: Optional[Callable[[int, int], nn.Module]] = None,
) -> "TaskTowerModel":
    """A multi-task model over the "all" group (and its sequence blocks); each task's label.

    Args:
        config: the config (MMoE, DBMTL, or a class with its own ``mixture``).
        feature_builder: its feature builder.
        mixture: the tasks' inputs from the shared input (``MultiTaskDense``'s), or None.

    Returns:
        The model.

    Raises:
        ConfigError: a task's label is not a label field, or a bad setting.
    """
    mc = config.model_config
    field, settings = model_settings(mc)
    if field == "dbmtl" and multimodal_bottom(settings):
        return build_multimodal_dbmtl(config, feature_builder)
    sequences = sequence_blocks(config, feature_builder)
    group = all_group(mc)
    blocks = sequences.get(group, [])
    emb, raw = embedded_and_dense(mc, feature_builder, {group: blocks})[group]
    regular = emb[: len(emb) - sum(len(b.lookups) for b in blocks)]
    # EasyRec's projected raw features (embedding_dim, no boundaries): a vector each
    dims = {fc.feature_name: int(fc.embedding_dim) for fc in feature_configs(config)}
    projected = [f for f in raw if dims.get(f, 0) > 0]
    raw = [f for f in raw if f not in projected]
    columns_of = feature_builder.dense_feature_columns
    columns, spaces = task_label_columns(config)
    try:
        layout = build_embedding_layout(feature_builder.table_specs, list(dict.fromkeys(emb)),
                                        [], 1, mixed_dims=True)
        return TaskTowerModel(layout, feature_builder.dense_feature_names, raw, mc, columns,
                              spaces, regular=regular, sequences=blocks,
                              projected=[columns_of[f] for f in projected],
                              projected_dim=dims[projected[0]] if projected else 0,
                              mixture=mixture)
    except ValueError as e:
        raise ConfigError(f"model_config.{field}", str(e)) from e


def multimodal_bottom(settings: pipeline_pb2.DBMTL) -> str:
    """DBMTL's multimodal bottom, ``"bottom_uniter"`` or ``"bottom_cmbf"``; "" without one."""
    return next((n for n in ("bottom_cmbf", "bottom_uniter") if settings.HasField(n)), "")


def build_multimodal_dbmtl(config: pipeline_pb2.EasyRecConfig,
                           feature_builder: FeatureBuilder) -> "TaskTowerModel":
    """DBMTL with ``bottom_uniter`` or ``bottom_cmbf`` (``odl.models.multimodal_inputs``)."""
    mc = config.model_config
    name = multimodal_bottom(mc.dbmtl)
    lookups, columns, layout = multimodal_inputs(config, feature_builder)
    label_columns, spaces = task_label_columns(config)

    try:
        bottom = (CMBFBottom(mc.dbmtl.bottom_cmbf, layout) if name == "bottom_cmbf"
                  else UniterBottom(mc.dbmtl.bottom_uniter, layout))
        tables = build_embedding_layout(feature_builder.table_specs, lookups, [], 1,
                                        mixed_dims=True)
        return TaskTowerModel(tables, feature_builder.dense_feature_names, columns, mc,
                              label_columns, spaces, regular=lookups, bottom_module=bottom)
    except ValueError as e:
        raise ConfigError(f"model_config.dbmtl.{name}", str(e)) from e


def _validate_named_experts(settings: pipeline_pb2.MMoE, where: str) -> None:
    """EasyRec's ``experts``: each its own DNN, one output width, no ``expert_dnn`` beside."""
    if settings.HasField("expert_dnn") or settings.HasField("expert_mlp") or settings.num_expert:
        raise ConfigError(f"{where}.experts", "give experts or expert_dnn with num_expert, "
                                              "not both")
    if len(settings.experts) > limits.MAX_EXPERTS:
        raise ConfigError(f"{where}.experts", f"at most {limits.MAX_EXPERTS} experts")
    widths = []
    for i, expert in enumerate(settings.experts):
        validate_dnn(expert.dnn, f"{where}.experts[{i}].dnn", required=True)
        widths.append(int(expert.dnn.hidden_units[-1]))
    if len(set(widths)) > 1:
        raise ConfigError(f"{where}.experts", "the experts' last hidden_units must be equal "
                                              f"(the gates mix their outputs); got {widths}")


def validate_multi_task(check: ModelCheck) -> None:
    """The input group, the tasks and their labels and relations (every multi-task class's).

    Args:
        check: the model's check.

    Raises:
        ConfigError: naming the first offending field.
    """
    config, groups = check.config, check.groups
    mc = config.model_config
    field, settings = check.field, check.settings
    where = f"model_config.{field}"
    if not mc.HasField(field):
        raise ConfigError(where, f"{mc.model_class} needs {field} {{ ... task_towers {{ ... }} }}")
    if field == "dbmtl" and multimodal_bottom(settings):
        _validate_multimodal(check)
        return
    if "all" not in groups and len(groups) != 1:
        raise ConfigError("model_config.feature_groups",
                          f'{mc.model_class} reads the feature group named "all" (or the only '
                          f"group); groups are {sorted(groups)}")
    gi = groups[all_group(mc)]
    group = mc.feature_groups[gi]
    projected_group_dim(group, check.features, f"model_config.feature_groups[{gi}].feature_names",
                        "a multi-task group")
    if settings.l2_regularization < 0:
        raise ConfigError(f"{where}.l2_regularization", "must be >= 0")
    validate_task_towers(check, relations=field == "dbmtl")


def _validate_multimodal(check: ModelCheck) -> None:
    """DBMTL's ``bottom_uniter`` / ``bottom_cmbf``: its groups, its settings, the tasks."""
    mc, settings = check.config.model_config, check.settings
    name = multimodal_bottom(settings)
    where = f"model_config.dbmtl.{name}"
    check_multimodal_groups(check.groups, name)
    if settings.HasField("bottom_cmbf") and settings.HasField("bottom_uniter"):
        raise ConfigError("model_config.dbmtl.bottom_uniter", "give bottom_cmbf or "
                                                              "bottom_uniter, not both")
    validate_multimodal_layer(getattr(settings, name), where)
    for dnn in ("bottom_dnn", "bottom_mlp"):
        if settings.HasField(dnn):  # EasyRec's DBMTL reads one bottom
            logger.warning("model_config.dbmtl.%s has no effect beside %s (EasyRec reads that "
                           "bottom instead)", dnn, name)
    if mc.HasField("variational_dropout"):
        raise ConfigError("model_config.variational_dropout",
                          f"variational dropout of {name}'s groups is not implemented")
    if settings.l2_regularization < 0:
        raise ConfigError("model_config.dbmtl.l2_regularization", "must be >= 0")
    validate_task_towers(check, relations=True)


def _validate(check: ModelCheck) -> None:
    """The input group, the experts, the tasks and their labels and relations."""
    validate_multi_task(check)
    field, settings = check.field, check.settings
    where = f"model_config.{field}"
    if field == "mmoe" and settings.experts:  # EasyRec's older form: one DNN per expert
        _validate_named_experts(settings, where)
    elif field == "mmoe" or (field == "dbmtl" and settings.HasField("expert_dnn")):
        validate_dnn(settings.expert_dnn, f"{where}.expert_dnn", required=True)
        if not 1 <= settings.num_expert <= limits.MAX_EXPERTS:
            raise ConfigError(f"{where}.num_expert",
                              f"must be 1 to {limits.MAX_EXPERTS}, got {settings.num_expert}")
    if field == "mmoe" and settings.HasField("gate_mlp"):
        validate_dnn(settings.gate_mlp, f"{where}.gate_mlp", required=False)
    if field == "dbmtl" and settings.HasField("bottom_dnn"):
        validate_dnn(settings.bottom_dnn, f"{where}.bottom_dnn", required=False)
    mc = check.config.model_config
    if field != "dbmtl" or not multimodal_bottom(settings):
        check_dropout_group(mc, mc.feature_groups[check.groups[all_group(mc)]],
                            check.features, with_sequences=True)


for _name in ("MMoE", "DBMTL", "SimpleMultiTask"):
    register_model(ModelClass(_name, build_multi_task_model, _validate, group_attention="all",
                              projected_raw=True, variational_dropout=True))
