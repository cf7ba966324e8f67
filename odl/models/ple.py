"""EasyRec's PLE (``model_class: "PLE"``, settings ``ple {}``) as a ``CtrModel``.

Progressive Layered Extraction: the multi-task model of ``odl.models.multi_task_models``
(its input ``x`` from the "all" group, its task heads, labels and loss) whose tasks' inputs
come from a stack of extraction networks (EasyRec's CGC layers) instead of MMoE's experts.
With ``T`` tasks, network ``l`` reads one input per task ``in_t`` and a shared input ``s``
(both ``x`` for the first network)::

    e_t,k  = task_expert_net_k(in_t)      k < expert_num_per_task, per task t
    e_s,k  = share_expert_net_k(s)        k < share_num
    out_t  = sum_j softmax(Linear_t(in_t))_j * [e_t,*, e_s,*]_j
    out_s  = sum_j softmax(Linear_s(s))_j * [e_1,*, ..., e_T,*, e_s,*]_j    (not the last)

and the next network reads ``out_t`` and ``out_s``; the last network's ``out_t`` is task
``t``'s input (its DNN, then one logit). Every expert of a network ends in one width (the
gates mix them). The loss is the multi-task models': per task its weighted prediction loss,
``l2_regularization`` * the squared dense Linear kernels, ``embedding_regularization`` * the
mean squared pooled lookup.

TorchEasyRec's PLE (``ple { extraction_networks task_towers { mlp } }``) reads the same
fields; its task towers' ``mlp`` is ``dnn`` (``odl.config.config_forms``).

Parameter names: ``dense.experts.networks.<l>.task_experts.<t>.<k>.*``,
``dense.experts.networks.<l>.shared_experts.<k>.*``,
``dense.experts.networks.<l>.task_gates.<t>.*``, ``dense.experts.networks.<l>.shared_gate.*``,
then the task heads' (``dense.heads.<t>.*``) as for MMoE.

This module has no ``from __future__ import annotations``: TorchScript reads the classes'
annotations as types.
"""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from odl.config import limits
from odl.config.config_error import ConfigError
from odl.config.model_validation import validate_dnn
from odl.features.feature_builder import FeatureBuilder
from odl.models.building_blocks import build_mlp
from odl.models.model_registry import ModelCheck, ModelClass, register_model
from odl.models.multi_task_models import (
    TaskTowerModel,
    build_multi_task_model,
    validate_multi_task,
)
from odl.protos import pipeline_pb2

logger = logging.getLogger(__name__)


def _experts(in_width: int, count: int, dnn: pipeline_pb2.DNN) -> tuple[nn.ModuleList, int]:
    """``count`` MLPs of ``dnn`` over ``in_width`` inputs and their output width."""
    experts = nn.ModuleList()
    width = 0
    for _ in range(int(count)):
        mlp, width = build_mlp(in_width, dnn)
        experts.append(mlp)
    return experts, width


class ExtractionNetwork(nn.Module):
    """One extraction network (the module docstring's ``out_t``, ``out_s``); scriptable.

    Args:
        task_widths: width of each task's input.
        shared_width: width of the shared input.
        settings: the network's experts.
        last: the last network (no shared gate; its shared output is its shared input).

    Raises:
        ValueError: no expert, or experts of different widths.
    """

    __constants__ = ["last"]

    def __init__(self, task_widths: Sequence[int], shared_width: int,
                 settings: pipeline_pb2.ExtractionNetwork, last: bool) -> None:
        super().__init__()
        per_task = int(settings.expert_num_per_task)
        shared = int(settings.share_num)
        if per_task < 1:
            raise ValueError("an extraction network needs at least one expert per task")
        self.last = bool(last)
        self.task_experts = nn.ModuleList()
        widths: set[int] = set()
        for width in task_widths:
            experts, out = _experts(int(width), per_task, settings.task_expert_net)
            self.task_experts.append(experts)
            widths.add(out)
        self.shared_experts, out = _experts(int(shared_width), shared,
                                            settings.share_expert_net)
        if shared:
            widths.add(out)
        if len(widths) != 1:
            raise ValueError(f"the experts of a network end in different widths: {widths}")
        self.out_width = widths.pop()
        self.task_gates = nn.ModuleList(nn.Linear(int(w), per_task + shared)
                                        for w in task_widths)
        self.shared_gate = (None if self.last else
                            nn.Linear(int(shared_width), per_task * len(task_widths) + shared))

    def forward(self, inputs: list[torch.Tensor],
                shared: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each task's output and the shared output (module docstring)."""
        shared_outs: list[torch.Tensor] = []
        for expert in self.shared_experts:
            shared_outs.append(expert(shared))
        task_outs: list[list[torch.Tensor]] = []
        for t, experts in enumerate(self.task_experts):
            mine: list[torch.Tensor] = []
            for expert in experts:
                mine.append(expert(inputs[t]))
            task_outs.append(mine)
        outs: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        for t, gate in enumerate(self.task_gates):
            outs.append(_mix(gate(inputs[t]), task_outs[t] + shared_outs))
            every.extend(task_outs[t])
        shared_gate = self.shared_gate
        if shared_gate is None:
            return outs, shared
        return outs, _mix(shared_gate(shared), every + shared_outs)


def _mix(gate_logits: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """``sum_j softmax(gate_logits)_j * experts[j]``."""
    weights = torch.softmax(gate_logits, dim=1).unsqueeze(2)  # [B, E, 1]
    return (torch.stack(experts, dim=1) * weights).sum(dim=1)


class ExtractionNetworks(nn.Module):
    """PLE's networks in order: the shared input to one input per task; scriptable.

    Args:
        in_width: width of the shared input ``x``.
        num_tasks: number of tasks.
        networks: the ``extraction_networks`` settings (at least one).
    """

    __constants__ = ["num_tasks"]

    def __init__(self, in_width: int, num_tasks: int,
                 networks: Sequence[pipeline_pb2.ExtractionNetwork]) -> None:
        super().__init__()
        self.num_tasks = int(num_tasks)
        self.networks = nn.ModuleList()
        task_widths = [int(in_width)] * self.num_tasks
        shared_width = int(in_width)
        for i, settings in enumerate(networks):
            network = ExtractionNetwork(task_widths, shared_width, settings,
                                        last=i == len(networks) - 1)
            self.networks.append(network)
            task_widths = [network.out_width] * self.num_tasks
            shared_width = network.out_width
        self.out_width = task_widths[0]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One ``[B, out_width]`` input per task."""
        inputs = [x for _ in range(self.num_tasks)]
        shared = x
        for network in self.networks:
            inputs, shared = network(inputs, shared)
        return inputs


def _build(config: pipeline_pb2.EasyRecConfig,
           feature_builder: FeatureBuilder) -> TaskTowerModel:
    """The multi-task model whose tasks' inputs are the extraction networks' outputs."""
    networks = list(config.model_config.ple.extraction_networks)

    def mixture(width: int, tasks: int) -> nn.Module:
        return ExtractionNetworks(width, tasks, networks)

    return build_multi_task_model(config, feature_builder, mixture=mixture)


def _validate(check: ModelCheck) -> None:
    """The multi-task checks, then each extraction network's experts."""
    validate_multi_task(check)
    where = check.where("extraction_networks")
    networks = check.settings.extraction_networks
    if not networks:
        raise ConfigError(where, "at least one extraction network is needed")
    if len(networks) > limits.MAX_HIDDEN_LAYERS:
        raise ConfigError(where, f"at most {limits.MAX_HIDDEN_LAYERS} extraction networks")
    for i, network in enumerate(networks):
        nw = f"{where}[{i}]"
        if not 1 <= network.expert_num_per_task <= limits.MAX_EXPERTS:
            raise ConfigError(f"{nw}.expert_num_per_task",
                              f"must be 1 to {limits.MAX_EXPERTS}, got "
                              f"{network.expert_num_per_task}")
        if network.share_num > limits.MAX_EXPERTS:
            raise ConfigError(f"{nw}.share_num",
                              f"must be 0 to {limits.MAX_EXPERTS}, got {network.share_num}")
        validate_dnn(network.task_expert_net, f"{nw}.task_expert_net", required=True)
        if not network.share_num:
            continue
        validate_dnn(network.share_expert_net, f"{nw}.share_expert_net", required=True)
        task_out = network.task_expert_net.hidden_units[-1]
        shared_out = network.share_expert_net.hidden_units[-1]
        if task_out != shared_out:
            raise ConfigError(f"{nw}.share_expert_net.hidden_units",
                              f"the shared experts' last layer ({shared_out}) must be as wide "
                              f"as the task experts' ({task_out}): the gates mix them")


register_model(ModelClass("PLE", _build, _validate, group_attention="all", projected_raw=True))

