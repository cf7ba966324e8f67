"""TorchEasyRec's PEPNet (``model_class: "PEPNet"``, settings ``pepnet {}``) as a ``CtrModel``.

The contract is ``odl.models.ctr_model``. As TorchEasyRec's ``tzrec/models/pepnet.py`` and
``tzrec/modules/personalized_net.py``: the feature group ``all`` read whole (its lookups,
then its dense columns) is ``x``; a ``domain`` group ``d`` and a ``uia`` group ``u`` are
optional. With ``gate(z) = gamma * sigmoid(W2 relu(W1 z))`` (a gate neural unit; ``sg`` stops
the gradient)::

    x'      = gate_e([d, sg(x)]) * x                 EPNet (a "domain" group); else x' = x
    h_t,0   = x'                                     per task t
    h_t,l   = dropout_l(act(Linear_t,l(h_t,l-1)) * gate_t,l([u, sg(x')]))
                                                     PPNet (a "uia" group), l per
                                                     ppnet_hidden_units; else in_t = x'
    logit   = Linear(dnn(h_t,L) -> 1)                per task, and per domain k with
                                                     domain_input_name (task_domain_num D)

``gate_e`` scales by ``epnet_gamma`` and is ``epnet_hidden_unit`` wide inside (0: the
width of ``x``); PPNet's gates scale by ``ppnet_gamma`` and are their layer's width. Outputs: one
logit per task (named by its ``tower_name``), or with ``domain_input_name`` one per task and
domain, ``<tower_name>_<k>`` (task-major: ``t * D + k``), all served. Loss: the multi-task
models' (``odl.models.task_losses``) on each record's own domain's logit per task (its
``domain_input_name`` label, an integer in ``[0, D)``; other values are rejected as
``bad_label`` when the record is read) + ``l2_regularization`` * the squared dense Linear
kernels + ``embedding_regularization`` * the mean squared pooled lookup. The progressive
metrics and the eval topic score, per task, each record's own domain's prediction
(``metric_outputs``, named by the task).

Parameter names: ``dense.epnet.*``, ``dense.ppnet.<t>.<l>.{linear,gate}.*``,
``dense.heads.<t * D + k>.*`` (a ``TaskHead``: ``dnn``, ``out``).

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.model_validation import SUPPORTED_ACTIVATIONS
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import activation_layer
from odl.models.ctr_losses import linear_kernel_l2
from odl.models.ctr_model import CtrModel, ModelOutput, PooledGroup
from odl.models.embedding_tables import build_embedding_layout
from odl.models.group_inputs import group_input
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.multi_task_models import validate_multi_task
from odl.models.task_losses import TaskLoss
from odl.models.task_towers import TaskHead, task_head_settings, task_label_columns
from odl.protos import pipeline_pb2

MAIN, DOMAIN, UIA = "all", "domain", "uia"


class GateUnit(nn.Module):
    """``gamma * sigmoid(Linear(relu(Linear(z))))`` (PEPNet's gate neural unit); scriptable."""

    __constants__ = ["gamma"]

    def __init__(self, in_width: int, hidden: int, out_width: int, gamma: float) -> None:
        super().__init__()
        self.gamma = float(gamma)
        self.hidden = nn.Linear(int(in_width), int(hidden))
        self.out = nn.Linear(int(hidden), int(out_width))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """The gate of ``z``, ``[B, out_width]``."""
        return self.gamma * torch.sigmoid(self.out(torch.relu(self.hidden(z))))


class PPNetLayer(nn.Module):
    """One PPNet layer of one task: ``dropout(act(Linear(h)) * gate(g))``; scriptable."""

    def __init__(self, in_width: int, width: int, gate_width: int, activation: str,
                 dropout: float, gamma: float) -> None:
        super().__init__()
        self.linear = nn.Linear(int(in_width), int(width))
        self.act = activation_layer(activation, int(width))
        self.gate = GateUnit(gate_width, width, width, gamma)
        self.dropout = nn.Dropout(float(dropout))

    def forward(self, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The layer's output of ``h``, gated by the gate's input ``g``."""
        return self.dropout(self.act(self.linear(h)) * self.gate(g))


class PEPNetDense(nn.Module):
    """The gates, PPNet's layers and the towers (module docstring); scriptable.

    Args:
        widths: the lookup widths of the groups read, in order (``all``, then ``domain``,
            then ``uia``, the ones present); their lookups are one pooled tensor in that
            order.
        columns: per group read, its ``Batch.dense`` columns (joining its lookups).
        has_domain: a ``domain`` group (EPNet).
        has_uia: a ``uia`` group (PPNet).
        settings: ``pepnet``.
        tasks: ``task_head_settings``' tasks (no relations).
        domains: towers per task (``task_domain_num`` with ``domain_input_name``, else 1).
    """

    __constants__ = ["has_domain", "has_uia", "num_tasks", "domains", "main_end",
                     "domain_end"]
    main_idx: list[int]
    domain_idx: list[int]
    uia_idx: list[int]

    def __init__(self, widths: Sequence[int], columns: Sequence[Sequence[int]],
                 has_domain: bool, has_uia: bool, settings: pipeline_pb2.PEPNet,
                 tasks: Sequence[tuple], domains: int) -> None:
        super().__init__()
        self.has_domain, self.has_uia = bool(has_domain), bool(has_uia)
        self.num_tasks, self.domains = len(tasks), int(domains)
        parts = [(int(w), [int(c) for c in cols]) for w, cols in zip(widths, columns,
                                                                      strict=True)]
        main = parts.pop(0)
        domain = parts.pop(0) if self.has_domain else (0, [])
        uia = parts.pop(0) if self.has_uia else (0, [])
        self.main_end = main[0]
        self.domain_end = main[0] + domain[0]
        self.main_idx, self.domain_idx, self.uia_idx = main[1], domain[1], uia[1]
        width = main[0] + len(main[1])
        self.epnet: Optional[GateUnit] = None
        if self.has_domain:
            hidden = int(settings.epnet_hidden_unit) or width
            self.epnet = GateUnit(domain[0] + len(domain[1]) + width, hidden, width,
                                  settings.epnet_gamma)
        self.ppnet = nn.ModuleList()
        task_width = width
        if self.has_uia:
            gate_width = uia[0] + len(uia[1]) + width
            units = [int(u) for u in settings.ppnet_hidden_units]
            ratios = [float(r) for r in settings.ppnet_dropout_ratio]
            ratios = ratios * len(units) if len(ratios) == 1 else ratios or [0.0] * len(units)
            for _ in range(self.num_tasks):
                layers = nn.ModuleList()
                in_width = width
                for unit, ratio in zip(units, ratios, strict=True):
                    layers.append(PPNetLayer(in_width, unit, gate_width,
                                             settings.ppnet_activation, ratio,
                                             settings.ppnet_gamma))
                    in_width = unit
                self.ppnet.append(layers)
            task_width = units[-1]
        self.heads = nn.ModuleList(
            TaskHead(task_width, dnn, [], 0, None, num_class)
            for dnn, _relations, _relation_dnn, num_class in tasks
            for _ in range(self.domains))

    def _part(self, lookups: torch.Tensor, idx: list[int], dense: torch.Tensor) -> torch.Tensor:
        return torch.cat([lookups, dense[:, idx]], dim=1) if len(idx) > 0 else lookups

    def forward(self, group: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, tasks * domains]`` (``[B]`` for one).

        Args:
            group: ``[B, lookup columns]``: the groups' pooled lookups, group after group.
            dense: ``[B, num_dense]`` raw dense features.
        """
        x = self._part(group[:, : self.main_end], self.main_idx, dense)
        epnet = self.epnet
        if epnet is not None:
            d = self._part(group[:, self.main_end : self.domain_end], self.domain_idx, dense)
            x = epnet(torch.cat([d, x.detach()], dim=1)) * x
        inputs: list[torch.Tensor] = [x for _ in range(self.num_tasks)]
        if self.has_uia:
            u = self._part(group[:, self.domain_end :], self.uia_idx, dense)
            g = torch.cat([u, x.detach()], dim=1)
            inputs = []
            for layers in self.ppnet:
                h = x
                for layer in layers:
                    h = layer(h, g)
                inputs.append(h)
        logits: list[torch.Tensor] = []
        no_relations: list[torch.Tensor] = []
        for j, head in enumerate(self.heads):
            _rel, logit = head(inputs[j // self.domains], no_relations)
            logits.append(logit)
        out = torch.cat(logits, dim=1)
        return out.squeeze(1) if out.shape[1] == 1 else out


class PEPNet(CtrModel):
    """PEPNet over an ``EmbeddingBagCollection`` built on ``ebc_device``.

    Args:
        config: the pipeline config (``model_config.pepnet``).
        feature_builder: the feature builder (tables, ``Batch.dense`` columns).
        ebc_device: device of the tables (``meta``: materialized by DMP).
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        mc = config.model_config
        settings = mc.pepnet
        names = [g.group_name for g in mc.feature_groups]
        groups = [MAIN] + [g for g in (DOMAIN, UIA) if g in names]
        reads = {g: group_input(config, feature_builder, g) for g in groups}
        lookups = [f for g in groups for f in reads[g].lookups]  # a feature may repeat
        layout = build_embedding_layout(feature_builder.table_specs,
                                        list(dict.fromkeys(lookups)), [], 1, mixed_dims=True)
        self.set_tables(layout, ebc_device)
        table_of = dict(layout.deep_keys)
        dim_of = dict(zip((f for f, _t in layout.deep_keys), layout.deep_dims, strict=True))
        col = {n: i for i, n in enumerate(feature_builder.dense_feature_names)}
        task_names, tasks = task_head_settings(settings.task_towers)
        self.domains = int(settings.task_domain_num) if settings.domain_input_name else 1
        self.dense = PEPNetDense([sum(dim_of[f] for f in reads[g].lookups) for g in groups],
                                 [[col[c] for c in reads[g].raw] for g in groups],
                                 DOMAIN in groups, UIA in groups, settings, tasks,
                                 self.domains)
        self.pooled_layout = (PooledGroup.of("pepnet", tuple((f, table_of[f]) for f in lookups),
                                             [dim_of[f] for f in lookups]),)
        label_columns, spaces = task_label_columns(config)
        labels = list(config.data_config.label_fields) or ["label"]
        self.domain_column = (labels.index(settings.domain_input_name)
                              if settings.domain_input_name else -1)
        self.task_names = tuple(task_names)
        self.output_names = tuple(n if self.domains == 1 else f"{n}_{k}"
                                  for n in task_names for k in range(self.domains))
        self.output_labels = tuple(int(c) for c in label_columns for _ in range(self.domains))
        self.task_loss = TaskLoss(mc, list(settings.task_towers), label_columns, spaces,
                                  self.dense)
        self.model_config = mc
        self.l2 = float(settings.l2_regularization)
        self.embedding_regularization = float(mc.embedding_regularization)

    def metric_outputs(self, regression: Sequence[bool]
                       ) -> tuple[list[tuple[str, int]], list[bool]]:
        """With domains, one scored prediction per task, named by the task; else every output.

        The task's prediction is its record's domain's (:meth:`metric_predictions`).
        """
        if self.domains == 1:
            return super().metric_outputs(regression)
        labels = self.output_labels[:: self.domains]
        return (list(zip(self.task_names, labels, strict=True)),
                list(regression)[:: self.domains])

    def metric_predictions(self, probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """With domains, per task the prediction of each record's domain.

        ``[B, tasks]`` (``[B]`` for one task); without domains, ``probs``.
        """
        if self.domains == 1:
            return probs
        y = labels if labels.ndim == 2 else labels[:, None]
        domain = y[:, self.domain_column].astype(np.int64)
        per_task = probs.reshape(probs.shape[0], -1, self.domains)
        out = per_task[np.arange(per_task.shape[0]), :, domain]
        return out[:, 0] if out.shape[1] == 1 else out

    def task_logits(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Per task, the logit of each record's domain: ``[B, tasks]``.

        Without domains, ``logits`` itself.
        """
        if self.domains == 1:
            return logits
        labels = batch.labels if batch.labels.dim() == 2 else batch.labels.unsqueeze(1)
        domain = labels[:, self.domain_column].long()
        per_task = logits.reshape(logits.shape[0], -1, self.domains)
        index = domain.view(-1, 1, 1).expand(-1, per_task.shape[1], 1)
        return per_task.gather(2, index).squeeze(2)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The tasks' losses on their records' domains, plus the regularization terms."""
        loss = self.task_loss(self.task_logits(output.logits, batch), batch, self.dense)
        if self.l2:
            loss = loss + self.l2 * linear_kernel_l2(self.dense)
        return self.add_regularization(loss, output, 0.0)


def _build(config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder) -> PEPNet:
    try:
        return PEPNet(config, feature_builder)
    except ValueError as e:
        raise ConfigError("model_config.pepnet", str(e)) from e


def _validate(check: ModelCheck) -> None:
    """The checks of the "all" group, the optional groups, the gates and the domain label."""
    mc, settings = check.config.model_config, check.settings
    if "all" not in check.groups:
        raise ConfigError("model_config.feature_groups",
                          f'PEPNet reads the feature group named "all"; groups are '
                          f"{sorted(check.groups)}")
    validate_multi_task(check)
    for name in (MAIN, DOMAIN, UIA):
        if name not in check.groups:
            continue
        group = mc.feature_groups[check.groups[name]]
        if group.sequence_features or any(
                check.features[f].feature_type == pipeline_pb2.FeatureConfig.SequenceFeature
                for f in group.feature_names if f in check.features):
            raise ConfigError(f"model_config.feature_groups[{check.groups[name]}]",
                              f"PEPNet's {name!r} group: sequences are not implemented "
                              "(plain id and raw features)")
    if settings.epnet_hidden_unit > limits.MAX_HIDDEN_UNITS:
        raise ConfigError(check.where("epnet_hidden_unit"),
                          f"at most {limits.MAX_HIDDEN_UNITS:,}")
    units = list(settings.ppnet_hidden_units)
    if UIA in check.groups and not units:
        raise ConfigError(check.where("ppnet_hidden_units"),
                          'PPNet (a "uia" group) needs its layers\' widths')
    if len(units) > limits.MAX_HIDDEN_LAYERS or any(
            not 1 <= u <= limits.MAX_HIDDEN_UNITS for u in units):
        raise ConfigError(check.where("ppnet_hidden_units"),
                          f"at most {limits.MAX_HIDDEN_LAYERS} widths of 1 to "
                          f"{limits.MAX_HIDDEN_UNITS:,}")
    ratios = list(settings.ppnet_dropout_ratio)
    if len(ratios) > 1 and len(ratios) != len(units):
        raise ConfigError(check.where("ppnet_dropout_ratio"),
                          f"one ratio per PPNet layer ({len(units)}), one for all, or none; "
                          f"got {len(ratios)}")
    if any(not 0.0 <= r < 1.0 for r in ratios):
        raise ConfigError(check.where("ppnet_dropout_ratio"), "each must be in [0, 1)")
    if settings.ppnet_activation not in SUPPORTED_ACTIVATIONS and \
            settings.ppnet_activation.lower() not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(check.where("ppnet_activation"),
                          f"{settings.ppnet_activation!r} is not a supported activation")
    if settings.domain_input_name:
        labels = list(check.config.data_config.label_fields)
        if settings.domain_input_name not in labels:
            raise ConfigError(check.where("domain_input_name"),
                              f"{settings.domain_input_name!r} is not one of "
                              f"data_config.label_fields {labels}")
        if not 1 <= settings.task_domain_num <= limits.MAX_EXPERTS:
            raise ConfigError(check.where("task_domain_num"),
                              f"must be 1 to {limits.MAX_EXPERTS}")
        for i, task in enumerate(settings.task_towers):
            if task.num_class > 1:
                raise ConfigError(check.where(f"task_towers[{i}].num_class"),
                                  "a task of several classes per domain is not implemented")


register_model(ModelClass("PEPNet", _build, _validate))
