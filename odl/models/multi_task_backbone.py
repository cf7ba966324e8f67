"""EasyRec's MultiTaskModel (``model_class: "MultiTaskModel"``): task towers over a backbone.

The contract is ``odl.models.ctr_model``. The network is ``model_config.backbone``
(``odl.models.backbone``, as RankModel's, ``odl.models.rank_model``); its output feeds the
tasks of ``model_params.task_towers`` as EasyRec's MultiTaskModel does: a list of one
``[B, d_t]`` tensor per task (e.g. an ``MMoE`` block's output, or ``output_blocks`` naming
one block per task) gives task ``t`` its own input; a tensor (or any output with
``backbone.top_mlp``, which runs over the output concatenated) is every task's input. Then
per task its tower, relation tower and logit (``odl.models.task_towers``: ``dnn``,
``relation_dnn`` over the task's tower and its ``relation_tower_names``' relation outputs,
a Linear to 1, or 2 for ``num_class: 2``). As in EasyRec's MultiTaskModel, a task without
``relation_dnn`` reads no relation (its ``relation_tower_names`` then have no effect).

Outputs: one logit per task (two for a two-class task), named by the tasks' ``tower_name``,
each trained on its label (``odl.models.task_losses``).

Loss: the tasks' weighted losses + the backbone's auxiliary losses in training
(``AuxiliaryLoss`` blocks) + ``model_params.l2_regularization`` * the squared kernels
of every Linear layer of the network and the towers + ``embedding_regularization`` * the
mean squared pooled lookup.

Parameter names: ``dense.graph.*`` (the blocks, as RankModel's), ``dense.top.*``,
``dense.heads.<t>.dnn.*``, ``dense.heads.<t>.relation_dnn.*``, ``dense.heads.<t>.out.*``.

This module has no ``from __future__ import annotations``: TorchScript reads the dense
class's annotations as types.
"""

import logging

import torch
from torch import nn

from odl.config.config_error import ConfigError
from odl.features.batch import Batch
from odl.features.feature_builder import FeatureBuilder
from odl.models.backbone.backbone_graph import BuiltGraph, GraphBuilder
from odl.models.backbone.backbone_inputs import BackboneInputs
from odl.models.backbone.graph_modules import BackboneGraph, GraphDense
from odl.models.backbone.value_specs import TensorSpec, describe, flat_tensors
from odl.models.ctr_model import CtrModel, ModelOutput
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.task_losses import TaskLoss
from odl.models.task_towers import (
    TaskHead,
    task_head_settings,
    task_label_columns,
    validate_task_towers,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


class TaskBackboneDense(GraphDense):
    """The graph, the tasks' inputs and their heads (module docstring); scriptable.

    Args:
        graph: the blocks.
        output_index: registers of the backbone's output.
        shared: every task reads the output (concatenated, through ``top``); else task
            ``t`` reads register ``output_index[t]``.
        top: ``top_mlp`` (identity when unset).
        heads: one per task.
    """

    __constants__ = ["has_aux_loss", "shared", "num_tasks", "num_logits"]
    output_index: list[int]

    def __init__(self, graph: BackboneGraph, output_index: list[int], shared: bool,
                 top: nn.Module, heads: list[TaskHead]) -> None:
        super().__init__(graph)
        self.top = top
        self.heads = nn.ModuleList(heads)
        self.output_index = [int(i) for i in output_index]
        self.shared = bool(shared)
        self.num_tasks = len(heads)
        self.num_logits = sum(int(h.out.out_features) for h in heads)

    def logits(self, regs: list[torch.Tensor], pooled: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, num_logits]``, task after task (``[B]`` with one logit in all)."""
        inputs: list[torch.Tensor] = []
        if self.shared:
            x = self.top(torch.cat([regs[i] for i in self.output_index], dim=-1))
            for _ in range(self.num_tasks):
                inputs.append(x)
        else:
            for i in self.output_index:
                inputs.append(regs[i])
        rel: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for i, head in enumerate(self.heads):
            r_out, logit = head(inputs[i], rel)
            rel.append(r_out)
            logits.append(logit)
        if self.num_logits == 1:
            return logits[0].squeeze(1)
        return torch.cat(logits, dim=1)


def task_inputs(built: BuiltGraph, backbone: pipeline_pb2.BackboneTower, tasks: int
                ) -> tuple[list[int], bool, nn.Module, list[int]]:
    """How the backbone's output feeds the tasks (module docstring).

    Returns:
        ``(registers, shared, top, each task's input width)``.

    Raises:
        ConfigError: a list whose length is not the number of tasks, items that are not
            ``[B, d]`` tensors.
    """
    items = flat_tensors(built.spec)
    if items is not None and not backbone.HasField("top_mlp"):
        if len(items) != tasks or any(len(t.shape) != 1 for t in items):
            raise ConfigError(built.where, f"the backbone's output {describe(built.spec)} "
                                           f"must be one [B, d] tensor per task ({tasks})")
        return built.index, False, nn.Identity(), [t.shape[0] for t in items]
    if items is None and not isinstance(built.spec, TensorSpec):
        raise ConfigError(built.where, f"the backbone's output {describe(built.spec)} is "
                                       "neither a tensor nor one tensor per task")
    index, top, width = built.concatenated(backbone)
    return index, True, top, [width] * tasks


class MultiTaskBackbone(CtrModel):
    """Task towers over a backbone, tables on ``ebc_device``.

    Args:
        config: the pipeline config.
        feature_builder: its feature builder.
        ebc_device: device of the tables (``meta``: materialized by DMP).

    Raises:
        ConfigError: by field, for a backbone or tasks odl cannot build.
    """

    def __init__(self, config: pipeline_pb2.EasyRecConfig, feature_builder: FeatureBuilder,
                 ebc_device: "torch.device | str" = "meta") -> None:
        super().__init__()
        mc = config.model_config
        settings = mc.model_params
        inputs = BackboneInputs(config, feature_builder)
        self.set_tables(inputs.layout, ebc_device)
        built = GraphBuilder(mc.backbone, inputs.group_input, set(inputs.groups), 1
                             ).build_graph()
        try:
            names, tasks = task_head_settings(settings.task_towers)
        except ValueError as e:
            raise ConfigError("model_config.model_params.task_towers", str(e)) from e
        # EasyRec's MultiTaskModel reads the relations through relation_dnn only (DBMTL's
        # reads them always)
        tasks = [(dnn, relations if relation_dnn is not None else [], relation_dnn, c)
                 for dnn, relations, relation_dnn, c in tasks]
        index, shared, top, widths = task_inputs(built, mc.backbone, len(tasks))
        heads: list[TaskHead] = []
        for (dnn, relations, relation_dnn, num_class), width in zip(tasks, widths, strict=True):
            rel_width = sum(heads[r].out_width for r in relations)
            heads.append(TaskHead(width, dnn, relations, rel_width, relation_dnn, num_class))
        self.dense = TaskBackboneDense(built.graph, index, shared, top, heads)
        self.pooled_layout = (inputs.pooled,)
        columns, spaces = task_label_columns(config)
        self.output_names = tuple(names)
        self.output_labels = tuple(columns)
        self.task_loss = TaskLoss(mc, list(settings.task_towers), columns, spaces, self.dense)
        self.model_config = mc
        self.l2 = float(settings.l2_regularization)
        self.embedding_regularization = float(mc.embedding_regularization)

    def loss(self, output: ModelOutput, batch: Batch) -> torch.Tensor:
        """The weighted task losses plus the regularization (module docstring).

        Args:
            output: ``forward(batch)``'s result.
            batch: the batch (labels ``[B, label columns]``).

        Returns:
            Scalar loss.
        """
        return self.add_regularization(self.task_loss(output.logits, batch, self.dense),
                                       output, self.l2)


def _build(config: pipeline_pb2.EasyRecConfig,
           feature_builder: FeatureBuilder) -> MultiTaskBackbone:
    return MultiTaskBackbone(config, feature_builder)


def _validate(check: ModelCheck) -> None:
    """A backbone, the tasks; then the network is built (every block's own checks)."""
    mc = check.config.model_config
    if not mc.HasField("backbone"):
        raise ConfigError("model_config.backbone",
                          "MultiTaskModel needs a backbone { blocks }")
    if mc.model_params.l2_regularization < 0:
        raise ConfigError("model_config.model_params.l2_regularization", "must be >= 0")
    validate_task_towers(check, relations=True)
    MultiTaskBackbone(check.config, FeatureBuilder(check.config))


register_model(ModelClass("MultiTaskModel", _build, _validate, group_attention="all",
                          projected_raw=True))
