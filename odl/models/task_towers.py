"""A multi-task model's task towers: their heads, their labels and their checks.

Shared by the multi-task models (``odl.models.multi_task_models``,
``odl.models.multi_task_backbone``). Per task ``t`` (``task_towers`` in order)::

    tower_t = dnn_t(in_t)                          (no dnn: in_t)
    rel_t   = relation_dnn_t(concat(tower_t, rel_r for r in relation_tower_names_t))
    logit_t = Linear(rel_t -> 1, or 2 for num_class: 2)

A relation names an earlier task (it reads that task's ``rel`` output), as in EasyRec's
DBMTL. Task ``t`` trains on its ``label_name`` (else the ``label_fields`` entry at its
position); its loss is ``odl.models.task_losses``'.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.config.loss_settings import POINTWISE_LOSS_TYPES, SOFTMAX_LOSS_TYPES
from odl.config.model_classes import domain_label, model_settings, task_label_names
from odl.config.model_validation import validate_dnn, validate_losses
from odl.models.building_blocks import build_optional_mlp
from odl.models.model_registry import ModelCheck
from odl.protos import pipeline_pb2


class TaskHead(nn.Module):
    """One task: its DNN, its relation DNN and its logit; scriptable.

    Args:
        in_width: width of the task's input.
        dnn: the task's DNN, or None.
        relations: indices of the earlier tasks whose relation outputs it reads.
        relation_width: sum of those outputs' widths.
        relation_dnn: the relation DNN, or None (identity).
        num_class: its logits (2: a two-class task).
    """

    relations: list[int]

    def __init__(self, in_width: int, dnn: Optional[pipeline_pb2.DNN], relations: Sequence[int],
                 relation_width: int, relation_dnn: Optional[pipeline_pb2.DNN],
                 num_class: int = 1) -> None:
        super().__init__()
        self.dnn, width = build_optional_mlp(in_width, dnn)
        self.relations = [int(r) for r in relations]
        self.relation_dnn, self.out_width = build_optional_mlp(width + relation_width,
                                                             relation_dnn)
        self.out = nn.Linear(self.out_width, int(num_class))

    def forward(self, x: torch.Tensor, earlier: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(relation output, logits)`` of the task's input ``x``.

        Args:
            x: the task's input.
            earlier: the earlier tasks' relation outputs, in task order.
        """
        parts = [self.dnn(x)]
        for r in self.relations:
            parts.append(earlier[r])
        rel = self.relation_dnn(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
        return rel, self.out(rel)


def _dnn(msg: pipeline_pb2.TaskTower, name: str) -> Optional[pipeline_pb2.DNN]:
    return getattr(msg, name) if msg.HasField(name) else None


def task_head_settings(task_towers: Sequence[pipeline_pb2.TaskTower]
                       ) -> tuple[list[str], list[tuple]]:
    """The tasks' names and, per task, ``(dnn, relation task indices, relation_dnn, logits)``.

    Raises:
        ValueError: two tasks of one name, a relation to an unknown or later task.
    """
    names = [t.tower_name or f"task{i}" for i, t in enumerate(task_towers)]
    if len(set(names)) != len(names):
        raise ValueError(f"task tower names must differ: {names}")
    tasks = []
    for i, t in enumerate(task_towers):
        relations = []
        for r in t.relation_tower_names:
            if r not in names[:i]:
                raise ValueError(f"task {names[i]!r}: relation tower {r!r} is not an "
                                 "earlier task")
            relations.append(names.index(r))
        tasks.append((_dnn(t, "dnn"), relations, _dnn(t, "relation_dnn"),
                      max(int(t.num_class), 1)))
    return names, tasks


def task_label_columns(config: pipeline_pb2.EasyRecConfig
                       ) -> tuple[list[int], list[Optional[int]]]:
    """Per task, its label's column and its ``task_space_indicator_label``'s (or None).

    Raises:
        ConfigError: a label that is not one of ``data_config.label_fields``.
    """
    mc = config.model_config
    label_fields = list(config.data_config.label_fields) or ["label"]
    field, settings = model_settings(mc)
    columns: list[int] = []
    spaces: list[Optional[int]] = []
    for i, name in enumerate(task_label_names(mc, label_fields)):
        if name not in label_fields:
            raise ConfigError(f"model_config.{field}.task_towers[{i}].label_name",
                              f"label {name!r} is not one of data_config.label_fields "
                              f"{label_fields}")
        columns.append(label_fields.index(name))
        space = settings.task_towers[i].task_space_indicator_label
        if space and space not in label_fields:
            raise ConfigError(f"model_config.{field}.task_towers[{i}]"
                              ".task_space_indicator_label",
                              f"{space!r} is not one of data_config.label_fields")
        spaces.append(label_fields.index(space) if space else None)
    return columns, spaces


def validate_task_towers(check: ModelCheck, relations: bool) -> None:
    """The tasks: names, labels, classes, losses, task spaces, relations.

    Relations to earlier tasks where the class has them; every label field trained.

    Args:
        check: the model's check (its settings hold ``task_towers``).
        relations: the class reads ``relation_tower_names``.

    Raises:
        ConfigError: naming the first offending field.
    """
    config, field, settings = check.config, check.field, check.settings
    mc = config.model_config
    where = f"model_config.{field}"
    if not settings.task_towers:
        raise ConfigError(f"{where}.task_towers", "at least one task is needed")
    label_fields = list(config.data_config.label_fields)
    labels = task_label_names(mc, label_fields)
    names: list[str] = []
    for i, task in enumerate(settings.task_towers):
        tw = f"{where}.task_towers[{i}]"
        if not task.tower_name:
            raise ConfigError(f"{tw}.tower_name", "required (the task's output name)")
        if task.tower_name in names:
            raise ConfigError(f"{tw}.tower_name", f"duplicate task {task.tower_name!r}")
        if labels[i] not in label_fields:
            raise ConfigError(f"{tw}.label_name",
                              f"{labels[i] or 'no label'!r} is not one of "
                              f"data_config.label_fields {label_fields}")
        if task.num_class not in (1, 2):
            raise ConfigError(f"{tw}.num_class",
                              f"num_class {task.num_class} is an EasyRec value that odl does not "
                              "implement yet (1: binary; 2: two logits, as for JRC_LOSS)")
        if task.num_class == 2 and task.task_space_indicator_label:
            raise ConfigError(f"{tw}.task_space_indicator_label",
                              "a task space weighs pointwise losses; a num_class 2 task trains "
                              "by softmax cross entropy or JRC_LOSS")
        if task.num_class == 2:
            kinds = [(f"{tw}.losses[{j}].loss_type", t.loss_type)
                     for j, t in enumerate(task.losses)] or [(f"{tw}.loss_type", task.loss_type)]
            for kw, kind in kinds:
                if kind not in SOFTMAX_LOSS_TYPES:
                    raise ConfigError(kw, f"a num_class 2 task trains by softmax cross "
                                          f"entropy or JRC_LOSS, not "
                                          f"{pipeline_pb2.LossType.Name(kind)}")
        if task.weight < 0:
            raise ConfigError(f"{tw}.weight", "must be >= 0")
        if task.HasField("dnn"):
            validate_dnn(task.dnn, f"{tw}.dnn", required=False)
        if task.HasField("relation_dnn"):
            validate_dnn(task.relation_dnn, f"{tw}.relation_dnn", required=False)
        for j, r in enumerate(task.relation_tower_names):
            if not relations:
                raise ConfigError(f"{tw}.relation_tower_names",
                                  f"{mc.model_class} has no relations between its tasks")
            if r not in names:
                raise ConfigError(f"{tw}.relation_tower_names[{j}]",
                                  f"{r!r} is not an earlier task (tasks so far: {names})")
        validate_losses(task.losses, f"{tw}.losses", mc.loss_weight_strategy,
                        calibration=True)
        calibrated = any(t.loss_type == pipeline_pb2.LossType.ORDER_CALIBRATE_LOSS
                         for t in task.losses)
        if calibrated and (task.num_class != 1 or any(
                settings.task_towers[names.index(r)].num_class != 1
                for r in task.relation_tower_names if r in names)):
            raise ConfigError(f"{tw}.losses", "ORDER_CALIBRATE_LOSS compares one-logit tasks' "
                                              "probabilities (num_class 1)")
        if task.task_space_indicator_label:
            if task.task_space_indicator_label not in label_fields:
                raise ConfigError(f"{tw}.task_space_indicator_label",
                                  f"{task.task_space_indicator_label!r} is not one of "
                                  f"data_config.label_fields {label_fields}")
            for name in ("in_task_space_weight", "out_task_space_weight"):
                if getattr(task, name) < 0:
                    raise ConfigError(f"{tw}.{name}", "must be >= 0")
            kinds = [loss.loss_type for loss in task.losses] or [task.loss_type]
            for k in kinds:
                if k not in POINTWISE_LOSS_TYPES:
                    raise ConfigError(f"{tw}.task_space_indicator_label",
                                      f"task-space weights apply to pointwise losses; "
                                      f"{pipeline_pb2.LossType.Name(k)} is not one")
        names.append(task.tower_name)
    # task spaces and a domain label (PEPNet's) are read, not trained on
    read = {t.task_space_indicator_label for t in settings.task_towers} | {
        domain_label(check.config.model_config)}
    unused = [lf for lf in label_fields if lf not in labels and lf not in read]
    if unused:
        raise ConfigError("data_config.label_fields",
                          f"label fields {unused} are not trained by any task")
